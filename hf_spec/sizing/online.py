"""What the automatic sizers learn during a call, shared by ``num_assistant_tokens="auto"`` (`AutoDraftLength`) and
``num_tree_nodes="auto"`` (`AutoTreeSize`).

- `PositionalAcceptance` and `PassCosts` (`hf_spec.sizing.estimates`): acceptance per position, and the seconds
  of draft and target passes, seeded by the cost probe and then measured;
- `Exploration`: after rounds without drafting, one round drafts a single token so the acceptance estimate can
  recover; each exploration that does not bring drafting back doubles the wait;
- `ClockGuard`: tokens per second of steady rounds that drafted and of plain steps, so that the clock can overrule
  the cost model (which misses costs such as a draft catching up on skipped tokens) once drafting is slower by a
  margin (`CLOCK_MARGIN`), until the cost model's case for drafting grows by `RETEST_GAIN` (then it measures again).

`OnlineSizer` holds one of each and the rules both sizers share: the probe's costs as a start, k = 0 throughout where
even a perfect draft cannot pay, the forced choices (before any cost, exploring), and what a finished round teaches.
"""

from __future__ import annotations

import collections
import logging

from hf_spec.checks import check_int
from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.estimates import OUTLIER_RATIO, SHIFT_EVIDENCE, DecayedMean, PassCosts, PositionalAcceptance

#: The longest wait between exploration rounds once explorations keep failing.
MAX_EXPLORE_EVERY = 128
#: Rounds of each kind, drafting and plain, before their measured speeds may overrule the cost model.
RATE_EVIDENCE = 6
#: Rounds whose choices a sizer keeps in ``chosen`` (a reused instance would otherwise grow without bound).
MAX_CHOSEN = 10_000
#: Drafting must be measurably slower than plain steps, by this factor, before the clock overrules the cost model.
CLOCK_MARGIN = 0.9
#: A clock veto holds until the cost model's predicted gain from drafting is this many times the gain it refuted.
RETEST_GAIN = 1.15
#: Where no size pays at the estimated acceptance, one token while it would pay at this many standard errors above it.
HOPE_ERRORS = 1.0
#: One position deeper where it would pay at this many standard errors above the estimate at the first position not
#: drafted (rounds that stop short never observe it, and its estimate leans on the pooled rate).
REACH_ERRORS = 0.5

#: Timed rounds that drafted after which a call's timings may correct the stored costs whichever way they lie.
OBSERVED_ROUNDS = 8
#: The most recent such rounds a sizer keeps (one kept across calls does not grow without bound).
MAX_OBSERVED = 256

logger = logging.getLogger(__name__)


class Exploration:
    """After ``every`` rounds without drafting, one round drafts a single token. Each exploring round doubles the wait
    before the next (up to `MAX_EXPLORE_EVERY`); a round that drafts because the model chose to resets it. An accepted
    exploration alone does not: where blocks are expensive, drafting loses even when the draft is right, and each
    exploration costs a block. While the acceptance estimate rests on fewer than ``every`` observations, the wait is
    that many rounds (at least one): a draft rejected in the call's first rounds is tried again soon, not written off
    for ``every`` rounds on one or two draws."""

    def __init__(self, every: int):
        self.every = check_int("explore_every", every)
        self.wait = every
        self.rounds_without_draft = 0
        self.is_exploring = False

    def is_due(self, evidence: float) -> bool:
        """``evidence``: observations counted at the first position so far (without forgetting)."""
        return self.rounds_without_draft >= min(self.wait, max(1.0, evidence))

    def chose(self, num_drafted: int) -> None:
        self.rounds_without_draft = self.rounds_without_draft + 1 if num_drafted == 0 else 0

    def learn(self, is_drafting: bool) -> None:
        if self.is_exploring and is_drafting:
            self.wait = min(2 * self.wait, MAX_EXPLORE_EVERY)
        elif is_drafting:
            self.wait = self.every


