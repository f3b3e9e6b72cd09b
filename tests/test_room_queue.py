"""Requests for room that found nothing to evict are woken one at a time, in the order they
came (``tierstore.room_queue``). Woken all at once at every change, each looked for a victim
and one found it: 1,000 puts in flight into a tier of 256 of them asked the eviction policy for
a victim 19,700 times, 2,000 puts 128,000 times (4 s; 11 s for 4,000). A review of the first
version found three ways a request was left waiting that the herd had woken (the last three
tests)."""

from __future__ import annotations

import asyncio
import contextlib
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


@pytest.mark.parametrize("below", ["disk", "memory"])
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_puts_of_many_sizes_in_flight_some_cancelled_all_end_with_nothing_lost(tmp_path: Path, seed: int, below: str) -> None:
    """Small requests behind large ones, cancellations at any moment (a wake a cancelled
    request had goes on), over the disk or a slower memory tier (requests there count on the
    room on its way, and wait in the other line): every put ends, and every key holds what it
    was given."""
    rng = random.Random(seed)
    slower = [HostTier("64MiB", name="slow")] if below == "memory" else []
    store = TierStore([HostTier("1MiB"), *slower, DiskTier(tmp_path / "d", "256MiB", durable=False)])
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


class PinningLRU(LRU):
    """LRU that never names a key under "pin/" as a victim (those stay on the tier)."""

    def victim(self, evictable=None):  # type: ignore[no-untyped-def]
        key = next((k for k in self._order if not k.startswith("pin/") and (evictable is None or evictable(k))), None)
        if key is not None:
            del self._order[key]
        return key


class GatedDisk(DiskTier):
    """A disk tier whose writes wait while ``gate`` is clear (a slow disk, made controllable)."""

    gate: asyncio.Event | None = None

    async def write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.gate is not None:
            await self.gate.wait()
        return await super().write(*args, **kwargs)

    async def write_committed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.gate is not None:
            await self.gate.wait()
        return await super().write_committed(*args, **kwargs)


async def test_a_request_that_fails_as_full_wakes_those_that_would_fail_too(tmp_path: Path) -> None:
    """Two puts wait on a fill, every other value held; the fill is aborted. The first, woken,
    found nothing to wait for and failed as full; the second was never woken."""
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)])
    await store.open()
    try:
        for i in range(15):
            await store.put(f"held{i}", torch.zeros(16 << 10), "host")  # 64 KiB each
        async with contextlib.AsyncExitStack() as stack:
            for i in range(15):
                await stack.enter_async_context(store.hold(f"held{i}", "host"))
            with contextlib.suppress(RuntimeError):
                async with store.fill("f", (4 << 10,), torch.float32, "host"):  # room on its way
                    puts = [asyncio.ensure_future(store.put(f"p{i}", torch.ones(32 << 10), "host")) for i in range(2)]
                    await asyncio.sleep(0.2)
                    assert not any(put.done() for put in puts)
                    raise RuntimeError("the fill is abandoned")
            done, pending = await asyncio.wait(puts, timeout=PATIENCE / 4)
            for put in pending:
                put.cancel()
            assert not pending, f"{len(pending)} of 2 puts left waiting"
            assert all(isinstance(put.exception(), TierFullError) for put in done)
    finally:
        await asyncio.wait_for(store.aclose(), PATIENCE)


async def test_a_small_value_is_woken_when_a_slot_of_its_size_frees(tmp_path: Path) -> None:
    """A put of 256 B queued needing a new slab; a delete frees a slot of its size (it needs no
    room now). The request woken at the next change found no victim and passed the wake to one
    whose value fitted by the size it had when queued: not this one, left waiting for ever."""
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)], eviction=PinningLRU)
    await store.open()
    try:
        for i in range(16):  # (256 B each: one full slab)
            await store.put(f"pin/s{i}", torch.full((64,), float(i)), "host")
        for i in range(15):
            await store.put(f"pin/big{i}", torch.zeros(16 << 10), "host")
        await store.put("pin/rest", torch.zeros(14 << 10), "host")
        async with store.fill("pin/f", (1024,), torch.float32, "host"):  # room on its way
            big = asyncio.ensure_future(store.put("big", torch.ones(16 << 10), "host"))
            await asyncio.sleep(0.05)
            small = asyncio.ensure_future(store.put("small", torch.ones(64), "host"))
            await asyncio.sleep(0.1)
            assert not big.done() and not small.done()
            await store.delete("pin/s0")
        done, pending = await asyncio.wait([small], timeout=PATIENCE / 4)
        for put in (big, small):
            put.cancel()
        await asyncio.gather(big, small, return_exceptions=True)
        assert not pending, "the small put was left waiting with a slot free for it"
        assert torch.equal(await store.get("small"), torch.ones(64))
    finally:
        await asyncio.wait_for(store.aclose(), PATIENCE)


