"""LIRS (Jiang and Zhang, SIGMETRICS 2002): rank keys by reuse distance, not recency. Keys with a
short reuse distance are LIR and hold most of the cache; the rest are HIR, of which only a small
share stays resident, in a FIFO queue that victims come from. Counted in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class LIRS:
    """LIRS with HIR keys resident in ``hir_ratio`` of the capacity (libCacheSim's 1%).

    State: the stack ``S`` (recency order, oldest first) holds LIR keys, resident HIR keys and
    non-resident HIR keys (ghosts, at most ``capacity`` bytes of them); the queue ``Q`` holds the
    resident HIR keys. The bottom of ``S`` is always LIR ("pruning" drops HIR keys below it).

    - a hit on a LIR key moves it to the top of ``S``;
    - a hit on a HIR key still in ``S`` (its reuse distance beats the oldest LIR's) makes it
      LIR, and the oldest LIR keys become HIR, to the end of ``Q``, until LIR fits its share;
      a HIR key not in ``S`` goes back to the top of ``S`` and the end of ``Q``;
    - a new key is LIR while LIR has room, else HIR; a ghost coming back is LIR at once;
    - ``victim`` is the front of ``Q`` (it stays in ``S`` as a ghost); with ``Q`` empty, the
      oldest LIR key.

    ``victim(evictable)``: a refused key keeps its status and place; the first evictable key of
    ``Q`` goes, else the oldest evictable LIR key."""

    name = "lirs"

    def __init__(self, capacity: int | None = None, hir_ratio: float = 0.01) -> None:
        if not 0 < hir_ratio < 1:
            raise ValueError(f"hir_ratio must lie in (0, 1), not {hir_ratio}")
        self.hir_ratio = hir_ratio
        self.capacity = capacity
        self.reset()

    def set_capacity(self, nbytes: int) -> None:
        self.capacity = nbytes

    def reset(self) -> None:
        self._stack: OrderedDict[Hashable, None] = OrderedDict()
        self._lir: dict[Hashable, int] = {}
        self._queue: OrderedDict[Hashable, int] = OrderedDict()  # resident HIR keys
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()  # non-resident HIR keys in S
        self._lir_bytes = self._ghost_bytes = 0

    def _lir_limit(self) -> int:
        capacity = self.capacity if self.capacity is not None else 1 << 62
        return capacity - max(1, int(self.hir_ratio * capacity))

    def _to_top(self, key: Hashable) -> None:
        self._stack[key] = None
        self._stack.move_to_end(key)

    def _prune(self) -> None:
        stack = self._stack
        while stack:
            bottom = next(iter(stack))
            if bottom in self._lir:
                return
            del stack[bottom]
            size = self._ghosts.pop(bottom, None)
            if size is not None:
                self._ghost_bytes -= size

    def _shrink_lir(self) -> None:
        """Demote the oldest LIR keys to resident HIR until LIR fits its share."""
        limit = self._lir_limit()
        while self._lir_bytes > limit and len(self._lir) > 1:
            self._prune()
            bottom = next(iter(self._stack))
            size = self._lir.pop(bottom)
            self._lir_bytes -= size
            del self._stack[bottom]
            self._queue[bottom] = size
        self._prune()

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        self.on_remove(key)
        ghost = self._ghosts.pop(key, None)
        if ghost is not None:
            self._ghost_bytes -= ghost
        if ghost is not None or self._lir_bytes + nbytes <= self._lir_limit():
            self._lir[key] = nbytes
            self._lir_bytes += nbytes
            self._to_top(key)
            self._shrink_lir()
        else:
            self._queue[key] = nbytes
            self._to_top(key)

    def on_hit(self, key: Hashable) -> None:
        if key in self._lir:
            self._to_top(key)
            self._prune()
            return
        size = self._queue.get(key)
        if size is None:
            return
        if key in self._stack:  # reuse distance shorter than the oldest LIR's: promote
            del self._queue[key]
            self._lir[key] = size
            self._lir_bytes += size
            self._to_top(key)
            self._shrink_lir()
        else:
            self._to_top(key)
            self._queue.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        size = self._lir.pop(key, None)
        if size is not None:
            self._lir_bytes -= size
            del self._stack[key]
            self._prune()
            return
        if self._queue.pop(key, None) is not None:
            self._stack.pop(key, None)

    def victim(self, evictable: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        key = next((k for k in self._queue if evictable is None or evictable(k)), None)
        if key is not None:
            size = self._queue.pop(key)
            if key in self._stack:  # remembered as a ghost while its recency matters
                self._ghosts[key] = size
                self._ghost_bytes += size
                self._trim_ghosts()
            return key
        key = next((k for k in self._stack if k in self._lir and (evictable is None or evictable(k))), None)
        if key is None:
            return None
        self._lir_bytes -= self._lir.pop(key)
        del self._stack[key]
        self._prune()
        return key

    def _trim_ghosts(self) -> None:
        limit = self.capacity if self.capacity is not None else self._lir_bytes
        while self._ghosts and self._ghost_bytes > limit:
            old, size = self._ghosts.popitem(last=False)
            self._ghost_bytes -= size
            del self._stack[old]

    def __len__(self) -> int:
        return len(self._lir) + len(self._queue)
