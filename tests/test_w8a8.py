"""int8 weights with inputs quantized on the fly (``quantize="w8a8"``, `hf_spec.loading.weight_only`, the
``int8_dynamic_mm`` kernel of `hf_spec.loading.int8_rows`): each row computed alone, as the torch reference computes
it; speculation exact with respect to the w8a8 target (greedy in ragged batches, the sampling law with its negative
control); refused by name where the kernel does not run."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import CASES, exact_law, make_noisy_copy, make_tiny_model, sample_speculative, small_target_model

import hf_spec
from hf_spec import speculative
from hf_spec.cli import main
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.loading import int8_rows
from hf_spec.loading.quantization import quantization_of, quantized_copy
from hf_spec.loading.weight_only import (
    WeightOnlyLinear,
    dynamic_int8_mm,
    int8_codes,
    quantize_weights,
    quantized_inputs,
)

runs_here = pytest.mark.skipif(int8_rows.dynamic_kernel() is None,
                               reason=f"the w8a8 kernel does not run here: {int8_rows.why_not() or 'no AVX512-VNNI'}")


@pytest.fixture(scope="module")
def full_precision():
    """The statistical tests' small target (vocabulary 4: its output layer takes the torch path)."""
    return small_target_model()


@pytest.fixture
def rebuilt_kernel_choice():
    int8_rows._build.cache_clear()
    yield
    int8_rows._build.cache_clear()


def test_inputs_are_quantized_per_row_and_group_of_32():
    rows = torch.zeros(2, 64)
    rows[0, :32] = torch.linspace(-2, 2, 32)  # a group whose largest magnitude is 2
    rows[1, 40] = -0.5
    codes, scales = quantized_inputs(rows)
    assert codes.shape == (2, 2, 32) and scales.shape == (2, 2)
    assert scales[0, 0] == torch.tensor(2.0) / 127 and scales[0, 1] == 0 and not codes[0, 1].any()
    assert codes[0, 0, 0] == -127 and codes[0, 0, -1] == 127 and codes[1, 1, 8] == -127
    assert torch.allclose(codes * scales[..., None], rows.view(2, 2, 32), atol=2 / 127 / 2 + 1e-7)


@runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [336, 40])
def test_each_row_is_computed_alone_as_the_reference_computes_it(dtype, out_features):
    """A verify pass's rows equal, bit for bit, what one-row steps compute (a row's codes, scales and group sums are
    its own); the kernel (336 outputs: 21 tiles) and the torch path (40: not a multiple of 16) compute the
    reference's product; a row of zeros gives the bias."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, out_features).to(dtype)
    layer = WeightOnlyLinear(linear, bits=8, dynamic=True)
    assert layer.takes_dynamic_kernel == (out_features % int8_rows.LANES == 0) and not layer.takes_rows_kernel
    rows = (torch.randn(21, 256) * torch.linspace(0.1, 4, 256)).to(dtype)
    rows[7] = 0
    out = layer(rows)
    assert out.dtype == dtype and torch.equal(out[7], layer.bias)
    for count in (1, 2, 6, 8, 9, 16, 21):
        assert torch.equal(layer(rows[:count]), out[:count])
    assert all(torch.equal(layer(rows[i:i + 1]), out[i:i + 1]) for i in range(len(rows)))
    codes, scales = int8_codes(linear.weight.float())
    assert torch.equal(layer.int8_weight(), codes) and torch.equal(layer.scales, scales)  # the tiles hold the codes
    reference = dynamic_int8_mm(rows, layer.int8_weight(), layer.scales).to(dtype) + layer.bias
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # fused or separate roundings of the group sums
    assert torch.allclose(out.float(), reference.float(), rtol=tolerance, atol=tolerance)
    exact = rows.float() @ (layer.int8_weight().float() * layer.scales[:, None]).T + layer.bias.float()
    assert torch.allclose(out.float(), exact, rtol=0.05, atol=0.05 * exact.abs().max().item())  # the same product


@runs_here
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_reaches_its_rows_output_as_in_the_reference(bad):
    """A NaN or inf input is not rounded away: its row's outputs are not finite, on the kernel as in torch."""
    layer = WeightOnlyLinear(torch.nn.Linear(64, 32), bits=8, dynamic=True)
    rows = torch.randn(2, 64)
    rows[0, 3] = bad
    out, reference = layer(rows), dynamic_int8_mm(rows, layer.int8_weight(), layer.scales)
    assert not out[0].isfinite().any() and not reference[0].isfinite().any()
    assert torch.equal(out[1], layer(rows[1:])[0])


