"""Small values packed into shared slabs, so a memory tier spends its capacity on values.

A value below one page (``ALIGNMENT``) gets a *slot*: its size rounded up to ``GRANULE`` bytes
(its size class), carved out of a *slab* of whole pages that holds slots of that class only.
The store names a slot by its slab and index (``take_index``; no object per slot: a million
small values must not cost a million tensors); ``Slab.view`` gives a tensor over it when bytes
move. ``take`` hands out a slot as a tensor with a storage of its own (``torch.frombuffer`` over
the slab's memory, so ``untyped_storage().nbytes()`` is the slot's size), for callers of the
tier's tensor API.

Accounting (what the owning tier reports):

- a slab's bytes are allocated, and count in ``used``, from its creation until it is dropped;
- a slot holding a value counts as that value's bytes (``value_bytes``);
- the rest of a slab that holds any value (free slots and the unused tail) is allocated but
  usable only by values of its class: it is not free room (``stranded_bytes``);
- a slab with no value left is pooled memory (``empty_bytes``): reused by its class, or dropped
  when the tier needs the room, so it counts as free.

Bounds: a slab is the fewest pages (at most ``MAX_SLAB_PAGES``) whose unused tail is at most a
``1/TAIL_FRACTION`` of it, so a class filled with values wastes at most ``GRANULE - 1`` bytes a
value plus that tail plus the free slots of one partly filled slab at a time. Because slabs are
only a few pages, evicting the values of one slab (4 values of 1 KiB, 64 of 64 bytes) frees its
pages; when every value of a tier is evicted, every slab is empty and droppable, so eviction can
always make the room a put needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import TierStoreError
from ..tensors import ALIGNMENT, storage_nbytes
from ..units import round_up

#: Size classes are multiples of this many bytes (a cache line; keeps every slot 64-byte aligned).
GRANULE = 64
#: A slab's unused tail is at most this fraction (1/N) of it, when a slab of at most
#: ``MAX_SLAB_PAGES`` pages can achieve it.
TAIL_FRACTION = 32
#: The largest slab, in pages: evicting the values of one slab frees it.
MAX_SLAB_PAGES = 16


def slot_size(nbytes: int) -> int | None:
    """The size class (slot bytes) of a value of ``nbytes``, or None if it is not packed (it
    takes whole pages of its own)."""
    size = round_up(max(nbytes, 1), GRANULE)
    return size if size < ALIGNMENT else None


def slab_size(slot: int, max_pages: int = MAX_SLAB_PAGES) -> int:
    """Bytes of a slab of ``slot``-byte slots: the fewest pages (at most ``max_pages``) whose
    tail is small enough."""
    best = ALIGNMENT
    for pages in range(1, max(1, max_pages) + 1):
        size = pages * ALIGNMENT
        if (size % slot) * TAIL_FRACTION <= size:
            return size
        if (size % slot) / size < (best % slot) / best:
            best = size
    return best


class Slab:
    """Pages of slots of one size class."""

    __slots__ = ("memory", "array", "address", "slot", "count", "free", "taken", "__weakref__")

    def __init__(self, memory: torch.Tensor, slot: int) -> None:
        self.memory = memory
        #: The same bytes as a numpy array (byte slices of it are cheaper than tensor views).
        self.array = memory.numpy()
        self.address = memory.data_ptr()
        self.slot = slot
        self.count = storage_nbytes(memory) // slot
        #: Indices of the slots holding no value.
        self.free = list(reversed(range(self.count)))
        #: Whether each slot holds a value (catches a slot released twice).
        self.taken = bytearray(self.count)

    @property
    def nbytes(self) -> int:
        return storage_nbytes(self.memory)

    @property
    def values(self) -> int:
        return self.count - len(self.free)

    def view(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over the first ``nbytes`` (default: all) of slot ``index``."""
        start = index * self.slot
        return self.memory[start : start + (self.slot if nbytes is None else nbytes)]

    def slot_tensor(self, index: int) -> torch.Tensor:
        """Slot ``index`` as a tensor with a storage of its own (its ``untyped_storage()`` is
        the slot's bytes, as a buffer of its own would be), keeping the slab's memory alive."""
        return torch.frombuffer(self.array, dtype=torch.uint8, count=self.slot, offset=index * self.slot)

    def bytes_of(self, index: int, nbytes: int) -> bytes:
        """A copy of the first ``nbytes`` of slot ``index``."""
        start = index * self.slot
        return self.array[start : start + nbytes].tobytes()


