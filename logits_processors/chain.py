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


def process_step(processors: LogitsProcessorList, prefix_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply the chain to the next-token logits after ``prefix_ids``.

    Args:
        processors: the chain; may be empty.
        prefix_ids: ``[batch, len]`` every token before the predicted one (prompt and generated).
        logits: ``[batch, vocab]`` float32 raw logits.

    Returns:
        ``[batch, vocab]`` processed scores.
    """
    return process_block(processors, prefix_ids, prefix_ids[:, :0], logits[:, None])[:, 0]


def process_block(
    processors: LogitsProcessorList, prefix_ids: torch.Tensor, block_ids: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Apply the chain to every position of a verification block.

    Args:
        processors: the chain; may be empty.
        prefix_ids: ``[batch, len]`` the tokens before the block.
        block_ids: ``[batch, k]`` the drafted tokens.
        logits: ``[batch, k + 1, vocab]`` float32 raw logits; position ``i`` predicts the token after
            ``prefix_ids + block_ids[:, :i]``. Not modified.

    Returns:
        ``[batch, k + 1, vocab]`` processed scores, a new tensor.
    """
    assert logits.shape[1] == block_ids.shape[1] + 1, (logits.shape, block_ids.shape)
    sequence_ids = torch.cat([prefix_ids, block_ids], dim=1)  # [batch, len + k]
    num_prefix = prefix_ids.shape[1]
    scores = logits
    for processor in processors:
        block_function = block_function_for(processor)
        if block_function is None:
            scores = _per_position(processor, sequence_ids, num_prefix, scores)
        else:
            scores = block_function(processor, sequence_ids, num_prefix, scores)
    return logits.clone() if scores is logits else scores


def _per_position(
    processor: LogitsProcessor, sequence_ids: torch.Tensor, num_prefix: int, scores: torch.Tensor
) -> torch.Tensor:
    """The exact fallback: one call per position ``i`` with ``sequence_ids[:, : num_prefix + i]``, in order."""
    return torch.stack(
        [processor(sequence_ids[:, : num_prefix + i], scores[:, i].clone()) for i in range(scores.shape[1])], dim=1
    )
