"""Memory tiers spend their capacity on values, not on padding (issue #9, DESIGN invariants 1, 12).

A tier of capacity C holds values whose sizes add up to C when each is a multiple of 4 KiB, and
values of about 1 KiB with at most 10% overhead (packed into shared slabs); the accounting is
what is really allocated; buffers of a page or more start on a page.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import DeviceTier, DiskTier, HostTier, TierFullError, TierStore
from tierstore.errors import BufferSharedError
from tierstore.tensors import ALIGNMENT
from tierstore.testing import check_consistency, watch_capacity

KiB = 1024
CAPACITY = 256 * KiB


def two_tiers(device: int = CAPACITY) -> list:
    return [DeviceTier("cpu", device), HostTier("4MiB")]


def value(nbytes: int, fill: int) -> torch.Tensor:
    return torch.full((nbytes,), fill % 251, dtype=torch.uint8)


async def put_all(store: TierStore, sizes: list[int]) -> None:
    for i, nbytes in enumerate(sizes):
        await store.put(f"v{i}", value(nbytes, i))


def on_device(store: TierStore, count: int) -> int:
    return sum(store.where(f"v{i}")[0] == "device" for i in range(count))


async def test_a_256k_tier_holds_four_64k_values() -> None:
    async with TierStore(two_tiers()) as store:
        breaches = watch_capacity(store)
        await put_all(store, [64 * KiB] * 4)
        assert on_device(store, 4) == 4
        assert store.stats()["tiers"]["device"]["evictions"] == 0
        assert store.tiers[0].used == CAPACITY and not breaches
        check_consistency(store)


async def test_page_multiples_add_up_to_the_capacity() -> None:
    sizes = [4 * KiB, 8 * KiB, 12 * KiB] * 10 + [4 * KiB, 12 * KiB]
    assert sum(sizes) == CAPACITY
    async with TierStore(two_tiers()) as store:
        breaches = watch_capacity(store)
        await put_all(store, sizes)
        assert on_device(store, len(sizes)) == len(sizes)
        assert store.tiers[0].used == store.tiers[0].live_bytes == CAPACITY and not breaches
        for i, nbytes in enumerate(sizes):
            assert torch.equal(await store.get(f"v{i}"), value(nbytes, i))
        check_consistency(store)


@pytest.mark.parametrize("nbytes", [1024, 1000, 1100, 960])
async def test_small_values_fill_nine_tenths_of_a_tier(nbytes: int) -> None:
    count = CAPACITY * 9 // 10 // nbytes
    async with TierStore(two_tiers()) as store:
        breaches = watch_capacity(store)
        await put_all(store, [nbytes] * count)
        assert on_device(store, count) == count, "values were evicted before 90% of the tier held values"
        assert store.stats()["tiers"]["device"]["evictions"] == 0
        assert store.tiers[0].used <= CAPACITY and not breaches
        for i in range(count):
            assert torch.equal(await store.get(f"v{i}"), value(nbytes, i))
        check_consistency(store)


async def test_1k_values_fill_a_tier_exactly() -> None:
    async with TierStore(two_tiers()) as store:
        await put_all(store, [KiB] * (CAPACITY // KiB))
        assert on_device(store, CAPACITY // KiB) == CAPACITY // KiB
        assert store.tiers[0].used == store.tiers[0].live_bytes == CAPACITY


async def test_accounting_is_the_storage_really_allocated() -> None:
    sizes = [64 * KiB, 4 * KiB, 5000, 1024, 100, 1, 3 * ALIGNMENT + 1]
    async with TierStore(two_tiers()) as store:
        await put_all(store, sizes)
        storages = []
        for i in range(len(sizes)):
            async with store.hold(f"v{i}", "device") as buffer:
                storages.append(buffer.untyped_storage().nbytes())
        tier = store.tiers[0]
        assert tier.live_bytes == sum(storages)
        large = [n for n in storages if n >= ALIGNMENT]
        assert large == [64 * KiB, 4 * KiB, 2 * ALIGNMENT, 4 * ALIGNMENT], "buffers carry no slack page"
        tier.clear_pool()
        # The small values take slots of 1024, 128 and 64 bytes, in one one-page slab per class:
        # the rest of those pages is allocated too, and accounted.
        assert sorted(n for n in storages if n < ALIGNMENT) == [64, 128, 1024]
        assert tier.used == sum(large) + 3 * ALIGNMENT
        check_consistency(store)


@pytest.mark.parametrize("tier", ["device", "host"])
async def test_buffers_of_a_page_or_more_are_page_aligned(tier: str) -> None:
    sizes = [ALIGNMENT, 5000, 64 * KiB, 3 << 20]
    async with TierStore([DeviceTier("cpu", "8MiB"), HostTier("8MiB")]) as store:
        for i, nbytes in enumerate(sizes):
            await store.put(f"v{i}", value(nbytes, i), tier=tier)
            async with store.hold(f"v{i}", tier) as buffer:
                assert buffer.data_ptr() % ALIGNMENT == 0, f"{nbytes} bytes at {buffer.data_ptr():#x}"


async def test_freed_buffers_are_reused() -> None:
    async with TierStore(two_tiers()) as store:
        await store.put("a", value(64 * KiB, 1))
        async with store.hold("a") as buffer:
            address = buffer.data_ptr()
        await store.delete("a")
        assert store.tiers[0].live_bytes == 0 and store.tiers[0].used == 64 * KiB  # pooled
        await store.put("b", value(64 * KiB, 2))
        async with store.hold("b") as buffer:
            assert buffer.data_ptr() == address
        assert store.tiers[0].used == 64 * KiB
        # Pooled buffers of another size make way for new ones: the capacity is never exceeded.
        await store.delete("b")
        await put_all(store, [48 * KiB] * 5)
        assert on_device(store, 5) == 5 and store.tiers[0].used == 240 * KiB


async def test_a_tier_full_of_small_values_makes_room_for_a_large_one() -> None:
    async with TierStore(two_tiers()) as store:
        breaches = watch_capacity(store)
        await put_all(store, [KiB] * (CAPACITY // KiB))
        await store.put("large", value(64 * KiB, 7))
        assert store.where("large") == ["device"] and not breaches
        assert store.tiers[0].used <= CAPACITY
        for i in range(CAPACITY // KiB):
            assert torch.equal(await store.get(f"v{i}", tier="host"), value(KiB, i))
        check_consistency(store)


async def test_pop_copies_a_packed_value_and_hands_over_a_large_one() -> None:
    async with TierStore(two_tiers()) as store:
        await put_all(store, [KiB, KiB, 64 * KiB])
        async with store.hold("v2") as buffer:
            address = buffer.data_ptr()
        popped = await store.pop("v0")
        assert torch.equal(popped, value(KiB, 0))
        assert torch.equal(await store.get("v1"), value(KiB, 1))  # its slab neighbour is untouched
        popped.fill_(99)
        assert torch.equal(await store.get("v1"), value(KiB, 1))  # the caller's tensor is its own
        large = await store.pop("v2")
        assert large.data_ptr() == address and torch.equal(large, value(64 * KiB, 2))
        assert store.tiers[0].live_bytes == KiB
        check_consistency(store)


def test_a_slot_cannot_leave_its_tier() -> None:
    tier = DeviceTier("cpu", CAPACITY)
    slot, page = tier.allocate(KiB), tier.allocate(ALIGNMENT)
    assert not tier.can_hand_over(slot) and tier.can_hand_over(page)
    tier.release(slot)
    with pytest.raises(BufferSharedError):
        tier.forget(slot)


def test_allocation_beyond_the_free_room_is_refused() -> None:
    tier = DeviceTier("cpu", 64 * KiB)
    buffers = [tier.allocate(16 * KiB) for _ in range(4)]
    assert tier.free == 0
    with pytest.raises(TierFullError):
        tier.allocate(16 * KiB)
    with pytest.raises(TierFullError):
        tier.allocate(KiB)  # a new slab needs a page
    tier.release(buffers.pop())
    assert tier.allocation_size(KiB) == ALIGNMENT and tier.free == 16 * KiB
    slots = [tier.allocate(KiB) for _ in range(4)]  # one slab: the pooled buffer makes way
    assert tier.allocation_size(KiB) == ALIGNMENT and tier.used == 52 * KiB
    for slot in slots:
        tier.release(slot)
    assert tier.free == 16 * KiB and tier.live_bytes == 48 * KiB


SIZES = st.one_of(st.integers(0, 4200), st.integers(4096, 100 * KiB), st.sampled_from([4 * KiB, 64 * KiB, 128 * KiB]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 10**6)), min_size=1, max_size=80))
def test_random_allocations_never_exceed_the_capacity(steps: list[tuple[bool, int, int]]) -> None:
    """Against a model: ``allocate`` succeeds exactly when ``free >= allocation_size``; live
    buffers never overlap and keep their bytes; accounting equals the storages handed out."""
    tier = DeviceTier("cpu", CAPACITY)
    live: list[tuple[torch.Tensor, int, int]] = []
    for allocate, nbytes, pick in steps:
        if allocate or not live:
            fits = tier.free >= tier.allocation_size(nbytes)
            try:
                buffer = tier.allocate(nbytes)
            except TierFullError:
                assert not fits
                continue
            assert fits and buffer.numel() >= nbytes
            if nbytes >= ALIGNMENT:
                assert buffer.data_ptr() % ALIGNMENT == 0
            buffer.fill_(pick % 251)
            live.append((buffer, nbytes, pick % 251))
        else:
            buffer, _, fill = live.pop(pick % len(live))
            assert bool((buffer == fill).all()), "another allocation overwrote this buffer"
            tier.release(buffer)
        assert tier.used <= tier.capacity
        assert tier.live_bytes == sum(b.untyped_storage().nbytes() for b, _, _ in live)
        spans = sorted((b.data_ptr(), b.data_ptr() + b.untyped_storage().nbytes()) for b, _, _ in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    for buffer, _, fill in live:
        assert bool((buffer == fill).all())
        tier.release(buffer)
    assert tier.live_bytes == 0 and tier.free == tier.capacity  # every slab can be dropped
    tier.clear_pool()
    assert tier.used == 0


@pytest.mark.gpu
async def test_pinned_host_buffers_are_exact_registered_mappings() -> None:
    async with TierStore([DeviceTier("cuda", "64MiB"), HostTier("64MiB", pinned=True)]) as store:
        sizes = [64 * KiB, 3 << 20, KiB, 5000]
        for i, nbytes in enumerate(sizes):
            await store.put(f"v{i}", value(nbytes, i), tier="host")
        host = store.tiers[1]
        assert host.pinned
        for i, nbytes in enumerate(sizes):
            async with store.hold(f"v{i}", "host") as buffer:
                assert buffer.is_pinned()
                if nbytes >= ALIGNMENT:
                    assert buffer.data_ptr() % ALIGNMENT == 0
            assert torch.equal((await store.get(f"v{i}", tier="device")).cpu(), value(nbytes, i))
        assert host.live_bytes == 64 * KiB + (3 << 20) + KiB + 2 * ALIGNMENT
        check_consistency(store)


async def test_a_held_small_value_pins_little_of_a_small_tier(tmp_path: Path) -> None:
    """A slab holding one held value cannot be freed: on a small tier slabs are small (a
    sixteenth of the capacity), so the rest of the tier stays usable for other sizes."""
    async with TierStore([HostTier("64KiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("small", torch.ones(3000, dtype=torch.uint8))
        async with store.hold("small"):
            await store.put("big", torch.ones(60 * 1024, dtype=torch.uint8), "host")
            assert store.where("big") == ["host"]
