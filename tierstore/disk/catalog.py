"""The disk tier's catalog: an LMDB database of what lives in the data files.

Two named databases: ``meta`` (format and its version, chunk size, segment sizes) and
``entries`` (one JSON record per key, found by the key's digest; the key itself is inside the
record). Nothing is pickled. Writes from many coroutines are grouped into one transaction each time the single
writer thread comes free (group commit), so durable puts share an fsync of the catalog.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lmdb

from ..errors import CatalogError, DiskFullError, StoreClosedError
from ..keys import key_digest
from ..tensors import TensorMeta
from .extents import Extent
from .files import is_disk_full

FORMAT = "tierstore-disk"
#: The on-disk layout this code writes. 1: the first release (segment files of any sizes, JSON
#: records); 2: segments shrink and go away as space is freed. Raise it whenever the layout
#: changes, and add the upgrade from the version before to ``_UPGRADES``.
FORMAT_VERSION = 2
#: What a catalog that records no version was written with.
_UNVERSIONED = 1
_META_KEY = b"format"
_INITIAL_MAP_SIZE = 256 << 20


@dataclass(frozen=True)
class DiskRecord:
    """What the catalog knows of one key: its tensor, where its bytes are, and their checksums."""

    key: str
    meta: TensorMeta
    extent: Extent
    version: int
    checksums: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "key": self.key,
                **self.meta.to_json(),
                "nbytes": self.meta.nbytes,
                "segment": self.extent.segment,
                "offset": self.extent.offset,
                "length": self.extent.length,
                "version": self.version,
                "checksums": list(self.checksums),
            },
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes) -> DiskRecord:
        """Parse a record; raises ``ValueError`` with the reason if it is malformed."""
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
        if length < nbytes:
            raise ValueError(f"extent of {length} bytes cannot hold {nbytes}")
        return cls(key, meta, Extent(segment, offset, length), version, tuple(checksums))


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
    """Version 1 -> 2: records and segments read the same; only the version number moves."""


#: Upgrades in place, by the version they start from: each brings a catalog to the next version
#: inside the write transaction that records the new version.
_UPGRADES: dict[int, Callable[[Any, Any], None]] = {1: _records_unchanged}


class Catalog:
    """The LMDB catalog of one disk folder. ``open`` and the reads run on the caller's thread;
    ``commit`` runs writes on one dedicated writer thread, grouped."""

    def __init__(self, path: Path, durable: bool) -> None:
        self.path = path
        self.durable = durable
        self._env: Any = None
        self._entries: Any = None
        self._meta: Any = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[tuple[list[tuple[str, DiskRecord | None]], asyncio.Future[None]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self.layout: CatalogLayout | None = None

    def open(self, create_layout: CatalogLayout | None) -> CatalogLayout:
        """Open the database. A new one gets ``create_layout`` (None: a new one is an error, as
        when data files exist); an existing one is validated."""
        self.path.mkdir(mode=0o700, exist_ok=True)
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
            if self.layout.format_version < FORMAT_VERSION:
                self._upgrade(self.layout)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-catalog")
        return self.layout

    def _upgrade(self, layout: CatalogLayout) -> None:
        """Bring an older catalog to ``FORMAT_VERSION`` in one transaction."""
        try:
            with self._env.begin(write=True) as txn:
                for version in range(layout.format_version, FORMAT_VERSION):
                    _UPGRADES[version](txn, self._entries)
                txn.put(_META_KEY, layout.to_bytes(), db=self._meta)
        except lmdb.Error as exc:
            self.close()
            raise CatalogError(f"the catalog in {self.path} cannot be upgraded from format version {layout.format_version}: {exc}") from None
        self.layout = replace(layout, format_version=FORMAT_VERSION)

    def open_readonly(self) -> CatalogLayout:
        """Open for reading only (safe beside a process that has the folder open for writing)."""
        if not (self.path / "data.mdb").exists():
            raise CatalogError(f"{self.path} holds no tierstore catalog")
        raw = self._open_env(readonly=True, lock=True, readahead=False)
        if raw is None:
            self.close()
            raise CatalogError(f"{self.path} holds no tierstore catalog")
        self.layout = CatalogLayout.from_bytes(raw, self.path)
        return self.layout

    def _open_env(self, **options: Any) -> bytes | None:
        """Open the LMDB environment and its two databases; return the format record, if any."""
        try:
            self._env = lmdb.open(str(self.path), max_dbs=2, **options)
            self._check_length()
            create = not options.get("readonly", False)
            self._meta = self._env.open_db(b"meta", create=create)
            self._entries = self._env.open_db(b"entries", create=create)
            with self._env.begin(db=self._meta) as txn:
                raw = txn.get(_META_KEY)
        except lmdb.Error as exc:
            self.close()
            raise CatalogError(f"the catalog in {self.path} cannot be opened: {exc}") from None
        except CatalogError:
            self.close()
            raise
        return bytes(raw) if raw is not None else None

    def _check_length(self) -> None:
        """A catalog file shorter than its own last page would fault (SIGBUS) when that page is
        read through the memory map: refuse it on open instead."""
        info, psize = self._env.info(), self._env.stat()["psize"]
        needed = (info["last_pgno"] + 1) * psize
        actual = (self.path / "data.mdb").stat().st_size
        if actual < needed:
            raise CatalogError(f"the catalog {self.path / 'data.mdb'} is truncated: {actual} of {needed} bytes")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._env is not None:
            self._env.close()
            self._env = None

    def records(self) -> Iterator[tuple[bytes, DiskRecord]]:
        """Every record, validated; raises ``CatalogError`` naming the first bad one."""
        with self._env.begin(db=self._entries) as txn:
            for digest, raw in txn.cursor():
                try:
                    record = DiskRecord.from_bytes(bytes(raw))
                except ValueError as exc:
                    raise CatalogError(f"catalog record {bytes(digest).hex()} in {self.path} is corrupt: {exc}") from None
                if key_digest(record.key) != bytes(digest):
                    raise CatalogError(f"catalog record for {record.key!r} is filed under the wrong address")
                yield bytes(digest), record

    def commit_now(self, changes: list[tuple[str, DiskRecord | None]], layout: CatalogLayout | None = None) -> None:
        """``commit`` on the caller's thread, for the open path (before the tier serves anything)."""
        if self._env is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        self._write_sync(changes, layout)
        if layout is not None:
            self.layout = layout

    async def commit(self, changes: list[tuple[str, DiskRecord | None]], layout: CatalogLayout | None = None) -> None:
        """Durably apply ``changes`` (key -> new record, or None to delete) in one transaction
        shared with whatever other commits are waiting; returns once it is on disk."""
        loop = asyncio.get_running_loop()
        if layout is not None:  # rare (a new segment): its own transaction
            if self._writer is None:
                raise StoreClosedError(f"the catalog in {self.path} is closed")
            await loop.run_in_executor(self._writer, self._write_sync, changes, layout)
            self.layout = layout
            return
        if self._writer is None:
            raise StoreClosedError(f"the catalog in {self.path} is closed")
        done: asyncio.Future[None] = loop.create_future()
        self._pending.append((changes, done))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush())
        await asyncio.shield(done)

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending, []
            changes = [change for group, _ in batch for change in group]
            try:
                await loop.run_in_executor(self._writer, self._write_sync, changes, None)
            except BaseException as exc:
                # One bad change must not fail its neighbours: retry each group on its own.
                if len(batch) > 1:
                    for group, done in batch:
                        try:
                            await loop.run_in_executor(self._writer, self._write_sync, group, None)
                        except BaseException as single:
                            _settle(done, single)
                        else:
                            _settle(done, None)
                    continue
                _settle(batch[0][1], exc)
                continue
            for _, done in batch:
                _settle(done, None)

    def _write_sync(self, changes: list[tuple[str, DiskRecord | None]], layout: CatalogLayout | None) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, record in changes:
                        digest = key_digest(key)
                        if record is None:
                            txn.delete(digest, db=self._entries)
                        else:
                            txn.put(digest, record.to_bytes(), db=self._entries)
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
                raise CatalogError(f"the catalog in {self.path} failed to commit: {exc}") from None


def _settle(done: asyncio.Future[None], exc: BaseException | None) -> None:
    if done.done():
        return
    if exc is None:
        done.set_result(None)
    else:
        done.set_exception(exc)
