"""Compact entries (issue 15): the default LRU linked through the memory copies, and entries of
a reopened store whose inline copy is made on first use.

``CopyLRU`` must choose exactly the victims ``policies.LRU`` chooses; an adopted entry must
behave as one built eagerly (get, overwrite, delete, holds, flush, reopen, damage caught).
"""

from __future__ import annotations

import random
import tracemalloc
from pathlib import Path

import pytest
import torch

from policies import LRU
from tierstore import TierStore
from tierstore.entry import Copy, MemoryCopy
from tierstore.errors import ChecksumError
from tierstore.recency import CopyLRU
from tierstore.testing import check_consistency, settle
from tierstore.tiers import DiskTier, HostTier


def disk(root: Path) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=False)


def value(i: int, size: int) -> torch.Tensor:
    return torch.full((size,), float(i % 251))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_copy_lru_chooses_what_lru_chooses(seed: int) -> None:
    rng = random.Random(seed)
    copies = {f"k{i}": MemoryCopy(0, 1) for i in range(40)}
    linked, plain = CopyLRU(copies.get), LRU()
    for _ in range(3000):
        key = rng.choice(list(copies))
        op = rng.random()
        if op < 0.35:
            if rng.random() < 0.5:
                linked.insert(copies[key], key)
            else:
                linked.on_insert(key, 4)
            plain.on_insert(key, 4)
        elif op < 0.65:
            linked.touch(copies[key]) if rng.random() < 0.5 else linked.on_hit(key)
            plain.on_hit(key)
        elif op < 0.75:
            linked.remove(copies[key]) if rng.random() < 0.5 else linked.on_remove(key)
            plain.on_remove(key)
        elif op < 0.995:
            skipped = set(rng.sample(list(copies), rng.randrange(0, 30)))
            allowed = (lambda k, skipped=skipped: k not in skipped) if skipped else None
            assert linked.victim(allowed) == plain.victim(allowed)
        else:
            linked.reset()
            plain.reset()
        assert len(linked) == len(plain)
    assert linked.keys() == list(plain._order)


async def _walk(store: TierStore, seed: int) -> list[dict[str, list[str]]]:
    """Random puts (packed and not), gets and deletes; where every key is after each step."""
    rng = random.Random(seed)
    keys = [f"k{i:02d}" for i in range(60)]
    seen = []
    for step in range(400):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.5:
            await store.put(key, value(step, rng.choice([1, 16, 300, 1100, 3000])))
        elif op < 0.9:
            if key in store:
                await store.get(key)
        elif key in store:
            await store.delete(key)
        await settle(store)
        seen.append({k: store.where(k) for k in keys if k in store})
    check_consistency(store)
    return seen


@pytest.mark.parametrize("seed", [0, 1])
async def test_the_default_policy_evicts_as_the_keyed_lru(tmp_path: Path, seed: int) -> None:
    async with TierStore([HostTier("64KiB"), disk(tmp_path / "a")]) as store:
        assert type(store._engine.policies[0]) is CopyLRU
        linked = await _walk(store, seed)
    async with TierStore([HostTier("64KiB"), disk(tmp_path / "b")], eviction=lambda: LRU()) as store:
        assert type(store._engine.policies[0]) is LRU
        keyed = await _walk(store, seed)
    assert any(where == ["disk"] for step in linked for where in step.values()), "nothing was evicted"
    assert linked == keyed


async def test_the_default_policy_keeps_no_table_per_key(tmp_path: Path) -> None:
    async with TierStore([HostTier("64MiB"), disk(tmp_path / "d")]) as store:
        policy = store._engine.policies[0]
        keys = [f"k{i}" for i in range(4000)]
        await store.put("warm", value(0, 1))
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i, key in enumerate(keys):
            await store.put(key, value(i, 1))
        per_key = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
        tracemalloc.stop()
        assert len(policy) == len(keys) + 1
        # An entry (80 B), its memory copy (128 B), a version (32 B) and the engine's dict
        # slot; the OrderedDict of the keyed LRU alone took ~90 B more.
        assert per_key < 330, per_key


