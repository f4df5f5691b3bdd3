"""The files of an EAGLE-3 head: which weights file a folder names, reading and writing the speculators format and
EAGLE-3's reference layout (the configs are `hf_spec.heads.speculators`'), damaged files refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_spec.heads.speculators import REFERENCE_PREFIX, Eagle3HeadConfig, eagle3_layout

#: Weight files a checkpoint folder names, in the order they are looked for (transformers' names).
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")


def read_checkpoint(folder: Path) -> tuple[Eagle3HeadConfig, dict[str, torch.Tensor]]:
    """The config and the weights of ``folder`` (the weights file, or the index, it names: `WEIGHT_FILES`; a reference
    checkpoint's ``midlayer.*`` renamed). A damaged file is refused naming the folder and the file."""
    config = Eagle3HeadConfig.from_speculators(read_json(folder / "config.json"), str(folder))
    state = {}
    for file in weight_files(folder):
        state.update(_load_weights(file))
    for name, value in state.items():
        if name not in ("d2t", "t2d") and not value.is_floating_point():
            raise ValueError(f"{folder}: the weight `{name}` holds {value.dtype} values, not floating-point ones; the "
                             "checkpoint is damaged.")
    return config, {(("layers.0." + name[len(REFERENCE_PREFIX):]) if name.startswith(REFERENCE_PREFIX) else name):
                    value for name, value in state.items()}


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; an unreadable or damaged file is refused by name."""
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as JSON ({error}); the file is damaged or missing.") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path} holds {type(values).__name__}, not a JSON object; the file is damaged.")
    return values


def weight_files(folder: Path) -> list[Path]:
    """The weight files ``folder`` names: the first of `WEIGHT_FILES` it holds (an index: the files it maps to).
    Other files beside them (a stray ``model_v0.safetensors``) are never read."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [path]
        weight_map = read_json(path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{path} has no `weight_map`; the index is damaged.")
        files = [folder / file for file in sorted(set(weight_map.values()))]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise FileNotFoundError(f"{path} names weight files {folder} does not hold: {missing}.")
        return files
    raise FileNotFoundError(f"{folder} holds none of the weight files {list(WEIGHT_FILES)}.")


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors or PyTorch (``.bin``, read with ``weights_only``) file."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file))
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors, pickle and zip readers each raise their own kinds
        raise ValueError(f"{file} cannot be read as weights ({type(error).__name__}: {error}); the file is "
                         "damaged.") from error
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(f"{file} does not hold a dict of tensors; the file is damaged.")
    return state


def write_checkpoint(folder: Path, config: Eagle3HeadConfig, state: dict[str, torch.Tensor],
                     dtype: torch.dtype, layout: str = "speculators") -> None:
    """``config.json`` and ``model.safetensors`` in ``folder``: the speculators format
    (`Eagle3HeadConfig.to_speculators`), or the reference layout (`Eagle3HeadConfig.to_reference`, the layer under
    ``midlayer.*``)."""
    from safetensors.torch import save_file

    if layout not in ("speculators", "reference"):
        raise ValueError(f"`layout` must be 'speculators' or 'reference', but is {layout!r}.")
    name = str(dtype).removeprefix("torch.")
    if layout == "speculators":
        values = config.to_speculators()
        values["transformer_layer_config"] = {**values["transformer_layer_config"], "dtype": name}
    else:
        values = config.to_reference()
        state = {(REFERENCE_PREFIX + key[len("layers.0."):]) if key.startswith("layers.0.") else key: value
                 for key, value in state.items()}
    values["dtype"] = name
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key: value.detach().contiguous().cpu() for key, value in state.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(values, indent=2) + "\n")


def local_folder(name: str, **kwargs) -> Path:
    """A local folder, or the Hub snapshot of a repository (``huggingface_hub``: offline-cached, or downloaded)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} holds no config.json, so it is not a saved EAGLE-3 head.")
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.bin"],
                                  **{key: kwargs[key] for key in ("revision", "token", "cache_dir") if key in kwargs}))


def is_eagle3_folder(name: str) -> bool:
    """Whether ``name`` is a local folder holding an EAGLE-3 head (speculators format or reference)."""
    config = Path(name) / "config.json"
    return config.is_file() and eagle3_layout(read_json(config)) is not None
