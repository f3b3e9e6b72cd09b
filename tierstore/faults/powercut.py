"""Power loss, in the manner of ALICE (Pillai et al., OSDI'14): record, cut, rebuild, check.

A kill -9 leaves the page cache behind, so it cannot tell whether each step of the disk tier's
write order reached stable storage before the next began. Here a workload runs against a real
``DiskTier`` whose file and catalog calls go through a :class:`Recorder` (``DiskTier(io=...)``):
every data write (with a copy of its bytes), ``fdatasync``/``fsync``, file creation, truncation
and reservation, and every catalog commit (its records, as one atomic step that begins and
ends), interleaved with the workload's own intent/acknowledgement notes. :func:`explore` then
builds the disk states a power cut at many points could leave, reopens a store on each and
checks it with the acknowledgement log (as ``tierstore.faults.crash`` does after a kill):

- every put acknowledged as durable before the cut reads back with exactly its bytes, and every
  acknowledged delete stays deleted (otherwise *lost*);
- any other key reads back one of the values it was given or that an operation in flight at the
  cut could leave, or raises ``CorruptionError`` (*caught*); never other bytes (*wrong*) and
  never a non-tierstore exception;
- the store opens and keeps working (a put, get and delete);
- a ``flush`` in flight at the cut left all of the keys it wrote old, or all new (*torn flush*).

What LMDB promises with the catalog's flags
-------------------------------------------
``Catalog`` opens LMDB with ``sync=durable, metasync=durable`` and the defaults
``writemap=False, map_async=False, lock=True``. With ``durable`` (what the explorer checks):
LMDB writes a transaction's pages copy-on-write beside the live tree, ``fdatasync``s them, then
writes the new meta page (one of two, alternating) and ``fdatasync``s again before commit
returns. A power cut at any moment leaves one of the two meta pages valid, so the catalog holds
exactly the transactions whose commit returned, plus possibly the one in progress, whole:
each commit is atomic and, once it returns, durable (given a drive that honours cache flushes).
With ``writemap=False`` pages are written with ``pwrite``, never through a writable map, so a
stray store into memory cannot reach the file. LMDB syncs only its own file: a commit says
nothing about data-file writes; ordering them is the disk tier's job (data, ``fdatasync``,
then commit). With ``durable=False`` nothing is synced and a power cut may lose any recent
transaction, but never leaves a torn one (the meta page is written last).

What the explorer assumes (the abstract persistence model)
----------------------------------------------------------
- A write to a data file is on stable storage once an ``fdatasync`` or ``fsync`` of that file
  returned after it. Until then it may be lost, may land while earlier unsynced writes do not
  (reordering), and may land in part: any subset of its 512-byte sectors (torn).
- A size change (``ftruncate``, ``posix_fallocate``) persists with the file's next sync; a new
  file's name persists when its folder is ``fsync``ed.
- A catalog commit is atomic; at a cut it is in the state if it returned before the cut, and
  may be (whole) if it was under way.
- Values are regenerated from (key, version) by :func:`value_for`; nothing is pickled.

The recording follows thread timing (several puts run at once), so the exact event order may
differ between runs; the cuts and choices taken from it are fixed by ``seed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..disk.catalog import Catalog, CatalogLayout, DiskRecord
from ..disk.files import FileIO
from ..errors import CorruptionError, TierStoreError
from ..store import TierStore
from ..tensors import ALIGNMENT, as_bytes
from ..tiers import DiskTier, HostTier
from ..units import parse_bytes, round_up

#: The unit a write can be torn into: a disk sector.
SECTOR = 512
CAPACITY = "64MiB"
CHUNK_SIZE = "16KiB"
#: Small enough that the two-tier phase demotes values to disk before it flushes.
HOST_CAPACITY = "192KiB"
KEYS = 24


# -- the record ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileOp:
    """One call that changes a data file: ``create``, ``write``, ``truncate``, ``reserve``
    (``posix_fallocate``), ``punch`` (a hole: the range reads zeros), ``unlink``, ``datasync``,
    ``sync`` (``fsync``) or ``dirsync``."""

    kind: Literal["create", "write", "truncate", "reserve", "punch", "unlink", "datasync", "sync", "dirsync"]
    file: str
    offset: int = 0
    data: bytes = b""
    length: int = 0


@dataclass(frozen=True)
class CommitBegin:
    """A catalog transaction starts: ``changes`` (key -> record, None deletes) and the new
    format record, if any."""

    commit: int
    changes: tuple[tuple[str, DiskRecord | None], ...]
    layout: CatalogLayout | None


@dataclass(frozen=True)
class CommitEnd:
    """The catalog transaction ``commit`` returned: it is durable."""

    commit: int


@dataclass(frozen=True)
class Note:
    """The workload's log: ``intent`` before an operation, ``ack`` once it returned.

    ``durable`` puts are acknowledged as kept; the others (a put to the host tier) are kept once
    a ``flush`` is acknowledged. A flush names every key's value (``values``) and the keys it
    has to write (``writes``, those not yet valid on disk)."""

    stage: Literal["intent", "ack"]
    op: Literal["put", "delete", "flush"]
    key: str = ""
    version: int | None = None
    durable: bool = True
    values: tuple[tuple[str, int], ...] = ()
    writes: tuple[str, ...] = ()


Event = FileOp | CommitBegin | CommitEnd | Note


class Recorder(FileIO):
    """A ``FileIO`` that performs each call and logs it, in order, with the workload's notes.

    Parameters
    ----------
    drop_fdatasync:
        The mutation: ``fdatasync`` is neither performed nor logged, as if the disk tier's sync
        before its catalog commit had been removed. The explorer must then find lost puts.
    """

    def __init__(self, drop_fdatasync: bool = False) -> None:
        self.drop_fdatasync = drop_fdatasync
        self.events: list[Event] = []
        self._names: dict[int, str] = {}
        self._commits = 0
        self._lock = threading.Lock()

    def note(self, note: Note) -> None:
        """Append a workload note (intent or acknowledgement)."""
        self._log(note)

    def _log(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def open(self, path: Path, flags: int, mode: int) -> int:
        fd = super().open(path, flags, mode)
        self._names[fd] = Path(path).name
        if flags & os.O_CREAT:
            self._log(FileOp("create", Path(path).name))
        return fd

    def close(self, fd: int) -> None:
        self._names.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        written = super().pwrite(fd, data, offset)
        self._log(FileOp("write", self._names[fd], offset, bytes(data[:written])))
        return written

    def ftruncate(self, fd: int, length: int) -> None:
        super().ftruncate(fd, length)
        self._log(FileOp("truncate", self._names[fd], length=length))

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        super().fallocate(fd, offset, length)
        self._log(FileOp("reserve", self._names[fd], offset, length=length))

    def punch_hole(self, fd: int, offset: int, length: int) -> None:
        super().punch_hole(fd, offset, length)
        self._log(FileOp("punch", self._names[fd], offset, length=length))

    def unlink(self, path: Path) -> None:
        super().unlink(path)
        self._log(FileOp("unlink", Path(path).name))

    def fdatasync(self, fd: int) -> None:
        if self.drop_fdatasync:
            return
        super().fdatasync(fd)
        self._log(FileOp("datasync", self._names[fd]))

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        self._log(FileOp("sync", self._names[fd]))

    def fsync_dir(self, folder: Path) -> None:
        super().fsync_dir(folder)
        self._log(FileOp("dirsync", Path(folder).name))

    @contextlib.contextmanager
    def catalog_commit(
        self, changes: Sequence[tuple[str, DiskRecord | None]], layout: CatalogLayout | None
    ) -> Iterator[None]:
        with self._lock:
            self._commits += 1
            commit = self._commits
            self.events.append(CommitBegin(commit, tuple(changes), layout))
        yield  # an exception leaves the commit under way for good: it may or may not be in
        self._log(CommitEnd(commit))


# -- the workload -----------------------------------------------------------------------------


def value_for(key: str, version: int) -> torch.Tensor:
    """Version ``version`` of ``key``: seeded random bytes, 0 to ~48 KiB, of a random dtype."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{version}".encode(), digest_size=8).digest(), "little")
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.uint8, torch.bfloat16, torch.int64])
    nbytes = rng.choice([0, 1, rng.randrange(2, 4096), rng.randrange(4096, 48 << 10)])
    numel = nbytes // dtype.itemsize
    generator = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype) if numel else torch.empty(0, dtype=dtype)


