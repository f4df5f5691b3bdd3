"""Which kind of draft head a folder holds, and loading it: `head_kind`, `load_head`.

- ``"eagle"``: a `hf_spec.heads.model.DraftHead` (``save_pretrained``'s ``config.json`` names its model type);
- ``"eagle3"``: an `hf_spec.heads.eagle3.Eagle3Head`, in the speculators format (what ``hf-spec train-head
  --architecture eagle3`` writes and vLLM serves) or EAGLE-3's reference layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_spec.heads.base import DraftHeadBase
from hf_spec.heads.checkpoints import is_eagle3_folder
from hf_spec.heads.eagle3 import Eagle3Head
from hf_spec.heads.model import DraftHead, DraftHeadConfig


def head_kind(name: str) -> str | None:
    """``"eagle"``, ``"eagle3"``, or ``None`` when ``name`` is not a local folder holding a draft head."""
    config = Path(name) / "config.json"
    if not config.is_file():
        return None
    if is_eagle3_folder(name):
        return "eagle3"
    return "eagle" if json.loads(config.read_text()).get("model_type") == DraftHeadConfig.model_type else None


def load_head(name: str, target, dtype: torch.dtype | None = None) -> DraftHeadBase:
    """The head saved in ``name``, in ``dtype`` (default: the target's) on the target's device, attached to
    ``target`` (which checks that it was built for it)."""
    kind = head_kind(name)
    if kind is None:
        raise ValueError(f"{name} holds no draft head (no config.json of a DraftHead or of an EAGLE-3 head).")
    head = (Eagle3Head if kind == "eagle3" else DraftHead).from_pretrained(name)
    device = target.get_input_embeddings().weight.device
    return head.to(dtype=dtype or target.dtype, device=device).eval().attach(target)
