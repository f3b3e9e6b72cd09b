"""The main job runs end to end (a few steps of a tiny model) and its comparison holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierstore.cli import main


def test_demo_compare_timeline_plot_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "demo", "--steps", "6", "--layers", "2", "--dim", "64", "--seq", "32", "--vocab", "64", "--batch", "4",
        "--host-capacity", "512KiB", "--root", str(tmp_path / "store"), "--compare",
        "--timeline", str(tmp_path / "step.json"), "--plot", str(tmp_path / "loss.png"), "--json", str(tmp_path / "run.json"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the curves agree" in out and "bytes/param" in out and "disk read" in out
    assert json.loads((tmp_path / "step.json").read_text())["traceEvents"]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    run = json.loads((tmp_path / "run.json").read_text())
    assert len(run["losses"]) == 6 and run["losses"] == run["reference_losses"]
    assert run["memory"]["state_by_tier"]["disk"] > 0  # the state really paged to disk
    # SSD wear over the whole run: what paging wrote, at the run's pace, on the default 2 TB drive
    assert "over the run" in out and "SSD wear:" in out and "reaches its rating in" in out
    wear = run["wear"]
    assert wear["bytes_written"] > 0 and wear["capacity"] == 2 * 1000**4 and 0 < wear["days_to_rated"] < float("inf")
    assert wear["seconds"] == pytest.approx(sum(run["step_seconds"]))


def test_demo_in_backward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "3", "--layers", "1", "--dim", "32", "--seq", "16", "--vocab", "32", "--batch", "2",
            "--host-capacity", "512KiB", "--root", str(tmp_path / "store"), "--step-in-backward"]
    assert main(args) == 0
    assert "in-backward" in capsys.readouterr().out


def test_demo_with_weights_and_activations_in_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "4", "--layers", "2", "--dim", "64", "--seq", "32", "--vocab", "64", "--batch", "4",
            "--host-capacity", "4MiB", "--device-capacity", "256KiB", "--root", str(tmp_path / "store"),
            "--offload-params", "--offload-activations", "--compare"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the curves agree" in out and "parameters: " in out and "activations: " in out


def test_demo_bf16_with_compressed_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "4", "--layers", "1", "--dim", "32", "--seq", "16", "--vocab", "32", "--batch", "2",
            "--host-capacity", "512KiB", "--root", str(tmp_path / "store"), "--dtype", "bf16", "--state-precision", "8bit",
            "--master-weights", "lossless", "--compare", "--json", str(tmp_path / "run.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "bf16 parameters" in out and "lossless master, 8bit moments" in out and "not expected to agree exactly" in out
    run = json.loads((tmp_path / "run.json").read_text())
    assert len(run["losses"]) == 4 and "final_loss_gap" in run
    assert main([*args[:-2], "--dtype", "fp32"]) == 2  # a lossless master needs bf16 weights
    assert "needs --dtype bf16" in capsys.readouterr().err
    assert main([*args[:-2], "--drive-tbw", "0"]) == 2
    assert "--drive-tbw must be a finite number above 0" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--lr", "-1", "--lr must be a finite number >= 0"),
    ("--lr", "nan", "--lr must be a finite number >= 0"),
    ("--clip", "-1", "--clip is a gradient norm"),
    ("--drive-capacity", "0", "--drive-capacity must be above 0"),
    ("--drive-tbw", "inf", "--drive-tbw must be a finite number above 0"),  # (an OverflowError traceback)
    ("--json", "/proc/x.json", "--json /proc/x.json: cannot be written"),  # (it trained, then a traceback)
    ("--plot", "/", "--plot /: is a folder"),
    ("--root", "/proc/nope", "--root /proc/nope: the disk tier's folder cannot be made"),
])
def test_demo_refuses_bad_numbers_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, says: str) -> None:
    args = ["demo", "--steps", "2", "--layers", "1", "--dim", "32", "--heads", "2", "--root", str(tmp_path / "store"), option, value]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert says in captured.err and "step 1/" not in captured.out + captured.err
