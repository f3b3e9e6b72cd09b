"""The store's promises where the first tests did not look (issue #9): write holds, hits seen by
the policy, puts that own their bytes, write-through, flush as one transaction, closed stores."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from policies import LFU, LRU
from tierstore import (
    DeviceTier,
    DiskTier,
    EntryHeldError,
    HostTier,
    StoreClosedError,
    TierFullError,
    TierStore,
)

KiB = 1024


def value(i: float, kib: int = 64) -> torch.Tensor:
    return torch.full((kib * KiB // 4,), float(i))


# -- write holds -----------------------------------------------------------------------------------


async def test_later_write_in_a_hold_survives_eviction_and_reopen(tmp_path: Path) -> None:
    """Defect 1: inside a write hold, fill; a get to the host tier (another task) and a flush
    come; write again; release: the later write is the value, after the held copy is evicted
    and after close and reopen (they waited for the release instead of copying the half-done
    buffer)."""
    tiers = lambda: [DeviceTier("cpu", "256KiB"), HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]  # noqa: E731
    async with TierStore(tiers()) as store:
        await store.put("k", value(0), "device")
        async with store.hold("k", "device", write=True) as buffer:
            buffer.fill_(1.0)
            to_host = asyncio.ensure_future(_outside(store.get("k", "host")))
            flushing = asyncio.ensure_future(_outside(store.flush()))
            await asyncio.sleep(0.02)
            buffer.fill_(2.0)
        assert torch.equal(await to_host, value(2))
        await flushing
        for i in range(8):  # push the device copy out
            await store.put(f"other{i}", value(10 + i), "device")
        assert "device" not in store.where("k")
        assert torch.equal(await store.get("k"), value(2))
    async with TierStore(tiers()) as store:
        assert torch.equal(await store.get("k"), value(2))


async def _outside(coro):  # type: ignore[no-untyped-def]
    """Run ``coro`` as another task would: outside the caller's holds."""
    import contextvars

    return await asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


