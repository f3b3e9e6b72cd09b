"""LFU: evict the key hit least often while resident (ties: least recently used)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class LFU:
    """Least frequently used, O(1): keys in buckets by hit count, each bucket in LRU order.
    Counts start at 1 on insertion and are forgotten when a key leaves. A key skipped by the
    ``evictable`` predicate keeps its count and its place in its bucket."""

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._buckets: dict[int, OrderedDict[str, None]] = {}
        self._lowest = 0

    def on_insert(self, key: str, nbytes: int) -> None:
        self.on_remove(key)
        self._count[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None
        self._lowest = 1

    def on_hit(self, key: str) -> None:
        count = self._count.get(key)
        if count is None:
            return
        self._unlink(key, count)
        if self._lowest == count and count not in self._buckets:
            self._lowest = count + 1
        self._count[key] = count + 1
        self._buckets.setdefault(count + 1, OrderedDict())[key] = None

    def on_remove(self, key: str) -> None:
        count = self._count.pop(key, None)
        if count is not None:
            self._unlink(key, count)

    def _unlink(self, key: str, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        if not self._count:
            return None
        if self._lowest not in self._buckets:
            self._lowest = min(self._buckets)
        key = _first(self._buckets[self._lowest], evictable)
        count = self._lowest
        if key is None:  # the least frequent keys are all excluded: look further up
            for count in sorted(self._buckets):
                key = _first(self._buckets[count], evictable)
                if key is not None:
                    break
            else:
                return None
        self._unlink(key, count)
        del self._count[key]
        return key

    def reset(self) -> None:
        self._count.clear()
        self._buckets.clear()
        self._lowest = 0

    def __len__(self) -> int:
        return len(self._count)


def _first(bucket: OrderedDict[str, None], evictable: Callable[[str], bool] | None) -> str | None:
    return next((k for k in bucket if evictable is None or evictable(k)), None)
