"""``TierStore``: the asynchronous tiered key-value store of tensors (its public verbs; the
machinery that moves bytes between tiers is ``tierstore.engine``)."""

from __future__ import annotations

import asyncio
import ctypes
import operator
import traceback
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
)
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import eviction, holds
from .copies import INLINE_COPY_BYTES
from .device.caller import caller_work
from .engine import Engine, TierRef
from .entry import Copy, Entry, meta_of
from .errors import (
    EntryHeldError,
    InvalidTensorError,
    StoreClosedError,
    TierFullError,
    TierStoreError,
    UnknownTierError,
)
from .flags import require_flag
from .keys import check_key, is_reserved, plain_text
from .namespaces import Namespace, NamespaceInfo, NamespaceRegistry
from .prefetching import PrefetchHandle
from .protocols import PrefetchPolicy
from .stats import StoreCounters
from .tensors import (
    PLAIN_TENSOR_TYPES,
    TensorMeta,
    as_bytes,
    check_tensor,
    dtype_name,
    from_bytes,
    supported_dtypes,
)
from .tiers.base import MemoryTier, Tier
from .tiers.disk import InlineSuperseded
from .units import format_bytes
from .workers import Priority

__all__ = ["TierRef", "TierStore"]


#: Small puts acknowledged before their commit (non-durable disk tier) queue at most this many
#: catalog changes (a newer put of a key not yet committing replaces its queued change); a put
#: beyond it waits for the queue to commit.
STAGED_LIMIT = 4096
_CPU = torch.device("cpu")


class _FillAbandoned(Exception):
    """The block filling a value raised: its buffer is freed, the old value stays."""


