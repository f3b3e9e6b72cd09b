"""Disk space given back: freed extents, empty segment files, reopening with a smaller capacity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, TierFullError, TierStore
from tierstore.disk.catalog import DiskRecord
from tierstore.disk.compact import plan_compaction
from tierstore.disk.extents import Extent, ExtentAllocator
from tierstore.errors import CapacityError
from tierstore.tensors import TensorMeta

MiB = 1 << 20
VALUE_NUMEL = 256 * 1024  # float32: 1 MiB


def disk(root: Path, capacity: int | str = "256MiB") -> DiskTier:
    return DiskTier(root, capacity, chunk_size="256KiB")


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "data").glob("segment-*.bin"))


def on_disk(root: Path) -> int:
    """Bytes the file system has allocated to the data files."""
    return sum(path.stat().st_blocks * 512 for path in segment_files(root))


def file_lengths(root: Path) -> int:
    return sum(path.stat().st_size for path in segment_files(root))


def values(count: int, prefix: str = "k") -> dict[str, torch.Tensor]:
    return {f"{prefix}{i}": torch.full((VALUE_NUMEL,), float(i)) for i in range(count)}


async def test_deleting_everything_gives_the_space_back_and_putting_again_reuses_it(tmp_path: Path) -> None:
    root = tmp_path / "d"
    data = values(60)
    async with TierStore([disk(root)]) as store:
        tier = store.tiers[0]
        assert isinstance(tier, DiskTier)
        for key, value in data.items():
            await store.put(key, value)
        assert on_disk(root) >= 60 * MiB
        peak_reserved = tier.reserved
        for key in data:
            await store.delete(key)
        assert tier.used == 0
    # Closed (so the background deletion of empty trailing files is done): those files are gone;
    # the first stays, its freed extents punched out.
    assert len(segment_files(root)) == 1
    assert on_disk(root) < 2 * MiB
    async with TierStore([disk(root)]) as store:
        tier = store.tiers[0]
        assert isinstance(tier, DiskTier)
        assert len(store) == 0 and tier.used == 0
        assert tier.reserved == file_lengths(root)
        for key, value in data.items():
            await store.put(key, value)
        assert tier.reserved <= peak_reserved
        assert tier.used == sum(tier.extent_size(v.nbytes) for v in data.values())
        for key, value in data.items():
            assert torch.equal(await store.get(key), value)
    assert on_disk(root) >= 60 * MiB


async def test_a_store_closed_empty_leaves_no_blocks_and_one_closed_holding_values_keeps_its_reservation(tmp_path: Path) -> None:
    """The first segment's reservation of space never written stayed after a store was emptied
    and closed: an optimizer's scratch state (``offload="disk"``, dropped by ``close()``) left
    7.7 MB of a 16 MB file allocated."""
    root = tmp_path / "d"
    async with TierStore([disk(root, "64MiB")]) as store:
        for key, value in values(4).items():
            await store.put(key, value)
        for key in list(store.keys()):
            await store.delete(key)
    assert on_disk(root) == 0 and file_lengths(root) > 0
    kept = tmp_path / "kept"
    async with TierStore([disk(kept, "64MiB")]) as store:
        await store.put("one", torch.ones(VALUE_NUMEL))
    assert on_disk(kept) == file_lengths(kept)  # (posix_fallocate's reservation, as before)
    async with TierStore([disk(root, "64MiB")]) as store:  # reopened, it writes into the holes
        await store.put("again", torch.full((VALUE_NUMEL,), 3.0))
        assert torch.equal(await store.get("again"), torch.full((VALUE_NUMEL,), 3.0))


def test_an_optimizer_closing_its_scratch_store_leaves_no_blocks(tmp_path: Path) -> None:
    from tierstore.optim import TieredAdamW

    model = torch.nn.Linear(512, 512)
    opt = TieredAdamW(model.parameters(), offload="disk", disk_root=tmp_path / "optim", host_capacity="1MiB")
    for _ in range(2):
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    assert file_lengths(tmp_path / "optim") > 0 and on_disk(tmp_path / "optim") == 0


async def test_overwrites_reuse_freed_extents(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as store:
        tier = store.tiers[0]
        assert isinstance(tier, DiskTier)
        for round_ in range(40):
            for key, value in values(8).items():
                await store.put(key, value + round_)
        assert tier.reserved == 16 * MiB  # never needed a second segment
        assert tier.used == 8 * MiB
        assert torch.equal(await store.get("k3"), torch.full((VALUE_NUMEL,), 42.0))


async def test_half_of_the_store_deleted_drops_the_empty_last_segment_while_open(tmp_path: Path) -> None:
    root = tmp_path / "d"
    data = values(40)  # 16 MiB + 32 MiB of segments
    async with TierStore([disk(root)]) as store:
        tier = store.tiers[0]
        assert isinstance(tier, DiskTier)
        for key, value in data.items():
            await store.put(key, value)
        assert len(segment_files(root)) == 2
        for key in list(data)[8:]:  # the second segment empties, the first is left half full
            await store.delete(key)
        await store.put("again", data["k0"])  # still works while files go
    assert len(segment_files(root)) == 1
    async with TierStore([disk(root)]) as store:
        assert sorted(store.keys()) == sorted([*list(data)[:8], "again"])
        assert torch.equal(await store.get("k7"), data["k7"])


async def _fill_and_thin(root: Path) -> dict[str, torch.Tensor]:
    """40 MiB put over two segment files (48 MiB), then every key but one in four deleted."""
    data = values(40)
    async with TierStore([disk(root)]) as store:
        for key, value in data.items():
            await store.put(key, value)
        for i in range(40):
            if i % 4:
                await store.delete(f"k{i}")
    return {key: value for key, value in data.items() if int(key[1:]) % 4 == 0}


async def test_reopening_with_a_smaller_capacity_compacts(tmp_path: Path) -> None:
    root = tmp_path / "d"
    kept = await _fill_and_thin(root)
    assert file_lengths(root) == 48 * MiB
    async with TierStore([disk(root, "20MiB")]) as store:
        tier = store.tiers[0]
        assert isinstance(tier, DiskTier)
        assert tier.reserved <= 20 * MiB and tier.used == 10 * MiB
        assert sorted(store.keys()) == sorted(kept)
        for key, value in kept.items():
            assert torch.equal(await store.get(key), value)
        await store.put("more", torch.ones(VALUE_NUMEL))  # room left within the new capacity
    assert file_lengths(root) <= 20 * MiB
    async with TierStore([disk(root, "20MiB")]) as store:
        assert len(store) == len(kept) + 1
        for key, value in kept.items():
            assert torch.equal(await store.get(key), value)


async def test_a_capacity_below_the_live_data_is_refused_clearly_and_nothing_changes(tmp_path: Path) -> None:
    root = tmp_path / "d"
    kept = await _fill_and_thin(root)
    before = {path.name: path.read_bytes() for path in segment_files(root)}
    with pytest.raises(CapacityError, match=r"10\.0 MiB of live data in 10 entries.*capacity of 8\.0 MiB"):
        async with TierStore([disk(root, "8MiB")]):
            pass
    assert {path.name: path.read_bytes() for path in segment_files(root)} == before
    async with TierStore([disk(root)]) as store:  # and the folder opens as it was
        for key, value in kept.items():
            assert torch.equal(await store.get(key), value)


async def test_a_segment_file_the_catalog_no_longer_names_is_deleted_on_open(tmp_path: Path) -> None:
    """What a crash between the catalog commit and the deletion of a trailing file leaves."""
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as store:
        await store.put("x", torch.arange(10.0))
    stray = root / "data" / "segment-000001.bin"
    stray.write_bytes(b"\0" * 8192)
    os.chmod(stray, 0o600)
    async with TierStore([disk(root)]) as store:
        assert torch.equal(await store.get("x"), torch.arange(10.0))
    assert not stray.exists()


def test_only_empty_trailing_segments_go_while_the_rest_stays_at_most_half_full() -> None:
    allocator = ExtentAllocator()
    for size in (16, 32, 64):
        allocator.add_segment(size)
    assert allocator.removable_tail() == 2  # nothing used: all but the first
    first = allocator.allocate(10)
    assert first is not None and first.segment == 0
    assert allocator.removable_tail() == 1  # 10 of 48 used: the 64 goes, 10 of 16 is over half
    big = allocator.allocate(40)
    assert big is not None and big.segment == 2
    assert allocator.removable_tail() == 0  # the last one is in use
    allocator.free(big)
    allocator.drop_tail(allocator.removable_tail())
    assert allocator.segment_sizes == [16, 32] and allocator.used == 10
    with pytest.raises(ValueError, match="not empty"):
        allocator.drop_tail(2)


def _record(key: str, segment: int, offset: int, length: int) -> DiskRecord:
    return DiskRecord(key, TensorMeta(torch.uint8, (length,)), Extent(segment, offset, length), 1, (0,))


def test_compaction_plans_moves_below_the_new_capacity_and_refuses_fragmented_space(tmp_path: Path) -> None:
    # Segment 0 (4 blocks) has two one-block holes; segment 1 holds one extent of each size.
    block = 4096
    records = {
        "a": _record("a", 0, 0, block),
        "b": _record("b", 0, 2 * block, block),
        "small": _record("small", 1, 0, block),
    }
    plan = plan_compaction(tmp_path, records, (4 * block, 4 * block), 4 * block, block)
    assert plan.segments == (4 * block,)
    assert plan.moves == {"small": Extent(0, block, block)}
    records["big"] = _record("big", 1, block, 2 * block)
    with pytest.raises(CapacityError, match=r"in pieces too small for 'big'"):
        plan_compaction(tmp_path, {k: v for k, v in records.items() if k != "small"}, (4 * block, 4 * block), 4 * block, block)
    with pytest.raises(CapacityError, match="more than the capacity"):
        plan_compaction(tmp_path, records, (4 * block, 4 * block), 4 * block, block)


async def test_a_value_beyond_the_capacity_is_told_so_not_the_segment_size(tmp_path: Path) -> None:
    """Nor that the tier "is full", which on an empty tier read as a fault (a tryout)."""
    from tierstore.errors import TierFullError

    async with TierStore([DiskTier(tmp_path, "4MiB")]) as store:
        with pytest.raises(TierFullError, match=r"a tensor of 5.0 MiB is more than tier 'disk' holds \(4.0 MiB\)") as raised:
            await store.put("big", torch.zeros(5 * VALUE_NUMEL))
        assert "segment_size" not in str(raised.value) and "is full" not in str(raised.value)
        await store.put("fits", torch.ones(VALUE_NUMEL))  # (still usable)
        assert torch.equal(await store.get("fits"), torch.ones(VALUE_NUMEL))


async def test_a_full_disk_tier_says_the_bytes_where_the_rounded_sizes_read_the_same(tmp_path: Path) -> None:
    """A tryout: "tier 'disk' is full: 1.0 MiB wanted, 1024.0 KiB free" read as if the value
    fitted (40 B short: a small value kept inline in the catalog). Such figures are exact now."""
    store = TierStore([DiskTier(tmp_path / "d", "8MiB")])
    await store.open()
    try:
        for i in range(7):
            await store.put(f"a{i}", torch.zeros(1 << 18))
        await store.put("small", torch.zeros(10))
        with pytest.raises(TierFullError, match=r"1,048,576 B wanted, 1,048,536 B free"):
            await store.put("c", torch.zeros(1 << 18))
        assert torch.equal(await store.get("a3"), torch.zeros(1 << 18))
    finally:
        await store.aclose()


async def test_a_full_disk_tier_says_how_much_holds_old_versions_of_changed_values(tmp_path: Path) -> None:
    """A value changed in memory since it was last written keeps that version on the disk until
    the new one is written back (copy-on-write): that copy is in no listing of the disk tier,
    and a put then refused for room named no reason the listing showed."""
    async with TierStore([HostTier("1MiB"), disk(tmp_path / "d", "4MiB")]) as store:
        for i in range(3):
            await store.put("one", torch.full((256 * 1024,), float(i)), "host")
            if i == 0:
                await store.flush()
        assert store.stats()["tiers"]["disk"]["entries"] == 0
        with pytest.raises(TierFullError, match="1.0 MiB of the tier hold the last written versions of values changed"):
            await store.put("big", torch.zeros(3 * 256 * 1024 + 1024), "disk")
        await store.flush()  # (the new value written, its old version freed: 3 MiB free, in two extents)
        await store.put("big", torch.zeros(2 * 256 * 1024), "disk")
        assert torch.equal(await store.get("one"), torch.full((256 * 1024,), 2.0))
