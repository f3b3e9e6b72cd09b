"""S3-FIFO (Yang et al., SOSP 2023): a small FIFO that filters one-hit wonders, a main FIFO
with lazy promotion, and a ghost FIFO of recently evicted keys. Counted in bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any


class S3FIFO:
    """New keys enter the small queue (10% of capacity) unless the ghost queue remembers them;
    a key evicted from small that was hit more than once moves to main; main evicts FIFO but
    gives keys hit since their last pass another round.

    ``victim(evictable)`` runs the same passes over evictable keys only: a skipped key keeps
    its queue, its place in it and its frequency (it is neither promoted nor given another
    round while excluded). When the queue the rule picks has no evictable key, the other is
    used."""

    name = "s3fifo"

    def __init__(self, capacity: int | None = None, small_fraction: float = 0.1) -> None:
        self.capacity = capacity
        self.small_fraction = small_fraction
        self.reset()

    def set_capacity(self, nbytes: int) -> None:
        self.capacity = nbytes

    def reset(self) -> None:
        self._small: OrderedDict[str, int] = OrderedDict()
        self._main: OrderedDict[str, int] = OrderedDict()
        self._ghost: OrderedDict[str, int] = OrderedDict()
        self._size: dict[str, int] = {}
        self._freq: dict[str, int] = {}
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0

    def on_insert(self, key: str, nbytes: int) -> None:
        self.on_remove(key)
        self._size[key], self._freq[key] = nbytes, 0
        if self._ghost.pop(key, None) is not None:
            self._ghost_bytes -= nbytes
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def on_hit(self, key: str) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def on_remove(self, key: str) -> None:
        size = self._size.pop(key, None)
        if size is None:
            return
        del self._freq[key]
        if self._small.pop(key, None) is not None:
            self._small_bytes -= size
        else:
            del self._main[key]
            self._main_bytes -= size

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        capacity = self.capacity or (self._small_bytes + self._main_bytes)
        small_blocked = main_blocked = False  # the queue holds no evictable key
        while True:
            small_ok = bool(self._small) and not small_blocked
            main_ok = bool(self._main) and not main_blocked
            if small_ok and (self._small_bytes >= self.small_fraction * capacity or not main_ok):
                key = _first(self._small, evictable)
                if key is None:
                    small_blocked = True
                    continue
                size = self._small.pop(key)
                self._small_bytes -= size
                if self._freq[key] > 1:  # hit while in small: promote to main
                    self._freq[key] = 0
                    self._main[key] = size
                    self._main_bytes += size
                    main_blocked = False
                    continue
                self._forget(key)
                self._ghost[key] = size
                self._ghost_bytes += size
                while self._ghost and self._ghost_bytes > capacity:
                    _, old = self._ghost.popitem(last=False)
                    self._ghost_bytes -= old
                return key
            if not main_ok:
                return None
            key = _first(self._main, evictable)
            if key is None:
                main_blocked = True
                continue
            size = self._main.pop(key)
            if self._freq[key] > 0:  # hit since its last pass: another round
                self._freq[key] -= 1
                self._main[key] = size
                continue
            self._main_bytes -= size
            self._forget(key)
            return key

    def replay(self, keys: Sequence[Any], sizes: Sequence[int], capacity: int) -> tuple[int, int]:
        """The one-tier simulation of ``keys`` (one size per key) at ``capacity`` bytes from an
        empty cache (it resets the policy), in one tight loop: ``(misses, missed bytes)``, the
        same answers as the simulator's loop over the protocol calls (``victim`` inlined)."""
        self.capacity = capacity
        self.reset()
        small, main, ghost, freq = self._small, self._main, self._ghost, self._freq
        small_limit = self.small_fraction * capacity
        small_bytes = main_bytes = ghost_bytes = 0
        misses = missed = 0
        for key, size in zip(keys, sizes, strict=True):
            count = freq.get(key)
            if count is not None:
                if count < 3:
                    freq[key] = count + 1
                continue
            misses += 1
            missed += size
            if size > capacity:
                continue
            while small_bytes + main_bytes + size > capacity:
                if small and (small_bytes >= small_limit or not main):
                    old, old_size = small.popitem(last=False)
                    small_bytes -= old_size
                    if freq[old] > 1:
                        freq[old] = 0
                        main[old] = old_size
                        main_bytes += old_size
                        continue
                    del freq[old]
                    ghost[old] = old_size
                    ghost_bytes += old_size
                    while ghost and ghost_bytes > capacity:
                        ghost_bytes -= ghost.popitem(last=False)[1]
                    continue
                old, old_size = main.popitem(last=False)
                count = freq[old]
                if count:
                    freq[old] = count - 1
                    main[old] = old_size
                    continue
                main_bytes -= old_size
                del freq[old]
            freq[key] = 0
            remembered = ghost.pop(key, None)
            if remembered is not None:
                ghost_bytes -= remembered
                main[key] = size
                main_bytes += size
            else:
                small[key] = size
                small_bytes += size
        self._small_bytes, self._main_bytes, self._ghost_bytes = small_bytes, main_bytes, ghost_bytes
        self._size = {**small, **main}
        return misses, missed

    def _forget(self, key: str) -> None:
        del self._size[key]
        del self._freq[key]

    def __len__(self) -> int:
        return len(self._size)


def _first(queue: OrderedDict[str, int], evictable: Callable[[str], bool] | None) -> str | None:
    return next((k for k in queue if evictable is None or evictable(k)), None)