async def test_own_reads_inside_a_write_hold_raise_instead_of_deadlocking(tmp_path: Path) -> None:
    async with TierStore([DeviceTier("cpu", "1MiB"), HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("k", value(0))
        async with store.hold("k", write=True) as buffer:
            buffer.fill_(1.0)
            for action in (store.get("k", "host"), store.get("k"), store.read("k"), store.flush(), store.put("k", value(5))):
                with pytest.raises(EntryHeldError, match="own write hold"):
                    await asyncio.wait_for(action, 5)
            with pytest.raises(EntryHeldError):  # a second write hold inside the first
                async with store.hold("k", write=True):
                    pass
            child = asyncio.ensure_future(store.get("k", "host"))  # tasks started inside count as inside
            with pytest.raises(EntryHeldError):
                await asyncio.wait_for(child, 5)
        assert torch.equal(await store.get("k", "host"), value(1))


async def test_other_tasks_wait_for_the_release_and_never_see_half_a_write() -> None:
    async with TierStore([DeviceTier("cpu", "1MiB"), HostTier("1MiB")]) as store:
        await store.put("k", value(0))
        entered, release = asyncio.Event(), asyncio.Event()

        async def writer() -> None:
            async with store.hold("k", "device", write=True) as buffer:
                buffer[: buffer.numel() // 2].fill_(1.0)  # half written ...
                entered.set()
                await release.wait()
                buffer[buffer.numel() // 2 :].fill_(1.0)  # ... and the rest

        async def second_writer() -> float:
            async with store.hold("k", "device", write=True) as buffer:
                seen = float(buffer.sum())
                buffer.fill_(2.0)
                return seen

        task = asyncio.ensure_future(writer())
        await entered.wait()
        readers = [asyncio.ensure_future(store.get("k", tier)) for tier in ("device", "host")]
        readers.append(asyncio.ensure_future(store.read("k")))
        waiting_writer = asyncio.ensure_future(second_writer())
        await asyncio.sleep(0.05)
        assert not any(r.done() for r in readers) and not waiting_writer.done()
        release.set()
        await task
        for reader in readers:
            got = await reader
            assert torch.equal(got, value(1)) or torch.equal(got, value(2))
        assert await waiting_writer == float(value(1).sum())
        assert torch.equal(await store.get("k", "host"), value(2))


async def test_flush_waits_for_another_tasks_write_hold(tmp_path: Path) -> None:
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("k", value(0))
        entered, release = asyncio.Event(), asyncio.Event()

        async def writer() -> None:
            async with store.hold("k", write=True) as buffer:
                buffer.fill_(1.0)
                entered.set()
                await release.wait()
                buffer.fill_(7.0)

        task = asyncio.ensure_future(writer())
        await entered.wait()
        flushing = asyncio.ensure_future(store.flush())
        await asyncio.sleep(0.05)
        assert not flushing.done()
        release.set()
        await task
        await flushing
        assert "disk" in store.where("k")
    async with TierStore([DiskTier(tmp_path / "d", "16MiB")]) as store:
        assert torch.equal(await store.get("k"), value(7))


# -- the policy sees every hit ---------------------------------------------------------------------


async def test_lru_device_tier_holds_the_most_recently_used_keys() -> None:
    """Defect 2: hits of any size reach the policy, so the device tier is LRU's choice."""
    generator = torch.Generator().manual_seed(0)
    async with TierStore([DeviceTier("cpu", "256KiB"), HostTier("4MiB")], eviction=LRU) as store:
        for i in range(16):
            await store.put(f"k{i}", value(i, kib=16), "host")
        recent: list[str] = []
        for _ in range(200):
            key = f"k{int(torch.randint(16, (1,), generator=generator))}"
            await store.get(key)
            recent = [k for k in recent if k != key] + [key]
        on_device = {key for key in store.keys() if "device" in store.where(key)}
        assert on_device == set(recent[-len(on_device) :])
        assert len(on_device) >= 8


async def test_lfu_keeps_a_key_read_often_over_one_never_read() -> None:
    async with TierStore([DeviceTier("cpu", "256KiB"), HostTier("4MiB")], eviction=LFU) as store:
        await store.put("hot", value(1, kib=64), "device")
        for _ in range(10):
            await store.get("hot")  # 64 KiB hits: more than the old inline-copy limit would matter
        await store.put("cold", value(2, kib=64), "device")
        for i in range(3):
            await store.put(f"new{i}", value(3 + i, kib=64), "device")
        assert "device" in store.where("hot")
        assert "device" not in store.where("cold")


# -- puts own their bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.01])
async def test_a_cancelled_put_no_longer_reads_the_callers_tensor(tmp_path: Path, delay: float) -> None:
    """Defect 5: once a cancelled put gives control back, changing the tensor changes nothing."""
    tensor = torch.full((8 << 20,), 1.0)  # 32 MiB: the write is still running when cancelled
    async with TierStore([DiskTier(tmp_path / "d", "256MiB")]) as store:
        await store.put("k", torch.zeros(8 << 20))
        put = asyncio.ensure_future(store.put("k", tensor))
        await asyncio.sleep(delay)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        tensor.fill_(-1.0)  # the caller reuses its memory at once
        await asyncio.sleep(0.2)  # (had the write gone on reading it, it would have read -1s)
    async with TierStore([DiskTier(tmp_path / "d", "256MiB")]) as store:
        got = await store.get("k")  # the old value or the new one, whole, and its checksums hold
        assert torch.equal(got, torch.zeros(8 << 20)) or torch.equal(got, torch.full((8 << 20,), 1.0))


async def test_close_waits_for_the_writes_of_cancelled_puts(tmp_path: Path) -> None:
    async with TierStore([DiskTier(tmp_path / "d", "256MiB")]) as store:
        puts = [asyncio.ensure_future(store.put(f"k{i}", torch.full((1 << 20,), float(i)))) for i in range(8)]
        await asyncio.sleep(0.001)
        for put in puts:
            put.cancel()
        await asyncio.gather(*puts, return_exceptions=True)
    async with TierStore([DiskTier(tmp_path / "d", "256MiB")]) as store:
        for key in store.keys():  # every committed value reads back whole
            i = int(key[1:])
            assert torch.equal(await store.get(key), torch.full((1 << 20,), float(i)))


# -- acknowledged means kept -----------------------------------------------------------------------


def run_script(body: str, root: Path) -> None:
    script = "import os, torch\nfrom tierstore import *\n" + textwrap.dedent(body).replace("ROOT", repr(str(root)))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize("durable", [True, False])
def test_write_through_survives_a_kill_and_write_back_is_documented_as_not(tmp_path: Path, durable: bool) -> None:
    run_script(
        f"""
        import asyncio
        async def main():
            store = TierStore([HostTier("64MiB"), DiskTier(ROOT, "256MiB")], durable={durable})
            await store.open()
            await store.put("k", torch.arange(1000.0))
            os._exit(0)  # like kill -9: no close, no atexit
        asyncio.run(main())
        """,
        tmp_path / "d",
    )
    run_script(
        f"""
        import asyncio
        async def main():
            async with TierStore([DiskTier(ROOT, "256MiB")]) as store:
                assert ("k" in store) is {durable}
                if {durable}:
                    assert torch.equal(await store.get("k"), torch.arange(1000.0))
        asyncio.run(main())
        """,
        tmp_path / "d",
    )


async def test_durable_put_option_overrides_the_store(tmp_path: Path) -> None:
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("fast", value(1))
        await store.put("safe", value(2), durable=True)
        assert store.where("fast") == ["host"]
        assert store.where("safe") == ["host", "disk"]
    with pytest.raises(ValueError, match="DiskTier"):
        TierStore([HostTier("1MiB")], durable=True)


async def test_flush_refuses_when_the_disk_cannot_hold_the_copy_on_write(tmp_path: Path) -> None:
    async with TierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "1MiB")]) as store:
        for i in range(6):
            await store.put(f"k{i}", value(i, kib=256), "host")
        used = store.tier("disk").used
        with pytest.raises(TierFullError, match="Nothing was written"):
            await store.flush()
        assert store.tier("disk").used == used
        assert all(store.where(f"k{i}") == ["host"] for i in range(6))
        await store.delete("k0")
        await store.delete("k1")
        await store.delete("k2")
        await store.flush()  # 3 x 256 KiB fit in 1 MiB
        assert all("disk" in store.where(f"k{i}") for i in range(3, 6))
        await store.aclose(flush=False)


# -- lifecycle -------------------------------------------------------------------------------------


async def test_a_closed_store_refuses_every_verb() -> None:
    store = TierStore([HostTier("1MiB")])
    async with store:
        await store.put("k", value(1))
    with pytest.raises(StoreClosedError):
        store.keys()
    with pytest.raises(StoreClosedError):
        len(store)
    with pytest.raises(StoreClosedError):
        "k" in store  # noqa: B015
    for verb in (store.info, store.where):
        with pytest.raises(StoreClosedError):
            verb("k")
    with pytest.raises(StoreClosedError):
        store.stats()
    for coro in (store.get("k"), store.put("k", value(1)), store.delete("k"), store.read("k"), store.flush()):
        with pytest.raises(StoreClosedError):
            await coro


async def test_a_store_collected_while_open_warns() -> None:
    store = TierStore([HostTier("1MiB")])
    await store.open()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del store
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)


