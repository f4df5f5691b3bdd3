"""Checks at the public boundary of speculative `generate()`: each error names the argument and its value."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from hf_spec.checks import check_int, is_int_at_least
from hf_spec.drafting.base import Drafter
from hf_spec.drafting.draft_length import (
    DEFAULT_MAX_DRAFT_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    AutoDraftLength,
    FixedDraftLength,
)
from hf_spec.drafting.tree_size import AutoTreeSize, FixedTreeSize
from hf_spec.heads.model import DraftHead

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
    if value is None and isinstance(draft, PreTrainedModel):
        value = getattr(getattr(draft, "generation_config", None), "num_assistant_tokens", None)
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


def resolve_tree_size(num_tree_nodes: Any, num_assistant_tokens: Any,
                      prompt_lookup_num_tokens: int | None) -> FixedTreeSize | AutoTreeSize:
    """How each round's tree is sized: ``num_tree_nodes`` nodes at most (an integer), or ``"auto"`` (a new
    `AutoTreeSize`; an instance is used as is, keeping what it learnt). The depth limit is ``num_assistant_tokens``,
    else ``prompt_lookup_num_tokens``, else the node budget (``"auto"``: `DEFAULT_MAX_DRAFT_TOKENS`)."""
    if isinstance(num_tree_nodes, AutoTreeSize):
        return num_tree_nodes
    depth = num_assistant_tokens if is_int_at_least(num_assistant_tokens, 1) else prompt_lookup_num_tokens
    if num_tree_nodes == "auto":
        if num_assistant_tokens not in (None, "auto") and not is_int_at_least(num_assistant_tokens, 1):
            raise ValueError(f"`num_assistant_tokens` caps a tree's depth: a positive integer, 'auto' or unset, "
                             f"but is {num_assistant_tokens!r}.")
        return AutoTreeSize(max_depth=depth or DEFAULT_MAX_DRAFT_TOKENS)
    if num_assistant_tokens is not None and not is_int_at_least(num_assistant_tokens, 1):
        raise ValueError(
            f"`num_assistant_tokens` is {num_assistant_tokens!r}; with a fixed `num_tree_nodes` it caps the tree's "
            "depth and must be a positive integer. Pass `num_tree_nodes='auto'` to let the tree's size and depth "
            "follow measured acceptance and costs."
        )
    check_tree_nodes(num_tree_nodes)
    return FixedTreeSize(num_tree_nodes, depth or num_tree_nodes)


def check_tree_nodes(num_tree_nodes: Any) -> None:
    """``num_tree_nodes`` must be a positive integer, ``"auto"`` or an `AutoTreeSize`."""
    if not (is_int_at_least(num_tree_nodes, 1) or isinstance(num_tree_nodes, AutoTreeSize)
            or (isinstance(num_tree_nodes, str) and num_tree_nodes == "auto")):
        raise ValueError(f"`num_tree_nodes` (draft tokens per tree) must be a positive integer, 'auto' or an "
                         f"AutoTreeSize, but is {num_tree_nodes!r} ({type(num_tree_nodes).__name__}).")


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

    ``draft`` is ``None`` for prompt lookup alone, or a `hf_spec.drafting.Drafter` of your own. May set
    ``generation_config.do_sample = False`` when ``temperature == 0`` (documented: greedy decoding).
    """
    if draft is not None and not isinstance(draft, (PreTrainedModel, Drafter)):
        raise TypeError(f"`assistant_model` must be a transformers PreTrainedModel or an hf_spec Drafter, but is "
                        f"{type(draft).__name__}.")
    if isinstance(draft, Drafter):
        draft = None  # a drafter of your own: nothing model-shaped to check
    if isinstance(draft, DraftHead):
        draft.check_target(target)
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


def validate_input_types(input_ids: Any, attention_mask: Any) -> None:
    """``input_ids`` a ``[batch, length]`` integer tensor with at least one token; ``attention_mask`` a tensor of its
    shape. No host synchronization."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"`input_ids` must be a torch.Tensor of token ids (tokenize with return_tensors='pt'), but is "
                        f"{type(input_ids).__name__}.")
    if input_ids.dim() != 2:
        raise ValueError(f"`input_ids` must have shape [batch, length], but has shape {tuple(input_ids.shape)}; add "
                         "the batch dimension with input_ids.unsqueeze(0).")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"`input_ids` must hold integer token ids, but has dtype {input_ids.dtype}.")
    if input_ids.shape[1] == 0:
        raise ValueError(f"`input_ids` must hold at least one token per row, but has shape {tuple(input_ids.shape)}: "
                         "speculative decoding continues a prompt (start it with the BOS token if you have none).")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"`attention_mask` must be a torch.Tensor, but is {type(attention_mask).__name__}.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, but has "
                         f"{tuple(attention_mask.shape)}.")


def validate_input_values(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int) -> None:
    """Ids within the target's vocabulary; a mask of 0 and 1 with left padding only, a real token in every row.
    One host synchronization for all of it."""
    checks = [input_ids.min(), input_ids.max()]
    if attention_mask is not None:
        mask = attention_mask.long()
        checks += [((mask != 0) & (mask != 1)).any(), (mask[:, 1:] < mask[:, :-1]).any(), (mask.sum(dim=1) == 0).any()]
    low, high, *mask_flags = torch.stack([value.long() for value in checks]).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"`input_ids` holds ids from {low} to {high}, but the model's vocabulary has {vocab_size} ids "
                         f"(0 to {vocab_size - 1}).")
    is_not_binary, is_right_padded, has_empty_row = mask_flags or (False, False, False)
    if is_not_binary:
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (token).")
    if is_right_padded:
        raise ValueError(
            "`attention_mask` has padding after a token in some row (right padding). Speculative decoding continues "
            "every row from its last token, so rows must be left-padded: set `tokenizer.padding_side = 'left'` "
            "before tokenizing the batch. (Without an `attention_mask`, transformers makes one from `pad_token_id`: "
            "a pad id inside a prompt then looks like padding; pass the mask.)"
        )
    if has_empty_row:
        raise ValueError("`attention_mask` has a row with no token at all (every entry 0).")


def validate_generator(generator: torch.Generator | None, model: PreTrainedModel) -> None:
    """The ``generator`` must draw on the device the models compute on."""
    if generator is not None and generator.device.type != model.device.type:
        raise ValueError(f"`generator` draws on {generator.device}, but the model runs on {model.device}: create it "
                         f"there, e.g. torch.Generator({str(model.device)!r}).manual_seed(seed).")


def validate_draft_length_limit(draft: PreTrainedModel | None, max_length: int) -> None:
    """Refuse, before the first round, a draft whose learned position table is shorter than the longest sequence the
    call may reach (models with rotary or ALiBi positions have no such limit)."""
    if not isinstance(draft, PreTrainedModel):
        return
    table = _position_table(draft)
    if table is not None and max_length > table:
        raise ValueError(
            f"`assistant_model` has a table of {table} learned positions, but this call may reach {max_length} "
            "tokens (prompt + max_new_tokens); lower `max_new_tokens` or use a draft with a longer context."
        )


def _position_table(model: PreTrainedModel) -> int | None:
    """Positions a model's learned position embeddings hold (GPT-2's ``wpe``, OPT's ``embed_positions``...), or
    ``None`` when it has none."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES:
            return module.num_embeddings - getattr(module, "offset", 0)
    return None


_POSITION_TABLES = frozenset({"wpe", "embed_positions", "position_embeddings"})
