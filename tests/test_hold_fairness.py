"""A task taking one write hold after another does not starve a reader of the same key: the
reader, woken when a hold ends, found the next hold taken each time it ran."""

from __future__ import annotations

import asyncio

import pytest
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


async def test_write_holds_asked_one_after_another_are_served_in_that_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Three write holds of one key asked in the order W0, W1, W2 were served W0, W2, W1: a
    task woken for nothing (a use of the key ended) waited again behind those that came after
    it, and one woken by the hold that ended let the others woken with it go first (a tryout).
    The value on the host, on the disk (the later ones wait for the first one's load), or being
    prefetched."""
    from tierstore import DiskTier

    numel = 16 << 10
    for setup in ("on the host", "on the disk", "prefetched"):
        async with TierStore([HostTier(4 * 4 * numel), DiskTier(tmp_path / setup.replace(" ", "_"), "16MiB")]) as store:
            for index, name in enumerate("abcdef"):
                await store.put(name, torch.full((numel,), 0.0 if name == "a" else float(index)))
            if setup == "on the host":
                await store.get("a", "host")
                assert "host" in store.where("a")
            else:
                assert "host" not in store.where("a")
            if setup == "prefetched":
                await store.prefetch(["a"], "host")
                for _ in range(3):
                    await asyncio.sleep(0)
            served: list[tuple[int, float]] = []

            async def writer(index: int, served: list[tuple[int, float]] = served) -> None:
                async with store.hold("a", "host", write=True) as held:
                    served.append((index, float(held[0])))
                    held.add_(1)
                    await asyncio.sleep(0.005)

            tasks = []
            for index in range(4):
                tasks.append(asyncio.ensure_future(writer(index)))
                await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            assert served == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)], (setup, served)


async def test_a_hold_too_large_for_its_tier_says_which_key_and_hold(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A hold refused as too large named neither the key nor the hold ("2.0 MiB is more than
    tier 'host' holds (1.0 MiB)"), where a step holds many keys; the value stays readable."""
    from tierstore import DiskTier, TierFullError

    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "64MiB")]) as store:
        await store.put("big", torch.ones(512 * 1024), "disk")
        for write in (False, True):
            kind = "write hold" if write else "hold"
            with pytest.raises(TierFullError, match=rf"^no {kind} of 'big' on tier 'host': 2\.0 MiB is more than tier 'host' holds \(1\.0 MiB\)$"):
                async with store.hold("big", "host", write=write):
                    pass
        assert torch.equal(await store.get("big"), torch.ones(512 * 1024))
