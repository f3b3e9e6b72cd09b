"""On/off options: a bool, nothing else. A string or a number would read as true or false without
a word (``overwrite="no"`` deleting what it was meant to keep)."""

from __future__ import annotations

from typing import Any

import numpy as np


def require_flag(name: str, value: Any, *, none: str | None = None) -> Any:
    """``value`` if it is ``True`` or ``False`` (numpy's too, as a bool; or None, where ``none``
    says what None means), else ``TypeError`` naming the option ``name``."""
    if value.__class__ is bool or (none is not None and value is None):
        return value
    if isinstance(value, np.bool_):  # (a flag read from a config through numpy)
        return bool(value)
    raise TypeError(f"{name} must be True or False{f' (or None: {none})' if none else ''}, not {value!r}")
