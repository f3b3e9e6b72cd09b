"""The disk tier's catalog: an LMDB database of what lives in the data files.

Two named databases: ``meta`` (format and its version, chunk size, segment sizes) and
``entries`` (one binary record per key, found by the key's digest; the key itself is inside the
record, and so are the bytes of a small value). Nothing is pickled. Writes from many coroutines
are grouped into one transaction each time the single writer thread comes free (group commit),
so durable puts share the sync of one commit; a non-durable write may be queued without waiting
(``stage``), and reads in the process see queued changes before they commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import resource
import shutil
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import crc32c
import lmdb
import torch

from ..errors import CatalogError, DiskFullError, FolderPermissionError, StoreClosedError
from ..keys import address_hash, key_digest
from ..tensors import TensorMeta, dtype_from_name, dtype_name
from .extents import Extent
from .files import is_disk_full
from .serial import SerialExecutor

FORMAT = "tierstore-disk"
#: The on-disk layout this code writes. 1: the first release (segment files of any sizes, JSON
#: records); 2: segments shrink and go away as space is freed; 3: binary records, and small
#: values inline in their record; 4: each binary record ends with a checksum of its own. Raise it
#: whenever the layout changes, and add the upgrade from the version before to ``_UPGRADES``.
FORMAT_VERSION = 4
#: What a catalog that records no version was written with.
_UNVERSIONED = 1
_META_KEY = b"format"
#: LMDB's errors that say the tree it read is damaged (not a reader's environment: a map grown
#: by the writer, a full reader table, which pass as LMDB raised them).
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError, lmdb.InvalidError)
_INITIAL_MAP_SIZE = 256 << 20
#: Records, and bytes of them, ``Catalog._seal_records`` rewrites per transaction (at most).
_SEAL_BATCH, _SEAL_BATCH_BYTES = 8192, 32 << 20
#: The most changes a transaction with no sync may hold to be committed on the loop's thread
#: (``Catalog._flush``), about 1.3 ms of the loop at ~5 us a change; larger ones (a ``flush()``
#: of many keys, a burst of puts) go to the writer thread.
_ON_LOOP_MAX = 256
#: Transactions of up to this many changes apply them one by one, in order (no sorting).
_FEW_CHANGES = 4
#: Seconds a staged change (a small non-durable put) waits before a transaction starts for it,
#: so that puts arriving one by one share transactions (``Catalog.stage_inline``).
STAGE_WINDOW = 0.002


#: First byte of a binary record as format version 3 wrote it; JSON records (versions 1 and 2)
#: start with ``{``, so both read back.
_BINARY = 0xB3
#: First byte of a *sealed* binary record (format version 4, what is written now): the same
#: record followed by the CRC-32C (``_CHECKSUM``) of all its bytes but an inline value's own
#: (those have their checksum, in the record), so that a damaged header, shape, key or extent is
#: found, not read as another tensor (LMDB checks nothing: a flipped bit in an empty tensor's
#: shape read back as another shape, no byte of data to fail), while a damaged inline value
#: still fails its own checksum when read, as a value in a data file does.
_SEALED = 0xB4
_EXTENT, _INLINE = 1, 2
#: magic, kind, ndim, dtype name length, key length, version
_HEAD = struct.Struct("<BBBBIQ")
_EXTENT_PART = struct.Struct("<IQQI")  # segment, offset, length, number of checksums
_CHECKSUM = struct.Struct("<I")
#: The same header read as half-words for the scan on open: magic and kind (``_INLINE_TAG`` for
#: an inline record), ndim and the dtype name's length (low byte, high byte), key length, version.
_SCAN_HEAD = struct.Struct("<HHIQ")
_INLINE_TAG = _BINARY | _INLINE << 8
_SEALED_INLINE_TAG = _SEALED | _INLINE << 8
_DTYPE_NAMES: dict[str, bytes] = {}
_DTYPES_BY_NAME: dict[bytes, torch.dtype] = {}


@dataclass(frozen=True)
class DiskRecord:
    """What the catalog knows of one key: its tensor, where its bytes are, and their checksums.

    A large value lies in an ``extent`` of a data file, with one checksum per chunk. A small
    value is *inline*: its bytes are ``data``, inside the record itself (``extent`` None, one
    checksum of the whole value), so writing it is one catalog transaction and nothing else.
    A record parsed without its data (``from_bytes(..., with_data=False)``, as on open) has
    ``inline`` set and ``data`` None.
    """

    key: str
    meta: TensorMeta
    extent: Extent | None
    version: int
    checksums: tuple[int, ...]
    data: bytes | None = None
    inline: bool = False

    def miscounted_checksums(self, chunk_size: int) -> str | None:
        """What is wrong with the number of checksums of a value in an extent, whose data
        file has one per ``chunk_size`` bytes (at least one); None if it is right."""
        expected = max(1, -(-self.meta.nbytes // chunk_size))
        if len(self.checksums) == expected:
            return None
        return f"has {len(self.checksums)} checksums for {self.meta.nbytes} bytes, expected {expected}"

    def to_bytes(self) -> bytes:
        """The sealed binary record (format version 4): a fixed header, the dtype name, the
        shape, the key, then an extent and its checksums, or the checksum and bytes of an inline
        value, then the checksum of all that (``seal``)."""
        if self.inline and self.data is not None and len(self.checksums) == 1:
            return inline_bytes(self.key, self.meta, self.version, self.checksums[0], self.data)
        dtype = _DTYPE_NAMES.get(str(self.meta.dtype))
        if dtype is None:
            dtype = _DTYPE_NAMES[str(self.meta.dtype)] = dtype_name(self.meta.dtype).encode("ascii")
        key = self.key.encode("utf-8")
        shape = self.meta.shape
        parts = [
            _HEAD.pack(_SEALED, _INLINE if self.inline else _EXTENT, len(shape), len(dtype), len(key), self.version),
            dtype,
            struct.pack(f"<{len(shape)}q", *shape),
            key,
        ]
        if self.inline:
            if self.data is None or len(self.checksums) != 1:
                raise ValueError(f"inline record of {self.key!r} needs its data and one checksum")
            parts += [_CHECKSUM.pack(self.checksums[0]), self.data]
        else:
            extent = self.extent
            if extent is None:
                raise ValueError(f"record of {self.key!r} has neither an extent nor inline data")
            parts += [
                _EXTENT_PART.pack(extent.segment, extent.offset, extent.length, len(self.checksums)),
                struct.pack(f"<{len(self.checksums)}I", *self.checksums),
            ]
        return seal(b"".join(parts))

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview, with_data: bool = True) -> DiskRecord:
        """Parse a record (sealed binary, the unsealed binary of format version 3, or the JSON
        of versions 1 and 2); raises ``ValueError`` with the reason if it is malformed or fails
        its own checksum. ``with_data=False`` leaves an inline value's bytes in the catalog
        (``data`` None)."""
        if len(raw) and raw[0] == _SEALED:
            return cls._from_binary(unsealed(raw), with_data)
        if len(raw) and raw[0] == _BINARY:
            return cls._from_binary(raw, with_data)
        return cls._from_json(bytes(raw))

    @classmethod
    def _from_binary(cls, raw: bytes | memoryview, with_data: bool) -> DiskRecord:
        try:
            _, kind, ndim, dtype_len, key_len, version = _HEAD.unpack_from(raw, 0)
            at = _HEAD.size
            name = bytes(raw[at : at + dtype_len])
            dtype = _DTYPES_BY_NAME.get(name)
            if dtype is None:
                dtype = _DTYPES_BY_NAME[name] = dtype_from_name(name.decode("ascii"))
            at += dtype_len
            shape = struct.unpack_from(f"<{ndim}q", raw, at)
            at += 8 * ndim
            key = bytes(raw[at : at + key_len]).decode("utf-8")
            at += key_len
            if kind == _INLINE:
                (checksum,) = _CHECKSUM.unpack_from(raw, at)
                at += _CHECKSUM.size
                data = bytes(raw[at:]) if with_data else None
                extent, checksums, inline, stored = None, (checksum,), True, len(raw) - at
            elif kind == _EXTENT:
                segment, offset, length, count = _EXTENT_PART.unpack_from(raw, at)
                at += _EXTENT_PART.size
                checksums = struct.unpack_from(f"<{count}I", raw, at)
                at += 4 * count
                if at != len(raw):
                    raise ValueError(f"{len(raw) - at} bytes after the checksums")
                extent, data, inline, stored = Extent(segment, offset, length), None, False, length
            else:
                raise ValueError(f"unknown record kind {kind}")
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"not a well-formed record ({exc})") from None
        if any(d < 0 for d in shape) or not key:
            raise ValueError("negative dimension or empty key")
        if version < 1:
            raise ValueError(f"version {version}: a stored value's version is 1 or more")
        meta = TensorMeta(dtype, shape)
        if stored < meta.nbytes or (inline and stored != meta.nbytes):
            raise ValueError(f"{stored} stored bytes cannot hold a value of {meta.nbytes}")
        return cls(key, meta, extent, version, checksums, data, inline)

    @classmethod
    def _from_json(cls, raw: bytes) -> DiskRecord:
        try:
            fields = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a JSON record ({exc})") from None
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        try:
            meta = TensorMeta.from_json(fields)
            ints = [fields[name] for name in ("nbytes", "segment", "offset", "length", "version")]
            checksums = fields["checksums"]
            key = fields["key"]
        except KeyError as exc:
            raise ValueError(f"field {exc} is missing") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError("nbytes, segment, offset, length and version must be non-negative ints")
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty str")
        if not isinstance(checksums, list) or not all(isinstance(c, int) for c in checksums):
            raise ValueError("checksums must be a list of ints")
        nbytes, segment, offset, length, version = ints
        if nbytes != meta.nbytes:
            raise ValueError(f"nbytes {nbytes} disagrees with dtype and shape ({meta.nbytes})")
        if version < 1:
            raise ValueError(f"version {version}: a stored value's version is 1 or more")
        if length < nbytes:
            raise ValueError(f"extent of {length} bytes cannot hold {nbytes}")
        return cls(key, meta, Extent(segment, offset, length), version, tuple(checksums))


#: A queued catalog change: key -> its new record (or, for a staged small put, the record's
#: binary form), or None to delete it.
_Change = tuple[str, "DiskRecord | bytes | None"]


@dataclass
class InlineScan:
    """The values inline in a catalog, as ``Catalog.scan`` found them: the i-th key's metadata
    (shared objects) and version are ``metas[i]`` and ``versions[i]``; ``nbytes`` is their
    total size. Iterating yields ``(key, meta, version)``."""

    keys: list[str]
    metas: list[TensorMeta]
    versions: list[int]
    nbytes: int

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[str, TensorMeta, int]]:
        return zip(self.keys, self.metas, self.versions, strict=True)


#: The dtype-and-shape part of inline records, by metadata (a store keeps few distinct ones).
_DESCRIBED: dict[TensorMeta, tuple[int, int, bytes]] = {}
_MAX_DESCRIBED = 4096
#: The last metadata described, with its part (one tuple, read at once: any thread may swap it):
#: a run of puts of one shape and dtype skips the hash of the metadata.
_LAST_DESCRIBED: list[tuple[TensorMeta | None, tuple[int, int, bytes]]] = [(None, (0, 0, b""))]


def inline_bytes(key: str, meta: TensorMeta, version: int, checksum: int, data: bytes) -> bytes:
    """The binary record of a value kept inline (what ``DiskRecord.to_bytes`` writes for one),
    made without a record object: the record a small put stages."""
    last_meta, described = _LAST_DESCRIBED[0]
    if last_meta is not meta:
        found = _DESCRIBED.get(meta)
        if found is None:
            name = dtype_name(meta.dtype).encode("ascii")
            shape = meta.shape
            found = (len(shape), len(name), name + struct.pack(f"<{len(shape)}q", *shape))
            if len(_DESCRIBED) < _MAX_DESCRIBED:
                _DESCRIBED[meta] = found
        described = found
        _LAST_DESCRIBED[0] = (meta, found)
    ndim, name_length, dtype_and_shape = described
    encoded = key.encode("utf-8")
    described_part = _HEAD.pack(_SEALED, _INLINE, ndim, name_length, len(encoded), version) + dtype_and_shape + encoded + _CHECKSUM.pack(checksum)
    return b"".join((described_part, data, _CHECKSUM.pack(crc32c.crc32c(described_part))))


def seal(body: bytes) -> bytes:
    """``body`` (the binary record of a value in an extent, starting with ``_SEALED``)
    followed by its own checksum."""
    return body + _CHECKSUM.pack(crc32c.crc32c(body))


def unsealed(raw: bytes | memoryview) -> memoryview:
    """A sealed record without its checksum, once that checksum is checked (``ValueError`` if
    the record is too short to hold one, or fails it). An inline value's bytes are not
    checked here: they fail their own checksum when read."""
    view = memoryview(raw)
    end = len(view) - _CHECKSUM.size
    if end < _HEAD.size:
        raise ValueError(f"{len(view)} bytes are too few for a record")
    _, kind, ndim, dtype_len, key_len, _ = _HEAD.unpack_from(view, 0)
    covered = _HEAD.size + dtype_len + 8 * ndim + key_len + _CHECKSUM.size if kind == _INLINE else end
    if covered > end or crc32c.crc32c(view[:covered]) != _CHECKSUM.unpack_from(view, end)[0]:
        raise ValueError("it fails its own checksum")
    return view[:end]


def _inline_of(raw: bytes | memoryview, key: str) -> tuple[int, int, bytes | bytearray] | None:
    """``(version, checksum, bytes)`` of a binary record if it holds an inline value (the bytes
    copied out once, into a bytearray a tensor can take over), else None; raises ``ValueError``
    (or ``struct.error``) if it is malformed, fails its own checksum or names another key."""
    magic, kind, ndim, dtype_len, key_len, version = _HEAD.unpack_from(raw, 0)
    if kind != _INLINE or magic not in (_SEALED, _BINARY):
        return None  # (a JSON record, format 1 or 2, is never inline; an extent's is read in full)
    at = _HEAD.size + dtype_len + 8 * ndim
    if raw[at : at + key_len] != key.encode("utf-8"):
        raise ValueError("the record names another key")
    at += key_len
    (checksum,) = _CHECKSUM.unpack_from(raw, at)
    data_at, end = at + _CHECKSUM.size, len(raw)
    if magic == _SEALED:  # (its seal, last, covers all but the value: the same check as ``unsealed``)
        end -= _CHECKSUM.size
        if end < data_at or crc32c.crc32c(raw[:data_at]) != _CHECKSUM.unpack_from(raw, end)[0]:
            raise ValueError("it fails its own checksum")
    return version, checksum, bytearray(raw[data_at:end])


@dataclass(frozen=True)
class CatalogLayout:
    """The format settings fixed when a folder is created."""

    chunk_size: int
    alignment: int
    segments: tuple[int, ...]
    #: The version the folder was written with (``to_bytes`` always writes ``FORMAT_VERSION``).
    format_version: int = field(default=FORMAT_VERSION, compare=False)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                # What readers of version 1 check: they refuse this folder by its number.
                "version": FORMAT_VERSION,
                "chunk_size": self.chunk_size,
                "alignment": self.alignment,
                "segments": list(self.segments),
            }
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: Path) -> CatalogLayout:
        try:
            fields = json.loads(raw)
            if fields.get("format") != FORMAT:
                raise CatalogError(f"{where} is not a tierstore disk folder (format {fields.get('format')!r})")
            version = _version_of(fields, where)
            layout = cls(
                int(fields["chunk_size"]), int(fields["alignment"]), tuple(int(s) for s in fields["segments"]), version
            )
        except CatalogError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CatalogError(f"the catalog's format record in {where} is unreadable: {exc!r}") from None
        if layout.chunk_size <= 0 or layout.alignment <= 0 or any(s < 0 for s in layout.segments):
            raise CatalogError(f"the catalog's format record in {where} has impossible values: {layout}")
        return layout


class RecordDamagedError(CatalogError):
    """One catalog record does not parse or fails its own checksum (``tierstore repair`` can drop it)."""


@dataclass(frozen=True)
class DamagedRecord:
    """A catalog record that does not parse or fails its own checksum: its address, the key
    it names where that is still readable (``_key_in``), and what is wrong."""

    digest: bytes
    key: str | None
    reason: str

    @property
    def name(self) -> str:
        """How a message names it: by its key where known, always by its address."""
        return f"of {self.key!r} ({self.digest.hex()})" if self.key is not None else self.digest.hex()


def _key_in(raw: bytes | memoryview, digest: bytes) -> str | None:
    """The key a damaged binary record names, where its bytes are intact (they hash to the
    record's address, so it is that key's record), else None."""
    try:
        _, _, ndim, dtype_len, key_len, _ = _HEAD.unpack_from(raw, 0)
        at = _HEAD.size + dtype_len + 8 * ndim
        key = bytes(raw[at : at + key_len]).decode("utf-8")
    except (struct.error, UnicodeDecodeError):
        return None
    return key if key and key_digest(key) == digest else None


def _version_of(fields: dict[str, Any], where: Path) -> int:
    """The format version a format record declares; refuses one this code cannot read."""
    version = fields.get("format_version", fields.get("version", _UNVERSIONED))
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CatalogError(f"{where} declares format version {version!r}, which no tierstore wrote")
    if version > FORMAT_VERSION:
        raise CatalogError(
            f"{where} was written by a newer tierstore (format version {version}); this one reads versions "
            f"up to {FORMAT_VERSION}: upgrade tierstore to open it"
        )
    missing = [v for v in range(version, FORMAT_VERSION) if v not in _UPGRADES]
    if missing:
        raise CatalogError(
            f"{where} has format version {version}, which this tierstore (format version {FORMAT_VERSION}) "
            f"cannot upgrade (no way from version {missing[0]}); open it with an older tierstore and export it"
        )
    return version


def _records_unchanged(txn: Any, entries: Any) -> None:
    """Version 1 -> 2: records and segments read the same; only the version number moves.
    Version 2 -> 3: JSON records stay as they are (they read back beside binary ones). Version
    3 -> 4: the same for unsealed binary records. ``Catalog.upgrade`` then seals them all
    (``Catalog._seal_records``)."""


#: Upgrades in place, by the version they start from: each brings a catalog to the next version
#: inside the write transaction that records the new version.
_UPGRADES: dict[int, Callable[[Any, Any], None]] = {1: _records_unchanged, 2: _records_unchanged, 3: _records_unchanged}


class Catalog:
    """The LMDB catalog of one disk folder. ``open`` and the reads run on the caller's thread;
    ``commit`` runs writes on one dedicated writer thread, grouped."""

    def __init__(self, path: Path, durable: bool) -> None:
        self.path = path
        self.durable = durable
        self._env: Any = None
        self._entries: Any = None
        self._meta: Any = None
        self._writer: SerialExecutor | None = None
        self._pending: list[tuple[list[_Change], asyncio.Future[None] | None, bool]] = []
        #: Changes queued or being committed, per key, oldest first, each with whether its
        #: writer waits for it (``get`` reads the newest). A waited change that fails is taken
        #: out and the one before it shows again, so the older ones stay until one commits.
        self._staged: dict[str, list[tuple[_Change, bool]]] = {}
        #: The changes in ``_staged``, all keys together (what ``queued`` says).
        self._changes = 0
        #: Per key in ``_staged``, its newest acknowledged (not waited) change, with (for one
        #: ``stage_inline`` queued) its group and the ``_pending`` list holding that group: while
        #: that list is still ``_pending`` the group is not committing, and a newer put of the
        #: key replaces the change in place instead of queuing another.
        self._newest: dict[str, tuple[_Change, list[_Change] | None, list[Any] | None]] = {}
        #: Staged groups whose transaction failed, for the next one.
        self._retry: list[tuple[list[_Change], asyncio.Future[None] | None, bool]] = []
        #: The failure of a staged group nobody waited for (raised by ``drain``).
        self.error: BaseException | None = None
        self._flushing: asyncio.Task[None] | None = None
        #: The timer that starts committing staged changes (``stage_inline``), if one is set.
        self._kick: asyncio.TimerHandle | None = None
        self.layout: CatalogLayout | None = None
        #: The addresses of the records the last ``scan`` found without a seal of their own
        #: (JSON, format 3): ``upgrade`` seals them.
        self._unsealed: list[bytes] = []
        #: Held by whichever thread runs a write transaction (the writer, or a worker thread
        #: committing the record of what it just wrote: ``commit_here``): one at a time.
        self._txn_lock = threading.RLock()
        #: Commits handed straight to the writer thread (``commit``'s uncontended path) and
        #: not yet done: while any is, the next ones queue for a shared transaction.
        self._direct = 0

    def open(self, create_layout: CatalogLayout | None) -> CatalogLayout:
        """Open the database. A new one gets ``create_layout`` (None: a new one is an error, as
        when data files exist); an existing one is validated."""
        self.path.mkdir(mode=0o700, exist_ok=True)
        self._refuse_emptied()
        raw = self._open_env(
            map_size=_INITIAL_MAP_SIZE, sync=self.durable, metasync=self.durable, mode=0o600, readahead=False
        )
        if raw is None:
            if create_layout is None:
                self.close()
                raise CatalogError(
                    f"{self.path} holds no catalog, but the folder has data files: it was emptied or lost. "
                    "Refusing to start over on top of them (move the folder away to start fresh)"
                )
            self._write_sync([], create_layout)
            self.layout = create_layout
        else:
            self.layout = CatalogLayout.from_bytes(raw, self.path)
        self._writer = SerialExecutor("tierstore-catalog")
        return self.layout

    def upgrade(self) -> None:
        """Bring an older catalog to ``FORMAT_VERSION`` (one transaction), then seal every record
        the last ``scan`` found unsealed (JSON or format-3 records, which an earlier tierstore
        left unsealed until their key was next written: ``_seal_records``); the opener calls it
        once its scan found the records sound (a damaged folder keeps its version: the
        tierstore that wrote it can still open it)."""
        layout = self.layout
        if layout is not None and layout.format_version < FORMAT_VERSION:
            self._upgrade(layout)
        if self._unsealed:
            self._seal_records()

    def _upgrade(self, layout: CatalogLayout) -> None:
        try:
            with self._env.begin(write=True) as txn:
                for version in range(layout.format_version, FORMAT_VERSION):
                    _UPGRADES[version](txn, self._entries)
                txn.put(_META_KEY, layout.to_bytes(), db=self._meta)
        except lmdb.Error as exc:
            self.close()
            raise CatalogError(f"the catalog in {self.path} cannot be upgraded from format version {layout.format_version}: {exc}") from None
        self.layout = replace(layout, format_version=FORMAT_VERSION)

    def _seal_records(self) -> None:
        """Rewrite every record not sealed (JSON, format 3) as the sealed binary record of the
        same key, tensor, extent, version and checksums (an inline value's bytes and checksum as
        they are: a value damaged already still fails its own checksum when read), in
        transactions of at most ``_SEAL_BATCH`` records and ``_SEAL_BATCH_BYTES`` that grow the
        map as a commit does (one for all would need free map room for the whole catalog twice
        over). Each record reads the same sealed or not, so a crash part-way leaves a sound
        folder whose next open seals the rest. The addresses are the scan's: no second pass."""
        addresses = self._unsealed
        start = 0
        while start < len(addresses):
            batch: list[tuple[str, DiskRecord]] = []
            nbytes = 0
            with self._env.begin(db=self._entries) as txn:
                while start < len(addresses) and len(batch) < _SEAL_BATCH and nbytes < _SEAL_BATCH_BYTES:
                    raw = txn.get(addresses[start])
                    record = DiskRecord.from_bytes(raw)
                    batch.append((record.key, record))
                    nbytes += len(raw)
                    start += 1
            self._write_sync(batch, None)
        self._unsealed = []

    def open_readonly(self) -> CatalogLayout:
        """Open for reading only (safe beside a process that has the folder open for writing)."""
        if not (self.path / "data.mdb").exists():
            raise CatalogError(f"{self.path} holds no tierstore catalog")
        self._refuse_emptied(opening=False)
        raw = self._open_env(readonly=True, lock=True, readahead=False)
        if raw is None:
            self.close()
            raise CatalogError(f"{self.path} holds no tierstore catalog")
        self.layout = CatalogLayout.from_bytes(raw, self.path)
        return self.layout

    def _refuse_emptied(self, opening: bool = True) -> None:
        data = self.path / "data.mdb"
        if data.exists() and data.stat().st_size == 0:
            # LMDB writes its meta pages as it creates the file: an empty one was truncated, and
            # small values lived in it (they have no data files to betray their loss).
            raise CatalogError(
                f"the catalog {data} is empty (truncated): whatever the store held is lost"
                + (". Refusing to start over on top of it (move the folder away to start fresh)" if opening else "")
            )

    def _open_env(self, **options: Any) -> bytes | None:
        """Open the LMDB environment and its two databases; return the format record, if any."""
        try:
            self._env = lmdb.open(str(self.path), max_dbs=2, **options)
            self._check_length()
            found = _named_databases(self._env)
            if found and found != {b"meta", b"entries"} and not (found == {b"meta"} and not self._has_format_record()):
                # (a catalog has both or neither -- or a meta database with no format record, made by a
                # tierstore that stopped before the other: a new store. One missing otherwise, or one
                # of another name, is damage -- a flipped bit in a database's name -- and an empty one
                # made in its place would hand the lost keys' extents to new writes)
                raise CatalogError(
                    f"the catalog in {self.path} is damaged: it names the databases {sorted(n.decode(errors='replace') for n in found)}, "
                    "not 'meta' and 'entries'; nothing was changed (restore the folder from a copy, or export what "
                    "`tierstore info` still lists)"
                )
            if options.get("readonly", False):
                self._meta = self._env.open_db(b"meta", create=False)
                self._entries = self._env.open_db(b"entries", create=False)
            else:
                with self._env.begin(write=True) as txn:  # (both or neither)
                    self._meta = self._env.open_db(b"meta", txn=txn, create=True)
                    self._entries = self._env.open_db(b"entries", txn=txn, create=True)
            with self._env.begin(db=self._meta) as txn:
                raw = txn.get(_META_KEY)
        except lmdb.Error as exc:
            self.close()
            # (py-lmdb names a system error by its strerror text alone, with no errno)
            code = next((code for code in (errno.EACCES, errno.EPERM, errno.EROFS) if os.strerror(code) in str(exc)), None)
            if code is not None:
                raise FolderPermissionError(
                    code,
                    f"the catalog in {self.path} cannot be opened: {exc} (the folder's permissions, not damage: this user "
                    "needs to read and write its files, its lock file included; nothing was changed)"
                ) from None
            raise CatalogError(
                f"the catalog in {self.path} cannot be opened: {exc} (LMDB's own header or pages are damaged, or the file is "
                "no LMDB database; `tierstore repair` mends records, not this: restore the folder from a copy)"
            ) from None
        except CatalogError:
            self.close()
            raise
        return bytes(raw) if raw is not None else None

    def _has_format_record(self) -> bool:
        meta = self._env.open_db(b"meta", create=False)
        with self._env.begin(db=meta) as txn:
            return txn.get(_META_KEY) is not None

    def _check_length(self) -> None:
        """A catalog file shorter than its own last page would fault (SIGBUS) when that page is
        read through the memory map: refuse it on open instead."""
        info, psize = self._env.info(), self._env.stat()["psize"]
        needed = (info["last_pgno"] + 1) * psize
        actual = (self.path / "data.mdb").stat().st_size
        if actual < needed:
            raise CatalogError(f"the catalog {self.path / 'data.mdb'} is truncated: {actual} of {needed} bytes")

    def close(self) -> None:
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._env is not None:
            self._env.close()
            self._env = None

    def records(self, with_data: bool = False, damaged: list[DamagedRecord] | None = None) -> Iterator[tuple[bytes, DiskRecord]]:
        """Every committed record, validated; raises ``CatalogError`` naming the first bad one,
        or, given a ``damaged`` list, adds each bad one to it and goes on. Inline values are
        left in the catalog unless ``with_data``."""
        try:
            with self._env.begin(db=self._entries, buffers=True) as txn:
                for digest_view, raw in txn.cursor():
                    digest = bytes(digest_view)
                    try:
                        record = DiskRecord.from_bytes(raw, with_data)
                        if key_digest(record.key) != digest:
                            raise ValueError("filed under another key's address")
                    except ValueError as exc:
                        bad = DamagedRecord(digest, _key_in(raw, digest), str(exc))
                        if damaged is None:
                            raise RecordDamagedError(f"catalog record {bad.name} in {self.path} is corrupt: {exc}") from None
                        damaged.append(bad)
                        continue
                    yield digest, record
        except _DAMAGE as exc:
            raise self._damaged(exc) from None

    def scan(self) -> tuple[dict[str, DiskRecord], InlineScan]:
        """Every committed record, validated as ``records`` does, split for a fast open: the
        records of values in extents by key, and the keys, metadata and versions of the values
        inline (no record object made for those: a store of a million small keys opens in
        seconds). Equal metadata comes back as one shared object."""
        from ..entry import shared_meta  # (entry imports the tiers, which import this module)

        extents: dict[str, DiskRecord] = {}
        found = InlineScan([], [], [], 0)
        keys, metas, versions = found.keys, found.metas, found.versions
        add_key, add_meta, add_version = keys.append, metas.append, versions.append
        # What follows the fixed header of an inline record (dtype name, then shape) ->
        # (the header's dtype-and-shape half-word, the shared meta, its nbytes). A store keeps
        # few distinct ones; each is parsed in full once (the slow path), then recognized.
        described: dict[bytes, tuple[int, TensorMeta, int]] = {}
        head, head_size, checksum_size, tag_inline = _SCAN_HEAD.unpack_from, _SCAN_HEAD.size, _CHECKSUM.size, _INLINE_TAG
        tag_sealed, unpack_checksum, crc = _SEALED_INLINE_TAG, _CHECKSUM.unpack_from, crc32c.crc32c
        hasher, inline_bytes = address_hash, 0
        to_seal: list[bytes] = []
        # (records as bytes, not buffers: slicing bytes is cheaper than making memoryviews)
        try:
            with self._env.begin(db=self._entries) as txn:
                for digest, raw in txn.cursor():
                    try:
                        tag, form, key_len, version = head(raw, 0)
                        at = head_size + (form >> 8) + 8 * (form & 0xFF)  # past the dtype name and shape
                        known = described.get(raw[head_size:at])
                        if known is None or known[0] != form or not key_len or not version:
                            raise _SlowPath
                        end = at + key_len
                        nbytes = known[2]
                        if tag == tag_sealed:  # (its seal covers all but the value's bytes: they have their own checksum)
                            sealed_at = len(raw) - checksum_size
                            if sealed_at - end - checksum_size != nbytes or crc(raw[: end + checksum_size]) != unpack_checksum(raw, sealed_at)[0]:
                                raise _SlowPath  # (the full parse names what is wrong)
                        elif tag != tag_inline or len(raw) - end - checksum_size != nbytes:
                            raise _SlowPath
                        encoded = raw[at:end]
                        if hasher(encoded).digest() != digest:
                            raise _SlowPath  # (the full parse raises for a record under another key's address)
                        add_key(encoded.decode("utf-8"))
                        if tag != tag_sealed:
                            to_seal.append(digest)
                    except (_SlowPath, struct.error, UnicodeDecodeError):
                        record = self._parse(digest, raw)
                        if raw[0] != _SEALED:
                            to_seal.append(digest)
                        if record.extent is not None:
                            extents[record.key] = record
                            continue
                        meta = shared_meta(record.meta)
                        if raw[0] in (_BINARY, _SEALED):  # (the next records of this dtype and shape take the fast path)
                            form = _SCAN_HEAD.unpack_from(raw, 0)[1]
                            described[raw[head_size : head_size + (form >> 8) + 8 * (form & 0xFF)]] = (form, meta, meta.nbytes)
                        add_key(record.key)
                        add_meta(meta)
                        add_version(record.version)
                        inline_bytes += meta.nbytes
                        continue
                    add_meta(known[1])
                    add_version(version)
                    inline_bytes += nbytes
        except _DAMAGE as exc:
            raise self._damaged(exc) from None
        found.nbytes = inline_bytes
        self._unsealed = to_seal
        return extents, found

    def remove_addresses(self, addresses: Iterable[bytes]) -> None:
        """Delete the records at ``addresses`` (damaged ones too, whose key may be unreadable),
        in one transaction (``tierstore.disk.repair``; on a catalog opened for writing)."""
        addresses = list(addresses)
        while True:
            try:
                with self._txn_lock, self._env.begin(write=True, db=self._entries) as txn:
                    for address in addresses:
                        txn.delete(address)
                return
            except lmdb.MapFullError:  # (a delete writes new pages too: a catalog opened at its size has no room)
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except _DAMAGE as exc:
                raise self._damaged(exc) from None

    def _parse(self, digest: bytes, raw: bytes | memoryview) -> DiskRecord:
        try:
            record = DiskRecord.from_bytes(raw, with_data=False)
        except ValueError as exc:
            name = DamagedRecord(digest, _key_in(raw, digest), str(exc)).name
            raise RecordDamagedError(f"catalog record {name} in {self.path} is corrupt: {exc}") from None
        if key_digest(record.key) != digest:
            raise RecordDamagedError(f"catalog record for {record.key!r} is filed under the wrong address")
        return record

    def get(self, key: str) -> DiskRecord | None:
        """The newest record of ``key`` with its data: a change waiting for its transaction if
        there is one (what this process wrote is what it reads), else the committed record.
        Runs on the caller's thread (a read of the memory-mapped tree, no lock)."""
        chain = self._staged.get(key)
        if chain is not None:
            record = chain[-1][0][1]
            return DiskRecord.from_bytes(record) if isinstance(record, bytes) else record
        if self._env is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        try:
            with self._env.begin(db=self._entries, buffers=True) as txn:
                raw = txn.get(key_digest(key))
                if raw is None:
                    return None
                try:
                    return DiskRecord.from_bytes(raw)
                except ValueError as exc:
                    raise CatalogError(f"catalog record of {key!r} in {self.path} is corrupt: {exc}") from None
        except _DAMAGE as exc:
            raise self._damaged(exc) from None

    def inline_value(self, key: str) -> tuple[int, int, bytes | bytearray] | None:
        """``(version, checksum, bytes)`` of ``key``'s newest record (as ``get``) if its value is
        inline, else None: the read path of a small value, parsing only what it needs."""
        chain = self._staged.get(key)
        if chain is not None:
            record = chain[-1][0][1]
            if record is None:
                return None
            if not isinstance(record, bytes):
                if not record.inline or record.data is None:
                    return None
                return record.version, record.checksums[0], record.data
            raw: bytes | memoryview = record
            return self._inline_of(raw, key)
        env = self._env
        if env is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        try:
            with env.begin(db=self._entries, buffers=True) as txn:
                raw = txn.get(key_digest(key))
                return None if raw is None else self._inline_of(raw, key)
        except _DAMAGE as exc:
            raise self._damaged(exc) from None

    def _damaged(self, exc: lmdb.Error) -> CatalogError:
        """LMDB's error reading a damaged tree (``_DAMAGE``)."""
        return CatalogError(f"the catalog in {self.path} is damaged: {exc}; nothing was changed (restore the folder from a copy)")

    def _inline_of(self, raw: bytes | memoryview, key: str) -> tuple[int, int, bytes | bytearray] | None:
        try:
            return _inline_of(raw, key)
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise CatalogError(f"catalog record of {key!r} in {self.path} is corrupt: {exc}") from None

    def commit_now(self, changes: list[tuple[str, DiskRecord | None]], layout: CatalogLayout | None = None) -> None:
        """``commit`` on the caller's thread, for the open path (before the tier serves anything)."""
        if self._env is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        self._write_sync(changes, layout)
        if layout is not None:
            self.layout = layout

    async def commit(self, changes: list[tuple[str, DiskRecord | None]], layout: CatalogLayout | None = None) -> None:
        """Durably apply ``changes`` (key -> new record, or None to delete) in one transaction
        shared with whatever other commits are waiting (group commit); returns once it is on
        disk. Reads (``get``) see queued changes from the moment this is called; an uncontended
        one, handed straight to the writer thread, from its commit on (its callers hold the
        key's disk lock until then)."""
        loop = asyncio.get_running_loop()
        if layout is not None:  # rare (a new segment): its own transaction
            if self._writer is None:
                raise StoreClosedError(f"the catalog in {self.path} is closed")
            await loop.run_in_executor(self._writer, self._write_sync, changes, layout)
            self.layout = layout
            return
        if self._idle() and not any(key in self._staged for key, _ in changes):
            await self._commit_direct(changes)
            return
        await asyncio.shield(self._enqueue(changes, waited=True))

    def _idle(self) -> bool:
        """Nothing queued, failed or being committed: a commit arriving now would be alone."""
        flushing = self._flushing
        return not self._direct and not self._pending and not self._retry and (flushing is None or flushing.done())

    async def _commit_direct(self, changes: list[tuple[str, DiskRecord | None]]) -> None:
        """An uncontended commit: its transaction handed to the writer thread at once, which
        settles the one future waited for here (no flush task, no executor future). Commits
        arriving meanwhile queue and share the next transaction (group commit)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hand_over(list(changes), None, partial(_settle_retrieved, done))
        # (a cancelled caller stops waiting; the transaction goes on, as a queued one would)
        await asyncio.shield(done)

    def idle_for(self, key: str) -> bool:
        """Whether ``commit_soon`` of a change of ``key`` would start now (checked before
        making the record: under contention the put goes the queued way at once)."""
        return self._starts_now((key,))

    def _starts_now(self, keys: Iterable[str]) -> bool:
        """Whether a commit of changes of ``keys`` would be handed to the writer at once: the
        catalog open and idle, none of these keys with a change under way."""
        return self._writer is not None and self._idle() and not (self._staged and any(key in self._staged for key in keys))

    def commit_soon(
        self,
        changes: list[_Change],
        then: Callable[[BaseException | None], None],
        scope: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> bool:
        """``commit`` with no await, if the catalog is idle (nothing queued, failed or being
        committed, none of these keys with a change under way): the transaction is handed to the
        writer thread at once, and ``then(error)`` runs on the loop once it is durable (``error``
        None) or failed (what it raised). False, with nothing done, otherwise: the caller then
        ``commit``s. ``scope()`` is entered around the transaction, on the writer thread
        (``commit_here``)."""
        if not self._starts_now(key for key, _ in changes):
            return False
        self._hand_over(changes, scope, then)
        return True

    def _hand_over(
        self,
        group: list[_Change],
        scope: Callable[[], AbstractContextManager[None]] | None,
        then: Callable[[BaseException | None], None],
    ) -> None:
        """Hand ``group`` to the writer thread as one transaction (in ``scope()`` if given); it
        calls ``then`` on the loop through a single ``call_soon_threadsafe`` (one wake-up of the
        loop, no future). The catalog counts as busy until then (``_idle``), so a later commit
        of the same key cannot overtake it."""
        writer = self._writer
        if writer is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        job = _Direct(self, group, scope, then, asyncio.get_running_loop())
        self._direct += 1
        try:
            writer.run_soon(job.run)
        except BaseException:
            self._direct -= 1
            raise

    def commit_here(
        self, changes: list[tuple[str, DiskRecord | None]], scope: Callable[[], AbstractContextManager[None]] | None = None
    ) -> bool:
        """On a worker thread: durably apply ``changes`` in a transaction of their own, run on
        this thread, if the catalog is idle (no transaction running, nothing queued, none of
        their keys with a change under way); ``scope()`` is entered around the transaction.
        False (nothing done, ``scope`` not entered) otherwise: the caller then ``commit``s
        them on the loop, in a shared transaction. The caller keeps other changes of these
        keys from starting meanwhile (the engine's disk lock)."""
        if self._env is None or not self._txn_lock.acquire(blocking=False):
            return False
        try:
            # (read from this thread: a change queued by the loop just after this check
            # waits for the lock, and names none of these keys)
            if not self._idle() or any(key in self._staged for key, _ in changes):
                return False
            if scope is None:
                self._write_sync(changes, None)
            else:
                with scope():
                    self._write_sync(changes, None)
            return True
        finally:
            self._txn_lock.release()

    def stage(self, changes: list[tuple[str, DiskRecord | None]]) -> asyncio.Future[None]:
        """Queue ``changes`` for the next transaction without waiting for it (a non-durable
        write acknowledged before its commit): reads see them at once, the returned future ends
        when they are committed. A transaction that fails keeps them queued (reads still see
        them) for the next one; ``drain`` raises the failure if they still cannot commit."""
        return self._enqueue(changes, waited=False)

    def stage_inline(self, key: str, raw: bytes) -> None:
        """``stage`` of one inline record already in its binary form (``inline_bytes``): the
        small non-durable put, with no record object and no future made."""
        if self._writer is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        change: _Change = (key, raw)
        chain = self._staged.get(key)
        pending = self._pending
        if chain is None:
            self._staged[key] = [(change, False)]
        else:
            newest = self._newest.get(key)
            if newest is not None and newest[2] is pending and chain[-1][0] is newest[0]:
                # Its last change is an acknowledged put not yet committing (and no one waits
                # for it): replaced in place, so puts of one key keep one change queued.
                group = newest[1]
                group[0] = change  # type: ignore[index]
                chain[-1] = (change, False)
                self._newest[key] = (change, group, pending)
                if self._kick is None:
                    self._kick_later()
                return
            chain.append((change, False))
        group = [change]
        pending.append((group, None, False))
        self._newest[key] = (change, group, pending)
        self._changes += 1
        if self._kick is None:  # (else a commit is due already: no call per put)
            self._kick_later()

    def _kick_later(self) -> None:
        """Start committing soon, unless a commit is already under way or due."""
        flushing = self._flushing
        if (flushing is None or flushing.done()) and self._kick is None:
            # Not at once: puts that come one at a time (the sync facade's, each a round trip of
            # the loop) share the transaction instead of one each.
            self._kick = asyncio.get_running_loop().call_later(STAGE_WINDOW, self._start_flush)

    def _start_flush(self) -> None:
        """Start committing what is queued, if nothing is committing it already."""
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None
        if self._pending and self._writer is not None and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    def _enqueue(self, changes: list[tuple[str, DiskRecord | None]], waited: bool) -> asyncio.Future[None]:
        if self._writer is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        group: list[_Change] = [(key, record) for key, record in changes]
        for change in group:
            self._staged.setdefault(change[0], []).append((change, waited))
            if not waited:
                self._newest[change[0]] = (change, None, None)
        self._changes += len(group)
        self._pending.append((group, done, waited))
        self._start_flush()
        return done

    @property
    def transactions(self) -> int:
        """Write transactions committed in this catalog's life (LMDB's last transaction id)."""
        if self._env is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        return int(self._env.info()["last_txnid"])

    @property
    def queued(self) -> int:
        """Changes waiting for (or in) a transaction, all keys together."""
        return self._changes

    @property
    def failed(self) -> bool:
        """Whether queued changes failed to commit and wait for another try (``drain``)."""
        return bool(self._retry)

    async def drain(self) -> None:
        """Return once every change queued so far is committed; raises the failure of changes
        that still cannot commit (``stage``), which stay queued."""
        while True:
            if self._retry:
                groups, self._retry = self._retry, []
                self._pending[:0] = groups
            self._start_flush()
            task = self._flushing
            if task is None or task.done():
                break
            await asyncio.shield(task)
            if self._retry:  # (the error stays until they commit: every later drain says so)
                raise _again(self.error, self.path) from self.error
        self.error = None

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            # An acknowledged change a newer one replaced is dropped: applying it after a newer
            # one committed would put the older value back.
            newest_of = self._newest
            batch = [
                (group, done, waited)
                if waited or (len(group) == 1 and (newest := newest_of.get(group[0][0])) is not None and newest[0] is group[0])
                else (self._current(group), done, waited)
                for group, done, waited in batch
            ]
            changes = [change for group, _, _ in batch for change in group]
            try:
                if self.durable or len(changes) > _ON_LOOP_MAX or not self._txn_lock.acquire(blocking=False):
                    await loop.run_in_executor(self._writer, self._write_sync, changes, None)
                else:
                    # A small transaction with no sync, when no other one runs, is committed
                    # here on the loop (~5 us a change: about a millisecond at most): on the writer thread
                    # each insert would hand the GIL back and forth with the loop (LMDB
                    # releases it around every put), costing more than the insert itself.
                    try:
                        self._write_sync(changes, None)
                    finally:
                        self._txn_lock.release()
            except BaseException as exc:
                # One bad change must not fail its neighbours: retry each group on its own.
                for group, done, waited in batch:
                    try:
                        if len(batch) == 1:
                            raise exc
                        await loop.run_in_executor(self._writer, self._write_sync, group, None)
                    except BaseException as single:
                        self._failed(group, done, waited, single)
                    else:
                        self._committed(group, done)
                continue
            self._all_committed(batch)

    def _current(self, group: list[_Change]) -> list[_Change]:
        """The changes of an acknowledged (not waited) group still to apply: those no newer
        change committed over, and that no newer acknowledged change replaces. One replaced only
        by waited changes is kept (applied first in the same transaction): those may fail, and
        it must then still be there."""
        return [change for change in group if self._wanted(change)]

    def _wanted(self, change: _Change) -> bool:
        # (the newest acknowledged change of its key leaves ``_newest`` once committed over)
        newest = self._newest.get(change[0])
        return newest is not None and newest[0] is change

    def _all_committed(self, batch: list[tuple[list[_Change], asyncio.Future[None] | None, bool]]) -> None:
        """``_committed`` of every group of a transaction, the common one (a staged put: one
        change, its key's only one, no future) taken here with no call."""
        staged, newest_of, committed = self._staged, self._newest, self._committed
        for group, done, _ in batch:
            if done is None and len(group) == 1:
                change = group[0]
                key = change[0]
                chain = staged.get(key)
                if chain is not None and len(chain) == 1 and chain[0][0] is change:
                    del staged[key]
                    newest = newest_of.get(key)
                    if newest is not None and newest[0] is change:
                        del newest_of[key]
                    self._changes -= 1
                    continue
            committed(group, done)

    def _committed(self, group: list[_Change], done: asyncio.Future[None] | None) -> None:
        # A committed change also ends every older one of its key: they must never apply now.
        staged, newest_of = self._staged, self._newest
        for change in group:
            key = change[0]
            chain = staged.get(key)
            if chain is None:
                continue
            if len(chain) == 1 and chain[0][0] is change:  # (the common case: the key's only change)
                del staged[key]
                newest = newest_of.get(key)
                if newest is not None and newest[0] is change:
                    del newest_of[key]
                self._changes -= 1
                continue
            at = next((i for i, (queued, _) in enumerate(chain) if queued is change), None)
            if at is None:
                continue
            newest = self._newest.get(change[0])
            if newest is not None and any(queued is newest[0] for queued, _ in chain[: at + 1]):
                del self._newest[change[0]]
            del chain[: at + 1]
            self._changes -= at + 1
            if not chain:
                del self._staged[change[0]]
        _settle(done, None)

    def _failed(self, group: list[_Change], done: asyncio.Future[None] | None, waited: bool, exc: BaseException) -> None:
        if waited:  # its writer is told, and the value before it (queued or committed) shows again
            for change in group:
                chain = self._staged.get(change[0])
                if chain is None:
                    continue
                kept = [(queued, w) for queued, w in chain if queued is not change]
                self._changes -= len(chain) - len(kept)
                chain[:] = kept
                if not chain:
                    del self._staged[change[0]]
            _settle(done, exc)
            return
        # Acknowledged already: keep it for the next transaction (and ``drain``).
        self.error = exc
        self._retry.append((group, done, waited))

    def _write_sync(self, changes: Sequence[_Change], layout: CatalogLayout | None) -> None:
        with self._txn_lock:
            self._write_locked(changes, layout)

    def _write_locked(self, changes: Sequence[_Change], layout: CatalogLayout | None) -> None:
        while True:
            try:
                if len(changes) <= _FEW_CHANGES:  # (a put's own transaction: applied in order)
                    with self._env.begin(write=True) as txn:
                        for key, record in changes:
                            if record is None:
                                txn.delete(key_digest(key), db=self._entries)
                            else:
                                raw = record if isinstance(record, bytes) else record.to_bytes()
                                txn.put(key_digest(key), raw, db=self._entries)
                        if layout is not None:
                            txn.put(_META_KEY, layout.to_bytes(), db=self._meta)
                    if layout is not None and not self.durable:
                        self._env.sync(True)  # (see below)
                    return
                # Each key's last change wins (as applying them in order would); the puts go in
                # key order through one ``putmulti``: one C loop, neighbouring leaves in turn.
                final: dict[bytes, bytes | None] = {}
                digest_of = key_digest
                for key, record in changes:
                    final[digest_of(key)] = record if record is None or isinstance(record, bytes) else record.to_bytes()
                puts = sorted([item for item in final.items() if item[1] is not None])
                with self._env.begin(write=True) as txn:
                    entries = self._entries
                    if len(puts) != len(final):
                        for digest, raw in final.items():
                            if raw is None:
                                txn.delete(digest, db=entries)
                    if puts:
                        txn.cursor(db=entries).putmulti(puts)
                    if layout is not None:
                        txn.put(_META_KEY, layout.to_bytes(), db=self._meta)
                if layout is not None and not self.durable:
                    # Files are created before and deleted after the layout that names them is
                    # committed; a layout rolled back by a power cut could name a deleted file.
                    self._env.sync(True)
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                if is_disk_full(exc) or "No space left" in str(exc):
                    raise DiskFullError(28, f"the catalog in {self.path} cannot grow: {exc}") from None
                if "File too large" in str(exc) or "Disk quota exceeded" in str(exc) or (
                    "Input/output error" in str(exc) and _short_writes_likely(self.path)
                ):
                    # (LMDB reports a short write -- a full file system, a file size limit -- as EIO)
                    raise DiskFullError(28, f"the catalog in {self.path} cannot grow: no room for it ({exc})") from None
                raise CatalogError(f"the catalog in {self.path} failed to commit: {exc}") from None


def _again(error: BaseException | None, path: Path) -> BaseException:
    """A new error saying again that queued changes cannot commit (each ``drain`` raises its
    own: one object raised twice would grow its traceback): of ``error``'s kind (a full disk
    stays a ``DiskFullError``), else a ``CatalogError``."""
    if isinstance(error, (DiskFullError, CatalogError)):
        try:
            return type(error)(*error.args)
        except Exception:  # (an error class with another signature)
            pass
    return CatalogError(f"the catalog in {path} could not commit queued changes: {error}")


class _Direct:
    """One transaction handed straight to the writer thread (``Catalog._hand_over``): ``run``
    on the writer, ``finish`` back on the loop. An object with slots and bound methods rather
    than closures: a durable small put makes one of these and nothing else here."""

    __slots__ = ("catalog", "group", "scope", "then", "loop")

    def __init__(
        self,
        catalog: Catalog,
        group: list[_Change],
        scope: Callable[[], AbstractContextManager[None]] | None,
        then: Callable[[BaseException | None], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.catalog = catalog
        self.group = group
        self.scope = scope
        self.then = then
        self.loop = loop

    def run(self) -> None:
        error: BaseException | None = None
        try:
            if self.scope is None:
                self.catalog._write_sync(self.group, None)
            else:
                with self.scope():
                    self.catalog._write_sync(self.group, None)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # (a closed loop: nobody is waiting any more)
            self.loop.call_soon_threadsafe(self.finish, error)

    def finish(self, error: BaseException | None) -> None:
        # (busy until the transaction ends, also for a caller that stopped waiting)
        self.catalog._direct -= 1
        self.then(error)


def _settle_retrieved(done: asyncio.Future[None], exc: BaseException | None) -> None:
    """``_settle``, the failure marked as seen: a cancelled caller no longer waits for it."""
    _settle(done, exc)
    if exc is not None and not done.cancelled():
        done.exception()


class _SlowPath(Exception):
    """A record the fast scan leaves to the full parser (not an inline binary one, or odd)."""


def _settle(done: asyncio.Future[None] | None, exc: BaseException | None) -> None:
    if done is None or done.done():
        return
    if exc is None:
        done.set_result(None)
    else:
        done.set_exception(exc)


def _named_databases(env: lmdb.Environment) -> set[bytes]:
    """The names in the environment's main database (where LMDB keeps its named databases)."""
    with env.begin() as txn:
        return {bytes(key) for key, _ in txn.cursor()}


def _short_writes_likely(path: Path) -> bool:
    """Whether a write to the catalog in ``path`` may have been cut short for want of room: its
    file system has less than 1 MiB free, or the catalog file is within 64 MiB (a step of its
    growth) of the process's file size limit."""
    try:
        if shutil.disk_usage(path).free < 1 << 20:
            return True
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return limit != resource.RLIM_INFINITY and (path / "data.mdb").stat().st_size + (64 << 20) >= limit
    except OSError:
        return False
