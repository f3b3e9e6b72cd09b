"""What a prefetch policy's ``suggest()`` gives, read the same way by the store and the
simulator (no torch here: the simulator runs without it)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

#: At most this many suggestions are read from one ``suggest()`` call (a policy's generator
#: that never ends would hold the loop for ever); far more than the store's queue keeps.
MAX_SUGGESTIONS = 16384


def read_suggestions(policy: Any) -> list[tuple[Any, str | None]]:
    """The first ``MAX_SUGGESTIONS`` of ``policy.suggest()``, checked to be ``(key, tier)``
    pairs (``TypeError`` naming what else came)."""
    suggestions = []
    for item in itertools.islice(policy.suggest(), MAX_SUGGESTIONS):
        if item.__class__ is tuple and len(item) == 2 and item[0].__class__ is str and (item[1] is None or item[1].__class__ is str):
            suggestions.append(item)  # (the common form, checked without the ABC's isinstance: a call per access, dozens of items)
            continue
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Hashable)
                and (item[1] is None or isinstance(item[1], str))):
            raise TypeError(f"suggest() gave {item!r}, not a (key, tier name or None) pair")
        suggestions.append((item[0], item[1]))
    return suggestions
