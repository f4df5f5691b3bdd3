"""`hf-spec bench --first-call`: each method's first call in a fresh process, as a user meets it in a new notebook or
script: the pair is loaded (not timed), then one ``generate()`` call is timed, nothing run before it.

Every (workload, setting, prompt, method) runs in its own subprocess (``python -m hf_spec.bench.first_call``), the
methods' order rotating from one prompt to the next. What a first call may pay and later calls do not: an automatic
size's cost probe, oneDNN's first-use kernel set-up, allocator growth. Probed costs are kept on disk between processes
(`hf_spec.timing.store`); ``store="fresh"`` gives every subprocess an empty store (a machine where hf_spec never
ran), ``store="shared"`` the user's (every later process).

The report: per (workload, setting, method) each prompt's seconds and new tokens, and the geometric mean over prompts
of the method's speed (tokens per second) over ``target_only``'s first call on the same prompt.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
from tqdm.auto import tqdm

from hf_spec.bench.methods import SETTINGS, generate_once, method_spec


def worker(job: dict) -> dict:
    """One fresh process's first call: load the pair, build the prompt, time one ``generate()``."""
    from hf_spec.bench.workloads import random_workloads, text_workloads
    from hf_spec.loading import packed
    from hf_spec.loading.pair import TINY, load_pair
    from hf_spec.loading.tiny import TINY_VOCAB_SIZE

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    method, _, kernels = job["method"].partition("@")  # target_only@stock, target_only@steps: a kernel baseline
    pair = load_pair(job["target"], job["draft"], dtype=job["dtype"], seed=job["seed"], optimize=kernels != "stock")
    if kernels == "steps":
        packed.optimize(pair.target, role="steps")
    if job["target"] == TINY:  # the same random prompts as the warm bench's
        prompt = random_workloads((job["workload"],), job["num_prompts"], TINY_VOCAB_SIZE,
                                  seed=job["seed"])[job["workload"]][job["prompt"]]
    else:
        prompts = text_workloads(pair.tokenizer, (job["workload"],), 1, job["offset"] + job["prompt"])
        prompt = prompts[job["workload"]][0]
    spec = method_spec(method, job["num_draft_tokens"])
    settings = {**SETTINGS[job["setting"]], "max_new_tokens": job["max_new_tokens"]}
    if job["min_new_tokens"] is not None:  # every method's text as long: sampled texts otherwise end where they end
        settings["min_new_tokens"] = job["min_new_tokens"]
    if settings.get("do_sample"):
        torch.manual_seed(job["seed"] + job["prompt"])
    draft_kwargs = {} if pair.draft_tokenizer is None else {"tokenizer": pair.tokenizer,
                                                            "assistant_tokenizer": pair.draft_tokenizer}
    started = time.perf_counter()
    sequence, stats = generate_once(spec, pair.target, pair.draft, prompt, settings, draft_kwargs=draft_kwargs)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "new_tokens": int(sequence.shape[0] - prompt["input_ids"].shape[1]),
            "new_ids": sequence[prompt["input_ids"].shape[1]:].tolist(),
            "acceptance_rate": None if stats is None else stats.acceptance_rate,
            "draft_lengths": None if stats is None else stats.draft_lengths,
            "accepted": None if stats is None else stats.num_accepted,
            "expected_accepted": None if stats is None else stats.expected_accepted,
            "cpu_paths": [None if path is None else path.name for path in (pair.target_path, pair.draft_path)]}


