"""Quantized targets (bitsandbytes 8-bit, nf4, fp4): exact with respect to the quantized model's own p (torch's
weight-only int8 and int4: `tests/test_weight_only.py`).

bitsandbytes runs 4-bit layers on a CPU by one of two paths (`hf_spec.loading.quantization`): with AVX512-BF16 it
repacks the weights for a fused bf16 kernel ("packed"), on AVX2-only CPUs it dequantizes them at every call
("dequantizing"). The tiny models here have every dimension a multiple of 64, so both paths take them, and whichever
path this CPU uses runs every test below (the pytest header says which). `test_4bit_shape_limit_*` exercise the packed
path's shape check on every CPU.

The laws are enumerated from the quantized target itself, so these tests check that nothing in the loop (block
verification of 4-bit or int8 layers, cache roll-back, the draft's own precision) moves the output law away from
target-only decoding with that quantized target. Greedy runs must equal its target-only output token for token.
"""

from __future__ import annotations

import json

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
)

import hf_spec.loading.quantization
import hf_spec.rounds
from hf_spec import speculative
from hf_spec.cli import main
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.loading.quantization import BITSANDBYTES_SCHEMES as SCHEMES
from hf_spec.loading.quantization import (
    check_quantizable,
    first_device,
    packs_4bit_for_cpu,
    quantization_config,
    quantization_of,
    quantized_copy,
)

pytest.importorskip("bitsandbytes")
bnb = pytest.importorskip("bitsandbytes.nn")

QUANTIZED_LINEAR = {"8bit": bnb.Linear8bitLt, "nf4": bnb.Linear4bit, "fp4": bnb.Linear4bit}


@pytest.fixture(scope="module")
def full_precision():
    """The statistical tests' small target (vocabulary 4), before quantization."""
    return make_tiny_model(seed=10, vocab_size=4, num_layers=1, head_scale=3.0)


@pytest.fixture(scope="module")
def quantized_targets(full_precision):
    return {scheme: speculative(quantized_copy(full_precision, scheme)) for scheme in SCHEMES}


@pytest.fixture(scope="module")
def small_draft(full_precision):
    """Full precision, about 50% acceptance against the quantized targets."""
    return make_noisy_copy(full_precision, seed=12, noise=1.0)


def test_quantized_copies_really_are_quantized_on_the_cpu(quantized_targets, full_precision):
    for scheme, model in quantized_targets.items():
        assert isinstance(model.model.layers[0].self_attn.q_proj, QUANTIZED_LINEAR[scheme]), scheme
        assert quantization_of(model) == scheme
        assert {parameter.device.type for parameter in model.parameters()} == {"cpu"}
        assert first_device(model) == torch.device("cpu")
        prompt = torch.tensor([[1, 3, 2, 0]])
        with torch.no_grad():  # p differs from the full-precision model's: exactness is about the quantized one
            assert not torch.equal(model(prompt).logits, full_precision(prompt).logits), scheme
    assert quantization_of(full_precision) is None


@pytest.mark.parametrize(
    "scheme, case", [("nf4", "temperature_1"), ("fp4", "combined_chain_k4"), ("8bit", "temperature_0.7_top_k")]
)
def test_speculative_sampling_follows_the_quantized_target_law(quantized_targets, small_draft, scheme, case):
    target = quantized_targets[scheme]
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(target, small_draft, settings, user_processors, k, seed=21)
    result = fit_sequences(samples, exact_law(target, settings, user_processors))
    assert result.is_consistent, result


def test_a_quantized_draft_keeps_the_law(quantized_targets, small_draft):
    """Both quantized: q is whatever the nf4 draft computes, p whatever the 8-bit target computes."""
    target, draft = quantized_targets["8bit"], quantized_copy(small_draft, "nf4")
    k, settings, user_processors = CASES["top_p_repetition_penalty"]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=22)
    result = fit_sequences(samples, exact_law(target, settings, user_processors))
    assert result.is_consistent, result


