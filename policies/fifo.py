"""FIFO: evict the key inserted longest ago; hits change nothing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


class FIFO:
    """First in, first out. A key skipped by the ``evictable`` predicate keeps its place."""

    name = "fifo"

    def __init__(self) -> None:
        self._queue: OrderedDict[str, int] = OrderedDict()

    def on_insert(self, key: str, nbytes: int) -> None:
        self._queue.pop(key, None)
        self._queue[key] = nbytes

    def on_hit(self, key: str) -> None:
        pass

    def on_remove(self, key: str) -> None:
        self._queue.pop(key, None)

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        key = next((k for k in self._queue if evictable is None or evictable(k)), None)
        if key is not None:
            del self._queue[key]
        return key

    def reset(self) -> None:
        self._queue.clear()

    def replay(self, keys: Sequence[Any], sizes: Sequence[int], capacity: int) -> tuple[int, int]:
        """The one-tier simulation of ``keys`` (one size per key) at ``capacity`` bytes from an
        empty cache (it resets the policy): ``(misses, missed bytes)``."""
        self.reset()
        queue = self._queue
        popitem = queue.popitem
        used = misses = missed = 0
        for key, size in zip(keys, sizes, strict=True):
            if key in queue:
                continue
            misses += 1
            missed += size
            if size > capacity:
                continue
            used += size
            while used > capacity:
                used -= popitem(last=False)[1]
            queue[key] = size
        return misses, missed

    def __len__(self) -> int:
        return len(self._queue)
