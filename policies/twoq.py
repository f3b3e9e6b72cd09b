"""2Q (Johnson and Shasha, VLDB 1994), full version: new keys enter a FIFO ``Ain``; keys evicted
from it are remembered in a ghost FIFO ``Aout``; a key missed again while remembered goes to the
LRU ``Am``. One-time scans stay in ``Ain`` and never disturb ``Am``. Counted in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class TwoQ:
    """2Q with ``Ain`` at ``in_ratio`` of the capacity and ``Aout`` remembering ``out_ratio`` of
    it in bytes (libCacheSim's ``TwoQ`` defaults, 0.25 and 0.5).

    ``victim`` takes the oldest of ``Ain`` while ``Ain`` is over its share, else the least recent
    of ``Am``. (libCacheSim also evicts from ``Am`` at once when a remembered key makes ``Am``
    overflow its own share; here that overflow is evicted first at the next ``victim``.)
    ``victim(evictable)``: a refused key keeps its queue and its place; when the queue the rule
    picks has no evictable key, the other one is used."""

    name = "2q"

    def __init__(self, capacity: int | None = None, in_ratio: float = 0.25, out_ratio: float = 0.5) -> None:
        if not 0 < in_ratio < 1 or out_ratio < 0:
            raise ValueError(f"in_ratio must lie in (0, 1) and out_ratio be >= 0, not {in_ratio}, {out_ratio}")
        self.in_ratio, self.out_ratio = in_ratio, out_ratio
        self.capacity = capacity
        self.reset()

    def set_capacity(self, nbytes: int) -> None:
        self.capacity = nbytes

    def reset(self) -> None:
        self._in: OrderedDict[Hashable, int] = OrderedDict()
        self._out: OrderedDict[Hashable, int] = OrderedDict()
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._in_bytes = self._out_bytes = self._main_bytes = 0

    def _limits(self) -> tuple[float, float, float]:
        capacity = self.capacity if self.capacity is not None else self._in_bytes + self._main_bytes
        in_limit = int(capacity * self.in_ratio)
        return in_limit, int(capacity * self.out_ratio), capacity - in_limit

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        self.on_remove(key)
        remembered = self._out.pop(key, None)
        if remembered is not None:
            self._out_bytes -= remembered
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._in[key] = nbytes
            self._in_bytes += nbytes

    def on_hit(self, key: Hashable) -> None:
        if key in self._main:
            self._main.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        nbytes = self._in.pop(key, None)
        if nbytes is not None:
            self._in_bytes -= nbytes
            return
        nbytes = self._main.pop(key, None)
        if nbytes is not None:
            self._main_bytes -= nbytes

    def victim(self, evictable: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        in_limit, out_limit, main_limit = self._limits()
        if self._main_bytes > main_limit or not (self._in_bytes > in_limit or not self._main):
            order = ("main", "in")
        else:
            order = ("in", "main")
        for queue_name in order:
            queue = self._in if queue_name == "in" else self._main
            key = next((k for k in queue if evictable is None or evictable(k)), None)
            if key is None:
                continue
            nbytes = queue.pop(key)
            if queue_name == "main":
                self._main_bytes -= nbytes
                return key
            self._in_bytes -= nbytes
            if nbytes <= out_limit:  # remember it
                while self._out and self._out_bytes + nbytes > out_limit:
                    self._out_bytes -= self._out.popitem(last=False)[1]
                self._out[key] = nbytes
                self._out_bytes += nbytes
            return key
        return None

    def __len__(self) -> int:
        return len(self._in) + len(self._main)
