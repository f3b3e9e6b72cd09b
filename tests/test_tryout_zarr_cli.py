"""A new user's tryout of the zarr adapter and the command line: each test failed before its fix."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from tierstore import DiskTier, HostTier, LoopDeadlockError, SyncTierStore
from tierstore.cli import main
from tierstore.sync import call_now
from tierstore.zarr import TierZarrStore


def test_a_sharded_array_reads_on_a_store_with_no_memory_tier(tmp_path: Path) -> None:
    """(zarr reads a shard's index as a byte range: "hold needs a memory tier" for every read)"""
    with SyncTierStore([DiskTier(tmp_path / "disk", "64MiB")]) as store:
        array = zarr.create_array(TierZarrStore(store), name="x", shape=(100,), chunks=(10,), shards=(50,), dtype="f4")
        array[:] = np.arange(100, dtype="f4")
        np.testing.assert_array_equal(array[3:7], [3, 4, 5, 6])
        np.testing.assert_array_equal(array[:], np.arange(100, dtype="f4"))


def test_sequential_reads_prefetch_on_every_pass_not_only_the_first(tmp_path: Path) -> None:
    """(the highest chunk prefetched was kept across passes: the second epoch prefetched none,
    64 of 64 reads missed)"""
    with SyncTierStore([HostTier("2MiB"), DiskTier(tmp_path / "disk", "256MiB")]) as store:
        array = zarr.create_array(TierZarrStore(store), name="x", shape=(8192, 256), chunks=(128, 256), dtype="f4", compressors=None)
        array[:] = np.ones(array.shape, dtype="f4")
        issued = []
        for _ in range(3):
            before = store.stats()["prefetch"]["issued"]
            for start in range(0, 8192, 512):
                array[start : start + 512]
            issued.append(store.stats()["prefetch"]["issued"] - before)
        assert issued[1] >= issued[0] // 2 and issued[2] >= issued[0] // 2 and issued[0] > 0, issued


def test_a_blocking_adapter_call_on_the_loop_thread_is_a_loop_deadlock_error(tmp_path: Path) -> None:
    """(a plain RuntimeError, where zarr's own blocking API and the README say LoopDeadlockError)"""
    with SyncTierStore([HostTier("1MiB")]) as store:
        adapter = TierZarrStore(store)
        with pytest.raises(LoopDeadlockError, match="own loop thread"):
            call_now(lambda: adapter.get_sync("x"))
        store.put("still", torch.ones(2))
        assert torch.equal(store.get("still"), torch.ones(2))


def test_importing_a_zarr_array_instead_of_a_group_says_so(tmp_path: Path) -> None:
    """(zarr's own "ContainsArrayError: An array already exists ... at path ." came out)"""
    zarr.create_array(str(tmp_path / "plain"), shape=(3,), dtype="f4")
    with SyncTierStore([HostTier("1MiB")]) as store, pytest.raises(ValueError, match="is a zarr array, not a group"):
        store.import_zarr(tmp_path / "plain")


# -- the command line ---------------------------------------------------------------------------


def test_bench_refuses_its_json_and_folder_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(``--json FOLDER`` ran the whole benchmark, then an ``IsADirectoryError`` traceback lost
    its figures; ``--dir FILE``: a ``FileExistsError`` traceback)"""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["bench", "--quick", "--disk-only", "--dir", str(tmp_path / "d"), "--json", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == f"tierstore bench: --json: {tmp_path} is a folder; give the path of the file to write" and out == ""
    assert main(["bench", "--quick", "--dir", str(afile)]) == 2
    assert capsys.readouterr().err.strip() == f"tierstore bench: --dir {afile} is not a folder"
    assert main(["bench", "--tune", str(tmp_path / "t"), "--json", str(afile / "x.json")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_demo_refuses_a_plot_format_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(it trained, printed its reports, then matplotlib's ValueError traceback)"""
    pytest.importorskip("matplotlib")
    assert main(["demo", "--root", str(tmp_path / "demo"), "--steps", "2", "--plot", str(tmp_path / "loss.xyz")]) == 2
    out, err = capsys.readouterr()
    assert "matplotlib writes no '.xyz' images" in err and "GPT:" not in out


def test_ctrl_c_ends_a_command_with_one_line_and_removes_the_bench_scratch(tmp_path: Path) -> None:
    """(a 55-line traceback, and ~365 MiB of the benchmark's files left in its folder)"""
    scratch = tmp_path / "bench"
    scratch.mkdir()
    (scratch / "mine.txt").write_text("a file of the user's")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "tierstore", "bench", "--disk-only", "--sizes-mib", "1", "--reps", "2000", "--volume-mib", "8",
         "--dir", str(scratch), "--json", str(tmp_path / "b.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(scratch.glob("disk-*")) and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert child.poll() is None, child.communicate()
        time.sleep(0.5)  # (measuring)
        # Ctrl-C, and again every few seconds, as a user would: a cancellation that lands as a
        # disk write commits is absorbed by the store (see the note of this stop), and asyncio
        # raises KeyboardInterrupt itself at the second.
        for _ in range(10):
            child.send_signal(signal.SIGINT)
            try:
                out, err = child.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            raise AssertionError("tierstore bench did not end on Ctrl-C")
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGINT, (out, err)  # (ended by the signal after its message: a shell loop stops)
    assert err.strip().splitlines()[-1] == "tierstore bench: interrupted" and "Traceback" not in err, err
    assert sorted(p.name for p in scratch.iterdir()) == ["mine.txt"], (out, err)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to run as another user")
def test_a_folder_this_user_cannot_read_is_not_called_damaged(tmp_path: Path) -> None:
    """(``info`` on a healthy folder another user owns: "LMDB's own header or pages are damaged
    ... restore the folder from a copy"; ``repair``: a PermissionError traceback)"""
    root = tmp_path / "store"
    with SyncTierStore([DiskTier(root, "16MiB")]) as store:
        store.put("a", torch.ones(4))
    os.chmod(tmp_path, 0o755)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "tierstore"]
    env = {**os.environ, "HOME": str(tmp_path)}
    for command in ("info", "repair"):
        done = subprocess.run([*as_nobody, command, str(root)], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "damaged" not in done.stderr and ("Permission denied" in done.stderr), done.stderr
    # (review) not a CorruptionError either, which code restoring damaged folders from a copy catches
    opening = ("import sys; from tierstore import SyncTierStore, DiskTier\n"
               "try:\n    SyncTierStore([DiskTier(sys.argv[1], '16MiB')]).open()\nexcept Exception as exc:\n"
               "    from tierstore import CorruptionError\n    print(type(exc).__name__, isinstance(exc, PermissionError), isinstance(exc, CorruptionError))")
    done = subprocess.run([*as_nobody[:-2], "-c", opening, str(root)], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split()[1:] == ["True", "False"], (done.stdout, done.stderr)
