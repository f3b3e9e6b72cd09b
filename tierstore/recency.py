"""The store's default eviction policy: LRU linked through the memory copies themselves.

``policies.LRU`` keeps an ``OrderedDict`` entry per key (~90 B a key at 10^5 keys); with a
million small values that is a fifth of the store's memory. ``CopyLRU`` chooses the same victims
in the same order, but its list runs through slots of the copies (``MemoryCopy.lru_older`` /
``lru_newer``), so it holds nothing per key of its own. The engine tells it about copies
directly (``insert`` / ``touch`` / ``remove``); the key-based protocol methods work too, finding
the copy through the engine.
"""

from __future__ import annotations

from collections.abc import Callable

from .entry import MemoryCopy

__all__ = ["CopyLRU"]


class CopyLRU:
    """Least recently used, over one memory tier's copies. ``victim`` is the oldest evictable
    copy's key; an insert or a hit moves a copy to the young end; a copy skipped by the
    ``evictable`` predicate keeps its place (as ``policies.LRU``)."""

    name = "lru"

    def __init__(self, find: Callable[[str], MemoryCopy | None]) -> None:
        #: The tier's copy of a key, or None (for the key-based protocol methods).
        self._find = find
        # A circular list through a sentinel: its ``lru_newer`` is the oldest copy.
        head = self._head = MemoryCopy(-1, 0)
        head.lru_older = head.lru_newer = head
        self._count = 0

    # -- by copy (the engine's calls) ----------------------------------------------------------

    def insert(self, copy: MemoryCopy, key: str) -> None:
        """``copy`` (of ``key``) was installed on the tier: it becomes the youngest."""
        if copy.lru_older is not None:
            self._unlink(copy)
        head = self._head
        youngest = head.lru_older
        copy.lru_older, copy.lru_newer = youngest, head
        youngest.lru_newer = head.lru_older = copy  # type: ignore[union-attr]
        copy.lru_key = key
        self._count += 1

    def touch(self, copy: MemoryCopy) -> None:
        """``copy`` served an access: it becomes the youngest, if tracked."""
        if copy.lru_older is not None and copy.lru_key is not None:
            self.insert(copy, copy.lru_key)

    def remove(self, copy: MemoryCopy) -> None:
        """``copy`` left the tier for another reason than this policy's choice."""
        if copy.lru_older is not None:
            self._unlink(copy)

    def _unlink(self, copy: MemoryCopy) -> None:
        older, newer = copy.lru_older, copy.lru_newer
        older.lru_newer, newer.lru_older = newer, older  # type: ignore[union-attr]
        copy.lru_older = copy.lru_newer = None
        self._count -= 1

    # -- the EvictionPolicy protocol -----------------------------------------------------------

    def on_insert(self, key: str, nbytes: int) -> None:
        copy = self._find(key)
        if copy is not None:
            self.insert(copy, key)

    def on_hit(self, key: str) -> None:
        copy = self._find(key)
        if copy is not None:
            self.touch(copy)

    def on_remove(self, key: str) -> None:
        copy = self._find(key)
        if copy is not None:
            self.remove(copy)

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None:
        head = self._head
        copy = head.lru_newer
        while copy is not head:
            key = copy.lru_key  # type: ignore[union-attr]
            if evictable is None or evictable(key):  # type: ignore[arg-type]
                self._unlink(copy)  # type: ignore[arg-type]
                copy.lru_key = None  # type: ignore[union-attr]
                return key
            copy = copy.lru_newer  # type: ignore[union-attr]
        return None

    def reset(self) -> None:
        head = self._head
        copy = head.lru_newer
        while copy is not head:
            following = copy.lru_newer  # type: ignore[union-attr]
            copy.lru_older = copy.lru_newer = copy.lru_key = None  # type: ignore[union-attr]
            copy = following
        head.lru_older = head.lru_newer = head
        self._count = 0

    def keys(self) -> list[str]:
        """The tracked keys, oldest first."""
        out, head = [], self._head
        copy = head.lru_newer
        while copy is not head:
            out.append(copy.lru_key)  # type: ignore[union-attr]
            copy = copy.lru_newer  # type: ignore[union-attr]
        return out  # type: ignore[return-value]

    def __len__(self) -> int:
        return self._count
