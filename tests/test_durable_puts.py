"""Durable small puts settled by the catalog writer's one callback (issue 15, durable put rate):
the put is committed when it returns, a failed commit keeps the old value, a cancelled caller
is told only once the commit is settled (and close waits for it), puts that meet a busy
catalog still share transactions, and puts that should be cached in memory still are."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import TierStore
from tierstore.errors import DiskFullError
from tierstore.tiers import DiskTier, HostTier

pytestmark = pytest.mark.device_modes


def disk(root: Path, durable: bool = True) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=durable)


def small(seed: int, n: int = 64) -> torch.Tensor:
    return torch.randint(-1000, 1000, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))




async def test_a_write_back_put_onto_a_durable_disk_tier_is_committed_on_return(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:  # (the store's default: write-back)
        tier: Any = store.tier("disk")
        for i in range(20):
            await store.put(f"k{i}", small(i))
            assert tier.committed()[f"k{i}"].inline  # in the catalog already, not queued
        assert tier.queued_changes == 0
    async with TierStore([disk(tmp_path / "d")]) as store:
        for i in range(20):
            assert torch.equal(await store.get(f"k{i}"), small(i))


async def test_close_waits_for_the_commit_of_a_cancelled_put(tmp_path: Path, commit_gate: threading.Event) -> None:
    store = TierStore([disk(tmp_path / "d")])
    await store.open()
    await store.put("slow", small(1))
    commit_gate.clear()
    task = asyncio.create_task(store.put("slow", small(2)))
    await asyncio.sleep(0.02)  # (its transaction waits at the gate, on the writer thread)
    task.cancel()
    closing = asyncio.create_task(store.aclose())
    await asyncio.sleep(0.05)
    assert not task.done() and not closing.done()  # both wait for the commit under way
    commit_gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await closing
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("slow"), small(2))


async def test_a_failed_commit_raises_and_a_cancelled_caller_is_told_once_it_is_settled(tmp_path: Path, commit_gate: threading.Event) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier: Any = store.tier("disk")
        await store.put("k", small(0))
        with pytest.raises(DiskFullError):
            await store.put("fail", small(1))
        used = tier.used
        commit_gate.clear()
        task = asyncio.create_task(store.put("fail", small(2)))
        await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0.02)
        assert not task.done()
        reported: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        commit_gate.set()
        with pytest.raises(asyncio.CancelledError):  # (cancelled: not the commit's failure)
            await task
        del task
        gc.collect()
        assert reported == []  # (no "exception was never retrieved" left behind)
        assert tier.used == used
        assert "fail" not in store
        await store.put("k", small(3))  # (the store goes on; the key's lock is free)
        assert torch.equal(await store.get("k"), small(3))


async def test_concurrent_durable_puts_share_transactions_and_all_land(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")], durable=True) as store:
        tier: Any = store.tier("disk")
        before = tier.transactions

        async def writer(w: int) -> None:
            for i in range(w, 160, 8):
                await store.put(f"k{i}", small(i))

        await asyncio.gather(*(writer(w) for w in range(8)))
        assert tier.transactions - before < 160  # busy catalog: group commit
        assert len(tier.committed()) == 160
    async with TierStore([disk(tmp_path / "d")]) as store:
        for i in range(160):
            assert torch.equal(await store.get(f"k{i}"), small(i))


async def test_a_durable_put_with_a_memory_tier_first_is_still_cached_there(tmp_path: Path) -> None:
    async with TierStore([HostTier("1MiB"), disk(tmp_path / "d")], durable=True) as store:
        await store.put("cached", small(1))
        assert store.where("cached") == ["host", "disk"]
        await store.put("direct", small(2), tier="disk")  # (asked for the disk tier: only there)
        assert store.where("direct") == ["disk"]
        assert torch.equal(await store.get("direct"), small(2))
    async with TierStore([HostTier("1MiB"), disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("cached"), small(1))
        assert torch.equal(await store.get("direct"), small(2))


async def test_a_hand_over_that_raises_leaves_the_key_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread refusing the job (here: out of memory once) fails that put only: the
    key's disk lock and the space it reserved are given back, and later puts and close go on
    (they hung: the lock stayed held and close waited for a commit that never started)."""
    from tierstore.disk.serial import SerialExecutor

    real = SerialExecutor.run_soon
    refusals = [MemoryError("injected")]

    def run_soon(self: SerialExecutor, job: Any) -> None:
        if refusals:
            raise refusals.pop()
        real(self, job)

    store = TierStore([disk(tmp_path / "d")])
    await store.open()
    await store.put("k", small(1))
    used = store.tier("disk").used  # type: ignore[attr-defined]
    monkeypatch.setattr(SerialExecutor, "run_soon", run_soon)
    with pytest.raises(MemoryError):
        await store.put("k", small(2))
    assert torch.equal(await store.get("k"), small(1))
    assert store.tier("disk").used == used  # type: ignore[attr-defined]
    await asyncio.wait_for(store.put("k", small(3)), 10)
    assert torch.equal(await store.get("k"), small(3))
    await asyncio.wait_for(store.aclose(), 10)


def test_the_writer_thread_refuses_jobs_in_a_forked_child() -> None:
    """A forked child has no copy of the thread: a job handed over there would never run."""
    import os

    from tierstore.disk.serial import SerialExecutor

    executor = SerialExecutor("test-writer")
    try:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            try:
                executor.run_soon(lambda: None)
            except RuntimeError as error:
                os._exit(0 if "forked child" in str(error) else 2)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert executor.submit(lambda: 7).result(timeout=10) == 7  # (the parent's still works)
    finally:
        executor.shutdown()
