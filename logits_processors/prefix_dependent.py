"""Block implementations of the processors that read the prefix: its tokens or its length.

Position ``i`` of row ``b`` follows ``sequence_ids[b, : prefix_lengths[b] + i]``, so its length is
``prefix_lengths[b] + i`` and the tokens it may see are those at positions below that length. Each function
computes, once for the whole sequence,
when each token or n-gram first appears, and compares that with every position's length: one pass instead of
``k + 1`` calls. Values are computed by the same float operations as transformers' own ``__call__``.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
)

from logits_processors.compat import encoder_ngram_bans, num_beams, prefix_allowed_tokens, prepare_sequence_bias
from logits_processors.registry import register_block_processor


def position_lengths(prefix_lengths: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``[batch, k + 1]``: the length of the prefix each block position follows."""
    return prefix_lengths[:, None] + torch.arange(scores.shape[1], device=scores.device)


def _vocab_mask(token_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``[vocab]`` bool: which ids are in ``token_ids``."""
    return torch.isin(torch.arange(scores.shape[-1], device=scores.device), token_ids.to(scores.device))


def _mask_where_active(scores: torch.Tensor, is_active: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Set ``token_mask`` ``[vocab]`` tokens to -inf at the positions where ``is_active`` ``[batch, k + 1]``."""
    return torch.where(is_active[..., None] & token_mask, float("-inf"), scores)


def min_length_block(processor, sequence_ids, prefix_lengths, scores):
    is_active = position_lengths(prefix_lengths, scores) < processor.min_length
    return _mask_where_active(scores, is_active, _vocab_mask(processor.eos_token_id, scores))


def min_new_tokens_block(processor, sequence_ids, prefix_lengths, scores):
    num_new = position_lengths(prefix_lengths, scores) - processor.prompt_length_to_skip
    return _mask_where_active(scores, num_new < processor.min_new_tokens, _vocab_mask(processor.eos_token_id, scores))


def suppress_at_begin_block(processor, sequence_ids, prefix_lengths, scores):
    is_active = position_lengths(prefix_lengths, scores) == processor.begin_index
    return _mask_where_active(scores, is_active, _vocab_mask(processor.begin_suppress_tokens, scores))


def forced_eos_block(processor, sequence_ids, prefix_lengths, scores):
    is_active = position_lengths(prefix_lengths, scores) == processor.max_length - 1  # [batch, k + 1]
    forced = torch.full_like(scores[:, :1], float("-inf"))
    forced[..., processor.eos_token_id] = 0
    return torch.where(is_active[..., None], forced, scores)


def _visible_ids(sequence_ids: torch.Tensor, lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[batch, k + 1, length]``: each position's prefix ids, with ``vocab_size`` (a spare column) past its end."""
    positions = torch.arange(sequence_ids.shape[1], device=sequence_ids.device)
    is_visible = positions < lengths[..., None]  # [batch, k + 1, length]
    return torch.where(is_visible, sequence_ids[:, None, :], vocab_size)


def _with_spare_column(scores: torch.Tensor) -> torch.Tensor:
    """``[batch, k + 1, vocab + 1]``: a copy of the scores with one spare column for ids that change nothing."""
    return torch.nn.functional.pad(scores, (0, 1))


def repetition_penalty_block(processor, sequence_ids, prefix_lengths, scores):
    """Penalize, at each position, the tokens that occur in its prefix (after ``prompt_ignore_length``).

    Only the prefix's own ids are gathered and scattered back, as transformers does, rather than a vocab-wide mask.
    """
    batch_size, _, vocab_size = scores.shape
    positions = torch.arange(sequence_ids.shape[1], device=sequence_ids.device)
    # Ids the scores have no column for (embedding rows past the LM head) go to the spare column, as in transformers.
    ids = sequence_ids.clamp(max=vocab_size)  # [batch, length]
    ignore = processor.prompt_ignore_length
    if isinstance(ignore, torch.Tensor):
        if ignore.shape[0] != batch_size:
            raise ValueError(f"prompt_ignore_length has {ignore.shape[0]} rows but the batch has {batch_size}")
        ids = ids.masked_fill(positions[None, :] < ignore.to(ids.device)[:, None], vocab_size)
    elif isinstance(ignore, int):
        ids = ids.masked_fill(positions[None, :] < ignore, vocab_size)
    index = _visible_ids(ids, position_lengths(prefix_lengths, scores), vocab_size)  # [batch, k + 1, length]
    padded = _with_spare_column(scores)
    picked = padded.gather(-1, index)
    picked = torch.where(picked < 0, picked * processor.penalty, picked / processor.penalty)
    return padded.scatter_(-1, index, picked)[..., :vocab_size]


def _tails(sequence_ids: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    """``[batch, k + 1, size]``: the last ``size`` tokens before each length ``[batch, k + 1]`` (index clamped at 0
    where the prefix is too short)."""
    offsets = torch.arange(-size, 0, device=sequence_ids.device)
    index = (lengths[..., None] + offsets).clamp_min(0)  # [batch, k + 1, size]
    return sequence_ids.gather(1, index.flatten(1)).view(index.shape)


def no_repeat_ngram_block(processor, sequence_ids, prefix_lengths, scores):
    """Ban, at each position, the tokens that would repeat an n-gram lying wholly inside its prefix."""
    n = processor.ngram_size
    vocab_size = scores.shape[-1]
    if sequence_ids.shape[1] < n:
        return scores
    lengths = position_lengths(prefix_lengths, scores)  # [batch, k + 1]
    windows = sequence_ids.unfold(dimension=1, size=n, step=1)  # [batch, W, n]: window w is tokens w .. w + n - 1
    contexts = _tails(sequence_ids, lengths, n - 1)  # [batch, k + 1, n - 1]
    is_match = (windows[:, None, :, :-1] == contexts[:, :, None, :]).all(dim=-1)  # [batch, k + 1, W]
    window_ends = torch.arange(windows.shape[1], device=scores.device) + n  # [W]
    is_match &= window_ends <= lengths[..., None]  # only n-grams inside the position's prefix
    banned_ids = torch.where(is_match, windows[:, None, :, -1].clamp(max=vocab_size), vocab_size)
    return _with_spare_column(scores).scatter_(-1, banned_ids, float("-inf"))[..., :vocab_size]


def sequence_bias_block(processor, sequence_ids, prefix_lengths, scores):
    """Add each sequence's bias to its last token at the positions whose prefix ends with the rest of it."""
    prepare_sequence_bias(processor, scores[:, 0])  # transformers' own checks and tensors
    lengths = position_lengths(prefix_lengths, scores)
    bias = torch.zeros_like(scores)
    bias += processor.length_1_bias
    for prefixes, last_tokens, sequence_biases in processor.multi_token_biases:  # [G, m], [G], [G]
        prefix_length = prefixes.shape[1]
        tails = _tails(sequence_ids, lengths, prefix_length)  # [batch, k + 1, m]
        is_match = (tails[:, :, None, :] == prefixes).all(dim=-1)  # [batch, k + 1, G]
        is_match &= (lengths >= prefix_length)[..., None]
        bias.index_add_(2, last_tokens, torch.where(is_match, sequence_biases, 0.0).to(bias.dtype))
    return scores + bias


def prefix_constrained_block(processor, sequence_ids, prefix_lengths, scores):
    """``prefix_allowed_tokens_fn(batch_id, prefix)`` for every row and position, with each row's own batch id."""
    if num_beams(processor) != 1:
        raise ValueError(f"`prefix_allowed_tokens_fn` was set up for {num_beams(processor)} beams; speculative "
                         "decoding runs without beams (num_beams=1).")
    mask = torch.full_like(scores, float("-inf"))  # [batch, k + 1, vocab]
    for batch_id, lengths in enumerate(position_lengths(prefix_lengths, scores).tolist()):
        for position, length in enumerate(lengths):
            allowed = prefix_allowed_tokens(processor, batch_id, sequence_ids[batch_id, :length])
            if len(allowed) == 0:
                raise ValueError(
                    f"`prefix_allowed_tokens_fn` returned an empty list for batch ID {batch_id}. This means that the "
                    "constraint is unsatisfiable. Please check your implementation of `prefix_allowed_tokens_fn`."
                )
            mask[batch_id, position, allowed] = 0
    processed = scores + mask
    # As transformers: where every allowed token already scores -inf, the allowed tokens get 0.
    return torch.where(processed.amax(dim=-1, keepdim=True).isneginf(), mask, processed)


def _rows_of(state: torch.Tensor, batch_size: int, name: str) -> torch.Tensor:
    """A processor's per-row ``state`` ``[rows, ...]`` for a batch of ``batch_size`` rows (transformers repeats each
    row for its beams; without beams the rows are the batch's)."""
    if state.shape[0] == batch_size:
        return state
    if batch_size % state.shape[0]:
        raise ValueError(f"{name} holds {state.shape[0]} rows, but the batch has {batch_size}.")
    return state.repeat_interleave(batch_size // state.shape[0], dim=0)


def encoder_repetition_penalty_block(processor, sequence_ids, prefix_lengths, scores):
    """Penalize, at every position of row b, the ids of row b's encoder input (the prompt, for a decoder-only model):
    transformers' gather and scatter, each row with its own ids, whichever rows share the call."""
    ids = _rows_of(processor.encoder_input_ids.to(scores.device), scores.shape[0], "`encoder_repetition_penalty`")
    index = ids[:, None, :].expand(-1, scores.shape[1], -1)  # [batch, k + 1, encoder length]
    picked = scores.gather(-1, index)
    picked = torch.where(picked < 0, picked * processor.penalty, picked / processor.penalty)
    return scores.scatter(-1, index, picked)


def encoder_no_repeat_ngram_block(processor, sequence_ids, prefix_lengths, scores):
    """Ban, at each position of row b, the tokens that would complete an n-gram of row b's encoder input: transformers'
    own lookup with each row's own n-grams (a call on a group of rows would read the first rows' n-grams)."""
    if scores.shape[0] != processor.batch_size:
        raise ValueError(f"`encoder_no_repeat_ngram_size` was set up for {processor.batch_size} rows, but the batch "
                         f"has {scores.shape[0]} (speculative decoding runs without beams).")
    processed = scores.clone()
    for row, lengths in enumerate(position_lengths(prefix_lengths, scores).tolist()):
        for position, length in enumerate(lengths):
            banned = encoder_ngram_bans(processor, row, sequence_ids[row, :length])
            processed[row, position, banned] = float("-inf")
    return processed


register_block_processor(PrefixConstrainedLogitsProcessor, prefix_constrained_block)
register_block_processor(EncoderRepetitionPenaltyLogitsProcessor, encoder_repetition_penalty_block)
register_block_processor(EncoderNoRepeatNGramLogitsProcessor, encoder_no_repeat_ngram_block)
register_block_processor(MinLengthLogitsProcessor, min_length_block)
register_block_processor(MinNewTokensLengthLogitsProcessor, min_new_tokens_block)
register_block_processor(SuppressTokensAtBeginLogitsProcessor, suppress_at_begin_block)
register_block_processor(ForcedEOSTokenLogitsProcessor, forced_eos_block)
register_block_processor(RepetitionPenaltyLogitsProcessor, repetition_penalty_block)
register_block_processor(NoRepeatNGramLogitsProcessor, no_repeat_ngram_block)
register_block_processor(SequenceBiasLogitsProcessor, sequence_bias_block)
register_block_processor(NoBadWordsLogitsProcessor, sequence_bias_block)
