"""Weight-only int8 and int4 targets and drafts on CPU kernels (`hf_spec.loading.weight_only`, and the int8 rows kernel
of `hf_spec.loading.int8_rows` for bf16 activations): exact with respect to the quantized model's own p, greedy and
sampled, in batches, with a negative control; the layers, their round trip and their refusals."""

from __future__ import annotations

import copy
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
from transformers import AutoModelForCausalLM

import hf_spec
from hf_spec import speculative
from hf_spec.cli import main
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.loading import int8_rows
from hf_spec.loading.packed import optimize
from hf_spec.loading.quantization import quantization_of, quantized_copy
from hf_spec.loading.weight_only import (
    DENSE_ROWS,
    WEIGHT_ONLY_SCHEMES,
    WeightOnlyLinear,
    adopt_torchao,
    quantize_weights,
    torchao_int8,
)


@pytest.fixture(scope="module")
def full_precision():
    """The statistical tests' small target (vocabulary 4), before quantization."""
    return small_target_model()


@pytest.fixture(scope="module")
def small_draft(full_precision):
    return make_noisy_copy(full_precision, seed=12, noise=1.0)


def schemes_here() -> list:
    """`WEIGHT_ONLY_SCHEMES`, ``"w8a8"`` skipped where its kernel does not run."""
    return [pytest.param(scheme, marks=pytest.mark.skipif(
        scheme == "w8a8" and int8_rows.dynamic_kernel() is None, reason="the w8a8 kernel does not run here"))
        for scheme in WEIGHT_ONLY_SCHEMES]


@pytest.mark.parametrize("scheme", schemes_here())
def test_every_linear_layer_is_replaced_and_close_to_its_weights(full_precision, scheme):
    model = quantized_copy(full_precision, scheme)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, WeightOnlyLinear)}
    assert not any(type(module) is torch.nn.Linear for module in model.modules())
    assert layers["lm_head"].bits == 8 and layers["model.layers.0.mlp.up_proj"].bits == (4 if scheme == "int4" else 8)
    assert quantization_of(model) == scheme and quantization_of(full_precision) is None
    original = full_precision.model.layers[0].mlp.up_proj.weight
    error = (layers["model.layers.0.mlp.up_proj"].dequantized() - original).abs().max()
    assert 0 < error < original.abs().max() / (100 if scheme == "int8" else 5)
    prompt = torch.tensor([[1, 3, 2, 0]])
    with torch.no_grad():  # p differs from the full-precision model's: exactness is about the quantized one
        assert not torch.equal(model(prompt).logits, full_precision(prompt).logits)
    assert "weight-only" in optimize(model, "auto").reason  # its layers are no dense layers to pack


def in_dtype(model, dtype):
    """A copy in ``dtype`` (the fixtures stay as they are)."""
    return copy.deepcopy(model).to(dtype)


def assert_greedy_batch_equals_target_only(target, draft, k: int) -> None:
    """Greedy speculation over a ragged batch writes what the target writes alone, with drafts both accepted and
    rejected (both paths of the rule ran)."""
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD}
    with hf_spec.without_speculation(target):
        expected = target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=draft, num_assistant_tokens=k, return_dict_in_generate=True,
                             **common)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.num_accepted < output.speculative_stats.num_draft_tokens


def kernel_runs() -> bool:
    return int8_rows.rows_kernel() is not None


@pytest.fixture
def rebuilt_kernel_choice():
    """Forget the process's kernel choice before and after a test that changes what it depends on."""
    int8_rows._build.cache_clear()
    yield
    int8_rows._build.cache_clear()


@pytest.mark.parametrize("scheme, case, dtype", [("int8", "temperature_1", torch.float32),
                                                 ("int8", "temperature_1", torch.bfloat16),
                                                 ("int4", "combined_chain_k4", torch.float32)])
