"""The private attributes of transformers' processors that the block implementations read, in one place.

`logits_processors` is importable without `hf_spec`, so it keeps its own uses here; `hf_spec.compat` re-exports
them beside hf_spec's, and ``tests/test_compat.py`` checks each against the pinned transformers.
"""

from __future__ import annotations

import torch


def prepare_sequence_bias(processor, scores: torch.Tensor) -> None:
    """Build a `SequenceBiasLogitsProcessor`'s (or `NoBadWordsLogitsProcessor`'s) bias tensors with transformers'
    own checks, once: ``processor._prepare_bias_variables(scores)``."""
    if not processor.prepared_bias_variables:
        processor._prepare_bias_variables(scores)


def num_beams(processor) -> int:
    """The beam count a `PrefixConstrainedLogitsProcessor` was built for: ``processor._num_beams``."""
    return processor._num_beams


def prefix_allowed_tokens(processor, batch_id: int, prefix_ids: torch.Tensor) -> list[int]:
    """What a `PrefixConstrainedLogitsProcessor`'s user function allows after ``prefix_ids`` ``[len]``:
    ``processor._prefix_allowed_tokens_fn(batch_id, prefix_ids)``."""
    return processor._prefix_allowed_tokens_fn(batch_id, prefix_ids)


def encoder_ngram_bans(processor, row: int, prefix_ids: torch.Tensor) -> list[int]:
    """What an `EncoderNoRepeatNGramLogitsProcessor` bans after row ``row``'s ``prefix_ids`` ``[len]`` (without
    beams): ``_get_generated_ngrams(processor.generated_ngrams[row], ...)`` of transformers' logits_process."""
    from transformers.generation.logits_process import _get_generated_ngrams

    length = prefix_ids.shape[0]
    return _get_generated_ngrams(processor.generated_ngrams[row], prefix_ids, processor.ngram_size, length)
