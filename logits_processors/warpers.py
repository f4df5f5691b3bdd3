"""Block implementations of the processors that never read ``input_ids`` (warpers and fixed token masks).

Their output row depends only on their input row, so a verification block ``[batch, k + 1, vocab]`` is processed
as ``batch * (k + 1)`` independent rows in one call of transformers' own code. Top-k and top-p get faster exact
row functions: transformers' top-p sorts the whole vocabulary (about 8 ms per row at 151,936 tokens on this CPU)
and its top-k builds a vocabulary-wide mask, but only a few highest-scoring tokens can survive either. Where the
fast answer could differ from transformers' (ties, rounding, NaN), that row is computed by transformers.
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
# A candidate whose cumulative probability lies this close to the cut-off could fall on either side of it under
# transformers' float32 rounding; such rows take the full sort. Measured differences on untied candidates at vocab
# 151,936: at most 7e-7.
TOP_P_TOLERANCE = 1e-5


def top_k_rows(processor: TopKLogitsWarper, scores: torch.Tensor) -> torch.Tensor:
    """``TopKLogitsWarper`` on rows ``[n, vocab]``: the top k scattered into -inf instead of a vocab-wide mask.

    transformers keeps every score not below the k-th highest, which is more than k tokens when the k-th is tied
    (common with bf16 logits); such rows, and rows with NaN, are computed by transformers.
    """
    top_k = min(processor.top_k, scores.shape[-1])
    if processor.filter_value != float("-inf") or top_k == scores.shape[-1] or scores.device.type != "cpu":
        return processor(None, scores)  # on an accelerator transformers' own needs no host synchronization
    top_scores, top_ids = scores.topk(top_k + 1, dim=-1)  # [n, k + 1], descending
    processed = torch.full_like(scores, float("-inf")).scatter_(-1, top_ids[:, :-1], top_scores[:, :-1])
    is_unsure = (top_scores[:, -1] == top_scores[:, -2]) | top_scores.isnan().any(dim=-1)
    unsure_rows = is_unsure.nonzero().flatten()
    if len(unsure_rows) > 0:  # host synchronization
        processed[unsure_rows] = processor(None, scores[unsure_rows])
    return processed


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
    if processor.filter_value != float("-inf") or scores.device.type != "cpu":
        # -inf scores change then too: not worth a fast path; on an accelerator the full sort is cheap and, unlike
        # the fall-back below, needs no host synchronization
        return processor(None, scores)
    min_keep = processor.min_tokens_to_keep
    num_candidates = min(vocab_size, max(NUM_TOP_P_CANDIDATES, min_keep + 1))
    cut_off = 1.0 - processor.top_p

    # 1. The candidates, highest first, and the cumulative probability transformers would give each of them. The
    # float32 softmax of an unsorted row is off by up to ~1e-5 in total (transformers' softmax of the ascending sorted
    # row by ~1e-7), so it is renormalized with a float64 sum before the answers are compared.
    probs = scores.softmax(dim=-1)  # [n, vocab]
    total = probs.sum(dim=-1, keepdim=True, dtype=torch.float64)  # [n, 1]
    top_scores, top_ids = scores.topk(num_candidates, dim=-1)  # [n, m], descending
    top_probs = probs.gather(-1, top_ids).double()  # [n, m]
    cumulative = 1.0 - (top_probs.cumsum(dim=-1) - top_probs) / total  # [n, m]: cum_j = 1 - above_j
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
    kept_scores = top_scores.masked_fill(~keep, float("-inf"))
    processed = torch.full_like(scores, float("-inf")).scatter_(-1, top_ids, kept_scores)
    unsure_rows = is_unsure.nonzero().flatten()
    if len(unsure_rows) > 0:  # host synchronization; rare
        processed[unsure_rows] = processor(None, scores[unsure_rows])
    return processed


for _processor_class in (
    TemperatureLogitsWarper,
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
register_position_independent(TopKLogitsWarper, top_k_rows)
register_position_independent(TopPLogitsWarper, top_p_rows)
