"""What a disk tier folder holds, read without opening a store (``tierstore info``)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .disk.catalog import Catalog, DamagedRecord, DiskRecord
from .disk.extents import ExtentAllocator
from .disk.files import checksum, file_lengths, segment_name
from .errors import CatalogError, ChecksumError
from .keys import is_reserved
from .namespaces import INDEX_KEY
from .tensors import ALIGNMENT
from .units import format_bytes


def describe_folder(root: str | Path, verify: bool = False, progress: bool = False) -> dict[str, Any]:
    """Entries (key, dtype, shape, bytes), totals, free space and health of the disk tier at
    ``root``.

    Reads the catalog read-only, so it works while another process has the folder open. The
    folder is ``healthy`` when every data file the catalog names is there and long enough for
    the extents in it; otherwise ``problems`` says what is wrong and ``damaged_keys`` names the
    entries whose bytes are not all there (``damaged_unnamed``: damaged records whose key cannot
    be read). The values' bytes are not read (a store verifies
    each value's checksums as it reads it) unless ``verify``: then every value is read and
    checked, and one that fails is damaged too (``progress``: a progress bar of the bytes read).
    """
    root = Path(root)
    if not root.exists():
        raise CatalogError(f"{root} does not exist")
    if not (root / "catalog").is_dir():
        raise CatalogError(f"{root} is not a tierstore disk folder (no catalog/ inside)")
    catalog = Catalog(root / "catalog", durable=False)
    layout = catalog.open_readonly()
    corrupt: list[DamagedRecord] = []
    try:
        records = [record for _, record in catalog.records(damaged=corrupt)]
        index = catalog.get(INDEX_KEY) if any(r.key == INDEX_KEY for r in records) else None  # (inline: with its bytes)
    finally:
        catalog.close()
    records.sort(key=lambda r: r.key)
    problems, damaged = _health(root, layout.segments, records)
    if corrupt:
        problems.insert(0, _corrupt_records(corrupt))
        damaged = sorted({*damaged, *(bad.key for bad in corrupt if bad.key is not None)})
    if verify:
        unreadable = set(damaged)
        failed = failing_values(root, layout.chunk_size, [r for r in records if r.key not in unreadable], progress)
        if failed:
            shown = ", ".join(repr(k) for k in failed[:10]) + (f" and {len(failed) - 10} more" if len(failed) > 10 else "")
            its = "its" if len(failed) == 1 else "their"
            problems.append(f"{_entries(len(failed))} fail{'s' if len(failed) == 1 else ''} {its} checksums ({its} bytes on "
                            f"disk are corrupt): {shown}")
            damaged = sorted({*damaged, *failed})
    namespaces = _namespaces(root, layout.chunk_size, [r for r in records if r.key not in damaged], index)
    records = [r for r in records if not is_reserved(r.key)]
    reserved = sum(layout.segments)
    # (a damaged record's extent may be any length: counted, a report said -8388608.0 TiB free;
    # one in a truncated data file still takes its room)
    used = sum(r.extent.length for r in records if r.extent is not None and _within(r.extent, layout.segments))
    disk = shutil.disk_usage(root)
    return {
        "root": str(root.resolve()),
        "entries": len(records),
        "tensor_bytes": sum(r.meta.nbytes for r in records),
        "extent_bytes": used,
        "segments": len(layout.segments),
        "reserved_bytes": reserved,
        "free_in_segments": max(reserved - used, 0),
        "filesystem_free": disk.free,
        "chunk_size": layout.chunk_size,
        "format_version": layout.format_version,
        "healthy": not problems,
        "verified": verify,
        "problems": problems,
        "damaged_keys": damaged,
        "damaged_unnamed": sum(bad.key is None for bad in corrupt),
        "dtypes": dict(Counter(str(r.meta.dtype).removeprefix("torch.") for r in records)),
        "namespaces": namespaces,
        "keys": [
            {
                "key": r.key,
                "dtype": str(r.meta.dtype).removeprefix("torch."),
                "shape": list(r.meta.shape),
                "nbytes": r.meta.nbytes,
                "version": r.version,
            }
            for r in records
        ],
    }


def _within(extent: Any, segments: tuple[int, ...] | list[int]) -> bool:
    """Whether ``extent`` lies inside the segments the catalog's layout reserves."""
    return 0 <= extent.segment < len(segments) and extent.offset >= 0 and extent.end <= segments[extent.segment]


