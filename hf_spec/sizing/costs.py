"""A round's costs as the sizers read them: `CostTable` (seconds of a target step, of target passes by size, of the
draft's passes), `interpolated` between measured sizes, and `merged_costs`. The tables are measured by the timing
probe (`hf_spec.timing.probe`); this module only reads them."""

from __future__ import annotations

import dataclasses
import itertools

from hf_spec.sizing.speedup import predicted_speedup


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Median seconds of a target step, of target passes over several block sizes, and of a draft step."""

    target_step_seconds: float
    draft_step_seconds: float  # 0 for a drafter without a model (prompt lookup)
    target_block_seconds: dict[int, float]  # tokens in the pass (k + 1) -> seconds; 1 is the step
    draft_pass_seconds: dict[int, float] = dataclasses.field(default_factory=dict)  # tokens -> seconds (model drafts)

    @property
    def cost_ratio(self) -> float:
        """c: draft step / target step."""
        return self.draft_step_seconds / self.target_step_seconds

    def block_cost(self, k: int) -> float:
        """b: a target pass over k + 1 tokens / a target step."""
        return self.target_block_seconds[k + 1] / self.target_step_seconds

    def best_possible_speedup(self) -> float:
        """The formula's speed-up at acceptance 1 for the best measured k: no draft can do better here."""
        return max(predicted_speedup(1.0, size - 1, self.cost_ratio, self.block_cost(size - 1))
                   for size in self.target_block_seconds if size > 1)


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


def merged_costs(known: CostTable, measured: CostTable) -> CostTable:
    """``known`` with the sizes and widths only ``measured`` has, scaled by the ratio of the two tables' steps (each
    measurement times the target step, and the draft step, again)."""
    target_scale = known.target_step_seconds / measured.target_step_seconds
    draft_scale = known.draft_step_seconds / measured.draft_step_seconds if measured.draft_step_seconds else 1.0
    blocks = {**{size: seconds * target_scale for size, seconds in measured.target_block_seconds.items()},
              **known.target_block_seconds}
    passes = {**{width: seconds * draft_scale for width, seconds in measured.draft_pass_seconds.items()},
              **known.draft_pass_seconds}
    return CostTable(known.target_step_seconds, known.draft_step_seconds, dict(sorted(blocks.items())),
                     dict(sorted(passes.items())))
