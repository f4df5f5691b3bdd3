"""Old import paths of modules that moved into the package's folders keep working, with a `DeprecationWarning`.

``import hf_spec.pretrained`` gives the very module ``hf_spec.loading.pretrained`` (same object, same functions), so
code and notebooks written against 0.1 run unchanged. `MOVED` is the whole list.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module name -> new module name
MOVED = {
    "hf_spec.acceptance": "hf_spec.evaluation.draft_fit",
    "hf_spec.bench_report": "hf_spec.bench.report",
    "hf_spec.corpora": "hf_spec.evaluation.corpora",
    "hf_spec.distill": "hf_spec.evaluation.distill",
    "hf_spec.draft_length": "hf_spec.drafting.draft_length",
    "hf_spec.drafters": "hf_spec.drafting",
    "hf_spec.measure": "hf_spec.bench.measure",
    "hf_spec.models": "hf_spec.loading.tiny",
    "hf_spec.pretrained": "hf_spec.loading.pretrained",
    "hf_spec.quantization": "hf_spec.loading.quantization",
    "hf_spec.speedup": "hf_spec.drafting.speedup",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name in `MOVED` and hands back the module at its new place."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        if spec.name != "hf_spec.pretrained":  # the documented public path: no warning
            warnings.warn(f"`{spec.name}` moved to `{MOVED[spec.name]}`; the old name is kept as an alias.",
                          DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        """The module ran already, at its new name."""


def install() -> None:
    """Register the finder once (importing `hf_spec` does)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