def format_description(info: dict[str, Any], limit: int | None = 40) -> str:
    """A short human-readable report of ``describe_folder``'s result."""
    lines = [
        f"{info['root']}",
        f"  {_entries(info['entries'])}, {format_bytes(info['tensor_bytes'])} of tensors "
        f"in {info['segments']} segment file(s) of {format_bytes(info['reserved_bytes'])} "
        f"({format_bytes(info['free_in_segments'])} free inside them)",
        f"  file system free: {format_bytes(info['filesystem_free'])}",
    ]
    if not info["healthy"]:
        unnamed = info.get("damaged_unnamed", 0)
        also = f", and {unnamed} damaged record{'' if unnamed == 1 else 's'} whose key cannot be read" if unnamed else ""
        lines.append(f"  UNHEALTHY ({_entries(len(info['damaged_keys']))} damaged{also}):")
        lines.extend(f"    {problem}" for problem in info["problems"])
    elif info.get("verified"):
        lines.append("  healthy: every data file is whole, and every value was read and passes its checksums")
    else:
        lines.append("  healthy: every data file the catalog names is there and long enough (--verify reads every value "
                     "and checks its checksums)")
    if info["dtypes"]:
        lines.append("  dtypes: " + ", ".join(f"{name} x{n}" for name, n in sorted(info["dtypes"].items())))
    if info.get("namespaces"):
        lines.append("")
        lines.append(f"  {'namespace':<24} {'owner':<20} {'kind':<6} {'keys':>6} {'size':>10}")
        for ns in info["namespaces"]:
            kind = "auto" if ns["auto"] else "named"
            lines.append(f"  {ns['name']!r:<24} {ns['owner']:<20} {kind:<6} {ns['keys']:>6} {format_bytes(ns['nbytes']):>10}")
    keys = info["keys"] if limit is None else info["keys"][:limit]
    if keys:
        shapes = ["x".join(map(str, k["shape"])) or "scalar" for k in keys]
        width = min(60, max(len(repr(k["key"])) for k in keys))
        dtype_width = max(14, *(len(str(k["dtype"])) for k in keys))
        shape_width = min(60, max(20, *map(len, shapes)))  # (a long shape is cut, as a long key is: the columns stay aligned)
        lines.append("")
        lines.append(f"  {'key':<{width}}  {'dtype':<{dtype_width}} {'shape':<{shape_width}} {'size':>10}")
        for k, shape in zip(keys, shapes, strict=True):
            name = repr(k["key"])
            name = name if len(name) <= width else name[: width - 3] + "..."
            shape = shape if len(shape) <= shape_width else shape[: shape_width - 3] + "..."
            lines.append(f"  {name:<{width}}  {k['dtype']:<{dtype_width}} {shape:<{shape_width}} {format_bytes(k['nbytes']):>10}")
        hidden = len(info["keys"]) - len(keys)
        if hidden > 0:
            lines.append(f"  ... and {hidden} more (--all to list them)")
    return "\n".join(lines)


def _entries(count: int) -> str:
    return f"{count:,} entr{'y' if count == 1 else 'ies'}"


