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
        #: An oracle object with a ``revision`` (``ScheduleLearned``): when it moves, every key's
        #: next use is asked anew before a victim is chosen (asked only at insertion and hits,
        #: the uses foreseen before a reversal, or before any order was learned, chose victims
        #: needed next: a resumed optimizer's second step read 2-3x its need).
        owner = oracle if hasattr(oracle, "next_use") else getattr(oracle, "__self__", None)  # (``MIN(schedule.next_use)`` too)
        self._revised = owner if hasattr(owner, "revision") else None
        self.reset()

    def reset(self) -> None:
        self._revision = getattr(self._revised, "revision", None)
        self._next: dict[str, float] = {}
        #: Each key's last insertion or hit, in the order of ``_seq``.
        self._last: dict[str, int] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        #: Rows of keys ``victim`` found not evictable (in use), out of the heap until the store
        #: says their copy is free again (``on_release``): the keys in use are the ones just hit,
        #: so the furthest next uses, the heap's top, and each victim() went through all of them
        #: again (with 8,000 small entries paged by an optimizer: 230 a call, the step 4x slower).
        self._parked: dict[str, tuple[float, int, str]] = {}
        #: The parked rows as a heap too (rows no longer parked are dropped as they surface), so
        #: ``furthest_next_use`` still sees a passed-over key's next use.
        self._parked_rows: list[tuple[float, int, str]] = []

    def _refresh(self, key: str) -> None:
        when = float(self.oracle(key))
        self._parked.pop(key, None)
        self._next[key] = when
        seq = self._last[key] = next(self._seq)  # (ties go least recently used first)
        heapq.heappush(self._heap, (-when, seq, key))
        if len(self._heap) > 4 * len(self._next) + 64:  # drop stale heap rows now and then
            parked = self._parked
            self._heap = [(-w, self._last[k], k) for k, w in self._next.items() if k not in parked]
            heapq.heapify(self._heap)

    def on_insert(self, key: str, nbytes: int) -> None:
        self._refresh(key)

    def on_hit(self, key: str) -> None:
        if key in self._next:
            self._refresh(key)

    def on_remove(self, key: str) -> None:
        self._next.pop(key, None)
        self._last.pop(key, None)
        self._parked.pop(key, None)

    def on_release(self, key: str) -> None:
        """The store: ``key``'s copy, in use when ``victim`` passed it over, may go again."""
        row = self._parked.pop(key, None)
        if row is not None and self._current(row):
            heapq.heappush(self._heap, row)

    def _current(self, row: tuple[float, int, str]) -> bool:
        """Whether ``row`` is its key's latest (a hit leaves the row before it in the heap:
        with the same next use it would still pass, and rank the key by its older use)."""
        return self._last.get(row[2]) == row[1] and self._next.get(row[2]) == -row[0]

    def _top(self) -> tuple[float, str] | None:
        while self._heap:
            row = self._heap[0]
            if self._current(row):
                return -row[0], row[2]
            heapq.heappop(self._heap)
        return None

    def _ask_again(self) -> None:
        """Every key's next use from the oracle, if its predictions changed since last asked."""
        revised = self._revised
        if revised is None or revised.revision == self._revision:
            return
        asked = {key: float(self.oracle(key)) for key in self._next}  # (all or nothing, should it raise)
        self._revision = revised.revision
        self._next = asked
        self._parked.clear()  # (those in use are found again by the next victim())
        self._parked_rows.clear()
        self._heap = [(-when, self._last[key], key) for key, when in asked.items()]
        heapq.heapify(self._heap)

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        self._ask_again()
        # Park only where the store says each key refused is in use, a use whose end it tells
        # (``on_release``); refused for another reason (no room below it), a key stays.
        park = evictable is not None and getattr(evictable, "releases", False)
        if not park:
            self._unpark_all()
        chosen = self._take(evictable, park)
        if chosen is None and self._parked:  # (nothing else may go: look at them again)
            self._unpark_all()
            chosen = self._take(evictable, park=False)
        if chosen is not None:
            del self._next[chosen]
            del self._last[chosen]
            self._parked.pop(chosen, None)  # (a second row of it, left by a hit at the same next use)
        return chosen

    def _unpark_all(self) -> None:
        if not self._parked:
            return
        for row in self._parked.values():
            heapq.heappush(self._heap, row)
        self._parked.clear()
        self._parked_rows.clear()

    def _take(self, evictable: Callable[[str], bool] | None, park: bool) -> str | None:
        """Pop the furthest-used key ``evictable`` allows; the rows passed over are parked
        (``on_release`` puts each back) or, with ``park`` False, pushed back at once."""
        skipped: list[tuple[float, int, str]] = []
        chosen = None
        while (top := self._top()) is not None:
            row = heapq.heappop(self._heap)
            if evictable is None or evictable(top[1]):
                chosen = top[1]
                break
            if park:
                self._parked[top[1]] = row
                heapq.heappush(self._parked_rows, row)
                if len(self._parked_rows) > 4 * len(self._parked) + 64:  # (rows of keys released or hit since)
                    self._parked_rows = list(self._parked.values())
                    heapq.heapify(self._parked_rows)
            else:
                skipped.append(row)
        for row in skipped:
            heapq.heappush(self._heap, row)
        return chosen

    def ranked(self, count: int) -> list[str]:
        """The ``count`` tracked keys ``victim()`` would take first, in that order (furthest
        next use first; in use or not), without taking them: an optimizer writes back early the
        states it is about to evict, not those it keeps."""
        self._ask_again()
        rows = [(-when, self._last[key], key) for key, when in self._next.items()]
        return [key for _, _, key in heapq.nsmallest(count, rows)]

    def furthest_next_use(self) -> float:
        """When the victim-to-be is next needed (``-inf`` if nothing is tracked): a prefetch of a
        key needed later than this would evict something more urgent, so it should wait."""
        self._ask_again()
        top = self._top()
        rows, parked = self._parked_rows, self._parked
        while rows and parked.get(rows[0][2]) is not rows[0]:
            heapq.heappop(rows)
        return max(top[0] if top is not None else -math.inf, -rows[0][0] if rows else -math.inf)

    def next_use(self, key: str) -> float:
        return self._next.get(key, math.inf)

    def __len__(self) -> int:
        return len(self._next)
