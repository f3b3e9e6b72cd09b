"""zarr v3 export and import."""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from tierstore import DeviceTier, DiskTier, HostTier, TierStore, snapshot
from tierstore.errors import InvalidKeyError, TierFullError
from tierstore.snapshot import array_name
from tierstore.tensors import supported_dtypes
from tierstore.testing import ODD_KEYS, same_bytes, sample


def tiers(tmp_path: Path, name: str = "disk") -> list:
    return [DeviceTier("cpu", "64KiB"), HostTier("128KiB"), DiskTier(tmp_path / name, "64MiB")]


async def test_every_dtype_and_odd_keys_round_trip(tmp_path: Path) -> None:
    values = {f"dtype/{dtype}": sample(dtype, (4, 3), seed=i) for i, dtype in enumerate(supported_dtypes())}
    values.update({key: torch.tensor([i, i + 0.5]) for i, key in enumerate(ODD_KEYS)})
    values["zero-d"] = torch.tensor(3.25, dtype=torch.bfloat16)
    values["empty"] = torch.empty(0, 5, dtype=torch.float8_e4m3fn)
    values["big"] = torch.randn(50_000)
    async with TierStore(tiers(tmp_path)) as store:
        for key, value in values.items():
            await store.put(key, value)
        assert await store.export_zarr(tmp_path / "snap.zarr") == len(values)
        with pytest.raises(FileExistsError):
            await store.export_zarr(tmp_path / "snap.zarr")
    async with TierStore(tiers(tmp_path, "other")) as fresh:
        assert await fresh.import_zarr(tmp_path / "snap.zarr") == len(values)
        assert sorted(fresh.keys()) == sorted(values)
        for key, value in values.items():
            assert same_bytes(await fresh.get(key), value), key


