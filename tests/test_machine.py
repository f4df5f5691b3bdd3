"""The CPU class every figure and every CI log names (`hf_spec.loading.cpu.cpu_class`, the pytest header)."""

from __future__ import annotations

import pytest
from conftest import pytest_report_header

from hf_spec.bench.measure import machine_info
from hf_spec.loading.cpu import cpu_class


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "AMX"),
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512-BF16"),
    ({"avx2", "avx512f"}, "AVX512"),
    ({"avx2", "fma"}, "AVX2"),
    (set(), "other"),
])
def test_cpu_class_from_flags(flags, expected):
    assert cpu_class(flags) == expected


def test_the_pytest_header_names_this_cpu_class_and_the_4bit_path():
    lines = pytest_report_header(None)
    assert f"class: {machine_info()['cpu_class']}" in lines[0]
    assert any(line.startswith("bitsandbytes") for line in lines)
