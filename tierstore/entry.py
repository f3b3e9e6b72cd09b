"""The store's record of one key: its tensor metadata, version, and a copy per tier.

All state of a key lives here. A *copy* is valid while its version equals the entry's version;
a write gives the entry a new version (store-wide unique) and so invalidates every other copy
at once. A memory copy that is no longer valid is dropped; a disk copy stays as the durable base
until a write-back replaces it (copy-on-write).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from .disk.extents import Extent
from .tensors import TensorMeta, storage_nbytes


@dataclass(eq=False)
class Copy:
    """One tier's copy of an entry: a buffer (memory tiers) or an extent (disk tier)."""

    tier: int
    version: int
    buffer: torch.Tensor | None = None
    extent: Extent | None = None
    checksums: tuple[int, ...] = ()
    #: Holds and in-flight transfers using this copy. While non-zero the copy cannot be evicted
    #: or freed (the engine excludes it from victim choice; it stays known to the policy).
    users: int = 0
    #: Of ``users``, how many are holds (leases) taken through ``TierStore.hold``.
    holds: int = 0
    #: The copy is known to the tier's eviction policy (valid, memory tier, not chosen as a victim).
    in_policy: bool = False
    #: A write hold is changing this buffer: nothing copies from it until the hold ends.
    writing: bool = False
    #: Replaced or invalidated; its space is released when the last user lets go.
    retired: bool = False
    #: A device buffer's last use by the caller's kernels (a link marker): copies from it and
    #: its reuse wait for it.
    last_use: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes this copy occupies on its tier."""
        if self.buffer is not None:
            return storage_nbytes(self.buffer)
        return self.extent.length if self.extent is not None else 0


@dataclass(eq=False)
class Entry:
    """Everything the store knows of one key."""

    key: str
    meta: TensorMeta
    #: Version of the current value; 0 while the first write is still in flight (invisible).
    version: int = 0
    copies: dict[int, Copy] = field(default_factory=dict)
    #: Promotions in flight, by target tier: later requesters wait for them.
    loading: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    #: Puts in flight that may still create this entry.
    pending_writes: int = 0
    #: Serialises catalog changes of this key (write, write-back, delete) so they commit in order.
    disk_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: The copy under a write hold, if any (at most one: write holds are exclusive).
    writer: Copy | None = None
    #: Names that write hold (``tierstore.holds``), so its holder is told apart from others.
    writer_token: int = 0
    #: Tokens of every hold open on this entry (``tierstore.holds``).
    hold_tokens: set[int] = field(default_factory=set)
    #: Tasks waiting for a hold or a use of this entry to end (see ``Engine._wait_until``).
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

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
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def held(self) -> bool:
        return any(copy.holds for copy in self.copies.values())
