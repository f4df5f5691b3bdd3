"""Shared fixtures: tiny random-weight Llama models (milliseconds per forward) and one thread per test process.

Helpers that are not fixtures are in ``helpers.py``."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_noisy_copy, make_tiny_model, small_target_model

from hf_spec import speculative

torch.set_num_threads(1)
# Probed costs stay in each process (and its subprocesses): a table another run stored would skip the probes tests
# time; `tests/test_draft_length.py` turns the store on where it tests it.
os.environ["HF_SPEC_COST_STORE"] = "off"
# Whether other processes load the machine decides what is stored (`hf_spec.timing.load`): unknown here, so that a
# test's outcome never depends on what else runs; `tests/test_packed.py` sets the load where it tests it.
os.environ["HF_SPEC_LOAD_METER"] = "off"


@pytest.fixture(scope="session")
def small_target():
    """The statistical tests' target (`helpers.small_target_model`), speculative."""
    return speculative(small_target_model())


@pytest.fixture(scope="session")
def small_draft(small_target):
    """Close enough to the small target for about 50% acceptance: both acceptance and rejection paths run."""
    return make_noisy_copy(small_target, seed=12, noise=1.0)


@pytest.fixture(scope="session")
def target():
    return speculative(make_tiny_model(seed=0))


@pytest.fixture(scope="session")
def random_draft():
    return make_tiny_model(seed=1)


@pytest.fixture(scope="session")
def close_draft(target):
    return make_noisy_copy(target, seed=2, noise=0.5)


def pytest_report_header(config) -> list[str]:
    """Which CPU path this run takes: the instruction-set flags that decide bf16 speed, oneDNN's use and
    bitsandbytes' 4-bit path (packed for AVX512-BF16, dequantizing otherwise)."""
    from hf_spec.bench.measure import machine_info

    machine = machine_info()
    flags = ", ".join(machine["cpu_bf16_flags"]) or "none of avx2/avx512/amx"
    onednn = "available" if torch.backends.mkldnn.is_available() else "unavailable"
    lines = [f"cpu: {machine['cpu']}; flags: {flags}; class: {machine['cpu_class']}",
             (f"torch {machine['torch']} (cpu capability {torch.backends.cpu.get_cpu_capability()}, oneDNN {onednn}), "
             f"transformers {machine['transformers']}")]
    try:
        from hf_spec.loading.quantization import packs_4bit_for_cpu

        lines.append("bitsandbytes 4-bit CPU path: "
                     + ("packed (fused AVX512-BF16 kernel)" if packs_4bit_for_cpu() else "dequantizing (AVX2)"))
    except ImportError:
        lines.append("bitsandbytes: not installed")
    return lines
