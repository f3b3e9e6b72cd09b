"""``DiskTier``: tensors as checksummed extents in preallocated files, with an LMDB catalog."""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import errno
import os
import shutil
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from ..device import link_for
from ..disk.catalog import (
    Catalog,
    CatalogLayout,
    DiskRecord,
    InlineScan,
    RecordDamagedError,
    inline_bytes,
)
from ..disk.compact import compact, plan_compaction
from ..disk.extents import Extent, ExtentAllocator
from ..disk.files import (
    FileIO,
    SegmentFiles,
    TruncatedSegment,
    allocated_bytes,
    checksum_bytes,
    combine_pieces,
    is_segment_name,
    split_chunks,
)
from ..disk.lock import FolderLock
from ..disk.tuning import TUNING_FILE
from ..disk.tuning import resolve as resolve_io_settings
from ..errors import (
    CapacityError,
    CatalogError,
    ChecksumError,
    DiskFullError,
    ForeignFolderError,
    NotAStoreFolderError,
    StoreClosedError,
    StoreForkedError,
    TierFullError,
    TierStoreError,
)
from ..flags import require_flag
from ..process import this_process
from ..tensors import ALIGNMENT, TensorMeta, aligned_empty
from ..units import distinct_sizes, format_bytes, parse_bytes, round_up
from ..workers import Priority, WorkerPool
from .base import Tier

#: Freed space is given back to the file system once this much was freed since the last time
#: and three quarters of the files are free (``DiskTier.release``), and on close.
PUNCH_AFTER = 16 << 20
#: Released extents remembered for ``PUNCH_AFTER`` before those allocated again are dropped.
_RELEASED_CAP = 4096
#: Size of the first segment file; each next one is twice the last, up to ``segment_size``.
FIRST_SEGMENT = 16 << 20
#: What a tierstore folder holds before its catalog exists (a crash during the first open).
_OWN_NAMES = {"lock", "data", "catalog", TUNING_FILE, TUNING_FILE + ".tmp"}
#: Values of at most this many bytes are kept inline in their catalog record (one transaction,
#: no extent, no data-file sync) unless ``DiskTier(inline_max=)`` says otherwise. Chosen by
#: measurement (``benchmarks/bench_keys.py --threshold``): see ``tierstore.bench.keys``.
INLINE_MAX = 2048
_PROBE_NAME = ".direct-probe"


class InlineSuperseded(TierStoreError):
    """Internal: the catalog holds another version of an inline value than the one asked for
    (its writer is installing a newer one); the reader waits for it and reads again."""