def test_speculative_sampling_follows_the_quantized_target_law(full_precision, small_draft, scheme, case, dtype):
    """bf16 activations on int8 layers take the rows kernel where this CPU has AVX512-BF16."""
    target = speculative(quantized_copy(in_dtype(full_precision, dtype), scheme))
    small_draft = in_dtype(small_draft, dtype)
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(target, small_draft, settings, user_processors, k, seed=21)
    result = fit_sequences(samples, exact_law(target, settings, user_processors))
    assert result.is_consistent, result


def test_an_int4_draft_for_an_int8_target_keeps_the_law(full_precision, small_draft):
    target, draft = speculative(quantized_copy(full_precision, "int8")), quantized_copy(small_draft, "int4")
    k, settings, user_processors = CASES["top_p_repetition_penalty"]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=22)
    assert fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


@pytest.mark.parametrize("scheme, dtype", [("int4", torch.float32), ("int8", torch.bfloat16)])
def test_negative_control_is_caught_with_a_quantized_target(full_precision, small_draft, scheme, dtype):
    target = speculative(quantized_copy(in_dtype(full_precision, dtype), scheme))
    small_draft = in_dtype(small_draft, dtype)
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(target, small_draft, settings, user_processors, k, seed=99,
                                 verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


@pytest.mark.parametrize("scheme", schemes_here())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ragged_batch_equals_quantized_target_only(scheme, dtype):
    plain = make_tiny_model(seed=0).to(dtype)
    target = speculative(quantized_copy(plain, scheme))
    draft = quantized_copy(make_noisy_copy(make_tiny_model(seed=0), seed=4, noise=0.5).to(dtype), scheme)
    assert_greedy_batch_equals_target_only(target, draft, k=4)


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


@pytest.mark.skipif(not kernel_runs(), reason=f"the int8 rows kernel does not run here: {int8_rows.why_not()}")
def test_the_rows_kernel_computes_each_row_as_a_one_row_step_would():
    """A verify pass's rows equal, bit for bit, what a one-token step computes for each: the sum over inputs runs in
    the same order whatever the rows beside it. The output widths (300, 4) take both the tiles and their tail."""
    torch.manual_seed(0)
    for out_features in (300, 4):
        layer = WeightOnlyLinear(torch.nn.Linear(256, out_features).to(torch.bfloat16), bits=8)
        assert layer.takes_rows_kernel
        rows = torch.randn(DENSE_ROWS - 1, 256).to(torch.bfloat16)
        out = layer(rows)
        for count in (1, 2, 5, 6, 7, DENSE_ROWS - 1):
            assert torch.equal(layer(rows[:count]), out[:count])
        assert all(torch.equal(layer(rows[i:i + 1]), out[i:i + 1]) for i in range(len(rows)))
        kernel = int8_rows.rows_kernel().int8_rows_mm(rows, layer.weight_tiles, layer.scales)
        assert torch.equal(out, kernel + layer.bias)  # the layer really took the kernel
        reference = torch.ops.aten._weight_int8pack_mm(rows, layer.int8_weight(), layer.scales) + layer.bias
        assert torch.allclose(out.float(), reference.float(), rtol=2e-2, atol=2e-2)  # the same product


@pytest.mark.skipif(not kernel_runs(), reason=f"the int8 rows kernel does not run here: {int8_rows.why_not()}")
def test_a_tiled_layer_multiplies_a_prompt_by_the_same_weights():
    """A prompt's pass (`DENSE_ROWS` rows or more) and float32 activations use the weight untiled."""
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    layer = WeightOnlyLinear(linear, bits=8)
    weight = linear.weight.float()
    plain = (weight / (weight.abs().amax(dim=1, keepdim=True) / 127)).round().clamp(-127, 127).to(torch.int8)
    assert layer.takes_rows_kernel and torch.equal(layer.int8_weight(), plain)
    rows = torch.randn(DENSE_ROWS, 64).to(torch.bfloat16)
    expected = torch.nn.functional.linear(rows, plain.to(torch.bfloat16)) * layer.scales + layer.bias
    assert torch.equal(layer(rows), expected)
    assert torch.allclose(layer(rows[:3]).float(), expected[:3].float(), rtol=2e-2, atol=2e-2)
    fp32 = torch.randn(3, 64)
    assert torch.equal(layer(fp32), torch.ops.aten._weight_int8pack_mm(fp32, plain, layer.scales.float())
                       + layer.bias.float())


def test_without_the_rows_kernel_int8_layers_take_torchs_kernel(monkeypatch, rebuilt_kernel_choice):
    monkeypatch.setenv(int8_rows.SWITCH, "0")
    assert int8_rows.rows_kernel() is None and int8_rows.why_not() == f"{int8_rows.SWITCH}=0"
    layer = WeightOnlyLinear(torch.nn.Linear(64, 96).to(torch.bfloat16), bits=8)
    rows = torch.randn(3, 64).to(torch.bfloat16)
    expected = torch.ops.aten._weight_int8pack_mm(rows, layer.weight_int8, layer.scales) + layer.bias
    assert torch.equal(layer(rows), expected)


def test_a_switch_value_other_than_0_or_1_is_refused_by_name(monkeypatch, rebuilt_kernel_choice):
    monkeypatch.setenv(int8_rows.SWITCH, "false")
    with pytest.raises(ValueError, match=r"`HF_SPEC_INT8_KERNEL` must be '0' .* but is 'false'"):
        WeightOnlyLinear(torch.nn.Linear(64, 96).to(torch.bfloat16), bits=8)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, rebuilt_kernel_choice):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(int8_rows, "cpu_flags", lambda: ("any", {"avx512_bf16"}))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    int8_rows._warn_once.cache_clear()
    with pytest.warns(UserWarning, match="fall back to torch's kernel: building int8_rows.cpp failed.*Ninja"):
        layer = WeightOnlyLinear(torch.nn.Linear(64, 96).to(torch.bfloat16), bits=8)
    assert not layer.takes_rows_kernel
    rows = torch.randn(3, 64).to(torch.bfloat16)
    expected = torch.ops.aten._weight_int8pack_mm(rows, layer.weight_int8, layer.scales) + layer.bias
    assert torch.equal(layer(rows), expected)
    int8_rows._warn_once.cache_clear()


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
    with pytest.raises(ValueError, match=r"`quantize` must be one of \('int8', 'int4', 'w8a8'\) here, but is 'int2'"):
        quantize_weights(make_tiny_model(seed=0), "int2")


