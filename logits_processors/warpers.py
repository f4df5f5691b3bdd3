"""Block implementations of the processors that never read ``input_ids`` (warpers and fixed token masks).

Their output row depends only on their input row, so a verification block ``[batch, k + 1, vocab]`` is processed
as ``batch * (k + 1)`` independent rows in one call of transformers' own code. Top-p gets a faster exact row
function: transformers sorts the whole vocabulary (about 8 ms per row at 151,936 tokens on this CPU), but only the
few highest-probability tokens can survive it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from logits_processors.registry import register_position_independent

# Top-p looks first at this many highest-scoring tokens; rows whose nucleus is larger take transformers' full sort.
NUM_TOP_P_CANDIDATES = 256
# A candidate whose cumulative probability lies this close to the cut-off could fall on either side of it once
# transformers' float32 rounding (a softmax over the sorted row) is applied; such rows take the full sort.
TOP_P_TOLERANCE = 1e-3


def top_p_rows(processor: TopPLogitsWarper, scores: torch.Tensor) -> torch.Tensor:
    """``TopPLogitsWarper`` on rows ``[n, vocab]``, the same mask as transformers' without sorting the vocabulary.

    transformers sorts each row ascending and removes token j when ``cum_j = P(tokens sorted at or below j) <=
    1 - top_p``, keeping the ``min_tokens_to_keep`` highest. In descending order ``cum_j = total - above_j``, where
    ``above_j`` sums the probabilities ranked above j, so the top candidates decide every token: once the highest
    candidate that is removed has been found, every token ranked below it is removed too. A row falls back to
    transformers' own computation when the answer could depend on rounding or on the order of tied scores: a
    cumulative probability within ``TOP_P_TOLERANCE`` of the cut-off, tied scores on both sides of it, or a nucleus
    reaching past the candidates.
    """
    vocab_size = scores.shape[-1]
    if processor.filter_value != float("-inf"):  # then even -inf scores change; not worth a fast path
        return processor(None, scores)
    min_keep = processor.min_tokens_to_keep
    num_candidates = min(vocab_size, max(NUM_TOP_P_CANDIDATES, min_keep + 1))
    cut_off = 1.0 - processor.top_p

    # 1. The candidates, highest first, and the cumulative probability transformers would give each of them.
    probs = scores.softmax(dim=-1)  # [n, vocab]
    top_scores, top_ids = scores.topk(num_candidates, dim=-1)  # [n, m], descending
    top_probs = probs.gather(-1, top_ids).double()  # [n, m]
    total = probs.sum(dim=-1, keepdim=True, dtype=torch.float64)  # [n, 1], 1 up to rounding
    cumulative = total - (top_probs.cumsum(dim=-1) - top_probs)  # [n, m]: cum_j = total - above_j
    keep = cumulative > cut_off
    keep[:, :min_keep] = True

    # 2. Rows whose answer is not certain: near the cut-off, a split tie, or the last candidate still kept.
    is_finite = top_scores > float("-inf")  # -inf stays -inf whatever is decided for it
    is_near = ((cumulative - cut_off).abs() <= TOP_P_TOLERANCE) & is_finite
    is_split_tie = (top_scores[:, 1:] == top_scores[:, :-1]) & (keep[:, 1:] != keep[:, :-1]) & is_finite[:, 1:]
    is_unsure = is_near.any(dim=-1) | is_split_tie.any(dim=-1) | total.isnan().view(-1)  # NaN or +inf scores
    if num_candidates < vocab_size:
        is_unsure |= keep[:, -1] & is_finite[:, -1]

    # 3. Remove everything but the kept candidates; unsure rows are computed by transformers.
    keep_mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top_ids, keep)  # [n, vocab]
    processed = scores.masked_fill(~keep_mask, float("-inf"))
    unsure_rows = is_unsure.nonzero().flatten()
    if len(unsure_rows) > 0:  # host synchronization; rare
        processed[unsure_rows] = processor(None, scores[unsure_rows])
    return processed


for _processor_class in (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    TopHLogitsWarper,
    LogitNormalization,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
):
    register_position_independent(_processor_class)
register_position_independent(TopPLogitsWarper, top_p_rows)
