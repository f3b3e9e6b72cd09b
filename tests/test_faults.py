"""Crashes, corruption, full disks, a second process, file modes and memory bounds."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch

from tierstore import CatalogError, ChecksumError, DiskTier, StoreLockedError, TierStore
from tierstore.faults.crash import check, kill_cycles, open_tier, value_for
from tierstore.inspect import describe_folder


def disk(root: Path, **options: object) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", **options)  # type: ignore[arg-type]


async def fill(root: Path, count: int = 8, numel: int = 20_000) -> dict[str, torch.Tensor]:
    values = {f"k{i}": torch.full((numel,), float(i)) for i in range(count)}
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            await store.put(key, value)
    return values


def open_in_child(root: Path, expected: str) -> subprocess.CompletedProcess[str]:
    """Open a store on ``root`` in a child process; it prints ``<expected>: <message>`` if that
    error is raised."""
    return run_python(
        f"""
        import asyncio, sys
        from tierstore import DiskTier, TierStore, {expected}
        async def main():
            async with TierStore([DiskTier(sys.argv[1], "64MiB")]):
                pass
        try:
            asyncio.run(main())
        except {expected} as exc:
            print("{expected}:", exc)
        """,
        str(root),
    )


def run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


# -- crashes -------------------------------------------------------------------------------------------


def test_sigkill_at_random_moments_loses_nothing_acknowledged(tmp_path: Path) -> None:
    report = kill_cycles(tmp_path / "store", cycles=24, seed=7)
    assert report.errors == []
    assert report.kills == 24 and report.acknowledged_ops > 200 and report.keys_checked > 0


async def test_a_log_line_cut_by_the_kill_is_dropped_before_the_checker_appends(tmp_path: Path) -> None:
    """SIGKILL can stop a write part-way: the log then ends without a newline, and the checker's
    resolution lines must not be glued onto the fragment (CI saw "26R" read as a version)."""
    root, log = tmp_path / "store", tmp_path / "store.log"
    async with TierStore([open_tier(root)]) as store:
        await store.put("k1", value_for("k1", 5))
    log.write_text("I put k1 5\nA put k1 5\nI put k3 7\nI put k2 26")  # k3 in flight, k2's intent cut
    first = await check(root, log)
    second = await check(root, log)  # replays the resolution the first check appended
    assert first.errors == [] and second.errors == []
    assert first.in_flight_resolved == 1
    assert log.read_text() == "I put k1 5\nA put k1 5\nI put k3 7\nR del k3\n"


# -- corruption ------------------------------------------------------------------------------------------


async def test_a_flipped_byte_is_caught_and_the_rest_is_fine(tmp_path: Path) -> None:
    values = await fill(tmp_path / "d")
    async with TierStore([disk(tmp_path / "d")]) as store:
        extent = store.tier("disk").committed()["k3"].extent
        segment = store.tiers[0].segment_path(extent.segment)  # type: ignore[attr-defined]
    with open(segment, "r+b") as handle:
        handle.seek(extent.offset + 12_345)
        byte = handle.read(1)
        handle.seek(extent.offset + 12_345)
        handle.write(bytes([byte[0] ^ 0x10]))
    async with TierStore([disk(tmp_path / "d")]) as store:
        with pytest.raises(ChecksumError, match="'k3'"):
            await store.get("k3")
        for key, value in values.items():
            if key != "k3":
                assert torch.equal(await store.get(key), value)
        await store.delete("k3")  # the store stays usable
        await store.put("k3", values["k3"])
        assert torch.equal(await store.get("k3"), values["k3"])


async def test_a_truncated_data_file_is_refused_on_open_and_nothing_is_lost(tmp_path: Path) -> None:
    await fill(tmp_path / "d")
    segment = tmp_path / "d" / "data" / "segment-000000.bin"
    size = segment.stat().st_size
    os.truncate(segment, size // 3)
    with pytest.raises(CatalogError, match=r"truncated.*of the 8 entries in it lie past its end"):
        async with TierStore([disk(tmp_path / "d")]):
            pass
    assert describe_folder(tmp_path / "d")["entries"] == 8  # the catalog kept every record
    os.truncate(segment, size)  # the file restored (here: its length), everything opens again
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert len(store) == 8


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_catalog_gives_a_clear_error_not_a_crash(tmp_path: Path, damage: str) -> None:
    import asyncio

    asyncio.run(fill(tmp_path / "d", count=200, numel=64))
    catalog = tmp_path / "d" / "catalog" / "data.mdb"
    size = catalog.stat().st_size
    if damage == "garbage":
        catalog.write_bytes(os.urandom(size))
    elif damage == "truncated":
        os.truncate(catalog, size // 2)
    else:
        os.truncate(catalog, 0)
    # In a child process: a fault deep in a memory map would kill it rather than the test run.
    result = open_in_child(tmp_path / "d", "CatalogError")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CatalogError:" in result.stdout


async def test_a_garbage_record_is_named(tmp_path: Path) -> None:
    await fill(tmp_path / "d")
    env = lmdb.open(str(tmp_path / "d" / "catalog"), max_dbs=2)
    entries = env.open_db(b"entries")
    with env.begin(write=True, db=entries) as txn:
        digest = next(iter(txn.cursor().iternext(keys=True, values=False)))
        txn.put(digest, b"{not json")
    env.close()
    with pytest.raises(CatalogError, match="corrupt"):
        async with TierStore([disk(tmp_path / "d")]):
            pass


# -- full disks -------------------------------------------------------------------------------------------

def full_disk(root: Path, limit: int) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-m", "tierstore.faults.full_disk", str(root), str(limit)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_full_file_system_fails_puts_cleanly_rlimit(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the file system 'full' for files beyond 40 MiB (segments grow 16, 32,
    then 64 MiB: the third cannot be reserved)."""
    report = full_disk(tmp_path / "d", 40 << 20)
    assert report["full"] >= 1 and report["puts"] >= 40, report  # type: ignore[operator]
    assert "File too large" in str(report["error"]) or "space" in str(report["error"])
    assert report["intact"] and report["reused"] and report["reopened"], report


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str, why: str = "") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted for the block, where the machine lets us mount one (else skip)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip() or made.returncode}){why}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_file_system_fails_puts_cleanly_tmpfs(tmp_path: Path) -> None:
    """A real small file system, where the machine lets us mount one."""
    with small_tmpfs(tmp_path, "40m", "; the RLIMIT_FSIZE test covers ENOSPC") as mount:
        report = full_disk(mount / "d", 0)
        assert report["full"] >= 1 and report["intact"] and report["reused"] and report["reopened"], report


