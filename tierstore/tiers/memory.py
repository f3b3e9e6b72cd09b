"""The two memory tiers: ``DeviceTier`` (a CUDA device, or the CPU as a stand-in) and ``HostTier``."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..device import Link, link_for
from ..flags import require_flag
from ..tensors import ALIGNMENT, page_empty
from ..units import round_up
from .base import MemoryTier

#: The CUDA caching allocator rounds every block up to a multiple of this.
CUDA_BLOCK = 512
_CPU = torch.device("cpu")


class DeviceTier(MemoryTier):
    """The fastest tier: memory of a CUDA device, or the CPU standing in for one.

    Parameters
    ----------
    device:
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. With ``"cpu"`` the tier behaves exactly like a
        device tier (own capacity, own eviction) so the whole engine runs on machines without a
        GPU. Copies in and out cross the device's ``link`` (``tierstore.device``): CUDA side
        streams awaited through their events, or, for ``"cpu"`` under emulation, the emulated link.
    capacity:
        Bytes the store may use on the device, an int or a string such as ``"8GiB"``.
    emulate_device:
        For ``"cpu"``: copies to and from this tier cross an emulated link (True), or are plain
        memory copies (False); None follows ``TIERSTORE_EMULATE_DEVICE`` / ``emulate_device()``
        as it is when the tier opens.
    """

    def __init__(self, device: str | torch.device, capacity: int | str, name: str = "device", *, emulate_device: bool | None = None) -> None:
        super().__init__(capacity, name)
        self._device = torch.device(device)
        if self._device.type not in ("cpu", "cuda"):
            raise ValueError(f"DeviceTier takes 'cuda', 'cuda:N' or 'cpu', not {device!r}")
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self._emulate = require_flag("emulate_device", emulate_device, none="as tierstore.device.emulate_device or TIERSTORE_EMULATE_DEVICE says")
        #: The link copies to and from this tier cross (None: plain memory copies).
        self.link: Link | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_cuda(self) -> bool:
        return self._device.type == "cuda"

    async def open(self) -> None:
        if self.is_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"DeviceTier({str(self._device)!r}): CUDA is not available on this machine; use 'cpu'")
        link = link_for(self._device, self._emulate)
        self.link = None if link.lends else link
        await super().open()

    @property
    def _packs_small_values(self) -> bool:
        return not self.is_cuda  # slots are carved through CPU buffer views

    def _buffer_size(self, nbytes: int) -> int:
        if self.is_cuda:
            return round_up(max(nbytes, 1), CUDA_BLOCK)
        return round_up(max(nbytes, 1), ALIGNMENT)

    def _new_buffer(self, size: int) -> torch.Tensor:
        if self.is_cuda:
            return torch.empty(size, dtype=torch.uint8, device=self._device)
        return page_empty(size)


class HostTier(MemoryTier):
    """Host (CPU) memory, page-locked where CUDA exists so device copies are asynchronous.

    Parameters
    ----------
    capacity:
        Bytes the store may use in host memory (an int or a string such as ``"32GiB"``).
    pinned:
        ``"auto"`` pins when ``torch.cuda.is_available()``; ``True`` requires it; ``False`` never pins.
    """

    def __init__(self, capacity: int | str, pinned: bool | str = "auto", name: str = "host") -> None:
        super().__init__(capacity, name)
        if pinned not in (True, False, "auto"):
            raise ValueError(f"pinned must be True, False or 'auto', not {pinned!r}")
        self._pinned_setting = pinned
        self._pinned = False

    @property
    def device(self) -> torch.device:
        return _CPU

    @property
    def pinned(self) -> bool:
        return self._pinned

    async def open(self) -> None:
        cuda = torch.cuda.is_available()
        if self._pinned_setting is True and not cuda:
            raise RuntimeError("HostTier(pinned=True) needs CUDA; this machine has none (use 'auto')")
        self._pinned = cuda and self._pinned_setting in (True, "auto")
        await super().open()

    def _buffer_size(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1), ALIGNMENT)

    def _new_buffer(self, size: int) -> torch.Tensor:
        # Pinned buffers are mappings of our own, page-locked, rather than blocks of torch's
        # caching host allocator, which rounds every block up to a power of two.
        return page_empty(size, pin_memory=self._pinned)


def device_link(tiers: Iterable[object], device: torch.device | str, emulate: bool | None, user: str) -> Link:
    """The link ``device``'s tensors cross to and from host memory in a store of ``tiers``: its
    device tier's on ``device`` where it has one (the store decides, so that swapping and the
    optimizer cross one boundary), else ``link_for(device, emulate)``. An ``emulate`` that
    contradicts the device tier's raises ``ValueError``; ``user`` names the caller in it."""
    device = torch.device(device)
    for tier in tiers:
        if isinstance(tier, DeviceTier) and tier.device == device:
            link = tier.link if tier.link is not None else link_for(device, emulate=False)
            if emulate is not None and link_for(device, emulate).lends != link.lends:
                raise ValueError(
                    f"emulate_device={emulate} contradicts the store's device tier {tier.name!r} on {device}, "
                    f"which {'lends plain CPU memory' if link.lends else 'crosses an emulated link'}; "
                    f"{user} uses the device tier's link: build the store with DeviceTier(..., emulate_device={emulate}) "
                    f"or leave emulate_device=None here"
                )
            return link
    return link_for(device, emulate)