class DiskTier(Tier):
    """The slowest tier: a folder on (ideally) NVMe.

    Data lives in segment files under ``root/data`` that are reserved on disk in whole
    (``posix_fallocate``) and created as the tier fills; each tensor is one aligned extent
    inside a segment, moved with ``pwrite``/``preadv`` straight from and into the tensor's
    memory (``O_DIRECT`` where supported) by a pool of ``io_threads`` threads, ``chunk_size``
    bytes per request. Each chunk carries a CRC-32C checksum, computed in the job that writes
    it and verified on every read.
    The LMDB catalog under ``root/catalog`` maps keys to extents. Updates are copy-on-write:
    a new extent is written (and, if ``durable``, fsync'ed), then the catalog commits, then the
    old extent is freed. Reopening the folder brings every entry back.

    Parameters
    ----------
    root:
        The folder; created by ``open`` if absent (unless ``create=False``). Keys never become
        file names in it.
    capacity:
        Most bytes of segment files the tier may hold (int, or a string such as ``"100GiB"``).
    durable:
        If True (default) a write is on stable storage before it is acknowledged and survives a
        crash or power loss. If False nothing is fsync'ed: the data and catalog still survive
        the process being killed (the kernel holds the writes), but a power loss or OS crash may
        lose recent writes; the catalog stays consistent and a record whose data did not reach
        the disk fails its checksum on read rather than returning wrong bytes.
    direct:
        ``"auto"`` (default) uses ``O_DIRECT`` where the file system supports it; ``True``
        requires it; ``False`` goes through the page cache.
    io_threads, chunk_size, queue_depth:
        Worker threads (requests in flight for the whole tier), bytes per request and per
        checksum (fixed when the folder is created: an existing folder keeps its own), and
        requests of one value in flight at a time. Each one not given comes from the folder's
        tuning file (``tierstore bench --tune ROOT`` measures and saves them) if there is one,
        else the defaults: 4 threads, 4 MiB, queue depth = threads. ``io_settings`` and the
        ``repr`` say which are in force and where from; a damaged tuning file gives a
        ``TuningFileWarning`` and the defaults.
    segment_size:
        Largest data file (default ``min(capacity, 4GiB)``); no tensor can be larger. Files are
        created as the tier fills, the first of 16 MiB, each next twice the last.
    io:
        The calls that change the data files and commit the catalog (default: ``os`` and
        LMDB as they are); ``tierstore.faults.powercut`` passes a recorder here.
    inline_max:
        Values of at most this many bytes (default ``INLINE_MAX``) live inline in their catalog
        record instead of an extent: a put of one is a single catalog transaction (one sync when
        durable) and takes no space in the data files; its checksum is verified on every read as
        an extent's is. 0 puts every value in an extent.
    overcommit:
        Accept a capacity larger than the file system can still give (the free space plus what
        the folder's files hold); puts then fail with ``DiskFullError`` when it fills. By default
        ``open`` refuses such a capacity with ``CapacityError``.

    Notes
    -----
    Freed extents are given back to the file system (holes punched where it supports them) once
    the store has mostly emptied, and at close; empty segment files at the end go once the rest
    is at most half full. Opening a
    folder with a capacity smaller than its segment files compacts it (live extents move into the
    first ``capacity`` bytes) or, if the live data does not fit, raises ``CapacityError``.

    The folder belongs to the process that opened it (an exclusive lock, released on ``aclose``
    or when the tier is garbage-collected); a forked child neither holds nor releases it, and
    using the tier there raises ``StoreForkedError``.
    """

    kind: ClassVar[str] = "disk"
    #: The values inline in the catalog, found on open (the store adopts them as entries;
    #: ``loaded`` holds the records of the values in extents).
    loaded_inline: InlineScan | tuple[()] = ()

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int | str,
        durable: bool = True,
        direct: bool | str = "auto",
        segment_size: int | str | None = None,
        io_threads: int | None = None,
        chunk_size: int | str | None = None,
        create: bool = True,
        name: str = "disk",
        io: FileIO | None = None,
        overcommit: bool = False,
        inline_max: int | str = INLINE_MAX,
        queue_depth: int | None = None,
    ) -> None:
        super().__init__(capacity, name)
        # ("~/scratch" is the user's, not a folder named ~; and a relative root stays where it
        # was when the tier was made: files are made by name, after a chdir too)
        self.root = Path(root).expanduser().absolute()
        self.io = io if io is not None else FileIO()
        self.durable = require_flag("durable", durable)
        if direct not in (True, False, "auto"):
            raise ValueError(f"direct must be True, False or 'auto', not {direct!r}")
        self._direct = direct
        default_segment = min(max(self.capacity, ALIGNMENT), 4 << 30)
        self.segment_size = round_up(parse_bytes(segment_size) if segment_size is not None else default_segment, ALIGNMENT)
        if self.segment_size <= 0:
            raise ValueError("segment_size must be positive")
        #: The I/O settings asked for and where each came from (argument, tuning file, default).
        self.io_settings = resolve_io_settings(self.root, chunk_size, io_threads, queue_depth)
        self.chunk_size = self.io_settings.settings.chunk_size
        self.io_threads = self.io_settings.settings.io_threads
        #: Requests of one value in flight at a time (its chunks, each checksummed in its job).
        self.queue_depth = self.io_settings.settings.queue_depth
        self.create = require_flag("create", create)
        self.overcommit = require_flag("overcommit", overcommit)
        self.inline_max = parse_bytes(inline_max)
        if self.inline_max < 0:
            raise ValueError(f"inline_max must not be negative, not {inline_max!r}")
        self.pool = WorkerPool(self.io_threads, name)
        self._catalog: Catalog | None = None
        self._files: SegmentFiles | None = None
        self._allocator = ExtentAllocator()
        #: Extents released since free space was last given back (``release``), and their bytes.
        self._released: list[Extent] = []
        self._released_bytes = 0
        #: Past this many released extents, those allocated again are forgotten (``release``).
        self._released_cap = _RELEASED_CAP
        #: Bytes of the values kept inline in the catalog (they count against the capacity).
        self._inline_bytes = 0
        self._lock: FolderLock | None = None
        self._release_lock: weakref.finalize | None = None
        #: The process that opened the tier (a forked child may not use it).
        self._pid: int | None = None
        self._grow_lock: asyncio.Lock | None = None
        self._trim_task: asyncio.Task[None] | None = None
        #: ``write_committed`` calls under way (one alone may commit on its I/O thread).
        self._writing = 0
        #: Records found on open, by key (the store adopts them as entries).
        self.loaded: dict[str, DiskRecord] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        """Check the folder, take its lock, load the catalog (compacting into a smaller capacity
        if needed) and start the I/O threads.

        Raises
        ------
        NotAStoreFolderError
            If ``root`` is a file.
        ForeignFolderError
            If ``root`` holds files but no tierstore catalog.
        CapacityError
            If the capacity exceeds what the file system can give (unless ``overcommit``), or is
            smaller than the live data in the folder.
        StoreLockedError
            If the folder is open already (in another process, or another object of this one).
        CatalogError
            If the catalog or data files are damaged or of a format this code cannot read.
        """
        if self.is_open:
            return
        self._check_folder()
        made = None  # (the first folder this open created: removed again, if empty, when the open fails here)
        if not self.root.exists():
            if not self.create:
                raise FileNotFoundError(f"disk tier folder {self.root} does not exist (create=False)")
            made = self.root
            while not made.parent.exists():
                made = made.parent
            try:
                self.root.mkdir(mode=0o700, parents=True)
            except (NotADirectoryError, FileExistsError) as exc:
                raise NotAStoreFolderError(f"cannot create the disk tier folder {self.root}: {exc.strerror}") from None
            except OSError as exc:  # (a folder that cannot be made there: not a question of capacity)
                _remove_empty(self.root, made)  # (those made before the one that failed)
                raise type(exc)(exc.errno, f"cannot create the disk tier folder {self.root}: {exc.strerror}") from None
        if not self.overcommit:
            try:
                self._check_capacity()
            except CapacityError:
                _remove_empty(self.root, made)
                raise
        self._lock = FolderLock.acquire(self.root / "lock")
        self._pid = os.getpid()
        try:
            await asyncio.to_thread(self._open_sync)
        except BaseException:
            self._close_sync()
            raise
        # Dropped without aclose (a notebook cell run again): the folder is let go with it.
        self._release_lock = weakref.finalize(self, self._lock.release)
        self._grow_lock = asyncio.Lock()
        self.pool.start()
        await super().open()

    def _check_folder(self) -> None:
        """Refuse a root that is a file, or a folder of someone else's files."""
        root = self.root
        if not root.exists():
            return
        if not root.is_dir():
            raise NotAStoreFolderError(f"the disk tier folder {root} is a file, not a folder")
        names = set(os.listdir(root))
        if "catalog" in names:
            return
        foreign = sorted(names - _OWN_NAMES)
        data = root / "data"
        if data.is_dir():
            foreign += sorted(f"data/{n}" for n in os.listdir(data) if n != _PROBE_NAME and not is_segment_name(n))
        elif data.exists():
            foreign.append("data")
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ForeignFolderError(
                f"{root} holds files but no tierstore catalog ({shown}); a DiskTier takes only an empty or "
                "new folder, or one a tierstore wrote"
            )

    def _check_capacity(self) -> None:
        """Refuse a capacity the file system cannot give: its free space plus what the folder's
        segment files hold already."""
        existing = self.root
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        data = self.root / "data"
        held = allocated_bytes(data) if data.is_dir() else 0
        if self.capacity > free + held:
            raise CapacityError(
                f"disk tier capacity {format_bytes(self.capacity)} for {self.root} is more than the file system "
                f"can give: {format_bytes(free)} free + {format_bytes(held)} in the folder's files = "
                f"{format_bytes(free + held)}; ask for less, or pass overcommit=True to accept filling up"
            )

    def _open_sync(self) -> None:
        (self.root / "data").mkdir(mode=0o700, exist_ok=True)
        self._catalog = Catalog(self.root / "catalog", self.durable)
        existing = sorted((self.root / "data").glob("segment-*.bin"))
        layout = self._catalog.open(CatalogLayout(self.chunk_size, ALIGNMENT, ()) if not existing else None)
        if layout.alignment != ALIGNMENT:
            raise CatalogError(f"{self.root} was written with {layout.alignment}-byte alignment; this tierstore uses {ALIGNMENT}")
        self.chunk_size = layout.chunk_size  # the folder's setting wins over the constructor's
        self._files = SegmentFiles(
            self.root / "data",
            self._direct,
            staging_buffers=self.io_threads,
            staging_size=self.chunk_size,
            pinned=torch.cuda.is_available(),
            io=self.io,
        )
        chunk_size = self.chunk_size
        # Values in extents come back as records; inline ones as (key, meta, version) only.
        try:
            records, inline = self._catalog.scan()
        except RecordDamagedError as exc:
            raise RecordDamagedError(f"{exc}; nothing was changed. {_repair_hint(self.root)}") from None
        for record in records.values():
            problem = record.miscounted_checksums(chunk_size)
            if problem is not None:
                raise RecordDamagedError(f"catalog record for {record.key!r} {problem}; nothing was changed. {_repair_hint(self.root)}")
        try:
            self._allocator = ExtentAllocator.rebuild(layout.segments, (r.extent for r in records.values() if r.extent is not None), ALIGNMENT)
        except ValueError as exc:
            raise CatalogError(f"the catalog in {self.root} is inconsistent: {exc}; nothing was changed. {_repair_hint(self.root)}") from None
        try:
            self._files.open(list(layout.segments))
        except TruncatedSegment as exc:
            path = self._files.path(exc.segment)
            length = path.stat().st_size if path.exists() else 0
            inside = [r for r in records.values() if r.extent is not None and r.extent.segment == exc.segment]
            past = sorted(r.key for r in inside if r.extent is not None and r.extent.end > length)
            shown = ", ".join(repr(k) for k in past[:10]) + (" ..." if len(past) > 10 else "")
            raise CatalogError(
                f"{exc}; {len(past)} of the {len(inside)} entries in it lie past its end ({shown}); nothing was changed. "
                f"If the file cannot be put back, {_repair_hint(self.root)}"
            ) from None
        self._catalog.upgrade()  # (sound: its records read, its files are there)
        # Segment files the catalog stopped naming just before a crash.
        self._files.remove_strays(len(layout.segments))
        if sum(layout.segments) > self.capacity:
            placeholders = {key: DiskRecord(key, meta, None, version, (0,), None, True) for key, meta, version in inline}
            plan = plan_compaction(self.root, {**records, **placeholders}, layout.segments, self.capacity, ALIGNMENT)
            layout, records = compact(self._files, self._catalog, layout, records, plan, self.chunk_size)
            self._allocator = ExtentAllocator.rebuild(layout.segments, (r.extent for r in records.values() if r.extent is not None), ALIGNMENT)
        count = self._allocator.removable_tail()
        if count:
            layout = CatalogLayout(layout.chunk_size, ALIGNMENT, tuple(self._allocator.segment_sizes[:-count]))
            with self.io.catalog_commit([], layout):
                self._catalog.commit_now([], layout)
            self._allocator.drop_tail(count)
            self._files.remove_tail(count)
        self._inline_bytes = inline.nbytes
        self.loaded = records
        self.loaded_inline = inline

    async def aclose(self) -> None:
        if not self.is_open:
            return
        try:
            if self._catalog is not None and self._pid == os.getpid():
                await self._catalog.drain()  # acknowledged non-durable writes reach the catalog
            # Taken after the drain: a free landing during it may start a trim, which must end
            # before the files close (it would delete segment files of a closed tier).
            while (trim := self._trim_task) is not None:
                self._trim_task = None
                if not trim.cancelled():
                    await trim  # a failure to give space back is reported, after closing
            if self._pid == os.getpid():
                self._punch_released()  # a store closed after deletes leaves no blocks behind
                if self._allocator.used == 0 and self._files is not None:
                    # Closed empty (an optimizer's scratch state, dropped): the files' reservation
                    # of space never written goes back too; a reopened tier allocates as it writes.
                    for segment, offset, length in self._allocator.free_ranges():
                        self._files.punch(segment, offset, length)
        finally:
            self.pool.shutdown()
            self._close_sync()
            await super().aclose()

    def _close_sync(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
        if self._release_lock is not None:
            self._release_lock.detach()
            self._release_lock = None
        if self._lock is not None:
            self._lock.release()  # in a forked child this closed nothing: the parent holds it
            self._lock = None

    # -- accounting -------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes of extents plus bytes of values kept inline in the catalog."""
        return self._allocator.used + self._inline_bytes

    def reserve_inline(self, nbytes: int) -> None:
        """Count a value of ``nbytes`` about to be kept inline against the capacity; raises
        ``TierFullError`` when it does not fit (``release_inline`` gives it back)."""
        if self.used + nbytes > self.capacity:
            wanted, free = distinct_sizes(nbytes, self.capacity - self.used)
            raise TierFullError(f"tier {self.name!r} is full: {wanted} wanted, {free} free of {format_bytes(self.capacity)}")
        self._inline_bytes += nbytes

    def release_inline(self, nbytes: int) -> None:
        self._inline_bytes -= nbytes

    @property
    def inline_bytes(self) -> int:
        """Bytes of the values kept inline in the catalog (part of ``used``)."""
        return self._inline_bytes

    @property
    def reserved(self) -> int:
        """Bytes of segment files (their length). Free extents inside them are punched out, so
        the file system holds about ``used`` of them where it supports holes."""
        return self._allocator.size

    def describe_io(self) -> str:
        """The I/O settings in force and where each came from (a folder's catalog fixes its
        chunk size once created; a tuning file or the arguments cannot change it then)."""
        text = self.io_settings.describe()
        if self.chunk_size != self.io_settings.settings.chunk_size:
            text += f"; the folder was created with chunk_size={format_bytes(self.chunk_size)}, which is in force"
        if self.io_settings.tuning_path is not None:
            text += f"; tuning file {self.io_settings.tuning_path}"
        return text

    def __repr__(self) -> str:
        return (f"DiskTier(name={self.name!r}, root={str(self.root)!r}, capacity={format_bytes(self.capacity)!r}, "
                f"durable={self.durable}, {self.describe_io()})")

    @property
    def direct_io(self) -> bool:
        """Whether ``O_DIRECT`` is in use."""
        return self._files is not None and self._files.direct

    @property
    def staging_bytes(self) -> int:
        """Host memory this tier holds for staging unaligned chunks."""
        return self._files.staging_bytes if self._files is not None else 0

    def extent_size(self, nbytes: int) -> int:
        """Bytes an extent for ``nbytes`` occupies."""
        return round_up(max(nbytes, 1), ALIGNMENT)

    def stored_size(self, nbytes: int) -> int:
        """Bytes of capacity a value of ``nbytes`` takes: itself if kept inline, else its extent."""
        return nbytes if self.holds_inline(nbytes) else self.extent_size(nbytes)

    # -- space --------------------------------------------------------------------------------

    async def allocate(self, nbytes: int) -> Extent:
        """Reserve an extent for ``nbytes``, creating a segment file if needed.

        Raises ``TierFullError`` when the capacity is reached (or too fragmented) and
        ``DiskFullError`` when the file system has no room for a new segment, even one of
        just the value's size (a segment that does not fit is tried again at half its size).
        """
        self._require_open()
        length = self.extent_size(nbytes)
        if length > self.capacity:  # (not "full": no room made would ever take it)
            if nbytes > self.capacity:
                value, capacity = distinct_sizes(nbytes, self.capacity)
                said = f"a tensor of {value} is more than tier {self.name!r} holds ({capacity})"
            else:
                value, taken, capacity = (f"{n:,} bytes" for n in (nbytes, length, self.capacity))
                said = f"a tensor of {value} takes {taken} on tier {self.name!r} (whole blocks of {ALIGNMENT:,} bytes), more than it holds ({capacity})"
            raise TierFullError(said)
        if self.used + length > self.capacity:  # values inline in the catalog take capacity too
            wanted, free = distinct_sizes(length, self.capacity - self.used)
            raise TierFullError(
                f"tier {self.name!r} is full: {wanted} wanted, {free} free "
                f"of {format_bytes(self.capacity)} ({format_bytes(self._inline_bytes)} of it values inline in the catalog)"
            )
        if length > self.segment_size:  # (checked second: a value beyond the capacity is told so)
            raise TierFullError(
                f"a tensor of {format_bytes(nbytes)} is larger than the disk tier's segment size "
                f"({format_bytes(self.segment_size)}); open the DiskTier with a larger segment_size"
            )
        extent = self._allocator.allocate(length)
        if extent is not None:
            return extent
        files, catalog = self._require_open(), self._require_catalog()
        async with self._grow_lock or asyncio.Lock():
            extent = self._allocator.allocate(length)
            if extent is not None:
                return extent
            remaining = (self.capacity - self._allocator.size - self._inline_bytes) // ALIGNMENT * ALIGNMENT
            # Segments grow geometrically from 16 MiB up to segment_size, so a small store
            # reserves little disk and a large one has few files.
            grown = min(self.segment_size, FIRST_SEGMENT << len(self._allocator.segment_sizes))
            size = min(remaining, max(grown, length))
            if size < length:
                wanted, free = distinct_sizes(length, self._allocator.free_bytes)
                raise TierFullError(
                    f"tier {self.name!r} is full: {wanted} wanted, {free} free "
                    f"of {format_bytes(self.capacity)} (largest free extent {format_bytes(self._allocator.largest_free)})"
                )
            segment = len(self._allocator.segment_sizes)
            while True:
                try:
                    await self.pool.run(partial(files.create, segment, size))
                    break
                except DiskFullError as error:
                    if size <= length or error.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise  # (EFBIG, a limit on a file's size, is the disk's limit here)
                    # (an overcommitted tier on a file system with less room than a whole
                    # segment: a smaller one, down to what the value needs, may still fit)
                    size = max(length, size // 2 // ALIGNMENT * ALIGNMENT)
            layout = CatalogLayout(self.chunk_size, ALIGNMENT, (*self._allocator.segment_sizes, size))
            with self.io.catalog_commit([], layout):
                await catalog.commit([], layout=layout)
            self._allocator.add_segment(size)
            extent = self._allocator.allocate(length)
            if extent is None:  # cannot happen: the new segment is at least `length` long
                raise TierFullError(f"tier {self.name!r}: no extent of {length} bytes in a new segment of {size}")
            return extent

    def release(self, extent: Extent) -> None:
        """Return an extent's space (the catalog no longer references it): reusable at once,
        and given back to the file system. Empty trailing segment files go in the background."""
        self._check_process()
        self._allocator.free(extent)
        if self._files is None:
            return
        # Punching every freed extent at once halved the speed of overwrites (the file system
        # allocates the blocks again on the next write). Freed extents are given back when the
        # store has mostly emptied (and on close): copy-on-write overwrites keep at most about
        # half of the files free and keep their blocks; a store that empties returns them.
        self._released.append(extent)
        self._released_bytes += extent.length
        if self._released_bytes >= PUNCH_AFTER and self._allocator.free_bytes > self._allocator.size * 3 // 4:
            self._punch_released()
        elif len(self._released) > self._released_cap:
            self._prune_released()
        if not self._allocator.removable_tail():
            return
        task = self._trim_task
        if task is not None and (not task.done() or (not task.cancelled() and task.exception() is not None)):
            return  # one at a time; an earlier failure is raised by aclose, not piled up
        self._trim_task = asyncio.get_running_loop().create_task(self._trim())

    def _punch_released(self) -> None:
        """Give the blocks of the extents released since the last time, and still free, back to
        the file system (space never written keeps its reservation). On the loop, with no
        await: nothing can allocate a range (and write into it) while it is punched."""
        released, self._released, self._released_bytes = self._released, [], 0
        if self._files is None:
            return
        for extent in self._still_free(released):
            self._files.punch(extent.segment, extent.offset, extent.length)

    def _prune_released(self) -> None:
        """Forget the released extents allocated again since (their blocks are in use): while
        a store is rewritten in place it is not emptying, nothing is punched, and the list
        would grow by one extent a put for as long as it runs."""
        self._released = self._still_free(self._released, wholly=False)
        self._released_bytes = sum(extent.length for extent in self._released)
        self._released_cap = max(_RELEASED_CAP, 2 * len(self._released))

    def _still_free(self, extents: list[Extent], wholly: bool = True) -> list[Extent]:
        """Those of ``extents`` that lie wholly in free space now (``wholly=False``: that
        overlap free space: one partly allocated again may be whole again by the next punch)."""
        free: dict[int, list[tuple[int, int]]] = {}
        for segment, offset, length in self._allocator.free_ranges():
            free.setdefault(segment, []).append((offset, offset + length))
        for ranges in free.values():
            ranges.sort()
        kept = []
        for extent in extents:
            ranges = free.get(extent.segment, [])
            end = extent.offset + extent.length
            if wholly:
                i = bisect.bisect_right(ranges, (extent.offset, float("inf"))) - 1
                if i >= 0 and ranges[i][0] <= extent.offset and end <= ranges[i][1]:
                    kept.append(extent)
            else:
                i = bisect.bisect_left(ranges, (end, -1)) - 1  # (the last free range starting before the end)
                if i >= 0 and ranges[i][1] > extent.offset:
                    kept.append(extent)
        return kept

    async def _trim(self) -> None:
        """Delete empty segment files at the end (``ExtentAllocator.removable_tail``)."""
        files, catalog = self._require_open(), self._require_catalog()
        async with self._grow_lock or asyncio.Lock():
            count = self._allocator.removable_tail()
            if not count:
                return
            dropped = self._allocator.segment_sizes[-count:]
            layout = CatalogLayout(self.chunk_size, ALIGNMENT, tuple(self._allocator.segment_sizes[:-count]))
            self._allocator.drop_tail(count)  # nothing allocates there from now on
            try:
                with self.io.catalog_commit([], layout):
                    await catalog.commit([], layout=layout)
            except Exception:
                for size in dropped:
                    self._allocator.add_segment(size)
                raise
            # Durability order: the catalog no longer names the files; now they may go (a crash
            # in between leaves stray files, which the next open deletes).
            await self.pool.run(partial(files.remove_tail, count), Priority.BACKGROUND)

    # -- data ---------------------------------------------------------------------------------

    def _parallel_requests(self, priority: Priority) -> int:
        """How many requests a value below ``queue_depth`` chunks is cut into: ``queue_depth``
        while no job as urgent as it waits for a thread; one piece a chunk once one does (the
        values in flight keep the threads busy: cutting this one would only add a thread hop
        and a wake-up per piece, which on a machine of few cores costs the caller's math its
        CPU). A demand value behind prefetches is cut: it goes before them, onto each thread
        that frees."""
        return 1 if self.pool.waiting(priority) else self.queue_depth

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(start, min(self.chunk_size, nbytes - start)) for start in range(0, max(nbytes, 1), self.chunk_size)]

    async def write(
        self, extent: Extent, src: torch.Tensor, nbytes: int, priority: Priority = Priority.DEMAND, sync: bool = True
    ) -> tuple[int, ...]:
        """Write the first ``nbytes`` of the uint8 buffer ``src`` into ``extent``; durable on
        return if the tier is (``sync=False`` leaves that to a later ``sync_segments``, so many
        writes share one fdatasync per file). Returns the chunk checksums. A buffer in device
        memory is staged through host memory first (this tier moves its own bytes)."""
        files = self._require_open()
        then = partial(files.sync, extent.segment) if sync and self.durable else None
        if src.device.type != "cpu":
            checksums = await self._write_from_device(files, extent, src, nbytes, priority)
            if then is not None:
                await self.pool.run(then, priority)
            return checksums
        # One batch of jobs, one wake-up of the loop; the fdatasync runs on the thread that ends
        # the last job.
        pieces, count, writes = self._write_jobs(files, extent, src, nbytes, priority)
        return combine_pieces(pieces, await self.pool.run_all(writes, priority, limit=self.queue_depth, then=then), count)

    def _write_jobs(
        self, files: SegmentFiles, extent: Extent, src: torch.Tensor, nbytes: int, priority: Priority
    ) -> tuple[list[tuple[int, int, int]], int, list[Callable[[], int]]]:
        """The jobs writing the first ``nbytes`` of ``src`` into ``extent``, each returning its
        piece's checksum: a value of fewer chunks than the queue depth is cut into pieces moved
        in parallel (see ``split_chunks``, ``_parallel_requests``). Returns the pieces, the
        number of chunks (for ``combine_pieces``) and the jobs."""
        chunks = self._chunks(nbytes)
        pieces = split_chunks(chunks, self._parallel_requests(priority))
        writes = [partial(files.write_chunk, extent.segment, extent.offset + start, src, start, length) for _, start, length in pieces]
        return pieces, len(chunks), writes

    async def write_committed(
        self,
        extent: Extent,
        src: torch.Tensor,
        nbytes: int,
        record_for: Callable[[tuple[int, ...]], DiskRecord | None],
        priority: Priority = Priority.DEMAND,
    ) -> DiskRecord | None:
        """``write`` then ``commit`` of the record ``record_for(checksums)`` makes (None: give
        up, nothing committed), in one trip from the loop where it can be: the thread that
        ends the last data job (after the fdatasync) commits the record itself when the catalog
        is idle (``Catalog.commit_here``) and no other such write is under way on this tier;
        otherwise (their commits are coming: they share a transaction), or for a buffer in
        device memory, the record joins the loop's group commit. ``record_for`` runs on that
        thread (it must only read loop state). Returns the committed record, or None if given
        up."""
        files, catalog = self._require_open(), self._require_catalog()
        if src.device.type != "cpu":
            record = record_for(await self.write(extent, src, nbytes, priority))
            if record is not None:
                await self.commit([(record.key, record)])
            return record
        then = partial(files.sync, extent.segment) if self.durable else None
        pieces, count, writes = self._write_jobs(files, extent, src, nbytes, priority)
        outcome: list[tuple[DiskRecord | None, bool]] = []

        def finish(results: list[int]) -> None:
            record = record_for(combine_pieces(pieces, results, count))
            changes: list[tuple[str, DiskRecord | None]] = [] if record is None else [(record.key, record)]
            alone = self._writing == 1  # (read here: others started since would share with it)
            here = alone and record is not None and catalog.commit_here(changes, partial(self.io.catalog_commit, changes, None))
            outcome.append((record, here))

        self._writing += 1
        try:
            await self.pool.run_all(writes, priority, limit=self.queue_depth, then=then, finish=finish)
        except asyncio.CancelledError:
            if not (outcome and outcome[0][1]):
                raise
            # (committed on the thread as the caller was cancelled: the write took effect, and
            # its extent is the key's now; the caller must see it so, not free it)
        finally:
            self._writing -= 1
        record, committed = outcome[0]
        if record is not None and not committed:
            await self.commit([(record.key, record)])
        return record

    async def sync_segments(self, segments: set[int], priority: Priority = Priority.DEMAND) -> None:
        """Make every write into ``segments`` durable (if the tier is): one fdatasync per file."""
        files = self._require_open()
        if self.durable and segments:
            await self.pool.run_all([partial(files.sync, segment) for segment in sorted(segments)], priority)

    async def read(self, record: DiskRecord, dst: torch.Tensor, priority: Priority = Priority.DEMAND) -> None:
        """Read ``record``'s bytes into the uint8 buffer ``dst``, verifying every checksum (a
        buffer in device memory is filled through a host bounce buffer)."""
        files = self._require_open()
        if dst.device.type != "cpu":
            await self._read_to_device(files, record, dst, priority)
            return
        extent = record.extent
        if extent is None:
            raise ValueError(f"{record.key!r} is kept inline in the catalog, not in an extent: read it with read_inline")
        chunks = self._chunks(record.meta.nbytes)
        pieces = split_chunks(chunks, self._parallel_requests(priority))
        reads = [partial(files.read_chunk, extent.segment, extent.offset + start, dst, start, length) for _, start, length in pieces]
        sums = combine_pieces(pieces, await self.pool.run_all(reads, priority, limit=self.queue_depth), len(chunks))
        for index, ((start, length), got) in enumerate(zip(chunks, sums, strict=True)):
            if got != record.checksums[index]:
                raise ChecksumError(
                    f"{record.key!r}: bytes {start}..{start + length} read from {files.path(extent.segment).name} "
                    f"at offset {extent.offset + start} fail their checksum; the data on disk is corrupt. {_damaged_value_hint(files)}"
                )

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """A host buffer for one chunk of a device transfer (pinned where CUDA is): the staging
        of a device copy is one chunk, not the whole value, so it stays a small bounded working
        set outside the tiers' budgets."""
        return aligned_empty(round_up(min(max(nbytes, 1), self.chunk_size), ALIGNMENT), pin_memory=torch.cuda.is_available())

    async def _write_from_device(self, files: SegmentFiles, extent: Extent, src: torch.Tensor, nbytes: int, priority: Priority) -> tuple[int, ...]:
        link = link_for(src.device)
        bounce = self._bounce(nbytes)
        checksums = []
        for start, length in self._chunks(nbytes):
            await link.to_host(bounce[:length], src[start : start + length])
            checksums.append(await self.pool.run(partial(files.write_chunk, extent.segment, extent.offset + start, bounce, 0, length), priority))
        return tuple(checksums)

    async def _read_to_device(self, files: SegmentFiles, record: DiskRecord, dst: torch.Tensor, priority: Priority) -> None:
        link = link_for(dst.device)
        bounce = self._bounce(record.meta.nbytes)
        for index, (start, length) in enumerate(self._chunks(record.meta.nbytes)):
            await self.pool.run(partial(self._read_verified, files, record, index, start, length, bounce, at=0), priority)
            await link.to_device(dst[start : start + length], bounce[:length])

    @staticmethod
    def _read_verified(
        files: SegmentFiles, record: DiskRecord, index: int, start: int, length: int, dst: torch.Tensor, at: int | None = None
    ) -> None:
        """Read chunk ``index`` (bytes ``start``.. of the value) into ``dst`` at ``at`` (default
        ``start``), verifying its checksum."""
        extent = record.extent
        if extent is None:
            raise ValueError(f"{record.key!r} is kept inline in the catalog, not in an extent: read it with read_inline")
        got = files.read_chunk(extent.segment, extent.offset + start, dst, start if at is None else at, length)
        if got != record.checksums[index]:
            raise ChecksumError(
                f"{record.key!r}: bytes {start}..{start + length} read from {files.path(extent.segment).name} "
                f"at offset {extent.offset + start} fail their checksum; the data on disk is corrupt. {_damaged_value_hint(files)}"
            )

    # -- small values, inline in the catalog -----------------------------------------------------

    def holds_inline(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` is kept inline in its catalog record."""
        return nbytes <= self.inline_max and self.inline_max > 0

    def inline_record(self, key: str, meta: TensorMeta, src: torch.Tensor | bytes, version: int) -> DiskRecord:
        """The catalog record holding the first ``meta.nbytes`` bytes of the uint8 buffer ``src``
        (or ``src`` itself, bytes of exactly the value) inline, with their checksum (a copy:
        ``src`` may be reused once this returns)."""
        data = _payload(key, meta, src)
        return DiskRecord(key, meta, None, version, (checksum_bytes(data),), data, inline=True)

    def inline_raw(self, key: str, meta: TensorMeta, src: torch.Tensor | bytes, version: int) -> bytes:
        """``inline_record``'s record in its binary form, made without a record object (what a
        flush of many small keys commits)."""
        data = _payload(key, meta, src)
        return inline_bytes(key, meta, version, checksum_bytes(data), data)

    def _inline_data(self, key: str, version: int) -> bytes | bytearray:
        """The verified bytes of the inline value ``version`` of ``key``. Raises
        ``InlineSuperseded`` if the catalog holds another version now (a newer value committed
        and not yet installed by its writer)."""
        found = self._require_catalog().inline_value(key)
        if found is None or found[0] != version:
            raise InlineSuperseded(key)
        _, checksum, data = found
        if checksum_bytes(data) != checksum:  # type: ignore[arg-type]  # (any buffer: a bytearray from the catalog)
            raise ChecksumError(f"{key!r}: the {len(data)} bytes kept inline in the catalog of {self.root} fail their checksum; the catalog "
                                f"is corrupt. {_damaged_value_hint(self.root)}")
        return data

    def read_inline(self, key: str, version: int, dst: torch.Tensor) -> None:
        """Copy the inline value ``version`` of ``key`` into the uint8 buffer ``dst``, verifying
        its checksum (see ``_inline_data`` for ``InlineSuperseded``)."""
        data = self._inline_data(key, version)
        if not data:
            return
        if dst.device.type == "cpu":
            dst[: len(data)].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        else:
            dst[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def read_inline_tensor(self, key: str, version: int, meta: TensorMeta) -> torch.Tensor:
        """The inline value ``version`` of ``key`` as a new CPU tensor of ``meta``'s dtype and
        shape, verified (the get of a small value: one copy of its bytes, at most one view)."""
        data = self._inline_data(key, version)
        if not data:
            return torch.empty(meta.shape, dtype=meta.dtype)
        value = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=meta.dtype)
        return value if len(meta.shape) == 1 else value.view(meta.shape)

    def read_inline_new(self, key: str, version: int) -> torch.Tensor:
        """The inline value ``version`` of ``key`` in a new uint8 CPU tensor, verified."""
        data = self._inline_data(key, version)
        if not data:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def stage(self, changes: list[tuple[str, DiskRecord | None]]) -> asyncio.Future[None]:
        """Queue catalog changes for the next transaction without waiting (see ``Catalog.stage``);
        the future ends once they are committed."""
        self._require_open()
        return self._require_catalog().stage(changes)

    def can_stage(self, nbytes: int, backlog: int) -> bool:
        """Whether a value of ``nbytes`` can be staged now (``stage_inline``): the tier is not
        durable, keeps it inline, has no failed commits to try again, and fewer than
        ``backlog`` changes wait for their transaction (one call for the small put's checks)."""
        catalog = self._catalog
        return (
            not self.durable and nbytes <= self.inline_max and self.inline_max > 0
            and catalog is not None and catalog.queued < backlog and not catalog.failed
        )

    def stage_inline(self, key: str, meta: TensorMeta, src: torch.Tensor | bytes, version: int) -> None:
        """``stage`` of the inline record of ``src`` (as ``inline_record`` makes it), queued in
        its binary form: the small non-durable put, with no record object made."""
        catalog = self._catalog
        if catalog is None or self._files is None or (self._pid is not None and self._pid != this_process.pid):
            self._require_open()  # (raises what is wrong)
            catalog = self._require_catalog()
        data = src if src.__class__ is bytes else _payload(key, meta, src)
        catalog.stage_inline(key, inline_bytes(key, meta, version, checksum_bytes(data), data))

    def release_when(self, committed: asyncio.Future[None], extent: Extent) -> None:
        """Release ``extent`` once ``committed`` ends (the commit that stops referencing it): its
        bytes stay the durable base until then."""
        if committed.done():
            self.release(extent)
            return

        def release(_: asyncio.Future[None]) -> None:
            if self.is_open:
                self.release(extent)

        committed.add_done_callback(release)

    @property
    def transactions(self) -> int:
        """Catalog transactions committed in the folder's life (each durable one is one sync)."""
        return self._require_catalog().transactions

    @property
    def queued_changes(self) -> int:
        """Catalog changes acknowledged and waiting for their transaction."""
        return self._catalog.queued if self._catalog is not None else 0

    @property
    def commit_failed(self) -> bool:
        """Whether acknowledged catalog changes failed to commit (a full disk) and wait for
        another try: the next put tries again first (``drain``) and raises if they still fail."""
        return self._catalog is not None and self._catalog.failed

    async def drain(self) -> None:
        """Return once every catalog change queued so far is committed."""
        await self._require_catalog().drain()

    async def commit(self, changes: list[tuple[str, DiskRecord | bytes | None]]) -> None:
        """Apply catalog changes (key -> record, or the binary form of an inline one as
        ``inline_raw`` makes it, or None to delete) durably, in one transaction."""
        self._require_open()
        with self.io.catalog_commit(self._as_records(changes), None):
            await self._require_catalog().commit(changes)  # type: ignore[arg-type]

    def can_commit_soon(self, key: str) -> bool:
        """Whether ``commit_soon`` of a change of ``key`` would start now (``Catalog.idle_for``)."""
        catalog = self._catalog
        return catalog is not None and catalog.idle_for(key)

    def commit_soon(
        self, changes: list[tuple[str, DiskRecord | bytes | None]], then: Callable[[BaseException | None], None]
    ) -> bool:
        """``commit`` started with no await when the catalog is idle (``Catalog.commit_soon``):
        ``then(error)`` runs on the loop once the transaction is durable (``error`` None) or
        failed. False (nothing done) otherwise. An ``io`` that watches commits (fault
        injection) gets its ``catalog_commit`` scope around the transaction, on the writer
        thread, as ``commit`` gives it around the awaited one."""
        self._require_open()
        catalog = self._require_catalog()
        if type(self.io).catalog_commit is FileIO.catalog_commit:
            return catalog.commit_soon(changes, then)
        return catalog.commit_soon(changes, then, partial(self.io.catalog_commit, self._as_records(changes), None))

    def _as_records(self, changes: list[tuple[str, DiskRecord | bytes | None]]) -> list[tuple[str, DiskRecord | None]]:
        """``changes`` as records, for an ``io`` that watches commits (fault injection); as they
        are for the plain one, which ignores them (no parse per key of a large flush)."""
        if type(self.io).catalog_commit is FileIO.catalog_commit:
            return changes  # type: ignore[return-value]
        return [(key, DiskRecord.from_bytes(r) if isinstance(r, bytes) else r) for key, r in changes]

    def committed(self) -> dict[str, DiskRecord]:
        """The records in the catalog now, by key: where each committed value lies on disk (for
        tools and fault tests; reads the catalog, moves nothing)."""
        self._require_open()
        return {record.key: record for _, record in self._require_catalog().records()}

    def read_raw_inline(self, key: str) -> bytes | None:
        """The bytes of ``key``'s value kept inline in the catalog (queued or committed), not
        verified, or None if it is not inline (for tools and tests)."""
        record = self._require_catalog().get(key)
        return record.data if record is not None and record.inline else None

    def read_raw(self, extent: Extent, length: int) -> bytes:
        """The bytes of an extent as they lie in the file (for tools and tests)."""
        return self._require_open().read_raw(extent.segment, extent.offset, length)

    def segment_path(self, segment: int) -> Path:
        return self.root / "data" / f"segment-{segment:06d}.bin"

    def _check_process(self) -> None:
        if self._pid is not None and self._pid != this_process.pid:
            raise StoreForkedError(
                f"disk tier {self.name!r} at {self.root} was opened by process {self._pid}; this process "
                f"({os.getpid()}) was forked from it and cannot use it: open a new store here if it needs one"
            )

    def _require_catalog(self) -> Catalog:
        self._check_process()
        if self._catalog is None:
            raise StoreClosedError(f"disk tier {self.name!r} at {self.root} is not open")
        return self._catalog

    def _require_open(self) -> SegmentFiles:
        self._check_process()
        if self._files is None:
            raise StoreClosedError(f"disk tier {self.name!r} at {self.root} is not open")
        return self._files


def _payload(key: str, meta: TensorMeta, src: torch.Tensor | bytes) -> bytes:
    """The first ``meta.nbytes`` bytes of the uint8 buffer ``src`` (``src`` itself if bytes),
    copied out."""
    if isinstance(src, bytes):
        return src
    nbytes = meta.nbytes
    if src.device.type != "cpu":
        src = src[:nbytes].cpu()
    if src.numel() < nbytes or src.element_size() != 1 or not src.is_contiguous():
        raise ValueError(f"inline record of {key!r} needs a contiguous byte buffer of {nbytes} bytes")
    # (a contiguous CPU buffer of at least nbytes: read its memory at once, no views)
    return ctypes.string_at(src.data_ptr(), nbytes) if nbytes else b""


def _repair_hint(root: Path) -> str:
    return f"`tierstore repair {root}` drops the entries whose values are lost (--dry-run lists them) and the rest opens again"


def _damaged_value_hint(where: SegmentFiles | Path) -> str:
    root = where if isinstance(where, Path) else where.folder.parent
    return (f"The value is lost: delete its key (store.delete), or close the store and run `tierstore repair {root} --verify`, "
            "which drops every value that fails its checksums")


def _remove_empty(path: Path, up_to: Path | None) -> None:
    """Remove the empty folders from ``path`` up to ``up_to`` (None: none), deepest first; a
    folder that is not empty (another store's, opened there meanwhile) stays, with those above."""
    if up_to is None:
        return
    while True:
        try:
            path.rmdir()
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENAMETOOLONG):  # (those were not made: the first that failed)
                return
        if path == up_to:
            return
        path = path.parent
