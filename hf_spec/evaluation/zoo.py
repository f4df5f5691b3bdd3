"""The model zoo: every causal-LM family transformers knows, as a tiny random model, checked against target-only.

`FAMILIES` enumerates transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, so a family a new transformers release adds
shows up here (as a case to check, or as one `NOT_CHECKED` must name with its reason) instead of being silently
absent. `tiny_config` shrinks a family's default config to a model of a few hundred thousand weights (hidden size 64,
one layer of each kind the family mixes, every sliding window `WINDOW` tokens), and `check_family` runs greedy
speculative decoding on it with two drafts, a near-copy (accepted most of the time: the rollback paths run) and
another random model of the family (rejected almost always), in a ragged batch and alone, with prompts longer than
every window, and compares with the target's own ``generate()``. A family is then either exact, or refused before any
forward pass with an error naming the model type or class (by hf_spec, or by transformers' own checks).

Greedy outputs are compared up to ties: where two sequences first differ, the target's own logits there (the row
decoded alone) must have its two candidates within `TIE_TOLERANCE`, a difference of float rounding between a verify
block and single steps, not of the algorithm. The reference for a batch is the target's own batched ``generate()``.
Where that differs from each row decoded alone (families whose forward takes no position ids place a left-padded
row's tokens by cache position), the rows decoded alone are a reference too, and the result says which one hf_spec
equals.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_spec.mixin import speculative

#: Every causal-LM family of the installed transformers, by ``model_type``.
FAMILIES = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
#: Every sliding window (and attention chunk) of a tiny model, in tokens: shorter than every prompt.
WINDOW = 8
VOCAB_SIZE = 256
PROMPT_LENGTHS = (30, 21)  # a ragged batch; both longer than the window
NEW_TOKENS = 24
TIE_TOLERANCE = 1e-4

#: Sizes every config takes where it has the attribute.
_SIZES = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "d_model": 64, "n_embd": 64, "n_embed": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1, "rotary_dim": 16, "kv_lora_rank": 32,
    "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16,
    "decoder_layers": 2, "encoder_layers": 2, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "decoder_start_token_id": 1, "tie_word_embeddings": False, "use_cache": True,
    "use_sliding_window": True, "max_window_layers": 1,  # Qwen's windows: layer 0 full, layer 1 sliding
    "is_decoder": True,  # BERT-family models as causal decoders (as transformers asks)
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
#: Per-family changes to the shrunk config, where the generic sizes do not fit the family.
_OVERRIDES: dict[str, dict] = {
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "persimmon": {"partial_rotary_factor": 0.5},
    "phi": {"partial_rotary_factor": 0.5},
    "stablelm": {"partial_rotary_factor": 0.25},
    "gpt_neox": {"rotary_pct": 0.25},
    "gpt_neox_japanese": {"rotary_pct": 1.0},
    # hybrids: one recurrent layer and one attention layer
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 16,
                         "mamba_n_groups": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64, "attention_window_size": WINDOW},
    "zamba": {"mamba_headdim": 16, "n_mamba_heads": 8, "attn_layer_period": 2, "attn_layer_offset": 1},
    "zamba2": {"mamba_headdim": 16, "n_mamba_heads": 8, "hybrid_layer_ids": [1], "num_mem_blocks": 1},
    "rwkv": {"attention_hidden_size": 64},
    "gemma3n_text": {"num_kv_shared_layers": 0, "altup_num_inputs": 2, "laurel_rank": 8,
                     "hidden_size_per_layer_input": 16, "activation_sparsity_pattern": [0.0, 0.0]},
    # multi-head latent attention: as many key-value heads as heads
    "deepseek_v3": {"num_key_value_heads": 4, "head_dim": 8},
    **{name: {"num_key_value_heads": 4} for name in ("deepseek_v2", "deepseek_v32", "minicpm3",
                                                     "kimi_linear", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash",
                                                     "sarvam_mla", "youtu", "axk1", "axk2", "hy_v4",
                                                     "bailing_hybrid")},
}

_PER_LAYER = "a config of per-layer settings (head sizes vary by layer), which the generic shrinking does not set"
_DOES_NOT_BUILD = "the generic tiny config does not build for this family"
#: Families the matrix does not check, and why: each is listed by name, so none is silently absent.
NOT_CHECKED = {
    "blt": "its tiny config still allocates over 10 GB (the byte-level patcher keeps full-size defaults)",
    "gemma3n": "its vision tower needs the timm library, which the tests do not install",
    **dict.fromkeys(("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gemma4_unified_assistant",
                     "dots3_note", "dots3_note_text"), _PER_LAYER),
    "gemma4_assistant": "a drafting head for Gemma 4 (its config requires Gemma 4's per-layer inputs), not a model "
                        "to speculate on",
    "musicgen": "an audio model whose ids hold one row per codebook, not a text decoder",
    "musicgen_melody": "an audio model whose ids hold one row per codebook, not a text decoder",
    "prophetnet": "an encoder-decoder family: its decoder needs encoder and decoder layer counts of its own",
    "xlnet": "a permutation language model without transformers' cache",
    "reformer": "its axial position embeddings need factors that sum to the hidden size",
    "xmod": "needs a default language set on the model before any forward pass",
    "dbrx": "its nested attention config has no rope_theta in the shrunk form",
    **dict.fromkeys(("axk1", "longcat_flash", "youtu", "cohere_compass_text", "dory", "dots1", "inkling2_text",
                     "inkling2_loop_text", "lfm2_moe", "qwen4_exp", "qwen4_exp_text", "xlstm"), _DOES_NOT_BUILD),
}


@dataclasses.dataclass
class FamilyResult:
    """What `check_family` found for one family."""

    model_type: str
    status: str  # "exact", "refused", "differs", "error" (hf_spec failed), "unbuildable" (the tiny model itself)
    detail: str = ""  # the refusal, the error or the first difference
    acceptance: dict[str, float] = dataclasses.field(default_factory=dict)  # draft name -> acceptance rate

    @property
    def is_ok(self) -> bool:
        return self.status in ("exact", "refused")


def tiny_config(model_type: str) -> PretrainedConfig:
    """The family's default config, shrunk (`_SIZES`, `_OVERRIDES`), with one layer of each kind it mixes (at least
    two layers) and every sliding window `WINDOW` tokens.

    The config is made again with the small values as arguments, so that what it derives from them (Qwen's layer
    types from ``use_sliding_window``) follows; where the family refuses that, the values are set on its default.
    """
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    values = {name: value for name, value in {**_SIZES, **_OVERRIDES.get(model_type, {})}.items()
              if hasattr(default, name)}
    kinds = _layer_kinds(default)
    values.update({name: max(2, len(kinds)) for name in _LAYER_COUNTS if hasattr(default, name)})
    if len(kinds) > 1 and _is_settable(default, "layer_types"):
        values["layer_types"] = (kinds * 2)[: max(2, len(kinds))]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = config_class(**values)
    except Exception:  # noqa: BLE001 - a family that validates its arguments differently: set them one by one
        config = default
        for name, value in values.items():
            _try_set(config, name, value)
    text = config.get_text_config(decoder=True)
    if text is not config:  # a composite config: its text part too
        for name, value in _SIZES.items():
            if hasattr(text, name):
                _try_set(text, name, value)
    return config


def _layer_kinds(config: PretrainedConfig) -> list[str]:
    """The distinct layer kinds of the family's default layout, in order of first use."""
    layer_types = getattr(config, "layer_types", None) or []
    return list(dict.fromkeys(layer_types))


