"""Where hf_spec keeps files between processes: ``$HF_SPEC_CACHE``, or ``~/.cache/hf_spec`` (converted models,
wheels, token counts, probed costs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where wheels, converted models, token counts and probed costs are kept: ``$HF_SPEC_CACHE`` or
    ``~/.cache/hf_spec``."""
    return Path(os.environ.get("HF_SPEC_CACHE", Path.home() / ".cache" / "hf_spec"))
