"""The residency machinery under ``TierStore``: entries, copies, moves between tiers, room.

One event loop owns all state here; bytes move on worker threads (disk, large CPU copies) and
CUDA side streams. The store keeps one ``Entry`` per key with a copy per tier; every change of
residency goes through a few functions (install, retire, use/unuse) so the eviction policies,
the accounting and the copies always agree. ``TierStore`` (store.py) puts the public verbs on
top of it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from . import eviction, flushing, holds, overwrite
from .copies import INLINE_COPY_BYTES, copy_bytes, cpu_copy
from .device import READY, TO_DEVICE, TO_HOST, Link, Transfer, link_for
from .device.caller import caller_work
from .disk.catalog import DiskRecord
from .disk.extents import Extent
from .entry import Copy, Entry, MemoryCopy, shared_meta
from .errors import (
    CorruptionError,
    EntryHeldError,
    InvalidTensorError,
    KeyNotFoundError,
    StoreClosedError,
    StoreForkedError,
    TierFullError,
    TierStoreError,
    UnknownTierError,
    WrongLoopError,
)
from .gcpause import gc_paused
from .keys import check_key, plain_text
from .prefetching import PrefetchIssuer
from .process import this_process
from .protocols import PREFETCH_CALLED, EvictionPolicy, PrefetchPolicy, missing_methods, policy_name
from .recency import CopyLRU
from .room_queue import RoomQueue
from .stats import StoreCounters
from .suggestions import read_suggestions
from .tensors import TensorMeta, aligned_empty, as_bytes, from_bytes
from .tiers.base import MemoryTier, Tier
from .tiers.disk import DiskTier, InlineSuperseded
from .tracing import TraceRecorder
from .units import format_bytes
from .warn import warn
from .workers import Priority, WorkerPool, wait_uncancelled

TierRef = int | str | Tier | None
#: Reads of an inline value that found a newer version in the catalog, waited for its writer
#: and read again, before giving up (each wait is for a commit that then installs it).
_MAX_REREADS = 100

T = TypeVar("T")





class Engine:
    """State and moves of a tiered store (see the module docstring); use ``TierStore``."""

    def __init__(self, tiers: Sequence[Tier], eviction: Any, prefetch: PrefetchPolicy | Callable[[], PrefetchPolicy] | str | None, cpu_threads: int) -> None:
        from policies import LRU, NoPrefetch

        self._tiers: list[Tier] = _check_tiers(tiers)
        #: The loop the store was last opened on (its verbs run there: ``require_open``).
        self._loop: asyncio.AbstractEventLoop | None = None
        self.names = [tier.name for tier in self._tiers]
        self._by_name = {name: i for i, name in reversed(list(enumerate(self.names)))}  # (the first of a name, as list.index)
        self.disk_index = len(self._tiers) - 1 if isinstance(self._tiers[-1], DiskTier) else None
        self.entries: dict[str, Entry] = {}
        self.policies: list[EvictionPolicy | None] = _make_policies(self._tiers, eviction if eviction is not None else LRU, self._copy_finder)
        #: Per tier, its policy's optional ``on_release`` (told when a copy's use ends).
        self._releases: list[Callable[[str], None] | None] = [
            getattr(policy, "on_release", None) if policy is not None and policy.__class__ is not CopyLRU else None
            for policy in self.policies
        ]
        self.prefetch_policy: PrefetchPolicy = _make_prefetch(prefetch if prefetch is not None else NoPrefetch)
        #: Per tier, the last failure of its eviction policy's hooks (``_eviction_policy_failed``).
        self.policy_failures: dict[int, str] = {}
        #: What was warned of (``warn_once``).
        self._warned: set[object] = set()
        #: The policy that never suggests anything is not asked on every access.
        self._no_prefetch = type(self.prefetch_policy) is NoPrefetch
        #: Blocks open now whose accesses the prefetch policy is not told of
        #: (``TierStore._unobserved``: a checkpoint's, not the training's pattern).
        self.unobserved = 0
        if hasattr(self.prefetch_policy, "set_capacities"):
            self.prefetch_policy.set_capacities({tier.name: tier.capacity for tier in self._tiers})
        self.trace: TraceRecorder | None = None
        self.cpu = WorkerPool(cpu_threads, "cpu")
        self.versions = itertools.count(1)
        #: Grows whenever a key appears or disappears (for caches of the key set).
        self.key_changes = 0
        #: Set while a point-in-time view is being read (an export): writers wait for ``thawed``.
        self.frozen = False
        self._thawed: asyncio.Event | None = None
        #: Bytes per tier that demotions under way will free (``tierstore.eviction``).
        self.freeing = [0] * len(self._tiers)
        self.demotions: list[set[asyncio.Task[None]]] = [set() for _ in self._tiers]
        #: Bytes per tier of copies retired but given back only once the kernels that last used
        #: them have run (``_release_after``), and futures each ending as one lands: room that
        #: comes back without an eviction (``tierstore.eviction`` counts it and waits for it).
        self.releasing = [0] * len(self._tiers)
        #: Bytes per tier that requests for room waiting there count on coming back, each what
        #: its value still needs (it may be more than ``freeing`` + ``releasing``): another
        #: request counts on only the rest of that room, and evicts for itself (``tierstore.eviction``).
        self.claimed = [0] * len(self._tiers)
        #: Per tier, how many times its eviction policy's ``victim()`` said None (checked on the
        #: first, second, fourth, eighth... time for a value that could have gone: ``tierstore.eviction``).
        self.none_victims = [0] * len(self._tiers)
        self.releases: list[set[asyncio.Future[None]]] = [set() for _ in self._tiers]
        #: Per tier, futures each ending as a read out of a copy there lets go of it, with the
        #: copy (``reading``): a request for room waits for those of unheld copies, a bounded
        #: number of times (``tierstore.eviction.READ_WAITS``).
        self.reads: list[dict[asyncio.Future[None], Copy]] = [{} for _ in self._tiers]
        #: Buffers allocated on a tier and being filled (they become evictable copies when done).
        self.incoming: list[set[asyncio.Future[None]]] = [set() for _ in self._tiers]
        #: Per tier, the requests waiting for room there (``wait_for_room``), and the awaitables
        #: watched for them, each with one callback that wakes the first of each line as it ends.
        self._room_queues = [RoomQueue() for _ in self._tiers]
        self._room_watched: list[set[Any]] = [set() for _ in self._tiers]
        self.background: set[asyncio.Task[Any]] = set()
        #: Writes that must finish even if their caller is cancelled (disk puts, write-backs);
        #: ``aclose`` drains them.
        self.writes: set[asyncio.Future[Any]] = set()
        #: Early write-backs in flight (``tierstore.eviction.write_early``), by the id of the memory
        #: copy each writes (alive meanwhile: each holds a use of its copy).
        self.early_writes: dict[int, asyncio.Task[None]] = {}
        #: How many requests wait for each load in flight (``_ensure``'s futures), to hand each
        #: a use of the loaded copy.
        self._load_waiters: dict[asyncio.Future[Copy | None], int] = {}
        #: Loaded copies whose waiters have not all run, by the copy's id (alive meanwhile: each
        #: waiter holds a use): the uses handed out and not given back yet, and the future that
        #: ends when they are (``expect_room``).
        self._handed: dict[int, list[Any]] = {}
        self._wait_tickets = itertools.count()
        self._prefetched: set[tuple[str, int]] = set()
        self.issuer: PrefetchIssuer | None = None
        self.counters = StoreCounters()
        #: Called as ``on_transfer(link, nbytes, start, end)`` after each transfer between tiers
        #: (``time.perf_counter()`` times); the optimizer's timeline listens here.
        self.on_transfer: Callable[[str, int, float, float], None] | None = None
        self.is_open = False
        self.closing = False
        #: A close is past waiting for write holds (``close``): until its outcome nothing is
        #: allocated, installed or changed; requests wait for the outcome (``settled``).
        self.sealed = False
        #: Closed after being open (a verb then says "closed", not "not open yet").
        self.closed = False
        #: Ends with the outcome of the sealed close (True: closed), made when it seals.
        self._outcome: asyncio.Future[bool] | None = None
        self._pid = os.getpid()

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first (the engine's own list: do not change it)."""
        return self._tiers

    def tier(self, ref: TierRef) -> Tier:
        """A tier by name, index or object."""
        return self._tiers[self.index_of(ref)]

    # -- lifecycle -----------------------------------------------------------------------------

    async def open(self, trace_path: Path | None) -> None:
        """Open every tier (the disk tier loads its catalog) and adopt what is on disk."""
        with gc_paused():
            await self._open(trace_path)

    async def _open(self, trace_path: Path | None) -> None:
        self._loop = asyncio.get_running_loop()
        opened: list[Tier] = []
        in_use = [tier.name for tier in self._tiers if tier.is_open]
        if in_use:  # (two stores over one tier object counted the same bytes, each as its own)
            raise ValueError(f"tier(s) {in_use} are open already, in another store (or opened by hand): each store needs "
                             "tier objects of its own, made for it")
        try:
            for tier in self._tiers:
                await tier.open()
                opened.append(tier)
        except BaseException:
            for tier in reversed(opened):
                await tier.aclose()
            raise
        newest = 0
        if self.disk_index is not None:
            disk, d, entries = self.disk, self.disk_index, self.entries
            for key, record in disk.loaded.items():
                entry = Entry(key, record.meta, version=record.version)
                entry.set_copy(Copy(d, record.version, extent=record.extent, checksums=record.checksums))
                entries[key] = entry
                if record.version > newest:
                    newest = record.version
            # Values inline in the catalog (their checksum stays there beside their bytes): the
            # metadata comes shared already; an entry per key, its copy made on first use.
            newest = max(newest, Entry.adopt_inline(disk.loaded_inline, d, entries))
            disk.loaded, disk.loaded_inline = {}, ()
        self.versions = itertools.count(newest + 1)
        self.key_changes += 1  # the keys found on disk
        for name in self.names:
            self.counters.tier(name)
        self.cpu.start()
        if trace_path is not None:
            self.trace = TraceRecorder(trace_path, self.names)
        self.issuer = PrefetchIssuer(self)
        self._pid = os.getpid()
        self.is_open = True

    async def close(self, flush: bool) -> None:
        """Refuse new write holds, cancel prefetches, wait for the write holds open (if it
        flushes), then seal: drain writes and demotions, flush (if asked and there is a disk
        tier), close the tiers. A flush that fails (the disk cannot take what only memory holds)
        leaves the store open, with nothing lost, and raises.

        Until it seals, requests go on as usual (the flush comes after them), except a write
        hold, which is refused (``StoreClosedError``): the close waits for the write holds open,
        and a holder may be waiting for the one asked for. Once sealed, the close waits for no
        request (room on its way may come only later, or never), and a request that would
        allocate, install or change anything, or a verb started, waits for the close's outcome
        (``settled``): it fails with ``StoreClosedError``, having installed nothing, if the
        store closed, and goes on as if no close had happened if the close failed.

        A close asked for while another is sealed waits for its outcome, and closes the store
        itself if that one failed (it does not return with the store open). One asked for
        before the seal returns at once (it may come from a holder the first close waits for)."""
        while self.sealed:
            await self.settled()
        if not self.is_open or self.closing:
            return
        self.closing = True
        try:
            await self._cancel_background()
            if self.disk_index is not None and flush:
                # Every write hold, not only those ``flush_all`` waits for (on values not yet on
                # disk): each makes its key's value new when it ends, and none starts from now.
                await self.no_writers(lambda: [e for e in self.entries.values() if e.visible], "close the store holding")
            # Sealed: from here the close waits for no request (only for its own work), so a
            # request may wait for it without a deadlock.
            self.sealed = True
            self._outcome = asyncio.get_running_loop().create_future()
            for queue in self._room_queues:  # requests waiting for room wait for the outcome (``tierstore.eviction``)
                queue.wake_all()
            await self._cancel_background()  # (prefetches started before the seal)
            while self.writes or any(self.demotions):
                # Shielded: a cancelled close (``wait_for(aclose(), t)``) must not cancel a write
                # or a commit under way, whose cleanup would then free what it still writes.
                pending = [*self.writes, *(t for tasks in self.demotions for t in tasks)]
                await asyncio.gather(*(asyncio.shield(w) for w in pending), return_exceptions=True)
            if self.disk_index is not None:
                if flush:
                    await self.flush_all(whole=False)
                await self.disk.drain()  # small puts acknowledged before their commit, flush or not
        except BaseException:
            # It stays open, nothing lost (a flush the disk had no room for, or a cancelled
            # close): close again later. The requests that waited for the outcome go on.
            self.closing = False
            self._settle(closed=False)
            raise
        self.is_open = False
        self.closing = False
        self.closed = True
        try:
            if self.trace is not None:
                await self.trace.aclose()
        finally:
            try:
                self._free_memory_copies()
                await _close_each(self._tiers)
            finally:
                self.cpu.shutdown()
                self.entries.clear()
                # (a reopen may run on another loop: nothing of this one's waits carries over)
                self._room_queues = [RoomQueue() for _ in self._tiers]
                self._room_watched = [set() for _ in self._tiers]
                # The policies forget every copy too: the default one links them (and so their
                # buffers) through itself, which would keep a closed store's memory alive.
                for policy in self.policies:
                    if policy is not None:
                        policy.reset()
                self._settle(closed=True)  # (once the tiers are closed: the waiters find them so)

    def _free_memory_copies(self) -> None:
        """At the close: give every memory copy no one uses back to its tier (a kernel that may
        still use one gives it back when done). Dropped with the entries instead, a store opened
        again found its memory tiers full of the bytes of the values it had held: every put there
        failed as full ("values deleted or replaced that a read still uses")."""
        for entry in self.entries.values():
            for copy in entry.all_copies():
                if copy.in_memory and not copy.users and not copy.retired:
                    self._free(copy)

    def _settle(self, closed: bool) -> None:
        """End the seal with the close's outcome (``settled`` returns to whoever waits)."""
        self.sealed = False
        outcome, self._outcome = self._outcome, None
        if outcome is not None:
            outcome.set_result(closed)

    async def _cancel_background(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)

    @property
    def winding_down(self) -> bool:
        """Sealed for a close, or closed: nothing may be allocated or changed that the close's
        flush would not see (a request then waits for the outcome, ``settled``, or is refused)."""
        return self.sealed or not self.is_open

    def wait_for_room(
        self, t: int, nbytes: int, pending: Iterable[Any], *, line: int, first: bool = False
    ) -> tuple[asyncio.Future[None], bool]:
        """A future a request for room on tier ``t`` (for a value of ``nbytes``) waits on, and
        whether it is a place in ``line`` of the tier's queue (``tierstore.room_queue``: a
        request that looked for victims and found none, or one whose shortfall the room on its
        way covers; ``first``: at the front), woken at a change: a copy becoming a victim, or
        any of ``pending`` ending (demotions, fills, releases and reads of the tier: each ends
        with room or a victim; each gets one callback, once, however many requests wait on it:
        each request adding and removing its own on every one was most of an optimizer's step
        with thousands of small entries in flight). Ended at once, and no place, where one has
        ended already or a close has sealed (the request then waits for the close's outcome).
        A request in the queue that stops waiting says so (``leave_room_queue``); one woken
        from it says when it has looked (``room_looked``)."""
        watched = self._room_watched[t]
        now = self.sealed
        for awaitable in pending:
            if awaitable in watched:
                continue
            if awaitable.done():
                now = True
                continue
            watched.add(awaitable)
            awaitable.add_done_callback(partial(self._watched_ended, t, awaitable))
        if now:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done, False
        tier = self._tiers[t]
        assert isinstance(tier, MemoryTier)
        return self._room_queues[t].join(line, nbytes, tier._slot_size(nbytes), first=first), True

    def leave_room_queue(self, t: int, line: int, waiter: asyncio.Future[None]) -> None:
        """The request of ``waiter`` (``wait_for_room``) stops waiting before it has looked
        again: a wake it had goes on."""
        self._room_queues[t].leave(line, waiter)

    def room_looked(self, t: int, line: int, wake_next: bool) -> None:
        """A request woken from ``line`` of tier ``t``'s queue has looked for victims, or
        leaves (``RoomQueue.pass_on``)."""
        tier = self._tiers[t]
        assert isinstance(tier, MemoryTier)
        self._room_queues[t].pass_on(line, wake_next, lambda nbytes: tier.free >= tier.allocation_size(nbytes))

    def room_unreachable(self, t: int) -> None:
        """A request for room on tier ``t`` fails as full: every waiting one looks again (each
        may fail too, with nothing left to wait for)."""
        self._room_queues[t].wake_all()

    def _watched_ended(self, t: int, awaitable: Any, _: Any) -> None:
        self._room_watched[t].discard(awaitable)
        self._room_may_have_changed(t)

    def _room_may_have_changed(self, t: int) -> None:
        """Room on tier ``t`` may have changed: wake the requests waiting for it, as
        ``RoomQueue.changed`` does (``wait_for_room``)."""
        self._room_queues[t].changed()

    async def settled(self) -> None:
        """Return once no sealed close is under way (at once when none is): the store is then
        closed, or open again after a close that failed. Waiting is safe: a sealed close waits
        for no request. Cancelling the wait cancels nothing else."""
        while self.sealed and self._outcome is not None:
            await asyncio.wait([self._outcome])

    # -- reading -------------------------------------------------------------------------------

    async def acquire(self, entry: Entry, t: int, priority: Priority) -> Copy:
        """Make ``entry`` valid on tier ``t`` and take a use of that copy (caller must unuse)."""
        await self._ensure(entry, t, priority)
        copy = entry.valid(t)
        if copy is None:  # _ensure returns only once valid; nothing awaited since
            raise TierStoreError(f"internal error: {entry.key!r} vanished from {self.names[t]!r}")
        self.use(entry, copy)
        return copy

    async def _ensure(self, entry: Entry, t: int, priority: Priority, using: bool = True) -> None:
        """Return once ``entry`` has a valid copy on tier ``t`` (one load at a time per tier).
        ``using``: the caller takes a use of it then (a prefetch does not)."""
        rereads = 0
        while entry.valid(t) is None:
            if self.entries.get(entry.key) is not entry or not entry.visible:
                raise self._deleted(entry)
            pending = entry.loading.get(t)
            if pending is not None:
                if using:
                    await self._wait_for_load(entry, pending)
                else:
                    await asyncio.shield(pending)
                continue
            done: asyncio.Future[Copy | None] = asyncio.get_running_loop().create_future()
            entry.start_loading(t, done)
            superseded = False
            try:
                await self._load(entry, t, priority)
            except InlineSuperseded:
                superseded = True
            finally:
                entry.end_loading(t, done)
                # Those waiting for this load get a use of the copy each, theirs until they run:
                # a copy no one used yet is a victim, and a request for room served before
                # they run would evict it (MIN does: a prefetch's copy, the next use of which
                # it placed after the request's) and they would read it again.
                waiting = self._load_waiters.pop(done, 0)
                loaded = entry.valid(t) if waiting else None
                if loaded is not None:
                    loaded.users += waiting
                    handed = self._handed.get(id(loaded))
                    if handed is None:
                        handed = self._handed[id(loaded)] = [0, asyncio.get_running_loop().create_future()]
                        self.expect_room(t, handed[1])  # (a request for room meanwhile waits for them to run)
                    handed[0] += waiting
                done.set_result(loaded)
            if superseded:
                rereads += 1
                if rereads > _MAX_REREADS:
                    raise CorruptionError(f"{entry.key!r}: the catalog keeps holding another version than the store's record of it")
                await self._superseded(entry)

    async def _wait_for_load(self, entry: Entry, pending: asyncio.Future[Copy | None]) -> None:
        """Wait for another request's load of ``entry`` (``_ensure``); the use of the loaded copy
        it takes on this waiter's behalf ends here, once the waiter runs, cancelled or not."""
        self._load_waiters[pending] = self._load_waiters.get(pending, 0) + 1
        try:
            await asyncio.shield(pending)
        finally:
            if not pending.done():  # (cancelled first: not counted when the load ends)
                left = self._load_waiters[pending] - 1
                if left:
                    self._load_waiters[pending] = left
                else:
                    del self._load_waiters[pending]
            elif (loaded := pending.result()) is not None:
                handed = self._handed[id(loaded)]
                handed[0] -= 1
                if not handed[0]:
                    del self._handed[id(loaded)]
                self.unuse(entry, loaded)  # (``acquire`` takes its own at once: nothing runs in between)
                if not handed[0]:
                    handed[1].set_result(None)

    def users_besides_waiters(self, copy: Copy) -> int:
        """The uses of ``copy`` other than those handed to requests that waited for its load and
        have not run since (each gives its own back as it runs): a write hold that asked first
        goes first, as it would had the copy been there."""
        handed = self._handed.get(id(copy))
        return copy.users - (handed[0] if handed is not None else 0)

    async def _load(self, entry: Entry, t: int, priority: Priority) -> None:
        """Copy the current value of ``entry`` onto memory tier ``t`` from its fastest copy."""
        if entry.writer is not None:
            await self.no_writer(entry, "read")
            return  # (the value may have changed meanwhile, and be on tier t now: ``_ensure`` looks again)
        sources = [s for s in entry.readable_tiers() if s != t]
        if not sources:
            raise CorruptionError(f"{entry.key!r} has no valid copy on any tier")
        source = entry.valid(sources[0])
        if source is None:
            raise CorruptionError(f"{entry.key!r} has no valid copy on any tier")
        version = entry.version
        self.hit(entry, source)
        self.use(entry, source)
        # (a load down the tiers needs room below its source only, never on it: a request for
        # room there may wait for it. One up the tiers may demote into its source's tier.)
        read = self.reading(source) if source.tier < t else None
        try:
            fill = self._filler(entry, source, t)
            await self._write_memory(entry, t, version, fill, priority, source_tier=sources[0], wait_for_close=True)
        finally:
            self.unuse(entry, source)
            self.read_done(read)

    async def _superseded(self, entry: Entry) -> None:
        """An inline value read from the catalog was of a newer version than the entry's copy:
        its writer holds the entry's disk lock until it has installed it. Wait for that (a
        reader then reads again, the new value)."""
        async with entry.disk_lock:
            pass

    def _filler(self, entry: Entry, source: Copy, target: int | None) -> Callable[[torch.Tensor, Priority], Awaitable[None]]:
        """A coroutine function that fills a buffer (on tier ``target``, or the caller's with
        None) with ``source``'s bytes."""
        meta = entry.meta
        if source.inline is not None:
            disk, key, version = self.disk, entry.key, source.version

            async def from_catalog(buffer: torch.Tensor, priority: Priority) -> None:
                disk.read_inline(key, version, buffer)

            return from_catalog
        if source.extent is not None:
            record = DiskRecord(entry.key, meta, source.extent, source.version, source.checksums)

            async def from_disk(buffer: torch.Tensor, priority: Priority) -> None:
                await self.disk.read(record, buffer, priority)

            return from_disk

        async def from_memory(buffer: torch.Tensor, priority: Priority) -> None:
            crossing = self._crossing(source.tier, target)
            # a tier's buffer: it waits only for the kernels of its last holder, if any
            await self._copy(buffer[: meta.nbytes], source.view(meta.nbytes), priority, crossing, after=READY if source.last_use is None else source.last_use)

        return from_memory

    async def clone(self, entry: Entry, copy: Copy, t: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The value of ``copy`` in ``out`` or a fresh tensor (on ``t``'s device)."""
        meta = entry.meta
        if out is None:
            out = torch.empty(meta.shape, dtype=meta.dtype, device=self._tiers[t].device)  # type: ignore[attr-defined]
        else:
            _refuse_changed_out(out, meta)
        if meta.nbytes:
            await self._copy(as_bytes(out), copy.view(meta.nbytes), Priority.DEMAND, after=READY if copy.last_use is None else copy.last_use)
        return out

    async def read_uncached(self, entry: Entry, device: torch.device, out: torch.Tensor | None = None, target: int | None = None) -> torch.Tensor:
        """Read the current value into ``out`` or a new tensor on ``device`` (the memory of tier
        ``target`` if given: a copy into it crosses that tier's link), caching it nowhere."""
        for _ in range(_MAX_REREADS):
            try:
                return await self._read_uncached(entry, device, out, target)
            except InlineSuperseded:
                await self._superseded(entry)
                if self.entries.get(entry.key) is not entry or not entry.visible:
                    raise self._deleted(entry) from None
        raise CorruptionError(f"{entry.key!r}: the catalog keeps holding another version than the store's record of it")

    async def _read_uncached(self, entry: Entry, device: torch.device, out: torch.Tensor | None, target: int | None) -> torch.Tensor:
        if entry.writer is not None:
            await self.no_writer(entry, "read")
        tiers = entry.readable_tiers()
        source = entry.valid(tiers[0]) if tiers else None
        if source is None:
            if self.entries.get(entry.key) is not entry or not entry.visible:  # (a delete or pop while the get waited)
                raise self._deleted(entry)
            raise CorruptionError(f"{entry.key!r} has no valid copy on any tier")
        meta = entry.meta
        if out is not None:
            _refuse_changed_out(out, meta)
        if source.inline is not None and out is None and device.type == "cpu" and self._crossing(None, target) is None:
            # No await, so no use taken: the bytes come from the catalog into a new tensor.
            return from_bytes(self.disk.read_inline_new(entry.key, source.version), meta)
        self.use(entry, source)
        read = self.reading(source)
        try:
            if out is None and device.type == "cpu":
                buffer = aligned_empty(meta.nbytes)
                await self._filler(entry, source, target)(buffer, Priority.DEMAND)
                return from_bytes(buffer, meta)
            if out is None:
                out = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            await self._filler(entry, source, target)(as_bytes(out), Priority.DEMAND)
            return out
        finally:
            self.unuse(entry, source)
            self.read_done(read)

    # -- writing -------------------------------------------------------------------------------

    async def cache_copy(self, entry: Entry, t: int, src: torch.Tensor) -> None:
        """Copy ``src`` (the bytes of ``entry``'s current value) onto memory tier ``t`` as a copy
        of that version; dropped if the value changes meanwhile. A store that closes meanwhile
        has no room for it (``TierFullError``: the value itself was written already)."""
        try:
            await self._write_memory(entry, t, entry.version, self._copier(src, t), Priority.DEMAND, source_tier=None)
        except StoreClosedError as exc:
            raise TierFullError(f"not cached on tier {self.names[t]!r}: {exc}") from exc

    async def put_memory(self, entry: Entry, t: int, src: torch.Tensor, meta: TensorMeta) -> None:
        """Copy ``src`` onto memory tier ``t`` as the new value of ``entry`` (over the value it
        replaces when the tier has no room for both: ``tierstore.overwrite``); the put is
        recorded in the trace."""
        fill = self._copier(src, t)
        old = overwrite.overwritable(self, entry, t, meta.nbytes, read=True)
        if old is not None:
            old = await overwrite.after_reads(self, entry, old, t, meta.nbytes)
        if old is not None and await overwrite.overwrite(self, entry, old, fill, meta, Priority.DEMAND):
            return
        with overwrite.refusal_explained(self, entry, t, meta.nbytes):
            await self._write_memory(entry, t, None, fill, Priority.DEMAND, meta=meta, source_tier=None, wait_for_close=True)
        self.observe("put", entry.key, meta.nbytes, t, hit=False)  # (room made for it: see tierstore.tracing)

    def put_memory_now(self, entry: Entry, t: int, src: torch.Tensor, meta: TensorMeta) -> bool:
        """``put_memory`` done at once, with no await, when nothing needs one: a small CPU
        value, a tier in the same memory (no link to cross) with room for it now, or a value
        that can be copied over now (``tierstore.overwrite``); recorded in the trace. False
        (nothing done) otherwise: the caller then goes the awaited way."""
        tier = self._tiers[t]
        nbytes = meta.nbytes
        if (
            self.winding_down  # (the awaited way waits for the close's outcome: its flush may have passed)
            or nbytes > INLINE_COPY_BYTES
            or src.device.type != "cpu"
            or getattr(tier, "link", None) is not None
            or not isinstance(tier, MemoryTier)
            or tier.device.type != "cpu"
        ):
            return False
        started = time.perf_counter()
        if tier.free < tier.allocation_size(nbytes):
            old = overwrite.overwritable(self, entry, t, nbytes)
            if old is None:
                return False
            cpu_copy(old.view(nbytes), src[:nbytes])  # (no await: nothing sees it part-way)
            self.overwritten(entry, old, meta, time.perf_counter() - started)
            return True
        self.policy_before_insert(t, entry.key, nbytes)
        packed = tier.allocate_packed(nbytes)
        copy = MemoryCopy(t, 0, slab=packed[0], index=packed[1]) if packed is not None else MemoryCopy(t, 0, buffer=tier.allocate(nbytes))
        if nbytes:
            cpu_copy(copy.view(nbytes), src[:nbytes])
        self.count_link(None, t, nbytes, time.perf_counter() - started)
        live = self._live_entry(entry, meta)
        self.new_version(live, keep=None, meta=meta)
        copy.version = live.version
        live.set_copy(copy)
        self.policy_insert(live, copy)
        self.observe("put", live.key, nbytes, t, hit=False)
        return True

    async def put_filled(self, entry: Entry, t: int, fill: Callable[[torch.Tensor, Priority], Awaitable[None]], meta: TensorMeta) -> None:
        """A new value of ``entry`` on memory tier ``t``, written into its buffer by ``fill``."""
        with overwrite.refusal_explained(self, entry, t, meta.nbytes, fill=True):
            await self._write_memory(entry, t, None, fill, Priority.DEMAND, meta=meta, source_tier=None, wait_for_close=True)

    def _copier(self, src: torch.Tensor, target: int) -> Callable[[torch.Tensor, Priority], Awaitable[None]]:
        """A coroutine function that fills a buffer on tier ``target`` with the bytes of ``src``
        (the caller's memory)."""
        crossing = self._crossing(None, target)

        async def fill(buffer: torch.Tensor, priority: Priority) -> None:
            await self._copy(buffer[: src.numel()], src, priority, crossing)

        return fill

    async def _write_memory(
        self,
        entry: Entry,
        t: int,
        version: int | None,
        fill: Callable[[torch.Tensor, Priority], Awaitable[None]],
        priority: Priority,
        *,
        meta: TensorMeta | None = None,
        source_tier: int | None,
        wait_for_close: bool = False,
    ) -> None:
        """Allocate on memory tier ``t`` (evicting as needed), fill, and install.

        ``version`` None means a put: the copy becomes the new value of the key. Otherwise the
        copy is of ``version`` and is installed only if that is still the current value.
        A sealed close (``close``) is waited for with ``wait_for_close`` (a request: it goes on
        if the close fails); without, it refuses (``StoreClosedError``), as a write that the
        close itself waits for (a demotion's) must.
        """
        tier = self._tiers[t]
        if not isinstance(tier, MemoryTier):
            raise UnknownTierError(f"tier {tier.name!r} holds no buffers")
        nbytes = (meta or entry.meta).nbytes
        self.policy_before_insert(t, entry.key, nbytes)
        await eviction.make_room(self, t, nbytes, priority, wait_for_close)
        # A small value takes a slot of a shared slab, named by (slab, index): no tensor is
        # kept per value (a million small keys must not cost a million tensor objects).
        packed = tier.allocate_packed(nbytes)
        if packed is not None:
            copy = MemoryCopy(t, 0, slab=packed[0], index=packed[1])
        else:
            copy = MemoryCopy(t, 0, buffer=tier.allocate(nbytes))
        started = time.perf_counter()
        arriving = asyncio.get_running_loop().create_future()
        self.incoming[t].add(arriving)
        try:
            await fill(copy.buffer, priority)  # type: ignore[arg-type]
        except BaseException:
            self._give_back(tier, copy)
            raise
        finally:
            self.incoming[t].discard(arriving)
            arriving.set_result(None)
        while self.winding_down:  # filled while the store closed: its flush may be past
            if wait_for_close and self.sealed:
                try:
                    await self.settled()
                except BaseException:
                    self._give_back(tier, copy)
                    raise
                continue
            self._give_back(tier, copy)
            raise StoreClosedError(f"the store closed while a value was being copied onto tier {tier.name!r}; nothing was installed")
        self.count_link(source_tier, t, self._moved_from(entry, source_tier, nbytes), time.perf_counter() - started)
        if version is None:
            live = self._live_entry(entry, meta)  # type: ignore[arg-type]
            self.new_version(live, keep=None, meta=meta)
            copy.version = live.version
            live.set_copy(copy)
            self.policy_insert(live, copy)
            return
        if self.entries.get(entry.key) is not entry or entry.version != version or entry.valid(t) is not None:
            self._give_back(tier, copy)  # the value changed meanwhile: this copy is stale
            return
        copy.version = version
        entry.set_copy(copy)
        self.policy_insert(entry, copy)

    @staticmethod
    def _give_back(tier: MemoryTier, copy: Copy) -> None:
        """Return a memory copy's slot or buffer to its tier (a closed tier keeps none of it:
        one that comes back after the close, its kernel done, is freed)."""
        slab = copy.slab
        if slab is not None:
            tier.release_packed(slab, copy.index)
        else:
            tier.release(copy.buffer)  # type: ignore[arg-type]
        copy.buffer = None
        if not tier.is_open:
            tier.clear_pool()

    async def write_back(self, entry: Entry, source: Copy, priority: Priority, target: int | None = None) -> None:
        """Write ``source`` (a memory copy the caller uses) to ``target`` (default: one tier down)."""
        below = source.tier + 1 if target is None else target
        buffer = source.buffer
        if buffer is None:
            raise TierStoreError(f"internal error: write-back of {entry.key!r} from a copy without a buffer")
        if below == self.disk_index:
            await self.write_disk(entry, buffer, entry.meta, source.version, priority, source_tier=source.tier)
        else:
            await self._write_memory(entry, below, source.version, self._filler(entry, source, below), priority, source_tier=source.tier)
        self.counters.tier(self.names[source.tier]).writebacks += 1

    async def write_disk(
        self,
        entry: Entry,
        src: torch.Tensor,
        meta: TensorMeta,
        version: int | None,
        priority: Priority,
        source_tier: int | None = None,
        abandon: asyncio.Event | None = None,
        staged: bool = True,
    ) -> int | None:
        """Copy-on-write to the disk tier: new extent, data (+fsync), catalog commit, install, free
        the old extent. ``version`` None is a put (a new value); otherwise a write-back of that
        version, skipped if it is no longer current. Must run to completion (callers shield it).
        Returns the version a put committed (None: it gave up, or a write-back).
        Once ``abandon`` is set (the put's caller was cancelled), a write whose commit has not
        begun gives up and changes nothing. A small value goes inline into its catalog record
        (``_write_inline``; ``staged``: on a non-durable tier it may be acknowledged before its
        commit)."""
        disk = self.disk
        d = self._tiers.index(disk)
        try:
            while True:
                if version is None:
                    entry = self._live_entry(entry, meta)
                async with entry.disk_lock:
                    if self.entries.get(entry.key) is not entry:
                        if version is None:
                            continue  # deleted while we waited: write to the new entry
                        return None
                    if (version is not None and entry.version != version) or (abandon is not None and abandon.is_set()):
                        return None
                    if disk.holds_inline(meta.nbytes):
                        written_version = await self._write_inline(entry, d, src, meta, version, source_tier, staged=staged)
                        return written_version if version is None else None
                    try:
                        extent = await disk.allocate(meta.nbytes)
                    except TierFullError as exc:
                        raise self._full_of_old_versions(exc, disk.extent_size(meta.nbytes)) from None
                    started = time.perf_counter()
                    written = entry

                    def record_for(checksums: tuple[int, ...], written: Entry = written, extent: Extent = extent) -> DiskRecord | None:
                        # (on the I/O thread that ends the write, just before the commit: reads only)
                        stale = version is not None and (written.version != version or self.entries.get(written.key) is not written)
                        if stale or (abandon is not None and abandon.is_set()):
                            return None
                        return DiskRecord(written.key, meta, extent, version if version is not None else next(self.versions), checksums)

                    try:
                        record = await disk.write_committed(extent, src, meta.nbytes, record_for, priority)
                        if record is None:
                            disk.release(extent)
                            return None
                        record_version, checksums = record.version, record.checksums
                    except BaseException:
                        disk.release(extent)
                        raise
                    self.count_link(source_tier, d, extent.length, time.perf_counter() - started)  # (whole blocks cross)
                    new = Copy(d, record_version, extent=extent, checksums=checksums)
                    old = entry.copy_on(d)
                    if old is not None:
                        self.retire(entry, d, old)
                    entry.set_copy(new)
                    if version is None:
                        self.new_version(entry, keep=new, meta=meta, version=record_version)
                        return record_version
                    return None
        finally:
            entry.forget_idle_lock()  # (the entry a put wrote to, if it was deleted meanwhile)
            if version is None:
                self.drop_if_unused(entry)  # (one made here for a put that gave up)

    def _full_of_old_versions(self, exc: TierFullError, length: int) -> TierFullError:
        """``exc`` (the disk tier full, asked for an extent of ``length`` bytes), saying how much
        of it holds the last written versions of values changed in memory since: kept as the
        durable copy until the new value is written back, they are in no listing of the tier (a
        put over a value that filled its memory tier evicted it to the disk first: the tier
        looked empty and refused a put). As it is for an extent beyond the whole tier: no flush
        would make room for it."""
        if length > self.disk.capacity:
            return exc
        d = self.disk_index
        kept = 0
        for entry in self.entries.values():
            copy = entry.copy_on(d) if d is not None else None
            if copy is not None and copy.version != entry.version and copy.extent is not None:
                kept += copy.extent.length
        if not kept:
            return exc
        return TierFullError(f"{exc}; {format_bytes(kept)} of the tier hold the last written versions of values changed in "
                             "memory since (kept as the durable copy until the new value is written back: flush() writes those "
                             "values and frees these bytes, as deleting their keys does)")

    async def _write_inline(
        self, entry: Entry, d: int, src: torch.Tensor, meta: TensorMeta, version: int | None, source_tier: int | None, staged: bool
    ) -> int:
        """Write a small value inline into its catalog record (the caller holds ``entry``'s disk
        lock): one catalog change, no extent and no data-file sync. On a durable tier (or when
        not ``staged``, or when the old value's extent must outlive the commit) it returns once
        the transaction holding it is committed; on a non-durable one the change is queued for
        the next transaction and the value installed at once (reads in the process see it).
        Returns the version written."""
        disk = self.disk
        started = time.perf_counter()
        nbytes = meta.nbytes
        disk.reserve_inline(nbytes)
        try:
            record_version = version if version is not None else next(self.versions)
            record = disk.inline_record(entry.key, meta, src, record_version)
            old = entry.copy_on(d)
            if disk.durable or not staged or (old is not None and old.extent is not None):
                await disk.commit([(entry.key, record)])
            else:
                disk.stage([(entry.key, record)])
        except BaseException:
            disk.release_inline(nbytes)
            raise
        self.count_link(source_tier, d, nbytes, time.perf_counter() - started)
        self.install_disk(entry, d, Copy(d, record_version, inline=nbytes), meta if version is None else None)
        return record_version

    def commit_small_now(self, entry: Entry, src: torch.Tensor | bytes, meta: TensorMeta) -> asyncio.Future[int] | None:
        """A put of a small value committed inline in the catalog, started with no await: the
        key's disk lock taken at once, the record handed to the catalog's writer thread, and the
        value installed (the lock released), on the loop, once the transaction is durable. The
        returned future then gives the version committed, or raises what the commit raised
        (nothing then changed). It cannot be cancelled: a task cancelled while awaiting it
        gets its ``CancelledError`` once the outcome is settled (the commit goes on; ``aclose``
        waits for it). None, with nothing done, when that cannot start at once (a value not
        small, a catalog change of the key or of the catalog under way): the caller then goes
        the awaited way (``write_disk``)."""
        disk = self.disk
        d = self.disk_index
        nbytes = meta.nbytes
        if d is None or not disk.holds_inline(nbytes) or not disk.can_commit_soon(entry.key):
            return None
        entry = self._live_entry(entry, meta)
        lock = entry.try_disk_lock()
        if lock is None:
            return None
        commit: _SmallCommit | None = None
        try:
            disk.reserve_inline(nbytes)
            try:
                version = next(self.versions)
                raw = disk.inline_raw(entry.key, meta, src, version)
                commit = _SmallCommit(self, entry, lock, meta, version, d)
                self.writes.add(commit.done)  # (``aclose`` waits for it, as for a write task)
                started = False
                try:
                    started = disk.commit_soon([(entry.key, raw)], commit.finish)
                finally:
                    if not started:
                        self.writes.discard(commit.done)
                        commit = None
            finally:
                if commit is None:
                    disk.release_inline(nbytes)
        finally:
            if commit is None:
                lock.release()
                entry.forget_idle_lock()
        if commit is None:
            self.drop_if_unused(entry)
            return None
        return commit.done

    def stage_new_small(self, key: str, data: bytes, meta: TensorMeta) -> bool:
        """A small put of a key with no entry onto a non-durable disk tier, done at once with
        no await (``put_staged`` of a new key): the record queued for the next transaction and
        the entry made with its inline copy. ``data`` is the value's bytes, ``meta`` shared.
        False (nothing done) when the tier has no room for it."""
        d = self.disk_index
        disk: DiskTier = self._tiers[d]  # type: ignore[index,assignment]  # (the caller staged onto it)
        nbytes = meta.nbytes
        try:
            disk.reserve_inline(nbytes)
        except TierFullError:
            return False  # (the awaited way says why)
        version = next(self.versions)
        try:
            disk.stage_inline(key, meta, data, version)
        except BaseException:
            disk.release_inline(nbytes)
            raise
        self.entries[key] = Entry.inline_on_disk(key, meta, version, d)  # type: ignore[arg-type]  # (a disk tier: d is set)
        self.key_changes += 1  # the key appears
        return True

    def put_staged(self, entry: Entry, src: torch.Tensor, meta: TensorMeta) -> bool:
        """A put of a small value onto a non-durable disk tier, done at once with no await: its
        catalog change is queued for the next transaction (group commit) and the value
        installed, so every read in the process sees it. False (nothing done) when the value is
        not small, the tier is durable, another catalog change of the key is under way, or the
        old value's extent must outlive the commit: the caller then goes the awaited way."""
        disk = self.disk
        d = self.disk_index
        nbytes = meta.nbytes
        if d is None or disk.durable or not disk.holds_inline(nbytes) or self.winding_down:
            return False
        entry = self._live_entry(entry, meta)
        old = entry.copy_on(d)
        if entry.disk_busy or (old is not None and old.extent is not None):
            return False
        disk.reserve_inline(nbytes)
        try:
            version = next(self.versions)
            disk.stage_inline(entry.key, meta, src, version)
        except BaseException:
            disk.release_inline(nbytes)
            raise
        self.install_disk(entry, d, Copy(d, version, inline=nbytes), meta)
        return True

    def install_disk(self, entry: Entry, d: int, new: Copy, meta: TensorMeta | None) -> None:
        """Make ``new`` (committed, or queued for commit) ``entry``'s disk copy; with ``meta``
        it is a new value (other copies retired), else a write-back of the current one."""
        old = entry.copy_on(d)
        if old is not None:
            self.retire(entry, d, old)
        entry.set_copy(new)
        if meta is not None:
            self.new_version(entry, keep=new, meta=meta, version=new.version)

    async def flush_all(self, whole: bool = True) -> None:
        """Write every value whose newest copy is only in memory to the disk tier, in one
        catalog transaction (``whole=False``: several when one does not fit); see
        ``tierstore.flushing``."""
        await flushing.flush_all(self, whole)

    async def delete_entry(self, entry: Entry, expect_version: int | None = None) -> bool:
        """Delete ``entry`` (if it is still the key's entry). With ``expect_version``, only if
        its value is still that version (a pop deletes only the value it read). Returns whether
        it deleted it."""
        if self.disk_index is not None:
            try:
                async with entry.disk_lock:
                    if self.entries.get(entry.key) is not entry:
                        return False
                    if expect_version is not None and entry.version != expect_version:
                        return False  # (a put committed while this waited for the lock)
                    if entry.held():
                        raise EntryHeldError(f"{entry.key!r} is held; release it before deleting")
                    if entry.copy_on(self.disk_index) is not None:
                        await self.disk.commit([(entry.key, None)])
                    self._remove(entry)
                    return True
            finally:
                entry.forget_idle_lock()
        if self.entries.get(entry.key) is entry and (expect_version is None or entry.version == expect_version):
            self._remove(entry)
            return True
        return False

    # -- residency bookkeeping (the only places that change copies) --------------------------------

    def new_version(self, entry: Entry, keep: Copy | None, meta: TensorMeta | None = None, version: int | None = None) -> None:
        """Give ``entry`` a new value held only by ``keep``: other memory copies are retired; the
        disk copy stays as the durable base until a write-back replaces it."""
        if entry.version == 0:
            self.key_changes += 1  # the key appears
        copies = entry.all_copies()  # (an adopted entry's copy is made with the version it has now)
        entry.version = version if version is not None else next(self.versions)
        if meta is not None and meta is not entry.meta:
            entry.meta = shared_meta(meta)
        if keep is not None:
            keep.version = entry.version
        for copy in copies:
            if copy is not keep and copy.tier != self.disk_index:
                self.retire(entry, copy.tier, copy)

    def retire(self, entry: Entry, t: int, copy: Copy) -> None:
        if entry.copy_on(t) is copy:
            entry.drop_copy(t)
        if copy.in_policy:
            policy = self.policies[t]
            if policy.__class__ is CopyLRU:
                policy.remove(copy)  # type: ignore[arg-type]
            elif policy is not None:
                try:
                    policy.on_remove(entry.key)
                except Exception as exc:
                    self._eviction_policy_failed(t, "on_remove", exc)
            copy.in_policy = False
        copy.retired = True
        self._prefetched.discard((entry.key, t))
        if copy.users == 0:
            self._free(copy)

    def _free(self, copy: Copy) -> None:
        tier = self._tiers[copy.tier]
        if copy.in_memory and isinstance(tier, MemoryTier):
            link = getattr(tier, "link", None)
            if copy.last_use is not None and link is not None:
                self._release_after(tier, copy, link.when_done(copy.last_use))
            else:
                self._give_back(tier, copy)
        elif copy.extent is not None and isinstance(tier, DiskTier):
            tier.release(copy.extent)
            copy.extent = None
        elif copy.inline is not None and isinstance(tier, DiskTier):
            tier.release_inline(copy.inline)
            copy.inline = None

    @asynccontextmanager
    async def freeze(self) -> AsyncIterator[None]:
        """Hold every value as it is for the block: puts, fills, deletes, pops and write holds
        started meanwhile wait until it ends; the block starts once those in flight ended."""
        while self.frozen:  # one view at a time
            await self.until_thawed()
        own = [e.key for e in self.entries.values() if e.writer is not None and holds.inside(e.writer_token)]
        if own:  # (it would wait for the caller's own hold to end: for ever)
            raise EntryHeldError(f"cannot take a point-in-time view from inside your own write hold of {own[0]!r}: "
                                 "release the hold first")
        self.frozen, self._thawed = True, asyncio.Event()
        try:
            while any(e.pending_writes or e.writer is not None for e in self.entries.values()):
                await asyncio.sleep(0.005)
            yield
        finally:
            self.frozen = False
            self._thawed.set()

    async def until_thawed(self) -> None:
        """Wait until no point-in-time view is being read."""
        while self.frozen and self._thawed is not None:
            await self._thawed.wait()

    def reading(self, copy: Copy) -> asyncio.Future[None] | None:
        """Note a use of ``copy`` (taken) by a read out of it that needs no room on ``copy``'s
        tier (into the caller's memory, or a load down the tiers): it ends by itself, so a
        request for room on that tier that finds nothing else to evict waits for it instead of
        refusing (a read is no hold; one of a copy held when the request looks frees nothing:
        not waited for). Pass what this returns to ``read_done`` after the ``unuse``."""
        if not copy.in_memory:
            return None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reads = self.reads[copy.tier]
        reads[done] = copy
        done.add_done_callback(reads.pop)
        return done

    @staticmethod
    def read_done(read: asyncio.Future[None] | None) -> None:
        """The read ``reading`` noted has let go of its copy."""
        if read is not None and not read.done():
            read.set_result(None)

    def expect_room(self, t: int, landed: asyncio.Future[Any]) -> None:
        """Room on tier ``t`` comes back when ``landed`` ends (holds let go from another thread,
        ending once the kernels that read them are done): a request that finds nothing to
        evict waits for it instead of refusing. Call it on the loop, before the request."""
        self.releases[t].add(landed)
        landed.add_done_callback(self.releases[t].discard)

    def _release_after(self, tier: MemoryTier, copy: Copy, last_use: Transfer) -> None:
        """Give ``copy``'s buffer back to ``tier`` once the kernels that last used it have run
        (a device buffer is not handed out again while a kernel may still read or write it)."""
        if last_use.done():
            self._give_back(tier, copy)
            return
        loop = asyncio.get_running_loop()
        t, size, landed = copy.tier, copy.nbytes, loop.create_future()
        self.releasing[t] += size
        self.expect_room(t, landed)

        def give_back() -> None:  # on the loop
            self.releasing[t] -= size
            try:
                self._give_back(tier, copy)
            finally:
                if not landed.done():
                    landed.set_result(None)

        def release(_: Transfer) -> None:  # on the thread that saw the kernels end
            if not loop.is_closed():
                loop.call_soon_threadsafe(give_back)

        last_use.add_done_callback(release)

    def use(self, entry: Entry, copy: Copy) -> None:
        """Take a use of ``copy`` (a hold or a transfer): it cannot be evicted or freed until
        ``_unuse``. It stays known to its tier's policy, which keeps its place; the engine
        excludes it from victim choice."""
        copy.users += 1

    def unuse(self, entry: Entry, copy: Copy) -> None:
        copy.users -= 1
        if copy.users == 0 and copy.retired:
            self._free(copy)
        elif copy.in_policy and copy.users <= (id(copy) in self.early_writes):  # (free to go again: as ``evictable`` asks)
            if (release := self._releases[copy.tier]) is not None:
                try:
                    release(entry.key)
                except Exception as exc:  # (advice only: nothing was left half done)
                    self.warn_once((copy.tier, "on_release"), f"the eviction policy {policy_name(self.policies[copy.tier])} of tier "
                                   f"{self.names[copy.tier]!r} raised {exc!r} in on_release; ignored (warned once per tier)")
            # A victim now: a request for room that found none waits for room to change, and
            # the room it waits on may come only after it is served (a scratch buffer of the
            # same update, held until the update ends): it looks for a victim again.
            self._room_may_have_changed(copy.tier)
        entry.wake()

    def _copy_finder(self, t: int) -> Callable[[str], Copy | None]:
        """Tier ``t``'s copy of a key (for a ``CopyLRU`` asked by key)."""
        entries = self.entries

        def find(key: str) -> Copy | None:
            entry = entries.get(key)
            return entry.copy_on(t) if entry is not None else None

        return find

    def policy_before_insert(self, t: int, key: str, nbytes: int) -> None:
        """Tell tier ``t``'s policy, if it asks (``before_insert``), that ``key`` is about to be
        inserted, before victims are chosen to make room for it."""
        policy = self.policies[t]
        if policy is None or policy.__class__ is CopyLRU:
            return
        before = getattr(policy, "before_insert", None)
        if before is not None:
            try:
                before(key, nbytes)
            except Exception as exc:  # (advice: the insert goes on)
                self._eviction_policy_failed(t, "before_insert", exc)

    def policy_insert(self, entry: Entry, copy: Copy) -> None:
        policy = self.policies[copy.tier]
        if policy is not None and copy.in_memory and not copy.in_policy:
            if policy.__class__ is CopyLRU:
                policy.insert(copy, entry.key)  # type: ignore[arg-type]
            else:
                try:
                    policy.on_insert(entry.key, copy.nbytes)
                except Exception as exc:  # (the copy stays unknown to it: see _untracked_victim)
                    self._eviction_policy_failed(copy.tier, "on_insert", exc)
                    return
            copy.in_policy = True

    def overwritten(self, entry: Entry, copy: Copy, meta: TensorMeta, seconds: float) -> None:
        """A put's new value was copied over ``copy``, the buffer of the value it replaced
        (``tierstore.overwrite``), in ``seconds``: it becomes ``entry``'s value. To the tier's
        policy, a hit (as the simulator counts a put of a value of the same size on the tier);
        a prefetch of the old value was not used. Recorded in the trace as a put row with
        ``hit`` 1 (``replay_store_trace`` replays it so)."""
        self.count_link(None, copy.tier, meta.nbytes, seconds)
        self.new_version(entry, keep=copy, meta=meta)
        self._prefetched.discard((entry.key, copy.tier))
        self.hit(entry, copy)
        self.observe("put", entry.key, meta.nbytes, copy.tier, hit=True)

    def hit(self, entry: Entry, copy: Copy) -> None:
        """Tell ``copy``'s tier policy that it was read (every hit, any size, any path)."""
        if copy.in_policy:
            policy = self.policies[copy.tier]
            if policy.__class__ is CopyLRU:
                policy.touch(copy)  # type: ignore[arg-type]
            elif policy is not None:
                try:
                    policy.on_hit(entry.key)
                except Exception as exc:
                    self._eviction_policy_failed(copy.tier, "on_hit", exc)

    def _eviction_policy_failed(self, t: int, hook: str, exc: Exception) -> None:
        """A tier policy's hook raised in the middle of the store's own bookkeeping, where raising
        would leave a request half done (a put stored but reported failed, a use never released):
        the store goes on, and says so once per tier. A value the policy was not told of is
        evicted once the policy has no victim left (``eviction._untracked_victim``)."""
        self.policy_failures[t] = f"{hook} raised {exc!r}"
        self.warn_once(t, f"the eviction policy {policy_name(self.policies[t])} of tier {self.names[t]!r} raised {exc!r} in "
                           f"{hook}; the request went on (values it was not told of are evicted once it has no victim left; "
                           "warned once per tier)")

    def warned(self, about: object) -> bool:
        """Whether ``warn_once`` warned about ``about`` already."""
        return about in self._warned

    def warn_once(self, about: object, message: str) -> None:
        """A ``RuntimeWarning`` of ``message``, the first time only for ``about``, sent from the
        loop after the request (a warning turned into an error, ``-W error``, must not fail a
        request that took effect)."""
        if self.warned(about):
            return
        self._warned.add(about)
        try:
            # (``warn`` names the line of the call this request serves: the callback runs in
            # this task's context, marked by the sync facade)
            asyncio.get_running_loop().call_soon(warn, message, RuntimeWarning)
        except RuntimeError:  # (no loop running here)
            warn(message, RuntimeWarning)

    async def wait_until(self, entry: Entry, ready: Callable[[], bool]) -> None:
        """Return once ``ready()`` holds; re-checked whenever a use or hold of ``entry`` ends
        (those waiting are woken in the order they began to wait)."""
        ticket = next(self._wait_tickets)
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            entry.add_waiter(waiter, ticket)
            try:
                await waiter
            finally:
                entry.forget_woken(waiter)

    async def no_writers(self, among: Callable[[], Iterable[Entry]], action: str) -> None:
        """Return once no write hold is open on the entries ``among()`` returns (asked again
        after each wait: the set may change meanwhile); see ``no_writer``."""
        while writing := [entry for entry in among() if entry.writer is not None]:
            for entry in writing:
                await self.no_writer(entry, action)

    async def no_writer(self, entry: Entry, action: str) -> None:
        """Return once no write hold is open on ``entry``; from inside that hold, raise (the
        holder would otherwise wait for itself)."""
        while entry.writer is not None:
            if holds.inside(entry.writer_token):
                raise EntryHeldError(
                    f"cannot {action} {entry.key!r} from inside its own write hold: use the held tensor, "
                    "or release the hold first"
                )
            await self.wait_until(entry, lambda: entry.writer is None)

    def _remove(self, entry: Entry) -> None:
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        for copy in entry.all_copies():
            self.retire(entry, copy.tier, copy)
        if entry.version != 0:
            self.key_changes += 1  # the key disappears
        entry.version = 0

    def drop_if_unused(self, entry: Entry) -> None:
        """Forget ``entry`` if it is the key's entry but holds no value yet and no put of it
        is in flight (made for a put that gave up or failed, after a delete)."""
        if not entry.visible and entry.pending_writes == 0 and not entry.disk_busy and self.entries.get(entry.key) is entry:
            del self.entries[entry.key]

    def _live_entry(self, entry: Entry, meta: TensorMeta) -> Entry:
        """The entry a put should write to: ``entry`` unless it was deleted meanwhile."""
        live = self.entries.get(entry.key)
        if live is None:
            live = self.entries[entry.key] = Entry(entry.key, meta)
        return live

    # -- what the prefetch issuer uses (tierstore.prefetching.PrefetchTarget) ----------------------

    def lookup(self, key: str) -> Entry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.visible else None

    def tier_index(self, tier: str | int) -> int:
        return self.index_of(tier)

    def can_hold_copies(self, t: int) -> bool:
        return isinstance(self._tiers[t], MemoryTier)

    def would_push_out_sooner(self, entry: Entry, t: int) -> bool:
        """With a future-seeing eviction policy (MIN), a prefetch that needs room must not evict
        a key needed before the one it fetches."""
        next_use = getattr(self.prefetch_policy, "next_use", None)
        furthest = getattr(self.policies[t], "furthest_next_use", None)
        if next_use is None or furthest is None or self._tiers[t].free >= entry.meta.nbytes:
            return False
        return bool(furthest() < next_use(entry.key))

    async def promote(self, entry: Entry, t: int, priority: Priority) -> None:
        await self._ensure(entry, t, priority, using=False)

    def prefetched(self, entry: Entry, t: int) -> None:
        self._prefetched.add((entry.key, t))
        if self.trace is not None:
            self.trace.record("prefetch", entry.key, entry.meta.nbytes, t, None)

    def own(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def disk(self) -> DiskTier:
        tier = self._tiers[self.disk_index] if self.disk_index is not None else None
        if not isinstance(tier, DiskTier):
            raise UnknownTierError("this store has no disk tier")
        return tier

    def index_of(self, ref: TierRef) -> int:
        if ref is None:
            return 0
        if type(ref) is str and ref in self._by_name:  # (the common case, asked on every access: no ABC check)
            return self._by_name[ref]
        if isinstance(ref, Tier):
            for i, tier in enumerate(self._tiers):
                if tier is ref:
                    return i
            raise UnknownTierError(f"{ref!r} is not a tier of this store")
        if isinstance(ref, bool):
            raise UnknownTierError(f"tier must be a name, an index or a Tier, not {ref!r}")
        if isinstance(ref, int):
            if 0 <= ref < len(self._tiers):
                return ref
            raise UnknownTierError(f"tier index {ref} is out of range (the store has {len(self._tiers)} tiers)")
        if isinstance(ref, str):
            try:
                return self.names.index(ref)
            except ValueError:
                raise UnknownTierError(f"no tier named {ref!r}; the tiers are {self.names}") from None
        raise UnknownTierError(f"tier must be a name, an index or a Tier, not {type(ref).__name__}")

    def visible_entry(self, key: object) -> Entry:
        key = check_key(key)
        entry = self.entries.get(key)
        if entry is None or not entry.visible:
            self._closed_meanwhile()
            raise KeyNotFoundError(f"no key {key!r} in the store")
        return entry

    def _deleted(self, entry: Entry) -> KeyNotFoundError:
        """The error for a request whose key went while it waited: ``StoreClosedError`` is
        raised instead if the store closed meanwhile (a close forgets every entry: no one
        deleted it)."""
        self._closed_meanwhile()
        return KeyNotFoundError(f"{entry.key!r} was deleted")

    def _closed_meanwhile(self) -> None:
        """``require_open``'s refusal of a closed store alone (not its check for a fork: a request
        in a forked child was refused as it began)."""
        if not self.is_open:
            self.require_open()

    def require_open(self) -> None:
        if not self.is_open:
            if self.closed:
                raise StoreClosedError("the store is closed: open it again ('await store.open()', or SyncTierStore's .open()) to use it")
            raise StoreClosedError("the store is not open: use 'async with TierStore(...)' or 'await store.open()' (the blocking SyncTierStore: 'with SyncTierStore(...)' or its .open())")
        if self._pid != this_process.pid:
            raise StoreForkedError(
                f"this store was opened by process {self._pid}; a forked child (pid {os.getpid()}) cannot use it: "
                "open a store of its own in the child"
            )
        if self.sealed:
            raise StoreClosedError("the store is closing")

    def require_open_here(self) -> None:
        """``require_open`` for a verb awaited on the running loop: ``WrongLoopError`` if that is
        not the store's loop while that one is not closed (the store's futures would be
        woken from the other loop without a thread-safe call: a hang). Sync verbs do not check:
        a thread that runs a loop of its own (a notebook's) may call them."""
        self.require_open()
        self.require_loop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the store runs on (see ``require_loop``)."""
        return self._loop

    def require_loop(self) -> None:
        """``WrongLoopError`` where ``require_open_here`` raises it. Awaited on another loop once
        the store's was closed (a second ``asyncio.run``), the store runs on that one from then
        on; one only paused (``run_until_complete`` between calls) still owns the store's work."""
        running = asyncio._get_running_loop()
        if running is None or running is self._loop:
            return
        from .sync import is_loop_thread_loop

        if is_loop_thread_loop(running):
            # (the library's own bridge: ``sync.run`` from code given an async store, such as
            # ``offload_parameters`` called from the store's loop thread while it waits)
            return
        if self._loop is None or self._loop.is_closed():
            self._loop = running
            return
        raise WrongLoopError(
            "this TierStore was opened on another event loop, which is not closed: await its verbs on that loop "
            "(asyncio.run_coroutine_threadsafe(coro, store.loop) from another thread), or use SyncTierStore, "
            "which any thread may call"
        )

    def _crossing(self, source: int | None, target: int | None) -> tuple[Link, str] | None:
        """The link a copy from tier ``source`` to tier ``target`` crosses (None: the caller's
        memory), with its direction; None when it crosses none (host to host)."""
        for t, direction in ((target, TO_DEVICE), (source, TO_HOST)):
            link = getattr(self._tiers[t], "link", None) if t is not None else None
            if link is not None and not (source is not None and target is not None and source == target):
                return link, direction
        return None

    async def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, priority: Priority, crossing: tuple[Link, str] | None = None, *, after: Any = None
    ) -> None:
        """Copy bytes: over ``crossing``'s link if given, over a CUDA device's link if either side
        is on one, else on the CPU. A copy over a link starts ``after`` that marker, else after
        the caller's queued work (``tierstore.device.caller``)."""
        if crossing is None and (dst.is_cuda or src.is_cuda):
            link = link_for(dst.device if dst.is_cuda else src.device)
            crossing = (link, TO_DEVICE if dst.is_cuda else TO_HOST)
        if crossing is None:
            await copy_bytes(dst, src, pool=self.cpu, priority=priority)
            return
        link, direction = crossing
        if after is None:
            after = caller_work(link)
        await (link.to_device(dst, src, after=after) if direction == TO_DEVICE else link.to_host(dst, src, after=after))

    def _track(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Start ``coro`` as a write that ``aclose`` waits for."""
        task = asyncio.ensure_future(coro)
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)
        return task

    async def shielded(self, coro: Awaitable[T], abandon: asyncio.Event | None = None, settle: bool = False) -> T:
        """Run ``coro`` to completion even if the caller is cancelled (it changes durable state);
        ``aclose`` waits for it. Returns what ``coro`` returns.

        With ``abandon`` (a put reading the caller's memory), a cancelled caller sets it and gets
        control back only once ``coro`` has ended: by then the write either gave up before its
        commit (nothing changed) or committed (the put took effect), and the caller's memory is
        no longer read. With ``settle`` (a delete), a cancelled caller waits for ``coro`` too,
        so what it sees next is the outcome, not a key that vanishes later. Otherwise the
        caller gets control back at once."""
        task = self._track(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            if abandon is not None:
                abandon.set()
            if abandon is not None or settle:
                await wait_uncancelled(task)
            raise

    def count_access(self, t: int, hit: bool, entry: Entry) -> None:
        counters = self.counters.tier(self.names[t])
        if hit:
            counters.hits += 1
            if (entry.key, t) in self._prefetched:
                self._prefetched.discard((entry.key, t))
                self.counters.prefetch.useful += 1
        else:
            counters.misses += 1

    def _moved_from(self, entry: Entry, source: int | None, nbytes: int) -> int:
        """Bytes a copy of ``nbytes`` from tier ``source`` moved: a disk extent is read in whole
        blocks (what the kernel's block-I/O counters see)."""
        if source is None or source != self.disk_index:
            return nbytes
        copy = entry.copy_on(source)
        extent = copy.extent if copy is not None else None
        return extent.length if extent is not None else nbytes

    def count_link(self, source: int | None, target: int, nbytes: int, seconds: float) -> None:
        name = self.names[source] if source is not None else "caller"
        self.counters.link(name, self.names[target]).add(nbytes, seconds)
        if self.on_transfer is not None:
            end = time.perf_counter()
            self.on_transfer(f"{name}->{self.names[target]}", nbytes, end - seconds, end)

    def observe(self, op: str, key: str, nbytes: int, t: int | None, hit: bool | None, before: int | None = None) -> None:
        key = plain_text(key)  # (a str subclass the caller used: its text, as check_key keeps it)
        if self.trace is not None:
            if before is None and op in ("get", "hold", "pop"):
                entry = self.entries.get(key)
                valid = entry.valid_tiers() if entry is not None else []
                before = valid[0] if valid else None
            self.trace.record(op, key, nbytes, t, hit, before)
        if op in ("get", "hold", "put", "pop") and t is not None and self.issuer is not None and not self._no_prefetch and not self.unobserved:
            try:
                self.prefetch_policy.on_access(key, nbytes, self.names[t], bool(hit) and op != "put")  # (a put never is one)
                suggestions = read_suggestions(self.prefetch_policy)
            except Exception as exc:  # (advice only: a policy that fails costs prefetches, not the request)
                self.prefetch_failed(exc)
                return
            self.issuer.follow(suggestions, t)

    def prefetch_failed(
        self, exc: Exception, methods: str = "on_access, suggest or on_step", lost: str = "its suggestions are skipped"
    ) -> None:
        """The prefetch policy raised in one of ``methods`` (it is advice: warned once per store
        and ``methods``, requests go on); ``lost``: what is dropped."""
        self.warn_once(("prefetch", methods), f"the prefetch policy {policy_name(self.prefetch_policy)} raised {exc!r} in {methods}: "
                                              f"{lost}, requests go on (warned once per store)")


async def _close_each(tiers: Sequence[Tier]) -> None:
    """Close every tier, slowest first, even where one fails or the close is cancelled: one left
    open would refuse every later store over it (``Engine._open``). Raises the first failure."""
    failure: BaseException | None = None
    for tier in reversed(tiers):
        try:
            await tier.aclose()
        except BaseException as exc:  # noqa: BLE001 - raised below, once every tier is closed
            failure = failure or exc
    if failure is not None:
        raise failure


def _check_tiers(tiers: Sequence[Tier]) -> list[Tier]:
    tiers = list(tiers)
    if not tiers:
        raise ValueError("a TierStore needs at least one tier")
    for tier in tiers:
        if not isinstance(tier, Tier):
            raise TypeError(f"tiers must be DeviceTier, HostTier or DiskTier objects, not {type(tier).__name__}")
    names = [tier.name for tier in tiers]
    if len(set(names)) != len(names):
        raise ValueError(f"tier names must be unique: {names}")
    for tier in tiers[:-1]:
        if isinstance(tier, DiskTier):
            raise ValueError("a DiskTier must be the last (slowest) tier")
    if len({id(t) for t in tiers}) != len(tiers):
        raise ValueError("the same tier object appears twice")
    return tiers


def _refuse_changed_out(out: torch.Tensor, meta: TensorMeta) -> None:
    """A read into ``out`` (checked against the value when it was asked for) of a value that a
    put copied over while the read waited for it, with another dtype or shape (the same room):
    refused, as a read asked for after the put would have been, not written past ``out``."""
    if out.dtype != meta.dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensorError(f"out is {out.dtype} {tuple(out.shape)}; the value is {meta.dtype} {meta.shape} now "
                                 "(a put replaced it while this read waited)")


def _make_prefetch(spec: Any) -> PrefetchPolicy:
    """The store's prefetch policy from ``prefetch=``: an instance, a class (or factory) called
    with no arguments, or a name of ``policies.PREFETCH`` (``"schedule"``), as ``eviction=``
    takes them. Anything else is refused here: accepted, it failed at the first access, and
    prefetching was off with only a warning."""
    from policies import PREFETCH

    if isinstance(spec, str):
        if spec not in PREFETCH:
            raise ValueError(f"unknown prefetch policy {spec!r}; choose from {sorted(PREFETCH)}, or give a policy instance or class")
        spec = PREFETCH[spec]
    def is_policy(obj: Any) -> bool:
        return not isinstance(obj, type) and not missing_methods(obj, PREFETCH_CALLED)

    made = isinstance(spec, type) or callable(spec) and not any(hasattr(spec, name) for name in (*PREFETCH_CALLED, "on_step"))
    policy = spec() if made else spec  # (an instance that has some of the methods is not called)
    if not is_policy(policy):
        raise TypeError(f"prefetch={spec!r:.80} is not a prefetch policy: give an instance, a class or a name of "
                        f"policies.PREFETCH ({sorted(PREFETCH)}); a policy has the methods on_access, suggest and on_step")
    return policy


def _make_policies(tiers: list[Tier], eviction: Any, finder: Callable[[int], Callable[[str], Any]]) -> list[EvictionPolicy | None]:
    """One eviction policy per tier that can evict (all but the last). The class ``policies.LRU``
    (the default) becomes a ``CopyLRU`` on a memory tier: the same order, no state per key."""
    from policies import LRU

    evicting = [tier.name for tier in tiers[:-1]]
    capacities = {tier.name: tier.capacity for tier in tiers}
    index = {tier.name: t for t, tier in enumerate(tiers)}

    def named(spec: str, name: str) -> Any:
        from policies import EVICTION  # (a name, as the simulator takes: policies.EVICTION's)

        if spec not in EVICTION:
            raise ValueError(f"unknown eviction policy {spec!r} for tier {name!r}; choose from {sorted(EVICTION)}, "
                             "or give a policy class")
        return EVICTION[spec]

    def build(spec: Any, name: str) -> EvictionPolicy:
        if isinstance(spec, str):
            spec = named(spec, name)
        if spec is LRU and isinstance(tiers[index[name]], MemoryTier):
            return CopyLRU(finder(index[name]))
        if isinstance(spec, type) or (callable(spec) and not isinstance(spec, EvictionPolicy)):
            policy = spec()
        else:
            policy = spec
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"eviction policy for tier {name!r} does not implement EvictionPolicy: {policy!r}")
        if hasattr(policy, "set_capacity"):
            policy.set_capacity(capacities[name])
        return policy

    if isinstance(eviction, Mapping):
        unknown = set(eviction) - {tier.name for tier in tiers}
        if unknown:
            raise UnknownTierError(f"eviction policies given for unknown tiers {sorted(unknown)}")
        if isinstance(spec := eviction.get(tiers[-1].name), str):  # (the last tier evicts nothing: a typo still shows)
            named(spec, tiers[-1].name)
        return [build(eviction.get(tier.name, LRU), tier.name) for tier in tiers[:-1]] + [None]
    if isinstance(eviction, str) and not evicting:
        named(eviction, tiers[-1].name)
    if isinstance(eviction, EvictionPolicy) and not isinstance(eviction, type) and len(evicting) > 1:
        raise TypeError("one policy instance cannot serve several tiers: pass its class (or a factory, or a dict by tier name)")
    return [build(eviction, tier.name) for tier in tiers[:-1]] + [None]


class _Uncancellable(asyncio.Future[int]):
    """A future that refuses ``cancel``: a task cancelled while awaiting it is told so (its
    ``CancelledError``) only once the future is done, as a ``shield`` and a second wait would
    do, with no second future and no callbacks."""

    __slots__ = ()

    def cancel(self, msg: Any = None) -> bool:
        return False


class _SmallCommit:
    """A durable small put under way (``Engine.commit_small_now``): ``finish`` runs on the loop
    once the catalog's writer thread has committed it (the one callback it schedules), installs
    the value, lets the key's disk lock go and settles ``done``, the one future the caller
    awaits."""

    __slots__ = ("engine", "entry", "lock", "meta", "version", "d", "started", "done")

    def __init__(self, engine: Engine, entry: Entry, lock: asyncio.Lock, meta: TensorMeta, version: int, d: int) -> None:
        self.engine = engine
        self.entry = entry
        self.lock = lock
        self.meta = meta
        self.version = version
        self.d = d
        self.started = time.perf_counter()
        self.done: asyncio.Future[int] = _Uncancellable(loop=asyncio.get_running_loop())

    def finish(self, error: BaseException | None) -> None:
        engine = self.engine
        entry = self.entry
        nbytes = self.meta.nbytes
        try:
            if error is not None:
                engine.disk.release_inline(nbytes)
            else:
                engine.install_disk(entry, self.d, Copy(self.d, self.version, inline=nbytes), self.meta)
                engine.count_link(None, self.d, nbytes, time.perf_counter() - self.started)
        except BaseException as failed:  # (committed, but not installed: the caller must hear it)
            error = error or failed
        finally:
            self.lock.release()
            entry.forget_idle_lock()
            engine.drop_if_unused(entry)  # (one made for this put, whose commit failed)
            engine.writes.discard(self.done)
            if error is None:
                self.done.set_result(self.version)
            else:
                self.done.set_exception(error)
