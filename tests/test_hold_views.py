"""A hold yields the store's buffer viewed as the value; the view is kept with the buffer, so
holding a resident value again makes none (``Copy.typed``). What a holder does to the view it
got, and what the store does to the value, never shows through a kept view."""

from __future__ import annotations

import asyncio

import torch

from tierstore import HostTier, TierStore


def test_a_view_changed_in_place_by_a_holder_is_made_again() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.arange(12.0).view(3, 4))
            async with store.hold("k") as held:
                held.t_()  # (the holder's view only)
            async with store.hold("k") as held:
                assert held.shape == (3, 4)
                held.unsqueeze_(0)
            async with store.hold("k") as held:
                assert held.shape == (3, 4)
                assert torch.equal(held, torch.arange(12.0).view(3, 4))

    asyncio.run(main())


def test_a_hold_after_a_put_of_another_shape_sees_the_new_value() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.zeros(4, 4))
            async with store.hold("k") as held:
                assert held.shape == (4, 4)
            await store.put("k", torch.ones(2, 8, dtype=torch.float64))
            async with store.hold("k", write=True) as held:
                assert held.shape == (2, 8) and held.dtype == torch.float64
                held.mul_(3)
            async with store.hold("k") as held:
                assert torch.equal(held, torch.full((2, 8), 3.0, dtype=torch.float64))

    asyncio.run(main())


def test_writes_through_a_kept_view_are_the_value() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.zeros(1000))
            for n in range(3):
                async with store.hold("k", write=True) as held:
                    held.add_(1)
            assert torch.equal(await store.get("k"), torch.full((1000,), 3.0))

    asyncio.run(main())
