"""LRU: evict the key least recently inserted or hit."""

from __future__ import annotations

from collections import OrderedDict


class LRU:
    """Least recently used. ``victim`` is the oldest key; a hit moves a key to the young end."""

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

    def victim(self) -> str | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def reset(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)
