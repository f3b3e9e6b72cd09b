"""Segment files of the disk tier and the chunked, checksummed I/O into and out of them.

Everything here is synchronous and runs on the disk tier's worker threads. Data moves straight
between a tensor's memory and the file (``os.pwrite`` / ``os.preadv`` on the tensor's buffer,
``O_DIRECT`` where the file system supports it); only a chunk whose memory is not 4096-aligned
goes through one of a few aligned staging buffers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import queue
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c
import numpy as np
import torch

from ..errors import CatalogError, DiskFullError, FolderReplacedError
from ..tensors import ALIGNMENT, aligned_empty, is_aligned
from ..units import round_up
from .crc import crc32c_array

if TYPE_CHECKING:
    from .catalog import CatalogLayout, DiskRecord

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
#: What ``fallocate`` answers where a file system or kernel cannot punch holes.
_NO_PUNCH_ERRNOS = {errno.EOPNOTSUPP, errno.ENOSYS}
# linux/falloc.h
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_SEGMENT_GLOB = "segment-*.bin"


class TruncatedSegment(CatalogError):
    """A segment file is missing or shorter than the catalog says (the tier names the entries in it)."""

    def __init__(self, segment: int, message: str) -> None:
        super().__init__(message)
        self.segment = segment


def checksum(data: np.ndarray) -> int:
    """The checksum recorded for one chunk: CRC-32C (hardware accelerated, by carry-less
    multiplication where the CPU has it: see ``tierstore.disk.crc``; releases the GIL, so
    chunks are checked in parallel and beside the I/O)."""
    return crc32c_array(data)


def checksum_bytes(data: bytes) -> int:
    """The checksum of ``data`` (as ``checksum``)."""
    return int(crc32c.crc32c(data))


def checksum_of(buffer: torch.Tensor, start: int, length: int) -> int:
    """The checksum of ``buffer[start:start+length]``."""
    return checksum(buffer[start : start + length].numpy())


# CRC-32C (Castagnoli), reflected: the polynomial crc32c uses.
_CRC32C_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (bit-reflected, as zlib's ``multmodp``)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()
_SHIFTS: dict[int, tuple[list[int], ...]] = {}


def _shift_tables(length: int) -> tuple[list[int], ...]:
    """Moving a CRC past ``length`` bytes is multiplying it by x^(8 * length) modulo the
    polynomial, a linear map of its 32 bits: kept as four byte-indexed tables (four lookups a
    combine instead of a 32-step loop)."""
    tables = _SHIFTS.get(length)
    if tables is None:
        shift, n, k = 1 << 31, length, 3
        while n:
            if n & 1:
                shift = _multmodp(_X2N[k & 31], shift)
            n >>= 1
            k += 1
        basis = [_multmodp(shift, 1 << bit) for bit in range(32)]
        built = []
        for byte in range(4):
            table = [0] * 256
            for j in range(1, 256):
                low = (j & -j).bit_length() - 1
                table[j] = table[j & (j - 1)] ^ basis[8 * byte + low]
            built.append(table)
        tables = tuple(built)
        if len(_SHIFTS) >= 64:  # a tier uses a few piece lengths; odd ones must not pile up
            _SHIFTS.clear()
        _SHIFTS[length] = tables
    return tables


def checksum_combine(first: int, second: int, second_length: int) -> int:
    """The checksum of two byte strings end to end, from their checksums (zlib's
    ``crc32_combine`` for CRC-32C): pieces of one chunk are checked in parallel, on the
    threads that move them, and recorded as the chunk's one checksum."""
    t0, t1, t2, t3 = _shift_tables(second_length)
    return t0[first & 255] ^ t1[(first >> 8) & 255] ^ t2[(first >> 16) & 255] ^ t3[first >> 24] ^ second


#: The smallest piece ``split_chunks`` cuts: below it a request's fixed cost (a thread hop, a
#: system call) outweighs what moving it beside others gains.
MIN_PIECE = 1 << 20


