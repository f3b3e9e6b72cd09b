"""Review of the small-value fast paths (issue 15): the sync facade's get reads a small value on
the loop thread only (no catalog read on the caller's, where an overwrite or a close could tear
it or unmap it), puts of one hot key keep one change queued, a closed store lets go of its
memory, and a put refused by a closed disk tier leaves no trace."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import tierstore
from tierstore import SyncTierStore, TierStore
from tierstore.errors import DiskFullError, StoreClosedError
from tierstore.tiers import DiskTier, HostTier

DISK_CODE = (str(Path(tierstore.__file__).parent / "disk"), str(Path(tierstore.__file__).parent / "tiers" / "disk.py"))


def disk(root: Path, durable: bool = False) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=durable)




def test_a_sync_get_never_reads_the_disk_tier_on_the_callers_thread(tmp_path: Path) -> None:
    """Only the loop touches the catalog: a read on the caller's thread could pair an old
    value with a new dtype (an overwrite between its reads) or read a map a close unmapped."""
    ran: list[str] = []

    def tracer(frame: FrameType, event: str, arg: object) -> None:
        if frame.f_code.co_filename.startswith(DISK_CODE):
            ran.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    with SyncTierStore([HostTier("1MiB"), disk(tmp_path / "d")]) as store:
        store.put("k", torch.tensor([1.0, 2.0, 3.0, 4.0]), tier="disk")  # inline, staged
        store.put("j", torch.arange(3, dtype=torch.int16), tier="disk")
        store.flush()  # ... and committed
        store.put("j", torch.tensor([5, 6], dtype=torch.int32), tier="disk")  # staged over it
        sys.settrace(tracer)  # (this thread only)
        try:
            got = [store.get("k", tier="disk"), store.get("j", tier="disk"), store.get("k")]
        finally:
            sys.settrace(None)
        assert ran == []
        assert torch.equal(got[0], torch.tensor([1.0, 2.0, 3.0, 4.0])) and torch.equal(got[2], got[0])
        assert got[1].dtype == torch.int32 and torch.equal(got[1], torch.tensor([5, 6], dtype=torch.int32))
        assert store.stats()["tiers"]["disk"]["hits"] >= 2  # counted as any get


def test_sync_gets_beside_a_writer_changing_dtype_and_tier_read_whole_values(tmp_path: Path) -> None:
    values = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([7, 8, 9, 10], dtype=torch.int32)]
    with SyncTierStore([HostTier("1MiB"), disk(tmp_path / "d")]) as store:
        store.put("k", values[0], tier="disk")
        stop = threading.Event()

        def write() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                store.put("k", values[i % 2], tier="disk" if i % 4 < 2 else 0)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                got = store.get("k", tier="disk")
                assert any(got.dtype == v.dtype and torch.equal(got, v) for v in values), got
        finally:
            stop.set()
            writer.join()


def test_closing_a_store_while_another_thread_gets_raises_or_reads_never_crashes(tmp_path: Path) -> None:
    store = SyncTierStore([disk(tmp_path / "d")]).open()
    value = torch.arange(256, dtype=torch.float32)
    for i in range(64):
        store.put(f"k{i}", value)
    store.flush()
    outcomes: list[str] = []
    started = threading.Event()

    def read() -> None:
        started.set()
        for n in range(100_000):
            try:
                assert torch.equal(store.get(f"k{n % 64}"), value)
            except StoreClosedError:
                outcomes.append("closed")
                return
        outcomes.append("done")

    reader = threading.Thread(target=read)
    reader.start()
    started.wait()
    time.sleep(0.05)
    store.close()
    reader.join()
    assert outcomes in (["closed"], ["done"])


async def test_puts_of_one_hot_key_keep_one_change_queued_and_flush_at_once(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        before = tier.transactions  # type: ignore[attr-defined]
        worst = 0
        for i in range(20_000):  # (no other await: the puts themselves let the commits run)
            await store.put("hot", torch.tensor([float(i)]))
            worst = max(worst, tier.queued_changes)  # type: ignore[attr-defined]
        assert worst <= 3  # (one committing, one queued behind it; each flush of it then O(1))
        assert tier.transactions > before  # type: ignore[attr-defined]
        assert torch.equal(await store.get("hot"), torch.tensor([19_999.0]))
        await store.flush()
        await tier.drain()  # type: ignore[attr-defined]
        assert tier.queued_changes == 0  # type: ignore[attr-defined]
        assert tier.read_raw_inline("hot") == torch.tensor([19_999.0]).numpy().tobytes()  # type: ignore[attr-defined]
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("hot"), torch.tensor([19_999.0]))


async def test_the_backlog_counts_changes_and_the_group_commit_starts_during_a_put_loop(tmp_path: Path) -> None:
    from tierstore.store import STAGED_LIMIT

    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        before = tier.transactions  # type: ignore[attr-defined]
        worst = 0
        for i in range(2 * STAGED_LIMIT):
            await store.put(f"k{i % 8}", torch.tensor([float(i)]))  # a few hot keys, no other await
            worst = max(worst, tier.queued_changes)  # type: ignore[attr-defined]
        assert worst <= STAGED_LIMIT
        assert tier.transactions > before  # type: ignore[attr-defined]  # commits ran meanwhile
        for i in range(8):
            assert torch.equal(await store.get(f"k{i}"), torch.tensor([float(2 * STAGED_LIMIT - 8 + i)]))


async def test_a_hot_key_whose_commit_fails_keeps_its_newest_value_and_commits_it_later(
    tmp_path: Path, full_for: set[str]
) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        full_for.add("hot")
        await store.put("hot", torch.tensor([1.0]))
        for _ in range(500):
            if tier.commit_failed:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        assert tier.commit_failed  # type: ignore[attr-defined]
        errors = []
        for _ in range(2):  # a fresh error each time, saying what failed
            with pytest.raises(DiskFullError) as caught:
                await store.put("hot", torch.tensor([2.0]))
            errors.append(caught.value)
        assert errors[0] is not errors[1] and isinstance(errors[0].__cause__, DiskFullError)
        assert torch.equal(await store.get("hot"), torch.tensor([1.0]))  # what was acknowledged stays
        full_for.clear()
        for i in range(2, 100):
            await store.put("hot", torch.tensor([float(i)]))
        await store.flush()
        await tier.drain()  # type: ignore[attr-defined]
        assert not tier.commit_failed  # type: ignore[attr-defined]
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("hot"), torch.tensor([99.0]))


async def test_a_durable_put_between_acknowledged_ones_keeps_their_order(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        await store.put("k", torch.tensor([1.0]))  # acknowledged, queued
        await store.put("k", torch.tensor([2.0]), durable=True)  # waits for its commit
        await store.put("k", torch.tensor([3.0]))  # acknowledged after it
        await store.put("k", torch.tensor([4.0]))  # ... and replacing that one in the queue
        assert torch.equal(await store.get("k"), torch.tensor([4.0]))
        await store.flush()
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("k"), torch.tensor([4.0]))


async def test_a_closed_store_holds_no_buffer_of_its_memory_tiers(tmp_path: Path) -> None:
    gc.disable()  # (freed by reference counts alone, not by a cyclic collection some time later)
    try:
        store = TierStore([HostTier("64MiB"), disk(tmp_path / "d")])
        await store.open()
        refs = []
        for i in range(8):
            await store.put(f"k{i}", torch.full((1 << 18,), float(i)))  # 1 MiB each, on the host tier
            async with store.hold(f"k{i}") as buffer:
                refs.append(StorageWeakRef(buffer.untyped_storage()))
                del buffer
        await store.aclose()
        assert all(ref.expired() for ref in refs)
    finally:
        gc.enable()


async def test_a_put_refused_by_a_closed_disk_tier_leaves_no_key(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        files, tier._files = tier._files, None  # type: ignore[attr-defined]  # as once closed under the store
        try:
            with pytest.raises(StoreClosedError):
                await store.put("new", torch.tensor([1.0]))
            assert "new" not in store and store.keys() == []
        finally:
            tier._files = files  # type: ignore[attr-defined]