async def test_plain_zarr_reads_the_snapshot(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("layers.0.w/exp_avg", torch.arange(6.0).reshape(2, 3))
        await store.put("bf", torch.ones(3, dtype=torch.bfloat16))
        await store.export_zarr(tmp_path / "snap.zarr")
    group = zarr.open_group(tmp_path / "snap.zarr", mode="r")
    array = group[array_name("layers.0.w/exp_avg")]
    np.testing.assert_array_equal(array[:], np.arange(6.0, dtype=np.float32).reshape(2, 3))
    assert array.attrs["tierstore_key"] == "layers.0.w/exp_avg"
    bf = group[array_name("bf")]
    assert bf.dtype == np.uint16 and bf.attrs["tierstore_dtype"] == "bfloat16"
    assert (bf[:] == 0x3F80).all()  # 1.0 in bfloat16


def test_array_names_are_safe_file_names() -> None:
    for key in ODD_KEYS:
        name = array_name(key)
        assert "/" not in name and "\x00" not in name and name not in (".", "..") and len(name) <= 200
        assert not name.startswith((".", "_"))
    assert array_name("a.b-c_d") == "a.b-c_d" and array_name("a/b") == "a%2Fb"
    assert array_name("a/b") != array_name("a%2Fb")
    assert array_name("zarr.json") == "%7Aarr.json"  # (the group's own metadata file: export raised FileExistsError)


async def test_a_key_named_like_zarr_metadata_round_trips(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("zarr.json", torch.tensor([1, 2]))
        await store.export_zarr(tmp_path / "snap")
    async with TierStore(tiers(tmp_path / "other")) as other:
        await other.import_zarr(tmp_path / "snap")
        assert torch.equal(await other.get("zarr.json"), torch.tensor([1, 2]))


async def test_an_export_from_inside_the_callers_own_write_hold_raises(tmp_path: Path) -> None:
    """It waited for every write hold to end, the caller's own too: for ever."""
    from tierstore import EntryHeldError

    async with TierStore(tiers(tmp_path)) as store:
        await store.put("w", torch.zeros(10))
        async with store.hold("w", "host", write=True):
            with pytest.raises(EntryHeldError, match="inside your own write hold of 'w'"):
                await asyncio.wait_for(store.export_zarr(tmp_path / "snap"), 30)
        assert await store.export_zarr(tmp_path / "snap") == 1  # released: it works


async def test_export_does_not_move_entries(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        for i in range(20):
            await store.put(f"k{i}", torch.full((2048,), float(i)))
        before = {key: store.where(key) for key in store.keys()}
        await store.export_zarr(tmp_path / "snap.zarr")
        assert {key: store.where(key) for key in store.keys()} == before


async def test_large_values_are_written_and_read_in_several_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot, "CHUNK_BYTES", 4096)
    value = torch.randn(100, 37)  # 14.8 KB: several 4 KiB chunks
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("w", value)
        await store.put("scalar", torch.tensor(2.5))
        await store.export_zarr(tmp_path / "snap.zarr")
    array = zarr.open_array(tmp_path / "snap.zarr" / array_name("w"), mode="r")
    assert array.nchunks > 1 and array.chunks[1:] == (37,)
    async with TierStore(tiers(tmp_path, "other")) as fresh:
        await fresh.import_zarr(tmp_path / "snap.zarr")
        assert same_bytes(await fresh.get("w"), value) and (await fresh.get("scalar")).item() == 2.5


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


async def test_oversized_import_is_refused_before_reading(tmp_path: Path) -> None:
    # 12 GiB, never written (all fill value): reading it first would allocate all of it.
    zarr.create_group(tmp_path / "huge.zarr").create_array("big", shape=(3 << 30,), chunks=(1 << 20,), dtype="f4")
    async with TierStore([HostTier("64MiB")]) as store:
        before = _peak_rss_bytes()
        with pytest.raises(TierFullError, match="does not fit"):
            await store.import_zarr(tmp_path / "huge.zarr")
        assert _peak_rss_bytes() - before < 64 << 20
        assert len(store) == 0


async def test_many_arrays_that_do_not_fit_together_are_refused(tmp_path: Path) -> None:
    group = zarr.create_group(tmp_path / "many.zarr")
    for i in range(5):
        group.create_array(f"a{i}", shape=(16 << 10,), dtype="u1")  # 16 KiB each, 80 KiB in all
    async with TierStore([HostTier("64KiB")]) as store:
        with pytest.raises(TierFullError, match="in all"):
            await store.import_zarr(tmp_path / "many.zarr")
        assert len(store) == 0


@pytest.mark.parametrize(
    ("craft", "error"),
    [
        (lambda g: g.create_array("a", shape=(4,), dtype="u1", attributes={"tierstore_key": "__tierstore__/namespaces"}), InvalidKeyError),
        (lambda g: g.create_array("a", shape=(4,), dtype="u1", attributes={"tierstore_key": ""}), InvalidKeyError),
        (lambda g: g.create_array("a", shape=(4,), dtype="u1", attributes={"tierstore_dtype": "float64"}), ValueError),
        (lambda g: g.create_array("a", shape=(4,), dtype="u1", attributes={"tierstore_dtype": "no-such"}), ValueError),
        (lambda g: g.create_array("a", shape=(3,), dtype=str), TypeError),
        (lambda g: g.create_array("a", shape=(10,), chunks=(1 << 34,), dtype="f4"), TierFullError),
    ],
)
async def test_crafted_snapshot_is_refused_before_anything_is_put(tmp_path: Path, craft: Any, error: type) -> None:
    group = zarr.create_group(tmp_path / "crafted.zarr")
    group.create_array("fine", shape=(2,), dtype="f4")[:] = 1.0
    craft(group)
    async with TierStore(tiers(tmp_path)) as store:
        with pytest.raises(error):
            await store.import_zarr(tmp_path / "crafted.zarr")
        assert len(store) == 0


async def cancel_an_overwrite(
    store: TierStore, target: Path, new: int, started: Callable[[], bool], before: Callable[[], object] = lambda: None
) -> None:
    """Export ``kept`` to ``target``, put ``new`` more values, then (after ``before()``) export
    again over it and cancel that export once ``started()``: the cancellation must reach us."""
    await store.put("kept", torch.arange(5.0))
    await store.export_zarr(target)
    for i in range(new):
        await store.put(f"new{i}", torch.full((2048,), float(i)))
    before()
    export = asyncio.ensure_future(store.export_zarr(target, overwrite=True))
    while not started():
        await asyncio.sleep(0.001)
    export.cancel()
    with pytest.raises(asyncio.CancelledError):
        await export


# zarr's own writes, cancelled before they started, warn that they were never awaited.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
async def test_interrupted_export_leaves_the_previous_snapshot(tmp_path: Path) -> None:
    target = tmp_path / "snap.zarr"
    async with TierStore(tiers(tmp_path)) as store:
        # (cancelled once the new export has written part of its arrays)
        await cancel_an_overwrite(store, target, 40, lambda: any(
            p.name.startswith(".snap.zarr.partial-") and any(p.glob("new*")) for p in tmp_path.iterdir()))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial folder left
    async with TierStore(tiers(tmp_path, "other")) as fresh:
        assert await fresh.import_zarr(target) == 1
        assert fresh.keys() == ["kept"] and same_bytes(await fresh.get("kept"), torch.arange(5.0))


# zarr's own writes, cancelled before they started, warn that they were never awaited.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
async def test_a_cancelled_export_outlasts_zarrs_writes_on_their_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zarr writes each file on a thread, which cancelling the export does not stop: the export
    removes its partial folder only once those writes have ended (a slow disk, here a write that
    takes 0.2 s, made the folder again after it was removed)."""
    import threading
    import time

    from zarr.storage import _local

    started = threading.Event()
    put = _local._put

    def slow_put(*args: Any, **kwargs: Any) -> int:
        started.set()
        time.sleep(0.2)
        return put(*args, **kwargs)

    target = tmp_path / "snap.zarr"
    async with TierStore(tiers(tmp_path)) as store:
        await cancel_an_overwrite(store, target, 8, started.is_set, lambda: monkeypatch.setattr(_local, "_put", slow_put))
        await asyncio.sleep(0.4)  # (what a write still running would do, it has done by now)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


async def test_export_replaces_a_snapshot_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "snap.zarr"
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("a", torch.ones(3))
        await store.export_zarr(target)
        await store.delete("a")
        await store.put("b", torch.zeros(2))
        assert await store.export_zarr(target, overwrite=True) == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    async with TierStore(tiers(tmp_path, "other")) as fresh:
        await fresh.import_zarr(target)
        assert fresh.keys() == ["b"]


async def test_chunk_bomb_is_refused_before_decompressing(tmp_path: Path) -> None:
    # A 40-byte array whose one stored chunk claims 256 MiB: gzip makes that a ~250 KiB file, and
    # reading any element decompresses all of it. The store is large enough for the chunk, so only
    # a check of the chunk against the array's own size refuses it before reading.
    group = zarr.create_group(tmp_path / "bomb.zarr")
    group.create_array("a", shape=(10,), chunks=(1 << 26,), dtype="f4", compressors=zarr.codecs.GzipCodec(level=1))
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    (tmp_path / "bomb.zarr" / "a" / "c").mkdir()
    with open(tmp_path / "bomb.zarr" / "a" / "c" / "0", "wb") as out:
        for _ in range(256):
            out.write(packer.compress(zeros))
        out.write(packer.flush())
    async with TierStore([HostTier("64MiB"), DiskTier(tmp_path / "disk", "1GiB")]) as store:
        before = _peak_rss_bytes()
        with pytest.raises(ValueError, match="chunks"):
            await store.import_zarr(tmp_path / "bomb.zarr")
        assert _peak_rss_bytes() - before < 64 << 20
        assert len(store) == 0


async def test_import_counts_the_room_taken_by_keys_already_in_the_store(tmp_path: Path) -> None:
    group = zarr.create_group(tmp_path / "two.zarr")
    for i in range(2):
        group.create_array(f"a{i}", shape=(12 << 10,), dtype="u1")[:] = 1  # 24 KiB in all
    async with TierStore([HostTier("64KiB")]) as store:
        await store.put("old", torch.zeros(48 << 10, dtype=torch.uint8))  # 16 KiB left
        with pytest.raises(TierFullError, match="in all"):
            await store.import_zarr(tmp_path / "two.zarr")
        assert store.keys() == ["old"]  # refused whole, not half imported
        await store.delete("old")
        await store.put("old", torch.zeros(36 << 10, dtype=torch.uint8))  # 36 + 24 KiB fit in 64
        assert await store.import_zarr(tmp_path / "two.zarr") == 2
        assert sorted(store.keys()) == ["a0", "a1", "old"] and (await store.get("a0") == 1).all()


async def test_import_takes_the_arrays_of_sub_groups_too(tmp_path: Path) -> None:
    """A zarr group with a sub-group: its arrays were left out without a word (the docstring
    promises every array of the group)."""
    group = zarr.create_group(tmp_path / "nested.zarr")
    group.create_array("top", shape=(3,), dtype="f4")[:] = 1.0
    group.create_group("sub").create_group("deeper").create_array("b", shape=(2, 2), dtype="i8")[:] = 7
    async with TierStore([HostTier("1MiB")]) as store:
        assert await store.import_zarr(tmp_path / "nested.zarr") == 2
        assert sorted(store.keys()) == ["sub/deeper/b", "top"]
        assert torch.equal(await store.get("sub/deeper/b"), torch.full((2, 2), 7))


_CRASH_ON_SECOND_RENAME = """
import asyncio, os, sys, torch
from tierstore import HostTier, TierStore
real = os.replace
def replace(src, dst):
    if ".old-" in os.fspath(dst):
        real(src, dst)
        os._exit(3)  # the process dies between moving the old snapshot away and moving the new one in
    real(src, dst)
os.replace = replace
async def main():
    async with TierStore([HostTier("1MiB")]) as store:
        await store.put("new", torch.ones(3))
        await store.export_zarr(sys.argv[1], overwrite=True)
asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="folders are swapped in one step only on Linux")
async def test_export_killed_while_replacing_leaves_a_whole_snapshot_in_place(tmp_path: Path) -> None:
    target = tmp_path / "snap.zarr"
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("kept", torch.arange(5.0))
        await store.export_zarr(target)
    subprocess.run([sys.executable, "-c", _CRASH_ON_SECOND_RENAME, str(target)], check=False, timeout=120)
    async with TierStore(tiers(tmp_path, "other")) as fresh:
        assert await fresh.import_zarr(target) == 1
        assert fresh.keys() in (["kept"], ["new"])


async def test_overwrite_never_replaces_a_folder_that_is_not_a_zarr_group(tmp_path: Path) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("a", torch.ones(3))
        with pytest.raises(FileExistsError, match="no zarr group"):
            await store.export_zarr(folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "mine"


async def test_an_export_is_a_point_in_time_view(tmp_path: Path) -> None:
    """Puts and deletes started while an export runs wait for it: the snapshot holds the values
    as they were when it began, and none that came after."""
    import asyncio

    import zarr

    async with TierStore([HostTier("64MiB")]) as store:
        for i in range(40):
            await store.put(f"k{i}", torch.full((64_000,), float(i)))
        export = asyncio.ensure_future(store.export_zarr(tmp_path / "snap.zarr"))
        await asyncio.sleep(0)  # the export has begun

        async def writer() -> None:
            for i in range(40):
                await store.put(f"k{i}", torch.full((64_000,), -1.0))
            await store.delete("k0")
            await store.put("late", torch.ones(3))

        writing = asyncio.ensure_future(writer())
        await export
        await writing
        assert torch.equal(await store.get("k1"), torch.full((64_000,), -1.0)) and "late" in store
    group = zarr.open_group(str(tmp_path / "snap.zarr"), mode="r")
    names = sorted(group.array_keys())
    assert "late" not in names and len(names) == 40
    for i in range(40):
        assert (group[f"k{i}"][:] == float(i)).all()
