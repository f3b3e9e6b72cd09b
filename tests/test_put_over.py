"""A put over a value that fills its memory tier is copied over it (``tierstore.overwrite``):
the old value is not written down the tiers to make room for its own replacement."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from kernel_link import KernelLink

from tierstore import (
    DeviceTier,
    DiskTier,
    HostTier,
    InvalidTensorError,
    KeyNotFoundError,
    SyncTierStore,
    TierFullError,
    TierStore,
)
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes

MiB = 1 << 20


def moved(store: TierStore | SyncTierStore, link: str) -> int:
    return store.stats()["links"].get(link, {}).get("nbytes", 0)


@pytest.mark.parametrize("top", ["device", "host"])
async def test_a_put_over_a_value_that_fills_its_tier_writes_nothing_below(tmp_path: Path, device_mode: str, top: str) -> None:
    tiers = [DeviceTier("cpu", "1MiB"), HostTier("4MiB")] if top == "device" else [HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]
    below = tiers[1].name
    async with TierStore(tiers) as store:
        for i in range(5):
            await store.put("one", torch.full((MiB // 4,), float(i)), top)
            assert torch.equal(await store.get("one"), torch.full((MiB // 4,), float(i)))
        assert moved(store, f"{top}->{below}") == 0
        assert store.where("one") == [top]
        await store.put("two", torch.ones(MiB // 4), top)  # a different key still evicts it
        assert moved(store, f"{top}->{below}") == MiB
        assert torch.equal(await store.get("one", below), torch.full((MiB // 4,), 4.0))


async def test_small_values_packed_in_a_full_tier_are_put_over_in_place(tmp_path: Path, device_mode: str) -> None:
    async with TierStore([HostTier("64KiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        for i in range(64):
            await store.put(f"k{i}", torch.full((256,), float(i)), "host")  # 1 KiB each: slots of shared slabs
        full = moved(store, "host->disk")
        for round_ in range(3):
            for i in range(64):
                await store.put(f"k{i}", torch.full((256,), float(100 * round_ + i)), "host")
        assert moved(store, "host->disk") == full
        for i in range(64):
            assert torch.equal(await store.get(f"k{i}"), torch.full((256,), float(200 + i)))


async def test_a_value_of_another_shape_dtype_or_size(tmp_path: Path, device_mode: str) -> None:
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("one", torch.zeros(MiB // 4), "host")
        await store.put("one", torch.full((512, 512), 1.0), "host")  # same bytes, another shape: over it
        assert moved(store, "host->disk") == 0
        got = await store.get("one")
        assert got.shape == (512, 512) and torch.equal(got, torch.ones(512, 512))
        await store.put("one", torch.full((MiB // 2,), 2, dtype=torch.int16), "host")  # another dtype
        assert (await store.get("one")).dtype == torch.int16
        await store.put("one", torch.full((MiB // 8,), 3.0), "host")  # smaller: a buffer of its own
        assert torch.equal(await store.get("one"), torch.full((MiB // 8,), 3.0))


async def test_a_held_value_is_not_put_over(tmp_path: Path, device_mode: str) -> None:
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("one", torch.zeros(MiB // 4), "host")
        async with store.hold("one") as held:
            await store.put("one", torch.ones(MiB // 4))  # no room on the host: lands on the disk
            assert torch.equal(held, torch.zeros(MiB // 4))
            assert torch.equal(await store.get("one", "disk"), torch.ones(MiB // 4))
        assert torch.equal(await store.get("one"), torch.ones(MiB // 4))


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 5, 8, 13])
async def test_a_cancelled_put_over_a_value_leaves_the_old_or_the_new_one_whole(tmp_path: Path, device_mode: str, turns: int) -> None:
    numel = 16 * MiB // 4  # 16 MiB: copied on a worker thread
    old, new = torch.zeros(numel), torch.ones(numel)
    async with TierStore([HostTier("16MiB"), DiskTier(tmp_path / "d", "64MiB")]) as store:
        await store.put("big", old, "host")
        put = asyncio.ensure_future(store.put("big", new, "host"))
        read = asyncio.ensure_future(store.get("big"))
        for _ in range(turns):
            await asyncio.sleep(0)
        put.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await put
        new.fill_(7.0)  # the put no longer reads the caller's memory
        for got in (await read, await store.get("big")):
            assert got.min() == got.max() and got[0] in (0.0, 1.0)
        assert moved(store, "host->disk") == 0
        await store.flush()
        assert torch.equal(await store.get("big", "disk"), await store.get("big"))


async def test_a_put_over_a_value_deleted_meanwhile(tmp_path: Path, device_mode: str) -> None:
    numel = 16 * MiB // 4
    async with TierStore([HostTier("16MiB"), DiskTier(tmp_path / "d", "64MiB")]) as store:
        for turns in range(6):
            await store.put("big", torch.zeros(numel), "host")
            put = asyncio.ensure_future(store.put("big", torch.ones(numel), "host"))
            for _ in range(turns):
                await asyncio.sleep(0)
            await store.delete("big")
            await put
            try:
                got = await store.get("big")
            except KeyNotFoundError:
                continue
            assert torch.equal(got, torch.ones(numel))
        await store.put("other", torch.ones(8))
        assert torch.equal(await store.get("other"), torch.ones(8))


async def test_a_full_memory_only_store_takes_a_new_value_of_a_key_it_holds(device_mode: str) -> None:
    """It refused one (``TierFullError``: no room beside the old value, nothing to evict)."""
    async with TierStore([HostTier("1MiB")]) as store:
        await store.put("one", torch.zeros(MiB // 4))
        await store.put("one", torch.ones(MiB // 4))
        with pytest.raises(TierFullError):
            await store.put("two", torch.ones(MiB // 4))
        assert torch.equal(await store.get("one"), torch.ones(MiB // 4))


def test_offloaded_weights_written_back_each_step_go_to_the_disk_only_where_they_do_not_fit(tmp_path: Path, device_mode: str) -> None:
    """Eight 256 KiB weights kept on a host tier with room for five: each step puts eight new
    weights; three must go on to the disk, and no more (the old weights were written to the disk
    to make room for their replacements: 4-7 weights a step)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)])
    weight = 256 * 256 * 4
    with SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier(5 * weight), DiskTier(tmp_path / "d", "64MiB")]) as store:
        params = offload_parameters(model, store, tier="host")
        opt = TieredAdamW(model.parameters(), lr=1e-3, offload="host")
        x = torch.randn(4, 256)
        written = []
        for _ in range(6):
            before = moved(store, "host->disk")
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            params.mark_step()
            written.append(moved(store, "host->disk") - before)
        opt.close()
        params.detach()
    assert max(written[2:]) <= 3 * weight, [w / weight for w in written]


