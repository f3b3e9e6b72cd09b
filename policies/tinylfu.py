"""W-TinyLFU (Einziger, Friedman and Manes, TOS 2017; Caffeine's policy): a small LRU window
admits every new key; when it overflows, its oldest key must beat the main cache's victim on
estimated frequency (a count-min sketch of recent accesses) to get in. The main cache is a
segmented LRU (probation, protected). Counted in bytes."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable

_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
_MASK64 = (1 << 64) - 1


def _stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


class CountMinSketch:
    """Approximate access counts in ``depth`` rows of ``width`` small counters (conservative
    update: only the smallest counters of a key grow). After ``sample`` additions every counter
    is halved, so old popularity fades (TinyLFU's reset)."""

    def __init__(self, width: int = 1 << 14, depth: int = 4, sample: int | None = None, cap: int = 15) -> None:
        if width < 1 or not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"need width >= 1 and 1 <= depth <= {len(_SEEDS)}, not {width}, {depth}")
        self.width, self.depth, self.cap = width, depth, cap
        self.sample = sample if sample is not None else 10 * width
        self.reset()

    def reset(self) -> None:
        self._rows = [[0] * self.width for _ in range(self.depth)]
        self.additions = 0

    def _cells(self, key: Hashable) -> list[int]:
        # str hashes change from process to process (PYTHONHASHSEED): the live store's keys
        # get a stable one, so the same accesses make the same choices in every run.
        h = (_stable_hash(key) if isinstance(key, str) else hash(key)) & _MASK64
        return [((h * seed) & _MASK64) >> 20 for seed in _SEEDS[: self.depth]]

    def add(self, key: Hashable) -> None:
        width = self.width
        cells = [c % width for c in self._cells(key)]
        rows = self._rows
        low = min(rows[r][c] for r, c in enumerate(cells))
        if low < self.cap:
            for r, c in enumerate(cells):
                if rows[r][c] == low:
                    rows[r][c] = low + 1
        self.additions += 1
        if self.additions >= self.sample:
            self.additions //= 2
            self._rows = [[v >> 1 for v in row] for row in rows]

    def estimate(self, key: Hashable) -> int:
        width, rows = self.width, self._rows
        return min(rows[r][c % width] for r, c in enumerate(self._cells(key)))


class WTinyLFU:
    """W-TinyLFU: LRU window of ``window_ratio`` of the bytes, main SLRU with ``protected_ratio``
    of its bytes protected. Every access (insertion or hit) counts in the sketch.

    ``victim``: while the window is over its share and main has room, the window's oldest key
    moves to main's probation. Then the window's oldest key (the candidate) duels main's
    victim (probation's oldest, else protected's): the more frequent stays (the candidate
    moving to probation), the other is the victim; with one side empty, the other side's key
    goes (libCacheSim's order).
    ``victim(evictable)``: candidate and main victim are the oldest evictable keys of their
    queues; a refused key keeps its queue and its place."""

    name = "tinylfu"

    def __init__(self, capacity: int | None = None, window_ratio: float = 0.01, protected_ratio: float = 0.8,
                 sketch_width: int = 1 << 14) -> None:
        if not 0 < window_ratio < 1 or not 0 < protected_ratio < 1:
            raise ValueError(f"window_ratio and protected_ratio must lie in (0, 1), not {window_ratio}, {protected_ratio}")
        self.window_ratio, self.protected_ratio = window_ratio, protected_ratio
        self.capacity = capacity
        self.sketch = CountMinSketch(sketch_width)
        self.reset()

    def set_capacity(self, nbytes: int) -> None:
        self.capacity = nbytes

    def reset(self) -> None:
        self._window: OrderedDict[Hashable, int] = OrderedDict()
        self._probation: OrderedDict[Hashable, int] = OrderedDict()
        self._protected: OrderedDict[Hashable, int] = OrderedDict()
        self._bytes = {"window": 0, "probation": 0, "protected": 0}
        self.sketch.reset()

    def _limits(self) -> tuple[int, int, int]:
        capacity = self.capacity if self.capacity is not None else 1 << 62
        window = max(1, int(capacity * self.window_ratio))
        main = capacity - window
        return window, main, int(main * self.protected_ratio)

    def _queue(self, name: str) -> OrderedDict[Hashable, int]:
        return {"window": self._window, "probation": self._probation, "protected": self._protected}[name]

    def _where(self, key: Hashable) -> str | None:
        for name in ("window", "probation", "protected"):
            if key in self._queue(name):
                return name
        return None

    def _take(self, name: str, key: Hashable) -> int:
        size = self._queue(name).pop(key)
        self._bytes[name] -= size
        return size

    def _put(self, name: str, key: Hashable, size: int) -> None:
        self._queue(name)[key] = size
        self._bytes[name] += size

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        self.on_remove(key)
        self._put("window", key, nbytes)
        self.sketch.add(key)

    def on_hit(self, key: Hashable) -> None:
        where = self._where(key)
        if where is None:
            return
        self.sketch.add(key)
        if where != "probation":
            self._queue(where).move_to_end(key)
            return
        self._put("protected", key, self._take("probation", key))
        protected_limit = self._limits()[2]
        while self._bytes["protected"] > protected_limit and len(self._protected) > 1:
            old, size = self._protected.popitem(last=False)
            self._bytes["protected"] -= size
            self._put("probation", old, size)

    def on_remove(self, key: Hashable) -> None:
        where = self._where(key)
        if where is not None:
            self._take(where, key)

    def victim(self, evictable: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        window_limit, main_limit, _ = self._limits()
        ok = (lambda k: True) if evictable is None else evictable
        main_bytes = self._bytes["probation"] + self._bytes["protected"]
        while self._bytes["window"] > window_limit:
            candidate = next((k for k in self._window if ok(k)), None)
            if candidate is None or main_bytes + self._window[candidate] > main_limit:
                break
            size = self._take("window", candidate)
            self._put("probation", candidate, size)
            main_bytes += size
        candidate = next((k for k in self._window if ok(k)), None)
        main_name, main_victim = self._main_victim(ok)
        if candidate is not None and main_victim is not None:
            if self.sketch.estimate(candidate) > self.sketch.estimate(main_victim):
                self._take(main_name, main_victim)
                self._put("probation", candidate, self._take("window", candidate))
                return main_victim
            self._take("window", candidate)
            return candidate
        if main_victim is not None:
            self._take(main_name, main_victim)
            return main_victim
        if candidate is not None:
            self._take("window", candidate)
        return candidate

    def _main_victim(self, ok: Callable[[Hashable], bool]) -> tuple[str, Hashable | None]:
        for name in ("probation", "protected"):
            key = next((k for k in self._queue(name) if ok(k)), None)
            if key is not None:
                return name, key
        return "probation", None

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)
