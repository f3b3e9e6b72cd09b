"""Review of small values inline in the catalog: what a non-durable acknowledged put keeps when
the commits around it fail, and what ``flush()`` promises for puts acknowledged before their
commit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.errors import CapacityError, DiskFullError
from tierstore.tiers import DiskTier


def disk(root: Path) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=False)




async def queue_behind_a_transaction(store: TierStore) -> None:
    """Put a key and let the group-commit task take it to the writer thread, so the next changes
    wait together for the next transaction."""
    await store.put("other", torch.tensor([0.0]))
    await asyncio.sleep(0)


@pytest.mark.parametrize("then", ["durable put", "delete"])
async def test_a_failed_change_leaves_the_acknowledged_value_before_it(tmp_path: Path, full_for: set[str], then: str) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        await queue_behind_a_transaction(store)
        await store.put("k", torch.tensor([1.0]))  # acknowledged before its commit
        full_for.add("k")
        with pytest.raises(DiskFullError):  # the failure goes to this caller, and changes nothing
            if then == "delete":
                await store.delete("k")
            else:
                await store.put("k", torch.tensor([2.0]), durable=True)
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))
        full_for.clear()
        await store.flush()
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert sorted(store.keys()) == ["k", "other"]
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))


async def test_an_acknowledged_value_that_cannot_commit_yet_stays_readable_then_commits(tmp_path: Path, full_for: set[str]) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        await queue_behind_a_transaction(store)
        full_for.add("k")
        await store.put("k", torch.tensor([1.0]))  # acknowledged; its transaction will fail
        with pytest.raises(DiskFullError):
            await store.put("k", torch.tensor([2.0]), durable=True)
        with pytest.raises(DiskFullError):
            await store.flush()  # the queued change cannot commit: flush says so
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))
        full_for.clear()
        await store.flush()
        assert tier.queued_changes == 0  # type: ignore[attr-defined]
        assert "k" in tier.committed()  # type: ignore[attr-defined]
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))


async def test_flush_commits_the_small_puts_acknowledged_before_their_commit(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        for i in range(300):
            await store.put(f"k{i}", torch.tensor([float(i)]))
        await store.flush()
        # Committed to LMDB: a kill -9 from here on loses none of them (the kernel holds them).
        assert tier.queued_changes == 0  # type: ignore[attr-defined]
        assert len(tier.committed()) == 300  # type: ignore[attr-defined]


async def test_a_failing_put_in_a_shared_transaction_fails_alone(tmp_path: Path, full_for: set[str]) -> None:
    tier = DiskTier(tmp_path / "d", "64MiB", chunk_size="64KiB")  # durable: every put waits for its commit
    async with TierStore([tier]) as store:
        full_for.add("full")
        values = {f"k{i}": torch.tensor([float(i)]) for i in range(20)}
        values["full"] = torch.tensor([1.0])
        values["bad"] = torch.ones(2).to_sparse()
        results = await asyncio.gather(*(store.put(key, value) for key, value in values.items()), return_exceptions=True)
        outcome = {key: type(r).__name__ for key, r in zip(values, results, strict=True) if isinstance(r, BaseException)}
        assert outcome == {"full": "DiskFullError", "bad": "InvalidTensorError"}
        assert sorted(store.keys()) == sorted(f"k{i}" for i in range(20))
        full_for.clear()
    async with TierStore([DiskTier(tmp_path / "d", "64MiB", chunk_size="64KiB")]) as store:
        assert sorted(store.keys()) == sorted(f"k{i}" for i in range(20))
        for i in range(20):
            assert torch.equal(await store.get(f"k{i}"), torch.tensor([float(i)]))


async def test_a_smaller_capacity_counts_the_inline_values_too(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        await store.put("large", torch.zeros(1 << 20, dtype=torch.uint8))  # one extent of 1 MiB
        for i in range(2000):  # 2 MB inline in the catalog
            await store.put(f"s{i}", torch.full((1000,), i % 256, dtype=torch.uint8))
    with pytest.raises(CapacityError, match="inline in the catalog"):
        async with TierStore([DiskTier(tmp_path / "d", "2MiB", durable=False)]):
            pass
    async with TierStore([DiskTier(tmp_path / "d", 3 << 20, durable=False)]) as store:  # 1 MiB + 2 MB fits
        tier = store.tier("disk")
        assert tier.used <= tier.capacity  # type: ignore[attr-defined]
        assert len(store) == 2001
        assert torch.equal(await store.get("s1999"), torch.full((1000,), 1999 % 256, dtype=torch.uint8))


@pytest.mark.parametrize("flush", [True, False], ids=["flush", "no-flush"])
async def test_close_that_cannot_commit_acknowledged_puts_stays_open(tmp_path: Path, full_for: set[str], flush: bool) -> None:
    """aclose(flush=False) too: small puts acknowledged before their commit are committed on
    close, or close raises and the store stays open with nothing lost."""
    root = tmp_path / "d"
    store = TierStore([disk(root)])
    await store.open()
    await store.put("a", torch.tensor([1.0]))
    await store.flush()
    full_for.add("k")
    await store.put("k", torch.tensor([2.0]))
    with pytest.raises(DiskFullError):
        await store.aclose(flush=flush)
    assert store.is_open and torch.equal(await store.get("k"), torch.tensor([2.0]))
    full_for.clear()
    await store.aclose()
    async with TierStore([disk(root)]) as again:
        assert sorted(again.keys()) == ["a", "k"]


async def test_a_put_loop_that_never_waits_leaves_a_bounded_backlog(tmp_path: Path) -> None:
    """Non-durable small puts in a loop with no other await: the group commit still runs, and no
    more than ``STAGED_LIMIT`` keys wait for a transaction (what a crash could lose)."""
    from tierstore.store import STAGED_LIMIT

    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        before = tier.transactions
        worst = 0
        for i in range(3 * STAGED_LIMIT):
            await store.put(f"k{i}", torch.zeros(16, dtype=torch.uint8))
            worst = max(worst, tier.queued_changes)
        assert worst <= STAGED_LIMIT
        assert tier.transactions - before >= 2  # committed along the way, not all at the end
