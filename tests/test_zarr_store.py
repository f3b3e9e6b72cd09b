"""``TierZarrStore``: zarr's own store conformance suite, and zarr arrays over the tiers."""

from __future__ import annotations

import asyncio
import gc
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
import zarr.api.asynchronous as zasync
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, cpu, default_buffer_prototype
from zarr.testing.store import StoreTests

from policies import MIN, ScheduleLearned
from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.errors import InvalidKeyError, StoreClosedError
from tierstore.zarr import LoopDeadlockError, StoreNotInProcessError, TierZarrStore


def tiers(root: Path) -> list[Any]:
    return [DeviceTier("cpu", "64KiB"), HostTier("128KiB"), DiskTier(root, "64MiB")]


@pytest.fixture
def sync_store(tmp_path: Path) -> Iterator[SyncTierStore]:
    with SyncTierStore(tiers(tmp_path / "disk")) as store:
        yield store


class TestTierZarrStore(StoreTests[TierZarrStore, cpu.Buffer]):
    """zarr's ``StoreTests``, unchanged; the helpers go around the adapter through plain verbs."""

    store_cls = TierZarrStore
    buffer_cls = cpu.Buffer

    async def set(self, store: TierZarrStore, key: str, value: Buffer) -> None:
        data = torch.from_numpy(np.array(value.as_numpy_array(), dtype=np.uint8))
        SyncTierStore.wrap(store.tier_store).put(store.prefix + key, data)

    async def get(self, store: TierZarrStore, key: str) -> Buffer:
        data = SyncTierStore.wrap(store.tier_store).get(store.prefix + key)
        return self.buffer_cls.from_bytes(data.numpy().tobytes())

    @pytest.fixture
    def store_kwargs(self, sync_store: SyncTierStore) -> dict[str, Any]:
        return {"store": sync_store, "prefix": "zarr/"}

    def test_store_repr(self, store: TierZarrStore) -> None:
        assert repr(store).startswith("TierZarrStore(TierStore(") and "prefix='zarr/'" in repr(store)

    def test_store_supports_writes(self, store: TierZarrStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: TierZarrStore) -> None:
        assert store.supports_listing


# -- zarr arrays and groups over the tiers ---------------------------------------------------------


def test_array_larger_than_memory_tiers_round_trips(sync_store: SyncTierStore) -> None:
    values = np.random.default_rng(0).standard_normal((512, 300)).astype(np.float32)  # 600 KiB > 192 KiB
    array = zarr.create_array(TierZarrStore(sync_store), name="big", shape=values.shape, chunks=(64, 100), dtype="f4")
    array[:] = values
    np.testing.assert_array_equal(array[:], values)
    np.testing.assert_array_equal(array[100:333, 7:250], values[100:333, 7:250])
    np.testing.assert_array_equal(array[-1, ::7], values[-1, ::7])
    assert "disk" in sync_store.where("zarr/big/c/0/0") or "host" in sync_store.where("zarr/big/c/0/0")
    assert sum(sync_store.stats()["tiers"][name]["used"] for name in ("device", "host")) <= 192 * 1024


def test_groups_and_members(sync_store: SyncTierStore) -> None:
    root = zarr.open_group(TierZarrStore(sync_store), mode="w")
    sub = root.create_group("a").create_group("b")
    sub.create_array("x", shape=(10,), chunks=(3,), dtype="i4")[:] = np.arange(10)
    root.create_array("y", shape=(2, 2), dtype="f8", fill_value=1.5)
    again = zarr.open_group(TierZarrStore(sync_store), mode="r")
    assert sorted(again.group_keys()) == ["a"] and sorted(again.array_keys()) == ["y"]
    np.testing.assert_array_equal(again["a/b/x"][:], np.arange(10))
    assert (again["y"][:] == 1.5).all()  # never written: the fill value, no chunk stored
    assert not any(key.startswith("zarr/y/c") for key in sync_store.keys())


