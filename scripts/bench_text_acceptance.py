"""The draft's acceptance on the very texts each method of an `hf-spec bench` run wrote (teacher-forced).

    python scripts/bench_text_acceptance.py benchmarks/amx-intel/2026-12-05-auto_trees_code.json --offset 4 \
        --output-dir benchmarks/amx-intel/2026-12-05-texts

With sampling every method writes its own texts, so a method's speed-up mixes its policy (which k, which tree) with
how easy its texts happened to be for the draft. This script scores each (workload, setting, method)'s texts with
`hf_spec.evaluation.draft_fit.evaluate_draft` under the run's own settings (1 - TV(p, q) at every position sampled,
argmax agreement greedy), prints each method's mean acceptance over its texts, and writes one report per
(workload, setting, method) in `hf-spec eval-draft`'s form, which ``scripts/sizer_simulation.py --replay`` reads: auto
k and every fixed k then run on the same texts' acceptance, policy against policy.

The prompts are rebuilt from the run's workloads, prompt counts and ``--offset`` (give the run's own); the pair is the
run's (the report's own, or ``--target``/``--draft``) in the run's dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

import hf_spec
from hf_spec.bench.workloads import random_workloads, text_workloads
from hf_spec.evaluation.draft_fit import evaluate_draft
from hf_spec.loading.pair import TINY
from hf_spec.loading.tiny import TINY_VOCAB_SIZE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", help="an `hf-spec bench --output` JSON")
    parser.add_argument("--offset", type=int, default=None, help="the run's --offset (default: the report's own)")
    parser.add_argument("--target", default=None, help="the run's target (default: the report's own)")
    parser.add_argument("--draft", default=None, help="the run's draft (default: the report's own)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = json.loads(Path(args.report).read_text())
    config = report["config"]
    target, draft = args.target or config["target"], args.draft or config["draft"]
    pair = hf_spec.load_pair(target, draft, dtype=config["dtype"], seed=config["seed"])
    names, count = tuple(config["prompts_per_workload"]), max(config["prompts_per_workload"].values())
    if target == TINY:  # the bench's random prompts
        workloads = random_workloads(names, count, TINY_VOCAB_SIZE, seed=config["seed"])
    else:
        offset = config.get("offset", 0) if args.offset is None else args.offset  # older reports lack it: give it
        workloads = text_workloads(pair.tokenizer, names, count, offset)
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for run in report["runs"]:
        if run.get("new_ids") and not run.get("error"):
            groups.setdefault((run["workload"], run["setting"], run["method"]), []).append(run)
    summary = []
    for (workload, setting, method), runs in sorted(groups.items()):
        prompts = [workloads[workload][run["prompt"]]["input_ids"] for run in runs]
        texts = [torch.tensor([run["new_ids"]]) for run in runs]
        settings = config["settings"][setting]
        scored = evaluate_draft(pair.target, pair.draft, prompts, texts, settings, progress=False)
        name = f"{workload}_{setting}_{method.replace('@', '-at-')}.json"
        (output / name).write_text(json.dumps({"source": args.report, "workload": workload, "setting": setting,
                                               "method": method, "prompts": [run["prompt"] for run in runs],
                                               "predicted": dataclasses.asdict(scored)}, indent=1))
        row = {"workload": workload, "setting": setting, "method": method, "texts": len(texts),
               "acceptance": scored.acceptance_rate,
               "acceptance_by_text": scored.acceptance_by_sequence,
               "expected_tokens_per_pass": scored.expected_tokens_per_pass}
        summary.append(row)
        by_text = ", ".join(f"{value:.2f}" for value in scored.acceptance_by_sequence)
        print(f"{workload} {setting} {method}: acceptance {scored.acceptance_rate:.3f} "
              f"(median text {statistics.median(scored.acceptance_by_sequence):.3f}; {by_text}); "
              f"E[tokens / pass] k=4 {scored.expected_tokens_per_pass[4]:.2f}, k=5 "
              f"{scored.expected_tokens_per_pass[5]:.2f}")
    (output / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
