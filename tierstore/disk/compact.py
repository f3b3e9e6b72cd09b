"""Fitting a disk tier folder into a smaller capacity: live extents move down, files shrink.

Runs on the open path, before the tier serves anything. The order is the copy-on-write order of
every disk write: copy each extent that lies beyond the new capacity into free space below it,
fdatasync, commit the moved records and the shorter layout in one catalog transaction, and only
then cut and delete the files. A crash before the commit leaves the old catalog, whose extents
were never touched; a crash after it leaves files longer than the layout says, which the next
open tolerates (and stray segment files, which it deletes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import CapacityError
from ..tensors import aligned_empty
from ..units import format_bytes, round_up
from .catalog import Catalog, CatalogLayout, DiskRecord
from .extents import Extent, ExtentAllocator
from .files import SegmentFiles


@dataclass(frozen=True)
class CompactionPlan:
    """Where every extent beyond the new capacity goes, and the segment sizes after."""

    segments: tuple[int, ...]
    moves: dict[str, Extent]


def plan_compaction(
    root: Path, records: Mapping[str, DiskRecord], segments: Sequence[int], capacity: int, alignment: int
) -> CompactionPlan:
    """Plan moving the live extents into the first ``capacity`` bytes of the segments, less
    the bytes of the values inline in the catalog (they count against the capacity too).

    Raises
    ------
    CapacityError
        If the live data is larger than ``capacity``, or cannot be placed in whole extents in the
        free space below it. Nothing has been changed then.
    """
    # Inline values live in the catalog, not in the segments: nothing of theirs moves, but they
    # count against the capacity (DiskTier.used), so the segments get what they leave.
    inline = sum(record.meta.nbytes for record in records.values() if record.extent is None)
    count = len(records)
    records = {key: record for key, record in records.items() if record.extent is not None}
    live = sum(record.extent.length for record in records.values() if record.extent is not None)
    limit = max(0, capacity - inline) // alignment * alignment
    if live > limit:
        kept = f" ({format_bytes(inline)} of it inline in the catalog)" if inline else ""
        raise CapacityError(
            f"{root} holds {format_bytes(live + inline)} of live data{kept} in {count} entries, more than the "
            f"capacity of {format_bytes(capacity)} asked; open it with a capacity of at least "
            f"{format_bytes(round_up(live, alignment) + inline if live else inline)}, or delete entries first"
        )
    target: list[int] = []
    room = limit
    for size in segments:
        if room <= 0:
            break
        target.append(min(size, room))
        room -= target[-1]

    def inside(extent: Extent) -> bool:
        return extent.segment < len(target) and extent.end <= target[extent.segment]

    extents = {key: record.extent for key, record in records.items() if record.extent is not None}
    allocator = ExtentAllocator.rebuild(target, [e for e in extents.values() if inside(e)])
    moves: dict[str, Extent] = {}
    # Largest first: the big pieces need the big holes.
    for key, old in sorted(((k, e) for k, e in extents.items() if not inside(e)), key=lambda item: (-item[1].length, item[0])):
        extent = allocator.allocate(old.length)
        if extent is None:
            raise CapacityError(
                f"{root} holds {format_bytes(live)} of live data, which would fit in the capacity of "
                f"{format_bytes(capacity)} asked, but the free space below it is in pieces too small for "
                f"{key!r} ({format_bytes(old.length)}; largest free piece "
                f"{format_bytes(allocator.largest_free)}); open it with its current capacity of "
                f"{format_bytes(sum(segments))}, or delete entries first"
            )
        moves[key] = extent
    return CompactionPlan(tuple(target), moves)


def compact(
    files: SegmentFiles,
    catalog: Catalog,
    layout: CatalogLayout,
    records: Mapping[str, DiskRecord],
    plan: CompactionPlan,
    buffer_size: int,
) -> tuple[CatalogLayout, dict[str, DiskRecord]]:
    """Carry out ``plan``; return the new layout and records."""
    buffer = aligned_empty(buffer_size)
    touched: set[int] = set()
    for key, extent in plan.moves.items():
        old = records[key].extent
        if old is None:
            continue
        files.copy((old.segment, old.offset), (extent.segment, extent.offset), extent.length, buffer)
        touched.add(extent.segment)
    # Durability order: the copies are on disk before the catalog points at them.
    for segment in sorted(touched):
        files.sync(segment)
    moved = {key: replace(records[key], extent=extent) for key, extent in plan.moves.items()}
    new_layout = replace(layout, segments=plan.segments)
    changes: list[tuple[str, DiskRecord | None]] = list(moved.items())
    with files.io.catalog_commit(changes, new_layout):
        catalog.commit_now(changes, new_layout)
    # The catalog names none of the space beyond the new capacity any more: now it may go.
    files.remove_tail(len(layout.segments) - len(plan.segments))
    if plan.segments and plan.segments[-1] < layout.segments[len(plan.segments) - 1]:
        files.truncate(len(plan.segments) - 1, plan.segments[-1])
    return new_layout, {**records, **moved}
