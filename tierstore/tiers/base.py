"""The tier abstraction: one storage level with a byte capacity.

``Tier`` is what every level shares (a name, a capacity, bytes used, an ``open``/``aclose`` pair).
``MemoryTier`` is a level whose copies are tensors (the device and host tiers); ``DiskTier`` keeps
extents in files. Tiers only allocate, free and account; the store decides what moves where.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch

from ..errors import BufferSharedError, TierFullError
from ..tensors import ALIGNMENT, storage_nbytes
from ..units import format_bytes, parse_bytes
from .slabs import Slab, SlabPacker, slot_size


class Tier(ABC):
    """A storage level with a byte capacity. Constructing one does no I/O; ``open`` does."""

    #: "memory" for tiers whose copies are tensors, "disk" for the file-backed tier.
    kind: ClassVar[str]

    def __init__(self, capacity: int | str, name: str) -> None:
        self.capacity = parse_bytes(capacity)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tier needs a non-empty name, not {name!r}")
        self.name = name
        self.is_open = False

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes allocated on this tier now (never more than ``capacity``)."""

    @property
    def free(self) -> int:
        """Bytes that can still be allocated without evicting anything."""
        return self.capacity - self.used

    async def open(self) -> None:
        """Acquire resources (files, streams). Called once by the store."""
        self.is_open = True

    async def aclose(self) -> None:
        """Release resources. The store calls it after all transfers have ended."""
        self.is_open = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, capacity={format_bytes(self.capacity)!r})"


