"""MIN (Belady): evict the key whose next use lies furthest in the future.

The future comes from an oracle: the simulator's trace, or a ``ScheduleLearned`` prefetch
policy at run time (``MIN(schedule)``). With objects of equal size MIN misses least of all
policies (Belady 1966); with sizes that differ it is the classic heuristic, not an optimum.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class MIN:
    """Belady's MIN. ``oracle`` is a callable ``key -> when it is next used`` (an absolute
    position; ``math.inf`` for never), or an object with such a ``next_use`` method. The next
    use is asked on insertion and on every hit. ``victim(evictable)`` takes the evictable key
    used furthest in the future; a skipped key keeps its next use."""

    name = "min"

    def __init__(self, oracle: Callable[[str], float] | Any) -> None:
        self.oracle: Callable[[str], float] = oracle.next_use if hasattr(oracle, "next_use") else oracle
        self.reset()

    def reset(self) -> None:
        self._next: dict[str, float] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def _refresh(self, key: str) -> None:
        when = float(self.oracle(key))
        self._next[key] = when
        heapq.heappush(self._heap, (-when, next(self._seq), key))
        if len(self._heap) > 4 * len(self._next) + 64:  # drop stale heap rows now and then
            self._heap = [(-w, next(self._seq), k) for k, w in self._next.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: str, nbytes: int) -> None:
        self._refresh(key)

    def on_hit(self, key: str) -> None:
        if key in self._next:
            self._refresh(key)

    def on_remove(self, key: str) -> None:
        self._next.pop(key, None)

    def _top(self) -> tuple[float, str] | None:
        while self._heap:
            negative, _, key = self._heap[0]
            if self._next.get(key) == -negative:
                return -negative, key
            heapq.heappop(self._heap)
        return None

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        skipped: list[tuple[float, int, str]] = []
        chosen = None
        while (top := self._top()) is not None:
            row = heapq.heappop(self._heap)
            if evictable is None or evictable(top[1]):
                chosen = top[1]
                break
            skipped.append(row)
        for row in skipped:
            heapq.heappush(self._heap, row)
        if chosen is not None:
            del self._next[chosen]
        return chosen

    def furthest_next_use(self) -> float:
        """When the victim-to-be is next needed (``-inf`` if nothing is tracked): a prefetch of a
        key needed later than this would evict something more urgent, so it should wait."""
        top = self._top()
        return top[0] if top is not None else -math.inf

    def next_use(self, key: str) -> float:
        return self._next.get(key, math.inf)

    def __len__(self) -> int:
        return len(self._next)
