"""Requests for room that found nothing to evict are woken one at a time, in the order they
came (``tierstore.room_queue``). Woken all at once at every change, each looked for a victim
and one found it: 1,000 puts in flight into a tier of 256 of them asked the eviction policy for
a victim 19,700 times, 2,000 puts 128,000 times (4 s; 11 s for 4,000)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from policies import LRU
from tierstore import DiskTier, HostTier, TierFullError, TierStore

PATIENCE = 60.0


class CountingLRU(LRU):
    """LRU that counts the calls of ``victim()``."""

    calls = 0

    def victim(self, evictable=None):  # type: ignore[no-untyped-def]
        CountingLRU.calls += 1
        return super().victim(evictable)


async def test_puts_in_flight_ask_for_a_victim_a_few_times_per_eviction(tmp_path: Path) -> None:
    store = TierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "256MiB", durable=False)], eviction=CountingLRU)
    await store.open()
    try:
        puts = 1000  # (16 KiB each: the host tier holds 256)
        CountingLRU.calls = 0
        await asyncio.wait_for(asyncio.gather(*(store.put(f"k{i}", torch.full((4096,), float(i))) for i in range(puts))), PATIENCE)
        assert CountingLRU.calls <= 4 * puts, f"{CountingLRU.calls:,} calls of victim() for {puts:,} puts"
        for i in range(puts):
            assert torch.equal(await store.get(f"k{i}"), torch.full((4096,), float(i)))
    finally:
        await store.aclose()


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_puts_of_many_sizes_in_flight_some_cancelled_all_end_with_nothing_lost(tmp_path: Path, seed: int) -> None:
    """Small requests behind large ones, cancellations at any moment (a wake a cancelled
    request had goes on), gets and deletes meanwhile: every put ends, and every key holds what
    its last put that ended wrote."""
    rng = random.Random(seed)
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "256MiB", durable=False)])
    await store.open()
    try:
        sizes = [rng.choice([256, 4 << 10, 16 << 10, 64 << 10, 256 << 10]) for _ in range(300)]
        values = {f"k{i}": torch.full((n // 4,), float(i)) for i, n in enumerate(sizes)}
        tasks = {key: asyncio.ensure_future(store.put(key, value)) for key, value in values.items()}
        cancelled = set()
        for _ in range(40):
            await asyncio.sleep(rng.random() * 0.002)
            key = rng.choice(list(tasks))
            if not tasks[key].done():
                tasks[key].cancel()
                cancelled.add(key)
        done, pending = await asyncio.wait(tasks.values(), timeout=PATIENCE)
        assert not pending, f"{len(pending)} puts still waiting for room"
        failed = [task.exception() for task in done if not task.cancelled() and task.exception() is not None]
        assert not failed, failed[:3]
        for key, value in values.items():
            if key in cancelled and key not in store:
                continue  # (cancelled before it wrote)
            assert torch.equal(await store.get(key), value), key
        more = [asyncio.ensure_future(store.put(f"again{i}", torch.ones(16 << 8))) for i in range(64)]
        await asyncio.wait_for(asyncio.gather(*more), PATIENCE)  # (usable after it all)
    finally:
        await store.aclose()


async def test_a_request_that_cannot_get_room_still_fails_at_once_among_waiting_ones(tmp_path: Path) -> None:
    """Every value on the tier held and nothing on its way: the request fails as full (queued
    requests never hid that)."""
    store = TierStore([HostTier("256KiB"), DiskTier(tmp_path / "d", "64MiB")])
    await store.open()
    try:
        for i in range(4):
            await store.put(f"held{i}", torch.zeros(16 << 10))
        async with store.hold("held0"), store.hold("held1"), store.hold("held2"), store.hold("held3"):
            with pytest.raises(TierFullError):
                await asyncio.wait_for(store.put("new", torch.zeros(16 << 10), "host"), PATIENCE)
        await store.put("new", torch.ones(16 << 10), "host")
        assert torch.equal(await store.get("new"), torch.ones(16 << 10))
    finally:
        await store.aclose()