async def _reopened(root: Path, n: int) -> dict[str, torch.Tensor]:
    expected = {f"k{i}": value(i, 1 + i % 3) for i in range(n)}
    expected["big"] = torch.rand(20_000)
    async with TierStore([disk(root)]) as store:
        for key, v in expected.items():
            await store.put(key, v)
    return expected


def _adopted(store: TierStore, key: str) -> bool:
    return not isinstance(store._engine.entries[key]._copies, (Copy, tuple))


async def test_reopened_entries_make_their_copy_on_first_use(tmp_path: Path) -> None:
    expected = await _reopened(tmp_path / "d", 50)
    async with TierStore([HostTier("16MiB"), disk(tmp_path / "d")]) as store:
        assert all(_adopted(store, f"k{i}") for i in range(50)) and not _adopted(store, "big")
        assert store.where("k1") == ["disk"]
        assert torch.equal(await store.get("k1"), expected["k1"])
        assert not _adopted(store, "k1") and store.where("k1") == ["host", "disk"]
        await store.put("k2", torch.zeros(7), durable=False)  # an adopted entry overwritten in memory
        assert store.where("k2") == ["host"], "the old disk copy must not pass for the new value"
        await store.delete("k3")
        assert "k3" not in store
        async with store.hold("k4", write=True) as held:
            held.fill_(42.0)
        await store.put("k5", torch.ones(3), durable=True)
        check_consistency(store)
        await store.flush()
        assert store.where("k2") == ["host", "disk"]
    expected.update(k2=torch.zeros(7), k4=torch.full_like(expected["k4"], 42.0), k5=torch.ones(3))
    del expected["k3"]
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert sorted(store.keys()) == sorted(expected)
        for key, v in expected.items():
            assert torch.equal(await store.get(key), v), key
        await store.put("k6", torch.zeros(1))  # versions go on from the newest found
        await store.pop("k7")
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("k6"), torch.zeros(1)) and "k7" not in store


async def test_an_adopted_entry_overwritten_on_the_host_then_evicted_keeps_the_new_value(tmp_path: Path) -> None:
    await _reopened(tmp_path / "d", 40)
    async with TierStore([HostTier("64KiB"), disk(tmp_path / "d")]) as store:
        for i in range(40):
            await store.put(f"k{i}", value(1000 + i, 4), durable=False)
        for i in range(200):  # push them out of the host tier
            await store.put(f"filler{i}", value(i, 1000), durable=False)
        await settle(store)
        for i in range(40):
            assert torch.equal(await store.get(f"k{i}"), value(1000 + i, 4)), i
        check_consistency(store)


async def test_a_damaged_inline_value_is_caught_on_the_first_get_after_reopen(tmp_path: Path) -> None:
    expected = {f"k{i}": torch.randint(0, 256, (300,), dtype=torch.uint8) for i in range(10)}
    async with TierStore([disk(tmp_path / "d")]) as store:
        for key, v in expected.items():
            await store.put(key, v)
    catalog = tmp_path / "d" / "catalog" / "data.mdb"
    raw = bytearray(catalog.read_bytes())
    needle = expected["k3"].numpy().tobytes()
    at = raw.find(needle)
    assert at >= 0
    while at >= 0:  # (LMDB may keep older copies of a page)
        raw[at + 100] ^= 0x08
        at = raw.find(needle, at + 1)
    catalog.write_bytes(bytes(raw))
    async with TierStore([HostTier("1MiB"), disk(tmp_path / "d")]) as store:
        assert _adopted(store, "k3")
        with pytest.raises(ChecksumError, match="'k3'"):
            await store.get("k3")
        assert store.where("k3") == ["disk"]  # nothing damaged was cached
        assert torch.equal(await store.get("k4"), expected["k4"])