def _health(root: Path, segments: tuple[int, ...], records: list[DiskRecord]) -> tuple[list[str], list[str]]:
    """What is wrong with the data files the catalog names, and the keys whose bytes are not all
    there (the checks the tier's open makes, reported instead of refused)."""
    problems: list[str] = []
    lengths = file_lengths(root, len(segments))
    for segment, (expected, actual) in enumerate(zip(segments, lengths, strict=True)):
        if actual is None:
            problems.append(f"data file {segment_name(segment)} is missing (the catalog says it holds {expected} bytes)")
        elif actual < expected:
            problems.append(f"data file {segment_name(segment)} is truncated: {actual} of {expected} bytes")
    damaged: dict[str, list[str]] = {}
    for record in records:
        extent = record.extent
        if extent is None:  # a small value inline in the catalog
            continue
        if not 0 <= extent.segment < len(lengths):
            damaged.setdefault(f"segment {extent.segment}, which the catalog's layout lacks", []).append(record.key)
            continue
        length = lengths[extent.segment]
        if length is None:
            damaged.setdefault(f"{segment_name(extent.segment)}, which is missing", []).append(record.key)
        elif extent.end > length:
            damaged.setdefault(f"{segment_name(extent.segment)} past its end", []).append(record.key)
    for where, keys in damaged.items():
        shown = ", ".join(repr(k) for k in keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
        problems.append(f"{len(keys)} entries lie in {where}: {shown}")
    try:
        ExtentAllocator.rebuild(segments, (r.extent for r in records if r.extent is not None and 0 <= r.extent.segment < len(lengths)), ALIGNMENT)
    except ValueError as exc:
        problems.append(f"the catalog's extents are inconsistent: {exc}")
    return problems, sorted(key for keys in damaged.values() for key in keys)


def _corrupt_records(corrupt: list[DamagedRecord]) -> str:
    """The problem line of catalog records that do not parse or fail their own checksum (their
    values cannot be found: a store refuses to open until they are dealt with, e.g. by
    ``tierstore repair``)."""
    shown = ", ".join(f"{bad.key!r}" if bad.key is not None else f"one at address {bad.digest.hex()}" for bad in corrupt[:10])
    more = f" and {len(corrupt) - 10} more" if len(corrupt) > 10 else ""
    count = "1 catalog record is" if len(corrupt) == 1 else f"{len(corrupt)} catalog records are"
    return f"{count} damaged ({corrupt[0].reason}; a store refuses to open the folder, `tierstore repair` drops them): {shown}{more}"


def failing_values(root: Path, chunk_size: int, records: list[DiskRecord], progress: bool) -> list[str]:
    """The keys of ``records`` whose bytes fail their checksums (or cannot be read whole): each
    value read back chunk by chunk, its extent from its data file, an inline one from the
    catalog. The folder may be in use: a value that fails is looked up again, and counts only
    if its record, read again, still names those bytes and they fail again (a writer may have
    replaced or deleted it since the catalog was read, and reused its old extent)."""
    from tqdm import tqdm

    catalog = Catalog(root / "catalog", durable=False)
    catalog.open_readonly()
    files = _SegmentReader(root)
    total = sum(r.meta.nbytes for r in records)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verifying", disable=not progress or not total)
    failed: list[str] = []
    try:
        order = sorted(records, key=lambda r: (r.extent.segment, r.extent.offset) if r.extent is not None else (-1, 0))
        for record in order:
            if not _intact(record, catalog, files, chunk_size) and _still_fails(record, catalog, files, chunk_size):
                failed.append(record.key)
            bar.update(record.meta.nbytes)
    finally:
        files.close()
        catalog.close()
        bar.close()
    return sorted(failed)


def _still_fails(record: DiskRecord, catalog: Catalog, files: _SegmentReader, chunk_size: int, tries: int = 3) -> bool:
    """Whether ``record``'s key, looked up again, still fails: its newest record names the same
    bytes and they fail again (a record that changes each time counts as in use, not corrupt)."""
    for _ in range(tries):
        current = catalog.get(record.key)
        if current is None:
            return False  # deleted meanwhile
        files = _SegmentReader(files.root)  # (a data file may have been deleted and made again since it was opened)
        try:
            intact = _intact(current, catalog, files, chunk_size)
        finally:
            files.close()
        if intact:
            return False
        if (current.version, current.extent) == (record.version, record.extent):
            return True
        record = current
    return False


def _intact(record: DiskRecord, catalog: Catalog, files: _SegmentReader, chunk_size: int) -> bool:
    """Whether ``record``'s bytes are all there and pass their checksums."""
    extent = record.extent
    if extent is None:  # inline: the bytes are in the catalog's record
        found = catalog.get(record.key)
        raw = found.data if found is not None and found.version == record.version else None
        return raw is not None and len(raw) == record.meta.nbytes and checksum(np.frombuffer(raw, dtype=np.uint8)) == record.checksums[0]
    starts = range(0, max(record.meta.nbytes, 1), chunk_size)
    if len(starts) != len(record.checksums):
        return False
    for start, expected in zip(starts, record.checksums, strict=True):
        length = min(chunk_size, record.meta.nbytes - start)
        raw = files.read(extent.segment, extent.offset + start, length)
        if len(raw) != length or checksum(np.frombuffer(raw, dtype=np.uint8)) != expected:
            return False
    return True


class _SegmentReader:
    """The data files of a folder, opened for reading as they are first needed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._handles: dict[int, Any] = {}

    def read(self, segment: int, offset: int, length: int) -> bytes:
        handle = self._handles.get(segment)
        if handle is None:
            try:
                handle = self._handles[segment] = open(self.root / "data" / segment_name(segment), "rb")  # noqa: SIM115 (closed by close())
            except FileNotFoundError:
                return b""
        handle.seek(offset)
        return handle.read(length)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()


def _namespaces(root: Path, chunk_size: int, records: list[DiskRecord], index: DiskRecord | None) -> list[dict[str, Any]]:
    """The namespaces recorded in the folder (``tierstore.namespaces``) with their keys and bytes,
    read from the index record's bytes (checksums verified) without opening the tier."""
    if index is None or not any(r.key == INDEX_KEY for r in records):
        return []
    segment = root / "catalog" / "data.mdb"
    if index.extent is None:
        raw = index.data or b""
        chunk_size = max(len(raw), 1)  # one checksum of the whole value
    else:
        segment = root / "data" / f"segment-{index.extent.segment:06d}.bin"
        with open(segment, "rb") as handle:
            handle.seek(index.extent.offset)
            raw = handle.read(index.meta.nbytes)
    starts = range(0, max(len(raw), 1), chunk_size)
    if len(raw) != index.meta.nbytes or any(
        checksum(np.frombuffer(raw[start : start + chunk_size], dtype=np.uint8)) != expected
        for start, expected in zip(starts, index.checksums, strict=True)
    ):
        raise ChecksumError(f"the namespace index in {segment.name} is truncated or fails its checksum")
    document = json.loads(raw.decode("utf-8"))
    listed = []
    for name, record in sorted(document["namespaces"].items()):
        inside = [r for r in records if r.key.startswith(name) and not is_reserved(r.key)]
        listed.append({
            "name": name, "owner": record["owner"], "auto": record["auto"], "created": record["created"],
            "pid": record["pid"], "keys": len(inside), "nbytes": sum(r.meta.nbytes for r in inside),
        })
    return listed
