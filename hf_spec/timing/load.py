"""How busy the rest of the machine was while hf_spec timed something: a timing taken while other processes kept the
CPUs busy is not kept for later processes (`hf_spec.timing.probe`, `hf_spec.loading.packed`).

`LoadMeter` reads, around a block, the CPU time every process spent (``/proc/stat``, all CPUs) and the time this
process spent (``os.times``); what others spent, over the block's wall time and the CPUs, is their share of the
machine. Steal time (a hypervisor's other guests) counts as others'. Where ``/proc/stat`` cannot be read (not Linux),
nothing is known and nothing counts as loaded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Other processes' share of the machine's CPUs above which a timing is not kept.
BUSY_SHARE = 0.25
#: ``off`` reads nothing: every block's load is unknown (never loaded, and no call's timings correct stored costs).
SWITCH = "HF_SPEC_LOAD_METER"


class LoadMeter:
    """``with LoadMeter() as meter: ...`` then ``meter.others_share`` (0 to 1, ``None`` where unknown) and
    ``meter.is_loaded``."""

    def __init__(self) -> None:
        self.others_share: float | None = None

    def __enter__(self) -> LoadMeter:
        self._start = _cpu_seconds(), _own_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if os.environ.get(SWITCH) == "off":
            return
        (busy, cpus), own, wall = _cpu_seconds(), _own_seconds(), time.perf_counter()
        (busy_before, _), own_before, wall_before = self._start
        if busy is None or busy_before is None or wall <= wall_before:
            return
        others = max(0.0, (busy - busy_before) - (own - own_before))
        self.others_share = min(1.0, others / ((wall - wall_before) * cpus))

    @property
    def is_loaded(self) -> bool:
        return self.others_share is not None and self.others_share > BUSY_SHARE


def _cpu_seconds() -> tuple[float | None, int]:
    """CPU seconds every process spent busy since boot (user, nice, system, interrupts, steal), and the CPU count."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None, 1
    fields = [int(value) for value in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(fields) - fields[3] - fields[4]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit()) or 1
    return busy / os.sysconf("SC_CLK_TCK"), cpus


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system