def test_a_catalog_that_fills_its_file_system_says_disk_full(tmp_path: Path) -> None:
    """LMDB reports its short write on a full file system as EIO: that is a DiskFullError, as
    ENOSPC is, not a CatalogError (which says the catalog is damaged), and the store goes on."""
    with small_tmpfs(tmp_path, "2m") as mount:
        from tierstore import DiskFullError, SyncTierStore

        with SyncTierStore([DiskTier(mount / "d", "64MiB", overcommit=True)]) as store:
            acknowledged = 0
            with pytest.raises(DiskFullError, match="cannot grow"):
                for acknowledged in range(100_000):  # small values: inline in the catalog
                    store.put(f"k{acknowledged}", torch.full((200,), acknowledged, dtype=torch.int32), durable=True)
            assert acknowledged > 100
            store.delete("k0")
            store.put("after", torch.ones(10))
        with SyncTierStore([DiskTier(mount / "d", "64MiB", overcommit=True)]) as reopened:
            assert len(reopened) == acknowledged  # every acknowledged put but k0, and "after"
            assert torch.equal(reopened.get("k1"), torch.full((200,), 1, dtype=torch.int32))


# -- processes and files ------------------------------------------------------------------------------------


async def test_a_second_process_gets_a_clear_error(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        await store.put("x", torch.ones(3))
        result = open_in_child(tmp_path / "d", "StoreLockedError")
        assert f"StoreLockedError: {tmp_path / 'd'} is open in another process (pid {os.getpid()})" in result.stdout, result.stderr
        assert torch.equal(await store.get("x"), torch.ones(3))
    with pytest.raises(StoreLockedError):  # and within one process, too
        async with TierStore([disk(tmp_path / "e")]), TierStore([disk(tmp_path / "e")]):
            pass


async def test_store_files_are_readable_by_the_owner_only(tmp_path: Path) -> None:
    await fill(tmp_path / "d", count=2)
    for path in [tmp_path / "d", *(tmp_path / "d").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} has mode {oct(mode)}"


# -- memory bounds ----------------------------------------------------------------------------------------------

MEMORY_WORKLOAD = """
import asyncio, json, random, sys, threading, time, psutil, torch
from tierstore import DeviceTier, DiskTier, HostTier, TierStore
process = psutil.Process()
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.002)
async def main():
    host = 32 << 20
    async with TierStore([HostTier(host), DiskTier(sys.argv[1], "2GiB")]) as store:
        staging = store.tiers[1].staging_bytes
        rng = random.Random(0)
        source = torch.randn(1 << 20)  # 4 MiB, reused for every put
        baseline = process.memory_info().rss
        threading.Thread(target=sample, daemon=True).start()
        for i in range(600):
            key = f"k{rng.randrange(64)}"
            size = rng.choice([1024, 65536, 1 << 18, 1 << 20])
            action = rng.random()
            if action < 0.5 or key not in store:
                await store.put(key, source[:size])
            elif action < 0.9:
                value = await store.get(key)
                del value
            else:
                await store.delete(key)
        time.sleep(0.05)
        print(json.dumps({"growth": peak[0] - baseline, "host": host, "staging": staging}))
asyncio.run(main())
"""


def test_host_memory_stays_within_the_host_tier_plus_staging(tmp_path: Path) -> None:
    # A fixed mmap threshold makes freed buffers go back to the OS, so RSS tracks live memory.
    result = run_python(MEMORY_WORKLOAD, str(tmp_path / "d"), env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    slack = 24 << 20  # one value returned by get (4 MiB), allocator and interpreter noise
    assert report["growth"] <= report["host"] + report["staging"] + slack, report


def test_an_overcommitted_tier_grows_by_smaller_segments_when_a_whole_one_does_not_fit(tmp_path: Path) -> None:
    """With ``overcommit=True`` on a 40 MiB file system, the second data file (32 MiB) could not
    be reserved and every put failed with ``DiskFullError`` while 24 MiB were still free: a
    smaller data file is reserved instead, down to what the value needs."""
    with small_tmpfs(tmp_path, "40m") as mount:
        from tierstore import DiskFullError, SyncTierStore

        stored = 0
        with SyncTierStore([DiskTier(mount / "d", "200MiB", overcommit=True)]) as store:
            with pytest.raises(DiskFullError):
                for stored in range(64):  # noqa: B007  (1 MiB each: the file system fills before the tier)
                    store.put(f"k{stored}", torch.full((1 << 18,), stored, dtype=torch.float32))
            assert stored >= 32, f"only {stored} MiB stored on a 40 MiB file system"
            assert torch.equal(store.get(f"k{stored - 1}"), torch.full((1 << 18,), stored - 1, dtype=torch.float32))