def test_cli_generate_with_weight_only_target_and_draft(capsys):
    assert main(["generate", "--target", "tiny", "--draft", "tiny", "--quantize", "int8", "--quantize-draft", "int4",
                 "--max-new-tokens", "8", "--compare", "--json"]) == 0
    assert '"num_accepted"' in capsys.readouterr().out


def test_a_torchao_int8_model_is_put_on_the_int8_kernels_by_prepare_pair(tmp_path):
    """transformers' route, ``from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))``:
    `prepare_pair` keeps torchao's codes and scales and multiplies with hf_spec's int8 layers; greedy speculation
    equals the adopted target's own decoding in a ragged batch."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    make_tiny_model(seed=0).to(torch.bfloat16).save_pretrained(tmp_path / "target")
    make_noisy_copy(make_tiny_model(seed=0), seed=4, noise=0.5).to(torch.bfloat16).save_pretrained(tmp_path / "draft")
    config = TorchAoConfig(Int8WeightOnlyConfig())
    target, draft = (AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.bfloat16,
                                                          quantization_config=config) for name in ("target", "draft"))
    up = target.model.layers[0].mlp.up_proj.weight
    codes, scales = up.qdata.clone(), up.scale.reshape(-1).clone()
    pair = hf_spec.prepare_pair(target, draft, optimize=False)
    layer = pair.target.model.layers[0].mlp.up_proj
    assert isinstance(layer, WeightOnlyLinear) and torch.equal(layer.int8_weight(), codes)
    assert torch.equal(layer.scales, scales.to(torch.bfloat16)) and layer.takes_rows_kernel == kernel_runs()
    assert not any(type(module) is torch.nn.Linear and type(module.weight).__name__ == "Int8Tensor"
                   for model in (pair.target, pair.draft) for module in model.modules())
    assert_greedy_batch_equals_target_only(pair.target, pair.draft, k=4)


def test_other_weights_are_not_taken_for_torchao_int8():
    layer = torch.nn.Linear(64, 32)
    assert torchao_int8(layer.weight) is None
    model = make_tiny_model(seed=0)
    assert adopt_torchao(model) == 0 and not any(isinstance(m, WeightOnlyLinear) for m in model.modules())


def test_a_pruned_draft_vocabulary_is_quantized_after_pruning():
    """`load_pair(quantize_draft="int8", draft_vocab=N)`: the draft is pruned first, then its layers (the pruned output
    layer of N ids included) go to int8; greedy speculation still equals the target's own decoding."""
    pair = hf_spec.load_pair("tiny", "tiny", quantize_draft="int8", draft_vocab=32, draft_vocab_counts="text",
                             optimize=False)
    kept = pair.draft.get_output_embeddings().kept  # the layer a draft step multiplies by: 32 of the 64 ids
    assert isinstance(kept, WeightOnlyLinear) and kept.out_features == 32 and quantization_of(pair.draft) == "int8"
    assert_greedy_batch_equals_target_only(pair.target, pair.draft, k=3)


