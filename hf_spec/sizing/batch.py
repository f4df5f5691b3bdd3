"""Draft lengths for a continuous batch (``num_assistant_tokens="auto"`` in `hf_spec.serving`): each step, each
request's k from its own acceptance and the pass costs the batch has measured, down to 0 where drafting does not pay
(a compute-bound batch, a request the draft does not know).

`batch_draft_lengths` is the choice (pure); `BatchDraftLengths` holds what it learns from the steps: seconds of target
and draft passes by size, and each request's acceptance, shrunk towards the batch's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hf_spec.sizing.costs import interpolated
from hf_spec.sizing.estimates import DecayedMean

#: Drafted tokens per request and step at most.
MAX_BATCH_DRAFT_TOKENS = 8
#: k while the costs are still unknown (before two target pass sizes and one draft pass were timed).
WARMUP_DRAFT_TOKENS = 3
#: Acceptance before any observation, and its weight in drafted tokens.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 4.0
#: Forgetting per step: of a request's acceptance (and the batch's), and of each pass size's seconds.
ACCEPTANCE_DECAY, COST_DECAY = 0.9, 0.9


def batch_draft_lengths(acceptance: Sequence[float], caps: Sequence[int], fixed_tokens: int,
                        target_seconds: Callable[[int], float], draft_seconds: Callable[[int], float]) -> list[int]:
    """Per request ``k_i <= caps[i]``, the most expected tokens per second of the requests' step::

        sum_i E(a_i, k_i) / (T(n) + T(F + n + m) - T(F + n) + sum_{j=1..K} draft_seconds(n_j))

    with ``T = target_seconds``, ``n`` requests, ``m = sum_i k_i`` drafts, ``F = fixed_tokens`` (prefill chunks and
    other blocks in the same pass), ``E(a, k) = 1 + a + ... + a^k``, ``K = max k_i`` draft passes and ``n_j`` the
    requests drafting a j-th token. The requests' share of a pass is what a pass of their own tokens costs, ``T(n)``,
    and the drafts add what they add to the shared pass: a large prefill chunk in the same pass makes neither drafting
    nor not drafting look free. For each depth K the drafts taken are those most likely kept (``a_i^j``, best
    first), as many as pay."""
    n = len(acceptance)
    if n == 0:
        return []
    draft_cost: dict[int, float] = {}

    def drafting(width: int) -> float:
        if width not in draft_cost:
            draft_cost[width] = draft_seconds(width)
        return draft_cost[width]

    own, shared = target_seconds(n), target_seconds(fixed_tokens + n)
    best, best_rate = [0] * n, n / own
    for depth in range(1, max(caps) + 1):
        drafts = sorted(((acceptance[i] ** j, -j, i) for i in range(n) for j in range(1, min(depth, caps[i]) + 1)),
                        reverse=True)  # a request's j-th draft always before its (j+1)-th
        lengths, width, gain, passes = [0] * n, [0] * (depth + 1), 0.0, 0.0
        for taken, (kept, _, i) in enumerate(drafts, start=1):
            lengths[i] += 1
            j = lengths[i]
            passes += drafting(width[j] + 1) - (drafting(width[j]) if width[j] else 0.0)
            width[j] += 1
            gain += kept
            rate = (n + gain) / (own + target_seconds(fixed_tokens + n + taken) - shared + passes)
            if rate > best_rate:
                best, best_rate = list(lengths), rate
    return best


class BatchDraftLengths:
    """What `batch_draft_lengths` needs, learnt from the batch's steps."""

    def __init__(self, max_draft_tokens: int = MAX_BATCH_DRAFT_TOKENS):
        self.max_draft_tokens = max_draft_tokens
        self.target: dict[int, DecayedMean] = {}  # tokens in a target pass -> seconds
        self.draft: dict[int, DecayedMean] = {}  # tokens in a draft pass -> seconds
        self.pooled = DecayedMean(ACCEPTANCE_DECAY)  # accepted / reached drafts, over every request

    @staticmethod
    def new_request() -> DecayedMean:
        """A request's acceptance record (accepted drafts over drafts reached, forgetting)."""
        return DecayedMean(ACCEPTANCE_DECAY)

    def add_target_pass(self, num_tokens: int, seconds: float) -> None:
        self.target.setdefault(num_tokens, DecayedMean(COST_DECAY)).add_timing(seconds)

    def add_draft_pass(self, num_tokens: int, seconds: float) -> None:
        self.draft.setdefault(num_tokens, DecayedMean(COST_DECAY)).add_timing(seconds)

    def observe(self, record: DecayedMean, num_drafted: int, num_accepted: int) -> None:
        """A request's step: ``num_accepted`` of ``num_drafted`` kept (0 drafted: its record forgets once)."""
        if num_drafted == 0:
            record.forget()
            return
        reached = min(num_drafted, num_accepted + 1)
        record.add(num_accepted / reached, weight=reached)
        self.pooled.add(num_accepted / reached, weight=reached)

    def end_step(self, observed: bool) -> None:
        """A step without any draft: the batch's acceptance forgets once too (back towards the prior)."""
        if not observed:
            self.pooled.forget()

    def acceptance(self, record: DecayedMean) -> float:
        pooled = (self.pooled.total + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.pooled.weight + PRIOR_WEIGHT)
        return (record.total + pooled * PRIOR_WEIGHT) / (record.weight + PRIOR_WEIGHT)

    def lengths(self, records: Sequence[DecayedMean], caps: Sequence[int], fixed_tokens: int) -> list[int]:
        """This step's k per request, given each one's cap (tokens left, room in the cache)."""
        caps = [min(cap, self.max_draft_tokens) for cap in caps]
        if len(self.target) < 2 or not self.draft:  # costs unknown: draft a little, and time it
            return [min(cap, WARMUP_DRAFT_TOKENS) for cap in caps]
        target = sorted((size, mean.get(0.0)) for size, mean in self.target.items())
        draft = sorted((size, mean.get(0.0)) for size, mean in self.draft.items())
        return batch_draft_lengths([self.acceptance(record) for record in records], caps, fixed_tokens,
                                   lambda size: interpolated(target, size), lambda size: interpolated(draft, size))
