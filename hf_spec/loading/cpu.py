"""The CPU this runs on: its instruction-set flags and the class that decides which forward path is fastest.

A CPU with native bf16 (AMX or AVX512-BF16) runs a bf16 block of several tokens in about the time of one decode
step; an AVX2-only CPU needs several steps for it. Which kernels torch picks (oneDNN or its own) matters as much:
`hf_spec.loading.packed` chooses them by measurement.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import sys

import torch


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


def has_native_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX512-BF16): then bf16 weights are the fast choice."""
    return cpu_class(cpu_flags()[1] if flags is None else flags) in ("AMX", "AVX512-BF16")


def default_dtype() -> torch.dtype:
    """The weights' dtype for the fastest exact path on this machine: bf16 on a GPU or a CPU with native bf16,
    float32 otherwise (without native bf16 a bf16 block costs several float32 ones)."""
    if torch.cuda.is_available() or has_native_bf16():
        return torch.bfloat16
    return torch.float32


def release_freed_memory() -> None:
    """Hand memory freed inside the process back to the operating system (glibc's ``malloc_trim``; nothing elsewhere).

    Loading a float32 checkpoint into bf16, or prepacking weights, frees large temporary copies; glibc may keep some
    of those pages, which matters when several models share a 24 GB machine (the bench holds three targets).
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
