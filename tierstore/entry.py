"""The store's record of one key: its tensor metadata, version, and a copy per tier.

All state of a key lives here. A *copy* is valid while its version equals the entry's version;
a write gives the entry a new version (store-wide unique) and so invalidates every other copy
at once. A memory copy that is no longer valid is dropped; a disk copy stays as the durable base
until a write-back replaces it (copy-on-write).

A store may hold millions of keys, so both records are slotted and what most keys never need
(a lock, waiters, loads in flight, hold tokens) is created on first use; equal dtype/shape
metadata is shared between keys (``shared_meta``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from .disk.extents import Extent
from .tensors import TensorMeta, storage_nbytes

_NO_LOADS: Mapping[int, asyncio.Future[None]] = MappingProxyType({})
_NO_TOKENS: frozenset[int] = frozenset()
#: Interned metadata: a million keys of a few shapes keep a few ``TensorMeta`` objects.
_METAS: dict[TensorMeta, TensorMeta] = {}
_MAX_METAS = 1 << 16


def shared_meta(meta: TensorMeta) -> TensorMeta:
    """``meta``, or an equal object already in use (keys of one dtype and shape share it)."""
    found = _METAS.get(meta)
    if found is not None:
        return found
    if len(_METAS) >= _MAX_METAS:  # many distinct shapes: stop interning rather than grow
        return meta
    _METAS[meta] = meta
    return meta


class Copy:
    """One tier's copy of an entry: a buffer (memory tiers), an extent (disk tier), or a value
    kept inline in the disk tier's catalog (its bytes are read from the catalog).

    Attributes
    ----------
    inline:
        For a value inline in the disk tier's catalog, its size in bytes (what it counts
        against the tier's capacity); None otherwise.
    users:
        Holds and in-flight transfers using this copy. While non-zero the copy cannot be evicted
        or freed (the engine excludes it from victim choice; it stays known to the policy).
    holds:
        Of ``users``, how many are holds (leases) taken through ``TierStore.hold``.
    in_policy:
        The copy is known to the tier's eviction policy (valid, memory tier, not a victim).
    writing:
        A write hold is changing this buffer: nothing copies from it until the hold ends.
    retired:
        Replaced or invalidated; its space is released when the last user lets go.
    last_use:
        A device buffer's last use by the caller's kernels (a link marker): copies from it and
        its reuse wait for it.
    """

    __slots__ = ("tier", "version", "buffer", "extent", "checksums", "inline", "users", "holds", "in_policy", "writing", "retired", "last_use")

    def __init__(
        self,
        tier: int,
        version: int,
        buffer: torch.Tensor | None = None,
        extent: Extent | None = None,
        checksums: tuple[int, ...] = (),
        inline: int | None = None,
    ) -> None:
        self.tier = tier
        self.version = version
        self.buffer = buffer
        self.extent = extent
        self.checksums = checksums
        self.inline = inline
        self.users = 0
        self.holds = 0
        self.in_policy = False
        self.writing = False
        self.retired = False
        self.last_use: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes this copy occupies on its tier."""
        if self.buffer is not None:
            return storage_nbytes(self.buffer)
        if self.inline is not None:
            return self.inline
        return self.extent.length if self.extent is not None else 0

    def __repr__(self) -> str:
        where = "inline" if self.inline is not None else (self.extent if self.extent is not None else "buffer")
        return f"Copy(tier={self.tier}, version={self.version}, {where}, users={self.users})"


class Entry:
    """Everything the store knows of one key.

    Attributes
    ----------
    version:
        Version of the current value; 0 while the first write is still in flight (invisible).
    copies:
        A copy per tier index.
    pending_writes:
        Puts in flight that may still create this entry.
    writer:
        The copy under a write hold, if any (at most one: write holds are exclusive).
    writer_token:
        Names that write hold (``tierstore.holds``), so its holder is told apart from others.
    """

    __slots__ = ("key", "meta", "version", "copies", "pending_writes", "writer", "writer_token", "_loading", "_disk_lock", "_hold_tokens", "_waiters")

    def __init__(self, key: str, meta: TensorMeta, version: int = 0) -> None:
        self.key = key
        self.meta = shared_meta(meta)
        self.version = version
        self.copies: dict[int, Copy] = {}
        self.pending_writes = 0
        self.writer: Copy | None = None
        self.writer_token = 0
        self._loading: dict[int, asyncio.Future[None]] | None = None
        self._disk_lock: asyncio.Lock | None = None
        self._hold_tokens: set[int] | None = None
        self._waiters: list[asyncio.Future[None]] | None = None

    def __repr__(self) -> str:
        return f"Entry({self.key!r}, {self.meta}, version={self.version}, copies={sorted(self.copies)})"

    @property
    def loading(self) -> Mapping[int, asyncio.Future[None]]:
        """Promotions in flight, by target tier: later requesters wait for them (read-only;
        ``start_loading`` / ``end_loading`` change it)."""
        return self._loading if self._loading is not None else _NO_LOADS

    def start_loading(self, tier: int, done: asyncio.Future[None]) -> None:
        if self._loading is None:
            self._loading = {}
        self._loading[tier] = done

    def end_loading(self, tier: int, done: asyncio.Future[None]) -> None:
        loading = self._loading
        if loading is not None and loading.get(tier) is done:
            del loading[tier]
            if not loading:
                self._loading = None

    @property
    def disk_lock(self) -> asyncio.Lock:
        """Serialises catalog changes of this key (write, write-back, delete) so they commit in
        order (created on first use)."""
        lock = self._disk_lock
        if lock is None:
            lock = self._disk_lock = asyncio.Lock()
        return lock

    @property
    def disk_busy(self) -> bool:
        """Whether a catalog change of this key is under way or waiting."""
        lock = self._disk_lock
        return lock is not None and lock.locked()

    @property
    def hold_tokens(self) -> frozenset[int] | set[int]:
        """Tokens of every hold open on this entry (``tierstore.holds``); read-only, see
        ``add_hold_token`` / ``discard_hold_token``."""
        return self._hold_tokens if self._hold_tokens is not None else _NO_TOKENS

    def add_hold_token(self, token: int) -> None:
        if self._hold_tokens is None:
            self._hold_tokens = set()
        self._hold_tokens.add(token)

    def discard_hold_token(self, token: int) -> None:
        tokens = self._hold_tokens
        if tokens is not None:
            tokens.discard(token)
            if not tokens:
                self._hold_tokens = None

    def add_waiter(self, waiter: asyncio.Future[None]) -> None:
        """Wake ``waiter`` when a hold or a use of this entry ends (see ``Engine.wait_until``)."""
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)

    @property
    def visible(self) -> bool:
        return self.version != 0

    def valid(self, tier: int) -> Copy | None:
        """This tier's copy if it holds the current value."""
        copy = self.copies.get(tier)
        return copy if copy is not None and copy.version == self.version else None

    def valid_tiers(self) -> list[int]:
        """Tiers holding the current value, fastest first."""
        return sorted(t for t, c in self.copies.items() if c.version == self.version)

    def readable_tiers(self) -> list[int]:
        """Tiers whose copy of the current value can be read now (not under a write hold),
        fastest first."""
        return sorted(t for t, c in self.copies.items() if c.version == self.version and not c.writing)

    def wake(self) -> None:
        """Tell every task waiting on this entry that its holds or uses changed."""
        waiters = self._waiters
        if waiters is None:
            return
        self._waiters = None
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def held(self) -> bool:
        return any(copy.holds for copy in self.copies.values())