def test_negative_control_resampling_from_p_is_caught_with_a_quantized_target(
    quantized_targets, small_draft, monkeypatch
):
    target = quantized_targets["nf4"]
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(target, small_draft, settings, user_processors, k, seed=99,
                                 verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


@pytest.fixture(scope="module")
def batch_target():
    """Vocabulary 16, prompts of 3 to 20 tokens (`test_batches.PROMPTS`)."""
    return make_tiny_model(seed=0)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("draft_scheme", [None, "nf4"])
def test_greedy_ragged_batch_equals_quantized_target_only(batch_target, scheme, draft_scheme):
    target = speculative(quantized_copy(batch_target, scheme))
    draft = make_noisy_copy(batch_target, seed=4, noise=0.5)
    draft = quantized_copy(draft, draft_scheme) if draft_scheme else draft
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": PAD}
    with hf_spec.without_speculation(target):
        expected = target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=draft, num_assistant_tokens=4, return_dict_in_generate=True,
                             **common)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.num_accepted < output.speculative_stats.num_draft_tokens  # both paths ran


def test_device_map_auto_on_a_single_cpu(batch_target, tmp_path):
    """What a machine with one CPU device allows: accelerate places every module on it; the draft goes to the
    target's first device; output equals target-only decoding."""
    from transformers import AutoModelForCausalLM

    batch_target.save_pretrained(tmp_path)
    target = speculative(AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto"))
    assert {parameter.device.type for parameter in target.parameters()} == {"cpu"}
    draft = make_noisy_copy(batch_target, seed=4, noise=0.5).to(first_device(target))
    prompt = torch.tensor([PROMPTS[1]])
    expected = batch_target.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=PAD)
    assert torch.equal(target.generate(prompt, assistant_model=draft, max_new_tokens=10, do_sample=False,
                                       pad_token_id=PAD), expected)


def test_a_target_dispatched_by_accelerate_hooks(batch_target, tmp_path):
    """A device map with more than one place makes accelerate dispatch the model with hooks that move weights and
    activations, as across GPUs; on a CPU-only machine, offloading a decoder layer to disk does that. Block
    verification and cache roll-back through those hooks equal target-only decoding."""
    from transformers import AutoModelForCausalLM

    batch_target.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    target = speculative(AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                              offload_folder=tmp_path / "offload"))
    assert target.hf_device_map == device_map and hasattr(target.model.layers[0], "_hf_hook")
    draft = make_noisy_copy(batch_target, seed=4, noise=0.5).to(first_device(target))
    input_ids, attention_mask = left_padded(PROMPTS)
    common = {"attention_mask": attention_mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": PAD}
    expected = batch_target.generate(input_ids, **common)
    output = target.generate(input_ids, assistant_model=draft, return_dict_in_generate=True, **common)
    assert torch.equal(output.sequences, expected)
    assert 0 < output.speculative_stats.num_accepted < output.speculative_stats.num_draft_tokens


def test_bad_scheme_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`quantize` must be one of .*'int3'"):
        quantization_config("int3")
    with pytest.raises(ValueError, match="'int3'"):
        quantized_copy(make_tiny_model(seed=0), "int3")


def test_config_of_each_scheme():
    assert quantization_config("8bit").load_in_8bit
    config = quantization_config("fp4", torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "fp4"
    assert config.bnb_4bit_compute_dtype == torch.bfloat16


def test_cli_generate_with_a_quantized_tiny_target(capsys):
    assert main(["generate", "--target", "tiny", "--draft", "tiny", "--quantize", "nf4", "--quantize-draft", "8bit",
                 "--max-new-tokens", "8", "--compare", "--json"]) == 0
    assert '"num_accepted"' in capsys.readouterr().out


def test_bench_runs_every_method_on_the_quantized_variants_too(tmp_path, capsys):
    """``--variants nf4 8bit``: target-only and hf_spec on the full-precision target and on each quantized copy,
    interleaved; each variant's greedy output equals its own target-only output, and ratios to both baselines."""
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--target", "tiny", "--draft", "tiny", "--variants", "nf4", "8bit", "--methods", "hf_spec",
                 "--workloads", "code", "--prompts", "2", "--max-new-tokens", "10", "--threads", "1", "--no-progress",
                 "--output", str(report_path), "--plot", str(tmp_path / "bench.png")]) == 0
    assert "| vs own target-only |" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    methods = ["target_only", "hf_spec", "target_only@nf4", "hf_spec@nf4", "target_only@8bit", "hf_spec@8bit"]
    assert report["config"]["methods"] == [*methods, "target_only@stock", "target_only@steps"]
    assert report["config"]["variants"] == {"nf4": {"target": "nf4", "draft": "same"},
                                            "8bit": {"target": "8bit", "draft": "same"},
                                            "stock": {"target": "tiny (float32, CPU path stock)", "draft": "same"},
                                            "steps": report["config"]["variants"]["steps"]}
    assert report["config"]["variants"]["steps"]["target"].startswith("tiny (float32, CPU path ")
    assert report["config"]["quantization"] is None
    assert report["weights_bytes"]["target@nf4"] < report["weights_bytes"]["target"]
    assert set(report["costs"]) == {"code", "code@nf4", "code@8bit"}
    rows = {row["method"]: row for row in report["results"] if row["setting"] == "greedy"}
    for method in methods:
        variant = method.partition("@")[2]
        own = rows["target_only" + ("@" + variant if variant else "")]
        assert rows[method]["identical_to_target_only"] == 1.0, method
        assert rows[method]["speedup_vs_own_target_only"] == pytest.approx(
            rows[method]["tokens_per_second"] / own["tokens_per_second"])
        assert rows[method]["speedup_vs_target_only"] == pytest.approx(
            rows[method]["tokens_per_second"] / rows["target_only"]["tokens_per_second"])
    assert rows["hf_spec@nf4"]["predicted_speedup"] is not None
    weights = report["weights_bytes"]
    assert rows["hf_spec@nf4"]["weights_bytes"] == weights["target@nf4"] + weights["draft@nf4"]


