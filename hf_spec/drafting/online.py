"""What the automatic sizers learn during a call, shared by ``num_assistant_tokens="auto"`` (`AutoDraftLength`) and
``num_tree_nodes="auto"`` (`AutoTreeSize`).

- `PositionalAcceptance`: the probability that a drafted token is accepted once reached, per block position (or tree
  depth), counted with exponential forgetting and shrunk towards the pooled rate of all positions, itself shrunk
  towards a prior;
- `PassCosts`: seconds of a draft pass (and of its 2-token catch-up beyond that) and of target passes by size, seeded
  by the cost probe (`hf_spec.drafting.costs`) and then measured, each new timing clipped to within `OUTLIER_RATIO`
  of the estimate so far (on a shared machine the same pass can take twice as long from one second to the next); a
  size not measured yet is interpolated, or extrapolated with the slope measured so far;
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
import dataclasses
import itertools
import logging

from hf_spec.checks import check_int
from hf_spec.drafting.costs import CostTable

#: The longest wait between exploration rounds once explorations keep failing.
MAX_EXPLORE_EVERY = 128
#: Rounds of each kind, drafting and plain, before their measured speeds may overrule the cost model.
RATE_EVIDENCE = 6
#: Rounds whose choices a sizer keeps in ``chosen`` (a reused instance would otherwise grow without bound).
MAX_CHOSEN = 10_000
#: A timing more than this many times away from the running estimate counts as this far (`clipped`).
OUTLIER_RATIO = 1.5
#: A block size's cost leans on the probe's figure times the machine's current speed with this many timings' weight.
ANCHOR_WEIGHT = 1.0
#: Drafting must be measurably slower than plain steps, by this factor, before the clock overrules the cost model.
CLOCK_MARGIN = 0.9
#: A clock veto holds until the cost model's predicted gain from drafting is this many times the gain it refuted.
RETEST_GAIN = 1.15

logger = logging.getLogger(__name__)


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

    def forget(self) -> None:
        """Decay once without a new value."""
        self.total, self.weight = self.decay * self.total, self.decay * self.weight

    def get(self, default: float) -> float:
        return self.total / self.weight if self.weight > 0 else default


class PositionalAcceptance:
    """P(accepted | reached) at each of ``num_positions`` positions, shrunk towards the pooled rate and ``prior``."""

    def __init__(self, num_positions: int, prior: float, prior_weight: float, decay: float):
        self.prior, self.prior_weight = prior, prior_weight
        self.cells = [DecayedMean(decay) for _ in range(num_positions)]

    def add(self, position: int, is_accepted: bool) -> None:
        self.cells[position].add(float(is_accepted))

    def forget_unreached(self, num_reached: int) -> None:
        """End of a round that reached positions ``0 .. num_reached - 1``: the positions beyond forget once too, so an
        old rejection there fades (and the estimate falls back to the pooled rate) while rounds stop short of them.
        Without it, one early rejection at a deep position would keep k below that position for the rest of the
        call: a round of k tokens accepted in full tells nothing about position k."""
        for cell in self.cells[num_reached:]:
            cell.forget()

    def pooled(self) -> float:
        total = sum(cell.total for cell in self.cells) + self.prior * self.prior_weight
        return total / (sum(cell.weight for cell in self.cells) + self.prior_weight)

    def estimate(self) -> list[float]:
        pooled = self.pooled()
        return [(cell.total + pooled * self.prior_weight) / (cell.weight + self.prior_weight) for cell in self.cells]


class PassCosts:
    """Seconds of a draft pass over one token (``draft_step``), what its 2-token catch-up pass costs beyond that
    (``catch_up_ratio`` steps), and of target passes by size (``block_seconds``).

    A size is measured only while the sizer asks for it, so its estimate can go stale: a size timed once in a slow
    phase of a shared machine would otherwise keep its slow figure for the rest of the call, and keep the sizer off
    it. So every target pass also measures the machine's current ``speed`` against the probe's figure for its size,
    each size's own timings fade while other sizes are measured, and an estimate leans on the probe's figure times
    that speed (worth `ANCHOR_WEIGHT` timings) as its own timings fade. Without a probe, sizes are interpolated."""

    def __init__(self, decay: float, max_block_size: int):
        self.decay, self.max_block_size = decay, max_block_size
        self.draft_step = DecayedMean(decay)
        self.catch_up_ratio = 0.0  # a draft pass over 2 tokens costs 1 + this many steps (the probe's, if it timed it)
        self.blocks: dict[int, DecayedMean] = {}  # tokens in a target pass -> seconds
        self.reference: list[tuple[int, float]] = []  # the probe's (size, seconds), sorted by size, kept as measured
        self.speed = DecayedMean(decay)  # measured seconds / the probe's, over recent target passes of any size

    def seed(self, costs: CostTable, weight: float) -> None:
        if costs.draft_step_seconds > 0:
            self.draft_step.add(costs.draft_step_seconds, weight)
            two_tokens = costs.draft_pass_seconds.get(2, costs.draft_step_seconds)  # both timed in one interleaved loop
            self.catch_up_ratio = max(0.0, two_tokens / costs.draft_step_seconds - 1.0)
        probed = {size: seconds for size, seconds in costs.target_block_seconds.items() if size <= self.max_block_size}
        self.reference = sorted({**dict(self.reference), **probed}.items())
        if self.reference:
            self.speed.add(1.0, weight)  # the probe's figures as they were measured

    def add_block(self, size: int, seconds: float) -> None:
        own = self.blocks.setdefault(size, DecayedMean(self.decay))
        if not self.reference:
            own.add(clipped(seconds, own))
            return
        estimate = self.block_seconds(size)  # a first timing of a size is clipped too, against the anchored figure
        seconds = bounded(seconds, estimate)
        self.speed.add(clipped(seconds / interpolated(self.reference, size), self.speed))
        for other, mean in self.blocks.items():
            if other != size:
                mean.forget()
        own.add(seconds)

    def block_seconds(self, size: int) -> float | None:
        """Estimated seconds of a target pass over ``size`` tokens (``None`` before any measurement)."""
        if self.reference:
            anchored = self.speed.get(1.0) * interpolated(self.reference, size)
            own = self.blocks.get(size, DecayedMean(self.decay))
            return (own.total + ANCHOR_WEIGHT * anchored) / (own.weight + ANCHOR_WEIGHT)
        known = sorted((s, m.get(0.0)) for s, m in self.blocks.items())
        return interpolated(known, size) if known else None


def interpolated(known: list[tuple[int, float]], size: int) -> float:
    """Seconds at ``size`` from ``(size, seconds)`` pairs sorted by size: linear between two known sizes, extrapolated
    with the nearest slope (not below 0), the one figure itself when only one is known."""
    if len(known) == 1:
        return known[0][1]
    for (s0, t0), (s1, t1) in itertools.pairwise(known):
        if s0 <= size <= s1:
            return t0 + (t1 - t0) * (size - s0) / (s1 - s0)
    (s0, t0), (s1, t1) = (known[0], known[1]) if size < known[0][0] else (known[-2], known[-1])
    slope = max(0.0, (t1 - t0) / (s1 - s0))
    return max(1e-9, t1 + slope * (size - s1)) if size > s1 else max(1e-9, t0 - slope * (s0 - size))


def clipped(seconds: float, mean: DecayedMean) -> float:
    """A new timing, at most `OUTLIER_RATIO` times away from the estimate so far: on a shared machine one slow (or
    fast) phase is noise, and a single outlier would otherwise move the choice for many rounds."""
    return seconds if mean.weight <= 0 else bounded(seconds, mean.get(seconds))


def bounded(seconds: float, estimate: float) -> float:
    """``seconds`` moved to within `OUTLIER_RATIO` times of ``estimate``."""
    return min(max(seconds, estimate / OUTLIER_RATIO), estimate * OUTLIER_RATIO)


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
        self.is_hopeless = False  # measured costs say no draft can pay: k = 0 throughout
        self.has_costs = False
        self.chosen: collections.deque[int] = collections.deque(maxlen=MAX_CHOSEN)  # tokens drafted, last rounds

    def start_from(self, costs: CostTable, weight: float = 4.0) -> None:
        """Seed the costs with measured ones: the draft step and the machine's speed are each worth ``weight`` online
        measurements (which then take over); each block size leans on the probe's figure (`PassCosts`)."""
        self.costs.seed(costs, weight)
        self.has_costs = True
        best = costs.best_possible_speedup()
        self.is_hopeless = best < 1.0
        if self.is_hopeless:
            logger.warning(
                "automatic draft size: speculation cannot pay on this machine with these models; even a draft "
                "accepted every time would reach at most %.2fx target-only decoding (draft step / target step c = "
                "%.2f, a 2-token target pass costs %.2f steps). Decoding with plain target steps.",
                best, costs.cost_ratio, costs.block_cost(1))

    def block_seconds(self, size: int) -> float | None:
        return self.costs.block_seconds(size)

    def _forced_choice(self) -> int | None:
        """Tokens to draft when the cost model is not asked: 0 when hopeless, ``initial`` before any cost, 1 to
        explore."""
        self.exploration.is_exploring = False
        if self.is_hopeless:
            return 0
        if self.block_seconds(1) is None:
            return self.initial
        if self.exploration.is_due(self.first.cells[0].count):
            self.exploration.is_exploring = True
            return 1
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
            if num_model_steps > 0:
                draft_step.add(clipped(draft_seconds / (num_model_steps + catch_up_steps), draft_step))
            self.costs.add_block(num_block_tokens, verify_seconds)
        self.clock.add(is_drafting, emitted, None if verify_seconds is None else draft_seconds + verify_seconds)
        self.exploration.learn(is_drafting)
