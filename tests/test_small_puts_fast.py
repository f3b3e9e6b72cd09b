"""The quick ways of small puts (issue 15, put rates): a durable small put handed to the
catalog's writer thread with no await before the hand-over (its outcome installed on the loop
by the commit's own callback), and a non-durable put of a new key staged with its entry made
in one object. Each must keep the contract of the full put: durable on return, the old value
kept when the commit fails, a cancelled caller back only once the outcome is settled, and
every read in the process (and after reopening) agreeing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import TierStore
from tierstore.errors import DiskFullError, KeyNotFoundError, TierFullError
from tierstore.tiers import DiskTier


def disk(root: Path, durable: bool, capacity: str = "64MiB") -> DiskTier:
    return DiskTier(root, capacity, chunk_size="64KiB", durable=durable)


def small(seed: int, n: int = 256) -> torch.Tensor:
    return torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))




async def test_a_durable_small_put_is_one_transaction_committed_on_return(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        tier: Any = store.tier("disk")
        for i in range(5):
            before = tier.transactions
            await store.put(f"k{i}", small(i))
            assert tier.transactions == before + 1  # one transaction (one sync) per sequential put
            assert tier.committed()[f"k{i}"].inline  # in the catalog, not queued
            assert tier.read_raw_inline(f"k{i}") == small(i).numpy().tobytes()
        await store.put("k0", small(99))  # an overwrite, the same way
        assert torch.equal(await store.get("k0"), small(99))
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        assert torch.equal(await store.get("k0"), small(99))
        for i in range(1, 5):
            assert torch.equal(await store.get(f"k{i}"), small(i))


async def test_a_cancelled_durable_put_returns_once_its_commit_is_settled(tmp_path: Path, commit_gate: threading.Event) -> None:
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        await store.put("slow", small(1))
        commit_gate.clear()
        task = asyncio.create_task(store.put("slow", small(2)))
        await asyncio.sleep(0.05)  # (the transaction is on the writer thread, waiting at the gate)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # the caller gets control back only with the outcome known
        commit_gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert torch.equal(await store.get("slow"), small(2))  # it had begun: it took effect
        await store.put("slow", small(3))  # (the key's disk lock is free again)
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        assert torch.equal(await store.get("slow"), small(3))


async def test_a_failed_durable_small_put_keeps_the_old_value_and_its_space(tmp_path: Path, full_for: set[str]) -> None:
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        tier: Any = store.tier("disk")
        await store.put("k", small(1))
        used = tier.used
        full_for.add("k")
        with pytest.raises(DiskFullError):
            await store.put("k", small(2))
        full_for.add("new")
        with pytest.raises(DiskFullError):
            await store.put("new", small(3))
        assert tier.used == used
        assert torch.equal(await store.get("k"), small(1))
        with pytest.raises(KeyNotFoundError):
            await store.get("new")
        full_for.clear()
        await store.put("k", small(4))
        await store.put("new", small(5))
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        assert torch.equal(await store.get("k"), small(4))
        assert torch.equal(await store.get("new"), small(5))


async def _value_of(store: TierStore, key: str) -> torch.Tensor | None:
    try:
        return await store.get(key)
    except KeyNotFoundError:
        return None


async def test_durable_puts_and_deletes_of_one_key_at_once_agree_with_the_disk(tmp_path: Path, commit_gate: threading.Event) -> None:
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        await store.put("slow", small(0))
        commit_gate.clear()
        first = asyncio.create_task(store.put("slow", small(1)))
        await asyncio.sleep(0.02)  # (its transaction waits at the gate; the others queue behind)
        rest = [asyncio.create_task(store.put("slow", small(2))), asyncio.create_task(store.delete("slow")),
                asyncio.create_task(store.put("slow", small(3)))]
        await asyncio.sleep(0.02)
        commit_gate.set()
        await asyncio.gather(first, *rest)
        seen = await _value_of(store, "slow")
        assert seen is None or any(torch.equal(seen, small(i)) for i in (2, 3))
    async with TierStore([disk(tmp_path / "d", durable=True)]) as store:
        after = await _value_of(store, "slow")
        assert (after is None) == (seen is None)
        assert seen is None or torch.equal(after, seen)  # type: ignore[arg-type]


async def test_non_durable_small_puts_of_new_keys_read_back_everywhere(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d", durable=False)]) as store:
        for i in range(300):
            await store.put(f"k{i}", small(i))
        assert torch.equal(await store.get("k7"), small(7))  # before any commit
        await store.put("k7", small(1007))  # an overwrite of a staged new key
        await store.delete("k8")
        assert sorted(store.keys()) == sorted(f"k{i}" for i in range(300) if i != 8)
        assert store.tier("disk").used == 299 * small(0).nbytes  # type: ignore[attr-defined]
    async with TierStore([disk(tmp_path / "d", durable=False)]) as store:
        assert torch.equal(await store.get("k7"), small(1007))
        assert torch.equal(await store.get("k299"), small(299))
        with pytest.raises(KeyNotFoundError):
            await store.get("k8")
        assert len(store.keys()) == 299


async def test_a_non_durable_small_put_with_no_room_says_so(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d", durable=False, capacity="4KiB")]) as store:
        await store.put("a", small(1, 512))  # 2 KiB
        with pytest.raises(TierFullError):
            await store.put("b", small(2, 768))  # 3 KiB more
        assert "b" not in store.keys()
        assert torch.equal(await store.get("a"), small(1, 512))