def test_cli_distill_has_no_quantized_draft(tmp_path, capsys):
    """The draft trains in float32: distill has no --quantize-draft (quantize the trained draft when loading it)."""
    assert main(["distill", "--target", "tiny", "--draft", "tiny", "--quantize-draft", "nf4",
                 "--output-dir", str(tmp_path)]) == 2
    assert "unrecognized arguments: --quantize-draft nf4" in capsys.readouterr().err


def _narrow_model():
    """hidden_size 32: fits the dequantizing 4-bit path but not the packed one (in_features < 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("scheme", ["nf4", "fp4"])
def test_4bit_shape_limit_of_the_packed_path_is_refused_by_layer_name(scheme, monkeypatch):
    """As on an AVX512-BF16 CPU (forced here, so every CPU class runs it): refused before anything is quantized,
    naming the first layer that does not fit and its size; the model is left as it was."""
    monkeypatch.setattr(hf_spec.loading.quantization, "packs_4bit_for_cpu", lambda: True)
    model = _narrow_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj' \(32 -> 32 features\).*"
                                         r"divisible by 64"):
        quantized_copy(model, scheme)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not any(isinstance(module, bnb.Linear4bit) for module in model.modules())
    check_quantizable(model, "8bit")  # 8-bit layers have no such limit
    check_quantizable(model, scheme, device_map={"": "cuda:0"})  # nor do 4-bit layers on a GPU


def test_4bit_shape_limit_is_checked_from_the_config_before_loading(tmp_path, monkeypatch):
    from hf_spec.loading.pretrained import load

    monkeypatch.setattr(hf_spec.loading.quantization, "packs_4bit_for_cpu", lambda: True)
    _narrow_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"`quantize='nf4'`: bitsandbytes cannot run layer 'model\.layers\.0"):
        load(str(tmp_path), quantize="nf4")


def test_4bit_narrow_model_on_this_cpu_path():
    """The real bitsandbytes on this CPU: the dequantizing path (AVX2 only) runs a 32-wide model; the packed path
    (AVX512-BF16) is refused up front with the clear error instead of bitsandbytes' reshape error mid-forward."""
    model = _narrow_model()
    if packs_4bit_for_cpu():
        with pytest.raises(ValueError, match="divisible by 64"):
            quantized_copy(model, "nf4")
    else:
        quantized = quantized_copy(model, "nf4")
        with torch.no_grad():
            assert quantized(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 16)
