"""Sampled speeds of an `hf-spec bench` run with the luck of the draws taken out (control variates).

    python scripts/sampled_speeds.py benchmarks/avx512-bf16-amd/2026-12-08-prose-sampled-64.json \
        --texts benchmarks/avx512-bf16-amd/2026-12-08-prose-sampled-64-texts

On sampled text every method writes texts of its own and its acceptance rule draws its own uniforms, so a few dozen
calls per method leave its speed a few percent away from its mean, more than the gap between auto k and the best
fixed k. Two quantities of each call have the same mean for every method, and explain much of that spread:

- the luck of the rule's draws, ``(accepted - expected_accepted) / new tokens``: what the acceptance rule kept minus
  what it expected to keep given each round's draft (`hf_spec.stats.SpeculativeStats.expected_accepted`, the sum of
  its reach). Its mean is exactly 0 for every method (a martingale over rounds); 0 for target-only and greedy;
- with ``--texts`` (`scripts/bench_text_acceptance.py`'s folder), how easy the call's text was for the draft: its mean
  1 - TV(p, q) over the text, teacher-forced. Every method's texts follow the target's law, so its mean is the same
  for every method; the pooled mean over all methods' texts stands in for it.

The log of each call's seconds per token is regressed on both, within each method (one slope per quantity, pooled
over the methods that draft; target-only is left as measured), and each method's mean log time is moved to where
both quantities sit at their common mean. With a slope estimated from the data the adjustment keeps the mean up to
O(1/n) and lowers the variance by the share of the spread the two explain. The raw figure is printed beside it,
with standard errors of both; the ratio to the fastest fixed k is the adjusted speeds' ratio.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def calls_by_method(report: dict, workload: str, setting: str) -> dict[str, list[dict]]:
    """The report's calls of one cell, per method, in the run's order (``prompt``, ``repeat``)."""
    groups: dict[str, list[dict]] = {}
    for run in report["runs"]:
        if run["workload"] == workload and run["setting"] == setting and not run.get("error"):
            groups.setdefault(run["method"], []).append(run)
    for runs in groups.values():
        runs.sort(key=lambda run: (run["prompt"], run.get("repeat", 0)))
    return groups


def text_scores(folder: Path | None, workload: str, setting: str, method: str, runs: list[dict]) -> np.ndarray | None:
    """Each call's teacher-forced acceptance from `scripts/bench_text_acceptance.py`'s report, or ``None``."""
    path = None if folder is None else folder / f"{workload}_{setting}_{method.replace('@', '-at-')}.json"
    if path is None or not path.is_file():
        return None
    scored = json.loads(path.read_text())
    if scored["prompts"] != [run["prompt"] for run in runs]:
        raise ValueError(f"{path} scores prompts {scored['prompts']}, the run has {[run['prompt'] for run in runs]}")
    return np.array(scored["predicted"]["acceptance_by_sequence"], dtype=float)


def luck(run: dict) -> float:
    """The call's accepted minus expected tokens, per new token (0 where the rule reports no reach)."""
    if run.get("accepted") is None or run.get("expected_accepted") is None:
        return 0.0
    return (run["accepted"] - run["expected_accepted"]) / max(1, run["new_tokens"])


def adjusted_speeds(groups: dict[str, list[dict]], scores: dict[str, np.ndarray | None]) -> dict[str, dict]:
    """Per method: raw and adjusted geometric-mean tokens per second, their standard errors, and the slopes."""
    log_times = {m: np.log([run["seconds"] / run["new_tokens"] for run in runs]) for m, runs in groups.items()}
    lucks = {m: np.array([luck(run) for run in runs]) for m, runs in groups.items()}
    has_texts = all(scores.get(m) is not None for m in groups)
    pooled_text = float(np.concatenate([scores[m] for m in groups]).mean()) if has_texts else 0.0
    drafting = [m for m, runs in groups.items() if any(run.get("accepted") is not None for run in runs)]
    columns, targets = [], []
    for method in drafting:  # target-only's time does not follow the text's acceptance: it sets no slope
        x = [lucks[method] - lucks[method].mean()]
        if has_texts:
            x.append(scores[method] - scores[method].mean())
        columns.append(np.stack(x, axis=1))
        targets.append(log_times[method] - log_times[method].mean())
    slopes = np.linalg.lstsq(np.concatenate(columns), np.concatenate(targets), rcond=None)[0]
    result = {}
    for method in groups:
        y, n = log_times[method], len(log_times[method])
        shift = slopes[0] * lucks[method]  # luck's mean is 0 for every method
        if has_texts and method in drafting:
            shift = shift + slopes[1] * (scores[method] - pooled_text)
        adjusted = y - shift
        result[method] = {
            "calls": n, "tokens_per_second": math.exp(-y.mean()),
            "adjusted_tokens_per_second": math.exp(-adjusted.mean()),
            "error": float(y.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
            "adjusted_error": float(adjusted.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
            "mean_luck": float(lucks[method].mean()),
            "mean_text_acceptance": float(scores[method].mean()) if has_texts else None,
        }
    return {"methods": result, "luck_slope": float(slopes[0]),
            "text_slope": float(slopes[1]) if has_texts else None, "pooled_text_acceptance": pooled_text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", help="an `hf-spec bench --output` JSON (warm or --first-call)")
    parser.add_argument("--texts", type=Path, default=None,
                        help="scripts/bench_text_acceptance.py's --output-dir for this report")
    parser.add_argument("--output", type=Path, default=None, help="write the figures here (JSON)")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    cells = sorted({(run["workload"], run["setting"]) for run in report["runs"] if run["setting"] == "sampled"})
    if not cells:
        raise SystemExit(f"{args.report} holds no sampled calls")
    out = {}
    for workload, setting in cells:
        groups = calls_by_method(report, workload, setting)
        scores = {m: text_scores(args.texts, workload, setting, m, runs) for m, runs in groups.items()}
        figures = adjusted_speeds(groups, scores)
        out[f"{workload}/{setting}"] = figures
        fixed = {m: f for m, f in figures["methods"].items() if m.startswith("hf_spec_k") or m == "hf_spec"}
        best = max(fixed, key=lambda m: fixed[m]["adjusted_tokens_per_second"], default=None)
        text_slope = "" if figures["text_slope"] is None else f", text slope {figures['text_slope']:.2f}"
        print(f"{workload}/{setting}: luck slope {figures['luck_slope']:.2f}{text_slope}")
        for method, f in figures["methods"].items():
            ratio = "" if best is None or method == best else (
                f"  {f['adjusted_tokens_per_second'] / fixed[best]['adjusted_tokens_per_second']:.3f}x "
                f"(se {100 * math.hypot(f['adjusted_error'], fixed[best]['adjusted_error']):.1f}%) {best}, raw "
                f"{f['tokens_per_second'] / fixed[best]['tokens_per_second']:.3f}x")
            print(f"  {method:22s} {f['calls']:3d} calls  raw {f['tokens_per_second']:6.2f} tok/s "
                  f"(se {100 * f['error']:.1f}%)  adjusted {f['adjusted_tokens_per_second']:6.2f} "
                  f"(se {100 * f['adjusted_error']:.1f}%)  luck {f['mean_luck']:+.3f}{ratio}")
    if args.output:
        args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
