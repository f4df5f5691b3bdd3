"""A GGUF file's own weights on hf_spec's kernel (`hf_spec.loading.gguf_weights`): exact to the file, and speculation
keeps the GGUF model's own law.

- The kernel against a float64 reference built from the ``gguf`` package's own dequantization of the same blocks and
  the rows quantized as the kernel quantizes them, for every type it takes, with rows alone and in blocks (bit for bit:
  a verify pass computes each position as a one-token step would).
- Tiny GGUF files (Llama and Qwen2, a different type per layer) loaded by transformers, then put back on their
  blocks: each layer's weights are transformers' dequantized values exactly; outputs close to the float model's.
- Speculation: greedy in ragged batches equal to the GGUF target's own decoding; the sampled law against the enumerated
  law, with a negative control; saving and loading; the fallback where the kernel cannot run.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from helpers import CASES, PAD, PROMPTS, exact_law, left_padded, make_noisy_copy, sample_speculative
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import hf_spec
from hf_spec import speculative, without_speculation
from hf_spec.compat import drop_gguf_quantizer
from hf_spec.evaluation.exactness import RESAMPLE_FROM_P, fit_sequences
from hf_spec.loading import gguf_weights
from hf_spec.loading.gguf_weights import TYPES, GGUFLinear, adopt_gguf, gguf_kernel, reference_mm
from hf_spec.loading.gguf_writer import QUANT_TYPES, encode_k, write_gguf
from hf_spec.loading.quantization import gguf_copy

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(gguf_kernel() is None, reason=f"the GGUF kernel does not run here: "
                                                              f"{gguf_weights.why_not()}")
TYPE_IDS = {name: type_id for type_id, (name, _, _) in TYPES.items()}


def blocks_of(kind: str, rows: int, inputs: int, seed: int = 0) -> torch.Tensor:
    """``[rows, inputs / block * bytes]``: a float weight encoded in ``kind`` (the ``gguf`` package, or `encode_k`)."""
    weight = np.random.default_rng(seed).standard_normal((rows, inputs)).astype(np.float32) * 0.05
    if kind.endswith("_K"):
        return torch.from_numpy(encode_k(weight, kind))
    return torch.from_numpy(gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_the_kernel_computes_the_files_values_times_the_quantized_rows(kind):
    layer = GGUFLinear(blocks_of(kind, 40, 768), TYPE_IDS[kind], 768)
    rows = torch.randn(11, 768)
    out = layer(rows)
    reference = reference_mm(rows, layer)
    assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(layer.dequantized(), torch.from_numpy(gguf.quants.dequantize(
        layer.blocks.numpy(), gguf.GGMLQuantizationType[kind]).astype(np.float32)).view(40, 768))
    dense = rows @ layer.dequantized().T  # the activations' rounding is all that separates them
    assert (out - dense).norm() < 0.03 * dense.norm()


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_computed_as_if_alone(kind, dtype):
    """A verify block's rows, a ragged batch's rows, a prompt's rows: each equals that row multiplied alone."""
    layer = GGUFLinear(blocks_of(kind, 24, 512, seed=1), TYPE_IDS[kind], 512)
    rows = torch.randn(19, 512).to(dtype)
    together = layer(rows)
    for count in (1, 2, 5, 8, 9, 19):
        assert torch.equal(layer(rows[:count]), together[:count])
    assert torch.equal(torch.cat([layer(rows[i:i + 1]) for i in range(19)]), together)
    assert together.dtype == dtype


def test_a_nan_input_reaches_its_row_only():
    layer = GGUFLinear(blocks_of("Q4_K", 8, 256), TYPE_IDS["Q4_K"], 256)
    rows = torch.randn(3, 256)
    rows[1, 7] = float("nan")
    out = layer(rows)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def tiny_models():
    common = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "tie_word_embeddings": False}
    torch.manual_seed(0)
    return {"llama": LlamaForCausalLM(LlamaConfig(**common)).eval(),
            "qwen2": Qwen2ForCausalLM(Qwen2Config(**common)).eval()}


