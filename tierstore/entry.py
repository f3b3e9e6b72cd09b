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
import bisect
from collections.abc import Iterable, Mapping
from operator import itemgetter
from types import MappingProxyType
from typing import Any

import torch

from .disk.extents import Extent
from .tensors import TensorMeta, from_bytes, storage_nbytes
from .tiers.slabs import Slab

_NO_LOADS: Mapping[int, asyncio.Future[Any]] = MappingProxyType({})
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


_METAS_OF: dict[tuple[torch.dtype, torch.Size], TensorMeta] = {}


def meta_of(tensor: torch.Tensor) -> TensorMeta:
    """The shared ``TensorMeta`` of ``tensor``'s dtype and shape (found without making one)."""
    found = _METAS_OF.get((tensor.dtype, tensor.shape))
    if found is not None:
        return found
    meta = shared_meta(TensorMeta.of(tensor))
    if meta is _METAS.get(meta) and len(_METAS_OF) < _MAX_METAS:
        _METAS_OF[(tensor.dtype, tensor.shape)] = meta
    return meta


class _Inline:
    """The mark of a copy kept inline in the disk tier's catalog."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "inline"


_INLINE = _Inline()


class Copy:
    """One tier's copy of an entry: a buffer (memory tiers), an extent (disk tier), or a value
    kept inline in the disk tier's catalog (its bytes are read from the catalog).

    A small value on a memory tier sits in a slot of a shared slab (``slab``, ``index``): no
    tensor object is kept for it, ``buffer`` makes a view when bytes move.

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

    # A copy is a memory copy, an extent or an inline value, never two: one slot (``_where``)
    # holds its buffer, slab, extent or the ``_INLINE`` mark, and one (``_aux``) its checksums
    # (disk) or last use (memory). A million copies are a million of these objects.
    __slots__ = ("tier", "version", "_where", "index", "_aux", "users", "holds", "_flags", "_typed")

    def __init__(
        self,
        tier: int,
        version: int,
        buffer: torch.Tensor | None = None,
        extent: Extent | None = None,
        checksums: tuple[int, ...] = (),
        inline: int | None = None,
        *,
        slab: Slab | None = None,
        index: int = 0,
    ) -> None:
        self.tier = tier
        self.version = version
        self._where: torch.Tensor | Slab | Extent | _Inline | None
        self._aux: Any
        if inline is not None:
            self._where, self.index, self._aux = _INLINE, inline, ()
        elif extent is not None:
            self._where, self.index, self._aux = extent, 0, checksums
        else:
            self._where, self.index, self._aux = (slab if slab is not None else buffer), index, None
        self.users = 0
        self.holds = 0
        self._flags = 0
        #: ``(meta, view)``: the buffer viewed as the value ``meta`` describes (``typed``).
        self._typed: tuple[TensorMeta, torch.Tensor] | None = None

    def _flag(bit: int, doc: str) -> Any:  # type: ignore[misc]  # (a helper of the class body)
        def get(self: Copy) -> bool:
            return bool(self._flags & bit)

        def set_(self: Copy, on: bool) -> None:
            self._flags = self._flags | bit if on else self._flags & ~bit

        return property(get, set_, doc=doc)

    in_policy = _flag(1, "The copy is known to the tier's eviction policy (valid, memory tier, not a victim).")
    writing = _flag(2, "A write hold is changing this buffer: nothing copies from it until the hold ends.")
    retired = _flag(4, "Replaced or invalidated; its space is released when the last user lets go.")
    del _flag

    @property
    def buffer(self) -> torch.Tensor | None:
        """The memory copy's bytes as a uint8 tensor (for a packed value, a tensor over its slot
        made on each call, with the slot as its storage), or None for a disk copy."""
        where = self._where
        if where.__class__ is Slab:
            return where.slot_tensor(self.index)
        return where if isinstance(where, torch.Tensor) else None

    @buffer.setter
    def buffer(self, buffer: torch.Tensor | None) -> None:
        self._where, self._aux, self._typed = buffer, None, None

    def typed(self, meta: TensorMeta) -> torch.Tensor:
        """The memory copy's bytes viewed as the value ``meta`` describes (``from_bytes``), a new
        tensor object for each holder. The typed view is made once per buffer and kept with it,
        never handed out: each holder gets an alias of it (one torch call instead of
        ``from_bytes``'s three; each torch call on the loop lets go of the GIL, and getting it
        back may wait for the math), so what a holder does to its tensor's shape, strides,
        dtype or ``requires_grad`` stays with that holder. A buffer whose memory moved (a
        holder's ``resize_`` that grew the storage) is viewed again."""
        where = self._where
        if where.__class__ is Slab:
            return from_bytes(where.slot_tensor(self.index), meta)  # (its tensor is made on each call: nothing to keep)
        typed = self._typed
        if typed is not None and typed[0] is meta and typed[1].data_ptr() == where.data_ptr():  # type: ignore[union-attr]
            return typed[1].detach()
        view = from_bytes(where, meta)  # type: ignore[arg-type]
        self._typed = (meta, view)
        return view.detach()

    @property
    def slab(self) -> Slab | None:
        """The slab whose slot ``index`` holds this copy (a packed small value), else None."""
        where = self._where
        return where if where.__class__ is Slab else None

    @property
    def in_memory(self) -> bool:
        """Whether this is a memory tier's copy (it has a buffer or a slot)."""
        where = self._where
        return where.__class__ is Slab or isinstance(where, torch.Tensor)

    @property
    def extent(self) -> Extent | None:
        """Where a disk copy's bytes lie in the data files (None for other copies)."""
        where = self._where
        return where if where.__class__ is Extent else None

    @extent.setter
    def extent(self, extent: Extent | None) -> None:
        self._where, self._typed = extent, None

    @property
    def checksums(self) -> tuple[int, ...]:
        """A disk extent's checksums, one per chunk (``()`` for other copies)."""
        return self._aux if self._where.__class__ is Extent else ()

    @property
    def inline(self) -> int | None:
        """For a value inline in the disk tier's catalog, its size in bytes (what it counts
        against the tier's capacity); None otherwise."""
        return self.index if self._where is _INLINE else None

    @inline.setter
    def inline(self, inline: int | None) -> None:
        if inline is None:
            self._where, self.index = None, 0
        else:
            self._where, self.index = _INLINE, inline
        self._typed = None

    @property
    def last_use(self) -> Any:
        """A device buffer's last use by the caller's kernels (a link marker), or None."""
        return self._aux if self.in_memory else None

    @last_use.setter
    def last_use(self, marker: Any) -> None:
        self._aux = marker

    def view(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of a memory copy, as a uint8 tensor."""
        where = self._where
        if where.__class__ is Slab:
            return where.view(self.index, nbytes)
        return where[:nbytes]  # type: ignore[index]

    @property
    def address(self) -> int:
        """Where a CPU memory copy's bytes start (for a copy with no views made)."""
        where = self._where
        if where.__class__ is Slab:
            return where.address + self.index * where.slot
        return where.data_ptr()  # type: ignore[union-attr]

    def payload(self, nbytes: int) -> torch.Tensor | bytes:
        """The first ``nbytes`` of a memory copy: a copy as bytes for a packed value (cheaper
        than a tensor over its slot), else a uint8 view of its buffer."""
        where = self._where
        if where.__class__ is Slab:
            return where.bytes_of(self.index, nbytes)
        return where[:nbytes]  # type: ignore[index]

    @property
    def nbytes(self) -> int:
        """Bytes this copy occupies on its tier."""
        where = self._where
        if where is None:
            return 0
        if where.__class__ is Slab:
            return where.slot
        if where is _INLINE:
            return self.index
        if where.__class__ is Extent:
            return where.length
        return storage_nbytes(where)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        where = "inline" if self.inline is not None else (self.extent if self.extent is not None else "buffer")
        return f"Copy(tier={self.tier}, version={self.version}, {where}, users={self.users})"


class MemoryCopy(Copy):
    """A copy on a memory tier: a ``Copy`` that can also sit in its tier's recency list
    (``tierstore.recency.CopyLRU``), linked through itself: the default policy keeps no
    object or table entry per key. Disk copies (most copies of a reopened store) stay plain."""

    __slots__ = ("lru_older", "lru_newer", "lru_key")

    def __init__(self, tier: int, version: int, buffer: torch.Tensor | None = None, *, slab: Slab | None = None, index: int = 0) -> None:
        super().__init__(tier, version, buffer, slab=slab, index=index)
        #: Neighbours in the recency list (None while not in it) and the key it answers with.
        self.lru_older: MemoryCopy | None = None
        self.lru_newer: MemoryCopy | None = None
        self.lru_key: str | None = None


class _Rare:
    """The parts of an entry that few entries need at a time (see ``Entry``)."""

    __slots__ = ("pending_writes", "writer", "writer_token", "loading", "disk_lock", "hold_tokens", "waiters", "woken")

    def __init__(self) -> None:
        self.pending_writes = 0
        self.writer: Copy | None = None
        self.writer_token = 0
        self.loading: dict[int, asyncio.Future[Any]] | None = None
        self.disk_lock: asyncio.Lock | None = None
        self.hold_tokens: set[int] | None = None
        self.waiters: list[tuple[int, asyncio.Future[None]]] | None = None
        #: Waiters woken whose tasks have not run since (``Entry.has_woken``).
        self.woken: list[asyncio.Future[None]] | None = None

    def is_plain_lock(self) -> bool:
        """Whether the disk lock is all this holds."""
        return (
            self.pending_writes == 0 and self.writer is None and self.writer_token == 0 and self.loading is None
            and self.hold_tokens is None and self.waiters is None and self.woken is None
        )


class Entry:
    """Everything the store knows of one key.

    Attributes
    ----------
    version:
        Version of the current value; 0 while the first write is still in flight (invisible).
    copies:
        A copy per tier index (a new dict on each access: read with ``copy_on`` on hot paths,
        change with ``set_copy`` / ``drop_copy``).
    pending_writes:
        Puts in flight that may still create this entry.
    writer:
        The copy under a write hold, if any (at most one: write holds are exclusive).
    writer_token:
        Names that write hold (``tierstore.holds``), so its holder is told apart from others.
    """

    __slots__ = ("key", "meta", "version", "_copies", "_rare")

    def __init__(self, key: str, meta: TensorMeta, version: int = 0) -> None:
        self.key = key
        self.meta = shared_meta(meta)
        self.version = version
        # None, one Copy, or a tuple of them by tier: most keys have one or two copies, and a
        # dict per key would cost more than the rest of the entry. An entry adopted from the
        # catalog holds an ``_InlineOnDisk`` mark instead, until its copy is first asked for.
        self._copies: Copy | tuple[Copy, ...] | _InlineOnDisk | None = None
        #: What few entries need at a time (write holds, loads, waiters, the disk lock), made
        #: on first use (``_Rare``).
        self._rare: _Rare | None = None

    @classmethod
    def adopt_inline(cls, found: Iterable[tuple[str, TensorMeta, int]], d: int, into: dict[str, Entry]) -> int:
        """Make an entry in ``into`` for each ``(key, meta, version)`` of a value inline in the
        catalog of disk tier ``d`` (``meta`` shared already); returns the newest version.

        The entries hold no ``Copy`` yet: one is made when the entry's copies are first asked
        for (``Copy`` of the entry's version, inline, ``meta.nbytes``), so a million keys open
        with one object each. The engine asks for them before it changes the version."""
        new, mark, newest = cls.__new__, _inline_on_disk(d), 0
        for key, meta, version in found:
            entry = new(cls)
            entry.key, entry.meta, entry.version, entry._copies, entry._rare = key, meta, version, mark, None
            into[key] = entry
            if version > newest:
                newest = version
        return newest

    @classmethod
    def inline_on_disk(cls, key: str, meta: TensorMeta, version: int, d: int) -> Entry:
        """A new entry whose one copy is ``version`` of its value inline in the catalog of disk
        tier ``d`` (as ``adopt_inline`` makes them; ``meta`` shared already): the entry of a
        small put of a new key staged on a non-durable disk tier, one object made."""
        entry = cls.__new__(cls)
        entry.key, entry.meta, entry.version, entry._copies, entry._rare = key, meta, version, _inline_on_disk(d), None
        return entry

    def _adopted(self) -> Copy | tuple[Copy, ...] | None:
        """The copies, the one of an adopted entry made now (see ``adopt_inline``)."""
        copies = self._copies
        if copies.__class__ is _InlineOnDisk:
            copies = self._copies = Copy(copies.tier, self.version, inline=self.meta.nbytes)
        return copies  # type: ignore[return-value]

    def _rare_set(self, name: str, value: Any) -> None:
        rare = self._rare
        if rare is None:
            if value is None or value == 0:
                return
            rare = self._rare = _Rare()
        setattr(rare, name, value)
        if (value is None or value == 0) and (
            rare.pending_writes == 0 and rare.writer is None and rare.writer_token == 0 and rare.loading is None
            and rare.disk_lock is None and rare.hold_tokens is None and rare.waiters is None and rare.woken is None
        ):
            self._rare = None  # all back to nothing: the entry keeps no object for it

    pending_writes = property(
        lambda self: self._rare.pending_writes if self._rare is not None else 0,
        lambda self, value: self._rare_set("pending_writes", value),
        doc="Puts in flight that may still create this entry.",
    )
    writer = property(
        lambda self: self._rare.writer if self._rare is not None else None,
        lambda self, value: self._rare_set("writer", value),
        doc="The copy under a write hold, if any (at most one: write holds are exclusive).",
    )

    writer_token = property(
        lambda self: self._rare.writer_token if self._rare is not None else 0,
        lambda self, value: self._rare_set("writer_token", value),
        doc="Names the open write hold (``tierstore.holds``), so its holder is told apart from others; 0 if none.",
    )
    _loading = property(
        lambda self: self._rare.loading if self._rare is not None else None,
        lambda self, value: self._rare_set("loading", value),
    )
    _disk_lock = property(
        lambda self: self._rare.disk_lock if self._rare is not None else None,
        lambda self, value: self._rare_set("disk_lock", value),
    )
    _hold_tokens = property(
        lambda self: self._rare.hold_tokens if self._rare is not None else None,
        lambda self, value: self._rare_set("hold_tokens", value),
    )
    _waiters = property(
        lambda self: self._rare.waiters if self._rare is not None else None,
        lambda self, value: self._rare_set("waiters", value),
    )
    _woken = property(
        lambda self: self._rare.woken if self._rare is not None else None,
        lambda self, value: self._rare_set("woken", value),
    )

    def __repr__(self) -> str:
        return f"Entry({self.key!r}, {self.meta}, version={self.version}, copies={sorted(self.copies)})"

    @property
    def copies(self) -> dict[int, Copy]:
        """The copies by tier index (a snapshot: changing it changes nothing)."""
        copies = self._adopted()
        if copies is None:
            return {}
        if isinstance(copies, Copy):
            return {copies.tier: copies}
        return {copy.tier: copy for copy in copies}

    def all_copies(self) -> tuple[Copy, ...]:
        """Every copy, fastest tier first."""
        copies = self._adopted()
        if copies is None:
            return ()
        if isinstance(copies, Copy):
            return (copies,)
        return copies

    def copy_on(self, tier: int) -> Copy | None:
        """Tier ``tier``'s copy (valid or not), or None."""
        copies = self._copies
        if copies is None:
            return None
        if isinstance(copies, Copy):
            return copies if copies.tier == tier else None
        if copies.__class__ is _InlineOnDisk:
            return self._adopted() if copies.tier == tier else None  # type: ignore[return-value]
        for copy in copies:  # type: ignore[union-attr]
            if copy.tier == tier:
                return copy
        return None

    def set_copy(self, copy: Copy) -> None:
        """Make ``copy`` this entry's copy on its tier (replacing the one there)."""
        copies = self._adopted()
        if copies is None or (isinstance(copies, Copy) and copies.tier == copy.tier):
            self._copies = copy
            return
        if isinstance(copies, Copy):
            self._copies = (copies, copy) if copies.tier < copy.tier else (copy, copies)
            return
        others = [c for c in self.all_copies() if c.tier != copy.tier]
        others.append(copy)
        others.sort(key=_tier_of)
        self._copies = tuple(others)

    def drop_copy(self, tier: int) -> None:
        """Forget the copy on tier ``tier``, if any."""
        others = [c for c in self.all_copies() if c.tier != tier]
        self._copies = None if not others else others[0] if len(others) == 1 else tuple(others)

    @property
    def loading(self) -> Mapping[int, asyncio.Future[Any]]:
        """Promotions in flight, by target tier: later requesters wait for them (read-only;
        ``start_loading`` / ``end_loading`` change it)."""
        return self._loading if self._loading is not None else _NO_LOADS

    def start_loading(self, tier: int, done: asyncio.Future[Any]) -> None:
        if self._loading is None:
            self._loading = {}
        self._loading[tier] = done

    def end_loading(self, tier: int, done: asyncio.Future[Any]) -> None:
        loading = self._loading
        if loading is not None and loading.get(tier) is done:
            del loading[tier]
            if not loading:
                self._loading = None

    @property
    def disk_lock(self) -> asyncio.Lock:
        """Serialises catalog changes of this key (write, write-back, delete) so they commit in
        order (created on first use)."""
        rare = self._rare
        if rare is None:
            rare = self._rare = _Rare()  # (direct: a flush asks for 10^5 of them at once)
        lock = rare.disk_lock
        if lock is None:
            lock = rare.disk_lock = asyncio.Lock()
        return lock

    def try_disk_lock(self) -> asyncio.Lock | None:
        """The disk lock, taken with no await if no one holds it or waits for it (the caller
        releases it); None, with nothing taken, otherwise."""
        lock = self.disk_lock
        if lock.locked() or getattr(lock, "_waiters", None):
            return None
        acquiring = lock.acquire()
        try:
            acquiring.send(None)  # (a free lock nobody waits for is taken without suspending)
        except StopIteration:
            return lock
        acquiring.close()
        return None

    def forget_idle_lock(self) -> None:
        """Let the disk lock go if no one holds or waits for it (a million keys written once
        must not keep a million locks); the next catalog change makes a new one."""
        rare = self._rare
        lock = rare.disk_lock if rare is not None else None
        if lock is not None and not lock.locked() and not getattr(lock, "_waiters", True):
            if rare.is_plain_lock():  # type: ignore[union-attr]
                self._rare = None
            else:
                rare.disk_lock = None  # type: ignore[union-attr]

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

    def add_waiter(self, waiter: asyncio.Future[None], ticket: int) -> None:
        """Wake ``waiter`` when a hold or a use of this entry ends (see ``Engine.wait_until``),
        in the order of ``ticket``: a task woken for nothing that waits again keeps its place
        ahead of those that came after it."""
        if self._waiters is None:
            self._waiters = []
        bisect.insort(self._waiters, (ticket, waiter), key=itemgetter(0))

    @property
    def visible(self) -> bool:
        return self.version != 0

    def valid(self, tier: int) -> Copy | None:
        """This tier's copy if it holds the current value."""
        copy = self.copy_on(tier)
        return copy if copy is not None and copy.version == self.version else None

    def valid_tiers(self) -> list[int]:
        """Tiers holding the current value, fastest first."""
        version = self.version
        return [c.tier for c in self.all_copies() if c.version == version]

    def readable_tiers(self) -> list[int]:
        """Tiers whose copy of the current value can be read now (not under a write hold),
        fastest first."""
        version = self.version
        return [c.tier for c in self.all_copies() if c.version == version and not c.writing]

    def wake(self) -> None:
        """Tell every task waiting on this entry that its holds or uses changed."""
        waiters = self._waiters
        if waiters is None:
            return
        self._waiters = None
        woken = [waiter for _, waiter in waiters if not waiter.done()]
        for waiter in woken:
            waiter.set_result(None)
        if woken:
            self._woken = [*(self._woken or ()), *woken]

    @property
    def has_woken(self) -> bool:
        """Whether tasks woken on this entry (``wake``) have yet to run: a write hold asked for
        now lets them go first (a task taking one write hold after another would otherwise
        starve a reader, which finds a writer again each time it runs)."""
        rare = self._rare
        return rare is not None and rare.woken is not None

    def forget_woken(self, waiter: asyncio.Future[None]) -> None:
        """``waiter``'s task has run (or given up)."""
        woken = self._woken
        if woken is not None and waiter in woken:
            woken.remove(waiter)
            if not woken:
                self._woken = None

    def held(self) -> bool:
        return any(copy.holds for copy in self.all_copies())


class _InlineOnDisk:
    """The mark of an entry adopted from disk tier ``tier``'s catalog whose inline copy is not
    made yet (``Entry.adopt_inline``); one per tier index, shared by every such entry."""

    __slots__ = ("tier",)

    def __init__(self, tier: int) -> None:
        self.tier = tier


_INLINE_ON_DISK: dict[int, _InlineOnDisk] = {}


def _inline_on_disk(d: int) -> _InlineOnDisk:
    mark = _INLINE_ON_DISK.get(d)
    if mark is None:
        mark = _INLINE_ON_DISK[d] = _InlineOnDisk(d)
    return mark


def _tier_of(copy: Copy) -> int:
    return copy.tier