def test_the_default_draft_is_quantized_exactly_where_hf_specs_kernels_run(monkeypatch, rebuilt_kernel_choice):
    """`load_pair`'s ``quantize_draft="auto"``: a bf16 draft goes to w8a8 where its kernel runs (AVX512-VNNI), to int8
    where only the rows kernel runs, and stays as loaded on float32 weights, beside a bitsandbytes target, or without
    the kernels; a scheme given is kept."""
    from hf_spec.loading.pair import draft_quantization

    bf16, fp32 = make_tiny_model(seed=0).to(torch.bfloat16), make_tiny_model(seed=0)
    chosen = ("w8a8" if int8_rows.dynamic_kernel() is not None else "int8") if kernel_runs() else None
    assert draft_quantization("auto", bf16) == chosen
    assert draft_quantization("auto", fp32) is None
    assert draft_quantization("auto", bf16, quantize="nf4") is None
    assert draft_quantization("auto", bf16, quantize="int8") == chosen
    monkeypatch.setattr(int8_rows, "_has_vnni", lambda: False)
    assert draft_quantization("auto", bf16) == ("int8" if kernel_runs() else None)
    assert draft_quantization("int4", fp32) == "int4" and draft_quantization(None, bf16) is None
    assert draft_quantization("8bit", bf16) is None  # bitsandbytes schemes are applied as the draft loads
    monkeypatch.setenv(int8_rows.SWITCH, "0")
    int8_rows._build.cache_clear()
    assert draft_quantization("auto", bf16) is None


def test_a_bad_draft_scheme_is_refused_by_name_before_loading(monkeypatch):
    import hf_spec.loading.pair

    monkeypatch.setattr(hf_spec.loading.pair, "load_model", lambda *args, **kwargs: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=r"`quantize_draft` must be None, 'auto' or one of .* but is 'int3'"):
        hf_spec.load_pair("tiny", "tiny", quantize_draft="int3")


def test_the_tiny_pair_keeps_a_float32_draft_by_default():
    pair = hf_spec.load_pair("tiny", "tiny", optimize=False)
    assert quantization_of(pair.draft) is None and "int8 weights" not in pair.describe()
    assert "int8 weights" in hf_spec.load_pair("tiny", "tiny", quantize_draft="int8", optimize=False).describe()


