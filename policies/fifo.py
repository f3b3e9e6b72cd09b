"""FIFO: evict the key inserted longest ago; hits change nothing."""

from __future__ import annotations

from collections import OrderedDict


class FIFO:
    """First in, first out."""

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

    def victim(self) -> str | None:
        return self._queue.popitem(last=False)[0] if self._queue else None

    def reset(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)
