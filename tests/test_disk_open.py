"""Opening a disk tier folder: input checks, the format version, the lock, and ``tierstore info``."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from catalog_records import flip_in_record

from tierstore import DiskTier, SyncTierStore, TierStore
from tierstore.cli import main as cli_main
from tierstore.disk.catalog import FORMAT_VERSION
from tierstore.disk.extents import Extent
from tierstore.errors import (
    CapacityError,
    CatalogError,
    ForeignFolderError,
    NotAStoreFolderError,
    StoreForkedError,
    StoreLockedError,
)
from tierstore.inspect import describe_folder, format_description
from tierstore.units import format_bytes

MiB = 1 << 20


def disk(root: Path, capacity: int | str = "64MiB", **options: Any) -> DiskTier:
    return DiskTier(root, capacity, chunk_size="256KiB", **options)


async def fill(root: Path, count: int = 8) -> dict[str, torch.Tensor]:
    values = {f"k{i}": torch.full((256 * 1024,), float(i)) for i in range(count)}  # 1 MiB each
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            await store.put(key, value)
    return values


async def check(root: Path, values: dict[str, torch.Tensor]) -> None:
    async with TierStore([disk(root)]) as store:
        assert sorted(store.keys()) == sorted(values)
        for key, value in values.items():
            assert torch.equal(await store.get(key), value)


def open_elsewhere(root: Path) -> str:
    """Open the folder in a new process; return what it printed (``opened`` or the error)."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        from tierstore import DiskTier, TierStore
        from tierstore.errors import StoreLockedError
        async def main():
            async with TierStore([DiskTier(sys.argv[1], "64MiB", chunk_size="256KiB")]):
                print("opened")
        try:
            asyncio.run(main())
        except StoreLockedError as exc:
            print("StoreLockedError:", exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


# -- the folder and the capacity ------------------------------------------------------------------------


async def test_a_root_that_is_a_file_is_refused_clearly(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.write_text("not a folder")
    with pytest.raises(NotAStoreFolderError, match=f"{root} is a file") as caught:
        await disk(root).open()
    assert isinstance(caught.value, NotADirectoryError)
    with pytest.raises(NotAStoreFolderError, match="cannot create"):
        await disk(root / "below").open()
    assert root.read_text() == "not a folder"


@pytest.mark.parametrize("stranger", ["notes.txt", "data/table.csv"])
async def test_a_folder_of_other_files_is_not_taken_over(tmp_path: Path, stranger: str) -> None:
    root = tmp_path / "d"
    (root / stranger).parent.mkdir(parents=True)
    (root / stranger).write_text("mine")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(ForeignFolderError, match=f"no tierstore catalog \\({stranger}\\)") as caught:
        await disk(root).open()
    assert isinstance(caught.value, FileExistsError)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # not even a lock file


async def test_an_empty_folder_and_a_tierstore_folder_with_extra_files_open(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    values = await fill(root)
    (root / "README.txt").write_text("the optimizer state of run 7")
    await check(root, values)


async def test_a_capacity_beyond_the_file_system_is_refused_unless_overcommitted(tmp_path: Path) -> None:
    root = tmp_path / "d"
    capacity = shutil.disk_usage(tmp_path).free + (1 << 40)
    with pytest.raises(CapacityError, match=f"capacity {format_bytes(capacity)} .* free \\+ 0 B in the folder's files"):
        await disk(root, capacity).open()
    assert not root.exists()  # refused before anything was made
    tier = disk(root, capacity, overcommit=True)
    await tier.open()
    await tier.aclose()


# -- the format version ------------------------------------------------------------------------------------


def edit_format_record(root: Path, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Change the catalog's format record through LMDB, as another version of the code would."""
    env = lmdb.open(str(root / "catalog"), max_dbs=2, map_size=1 << 31)
    try:
        meta = env.open_db(b"meta")
        with env.begin(write=True, db=meta) as txn:
            fields: dict[str, Any] = json.loads(bytes(txn.get(b"format")))
            edit(fields)
            txn.put(b"format", json.dumps(fields).encode())
    finally:
        env.close()
    return fields


def read_format_record(root: Path) -> dict[str, Any]:
    return edit_format_record(root, lambda fields: None)


def as_format_3(root: Path) -> None:
    """Turn a closed folder into what format version 3 wrote: binary records without the
    checksum of their own that version 4 ends each with (first byte 0xB3, not 0xB4)."""
    unseal(root, lambda i: True)
    edit_format_record(root, lambda fields: fields.update(format_version=3, version=3))


def unseal(root: Path, which: Callable[[int], bool]) -> None:
    """Turn the records ``which(i)`` picks (by position) back into format 3's, keeping the
    folder's format version (4: what the last stop's tierstore left after an upgrade, each
    record sealed only once its key was next written)."""
    env = lmdb.open(str(root / "catalog"), max_dbs=2, map_size=1 << 31)
    try:
        entries = env.open_db(b"entries", create=False)
        with env.begin(write=True, db=entries) as txn:
            for i, (address, raw) in enumerate(list(txn.cursor())):
                if which(i):
                    assert raw[0] == 0xB4, raw[:1]
                    txn.put(address, b"\xb3" + raw[1:-4], db=entries)
    finally:
        env.close()


def records_sealed(root: Path) -> list[bool]:
    """Whether each catalog record is sealed (format version 4) or not (3)."""
    env = lmdb.open(str(root / "catalog"), max_dbs=2, readonly=True, lock=False)
    try:
        entries = env.open_db(b"entries", create=False)
        with env.begin(db=entries) as txn:
            return [raw[0] == 0xB4 for _, raw in txn.cursor()]
    finally:
        env.close()


async def test_a_new_folder_records_the_format_version(tmp_path: Path) -> None:
    await fill(tmp_path / "d", count=1)
    assert read_format_record(tmp_path / "d")["format_version"] == FORMAT_VERSION == 4
    assert describe_folder(tmp_path / "d")["format_version"] == FORMAT_VERSION


async def test_a_folder_from_a_newer_tierstore_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "d"
    await fill(root, count=2)
    edit_format_record(root, lambda fields: fields.update(format_version=99, version=99))
    with pytest.raises(CatalogError, match=f"newer tierstore \\(format version 99\\); this one reads versions up to {FORMAT_VERSION}"):
        await disk(root).open()
    with pytest.raises(CatalogError, match="format version 99"):
        describe_folder(root)


def _as_version_1(fields: dict[str, Any]) -> None:
    del fields["format_version"]
    fields["version"] = 1


def _unversioned(fields: dict[str, Any]) -> None:
    del fields["format_version"]
    del fields["version"]


@pytest.mark.parametrize("older", [_as_version_1, _unversioned], ids=["version-1", "no-version"])
async def test_a_folder_written_before_format_versions_opens_and_is_upgraded(
    tmp_path: Path, older: Callable[[dict[str, Any]], None]
) -> None:
    root = tmp_path / "d"
    values = await fill(root, count=3)
    edit_format_record(root, older)
    assert describe_folder(root)["format_version"] == 1  # read-only: reported, not changed
    await check(root, values)
    assert read_format_record(root)["format_version"] == FORMAT_VERSION


async def test_a_format_3_folder_opens_reads_and_is_sealed_whole(tmp_path: Path) -> None:
    """Version 4 ends each record with a checksum of its own; version 3's records read as they
    are, and the open that upgrades the folder seals them all (the last stop sealed each only
    when its key was next written: the others stayed open to an undetected flipped bit)."""
    root = tmp_path / "d"
    values = {"big": torch.arange(300_000.0), "small": torch.arange(8.0), "empty": torch.zeros(0, 3)}
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            await store.put(key, value)
    as_format_3(root)
    assert describe_folder(root)["healthy"] and describe_folder(root, verify=True)["healthy"]
    assert records_sealed(root) == [False] * 3  # (info opens read-only: nothing changed)
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            got = await store.get(key)
            assert got.shape == value.shape and torch.equal(got, value)
        await store.put("small", torch.ones(8))
    assert read_format_record(root)["format_version"] == FORMAT_VERSION
    assert records_sealed(root) == [True] * 3
    values["small"] = torch.ones(8)
    await check(root, values)


async def test_a_folder_half_sealed_by_an_earlier_upgrade_is_sealed_on_open(tmp_path: Path) -> None:
    """(The review: the open scan's fast path, taken by records of a dtype and shape already
    seen, was tested on sealed records only.) Sixty inline values of one shape, half of their
    records unsealed as an earlier upgrade left them: every value reads back and the open seals
    the rest; an unsealed record one byte short, late in the scan, is refused as before (the
    folder not sealed: nothing changed), and ``info`` names it."""
    root = tmp_path / "d"
    values = {f"k{i:03d}": torch.full((4,), float(i)) for i in range(60)}
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            await store.put(key, value)
    shutil.copytree(root, tmp_path / "damaged")
    unseal(root, lambda i: i % 2 == 0)
    assert sorted(records_sealed(root)) == [False] * 30 + [True] * 30
    await check(root, values)
    assert records_sealed(root) == [True] * 60
    root = tmp_path / "damaged"
    unseal(root, lambda i: i % 2 == 0)
    env = lmdb.open(str(root / "catalog"), max_dbs=2, map_size=1 << 31)
    try:
        entries = env.open_db(b"entries", create=False)
        with env.begin(write=True, db=entries) as txn:
            address, raw = [(bytes(a), bytes(r)) for a, r in txn.cursor() if r[0] == 0xB3][-1]
            txn.put(address, raw[:-1])
    finally:
        env.close()
    with pytest.raises(CatalogError, match="is corrupt"):
        async with TierStore([disk(root)]):
            pass
    assert sorted(records_sealed(root)) == [False] * 30 + [True] * 30
    info = describe_folder(root)
    assert not info["healthy"] and len(info["damaged_keys"]) == 1 and len(info["keys"]) == 59


# -- the lock ---------------------------------------------------------------------------------------------


async def test_a_folder_open_in_this_process_says_so(tmp_path: Path) -> None:
    root = tmp_path / "d"
    async with TierStore([disk(root)]):
        with pytest.raises(StoreLockedError, match="already open in this process") as caught:
            async with TierStore([disk(root)]):
                pass
        assert "another process" not in str(caught.value)
    async with TierStore([disk(root)]):  # and the failed open took nothing with it
        pass


async def test_a_folder_open_in_another_process_names_it(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]):
        said = open_elsewhere(tmp_path / "d")
    assert said == f"StoreLockedError: {tmp_path / 'd'} is open in another process (pid {os.getpid()})"


async def test_a_lock_file_deleted_while_open_does_not_let_a_second_store_in(tmp_path: Path) -> None:
    """A clean-up of "stale" lock files let a second store (another process in the tryout)
    take a new lock file and write the same extents: the folder no longer opened (overlapping
    extents). The folder itself is locked too."""
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as first:
        await first.put("kept", torch.arange(3000.0), durable=True)
        (root / "lock").unlink()
        with pytest.raises(StoreLockedError, match="lock file .* was deleted while that store was open"):
            async with TierStore([disk(root)]):
                pass
        assert open_elsewhere(root).startswith("StoreLockedError: ")
        await first.put("after", torch.ones(3000), durable=True)  # the first goes on
    async with TierStore([disk(root)]) as again:  # and once it closed, the folder opens whole
        assert torch.equal(await again.get("kept"), torch.arange(3000.0))
        assert torch.equal(await again.get("after"), torch.ones(3000))


async def test_a_tier_dropped_without_closing_lets_the_folder_go(tmp_path: Path) -> None:
    root = tmp_path / "d"
    tier = disk(root)
    await tier.open()
    del tier
    gc.collect()
    values = await fill(root, count=2)  # opens: the lock went with the tier
    store = TierStore([disk(root)])
    await store.open()
    del store  # a notebook cell run again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    await check(root, values)


def test_a_forked_child_neither_holds_nor_releases_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "d"
    values = asyncio.run(fill(root, count=2))
    tier = disk(root)
    asyncio.run(tier.open())
    go_on, wait = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker, say
        status = 1
        try:
            os.close(wait)
            with pytest.raises(StoreForkedError, match=f"opened by process {os.getppid()}"):
                tier.read_raw(Extent(0, 0, 4096), 16)
            with pytest.raises(StoreForkedError):
                asyncio.run(tier.allocate(10))
            with pytest.raises(StoreForkedError):
                tier.release(Extent(0, 0, 4096))
            with pytest.raises(StoreLockedError, match=f"another process \\(pid {os.getppid()}\\)"):
                asyncio.run(disk(root).open())
            status = 0
            os.read(go_on, 1)  # live on until the parent has checked
        finally:
            os._exit(status)
    os.close(go_on)
    try:
        assert open_elsewhere(root).startswith("StoreLockedError")  # the parent holds it
        asyncio.run(tier.aclose())
        assert open_elsewhere(root) == "opened"  # the child, still alive, does not
    finally:
        os.write(wait, b"x")
        os.close(wait)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    asyncio.run(check(root, values))


# -- tierstore info --------------------------------------------------------------------------------------------


async def test_info_calls_a_whole_store_healthy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await fill(tmp_path / "d")
    info = describe_folder(tmp_path / "d")
    assert info["healthy"] and info["problems"] == [] and info["damaged_keys"] == []
    assert cli_main(["info", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "UNHEALTHY" not in out and "healthy: every data file the catalog names is there" in out  # (it said nothing)
    assert cli_main(["info", str(tmp_path / "d"), "--verify"]) == 0
    assert "every value was read and passes its checksums" in capsys.readouterr().out


async def test_info_reports_a_truncated_data_file_and_the_keys_in_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "d"
    values = await fill(root)
    segment = root / "data" / "segment-000000.bin"
    os.truncate(segment, 3 * MiB)
    info = describe_folder(root)
    assert not info["healthy"]
    assert len(info["damaged_keys"]) >= 5 and set(info["damaged_keys"]) <= set(values)
    assert any("segment-000000.bin is truncated" in problem for problem in info["problems"])
    assert cli_main(["info", str(root)]) != 0
    out = capsys.readouterr().out
    assert "UNHEALTHY" in out and repr(info["damaged_keys"][0]) in out


async def test_info_reports_a_missing_data_file(tmp_path: Path) -> None:
    root = tmp_path / "d"
    values = await fill(root)
    (root / "data" / "segment-000000.bin").unlink()
    info = describe_folder(root)
    assert not info["healthy"]
    assert info["damaged_keys"] == sorted(values)
    assert any("segment-000000.bin is missing" in problem for problem in info["problems"])
    assert cli_main(["info", str(root), "--json"]) != 0


async def test_info_verify_reads_the_bytes_and_names_the_corrupt_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped byte in a value's extent, or in a small value kept inline in the catalog, went
    unseen: info reads no value's bytes and called the folder healthy. --verify reads them."""
    root = tmp_path / "d"
    big = torch.arange(100_000, dtype=torch.float32)
    small = torch.full((8,), 1234.5678)
    async with TierStore([DiskTier(root, "16MiB")]) as store:
        await store.put("big", big)
        await store.put("small", small)
        await store.put("fine", torch.ones(50_000))
    assert describe_folder(root, verify=True)["healthy"]
    segment = root / "data" / "segment-000000.bin"
    data = bytearray(segment.read_bytes())
    at = data.find(big[1000:1004].numpy().tobytes())
    assert at >= 0
    data[at] ^= 0x10
    segment.write_bytes(bytes(data))
    catalog = root / "catalog" / "data.mdb"
    raw = bytearray(catalog.read_bytes())
    pattern = small.numpy().tobytes()
    inline_at = raw.find(pattern)
    assert inline_at >= 0
    while inline_at >= 0:  # (LMDB's copy-on-write pages may hold older copies too)
        raw[inline_at + 5] ^= 0x01
        inline_at = raw.find(pattern, inline_at + 1)
    catalog.write_bytes(bytes(raw))
    assert describe_folder(root)["healthy"]  # (what info can tell without reading the values)
    info = describe_folder(root, verify=True)
    assert not info["healthy"] and info["damaged_keys"] == ["big", "small"]
    assert cli_main(["info", str(root), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "2 entries fail their checksums" in out and "'big', 'small'" in out
    assert cli_main(["info", str(root)]) == 0


def _overwrite_until(root: str, ready: Any, stop: Any) -> None:
    """A writer process for the test below: overwrites extent and inline values until told."""
    from tierstore import DiskTier, SyncTierStore

    with SyncTierStore([DiskTier(root, "64MiB", durable=True)]) as store:
        for i in range(200):
            store.put(f"k{i}", torch.full((50000,), i, dtype=torch.uint8))
            store.put(f"s{i}", torch.full((100,), i, dtype=torch.uint8))  # (inline in the catalog)
        ready.set()
        n = 0
        while not stop.is_set():
            store.put(f"k{n % 200}", torch.full((50000,), n % 251, dtype=torch.uint8))
            store.put(f"s{n % 100}", torch.full((100,), n % 251, dtype=torch.uint8))
            n += 1


def test_info_verify_beside_a_live_writer_reports_no_corruption(tmp_path: Path) -> None:
    """info reads a folder in use safely; --verify read extents that the writer had freed and
    reused since the catalog was read, and called a healthy store corrupt (3 runs of 15; this
    test caught it in about half its runs before the fix)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    writer = context.Process(target=_overwrite_until, args=(str(tmp_path / "d"), ready, stop))
    writer.start()
    try:
        assert ready.wait(120)
        verdicts = [describe_folder(tmp_path / "d", verify=True) for _ in range(20)]
    finally:
        stop.set()
        writer.join(60)
    assert all(info["healthy"] for info in verdicts), [info["problems"] for info in verdicts if not info["healthy"]]
    assert describe_folder(tmp_path / "d", verify=True)["healthy"]


async def test_info_on_an_emptied_catalog_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said 'Bad file descriptor' where opening the store says the catalog was truncated."""
    root = tmp_path / "d"
    async with TierStore([DiskTier(root, "16MiB")]) as store:
        await store.put("small", torch.ones(4))
    os.truncate(root / "catalog" / "data.mdb", 0)
    assert cli_main(["info", str(root)]) == 1
    assert "is empty (truncated)" in capsys.readouterr().err


async def test_info_piped_into_head_ends_quietly(tmp_path: Path) -> None:
    """A reader that stops early (``tierstore info ... | head``) gave a BrokenPipeError traceback."""
    root = tmp_path / "d"
    async with TierStore([DiskTier(root, "16MiB")]) as store:
        for i in range(3000):
            await store.put(f"a-long-key-name-to-fill-the-pipe-{i:05d}", torch.ones(1))
    reader = subprocess.Popen([sys.executable, "-m", "tierstore", "info", str(root), "--all"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.read(100)
    reader.stdout.close()
    error = reader.stderr.read().decode()
    assert reader.wait(timeout=60) == 141  # (as a process ended by SIGPIPE: 1 says a store is damaged)
    assert "Traceback" not in error and "BrokenPipe" not in error, error


def test_info_on_a_missing_folder_says_it_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["info", str(tmp_path / "nope")]) != 0
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["info", str(tmp_path / "empty")]) != 0
    assert "is not a tierstore disk folder" in capsys.readouterr().err


@pytest.mark.parametrize("name", [b"entries", b"meta"])
def test_a_flipped_bit_in_a_catalog_database_name_is_refused_not_taken_for_an_empty_store(tmp_path: Path, name: bytes) -> None:
    """LMDB keeps its named databases' names in its main database: one flipped bit there made
    the store open empty (no CatalogError) and hand the lost keys' extents to new writes."""
    root = tmp_path / "d"

    async def fill() -> None:
        async with TierStore([DiskTier(root, "16MiB")]) as store:
            await store.put("big", torch.arange(100_000, dtype=torch.float32))
            await store.put("small", torch.arange(10))

    asyncio.run(fill())
    catalog = root / "catalog" / "data.mdb"
    data = bytearray(catalog.read_bytes())
    at = data.find(name)
    while at >= 0:  # (every copy of the page that names it: LMDB keeps older ones beside the live one)
        data[at + 1] ^= 0x10
        at = data.find(name, at + 1)
    catalog.write_bytes(bytes(data))
    before = {path.name: path.read_bytes() for path in (root / "data").iterdir()}

    async def reopen() -> None:
        async with TierStore([DiskTier(root, "16MiB")]) as store:
            await store.put("new", torch.ones(100_000))

    with pytest.raises(CatalogError, match="is damaged"):
        asyncio.run(reopen())
    assert {path.name: path.read_bytes() for path in (root / "data").iterdir()} == before  # nothing written over
    assert cli_main(["info", str(root)]) != 0


async def test_a_catalog_made_half_way_is_a_new_store_not_a_damaged_one(tmp_path: Path) -> None:
    """A tierstore that stopped between making the catalog's two databases (before they were
    made in one transaction) left a meta database with no format record: a new store."""
    catalog = tmp_path / "d" / "catalog"
    catalog.mkdir(parents=True)
    env = lmdb.open(str(catalog), max_dbs=2)
    env.open_db(b"meta")
    env.close()
    async with TierStore([DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("k", torch.arange(3))
    async with TierStore([DiskTier(tmp_path / "d", "16MiB")]) as store:
        assert torch.equal(await store.get("k"), torch.arange(3))


async def test_a_damaged_catalog_page_is_a_catalog_error_on_open_and_in_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The root page of the catalog's records with its LMDB page-type flag damaged made opening
    the store and ``tierstore info`` raise LMDB's raw ``CorruptedError`` (with a traceback in
    the CLI): it is a ``CatalogError``, nothing is changed, and ``info`` says so. (Some damage
    to a leaf page trips an assertion inside LMDB instead, which ends the process.)"""
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as store:
        for i in range(200):
            await store.put(f"small-{i}", torch.full((10,), float(i)))
    catalog = root / "catalog" / "data.mdb"
    data = bytearray(catalog.read_bytes())
    page = _entries_root_page(bytes(data))
    data[page * 4096 + 10 : page * 4096 + 12] = (0x04).to_bytes(2, "little")  # (P_BRANCH -> P_OVERFLOW)
    catalog.write_bytes(bytes(data))
    with pytest.raises(CatalogError, match="is damaged: .*MDB_CORRUPTED"):
        async with TierStore([disk(root)]):
            pass
    assert catalog.read_bytes() == bytes(data)
    assert cli_main(["info", str(root)]) != 0
    captured = capsys.readouterr()
    assert "is damaged" in captured.err + captured.out and "Traceback" not in captured.err


def _entries_root_page(data: bytes) -> int:
    """The root page of the catalog's ``entries`` database, read from LMDB's file layout: the
    newer of the two meta pages (by transaction id) names the main database's root, a leaf
    whose node ``entries`` holds that database's ``MDB_db`` record (its root page last)."""
    newest = max((int.from_bytes(data[p * 4096 + 144 : p * 4096 + 152], "little"), p) for p in (0, 1))[1]
    main_root = int.from_bytes(data[newest * 4096 + 128 : newest * 4096 + 136], "little")
    page = data[main_root * 4096 : (main_root + 1) * 4096]
    record = page.index(b"entries") + len(b"entries")
    return int.from_bytes(page[record + 40 : record + 48], "little")


# -- one damaged catalog record --------------------------------------------------------------------------------


@pytest.mark.parametrize("value, byte, bit, words", [
    (torch.arange(100.0), 8, 1, "version 0"),  # (version 2 -> 0: the key silently vanished)
    (torch.arange(3 * 700001.0), 16 + 7 + 8 + 6 + 4, 0, "not aligned to the 4096-byte blocks"),  # (head, "float32", shape, key, segment: the offset 0 -> 1: a bare EINVAL on read)
    (torch.arange(100.0), 1, 0, "catalog record of 'victim' [(][0-9a-f]+[)] in .* is corrupt: unknown record kind"),  # (named by its digest only)
], ids=["version", "extent offset", "kind"])
async def test_a_damaged_record_is_a_catalog_error_on_open_not_a_silent_change(
    tmp_path: Path, value: torch.Tensor, byte: int, bit: int, words: str
) -> None:
    """Found by a kill-and-corrupt fuzzer: a record whose version read 0 made its key disappear
    without a word; one whose extent offset lost its alignment opened, and its read failed with
    a bare ``OSError: [Errno 22]`` naming no key. (Records of format version 3, which have no
    checksum of their own: a version 4 record fails that first, the cases below.)"""
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as store:
        await store.put("other", torch.ones(10))
        await store.put("victim", value)
    as_format_3(root)
    flip_in_record(root, "victim", byte, bit)
    with pytest.raises(CatalogError, match=words):
        async with TierStore([disk(root)]):
            pass
    assert read_format_record(root)["format_version"] == 3  # (refused: not upgraded, the version that wrote it opens it)
    assert cli_main(["info", str(root)]) != 0


@pytest.mark.parametrize("value, byte", [
    (torch.zeros(2, 0), 16 + 7),  # (head, "float32", its first dimension: 2 -> 3 read back as a (3, 0) tensor, no byte to fail)
    (torch.zeros(2, 0), 8),  # (the version)
    (torch.arange(100.0), 16 + 7 + 8 + 6),  # (an inline value's checksum)
    (torch.arange(3 * 700001.0), 16 + 7 + 8 + 6 + 4 + 8),  # (an extent's length)
    (torch.arange(3 * 700001.0), -1),  # (the record's own checksum)
], ids=["empty shape", "version", "inline checksum", "extent length", "seal"])
async def test_any_flipped_bit_of_a_record_but_its_values_is_a_catalog_error_naming_the_key(
    tmp_path: Path, value: torch.Tensor, byte: int
) -> None:
    """Found by the fuzzer: 96 of 2,207 single-bit flips in live records changed a dimension of
    an empty tensor's shape and read back as another shape, no error (a record had no checksum
    of its own). Every bit of a record but an inline value's bytes is now checked on open."""
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as store:
        await store.put("other", torch.ones(10))
        await store.put("victim", value)
    for bit in range(8):
        shutil.copytree(root, tmp_path / f"bit{bit}")
        flip_in_record(tmp_path / f"bit{bit}", "victim", byte, bit)
        with pytest.raises(CatalogError, match="catalog record of 'victim' [(][0-9a-f]+[)] in .* fails its own checksum"):
            async with TierStore([disk(tmp_path / f"bit{bit}")]):
                pass
        info = describe_folder(tmp_path / f"bit{bit}")
        assert not info["healthy"] and info["damaged_keys"] == ["victim"] and [k["key"] for k in info["keys"]] == ["other"], info


async def test_info_leaves_a_damaged_records_extent_out_of_the_free_space(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An extent length damaged to 2**62 was counted as used: ``info`` said -8388608.0 TiB free."""
    root = tmp_path / "d"
    async with TierStore([disk(root)]) as store:
        await store.put("other", torch.ones(10))
        await store.put("victim", torch.arange(3 * 700001.0))
    flip_in_record(root, "victim", 16 + 7 + 8 + 6 + 4 + 8 + 7, 6)  # (the length's top byte)
    assert cli_main(["info", str(root), "--json"]) != 0
    info = json.loads(capsys.readouterr().out)
    assert 0 <= info["free_in_segments"] <= info["reserved_bytes"], info
    assert info["damaged_keys"] == ["victim"] and not info["healthy"], info


async def test_info_counts_the_room_of_values_in_a_truncated_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(The review of the change above: values past a truncated file's end were left out of the
    used bytes too, overstating the free space.) Their extents still take their room."""
    root = tmp_path / "d"
    async with TierStore([DiskTier(root, "64MiB", inline_max=0)]) as store:
        for i in range(4):
            await store.put(f"k{i}", torch.zeros(1 << 20, dtype=torch.uint8))
    segment = sorted((root / "data").glob("segment-*"))[0]
    os.truncate(segment, 2 << 20)  # the last two values' bytes cut off
    assert cli_main(["info", str(root), "--json"]) != 0
    info = json.loads(capsys.readouterr().out)
    assert info["extent_bytes"] == 4 << 20 and info["free_in_segments"] == info["reserved_bytes"] - (4 << 20), info
    assert info["damaged_keys"] == ["k2", "k3"]


async def test_an_old_catalog_larger_than_half_its_map_is_sealed_and_opens(tmp_path: Path) -> None:
    """The review: sealing every record in one transaction needed free map room for the whole
    catalog twice over; a folder of 160 MiB of unsealed inline records (``inline_max`` raised),
    which the last stop opened, failed every open with MDB_MAP_FULL. Now in transactions that
    grow the map as a commit does."""
    root = tmp_path / "d"

    def big_inline() -> DiskTier:
        return DiskTier(root, "1GiB", chunk_size="256KiB", inline_max="1MiB")

    async with TierStore([big_inline()]) as store:
        for i in range(160):
            await store.put(f"k{i}", torch.full((1 << 18,), float(i)))  # 1 MiB each, inline
    as_format_3(root)
    async with TierStore([big_inline()]) as store:
        assert torch.equal(await store.get("k7"), torch.full((1 << 18,), 7.0))
        assert len(store.keys()) == 160
    assert all(records_sealed(root))


def test_info_keeps_its_columns_aligned_for_long_shapes_and_keys(tmp_path: Path) -> None:
    """A 21-dimension shape pushed the size column out of line (found by a tryout)."""
    with SyncTierStore([DiskTier(tmp_path / "d", "64MiB")]) as store:
        store.put("a", torch.zeros([1] * 21))
        store.put("bb", torch.zeros(3, 4))
        store.put("long/" + "x" * 70, torch.zeros([1] * 40 + [3], dtype=torch.bfloat16))
    lines = format_description(describe_folder(tmp_path / "d")).splitlines()
    table = lines[lines.index(next(line for line in lines if line.lstrip().startswith("key "))):]
    assert len(table) == 4 and len({len(line) for line in table}) == 1, table
    assert len({line.index(" float32") if " float32" in line else line.index(" bfloat16") for line in table[1:]}) == 1
