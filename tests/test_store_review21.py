"""Races of the store's concurrent verbs found by review 21 (issue 15 area): a write-through put
caching a value a racing put replaced, a pop deleting a value a racing put committed, a
cancelled ``aclose`` cancelling a commit under way, an entry left behind by a cancelled put
racing a delete, and the power-cut recorder's view of the durable small put. Each interleaving
is driven by a gate on the catalog's transactions and by waiting for explicit states, never by
sleeping."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import TierStore
from tierstore.disk.catalog import Catalog, CatalogLayout, DiskRecord
from tierstore.faults.powercut import Recorder
from tierstore.tiers import DiskTier, HostTier


class Gate:
    """Catalog transactions that ``match`` their changes wait while the gate is closed;
    ``entered`` is set once one of them is waiting."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.match: Callable[[Sequence[tuple[str, Any]]], bool] = lambda changes: False

    def close(self, match: Callable[[Sequence[tuple[str, Any]]], bool]) -> None:
        self.match = match
        self.entered.clear()
        self.open.clear()

    async def reached(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), "the gated transaction never started"


@pytest.fixture
def gate() -> Iterator[Gate]:
    state = Gate()
    real = Catalog._write_sync

    def write(self: Catalog, changes: Any, layout: Any) -> None:
        if state.match(changes):
            state.entered.set()
            assert state.open.wait(10), "gate left closed"
        real(self, changes, layout)

    Catalog._write_sync = write  # type: ignore[method-assign]
    try:
        yield state
    finally:
        state.open.set()
        Catalog._write_sync = real  # type: ignore[method-assign]


def of_key(key: str, deletes: bool | None = None) -> Callable[[Sequence[tuple[str, Any]]], bool]:
    """Changes naming ``key`` (only its deletes / only its puts when ``deletes`` says so)."""
    return lambda changes: any(k == key and (deletes is None or (r is None) == deletes) for k, r in changes)


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until ``condition`` holds (bounded in loop turns, not in time)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def lock_waited(store: TierStore, key: str) -> Callable[[], bool]:
    """Whether some task waits for ``key``'s disk lock (its catalog change is queued behind
    the one under way)."""

    def waited() -> bool:
        entry = store._engine.entries.get(key)
        return entry is not None and bool(getattr(entry.disk_lock, "_waiters", None))

    return waited


def filled(value: int, n: int) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


@pytest.mark.parametrize("durable_disk", [False, True])
@pytest.mark.parametrize("other_size", [256, 16])
async def test_write_through_put_does_not_cache_the_value_a_racing_put_replaced(
    tmp_path: Path, gate: Gate, durable_disk: bool, other_size: int
) -> None:
    def tiers() -> list[Any]:
        return [HostTier("1MiB"), DiskTier(tmp_path, "64MiB", durable=durable_disk, chunk_size="64KiB")]

    first, second = filled(1, 256), filled(2, other_size)
    async with TierStore(tiers()) as store:
        await store.put("k", filled(0, 256), "disk")
        gate.close(of_key("k"))
        a = asyncio.ensure_future(store.put("k", first, durable=True))
        await gate.reached()  # the durable put's commit is on the writer thread
        b = asyncio.ensure_future(store.put("k", second, "disk", durable=False))
        await until(lock_waited(store, "k"))  # the second put waits for the key's disk lock
        gate.open.set()
        await asyncio.gather(a, b)  # (neither raises: before the fix one copied 256 bytes into 16)
        assert torch.equal(await store.get("k"), second)
        assert torch.equal(await store.read("k"), second)
    async with TierStore(tiers()) as store:
        assert torch.equal(await store.get("k"), second)


async def test_pop_never_deletes_a_value_a_racing_put_committed(tmp_path: Path, gate: Gate) -> None:
    async with TierStore([DiskTier(tmp_path, "64MiB", durable=True, chunk_size="64KiB")]) as store:
        await store.put("k", filled(1, 64))
        gate.close(of_key("k", deletes=False))
        put = asyncio.ensure_future(store.put("k", filled(2, 64)))
        await gate.reached()  # the put's commit is under way, holding the key's disk lock
        pop = asyncio.ensure_future(store.pop("k"))
        await until(lock_waited(store, "k"))  # the pop read the old value and waits to delete
        gate.open.set()
        _, popped = await asyncio.gather(put, pop)
        # Serial orders: put then pop (2 popped, key gone) or pop then put (1 popped, 2 kept).
        if int(popped[0]) == 2:
            assert "k" not in store
        else:
            assert int(popped[0]) == 1 and torch.equal(await store.get("k"), filled(2, 64))


