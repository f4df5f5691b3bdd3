"""Checks at the public boundary of speculative `generate()`: each error names the argument and its value."""

from __future__ import annotations

import numbers
from typing import Any

from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from hf_spec.checks import check_int, is_int_at_least
from hf_spec.drafting.draft_length import (
    DEFAULT_MAX_DRAFT_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    AutoDraftLength,
    FixedDraftLength,
)

#: Model kwargs the speculative loop consumes; any other forward kwarg would be silently dropped, so it is refused.
SUPPORTED_MODEL_KWARGS = frozenset({"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep"})


def resolve_num_draft_tokens(
    call_value: Any, draft: PreTrainedModel | None, prompt_lookup_num_tokens: int | None = None
) -> FixedDraftLength | AutoDraftLength:
    """How k is chosen: ``num_assistant_tokens`` from the call, else from the draft's generation config, else
    ``prompt_lookup_num_tokens``, else the default (`DEFAULT_NUM_DRAFT_TOKENS`).

    ``"auto"`` makes a new `AutoDraftLength` (at most ``prompt_lookup_num_tokens`` tokens with prompt lookup); an
    `AutoDraftLength` instance is used as is, keeping what it learnt in earlier calls. transformers reads
    ``num_assistant_tokens`` only from the draft's config; here the call wins.
    """
    value = call_value
    if value is None and draft is not None:
        value = getattr(draft.generation_config, "num_assistant_tokens", None)
    if value is None:
        value = prompt_lookup_num_tokens
    if value is None:
        return FixedDraftLength(DEFAULT_NUM_DRAFT_TOKENS)
    if isinstance(value, AutoDraftLength):
        return value
    if value == "auto":
        return AutoDraftLength(max_draft_tokens=prompt_lookup_num_tokens or DEFAULT_MAX_DRAFT_TOKENS)
    if not is_int_at_least(value, 1):
        raise ValueError(
            f"`num_assistant_tokens` (the draft block length k) must be a positive integer, 'auto' or an "
            f"AutoDraftLength, but is {value!r} ({type(value).__name__})."
        )
    return FixedDraftLength(int(value))


def resolve_prompt_lookup(generation_config: GenerationConfig) -> tuple[int | None, int]:
    """``(prompt_lookup_num_tokens or None, max_matching_ngram_size)``, validated (transformers' default n-gram: 2)."""
    num_tokens = generation_config.prompt_lookup_num_tokens
    ngram = generation_config.max_matching_ngram_size
    if num_tokens is not None:
        check_int("prompt_lookup_num_tokens", num_tokens)
    return num_tokens, 2 if ngram is None else check_int("max_matching_ngram_size", ngram)


def validate_speculative_call(
    target: PreTrainedModel,
    draft: Any,
    generation_config: GenerationConfig,
    generation_mode_kwargs: dict[str, Any],
    num_assistant_tokens: Any,
) -> None:
    """Refuse what the speculative loop cannot do exactly, before any forward pass.

    ``draft`` is ``None`` for prompt lookup alone. May set ``generation_config.do_sample = False`` when
    ``temperature == 0`` (documented: greedy decoding).
    """
    if draft is not None and not isinstance(draft, PreTrainedModel):
        raise TypeError(f"`assistant_model` must be a transformers PreTrainedModel, but is {type(draft).__name__}.")
    prompt_lookup_num_tokens, _ = resolve_prompt_lookup(generation_config)
    resolve_num_draft_tokens(num_assistant_tokens, draft, prompt_lookup_num_tokens)
    for name, model in (("model", target), ("assistant_model", draft)):
        if model is not None and model.config.is_encoder_decoder:
            raise ValueError(
                f"hf_spec supports decoder-only models; `{name}` ({type(model).__name__}) is an encoder-decoder model."
            )
    if draft is not None and draft.device != target.device:
        raise ValueError(
            f"`assistant_model` is on {draft.device} but the model is on {target.device}; move the draft to the "
            f"target's (first) device, e.g. `assistant_model.to({str(target.device)!r})`."
        )
    base_mode = generation_config.get_generation_mode()
    # prompt lookup turns greedy and sampling into assisted generation, and only those
    if base_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.ASSISTED_GENERATION):
        raise ValueError(
            "Speculative decoding (`assistant_model` or `prompt_lookup_num_tokens`) supports greedy decoding and "
            f"sampling only, but the "
            f"generation settings select {base_mode.value!r} (num_beams={generation_config.num_beams}, "
            f"penalty_alpha={generation_config.penalty_alpha}, constraints={generation_config.constraints})."
        )
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError(
            "`num_return_sequences` must be 1 with `assistant_model`, but is "
            f"{generation_config.num_return_sequences}; repeat the prompt in the batch instead."
        )
    if generation_config.use_cache is False:
        raise ValueError("`use_cache=False` cannot be combined with `assistant_model`: speculation needs KV caches.")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(generation_config, flag):
            raise ValueError(f"`{flag}=True` is not supported with `assistant_model` (hf_spec returns scores/logits).")
    _validate_sampling_settings(generation_config)
    _validate_tokenizers(generation_mode_kwargs)


def _validate_sampling_settings(generation_config: GenerationConfig) -> None:
    temperature = generation_config.temperature
    if temperature is not None and (not isinstance(temperature, numbers.Real) or temperature < 0):
        raise ValueError(f"`temperature` must be a number >= 0, but is {temperature!r}.")
    if generation_config.do_sample and temperature == 0:
        # The limit of sampling as temperature -> 0 is greedy decoding; transformers would raise instead.
        generation_config.do_sample = False
    top_p = generation_config.top_p
    if generation_config.do_sample and top_p is not None and not (0 < top_p <= 1):
        raise ValueError(f"`top_p` must be in (0, 1], but is {top_p!r}.")


def _validate_tokenizers(generation_mode_kwargs: dict[str, Any]) -> None:
    tokenizer = generation_mode_kwargs.get("tokenizer")
    assistant_tokenizer = generation_mode_kwargs.get("assistant_tokenizer")
    if assistant_tokenizer is None:
        return
    if tokenizer is None:
        raise ValueError("`assistant_tokenizer` was given without `tokenizer`; pass both or neither.")
    check_same_vocabulary(tokenizer, assistant_tokenizer)


def check_same_vocabulary(tokenizer: Any, assistant_tokenizer: Any) -> None:
    """Refuse a draft tokenizer whose vocabulary differs from the target's."""
    if tokenizer.get_vocab() != assistant_tokenizer.get_vocab():
        raise ValueError(
            f"`assistant_tokenizer` ({type(assistant_tokenizer).__name__}, {len(assistant_tokenizer)} tokens) and "
            f"`tokenizer` ({type(tokenizer).__name__}, {len(tokenizer)} tokens) have different vocabularies; exact "
            "speculative decoding needs a draft that shares the target's tokenizer."
        )


def validate_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    """Refuse forward kwargs the speculative loop would not pass on (they would be silently ignored)."""
    unsupported = sorted(
        key for key, value in model_kwargs.items() if key not in SUPPORTED_MODEL_KWARGS and value is not None
    )
    if unsupported:
        raise ValueError(
            f"Model inputs {unsupported} are not supported with `assistant_model`; hf_spec feeds `input_ids`, "
            "`attention_mask` and positions only."
        )