def open_tier(root: Path, io: FileIO | None = None) -> DiskTier:
    """The durable disk tier the workload writes and the checker reopens."""
    return DiskTier(root, CAPACITY, durable=True, chunk_size=CHUNK_SIZE, io=io)


async def _random_ops(
    store: TierStore, recorder: Recorder, rng: random.Random, count: int, concurrency: int,
    durable: float, current: dict[str, int],
) -> None:
    """``count`` puts, overwrites and deletes, ``concurrency`` at a time on distinct keys; a
    put is written through (``durable=True``) with probability ``durable``."""

    async def one(key: str) -> None:
        if key in current and rng.random() < 0.25:
            recorder.note(Note("intent", "delete", key))
            await store.delete(key)
            del current[key]
            recorder.note(Note("ack", "delete", key))
        else:
            version = rng.getrandbits(40)
            through = rng.random() < durable
            recorder.note(Note("intent", "put", key, version, through))
            await store.put(key, value_for(key, version), durable=through)
            current[key] = version
            recorder.note(Note("ack", "put", key, version, through))

    done = 0
    while done < count:
        keys = rng.sample([f"k{i}" for i in range(KEYS)], min(concurrency, count - done))
        await asyncio.gather(*(one(key) for key in keys))
        done += len(keys)


async def record_workload(root: Path, recorder: Recorder, seed: int = 0, operations: int = 120, concurrency: int = 3) -> None:
    """Run the workload on a new folder ``root``, logging into ``recorder``.

    Half of ``operations`` go to ``TierStore([DiskTier])`` (durable puts, overwrites, deletes);
    the rest to ``TierStore([HostTier, DiskTier])`` in rounds, each ended by a ``flush``
    (most puts land on the host tier, some are demoted to disk, the flush writes the rest in
    one transaction; a few are written through with ``durable=True``)."""
    rng = random.Random(seed)
    current: dict[str, int] = {}
    async with TierStore([open_tier(root, recorder)]) as store:
        await _random_ops(store, recorder, rng, operations // 2, concurrency, 1.0, current)
    rounds = 3
    async with TierStore([HostTier(HOST_CAPACITY, pinned=False), open_tier(root, recorder)]) as store:
        for _ in range(rounds):
            await _random_ops(store, recorder, rng, (operations - operations // 2) // rounds, concurrency, 0.2, current)
            values = tuple(sorted(current.items()))
            writes = tuple(key for key, _ in values if "disk" not in store.where(key))
            recorder.note(Note("intent", "flush", values=values, writes=writes))
            await store.flush()
            recorder.note(Note("ack", "flush", values=values, writes=writes))


# -- expectations ---------------------------------------------------------------------------------


@dataclass
class Expect:
    """What a key may hold at a cut: its durable value (a version, or None: absent) and what
    operations since then may have left instead."""

    durable: int | None = None
    maybe: set[int | None] = field(default_factory=set)


class Ledger:
    """The notes replayed up to a cut."""

    def __init__(self) -> None:
        self.keys: dict[str, Expect] = {}
        self.flush: Note | None = None  # a flush under way

    def apply(self, note: Note) -> None:
        if note.op == "flush":
            self.flush = note if note.stage == "intent" else None
            if note.stage == "ack":
                kept = dict(note.values)
                for key, expect in self.keys.items():
                    expect.durable, expect.maybe = kept.get(key), set()
            return
        expect = self.keys.setdefault(note.key, Expect())
        if note.stage == "intent":
            expect.maybe.add(note.version)
        elif note.op == "delete" or note.durable:
            expect.durable, expect.maybe = note.version, set()


# -- states ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """One disk state: the events before ``at`` happened; of the unsynced file operations
    ``landed`` persisted (in that order; ``torn`` maps one to the sectors of it that did), and
    of the commits under way ``committed`` did."""

    at: int
    variant: str
    landed: tuple[int, ...]
    torn: tuple[int, tuple[int, ...]] | None
    committed: tuple[int, ...]


def _unsynced_and_pending(events: Sequence[Event], at: int) -> tuple[list[int], list[int], list[int]]:
    """File operations before ``at`` that are surely on disk, those that may be, and the
    commits under way at ``at``."""
    last_sync: dict[str, int] = {}
    dir_synced: int = -1
    ended: set[int] = set()
    for i in range(at):
        event = events[i]
        if isinstance(event, FileOp) and event.kind in ("datasync", "sync"):
            last_sync[event.file] = i
        elif isinstance(event, FileOp) and event.kind == "dirsync":
            dir_synced = i
        elif isinstance(event, CommitEnd):
            ended.add(event.commit)
    sure: list[int] = []
    maybe: list[int] = []
    pending: list[int] = []
    for i in range(at):
        event = events[i]
        if isinstance(event, FileOp) and event.kind not in ("datasync", "sync", "dirsync"):
            synced = dir_synced if event.kind in ("create", "unlink") else last_sync.get(event.file, -1)
            (sure if i < synced else maybe).append(i)
        elif isinstance(event, CommitBegin) and event.commit not in ended:
            pending.append(i)
    return sure, maybe, pending


def plan_cuts(events: Sequence[Event], states: int, seed: int = 0, points: Sequence[int] | None = None) -> list[Cut]:
    """About ``states`` cuts: cut points spread over the recording, half of them (or all, if
    there are few) where a catalog commit is under way -- first those of several keys (a
    flush) -- each with several variants of what persisted. ``points`` fixes the cut points
    instead (to look again at a cut a report named)."""
    rng = random.Random(seed)
    variants = ("none", "all", "subset", "torn", "reorder")
    every = [i + 1 for i, event in enumerate(events) if not isinstance(event, Note)]
    wanted = min(len(every), max(1, states // len(variants)))
    groups = [i + 1 for i, event in enumerate(events) if isinstance(event, CommitBegin) and len(event.changes) > 1]
    under_way = [i + 1 for i, event in enumerate(events) if isinstance(event, CommitBegin) and len(event.changes) <= 1]
    chosen = set(rng.sample(groups, min(len(groups), wanted // 4)))
    chosen.update(rng.sample(under_way, min(len(under_way), wanted // 2 - len(chosen))))
    rest = [point for point in every if point not in chosen]
    chosen.update(rng.sample(rest, min(len(rest), wanted - len(chosen))))
    if points is not None:
        chosen = set(points)
    cuts: list[Cut] = []
    for at in sorted(chosen):
        _, maybe, pending = _unsynced_and_pending(events, at)
        writes = [i for i in maybe if isinstance(events[i], FileOp) and events[i].kind == "write"]  # type: ignore[union-attr]
        for variant in variants:
            landed = list(maybe)
            torn = None
            if variant == "none":
                landed = []
            elif variant in ("subset", "torn", "reorder"):
                landed = [i for i in maybe if rng.random() < 0.5]
            if variant == "torn" and writes:
                victim = rng.choice(writes)
                if victim not in landed:
                    landed.append(victim)
                    landed.sort()
                sectors = -(-len(events[victim].data) // SECTOR)  # type: ignore[union-attr]
                torn = (victim, tuple(s for s in range(sectors) if rng.random() < 0.5))
            if variant == "reorder":
                rng.shuffle(landed)
            committed = {"none": [], "all": pending}.get(variant, [i for i in pending if rng.random() < 0.5])
            cuts.append(Cut(at, variant, tuple(landed), torn, tuple(committed)))
    return cuts


def _materialise_files(events: Sequence[Event], cut: Cut, data: Path) -> None:
    sure, _, _ = _unsynced_and_pending(events, cut.at)
    order = sorted({*sure, *cut.landed})
    # Reordering moves writes among the places of the landed writes; other calls keep theirs.
    moved = [i for i in cut.landed if isinstance(events[i], FileOp) and events[i].kind == "write"]  # type: ignore[union-attr]
    places, movable = iter(moved), set(moved)
    order = [next(places) if i in movable else i for i in order]
    fds: dict[str, int] = {}
    try:
        for i in order:
            op = events[i]
            if not isinstance(op, FileOp):
                continue
            path = data / op.file
            if op.kind == "unlink":
                if op.file in fds:
                    os.close(fds.pop(op.file))
                path.unlink(missing_ok=True)
                continue
            if op.kind == "create":
                if op.file in fds:
                    os.close(fds.pop(op.file))
                fds[op.file] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                continue
            fd = fds.get(op.file)
            if fd is None:
                continue  # its creation did not persist: neither does anything done to it
            if op.kind == "truncate":
                os.ftruncate(fd, op.length)
            elif op.kind == "reserve":
                if os.fstat(fd).st_size < op.offset + op.length:
                    os.ftruncate(fd, op.offset + op.length)  # sparse: the content is zeros either way
            elif op.kind == "punch":
                os.pwrite(fd, bytes(op.length), op.offset)
            elif cut.torn is not None and cut.torn[0] == i:
                for sector in cut.torn[1]:
                    os.pwrite(fd, op.data[sector * SECTOR : (sector + 1) * SECTOR], op.offset + sector * SECTOR)
            else:
                os.pwrite(fd, op.data, op.offset)
    finally:
        for fd in fds.values():
            os.close(fd)


async def _materialise_catalog(events: Sequence[Event], cut: Cut, path: Path, first: CatalogLayout) -> None:
    ended = {e.commit for e in events[: cut.at] if isinstance(e, CommitEnd)}
    layout = first
    records: dict[str, DiskRecord | None] = {}
    for i in range(cut.at):
        event = events[i]
        if isinstance(event, CommitBegin) and (event.commit in ended or i in cut.committed):
            records.update(event.changes)
            layout = event.layout or layout
    catalog = Catalog(path, durable=False)
    catalog.open(layout)
    try:
        live: list[tuple[str, DiskRecord | None]] = [(key, record) for key, record in records.items() if record is not None]
        if live:
            await catalog.commit(live)
    finally:
        catalog.close()


# -- checking -------------------------------------------------------------------------------------


@dataclass
class PowerCutReport:
    """What :func:`explore` tried and found; ``problems`` holds one line per finding."""

    states: int = 0
    cut_points: int = 0
    events: int = 0
    acknowledged: int = 0
    checked_keys: int = 0
    caught: int = 0
    lost: int = 0
    wrong: int = 0
    torn_flushes: int = 0
    flushes_under_way: int = 0
    refused: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def failures(self) -> int:
        """Lost or wrong values, torn flushes and refusals to open."""
        return self.lost + self.wrong + self.torn_flushes + self.refused


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(as_bytes(a), as_bytes(b)))


async def _check_state(root: Path, ledger: Ledger, cut: Cut, report: PowerCutReport) -> None:
    where = f"cut {cut.at} ({cut.variant})"
    try:
        store = await TierStore([open_tier(root)]).open()
    except TierStoreError as exc:
        report.refused += 1
        report.problems.append(f"{where}: the store refused to open: {exc}")
        return
    try:
        for key in sorted(set(store.keys()) - set(ledger.keys)):
            report.wrong += 1
            report.problems.append(f"{where}: {key!r} is in the store but was never written")
        found: dict[str, set[int | None]] = {}  # versions the value read could be (equal bytes)
        for key, expect in sorted(ledger.keys.items()):
            report.checked_keys += 1
            allowed = {expect.durable, *expect.maybe}
            if key not in store:
                found[key] = {None}
                if None not in allowed:
                    report.lost += 1
                    report.problems.append(f"{where}: {key!r} is missing (allowed versions {sorted(map(str, allowed))})")
                continue
            try:
                value = await store.get(key)
            except CorruptionError as exc:
                if expect.maybe:
                    report.caught += 1
                else:
                    report.lost += 1
                    report.problems.append(f"{where}: acknowledged {key!r} v{expect.durable} is unreadable: {exc}")
                continue
            match = [v for v in allowed if v is not None and _same(value, value_for(key, v))]
            if not match:
                report.wrong += 1
                report.problems.append(f"{where}: {key!r} holds bytes of no allowed version ({sorted(map(str, allowed))})")
                continue
            found[key] = set(match)
        flush = ledger.flush
        if flush is not None and flush.writes:
            report.flushes_under_way += 1
            new = dict(flush.values)
            # A value equal in bytes to the one before (an empty tensor) tells nothing: skipped.
            landed = [key for key in flush.writes if found.get(key) == {new[key]}]
            stayed = [key for key in flush.writes if key in found and new[key] not in found[key]]
            if landed and stayed:
                report.torn_flushes += 1
                report.problems.append(f"{where}: a flush under way left {landed} new and {stayed} old")
        probe = torch.arange(5.0)
        await store.put("probe-after-power-cut", probe)
        if not _same(await store.get("probe-after-power-cut"), probe):
            report.wrong += 1
            report.problems.append(f"{where}: a put after recovery did not read back")
        await store.delete("probe-after-power-cut")
    finally:
        await store.aclose(flush=False)


async def explore(
    events: Sequence[Event], scratch: Path, states: int = 100, seed: int = 0, points: Sequence[int] | None = None
) -> PowerCutReport:
    """Build about ``states`` power-cut states of a recording under ``scratch`` (a folder of its
    own; emptied for each state), reopen and check each; see the module docstring. ``points``
    fixes the cut points (see ``plan_cuts``)."""
    first = CatalogLayout(round_up(parse_bytes(CHUNK_SIZE), ALIGNMENT), ALIGNMENT, ())
    cuts = plan_cuts(events, states, seed, points)
    report = PowerCutReport(events=len(events), cut_points=len({cut.at for cut in cuts}))
    report.acknowledged = sum(1 for e in events if isinstance(e, Note) and e.stage == "ack" and e.op != "flush")
    ledger, replayed = Ledger(), 0
    for cut in cuts:
        for event in events[replayed : cut.at]:
            if isinstance(event, Note):
                ledger.apply(event)
        replayed = cut.at
        shutil.rmtree(scratch, ignore_errors=True)
        (scratch / "data").mkdir(parents=True)
        _materialise_files(events, cut, scratch / "data")
        await _materialise_catalog(events, cut, scratch / "catalog", first)
        await _check_state(scratch, ledger, cut, report)
        report.states += 1
    shutil.rmtree(scratch, ignore_errors=True)
    return report


async def power_cuts(folder: Path, states: int = 100, seed: int = 0, operations: int = 120, drop_fdatasync: bool = False) -> PowerCutReport:
    """Record the workload in ``folder/recorded`` and explore ``states`` cuts in
    ``folder/state``. ``drop_fdatasync`` runs the mutation (no sync before the commit)."""
    recorder = Recorder(drop_fdatasync=drop_fdatasync)
    recorded = folder / "recorded"
    shutil.rmtree(recorded, ignore_errors=True)
    await record_workload(recorded, recorder, seed=seed, operations=operations)
    shutil.rmtree(recorded, ignore_errors=True)
    return await explore(recorder.events, folder / "state", states=states, seed=seed)
