"""Which kernels a pass runs on: torch's own for passes of few rows, oneDNN for the rest (`hf_spec.loading.packed`'s
``dense`` path), switched per pass and safe across threads.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import PreTrainedModel

#: The dispatch hooks registered per model: held here, never written onto the model.
_HANDLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Held through every pass of a dispatching model (and `hf_spec.loading.packed`'s timing), so two threads never see
#: each other's switch of the process-wide oneDNN flag.
ONEDNN_SWITCH = threading.RLock()


def dispatching(model: PreTrainedModel, path):
    """Run passes of at most ``path.aten_max_rows`` rows with oneDNN switched off, restored after every pass.

    ``torch.backends.mkldnn.enabled`` is one flag for the whole process, and torch has no per-thread form of it. So
    every pass of a dispatching model holds `ONEDNN_SWITCH` from its start to its end: passes of optimized models in
    several threads take turns, none runs while another has switched the flag, and the flag is back to the caller's
    value after each. Code outside hf_spec running in another thread during a 1-token pass sees oneDNN off for that
    pass (docs/cpu_kernels.md).
    """
    if path.aten_max_rows > 0:
        switch = OneDNNSwitch(path)
        _HANDLES[model] = (model.register_forward_pre_hook(switch.before, with_kwargs=True),
                           model.register_forward_hook(switch.after, always_call=True))
    return path


class OneDNNSwitch:
    """The hooks of one dispatching model (see `dispatching`); an object, not closures, so that the model pickles.
    Its per-thread stacks (the flag before each pass, innermost last) are not pickled: a copy starts with none."""

    def __init__(self, path):
        self.path = path
        self._passes = threading.local()

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids.numel() if ids is not None else kwargs["inputs_embeds"].shape[:-1].numel()
        ONEDNN_SWITCH.acquire()
        self._passes.__dict__.setdefault("stack", []).append(torch.backends.mkldnn.enabled)
        if rows <= self.path.aten_max_rows:
            torch.backends.mkldnn.enabled = False

    def after(self, module, args, output) -> None:
        saved = self._passes.__dict__.get("stack")
        if saved:
            torch.backends.mkldnn.enabled = saved.pop()
            ONEDNN_SWITCH.release()


def stop_dispatch(model: PreTrainedModel) -> None:
    """Remove the hooks `dispatching` registered on ``model`` (none: nothing to do)."""
    for handle in _HANDLES.pop(model, ()):
        handle.remove()