class ClockGuard:
    """Tokens per second of steady rounds that drafted, and of plain target steps (decayed token sums over decayed
    second sums); a round right after a switch is not steady (the draft catches up on what it skipped).

    A veto answers the cost model's claim at the time (drafting ``predicted_gain`` times faster than plain steps). It
    holds until the cost model claims `RETEST_GAIN` times more than the claim refuted (the acceptance rose, say): then
    the drafting rate is measured again, so that a slow start cannot keep auto off drafting for the rest of the call.
    Each retest needs a larger claim than the last, and the claim is bounded, so retests are few."""

    def __init__(self, decay: float):
        self.rates = {True: DecayedMean(decay), False: DecayedMean(decay)}
        self.was_drafting = False
        self.refuted_gain: float | None = None  # the claim the drafting rate measured last was slower than

    def add(self, is_drafting: bool, emitted: float, seconds: float | None) -> None:
        """One round; ``seconds`` is ``None`` for a round that is not timed (the prefill)."""
        if seconds is not None and is_drafting == self.was_drafting:
            self.rates[is_drafting].add(emitted / seconds, weight=seconds)  # so the mean is tokens / seconds
        self.was_drafting = is_drafting

    def overrules(self, predicted_gain: float) -> bool:
        """Whether the clock vetoes a round the cost model would draft, expecting ``predicted_gain`` times the speed
        of plain steps: only once rounds that drafted have emitted fewer tokens per second than plain steps, both
        measured, and while the claim is not `RETEST_GAIN` times the one refuted."""
        drafting, plain = self.rates[True], self.rates[False]
        if drafting.count < RATE_EVIDENCE or plain.count < RATE_EVIDENCE:
            return False  # too little evidence: the cost model decides
        if drafting.get(0.0) >= CLOCK_MARGIN * plain.get(0.0):
            self.refuted_gain = None
            return False
        if self.refuted_gain is None:
            self.refuted_gain = predicted_gain
        if predicted_gain <= RETEST_GAIN * self.refuted_gain:
            return True
        self.rates[True] = DecayedMean(drafting.decay)  # a stronger claim than the one refuted: measure it again
        self.refuted_gain = predicted_gain
        return False


