"""SLRU: segmented LRU. Keys enter the lowest segment; a hit promotes a key one segment up (the
top segment is plain LRU); a segment over its share of the bytes demotes its least recent key one
segment down. Victims come from the lowest segment that holds anything."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class SLRU:
    """Segmented LRU in bytes, as libCacheSim's ``SLRU`` (default four equal segments): a new key
    goes to the lowest segment with room for it, else to segment 0. Demotions cascade downwards;
    segment 0 may run over its share until the next ``victim`` (libCacheSim evicts there and
    then, which only differs when sizes differ).

    ``victim(evictable)``: the least recent evictable key of the lowest segment that has one; a
    refused key keeps its segment and its place."""

    name = "slru"

    def __init__(self, capacity: int | None = None, segments: int | list[float] = 4) -> None:
        shares = [1.0] * segments if isinstance(segments, int) else [float(s) for s in segments]
        if not shares or min(shares) <= 0:
            raise ValueError(f"segments must be a positive count or positive shares, not {segments!r}")
        self.shares = [s / sum(shares) for s in shares]
        self.capacity = capacity
        self.reset()

    def set_capacity(self, nbytes: int) -> None:
        self.capacity = nbytes
        self._limits = [int(share * nbytes) for share in self.shares]

    def reset(self) -> None:
        self._segments: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in self.shares]
        self._bytes = [0] * len(self.shares)
        self._where: dict[Hashable, int] = {}
        if self.capacity is not None:
            self.set_capacity(self.capacity)
        else:
            self._limits = [1 << 62] * len(self.shares)

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        self.on_remove(key)
        target = next((i for i, (used, limit) in enumerate(zip(self._bytes, self._limits, strict=True)) if used + nbytes <= limit), 0)
        self._put(target, key, nbytes)

    def _put(self, index: int, key: Hashable, nbytes: int) -> None:
        self._segments[index][key] = nbytes
        self._bytes[index] += nbytes
        self._where[key] = index

    def _take(self, index: int, key: Hashable) -> int:
        nbytes = self._segments[index].pop(key)
        self._bytes[index] -= nbytes
        return nbytes

    def on_hit(self, key: Hashable) -> None:
        index = self._where.get(key)
        if index is None:
            return
        top = len(self._segments) - 1
        if index == top:
            self._segments[top].move_to_end(key)
            return
        self._put(index + 1, key, self._take(index, key))
        while self._bytes[index + 1] > self._limits[index + 1]:
            self._demote(index + 1)

    def _demote(self, level: int) -> None:
        """Move the least recent key of ``level`` one segment down, cascading; segment 0 is left
        over its share (the next victims come from it)."""
        old, nbytes = self._segments[level].popitem(last=False)
        self._bytes[level] -= nbytes
        self._put(level - 1, old, nbytes)
        while level - 1 > 0 and self._bytes[level - 1] > self._limits[level - 1]:
            self._demote(level - 1)

    def on_remove(self, key: Hashable) -> None:
        index = self._where.pop(key, None)
        if index is not None:
            self._take(index, key)

    def victim(self, evictable: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        for index, segment in enumerate(self._segments):
            key = next((k for k in segment if evictable is None or evictable(k)), None)
            if key is not None:
                self._take(index, key)
                del self._where[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._where)
