"""Sequential(depth): after an access, suggest the next ``depth`` keys in first-seen order."""

from __future__ import annotations

from collections.abc import Iterable


class Sequential:
    """Keys are numbered in the order they are first accessed; an access to key number ``i``
    suggests keys ``i+1 .. i+depth`` (the readahead of block storage, for named tensors)."""

    name = "sequential"

    def __init__(self, depth: int = 4) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.depth = depth
        self.reset()

    def reset(self) -> None:
        self._order: list[str] = []
        self._index: dict[str, int] = {}
        self._last: tuple[int, str | None] = (-1, None)

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._order)
            self._order.append(key)
        self._last = (index, tier)

    def on_step(self) -> None:
        pass

    def suggest(self) -> Iterable[tuple[str, str | None]]:
        index, tier = self._last
        return [(key, tier) for key in self._order[index + 1 : index + 1 + self.depth]]
