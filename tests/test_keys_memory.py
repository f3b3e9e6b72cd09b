"""Many small keys: what a key costs in memory, and a store of them reopened (issue 15).

Speed lives in ``benchmarks/bench_keys.py``; these check the structure behind the figures: no
tensor object per small value, no dict or lock per key left behind, metadata shared, and the
fast reopen path reading (and refusing) catalog records as the full parser does.
"""

from __future__ import annotations

import gc
import struct
from pathlib import Path

import lmdb
import pytest
import torch

from tierstore import TierStore
from tierstore.disk.catalog import DiskRecord
from tierstore.errors import CatalogError
from tierstore.keys import key_digest
from tierstore.tiers import DeviceTier, DiskTier, HostTier

KEYS = 2000


def small(i: int) -> torch.Tensor:
    return torch.full((1 + i % 3,), float(i))


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)


def disk(root: Path) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=False)


async def test_small_values_on_a_memory_tier_keep_no_tensor_each(tmp_path: Path) -> None:
    async with TierStore([HostTier("16MiB"), disk(tmp_path / "d")]) as store:
        await store.put("warm", small(0))  # the first slab of each size class
        for i in range(3):
            await store.put(f"warm{i}", small(i))
        before = live_tensors()
        for i in range(KEYS):
            await store.put(f"k{i}", small(i))
        assert live_tensors() - before < KEYS // 20, "a tensor object per small value"
        assert store.where("k7") == ["host"]
        for i in range(0, KEYS, 97):
            assert torch.equal(await store.get(f"k{i}"), small(i))


async def test_small_values_share_their_metadata_and_keep_no_lock_after_a_flush(tmp_path: Path) -> None:
    async with TierStore([HostTier("16MiB"), disk(tmp_path / "d")]) as store:
        for i in range(300):
            await store.put(f"k{i}", small(i))
        await store.flush()
        entries = [store._engine.entries[f"k{i}"] for i in range(300)]
        assert len({id(e.meta) for e in entries}) == 3  # one object per dtype and shape
        assert all(e._rare is None for e in entries), "a flush left a lock (or more) per key"
        assert all(store.where(f"k{i}") == ["host", "disk"] for i in range(300))


@pytest.mark.parametrize("tier", ["device", "host"])
async def test_a_held_packed_value_is_changed_in_place(tmp_path: Path, tier: str) -> None:
    async with TierStore([DeviceTier("cpu", "4MiB"), HostTier("4MiB"), disk(tmp_path / "d")]) as store:
        for i in range(8):
            await store.put(f"k{i}", small(i), tier)
        async with store.hold("k3", tier, write=True) as held:
            held.fill_(-1.0)
        assert torch.equal(await store.get("k3", tier), torch.full((1,), -1.0))
        assert [torch.equal(await store.get(f"k{i}", tier), small(i)) for i in range(8) if i != 3] == [True] * 7
        popped = await store.pop("k4", tier)  # a packed value is copied out, its neighbours stay
        assert torch.equal(popped, small(4)) and torch.equal(await store.get("k5", tier), small(5))


async def test_a_store_of_small_and_large_keys_reopens_with_every_value(tmp_path: Path) -> None:
    expected = {f"k{i}": small(i) for i in range(KEYS)}
    expected.update({f"big{i}": torch.rand(20_000) for i in range(3)})
    expected["empty"] = torch.empty(0, 4)
    expected["int"] = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    async with TierStore([HostTier("16MiB"), disk(tmp_path / "d")]) as store:
        for key, value in expected.items():
            await store.put(key, value)
        await store.delete("k5")
        del expected["k5"]
    async with TierStore([HostTier("16MiB"), disk(tmp_path / "d")]) as store:
        assert len(store) == len(expected)
        assert store.info("int")["shape"] == (2, 3) and store.info("int")["dtype"] == torch.int16
        for key, value in expected.items():
            assert torch.equal(await store.get(key), value), key
        await store.put("k6", torch.zeros(2))  # versions go on from the newest found
        assert torch.equal(await store.get("k6"), torch.zeros(2))
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("k6"), torch.zeros(2))


def _rewrite(root: Path, key: str, change: object) -> None:
    env = lmdb.open(str(root / "catalog"), max_dbs=2)
    entries = env.open_db(b"entries")
    with env.begin(write=True, db=entries) as txn:
        raw = bytes(txn.get(key_digest(key)))
        txn.put(key_digest(key), change(raw))  # type: ignore[operator]
    env.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:-1],  # a byte of the value lost
        lambda raw: raw.replace(b"k12", b"k13"),  # filed under another key's address
        lambda raw: raw[:1] + b"\x09" + raw[2:],  # an unknown kind of record
        lambda raw: raw[:2] + struct.pack("<B", 7) + raw[3:],  # a shape longer than the record
    ],
    ids=["short", "misfiled", "kind", "shape"],
)
async def test_a_damaged_small_record_is_refused_on_reopen(tmp_path: Path, damage: object) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        for i in range(20):
            await store.put(f"k{i}", small(i))
    assert DiskRecord.from_bytes(_read(tmp_path / "d", "k12")).inline
    _rewrite(tmp_path / "d", "k12", damage)
    with pytest.raises(CatalogError):
        async with TierStore([disk(tmp_path / "d")]):
            pass


def _read(root: Path, key: str) -> bytes:
    env = lmdb.open(str(root / "catalog"), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"entries", create=False)) as txn:
        raw = bytes(txn.get(key_digest(key)))
    env.close()
    return raw
