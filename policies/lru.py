"""LRU: evict the key least recently inserted or hit."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


class LRU:
    """Least recently used. ``victim`` is the oldest evictable key; a hit moves a key to the young
    end. A key skipped by the ``evictable`` predicate keeps its place in the order."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def on_insert(self, key: str, nbytes: int) -> None:
        self._order[key] = nbytes
        self._order.move_to_end(key)

    def on_hit(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        key = next((k for k in self._order if evictable is None or evictable(k)), None)
        if key is not None:
            del self._order[key]
        return key

    def ranked(self, count: int) -> list[str]:
        """The ``count`` keys ``victim()`` would take first, in that order (least recently
        used first), without taking them."""
        return list(itertools.islice(self._order, count))

    def reset(self) -> None:
        self._order.clear()

    def replay(self, keys: Sequence[Any], sizes: Sequence[int], capacity: int) -> tuple[int, int]:
        """The one-tier simulation of ``keys`` (one size per key) at ``capacity`` bytes from an
        empty cache (it resets the policy), in one tight loop: ``(misses, missed bytes)``, the
        same answers as the simulator's loop over the protocol calls."""
        self.reset()
        order = self._order
        move_to_end, popitem = order.move_to_end, order.popitem
        used = misses = missed = 0
        for key, size in zip(keys, sizes, strict=True):
            if key in order:
                move_to_end(key)
                continue
            misses += 1
            missed += size
            if size > capacity:
                continue
            used += size
            while used > capacity:
                used -= popitem(last=False)[1]
            order[key] = size
        return misses, missed

    def __len__(self) -> int:
        return len(self._order)
