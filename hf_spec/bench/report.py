"""The report of `hf-spec bench`: one row per (workload, setting, method), the formula's prediction, a Markdown
table and a plot.

The formula's prediction for a method drafting a fixed k with a draft model, at the cost probe's figures and at the
costs of the run's own passes, and the share of each it reaches: `hf_spec.bench.formula`.

For every method, ``modelled_speedup`` prices the passes a method actually ran (target passes at their mean block
size, draft passes) at the cost probe's figures, against target-only steps at the same figures: it compares the
methods' decisions free of the runs' timing noise, and ``vs target-only`` / ``modelled`` is the share the loop's
own overhead (and the machine's noise) leaves. ``speedup_median`` and its range are over prompts (and repeats),
each against target-only decoding of the same prompt; ``profile_shares``: where hf_spec's time went.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from hf_spec.bench.formula import format_formula_table, in_run_prediction, probe_prediction
from hf_spec.extras import require
from hf_spec.sizing.costs import CostTable

#: Every workload together, per setting: a mixed workload.
ALL_WORKLOADS = "all"
#: Target-only decoding of the same weights on the optimized path, as loaded (stock kernels), and on the path that is
#: fastest for 1-token steps: the best of them is the strongest target-only baseline.
KERNEL_BASELINES = ("target_only", "target_only@stock", "target_only@steps")


@dataclasses.dataclass
class Run:
    """One ``generate()`` call."""

    workload: str
    setting: str
    method: str
    prompt: int
    repeat: int
    seconds: float
    new_tokens: int
    target_passes: int
    draft_passes: int
    proposed: int | None
    accepted: int | None
    working_memory_bytes: int | None
    identical_to_target_only: bool | None = None
    new_ids: list[int] | None = None  # what the call generated (up to and including the first EOS)
    text: str | None = None  # ``new_ids`` decoded, when a tokenizer was given
    profile: dict[str, float] | None = None  # hf_spec's loop, seconds per section (`hf_spec.profiling`)
    profile_passes: dict[str, int] | None = None  # and forward passes per section
    draft_lengths: list[int] | None = None  # hf_spec: the k of each round, in order (0: a plain target step)
    expected_accepted: float | None = None  # hf_spec: what the acceptance rule expected to accept of its drafts
    error: str | None = None  # transformers' own method raised (the call is reported, left out of every figure)


def summarize(runs: list[Run], methods: list[str], costs: dict[str, CostTable], method_k: dict[str, int | None],
              weights: dict[str, int], cost_table: CostTable | None = None) -> list[dict]:
    """One row per (workload, setting, method) with every figure the report shows, then, with several workloads,
    one row per (setting, method) over all of them (workload ``"all"``).

    Args:
        methods: in the order to report them.
        method_k: per method, the fixed k it drafts with a draft model (the formula applies), else ``None``.
        costs, weights: keyed by workload (``"target"``, ``"draft"``) for the first pair, ``<workload>@<label>``
            (``"target@<label>"``, ``"draft@<label>"``) for a variant (methods named ``<method>@<label>``), whose
            own target-only baseline is ``target_only@<label>``, or ``target_only`` where that did not run.
        cost_table: the probe's pass costs (`hf_spec.timing.probe`): the ``modelled_speedup`` of each row is the
            speed-up its counts (target passes and their sizes, draft passes) give at those costs, free of the timing
            noise of the runs themselves.
    """
    failed = collections.Counter((run.workload, run.setting, run.method) for run in runs if run.error is not None)
    runs = [run for run in runs if run.error is None]
    workloads = list(dict.fromkeys(run.workload for run in runs))
    if len(workloads) > 1:
        for (_, setting, method), count in list(failed.items()):
            failed[(ALL_WORKLOADS, setting, method)] += count
        runs = runs + [dataclasses.replace(run, workload=ALL_WORKLOADS) for run in runs]
    cases = list(dict.fromkeys((run.workload, run.setting) for run in runs))
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in sorted(runs, key=lambda run: (cases.index((run.workload, run.setting)), methods.index(run.method))):
        groups.setdefault((run.workload, run.setting, run.method), []).append(run)
    rows = []
    for (workload, setting, method), group in groups.items():
        variant = variant_suffix(method)
        seconds = sum(run.seconds for run in group)
        tokens = sum(run.new_tokens for run in group)
        latencies = [run.seconds for run in group]
        memory = [run.working_memory_bytes for run in group if run.working_memory_bytes is not None]
        proposed = sum(run.proposed or 0 for run in group)
        identical = [run.identical_to_target_only for run in group if run.identical_to_target_only is not None]
        rows.append({
            "workload": workload, "setting": setting, "method": method, "calls": len(group),
            "failed_calls": failed[(workload, setting, method)],
            "new_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "acceptance_rate": sum(run.accepted or 0 for run in group) / proposed if proposed else None,
            "tokens_per_target_pass": _per_pass(tokens, sum(run.target_passes for run in group)),
            "latency_p50_seconds": float(np.percentile(latencies, 50)),
            "latency_p90_seconds": float(np.percentile(latencies, 90)),
            "weights_bytes": None if not any(run.target_passes for run in group) else  # a peer: not counted here
            weights["target" + variant] + (weights["draft" + variant] if any(run.draft_passes for run in group) else 0),
            "working_memory_bytes": max(memory) if memory else None,
            "identical_to_target_only": sum(identical) / len(identical) if identical else None,
        })
        row = rows[-1]
        row["peak_memory_bytes"] = None if row["weights_bytes"] is None else (
            row["weights_bytes"] + (row["working_memory_bytes"] or 0))
    by_key = {(row["workload"], row["setting"], row["method"]): row for row in rows}
    for row in rows:
        key = (row["workload"], row["setting"])
        baseline = by_key[(*key, "target_only")]["tokens_per_second"]
        row["speedup_vs_target_only"] = row["tokens_per_second"] / baseline
        transformers_row = by_key.get((*key, "transformers"))
        row["speedup_vs_transformers"] = (row["tokens_per_second"] / transformers_row["tokens_per_second"]
                                          if transformers_row else None)
        variant = variant_suffix(row["method"])
        own = by_key.get((*key, "target_only" + variant)) or by_key[(*key, "target_only")]
        row["speedup_vs_own_target_only"] = row["tokens_per_second"] / own["tokens_per_second"]
        stock = by_key.get((*key, "target_only@stock"))
        row["speedup_vs_stock_target_only"] = row["tokens_per_second"] / stock["tokens_per_second"] if stock else None
        best = max(by_key[(*key, name)]["tokens_per_second"] for name in KERNEL_BASELINES if (*key, name) in by_key)
        row["speedup_vs_best_target_only"] = row["tokens_per_second"] / best
        row.update(probe_prediction(row, costs.get(row["workload"] + variant), method_k[row["method"]]))
        row.update(in_run_prediction(groups[(*key, row["method"])], groups[(*key, own["method"])],
                                     method_k[row["method"]]))
        row.update(_spread(groups, [key] if key[0] != ALL_WORKLOADS else [(name, key[1]) for name in workloads],
                           row["method"], own["method"]))
        row["modelled_speedup"] = _modelled(groups[(*key, row["method"])], cost_table) if not variant else None
        row["profile_shares"] = _profile_shares(groups[(*key, row["method"])])
    return rows


def _spread(groups: dict, keys: list[tuple[str, str]], method: str, baseline: str) -> dict:
    """Median and range over prompts (and repeats) of the speed-up over ``baseline`` on the same prompt, pooled over
    the (workload, setting) ``keys``."""
    ratios = []
    for key in keys:
        base = {(run.prompt, run.repeat): run.new_tokens / run.seconds for run in groups.get((*key, baseline), [])}
        ratios += [run.new_tokens / run.seconds / base[(run.prompt, run.repeat)]
                   for run in groups.get((*key, method), []) if (run.prompt, run.repeat) in base]
    if not ratios:
        return dict.fromkeys(("speedup_median", "speedup_min", "speedup_max"))
    return {"speedup_median": float(np.median(ratios)), "speedup_min": min(ratios), "speedup_max": max(ratios)}


def _per_pass(tokens: int, passes: int) -> float | None:
    """Tokens per target pass; ``None`` where no pass was counted (a peer outside this process)."""
    return tokens / passes if passes else None


def _modelled(group: list[Run], table: CostTable | None) -> float | None:
    """Target-only seconds over this method's, both at the probe's costs: each target pass priced at its mean block
    size's cost, each draft pass at a draft step."""
    if table is None or not table.target_block_seconds:
        return None
    tokens = sum(run.new_tokens for run in group)
    passes = sum(run.target_passes for run in group)
    block = (sum(run.proposed or 0 for run in group) + passes) / max(1, passes)  # tokens per verify pass
    sizes = sorted(table.target_block_seconds)
    pass_seconds = float(np.interp(block, sizes, [table.target_block_seconds[size] for size in sizes]))
    seconds = passes * pass_seconds + sum(run.draft_passes for run in group) * table.draft_step_seconds
    return tokens * table.target_step_seconds / seconds if seconds else None