def test_disk_tier_reopened_after_close(tmp_path: Path) -> None:
    values = np.arange(40_000, dtype=np.int64).reshape(200, 200)
    with SyncTierStore(tiers(tmp_path / "disk")) as store:
        zarr.create_array(TierZarrStore(store), name="a", shape=values.shape, chunks=(50, 50), dtype="i8")[:] = values
    with SyncTierStore(tiers(tmp_path / "disk")) as store:
        np.testing.assert_array_equal(zarr.open_array(TierZarrStore(store), path="a", mode="r")[:], values)


def test_read_only_adapter_refuses_writes(sync_store: SyncTierStore) -> None:
    zarr.create_array(TierZarrStore(sync_store), name="a", shape=(4,), dtype="u1")[:] = 7
    reader = TierZarrStore(sync_store, read_only=True)
    array = zarr.open_array(reader, path="a", mode="r")
    assert (array[:] == 7).all()
    with pytest.raises(ValueError, match="read-only"):
        array[:] = 1
    with pytest.raises(ValueError, match="read-only"):
        zarr.storage.StorePath(reader).store.set_sync("a/c/0", cpu.Buffer.from_bytes(b"x"))
    writer = reader.with_read_only(False)
    assert writer == reader and not writer.read_only


HOSTILE = ["../../escape", "/abs/zarr.json", "a/../../b", "a\x00b", "é/ü", "..", "c/" + "9" * 300]


def test_hostile_keys_stay_inside_the_prefix(tmp_path: Path, sync_store: SyncTierStore) -> None:
    adapter = TierZarrStore(sync_store)
    for i, key in enumerate(HOSTILE):
        adapter.set_sync(key, cpu.Buffer.from_bytes(bytes([i])))
    assert sorted(sync_store.keys()) == sorted("zarr/" + key for key in HOSTILE)
    for i, key in enumerate(HOSTILE):
        assert adapter.get_sync(key).to_bytes() == bytes([i])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk"]  # nothing written beside the store
    whole = TierZarrStore(sync_store, prefix="")
    with pytest.raises(InvalidKeyError):  # the store's own records are out of reach
        whole.set_sync("__tierstore__/namespaces", cpu.Buffer.from_bytes(b"{}"))
    assert whole.get_sync("__tierstore__/namespaces") is None


def test_plain_verbs_and_adapter_see_the_same_keys(sync_store: SyncTierStore) -> None:
    adapter = TierZarrStore(sync_store)
    adapter.set_sync("g/zarr.json", cpu.Buffer.from_bytes(b"{}"))
    sync_store.put("zarr/g/extra", torch.tensor([1, 2], dtype=torch.uint8))
    sync_store.put("other/key", torch.zeros(3))
    listed = zarr.core.sync.sync(zarr.core.sync._collect_aiterator(adapter.list()))
    assert sorted(listed) == ["g/extra", "g/zarr.json"]
    sync_store.delete("zarr/g/extra")
    assert zarr.core.sync.sync(zarr.core.sync._collect_aiterator(adapter.list_dir("g"))) == ("zarr.json",)
    assert sync_store.read("zarr/g/zarr.json").dtype == torch.uint8


def test_listing_many_keys_by_directory(sync_store: SyncTierStore) -> None:
    adapter = TierZarrStore(sync_store)
    names = [f"arr/c/{i}/{j}" for i in range(40) for j in range(40)] + ["arr/zarr.json", "arr.x", "b/zarr.json"]
    for name in names:
        sync_store.put("zarr/" + name, torch.zeros(1, dtype=torch.uint8))
    collect = zarr.core.sync._collect_aiterator
    assert sorted(zarr.core.sync.sync(collect(adapter.list_dir("")))) == ["arr", "arr.x", "b"]
    assert sorted(zarr.core.sync.sync(collect(adapter.list_dir("arr/")))) == ["c", "zarr.json"]
    assert len(zarr.core.sync.sync(collect(adapter.list_dir("arr/c")))) == 40
    assert len(zarr.core.sync.sync(collect(adapter.list_prefix("arr/c/3")))) == 11 * 40  # 3, 30..39