async def test_requests_counting_on_room_under_way_do_not_keep_others_waiting(tmp_path: Path) -> None:
    """Two small puts count on a write-back under way (they need new slabs: they count all of
    it) and a large one waits for a victim. Queued together, the two woke each other without
    end (188,000 times in 3 s, the loop busy) and the large put was never woken when a hold
    ended and gave it its victim; where the write-back could end only after it, never."""
    disk = GatedDisk(tmp_path / "d", "256MiB", durable=False)
    store = TierStore([HostTier("12MiB"), disk])
    await store.open()
    try:
        await store.put("E", torch.zeros(1 << 20), "disk")
        await store.put("D", torch.zeros(2 << 20), "host")  # (only on the host: its eviction writes it back)
        await store.get("E", "host")  # (clean on the host: dropped at once when evicted)
        disk.gate = asyncio.Event()
        async with store.hold("E", "host"):
            x = asyncio.ensure_future(store.put("X", torch.ones(2 << 20), "host"))  # evicts D: a write that waits
            await asyncio.sleep(0.05)
            a = asyncio.ensure_future(store.put("a", torch.ones(64), "host"))
            b = asyncio.ensure_future(store.put("b", torch.ones(128), "host"))
            await asyncio.sleep(0.05)
            c = asyncio.ensure_future(store.put("C", torch.ones(1 << 20), "host"))  # E held: nothing to evict
            await asyncio.sleep(0.05)
            assert not any(put.done() for put in (x, a, b, c))
            c.add_done_callback(lambda _: disk.gate.set())  # (the write-back ends only once C is stored)
        puts = [x, a, b, c]
        done, pending = await asyncio.wait(puts, timeout=PATIENCE / 4)
        for put in pending:
            put.cancel()
        await asyncio.gather(*puts, return_exceptions=True)
        assert not pending, f"{len(pending)} of 4 puts left waiting"
        assert torch.equal(await store.get("C"), torch.ones(1 << 20))
    finally:
        if disk.gate is not None:
            disk.gate.set()
        await asyncio.wait_for(store.aclose(), PATIENCE)


class CountingHostTier(HostTier):
    """A host tier that counts the calls of ``allocation_size`` (the room a value needs now)."""

    calls = 0

    def allocation_size(self, nbytes: int) -> int:
        CountingHostTier.calls += 1
        return super().allocation_size(nbytes)


@pytest.mark.parametrize("base", [300, 16 << 10])
async def test_puts_of_distinct_sizes_in_flight_are_not_each_asked_at_every_wake(tmp_path: Path, base: int) -> None:
    """A woken request that found nothing passes its wake to one whose value fits the free
    room: it asked that of every size waiting (2,000 puts of distinct sizes: 2.9 million
    checks; 26 s for 4,000, where one size took 1.7 s). The first of each slab class, and the
    smallest value with a buffer of its own, are asked now."""
    store = TierStore([CountingHostTier("256KiB" if base < 4096 else "4MiB"), DiskTier(tmp_path / "d", "1GiB", durable=False)])
    await store.open()
    try:
        puts = 2000
        values = [torch.full((base + i,), i % 251, dtype=torch.uint8) for i in range(puts)]
        CountingHostTier.calls = 0
        await asyncio.wait_for(asyncio.gather(*(store.put(f"k{i}", value) for i, value in enumerate(values))), PATIENCE)
        assert CountingHostTier.calls <= 100 * puts, f"{CountingHostTier.calls:,} checks of the room a value needs for {puts:,} puts"
        for i in range(0, puts, 97):
            assert torch.equal(await store.get(f"k{i}"), values[i])
    finally:
        await store.aclose()
