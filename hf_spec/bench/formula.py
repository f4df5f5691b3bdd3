"""The speed-up formula beside what a fixed-k method measured: priced at the cost probe's figures, and at the costs of
the run's own passes, with where the rest of the time went.

The formula (`hf_spec.sizing.speedup`), with the per-token acceptance ``alpha`` that explains the measured tokens
per target pass::

    predicted = (1 - alpha^(k+1)) / ((1 - alpha) (k c + b))

`probe_prediction` takes ``c`` and ``b`` from the cost probe, timed before the runs on a 128-token prefix: on a shared
machine whose speed drifts, those can differ from what the runs' passes cost. `in_run_prediction` takes them from the
profiled calls themselves (`hf_spec.profiling`): ``c`` = the mean 1-token draft pass over the per-token seconds of
target-only decoding on the same prompts, ``b`` = the mean verify pass over the same. Priced so, a round of k draft
steps and one verify pass is exactly what the formula counts, and the share it reaches splits into what the formula
leaves out:

- ``lost to draft prefill and catch-up``: what the draft's first pass (the prompt) and its multi-token catch-up passes
  cost beyond a 1-token step each;
- ``lost outside the passes``: the loop's own work between forward passes (processors, softmax, acceptance, host
  syncs, Python) and ``generate()``'s setup around the loop;
- the rest, draft passes fewer or more than k per round (a round near ``max_new_tokens`` drafts fewer).
"""

from __future__ import annotations

from hf_spec.sizing.costs import CostTable
from hf_spec.sizing.speedup import acceptance_from_tokens_per_pass, predicted_speedup

PROBE_FIELDS = ("alpha", "probe_cost_ratio", "probe_block_cost", "predicted_speedup", "predicted_speedup_block_cost",
                "share_of_predicted", "share_of_predicted_block_cost")
IN_RUN_FIELDS = ("in_run_cost_ratio", "in_run_block_cost", "predicted_speedup_in_run", "share_of_predicted_in_run",
                 "lost_to_draft_prefill_and_catch_up", "lost_outside_the_passes")


def probe_prediction(row: dict, costs: CostTable | None, k: int | None) -> dict:
    """The formula for a method drafting exactly k tokens per pass, at the probe's ``c`` (and ``b``), over target-only
    decoding with the same target (``speedup_vs_own_target_only``), and the share of it measured."""
    if k is None or costs is None:
        return dict.fromkeys(PROBE_FIELDS)
    alpha = acceptance_from_tokens_per_pass(row["tokens_per_target_pass"], k)
    predicted = predicted_speedup(alpha, k, costs.cost_ratio)
    predicted_block = predicted_speedup(alpha, k, costs.cost_ratio, costs.block_cost(k))
    return {
        "alpha": alpha, "probe_cost_ratio": costs.cost_ratio, "probe_block_cost": costs.block_cost(k),
        "predicted_speedup": predicted, "predicted_speedup_block_cost": predicted_block,
        "share_of_predicted": row["speedup_vs_own_target_only"] / predicted,
        "share_of_predicted_block_cost": row["speedup_vs_own_target_only"] / predicted_block,
    }


def in_run_prediction(group: list, baseline: list, k: int | None) -> dict:
    """The formula at the costs of the profiled calls in ``group`` (`hf_spec.bench.report.Run`s of one method drafting
    k tokens per pass), against the target-only calls ``baseline`` on the same prompts; ``None``s without a profile.

    Shares are of the method's wall time: ``share_of_predicted_in_run`` = the passes priced as the formula counts them
    (target passes x (k d + v), d the mean 1-token draft pass, v the mean verify pass) / the wall time."""
    profiled = [run for run in group if run.profile and run.profile_passes]
    prompts = {(run.prompt, run.repeat) for run in profiled}
    baseline = [run for run in baseline if (run.prompt, run.repeat) in prompts]
    steps = sum(run.profile_passes["draft forward"] for run in profiled)
    if k is None or not profiled or not baseline or not steps:
        return dict.fromkeys(IN_RUN_FIELDS)

    def total(field: str, section: str) -> float:
        return sum(getattr(run, field)[section] for run in profiled)

    wall = sum(run.seconds for run in profiled)
    target_passes = total("profile_passes", "target forward")
    per_token = sum(run.seconds for run in baseline) / sum(run.new_tokens for run in baseline)  # target-only
    step, verify = total("profile", "draft forward") / steps, total("profile", "target forward") / target_passes
    alpha = acceptance_from_tokens_per_pass(sum(run.new_tokens for run in profiled) / target_passes, k)
    predicted = predicted_speedup(alpha, k, step / per_token, verify / per_token)
    measured = per_token * sum(run.new_tokens for run in profiled) / wall
    others = ("draft prefill", "draft catch-up")
    premium = sum(total("profile", name) - total("profile_passes", name) * step for name in others)
    forward = sum(total("profile", name) for name in ("draft forward", "target forward", *others))
    return {
        "in_run_cost_ratio": step / per_token, "in_run_block_cost": verify / per_token,
        "predicted_speedup_in_run": predicted, "share_of_predicted_in_run": measured / predicted,
        "lost_to_draft_prefill_and_catch_up": premium / wall, "lost_outside_the_passes": (wall - forward) / wall,
    }


def format_formula_table(rows: list[dict]) -> str:
    """The formula at the probe's costs and at the run's own, for each fixed-k row with a profile, as Markdown."""
    rows = [row for row in rows if row.get("share_of_predicted_in_run") is not None]
    if not rows:
        return ""
    lines = [("The formula for fixed k, at the cost probe's c and b and at the run's own (`hf_spec.bench.formula`); "
              "shares lost are of the method's wall time:"), "",
             ("| workload | setting | method | vs own target-only | c, b (probe) | predicted (probe) | share | "
              "c, b (run) | predicted (run) | share | lost to draft prefill and catch-up | lost outside the passes |"),
             "|" + "---|" * 12]
    for row in rows:
        probe = ("- | - | -" if row["alpha"] is None else
                 f"{row['probe_cost_ratio']:.2f}, {row['probe_block_cost']:.2f} "
                 f"| {row['predicted_speedup_block_cost']:.2f}x | {row['share_of_predicted_block_cost']:.0%}")
        lines.append(
            f"| {row['workload']} | {row['setting']} | {row['method']} | {row['speedup_vs_own_target_only']:.2f}x "
            f"| {probe} "
            f"| {row['in_run_cost_ratio']:.2f}, {row['in_run_block_cost']:.2f} "
            f"| {row['predicted_speedup_in_run']:.2f}x | {row['share_of_predicted_in_run']:.0%} "
            f"| {row['lost_to_draft_prefill_and_catch_up']:.1%} | {row['lost_outside_the_passes']:.1%} |")
    return "\n".join(lines)