def test_adapters_compare_equal_and_pickle_in_process(sync_store: SyncTierStore, tmp_path: Path) -> None:
    one, two = TierZarrStore(sync_store), TierZarrStore(sync_store.store, prefix="zarr")
    assert one == two and hash(one) == hash(two) and one != TierZarrStore(sync_store, prefix="other/")
    copy = pickle.loads(pickle.dumps(one))
    assert copy == one and copy.tier_store is sync_store.store
    with SyncTierStore(tiers(tmp_path / "gone")) as gone:
        blob = pickle.dumps(TierZarrStore(gone))
    del gone
    gc.collect()
    with pytest.raises(StoreNotInProcessError, match="only in the process"):
        pickle.loads(blob)


async def test_async_store_on_the_callers_loop(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path / "disk")) as store:
        adapter = TierZarrStore(store)
        array = await zasync.create_array(adapter, name="a", shape=(100,), chunks=(10,), dtype="i2")
        await array.setitem(slice(None), np.arange(100, dtype=np.int16))
        np.testing.assert_array_equal(await array.getitem(slice(5, 95)), np.arange(5, 95))
        assert len(store.keys()) == 12  # the root group, the array, 10 chunks


async def test_blocking_zarr_call_on_the_stores_loop_raises_instead_of_hanging(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path / "disk")) as store:
        adapter = TierZarrStore(store)
        await zasync.create_array(adapter, name="a", shape=(4,), dtype="u1")
        with pytest.raises(LoopDeadlockError, match="async API"):
            zarr.open_array(adapter, path="a", mode="r")[:]  # blocks this loop's thread on zarr's loop


async def test_bridge_from_another_thread_does_not_block_the_store(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path / "disk")) as store:
        adapter = TierZarrStore(store)
        await zasync.create_array(adapter, name="a", shape=(64,), chunks=(8,), dtype="u1", fill_value=3)

        def blocking_read() -> np.ndarray:
            return zarr.open_array(adapter, path="a", mode="r")[:]

        values = await asyncio.to_thread(blocking_read)  # this loop stays free to serve the store
        assert (values == 3).all()


def test_sequential_reads_prefetch_the_following_chunks(sync_store: SyncTierStore) -> None:
    values = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)  # 256 KiB > the memory tiers
    array = zarr.create_array(TierZarrStore(sync_store), name="a", shape=values.shape, chunks=(4, 256), dtype="f4")
    array[:] = values
    before = sync_store.stats()["prefetch"]["issued"]
    for start in range(0, 256, 8):
        np.testing.assert_array_equal(array[start : start + 8], values[start : start + 8])
    stats = sync_store.stats()["prefetch"]
    assert stats["issued"] > before and stats["useful"] > 0


def test_mark_step_learns_the_epoch_order(tmp_path: Path) -> None:
    schedule = ScheduleLearned()
    with SyncTierStore(tiers(tmp_path / "disk"), prefetch=schedule, eviction={"device": lambda: MIN(schedule.next_use), "host": lambda: MIN(schedule.next_use)}) as store:
        adapter = TierZarrStore(store, prefetch=False)
        order = np.random.default_rng(1).permutation(64)  # 64 chunks of 2 KiB: twice the read tier
        array = zarr.create_array(adapter, name="a", shape=(64 * 512,), chunks=(512,), dtype="f4")
        array[:] = np.arange(64 * 512, dtype=np.float32)
        hits = []
        for _ in range(3):
            before = store.stats()["tiers"]["device"]["hits"]
            for i in order:
                assert array[i * 512] == i * 512
            adapter.mark_step()
            hits.append(store.stats()["tiers"]["device"]["hits"] - before)
        assert schedule.phases == 3 and hits[2] > hits[0]


def test_default_prototype_buffers(sync_store: SyncTierStore) -> None:
    adapter = TierZarrStore(sync_store)
    adapter.set_sync("k", cpu.Buffer.from_bytes(b"abcdef"))
    assert adapter.get_sync("k", prototype=default_buffer_prototype()).to_bytes() == b"abcdef"
    assert adapter.get_sync("missing") is None


