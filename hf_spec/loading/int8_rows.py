"""An int8 weight-only multiply that reads each weight once for a block of rows, on CPUs with AVX512-BF16.

`kernels/int8_rows.cpp` is compiled on first use by torch's C++ extension loader and cached per machine.

torch's own kernel (``aten._weight_int8pack_mm``) streams the whole weight again for every 4 rows and converts it to
float32 for each, so a verify pass over 6 tokens costs several decoding steps. This one reads the weight in tiles laid
out for it (`tiles`: 32 inputs of 4 outputs side by side, one sequential stream per thread), casts each weight to bf16
once in registers and multiplies it with every row (``vdpbf16ps``, float32 sums); a row's sum runs in the same order
whatever the number of rows beside it, so a verify pass computes each position exactly as a step would.

The same module holds ``int8_dynamic_mm`` for ``quantize="w8a8"`` (`hf_spec.loading.weight_only`): each row's inputs
quantized to int8 per group of `GROUP` inputs, multiplied with the int8 weights by integer dot products (``vpdpbusd``,
AVX512-VNNI; the weights laid out by `vnni_tiles`), so that nothing is converted per weight and a block of rows costs
little more than one. A group's sum is an exact integer and the groups are added in order, so here too a row's
output does not depend on the rows beside it.

`rows_kernel()` is the compiled module, or ``None`` where it cannot run here (no AVX512-BF16, no C++ compiler or
``ninja``, or ``HF_SPEC_INT8_KERNEL=0``); `why_not()` says why, and int8 layers then use torch's kernel.
`dynamic_kernel()` is the module where AVX512-VNNI runs too; ``"w8a8"`` is refused where it is ``None``.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from pathlib import Path

import torch

from hf_spec.loading.cpu import cpu_flags

#: The C++ source of the kernel.
SOURCE = Path(__file__).with_name("kernels") / "int8_rows.cpp"
#: Inputs per multiply instruction: a layer's ``in_features`` must be a multiple.
DEPTH = 32
#: Outputs per tile: a layer's ``out_features`` must be a multiple.
TILE = 4
#: Set to ``0`` to keep int8 layers on torch's kernel (for a comparison, or where building is unwanted); ``1``, the
#: default, takes the rows kernel where it runs; any other value is an error.
SWITCH = "HF_SPEC_INT8_KERNEL"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-fopenmp"]
#: Inputs per activation scale of the ``"w8a8"`` multiply (`dynamic_kernel`): a layer's ``in_features`` must be a
#: multiple.
GROUP = 32
#: Outputs per vector of the ``"w8a8"`` multiply: a layer's ``out_features`` must be a multiple.
LANES = 16
_BUILDING = threading.Lock()  # threads quantizing models at once build (or load) the module once


@functools.cache
def _build() -> tuple[object | None, str | None]:
    """``(module, None)``, or ``(None, the reason it cannot run here)``; built at most once per process."""
    with _BUILDING:
        return _built()


def _built() -> tuple[object | None, str | None]:
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"`{SWITCH}` must be '0' (torch's int8 kernel) or '1' (the rows kernel where it runs), but is "
                         f"{switch!r}.")
    if switch == "0":
        return None, f"{SWITCH}=0"
    if "avx512_bf16" not in cpu_flags()[1]:
        return None, "this CPU has no AVX512-BF16"
    from torch.utils.cpp_extension import load

    try:
        module = load("hf_spec_int8_rows", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
    except (OSError, RuntimeError, ImportError, SystemExit) as error:  # no compiler, no ninja, a failed build
        return None, f"building {SOURCE.name} failed ({type(error).__name__}: {str(error).strip()[:200]})"
    return module, None


def rows_kernel() -> object | None:
    """The compiled module (``int8_rows_mm(x, w, scales)``), or ``None`` where it cannot run (a warning says why,
    once per process, except where the CPU lacks the instructions or the switch is off)."""
    module, reason = _build()
    if module is None and reason.startswith("building"):
        _warn_once(reason)
    return module


def dynamic_kernel() -> object | None:
    """The compiled module where its ``int8_dynamic_mm(x, w, scales)`` runs (`rows_kernel`, on a CPU with AVX512-VNNI
    too), else ``None``."""
    module = rows_kernel()
    return module if module is not None and _has_vnni() else None


@functools.cache
def _has_vnni() -> bool:
    return "avx512_vnni" in cpu_flags()[1]


def why_not() -> str | None:
    """Why `rows_kernel` is ``None``, or ``None`` when it runs."""
    return _build()[1]


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"int8 weight-only layers fall back to torch's kernel: {reason}.", stacklevel=3)


def fits(in_features: int, out_features: int, dtype: torch.dtype) -> bool:
    """Whether a layer of this shape with activations of this dtype can take the kernel (bf16, ``in_features`` a
    multiple of `DEPTH`, ``out_features`` of `TILE`); the CPU and the build are checked by `rows_kernel`."""
    return dtype == torch.bfloat16 and in_features % DEPTH == 0 and out_features % TILE == 0


def tiles(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of int8 weights ``[out, in]``: ``[out / TILE, in / DEPTH, TILE, DEPTH]``."""
    out_features, in_features = codes.shape
    return codes.view(out_features // TILE, TILE, in_features // DEPTH, DEPTH).transpose(1, 2).contiguous()


def untiled(weight_tiles: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` from `tiles` (a copy), in the dtype of ``weight_tiles``."""
    groups, depth_blocks, tile, depth = weight_tiles.shape
    return weight_tiles.transpose(1, 2).reshape(groups * tile, depth_blocks * depth)


def fits_dynamic(in_features: int, out_features: int) -> bool:
    """Whether a layer of this shape can take ``int8_dynamic_mm`` (``in_features`` a multiple of `GROUP`,
    ``out_features`` of `LANES`); the CPU and the build are checked by `dynamic_kernel`."""
    return in_features % GROUP == 0 and out_features % LANES == 0


def vnni_tiles(codes: torch.Tensor) -> torch.Tensor:
    """``int8_dynamic_mm``'s layout of int8 weights ``[out, in]``: the bytes ``codes + 128`` as
    ``[out / LANES, in / 4, LANES, 4]`` (4 consecutive inputs of `LANES` outputs side by side)."""
    out_features, in_features = codes.shape
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    return unsigned.view(out_features // LANES, LANES, in_features // 4, 4).transpose(1, 2).contiguous()


def from_vnni_tiles(weight: torch.Tensor) -> torch.Tensor:
    """int8 ``[out, in]`` from `vnni_tiles` (a copy)."""
    blocks, quads, lanes, four = weight.shape
    return (weight.transpose(1, 2).reshape(blocks * lanes, quads * four).to(torch.int16) - 128).to(torch.int8)
