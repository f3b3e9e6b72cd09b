"""Prefetch, demand-before-prefetch ordering, and cancellation leaving the store consistent."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier, TierStore
from tierstore.testing import check_consistency, settle
from tierstore.workers import Priority, WorkerPool


def tiers(tmp_path: Path) -> list:
    return [DeviceTier("cpu", "1MiB"), HostTier("2MiB"), DiskTier(tmp_path / "disk", "64MiB", chunk_size="16KiB")]


async def fill_disk(store: TierStore, count: int, numel: int = 16384) -> dict[str, torch.Tensor]:
    values = {f"k{i}": torch.full((numel,), float(i)) for i in range(count)}
    for key, value in values.items():
        await store.put(key, value, tier="disk")
    return values


async def test_prefetch_brings_keys_up_and_gets_then_hit(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        values = await fill_disk(store, 8)
        handle = await store.prefetch(list(values), "device")
        result = await handle
        assert sorted(result.fetched) == sorted(values) and not result.dropped and not result.failed
        for key, value in values.items():
            assert store.where(key)[0] == "device"
            assert torch.equal(await store.get(key), value)
        stats = store.stats()
        assert stats["tiers"]["device"]["hits"] == 8 and stats["tiers"]["device"]["misses"] == 0
        assert stats["prefetch"]["useful"] == 8
        check_consistency(store)


async def test_a_key_named_twice_is_fetched_and_reported_once(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        values = await fill_disk(store, 2)
        result = await (await store.prefetch(["k0", "k0", "k1", "k0"], "host"))
        assert result.fetched == ["k0", "k1"] and result.already_there == []
        assert store.stats()["links"]["disk->host"]["transfers"] == 2
        assert torch.equal(await store.get("k0"), values["k0"])


async def test_prefetch_more_than_fits_drops_or_evicts_but_stays_within_capacity(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        values = await fill_disk(store, 40)  # 64 KiB each: 40 do not fit in 1 MiB
        result = await (await store.prefetch(list(values), "device"))
        assert len(result.fetched) + len(result.dropped) == 40
        assert store.tiers[0].used <= store.tiers[0].capacity
        for key, value in values.items():
            assert torch.equal(await store.get(key, "host"), value)
        check_consistency(store)


async def test_cancelled_prefetch_leaves_store_consistent(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        values = await fill_disk(store, 24)
        for delay in (0, 0.0005, 0.002, 0.01):
            handle = await store.prefetch(list(values), "device")
            await asyncio.sleep(delay)
            handle.cancel()
            result = await handle
            assert result.cancelled or len(result.fetched) + len(result.already_there) + len(result.dropped) == 24
            await settle(store)
            check_consistency(store)
        for key, value in values.items():
            assert torch.equal(await store.get(key), value)
        check_consistency(store)


async def test_cancelled_gets_and_puts_leave_store_consistent(tmp_path: Path) -> None:
    rng = random.Random(7)
    async with TierStore(tiers(tmp_path)) as store:
        values = await fill_disk(store, 16)
        for _ in range(6):
            tasks = []
            for key in values:
                if rng.random() < 0.3:
                    values[key] = torch.full((16384,), float(rng.randrange(1000)))
                    tasks.append(asyncio.ensure_future(store.put(key, values[key])))
                else:
                    tasks.append(asyncio.ensure_future(store.get(key, rng.choice(["device", "host"]))))
            await asyncio.sleep(rng.choice([0, 0.0002, 0.001, 0.003]))
            cancelled = [t for t in tasks if rng.random() < 0.5 and t.cancel()]
            await asyncio.gather(*tasks, return_exceptions=True)
            await settle(store)
            check_consistency(store)
            # A cancelled put may or may not have landed: read back what is there and adopt it.
            for key in values:
                got = await store.get(key)
                assert bool((got == got[0]).all())
                values[key] = got
            del cancelled
        check_consistency(store)


async def test_demand_jobs_overtake_queued_prefetch_jobs() -> None:
    pool = WorkerPool(1, "test")
    pool.start()
    try:
        gate = threading.Event()
        order: list[str] = []
        blocker = asyncio.ensure_future(pool.run(gate.wait, Priority.DEMAND))
        await asyncio.sleep(0.05)  # the only thread is now busy
        prefetches = [asyncio.ensure_future(pool.run(lambda i=i: order.append(f"prefetch{i}"), Priority.PREFETCH)) for i in range(3)]
        await asyncio.sleep(0)
        demand = asyncio.ensure_future(pool.run(lambda: order.append("demand"), Priority.DEMAND))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(blocker, demand, *prefetches)
        assert order == ["demand", "prefetch0", "prefetch1", "prefetch2"]
    finally:
        pool.shutdown()


async def test_cancelled_job_that_has_not_started_is_skipped() -> None:
    pool = WorkerPool(1, "test")
    pool.start()
    try:
        gate = threading.Event()
        ran: list[int] = []
        blocker = asyncio.ensure_future(pool.run(gate.wait))
        await asyncio.sleep(0.05)
        job = asyncio.ensure_future(pool.run(lambda: ran.append(1)))
        await asyncio.sleep(0.01)
        job.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await job
        await blocker
        await pool.run(lambda: None)  # the queue has been served past the skipped job
        assert ran == []
    finally:
        pool.shutdown()


async def test_a_job_error_reaches_the_caller() -> None:
    pool = WorkerPool(2, "test")
    pool.start()
    try:
        with pytest.raises(ZeroDivisionError):
            await pool.run_all([lambda: 1, lambda: 1 // 0])
    finally:
        pool.shutdown()


@pytest.mark.parametrize("verb", ["delete", "pop"])
@pytest.mark.parametrize("where", ["disk", "host"])
async def test_a_cancelled_delete_or_pop_is_settled_when_the_caller_gets_control_back(tmp_path: Path, verb: str, where: str) -> None:
    """A tryout: right after a cancelled delete of a value on disk, ``k in store`` was True and
    ``get`` returned the value (or raised "was deleted"), and the key vanished a moment later.
    Now the caller's ``CancelledError`` comes once the deletion is over: whatever it sees next
    stays so."""
    for attempt in range(5):
        async with TierStore(tiers(tmp_path)) as store:
            await store.put("k", torch.ones(5000), where)
            await store.put("other", torch.zeros(10))
            task = asyncio.ensure_future(getattr(store, verb)("k"))
            for _ in range(attempt):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
                cancelled = False
            except asyncio.CancelledError:
                cancelled = True
            present, listed = "k" in store, "k" in store.keys()
            value = await store.get("k") if present else None
            await asyncio.sleep(0.1)
            assert ("k" in store) == present == listed, (attempt, cancelled)
            assert not cancelled or value is None or torch.equal(value, torch.ones(5000))
            assert torch.equal(await store.get("other"), torch.zeros(10))
            check_consistency(store)
