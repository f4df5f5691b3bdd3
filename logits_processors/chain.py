"""Applying a transformers logits-processor chain to one drafting step or to a whole verification block.

Every processor keeps the transformers contract ``__call__(input_ids [batch, len], scores [batch, vocab]) ->
scores [batch, vocab]``, so any transformers processor, or a user's own, drops in. Processors are applied in chain
order; each one runs on the whole block at once when it has a registered block implementation
(`logits_processors.registry`) and otherwise once per block position, with that position's prefix: exactly the
calls target-only decoding makes. Drafting steps go through the same code (a block of one position), so draft and
target see identical transforms.

Processors must be pure functions of ``(input_ids, scores)``: the chain is also called on drafted positions that
are later rejected. The two transformers processors that keep state between calls are refused.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from logits_processors.registry import block_function_for

_STATEFUL_PROCESSORS = {
    UnbatchedClassifierFreeGuidanceLogitsProcessor: "guidance_scale (it keeps its own cache of the unguided model)",
    SynthIDTextWatermarkLogitsProcessor: "SynthID watermarking (it keeps a context of the tokens it has seen)",
}


def check_processors(processors: LogitsProcessorList) -> None:
    """Raise ``ValueError`` for processors that keep state between calls (they would see rejected drafts)."""
    for processor in processors:
        for stateful_class, what in _STATEFUL_PROCESSORS.items():
            if isinstance(processor, stateful_class):
                raise ValueError(  # noqa: TRY004 (a supported type, an unsupported use)
                    f"{type(processor).__name__} cannot be used with speculative decoding: {what}, and speculative "
                    "decoding also calls the chain on drafted tokens that are later rejected."
                )


def process_step(
    processors: LogitsProcessorList,
    prefix_ids: torch.Tensor,
    logits: torch.Tensor,
    prefix_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply the chain to the next-token logits after ``prefix_ids``.

    Args:
        processors: the chain; may be empty.
        prefix_ids: ``[batch, len]`` every token before the predicted one (prompt and generated).
        logits: ``[batch, vocab]`` float32 raw logits.
        prefix_lengths: ``[batch]`` int64, when rows have different lengths: row b's prefix is
            ``prefix_ids[b, : prefix_lengths[b]]`` (anything after it is padding). ``None``: every row is ``len``.

    Returns:
        ``[batch, vocab]`` processed scores.
    """
    return process_block(processors, prefix_ids, prefix_ids[:, :0], logits[:, None], prefix_lengths)[:, 0]


def process_block(
    processors: LogitsProcessorList,
    prefix_ids: torch.Tensor,
    block_ids: torch.Tensor,
    logits: torch.Tensor,
    prefix_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply the chain to every position of a verification block.

    Args:
        processors: the chain; may be empty.
        prefix_ids: ``[batch, len]`` the tokens before the block.
        block_ids: ``[batch, k]`` the drafted tokens.
        logits: ``[batch, k + 1, vocab]`` float32 raw logits; position ``i`` of row b predicts the token after
            ``prefix_ids[b, : prefix_lengths[b]] + block_ids[b, :i]``. Not modified.
        prefix_lengths: ``[batch]`` int64 for rows of different lengths (as in :func:`process_step`), or ``None``.

    Returns:
        ``[batch, k + 1, vocab]`` processed scores, a new tensor.
    """
    if block_ids.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != (block_ids.shape[0], block_ids.shape[1] + 1):
        raise ValueError(f"`logits` must have shape [batch, k + 1, vocab] for `block_ids` of shape [batch, k] = "
                         f"{tuple(block_ids.shape)}, but has shape {tuple(logits.shape)}.")
    batch_size = block_ids.shape[0]
    if prefix_lengths is None:
        sequence_ids = torch.cat([prefix_ids, block_ids], dim=1)  # [batch, len + k]
        prefix_lengths = torch.full((batch_size,), prefix_ids.shape[1], device=prefix_ids.device)
    else:
        sequence_ids = _append_per_row(prefix_ids, prefix_lengths, block_ids)  # [batch, len + k]
    scores = logits
    for processor in processors:
        block_function = block_function_for(processor)
        if block_function is None:
            scores = _per_position(processor, sequence_ids, prefix_lengths, scores)
        else:
            scores = block_function(processor, sequence_ids, prefix_lengths, scores)
    return logits.clone() if scores is logits else scores


def _append_per_row(prefix_ids: torch.Tensor, prefix_lengths: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, len + k]``: row b is ``prefix_ids[b, : prefix_lengths[b]]``, then ``block_ids[b]``, then padding."""
    k = block_ids.shape[1]
    sequence_ids = torch.nn.functional.pad(prefix_ids, (0, k))
    columns = prefix_lengths[:, None] + torch.arange(k, device=prefix_ids.device)  # [batch, k]
    return sequence_ids.scatter_(1, columns, block_ids)


def rows_by_length(lengths: list[int]) -> dict[int, list[int]]:
    """Row indices grouped by length, rows in their original order within a group."""
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        groups.setdefault(length, []).append(row)
    return groups


def _per_position(
    processor: LogitsProcessor, sequence_ids: torch.Tensor, prefix_lengths: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """The exact fallback: one call per position ``i`` with each row's prefix, in position order.

    Rows of equal length share a call (the whole batch when all rows have the same length, as in target-only
    decoding); rows of different lengths are called in groups, since one ``input_ids`` tensor holds one length.
    """
    processed = []
    position_lengths = prefix_lengths[:, None] + torch.arange(scores.shape[1], device=scores.device)  # [batch, k + 1]
    for i, lengths in enumerate(position_lengths.T.tolist()):
        groups = rows_by_length(lengths)
        if len(groups) == 1:
            processed.append(processor(sequence_ids[:, : lengths[0]], scores[:, i].clone()))
            continue
        position_scores = torch.empty_like(scores[:, i])
        for length, rows in groups.items():
            index = torch.tensor(rows, device=scores.device)
            position_scores[index] = processor(sequence_ids[index, :length], scores[index, i].clone())
        processed.append(position_scores)
    return torch.stack(processed, dim=1)
