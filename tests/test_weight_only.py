"""Weight-only int8 and int4 targets and drafts on torch's CPU kernels (`hf_spec.loading.weight_only`): exact with
respect to the quantized model's own p, greedy and sampled, in batches, with a negative control; the layers, their
round trip and their refusals."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import (
    CASES,
    PAD,
    PROMPTS,
    exact_law,
    left_padded,
    make_noisy_copy,
    make_tiny_model,
    sample_speculative,
    small_target_model,
)

import hf_spec
from hf_spec import speculative
from hf_spec.cli import main
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.loading.packed import optimize
from hf_spec.loading.quantization import quantization_of, quantized_copy
from hf_spec.loading.weight_only import DENSE_ROWS, WEIGHT_ONLY_SCHEMES, WeightOnlyLinear, quantize_weights


@pytest.fixture(scope="module")
def full_precision():
    """The statistical tests' small target (vocabulary 4), before quantization."""
    return small_target_model()


@pytest.fixture(scope="module")
def small_draft(full_precision):
    return make_noisy_copy(full_precision, seed=12, noise=1.0)


@pytest.mark.parametrize("scheme", WEIGHT_ONLY_SCHEMES)
def test_every_linear_layer_is_replaced_and_close_to_its_weights(full_precision, scheme):
    model = quantized_copy(full_precision, scheme)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, WeightOnlyLinear)}
    assert not any(type(module) is torch.nn.Linear for module in model.modules())
    assert layers["lm_head"].bits == 8 and layers["model.layers.0.mlp.up_proj"].bits == (8 if scheme == "int8" else 4)
    assert quantization_of(model) == scheme and quantization_of(full_precision) is None
    original = full_precision.model.layers[0].mlp.up_proj.weight
    error = (layers["model.layers.0.mlp.up_proj"].dequantized() - original).abs().max()
    assert 0 < error < original.abs().max() / (100 if scheme == "int8" else 5)
    prompt = torch.tensor([[1, 3, 2, 0]])
    with torch.no_grad():  # p differs from the full-precision model's: exactness is about the quantized one
        assert not torch.equal(model(prompt).logits, full_precision(prompt).logits)
    assert "weight-only" in optimize(model, "auto").reason  # its layers are no dense layers to pack


@pytest.mark.parametrize("scheme, case", [("int8", "temperature_1"), ("int4", "combined_chain_k4")])
def test_speculative_sampling_follows_the_quantized_target_law(full_precision, small_draft, scheme, case):
    target = speculative(quantized_copy(full_precision, scheme))
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(target, small_draft, settings, user_processors, k, seed=21)
    result = fit_sequences(samples, exact_law(target, settings, user_processors))
    assert result.is_consistent, result


def test_an_int4_draft_for_an_int8_target_keeps_the_law(full_precision, small_draft):
    target, draft = speculative(quantized_copy(full_precision, "int8")), quantized_copy(small_draft, "int4")
    k, settings, user_processors = CASES["top_p_repetition_penalty"]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=22)
    assert fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


def test_negative_control_is_caught_with_an_int4_target(full_precision, small_draft, monkeypatch):
    target = speculative(quantized_copy(full_precision, "int4"))
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(target, small_draft, settings, user_processors, k, seed=99,
                                 verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


@pytest.mark.parametrize("scheme", WEIGHT_ONLY_SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ragged_batch_equals_quantized_target_only(scheme, dtype):
    plain = make_tiny_model(seed=0).to(dtype)
    target = speculative(quantized_copy(plain, scheme))
    draft = quantized_copy(make_noisy_copy(make_tiny_model(seed=0), seed=4, noise=0.5).to(dtype), scheme)
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD}
    with hf_spec.without_speculation(target):
        expected = target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=draft, num_assistant_tokens=4, return_dict_in_generate=True,
                             **common)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.num_accepted < output.speculative_stats.num_draft_tokens  # both paths ran


def test_a_model_on_packed_layers_is_quantized_from_its_dense_weights():
    model = make_tiny_model(seed=0).to(torch.bfloat16)
    expected = quantized_copy(model, "int8")
    optimize(model, "packed")
    quantized = quantized_copy(model, "int8")
    assert not any("Packed" in type(module).__name__ for module in quantized.modules())
    prompt = torch.tensor([[1, 3, 2, 0]])
    with torch.no_grad():
        assert torch.equal(quantized(prompt).logits, expected(prompt).logits)


def test_both_int8_paths_multiply_by_the_same_weights():
    """Few rows take torch's int8 kernel, a prompt's pass the int8 weight cast and the result scaled: the same
    product up to float rounding."""
    layer = WeightOnlyLinear(torch.nn.Linear(64, 128), bits=8)
    rows = torch.randn(DENSE_ROWS, 64)
    few, many = layer(rows[:DENSE_ROWS - 1]), layer(rows)
    expected = rows @ layer.dequantized().T + layer.bias
    assert torch.allclose(many, expected, atol=1e-5) and torch.allclose(few, expected[:DENSE_ROWS - 1], atol=1e-5)


def test_a_quantized_model_pickles(full_precision):
    model = quantized_copy(full_precision, "int4")
    copy = pickle.loads(pickle.dumps(model))
    prompt = torch.tensor([[1, 3, 2, 0]])
    with torch.no_grad():
        assert torch.equal(copy(prompt).logits, model(prompt).logits)


def test_what_the_kernels_cannot_take_is_refused_before_any_layer_changes():
    model = make_tiny_model(seed=0)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(100, 64, bias=False)  # 100 inputs: not groups of 32
    with pytest.raises(ValueError, match=r"'down_proj' has 100 inputs.*'int8'"):
        quantize_weights(model, "int4")
    assert not any(isinstance(module, WeightOnlyLinear) for module in model.modules())
    quantize_weights(model, "int8")  # int8 takes any width
    with pytest.raises(ValueError, match=r"`quantize` must be one of \('int8', 'int4'\) here, but is 'int2'"):
        quantize_weights(make_tiny_model(seed=0), "int2")


def test_cli_generate_with_weight_only_target_and_draft(capsys):
    assert main(["generate", "--target", "tiny", "--draft", "tiny", "--quantize", "int8", "--quantize-draft", "int4",
                 "--max-new-tokens", "8", "--compare", "--json"]) == 0
    assert '"num_accepted"' in capsys.readouterr().out
