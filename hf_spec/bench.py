"""`hf-spec bench`: target-only decoding, transformers' assisted generation and hf_spec, side by side.

All methods run in one process on the same weights, prompts and settings, interleaved prompt by prompt (their order
rotates from one prompt to the next), after a warm-up call of each:

- ``target_only``: ``generate()`` without a draft;
- ``transformers``: transformers' own ``generate(assistant_model=...)`` at its best: constant schedule, the same k,
  confidence threshold off;
- ``transformers_default``: the same with transformers' defaults (20 draft tokens, confidence threshold 0.4);
- ``hf_spec``: ours, ``generate(assistant_model=..., num_assistant_tokens=k)``.

Sampled runs of one prompt start from the same seed for every method. Target and draft forward passes are counted
with forward pre-hooks; acceptance for transformers is derived from those counts (accepted = tokens - target passes,
proposed = draft passes), for hf_spec it is its own statistics.

The speed-up predicted by the formula (Leviathan et al.) uses the per-token acceptance ``alpha`` that explains the
measured tokens per target pass, and the draft/target cost ratio ``c`` of single-token steps measured before the runs::

    predicted = (1 - alpha^(k+1)) / ((1 - alpha) (1 + k c))

The formula assumes a (k+1)-token verify pass costs one target step. ``predicted_block_cost`` replaces that 1 by the
measured cost ratio ``b`` of a (k+1)-token block to a step, so the share of it that a method reaches is what its own
overhead leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, crop_to, new_cache
from hf_spec.mixin import speculative, without_speculation

METHODS = ("target_only", "transformers", "transformers_default", "hf_spec")
ASSISTED = ("transformers", "transformers_default", "hf_spec")
SETTINGS = {
    "greedy": {"do_sample": False},
    "sampled": {"do_sample": True, "temperature": 0.7, "top_p": 0.9},
}
_ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")

PROSE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a curious ten-year-old why the sky is blue and sunsets are red.",
    "Write a friendly letter to a neighbour inviting them to a garden party next Saturday.",
    "Describe a busy morning market in a small coastal town, with its sounds and smells.",
    "Summarise the main causes of the French Revolution in a few paragraphs.",
    "Give advice to someone starting their first job about managing their time.",
    "Write a product description for a handmade wooden chess set.",
    "Tell the story of how tea spread from China to the rest of the world.",
)


# --- the formula ---------------------------------------------------------------------------------------------------

def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """E[tokens per target pass] when each of k draft tokens is accepted with probability ``alpha``, independently."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance_from_tokens_per_pass(tokens_per_pass: float, k: int) -> float:
    """The ``alpha`` whose `expected_tokens_per_pass` is ``tokens_per_pass`` (clipped to [1, k+1]), by bisection."""
    target = min(max(tokens_per_pass, 1.0), k + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):  # the function increases with alpha
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens_per_pass(middle, k) < target else (low, middle)
    return (low + high) / 2


def predicted_speedup(alpha: float, k: int, cost_ratio: float, block_cost: float = 1.0) -> float:
    """Tokens per unit of target-step time, relative to target-only: E[tokens] / (k c + b)."""
    return expected_tokens_per_pass(alpha, k) / (k * cost_ratio + block_cost)


# --- measuring -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """Median seconds of a target step, a target (k+1)-token block and a draft step, after the same prompt."""

    target_step_s: float
    target_block_s: float
    draft_step_s: float

    @property
    def cost_ratio(self) -> float:
        """c: draft step / target step."""
        return self.draft_step_s / self.target_step_s

    @property
    def block_cost(self) -> float:
        """b: target (k+1)-token block / target step."""
        return self.target_block_s / self.target_step_s


@torch.no_grad()
def forward_seconds(model: PreTrainedModel, input_ids: torch.Tensor, widths: tuple[int, ...], repeats: int = 5):
    """Median seconds of a forward pass of each width in ``widths`` on top of a cached ``input_ids`` prefix."""
    cache = new_cache(model)
    model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    prefix = cache_length(cache)
    seconds = {width: [] for width in widths}
    for _ in range(repeats):
        for width in widths:
            block = input_ids[:, -1:].expand(-1, width)  # [1, width]
            started = time.perf_counter()
            model(input_ids=block, cache=cache, use_cache=True, logits_to_keep=width)
            seconds[width].append(time.perf_counter() - started)
            crop_to(cache, prefix)
    return tuple(float(np.median(seconds[width])) for width in widths)


