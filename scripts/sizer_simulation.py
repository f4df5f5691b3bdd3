"""Auto k against every fixed k on a simulated pair, with and without phases of a slower machine.

    python scripts/sizer_simulation.py --calls 150 --output sizer_simulation.json
    python scripts/sizer_simulation.py --calls 150 --catch-up 0.7 --output catch_up_0.7.json

No model runs: a round's accepted count is drawn (i.i.d. acceptance ``a`` per drafted token), a draft step costs ``c``
target steps and a target pass over m tokens ``1 + 0.03 (m - 1)``, each timing times a uniform factor in [0.9, 1.1].
With ``--phases`` the machine switches between normal and 2x slower with probability 0.08 per round (spells of about
12 rounds), as a shared VM does. Each call decodes 128 tokens; `AutoDraftLength` starts from a probe of the normal
speed, as in ``generate()``. Reported: auto k's mean tokens per second over the best fixed k's (k = 1..8).

With ``--catch-up P`` the draft's first pass of a round costs P more draft steps when it catches up on a token: after
a round accepted in full (the last drafted and the bonus token), or after plain steps, each token skipped beyond the
first 0.07 steps more (a 16-token pass costs about 2 steps on AVX2). P = 0.7 was measured on AVX512-BF16, 0.1 to
0.2 on AVX2. Auto k then runs twice: told the tokens caught up on (``num_catch_up_tokens``, as ``generate()`` does),
and not told (the catch-up folded into the step's cost). Without ``--catch-up`` the script is what it was.

With ``--paired`` call i of every method draws from ``random.Random(i)`` (without it, the methods of a case share
one stream, so a method's choices change the draws of the next: differences of a few points between auto variants
were that noise), k = 0 (target-only) counts among the fixed settings, and a case where no draft pays is added.

With ``--probe-error F`` the probe that seeds every auto call timed the draft F times too slow (a probe in a slow
phase of the machine: F = 2.5 was seen on AVX2, 295 ms against 119 ms in the run), as ``generate()``'s cost probe,
made once per process, seeds every call of that process.

With ``--bursty`` the cases are text in easy and hard stretches (`Bursty`, paired): acceptance rises with the block
position, as on code, where i.i.d. draws at the measured acceptance under-predict the tokens of a long block.

With ``--replay FILE`` (an `hf-spec eval-draft --output` report) the texts are real: each call decodes one of the
report's continuations (the target's own text, teacher-forced), and a token drafted at text position t is accepted
with that position's measured probability (1 - TV(p, q) sampled, 0 or 1 greedy; `Replay`), so acceptance has the
text's own structure: easy lines, hard names, the end of a completion. ``--c`` and ``--block-slope`` set the costs
(a target pass over m tokens costs ``1 + slope (m - 1)`` steps); every fixed k of 0 .. 10 and auto k run on the same
draws (paired), and auto's per-text ratio to the best fixed k is reported beside the mean.

With ``--reach`` (and ``--replay``) auto k runs twice: learning from the drawn counts, and from the reach
(`hf_spec.sizing.estimates.PositionalAcceptance.add_reach`, as ``generate()`` does on sampled calls): each drafted
token's chance is the text position's measured probability. The real rule's chance for a drafted token,
min(1, p / q), varies around that mean (1 - TV) from token to token, so the simulation's reach is less noisy than
``generate()``'s: it bounds what the reach can gain.

``--reach-errors Z`` sets `hf_spec.sizing.draft_length.REACH_ERRORS` (0: auto never reaches one position past
its best k, as before that rule), to compare the rule on and off on the same draws.

A last case is one long call whose text turns from prose to code: 1,024 tokens, a = 0.2 for the first 256 and 0.9
after, c = 0.3 (without phases; call i draws from seed i for every method, so calls are paired). It also reports the
share of calls whose last 100 rounds drafted in fewer than half (auto stuck at plain steps on code).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import operator
import random
import statistics

from hf_spec.sizing import draft_length
from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.draft_length import AutoDraftLength

CASES = [(0.65, 0.30), (0.65, 0.42), (0.85, 0.42), (0.90, 0.30)]  # (acceptance, draft step / target step)
BURSTY_CASES = [((0.995, 0.1, 0.05, 0.5), 0.47), ((0.995, 0.1, 0.05, 0.5), 0.30), ((0.97, 0.3, 0.1, 0.4), 0.47)]
SHIFT = {"start": (0.2, 256), "a": 0.9, "c": 0.3, "tokens": 1024}  # prose (a = 0.2) for 256 tokens, then code


class Bursty:
    """Text whose tokens come in easy and hard stretches (code: a line the draft knows, then a name it must guess): a
    token's acceptance is ``easy`` or ``hard`` by a two-state Markov chain over the text's tokens, leaving easy with
    ``to_hard`` per token and hard with ``to_easy``. Acceptance at a block position then rises with the position (a
    round that reached it is likelier in an easy stretch), as measured on code: fixed k = 4 emitted 4.29 tokens a
    pass at 0.82 acceptance, where i.i.d. draws give 3.49."""

    def __init__(self, easy: float, hard: float, to_hard: float, to_easy: float):
        self.easy, self.hard, self.to_hard, self.to_easy = easy, hard, to_hard, to_easy
        self.is_easy = True

    def mean(self) -> float:
        share = self.to_easy / (self.to_easy + self.to_hard)
        return share * self.easy + (1 - share) * self.hard

    def step(self, rng: random.Random) -> None:
        self.is_easy = rng.random() >= self.to_hard if self.is_easy else rng.random() < self.to_easy

    def draw(self, k: int, rng: random.Random) -> int:
        """Tokens accepted of ``k`` drafted; the text moves on by the tokens emitted (accepted, and the target's)."""
        accepted = k
        for i in range(k):
            if rng.random() >= (self.easy if self.is_easy else self.hard):
                accepted = i
                break
            self.step(rng)
        self.step(rng)
        return accepted


class Replay:
    """A real text's acceptance, position by position (`hf_spec.evaluation.draft_fit.AcceptanceReport`'s
    ``acceptance_along_text``): a token drafted at text position t is accepted with probability ``along[t]``, nothing
    past the text's end. The text moves on by the tokens emitted; a call starts at its beginning."""

    def __init__(self, along: list[float]):
        self.along, self.position = along, 0

    def mean(self) -> float:
        return statistics.mean(self.along)

    def chances(self, k: int) -> list[float]:
        """The acceptance probabilities of the next ``k`` drafted tokens (0 past the text's end)."""
        return [self.along[t] if t < len(self.along) else 0.0 for t in range(self.position, self.position + k)]

    def draw(self, k: int, rng: random.Random) -> int:
        t = self.position
        accepted = next((i for i in range(k) if t + i >= len(self.along) or rng.random() >= self.along[t + i]), k)
        self.position += accepted + 1
        return accepted


#: A target pass over m tokens costs ``1 + BLOCK_SLOPE (m - 1)`` steps (``--block-slope`` changes it).
BLOCK_SLOPE = 0.03


def block(size: int) -> float:
    return 1.0 + BLOCK_SLOPE * (size - 1)


def call(sizer: AutoDraftLength | int, a: float, c: float, phases: bool, rng: random.Random, tokens: int = 128,
         start: tuple[float, int] = (0.0, 0), catch_up: float = 0.0, told: bool = True, reach: bool = False):
    """One call; ``sizer`` is a fixed k or an `AutoDraftLength`; ``start``: the acceptance of the first tokens, and
    how many; ``catch_up``: draft steps more for a pass that catches up; ``told``: the sizer hears of it;
    ``reach``: the sizer learns from a `Replay`'s chances instead of the count drawn. Returns emitted tokens per
    second."""
    seconds = emitted = 0.0
    a = copy.copy(a)  # a `Bursty` text starts each call afresh, in an easy stretch
    slow, first, lag = False, True, 0  # lag: tokens the draft's next first pass feeds beyond one
    while emitted < tokens:
        k = sizer if isinstance(sizer, int) else sizer.choose(limit=int(tokens - emitted))
        a_now = start[0] if emitted < start[1] else a
        chances = a_now.chances(k) if reach and isinstance(a_now, Replay) else None
        if isinstance(a_now, (Bursty, Replay)):
            accepted = a_now.draw(k, rng)
        else:
            accepted = next((i for i in range(k) if rng.random() >= a_now), k)
        if phases and rng.random() < 0.08:
            slow = not slow
        factor = 2.0 if slow else 1.0
        extra = lag if k > 0 else 0
        premium = catch_up * min(extra, 1) + 0.07 * max(0, extra - 1) if catch_up else 0.0
        draft = (k + premium) * c * factor * rng.uniform(0.9, 1.1)
        verify = block(k + 1) * factor * rng.uniform(0.9, 1.1)
        if not isinstance(sizer, int):
            sizer.update(k, [accepted], draft_seconds=draft, num_model_steps=k,
                         verify_seconds=None if first else verify, num_catch_up_tokens=extra if told else 0,
                         reach=None if chances is None else [[1.0, *itertools.accumulate(chances, operator.mul)]])
        lag = lag + 1 if k == 0 else int(accepted == k)
        first = False
        seconds, emitted = seconds + draft + verify, emitted + accepted + 1
    return emitted / seconds


def auto_sizer(c: float, catch_up: float = 0.0, told: bool = True, probe_error: float = 1.0) -> AutoDraftLength:
    """Started from a probe of the normal speed (the draft's ``probe_error`` times too slow); told of catch-ups, the
    probe's 2-token draft pass too."""
    sizer = AutoDraftLength()
    probed = c * probe_error
    passes = {1: probed, 2: (1 + catch_up) * probed} if catch_up and told else {}
    sizer.start_from(CostTable(1.0, probed, {size: block(size) for size in range(1, 12)}, passes))
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


def replay_rows(path: str, c: float, calls: int, reach: bool = False, tokens: int | None = None) -> list[dict]:
    """Every fixed k (0 .. 10) and auto k on each text of an `hf-spec eval-draft` report, ``calls`` paired draws per
    text (seed i for call i of every method): the mean over texts, and auto over the best fixed k per text; with
    ``reach``, auto learning from the reach too (``auto_reach``); ``tokens``: each text's first tokens only."""
    with open(path) as file:
        report = json.load(file)
    report = report.get("predicted", report)  # the CLI's report holds `AcceptanceReport` under "predicted"
    texts = [Replay(along[:tokens]) for along in report["acceptance_along_text"] if along]
    common = {"c": c, "phases": False, "catch_up": 0.0}
    per_text = []
    for text in texts:
        runs = {k: [call(k, a=text, rng=random.Random(i), tokens=len(text.along), **common) for i in range(calls)]
                for k in range(11)}
        for name, learns_reach in (("auto", False), ("auto_reach", True))[:1 + reach]:
            runs[name] = [call(auto_sizer(c), a=text, rng=random.Random(i), tokens=len(text.along),
                               reach=learns_reach, **common) for i in range(calls)]
        per_text.append({name: statistics.mean(rates) for name, rates in runs.items()})
    mean = {name: statistics.mean(row[name] for row in per_text) for name in per_text[0]}
    best = max(range(11), key=mean.get)
    ratios = [row["auto"] / max(row[k] for k in range(11)) for row in per_text]
    acceptance = statistics.mean(text.mean() for text in texts)
    with_reach = f", auto from the reach {mean['auto_reach'] / mean[best]:.3f}" if reach else ""
    print(f"{path} c={c} slope={BLOCK_SLOPE}: {len(texts)} texts, acceptance {acceptance:.3f}"
          f"; best fixed k = {best} ({mean[best]:.3f}), auto {mean['auto']:.3f} = {mean['auto'] / mean[best]:.3f} of "
          f"it{with_reach}; auto / each text's best fixed k: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    row = {"replay": path, "settings": report.get("settings"), "cost_ratio": c, "block_slope": BLOCK_SLOPE,
           "texts": len(texts), "tokens": tokens, "best_fixed_k": best, "mean": mean,
           "auto_over_best_fixed": mean["auto"] / mean[best], "auto_over_each_texts_best": ratios,
           "per_text": per_text}
    if reach:
        row["auto_reach_over_best_fixed"] = mean["auto_reach"] / mean[best]
    return [row]


def main() -> None:
    global BLOCK_SLOPE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--output", default=None)
    parser.add_argument("--catch-up", type=float, default=0.0, help="draft steps per token caught up on")
    parser.add_argument("--probe-error", type=float, default=1.0, help="the probe's draft step over the true one")
    parser.add_argument("--paired", action="store_true", help="the same draws for every method; k = 0 among the fixed "
                        "settings; a case where no draft pays (a = 0.35) added")
    parser.add_argument("--bursty", action="store_true", help="only the cases whose text comes in easy and hard "
                        "stretches (`Bursty`: code-like), paired")
    parser.add_argument("--replay", nargs="+", default=None, metavar="FILE",
                        help="`hf-spec eval-draft --output` reports: replay their texts' measured acceptance")
    parser.add_argument("--reach", action="store_true", help="--replay: auto also learning from the reach")
    parser.add_argument("--tokens", type=int, default=None, help="--replay: each text's first tokens only")
    parser.add_argument("--c", type=float, nargs="+", default=[0.42], help="draft step / target step (--replay)")
    parser.add_argument("--block-slope", type=float, default=BLOCK_SLOPE, help="target pass cost per extra token")
    parser.add_argument("--reach-errors", type=float, default=None,
                        help="`REACH_ERRORS` for auto k (0: never reach past the best k; for before/after runs)")
    args = parser.parse_args()
    BLOCK_SLOPE = args.block_slope
    if args.reach_errors is not None:
        draft_length.REACH_ERRORS = args.reach_errors
    if args.replay:
        rows = [row for path in args.replay for c in args.c
                for row in replay_rows(path, c, args.calls, args.reach, args.tokens)]
        if args.output:
            with open(args.output, "w") as file:
                json.dump({"calls": args.calls, "rows": rows}, file, indent=1)
        return
    rows = []
    cases = CASES + ([(0.35, 0.42)] if args.paired else [])
    if args.bursty:
        cases, args.paired = [(Bursty(*text), c) for text, c in BURSTY_CASES], True
    for phases in (False, True):
        for a, c in cases:
            rows.append(case_row(a, c, phases, args.calls, args.catch_up, args.probe_error, args.paired))
    if not args.catch_up and args.probe_error == 1.0 and not args.bursty:
        rows.append(shift_row(args.calls))
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"calls": args.calls, "catch_up": args.catch_up, "probe_error": args.probe_error,
                       "paired": args.paired, "rows": rows}, file, indent=1)


