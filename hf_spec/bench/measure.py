"""Measuring a generate() call: forward-pass counts, peak memory, weights, and the machine (forward-pass costs:
`hf_spec.timing.probe`)."""

from __future__ import annotations

import datetime
import os
import platform
import threading

import torch
import transformers

from hf_spec.loading.cpu import cpu_class, cpu_flags


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


def describe_machine(info: dict | None = None) -> str:
    """One line naming the CPU (or GPU), the CPU class, threads, library versions and date (from `machine_info`)."""
    info = info or machine_info()
    device = info["cuda"] or f"{info['cpu']} ({info['cpu_class']})"
    return (f"{device}, {info['threads']} threads, torch {info['torch']}, transformers {info['transformers']}, "
            f"{info['date']}")
