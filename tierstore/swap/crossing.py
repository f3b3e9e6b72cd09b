"""How swapped tensors cross the device boundary: which link they take, and the two crossings
(device to store, store to device).

One device has one link. When the store has a ``DeviceTier`` on the tensors' device, swapping
uses that tier's link, so the store's own copies (a parameter held on the device tier) and the
swap's (an activation saved to the host) cross the same link, emulated or not as the tier was
made. An explicit ``emulate_device=`` that contradicts the tier's raises ``ValueError`` rather
than mixing a plain CPU tier with an emulated swap. Without such a tier the swap's own choice
(``emulate_device=``, else the process setting, else ``TIERSTORE_EMULATE_DEVICE``) picks the link.

When the link ``lends`` (the plain CPU: device memory is host memory) the store's verbs move
the bytes as they always did; otherwise every crossing is a copy over the link.
"""

from __future__ import annotations

from typing import Any

import torch

from ..device import Link
from ..errors import TierFullError
from ..flags import require_flag
from ..store import TierStore
from ..tensors import empty
from ..tiers import DeviceTier, MemoryTier
from ..tiers.memory import device_link


def swap_link(store: TierStore, device: torch.device, emulate: bool | None) -> Link:
    """The link ``device``'s tensors cross when swapped through ``store`` (see the module
    docstring and ``tierstore.tiers.memory.device_link``)."""
    require_flag("emulate_device", emulate, none="the device tier's link, else tierstore.device.emulate_device")
    return device_link(store.tiers, device, emulate, "swapping")


def host_tier(store: TierStore) -> str | None:
    """The fastest memory tier that is not device memory (where values cross from), if any."""
    for tier in store.tiers:
        if isinstance(tier, MemoryTier) and not isinstance(tier, DeviceTier):
            return tier.name
    return None


async def to_store(store: TierStore, key: str, tensor: torch.Tensor, tier: str, link: Link, marker: Any) -> None:
    """Store device tensor ``tensor`` (contiguous) under ``key`` on ``tier``, crossing ``link``
    after ``marker`` (taken on the thread that produced it).

    A memory tier gets the copy straight into the buffer that becomes the value
    (``store.fill``). The disk tier gets it through one 4096-aligned staging buffer, which the
    disk write reads with no further copy. A device tier, or a link that lends, needs no
    crossing of ours: ``put`` copies (the engine crosses a device tier's link itself)."""
    target = store.tier(tier)
    if link.lends or isinstance(target, DeviceTier):
        await store.put(key, tensor, tier=tier)
        return
    if isinstance(target, MemoryTier):
        async with store.fill(key, tensor.shape, tensor.dtype, tier) as buffer:
            await link.to_host(buffer, tensor, after=marker)
        return
    staging = empty(tuple(tensor.shape), tensor.dtype)
    await link.to_host(staging, tensor, after=marker)
    await store.put(key, staging, tier=tier)


async def to_device(store: TierStore, key: str, device: torch.device, link: Link) -> torch.Tensor:
    """A new tensor on ``device`` with the value of ``key`` (which stays in the store), copied
    over ``link`` from the store's own host buffer (held for the copy; a value on disk is
    brought up to the host tier first), or from a plain read when no host tier has room."""
    info = store.info(key)
    out = torch.empty(tuple(info["shape"]), dtype=info["dtype"], device=device)
    source = host_tier(store)
    if source is not None:
        try:
            async with store.hold(key, source) as buffer:
                await link.to_device(out, buffer)
            return out
        except TierFullError:
            pass
    await link.to_device(out, await store.read(key))
    return out