def run_first_calls(target: str, draft: str, methods: tuple[str, ...], workloads: tuple[str, ...],
                    settings: tuple[str, ...], num_prompts: int, *, num_draft_tokens: int, max_new_tokens: int,
                    min_new_tokens: int | None = None, dtype: str = "fastest", threads: int | None = None,
                    offset: int = 0, seed: int = 0, store: str = "shared", kernel_baselines: tuple[str, ...] = (),
                    progress: bool = True) -> dict:
    """Every (workload, setting, prompt, method) first call, each in a fresh subprocess; the report (JSON-ready).
    ``kernel_baselines`` (``"stock"``, ``"steps"``) add target-only first calls on those paths of the target
    (``target_only@stock``: not optimized; ``target_only@steps``: on the path fastest for 1-token steps)."""
    if store not in ("shared", "fresh"):
        raise ValueError(f"`store` must be 'shared' or 'fresh', but is {store!r}.")
    if not set(kernel_baselines) <= {"stock", "steps"}:
        raise ValueError(f"`kernel_baselines` must hold 'stock' or 'steps', but is {kernel_baselines!r}.")
    methods = tuple(dict.fromkeys(["target_only", *methods, *(f"target_only@{label}" for label in kernel_baselines)]))
    jobs = [{"target": target, "draft": draft, "method": method, "workload": workload, "setting": setting,
             "prompt": prompt, "num_prompts": num_prompts, "offset": offset, "num_draft_tokens": num_draft_tokens,
             "dtype": dtype, "max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, "threads": threads,
             "seed": seed}
            for workload in workloads for setting in settings for prompt in range(num_prompts)
            for turn in range(len(methods)) for method in [methods[(turn + prompt) % len(methods)]]]
    runs = []
    for job in tqdm(jobs, desc="first calls", disable=not progress):
        runs.append({**job, **_in_fresh_process(job, store)})
    return {"config": {"target": target, "draft": draft, "methods": list(methods), "workloads": list(workloads),
                       "settings": list(settings), "num_prompts": num_prompts, "num_draft_tokens": num_draft_tokens,
                       "max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, "dtype": dtype,
                       "threads": threads, "store": store, "kernel_baselines": list(kernel_baselines)},
            "results": summarize_first_calls(runs, methods), "runs": runs}


def summarize_first_calls(runs: list[dict], methods: tuple[str, ...]) -> dict:
    """Per ``"<workload>/<setting>"`` and method: seconds and new tokens per prompt, and the geometric mean of its
    tokens per second over ``target_only``'s first call on the same prompt, and over the fastest target-only first
    call on that prompt (of ``target_only`` and its kernel baselines)."""
    results = {}
    for run in runs:
        group = results.setdefault(f"{run['workload']}/{run['setting']}", {})
        group.setdefault(run["method"], {})[run["prompt"]] = run
    summary = {}
    for name, by_method in results.items():
        baseline = {p: _speed(run) for p, run in by_method["target_only"].items()}
        fastest = {p: max(_speed(by_prompt[p]) for method, by_prompt in by_method.items()
                          if method.partition("@")[0] == "target_only" and p in by_prompt) for p in baseline}
        summary[name] = {}
        for method in methods:
            prompts = by_method.get(method, {})
            summary[name][method] = {
                "seconds": [round(prompts[p]["seconds"], 3) for p in sorted(prompts)],
                "new_tokens": [prompts[p]["new_tokens"] for p in sorted(prompts)],
                "speed_over_target_only": _mean_ratio(prompts, baseline),
                "speed_over_fastest_target_only": _mean_ratio(prompts, fastest),
            }
    return summary


def _speed(run: dict) -> float:
    return run["new_tokens"] / run["seconds"]


def _mean_ratio(runs: dict, baseline: dict) -> float | None:
    """The geometric mean over prompts of a run's speed over the baseline's speed on the same prompt."""
    ratios = [_speed(run) / baseline[p] for p, run in runs.items() if p in baseline]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def format_first_calls(report: dict) -> str:
    """A Markdown table: one row per method, one column per workload and setting (speed over target-only's first
    call, and over the fastest target-only first call when kernel baselines ran)."""
    groups = list(report["results"])
    lines = ["| method (first call in a fresh process) | " + " | ".join(groups) + " |",
             "|---|" + "---|" * len(groups)]
    has_baselines = any("@" in method for method in report["config"]["methods"])
    for method in report["config"]["methods"]:
        cells = []
        for group in groups:
            result = report["results"][group][method]
            ratio, fastest = result["speed_over_target_only"], result.get("speed_over_fastest_target_only")
            cell = "-" if ratio is None else f"{ratio:.2f}x"
            cells.append(cell + (f" ({fastest:.2f}x)" if has_baselines and fastest is not None else ""))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    note = ("\n\nSpeed over `target_only`'s first call (in brackets: over the fastest target-only first call on the "
            "same prompt, kernel baselines included); geometric means over prompts.")
    return "\n".join(lines) + note


def _in_fresh_process(job: dict, store: str) -> dict:
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as empty:
        if store == "fresh":
            environment["HF_SPEC_COST_STORE"] = empty
        finished = subprocess.run([sys.executable, "-m", "hf_spec.bench.first_call", json.dumps(job)],
                                  capture_output=True, text=True, env=environment, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"The first call of {job['method']} on {job['workload']} prompt {job['prompt']} failed:\n"
                           f"{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))), flush=True)