async def test_the_trace_replays_puts_copied_over_fills_and_cancelled_puts(tmp_path: Path, device_mode: str) -> None:
    """A put copied over its value is recorded as such (a put row with ``hit`` 1, also when its
    caller was cancelled once the copy had begun); a ``fill`` is not copied over (its block may
    raise): the replay evicts what the store evicted."""
    from tierstore.sim import load_evictions, replay_store_trace

    path = tmp_path / "t.npz"
    async with TierStore([HostTier("16MiB"), DiskTier(tmp_path / "d", "256MiB")], eviction="lru", trace=path) as store:
        for key in "abcd":
            await store.put(key, torch.zeros(MiB), "host")  # 4 MiB each: full
        await store.put("a", torch.ones(MiB), "host")  # copied over: nothing evicted
        async with store.fill("b", (MiB,), torch.float32, "host") as buffer:  # evicts (LRU: c)
            buffer.fill_(2.0)
        put = asyncio.ensure_future(store.put("d", torch.ones(MiB), "host"))
        for _ in range(3):
            await asyncio.sleep(0)
        put.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await put
        await store.put("e", torch.zeros(MiB), "host")
        await store.put("c", torch.full((MiB,), 3.0), "host")
        assert torch.equal(await store.get("b"), torch.full((MiB,), 2.0))
    live = load_evictions(path)
    assert live
    assert replay_store_trace(path, [16 * MiB], "lru", accounting=[HostTier("16MiB")]).evictions == live