def _is_settable(config: PretrainedConfig, name: str) -> bool:
    attribute = getattr(type(config), name, None)
    return not isinstance(attribute, property) or attribute.fset is not None


def _try_set(config: PretrainedConfig, name: str, value) -> None:
    try:
        setattr(config, name, value)
    except (AttributeError, TypeError, ValueError):
        pass  # a derived attribute (a read-only property) or one the family validates: its default stays


def build_tiny(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random model of the family, float32, eval mode, with no EOS (every row generates `NEW_TOKENS`)."""
    config = tiny_config(model_type)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def near_copy(model: PreTrainedModel, noise: float = 0.05, seed: int = 1) -> PreTrainedModel:
    """The model plus Gaussian noise of ``noise`` times each weight tensor's own standard deviation."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.numel() > 1 and parameter.is_floating_point():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    return draft


def prompts(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` ``[2, 30]``: a ragged, left-padded batch of random ids (3 .. `VOCAB_SIZE` - 1)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros((len(PROMPT_LENGTHS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, width - length:] = torch.randint(3, VOCAB_SIZE, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def check_family(model_type: str, num_assistant_tokens: int = 4) -> FamilyResult:
    """Greedy speculative decoding of the family's tiny model against its own ``generate()``, in a ragged batch of two
    and for the first row alone, with a near-copy draft and another random model of the family."""
    ids, mask = prompts()
    try:
        target = build_tiny(model_type)
        references = {"batch": _generate(target, ids, mask), "row": _generate(target, ids[:1], mask[:1])}
        alone = rows_alone(target, ids, mask)
    except Exception as error:  # noqa: BLE001 - whatever stops the tiny model itself
        return FamilyResult(model_type, "unbuildable", f"{type(error).__name__}: {error}"[:300])
    result = FamilyResult(model_type, "exact")
    is_batch_consistent = not first_difference(target, alone, references["batch"], ids.shape[1])
    speculative(target)
    for draft_name, draft in (("near-copy", near_copy(target)), ("same family", build_tiny(model_type, seed=1))):
        for case, (case_ids, case_mask) in (("batch", (ids, mask)), ("row", (ids[:1], mask[:1]))):
            passes = _count_forward_passes(target)
            try:
                output = target.generate(case_ids, attention_mask=case_mask, assistant_model=draft,
                                         do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                                         num_assistant_tokens=num_assistant_tokens, return_dict_in_generate=True)
            except (ValueError, TypeError) as error:
                passes.remove()
                if passes.count == 0 and (model_type in str(error) or type(target).__name__ in str(error)):
                    return FamilyResult(model_type, "refused", str(error))
                return FamilyResult(model_type, "error", f"{type(error).__name__}: {error}"[:300])
            except Exception as error:  # noqa: BLE001 - a crash is a finding
                passes.remove()
                return FamilyResult(model_type, "error", f"{type(error).__name__}: {error}"[:300])
            passes.remove()
            difference = first_difference(target, references[case], output.sequences, case_ids.shape[1])
            if difference and case == "batch" and not is_batch_consistent:
                if not first_difference(target, alone, output.sequences, case_ids.shape[1]):
                    difference = ""
                    result.detail = ("transformers' batched generate() differs from the rows decoded alone here; "
                                     "hf_spec's batch equals the rows decoded alone")
            if difference:
                return FamilyResult(model_type, "differs", f"{draft_name}, {case}: {difference}")
            if case == "batch":
                result.acceptance[draft_name] = round(output.speculative_stats.acceptance_rate, 3)
    return result


def check_transformers_assisted(model_type: str) -> str:
    """What transformers' own assisted generation does with the family's tiny model and a near-copy draft, for the
    first row alone (it takes no batches): "equal" to target-only, "differs", or its error."""
    ids, mask = prompts()
    try:
        target = build_tiny(model_type)
        expected = _generate(target, ids[:1], mask[:1])
        with torch.no_grad():
            output = target.generate(ids[:1], attention_mask=mask[:1], assistant_model=near_copy(target),
                                     do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    except Exception as error:  # noqa: BLE001 - its error is the answer
        return f"error: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return "differs" if first_difference(target, expected, output, ids.shape[1]) else "equal"


def _generate(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)


def rows_alone(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch, width + new]``: each row decoded alone, without its padding, put back in the batch's layout."""
    rows = []
    for row in range(ids.shape[0]):
        start = int(mask[row].argmax())
        output = _generate(model, ids[row:row + 1, start:], mask[row:row + 1, start:])
        rows.append(torch.nn.functional.pad(output, (start, 0)))
    return torch.cat(rows)

def first_difference(target: PreTrainedModel, expected: torch.Tensor, actual: torch.Tensor,
                     prompt_length: int) -> str:
    """``""`` when ``actual`` equals ``expected`` ``[batch, prompt + new]`` up to ties; else where and how they
    differ, with the target's own margin between the two tokens there."""
    if actual.shape == expected.shape and torch.equal(actual, expected):
        return ""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} instead of {tuple(expected.shape)}"
    for row in range(expected.shape[0]):
        differs = (actual[row] != expected[row]).nonzero()
        if differs.numel() == 0:
            continue
        column = int(differs[0])
        prefix = expected[row, :column]
        prefix = prefix[(prefix != 0).cumsum(0) > 0]  # the row's own tokens: its left padding dropped
        with torch.no_grad():
            logits = target(prefix[None]).logits[0, -1].float()
        margin = float(logits[expected[row, column]] - logits[actual[row, column]])
        if abs(margin) > TIE_TOLERANCE:
            return (f"row {row} differs at new token {column - prompt_length}: {int(actual[row, column])} instead of "
                    f"{int(expected[row, column])}, whose logit leads by {margin:.4g}")
    return ""


class _count_forward_passes:  # used like a function
    """Counts the model's forward passes until `remove`."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def remove(self) -> None:
        self._handle.remove()