class MemoryTier(Tier):
    """A tier whose copies are uint8 tensors on one device, allocated with no padding.

    Values of a page or more get buffers of their own, rounded up to a page (or, on a CUDA
    device, to the caching allocator's 512 bytes); on the CPU these are mappings of their own,
    page aligned with no slack, so values whose sizes are multiples of 4 KiB fill a tier exactly.
    Smaller values are packed into shared slabs by size class (see :mod:`tierstore.tiers.slabs`
    for how slab bytes are accounted and why eviction can always free them).

    Freed buffers are kept for reuse by exact size (the optimizer asks for the same sizes every
    step, and pinned allocations are slow); pooled bytes and empty slabs count against the
    capacity and are dropped first when room is needed, so ``used`` always equals the bytes
    really allocated.
    """

    kind: ClassVar[str] = "memory"

    def __init__(self, capacity: int | str, name: str) -> None:
        super().__init__(capacity, name)
        self._live_bytes = 0
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._pooled_bytes = 0
        self._slabs = SlabPacker(self._new_buffer, max_pages=self.capacity // 16 // ALIGNMENT)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where this tier's tensors live."""

    @property
    def pinned(self) -> bool:
        """Whether buffers are page-locked host memory (fast, asynchronous device copies)."""
        return False

    @property
    def _packs_small_values(self) -> bool:
        """Whether values below a page share slabs (the buffer allocator must give CPU memory)."""
        return True

    @abstractmethod
    def _buffer_size(self, nbytes: int) -> int:
        """Bytes of a buffer of its own for a value of ``nbytes`` (what the allocator takes)."""

    @abstractmethod
    def _new_buffer(self, size: int) -> torch.Tensor:
        """Allocate a uint8 buffer whose storage holds exactly ``size`` bytes."""

    def _slot_size(self, nbytes: int) -> int | None:
        return slot_size(nbytes) if self._packs_small_values else None

    def value_size(self, nbytes: int) -> int:
        """Bytes a value of ``nbytes`` occupies on this tier once stored (its slot or buffer),
        whatever the tier holds now: the figure to plan capacity with.

        Parameters
        ----------
        nbytes:
            Size of the value in bytes.
        """
        slot = self._slot_size(nbytes)
        return slot if slot is not None else self._buffer_size(nbytes)

    def room_for(self, sizes: Iterable[int]) -> int:
        """Bytes of capacity values of ``sizes`` bytes take together, held at once, where
        nothing else holds room: each its buffer, and the values packed into slabs (below a
        page) the slabs of their size classes, so a handful of small values of distinct sizes
        takes a slab each (whole pages: on a small tier, more than their bytes by far). The
        figure to plan what must be held at once with (``value_size`` sums to less).

        Parameters
        ----------
        sizes:
            The values' sizes in bytes.
        """
        tally = RoomTally(self)
        for nbytes in sizes:
            tally.add(nbytes)
        return tally.room

    def allocation_size(self, nbytes: int) -> int:
        """Bytes of free room (``free``) that ``allocate(nbytes)`` needs now.

        A value with a buffer of its own needs the buffer's bytes. A packed value needs none
        when a slab of its class has a free slot, else a new slab's bytes; so it depends on
        what the tier holds (:meth:`value_size` does not).

        Parameters
        ----------
        nbytes:
            Size of the value in bytes.
        """
        slot = self._slot_size(nbytes)
        if slot is None:
            return self._buffer_size(nbytes)
        return self._slabs.room_needed(slot)

    @property
    def used(self) -> int:
        return self._live_bytes + self._pooled_bytes + self._slabs.slab_bytes

    @property
    def free(self) -> int:
        """Bytes available: unallocated, pooled buffers and empty slabs (dropped on demand).
        Free slots of slabs that hold values are not free: only their class can use them."""
        return self.capacity - self._live_bytes - (self._slabs.slab_bytes - self._slabs.empty_bytes)

    @property
    def live_bytes(self) -> int:
        """Bytes in buffers and slots that hold copies now (the sum of their storages' sizes)."""
        return self._live_bytes + self._slabs.value_bytes

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes``: a slot of a shared slab for a value below a
        page, else a buffer of its own (from the pool when one of the size is free).

        Raises ``TierFullError`` if it does not fit beside the live buffers and slabs
        (``free < allocation_size(nbytes)``); the store makes room by eviction before calling
        this. Buffers of a page or more start on a 4096-byte boundary.

        Parameters
        ----------
        nbytes:
            Bytes the buffer must hold.
        """
        slot = self._slot_size(nbytes)
        if slot is not None:
            self._reserve(self._slabs.room_needed(slot))
            return self._slabs.take(slot)
        size = self._buffer_size(nbytes)
        pooled = self._pool.get(size)
        if pooled:
            buffer = pooled.pop()
            self._pooled_bytes -= size
            self._live_bytes += size
            return buffer
        self._reserve(size)
        buffer = self._new_buffer(size)
        self._live_bytes += size
        return buffer

    def allocate_packed(self, nbytes: int) -> tuple[Slab, int] | None:
        """For a value that this tier packs into a slab, a slot of it as (slab, index) with no
        tensor made for it (the store keeps millions of these); None for a value that takes a
        buffer of its own (use :meth:`allocate`). ``release_packed`` gives it back; room as in
        :meth:`allocate` (``TierFullError`` if a new slab does not fit).

        Parameters
        ----------
        nbytes:
            Bytes the slot must hold.
        """
        slot = self._slot_size(nbytes)
        if slot is None:
            return None
        self._reserve(self._slabs.room_needed(slot))
        return self._slabs.take_index(slot)

    def release_packed(self, slab: Slab, index: int) -> None:
        """Give back a slot from :meth:`allocate_packed`."""
        self._slabs.give_index(slab, index)

    def _reserve(self, size: int) -> None:
        """Check that ``size`` more bytes fit, and drop pooled memory until they really do."""
        if size == 0:
            return
        if self.free < size:
            raise TierFullError(
                f"tier {self.name!r}: {format_bytes(size)} does not fit "
                f"({format_bytes(self.capacity - self.free)} of {format_bytes(self.capacity)} in use)"
            )
        self._trim_pool(self.capacity - (self.used - self._pooled_bytes - self._slabs.empty_bytes) - size)

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer from :meth:`allocate`: a slot goes back to its slab, a buffer of its
        own to the pool for reuse."""
        if self._slabs.give(buffer):
            return
        size = storage_nbytes(buffer)
        self._live_bytes -= size
        self._pool.setdefault(size, []).append(buffer)
        self._pooled_bytes += size

    def can_hand_over(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` can leave the tier (:meth:`forget`) for a caller to keep: not a
        slot of a slab, whose memory other values share (copy those instead)."""
        return not self._slabs.owns(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """Take a just-released buffer back out of the pool: it leaves the tier (handed to a
        caller), so it no longer counts against the capacity.

        Raises ``BufferSharedError`` for a slot of a slab (see :meth:`can_hand_over`).
        """
        if self._slabs.owns(buffer):
            raise BufferSharedError(f"tier {self.name!r}: a packed small value shares its slab; copy it instead")
        size = storage_nbytes(buffer)
        pooled = self._pool.get(size, [])
        for i, candidate in enumerate(pooled):
            if candidate is buffer:
                del pooled[i]
                self._pooled_bytes -= size
                if not pooled:
                    del self._pool[size]
                return

    def _trim_pool(self, keep: int) -> None:
        """Drop pooled buffers (largest first), then empty slabs, until at most ``keep`` bytes
        of both stay."""
        for size in sorted(self._pool, reverse=True):
            buffers = self._pool[size]
            while buffers and self._pooled_bytes + self._slabs.empty_bytes > keep:
                buffers.pop()
                self._pooled_bytes -= size
            if not buffers:
                del self._pool[size]
        self._slabs.drop_empty(max(keep - self._pooled_bytes, 0))

    def clear_pool(self) -> None:
        """Release every pooled buffer and empty slab back to the allocator."""
        self._trim_pool(0)

    async def aclose(self) -> None:
        self.clear_pool()
        await super().aclose()


class RoomTally:
    """``MemoryTier.room_for`` of a growing set of values, a value at a time."""

    __slots__ = ("_tier", "_classes", "room")

    def __init__(self, tier: MemoryTier) -> None:
        self._tier = tier
        self._classes: dict[int, int] = {}
        #: ``room_for`` the values added so far.
        self.room = 0

    def cost(self, *sizes: int) -> int:
        """What adding values of ``sizes`` bytes would add to ``room``."""
        total = 0
        added: dict[int, int] = {}
        slabs = self._tier._slabs
        for nbytes in sizes:
            slot = self._tier._slot_size(nbytes)
            if slot is None:
                total += self._tier._buffer_size(nbytes)
                continue
            count = self._classes.get(slot, 0) + added.get(slot, 0)
            total += slabs.slabs_for(slot, count + 1) - slabs.slabs_for(slot, count)
            added[slot] = added.get(slot, 0) + 1
        return total

    def add(self, nbytes: int) -> None:
        self.room += self.cost(nbytes)
        slot = self._tier._slot_size(nbytes)
        if slot is not None:
            self._classes[slot] = self._classes.get(slot, 0) + 1
