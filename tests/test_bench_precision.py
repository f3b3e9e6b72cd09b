"""bench_optim part (f), compressed Adam state, end to end at a tiny size: its JSON holds every
setting's figures and they are sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tierstore.bench.optim import main
from tierstore.bench.precision import SETTINGS


def test_part_f_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "bench_optim.json"
    argv = ["--parts", "f", "--f-steps", "4", "--f-timed-steps", "2", "--f-layers", "1", "--f-dim", "32", "--f-seq", "16",
            "--json", str(out), "--dir", str(tmp_path / "disk")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.with_name("bench_optim_f.json").read_text())
    rows = {row["setting"]: row for row in result["settings"]}
    assert list(rows) == [s.name for s in SETTINGS] and all(name in printed for name in rows)
    stored = {name: row["stored_bytes_per_param"] for name, row in rows.items()}
    # fp32 moments hold as much as bf16 ones beside an fp32 master, or more: on the plain CPU an
    # fp32 parameter is its own master, so exact fp32 state stores 8 B, not 12
    assert stored["fp32"] >= stored["bf16"] > stored["8bit"]
    assert stored["bf16 model, fp32 master"] > stored["bf16 model, lossless + bf16"] > stored["bf16 model, lossless + 8bit"]
    assert stored["bf16 model, lossless + 8bit"] == pytest.approx(4, abs=0.2)  # 2 B master + 2 x (1 B code + a scale per 256)
    for name, row in rows.items():
        assert row["paged_parameters"] > 0 and row["host_tier_bytes"] > 0
        assert row["disk_bytes_per_param_step"] > 0, name  # half the state is on disk: every step pages
        # near the need, not exactly it: two steps right after warm-up, an entry read in one step
        # may be written back in the next, and a write-back still in flight when a step ends counts
        # in the next (tests/test_io_accounting.py holds the steady state to 1.1x)
        assert row["disk_need_bytes"] > 0
        assert 0.5 <= (row["disk_read_bytes"] + row["disk_write_bytes"]) / row["disk_need_bytes"] <= 3, name
        assert row["step_ms"] > 0 and row["compute_ms"] > 0 and row["vs_bound"] > 0 and row["step_vs_fp32"] > 0
        assert math.isfinite(row["final_loss"]) and math.isfinite(row["torch_final_loss"])
        # the disk-paged steps and the host-resident curve run the same math on the same data
        assert row["disk_vs_host_loss_gap"] == 0.0, name
    assert rows["fp32"]["step_vs_fp32"] == 1.0 and rows["fp32"]["vs_fp32"] == 0.0
    assert set(result["losses"]) == {"torch fp32", "torch bf16", *rows} and all(len(v) == 4 for v in result["losses"].values())
    # exact fp32 state is torch's AdamW's math: the same losses, near bit for bit
    assert result["losses"]["fp32"] == pytest.approx(result["losses"]["torch fp32"], rel=1e-5)
    if result["plot"] is not None:
        assert Path(result["plot"]).stat().st_size > 1000
    else:
        assert "no convergence plot" in printed


def test_part_f_rejects_no_steps(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--f-steps must be at least 1"):
        main(["--parts", "f", "--f-steps", "0", "--json", str(tmp_path / "b.json"), "--dir", str(tmp_path / "disk")])
