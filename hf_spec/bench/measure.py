"""Measuring a generate() call: forward-pass costs, forward-pass counts, peak memory, weights, and the machine."""

from __future__ import annotations

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
from hf_spec.loading.cpu import cpu_class, cpu_flags


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    """Median seconds of a target step, of target blocks of several widths, and of a draft step, after one prompt."""

    target_step_seconds: float
    draft_step_seconds: float
    target_block_seconds: dict[int, float]  # width (k + 1) -> seconds

    @property
    def cost_ratio(self) -> float:
        """c: draft step / target step."""
        return self.draft_step_seconds / self.target_step_seconds

    def block_cost(self, k: int) -> float:
        """b: a target pass over k + 1 tokens / a target step."""
        return self.target_block_seconds[k + 1] / self.target_step_seconds


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


def forward_costs(target: PreTrainedModel, draft: PreTrainedModel, input_ids: torch.Tensor,
                  ks: set[int]) -> ForwardCosts:
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


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


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