#: One type per kind of layer, so that a file holds every type the kernel takes.
LAYER_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
               "ffn_up": "Q5_0", "ffn_down": "Q5_1", "output": "Q8_0"}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {name: write_gguf(model, folder / f"{name}.gguf", LAYER_TYPES) for name, model in tiny_models().items()}


def loaded(path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    drop_gguf_quantizer(model)
    return model


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_every_layer_takes_the_files_blocks_exactly(gguf_files, name):
    """transformers' dequantized model, then the same model on the file's blocks: every linear layer changed (Llama's q
    and k rows in transformers' order, Qwen2's biases kept), each layer's weight is transformers' value exactly, and
    each layer computes the reference product of those weights."""
    model = loaded(gguf_files[name])
    dense = {layer: module.weight.detach().clone() for layer, module in model.named_modules()
             if isinstance(module, torch.nn.Linear)}
    ids = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        float_logits = model(ids).logits
    adopted = adopt_gguf(model, gguf_files[name])
    assert set(adopted) == set(dense) and set(adopted.values()) == set(QUANT_TYPES)
    for layer, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            assert torch.equal(module.dequantized(), dense[layer]), layer
            rows = torch.randn(4, module.in_features)
            expected = reference_mm(rows, module) + (0 if module.bias is None else module.bias.double())
            assert torch.allclose(module(rows).double(), expected, rtol=1e-5, atol=1e-5), layer
    assert model.config.quantization_config.scheme == "gguf"
    with torch.no_grad():
        logits = model(ids).logits
    assert (logits - float_logits).norm() < 0.05 * float_logits.norm()


def test_a_file_of_another_model_is_refused_by_name(gguf_files):
    model = loaded(gguf_files["llama"])
    other = copy.deepcopy(model)
    for parameter in other.parameters():
        parameter.data.add_(0.01)
    with pytest.raises(ValueError, match=r"`gguf_file` .*llama.gguf.* does not hold this model's weights"):
        adopt_gguf(other, gguf_files["llama"])


def test_speculation_on_a_gguf_target_equals_its_own_decoding_in_a_ragged_batch(gguf_files):
    """A Qwen2 target on its file's blocks, and two drafts: its float near-copy, and a GGUF copy of that."""
    target = speculative(adopt_and_return(loaded(gguf_files["qwen2"]), gguf_files["qwen2"]))
    float_draft = make_noisy_copy(loaded(gguf_files["qwen2"]), seed=3, noise=0.002)
    ids, mask = left_padded([[5 + token for token in prompt] for prompt in PROMPTS])
    common = {"attention_mask": mask, "max_new_tokens": 16, "do_sample": False, "pad_token_id": PAD}
    with without_speculation(target):
        expected = target.generate(ids, **common)
    for draft in (float_draft, gguf_copy(float_draft, "Q8_0")):
        for k in (2, 5):
            output = target.generate(ids, assistant_model=draft, num_assistant_tokens=k, return_dict_in_generate=True,
                                     **common)
            assert torch.equal(output.sequences, expected)
            assert output.speculative_stats.num_accepted > 0


def adopt_and_return(model, path):
    adopt_gguf(model, path)
    return model


@pytest.fixture(scope="module")
def small_gguf_pair():
    """The statistical tests' small target (vocabulary 4, 64 wide: Q4_0 blocks) on a GGUF file's blocks, and its
    draft."""
    from helpers import small_target_model

    target = small_target_model()
    draft = make_noisy_copy(target, seed=12, noise=1.0)
    return speculative(gguf_copy(target, "Q4_0")), draft


@pytest.mark.parametrize("case", ["temperature_1", "combined_chain_k4"])
def test_sampling_follows_the_gguf_targets_law(small_gguf_pair, case):
    target, draft = small_gguf_pair
    assert any(isinstance(module, GGUFLinear) for module in target.modules())
    k, settings, user_processors = CASES[case]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=31)
    assert fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


def test_negative_control_is_caught_with_a_gguf_target(small_gguf_pair):
    target, draft = small_gguf_pair
    k, settings, user_processors = CASES["temperature_1"]
    samples = sample_speculative(target, draft, settings, user_processors, k, seed=98, verification=RESAMPLE_FROM_P)
    assert not fit_sequences(samples, exact_law(target, settings, user_processors)).is_consistent


def test_a_gguf_model_saves_loads_and_pickles(gguf_files, tmp_path):
    model = adopt_and_return(loaded(gguf_files["llama"]), gguf_files["llama"])
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert {type(module).__name__ for module in again.modules()} >= {"GGUFLinear"}
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        assert torch.equal(pickle.loads(pickle.dumps(model))(ids).logits, model(ids).logits)


def test_the_tiny_pair_loads_on_gguf_blocks_and_speculates():
    pair = hf_spec.load_pair("tiny", "tiny", quantize="gguf", quantize_draft="gguf", optimize=False)
    for model in (pair.target, pair.draft):
        assert any(isinstance(module, GGUFLinear) for module in model.modules())
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with without_speculation(pair.target):
        expected = pair.target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(pair.target.generate(ids, assistant_model=pair.draft, max_new_tokens=12, do_sample=False),
                       expected)


@pytest.mark.parametrize("why", ["switch", "cpu"])
def test_where_the_kernel_cannot_run_the_model_keeps_its_float_weights(gguf_files, monkeypatch, why, caplog):
    """A CPU without AVX2, FMA or F16C, or ``HF_SPEC_GGUF_KERNEL=0``: nothing changes, as before this path existed."""
    gguf_weights._build.cache_clear()
    try:
        if why == "switch":
            monkeypatch.setenv(gguf_weights.SWITCH, "0")
        else:
            monkeypatch.setattr(gguf_weights, "cpu_flags", lambda: ("some CPU", {"sse2", "avx"}))
        model = loaded(gguf_files["llama"])
        assert adopt_gguf(model, gguf_files["llama"]) == {}
        assert not any(isinstance(module, GGUFLinear) for module in model.modules())
        expected = "HF_SPEC_GGUF_KERNEL=0" if why == "switch" else "this CPU has no AVX2, F16C, FMA"
        assert gguf_weights.why_not() == expected
    finally:
        gguf_weights._build.cache_clear()


def test_a_bad_kernel_switch_is_named(monkeypatch):
    gguf_weights._build.cache_clear()
    monkeypatch.setenv(gguf_weights.SWITCH, "yes")
    try:
        with pytest.raises(ValueError, match="`HF_SPEC_GGUF_KERNEL` must be '0'.*'yes'"):
            gguf_weights.gguf_kernel()
    finally:
        gguf_weights._build.cache_clear()


def test_a_tied_output_layer_takes_the_embeddings_blocks(tmp_path):
    """A file of a model with tied embeddings holds ``token_embd`` once: the output layer multiplies by its blocks
    (the input embedding keeps its float rows for lookups), and the model saves and loads."""
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(1)
    path = write_gguf(LlamaForCausalLM(config).eval(), tmp_path / "tied.gguf", "Q8_0")
    model = loaded(path)
    adopted = adopt_gguf(model, path)
    assert adopted["lm_head"] == "Q8_0"
    assert torch.equal(model.get_output_embeddings().dequantized(), model.get_input_embeddings().weight)
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_a_gguf_target_compiles_whole_with_a_static_cache():
    """The kernel is a torch operator (``hf_spec::gguf_mm``) to ``torch.compile``: verify passes compile in one graph
    (``fullgraph=True``), and greedy output equals the GGUF target's own."""
    from helpers import make_tiny_model
    from transformers import CompileConfig

    target = speculative(gguf_copy(make_tiny_model(seed=0), "Q8_0"))
    draft = make_noisy_copy(make_tiny_model(seed=0), seed=2, noise=0.05)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with without_speculation(target):
        expected = target.generate(ids, max_new_tokens=10, do_sample=False)
    output = target.generate(ids, assistant_model=draft, max_new_tokens=10, do_sample=False,
                             cache_implementation="static", compile_config=CompileConfig(fullgraph=True))
    assert torch.equal(output, expected)