async def test_a_request_for_room_meanwhile_waits_for_the_copy(tmp_path: Path, device_mode: str) -> None:
    async with TierStore([HostTier("8MiB"), DiskTier(tmp_path / "d", "256MiB")]) as store:
        await store.put("k", torch.zeros(2 * MiB), "host")  # 8 MiB: the host is full
        await store.put("l", torch.zeros(2 * MiB), "disk")
        put = asyncio.ensure_future(store.put("k", torch.ones(2 * MiB), "host"))
        await asyncio.sleep(0)
        await store.put("l", torch.ones(2 * MiB), "host")  # k is evicted once its copy ends
        await put
        assert store.where("l") == ["host"]
        assert torch.equal(await store.get("k"), torch.ones(2 * MiB))
        assert torch.equal(await store.get("l"), torch.ones(2 * MiB))


@pytest.mark.parametrize("layout", ["host", "host+disk"])
async def test_a_put_racing_a_read_of_its_key_waits_for_the_read_then_copies_over(tmp_path: Path, device_mode: str, layout: str) -> None:
    """It evicted the value being read instead (64 MiB written to the disk), or was refused on a
    memory-only store ("0 B free, 0 B held")."""
    numel = 16 * MiB  # float32: 64 MiB, copied on a worker thread
    tiers = [HostTier("64MiB")] + ([DiskTier(tmp_path / "d", "1GiB")] if layout == "host+disk" else [])
    async with TierStore(tiers) as store:
        await store.put("k", torch.zeros(numel))
        for i in range(1, 4):
            read = asyncio.ensure_future(store.get("k"))
            await asyncio.sleep(0)
            await store.put("k", torch.full((numel,), float(i)))
            got = await read
            assert got.min() == got.max() and got[0] in (0.0, i - 1.0)
            assert torch.equal(await store.get("k"), torch.full((numel,), float(i)))
        assert moved(store, "host->disk") == 0


