"""Auto k against every fixed k on a simulated pair, with and without phases of a slower machine.

    python scripts/sizer_simulation.py --calls 150 --output benchmarks/2026-12-02f/sizer_simulation.json

No model runs: a round's accepted count is drawn (i.i.d. acceptance ``a`` per drafted token), a draft step costs ``c``
target steps and a target pass over m tokens ``1 + 0.03 (m - 1)``, each timing times a uniform factor in [0.9, 1.1].
With ``--phases`` the machine switches between normal and 2x slower with probability 0.08 per round (spells of about
12 rounds), as a shared VM does. Each call decodes 128 tokens; `AutoDraftLength` starts from a probe of the normal
speed, as in ``generate()``. Reported: auto k's mean tokens per second over the best fixed k's (k = 1..8).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from hf_spec.drafting.costs import CostTable
from hf_spec.drafting.draft_length import AutoDraftLength

CASES = [(0.65, 0.30), (0.65, 0.42), (0.85, 0.42), (0.90, 0.30)]  # (acceptance, draft step / target step)


def block(size: int) -> float:
    return 1.0 + 0.03 * (size - 1)


def call(sizer: AutoDraftLength | int, a: float, c: float, phases: bool, rng: random.Random, tokens: int = 128):
    """One call; ``sizer`` is a fixed k or an `AutoDraftLength`. Returns emitted tokens per second."""
    seconds = emitted = 0.0
    slow, first = False, True
    while emitted < tokens:
        k = sizer if isinstance(sizer, int) else sizer.choose(limit=int(tokens - emitted))
        accepted = next((i for i in range(k) if rng.random() >= a), k)
        if phases and rng.random() < 0.08:
            slow = not slow
        factor = 2.0 if slow else 1.0
        draft = k * c * factor * rng.uniform(0.9, 1.1)
        verify = block(k + 1) * factor * rng.uniform(0.9, 1.1)
        if not isinstance(sizer, int):
            sizer.update(k, [accepted], draft_seconds=draft, num_model_steps=k,
                         verify_seconds=None if first else verify)
        first = False
        seconds, emitted = seconds + draft + verify, emitted + accepted + 1
    return emitted / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    rows = []
    for phases in (False, True):
        for a, c in CASES:
            rng = random.Random(3)
            fixed = {k: statistics.mean(call(k, a, c, phases, rng) for _ in range(args.calls)) for k in range(1, 9)}
            autos = []
            for _ in range(args.calls):
                sizer = AutoDraftLength()
                sizer.start_from(CostTable(1.0, c, {size: block(size) for size in range(1, 12)}))
                autos.append(call(sizer, a, c, phases, rng))
            best = max(fixed, key=fixed.get)
            rows.append({"phases": phases, "acceptance": a, "cost_ratio": c, "best_fixed_k": best,
                         "fixed": fixed, "auto": statistics.mean(autos),
                         "auto_over_best_fixed": statistics.mean(autos) / fixed[best]})
            print(f"phases={phases!s:5} a={a} c={c}: best fixed k = {best}, auto / best fixed = "
                  f"{rows[-1]['auto_over_best_fixed']:.3f}")
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"calls": args.calls, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
