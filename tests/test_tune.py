"""``tierstore bench --tune`` and the tuning file a ``DiskTier`` reads: tiny sizes, real I/O."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.cli import main as cli_main
from tierstore.disk.tuning import (
    TUNING_FILE,
    IOSettings,
    TuningFileWarning,
    choose_setting,
    save_tuning,
)
from tierstore.tiers import DeviceTier, DiskTier, HostTier
from tierstore.workers import WorkerPool

MiB = 1 << 20
KiB = 1 << 10


async def _round_trip(root: Path, **options: object) -> DiskTier:
    """Put values of several chunks (and a small one) into a disk tier at ``root``, read them
    back, reopen the folder and read them again; return the (closed) tier."""
    values = {"big": torch.randn(300_000), "odd": torch.randn(77_777).double(), "small": torch.arange(10)}
    disk = DiskTier(root, "64MiB", **options)  # type: ignore[arg-type]
    async with TierStore([disk]) as store:
        for key, value in values.items():
            await store.put(key, value)
        for key, value in values.items():
            assert torch.equal(await store.get(key), value)
    async with TierStore([DiskTier(root, "64MiB", **options)]) as store:  # type: ignore[arg-type]
        for key, value in values.items():
            assert torch.equal(await store.get(key), value)
    return disk


def test_tune_writes_the_tuning_file_and_a_disk_tier_there_uses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "store"
    report = tmp_path / "tune.json"
    assert cli_main(["bench", "--tune", str(folder), "--tune-mib", "2", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "write GB/s" in out and "best:" in out
    saved = json.loads((folder / TUNING_FILE).read_text())
    assert saved["format"] == "tierstore-tuning"
    best = saved["settings"]
    assert {"chunk_size", "io_threads", "queue_depth"} == set(best)
    measured = saved["measured"]
    assert {row["stage"] for row in measured} == {"chunk_size", "io_threads", "queue_depth"}
    assert all(row["write_gbs"] > 0 and row["read_gbs"] > 0 for row in measured)
    assert best in [{k: row[k] for k in best} for row in measured]  # the best is one that was measured
    assert json.loads(report.read_text())["best"] == best
    assert set(saved["choices"]) == {"chunk_size", "io_threads", "queue_depth"}  # why each sweep chose what it did
    for stage, reason in saved["choices"].items():
        assert f"  {stage}: {reason}" in out
    assert sum(bool(row.get("chosen")) for row in measured) == 3
    assert sorted(p.name for p in folder.iterdir()) == [TUNING_FILE]  # the scratch files are gone
    # (a small --tune-mib measured 1 MiB chunks only and saved one never compared with the default,
    # for good: a folder's chunk size is fixed when a store is first made there)
    assert 4 * MiB in {row["chunk_size"] for row in measured if row["stage"] == "chunk_size"}
    assert "not among them" not in saved["choices"]["chunk_size"]

    disk = DiskTier(folder, "64MiB")
    assert (disk.chunk_size, disk.io_threads, disk.queue_depth) == (best["chunk_size"], best["io_threads"], best["queue_depth"])
    assert disk.io_settings.sources == {"chunk_size": "tuning file", "io_threads": "tuning file", "queue_depth": "tuning file"}
    assert "tuning file" in repr(disk) and str(folder / TUNING_FILE) in repr(disk)
    asyncio.run(_round_trip(folder))


def test_tune_with_the_least_volume_and_on_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--tune-mib 1`` (which argparse takes) ended in a traceback from the chooser (no chunk
    size fitted the values); a regular file as the folder in a ``FileExistsError`` traceback."""
    assert cli_main(["bench", "--tune", str(tmp_path / "store"), "--tune-mib", "1"]) == 0
    assert json.loads((tmp_path / "store" / TUNING_FILE).read_text())["settings"]["chunk_size"] in (1 * MiB, 2 * MiB, 4 * MiB)
    capsys.readouterr()
    (tmp_path / "file").write_text("x")
    assert cli_main(["bench", "--tune", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments",
    [["bench", "--sizes-mib", "0"], ["bench", "--sizes-mib", "x"], ["bench", "--sizes-mib", "1,-1"],
     ["bench", "--sizes-mib", "1e-12"], ["bench", "--sizes-mib", "1e300"],
     ["bench", "--deepspeed-settings", "1,2"], ["bench", "--deepspeed-settings", "4,0,2"], ["bench", "--deepspeed-settings", "4,1e300,2"],
     ["bench", "--deepspeed-settings", "1e300,32,2"], ["bench", "--deepspeed-settings", "0.001,32,2"], ["info", "ROOT", "--limit", "-1"]],
    ids=["size-0", "size-x", "size-negative", "size-below-a-byte", "size-beyond-memory", "deepspeed-two", "deepspeed-depth-0",
         "deepspeed-depth-huge", "deepspeed-block-huge", "deepspeed-block-below-a-page", "info-negative-limit"],
)
def test_bad_numbers_on_the_command_line_are_usage_errors(tmp_path: Path, arguments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Each was a traceback (a division by zero, a negative tensor size, an unpack), a size
    silently made 1 byte (``1e-12``) or taken as given (a queue depth of 1e300), or, for
    ``info --limit -1``, a listing that silently left keys out."""
    arguments = [str(tmp_path) if argument == "ROOT" else argument for argument in arguments]
    with pytest.raises(SystemExit) as exited:
        cli_main([*arguments, "--dir", str(tmp_path)] if arguments[0] == "bench" else arguments)
    assert exited.value.code == 2
    assert f"argument {arguments[1] if arguments[0] == 'bench' else '--limit'}" in capsys.readouterr().err


LABELS = ["chunk 1 MiB", "chunk 4 MiB", "chunk 16 MiB"]


def test_choose_setting_keeps_the_default_against_a_gain_within_the_noise() -> None:
    # 16 MiB beats the default (index 1) in every repetition, but by about 1%: noise, not a win
    choice = choose_setting([[1.0, 1.1, 0.9], [2.0, 2.4, 1.6], [2.02, 2.43, 1.62]], 1, LABELS)
    assert (choice.index, choice.kept_default, choice.gain) == (1, True, 0.0)
    assert choice.reason.startswith("default kept (chunk 4 MiB): no setting beat it by more than 5%")
    assert "closest: chunk 16 MiB, +1%" in choice.reason


def test_choose_setting_keeps_the_default_when_a_challenger_wins_only_a_minority_of_repetitions() -> None:
    # twice as fast in one repetition of three, even in the others: one lucky repetition is no win
    choice = choose_setting([[2.0, 1.0, 1.0], [4.0, 1.0, 1.0]], 0, ["default", "other"])
    assert choice.kept_default and choice.index == 0
    choice = choose_setting([[1.0, 1.0, 1.0], [1.3, 1.01, 1.02]], 0, ["default", "other"])
    assert choice.kept_default  # the median (+2%) is no clear gain either


def test_choose_setting_keeps_the_default_when_the_gain_is_within_the_spread_between_repetitions() -> None:
    # faster by more than 5% in 2 of 3 repetitions, median +30%, but the ratios swing 0.8-1.6 (±40%)
    choice = choose_setting([[1.0, 1.0, 1.0], [0.8, 1.3, 1.6]], 0, ["default", "other"])
    assert choice.kept_default
    assert "spread ±40%" in choice.reason


def test_choose_setting_takes_a_clearly_faster_setting_and_says_why() -> None:
    scores = [[1.0, 1.2, 0.8], [1.0, 1.2, 0.8], [1.25, 1.62, 1.04]]  # 16 MiB: +25-35% in every repetition
    choice = choose_setting(scores, 1, LABELS)
    assert (choice.index, choice.kept_default) == (2, False)
    assert choice.gain == pytest.approx(0.3)
    assert choice.reason.startswith("chunk 16 MiB: 30% faster than the default chunk 4 MiB")
    assert "in 3 of 3" in choice.reason
    # of two that qualify, the larger median gain wins
    assert choose_setting([[1.0, 1.0, 1.0], [1.2, 1.2, 1.2], [1.5, 1.4, 1.45]], 0).index == 2
    # two of three repetitions is most of them (the third a dip)
    assert choose_setting([[1.0, 1.0, 1.0], [1.3, 1.3, 1.1]], 0).index == 1


def test_choose_setting_without_the_default_takes_the_fastest_and_refuses_bad_scores() -> None:
    choice = choose_setting([[1.0, 1.1], [1.2, 1.0], [1.3, 1.2]], None, LABELS)
    assert (choice.index, choice.kept_default) == (2, False) and "the default was not among them" in choice.reason
    for bad in ([], [[]], [[1.0], [1.0, 2.0]], [[1.0], [0.0]]):
        with pytest.raises(ValueError):
            choose_setting(bad, 0)


async def test_the_tuned_settings_are_the_ones_used(tmp_path: Path) -> None:
    save_tuning(tmp_path, IOSettings(chunk_size=256 * KiB, io_threads=3, queue_depth=2))
    disk = await _round_trip(tmp_path)
    assert (disk.chunk_size, disk.io_threads, disk.queue_depth) == (256 * KiB, 3, 2)
    assert disk.pool.threads == 3
    reopened = DiskTier(tmp_path, "64MiB")
    async with TierStore([reopened]):
        record = reopened.committed()["big"]
        assert len(record.checksums) == -(-1_200_000 // (256 * KiB))  # one checksum per 256 KiB chunk


async def test_explicit_arguments_win_over_the_tuning_file(tmp_path: Path) -> None:
    save_tuning(tmp_path, IOSettings(chunk_size=256 * KiB, io_threads=3, queue_depth=2))
    disk = DiskTier(tmp_path, "64MiB", io_threads=5, chunk_size="512KiB")
    assert (disk.chunk_size, disk.io_threads, disk.queue_depth) == (512 * KiB, 5, 2)
    assert disk.io_settings.sources == {"chunk_size": "argument", "io_threads": "argument", "queue_depth": "tuning file"}
    await _round_trip(tmp_path, io_threads=5, chunk_size="512KiB")


async def test_a_folder_keeps_the_chunk_size_it_was_created_with(tmp_path: Path) -> None:
    await _round_trip(tmp_path, chunk_size="256KiB")
    save_tuning(tmp_path, IOSettings(chunk_size=1 * MiB, io_threads=2, queue_depth=2))
    disk = DiskTier(tmp_path, "64MiB")
    async with TierStore([disk]) as store:
        assert disk.chunk_size == 256 * KiB and disk.io_threads == 2
        assert "created with chunk_size=256.0 KiB" in disk.describe_io()
        assert (await store.get("big")).shape == (300_000,)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"hello": "world"}),
        json.dumps({"format": "tierstore-tuning", "version": 99, "settings": {}}),
        json.dumps({"format": "tierstore-tuning", "version": 1, "settings": {"chunk_size": 1000, "io_threads": 2, "queue_depth": 2}}),
        json.dumps({"format": "tierstore-tuning", "version": 1, "settings": {"chunk_size": 4096, "io_threads": -1, "queue_depth": 2}}),
        json.dumps({"format": "tierstore-tuning", "version": 1, "settings": {"chunk_size": 4096, "io_threads": 2}}),
        json.dumps([1, 2, 3]),
        "[" * 100_000,
    ],
    ids=["not-json", "foreign", "other-version", "unaligned-chunk", "negative-threads", "missing-setting", "a-list",
         "nested-too-deeply"],  # (the last: a RecursionError kept the store from opening)
)
async def test_a_damaged_or_foreign_tuning_file_warns_and_the_defaults_apply(tmp_path: Path, content: str) -> None:
    (tmp_path / TUNING_FILE).write_text(content)
    with pytest.warns(TuningFileWarning, match=TUNING_FILE):
        disk = DiskTier(tmp_path, "64MiB")
    assert (disk.chunk_size, disk.io_threads, disk.queue_depth) == (4 * MiB, 4, 4)
    assert set(disk.io_settings.sources.values()) <= {"default", "default: io_threads"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TuningFileWarning)
        await _round_trip(tmp_path)


def test_bad_io_arguments_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="io_threads"):
        DiskTier(tmp_path, "64MiB", io_threads=0)
    with pytest.raises(ValueError, match="queue_depth"):
        DiskTier(tmp_path, "64MiB", queue_depth=0)
    with pytest.raises(ValueError, match="chunk_size"):
        DiskTier(tmp_path, "64MiB", chunk_size=0)


@pytest.mark.device_modes
async def test_device_values_round_trip_through_a_tuned_disk_tier(tmp_path: Path, device_mode: str) -> None:
    save_tuning(tmp_path, IOSettings(chunk_size=128 * KiB, io_threads=2, queue_depth=1))
    value = torch.randn(200_000)
    async with TierStore([DeviceTier("cpu", "8MiB"), HostTier("8MiB"), DiskTier(tmp_path, "64MiB")]) as store:
        await store.put("x", value, tier="disk")
        await (await store.prefetch(["x"], "device"))
        assert torch.equal((await store.get("x")).cpu(), value)


async def test_run_all_keeps_to_its_limit_and_runs_then_after_the_jobs() -> None:
    pool = WorkerPool(4, "test")
    pool.start()
    try:
        running, most, events = [0], [0], []
        lock = threading.Lock()

        def job(i: int) -> int:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.01)
            with lock:
                running[0] -= 1
                events.append(i)
            return i * i

        results = await pool.run_all([lambda i=i: job(i) for i in range(8)], limit=2, then=lambda: events.append("then"))
        assert results == [i * i for i in range(8)]
        assert most[0] == 2 and events[-1] == "then" and len(events) == 9

        ran_then = []
        with pytest.raises(ZeroDivisionError):
            await pool.run_all([lambda: 1, lambda: 1 // 0], then=lambda: ran_then.append(1))
        assert ran_then == []  # no fdatasync after a failed write
    finally:
        pool.shutdown()