@runs_here
def test_law_and_negative_control_with_a_w8a8_target(full_precision):
    target = speculative(quantized_copy(full_precision.to(torch.bfloat16), "w8a8"))
    draft = make_noisy_copy(full_precision, seed=12, noise=1.0).to(torch.bfloat16)
    k, settings, user_processors = CASES["temperature_1"]
    law = exact_law(target, settings, user_processors)
    assert fit_sequences(sample_speculative(target, draft, settings, user_processors, k, seed=31), law).is_consistent
    wrong = sample_speculative(target, draft, settings, user_processors, k, seed=99, verification=RESAMPLE_FROM_P)
    assert not fit_sequences(wrong, law).is_consistent


@runs_here
def test_a_w8a8_draft_for_an_int8_target_keeps_the_law(full_precision):
    target = speculative(quantized_copy(full_precision, "int8"))
    draft = quantized_copy(make_noisy_copy(full_precision, seed=12, noise=1.0), "w8a8")
    k, settings, user_processors = CASES["top_p_repetition_penalty"]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=32)
    assert fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


@runs_here
def test_a_w8a8_model_pickles_and_says_what_it_is():
    model = quantized_copy(make_tiny_model(seed=0), "w8a8")
    assert quantization_of(model) == "w8a8" and "inputs int8 on the fly" in repr(model.lm_head)
    again = pickle.loads(pickle.dumps(model))
    prompt = torch.tensor([[1, 3, 2, 0]])
    with torch.no_grad():
        assert torch.equal(again(prompt).logits, model(prompt).logits)
    assert "w8a8 weights" in hf_spec.load_pair("tiny", "tiny", quantize="w8a8", quantize_draft="w8a8",
                                               optimize=False).describe()


@runs_here
def test_cli_generate_with_a_w8a8_target(capsys):
    assert main(["generate", "--target", "tiny", "--draft", "tiny", "--quantize", "w8a8", "--quantize-draft", "w8a8",
                 "--max-new-tokens", "8", "--compare", "--json"]) == 0
    assert '"num_accepted"' in capsys.readouterr().out


def test_without_the_kernel_w8a8_is_refused_by_name_before_loading(monkeypatch, rebuilt_kernel_choice):
    import hf_spec.loading.pair

    monkeypatch.setenv(int8_rows.SWITCH, "0")
    with pytest.raises(ValueError, match=r"`quantize='w8a8'` needs hf_spec's int8 kernel .*HF_SPEC_INT8_KERNEL=0"):
        quantize_weights(model := make_tiny_model(seed=0), "w8a8")
    assert not any(isinstance(module, WeightOnlyLinear) for module in model.modules())
    monkeypatch.setattr(hf_spec.loading.pair, "load_model", lambda *args, **kwargs: pytest.fail("loaded"))
    for argument in ("quantize", "quantize_draft"):
        with pytest.raises(ValueError, match=f"`{argument}='w8a8'` needs"):
            hf_spec.load_pair("tiny", "tiny", **{argument: "w8a8"})


def test_w8a8_refuses_layers_that_are_not_groups_of_32(monkeypatch):
    import hf_spec.loading.weight_only as weight_only

    monkeypatch.setattr(weight_only, "dynamic_kernel", lambda: object())  # the shapes are checked on every CPU
    model = make_tiny_model(seed=0)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(100, 64, bias=False)
    with pytest.raises(ValueError, match=r"`quantize='w8a8'`: layer 'down_proj' has 100 inputs.*'int8'"):
        quantize_weights(model, "w8a8")
    assert not any(isinstance(module, WeightOnlyLinear) for module in model.modules())