def test_sync_facade_write_hold_raises_in_its_own_thread_and_blocks_others() -> None:
    import threading

    from tierstore import SyncTierStore

    with SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("1MiB")]) as store:
        store.put("k", value(0))
        seen: list[torch.Tensor] = []
        with store.hold("k", write=True) as buffer:
            buffer.fill_(1.0)
            with pytest.raises(EntryHeldError, match="own write hold"):
                store.get("k", "host")
            reader = threading.Thread(target=lambda: seen.append(store.get("k", "host")))
            reader.start()
            reader.join(0.1)
            assert reader.is_alive() and not seen  # another thread waits for the release
            buffer.fill_(2.0)
        reader.join(10)
        assert torch.equal(seen[0], value(2))


async def test_a_store_collected_while_open_releases_its_folder(tmp_path: Path) -> None:
    """Re-running a notebook cell: the first store was never closed, the second opens anyway."""
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")])
    await store.open()
    await store.put("k", value(1), durable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del store
        gc.collect()
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as again:
        assert torch.equal(await again.get("k"), value(1))


# -- found in review: cancellation and write-through edges -----------------------------------------


def slow_writes(disk: DiskTier, seconds: float) -> None:
    """Make every data write of ``disk`` take ``seconds`` longer (fault injection)."""
    write, write_committed = disk.write, disk.write_committed

    async def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        await asyncio.sleep(seconds)
        return await write(*args, **kwargs)

    async def slow_committed(*args, **kwargs):  # type: ignore[no-untyped-def]  # (a put's write and commit)
        await asyncio.sleep(seconds)
        return await write_committed(*args, **kwargs)

    disk.write = slow  # type: ignore[method-assign]
    disk.write_committed = slow_committed  # type: ignore[method-assign]


async def test_a_cancelled_flush_keeps_its_sources_until_its_commit(tmp_path: Path) -> None:
    tiers = lambda: [DeviceTier("cpu", "8KiB"), HostTier("64KiB"), DiskTier(tmp_path / "d", "64MiB")]  # noqa: E731
    async with TierStore(tiers()) as store:
        await store.put("a", value(1, kib=8), "device")
        slow_writes(store.tier("disk"), 0.2)  # type: ignore[arg-type]
        flushing = asyncio.ensure_future(store.flush())
        await asyncio.sleep(0.05)
        flushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        with pytest.raises(TierFullError):  # a's buffer is still being written: it cannot be reused
            await store.put("b", value(2, kib=8), "device")
    async with TierStore(tiers()) as store:
        assert torch.equal(await store.get("a"), value(1, kib=8))
        assert "b" not in store


async def test_a_put_cancelled_while_making_room_leaves_every_victim_evictable() -> None:
    async with TierStore([DeviceTier("cpu", "16KiB"), HostTier("64KiB")]) as store:
        for i in range(4):
            await store.put(f"k{i}", value(i, kib=4), "device")
        put = asyncio.ensure_future(store.put("big", value(9, kib=12), "device"))
        await asyncio.sleep(0)  # the put is demoting its first victim
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        for i in range(4):
            async with asyncio.timeout(5):
                async with store.hold(f"k{i}", "host", write=True):
                    pass
        await store.put("whole", value(5, kib=16), "device")  # every copy on the device can go
        assert store.where("whole") == ["device"]


async def test_a_write_hold_waits_for_a_put_in_flight() -> None:
    big = 16 << 20  # the put's copy runs on a worker thread: it is in flight for a while
    async with TierStore([HostTier("128MiB")]) as store:
        await store.put("k", torch.zeros(big // 4))
        put = asyncio.ensure_future(store.put("k", torch.ones(big // 4)))
        await asyncio.sleep(0)
        async with store.hold("k", write=True) as buffer:
            assert put.done()  # the hold started after the put, on its value
            assert float(buffer.view(torch.float32)[0]) == 1.0
            buffer.view(torch.float32).fill_(7.0)
        assert float((await store.get("k"))[0]) == 7.0


async def test_an_acknowledged_durable_put_survives_a_later_write_back_put(tmp_path: Path) -> None:
    tiers = lambda: [HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]  # noqa: E731
    async with TierStore(tiers()) as store:
        await store.put("k", value(0), durable=True)
        slow_writes(store.tier("disk"), 0.1)  # type: ignore[arg-type]
        durable = asyncio.ensure_future(store.put("k", value(1), durable=True))
        await asyncio.sleep(0.02)
        await store.put("k", value(2))  # write-back, newer, not durable
        await durable
        await store.aclose(flush=False)  # as if the process died now: only the catalog counts
    async with TierStore(tiers()) as store:
        assert torch.equal(await store.get("k"), value(1))


async def test_a_durable_put_that_fails_leaves_the_old_value(tmp_path: Path) -> None:
    async with TierStore([DeviceTier("cpu", "1MiB"), DiskTier(tmp_path / "d", "64KiB")]) as store:
        await store.put("k", value(0, kib=32), durable=True)
        with pytest.raises(TierFullError, match="disk"):
            await store.put("k", value(1, kib=48), durable=True)  # the copy-on-write does not fit
        assert torch.equal(await store.get("k"), value(0, kib=32))


async def test_a_cancelled_overwrite_is_settled_when_the_caller_gets_control_back(tmp_path: Path) -> None:
    """No flip after the fact: what a read sees right after the cancel is what stays."""
    async with TierStore([DiskTier(tmp_path / "d", "256MiB")]) as store:
        await store.put("k", torch.full((1 << 20,), 1.0))
        slow_writes(store.tier("disk"), 0.05)  # type: ignore[arg-type]
        put = asyncio.ensure_future(store.put("k", torch.full((1 << 20,), 2.0)))
        await asyncio.sleep(0.01)  # the data write is under way, the commit has not begun
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        seen = [float((await store.get("k"))[0])]
        await asyncio.sleep(0.2)
        seen.append(float((await store.get("k"))[0]))
        assert seen == [1.0, 1.0]
    async with TierStore([DiskTier(tmp_path / "d", "256MiB")]) as store:
        assert float((await store.get("k"))[0]) == 1.0


async def test_close_writes_in_several_transactions_when_one_does_not_fit(tmp_path: Path) -> None:
    tiers = lambda: [HostTier("4MiB"), DiskTier(tmp_path / "d", "1MiB")]  # noqa: E731
    async with TierStore(tiers()) as store:
        for i in range(2):
            await store.put(f"k{i}", value(i, kib=300), durable=True)
        for i in range(2):
            await store.put(f"k{i}", value(10 + i, kib=300))  # newer, only in memory
        with pytest.raises(TierFullError):
            await store.flush()  # both copy-on-writes at once do not fit beside the old values
    async with TierStore(tiers()) as store:  # close wrote them in turns
        for i in range(2):
            assert torch.equal(await store.get(f"k{i}"), value(10 + i, kib=300))


async def test_a_close_that_cannot_flush_leaves_the_store_open(tmp_path: Path) -> None:
    store = TierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "512KiB")])
    await store.open()
    await store.put("a", value(1, kib=400))
    await store.put("b", value(2, kib=400))
    with pytest.raises(TierFullError):
        await store.aclose()
    assert store.is_open and torch.equal(await store.get("b"), value(2, kib=400))  # nothing lost
    await store.delete("b")
    await store.aclose()
    async with TierStore([DiskTier(tmp_path / "d", "512KiB")]) as again:
        assert again.keys() == ["a"]


def test_a_forked_child_cannot_use_the_parents_store(tmp_path: Path) -> None:
    import os

    from tierstore import StoreForkedError, SyncTierStore

    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        store.put("on_host", value(1))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: every verb refuses, memory-only ones too
            outcomes = []
            for verb in (lambda: store.store.keys(), lambda: store.store.where("on_host"), lambda: store.store.stats()):
                try:
                    verb()
                    outcomes.append("ok")
                except StoreForkedError:
                    outcomes.append("refused")
            os.write(write, ",".join(outcomes).encode())
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.read(read, 100).decode() == "refused,refused,refused"
        assert store.keys() == ["on_host"]  # the parent's store is unaffected


async def test_a_refused_put_changes_nothing_not_even_the_eviction_order(tmp_path: Path) -> None:
    """The last memory tier evicts nothing: a victim that could not be written back into it is
    never chosen, so a refused put leaves the policy as it was (and the trace as well)."""
    from tierstore.sim import load_evictions, replay_store_trace

    page = lambda: torch.ones(4096, dtype=torch.uint8)  # noqa: E731
    trace = tmp_path / "trace.npz"
    async with TierStore([DeviceTier("cpu", 8192), HostTier(16384)], eviction=LRU, trace=trace) as store:
        for i in range(6):
            await store.put(f"k{i}", page())  # k0..k3 end on the host, k4 and k5 on the device
        with pytest.raises(TierFullError):
            await store.put("big", page())
        await store.delete("k0")
        await store.put("k6", page())  # LRU's victim on the device is still k4
        assert store.where("k4") == ["host"] and store.where("k5") == ["device"]
    replayed = replay_store_trace(trace, [8192, 16384], "lru", accounting=[DeviceTier("cpu", 8192), HostTier(16384)])
    assert replayed.evictions == load_evictions(trace)


def test_a_store_left_open_is_closed_after_the_programs_other_threads_end(tmp_path: Path) -> None:
    run_script(
        """
        import threading, time
        store = SyncTierStore([HostTier("64MiB"), DiskTier(ROOT, "256MiB")]).open()
        def worker():
            for i in range(5):
                time.sleep(0.05)
                store.put(f"w{i}", torch.full((4097,), i, dtype=torch.uint8))
        threading.Thread(target=worker).start()
        """,
        tmp_path / "d",
    )
    run_script(
        """
        with SyncTierStore([DiskTier(ROOT, "256MiB")]) as store:
            assert sorted(store.keys()) == [f"w{i}" for i in range(5)], store.keys()
        """,
        tmp_path / "d",
    )
