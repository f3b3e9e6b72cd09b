"""A device buffer whose last kernel may still run is given back to its tier later, when the
kernel is done; eviction counts that room as coming back (no spurious TierFullError, no
needless eviction) and waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
from kernel_link import KernelLink

from tierstore import DeviceTier, HostTier, TierFullError, TierStore

VALUE = 64 * 1024  # one page-aligned buffer each: no packing


@asynccontextmanager
async def two_value_device() -> AsyncIterator[tuple[TierStore, KernelLink]]:
    """A store whose device tier holds two values, behind a ``KernelLink``."""
    device = DeviceTier("cpu", 2 * VALUE, emulate_device=True)
    store = TierStore([device, HostTier("1MiB")])
    await store.open()
    link = device.link = KernelLink()
    try:
        yield store, link
    finally:
        link.finish()
        await store.aclose()
        link.close()


def value(n: int) -> torch.Tensor:
    return torch.full((VALUE // 4,), float(n))


async def retired_while_a_kernel_runs(store: TierStore, key: str) -> None:
    """``key`` held on the device (a kernel reads it, still running), then deleted: its buffer
    comes back to the tier only when that kernel is done."""
    link = store.tier("device").link
    async with store.hold(key, "device"):
        link.launching = True
    link.launching = False
    await store.delete(key)


async def until_stuck(task: asyncio.Task[Any]) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    assert not task.done(), "the put did not wait for the room a kernel still uses"


def test_a_put_waits_for_a_buffer_that_comes_back_when_its_kernel_ends() -> None:
    async def main() -> None:
        async with two_value_device() as (store, link):
            await store.put("a", value(1), tier="device")
            await store.put("held", value(2), tier="device")
            await retired_while_a_kernel_runs(store, "a")
            async with store.hold("held", "device"):  # nothing to evict: only a's room comes back
                put = asyncio.ensure_future(store.put("b", value(3), tier="device"))
                await until_stuck(put)
                link.finish()
                await put  # (was: TierFullError, 0 B free, with a's buffer about to come back)
            assert store.where("b") == ["device"]
            assert torch.equal(await store.get("b"), value(3))

    asyncio.run(main())


def test_room_coming_back_is_not_made_again_by_evicting_another_value() -> None:
    async def main() -> None:
        async with two_value_device() as (store, link):
            await store.put("a", value(1), tier="device")
            await store.put("kept", value(2), tier="device")
            await retired_while_a_kernel_runs(store, "a")
            put = asyncio.ensure_future(store.put("b", value(3), tier="device"))
            await until_stuck(put)
            link.finish()
            await put
            assert store.where("kept") == ["device"]  # (was: evicted to the host for a's room)
            assert store.stats()["tiers"]["device"]["evictions"] == 0

    asyncio.run(main())


def test_with_no_kernel_running_a_full_tier_still_refuses_at_once() -> None:
    async def main() -> None:
        async with two_value_device() as (store, link):
            link.finish()
            await store.put("a", value(1), tier="device")
            await store.put("b", value(2), tier="device")
            async with store.hold("a", "device"), store.hold("b", "device"):
                with pytest.raises(TierFullError, match="0 B free, 128.0 KiB held"):
                    await store.put("c", value(3), tier="device")

    asyncio.run(main())
