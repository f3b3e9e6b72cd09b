"""Closing a store while requests wait for room that a kernel gives back (a device buffer
retired while the caller's kernel may still use it comes back only when that kernel ends):
the close does not hang, each waiting request fails with ``StoreClosedError``, nothing is
allocated on the closed tiers afterwards and they keep none of the buffers that come back.

A close that fails (its flush cannot write: here a disk whose writes fail as a full disk's,
held until the test lets them go) leaves the store open, and the requests that waited for its
outcome go on as if it had not happened: the put waiting for room lands, the write hold is
granted, the put made meanwhile is done. A write hold asked for while the close still waits
for the write holds open is refused at once instead (its holder's may wait for it)."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
from kernel_link import KernelLink
from torch.multiprocessing.reductions import StorageWeakRef

from tierstore import (
    DeviceTier,
    DiskTier,
    HostTier,
    StoreClosedError,
    SyncTierStore,
    TierStore,
    TierStoreError,
)
from tierstore.disk.files import FileIO
from tierstore.tiers import Tier

VALUE = 64 * 1024  # one page-aligned buffer each: no packing
PATIENCE = 10.0  # seconds: far more than any step here takes, less than forever


def value(n: int) -> torch.Tensor:
    return torch.full((VALUE // 4,), float(n))


async def kernel_store(*below: Tier) -> tuple[TierStore, DeviceTier, KernelLink]:
    """An open store: a device tier of room for two values, behind a ``KernelLink``, a host
    tier, and the tiers ``below`` it."""
    device = DeviceTier("cpu", 2 * VALUE, emulate_device=True)
    store = TierStore([device, HostTier("1MiB"), *below])
    await store.open()
    link = device.link = KernelLink()
    return store, device, link


async def fill_device(store: TierStore, link: KernelLink) -> None:
    """Fill the device tier: ``a``'s buffer retired while a kernel still uses it (it comes back
    when ``link.finish()`` is called), ``held`` on it."""
    await store.put("a", value(1), tier="device")
    await store.put("held", value(2), tier="device")
    async with store.hold("a", "device"):
        link.launching = True  # a kernel that reads a's buffer is queued
    link.launching = False
    await store.delete("a")


@asynccontextmanager
async def full_device() -> AsyncIterator[tuple[TierStore, DeviceTier, KernelLink]]:
    """A store whose device tier is full (``fill_device``), with ``h`` on the host."""
    store, device, link = await kernel_store()
    try:
        await store.put("h", value(3), tier="host")
        await fill_device(store, link)
        yield store, device, link
    finally:
        link.finish()
        if store.is_open:
            await store.aclose()
        link.close()


async def until_waiting(task: asyncio.Future[Any]) -> None:
    for _ in range(50):
        await asyncio.sleep(0)
    assert not task.done(), "the request did not wait for the room a kernel still uses"


async def outcome(task: asyncio.Future[Any]) -> BaseException | None:
    """What ``task`` ends with, failing the test if it does not end in time."""
    done, _ = await asyncio.wait([task], timeout=PATIENCE)
    assert done, "the request waits on after the store closed"
    return task.exception()


async def close_in_time(store: TierStore) -> None:
    await asyncio.wait_for(store.aclose(), PATIENCE)


def request(store: TierStore, kind: str) -> asyncio.Future[Any]:
    """A put of a new value on the device, or a hold there of a value only on the host."""

    async def hold() -> None:
        async with store.hold("h", "device"):
            pass

    return asyncio.ensure_future(store.put("b", value(4), tier="device") if kind == "put" else hold())


@pytest.mark.parametrize("kind", ["put", "hold"])
@pytest.mark.parametrize("kernel", ["ends after the close", "never ends"])
async def test_close_fails_a_request_waiting_for_room_a_kernel_gives_back(kind: str, kernel: str) -> None:
    async with full_device() as (store, device, link):
        async with store.hold("held", "device"):  # nothing to evict: only a's room can come
            waiting = request(store, kind)
            await until_waiting(waiting)
            await close_in_time(store)
            error = await outcome(waiting)  # (was: still waiting; with the kernel ended, allocating on the closed tier)
        assert isinstance(error, StoreClosedError), error
        if kernel == "ends after the close":
            link.finish()
            await asyncio.sleep(0.05)  # (the buffer comes back on the loop)
        assert not store.is_open


async def test_a_request_waiting_for_room_when_the_close_starts_allocates_nothing_later() -> None:
    async with full_device() as (store, device, link):
        async with store.hold("held", "device"):
            waiting = request(store, "put")
            await until_waiting(waiting)
            used = device.used
        await close_in_time(store)
        link.finish()  # a's buffer comes back: room a waiting put would take
        await outcome(waiting)
        await asyncio.sleep(0.05)
        assert device.used <= used - VALUE  # a's buffer went back and stayed free
        with pytest.raises(StoreClosedError):
            await store.put("b", value(4), tier="device")


async def test_a_buffer_whose_kernel_ends_after_the_close_is_freed() -> None:
    store, device, link = await kernel_store()
    try:
        await store.put("a", value(1), tier="device")
        async with store.hold("a", "device") as buffer:
            ref = StorageWeakRef(buffer.untyped_storage())
            del buffer
            link.launching = True
        link.launching = False
        await store.delete("a")
        await close_in_time(store)
        link.finish()
        await asyncio.sleep(0.05)
        gc.collect()
        assert ref.expired(), "the closed tier's pool kept the buffer that came back"  # (was: pooled)
    finally:
        link.finish()
        link.close()


def test_sync_close_fails_a_put_another_thread_waits_with() -> None:
    device = DeviceTier("cpu", 2 * VALUE, emulate_device=True)
    store = SyncTierStore([device, HostTier("1MiB")])
    store.open()
    link = device.link = KernelLink()
    try:
        store.put("a", value(1), tier="device")
        store.put("held", value(2), tier="device")
        with store.hold("a", "device"):
            link.launching = True
        link.launching = False
        store.delete("a")
        errors: list[BaseException] = []

        def put() -> None:
            try:
                store.put("b", value(3), tier="device")
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        with store.hold("held", "device"):
            worker = threading.Thread(target=put)
            worker.start()
            worker.join(0.2)
            assert worker.is_alive(), "the put did not wait for the room a kernel still uses"
            closer = threading.Thread(target=store.close)
            closer.start()
            closer.join(PATIENCE)
            assert not closer.is_alive(), "close hangs"
            worker.join(PATIENCE)
            assert not worker.is_alive(), "the put waits on after the store closed"
        assert len(errors) == 1 and isinstance(errors[0], StoreClosedError), errors
    finally:
        link.finish()
        if store.is_open:
            store.close()
        link.close()


def test_a_verb_on_a_closed_store_says_it_was_closed() -> None:
    store = SyncTierStore([HostTier("1MiB")]).open()
    store.put("a", value(1))
    store.close()
    with pytest.raises(StoreClosedError, match="the store is closed"):
        store.get("a")
    never = SyncTierStore([HostTier("1MiB")])
    with pytest.raises(StoreClosedError, match="not open"):
        never.get("a")
    store.open()  # (a closed store opens again)
    try:
        assert "a" not in store  # (memory tiers only: nothing outlives the close)
    finally:
        store.close()


async def _busy_store(root: Any) -> TierStore:
    """A store whose next close has a flush that takes a while (40 dirty values), and ``k`` clean
    on disk."""
    store = TierStore([HostTier(64 * VALUE), DiskTier(root, "64MiB", durable=True)])
    await store.open()
    await store.put("k", torch.zeros(16), tier="host")
    await store.flush()
    for i in range(40):
        await store.put(f"d{i}", value(i), tier="host")
    return store


async def _on_disk(root: Any, key: str) -> float:
    reopened = TierStore([DiskTier(root, "64MiB")])
    await reopened.open()
    try:
        return float((await reopened.get(key))[0])
    finally:
        await reopened.aclose()


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02])
async def test_a_write_hold_released_during_the_close_is_written(tmp_path: Any, delay: float) -> None:
    store = await _busy_store(tmp_path / "d")
    released = asyncio.get_running_loop().create_future()

    async def writer() -> None:
        async with store.hold("k", "host", write=True) as buffer:  # on a value clean on disk
            buffer.fill_(7.0)
            await released

    holding = asyncio.ensure_future(writer())
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(delay)
    released.set_result(None)
    await asyncio.wait_for(holding, PATIENCE)
    await asyncio.wait_for(closing, PATIENCE)
    assert await _on_disk(tmp_path / "d", "k") == 7.0  # (was lost: the flush had not waited for it)


async def test_a_put_in_flight_when_the_close_begins_is_written_or_refused(tmp_path: Any) -> None:
    store = await _busy_store(tmp_path / "d")
    released = asyncio.get_running_loop().create_future()

    async def holder() -> None:
        async with store.hold("k", "host", write=True):
            await released

    holding = asyncio.ensure_future(holder())
    await asyncio.sleep(0.01)
    put = asyncio.ensure_future(store.put("k", torch.full((16,), 5.0), tier="host"))  # waits for the hold
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0.005)
    released.set_result(None)
    await asyncio.wait_for(holding, PATIENCE)
    try:
        await asyncio.wait_for(put, PATIENCE)
        acknowledged = True
    except StoreClosedError:
        acknowledged = False
    await asyncio.wait_for(closing, PATIENCE)
    # (it was acknowledged after the close's flush had passed, and lost)
    assert await _on_disk(tmp_path / "d", "k") == (5.0 if acknowledged else 0.0)


async def test_a_write_hold_asked_for_during_the_close_is_refused(tmp_path: Any) -> None:
    store = await _busy_store(tmp_path / "d")
    reader_done = asyncio.get_running_loop().create_future()

    async def reader() -> None:
        async with store.hold("k", "host"):
            await reader_done

    reading = asyncio.ensure_future(reader())
    await asyncio.sleep(0.01)
    write = asyncio.ensure_future(store.hold("k", "host", write=True).__aenter__())  # waits for the reader
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0)
    reader_done.set_result(None)
    await asyncio.wait_for(reading, PATIENCE)
    with pytest.raises(StoreClosedError, match="no write hold"):
        await asyncio.wait_for(write, PATIENCE)
    await asyncio.wait_for(closing, PATIENCE)
    assert await _on_disk(tmp_path / "d", "k") == 0.0


# -- a close that fails -------------------------------------------------------------------------


class HeldWrites(FileIO):
    """Data writes that, once ``armed``, wait until ``let_go()``, then fail as a full disk's
    (``fail``) or go on: a close whose flush the test holds, then fails or lets succeed."""

    def __init__(self) -> None:
        self.armed = False
        self.fail = True
        self.entered = threading.Event()
        self._gate = threading.Event()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if self.armed:
            self.entered.set()
            self._gate.wait(PATIENCE)
            if self.fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwrite(fd, data, offset)

    def let_go(self) -> None:
        self._gate.set()

@asynccontextmanager
async def held_store(tmp_path: Any) -> AsyncIterator[tuple[TierStore, HeldWrites]]:
    """An open host + disk store whose disk writes ``HeldWrites`` can hold (the close's flush),
    closed at the end if a test left it open (its held writes let go first)."""
    io = HeldWrites()
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB", io=io)])
    await store.open()
    try:
        yield store, io
    finally:
        io.let_go()
        if store.is_open:
            await store.aclose()



async def close_held(store: TierStore, io: HeldWrites) -> asyncio.Future[None]:
    """A close started with its flush's writes held (returned once it is in them)."""
    io.armed = True
    closing = asyncio.ensure_future(store.aclose())
    entered = await asyncio.to_thread(io.entered.wait, PATIENCE)
    assert entered, "the close never wrote"
    return closing


async def end_close(closing: asyncio.Future[None], io: HeldWrites, fails: bool) -> None:
    """Let the close's writes go: it fails (the store stays open) or succeeds."""
    io.fail = fails
    io.let_go()
    done, _ = await asyncio.wait([closing], timeout=PATIENCE)
    assert done, "close hangs"
    io.armed = False
    if fails:
        assert isinstance(closing.exception(), TierStoreError), closing.exception()
    else:
        assert closing.exception() is None


async def on_disk(root: Any) -> dict[str, float]:
    reopened = TierStore([DiskTier(root, "16MiB")])
    await reopened.open()
    try:
        return {key: float((await reopened.get(key))[0]) for key in reopened.keys()}
    finally:
        await reopened.aclose()


@pytest.mark.parametrize("close", ["fails", "succeeds"])
async def test_a_put_waiting_for_room_during_a_close_waits_for_its_outcome(tmp_path: Any, close: str) -> None:
    io = HeldWrites()
    store, _, link = await kernel_store(DiskTier(tmp_path / "d", "16MiB", io=io))
    try:
        await fill_device(store, link)
        async with store.hold("held", "device"):  # nothing to evict: only a's room can come
            waiting = request(store, "put")
            await until_waiting(waiting)
            closing = await close_held(store, io)
            await until_waiting(waiting)  # (was: StoreClosedError at once, though the close failed)
            await end_close(closing, io, fails=close == "fails")
            if close == "fails":
                assert store.is_open
                await until_waiting(waiting)  # still waiting for room, as before the close
                link.finish()
                assert await outcome(waiting) is None
                assert float((await store.get("b"))[0]) == 4.0
            else:
                error = await outcome(waiting)
                assert isinstance(error, StoreClosedError), error
                link.finish()
        if store.is_open:
            await close_in_time(store)
        assert await on_disk(tmp_path / "d") == ({"held": 2.0, "b": 4.0} if close == "fails" else {"held": 2.0})
    finally:
        io.let_go()
        link.finish()
        if store.is_open:
            await store.aclose()
        link.close()


@pytest.mark.parametrize("close", ["fails", "succeeds"])
async def test_a_write_hold_asked_for_during_a_close_waits_for_its_outcome(tmp_path: Any, close: str) -> None:
    async with held_store(tmp_path) as (store, io):
        await store.put("k", value(0), tier="host")
        reader_done = asyncio.get_running_loop().create_future()

        async def reader() -> None:
            async with store.hold("k", "host"):
                await reader_done

        async def writer() -> None:
            async with store.hold("k", "host", write=True) as buffer:
                buffer.fill_(7.0)

        reading = asyncio.ensure_future(reader())
        await asyncio.sleep(0)
        writing = asyncio.ensure_future(writer())  # waits for the reader
        await until_waiting(writing)
        closing = await close_held(store, io)
        reader_done.set_result(None)
        await asyncio.wait_for(reading, PATIENCE)
        await until_waiting(writing)  # (was: StoreClosedError, though the close failed)
        await end_close(closing, io, fails=close == "fails")
        error = await outcome(writing)
        if close == "fails":
            assert error is None  # granted, after the close
            assert float((await store.get("k"))[0]) == 7.0
            await close_in_time(store)
            assert await on_disk(tmp_path / "d") == {"k": 7.0}
        else:
            assert isinstance(error, StoreClosedError) and "no write hold" in str(error), error
            assert await on_disk(tmp_path / "d") == {"k": 0.0}


@pytest.mark.parametrize("close", ["fails", "succeeds"])
async def test_a_put_made_during_a_close_waits_for_its_outcome(tmp_path: Any, close: str) -> None:
    async with held_store(tmp_path) as (store, io):
        await store.put("k", value(0), tier="host")
        closing = await close_held(store, io)
        put = asyncio.ensure_future(store.put("n", value(9), tier="host"))
        await until_waiting(put)  # (was: StoreClosedError at once)
        await end_close(closing, io, fails=close == "fails")
        error = await outcome(put)
        if close == "fails":
            assert error is None
            assert float((await store.get("n"))[0]) == 9.0
            await close_in_time(store)
            assert await on_disk(tmp_path / "d") == {"k": 0.0, "n": 9.0}
        else:
            assert isinstance(error, StoreClosedError), error
            assert await on_disk(tmp_path / "d") == {"k": 0.0}


async def test_a_write_hold_asked_for_while_the_close_waits_for_write_holds_is_refused(tmp_path: Any) -> None:
    """The one request a close refuses rather than waits with: its holder's may be waiting for
    it (here another task's, which no context marks), and the close waits for that one."""
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")])
    await store.open()
    try:
        await store.put("a", value(1), tier="host")
        await store.put("b", value(2), tier="host")
        asked = asyncio.get_running_loop().create_future()

        async def other() -> None:  # started outside any hold
            await asked
            async with store.hold("b", "host", write=True) as buffer:
                buffer.fill_(5.0)

        helper = asyncio.ensure_future(other())
        holding = asyncio.get_running_loop().create_future()
        close_started: asyncio.Future[asyncio.Future[None]] = asyncio.get_running_loop().create_future()

        async def holder() -> BaseException | None:
            async with store.hold("a", "host", write=True) as buffer:
                buffer.fill_(3.0)
                holding.set_result(None)
                await until_waiting(await close_started)  # the close waits for this hold
                asked.set_result(None)
                return await outcome(helper)  # (a wait here would never end: the close waits for us)

        holds_a = asyncio.ensure_future(holder())
        await holding
        closing = asyncio.ensure_future(store.aclose())  # (from outside the hold)
        close_started.set_result(closing)
        error = await asyncio.wait_for(holds_a, PATIENCE)
        assert isinstance(error, StoreClosedError) and "waits for the write holds open" in str(error), error
        await asyncio.wait_for(closing, PATIENCE)
        assert await on_disk(tmp_path / "d") == {"a": 3.0, "b": 2.0}
    finally:
        if store.is_open:
            await store.aclose()


# -- verbs started before the seal, closes racing ---------------------------------------------


@pytest.mark.parametrize("verb", ["delete", "pop"])
@pytest.mark.parametrize("yields", [0, 1, 3])
async def test_a_delete_paused_before_the_seal_is_done_or_refused(tmp_path: Any, verb: str, yields: int) -> None:
    """A delete (or pop) that passed its open check before the close sealed, then waited (here
    for a point-in-time view to end), and went on once the close's flush was past: it deletes
    before the close ends, or is refused; never acknowledged with the key still on disk."""
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")])
    await store.open()
    try:
        await store.put("k", value(1), tier="disk")
        await store.put("j", value(2), tier="host")  # (the close has something to flush)
        view = store._engine.freeze()  # (as export_zarr holds it: deletes wait until it ends)
        await view.__aenter__()
        waiting = asyncio.ensure_future(store.delete("k") if verb == "delete" else store.pop("k"))
        await until_waiting(waiting)
        disk = store._engine.disk
        drain = disk.drain

        async def after_the_flush() -> None:  # (the close's last step before the tiers close)
            if store._engine.frozen:
                await view.__aexit__(None, None, None)
                for _ in range(yields):
                    await asyncio.sleep(0)
            await drain()

        disk.drain = after_the_flush  # type: ignore[method-assign]
        await close_in_time(store)
        error = await outcome(waiting)
        kept = await on_disk(tmp_path / "d")
        if error is None:
            assert "k" not in kept, "an acknowledged delete was lost"  # (was: acknowledged, deleting nothing)
        else:
            assert isinstance(error, StoreClosedError), error
            assert kept["k"] == 1.0
    finally:
        if store.is_open:
            await store.aclose()


async def test_a_second_close_during_a_sealed_one_waits_for_its_outcome(tmp_path: Any) -> None:
    """A second close while the first is sealed does not return with the store still open: it
    waits, and closes the store itself when the first failed."""
    async with held_store(tmp_path) as (store, io):
        await store.put("k", value(1), tier="host")
        closing = await close_held(store, io)
        second = asyncio.ensure_future(store.aclose())
        await until_waiting(second)  # (was: returned at once)
        await end_close(closing, io, fails=True)
        assert await outcome(second) is None
        assert not store.is_open  # (was: open, k only in memory)
        assert await on_disk(tmp_path / "d") == {"k": 1.0}
