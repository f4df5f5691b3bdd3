"""Which processors have a vectorized block implementation, and how a user registers one.

A block implementation applies one processor to every position of a verification block at once::

    fn(processor, sequence_ids, prefix_lengths, scores) -> scores
        sequence_ids:   [batch, length]          each row's prefix followed by its k drafted tokens (then padding)
        prefix_lengths: [batch] int64            position i of row b follows sequence_ids[b, : prefix_lengths[b] + i]
        scores:         [batch, k + 1, vocab]    the scores so far (not modified)
        returns         [batch, k + 1, vocab]    what calling ``processor`` once per position would return

Rows may have different prefix lengths (a batch whose rows have accepted different numbers of tokens).

Lookup is by exact class: a subclass (which may override ``__call__``) takes the exact per-position loop until it is
registered itself. Processors with no implementation are never refused for that; they take the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessor

BlockFunction = Callable[[LogitsProcessor, torch.Tensor, int, torch.Tensor], torch.Tensor]
RowFunction = Callable[[LogitsProcessor, torch.Tensor], torch.Tensor]

_BLOCK_FUNCTIONS: dict[type, BlockFunction] = {}


def register_block_processor(processor_class: type, function: BlockFunction) -> None:
    """Use ``function`` for every processor whose class is exactly ``processor_class``.

    ``function`` must return exactly what the processor returns when called once per block position with that
    position's prefix; `tests/test_processor_equivalence.py` shows how to check it with hypothesis.
    """
    if not isinstance(processor_class, type):
        raise TypeError(f"processor_class must be a class, got {processor_class!r}")
    if not callable(function):
        raise TypeError(f"function must be callable, got {function!r}")
    _BLOCK_FUNCTIONS[processor_class] = function


def register_position_independent(processor_class: type, row_function: RowFunction | None = None) -> None:
    """Register a processor that never reads ``input_ids``: its output row depends on its input row only.

    The block is then processed as one batch of ``batch * (k + 1)`` rows, by ``row_function(processor, rows)`` when
    given (rows ``[n, vocab]`` -> ``[n, vocab]``) and by the processor's own ``__call__`` otherwise.
    """

    def block_function(processor, sequence_ids, prefix_lengths, scores):
        rows = scores.flatten(0, 1)  # [batch * (k + 1), vocab]
        if row_function is not None:
            return row_function(processor, rows).view_as(scores)
        # The processor never reads input_ids: an empty one of the right batch size, rather than a copy per row.
        return processor(sequence_ids.new_empty((rows.shape[0], 0)), rows).view_as(scores)

    register_block_processor(processor_class, block_function)


def block_function_for(processor: LogitsProcessor) -> BlockFunction | None:
    """The registered block implementation for ``processor``'s exact class, or ``None`` (per-position loop)."""
    return _BLOCK_FUNCTIONS.get(type(processor))


def has_block_implementation(processor: LogitsProcessor) -> bool:
    """Whether ``processor`` is applied to a whole block at once rather than position by position."""
    return block_function_for(processor) is not None
