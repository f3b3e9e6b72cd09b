"""A task taking one write hold after another does not starve a reader of the same key: the
reader, woken when a hold ends, found the next hold taken each time it ran."""

from __future__ import annotations

import asyncio

import torch

from tierstore import DeviceTier, HostTier, TierStore


async def test_a_reader_gets_through_a_task_taking_write_holds_back_to_back() -> None:
    async with TierStore([DeviceTier("cpu", "1MiB"), HostTier("4MiB")]) as store:
        await store.put("k", torch.ones(1000), tier="host")
        stop, rounds = False, 0

        async def writer() -> None:
            nonlocal rounds
            while not stop:
                async with store.hold("k", "host", write=True) as held:
                    held.add_(1)
                    rounds += 1
                    await asyncio.sleep(0.001)

        task = asyncio.create_task(writer())
        await asyncio.sleep(0.01)
        try:
            value = await asyncio.wait_for(store.get("k", "device"), 5)
            before = rounds
        finally:
            stop = True
            await task
        assert before < 100, f"the reader waited {before} write holds"
        assert torch.equal(value, torch.full((1000,), float(value[0]))) and value[0] > 1
