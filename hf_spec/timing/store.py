"""Probed costs kept on disk, so that a fresh process's first automatic call starts from measured costs without
probing: one JSON file per (machine: its CPU model and flags; torch; hf_spec's version and kernel sources; the two
models' architectures, dtypes, devices and kernels; the drafter's kind; threads) under ``$HF_SPEC_CACHE/costs``
(`hf_spec.storage.cache_dir`). The CPU paths `hf_spec.loading.packed.optimize` chose are kept there too, one file per
(machine, torch, kernels, threads, role, the timed widths, the model's architecture, dtype and layers), so that a
later process loads its models without timing them.

A timing taken while other processes loaded the machine is not written (`hf_spec.timing.load`), and a call whose own
timings disagree with a stored table corrects it (`hf_spec.timing.probe.correct_costs`).

Costs depend on the shapes and the kernels, not on the weights' values, so a model is identified by its config, dtype,
device and the kinds of its modules and hooks (packed layers, the kernel dispatch), never by its weights.
``$HF_SPEC_COST_STORE=off`` keeps everything in the process (the test suite does); a path puts the files there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from hf_spec.storage import cache_dir

#: The variable that moves (a path) or turns off (``off``) the store.
STORE_VARIABLE = "HF_SPEC_COST_STORE"


def store_folder() -> Path | None:
    """Where tables are kept, or ``None`` when the store is off."""
    setting = os.environ.get(STORE_VARIABLE)
    if setting == "off":
        return None
    return Path(setting) if setting else cache_dir() / "costs"


def store_key(target, draft_model, drafter, threads: int) -> str:
    """A file name for the costs of this pair on this machine: the hash of everything they depend on."""
    kind = type(drafter).__name__ if drafter is not None else ""
    parts = [_machine(), torch.__version__, _kernels(), str(threads), kind, _model_signature(target),
             _model_signature(draft_model)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def load_table(key: str, table_type: type):
    """The stored table of ``key`` (a `hf_spec.sizing.costs.CostTable`), or ``None`` (none, unreadable, store off)."""
    values = _read(key)
    try:
        return None if values is None else table_type(
            values["target_step_seconds"], values["draft_step_seconds"],
            {int(size): float(s) for size, s in values["target_block_seconds"].items()},
            {int(width): float(s) for width, s in values["draft_pass_seconds"].items()})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # a damaged file is measured again, and overwritten


def save_table(key: str, table) -> None:
    """Keep ``table`` for later processes."""
    _write(key, dataclasses.asdict(table))


def path_key(model, role: str, widths: list[int], repeats: int) -> str:
    """A file name for the CPU path `hf_spec.loading.packed.optimize` chose for a model of this kind, in this role,
    on this machine and thread count (its timings decide it, and seed auto k's costs)."""
    parts = ["cpu path", _machine(), torch.__version__, _kernels(), str(torch.get_num_threads()), role,
             str(sorted(widths)), str(repeats), _model_signature(model)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def load_path(key: str) -> dict | None:
    """The stored choice of ``key``: ``{"name", "aten_max_rows", "seconds", "reason"}`` (``seconds``: candidate ->
    tokens -> seconds), or ``None``."""
    values = _read(key)
    try:
        return None if values is None else {
            "name": str(values["name"]), "aten_max_rows": int(values["aten_max_rows"]), "reason": str(values["reason"]),
            "seconds": {str(name): {int(width): float(s) for width, s in by_width.items()}
                        for name, by_width in values["seconds"].items()}}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def save_path(key: str, values: dict) -> None:
    """Keep a chosen path (`load_path`'s fields) for later processes."""
    _write(key, values)


def _read(key: str) -> dict | None:
    folder = store_folder()
    if folder is None or not (folder / f"{key}.json").is_file():
        return None
    try:
        return json.loads((folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _write(key: str, values: dict) -> None:
    """Written whole, then renamed: readers never see half a file."""
    folder = store_folder()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as file:
            json.dump(values, file)
        os.replace(file.name, folder / f"{key}.json")
    except OSError:
        pass  # a read-only cache: the values stay in the process


def _machine() -> str:
    """The CPU model, its feature flags and the machine's architecture (what decides the kernels' speed)."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        model = platform.processor()
    return f"{platform.machine()} {model} {flags} {os.cpu_count()}"


@functools.cache
def _kernels() -> str:
    """hf_spec's version and its C++ kernels' sources (a rebuilt kernel times differently; torch's version, beside it
    in the keys, fixes the oneDNN it bundles)."""
    sources = sorted((Path(__file__).parent.parent / "loading" / "kernels").glob("*.cpp"))
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:16]
    from hf_spec import __version__

    return f"{__version__} {digest}"


def _model_signature(model) -> str:
    """A model's config, dtype, device, linear layers' shapes (a pruned vocabulary's output layer is not in the
    config), module kinds and forward hooks' owners (kernel dispatch); no weights."""
    if model is None:
        return ""
    config = getattr(model, "config", None)
    described = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else ""
    kinds = sorted({type(module).__name__ + ("+rows kernel" if getattr(module, "takes_rows_kernel", False) else "")
                    + ("+dynamic kernel" if getattr(module, "takes_dynamic_kernel", False) else "")
                    for module in model.modules()})  # an int8 layer on hf_spec's kernels or on torch's
    hooks = sorted(repr(getattr(getattr(hook, "__self__", None), "path", None))
                   for hook in model._forward_pre_hooks.values())
    shapes = sorted({f"{module.in_features}x{module.out_features}" for module in model.modules()
                     if hasattr(module, "in_features") and hasattr(module, "out_features")})
    return f"{described}|{getattr(model, 'dtype', None)}|{getattr(model, 'device', None)}|{shapes}|{kinds}|{hooks}"
