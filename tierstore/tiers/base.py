"""The tier abstraction: one storage level with a byte capacity.

``Tier`` is what every level shares (a name, a capacity, bytes used, an ``open``/``aclose`` pair).
``MemoryTier`` is a level whose copies are tensors (the device and host tiers); ``DiskTier`` keeps
extents in files. Tiers only allocate, free and account; the store decides what moves where.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ..errors import TierFullError
from ..tensors import storage_nbytes
from ..units import format_bytes, parse_bytes


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
    """A tier whose copies are uint8 tensors on one device, recycled through a buffer pool.

    Freed buffers are kept for reuse by exact size (the optimizer asks for the same sizes every
    step, and pinned allocations are slow); pooled bytes count against the capacity and are
    released first when room is needed, so ``used`` always equals the bytes really allocated.
    """

    kind: ClassVar[str] = "memory"

    def __init__(self, capacity: int | str, name: str) -> None:
        super().__init__(capacity, name)
        self._live_bytes = 0
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._pooled_bytes = 0

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where this tier's tensors live."""

    @property
    def pinned(self) -> bool:
        """Whether buffers are page-locked host memory (fast, asynchronous device copies)."""
        return False

    @abstractmethod
    def allocation_size(self, nbytes: int) -> int:
        """Bytes really allocated (and accounted) for a buffer of ``nbytes``."""

    @abstractmethod
    def _new_buffer(self, size: int) -> torch.Tensor:
        """Allocate a uint8 buffer whose storage holds exactly ``size`` bytes."""

    @property
    def used(self) -> int:
        return self._live_bytes + self._pooled_bytes

    @property
    def free(self) -> int:
        """Bytes available: unallocated plus pooled (pooled buffers are dropped on demand)."""
        return self.capacity - self._live_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes in buffers that hold copies now (excludes the pool)."""
        return self._live_bytes

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes``, from the pool when one of the size is free.

        Raises ``TierFullError`` if the buffer does not fit beside the live ones; the store makes
        room by eviction before calling this.
        """
        size = self.allocation_size(nbytes)
        pooled = self._pool.get(size)
        if pooled:
            buffer = pooled.pop()
            self._pooled_bytes -= size
            self._live_bytes += size
            return buffer
        if self._live_bytes + size > self.capacity:
            raise TierFullError(
                f"tier {self.name!r}: {format_bytes(size)} does not fit "
                f"({format_bytes(self._live_bytes)} of {format_bytes(self.capacity)} in use)"
            )
        self._trim_pool(self.capacity - self._live_bytes - size)
        buffer = self._new_buffer(size)
        self._live_bytes += size
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer; it goes to the pool for reuse."""
        size = storage_nbytes(buffer)
        self._live_bytes -= size
        self._pool.setdefault(size, []).append(buffer)
        self._pooled_bytes += size

    def forget(self, buffer: torch.Tensor) -> None:
        """Take a just-released buffer back out of the pool: it leaves the tier (handed to a
        caller), so it no longer counts against the capacity."""
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
        """Drop pooled buffers, largest first, until at most ``keep`` bytes stay pooled."""
        for size in sorted(self._pool, reverse=True):
            buffers = self._pool[size]
            while buffers and self._pooled_bytes > keep:
                buffers.pop()
                self._pooled_bytes -= size
            if not buffers:
                del self._pool[size]
            if self._pooled_bytes <= keep:
                return

    def clear_pool(self) -> None:
        """Release every pooled buffer back to the allocator."""
        self._trim_pool(0)

    async def aclose(self) -> None:
        self.clear_pool()
        await super().aclose()
