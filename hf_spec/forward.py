"""The two forward passes of the loop: over the tokens a model's cache lacks (the target's verify pass over a chain, a
draft model's steps), and over a tree of draft tokens under a tree attention mask. Either can also return the hidden
states a draft head reads (``feature_layers``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hf_spec.caches import (
    ColumnRules,
    attached_inputs,
    attends,
    cache_length,
    column_rules,
    crop_to,
    static_length,
)
from hf_spec.compat import attention_implementation
from hf_spec.compiled import active_forward, pad_inputs, padded_width, run_post_hooks, run_pre_hooks, strip_padding
from hf_spec.conditioning import POSITION_OFFSETS, prompt_pass_inputs, with_position_axes
from hf_spec.profiling import timed_forward


def forward_missing(
    model: PreTrainedModel,
    cache,
    sequence_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    num_logits: int,
    feature_layers: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed ``model`` the tokens of ``sequence_ids`` its cache lacks; return the last ``num_logits`` logits.

    Args:
        sequence_ids: ``[batch, length]`` the whole sequence; the cache holds a prefix of it.
        attention_mask: ``[batch, length]`` or ``None`` (no padding).
        feature_layers: hidden states to return as well (indices into transformers' ``output_hidden_states`` tuple;
            only those are kept), for a draft head; ``None``: none.

    Returns:
        ``[batch, num_logits, vocab]`` float32 logits (a new tensor), and the ``feature_layers`` hidden states at every
        token fed, concatenated, ``[batch, fed, hidden * len(feature_layers)]`` in the model's dtype (``None`` without
        ``feature_layers``).
    """
    inputs = _missing_inputs(model, cache, sequence_ids, attention_mask, num_logits)
    return _run(model, inputs, num_logits, feature_layers)