def test_blocking_zarr_call_on_a_sync_stores_loop_thread_raises_instead_of_hanging(sync_store: SyncTierStore) -> None:
    # zarr's open_array(mode="r") calls with_read_only from its loop thread: that must not make a
    # blocking round trip to the store's loop, or the deadlock goes undetected and hangs.
    adapter = TierZarrStore(sync_store)
    zarr.create_array(adapter, name="a", shape=(4,), dtype="u1")

    async def on_the_loop() -> Any:
        return zarr.open_array(adapter, path="a", mode="r")[:]

    outcome: list[BaseException] = []

    def call() -> None:
        try:
            sync_store.run(on_the_loop())
        except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "the blocking zarr call on the store's loop thread hung"
    assert len(outcome) == 1 and isinstance(outcome[0], LoopDeadlockError)


@pytest.mark.parametrize("byte_range", [RangeByteRequest(-3, 5), RangeByteRequest(2, -1), OffsetByteRequest(-2), SuffixByteRequest(-1)])
def test_negative_byte_ranges_are_refused(sync_store: SyncTierStore, byte_range: Any) -> None:
    adapter = TierZarrStore(sync_store)
    adapter.set_sync("k", cpu.Buffer.from_bytes(b"0123456789"))
    with pytest.raises(ValueError, match="negative"):
        adapter.get_sync("k", byte_range=byte_range)
    assert adapter.get_sync("k", byte_range=RangeByteRequest(8, 20)).to_bytes() == b"89"  # past the end: clipped
    assert adapter.get_sync("k", byte_range=OffsetByteRequest(50)).to_bytes() == b""


async def test_a_short_blocking_zarr_call_on_the_stores_loop_is_not_taken_for_a_deadlock(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path / "disk")) as store:
        adapter = TierZarrStore(store)
        array = await zasync.create_array(adapter, name="a", shape=(4,), dtype="u1")
        await array.setitem(slice(None), np.ones(4, dtype=np.uint8))

        outcome: list[Any] = []

        def read_soon() -> None:
            time.sleep(0.05)
            try:
                outcome.append(zarr.open_array(adapter, path="a", mode="r")[:])
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                outcome.append(exc)

        reader = threading.Thread(target=read_soon)
        reader.start()  # a thread, not a task: it must run while this loop is blocked
        zarr.core.sync.sync(asyncio.sleep(0.6))  # this loop blocked a while in zarr, on unrelated work
        await asyncio.to_thread(reader.join)
        assert isinstance(outcome[0], np.ndarray) and (outcome[0] == 1).all()  # the read waited: no deadlock


def test_a_blocking_call_on_an_async_store_whose_loop_is_idle_raises_instead_of_hanging() -> None:
    loop = asyncio.new_event_loop()
    store = loop.run_until_complete(TierStore([HostTier("1MiB")]).open())
    z = TierZarrStore(store)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            z.get_sync("x", prototype=default_buffer_prototype())
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "get_sync hung"
    assert isinstance(outcome[0], StoreClosedError) and "not running" in str(outcome[0])
    loop.run_until_complete(store.aclose())
    loop.close()


def test_a_disk_tier_to_promote_reads_to_is_refused_when_made(sync_store: SyncTierStore) -> None:
    """Whole-chunk reads worked and a byte range raised "hold needs a memory tier"."""
    with pytest.raises(ValueError, match=r"tier='disk' is not a memory tier: reads promote chunks to a memory tier"):
        TierZarrStore(sync_store, tier="disk")


def test_a_blocking_call_from_the_store_loop_is_a_loop_deadlock_error(sync_store: SyncTierStore) -> None:
    from tierstore import LoopDeadlockError
    from tierstore.sync import call_now

    def blocking() -> None:
        sync_store.put("x", torch.ones(2))  # (on the store's own loop thread)

    with pytest.raises(LoopDeadlockError, match="from the tierstore loop thread"):
        call_now(blocking)