def forward_costs(target: PreTrainedModel, draft: PreTrainedModel, input_ids: torch.Tensor, k: int) -> ForwardCosts:
    target_step, target_block = forward_seconds(target, input_ids, (1, k + 1))
    (draft_step,) = forward_seconds(draft, input_ids.to(draft.device), (1,))
    return ForwardCosts(target_step, target_block, draft_step)


class ForwardCounter:
    """Counts a model's forward calls (a pre-hook on the module) while the context is open."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.count = model, 0

    def _hook(self, module, args):
        self.count += 1

    def __enter__(self):
        self._handle = self.model.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


class PeakMemory:
    """Peak memory above the level at entry, in bytes: the CUDA allocator's peak on a GPU, else the process's resident
    set sampled every 5 ms (Linux; ``None`` elsewhere)."""

    def __init__(self, device: torch.device):
        self.device, self.peak_bytes = device, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        self._base = _resident_bytes()
        self._peak, self._stop = self._base, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        if self._base is not None:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, _resident_bytes() or 0)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        if self._base is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self._peak, _resident_bytes() or 0) - self._base


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def machine_info() -> dict:
    """CPU model and the instruction-set flags that decide bf16 speed, threads, library versions."""
    flags, cpu = set(), platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "cpu": cpu,
        "cpu_bf16_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


# --- running -------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def assistant_config(draft: PreTrainedModel, **fields) -> Iterator[None]:
    """Set fields of ``draft.generation_config`` (where transformers reads its assistant settings) for the block."""
    config = draft.generation_config
    saved = {name: getattr(config, name, None) for name in fields}
    for name, value in fields.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def transformers_settings(method: str, k: int) -> dict:
    """The draft's assistant settings for transformers' assisted generation (``None``: transformers' default)."""
    if method == "transformers":
        return {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    return dict.fromkeys(_ASSISTANT_FIELDS)


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


def count_new_tokens(sequence: torch.Tensor, prompt_length: int, eos_ids: set[int]) -> int:
    """Tokens generated up to and including the first EOS."""
    new = sequence[prompt_length:].tolist()
    return next((i + 1 for i, token in enumerate(new) if token in eos_ids), len(new))


def generate_once(method: str, target, draft, inputs: dict, generate_kwargs: dict, k: int):
    """``(sequence [total], hf_spec stats or None)`` of one batch-1 call of ``method``."""
    if method == "target_only":
        return target.generate(**inputs, **generate_kwargs)[0], None
    if method == "hf_spec":
        output = target.generate(**inputs, **generate_kwargs, assistant_model=draft, num_assistant_tokens=k,
                                 return_dict_in_generate=True)
        return output.sequences[0], output.speculative_stats
    with without_speculation(target), assistant_config(draft, **transformers_settings(method, k)):
        return target.generate(**inputs, **generate_kwargs, assistant_model=draft)[0], None


def run_one(method, target, draft, inputs, generate_kwargs, k, eos_ids, **where) -> tuple[Run, torch.Tensor]:
    prompt_length = inputs["input_ids"].shape[1]
    with ForwardCounter(target) as target_calls, ForwardCounter(draft) as draft_calls, PeakMemory(target.device) as memory:
        started = time.perf_counter()
        sequence, stats = generate_once(method, target, draft, inputs, generate_kwargs, k)
        seconds = time.perf_counter() - started
    new_tokens = count_new_tokens(sequence, prompt_length, eos_ids)
    if stats is not None:
        proposed, accepted = stats.num_draft_tokens, stats.num_accepted
    elif method == "target_only":
        proposed = accepted = None
    else:  # transformers: every target pass emits its accepted tokens plus one
        proposed, accepted = draft_calls.count, max(0, new_tokens - target_calls.count)
    run = Run(method=method, seconds=seconds, new_tokens=new_tokens, target_passes=target_calls.count,
              draft_passes=draft_calls.count, proposed=proposed, accepted=accepted,
              working_memory_bytes=memory.peak_bytes, **where)
    return run, sequence[prompt_length:]


def run_benchmark(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    workloads: dict[str, list[dict[str, torch.Tensor]]],
    settings: dict[str, dict] | None = None,
    methods: tuple[str, ...] = METHODS,
    k: int = 5,
    max_new_tokens: int = 128,
    repeats: int = 1,
    seed: int = 0,
    eos_token_ids: set[int] | None = None,
    progress: bool = True,
) -> dict:
    """Run every method on every (workload, setting, prompt, repeat), interleaved; return the report (JSON-ready).

    Args:
        workloads: name -> batch-1 model inputs (``input_ids`` [1, S], ``attention_mask``) of each prompt.
        settings: name -> sampling kwargs of ``generate()`` (default: `SETTINGS`).
        eos_token_ids: ids that end a generation (default: the target's ``generation_config.eos_token_id``).
    """
    settings = SETTINGS if settings is None else settings
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise ValueError(f"`methods` must be a non-empty subset of {METHODS}, got {methods!r}.")
    if "target_only" not in methods:
        raise ValueError(f"`methods` must include 'target_only' (every ratio is relative to it), got {methods!r}.")
    for name, prompts in workloads.items():
        if not prompts:
            raise ValueError(f"Workload {name!r} has no prompts.")
    target = speculative(target)
    eos_ids = _eos_ids(target) if eos_token_ids is None else set(eos_token_ids)
    pad = target.generation_config.pad_token_id
    pad = min(eos_ids) if pad is None and eos_ids else pad
    generate_kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad}

    first = next(iter(workloads.values()))[0]
    for method in methods:  # warm-up
        generate_once(method, target, draft, first, {**generate_kwargs, "max_new_tokens": 4}, k)
    costs = {name: forward_costs(target, draft, prompts[0]["input_ids"], k) for name, prompts in workloads.items()}

    jobs = [(w, s, p, r) for w in workloads for s in settings for p in range(len(workloads[w])) for r in range(repeats)]
    runs = []
    bar = tqdm(total=len(jobs) * len(methods), desc="hf-spec bench", unit="call", disable=not progress)
    for index, (workload, setting, prompt, repeat) in enumerate(jobs):
        inputs = workloads[workload][prompt]
        for method in methods[index % len(methods):] + methods[:index % len(methods)]:
            torch.manual_seed(seed + index)
            run, new_ids = run_one(method, target, draft, inputs, {**generate_kwargs, **settings[setting]}, k,
                                   eos_ids, workload=workload, setting=setting, prompt=prompt, repeat=repeat)
            runs.append((run, new_ids))
            bar.update()
            bar.set_postfix_str(f"{workload}/{setting} {method} {run.new_tokens / run.seconds:.2f} tok/s")
        reference = next(ids for run, ids in runs[-len(methods):] if run.method == "target_only")
        if not settings[setting].get("do_sample"):
            for run, new_ids in runs[-len(methods):]:
                run.identical_to_target_only = bool(torch.equal(new_ids, reference))
    bar.close()

    weights = {"target": weight_bytes(target), "draft": weight_bytes(draft)}
    plain_runs = [run for run, _ in runs]
    return {
        "machine": machine_info(),
        "config": {
            "k": k, "max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed, "methods": list(methods),
            "settings": settings, "prompts_per_workload": {name: len(p) for name, p in workloads.items()},
            "dtype": str(target.dtype).removeprefix("torch."),
            "transformers_assistant_settings": {m: transformers_settings(m, k) for m in methods if m in ASSISTED[:2]},
        },
        "weights_bytes": weights,
        "costs": {name: {**dataclasses.asdict(c), "cost_ratio": c.cost_ratio, "block_cost": c.block_cost}
                  for name, c in costs.items()},
        "results": summarize(plain_runs, costs, k, weights),
        "runs": [dataclasses.asdict(run) for run in plain_runs],
    }


def _eos_ids(model: PreTrainedModel) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


def text_workloads(tokenizer, names: tuple[str, ...], num_prompts: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """``code``: the first HumanEval prompts, to complete as plain text; ``prose``: `PROSE_PROMPTS` as chat messages
    (plain text where the tokenizer has no chat template)."""
    from hf_spec.pretrained import humaneval_prompts

    if num_prompts > len(PROSE_PROMPTS) and "prose" in names:
        raise ValueError(f"The prose workload has {len(PROSE_PROMPTS)} prompts; `num_prompts` is {num_prompts}.")
    workloads = {}
    for name in names:
        if name == "code":
            texts = humaneval_prompts()[:num_prompts]
        elif name == "prose":
            texts = [
                tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True) if tokenizer.chat_template else text
                for text in PROSE_PROMPTS[:num_prompts]
            ]
        else:
            raise ValueError(f"Unknown workload {name!r}; choose from ('code', 'prose').")
        workloads[name] = [dict(tokenizer(text, return_tensors="pt", add_special_tokens=False)) for text in texts]
    return workloads


def random_workloads(names: tuple[str, ...], num_prompts: int, vocab_size: int, seed: int = 0) -> dict:
    """Random-id prompts (lengths 4 to 11) under each workload name, for models without a tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    workloads = {}
    for name in names:
        lengths = torch.randint(4, 12, (num_prompts,), generator=generator).tolist()
        workloads[name] = [{"input_ids": torch.randint(1, vocab_size, (1, n), generator=generator),
                            "attention_mask": torch.ones(1, n, dtype=torch.long)} for n in lengths]
    return workloads


# --- reporting -----------------------------------------------------------------------------------------------------

def summarize(runs: list[Run], costs: dict[str, ForwardCosts], k: int, weights: dict[str, int]) -> list[dict]:
    """One row per (workload, setting, method) with every figure the report shows."""
    cases = list(dict.fromkeys((run.workload, run.setting) for run in runs))
    groups: dict[tuple[str, str, str], list[Run]] = {}
    for run in sorted(runs, key=lambda run: (cases.index((run.workload, run.setting)), METHODS.index(run.method))):
        groups.setdefault((run.workload, run.setting, run.method), []).append(run)
    rows = []
    for (workload, setting, method), group in groups.items():
        seconds = sum(run.seconds for run in group)
        tokens = sum(run.new_tokens for run in group)
        latencies = [run.seconds for run in group]
        memory = [run.working_memory_bytes for run in group if run.working_memory_bytes is not None]
        proposed = sum(run.proposed or 0 for run in group)
        identical = [run.identical_to_target_only for run in group if run.identical_to_target_only is not None]
        rows.append({
            "workload": workload, "setting": setting, "method": method, "calls": len(group),
            "new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "acceptance_rate": sum(run.accepted or 0 for run in group) / proposed if proposed else None,
            "tokens_per_target_pass": tokens / max(1, sum(run.target_passes for run in group)),
            "latency_p50_s": float(np.percentile(latencies, 50)),
            "latency_p90_s": float(np.percentile(latencies, 90)),
            "weights_bytes": weights["target"] + (weights["draft"] if method != "target_only" else 0),
            "working_memory_bytes": max(memory) if memory else None,
            "identical_to_target_only": sum(identical) / len(identical) if identical else None,
        })
        row = rows[-1]
        row["peak_memory_bytes"] = row["weights_bytes"] + (row["working_memory_bytes"] or 0)
    by_key = {(row["workload"], row["setting"], row["method"]): row for row in rows}
    for row in rows:
        key = (row["workload"], row["setting"])
        baseline = by_key[(*key, "target_only")]["tokens_per_s"]
        row["speedup_vs_target_only"] = row["tokens_per_s"] / baseline
        transformers_row = by_key.get((*key, "transformers"))
        row["speedup_vs_transformers"] = row["tokens_per_s"] / transformers_row["tokens_per_s"] if transformers_row else None
        row.update(_prediction(row, costs[row["workload"]], k))
    return rows


def _prediction(row: dict, costs: ForwardCosts, k: int) -> dict:
    """The formula's speed-up for a method drafting exactly k tokens per pass, and the share of it measured."""
    if row["method"] not in ("transformers", "hf_spec"):
        return dict.fromkeys(("alpha", "predicted_speedup", "predicted_speedup_block_cost", "share_of_predicted",
                              "share_of_predicted_block_cost"))
    alpha = acceptance_from_tokens_per_pass(row["tokens_per_target_pass"], k)
    predicted = predicted_speedup(alpha, k, costs.cost_ratio)
    predicted_block = predicted_speedup(alpha, k, costs.cost_ratio, costs.block_cost)
    return {
        "alpha": alpha, "predicted_speedup": predicted, "predicted_speedup_block_cost": predicted_block,
        "share_of_predicted": row["speedup_vs_target_only"] / predicted,
        "share_of_predicted_block_cost": row["speedup_vs_target_only"] / predicted_block,
    }


def format_table(report: dict) -> str:
    """The results as a Markdown table."""
    def number(value, spec):
        return "-" if value is None else format(value, spec)

    header = (
        "| workload | setting | method | tok/s | vs target-only | vs transformers | acceptance | tokens/pass "
        "| predicted (b=1) | predicted (measured b) | share of predicted (measured b) | p50 s | p90 s | peak MB "
        "| identical to target-only |"
    )
    lines = [header, "|" + "---|" * 15]
    for row in report["results"]:
        lines.append(
            f"| {row['workload']} | {row['setting']} | {row['method']} | {row['tokens_per_s']:.2f} "
            f"| {row['speedup_vs_target_only']:.2f}x | {number(row['speedup_vs_transformers'], '.2f')}x "
            f"| {number(row['acceptance_rate'], '.2f')} | {row['tokens_per_target_pass']:.2f} "
            f"| {number(row['predicted_speedup'], '.2f')} | {number(row['predicted_speedup_block_cost'], '.2f')} "
            f"| {number(row['share_of_predicted_block_cost'], '.0%')} | {row['latency_p50_s']:.1f} "
            f"| {row['latency_p90_s']:.1f} | {row['peak_memory_bytes'] / 2**20:.0f} "
            f"| {number(row['identical_to_target_only'], '.0%')} |"
        )
    costs = ", ".join(f"{name}: c = {c['cost_ratio']:.2f}, b = {c['block_cost']:.2f}"
                      for name, c in report["costs"].items())
    return "\n".join(lines) + f"\n\nMeasured cost ratios ({costs}); machine: {report['machine']}"


def plot(report: dict, path: str) -> None:
    """Speed-up over target-only (bars, with the formula's prediction for hf_spec as a tick) and tokens per pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    groups = list(dict.fromkeys((row["workload"], row["setting"]) for row in rows))
    methods = [m for m in report["config"]["methods"] if m != "target_only"]
    figure, (speed, passes) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(methods))
    by_key = {(row["workload"], row["setting"], row["method"]): row for row in rows}
    for offset, method in enumerate(methods):
        xs = [g + offset * width for g in range(len(groups))]
        speed.bar(xs, [by_key[(*key, method)]["speedup_vs_target_only"] for key in groups], width, label=method)
        passes.bar(xs, [by_key[(*key, method)]["tokens_per_target_pass"] for key in groups], width, label=method)
        if method == "hf_spec":
            speed.scatter(xs, [by_key[(*key, method)]["predicted_speedup_block_cost"] for key in groups],
                          marker="_", s=400, color="black", zorder=3, label="hf_spec predicted (measured b)")
    ticks = [g + width * (len(methods) - 1) / 2 for g in range(len(groups))]
    for axes, title in ((speed, "speed-up over target-only"), (passes, "tokens per target pass")):
        axes.set_xticks(ticks, [f"{w}\n{s}" for w, s in groups])
        axes.set_title(title)
    speed.axhline(1.0, color="grey", linewidth=1)
    speed.legend(fontsize=8)
    machine = report["machine"]
    figure.suptitle(f"k={report['config']['k']}, {report['config']['dtype']}, {machine['threads']} threads, "
                    f"{machine['cuda'] or machine['cpu']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
