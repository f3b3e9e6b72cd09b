"""Free-space accounting of the disk tier: extents inside fixed-size segment files.

The free list is never written to disk: on open it is rebuilt as the complement of the extents
the catalog references, so a crash can never leak space.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """A byte range ``[offset, offset + length)`` of segment file number ``segment``."""

    segment: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def misplaced(extent: Extent, segment_sizes: Sequence[int], alignment: int = 1) -> str | None:
    """What is wrong with ``extent`` alone in segments of ``segment_sizes``: a segment that does
    not exist, a range outside its segment, or one not aligned to ``alignment`` bytes; None if
    nothing (overlaps with other extents are ``ExtentAllocator.rebuild``'s to find)."""
    if not 0 <= extent.segment < len(segment_sizes):
        return f"{extent} names segment {extent.segment}, which does not exist"
    if extent.offset < 0 or extent.length <= 0 or extent.end > segment_sizes[extent.segment]:
        return f"{extent} lies outside its segment of {segment_sizes[extent.segment]} bytes"
    if extent.offset % alignment or extent.length % alignment:
        return f"{extent} is not aligned to the {alignment}-byte blocks extents are made of"
    return None


class ExtentAllocator:
    """Best-fit allocation of extents with coalescing of neighbours on free."""

    def __init__(self) -> None:
        self.segment_sizes: list[int] = []
        self._by_size: list[tuple[int, int, int]] = []  # (length, segment, offset), sorted
        self._starts: dict[tuple[int, int], int] = {}  # (segment, offset) -> length
        self._ends: dict[tuple[int, int], int] = {}  # (segment, end) -> offset
        self.used = 0

    @property
    def size(self) -> int:
        """Bytes in all segments."""
        return sum(self.segment_sizes)

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    def free_ranges(self) -> list[tuple[int, int, int]]:
        """Every free range as ``(segment, offset, length)``."""
        return [(segment, offset, length) for (segment, offset), length in self._starts.items()]

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def add_segment(self, size: int) -> int:
        """Register a new segment of ``size`` bytes, all free; return its number."""
        segment = len(self.segment_sizes)
        self.segment_sizes.append(size)
        if size:
            self._add_free(segment, 0, size)
        return segment

    def allocate(self, length: int) -> Extent | None:
        """The smallest free extent that holds ``length`` bytes (split off), or None."""
        i = bisect.bisect_left(self._by_size, (length, -1, -1))
        if i == len(self._by_size):
            return None
        free_length, segment, offset = self._by_size[i]
        self._remove_free(segment, offset, free_length)
        if free_length > length:
            self._add_free(segment, offset + length, free_length - length)
        self.used += length
        return Extent(segment, offset, length)

    def free(self, extent: Extent) -> None:
        """Return ``extent`` to the free space, merged with free neighbours."""
        segment, offset, end = extent.segment, extent.offset, extent.end
        before = self._ends.get((segment, offset))
        if before is not None:
            self._remove_free(segment, before, offset - before)
            offset = before
        after = self._starts.get((segment, end))
        if after is not None:
            self._remove_free(segment, end, after)
            end += after
        self._add_free(segment, offset, end - offset)
        self.used -= extent.length

    def is_empty(self, segment: int) -> bool:
        """Whether nothing is allocated in ``segment``."""
        size = self.segment_sizes[segment]
        return size == 0 or self._starts.get((segment, 0)) == size

    def removable_tail(self) -> int:
        """How many trailing segments to give back to the file system: empty ones, while the
        segments before them would stay at most half full. The first segment stays, and the
        half-full margin keeps a store that hovers at a boundary from dropping and re-creating
        a file on every put and delete."""
        count, rest = 0, self.size
        for segment in range(len(self.segment_sizes) - 1, 0, -1):
            if not self.is_empty(segment):
                break
            rest -= self.segment_sizes[segment]
            if 2 * self.used > rest:
                break
            count += 1
        return count

    def drop_tail(self, count: int) -> None:
        """Forget the last ``count`` segments, which must be empty."""
        for segment in range(len(self.segment_sizes) - 1, len(self.segment_sizes) - 1 - count, -1):
            if not self.is_empty(segment):
                raise ValueError(f"segment {segment} is not empty")
            if self.segment_sizes[segment]:
                self._remove_free(segment, 0, self.segment_sizes[segment])
            self.segment_sizes.pop()

    @classmethod
    def rebuild(cls, segment_sizes: Iterable[int], used: Iterable[Extent], alignment: int = 1) -> ExtentAllocator:
        """An allocator whose free space is everything in the segments but ``used``.

        Raises ``ValueError`` naming the first extent that lies outside its segment, is not
        aligned to ``alignment`` bytes (every extent a disk tier allocates is: a damaged record's
        would fail its reads with a bare ``EINVAL``) or overlaps another one.
        """
        allocator = cls()
        allocator.segment_sizes = list(segment_sizes)
        by_segment: dict[int, list[Extent]] = {}
        for extent in used:
            problem = misplaced(extent, allocator.segment_sizes, alignment)
            if problem is not None:
                raise ValueError(problem)
            by_segment.setdefault(extent.segment, []).append(extent)
        for segment, size in enumerate(allocator.segment_sizes):
            cursor = 0
            for extent in sorted(by_segment.get(segment, []), key=lambda e: e.offset):
                if extent.offset < cursor:
                    raise ValueError(f"{extent} overlaps another extent")
                if extent.offset > cursor:
                    allocator._add_free(segment, cursor, extent.offset - cursor)
                cursor = extent.end
                allocator.used += extent.length
            if cursor < size:
                allocator._add_free(segment, cursor, size - cursor)
        return allocator

    def _add_free(self, segment: int, offset: int, length: int) -> None:
        bisect.insort(self._by_size, (length, segment, offset))
        self._starts[(segment, offset)] = length
        self._ends[(segment, offset + length)] = offset

    def _remove_free(self, segment: int, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._by_size, (length, segment, offset))
        del self._by_size[i]
        del self._starts[(segment, offset)]
        del self._ends[(segment, offset + length)]