class OnlineSizer:
    """The state and rules `AutoDraftLength` and `AutoTreeSize` share (see the module docstring).

    Args:
        num_positions: block positions (tree depths) whose acceptance is tracked: the longest chain or deepest tree.
        max_block_size: the largest target pass the sizer may ask for.
        initial: tokens of the first round, before any cost is known.
        prior_acceptance, prior_weight: the acceptance assumed before any round, worth this many observations.
        decay: forgetting factor per observation, in (0, 1]; 1 never forgets.
        explore_every: after this many rounds without drafting (fewer early on), draft one token once.
    """

    is_timed = True  # learns from the round's timings

    def __init__(self, num_positions: int, max_block_size: int, initial: int, prior_acceptance: float,
                 prior_weight: float, decay: float, explore_every: int):
        check_int("initial", initial, minimum=0)
        if not 0.0 < prior_acceptance < 1.0 or prior_weight <= 0:
            raise ValueError(f"`prior_acceptance` must be in (0, 1) and `prior_weight` > 0, but are "
                             f"{prior_acceptance!r} and {prior_weight!r}.")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"`decay` must be in (0, 1], but is {decay!r}.")
        self.initial, self.decay = initial, decay
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.explore_every = check_int("explore_every", explore_every)
        self.first = PositionalAcceptance(num_positions, prior_acceptance, prior_weight, decay)
        self.costs = PassCosts(decay, max_block_size)
        self.exploration = Exploration(explore_every)
        self.clock = ClockGuard(decay)
        self.is_hopeless = False  # measured costs say no draft can pay: k = 0 (once the call's timings agree)
        self.has_costs = False
        self.chosen: collections.deque[int] = collections.deque(maxlen=MAX_CHOSEN)  # tokens drafted, last rounds
        # per timed round that drafted: (its draft step / the probe's) / (its target pass / the probe's), recent ones
        self.observed_cost_ratios: collections.deque[float] = collections.deque(maxlen=MAX_OBSERVED)
        self.seeded: CostTable | None = None  # the costs it started from

    @property
    def needs_costs(self) -> bool:
        """Whether the cost probe has not seeded it yet (`start_from`)."""
        return not self.has_costs

    def start_from(self, costs: CostTable, weight: float = 4.0, catch_up: bool = True) -> None:
        """Seed the costs with measured ones: the draft step and the machine's speed are each worth ``weight`` online
        measurements (which then take over); each block size leans on the probe's figure (`PassCosts`). ``catch_up``:
        whether the drafter reports catch-ups, so that the probe's 2-token pass prices them (a tree's level pass of
        two nodes is no catch-up)."""
        self.costs.seed(costs, weight, catch_up)
        self.has_costs = True
        self.seeded = costs
        self.observed_cost_ratios.clear()
        best = costs.best_possible_speedup()
        self.is_hopeless = best < 1.0
        if self.is_hopeless:
            logger.warning(
                "automatic draft size: speculation cannot pay on this machine with these models; even a draft "
                "accepted every time would reach at most %.2fx target-only decoding (draft step / target step c = "
                "%.2f, a 2-token target pass costs %.2f steps). Decoding with plain target steps, after a few "
                "rounds that check the probe's draft step.",
                best, costs.cost_ratio, costs.block_cost(1))

    def block_seconds(self, size: int) -> float | None:
        return self.costs.block_seconds(size)

    def _forced_choice(self) -> int | None:
        """Tokens to draft when the cost model is not asked: 0 when hopeless, ``initial`` before any cost, 1 to
        explore. Hopeless on the probe's draft step alone, a sizer still explores until the call's own timings have
        judged that step (`SHIFT_EVIDENCE` rounds): one probe in a slow phase would otherwise keep a whole process
        from drafting."""
        self.exploration.is_exploring = False
        if self.is_hopeless and self.costs.draft_step.seeded is None:
            return 0
        if self.block_seconds(1) is None:
            return self.initial
        if self.exploration.is_due(self.first.cells[0].count):
            self.exploration.is_exploring = True
            return 1
        return 0 if self.is_hopeless else None

    def _best_possible_speedup(self) -> float:
        """`CostTable.best_possible_speedup` at the costs as now estimated."""
        sizes = [size for size, _ in self.costs.reference]
        blocks = {size: self.block_seconds(size) for size in sizes}
        return CostTable(self.block_seconds(1), self.costs.draft_step.get(0.0), blocks, {}).best_possible_speedup()

    def observed_cost_ratio(self) -> float | None:
        """What this call's own timings say of the probe's draft step against its target passes: the median, over the
        rounds that drafted, of (draft step / the probe's) / (target pass / the probe's), where the evidence is firm
        (`OBSERVED_ROUNDS` rounds, or `SHIFT_EVIDENCE` that all lie beyond `OUTLIER_RATIO` on one side, as a seed
        gives way within a call); else ``None``. The stored costs follow it (`hf_spec.timing.probe.correct_costs`)."""
        ratios = sorted(self.observed_cost_ratios)
        is_one_sided = all(ratio > OUTLIER_RATIO for ratio in ratios) or all(
            ratio < 1 / OUTLIER_RATIO for ratio in ratios)
        if len(ratios) >= OBSERVED_ROUNDS or (len(ratios) >= SHIFT_EVIDENCE and is_one_sided):
            return ratios[len(ratios) // 2]
        return None

    def _chose(self, num_drafted: int) -> None:
        self.exploration.chose(num_drafted)
        self.chosen.append(num_drafted)

    def _learn_round(self, num_block_tokens: int, draft_step: DecayedMean, draft_seconds: float,
                     num_model_steps: int, verify_seconds: float | None, emitted: float,
                     catch_up_steps: float = 0.0) -> None:
        """A round's timings (a draft pass into ``draft_step``, its passes worth ``num_model_steps`` plus
        ``catch_up_steps`` steps, the target pass over ``num_block_tokens`` tokens, tokens per second) and what it
        means for exploration; untimed rounds (the prefill) teach no cost."""
        is_drafting = num_block_tokens > 1
        if verify_seconds is not None:
            speed = self.costs.round_speed(num_block_tokens, verify_seconds)
            if num_model_steps > 0:
                step_seconds = draft_seconds / (num_model_steps + catch_up_steps)
                draft_step.add_timing(step_seconds, scale=speed)
                seeded_step = 0.0 if self.seeded is None else self.seeded.draft_step_seconds
                if draft_step is self.costs.draft_step and seeded_step > 0 and self.costs.reference:
                    self.observed_cost_ratios.append(step_seconds / seeded_step / speed)
            self.costs.add_block(num_block_tokens, verify_seconds)
            if self.is_hopeless and self.costs.draft_step.seeded is None:
                self.is_hopeless = self._best_possible_speedup() < 1.0  # the step judged: hopeless if it held
        self.clock.add(is_drafting, emitted, None if verify_seconds is None else draft_seconds + verify_seconds)
        self.exploration.learn(is_drafting)
