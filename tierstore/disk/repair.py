"""``tierstore repair ROOT``: make a damaged disk tier folder open again, dropping only what is lost.

A store refuses to open a folder with a damaged catalog record, or with a data file missing or
shorter than the extents the catalog places in it: opening would hand out wrong bytes or lose
track of space. That refusal protects the data, but it leaves the intact entries out of reach
too. ``repair_folder`` removes exactly the records whose values cannot be had (a record that
does not parse or fails its own checksum; an entry whose extent lies in a missing data file or
past a truncated one's end; a record whose checksums do not match its size) and brings the data
files back to the length the catalog's layout gives them, so every other entry opens and reads
as before. Values whose bytes fail their checksums are not found here (their records are sound;
a read raises ``ChecksumError`` naming the key, and ``store.delete(key)`` removes one).

It takes the folder's lock, as a store does, so it never runs beside a store using the folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CatalogError
from ..keys import is_reserved, key_digest
from ..namespaces import INDEX_KEY
from .catalog import Catalog, CatalogLayout, DamagedRecord, DiskRecord
from .extents import ExtentAllocator, misplaced
from .files import file_lengths, segment_name
from .lock import FolderLock


@dataclass
class RepairReport:
    """What ``repair_folder`` found and did (or, on a dry run, would do)."""

    root: Path
    #: The records removed: by key where it is readable, else ``"<address hex>"``, with why.
    dropped: list[tuple[str, str]] = field(default_factory=list)
    #: Data files created again or extended back to their layout's length (with zeros).
    restored_files: list[str] = field(default_factory=list)
    #: Entries left (as ``tierstore info`` counts them: the store's own records not), all sound as
    #: far as their records and files go, and (``verified``) their bytes.
    kept: int = 0
    dry_run: bool = False
    verified: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.dropped or self.restored_files)

    def summary(self) -> str:
        """A short report for a person."""
        verb = "would drop" if self.dry_run else "dropped"
        lines = [f"{self.root}: {'nothing to repair' if not self.changed else ('dry run' if self.dry_run else 'repaired')}"]
        if self.dropped:
            lines.append(f"  {verb} {len(self.dropped)} entr{'y' if len(self.dropped) == 1 else 'ies'} whose values are lost:")
            lines.extend(f"    {name}: {why}" for name, why in self.dropped[:20])
            if len(self.dropped) > 20:
                lines.append(f"    ... and {len(self.dropped) - 20} more")
        for name in self.restored_files:
            lines.append(f"  {'would restore' if self.dry_run else 'restored'} data file {name} to its length (zeros where bytes were lost)")
        checked = "their bytes read and checked" if self.verified else "values not read: --verify reads and checks them"
        lines.append(f"  {self.kept:,} entr{'y' if self.kept == 1 else 'ies'} kept ({checked})")
        return "\n".join(lines)


def repair_folder(root: str | os.PathLike[str], dry_run: bool = False, verify: bool = False, progress: bool = False) -> RepairReport:
    """Drop the catalog records of ``root`` whose values are lost and restore its data files'
    lengths, so that a store opens the folder with every other entry intact. ``verify``: also
    read every value and drop those whose bytes fail their checksums (``progress``: a
    progress bar of the bytes read).

    Raises
    ------
    CatalogError
        If ``root`` is no disk tier folder, or its catalog as a whole cannot be read (its format
        record, its databases), or its extents overlap (which value owns the bytes cannot be
        told): nothing is changed then.
    StoreLockedError
        If a store has the folder open (a dry run reads it read-only, as ``tierstore info``
        does, and takes no lock).
    """
    from ..inspect import failing_values  # (inspect reads folders through this package)

    root = Path(root)
    if not (root / "catalog").is_dir():
        raise CatalogError(f"{root} is not a tierstore disk folder (no catalog/ inside)")
    lock = None if dry_run else FolderLock.acquire(root / "lock")
    try:
        if not (root / "catalog" / "data.mdb").exists():  # (an open for writing would make an empty one)
            raise CatalogError(f"{root / 'catalog'} holds no tierstore catalog: it was lost, and with it what the folder held; "
                               "nothing was changed")
        catalog = Catalog(root / "catalog", durable=True)
        layout = catalog.open_readonly()
        try:
            damaged: list[DamagedRecord] = []
            records = [record for _, record in catalog.records(damaged=damaged)]
        finally:
            catalog.close()
        lost: list[tuple[bytes, str, str]] = [
            (bad.digest, bad.key if bad.key is not None else f"<address {bad.digest.hex()}>", f"its catalog record is damaged ({bad.reason})")
            for bad in damaged
        ]
        lengths = file_lengths(root, len(layout.segments))
        sound: list[DiskRecord] = []
        for record in records:
            why = _why_lost(record, lengths, layout)
            if why is None:
                sound.append(record)
            else:
                lost.append((key_digest(record.key), record.key, why))
        try:
            ExtentAllocator.rebuild(layout.segments, (r.extent for r in sound if r.extent is not None), layout.alignment)
        except ValueError as exc:
            raise CatalogError(f"the catalog in {root} is inconsistent ({exc}); repair cannot tell which value owns those bytes, "
                               "nothing was changed") from None
        if verify:
            failed = set(failing_values(root, layout.chunk_size, sound, progress))
            lost += [(key_digest(r.key), r.key, "its bytes fail their checksums") for r in sound if r.key in failed]
            sound = [r for r in sound if r.key not in failed]
        report = RepairReport(root, dry_run=dry_run, verified=verify)
        report.dropped = sorted((name, why + (_INDEX_LOST if name == INDEX_KEY else "")) for _, name, why in lost)
        report.restored_files = [segment_name(s) for s, size in enumerate(layout.segments) if (lengths[s] or 0) < size]
        report.kept = sum(not is_reserved(r.key) for r in sound)
        if not dry_run:
            if lost:
                catalog = Catalog(root / "catalog", durable=True)
                catalog.open(None)
                try:
                    catalog.remove_addresses(address for address, _, _ in lost)
                finally:
                    catalog.close()
            _restore_files(root, layout.segments, lengths)
        return report
    finally:
        if lock is not None:
            lock.release()


#: What losing the namespace index means (said where it is dropped).
_INDEX_LOST = (
    "; the namespaces' claims are lost with it: their keys stay and read as before, but belong to no namespace, so "
    "claiming one (an optimizer's namespace=) is refused with NamespaceClaimedError (overwrite=True deletes them). "
    "store.claim(name, owner=..., adopt=True) makes them the namespace's again (owner: the class name of an optimizer "
    "or offload that claims it), then release() it"
)


def _why_lost(record: DiskRecord, lengths: list[int | None], layout: CatalogLayout) -> str | None:
    """Why ``record``'s value cannot be read whole from the folder; None if it can."""
    extent = record.extent
    if extent is None:
        return None  # (inline in the catalog: its record parsed, so its bytes are there)
    miscounted = record.miscounted_checksums(layout.chunk_size)
    if miscounted is not None:
        return f"its record {miscounted}"
    problem = misplaced(extent, layout.segments, layout.alignment)
    if problem is not None:
        return f"its extent {problem}"
    length = lengths[extent.segment]
    if length is None:
        return f"its data file {segment_name(extent.segment)} is missing"
    if extent.end > length:
        return f"its data file {segment_name(extent.segment)} ends at byte {length}, before the value's end at {extent.end}"
    return None


def _restore_files(root: Path, segments: tuple[int, ...], lengths: list[int | None]) -> None:
    """Create missing data files and extend short ones to their layout's length (a hole: no
    blocks are written), then make that durable."""
    data = root / "data"
    data.mkdir(mode=0o700, exist_ok=True)
    changed = False
    for segment, size in enumerate(segments):
        length = lengths[segment]
        if length is not None and length >= size:
            continue
        fd = os.open(data / segment_name(segment), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        changed = True
    if changed:
        fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
