"""How many tokens to draft each round: a fixed k, or the k that maximizes expected emitted tokens per second.

`FixedDraftLength` drafts the same k every round (fewer near ``max_length``). `AutoDraftLength`: a round that drafts k
tokens emits E[tokens](k) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_{k-1} in expectation (`hf_spec.drafting.speedup`) and
costs k draft steps plus one target pass over k + 1 tokens. `AutoDraftLength` estimates both online, during the call,
and picks ``argmax_k E[tokens](k) / (k * draft_step_seconds + block_seconds(k + 1))`` before every round:

- acceptance per block position: counts with exponential forgetting (so it follows the text as it changes between
  code and prose), shrunk towards the pooled rate of all positions, which is shrunk towards a prior;
- costs: the draft's seconds per forward pass and the target's seconds per pass of each block size, measured (means
  with forgetting); a block size not measured yet is interpolated, or extrapolated with the slope measured so far
  (flat until two sizes are known). The first round, which includes the prompt's prefill, is not timed.

k = 0 (no draft: a plain target step) is allowed; after ``explore_every`` rounds without drafting, one round drafts a
single token so the acceptance estimate can recover, and each exploration that does not bring drafting back doubles
the wait (up to `MAX_EXPLORE_EVERY`), so a draft that does not fit (or blocks too expensive to pay for any draft)
costs ever less. The clock has the last word: once rounds that
drafted have measurably emitted fewer tokens per second than plain target steps, k is 0 until an exploration says
otherwise (the cost model misses costs such as the draft catching up on skipped tokens). `start_from` seeds the costs
with measured ones (`hf_spec.drafting.costs.probe_costs`, which speculative ``generate()`` runs once per process for
``"auto"``): the first rounds are then chosen from them, and where even a draft accepted every time could not beat a
plain step (`CostTable.best_possible_speedup` below 1), it decodes with k = 0 throughout and says so in a warning.
With a model-free drafter (prompt lookup) draft steps cost nothing and only the block cost limits k.

No state outlives a ``generate()`` call unless you pass your own instance, ``num_assistant_tokens=AutoDraftLength()``,
to several calls: then it starts each call from what the previous ones measured (warm start).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from hf_spec.checks import check_int
from hf_spec.drafting.costs import CostTable
from hf_spec.drafting.speedup import predicted_speedup

#: k when neither the call nor the draft's generation config sets ``num_assistant_tokens``.
DEFAULT_NUM_DRAFT_TOKENS = 5
#: Drafted tokens per round at most with ``num_assistant_tokens="auto"``, unless the caller says otherwise.
DEFAULT_MAX_DRAFT_TOKENS = 10
#: The longest wait between exploration rounds once explorations keep failing.
MAX_EXPLORE_EVERY = 128
#: Rounds of each kind, drafting and plain, before their measured speeds may overrule the cost model.
RATE_EVIDENCE = 6

logger = logging.getLogger(__name__)


def best_draft_length(acceptance: list[float], draft_step_seconds: float, block_seconds: list[float]) -> int:
    """The k in ``0 .. len(block_seconds) - 1`` with the most expected tokens per second.

    Args:
        acceptance: ``a_i`` for block positions ``0 .. len(block_seconds) - 2``.
        draft_step_seconds: one draft forward pass (0 for a model-free drafter).
        block_seconds: ``block_seconds[k]``: a target pass over ``k + 1`` tokens.
    """
    # The speed-up formula with costs in seconds instead of target steps: expected tokens per second.
    rates = [predicted_speedup(acceptance, k, draft_step_seconds, block_seconds[k]) for k in range(len(block_seconds))]
    return max(range(len(rates)), key=rates.__getitem__)


class FixedDraftLength:
    """The same k every round, fewer when fewer tokens are left before ``max_length``."""

    is_timed = False  # nothing to learn from timings

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = check_int("num_assistant_tokens", num_draft_tokens)

    def choose(self, limit: int) -> int:
        return min(self.num_draft_tokens, limit)

    def update(self, num_draft_tokens: int, num_accepted: list[int], draft_seconds: float, num_model_steps: int,
               verify_seconds: float | None) -> None:
        """Nothing to learn."""


@dataclasses.dataclass
class DecayedMean:
    """A mean with exponential forgetting: each new value weighs ``1 - decay`` of the total once warmed up."""

    decay: float
    total: float = 0.0
    weight: float = 0.0
    count: int = 0  # values added, without forgetting

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.decay * self.total + value * weight
        self.weight = self.decay * self.weight + weight
        self.count += 1

    def get(self, default: float) -> float:
        return self.total / self.weight if self.weight > 0 else default


class AutoDraftLength:
    """Chooses k before every round from acceptance and costs measured online (see the module docstring).

    Args:
        max_draft_tokens: largest k considered.
        initial: k of the first round, before anything is measured.
        prior_acceptance, prior_weight: the acceptance assumed before any round, worth this many observations.
        decay: forgetting factor per observation, in (0, 1]; 1 never forgets.
        explore_every: after this many rounds at k = 0, draft one token once.
    """

    is_timed = True  # learns from the round's timings

    def __init__(self, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, initial: int = 4,
                 prior_acceptance: float = 0.6, prior_weight: float = 2.0, decay: float = 0.97, explore_every: int = 8):
        check_int("max_draft_tokens", max_draft_tokens)
        check_int("initial", initial, minimum=0)
        check_int("explore_every", explore_every)
        if not 0.0 < prior_acceptance < 1.0 or prior_weight <= 0:
            raise ValueError(f"`prior_acceptance` must be in (0, 1) and `prior_weight` > 0, but are "
                             f"{prior_acceptance!r} and {prior_weight!r}.")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"`decay` must be in (0, 1], but is {decay!r}.")
        self.max_draft_tokens, self.initial = max_draft_tokens, min(initial, max_draft_tokens)
        self.prior_acceptance, self.prior_weight, self.explore_every = prior_acceptance, prior_weight, explore_every
        self._accepted = [DecayedMean(decay) for _ in range(max_draft_tokens)]  # per position: P(accepted | reached)
        self._draft_step = DecayedMean(decay)
        self._block = {}  # block size -> DecayedMean of seconds
        self._decay = decay
        self._rounds_without_draft = 0
        self._explore_wait = explore_every  # grows while explorations leave k at 0
        self._is_exploring = False
        self.is_hopeless = False  # measured costs say no draft can pay: k = 0 throughout
        # tokens per second of steady rounds that drafted, or not: decayed token sums over decayed second sums
        self._rate = {True: DecayedMean(decay), False: DecayedMean(decay)}
        self._was_drafting = False
        self.has_costs = False
        self.chosen: list[int] = []  # k of every round, in order (across calls when reused)

    def start_from(self, costs: CostTable, weight: float = 4.0) -> None:
        """Seed the costs with measured ones, each worth ``weight`` online measurements (which then take over)."""
        if costs.draft_step_seconds > 0:
            self._draft_step.add(costs.draft_step_seconds, weight)
        for size, seconds in costs.target_block_seconds.items():
            if size <= self._max_block_size():
                self._block.setdefault(size, DecayedMean(self._decay)).add(seconds, weight)
        self.has_costs = True
        best = costs.best_possible_speedup()
        self.is_hopeless = best < 1.0
        if self.is_hopeless:
            logger.warning(
                "num_assistant_tokens='auto': speculation cannot pay on this machine with these models; even a draft "
                "accepted every time would reach at most %.2fx target-only decoding (draft step / target step c = "
                "%.2f, a %d-token target pass costs %.2f steps). Decoding with k = 0 (plain target steps).",
                best, costs.cost_ratio, 2, costs.block_cost(1))

    def _max_block_size(self) -> int:
        """The largest target pass this chooser may ask for."""
        return self.max_draft_tokens + 1

    def acceptance(self) -> list[float]:
        """Estimated P(accepted | reached) per block position."""
        pooled_total = sum(m.total for m in self._accepted)
        pooled_weight = sum(m.weight for m in self._accepted)
        pooled = ((pooled_total + self.prior_acceptance * self.prior_weight) / (pooled_weight + self.prior_weight))
        return [(m.total + pooled * self.prior_weight) / (m.weight + self.prior_weight) for m in self._accepted]

    def block_seconds(self, size: int) -> float | None:
        """Estimated seconds of a target pass over ``size`` tokens (``None`` before any measurement)."""
        known = sorted((s, m.get(0.0)) for s, m in self._block.items())
        if not known:
            return None
        if len(known) == 1:
            return known[0][1]
        for (s0, t0), (s1, t1) in itertools.pairwise(known):
            if s0 <= size <= s1:
                return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
        (s0, t0), (s1, t1) = (known[0], known[1]) if size < known[0][0] else (known[-2], known[-1])
        slope = max(0.0, (t1 - t0) / (s1 - s0))
        return max(1e-9, t1 + slope * (size - s1)) if size > s1 else max(1e-9, t0 - slope * (s0 - size))

    def choose(self, limit: int) -> int:
        """k for the next round, at most ``limit`` (tokens left before ``max_length``)."""
        limit = max(0, min(limit, self.max_draft_tokens))
        k = self._forced_choice()
        if k is None:
            draft_step = self._draft_step.get(0.0)  # 0 until a draft model ran (prompt lookup costs nothing)
            blocks = [self.block_seconds(size) for size in range(1, limit + 2)]
            k = best_draft_length(self.acceptance(), draft_step, blocks)
            if k > 0 and self._is_drafting_slower():
                k = 0  # the cost model says draft, the clock says no: trust the clock, explore later
        return self._chose(min(k, limit))

    def _forced_choice(self) -> int | None:
        """k when the cost model is not asked: 0 when hopeless, ``initial`` before any cost, 1 to explore."""
        self._is_exploring = False
        if self.is_hopeless:
            return 0
        if self.block_seconds(1) is None:
            return self.initial
        if self._rounds_without_draft >= self._explore_wait:
            self._is_exploring = True
            return 1
        return None

    def _chose(self, k: int) -> int:
        self._rounds_without_draft = self._rounds_without_draft + 1 if k == 0 else 0
        self.chosen.append(k)
        return k

    def update(self, num_draft_tokens: int, num_accepted: list[int], draft_seconds: float, num_model_steps: int,
               verify_seconds: float | None) -> None:
        """Learn from a finished round: each active row's accepted count, and the round's timings.

        Args:
            num_draft_tokens: tokens proposed per row this round.
            num_accepted: per active row.
            verify_seconds: the target pass, or ``None`` when it must not be timed (the first round's prefill).
        """
        for accepted in num_accepted:
            for position in range(min(num_draft_tokens, accepted + 1)):  # positions this row reached
                self._accepted[position].add(float(position < accepted))
        emitted = 1.0 + sum(num_accepted) / max(1, len(num_accepted))  # per row
        self._learn_costs(num_draft_tokens + 1, self._draft_step, draft_seconds, num_model_steps, verify_seconds,
                          emitted)
        self._learn_exploration(num_draft_tokens > 0)

    def _learn_costs(self, num_block_tokens: int, draft_step: DecayedMean, draft_seconds: float, num_model_steps: int,
                     verify_seconds: float | None, emitted: float) -> None:
        """A round's timings: a draft pass (into ``draft_step``), the target pass over ``num_block_tokens`` tokens,
        and the tokens per second of steady rounds, drafting or not."""
        if verify_seconds is None:
            return
        if num_model_steps > 0:
            draft_step.add(draft_seconds / num_model_steps)
        self._block.setdefault(num_block_tokens, DecayedMean(self._decay)).add(verify_seconds)
        is_drafting = num_block_tokens > 1
        if is_drafting == self._was_drafting:  # steady rounds only: a switch costs the draft a catch-up pass
            seconds = draft_seconds + verify_seconds
            self._rate[is_drafting].add(emitted / seconds, weight=seconds)  # so the mean is tokens / seconds

    def _learn_exploration(self, is_drafting: bool) -> None:
        """Each exploring round doubles the wait before the next one; a round that drafts because the model chose to
        (the exploration changed its mind) resets it. An accepted exploration alone does not: where blocks are
        expensive, drafting loses even when the draft is right, and each exploration costs a block."""
        self._was_drafting = is_drafting
        if self._is_exploring and is_drafting:
            self._explore_wait = min(2 * self._explore_wait, MAX_EXPLORE_EVERY)
        elif is_drafting:
            self._explore_wait = self.explore_every

    def _is_drafting_slower(self) -> bool:
        """Whether rounds that drafted have emitted fewer tokens per second than plain target steps, both measured
        (a few rounds each): the cost model misses what the clock sees, e.g. the draft catching up on the tokens
        it skipped, or a draft step that costs more with two tokens than with one."""
        drafting, plain = self._rate[True], self._rate[False]
        if drafting.count < RATE_EVIDENCE or plain.count < RATE_EVIDENCE:
            return False
        return drafting.get(0.0) < plain.get(0.0)
