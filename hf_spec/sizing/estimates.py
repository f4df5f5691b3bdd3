"""The running estimates the automatic sizers (`hf_spec.sizing.online`) learn from: means that forget, acceptance
per position, and the seconds of draft and target passes.

- `DecayedMean`: a mean with exponential forgetting. `DecayedMean.add_timing` takes a timing clipped to within
  `OUTLIER_RATIO` of the estimate so far (on a shared machine the same pass can take twice as long from one second to
  the next), except that a seed (the probe's figure) gives way when the first `SHIFT_EVIDENCE` timings after it all
  lie beyond that on the same side: the probe was made in another phase of the machine;
- `PositionalAcceptance`: the probability that a drafted token is accepted once reached, per block position (or tree
  depth), counted with exponential forgetting and shrunk towards the pooled rate of all positions, itself shrunk
  towards a prior;
- `PassCosts`: seconds of a draft pass (and of its 2-token catch-up beyond that) and of target passes by size, seeded
  by the cost probe (`hf_spec.timing.probe`) and then measured; a size not measured yet is interpolated, or
  extrapolated with the slope measured so far.
"""

from __future__ import annotations

import dataclasses
import math

from hf_spec.sizing.costs import CostTable, interpolated

#: A timing more than this many times away from the running estimate counts as this far (`DecayedMean.add_timing`).
OUTLIER_RATIO = 1.5
#: The first timings after a seed that, all beyond `OUTLIER_RATIO` of it on one side (at the same machine speed),
#: overrule it.
SHIFT_EVIDENCE = 3
#: A block size's cost leans on the probe's figure times the machine's current speed with this many timings' weight.
ANCHOR_WEIGHT = 1.0