def split_chunks(chunks: Sequence[tuple[int, int]], requests: int, min_piece: int = MIN_PIECE) -> list[tuple[int, int, int]]:
    """``(chunk index, start, length)`` of the requests that move a value of ``chunks``
    (``(start, length)`` each): a value of fewer chunks than ``requests`` has each chunk cut
    into block-aligned pieces of at least ``min_piece`` bytes, so that about ``requests`` of
    them are in flight (a single 4 MiB value is not one request at queue depth 1); the
    checksum stays one per chunk (``combine_pieces``)."""
    parts = max(1, requests // max(1, len(chunks)))
    pieces = []
    for index, (start, length) in enumerate(chunks):
        step = max(min_piece, round_up(-(-length // parts), ALIGNMENT))
        pieces += [(index, start + at, min(step, length - at)) for at in range(0, max(length, 1), step)]
    return pieces


def combine_pieces(pieces: Sequence[tuple[int, int, int]], checksums: Sequence[int], chunks: int) -> tuple[int, ...]:
    """Each chunk's checksum from those of its pieces (``split_chunks`` order)."""
    combined: list[int | None] = [None] * chunks
    for (index, _, length), crc in zip(pieces, checksums, strict=True):
        before = combined[index]
        combined[index] = crc if before is None else checksum_combine(before, crc, length)
    return tuple(crc if crc is not None else checksum_bytes(b"") for crc in combined)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS


def disk_full(exc: OSError, what: str) -> DiskFullError:
    return DiskFullError(exc.errno, f"{what}: {os.strerror(exc.errno or 0)}")


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.numpy()


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's ``fallocate`` (Python exposes only ``posix_fallocate``, which cannot punch)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "fallocate", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int
    return function


_fallocate = _load_fallocate()


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate ``length`` bytes at ``offset`` of the file (it keeps its length and reads
    zeros there). Raises ``OSError`` (``EOPNOTSUPP`` where it cannot be done)."""
    if _fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available on this platform")
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def segment_name(segment: int) -> str:
    """The file name of segment ``segment`` (inside ``<root>/data``)."""
    return f"segment-{segment:06d}.bin"


def file_lengths(root: Path, segments: int) -> list[int | None]:
    """The length of each of the first ``segments`` data files of the disk tier at ``root``,
    None where one is missing."""
    lengths: list[int | None] = []
    for segment in range(segments):
        try:
            lengths.append((root / "data" / segment_name(segment)).stat().st_size)
        except FileNotFoundError:
            lengths.append(None)
    return lengths


def segment_number(path: Path) -> int | None:
    """The number of a segment file from its name, or None if it is not one."""
    stem = path.name.removeprefix("segment-").removesuffix(".bin")
    if path.name == stem or not stem.isdigit():
        return None
    return int(stem)


def is_segment_name(name: str) -> bool:
    return segment_number(Path(name)) is not None


def allocated_bytes(folder: Path) -> int:
    """Bytes the file system has allocated to the segment files in ``folder``."""
    return sum(path.stat().st_blocks * 512 for path in folder.glob(_SEGMENT_GLOB) if segment_number(path) is not None)


class FileIO:
    """The calls by which a disk tier changes its files and its catalog; plain ``os`` here.

    A subclass sees each of them in the order they are made (from several threads), which is
    how ``tierstore.faults.powercut`` records a workload and rebuilds the states a power cut
    could leave. Reads are not routed through it.
    """

    def open(self, path: Path, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        os.posix_fallocate(fd, offset, length)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, folder: Path) -> None:
        _fsync_dir(folder)

    def punch_hole(self, fd: int, offset: int, length: int) -> None:
        punch_hole(fd, offset, length)

    def unlink(self, path: Path) -> None:
        path.unlink()

    def catalog_commit(
        self, changes: Sequence[tuple[str, DiskRecord | None]], layout: CatalogLayout | None
    ) -> AbstractContextManager[None]:
        """A scope around one catalog transaction (``layout``: the new format record, if any):
        entered before it starts, left normally once it is durable."""
        return nullcontext()


class SegmentFiles:
    """The open data files of one disk tier folder.

    Parameters
    ----------
    folder:
        Where the segment files live (``<root>/data``).
    direct:
        ``"auto"`` uses ``O_DIRECT`` when the file system accepts it, ``True`` requires it,
        ``False`` uses the page cache.
    staging_buffers, staging_size:
        Aligned bounce buffers for chunks whose memory is not aligned (user tensors, small
        buffers); at most one per worker thread is in use at a time.
    io:
        The file-system calls that change the files (default: ``os``, see ``FileIO``).
    """

    def __init__(
        self, folder: Path, direct: bool | str, staging_buffers: int, staging_size: int, pinned: bool, io: FileIO | None = None
    ) -> None:
        self.folder = folder
        self.io = io if io is not None else FileIO()
        self._direct_setting = direct
        self.direct = False
        self._fds: list[int] = []
        # Descriptors of a SegmentFiles dropped without close() are closed when it is collected
        # (no job can use them then: every job holds a reference to this object). Not at
        # interpreter exit, where a store left open may still have jobs running on its daemon
        # I/O threads: closed under them, a number reused by a later open would take a pending
        # write into another file, and a trim raised IndexError. The process's end closes them.
        weakref.finalize(self, _close_all, self._fds, self.io).atexit = False
        #: The folder, held open while the files are: files are made and deleted by name, and a
        #: folder deleted and made again while its store was open (a notebook cell run twice)
        #: is another store's; its names must not be used (``_require_same_folder``).
        self._folder_fd: list[int] = []
        weakref.finalize(self, _close_plain, self._folder_fd).atexit = False
        #: False once the file system has said it cannot punch holes (space is then reused
        #: inside the files but not given back until trailing segments go).
        self.can_punch = True
        self._staging: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._staging_count = staging_buffers
        self._staging_size = staging_size
        self._pinned = pinned

    @property
    def staging_bytes(self) -> int:
        """Host memory held for staging (documented overhead beside the tiers' capacities)."""
        return self._staging_count * self._staging_size if self.direct else 0

    def path(self, segment: int) -> Path:
        return self.folder / segment_name(segment)

    def open(self, sizes: list[int]) -> None:
        """Open the existing segments, checking each is there and whole."""
        self.close()
        try:
            self._folder_fd.append(os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)))
            self.direct = self._probe_direct(sizes)
            for segment, size in enumerate(sizes):
                path = self.path(segment)
                try:
                    actual = path.stat().st_size
                except FileNotFoundError:
                    raise TruncatedSegment(segment, f"data file {path} is missing; the catalog says it holds {size} bytes") from None
                if actual < size:
                    raise TruncatedSegment(segment, f"data file {path} is truncated: {actual} of {size} bytes")
                self._fds.append(self._open_fd(path, create=False))
        except BaseException:
            self.close()
            raise
        if self.direct:
            for _ in range(self._staging_count):
                self._staging.put(aligned_empty(self._staging_size, pin_memory=self._pinned))

    def create(self, segment: int, size: int) -> None:
        """Create (or recreate) segment file ``segment`` with ``size`` bytes reserved on disk."""
        if segment != len(self._fds):
            raise ValueError(f"segments are created in order: expected {len(self._fds)}, got {segment}")
        self._require_same_folder(f"create data file {segment_name(segment)}")
        path = self.path(segment)
        fd = self._open_fd(path, create=True)
        try:
            self.io.ftruncate(fd, 0)
            self.io.fallocate(fd, 0, size)
            self.io.fsync(fd)
            self.io.fsync_dir(self.folder)
        except OSError as exc:
            self.io.close(fd)
            path.unlink(missing_ok=True)
            if is_disk_full(exc):
                raise disk_full(exc, f"cannot reserve {size} bytes for {path}") from None
            raise
        self._fds.append(fd)

    def close(self) -> None:
        _close_all(self._fds, self.io)
        _close_plain(self._folder_fd)
        while not self._staging.empty():
            self._staging.get()

    def punch(self, segment: int, offset: int, length: int) -> None:
        """Give the blocks of a freed range back to the file system; the file keeps its length.
        Where holes cannot be punched, the space stays in the file for reuse."""
        if not self.can_punch:
            return
        try:
            self.io.punch_hole(self._fds[segment], offset, length)
        except OSError as exc:
            if exc.errno not in _NO_PUNCH_ERRNOS:
                raise
            self.can_punch = False  # a property of the file system, not of this call

    def copy(self, source: tuple[int, int], target: tuple[int, int], length: int, buffer: torch.Tensor) -> None:
        """Copy ``length`` bytes from ``(segment, offset)`` ``source`` to ``target`` through the
        aligned ``buffer`` (both ranges aligned; the caller syncs the target)."""
        staging = _as_numpy(buffer)
        step = len(staging) // ALIGNMENT * ALIGNMENT
        if step <= 0:
            raise ValueError("the copy buffer is smaller than one block")
        for done in range(0, length, step):
            size = min(step, length - done)
            _pread_all(self._fds[source[0]], staging[:size].data, source[1] + done)
            _pwrite_all(self._fds[target[0]], staging[:size].data, target[1] + done, self.io.pwrite)

    def truncate(self, segment: int, size: int) -> None:
        """Cut segment file ``segment`` to ``size`` bytes (the catalog no longer uses the rest)."""
        self.io.ftruncate(self._fds[segment], size)

    def remove_tail(self, count: int) -> None:
        """Close and delete the last ``count`` segment files (the catalog no longer names them).
        Files already closed are left: the next open deletes them as strays. In a folder
        deleted or moved since it was opened (``same_folder``), they are closed and not deleted
        by name (the names may be another store's now): a deleted folder's go with it, a moved
        one's are strays for its next open."""
        here = not (count and self._fds) or self.same_folder()
        for _ in range(count):
            if not self._fds:  # (closed meanwhile: the rest stay as strays)
                break
            segment = len(self._fds) - 1
            self.io.close(self._fds.pop())
            if here:
                self.io.unlink(self.path(segment))
        if count and here:
            self.io.fsync_dir(self.folder)

    def remove_strays(self, count: int) -> list[Path]:
        """Delete segment files numbered ``count`` or more (left by a crash after the catalog
        stopped naming them, before they were deleted); return their paths."""
        self._require_same_folder("delete stray data files")
        numbered = ((path, segment_number(path)) for path in self.folder.glob(_SEGMENT_GLOB))
        strays = [path for path, number in numbered if number is not None and number >= count]
        for path in strays:
            self.io.unlink(path)
        if strays:
            self.io.fsync_dir(self.folder)
        return strays

    def same_folder(self) -> bool:
        """Whether ``folder`` still names the folder opened (True when not open): not deleted,
        moved or replaced since. Making or deleting files by name in another folder there would
        change another store's (a segment file created again over a new store's own: both
        wrote one file). (A check, then a call by name: a folder replaced in between is not
        seen; the window is that of one call.)"""
        if not self._folder_fd:
            return True
        held = os.fstat(self._folder_fd[0])
        try:
            now = os.stat(self.folder)
        except OSError:
            return False
        # (the held descriptor keeps the old folder's inode: a new folder cannot reuse its number)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def _require_same_folder(self, doing: str) -> None:
        """Raise ``FolderReplacedError`` unless ``same_folder``."""
        if self.same_folder():
            return
        root = self.folder.parent
        raise FolderReplacedError(
            f"cannot {doing}: the disk tier folder {root} was deleted, moved or replaced while its store was open "
            "(by a clean-up, or by code run again that then opened a new store there?); this store makes and deletes "
            "no files at that path any more, which may be another store's now. Its values already stored stay readable "
            "until it closes: read out what you need (in a deleted folder they are gone once it closes), then close it "
            "(aclose(flush=False); close(flush=False) on a SyncTierStore: what only memory holds has nowhere to go)",
        )

    def sync(self, segment: int) -> None:
        """Make the data written to ``segment`` durable."""
        self.io.fdatasync(self._fds[segment])

    def write_chunk(self, segment: int, file_offset: int, src: torch.Tensor, start: int, length: int) -> int:
        """Write ``src[start:start+length]`` at ``file_offset``; return its checksum (computed
        in the same job, so a chunk costs one trip to a worker thread)."""
        crc = checksum(_as_numpy(src[start : start + length]))
        self.write_unchecked(segment, file_offset, src, start, length)
        return crc

    def write_unchecked(self, segment: int, file_offset: int, src: torch.Tensor, start: int, length: int) -> None:
        """Write ``src[start:start+length]`` at ``file_offset`` (its checksum is computed
        elsewhere, beside the write)."""
        fd = self._fds[segment]
        payload = _as_numpy(src[start : start + length])
        pwrite = self.io.pwrite
        if not self.direct:
            _pwrite_all(fd, payload.data, file_offset, pwrite)
            return
        padded = round_up(length, ALIGNMENT)
        direct = self._direct_span(src, start, length)
        if direct == padded:  # aligned, with room for the padding: straight from the tensor
            _pwrite_all(fd, (_as_numpy(src[start : start + padded])).data, file_offset, pwrite)
            return
        if direct:
            _pwrite_all(fd, (payload[:direct]).data, file_offset, pwrite)
        rest = length - direct
        staging = self._staging.get()
        try:
            stage = _as_numpy(staging)
            np.copyto(stage[:rest], payload[direct:])
            stage[rest : padded - direct] = 0
            _pwrite_all(fd, (stage[: padded - direct]).data, file_offset + direct, pwrite)
        finally:
            self._staging.put(staging)

    def read_chunk(self, segment: int, file_offset: int, dst: torch.Tensor, start: int, length: int) -> int:
        """Read ``length`` bytes at ``file_offset`` into ``dst[start:]``; return their checksum."""
        fd = self._fds[segment]
        target = _as_numpy(dst[start : start + length])
        if not self.direct:
            _pread_all(fd, target.data, file_offset)
            return checksum(target)
        padded = round_up(length, ALIGNMENT)
        direct = self._direct_span(dst, start, length)
        if direct == padded:
            _pread_all(fd, (_as_numpy(dst[start : start + padded])).data, file_offset)
            return checksum(target)
        if direct:
            _pread_all(fd, (target[:direct]).data, file_offset)
        rest = length - direct
        staging = self._staging.get()
        try:
            stage = _as_numpy(staging)
            _pread_all(fd, (stage[: padded - direct]).data, file_offset + direct)
            np.copyto(target[direct:], stage[:rest])
        finally:
            self._staging.put(staging)
        return checksum(target)

    @staticmethod
    def _direct_span(buffer: torch.Tensor, start: int, length: int) -> int:
        """How many leading bytes of ``buffer[start:start+length]`` can move with O_DIRECT in
        place: all of it rounded up to a block if the buffer is aligned and has room for the
        padding, its whole blocks if aligned without that room, none if unaligned."""
        if not is_aligned(buffer[start:]):
            return 0
        padded = round_up(length, ALIGNMENT)
        if buffer.numel() - start >= padded:
            return padded
        return length // ALIGNMENT * ALIGNMENT

    def read_raw(self, segment: int, file_offset: int, length: int) -> bytes:
        """Bytes straight from the file through the page cache (for tools and tests)."""
        self._require_same_folder(f"read data file {segment_name(segment)}")
        with open(self.path(segment), "rb") as handle:
            handle.seek(file_offset)
            return handle.read(length)

    def _open_fd(self, path: Path, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0)
        if self.direct:
            flags |= os.O_DIRECT
        return self.io.open(path, flags, 0o600)

    def _probe_direct(self, sizes: list[int]) -> bool:
        if self._direct_setting is False or not hasattr(os, "O_DIRECT"):
            if self._direct_setting is True:
                raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
            return False
        probe = self.folder / ".direct-probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError as exc:
            if self._direct_setting is True:
                raise OSError(exc.errno, f"O_DIRECT is not supported under {self.folder}: {exc.strerror}") from None
            return False
        try:
            block = aligned_empty(ALIGNMENT)
            os.pwrite(fd, block.numpy().data, 0)
            os.preadv(fd, [block.numpy().data], 0)
            return True
        except OSError as exc:
            if self._direct_setting is True:
                raise OSError(exc.errno, f"O_DIRECT I/O fails under {self.folder}: {exc.strerror}") from None
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)


def _pwrite_all(fd: int, data: memoryview, offset: int, pwrite: Callable[[int, memoryview, int], int] = os.pwrite) -> None:
    done = 0
    total = len(data)
    while done < total:
        try:
            written = pwrite(fd, data[done:], offset + done)
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full(exc, "writing a data file") from None
            raise
        if written == 0:
            raise DiskFullError(errno.ENOSPC, "writing a data file: no progress")
        done += written


def _pread_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    total = len(data)
    while done < total:
        got = os.preadv(fd, [data[done:]], offset + done)
        if got == 0:
            raise CatalogError(f"data file ends at byte {offset + done}, inside an extent; it was truncated")
        done += got


def _close_all(fds: list[int], io: FileIO) -> None:
    while fds:
        io.close(fds.pop())


def _close_plain(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