def test_a_draft_head_refuses_a_draft_scheme(tmp_path):
    from hf_spec.heads import DraftHead

    pair = hf_spec.load_pair("tiny", "tiny", optimize=False)
    DraftHead.from_target(pair.target).save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match=r"`quantize_draft` 'int8': `draft` .* is a draft head"):
        hf_spec.load_pair("tiny", str(tmp_path / "head"), quantize_draft="int8")


def _all_schemes(monkeypatch) -> None:
    """w8a8 layers where its kernel does not run take its torch path: the saved form is the same."""
    from hf_spec.loading import weight_only

    monkeypatch.setattr(weight_only, "check_runs_here", lambda *args, **kwargs: None)


@pytest.mark.parametrize("scheme", WEIGHT_ONLY_SCHEMES)
def test_a_saved_quantized_model_loads_back_as_the_same_model(tmp_path, monkeypatch, scheme):
    """``save_pretrained`` writes each layer's codes and scales in one saved form (quantization method "hf_spec" in
    its config) and ``from_pretrained`` builds the same layers from it, on this CPU's kernels: the same logits, and
    speculation on the loaded target equals its own decoding. (It loaded as random weights before.)"""
    _all_schemes(monkeypatch)
    model = quantize_weights(make_tiny_model(seed=0, vocab_size=64, head_scale=2.0), scheme)
    model.save_pretrained(tmp_path / "model")
    loaded = speculative(AutoModelForCausalLM.from_pretrained(tmp_path / "model"))
    assert loaded.config.quantization_config.quant_method == "hf_spec"
    assert {type(module).__name__ for module in loaded.modules()} >= {"WeightOnlyLinear"}
    assert loaded.hf_spec_weight_only == scheme
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    draft = make_noisy_copy(make_tiny_model(seed=0, vocab_size=64, head_scale=2.0), seed=1, noise=0.01)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD)
    assert torch.equal(loaded.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=8,
                                       pad_token_id=PAD), expected)
    pickle.loads(pickle.dumps(loaded))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_bf16_quantized_model_round_trips_through_save_and_load(tmp_path, scheme):
    """In bf16 the round trip is exact too (a model loaded in bf16 is compared with itself saved again: moving a built
    model with ``.to(bf16)`` also rounds its rotary table, which loading does not)."""
    model = make_tiny_model(seed=0, vocab_size=64).to(torch.bfloat16)
    quantize_weights(model, scheme).save_pretrained(tmp_path / "first")
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "first", dtype=torch.bfloat16)
    first.save_pretrained(tmp_path / "second")
    second = AutoModelForCausalLM.from_pretrained(tmp_path / "second", dtype=torch.bfloat16)
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(value, second.state_dict()[name]) for name, value in first.state_dict().items())
    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(first(prompt).logits, second(prompt).logits)


def test_the_saved_form_is_the_same_whatever_layout_the_kernels_keep(monkeypatch):
    """A layer's state dict holds its codes ``[out, in]`` and scales (int4: two codes a byte), never a CPU's tiles,
    and loads into a layer of either layout."""
    _all_schemes(monkeypatch)
    linear = torch.nn.Linear(128, 64)
    for bits, dynamic in ((8, False), (8, True), (4, False)):
        layer = WeightOnlyLinear(linear, bits, dynamic=dynamic)
        state = layer.state_dict()
        names = {"weight_int8", "scales", "bias"} if bits == 8 else {"weight_int4_codes", "scales_and_zeros", "bias"}
        assert set(state) == names
        empty = WeightOnlyLinear.to_load(128, 64, bits, dynamic, True, torch.float32)
        empty.load_state_dict(state)
        rows = torch.randn(5, 128)
        assert torch.equal(empty(rows), layer(rows))
        again = WeightOnlyLinear(torch.nn.Linear(128, 64), bits, dynamic=dynamic)
        again.load_state_dict(state)
        assert torch.equal(again(rows), layer(rows))
