"""A sorted index of the zarr keys under one prefix of a store, for fast listing.

``list_prefix`` and ``list_dir`` answer from a sorted list by bisection: a directory listing
costs its children, not every key of the store. Every adapter over the same store and prefix
shares one index, changed on the store's loop as their puts and deletes commit.

Keys put or deleted under the prefix through the plain verbs bypass the adapters, so before
answering a listing the index looks at the store's ``changes`` counter (it grows whenever a key
appears or disappears): while it has not moved, the index is current and nothing is scanned;
when it has, one pass over ``store.keys()`` (a membership test per key, no sorting) checks the
index, and only a difference rebuilds the sorted list.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator

from tierstore.store import TierStore

__all__ = ["KeyIndex", "index_of"]

#: One index per (store, prefix), shared by every adapter over them, dropped with the store.
_INDEXES: weakref.WeakKeyDictionary[TierStore, dict[str, KeyIndex]] = weakref.WeakKeyDictionary()


def index_of(store: TierStore, prefix: str) -> KeyIndex:
    """The shared index of ``prefix`` in ``store`` (created empty and stale)."""
    by_prefix = _INDEXES.setdefault(store, {})
    index = by_prefix.get(prefix)
    if index is None:
        index = by_prefix[prefix] = KeyIndex(prefix)
    return index


class KeyIndex:
    """Zarr keys (the store keys with ``prefix`` removed) in sorted order; used on the store's loop.

    It keeps no reference to its store (the store is the key of the weak map holding it)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._sorted: list[str] = []
        self._members: set[str] = set()
        self._seen_changes: int | None = None
        self._stale = True
        #: Keys a ``set_if_not_exists`` is writing (so a second one waits its turn, not writes too).
        self.pending: set[str] = set()

    # -- kept current by the adapters ----------------------------------------------------------

    def added(self, key: str) -> None:
        if key not in self._members:
            self._members.add(key)
            bisect.insort(self._sorted, key)

    def removed(self, key: str) -> None:
        if key in self._members:
            self._members.discard(key)
            i = bisect.bisect_left(self._sorted, key)
            del self._sorted[i]

    # -- answering ------------------------------------------------------------------------------

    def refresh(self, store: TierStore) -> None:
        """Catch up with puts and deletes made in ``store`` through the plain verbs (see the module doc)."""
        changes = getattr(store, "changes", None)
        if not self._stale and changes is not None and changes == self._seen_changes:
            return
        prefix, cut = self._prefix, len(self._prefix)
        members = self._members
        present = [key[cut:] for key in store.keys() if key.startswith(prefix)]
        if len(present) != len(members) or not all(key in members for key in present):
            self._members = set(present)
            self._sorted = sorted(self._members)
        self._seen_changes = changes if isinstance(changes, int) else None
        self._stale = False

    def under(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix``, sorted (a copy: safe to delete while iterating)."""
        start = bisect.bisect_left(self._sorted, prefix)
        end = start
        keys = self._sorted
        while end < len(keys) and keys[end].startswith(prefix):
            end += 1
        return keys[start:end]

    def children(self, prefix: str) -> Iterator[str]:
        """Names directly under the directory ``prefix`` (``""`` or ending in ``"/"``): keys,
        and the first component of deeper keys once each. A directory's descendants are jumped
        over by bisection (every key under ``d/`` sorts before ``d0``, ``"0"`` following ``"/"``)."""
        keys = self._sorted
        i = bisect.bisect_left(keys, prefix)
        cut = len(prefix)
        seen: set[str] = set()  # a name can be both a key and a directory ("a" and "a/b")
        while i < len(keys) and keys[i].startswith(prefix):
            rest = keys[i][cut:]
            slash = rest.find("/")
            name = rest if slash < 0 else rest[:slash]
            if name and name not in seen:
                seen.add(name)
                yield name
            if slash < 0:
                i += 1
                continue
            i = bisect.bisect_left(keys, prefix + name + "0", i + 1)

    def __len__(self) -> int:
        return len(self._sorted)
