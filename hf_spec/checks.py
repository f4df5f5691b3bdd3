"""Argument checks shared by every public entry point: one rule, one message, the argument named with its value."""

from __future__ import annotations

import numbers
from typing import Any


def is_int_at_least(value: Any, minimum: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``minimum``."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= minimum


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an ``int``; ``ValueError`` naming ``name`` and the value unless it is an integer >= ``minimum``."""
    if not is_int_at_least(value, minimum):
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"`{name}` must be {wanted}, but is {value!r} ({type(value).__name__}).")
    return int(value)