def _run(model: PreTrainedModel, inputs: dict, num_logits: int,
         feature_layers: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass: ``(logits [batch, num_logits, vocab] float32, features [batch, fed, F] or None)``."""
    num_fed = inputs[input_names(type(model)).ids].shape[1]
    extra = {} if feature_layers is None else {"output_hidden_states": list(feature_layers)}
    with timed_forward(model, num_fed):  # counted only in a profiled call
        compiled, width = active_forward(model), padded_width(num_fed)  # a static cache's chain pass: compiled
        mask = inputs.get("attention_mask")
        cached = cache_length(inputs["cache"]) if compiled is not None else 0
        if (compiled is not None and width is not None and (mask is None or mask.dim() == 2)  # not a tree's pass
                and cached + width <= (static_length(inputs["cache"]) or 0)):  # a static cache the padding fits in
            run_pre_hooks(model, inputs)
            output = None
            try:
                output = compiled(**pad_inputs(inputs, width), use_cache=True, **extra)
            finally:
                run_post_hooks(model, inputs, output)
            crop_to(inputs["cache"], cached + num_fed)  # the padding's positions: written, then cut off
            logits, hidden = strip_padding(output.logits, getattr(output, "hidden_states", None), num_fed)
        else:
            output = model(**inputs, use_cache=True, **extra)
            logits, hidden = output.logits, getattr(output, "hidden_states", None)
    features = None if feature_layers is None else torch.cat([hidden[i] for i in feature_layers], dim=-1)
    return logits[:, -num_logits:].to(dtype=torch.float32, copy=True), features  # features: [batch, fed, F]


def _missing_inputs(model: PreTrainedModel, cache, sequence_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    num_logits: int) -> dict:
    """The keyword arguments of a forward pass over the tokens the cache lacks (positions from the mask)."""
    num_cached = cache_length(cache)
    assert num_cached + num_logits <= sequence_ids.shape[1], (num_cached, num_logits, sequence_ids.shape)
    if attention_mask is None:
        position_ids = torch.arange(num_cached, sequence_ids.shape[1], device=sequence_ids.device).unsqueeze(0)
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min_(0)[:, num_cached:]
    names, attached = input_names(type(model)), dict(attached_inputs(cache))
    offsets = attached.pop(POSITION_OFFSETS, None)
    inputs = {**attached, names.ids: sequence_ids[:, num_cached:], "cache": cache}
    if names.positions is not None:  # a model without them places tokens by cache position (no holes then)
        inputs[names.positions] = with_position_axes(position_ids, offsets)
    length = static_length(cache)
    if length is not None:  # a static cache attends over all its positions: the mask has as many, 0 past the fed
        mask = torch.ones_like(sequence_ids) if attention_mask is None else attention_mask
        inputs[names.mask] = F.pad(mask, (0, length - mask.shape[1]))
    elif attention_mask is not None:
        inputs[names.mask] = attention_mask if attends(cache) else attention_mask[:, num_cached:]
    if _supports_logits_to_keep(type(model)):
        inputs["logits_to_keep"] = num_logits
    return inputs


#: Config attributes naming the placeholder ids a vision-language prompt holds where its images go.
PLACEHOLDER_IDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id")


@torch.no_grad()
def prefill(model: PreTrainedModel, cache, sequence_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            prompt_inputs: dict) -> None:
    """Feed the prompt but its last token, with what only the prompt's pass reads (``prompt_inputs``: a
    vision-language model's pixel values...), into an empty ``cache``: later passes read the images' keys and
    values from it. Nothing to do without ``prompt_inputs``.

    Args:
        sequence_ids: ``[batch, prompt]``; no row may end in an image placeholder (that token is fed again later,
            without its image).
    """
    if not prompt_inputs:
        return
    placeholders = {getattr(model.config, name, None) for name in PLACEHOLDER_IDS} - {None}
    if cache_length(cache) > 0 or sequence_ids.shape[1] < 2:
        raise ValueError(f"Image inputs ({', '.join(sorted(prompt_inputs))}) need a prompt of at least 2 tokens and "
                         "no `cache=` holding part of it: they are read in the prompt's own pass.")
    placeholder_ids = torch.tensor(sorted(placeholders), dtype=torch.long, device=sequence_ids.device)
    if placeholders and bool(torch.isin(sequence_ids[:, -1], placeholder_ids).any()):
        raise ValueError(f"A prompt of `input_ids` ends in an image placeholder ({sorted(placeholders)}); end it with "
                         "text (the chat template's generation prompt does).")
    mask = None if attention_mask is None else attention_mask[:, :-1]
    inputs = _missing_inputs(model, cache, sequence_ids[:, :-1], mask, num_logits=1)
    model(**{**inputs, **prompt_pass_inputs(prompt_inputs)}, use_cache=True)


def forward_tree(
    model: PreTrainedModel,
    cache,
    sequence_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    node_ids: torch.Tensor,
    node_depths: torch.Tensor,
    node_visible: torch.Tensor,
    num_logits: int,
    feature_layers: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed ``model`` the committed tokens its cache lacks, then tree nodes; return the last ``num_logits`` logits.

    The cache holds a prefix of ``sequence_ids``, or all of it followed by nodes fed in earlier passes (never both
    missing tokens and earlier nodes). A node sees every real committed token and the nodes ``node_visible`` marks
    (its ancestors and itself), at position ``last committed position + depth``: exactly the keys and values the
    node would get as the next token of its own path, so a path's cached entries can be kept as they are.

    Args:
        sequence_ids: ``[1, length]`` the committed sequence.
        attention_mask: ``[1, length]`` or ``None`` (no padding).
        node_ids: ``[m]`` the nodes to feed now.
        node_depths: ``[m]`` int64, their depths (1 for the root's children).
        node_visible: ``[m, fed + m]`` bool, over the nodes already in the cache (in the order fed) and these.
        feature_layers: as in `forward_missing`; a node's hidden states are the ones it would have as the next token
            of its own path.

    Returns:
        ``[num_logits, vocab]`` float32 logits, the last of those after each missing committed token, then after
        each node; and the features of every token fed (the missing committed ones, then the nodes),
        ``[missing + m, F]`` (``None`` without ``feature_layers``).
    """
    inputs = _tree_inputs(model, cache, sequence_ids, attention_mask, node_ids, node_depths, node_visible, num_logits)
    logits, features = _run(model, inputs, num_logits, feature_layers)
    return logits[0], None if features is None else features[0]


def _tree_inputs(model: PreTrainedModel, cache, sequence_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 node_ids: torch.Tensor, node_depths: torch.Tensor, node_visible: torch.Tensor,
                 num_logits: int) -> dict:
    """The keyword arguments of `forward_tree`'s pass: ids, positions by depth and the 4D tree mask."""
    device = sequence_ids.device
    length = sequence_ids.shape[1]
    num_cached = cache_length(cache)
    missing_ids = sequence_ids[0, min(num_cached, length):]  # [missing]
    num_fed, num_missing = max(0, num_cached - length), missing_ids.shape[0]
    if num_fed and num_missing:
        raise RuntimeError(f"cache holds {num_cached} positions: tree nodes and missing committed tokens at once")
    is_real = (torch.ones(length, dtype=torch.bool, device=device) if attention_mask is None
               else attention_mask[0].bool())  # [length]
    num_new = num_missing + node_ids.shape[0]
    visible = torch.zeros((num_new, length + num_fed + node_ids.shape[0]), dtype=torch.bool, device=device)
    # a padding position sees itself: a query that sees nothing gives NaN in some attention kernels
    causal = torch.ones((length, length), dtype=torch.bool, device=device).tril_() & is_real  # [length, length]
    causal |= torch.eye(length, dtype=torch.bool, device=device)
    visible[:num_missing, :length] = causal[length - num_missing:]
    visible[num_missing:, :length] = is_real
    visible[num_missing:, length:] = node_visible
    if static_length(cache) is not None:  # a static cache's keys: all its positions
        visible = F.pad(visible, (0, static_length(cache) - visible.shape[1]))
    positions = is_real.long().cumsum(0) - 1  # [length]
    position_ids = torch.cat([positions[length - num_missing:], positions[-1] + node_depths])  # [missing + m]
    names = input_names(type(model))  # positions: a model without them is refused with trees before any pass
    attached = dict(attached_inputs(cache))
    offsets = attached.pop(POSITION_OFFSETS, None)
    inputs = {**attached, names.ids: torch.cat([missing_ids, node_ids])[None],
              names.positions: with_position_axes(position_ids[None], offsets),
              names.mask: tree_attention_mask(model, visible), "cache": cache}
    if _supports_logits_to_keep(type(model)):
        inputs["logits_to_keep"] = num_logits
    return inputs


def tree_attention_mask(model: PreTrainedModel, visible: torch.Tensor) -> torch.Tensor:
    """``visible`` ``[queries, keys]`` (or ``[batch, queries, keys]``) bool as ``[1 or batch, 1, queries, keys]``, in
    the form the model's attention takes a custom mask: boolean (sdpa, flex) or additive (eager); flash attention
    cannot take one."""
    implementation = attention_implementation(model)
    if "flash" in implementation:
        raise ValueError(f"Tree verification needs a custom attention mask, which attn_implementation="
                         f"{implementation!r} cannot take; load the model with attn_implementation='sdpa'.")
    if implementation == "eager":
        additive = torch.zeros(visible.shape, dtype=model.dtype, device=visible.device).masked_fill_(
            ~visible, torch.finfo(model.dtype).min)
        return additive[None, None] if visible.dim() == 2 else additive[:, None]
    return visible[None, None] if visible.dim() == 2 else visible[:, None]


def model_column_rules(model: PreTrainedModel, cache) -> ColumnRules:
    """What a model and its cache ask of a batch's columns (`hf_spec.caches.ColumnRules`): its cache's windows and
    recurrent states, and no holes where the model reads a token's cache position rather than its position id: a
    forward that takes no position ids (BART-family decoders, MPT's ALiBi), and chunked attention (Llama 4), whose
    chunks are runs of cache positions; a hole would shift every later token there."""
    config = model.config.get_text_config(decoder=True)
    is_chunked = ("chunked_attention" in (getattr(config, "layer_types", None) or ())
                  or getattr(config, "attention_chunk_size", None) is not None)
    takes_positions = input_names(type(model)).positions is not None
    return column_rules(cache) | ColumnRules(allows_holes=takes_positions and not is_chunked)


@dataclasses.dataclass(frozen=True)
class InputNames:
    """What a model's forward calls the decoder's tokens, their attention mask and their positions (``None``: it
    takes none): ``input_ids``..., or an encoder-decoder's ``decoder_input_ids``..."""

    ids: str
    mask: str
    positions: str | None


@functools.cache
def input_names(model_class: type) -> InputNames:
    """The `InputNames` of ``model_class``'s forward."""
    parameters = inspect.signature(model_class.forward).parameters
    prefix = "decoder_" if "decoder_input_ids" in parameters else ""
    positions = f"{prefix}position_ids"
    return InputNames(f"{prefix}input_ids", f"{prefix}attention_mask", positions if positions in parameters else None)


@functools.cache
def _supports_logits_to_keep(model_class: type) -> bool:
    """Whether ``forward`` takes ``logits_to_keep`` (transformers inspects the signature on every call)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def extend_mask(attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
    """``[batch, length + num_new]``: the mask with ``num_new`` real (1) positions appended."""
    if attention_mask is None or num_new == 0:
        return attention_mask
    return F.pad(attention_mask, (0, num_new), value=1)


def has_invalid_values(scores: torch.Tensor) -> torch.Tensor:
    """0-dim bool: any NaN or +inf, or a row with every value -inf (nothing left to sample).

    One pass over the vocabulary: a row's maximum is NaN if the row holds a NaN, +inf if it holds +inf, and -inf only
    if every value is -inf; it is finite exactly when the row is usable.
    """
    return ~torch.isfinite(scores.amax(dim=-1)).all()


def position_table(model: torch.nn.Module) -> int | None:
    """Positions a model's learned position embeddings hold (GPT-2's ``wpe``, OPT's ``embed_positions``...), or
    ``None`` when it has none (rotary or ALiBi positions). An encoder-decoder's: its decoder's (the encoder's table
    holds the source's positions, which a decoding call never adds to)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        model = model.get_decoder()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES:
            return module.num_embeddings - getattr(module, "offset", 0)
    return None


_POSITION_TABLES = frozenset({"wpe", "embed_positions", "position_embeddings"})