async def test_cancelled_aclose_leaves_a_commit_under_way_alone_and_can_close_again(tmp_path: Path, gate: Gate) -> None:
    def tiers() -> list[Any]:
        return [DiskTier(tmp_path, "64MiB", durable=True, chunk_size="64KiB")]

    store = TierStore(tiers())
    await store.open()
    await store.put("slow", filled(1, 256))
    gate.close(of_key("slow"))
    put = asyncio.ensure_future(store.put("slow", filled(2, 256)))
    await gate.reached()
    closing = asyncio.ensure_future(store.aclose())
    await until(lambda: store._engine.closing)
    for _ in range(5):  # (the close is waiting for the writes under way)
        await asyncio.sleep(0)
    assert not closing.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not put.done()  # the commit goes on
    gate.open.set()
    await put  # committed: not cancelled by the close
    assert store.is_open  # a cancelled close leaves the store open ...
    assert torch.equal(await store.get("slow"), filled(2, 256))
    await store.aclose()  # ... and closing again closes it
    assert not store.is_open
    async with TierStore(tiers()) as reopened:
        assert torch.equal(await reopened.get("slow"), filled(2, 256))
        assert reopened.stats()["tiers"]["disk"]["used"] == 256


@pytest.mark.parametrize("nbytes", [1000, 20_000])  # inline in the catalog, and in an extent
async def test_cancelled_put_racing_a_delete_leaves_no_entry(tmp_path: Path, gate: Gate, nbytes: int) -> None:
    async with TierStore([DiskTier(tmp_path, "64MiB", durable=True, chunk_size="64KiB")]) as store:
        await store.put("a", filled(1, 16))
        gate.close(of_key("a", deletes=True))
        delete = asyncio.ensure_future(store.delete("a"))
        await gate.reached()  # the delete's commit is under way, holding the key's disk lock
        put = asyncio.ensure_future(store.put("a", filled(2, nbytes), "disk", durable=True))
        await until(lock_waited(store, "a"))
        put.cancel()  # gives up before its commit: the delete wins
        gate.open.set()
        await delete
        with pytest.raises(asyncio.CancelledError):
            await put
        assert "a" not in store and len(store) == 0
        assert "a" not in store._engine.entries  # (no invisible entry left behind for good)
        await store.put("a", filled(3, 16))
        assert torch.equal(await store.get("a"), filled(3, 16))


class ThreadRecorder(Recorder):
    """The power-cut recorder, noting the thread each catalog commit scope is entered on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    @contextlib.contextmanager
    def catalog_commit(
        self, changes: Sequence[tuple[str, DiskRecord | None]], layout: CatalogLayout | None
    ) -> Iterator[None]:
        self.threads.append(threading.get_ident())
        with super().catalog_commit(changes, layout):
            yield


async def test_power_cut_recorder_sees_the_durable_small_put_hand_over(tmp_path: Path) -> None:
    # The fault harness must run the path users run: a durable small put handed to the
    # catalog's writer thread (its commit scope entered there), not the awaited commit.
    io = ThreadRecorder()
    async with TierStore([DiskTier(tmp_path, "64MiB", durable=True, chunk_size="64KiB", io=io)]) as store:
        before = len(io.threads)
        for i in range(8):
            await store.put(f"k{i}", filled(i, 64))
        scopes = io.threads[before:]
    assert len(scopes) == 8
    loop_thread = threading.get_ident()
    assert all(t != loop_thread for t in scopes)
    async with TierStore([DiskTier(tmp_path, "64MiB", durable=True, chunk_size="64KiB")]) as store:
        for i in range(8):
            assert torch.equal(await store.get(f"k{i}"), filled(i, 64))
