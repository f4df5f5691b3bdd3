"""Measuring a generate() call: forward-pass costs, forward-pass counts, peak memory, and the machine."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import threading
import time

import numpy as np
import torch
import transformers
from transformers import PreTrainedModel

from hf_spec.caches import cache_length, crop_to, new_cache


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """Median seconds of a target step, of target blocks of several widths, and of a draft step, after one prompt."""

    target_step_s: float
    draft_step_s: float
    target_block_s: dict[int, float]  # width (k + 1) -> seconds

    @property
    def cost_ratio(self) -> float:
        """c: draft step / target step."""
        return self.draft_step_s / self.target_step_s

    def block_cost(self, k: int) -> float:
        """b: a target pass over k + 1 tokens / a target step."""
        return self.target_block_s[k + 1] / self.target_step_s


@torch.no_grad()
def forward_seconds(model: PreTrainedModel, input_ids: torch.Tensor, widths: list[int], repeats: int = 5) -> dict:
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
    return {width: float(np.median(values)) for width, values in seconds.items()}


def forward_costs(target: PreTrainedModel, draft: PreTrainedModel, input_ids: torch.Tensor, ks: set[int]) -> ForwardCosts:
    """Costs for drafting each k in ``ks`` after the prompt ``input_ids`` ``[1, S]``."""
    target_seconds = forward_seconds(target, input_ids, sorted({1} | {k + 1 for k in ks}))
    draft_seconds = forward_seconds(draft, input_ids.to(draft.device), [1])
    return ForwardCosts(target_seconds[1], draft_seconds[1], target_seconds)


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


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    """The ids that end ``model``'s generations (its ``generation_config.eos_token_id``)."""
    eos = model.generation_config.eos_token_id
    return set() if eos is None else set(eos if isinstance(eos, list) else [eos])


def count_new_tokens(new_ids: torch.Tensor, eos_ids: set[int]) -> int:
    """Tokens of ``new_ids`` ``[m]`` up to and including the first EOS (all of them without one)."""
    new = new_ids.tolist()
    return next((i + 1 for i, token in enumerate(new) if token in eos_ids), len(new))


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def cpu_flags() -> tuple[str, set[str]]:
    """``(model name, instruction-set flags)`` of this machine's CPU, from ``/proc/cpuinfo`` (empty elsewhere)."""
    flags, cpu = set(), platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return cpu, flags


def cpu_class(flags: set[str]) -> str:
    """The class that decides CPU speed regimes here: ``"AMX"`` (``amx_bf16``), ``"AVX512-BF16"``, ``"AVX512"``,
    ``"AVX2"`` or ``"other"``. With native bf16 (the first two) a multi-token bf16 block costs about one decode step;
    without it, several."""
    for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "other"


def machine_info() -> dict:
    """CPU model, class and the instruction-set flags that decide bf16 speed, threads, library versions."""
    cpu, flags = cpu_flags()
    return {
        "cpu": cpu,
        "cpu_class": cpu_class(flags),
        "cpu_bf16_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }
