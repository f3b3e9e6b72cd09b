"""Eviction cascades, holds, capacity limits and reopening, on tiny tiers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, EntryHeldError, HostTier, TierFullError, TierStore
from tierstore.testing import check_consistency, watch_capacity
from tierstore.tiers import MemoryTier

KiB = 1024


def three_tiers(tmp_path: Path, device: str = "40KiB", host: str = "80KiB", disk: str = "8MiB") -> list:
    return [DeviceTier("cpu", device), HostTier(host), DiskTier(tmp_path / "disk", disk, chunk_size="16KiB")]


async def test_eviction_cascades_through_three_tiers(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        breaches = watch_capacity(store)
        values = {f"v{i}": torch.full((2048,), float(i)) for i in range(40)}  # 8 KiB each
        for key, value in values.items():
            await store.put(key, value)
            check_consistency(store)
        where = {key: store.where(key)[0] for key in values}
        assert {"device", "host", "disk"} <= set(where.values())
        for key, value in reversed(values.items()):
            assert torch.equal(await store.get(key), value)
            check_consistency(store)
        assert not breaches
        stats = store.stats()
        assert stats["tiers"]["device"]["evictions"] > 0 and stats["tiers"]["host"]["writebacks"] > 0
        assert stats["links"]["host->disk"]["nbytes"] > 0 and stats["links"]["disk->device"]["nbytes"] > 0


async def test_clean_copies_are_dropped_not_written_again(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        for i in range(30):
            await store.put(f"v{i}", torch.full((2048,), float(i)))
        await store.flush()  # now every value is on disk, and every memory copy is clean
        written = sum(link["nbytes"] for name, link in store.stats()["links"].items() if name.endswith("->disk"))
        for _ in range(3):  # reading brings clean copies up; evicting them must not rewrite disk
            for i in range(30):
                await store.get(f"v{i}")
        assert sum(link["nbytes"] for name, link in store.stats()["links"].items() if name.endswith("->disk")) == written


async def test_held_entries_are_never_evicted(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        await store.put("held", torch.full((2048,), -1.0))
        async with store.hold("held", "device") as buffer:
            pointer = buffer.data_ptr()
            for i in range(30):
                await store.put(f"v{i}", torch.full((2048,), float(i)))
                assert store.where("held")[0] == "device"
            assert buffer.data_ptr() == pointer and bool((buffer == -1).all())
        with pytest.raises(EntryHeldError):
            async with store.hold("held", "host"):
                await store.delete("held")
        check_consistency(store)


async def test_full_of_held_entries_fails_fast(tmp_path: Path) -> None:
    async with TierStore([DeviceTier("cpu", "40KiB"), HostTier("1MiB")]) as store:
        await store.put("a", torch.zeros(4096))  # 16 KiB each: with "c", 48 KiB > 40 KiB
        await store.put("b", torch.zeros(4096))
        async with store.hold("a"), store.hold("b"):
            with pytest.raises(TierFullError, match="held"):
                await asyncio.wait_for(store.put("c", torch.zeros(4096), tier="device"), timeout=5)
            assert sorted(store.keys()) == ["a", "b"]
            check_consistency_when_released = store.where("a") == ["device"]
        assert check_consistency_when_released
        await store.put("c", torch.zeros(4096), tier="device")  # released: eviction makes room
        assert store.where("c") == ["device"] and sorted(store.keys()) == ["a", "b", "c"]
        check_consistency(store)


async def test_last_tier_full_is_an_error_not_an_eviction(tmp_path: Path) -> None:
    async with TierStore([HostTier("40KiB")]) as store:
        await store.put("a", torch.zeros(4096))
        await store.put("b", torch.zeros(4096))
        with pytest.raises(TierFullError):
            await store.put("c", torch.zeros(4096))
        await store.delete("a")
        await store.put("c", torch.zeros(4096))
        assert sorted(store.keys()) == ["b", "c"]


async def test_put_larger_than_every_tier(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path, disk="64KiB")) as store:
        await store.put("small", torch.ones(10))
        with pytest.raises(TierFullError):
            await store.put("huge", torch.zeros(1 << 20))
        assert store.keys() == ["small"]
        check_consistency(store)


async def test_held_put_falls_through_to_a_slower_tier(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        await store.put("a", torch.zeros(4096))
        await store.put("b", torch.zeros(4096))
        async with store.hold("a", "device"), store.hold("b", "device"):
            await store.put("c", torch.ones(4096))
            assert store.where("c") == ["host"]


async def test_delete_returns_every_byte(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        for i in range(30):
            await store.put(f"v{i}", torch.full((2048,), float(i)))
        for i in range(30):
            await store.delete(f"v{i}")
        assert [tier.used if not isinstance(tier, MemoryTier) else tier.live_bytes for tier in store.tiers] == [0, 0, 0]
        check_consistency(store)


async def test_reopen_brings_back_every_entry(tmp_path: Path) -> None:
    values = {f"layer.{i}/exp_avg": torch.randn(1000 + i) for i in range(20)}
    async with TierStore(three_tiers(tmp_path)) as store:
        for key, value in values.items():
            await store.put(key, value)
        async with store.hold("layer.0/exp_avg", write=True) as buffer:
            buffer.fill_(42.0)  # newest value only in memory: close flushes it
        await store.delete("layer.19/exp_avg")
    values["layer.0/exp_avg"] = torch.full((1000,), 42.0)
    del values["layer.19/exp_avg"]
    async with TierStore(three_tiers(tmp_path)) as store:
        assert sorted(store.keys()) == sorted(values)
        for key, value in values.items():
            assert store.where(key) == ["disk"]
            assert torch.equal(await store.get(key), value)
        check_consistency(store)


async def test_close_without_flush_keeps_the_last_durable_value(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        await store.put("k", torch.zeros(4), tier="disk")
        await store.put("k", torch.ones(4))  # lands on the device tier
        await store.aclose(flush=False)
    async with TierStore(three_tiers(tmp_path)) as store:
        assert torch.equal(await store.get("k"), torch.zeros(4))


async def test_get_from_a_full_tier_reads_uncached(tmp_path: Path) -> None:
    async with TierStore(three_tiers(tmp_path)) as store:
        await store.put("far", torch.arange(4096.0), tier="disk")
        await store.put("a", torch.zeros(4096))
        await store.put("b", torch.zeros(4096))
        async with store.hold("a", "device"), store.hold("b", "device"):
            got = await store.get("far", "device")
            assert torch.equal(got, torch.arange(4096.0))
            assert store.where("far") == ["disk"]