@dataclasses.dataclass
class DecayedMean:
    """A mean with exponential forgetting: each new value weighs ``1 - decay`` of the total once warmed up."""

    decay: float
    total: float = 0.0
    weight: float = 0.0
    count: int = 0  # values added, without forgetting
    seeded: float | None = None  # a measured start (the probe's) that the first own timings have not yet judged
    first_timings: list[float] = dataclasses.field(default_factory=list)  # the timings since ``seeded``
    first_scales: list[float] = dataclasses.field(default_factory=list)  # and the machine's speed in their rounds

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.decay * self.total + value * weight
        self.weight = self.decay * self.weight + weight
        self.count += 1

    def seed(self, value: float, weight: float) -> None:
        """Start from a figure measured elsewhere (the cost probe), worth ``weight`` values (see `add_timing`)."""
        self.add(value, weight)
        self.seeded, self.first_timings, self.first_scales = value, [], []

    def add_timing(self, seconds: float, scale: float = 1.0) -> None:
        """A timing, clipped to within `OUTLIER_RATIO` of the estimate so far: one slow (or fast) pass on a shared
        machine is noise, and would otherwise move the choice for many rounds.

        But a seed can be wrong: the probe runs once per process, and one that timed the draft in a slow phase of the
        machine would come down only slowly under clipping, keeping auto k at plain steps for much of a call. So if
        the first `SHIFT_EVIDENCE` timings after a seed, each divided by
        ``scale`` (the machine's speed against the probe's in that round, from the target's pass), all lie beyond
        `OUTLIER_RATIO` of it on the same side, the seed gives way: the estimate restarts from them. A phase that
        slows both models alike is not a wrong seed (the ratio of their costs, which decides k, holds), and later
        timings are only clipped."""
        estimate = self.get(seconds)
        self.add(seconds if self.weight <= 0 else bounded(seconds, estimate))
        if self.seeded is None:
            return
        self.first_timings.append(seconds)
        self.first_scales.append(scale)
        if len(self.first_timings) < SHIFT_EVIDENCE:
            return
        ratios = [timing / speed / self.seeded for timing, speed in zip(self.first_timings, self.first_scales)]
        if all(ratio > OUTLIER_RATIO for ratio in ratios) or all(ratio < 1 / OUTLIER_RATIO for ratio in ratios):
            count, self.total, self.weight = self.count, 0.0, 0.0
            for timing in self.first_timings:
                self.add(timing)
            self.count = count
        self.seeded, self.first_timings, self.first_scales = None, [], []

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

    def add_counts(self, num_drafted: int, num_accepted: int) -> None:
        """A row that kept ``num_accepted`` of ``num_drafted`` tokens: each position it reached, accepted or not."""
        for position in range(min(num_drafted, num_accepted + 1)):
            self.add(position, position < num_accepted)

    def add_reach(self, reach: list[float]) -> None:
        """A row's reach ``[1, r_1 .. r_k]``: the chance to keep at least j of its k drafted tokens, over the
        acceptance rule's randomness (`hf_spec.rejection`). Position j counts as reached with weight r_j and
        accepted with r_{j+1}: the expectation of what `add_counts` adds over the rule's uniforms, so the estimate
        keeps its mean and loses the noise of the draw. Where a row's reach fell to 0, later positions are not
        observed (they forget, as unreached ones do)."""
        for position, (reached, kept) in enumerate(zip(reach, reach[1:])):
            if reached <= 0.0:
                self.cells[position].forget()
            else:
                self.cells[position].add(min(1.0, kept / reached), weight=reached)

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

    def hopeful(self, z: float, position: int = 0) -> list[float]:
        """`estimate` with one ``position`` raised by ``z`` standard errors (its observations plus the prior's
        weight): what the acceptance there may still be while its evidence is thin (after few draws, or where rounds
        have stopped short of it)."""
        estimate = self.estimate()
        value, weight = estimate[position], self.cells[position].weight + self.prior_weight
        estimate[position] = min(1.0, value + z * math.sqrt(value * (1.0 - value) / weight))
        return estimate


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

    def seed(self, costs: CostTable, weight: float, catch_up: bool = True) -> None:
        if costs.draft_step_seconds > 0:
            self.draft_step.seed(costs.draft_step_seconds, weight)
            two_tokens = costs.draft_pass_seconds.get(2, costs.draft_step_seconds)  # both timed in one interleaved loop
            self.catch_up_ratio = max(0.0, two_tokens / costs.draft_step_seconds - 1.0) if catch_up else 0.0
        probed = {size: seconds for size, seconds in costs.target_block_seconds.items() if size <= self.max_block_size}
        self.reference = sorted({**dict(self.reference), **probed}.items())
        if self.reference:
            self.speed.add(1.0, weight)  # the probe's figures as they were measured

    def add_block(self, size: int, seconds: float) -> None:
        own = self.blocks.setdefault(size, DecayedMean(self.decay))
        if not self.reference:
            own.add_timing(seconds)
            return
        estimate = self.block_seconds(size)  # a first timing of a size is clipped too, against the anchored figure
        seconds = bounded(seconds, estimate)
        self.speed.add_timing(self.round_speed(size, seconds))
        for other, mean in self.blocks.items():
            if other != size:
                mean.forget()
        own.add(seconds)

    def round_speed(self, size: int, seconds: float | None) -> float:
        """A target pass's ``seconds`` over the probe's figure for its ``size`` (1 without either)."""
        return seconds / interpolated(self.reference, size) if self.reference and seconds else 1.0

    def block_seconds(self, size: int) -> float | None:
        """Estimated seconds of a target pass over ``size`` tokens (``None`` before any measurement)."""
        if self.reference:
            anchored = self.speed.get(1.0) * interpolated(self.reference, size)
            own = self.blocks.get(size, DecayedMean(self.decay))
            return (own.total + ANCHOR_WEIGHT * anchored) / (own.weight + ANCHOR_WEIGHT)
        known = sorted((s, m.get(0.0)) for s, m in self.blocks.items())
        return interpolated(known, size) if known else None


def bounded(seconds: float, estimate: float) -> float:
    """``seconds`` moved to within `OUTLIER_RATIO` times of ``estimate``."""
    return min(max(seconds, estimate / OUTLIER_RATIO), estimate * OUTLIER_RATIO)
