"""CLOCK: FIFO with reinsertion. A hit raises a key's counter (one bit by default); the oldest key
with a counter above zero is moved to the new end with its counter lowered, instead of evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any


class CLOCK:
    """CLOCK with an ``bits``-bit counter per key (libCacheSim's ``Clock``, ``n-bit-counter``).

    ``victim(evictable)``: a key the predicate refuses keeps its place and its counter (it is
    neither given another round nor evicted)."""

    name = "clock"

    def __init__(self, bits: int = 1) -> None:
        if bits < 1:
            raise ValueError(f"bits must be at least 1, not {bits}")
        self.max_count = (1 << bits) - 1
        self._queue: OrderedDict[Hashable, int] = OrderedDict()  # key -> counter, oldest first

    def reset(self) -> None:
        self._queue.clear()

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        self._queue.pop(key, None)
        self._queue[key] = 0

    def on_hit(self, key: Hashable) -> None:
        count = self._queue.get(key)
        if count is not None and count < self.max_count:
            self._queue[key] = count + 1

    def on_remove(self, key: Hashable) -> None:
        self._queue.pop(key, None)

    def victim(self, evictable: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        queue = self._queue
        if evictable is None:
            while queue:
                key, count = queue.popitem(last=False)
                if not count:
                    return key
                queue[key] = count - 1
            return None
        skipped: list[tuple[Hashable, int]] = []
        chosen = None
        while queue:
            key, count = queue.popitem(last=False)
            if not evictable(key):
                skipped.append((key, count))
            elif count:
                queue[key] = count - 1
            else:
                chosen = key
                break
        for key, count in reversed(skipped):  # back to the old end, in their order
            queue[key] = count
            queue.move_to_end(key, last=False)
        return chosen

    def replay(self, keys: Sequence[Any], sizes: Sequence[int], capacity: int) -> tuple[int, int]:
        """The one-tier simulation of ``keys`` (one size per key) at ``capacity`` bytes from an
        empty cache (it resets the policy): ``(misses, missed bytes)``."""
        self.reset()
        queue, top = self._queue, self.max_count
        size_of: dict[Hashable, int] = {}
        popitem = queue.popitem
        used = misses = missed = 0
        for key, size in zip(keys, sizes, strict=True):
            count = queue.get(key)
            if count is not None:
                if count < top:
                    queue[key] = count + 1
                continue
            misses += 1
            missed += size
            if size > capacity:
                continue
            while used + size > capacity:
                victim, count = popitem(last=False)
                if count:
                    queue[victim] = count - 1
                else:
                    used -= size_of.pop(victim)
            queue[key] = 0
            size_of[key] = size
            used += size
        return misses, missed

    def __len__(self) -> int:
        return len(self._queue)
