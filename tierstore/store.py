"""``TierStore``: the asynchronous tiered key-value store of tensors (its public verbs; the
machinery that moves bytes between tiers is ``tierstore.engine``)."""

from __future__ import annotations

import asyncio
import itertools
import warnings
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch

from . import holds
from .copies import INLINE_COPY_BYTES, cpu_copy
from .engine import Engine, TierRef
from .entry import Copy, Entry
from .errors import (
    EntryHeldError,
    InvalidTensorError,
    StoreClosedError,
    TierFullError,
    UnknownTierError,
)
from .keys import check_key
from .prefetching import PrefetchHandle, PrefetchIssuer
from .protocols import PrefetchPolicy
from .tensors import TensorMeta, as_bytes, check_tensor, from_bytes
from .tiers.base import MemoryTier, Tier
from .tracing import TraceRecorder
from .units import format_bytes
from .workers import Priority

__all__ = ["TierRef", "TierStore"]


class TierStore(Engine):
    """A key-value store of tensors over tiers ordered fastest first.

    Parameters
    ----------
    tiers:
        e.g. ``[DeviceTier("cuda:0", "8GiB"), HostTier("32GiB"), DiskTier("/nvme/ts", "1TiB")]``.
        Names must be unique; a ``DiskTier``, if any, comes last.
    eviction:
        The eviction policy of each tier that can evict (every tier but the last): a class or
        factory called once per tier (default ``policies.LRU``), or a mapping from tier name to
        a class, factory or instance.
    prefetch:
        A prefetch policy instance (default ``policies.NoPrefetch()``); it watches demand
        accesses and its suggestions are fetched in the background.
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
        prefetch: PrefetchPolicy | None = None,
        trace: str | Path | None = None,
        cpu_threads: int = 1,
        flush_on_close: bool = True,
        durable: bool = False,
    ) -> None:
        super().__init__(tiers, eviction, prefetch, cpu_threads)
        self._trace_path = Path(trace) if trace is not None else None
        self.flush_on_close = flush_on_close
        if durable and self._disk_index is None:
            raise ValueError("durable=True needs a DiskTier to write through to")
        self.durable = bool(durable)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> TierStore:
        """Open every tier (the disk tier loads its catalog) and adopt what is on disk."""
        if self.is_open:
            return self
        self._loop = asyncio.get_running_loop()
        opened: list[Tier] = []
        try:
            for tier in self._tiers:
                await tier.open()
                opened.append(tier)
        except BaseException:
            for tier in reversed(opened):
                await tier.aclose()
            raise
        newest = 0
        if self._disk_index is not None:
            disk = self._disk
            for key, record in disk.loaded.items():
                entry = Entry(key, record.meta, version=record.version)
                entry.copies[self._disk_index] = Copy(
                    self._disk_index, record.version, extent=record.extent, checksums=record.checksums
                )
                self._entries[key] = entry
                newest = max(newest, record.version)
            disk.loaded = {}
        self._versions = itertools.count(newest + 1)
        for name in self._names:
            self.counters.tier(name)
        self._cpu.start()
        if self._trace_path is not None:
            self.trace = TraceRecorder(self._trace_path, self._names)
        self._issuer = PrefetchIssuer(self)
        self.is_open = True
        return self

    async def aclose(self, flush: bool | None = None) -> None:
        """Finish in-flight work, write memory-only entries to disk (if ``flush``, default
        ``flush_on_close``), and close the tiers."""
        if not self.is_open or self._closing:
            return
        self._closing = True  # new verbs are refused from here on
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        while self._writes or any(self._demotions):
            await asyncio.gather(*self._writes, *(t for pending in self._demotions for t in pending), return_exceptions=True)
        try:
            if self._disk_index is not None and (self.flush_on_close if flush is None else flush):
                await self._flush_all()
        finally:
            self.is_open = False
            self._closing = False
            if self.trace is not None:
                self.trace.close()
            for tier in reversed(self._tiers):
                await tier.aclose()
            self._cpu.shutdown()
            self._entries.clear()

    async def __aenter__(self) -> TierStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if getattr(self, "is_open", False):
            warnings.warn(
                f"{self!r} was garbage-collected while open: entries only in memory were not written to "
                "its disk tier; close it (async with, or await store.aclose())",
                ResourceWarning,
                stacklevel=2,
            )

    # -- introspection -------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        self._require_open()
        entry = self._entries.get(key) if isinstance(key, str) else None
        return entry is not None and entry.visible

    def __len__(self) -> int:
        self._require_open()
        return sum(1 for entry in self._entries.values() if entry.visible)

    def keys(self) -> list[str]:
        """Every key in the store."""
        self._require_open()
        return [key for key, entry in self._entries.items() if entry.visible]

    def info(self, key: str) -> dict[str, Any]:
        """dtype, shape, nbytes of ``key`` and the tiers holding its current value."""
        self._require_open()
        entry = self._visible(key)
        return {
            "key": key,
            "dtype": entry.meta.dtype,
            "shape": entry.meta.shape,
            "nbytes": entry.meta.nbytes,
            "tiers": [self._names[t] for t in entry.valid_tiers()],
            "held": entry.held(),
        }

    def where(self, key: str) -> list[str]:
        """Names of the tiers holding the current value of ``key``, fastest first."""
        self._require_open()
        return [self._names[t] for t in self._visible(key).valid_tiers()]

    def stats(self) -> dict[str, Any]:
        """Bytes used and capacity per tier, hits and misses, bytes and seconds per link, and
        prefetch counters, as plain (JSON-ready) data."""
        self._require_open()
        counters = self.counters.to_dict()
        tiers = {}
        for tier in self._tiers:
            tiers[tier.name] = {
                "used": tier.used,
                "capacity": tier.capacity,
                "entries": sum(1 for e in self._entries.values() if e.valid(self._index(tier)) is not None),
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
        through. See README, "Durability".
        """
        self._require_open()
        key = check_key(key)
        through = self.durable if durable is None else bool(durable)
        if through and self._disk_index is None:
            raise UnknownTierError("durable=True needs a disk tier to write through to; this store has none")
        tensor = check_tensor(tensor).detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        meta = TensorMeta.of(tensor)
        src = as_bytes(tensor)
        targets = [self._index(tier)] if tier is not None else list(range(len(self._tiers)))
        entry = self._entries.get(key)
        if entry is not None:
            await self._no_writer(entry, "put")
            entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry(key, meta)
        entry.pending_writes += 1
        try:
            failures: list[TierFullError] = []
            for t in targets:
                try:
                    if t == self._disk_index:
                        copied = asyncio.get_running_loop().create_future()
                        await self._shielded(self._write_disk(entry, src, meta, None, Priority.DEMAND, copied=copied), copied)
                    else:
                        await self._put_memory(entry, t, src, meta)
                        if through:
                            await self._write_through(key)
                    self._observe("put", key, meta.nbytes, t, hit=None)
                    return
                except TierFullError as exc:
                    failures.append(exc)
            if len(failures) == 1:
                raise failures[0]
            raise TierFullError(
                f"no tier has room for {key!r} ({format_bytes(meta.nbytes)}): " + "; ".join(str(f) for f in failures)
            )
        finally:
            entry.pending_writes -= 1
            if not entry.visible and entry.pending_writes == 0 and self._entries.get(key) is entry:
                del self._entries[key]

    async def _write_through(self, key: str) -> None:
        """Write the value a put just installed down to the disk tier (the put's own copy: the
        caller's memory is not read again)."""
        entry = self._entries.get(key)
        if entry is None or self._disk_index is None or entry.valid(self._disk_index) is not None:
            return
        tiers = entry.readable_tiers()
        source = entry.valid(tiers[0]) if tiers else None
        if source is None or source.buffer is None:
            return  # replaced meanwhile: the newer put answers for its own durability
        self._use(entry, source)
        try:
            await self._shielded(self._write_back(entry, source, Priority.DEMAND, target=self._disk_index))
        finally:
            self._unuse(entry, source)

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
        self._require_open()
        t = self._index(tier)
        entry = self._visible(key)
        device = self._tiers[t].device if isinstance(self._tiers[t], MemoryTier) else torch.device("cpu")  # type: ignore[attr-defined]
        if out is not None:
            _check_out(out, entry.meta, device)
        await self._no_writer(entry, "get")
        entry = self._visible(key)
        copy = entry.valid(t)
        hit = copy is not None
        self._count(t, hit, entry)
        self._observe("get", key, entry.meta.nbytes, t, hit=hit)
        if t == self._disk_index:
            return await self._read_uncached(entry, device, out)
        if copy is not None:
            self._hit(entry, copy)
            if copy.buffer is not None and entry.meta.nbytes <= INLINE_COPY_BYTES and copy.buffer.device.type == "cpu":
                if out is None:
                    out = torch.empty(entry.meta.shape, dtype=entry.meta.dtype)
                cpu_copy(as_bytes(out), copy.buffer[: entry.meta.nbytes])
                return out
        try:
            copy = await self._acquire(entry, t, Priority.DEMAND)
        except TierFullError:
            return await self._read_uncached(entry, device, out)
        try:
            return await self._clone(entry, copy, t, out)
        finally:
            self._unuse(entry, copy)

    async def pop(self, key: str, tier: TierRef = None) -> torch.Tensor:
        """Remove ``key`` and return its value on ``tier``'s device (default: the fastest tier).

        When the current value already sits in that tier's device memory (on that tier, or on
        a host tier when the CPU stands in for the device), unheld and unused, its buffer leaves
        the store and is returned as it is (no copy; the tier's accounting drops it); otherwise
        the value is read from its fastest copy."""
        self._require_open()
        t = self._index(tier)
        entry = self._visible(key)
        await self._no_writer(entry, "pop")
        entry = self._visible(key)
        if entry.held():
            raise EntryHeldError(f"{key!r} is held; release it before popping it")
        copy = entry.valid(t)
        hit = copy is not None
        self._count(t, hit, entry)
        self._observe("get", key, entry.meta.nbytes, t, hit=hit)
        tier_obj = self._tiers[t]
        device = tier_obj.device if isinstance(tier_obj, MemoryTier) else torch.device("cpu")
        # A buffer already in the requested device's memory can be handed over: the asked tier's
        # own copy, or (the CPU standing in for the device) a host copy in the same memory.
        candidates = [copy] if copy is not None else []
        candidates += [c for u in entry.valid_tiers() if (c := entry.valid(u)) is not None and c is not copy]
        for candidate in candidates:
            owner = self._tiers[candidate.tier]
            if (
                candidate.users == 0
                and candidate.buffer is not None
                and isinstance(owner, MemoryTier)
                and owner.device == device
                and not owner.pinned
                and owner.can_hand_over(candidate.buffer)
            ):
                buffer = candidate.buffer
                self._retire(entry, candidate.tier, candidate)  # releases the buffer into the pool ...
                owner.forget(buffer)  # ... from which it leaves the tier, handed to the caller
                value = from_bytes(buffer, entry.meta)
                break
        else:
            value = await self._read_uncached(entry, device)
        await self._shielded(self._delete(entry))
        return value

    async def read(self, key: str) -> torch.Tensor:
        """The value of ``key`` as a new CPU tensor, read from wherever it is, moving nothing
        (for snapshots and inspection: no promotion, no eviction, no hit or miss counted)."""
        self._require_open()
        entry = self._visible(key)
        await self._no_writer(entry, "read")
        return await self._read_uncached(self._visible(key), torch.device("cpu"))

    async def export_zarr(self, path: str | Path, overwrite: bool = False) -> int:
        """Write every entry as a zarr v3 array under ``path`` (see ``tierstore.snapshot``)."""
        from .snapshot import export_zarr

        self._require_open()
        return await export_zarr(self, path, overwrite)

    async def import_zarr(self, path: str | Path, tier: TierRef = None) -> int:
        """Put every array of the zarr group at ``path`` into the store."""
        from .snapshot import import_zarr

        self._require_open()
        return await import_zarr(self, path, tier)

    async def delete(self, key: str) -> None:
        """Remove ``key`` from every tier (and from the disk catalog)."""
        self._require_open()
        entry = self._visible(key)
        if entry.held():
            raise EntryHeldError(f"{key!r} is held; release it before deleting")
        await self._shielded(self._delete(entry))
        self._observe("delete", key, entry.meta.nbytes, None, hit=None)

    @asynccontextmanager
    async def hold(self, key: str, tier: TierRef = None, write: bool = False) -> AsyncIterator[torch.Tensor]:
        """Pin ``key`` on a memory tier (default: the fastest) and yield the store's own buffer.

        While held the entry cannot be evicted from that tier. With ``write=True`` the yielded
        tensor may be changed in place, and the changes become the new value when the hold is
        released (they reach the disk on eviction, ``flush`` or close). A write hold is
        exclusive: it waits until no one else reads, copies or holds that copy, and until it
        ends, every other reader of ``key`` (get, flush, prefetch, another hold) waits; code
        inside the write hold that reads ``key`` through the store gets ``EntryHeldError``
        instead of waiting for itself. Read holds share the buffer with each other; a put
        while one is open replaces the value without changing the held buffer.
        """
        self._require_open()
        t = self._index(tier)
        if not isinstance(self._tiers[t], MemoryTier):
            raise UnknownTierError(f"hold needs a memory tier; {self._names[t]!r} is a {self._tiers[t].kind} tier")
        entry = self._visible(key)
        await self._no_writer(entry, "hold")
        entry = self._visible(key)
        hit = entry.valid(t) is not None
        self._count(t, hit, entry)
        self._observe("hold", key, entry.meta.nbytes, t, hit=hit)
        copy = await self._take_hold(entry, t, write, hit)
        token = holds.new_token()
        holds.enter(token)
        entry.hold_tokens.add(token)
        if write:
            copy.writing = True
            entry.writer, entry.writer_token = copy, token
        try:
            yield from_bytes(copy.buffer, entry.meta)  # type: ignore[arg-type]
        finally:
            holds.leave(token)
            entry.hold_tokens.discard(token)
            copy.holds -= 1
            if write:
                copy.writing = False
                entry.writer, entry.writer_token = None, 0
                if self._entries.get(entry.key) is entry and entry.copies.get(t) is copy and copy.version == entry.version:
                    self._new_version(entry, keep=copy)  # the changes are the value from now on
            self._unuse(entry, copy)

    async def _take_hold(self, entry: Entry, t: int, write: bool, hit: bool) -> Copy:
        """A copy of ``entry`` on tier ``t`` with a use and a hold taken; for a write hold, once
        no one else uses that copy and no other write hold is open."""

        def free_to_write() -> bool:
            copy = entry.copies.get(t)
            return entry.writer is None and (copy is None or copy.users == 0)

        while True:
            copy = await self._acquire(entry, t, Priority.DEMAND)
            if entry.writer is None and (not write or copy.users == 1):
                break
            self._unuse(entry, copy)
            if write and any(holds.inside(token) for token in entry.hold_tokens):
                raise EntryHeldError(f"a write hold of {entry.key!r} cannot start inside your own hold of it")
            await self._no_writer(entry, "hold")
            if write:
                await self._wait_until(entry, free_to_write)
            hit = False
        if hit:
            self._hit(entry, copy)
        copy.holds += 1
        return copy

    async def prefetch(self, keys: Iterable[str], tier: TierRef = None) -> PrefetchHandle:
        """Start bringing ``keys`` up to ``tier`` (default: the fastest) in the background, behind
        every demand request. Returns at once with a handle: ``await handle`` waits (and returns
        a summary), ``handle.cancel()`` stops what has not started."""
        self._require_open()
        t = self._index(tier)
        entries = [self._visible(key) for key in keys]
        if self._issuer is None:
            raise StoreClosedError("the store is not open")
        return self._issuer.start(entries, t)

    async def flush(self) -> None:
        """Write every entry whose current value is not on the disk tier down to it, in one
        catalog transaction: after a crash, either every value this flush wrote is there or
        none is. Refuses (``TierFullError``, nothing written) when the disk tier has no room for
        the copy-on-write of all of them. Waits for other tasks' write holds; raises
        ``EntryHeldError`` inside the caller's own."""
        self._require_open()
        await self._flush_all()

    def mark_step(self) -> None:
        """Mark the end of a repeated phase (a training step) for the prefetch policy and trace."""
        self.prefetch_policy.on_step()
        if self.trace is not None:
            self.trace.mark_step()

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"TierStore({self._tiers!r}, {state}, {len(self._entries)} keys)"


def _check_out(out: object, meta: TensorMeta, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise InvalidTensorError(f"out must be a tensor, not {type(out).__name__}")
    if out.dtype != meta.dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensorError(f"out is {out.dtype} {tuple(out.shape)}; the value is {meta.dtype} {meta.shape}")
    if not out.is_contiguous() or out.layout != torch.strided:
        raise InvalidTensorError("out must be a contiguous dense tensor")
    if out.device.type != device.type:
        raise InvalidTensorError(f"out is on {out.device}; this read delivers to {device}")