def _profile_shares(group: list[Run]) -> dict[str, float] | None:
    """Each profiled section's share of the calls' wall time, and ``outside the loop`` (generate()'s own setup)."""
    profiled = [run for run in group if run.profile]
    if not profiled:
        return None
    total = sum(run.seconds for run in profiled)
    shares = {name: sum(run.profile[name] for run in profiled) / total for name in profiled[0].profile}
    shares["outside the loop"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def variant_suffix(method: str) -> str:
    """``"@nf4"`` for ``"hf_spec@nf4"`` (a method on the variant labelled nf4), ``""`` for a method on the first
    pair. Report keys (costs, weights, baselines) of a variant carry the same suffix."""
    _, at, label = method.partition("@")
    return at + label


def first_calls(warm: dict[str, dict], workload: str) -> dict[str, dict]:
    """Each method's first call (`hf_spec.bench.runner`'s warm-up): seconds, tokens per second and the ratio to
    target-only's first call on the same prompt."""
    speed = {method: entry["first_tokens"] / entry["first_seconds"] if entry["first_tokens"] else None
             for method, entry in warm.items()}
    baseline = speed.get("target_only")
    return {method: {"workload": workload, "setting": entry["setting"], "seconds": entry["first_seconds"],
                     "new_tokens": entry["first_tokens"], "tokens_per_second": speed[method],
                     "speedup_vs_target_only": speed[method] / baseline if speed[method] and baseline else None}
            for method, entry in warm.items()}


def _first_call_lines(firsts: dict | None) -> list[str]:
    if not firsts:
        return []
    return ["", "Each method's first call (the first prompt and setting; a cost probe or a compile included; the "
            "calls above come after it):", "", "| method | seconds | tok/s | vs target-only's first call |",
            "|---|---|---|---|"] + [
        f"| {method} | {entry['seconds']:.2f} | " + ("-" if entry["tokens_per_second"] is None else
                                                    f"{entry['tokens_per_second']:.2f}")
        + " | " + ("-" if entry["speedup_vs_target_only"] is None else f"{entry['speedup_vs_target_only']:.2f}x")
        + " |" for method, entry in firsts.items()]


def format_table(report: dict) -> str:
    """The results as a Markdown table."""
    def number(value, spec, unit=""):
        return "-" if value is None else format(value, spec) + unit

    header = (
        "| workload | setting | method | tok/s | vs target-only | per prompt: median [range] | vs transformers "
        "| acceptance | tokens/pass | modelled | share of modelled | share of predicted (measured b) | p50 s | p90 s "
        "| peak MB | identical to target-only |"
    )
    has_variants = any("@" in row["method"] for row in report["results"])
    has_stock = any(row["speedup_vs_stock_target_only"] is not None for row in report["results"])
    extra = ((" vs own target-only |" if has_variants else "")
             + (" vs stock | vs best target-only |" if has_stock else ""))
    header = header.replace("| vs transformers |", "|" + extra + " vs transformers |", 1)
    lines = [header, "|" + "---|" * (16 + has_variants + 2 * has_stock)]
    for row in report["results"]:
        own = f"| {number(row['speedup_vs_own_target_only'], '.2f', 'x')} " if has_variants else ""
        if has_stock:
            own += (f"| {number(row['speedup_vs_stock_target_only'], '.2f', 'x')} "
                    f"| {number(row['speedup_vs_best_target_only'], '.2f', 'x')} ")
        spread = ("-" if row.get("speedup_median") is None else
                  f"{row['speedup_median']:.2f}x [{row['speedup_min']:.2f}, {row['speedup_max']:.2f}]")
        modelled = row.get("modelled_speedup")
        lines.append(
            f"| {row['workload']} | {row['setting']} | {row['method']} | {row['tokens_per_second']:.2f} "
            f"| {row['speedup_vs_target_only']:.2f}x | {spread} {own}"
            f"| {number(row['speedup_vs_transformers'], '.2f', 'x')} "
            f"| {number(row['acceptance_rate'], '.2f')} | {number(row['tokens_per_target_pass'], '.2f')} "
            f"| {number(modelled, '.2f', 'x')} "
            f"| {number(None if not modelled else row['speedup_vs_target_only'] / modelled, '.0%')} "
            f"| {number(row['share_of_predicted_block_cost'], '.0%')} | {row['latency_p50_seconds']:.1f} "
            f"| {row['latency_p90_seconds']:.1f} "
            f"| {number(row['peak_memory_bytes'] and row['peak_memory_bytes'] / 2**20, '.0f')} "
            f"| {number(row['identical_to_target_only'], '.0%')} |"
        )
    lines += _first_call_lines(report.get("first_calls"))
    failures = [run for run in report.get("runs", []) if run.get("error")]
    if failures:
        lines += ["", "Calls that raised (left out of every figure above; `runs[].error` in the JSON):", ""]
        lines += [f"- {run['workload']}/{run['setting']} prompt {run['prompt']}: {run['method']}: {run['error']}"
                  for run in failures]
    profiled = [row for row in report["results"] if row.get("profile_shares") and row["workload"] != ALL_WORKLOADS]
    if profiled:
        sections = list(profiled[0]["profile_shares"])
        lines += ["", "Where hf_spec's time goes (share of each call's wall time, `hf_spec.profiling`):", "",
                  "| workload | setting | method | " + " | ".join(sections) + " |",
                  "|" + "---|" * (3 + len(sections))]
        lines += [f"| {row['workload']} | {row['setting']} | {row['method']} | "
                  + " | ".join(f"{row['profile_shares'][name]:.0%}" for name in sections) + " |" for row in profiled]
    formula = format_formula_table([row for row in report["results"] if row["workload"] != ALL_WORKLOADS])
    lines += ["", formula] if formula else []
    costs = "; ".join(
        f"{name}: c = {c['cost_ratio']:.2f}, "
        + ", ".join(f"b(k={k}) = {b:.2f}" for k, b in c["block_cost_by_k"].items())
        for name, c in report["costs"].items()
    )
    return ("\n".join(lines) + f"\n\nMeasured cost ratios: {costs}.\n\n" + format_cost_table(report["cost_table"])
            + f"\n\nMachine: {report['machine']}")


def format_cost_table(table: dict) -> str:
    """b (a target pass over n tokens / a step) for each n, and c (a draft step / a target step), as Markdown."""
    step = table["target_step_seconds"]
    lines = [(f"Target step {step * 1e3:.0f} ms, draft step {table['draft_step_seconds'] * 1e3:.0f} ms: "
             f"c = {table['draft_step_seconds'] / step:.2f}."), "", "| tokens in the target pass | ms | b |",
             "|---|---|---|"]
    lines += [f"| {n} | {seconds * 1e3:.0f} | {seconds / step:.2f} |"
              for n, seconds in sorted(table["target_block_seconds"].items(), key=lambda item: int(item[0]))]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Speed-up over target-only (bars; the formula's prediction as a tick where it applies) and tokens per pass."""
    require("matplotlib", "cli", "hf-spec bench's plot")
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) stays as it is

    rows = report["results"]
    groups = list(dict.fromkeys((row["workload"], row["setting"]) for row in rows))
    methods = [m for m in report["config"]["methods"] if m != "target_only"]
    figure = Figure(figsize=(12, 4.5))
    speed, passes = figure.subplots(1, 2)
    width = 0.8 / max(1, len(methods))
    by_key = {(row["workload"], row["setting"], row["method"]): row for row in rows}
    has_prediction = False
    for offset, method in enumerate(methods):
        xs = [g + offset * width for g in range(len(groups))]
        rows_of = [by_key.get((*key, method)) for key in groups]  # None where every call of the method raised
        speed.bar(xs, [float("nan") if row is None else row["speedup_vs_target_only"] for row in rows_of], width,
                  label=method)
        passes.bar(xs, [float("nan") if row is None or row["tokens_per_target_pass"] is None
                        else row["tokens_per_target_pass"] for row in rows_of], width,
                   label=method)
        predicted = [None if row is None else row["predicted_speedup_block_cost"] for row in rows_of]
        if any(value is not None for value in predicted):
            speed.scatter(xs, [float("nan") if value is None else value for value in predicted], marker="_", s=400,
                          color="black", zorder=3, label=None if has_prediction else "formula, measured block cost")
            has_prediction = True
    ticks = [g + width * (len(methods) - 1) / 2 for g in range(len(groups))]
    for axes, title in ((speed, "speed-up over target-only"), (passes, "tokens per target pass")):
        axes.set_xticks(ticks, [f"{w}\n{s}" for w, s in groups])
        axes.set_title(title)
    speed.axhline(1.0, color="grey", linewidth=1)
    speed.legend(fontsize=8)
    machine = report["machine"]
    config = report["config"]
    figure.suptitle(f"k={config['num_draft_tokens']}, {config['dtype']}, {machine['threads']} threads, "
                    f"{machine['cuda'] or machine['cpu']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