class SlabPacker:
    """The slabs of one memory tier, by size class.

    Parameters
    ----------
    new_memory:
        Allocates a slab's memory: a contiguous uint8 CPU tensor of exactly the bytes asked
        (the tier's own buffer allocator, pinned or not).
    max_pages:
        The largest slab in pages. A slab with one value held cannot be freed, so on a small
        tier slabs must be small: the tier passes a sixteenth of its capacity.
    """

    def __init__(self, new_memory: Callable[[int], torch.Tensor], max_pages: int = MAX_SLAB_PAGES) -> None:
        self._new_memory = new_memory
        self._max_pages = max(1, min(max_pages, MAX_SLAB_PAGES))
        #: Slabs with at least one value and one free slot, by slot size.
        self._partial: dict[int, dict[Slab, None]] = {}
        #: Slabs without values, by slot size.
        self._empty: dict[int, list[Slab]] = {}
        #: Slot address -> (slab, index) of every slot handed out as a tensor (``take``), until
        #: its slab is dropped.
        self._where: dict[int, tuple[Slab, int]] = {}
        #: Bytes of all slabs.
        self.slab_bytes = 0
        #: Bytes of the slabs holding no value (droppable).
        self.empty_bytes = 0
        #: Bytes of the slots that hold values.
        self.value_bytes = 0

    @property
    def stranded_bytes(self) -> int:
        """Bytes of slabs holding values that no value uses (free slots, tails): allocated,
        and usable only by values of their class."""
        return self.slab_bytes - self.empty_bytes - self.value_bytes

    def room_needed(self, slot: int) -> int:
        """Bytes of free room taking a ``slot``-byte slot costs: none if a slab of that class
        has a free slot, else a new slab."""
        if self._partial.get(slot) or self._empty.get(slot):
            return 0
        return slab_size(slot, self._max_pages)

    def slabs_for(self, slot: int, count: int) -> int:
        """Bytes of the slabs ``count`` values of the ``slot``-byte class fill, from none."""
        size = slab_size(slot, self._max_pages)
        return -(-count // (size // slot)) * size

    def take_index(self, slot: int) -> tuple[Slab, int]:
        """A free ``slot``-byte slot as (slab, index), from a slab with values first, then an
        empty slab, then a new slab (the caller has checked that its ``room_needed`` fits)."""
        partial = self._partial.get(slot)
        if partial:
            slab = next(iter(partial))
        elif self._empty.get(slot):
            slab = self._empty[slot].pop()
            self.empty_bytes -= slab.nbytes
        else:
            slab = self._new_slab(slot)
        index = slab.free.pop()
        slab.taken[index] = 1
        self.value_bytes += slot
        partial = self._partial.setdefault(slot, {})
        if slab.free:
            partial[slab] = None
        else:
            partial.pop(slab, None)
        return slab, index

    def take(self, slot: int) -> torch.Tensor:
        """``take_index`` handed out as a tensor with a storage of its own (``give`` takes it back)."""
        slab, index = self.take_index(slot)
        tensor = slab.slot_tensor(index)
        self._where[tensor.data_ptr()] = (slab, index)
        return tensor

    def owns(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is a slot handed out by ``take``."""
        found = self._where.get(buffer.data_ptr())
        return found is not None and storage_nbytes(buffer) == found[0].slot

    def give(self, buffer: torch.Tensor) -> bool:
        """Take back a slot handed out by ``take`` (False if ``buffer`` is not one of them)."""
        found = self._where.get(buffer.data_ptr())
        if found is None or storage_nbytes(buffer) != found[0].slot:
            return False
        self.give_index(*found)
        return True

    def give_index(self, slab: Slab, index: int) -> None:
        """Take back slot ``index`` of ``slab`` (from ``take_index``)."""
        if not slab.taken[index]:
            raise TierStoreError(f"internal error: a {slab.slot}-byte slot was released twice")
        slab.taken[index] = 0
        slab.free.append(index)
        self.value_bytes -= slab.slot
        partial = self._partial.setdefault(slab.slot, {})
        if slab.values:
            partial[slab] = None
        else:
            partial.pop(slab, None)
            self._empty.setdefault(slab.slot, []).append(slab)
            self.empty_bytes += slab.nbytes

    def drop_empty(self, keep: int) -> None:
        """Drop empty slabs until at most ``keep`` bytes of them remain."""
        for slot in list(self._empty):
            slabs = self._empty[slot]
            while slabs and self.empty_bytes > keep:
                self._drop(slabs.pop())
            if not slabs:
                del self._empty[slot]
            if self.empty_bytes <= keep:
                return

    def _new_slab(self, slot: int) -> Slab:
        slab = Slab(self._new_memory(slab_size(slot, self._max_pages)), slot)
        self.slab_bytes += slab.nbytes
        return slab

    def _drop(self, slab: Slab) -> None:
        base = slab.memory.data_ptr()
        for index in range(slab.count):
            self._where.pop(base + index * slab.slot, None)
        self.slab_bytes -= slab.nbytes
        self.empty_bytes -= slab.nbytes