async def test_a_put_refused_for_room_says_when_the_keys_own_value_fills_the_tier(device_mode: str) -> None:
    async with TierStore([HostTier("1MiB")]) as store:
        await store.put("k", torch.zeros(MiB // 4))
        with pytest.raises(TierFullError, match=r"1.0 MiB of it hold the value 'k' has now: a value of another size .*delete the key first"):
            await store.put("k", torch.zeros(MiB // 8))
        async with store.hold("k"):
            with pytest.raises(TierFullError, match=r"the value 'k' has now, held now: .*release the hold first"):
                await store.put("k", torch.ones(MiB // 4))
        with pytest.raises(TierFullError, match=r"a fill gets room .*delete the key first, or write into its buffer under hold"):
            async with store.fill("k", (MiB // 4,), torch.float32) as buffer:
                buffer.fill_(1.0)
        assert torch.equal(await store.get("k"), torch.zeros(MiB // 4))
        await store.delete("k")
        await store.put("k", torch.zeros(MiB // 8))
    async with TierStore([HostTier("1MiB")]) as store:
        await store.put("a", torch.zeros(MiB // 8))
        await store.put("b", torch.zeros(MiB // 8))
        with pytest.raises(TierFullError) as refused:
            await store.put("a", torch.zeros(MiB // 4))  # deleting "a" would not make room
        assert "has now" not in str(refused.value)


async def test_a_buffer_a_kernel_may_still_read_is_not_copied_over(device_mode: str) -> None:
    """A device buffer whose holder's kernels have not ended (its ``last_use`` marker pending,
    as a CUDA event after a slow kernel) is not written over: the put waits for room instead."""
    value = 64 * 1024
    device = DeviceTier("cpu", value, emulate_device=True)  # room for one value
    store = TierStore([device, HostTier("1MiB")])
    await store.open()
    link = device.link = KernelLink()
    try:
        await store.put("k", torch.zeros(value // 4), tier="device")
        async with store.hold("k", "device") as held:
            link.launching = True  # a "kernel" reading the held buffer, running past the release
            read_by_kernel = held
        link.launching = False
        put = asyncio.ensure_future(store.put("k", torch.ones(value // 4), tier="device"))
        await asyncio.sleep(0.05)
        assert torch.equal(read_by_kernel, torch.zeros(value // 4))
        link.finish()
        await asyncio.wait_for(put, 30)
        assert torch.equal(await store.get("k"), torch.ones(value // 4))
    finally:
        link.finish()
        await store.aclose()
        link.close()


@pytest.mark.parametrize("layout", ["host", "host+disk"])
async def test_a_put_behind_a_loop_of_reads_of_its_key_ends(tmp_path: Path, device_mode: str, layout: str) -> None:
    """It waits for the reads under way when it comes, not for those that start meanwhile."""
    numel = 16 * MiB
    tiers = [HostTier("64MiB")] + ([DiskTier(tmp_path / "d", "1GiB")] if layout == "host+disk" else [])
    async with TierStore(tiers) as store:
        await store.put("k", torch.zeros(numel))
        stop = asyncio.Event()

        async def read_in_a_loop() -> None:
            while not stop.is_set():
                got = await store.get("k")
                assert got.min() == got.max()

        readers = [asyncio.ensure_future(read_in_a_loop()) for _ in range(2)]
        await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(store.put("k", torch.ones(numel)), 60)
        finally:
            stop.set()
            await asyncio.gather(*readers)
        assert torch.equal(await store.get("k"), torch.ones(numel))
        assert moved(store, "host->disk") == 0


@pytest.mark.parametrize("layout", ["host", "host+disk"])
@pytest.mark.parametrize(("before", "after"), [(1, 1), (3, 3), (0, 3)])
async def test_gets_issued_around_a_put_over_a_full_tier_wait_for_it(tmp_path: Path, device_mode: str, layout: str,
                                                                     before: int, after: int) -> None:
    """Gets issued after the put started reading while it waited for those before it, so the
    copy was still in use: the put was refused on a memory-only store ("... a value of another
    size gets room beside the old one", of a value of the same size) or wrote the old value to
    the disk to make room beside it (a tryout)."""
    numel = 2_000_000
    tiers = [HostTier("8MiB")] + ([DiskTier(tmp_path / "d", "64MiB")] if layout == "host+disk" else [])
    async with TierStore(tiers) as store:
        await store.put("k", torch.zeros(numel))
        for i in range(1, 4):
            gets = [asyncio.ensure_future(store.get("k")) for _ in range(before)]
            put = asyncio.ensure_future(store.put("k", torch.full((numel,), float(i))))
            gets += [asyncio.ensure_future(store.get("k")) for _ in range(after)]
            got_all = await asyncio.gather(*gets, put)
            for got in got_all[:-1]:
                assert got.min() == got.max() and got[0] in (i - 1.0, float(i))  # (the old value or the new, never torn)
            assert all(got[0] == i for got in got_all[before:-1])  # (issued after it: they waited for it)
            assert torch.equal(await store.get("k"), torch.full((numel,), float(i)))
        assert moved(store, "host->disk") == 0


@pytest.mark.parametrize("new", ["int32", "longer"])
async def test_a_get_into_out_that_waited_for_a_put_over_its_value_is_refused_if_the_value_changed_form(
    device_mode: str, new: str
) -> None:
    """A put may copy over a value of another dtype or shape that takes the same room. A
    ``get(out=)`` checked ``out`` against the value when it was asked for, then waited for the
    put: it read the new value into ``out`` (int32 bits as floats; 1,000 bytes past its end, a
    reviewer)."""
    numel = 2_000_000
    value = torch.full((numel,), 7, dtype=torch.int32) if new == "int32" else torch.full((numel + 250,), 2.5)
    async with TierStore([HostTier("8MiB")]) as store:
        await store.put("k", torch.full((numel,), 1.5))
        reader = asyncio.ensure_future(store.get("k"))  # a read under way: the put waits for it
        await asyncio.sleep(0)
        put = asyncio.ensure_future(store.put("k", value))
        await asyncio.sleep(0)
        room = torch.full((numel + 1024,), -1.0)
        with pytest.raises(InvalidTensorError, match=r"out is torch.float32 \(2000000,\); the value is"):
            await store.get("k", out=room[:numel])  # checked when asked: float32 of numel, as the value was
        assert torch.equal(room, torch.full((numel + 1024,), -1.0))  # nothing written into it, nor past it
        await asyncio.gather(reader, put)
        assert torch.equal(await store.get("k"), value)