class TierStore:
    """A key-value store of tensors over tiers ordered fastest first.

    Parameters
    ----------
    tiers:
        e.g. ``[DeviceTier("cuda:0", "8GiB"), HostTier("32GiB"), DiskTier("/nvme/ts", "1TiB")]``.
        Names must be unique; a ``DiskTier``, if any, comes last.
    eviction:
        The eviction policy of each tier that can evict (every tier but the last): a class or
        factory called once per tier (default ``policies.LRU``), a name of ``policies.EVICTION``
        (``"arc"``), or a mapping from tier name to a class, factory, name or instance.
    prefetch:
        A prefetch policy (default ``policies.NoPrefetch()``): an instance, a class (made with
        no arguments) or a name of ``policies.PREFETCH`` (``"schedule"``); it watches demand
        accesses and its suggestions are fetched in the background. Pass an instance to share
        it, as ``MIN(schedule)`` does.
    trace:
        A file to record every access to (see ``tierstore.tracing``), or None.
    cpu_threads:
        Threads for large CPU memory copies.
    flush_on_close:
        Write every entry whose newest value is only in memory to the disk tier on close.
    durable:
        The default of ``put(..., durable=)``. False (default): *write-back* -- a put into a
        memory tier is acknowledged once the store owns a copy; it reaches the disk tier on
        eviction, ``flush()``, ``close`` or interpreter exit (``SyncTierStore``), and a crash
        (kill -9, power loss) before then loses it. True: *write-through* -- a put returns only
        once its value is also on the disk tier (on stable storage if the ``DiskTier`` is
        durable), so it survives a crash. Needs a disk tier.

    Use it as ``async with TierStore([...]) as store:``; constructing it does no I/O.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        eviction: Any = None,
        prefetch: PrefetchPolicy | Callable[[], PrefetchPolicy] | str | None = None,
        trace: str | Path | None = None,
        cpu_threads: int = 1,
        flush_on_close: bool = True,
        durable: bool = False,
    ) -> None:
        durable = _durability(durable, none=False)
        self._engine = Engine(tiers, eviction, prefetch, cpu_threads)
        self._trace_path = Path(trace) if trace is not None else None
        if self._trace_path is not None and self._trace_path.is_dir():  # (else found at close, the trace lost)
            raise IsADirectoryError(f"trace={str(trace)!r} is a folder; give the path of the file to write, e.g. "
                                    f"{str(self._trace_path / 'trace.npz')!r}")
        self.flush_on_close = require_flag("flush_on_close", flush_on_close)
        self.durable = durable
        if durable and self._engine.disk_index is None:
            raise ValueError("durable=True needs a DiskTier to write through to")
        #: Small puts acknowledged before their commit, in the store's life (``_after_staged``).
        self._staged_puts = 0
        self._namespaces = NamespaceRegistry(self)
        self._close_hooks: OrderedDict[int, Callable[[], Awaitable[None]]] = OrderedDict()  # (torch's handles need a weakref-able dict)
        #: The copies read holds have handed out now, by ``id``, with their keys: a ``get`` must
        #: not write into one (``_refuse_held_out``).
        self._read_held: dict[int, tuple[str, Copy]] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> TierStore:
        """Open every tier (the disk tier loads its catalog) and adopt what is on disk."""
        if not self._engine.is_open:
            await self._engine.open(self._trace_path)
        else:
            self._engine.require_loop()
        return self

    async def aclose(self, flush: bool | None = None) -> None:
        """Run the close hooks (``register_close_hook``), finish in-flight work (prefetches
        are cancelled, writes drained), write memory-only entries to disk (if ``flush``,
        default ``flush_on_close``), and close the tiers."""
        require_flag("flush", flush, none="flush_on_close")
        if self._engine.is_open:
            self._engine.require_loop()
        await self._run_close_hooks()
        await self._engine.close(self.flush_on_close if flush is None else flush)

    def register_close_hook(self, hook: Callable[[], Awaitable[None]]) -> RemovableHandle:
        """Have ``await hook()`` run on the store's loop when a close starts, while the store
        still serves every request: for whoever keeps values in the store on someone else's
        behalf and must give them back first (``offload_parameters`` puts its weights back
        into their module, so closing the store does not take a model's weights with it).
        Hooks run in the order registered, at each close of an open store; one that raises
        fails the close (the store stays open; the hook runs again at the next close, so a hook
        that gives values back should leave what it gave back as it is), except at interpreter exit,
        where the error is printed and the close goes on. Returns a handle whose
        ``remove()`` unregisters the hook."""
        if not callable(hook):
            raise TypeError(f"register_close_hook takes an async function, not {type(hook).__name__}")
        handle = RemovableHandle(self._close_hooks)
        self._close_hooks[handle.id] = hook
        return handle

    async def _run_close_hooks(self, at_exit: bool = False) -> None:
        engine = self._engine
        if not engine.is_open or engine.closing or engine.sealed:
            return
        for hook in list(self._close_hooks.values()):
            try:
                await hook()
            except Exception:
                if not at_exit:
                    raise
                traceback.print_exc()

    async def _aclose_at_exit(self) -> None:
        """``aclose`` at interpreter exit, from a thread still inside write holds of its own (a
        hold entered and never left: ``SyncTierStore.hold(...).__enter__()``): those holds end
        first, as their blocks would have (the changes made in them are the values), instead
        of the close refusing to wait for its own holder and every value only in memory being
        lost with the process."""
        for entry in list(self._engine.entries.values()):
            copy, token = entry.writer, entry.writer_token
            if copy is not None and holds.inside(token):
                self._close_hold(entry, copy, copy.tier, True, token, mark=False)
                holds.leave(token)
        await self._run_close_hooks(at_exit=True)
        await self._engine.close(self.flush_on_close)

    async def __aenter__(self) -> TierStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.is_open:
            warnings.warn(
                f"{self!r} was garbage-collected while open: entries only in memory were not written to "
                "its disk tier; close it (async with, or await store.aclose())",
                ResourceWarning,
                stacklevel=2,
            )

    # -- introspection -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the store was opened and has been closed since (``is_open`` is False before
        the first ``open`` too)."""
        return not self._engine.is_open and self._engine.closed

    @property
    def is_open(self) -> bool:
        """Whether the store is open (and not closing)."""
        return self._engine.is_open and not self._engine.closing

    async def _require_open(self) -> None:
        """``Engine.require_open`` for a verb that may wait: while a close is sealed it waits
        for the close's outcome first (closed: ``StoreClosedError``; failed: it goes on)."""
        engine = self._engine
        if engine.sealed:
            engine.require_loop()  # (another loop's: its close is not ours to wait for)
            await engine.settled()
        engine.require_open_here()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the store runs on (every verb must run on it: the one it was opened
        on, or, once that one was closed, the next one a verb was awaited on), or None."""
        return self._engine.loop if self.is_open else None

    @property
    def tiers(self) -> list[Tier]:
        """The tiers, fastest first."""
        return list(self._engine.tiers)

    def _expect_room(self, tier: TierRef, landed: asyncio.Future[Any]) -> None:
        """Room on ``tier`` comes back when ``landed`` ends (``Engine.expect_room``; for
        ``tierstore.swap``, whose holds end on the loop after the kernels that read them)."""
        self._engine.expect_room(self._engine.index_of(tier), landed)

    def tier(self, ref: TierRef) -> Tier:
        """A tier by name, index or object."""
        return self._engine.tier(ref)

    @property
    def counters(self) -> StoreCounters:
        """The live counters behind ``stats()`` (hits, misses, links, prefetches)."""
        return self._engine.counters

    @property
    def prefetch_policy(self) -> PrefetchPolicy:
        """The prefetch policy the store consults."""
        return self._engine.prefetch_policy

    @property
    def on_transfer(self) -> Callable[[str, int, float, float], None] | None:
        """Called as ``on_transfer(link, nbytes, start, end)`` after each transfer between tiers
        (``time.perf_counter()`` times); the optimizer's timeline listens here."""
        return self._engine.on_transfer

    @on_transfer.setter
    def on_transfer(self, listener: Callable[[str, int, float, float], None] | None) -> None:
        self._engine.on_transfer = listener

    @property
    def changes(self) -> int:
        """A counter that grows whenever a key appears or disappears (not when a value changes):
        a cache of the key set, such as the zarr adapter's listing index, is current while it
        has not moved."""
        return self._engine.key_changes

    def __contains__(self, key: object) -> bool:
        return self._user_entry(key) is not None

    def _user_entry(self, key: object) -> Entry | None:
        """The entry of a user's ``key`` (None: not in the store, or not a key a user can have)."""
        self._engine.require_open()
        if not isinstance(key, str) or is_reserved(key):
            return None
        return self._engine.lookup(plain_text(key))

    def __len__(self) -> int:
        self._engine.require_open()
        return sum(1 for key, entry in self._engine.entries.items() if entry.visible and not is_reserved(key))

    def keys(self) -> list[str]:
        """Every key in the store."""
        self._engine.require_open()
        return [key for key, entry in self._engine.entries.items() if entry.visible and not is_reserved(key)]

    def info(self, key: str) -> dict[str, Any]:
        """dtype, shape, nbytes of ``key`` and the tiers holding its current value."""
        self._engine.require_open()
        entry = self._engine.visible_entry(key)
        return {
            "key": entry.key,
            "dtype": entry.meta.dtype,
            "shape": entry.meta.shape,
            "nbytes": entry.meta.nbytes,
            "tiers": [self._engine.names[t] for t in entry.valid_tiers()],
            "held": entry.held(),
        }

    def where(self, key: str) -> list[str]:
        """Names of the tiers holding the current value of ``key``, fastest first."""
        self._engine.require_open()
        return [self._engine.names[t] for t in self._engine.visible_entry(key).valid_tiers()]

    def _on_tier(self, key: str, tier: TierRef, idle: bool = False) -> bool:
        """For the package's own callers: whether ``key`` is in the store with its current
        value on ``tier`` (``tier`` in ``where(key)``, without building the list); ``idle``:
        and no one uses that copy (a hold, a read, a write-back), so a write hold takes it at
        once."""
        entry = self._user_entry(key)
        copy = entry.valid(self._engine.index_of(tier)) if entry is not None else None
        return copy is not None and (not idle or copy.users == 0 and entry.writer is None)  # type: ignore[union-attr]

    def _ranked_victims(self, tier: TierRef, count: int) -> list[str] | None:
        """For the package's own callers: the ``count`` keys ``tier``'s eviction policy would
        evict first, in that order (its optional ``ranked``); None where it cannot tell (no
        ``ranked``, or it raised: the caller guesses as it did before)."""
        policy = self._engine.policies[self._engine.index_of(tier)]
        ranked = getattr(policy, "ranked", None)
        if ranked is None:
            return None
        try:
            return [key for key in ranked(count) if isinstance(key, str)]
        except Exception:  # noqa: BLE001 - a hint only: the eviction itself reports a policy that fails
            return None

    def _copy_on_tier(self, key: str, tier: TierRef) -> object | None:
        """For the package's own callers: what stands for ``key``'s current copy on ``tier``
        (the same object while that copy stays; another once it was dropped and read back), or
        None where the tier has no current copy."""
        entry = self._user_entry(key)
        return entry.valid(self._engine.index_of(tier)) if entry is not None else None

    def _bytes_on_tier(self, key: str, tier: TierRef) -> int:
        """For the package's own callers: bytes ``key``'s copy on ``tier`` takes of its room,
        whether it holds the current value or an older one not yet written over (0: none)."""
        self._engine.require_open()
        entry = self._engine.entries.get(key) if isinstance(key, str) else None
        copy = entry.copy_on(self._engine.index_of(tier)) if entry is not None else None
        return 0 if copy is None else copy.nbytes

    def _shape_and_dtype(self, key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """For the package's own callers: shape and dtype of ``key`` (None: not in the store),
        what ``info`` tells of them without building its dict."""
        entry = self._user_entry(key)
        return None if entry is None else (tuple(entry.meta.shape), entry.meta.dtype)

    def _holdable(self, key: str, tier: TierRef = None) -> tuple[tuple[int, ...], torch.dtype] | None:
        """For the package's own callers (the optimizer's resident step): shape and dtype of
        ``key`` if a hold on memory tier ``tier`` takes it now, with no transfer and no wait:
        its current value is on that tier and no one holds it; else None (a key not in the
        store too). What ``info`` tells of one tier, without building its dict (asked of every
        entry a step updates)."""
        entry = self._user_entry(key)
        if entry is None or entry.valid(self._engine.index_of(tier)) is None or entry.held():
            return None
        return tuple(entry.meta.shape), entry.meta.dtype

    def stats(self) -> dict[str, Any]:
        """Bytes used and capacity per tier, hits and misses, bytes and seconds per link, and
        prefetch counters, as plain (JSON-ready) data. A tier's hits and misses are of the
        requests made of it (a get, hold or pop names a tier, the fastest by default): a value
        read from the disk for a get of the host tier is a host miss, not a disk hit; the
        ``links`` show where the bytes came from."""
        self._engine.require_open()
        counters = self._engine.counters.to_dict()
        tiers = {}
        for tier in self._engine.tiers:
            tiers[tier.name] = {
                "used": tier.used,
                "capacity": tier.capacity,
                "entries": sum(1 for e in self._engine.entries.values() if e.valid(self._engine.index_of(tier)) is not None),
                **counters["tiers"].get(tier.name, {}),
            }
            if isinstance(tier, MemoryTier):
                tiers[tier.name]["live"] = tier.live_bytes
        return {"tiers": tiers, "links": counters["links"], "prefetch": counters["prefetch"], "keys": len(self)}

    # -- the verbs -----------------------------------------------------------------------------

    async def put(self, key: str, tensor: torch.Tensor, tier: TierRef = None, *, durable: bool | None = None) -> None:
        """Store a copy of ``tensor`` under ``key`` (replacing any value it had).

        It lands on ``tier`` if given, else on the fastest tier where room can be made by
        eviction. Non-contiguous tensors are stored as a contiguous copy; ``requires_grad`` is
        dropped. When this returns -- or raises, or is cancelled -- the store no longer reads
        ``tensor``'s memory (the caller may reuse it at once).

        ``durable`` (default: the store's ``durable``): True writes the value through to the
        disk tier before returning (on stable storage if the ``DiskTier`` is durable); False
        acknowledges it once a memory tier holds it (it reaches the disk on eviction,
        ``flush()`` or close). A put that lands on the disk tier itself is always written
        through. See README, "Durability". A put that waits for a disk commit (or sync) goes on
        when its caller is cancelled, and the caller's ``CancelledError`` (or a timeout's
        ``TimeoutError``) comes once the commit is settled: the value may then be the new one.
        """
        durable = _durability(durable, none=True)
        soon = self._commit_small_soon(key, tensor, tier, durable)
        if soon is not None:  # (a small value committed on the disk tier: one hand-over and back)
            await self._committed_small(*soon)
            return
        landed = self._put_small_now(key, tensor, tier, durable)
        if landed is not None:
            if landed == self._engine.disk_index:
                # (``_after_staged`` spelled out: no coroutine made for the common case; the
                # backlog is below ``STAGED_LIMIT`` here, ``_stage_small_now`` having checked it)
                self._staged_puts += 1
                if self._staged_puts % 256 == 0:
                    self._staged_puts -= 1
                    await self._after_staged()
            return
        await self._require_open()
        if self._engine.disk_index is not None and self._engine.disk.commit_failed:
            # Puts acknowledged earlier could not commit: try them again before anything new,
            # and say so (this put is not done) if they still cannot.
            await self._engine.disk.drain()
        key = check_key(key)
        through = self.durable if durable is None else bool(durable)
        if through and self._engine.disk_index is None:
            raise UnknownTierError("durable=True needs a disk tier to write through to; this store has none")
        if self._engine.frozen:
            await self._engine.until_thawed()
        tensor = check_tensor(tensor).detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        meta = meta_of(tensor)
        src = as_bytes(tensor)
        engine = self._engine
        first = engine.index_of(tier)
        while True:
            entry = engine.entries.get(key)
            if entry is not None and entry.writer is not None:
                await engine.no_writer(entry, "put")
            elif engine.sealed:  # (it waited: a close sealed meanwhile, its flush may be past)
                await self._require_open()
            else:
                break
        if entry is None:
            entry = engine.entries[key] = Entry(key, meta)
        if not through and self._put_now(entry, src, meta, first):
            # Done with no await (so no put of it was in flight meanwhile for anyone to see).
            if first == engine.disk_index:
                engine.observe("put", key, meta.nbytes, first, hit=None)  # (a memory tier's put is recorded as it lands)
                await self._after_staged()
            return
        targets = [first] if tier is not None else list(range(len(engine.tiers)))
        entry.pending_writes += 1
        try:
            if through:
                await self._put_through(entry, src, meta, targets)
            else:
                await self._put_back(entry, src, meta, targets)
        finally:
            entry.pending_writes -= 1
            entry.wake()  # a write hold waits for puts in flight
            if not entry.visible and entry.pending_writes == 0 and engine.entries.get(key) is entry:
                del engine.entries[key]

    def _put_small_now(self, key: str, tensor: torch.Tensor, tier: TierRef, durable: bool | None) -> int | None:
        """All of a put that needs no await, done at once: a small write-back value onto a
        non-durable disk tier (queued for the next catalog transaction) or into CPU memory with
        room; returns the tier it landed on. None, having changed nothing, for every other put
        (and bad input: the full ``put`` says what is wrong). The sync facade calls this on the
        loop thread directly, with no task."""
        engine = self._engine
        if (self.durable if durable is None else durable) or engine.frozen or engine.winding_down:
            return None
        if not _plain_cpu(tensor):
            return None
        try:
            key = check_key(key)
            first = engine.index_of(tier)
            engine.require_open_here()  # (called on the store's loop: a coroutine's, or call_now's)
        except TierStoreError:
            return None
        if first == engine.disk_index:
            return self._stage_small_now(key, tensor)
        meta = meta_of(tensor)
        if engine.disk_index is not None and engine.disk.commit_failed:
            return None  # (the full put tries failed commits again)
        entry = engine.entries.get(key)
        if entry is not None and entry.writer is not None:
            return None
        created = entry is None
        if entry is None:
            entry = engine.entries[key] = Entry(key, meta)
        done = False
        try:
            done = engine.put_memory_now(entry, first, as_bytes(tensor), meta)
        finally:  # (also when that raised: no entry left behind)
            if not done and created and not entry.visible and entry.pending_writes == 0 and engine.entries.get(key) is entry:
                del engine.entries[key]
        return first if done else None  # (recorded in the trace as it landed)

    def _stage_small_now(self, key: str, tensor: torch.Tensor) -> int | None:
        """``_put_small_now`` onto the disk tier (``key`` checked, ``tensor`` a plain CPU
        one): a small value on a non-durable disk tier queued for the next catalog transaction;
        a new key gets its entry with the inline copy in one object. Returns the disk tier's
        index, or None, having changed nothing, when the full put must do it."""
        engine = self._engine
        disk = engine.disk
        meta = meta_of(tensor)
        nbytes = meta.nbytes
        if not disk.can_stage(nbytes, STAGED_LIMIT - 1):
            return None  # (committed before acknowledged, in an extent, failed commits tried again, or a backlog)
        entry = engine.entries.get(key)
        data = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        if entry is None:
            if not engine.stage_new_small(key, data, meta):
                return None
        elif entry.writer is not None or not self._put_staged_now(entry, data, meta):
            return None
        d = engine.disk_index
        engine.observe("put", key, nbytes, d, hit=None)
        return d

    def _commit_small_soon(
        self, key: str, tensor: torch.Tensor, tier: TierRef, durable: bool | None
    ) -> tuple[Entry, asyncio.Future[int], int] | None:
        """The start of a put that lands on the disk tier itself (the only tier, or the one
        asked for) and waits for its commit (a durable put, or any put onto a durable disk
        tier) of a small value: its record handed to the catalog's writer thread with no await
        (``Engine.commit_small_now``). Returns the entry, the commit's future and the value's
        size; None, having changed nothing, for every other put (and bad input: the full
        ``put`` says what is wrong)."""
        engine = self._engine
        d = engine.disk_index
        if d is None or engine.frozen or engine.winding_down:
            return None
        disk = engine.disk
        if not (disk.durable or (self.durable if durable is None else durable)) or disk.commit_failed:
            return None  # (a write-back put onto a non-durable tier may be staged; failed commits first)
        try:
            if engine.index_of(tier) != d:
                return None  # (a memory tier first: the put caches there)
            key = check_key(key)
            engine.require_open_here()  # (refused: the full put says why)
        except TierStoreError:
            return None
        if not _plain_cpu(tensor):
            return None
        meta = meta_of(tensor)
        nbytes = meta.nbytes
        if not disk.holds_inline(nbytes) or not disk.can_commit_soon(key):
            return None  # (a large value, or a busy catalog: queued for a shared transaction)
        entry = engine.entries.get(key)
        if entry is None:
            entry = engine.entries[key] = Entry(key, meta)
        elif entry.writer is not None:
            return None
        data = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        committed = engine.commit_small_now(entry, data, meta)  # (drops an entry made here if not)
        if committed is None:
            return None
        return entry, committed, nbytes

    async def _committed_small(self, entry: Entry, committed: asyncio.Future[int], nbytes: int) -> None:
        """The rest of a put ``_commit_small_soon`` started: back once its commit is settled
        (the future cannot be cancelled: a cancelled caller is told then)."""
        engine = self._engine
        entry.pending_writes += 1
        try:
            await committed
        finally:
            entry.pending_writes -= 1
            entry.wake()  # a write hold waits for puts in flight
            if not entry.visible and entry.pending_writes == 0 and engine.entries.get(entry.key) is entry:
                del engine.entries[entry.key]
            if committed.done() and committed.exception() is None:  # (also for a caller cancelled meanwhile)
                engine.observe("put", entry.key, nbytes, engine.disk_index, hit=None)

    def _put_now(self, entry: Entry, src: torch.Tensor, meta: TensorMeta, t: int) -> bool:
        """A write-back put onto tier ``t`` done at once when it needs no await (a small value
        with room on a memory tier in CPU memory, or staged on a non-durable disk tier);
        False, having changed nothing, when it would (the caller then goes the awaited way)."""
        engine = self._engine
        if t != engine.disk_index:
            return engine.put_memory_now(entry, t, src, meta)
        try:
            return engine.put_staged(entry, src, meta)
        except TierFullError:
            return False  # (refused before anything was queued: the awaited way says why)

    def _put_staged_now(self, entry: Entry, data: bytes, meta: TensorMeta) -> bool:
        """A small write-back put of ``data`` (the value's bytes, read once straight from the
        tensor's memory) onto a non-durable disk tier, queued for the next catalog transaction
        with no await. False, having changed nothing, when it cannot be done so."""
        try:
            return self._engine.put_staged(entry, data, meta)  # type: ignore[arg-type]  # (bytes of exactly the value)
        except TierFullError:
            return False  # (refused before anything was queued: the awaited way says why)

    async def _after_staged(self) -> None:
        """After a small put acknowledged before its commit: keep the backlog bounded."""
        self._staged_puts += 1
        if self._engine.disk.queued_changes >= STAGED_LIMIT:
            await self._engine.disk.drain()  # a bounded backlog: a crash loses at most about this many
        elif self._staged_puts % 256 == 0:
            # A put loop that never awaits lets the group commit start (counted in puts: puts
            # of one key replace each other in the backlog, which then never grows).
            await asyncio.sleep(0)

    async def _put_back(self, entry: Entry, src: torch.Tensor, meta: TensorMeta, targets: list[int]) -> None:
        """A write-back put: the value lands on the first of ``targets`` with room."""
        engine = self._engine
        failures: list[TierFullError] = []
        for t in targets:
            try:
                if t == engine.disk_index:
                    await self._put_disk(entry, src, meta, staged=True)
                    engine.observe("put", entry.key, meta.nbytes, t, hit=None)
                elif not engine.put_memory_now(entry, t, src, meta):  # (a memory tier's put is recorded as it lands)
                    await engine.put_memory(entry, t, src, meta)
                return
            except TierFullError as exc:
                failures.append(exc)
        if len(failures) == 1:
            raise failures[0]
        raise TierFullError(
            f"no tier has room for {entry.key!r} ({format_bytes(meta.nbytes)}): " + "; ".join(str(f) for f in failures)
        )

    async def _put_through(self, entry: Entry, src: torch.Tensor, meta: TensorMeta, targets: list[int]) -> None:
        """A write-through put: committed on the disk tier first (a failure there leaves the old
        value in place), then cached on the first memory tier of ``targets`` with room."""
        engine = self._engine
        d = engine.disk_index
        committed = await self._put_disk(entry, src, meta, staged=False)
        landed = d
        for t in targets:
            if t == d:
                break
            live = engine.entries.get(entry.key)
            if committed is None or live is None or d is None or live.version != committed or live.valid(d) is None:
                break  # replaced or deleted meanwhile: the newer value is what to cache
            try:
                await engine.cache_copy(live, t, src)
            except TierFullError:
                continue
            landed = t
            break
        engine.observe("put", entry.key, meta.nbytes, landed, hit=None)
        if landed != d:
            engine.observe("writeback", entry.key, meta.nbytes, d, hit=None)

    async def _put_disk(self, entry: Entry, src: torch.Tensor, meta: TensorMeta, staged: bool) -> int | None:
        """Commit ``src`` as the new value on the disk tier; returns the version it got (None
        when acknowledged before its commit). A cancelled caller gets control back once the
        outcome is settled: given up before the commit (the old value stays), or committed;
        either way ``src`` is no longer read. ``staged``: a small value on a non-durable disk
        tier may be acknowledged before its commit (a write-back put; a write-through one waits
        for it)."""
        if staged and self._engine.put_staged(entry, src, meta):
            await self._after_staged()
            return None
        committed = self._engine.commit_small_now(entry, src, meta)
        if committed is not None:  # (a small value: one hand-over to the catalog's writer and back)
            # (it cannot be cancelled: a cancelled caller is told once the outcome is settled)
            return await committed
        abandon = asyncio.Event()
        write = self._engine.write_disk(entry, src, meta, None, Priority.DEMAND, abandon=abandon, staged=staged)
        return await self._engine.shielded(write, abandon)

    def fill(
        self, key: str, shape: Sequence[int], dtype: torch.dtype, tier: TierRef = None, *, durable: bool | None = None
    ) -> AbstractAsyncContextManager[torch.Tensor]:
        """A put whose bytes the caller writes in place: an async context manager giving an
        uninitialised tensor of ``shape`` and ``dtype`` in a buffer on memory tier ``tier``
        (default: the fastest with room), which becomes ``key``'s value when the block ends
        without an error. If the block raises (or is cancelled), nothing changes and the buffer
        is freed. For producers that write the value themselves, such as a copy over a device
        link, instead of handing ``put`` a tensor to copy. ``durable`` as in ``put`` (a durable
        value is filled in a staging buffer and then written through)."""
        return self._fill(key, _fill_shape(shape, dtype), dtype, tier, durable)

    @asynccontextmanager
    async def _fill(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, tier: TierRef, durable: bool | None) -> AsyncIterator[torch.Tensor]:
        engine = self._engine
        await self._require_open()
        key = check_key(key)
        durable = _durability(durable, none=True)
        if engine.frozen:
            await engine.until_thawed()
        meta = TensorMeta(dtype, shape)
        through = self.durable if durable is None else bool(durable)
        targets = [engine.index_of(tier)] if tier is not None else [t for t, x in enumerate(engine.tiers) if isinstance(x, MemoryTier)]
        if not targets or not all(isinstance(engine.tiers[t], MemoryTier) for t in targets):
            raise UnknownTierError(f"fill writes into a memory tier; {self._engine.names[targets[0]] if targets else 'this store'!r} has none")
        if through:
            staged = torch.empty(shape, dtype=dtype)
            yield staged
            await self.put(key, staged, targets[0] if tier is not None else None, durable=True)
            return
        entry = engine.entries.get(key)
        if entry is not None and entry.writer is not None:
            await engine.no_writer(entry, "put")
            entry = engine.entries.get(key)
        if entry is None:
            entry = engine.entries[key] = Entry(key, meta)
        entry.pending_writes += 1
        try:
            async with self._filling(entry, meta, targets) as buffer:
                yield from_bytes(buffer[: meta.nbytes], meta)
        finally:
            entry.pending_writes -= 1
            entry.wake()
            if not entry.visible and entry.pending_writes == 0 and engine.entries.get(key) is entry:
                del engine.entries[key]

    @asynccontextmanager
    async def _filling(self, entry: Entry, meta: TensorMeta, targets: list[int]) -> AsyncIterator[torch.Tensor]:
        """Allocate a buffer on the first of ``targets`` with room, yield it, install it."""
        engine = self._engine
        loop = asyncio.get_running_loop()
        failures: list[TierFullError] = []
        for t in targets:
            ready: asyncio.Future[torch.Tensor] = loop.create_future()
            finished: asyncio.Future[None] = loop.create_future()

            async def filler(buffer: torch.Tensor, priority: Priority, ready: Any = ready, finished: Any = finished) -> None:
                ready.set_result(buffer)
                await finished

            installing = asyncio.ensure_future(engine.put_filled(entry, t, filler, meta))
            try:
                await asyncio.wait([ready, installing], return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                installing.cancel()
                await asyncio.gather(installing, return_exceptions=True)
                raise
            if not ready.done():
                try:
                    installing.result()
                except TierFullError as exc:
                    failures.append(exc)
                    continue
                raise TierStoreError(f"internal error: fill of {entry.key!r} installed no buffer")  # pragma: no cover
            try:
                yield ready.result()
            except BaseException as exc:
                finished.set_exception(_FillAbandoned())
                await asyncio.gather(installing, return_exceptions=True)
                raise exc
            finished.set_result(None)
            await installing
            engine.observe("put", entry.key, meta.nbytes, t, hit=False)  # (room made for it: see tierstore.tracing)
            return
        if len(failures) == 1:
            raise failures[0]
        raise TierFullError(f"no memory tier has room for {entry.key!r} ({format_bytes(meta.nbytes)}): " + "; ".join(map(str, failures)))

    async def get(self, key: str, tier: TierRef = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the value of ``key``, as a tensor on ``tier``'s device (default: the fastest
        tier). The value is promoted to that tier when room can be made (so the next read hits);
        when not, it is read without being cached there.

        ``out``: a contiguous tensor of the value's dtype and shape (on that device) to read into
        instead of a new one; reusing it saves an allocation per read, and a 4096-aligned ``out``
        (see ``tierstore.empty``) is read from disk with no intermediate copy.

        While another task or thread holds ``key`` for writing, this waits for the release; from
        inside the caller's own write hold of ``key`` it raises ``EntryHeldError``.
        """
        given = out
        try:
            value = self._get_small_now(key, tier, out)
            if value is not None:
                return value
            await self._require_open()
            t = self._engine.index_of(tier)
            entry = self._engine.visible_entry(key)
            device = self._engine.tiers[t].device if isinstance(self._engine.tiers[t], MemoryTier) else _CPU  # type: ignore[attr-defined]
            if out is not None:
                _check_out(out, entry.meta, device)
                self._refuse_held_out(out)
            if entry.writer is not None:  # (checked here first: this is the hot path of a hit)
                await self._engine.no_writer(entry, "get")
                entry = self._engine.visible_entry(key)
                if out is not None:  # (a put copied over it meanwhile may have changed its dtype or shape)
                    _check_out(out, entry.meta, device)
            copy = entry.valid(t)
            hit = copy is not None
            self._engine.count_access(t, hit, entry)
            self._engine.observe("get", key, entry.meta.nbytes, t, hit=hit)
            if t == self._engine.disk_index:
                if copy is not None and copy.inline is not None and out is None and not copy.writing:
                    # A small value inline in the catalog: read and verified with no await.
                    try:
                        return self._engine.disk.read_inline_tensor(key, copy.version, entry.meta)
                    except InlineSuperseded:
                        pass  # (a newer value is being installed: the awaited way waits for it)
                return await self._engine.read_uncached(entry, device, out)
            if copy is not None:
                self._engine.hit(entry, copy)
                meta = entry.meta
                if meta.nbytes <= INLINE_COPY_BYTES and device.type == "cpu" and copy.in_memory and copy.last_use is None:
                    # A small hit in CPU memory: one memmove into a new (or the caller's
                    # contiguous) tensor, with no views made and no await.
                    if out is None:
                        out = torch.empty(meta.shape, dtype=meta.dtype)
                    if meta.nbytes:
                        ctypes.memmove(out.data_ptr(), copy.address, meta.nbytes)
                    return out
            while True:
                try:
                    copy = await self._engine.acquire(entry, t, Priority.DEMAND)
                except TierFullError:
                    return await self._engine.read_uncached(entry, device, out, target=t)
                if entry.writer is None:
                    break
                # A write hold opened while this waited for the load (it waited for the same
                # load, ahead of this, or started it): its buffer is changing, wait for its end.
                self._engine.unuse(entry, copy)
                await self._engine.no_writer(entry, "get")
                entry = self._engine.visible_entry(key)
            read = self._engine.reading(copy)
            try:
                return await self._engine.clone(entry, copy, t, out)
            finally:
                self._engine.unuse(entry, copy)
                self._engine.read_done(read)
        finally:
            if isinstance(given, torch.Tensor):  # (written as ``out.copy_`` writes: autograd sees the change)
                _increment_version(given)

    def _refuse_held_out(self, out: torch.Tensor) -> None:
        """Raise ``InvalidTensorError`` if ``out`` shares memory with a buffer a read hold has
        handed out: it is the store's own copy of that value (a write into it would change the
        value in memory only, and not its copy on disk). A write hold's buffer is the holder's
        to change, and may be read into."""
        if not self._read_held:
            return
        start = out.data_ptr()
        end = start + out.numel() * out.element_size()
        for key, copy in self._read_held.values():
            if copy.in_memory and copy.nbytes and copy.address < end and start < copy.address + copy.nbytes:
                raise InvalidTensorError(
                    f"out is the buffer of a read hold of {key!r} (the store's own copy of its value); read into a tensor of "
                    f"your own, or hold {key!r} for writing to change it")

    def _get_small_now(self, key: str, tier: TierRef, out: torch.Tensor | None) -> torch.Tensor | None:
        """All of a get that needs no await, done at once: a small value inline in the disk
        tier's catalog, or a small hit in CPU memory, read into a new tensor. None, having
        changed nothing, for every other get (and bad input: the full ``get`` says what is
        wrong). The sync facade calls this on the loop thread directly, with no task."""
        engine = self._engine
        if out is not None or engine.winding_down or not isinstance(key, str):
            return None
        try:
            key = check_key(key)
            entry = engine.entries.get(key)
            t = engine.index_of(tier)
            engine.require_open_here()  # (called on the store's loop: a coroutine's, or call_now's)
        except TierStoreError:
            return None
        if entry is None or not entry.visible or entry.writer is not None:
            return None
        copy = entry.valid(t)
        if copy is None:
            return None
        meta = entry.meta
        if t == engine.disk_index:
            if copy.inline is None or copy.writing:
                return None
            try:
                value = engine.disk.read_inline_tensor(key, copy.version, meta)
            except InlineSuperseded:
                return None  # (a newer value is being installed: the full get waits for it)
            engine.count_access(t, True, entry)
            engine.observe("get", key, meta.nbytes, t, hit=True)
            return value
        tier_object = engine.tiers[t]
        if (
            meta.nbytes > INLINE_COPY_BYTES
            or not copy.in_memory
            or copy.last_use is not None
            or not isinstance(tier_object, MemoryTier)
            or tier_object.device.type != "cpu"
        ):
            return None
        engine.count_access(t, True, entry)
        engine.observe("get", key, meta.nbytes, t, hit=True)
        engine.hit(entry, copy)
        # A small hit in CPU memory: one memmove into a new tensor, with no views made.
        value = torch.empty(meta.shape, dtype=meta.dtype)
        if meta.nbytes:
            ctypes.memmove(value.data_ptr(), copy.address, meta.nbytes)
        return value

    async def pop(self, key: str, tier: TierRef = None) -> torch.Tensor:
        """Remove ``key`` and return its value on ``tier``'s device (default: the fastest tier).

        When the current value already sits in that tier's device memory (on that tier, or on
        a host tier when the CPU stands in for the device), unheld and unused, its buffer leaves
        the store and is returned as it is (no copy; the tier's accounting drops it); otherwise
        the value is read from its fastest copy. A pop cancelled once it has begun deleting
        still deletes the key (its value then reaches no one), as a cancelled delete would."""
        while True:
            value = await self._pop_once(key, tier)
            if value is not None:
                return value
            # (a put committed a newer value while the pop waited to delete: it deletes only
            # the value it returns, so it reads again)

    async def _pop_once(self, key: str, tier: TierRef) -> torch.Tensor | None:
        """One try of ``pop``: None, having deleted nothing, when the value changed between its
        read and its delete."""
        await self._require_open()
        if self._engine.frozen:
            await self._engine.until_thawed()
            await self._require_open()  # (a close sealed meanwhile: its flush may be past)
        t = self._engine.index_of(tier)
        entry = self._engine.visible_entry(key)
        if entry.held():  # as delete: a held key (read or write, anyone's) is refused at once
            raise EntryHeldError(f"{key!r} is held; release it before popping it")
        copy = entry.valid(t)
        hit = copy is not None
        self._engine.count_access(t, hit, entry)
        if copy is not None:
            self._engine.hit(entry, copy)
        self._engine.observe("pop", key, entry.meta.nbytes, t, hit=hit)
        tier_obj = self._engine.tiers[t]
        device = tier_obj.device if isinstance(tier_obj, MemoryTier) else torch.device("cpu")
        # A buffer already in the requested device's memory can be handed over: the asked tier's
        # own copy, or (the CPU standing in for the device) a host copy in the same memory.
        candidates = [copy] if copy is not None else []
        candidates += [c for u in entry.valid_tiers() if (c := entry.valid(u)) is not None and c is not copy]
        for candidate in candidates:
            owner = self._engine.tiers[candidate.tier]
            if (
                candidate.users == 0
                and candidate.slab is None  # a packed value shares its slab: copy it instead
                and (buffer := candidate.buffer) is not None
                and isinstance(owner, MemoryTier)
                and (owner is tier_obj or _same_memory(owner, tier_obj))
                and not owner.pinned
                and owner.can_hand_over(buffer)
            ):
                return await self._pop_buffer(entry, candidate, owner, buffer)
        version = entry.version
        value = await self._engine.read_uncached(entry, device, target=t if isinstance(tier_obj, MemoryTier) else None)
        if self._engine.sealed:  # (sealed while it read: no delete starts now, its flush may be past)
            await self._require_open()
            return None  # (the close failed: read again, the value may have changed meanwhile)
        if not await self._engine.shielded(self._engine.delete_entry(entry, expect_version=version), settle=True):
            return None
        return value

    async def _pop_buffer(self, entry: Entry, copy: Copy, owner: MemoryTier, buffer: torch.Tensor) -> torch.Tensor | None:
        """Delete ``entry`` and hand ``copy``'s buffer (of the current value) to the caller. The
        copy stays in the store, in use, until the delete is done: until then readers still read
        it, and a delete refused (a hold taken meanwhile) leaves the value where it was. None
        (nothing deleted) when a newer value replaced it meanwhile."""
        meta = entry.meta
        engine = self._engine
        engine.use(entry, copy)
        done = asyncio.get_running_loop().create_future()
        engine.expect_room(copy.tier, done)  # (a request for room meanwhile waits for the pop, not refuses)
        try:
            try:
                deleted = await engine.shielded(engine.delete_entry(entry, expect_version=copy.version), settle=True)
            finally:
                engine.unuse(entry, copy)
            if not deleted:
                return None  # retired by the delete: the buffer goes back to the pool ...
            if copy.retired and not copy.in_memory:
                owner.forget(buffer)  # ... from which it leaves the tier, handed to the caller
                return from_bytes(buffer, meta)
            return from_bytes(buffer, meta).clone()  # still used (a hold taken meanwhile): a copy of it
        finally:
            done.set_result(None)

    async def read(self, key: str) -> torch.Tensor:
        """The value of ``key`` as a new CPU tensor, read from wherever it is, moving nothing
        (for snapshots and inspection: no promotion, no eviction, no hit or miss counted)."""
        await self._require_open()
        entry = self._engine.visible_entry(key)
        if entry.writer is not None:
            await self._engine.no_writer(entry, "read")
            entry = self._engine.visible_entry(key)
        return await self._engine.read_uncached(entry, _CPU)

    async def export_zarr(self, path: str | Path, overwrite: bool = False) -> int:
        """Write every entry as a zarr v3 array under ``path`` (see ``tierstore.snapshot``)."""
        from .snapshot import export_zarr

        require_flag("overwrite", overwrite)
        self._engine.require_open_here()
        async with self._engine.freeze():  # a point-in-time view: writers wait until it is written
            return await export_zarr(self, path, overwrite)

    async def import_zarr(self, path: str | Path, tier: TierRef = None) -> int:
        """Put every array of the zarr group at ``path`` into the store."""
        from .snapshot import import_zarr

        self._engine.require_open_here()
        return await import_zarr(self, path, tier)

    async def delete(self, key: str) -> None:
        """Remove ``key`` from every tier (and from the disk catalog)."""
        await self._require_open()
        if self._engine.frozen:
            await self._engine.until_thawed()
            await self._require_open()  # (a close sealed meanwhile: its flush may be past)
        entry = self._engine.visible_entry(key)
        if entry.held():
            raise EntryHeldError(f"{key!r} is held; release it before deleting")
        if not await self._engine.shielded(self._engine.delete_entry(entry), settle=True) and not self._engine.is_open:
            raise StoreClosedError(f"the store closed before {key!r} was deleted (it was not)")
        self._engine.observe("delete", key, entry.meta.nbytes, None, hit=None)

    def hold(self, key: str, tier: TierRef = None, write: bool = False) -> AbstractAsyncContextManager[torch.Tensor]:
        """Pin ``key`` on a memory tier (default: the fastest) and yield the store's own buffer.

        While held the entry cannot be evicted from that tier. With ``write=True`` the yielded
        tensor may be changed in place, and the changes become the new value when the hold is
        released (they reach the disk on eviction, ``flush`` or close); released by an
        exception too: what was written before it stays, nothing rolls back. A write hold is
        exclusive: it waits until no one else reads, copies or holds that copy, and until it
        ends, every other reader of ``key`` (get, flush, prefetch, another hold) waits; code
        inside the write hold that reads ``key`` through the store gets ``EntryHeldError``
        instead of waiting for itself. Read holds share the buffer with each other; a put
        while one is open replaces the value without changing the held buffer.
        """
        return self._hold(key, tier, require_flag("write", write), holds.new_token(), mark=True)

    @asynccontextmanager
    async def _hold_all(self, keys: Sequence[str], tier: TierRef = None, write: bool = False) -> AsyncIterator[list[torch.Tensor]]:
        """``hold`` of each of ``keys`` (distinct) in one block, for the package's own callers
        (the optimizer's resident step): yields their buffers in order. The holds are taken one
        after the other in the order given (callers holding several keys from more than one
        task give them in one order, sorted say, so no two wait for each other) and released
        together, last first, when the block ends; if one cannot be taken, those taken already
        are released and the error raised. The same as nesting ``hold`` once per key, for one
        context manager instead of one per key (a subclass's own ``hold``, or one set on the
        instance, a fault injector's say, is still asked for each)."""
        await self._require_open()
        if getattr(self.hold, "__func__", None) is not TierStore.hold:  # (a subclass's hold, or one set on the instance)
            async with AsyncExitStack() as stack:
                yield [await stack.enter_async_context(self.hold(key, tier, write)) for key in keys]
            return
        t = self._hold_tier(tier)
        # One token names the block's holds (the running context is inside all of them, as
        # inside nested holds; marked once, not once per key).
        token = holds.new_token()
        taken: list[tuple[Entry, Copy]] = []
        holds.enter(token)
        try:
            values = []
            for key in keys:
                entry, copy = await self._open_hold(key, t, write, token, mark=False)
                taken.append((entry, copy))
                values.append(copy.typed(entry.meta))
            yield values
        finally:
            for entry, copy in reversed(taken):
                self._close_hold(entry, copy, t, write, token, mark=False)
            holds.leave(token)

    @asynccontextmanager
    async def _hold(self, key: str, tier: TierRef, write: bool, token: int, mark: bool) -> AsyncIterator[torch.Tensor]:
        """``hold`` named by ``token``; ``mark``: mark the running context as inside it (the
        sync facade marks its caller's thread instead)."""
        await self._require_open()
        t = self._hold_tier(tier)
        entry, copy = await self._open_hold(key, t, write, token, mark)
        try:
            yield copy.typed(entry.meta)
        finally:
            self._close_hold(entry, copy, t, write, token, mark)

    def _hold_tier(self, tier: TierRef) -> int:
        """The index of ``tier``, a memory tier a hold can pin values on."""
        t = self._engine.index_of(tier)
        if not isinstance(self._engine.tiers[t], MemoryTier):
            raise UnknownTierError(f"hold needs a memory tier; {self._engine.names[t]!r} is a {self._engine.tiers[t].kind} tier")
        return t

    async def _open_hold(self, key: str, t: int, write: bool, token: int, mark: bool) -> tuple[Entry, Copy]:
        """Take the hold ``token`` of ``key`` on tier ``t`` (``_hold`` up to its block); once
        this returns, ``_close_hold`` must release it."""
        if write and self._engine.frozen:
            await self._engine.until_thawed()
        entry = self._engine.visible_entry(key)
        woken = entry.writer is not None
        if woken:
            await self._engine.no_writer(entry, "hold")
            entry = self._engine.visible_entry(key)
        hit = entry.valid(t) is not None
        self._engine.count_access(t, hit, entry)
        self._engine.observe("hold", key, entry.meta.nbytes, t, hit=hit)
        copy = await self._take_hold(entry, t, write, hit, woken)
        engine = self._engine
        while write and (engine.closing or engine.winding_down or engine.frozen):
            # (a change made once the close has sealed would not be written by its flush; one
            # made in a point-in-time view begun while this suspended would show in it)
            copy.holds -= 1
            engine.unuse(entry, copy)
            if engine.frozen and not (engine.closing or engine.winding_down):
                await engine.until_thawed()
                entry = engine.visible_entry(key)
                copy = await self._take_hold(entry, t, write, False)
                continue
            if not engine.winding_down:
                # Refused, not waited for: the close is waiting for the write holds open, and
                # their holders may be waiting for this one (here or in another task, where no
                # one can tell); a wait would be a deadlock.
                raise StoreClosedError(f"the store is closing and waits for the write holds open: no write hold of {key!r} "
                                       "starts meanwhile (nothing was changed; should the close fail, ask again)")
            if engine.sealed:
                await engine.settled()  # (a sealed close waits for no request)
            if not engine.is_open:
                raise StoreClosedError(f"the store closed: no write hold of {key!r} starts (nothing was changed)")
            entry = engine.visible_entry(key)  # (the close failed: as if it had not happened)
            copy = await self._take_hold(entry, t, write, False)
        if mark:
            holds.enter(token)
        entry.add_hold_token(token)
        if write:
            copy.writing = True
            entry.writer, entry.writer_token = copy, token
        return entry, copy

    def _close_hold(self, entry: Entry, copy: Copy, t: int, write: bool, token: int, mark: bool) -> None:
        """Release the hold ``_open_hold`` took (once: a hold ended already, by a close at exit,
        is left as it is)."""
        if token not in entry.hold_tokens:
            return
        if mark:
            holds.leave(token)
        entry.discard_hold_token(token)
        copy.holds -= 1
        if copy.holds == 0:
            self._read_held.pop(id(copy), None)
        link = getattr(self._engine.tiers[t], "link", None)
        if link is not None and not link.lends:
            copy.last_use = caller_work(link)  # the holder's kernels may still use the buffer
        if write:
            copy.writing = False
            entry.writer, entry.writer_token = None, 0
            if self._engine.entries.get(entry.key) is entry and entry.copy_on(t) is copy and copy.version == entry.version:
                self._engine.new_version(entry, keep=copy)  # the changes are the value from now on
                self._engine.observe("update", entry.key, entry.meta.nbytes, t, hit=None)
        self._engine.unuse(entry, copy)

    async def _take_hold(self, entry: Entry, t: int, write: bool, hit: bool, woken: bool = False) -> Copy:
        """A copy of ``entry`` on tier ``t`` with a use and a hold taken; for a write hold, once
        no one else uses that copy, no put of the key is in flight and no other write hold is
        open. ``woken``: the request waited for a write hold to end (it does not let those
        woken with it go first: they asked after it)."""

        def free_to_write() -> bool:
            copy = entry.copy_on(t)
            return entry.writer is None and entry.pending_writes == 0 and (copy is None or self._engine.users_besides_waiters(copy) == 0)

        if write and not woken and entry.has_woken:
            await asyncio.sleep(0)  # (those woken by the hold that just ended go first)

        while True:
            copy = entry.valid(t)
            if copy is not None:  # (what acquire does for a value on the tier already, without its coroutines)
                self._engine.use(entry, copy)
            else:
                try:
                    copy = await self._engine.acquire(entry, t, Priority.DEMAND)
                except TierFullError as exc:  # (what was refused, not only why)
                    raise TierFullError(f"no {'write ' if write else ''}hold of {entry.key!r} on tier {self._engine.names[t]!r}: {exc}") from exc
            if entry.writer is None and (not write or (self._engine.users_besides_waiters(copy) == 1 and entry.pending_writes == 0)):
                break
            self._engine.unuse(entry, copy)
            if write and any(holds.inside(token) for token in entry.hold_tokens):
                raise EntryHeldError(f"a write hold of {entry.key!r} cannot start inside your own hold of it")
            await self._engine.no_writer(entry, "hold")
            if write:
                await self._engine.wait_until(entry, free_to_write)
            hit = False
        if hit:
            self._engine.hit(entry, copy)
        copy.holds += 1
        if not write:
            self._read_held[id(copy)] = (entry.key, copy)
        return copy

    async def prefetch(self, keys: Iterable[str], tier: TierRef = None) -> PrefetchHandle:
        """Start bringing ``keys`` up to ``tier`` (default: the fastest) in the background, behind
        every demand request. Returns at once with a handle: ``await handle`` waits (and returns
        a summary), ``handle.cancel()`` stops what has not started."""
        await self._require_open()
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"prefetch takes an iterable of keys, not one key: prefetch([{keys!r}])")
        t = self._engine.index_of(tier)
        entries: dict[str, Entry] = {}  # (a key named twice is fetched, and reported, once)
        for key in keys:
            entry = self._engine.visible_entry(key)
            entries.setdefault(key, entry)
        if self._engine.issuer is None:
            raise StoreClosedError("the store is not open")
        return self._engine.issuer.start(list(entries.values()), t)

    def write_back(self, keys: Iterable[str], tier: TierRef = None) -> int:
        """Start writing the current values of ``keys`` held on memory tier ``tier`` (default:
        the one right above the disk tier) to the disk tier right below it, behind demand
        requests, keeping them there: evicting them later costs no write. Not a coroutine: it
        starts the writes and returns how many started (``aclose`` waits for them). Keys not on
        that tier (or not in the store), held for writing or already on the disk are skipped;
        a tier with no disk tier right below it raises ``UnknownTierError``."""
        self._engine.require_open()
        engine = self._engine
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"write_back takes an iterable of keys, not one key: write_back([{keys!r}])")
        if not engine.disk_index:  # (None, or a disk tier with no memory tier above it)
            raise UnknownTierError("write_back needs a memory tier above a disk tier; this store has none")
        t = engine.disk_index - 1 if tier is None else engine.index_of(tier)
        if t + 1 != engine.disk_index:
            raise UnknownTierError(
                f"write_back writes from the memory tier right above the disk tier ({engine.names[engine.disk_index - 1]!r}), "
                f"not from {engine.names[t]!r}")
        entries = [engine.lookup(check_key(key)) for key in keys]
        return sum(eviction.write_early(engine, entry, t) for entry in entries if entry is not None)

    async def flush(self) -> None:
        """Write every entry whose current value is not on the disk tier down to it, in one
        catalog transaction: after a crash, either every value this flush wrote is there or
        none is. Refuses (``TierFullError``, nothing written) when the disk tier has no room for
        the copy-on-write of all of them. Waits for other tasks' write holds; raises
        ``EntryHeldError`` inside the caller's own."""
        await self._require_open()
        await self._engine.flush_all()

    @contextmanager
    def _unobserved(self) -> Iterator[None]:
        """For the package's own callers (an optimizer's checkpoint): the accesses made inside
        the block are not told to the prefetch policy, whose schedule is the training's."""
        self._engine.unobserved += 1
        try:
            yield
        finally:
            self._engine.unobserved -= 1

    def mark_step(self) -> None:
        """Mark the end of a repeated phase (a training step) for the prefetch policy and trace."""
        self._engine.require_open()
        try:
            self._engine.prefetch_policy.on_step()
        except Exception as exc:  # (advice only, as on_access and suggest: warned once, the step goes on)
            self._engine.prefetch_failed(exc)
        if self._engine.trace is not None:
            self._engine.trace.mark_step()

    def expect(self, used: Iterable[str], unused: Iterable[str] = ()) -> None:
        """Tell the prefetch policy what the phase beginning now will access (``used``) and will
        not (``unused``), where the caller knows it: an optimizer, which states its step
        updates. Advice, as ``mark_step``: a policy without an ``expect`` method ignores it
        (``ScheduleLearned`` has one; its phase ends at the next ``mark_step``)."""
        self._engine.require_open()
        for name, keys in (("used", used), ("unused", unused)):
            if isinstance(keys, (str, bytes)):
                raise TypeError(f"expect takes iterables of keys, not one key: {name}=[{keys!r}]")
        expect = getattr(self._engine.prefetch_policy, "expect", None)
        if expect is None:
            return
        try:
            expect(used, unused)
        except Exception as exc:  # (advice only: warned once, the step goes on)
            self._engine.prefetch_failed(exc, "expect", "the advice is dropped")

    def __repr__(self) -> str:
        state = "open" if self._engine.is_open else "closed"
        keys = sum(1 for key in self._engine.entries if not is_reserved(key))
        return f"TierStore({self._engine.tiers!r}, {state}, {keys} keys)"

    # -- namespaces (tierstore/namespaces.py)

    async def claim(self, name: str, *, owner: str = "user", overwrite: bool = False, adopt: bool = False) -> Namespace:
        """Claim the key namespace ``name`` (a prefix; a trailing ``"/"`` is added) for ``owner``.

        Recorded in the store; the same owner claiming it after a restart adopts its keys. Raises
        ``NamespaceClaimedError`` if it overlaps a live claim, or (unless ``overwrite=True``,
        which deletes what is in the way) another owner's record or keys no namespace owns.
        ``adopt=True`` makes those keys the namespace's instead (keys whose namespace record was
        lost: an index dropped by ``tierstore repair``, keys imported from a zarr snapshot); with
        ``overwrite=True`` too, only the other namespaces in the way are deleted."""
        return await self._namespaces.claim(name, owner=owner, overwrite=overwrite, adopt=adopt)

    async def claim_unique(self, base: str, *, owner: str = "user") -> Namespace:
        """Claim the first free namespace ``{base}{n}/`` (a default, marked auto) for ``owner``."""
        return await self._namespaces.claim_unique(base, owner=owner)

    async def namespaces(self) -> list[NamespaceInfo]:
        """Every recorded namespace: name, owner, auto, live, keys and bytes."""
        return await self._namespaces.namespaces()

    async def gc(self, *, names: Iterable[str] | None = None, dry_run: bool = True) -> list[NamespaceInfo]:
        """Remove orphaned namespaces (recorded, not claimed live): the auto ones, or ``names``.
        Returns what was removed (with ``dry_run``, what would be)."""
        return await self._namespaces.gc(names=names, dry_run=require_flag("dry_run", dry_run))


def _fill_shape(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    """``fill``'s shape as a tuple of ints, once the dtype is one ``put`` takes and every size
    is a non-negative integer (``InvalidTensorError`` otherwise: a float or a bool is not
    truncated into a size; ``torch.empty`` refuses them too)."""
    if not isinstance(dtype, torch.dtype):
        raise InvalidTensorError(f"fill needs a torch.dtype, not {dtype!r}")
    dtype_name(dtype)  # (InvalidTensorError for a dtype the store cannot hold: a put refuses it too)
    sizes = shape if hasattr(shape, "__iter__") else (shape,)  # (one size alone: a 1-D shape, as torch.empty takes)
    try:
        dims = tuple(_size(d) for d in sizes)
    except TypeError:
        raise InvalidTensorError(f"fill needs a shape of non-negative integer sizes, not {shape!r}") from None
    if any(d < 0 for d in dims):
        raise InvalidTensorError(f"fill needs a shape of non-negative integer sizes, not {shape!r}")
    return dims


def _size(dimension: object) -> int:
    if isinstance(dimension, bool):
        raise TypeError("a bool is not a size")
    return operator.index(dimension)  # type: ignore[arg-type]


_PLAIN_DTYPES = frozenset(supported_dtypes())


def _plain_cpu(tensor: object) -> bool:
    """Whether ``tensor`` is a contiguous dense CPU tensor whose memory holds its value as is
    (what ``check_tensor`` accepts unchanged), found with a few cheap attribute reads."""
    return (
        type(tensor) in PLAIN_TENSOR_TYPES
        and tensor.is_cpu  # type: ignore[attr-defined]
        and tensor.layout is torch.strided  # type: ignore[attr-defined]
        and not tensor.is_nested  # type: ignore[attr-defined]
        and tensor.dtype in _PLAIN_DTYPES  # type: ignore[attr-defined]
        and tensor.is_contiguous()  # type: ignore[attr-defined]
        and not tensor.is_conj()  # type: ignore[attr-defined]
        and not tensor.is_neg()  # type: ignore[attr-defined]
    )


def _increment_version(tensor: torch.Tensor) -> None:
    """Move ``tensor``'s version counter, as an in-place op does: a tensor saved for backward
    and then read into raises there, instead of giving wrong gradients."""
    increment = getattr(torch.autograd.graph, "increment_version", None)
    if increment is not None:
        increment(tensor)


def _durability(durable: object, *, none: bool) -> Any:
    """``durable`` if it is a bool (or None, where ``none``), else ``TypeError``: a string or a
    number would read as true or false without a word."""
    return require_flag("durable", durable, none="the store default" if none else None)


def _check_out(out: object, meta: TensorMeta, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise InvalidTensorError(f"out must be a tensor, not {type(out).__name__}")
    if out.dtype != meta.dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensorError(f"out is {out.dtype} {tuple(out.shape)}; the value is {meta.dtype} {meta.shape}")
    if not out.is_contiguous() or out.layout != torch.strided:
        raise InvalidTensorError("out must be a contiguous dense tensor")
    if out.device.type != device.type:
        raise InvalidTensorError(f"out is on {out.device}; this read delivers to {device}")


def _same_memory(a: Tier, b: Tier) -> bool:
    """Whether two tiers' buffers live in the same memory: same device and no link between
    them (an emulated device tier is behind a link even though its buffers are CPU memory)."""
    return (
        isinstance(a, MemoryTier) and isinstance(b, MemoryTier) and a.device == b.device
        and getattr(a, "link", None) is None and getattr(b, "link", None) is None
    )
