"""Auto k against every fixed k on a simulated pair, with and without phases of a slower machine.

    python scripts/sizer_simulation.py --calls 150 --output benchmarks/2026-12-02f/sizer_simulation.json

No model runs: a round's accepted count is drawn (i.i.d. acceptance ``a`` per drafted token), a draft step costs ``c``
target steps and a target pass over m tokens ``1 + 0.03 (m - 1)``, each timing times a uniform factor in [0.9, 1.1].
With ``--phases`` the machine switches between normal and 2x slower with probability 0.08 per round (spells of about
12 rounds), as a shared VM does. Each call decodes 128 tokens; `AutoDraftLength` starts from a probe of the normal
speed, as in ``generate()``. Reported: auto k's mean tokens per second over the best fixed k's (k = 1..8).

A last case is one long call whose text turns from prose to code: 1,024 tokens, a = 0.2 for the first 256 and 0.9
after, c = 0.3 (without phases; call i draws from seed i for every method, so calls are paired). It also reports the
share of calls whose last 100 rounds drafted in fewer than half (auto stuck at plain steps on code).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from hf_spec.drafting.costs import CostTable
from hf_spec.drafting.draft_length import AutoDraftLength

CASES = [(0.65, 0.30), (0.65, 0.42), (0.85, 0.42), (0.90, 0.30)]  # (acceptance, draft step / target step)
SHIFT = {"start": (0.2, 256), "a": 0.9, "c": 0.3, "tokens": 1024}  # prose (a = 0.2) for 256 tokens, then code


def block(size: int) -> float:
    return 1.0 + 0.03 * (size - 1)


def call(sizer: AutoDraftLength | int, a: float, c: float, phases: bool, rng: random.Random, tokens: int = 128,
         start: tuple[float, int] = (0.0, 0)):
    """One call; ``sizer`` is a fixed k or an `AutoDraftLength`; ``start``: the acceptance of the first tokens, and
    how many. Returns emitted tokens per second."""
    seconds = emitted = 0.0
    slow, first = False, True
    while emitted < tokens:
        k = sizer if isinstance(sizer, int) else sizer.choose(limit=int(tokens - emitted))
        a_now = start[0] if emitted < start[1] else a
        accepted = next((i for i in range(k) if rng.random() >= a_now), k)
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


def auto_sizer(c: float) -> AutoDraftLength:
    sizer = AutoDraftLength()
    sizer.start_from(CostTable(1.0, c, {size: block(size) for size in range(1, 12)}))
    return sizer


def shift_row(calls: int) -> dict:
    """The long prose-then-code call, paired: call i of every method draws from ``random.Random(i)``."""
    fixed = {k: statistics.mean(call(k, phases=False, rng=random.Random(i), **SHIFT) for i in range(calls))
             for k in range(9)}  # k = 0: target-only
    autos, stuck = [], 0
    for i in range(calls):
        sizer = auto_sizer(SHIFT["c"])
        autos.append(call(sizer, phases=False, rng=random.Random(i), **SHIFT))
        stuck += sum(k > 0 for k in list(sizer.chosen)[-100:]) < 50
    best = max(fixed, key=fixed.get)
    print(f"prose then code: best fixed k = {best}, auto / best fixed = {statistics.mean(autos) / fixed[best]:.3f}, "
          f"auto stuck at plain steps in {stuck} of {calls} calls")
    return {"case": "prose then code", **SHIFT, "best_fixed_k": best, "fixed": fixed, "auto": statistics.mean(autos),
            "auto_over_best_fixed": statistics.mean(autos) / fixed[best], "calls_stuck_at_plain_steps": stuck}


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
                autos.append(call(auto_sizer(c), a, c, phases, rng))
            best = max(fixed, key=fixed.get)
            rows.append({"phases": phases, "acceptance": a, "cost_ratio": c, "best_fixed_k": best,
                         "fixed": fixed, "auto": statistics.mean(autos),
                         "auto_over_best_fixed": statistics.mean(autos) / fixed[best]})
            print(f"phases={phases!s:5} a={a} c={c}: best fixed k = {best}, auto / best fixed = "
                  f"{rows[-1]['auto_over_best_fixed']:.3f}")
    rows.append(shift_row(args.calls))
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"calls": args.calls, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
