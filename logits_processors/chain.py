"""Per-position application of a transformers logits-processor chain.

Every processor keeps the transformers contract ``__call__(input_ids [batch, len], scores [batch, vocab]) ->
scores [batch, vocab]``, so any transformers processor, or a user's own, drops in. The block version calls the chain
once per block position with that position's prefix: the exact order and inputs that target-only decoding uses.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList


def process_step(
    processors: LogitsProcessorList, prefix_ids: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Apply the chain to the next-token logits after ``prefix_ids``.

    Args:
        processors: the chain; may be empty.
        prefix_ids: ``[batch, len]`` every token before the predicted one (prompt and generated).
        logits: ``[batch, vocab]`` float32 raw logits.

    Returns:
        ``[batch, vocab]`` processed scores.
    """
    return processors(prefix_ids, logits) if len(processors) > 0 else logits


def process_block(
    processors: LogitsProcessorList, prefix_ids: torch.Tensor, block_ids: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Apply the chain to every position of a verification block.

    Args:
        processors: the chain; may be empty.
        prefix_ids: ``[batch, len]`` the tokens before the block.
        block_ids: ``[batch, k]`` the drafted tokens.
        logits: ``[batch, k + 1, vocab]`` float32 raw logits; position ``i`` predicts the token after
            ``prefix_ids + block_ids[:, :i]``.

    Returns:
        ``[batch, k + 1, vocab]`` processed scores, a new tensor.
    """
    k = block_ids.shape[1]
    assert logits.shape[1] == k + 1, (logits.shape, block_ids.shape)
    if len(processors) == 0:
        return logits.clone()
    sequence_ids = torch.cat([prefix_ids, block_ids], dim=1)  # [batch, len + k]
    num_prefix = prefix_ids.shape[1]
    return torch.stack(
        [processors(sequence_ids[:, : num_prefix + i], logits[:, i].clone()) for i in range(k + 1)], dim=1
    )
