"""One forward pass over the tokens a model's cache lacks, shared by the target's verify pass and a draft model."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from hf_spec.caches import cache_length


def forward_missing(
    model: PreTrainedModel,
    cache,
    sequence_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    num_logits: int,
) -> torch.Tensor:
    """Feed ``model`` the tokens of ``sequence_ids`` its cache lacks; return the last ``num_logits`` logits.

    Args:
        sequence_ids: ``[batch, length]`` the whole sequence; the cache holds a prefix of it.
        attention_mask: ``[batch, length]`` or ``None`` (no padding).

    Returns:
        ``[batch, num_logits, vocab]`` float32 logits (a new tensor).
    """
    num_cached = cache_length(cache)
    assert num_cached + num_logits <= sequence_ids.shape[1], (num_cached, num_logits, sequence_ids.shape)
    if attention_mask is None:
        position_ids = torch.arange(num_cached, sequence_ids.shape[1], device=sequence_ids.device).unsqueeze(0)
    else:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min_(0)[:, num_cached:]
    inputs = {"input_ids": sequence_ids[:, num_cached:], "position_ids": position_ids, "cache": cache}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    if _supports_logits_to_keep(type(model)):
        inputs["logits_to_keep"] = num_logits
    logits = model(**inputs, use_cache=True).logits[:, -num_logits:]
    return logits.to(dtype=torch.float32, copy=True)


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
