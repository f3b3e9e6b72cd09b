"""Rough edges of issue #9: lazy conj/neg views in put, the demo's bad options, progress bars in logs."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, TierStore
from tierstore.bench.common import milestones, progress
from tierstore.cli import main

# -- conj and neg views -----------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
async def test_a_conjugate_view_is_stored_as_the_values_it_shows(tier: str, tmp_path: Path) -> None:
    x = torch.randn(5, 3, dtype=torch.complex64)
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("conj", x.conj(), tier)
        await store.put("neg", x.conj().imag, tier)  # a float tensor with the negative bit set
        conj, neg = await store.get("conj"), await store.get("neg")
        assert not conj.is_conj() and torch.equal(conj, torch.conj_physical(x))
        assert not neg.is_neg() and torch.equal(neg, -x.imag)
        assert torch.equal(x, x.conj().conj())  # the caller's tensor is untouched


# -- the demo refuses bad options in one line -------------------------------------------------------

TINY = ["--layers", "1", "--dim", "32", "--seq", "16", "--vocab", "32", "--batch", "2"]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--steps", "-3"], "--steps must be at least 1"),
        (["--device", "cuda"], "CUDA is not available"),
        (["--device", "nonsense"], "is not a device name"),
        (["--disk-capacity", "64KiB"], "--disk-capacity 64KiB is too small"),
        (["--host-capacity", "lots"], "--host-capacity: cannot read 'lots'"),
    ],
)
def test_the_demo_refuses_bad_options_in_one_line(
    options: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if "cuda" in options and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["demo", *TINY, "--root", str(tmp_path / "store"), *options]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tierstore demo: error: ") and says in err, err
    assert not (tmp_path / "store").exists()  # refused before anything was created


def test_the_demo_accepts_the_smallest_disk_it_asks_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (a host tier of 128 KiB, below the 180 KiB of state: 64 KiB held no gradient beside a
    # state under the emulated device, where gradients cross to the host and wait there)
    assert main(["demo", *TINY, "--steps", "2", "--root", str(tmp_path / "a"), "--disk-capacity", "1KiB"]) == 2
    asked = capsys.readouterr().err.rsplit("give at least ", 1)[1].strip().replace(" ", "")
    assert main(["demo", *TINY, "--steps", "3", "--host-capacity", "128KiB", "--root", str(tmp_path / "b"), "--disk-capacity", asked]) == 0


# -- progress bars stay out of logs -----------------------------------------------------------------


def test_a_progress_bar_writes_nothing_when_not_on_a_terminal() -> None:
    log = io.StringIO()  # like a file or a pipe: not a TTY
    for _ in progress(range(500), desc="work", file=log, mininterval=0):
        pass
    assert log.getvalue() == ""


def test_milestones_are_few_and_end_on_the_last_step() -> None:
    assert milestones(200) == set(range(20, 201, 20))
    assert milestones(3) == {1, 2, 3}
    assert max(milestones(7)) == 7 and len(milestones(1000)) <= 11
    assert milestones(0) == set()


def test_the_demo_logs_a_few_lines_when_output_is_not_a_terminal(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tierstore", "demo", *TINY, "--steps", "30", "--root", str(tmp_path / "store")]
    env = {**os.environ, "TQDM_MININTERVAL": "0"}  # a bar, if drawn, would refresh every step
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "\r" not in output  # no bar redrawn into the log
    progress_lines = [line for line in output.splitlines() if line.startswith("tiered: step ")]
    assert progress_lines[-1].startswith("tiered: step 30/30") and len(progress_lines) <= 11
    assert len(output.splitlines()) < 60
