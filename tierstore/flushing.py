"""Flushing: every value whose newest copy is only in memory goes down to the disk tier in
one catalog transaction (or, when closing and one does not fit, in several).

The order, for crash safety: the room is checked first; each value is written to a new extent
(its old extent stays the durable base); each data file is synced once; one catalog commit;
then the old extents are freed. The sources are in use throughout, so no write hold starts on
them and no eviction frees them while they are read.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .disk.catalog import DiskRecord
from .disk.extents import Extent
from .entry import Copy, Entry
from .errors import TierFullError
from .gcpause import gc_paused
from .tensors import TensorMeta
from .units import format_bytes
from .workers import Priority

if TYPE_CHECKING:
    from .engine import Engine
    from .tiers.disk import DiskTier

#: Values a flush writes at once (enough to keep the disk's queue full).
FLUSH_CONCURRENCY = 8


async def flush_all(engine: Engine, whole: bool = True) -> None:
    """Write every entry whose current value is not on the disk tier down to it, and commit
    them all in one catalog transaction (after a crash the flush is all old or all new).

    Order: room checked first; each value written to a new extent (the old one stays the
    durable base); one fdatasync per segment; one catalog commit; then the old extents are
    freed. Sources are in use throughout, so no write hold starts on them meanwhile.
    ``whole=False`` (closing): when the copy-on-write of everything does not fit at once,
    write in several transactions, each as large as the free space then (every commit frees
    the old extents it replaces). Returns once the catalog changes queued before it (small
    values acknowledged before their commit) are committed as well."""
    d = engine.disk_index
    if d is None:
        return
    disk = engine.disk

    def dirty() -> list[Entry]:
        return [e for e in engine.entries.values() if e.visible and e.valid(d) is None]

    await engine.no_writers(dirty, "flush")  # others' write holds (the caller's own raise), holding nothing meanwhile
    plan: list[tuple[Entry, Copy]] = []
    with gc_paused():  # (only around what makes objects per key: never across an await)
        for entry in sorted(dirty(), key=lambda e: e.key):  # no await from the check to here
            tiers = entry.readable_tiers()
            source = entry.valid(tiers[0]) if tiers else None
            if source is not None:
                engine.use(entry, source)  # no write hold can start on it now
                plan.append((entry, source))
    while plan:
        free = disk.capacity - disk.used
        sizes = [disk.stored_size(entry.meta.nbytes) for entry, _ in plan]
        batch = len(plan)
        if sum(sizes) > free:
            batch = 0 if whole else next(i for i in range(len(sizes) + 1) if sum(sizes[: i + 1]) > free)
        if batch == 0:
            for entry, source in plan:
                engine.unuse(entry, source)
            raise TierFullError(
                f"flush needs {format_bytes(sum(sizes))} on tier {disk.name!r} for {len(plan)} entries (copy-on-write: "
                f"the old values stay until the commit); {format_bytes(free)} of {format_bytes(disk.capacity)} is free. "
                + ("Nothing was written." if whole else "What did not fit is still in memory.")
            )
        # the write owns the uses from here: a cancelled caller leaves it running
        await engine.shielded(_flush_plan(engine, disk, d, plan[:batch]))
        plan = plan[batch:]
    # Small puts acknowledged before their commit (non-durable tier) are committed too: after
    # flush() returns, a kill -9 loses none of them. Raises if they cannot commit (they stay
    # queued, and readable).
    await disk.drain()

async def _flush_plan(engine: Engine, disk: DiskTier, d: int, plan: list[tuple[Entry, Copy]]) -> None:
    """Write and commit ``plan`` (entries with a use taken of their source), then let the
    sources go."""
    try:
        await _flush_locked(engine, disk, d, plan)
    finally:
        for entry, source in plan:
            engine.unuse(entry, source)

async def _flush_locked(engine: Engine, disk: DiskTier, d: int, plan: list[tuple[Entry, Copy]]) -> None:
    locks: list[asyncio.Lock] = []
    try:
        for entry, _ in plan:  # sorted by key: two flushes never wait for each other in a cycle
            lock = entry.disk_lock
            await lock.acquire()
            locks.append(lock)
        await _flush_plan_locked(engine, disk, d, plan)
    finally:
        for lock in locks:
            lock.release()
        for entry, _ in plan:
            entry.forget_idle_lock()  # (a flush of a million keys keeps no million locks)


async def _flush_plan_locked(engine: Engine, disk: DiskTier, d: int, plan: list[tuple[Entry, Copy]]) -> None:
    # The metadata of each source's value is taken now: a put without an await (a small value
    # onto memory, ``Engine.put_memory_now``) may give the entry a new value, of another size,
    # while the writes below are in flight; the source keeps the old one (it is in use).
    with gc_paused():  # (10^5 small keys make 10^5 tuples here: no full collection meanwhile)
        planned = [(e, c, e.meta) for e, c in plan if engine.entries.get(e.key) is e and c.version == e.version and not c.retired]
        # Small values go inline into their records, built here at once (no extent, no I/O
        # task): a flush of many small keys is one transaction.
        small = [(e, c, m) for e, c, m in planned if disk.holds_inline(m.nbytes)]
        large = [(e, c, m) for e, c, m in planned if not disk.holds_inline(m.nbytes)]
    inline: list[tuple[Entry, Copy, bytes, TensorMeta]] = []
    limit = asyncio.Semaphore(FLUSH_CONCURRENCY)
    written: list[tuple[Entry, Copy, Extent, tuple[int, ...], TensorMeta]] = []

    async def write(entry: Entry, source: Copy, meta: TensorMeta) -> None:
        async with limit:
            extent = await disk.allocate(meta.nbytes)
            try:
                started = time.perf_counter()
                checksums = await disk.write(extent, source.buffer, meta.nbytes, Priority.BACKGROUND, sync=False)  # type: ignore[arg-type]
            except BaseException:
                disk.release(extent)
                raise
            written.append((entry, source, extent, checksums, meta))
            engine.count_link(source.tier, d, extent.length, time.perf_counter() - started)  # (whole blocks cross)

    tasks = [asyncio.ensure_future(write(entry, source, meta)) for entry, source, meta in large]
    try:
        started = time.perf_counter()
        with gc_paused():
            for entry, source, meta in small:
                disk.reserve_inline(meta.nbytes)
                try:  # (the record in its binary form: no record object per key)
                    record = disk.inline_raw(entry.key, meta, source.payload(meta.nbytes), source.version)
                except BaseException:
                    disk.release_inline(meta.nbytes)
                    raise
                inline.append((entry, source, record, meta))
        if inline:
            engine.count_link(small[0][1].tier, d, sum(m.nbytes for _, _, m in small), time.perf_counter() - started)
        await asyncio.gather(*tasks)
        await disk.sync_segments({extent.segment for _, _, extent, _, _ in written})
        with gc_paused():
            changes: list[tuple[str, DiskRecord | bytes | None]] = [
                (e.key, DiskRecord(e.key, m, extent, c.version, sums)) for e, c, extent, sums, m in written
            ]
            changes += [(e.key, record) for e, _, record, _ in inline]
            await disk.commit(changes)  # (it makes objects per key too; it waits for no hold)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, _, extent, _, _ in written:
            disk.release(extent)
        for _, _, _, meta in inline:
            disk.release_inline(meta.nbytes)
        raise
    with gc_paused():
        installed = [(e, c, Copy(d, c.version, extent=extent, checksums=sums)) for e, c, extent, sums, _ in written]
        installed += [(e, c, Copy(d, c.version, inline=m.nbytes)) for e, c, _, m in inline]
        writebacks = [0] * len(engine.names)
        for entry, source, new in installed:
            engine.install_disk(entry, d, new, None)
            writebacks[source.tier] += 1
            if entry.version == source.version:
                engine.observe("writeback", entry.key, entry.meta.nbytes, d, hit=None)
        for t, count in enumerate(writebacks):
            if count:
                engine.counters.tier(engine.names[t]).writebacks += count
        # The per-key tuples freed while paused: the collector, back on, finds no young
        # objects of this flush to walk (at 10^5 keys that walk cost a fifth of the flush).
        del installed, changes, inline, planned, small, large