def case_row(a: float, c: float, phases: bool, calls: int, catch_up: float, probe_error: float = 1.0,
             paired: bool = False) -> dict:
    """Every fixed k and auto k (told of catch-ups, and not, where there are any) on the same draws' seed; ``paired``:
    call i of every method draws from ``random.Random(i)``, and k = 0 (target-only) is among the fixed settings."""
    shared = random.Random(3)
    common = {"a": a, "c": c, "phases": phases, "catch_up": catch_up}
    fixed = {k: statistics.mean(call(k, rng=rng, **common) for rng in streams(calls, paired, shared))
             for k in range(0 if paired else 1, 9)}
    best = max(fixed, key=fixed.get)
    text = vars(a) if isinstance(a, Bursty) else None
    row = {"phases": phases, "acceptance": a.mean() if text else a, "bursty": text, "cost_ratio": c,
           "catch_up": catch_up, "best_fixed_k": best, "fixed": fixed}
    for told in (True, False) if catch_up else (True,):
        runs = [call(auto_sizer(c, catch_up, told, probe_error), rng=rng, told=told, **common)
                for rng in streams(calls, paired, shared)]
        auto = statistics.mean(runs)
        name = "auto" if told else "auto_not_told"
        row.update({name: auto, f"{name}_over_best_fixed": auto / fixed[best]})
    print(f"phases={phases!s:5} a={row['acceptance']:.3f}{' bursty' if text else ''} c={c}: best fixed k = {best}, "
          "auto / best fixed = "
          + ", ".join(f"{row[name]:.3f} ({name})" for name in row if name.endswith("_over_best_fixed")))
    return row


def streams(calls: int, paired: bool, shared: random.Random) -> list[random.Random]:
    """One method's random stream per call: seeds 0 .. calls - 1 afresh when paired, else the case's shared one."""
    return [random.Random(i) for i in range(calls)] if paired else [shared] * calls


if __name__ == "__main__":
    main()
