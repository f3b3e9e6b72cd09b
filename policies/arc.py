"""ARC (Megiddo and Modha, FAST 2003) counted in bytes: recency and frequency lists whose split
adapts to ghost hits."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class ARC:
    """Adaptive Replacement Cache. ``T1`` holds keys seen once recently, ``T2`` keys seen again;
    ``B1``/``B2`` remember keys evicted from each. A miss on a ghost moves the target size ``p``
    of ``T1`` towards the list that would have kept it. Sizes are bytes; ``set_capacity`` (the
    store and the simulator call it) bounds the ghosts.

    As in the paper, a miss on a ghost moves ``p`` before the victims for it are chosen: the
    store and the simulator call ``before_insert`` first (without it, ``on_insert`` adapts ``p``,
    after the victims). ``victim(evictable)`` takes the oldest evictable key of the list ARC's
    REPLACE picks (``T1`` when it is over its target ``p``, or at it for a key coming back from
    ``B2``, or when ``T2`` is empty), or of the other list when the picked one has no evictable
    key. A skipped key keeps its list and its place in it. With equal sizes this is the paper's
    ARC, miss for miss (tested against a transcription of its pseudocode)."""

    name = "arc"

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.reset()

    def set_capacity(self, nbytes: int) -> None:
        self.capacity = nbytes

    def reset(self) -> None:
        self._t1: OrderedDict[str, int] = OrderedDict()
        self._t2: OrderedDict[str, int] = OrderedDict()
        self._b1: OrderedDict[str, int] = OrderedDict()
        self._b2: OrderedDict[str, int] = OrderedDict()
        self._bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self.p = 0.0
        #: Keys between ``before_insert`` and ``on_insert`` that came back from a ghost list (its
        #: name): ``p`` adapted for them already. A store inserts several at once.
        self._adapted: dict[str, str] = {}
        self._incoming: str | None = None  # the key of the latest before_insert (REPLACE's x)

    def _cap(self) -> int:
        return self.capacity if self.capacity is not None else max(1, self._bytes["t1"] + self._bytes["t2"])

    def _take(self, name: str, key: str) -> int | None:
        size = getattr(self, f"_{name}").pop(key, None)
        if size is not None:
            self._bytes[name] -= size
        return size

    def _put(self, name: str, key: str, size: int) -> None:
        getattr(self, f"_{name}")[key] = size
        self._bytes[name] += size

    def before_insert(self, key: str, nbytes: int) -> None:
        """A miss on ``key`` is about to insert it: a ghost hit adapts ``p`` now, before REPLACE."""
        self._incoming = key
        ghost = "b1" if key in self._b1 else "b2" if key in self._b2 else None
        if ghost is not None and key not in self._adapted:
            self._adapt(ghost, nbytes)
            self._adapted[key] = ghost

    def _adapt(self, ghost: str, nbytes: int) -> None:
        b1, b2 = self._bytes["b1"], self._bytes["b2"]
        if ghost == "b1":
            self.p = min(self._cap(), self.p + max(b2 / max(b1, 1), 1.0) * nbytes)
        else:
            self.p = max(0.0, self.p - max(b1 / max(b2, 1), 1.0) * nbytes)

    def on_insert(self, key: str, nbytes: int) -> None:
        self.on_remove(key)
        adapted = self._adapted.pop(key, None) is not None
        if self._incoming == key:
            self._incoming = None
        ghost = "b1" if key in self._b1 else "b2" if key in self._b2 else None
        if ghost is not None:
            if not adapted:
                self._adapt(ghost, nbytes)
            self._take(ghost, key)
            self._put("t2", key, nbytes)
        else:
            self._put("t1", key, nbytes)
        self._trim_ghosts(self._cap())

    def on_hit(self, key: str) -> None:
        size = self._take("t1", key)
        if size is None:
            size = self._take("t2", key)
        if size is not None:
            self._put("t2", key, size)

    def on_remove(self, key: str) -> None:
        if self._take("t1", key) is None:
            self._take("t2", key)

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        t1 = self._bytes["t1"]
        from_b2 = self._incoming is not None and self._adapted.get(self._incoming) == "b2"
        order = ("t1", "t2") if self._t1 and (t1 > self.p or (from_b2 and t1 == self.p) or not self._t2) else ("t2", "t1")
        for name in order:
            queue: OrderedDict[str, int] = getattr(self, f"_{name}")
            key = next((k for k in queue if evictable is None or evictable(k)), None)
            if key is not None:
                size = queue.pop(key)
                self._bytes[name] -= size
                self._put("b1" if name == "t1" else "b2", key, size)
                self._trim_ghosts(self._cap())
                return key
        return None

    def _trim_ghosts(self, cap: int) -> None:
        while self._b1 and self._bytes["t1"] + self._bytes["b1"] > cap:
            key, size = self._b1.popitem(last=False)
            self._bytes["b1"] -= size
            self._adapted.pop(key, None)  # (an insert that never came: forgotten with its ghost)
        while self._b2 and sum(self._bytes.values()) > 2 * cap:
            key, size = self._b2.popitem(last=False)
            self._bytes["b2"] -= size
            self._adapted.pop(key, None)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
