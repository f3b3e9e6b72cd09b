"""SSD wear: bytes written per hour, drive writes per day and days to a drive's rated TBW, from
known figures, and from a real optimizer step paging state to disk."""

from __future__ import annotations

import decimal
import fractions
import math
from pathlib import Path

import numpy
import pytest
import torch

from tierstore.optim import TieredAdamW
from tierstore.optim.reports import TimeReport
from tierstore.wear import DEFAULT_CAPACITY, DriveWear, drive_wear


def test_arithmetic_with_known_inputs() -> None:
    # 100 MB in 0.5 s: 200 MB/s, 720 GB an hour, 17.28 TB a day.
    wear = drive_wear(100_000_000, 0.5, capacity="4TB", rated_tbw=2400)
    assert wear.bytes_per_second == pytest.approx(2e8)
    assert wear.bytes_per_hour == pytest.approx(7.2e11)
    assert wear.drive_writes_per_day == pytest.approx(17.28 / 4)
    assert wear.days_to_rated == pytest.approx(2400 / 17.28)
    assert "a 4 TB drive rated 2400 TBW reaches its rating in 139 days" in str(wear)


def test_defaults_are_a_typical_two_terabyte_drive() -> None:
    wear = drive_wear(1_000_000_000, 1.0)  # 1 GB/s: 86.4 TB a day
    assert wear.capacity == DEFAULT_CAPACITY == 2 * 1000**4
    assert wear.rated_bytes == 1200 * 1000**4  # 600 TBW per TB of capacity
    assert wear.days_to_rated == pytest.approx(1200 / 86.4)
    # Without a rating, it scales with the capacity given.
    assert drive_wear(1, 1.0, capacity="1TB").rated_bytes == 600 * 1000**4


def test_nothing_written_never_wears_out() -> None:
    for wear in (drive_wear(0, 1.0), drive_wear(0, 0.0)):
        assert wear.days_to_rated == math.inf
        assert "nothing written" in str(wear)
    assert drive_wear(0, 0.0).bytes_per_hour == 0.0


def test_bytes_written_in_no_time_are_not_said_to_be_nothing() -> None:
    """(1 GB in 0 seconds read "nothing written")"""
    wear = drive_wear(10**9, 0.0)
    assert "953.7 MiB written in no measured time (no rate)" in str(wear) and "nothing" not in str(wear)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((-1, 1.0), {}), ((1.5, 1.0), {}), ((True, 1.0), {}), ((1, -1.0), {}), ((1, float("nan")), {}),
     ((1, 1.0), {"capacity": 0}), ((1, 1.0), {"capacity": "lots"}), ((1, 1.0), {"rated_tbw": 0}),
     ((1, 1.0), {"rated_tbw": "1200"}),
     # (an infinite rating was an OverflowError, 1e-30 TBW "rated 0 TBW ... in 0.0 hours", infinite seconds "nothing written")
     ((1, 1.0), {"rated_tbw": float("inf")}), ((1, 1.0), {"rated_tbw": 1e-30}), ((1, float("inf")), {}),
     ((1, 1.0), {"rated_tbw": 1e297}), ((1, 1.0), {"rated_tbw": 10**400})],
)
def test_bad_input(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        drive_wear(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("number", [numpy.int64(1200), numpy.float32(1200.0), decimal.Decimal("1200"), fractions.Fraction(1200)],
                         ids=["numpy int", "numpy float", "Decimal", "Fraction"])
def test_numbers_of_other_kinds_are_numbers(number: object) -> None:
    """A rating from a config or a pandas column (numpy's numbers, a Decimal, a Fraction) was
    refused as "must be a finite number", and a numpy count of bytes or seconds too."""
    expected = drive_wear(10**9, 1.0, capacity="2TB", rated_tbw=1200)
    assert drive_wear(10**9, 1.0, capacity="2TB", rated_tbw=number) == expected  # type: ignore[arg-type]
    assert drive_wear(numpy.int64(10**9), numpy.float64(1.0)) == drive_wear(10**9, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [numpy.bool_(True), decimal.Decimal("NaN"), decimal.Decimal("sNaN"), decimal.Decimal("Infinity"),
                                 numpy.float64("nan"), fractions.Fraction(10**400)])
def test_what_is_no_rating_or_time_of_those_kinds_is_still_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="rated_tbw"):
        drive_wear(1, 1.0, rated_tbw=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seconds"):
        drive_wear(1, bad)  # type: ignore[arg-type]


def test_time_report_wear_and_summary() -> None:
    report = TimeReport(step=3, step_wall=0.25, disk_write_bytes=50_000_000, disk_read_bytes=50_000_000, disk_need_bytes=80_000_000)
    assert report.disk_write_bytes_per_hour == pytest.approx(7.2e11)
    assert report.io_overhead == pytest.approx(1.25)
    wear = report.wear(capacity="1TB", rated_tbw=300)
    assert isinstance(wear, DriveWear) and wear.days_to_rated == pytest.approx(300 / 17.28)
    text = str(report)
    assert "needed 76.3 MiB, moved 1.25x of it" in text
    assert "SSD wear:" in text and "drive writes/day" in text
    data = report.as_dict()
    assert data["wear"]["days_to_rated"] == pytest.approx(report.wear().days_to_rated)
    assert data["io_overhead"] == pytest.approx(1.25)
    assert "SSD wear" not in str(TimeReport(step_wall=0.1))  # no disk, no wear line


def _train(model: torch.nn.Module, opt: TieredAdamW, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(8, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_real_disk_step_reports_writes_per_hour(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    opt = TieredAdamW(model.parameters(), lr=1e-3, offload="disk", disk_root=tmp_path / "disk", host_capacity="128KiB")
    try:
        _train(model, opt)
        report = opt.time_report()
        assert report.disk_write_bytes > 0 and report.disk_write_bytes_per_hour > 0
        wear = report.wear()
        assert 0 < wear.days_to_rated < math.inf
        assert "SSD wear:" in str(report)
    finally:
        opt.close()


def test_memory_report_shows_the_last_steps_disk_writes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    opt = TieredAdamW(model.parameters(), lr=1e-3, offload="disk", disk_root=tmp_path / "disk", host_capacity="128KiB")
    try:
        assert opt.memory_report().wear is None  # no step yet
        _train(model, opt)
        memory = opt.memory_report()
        assert memory.disk_write_bytes_per_step == opt.time_report().disk_write_bytes > 0
        assert memory.wear is not None and memory.wear.bytes_per_hour > 0
        assert "to disk; SSD wear:" in str(memory)
    finally:
        opt.close()


def test_reports_for_a_given_drive_say_so_everywhere(tmp_path: Path) -> None:
    """The demo's ``--drive-capacity 1TB --drive-tbw 600`` reached only its last line: the memory
    and time reports (text and JSON) still described a 2 TB drive rated 1200 TBW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    opt = TieredAdamW(model.parameters(), lr=1e-3, offload="disk", disk_root=tmp_path / "disk", host_capacity="128KiB")
    try:
        _train(model, opt)
        timing, memory = opt.time_report().for_drive("1TB", 600), opt.memory_report().for_drive("1TB", 600)
        for text in (str(timing), str(memory)):
            assert "a 1 TB drive rated 600 TBW" in text and "2 TB" not in text
        expected = drive_wear(timing.disk_write_bytes, timing.step_wall, capacity="1TB", rated_tbw=600)
        assert timing.wear() == expected and timing.as_dict()["wear"] == expected.as_dict()
        assert memory.wear is not None and memory.wear.rated_bytes == 600 * 10**12 and memory.as_dict()["wear"]["capacity"] == 10**12
        assert opt.time_report().wear().capacity == drive_wear(1, 1.0).capacity  # (the optimizer's own reports keep the default)
        with pytest.raises(ValueError, match="capacity"):
            opt.time_report().for_drive("0TB")
    finally:
        opt.close()


def test_the_demo_describes_the_drive_it_is_given(tmp_path: Path) -> None:
    import json

    from tierstore.demo import main as demo_main

    out = tmp_path / "demo.json"
    assert demo_main(["--steps", "3", "--layers", "1", "--dim", "64", "--host-capacity", "256KiB", "--root", str(tmp_path / "d"),
                      "--drive-capacity", "1TB", "--drive-tbw", "600", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["last_step"]["wear"]["capacity"] == result["wear"]["capacity"] == 10**12
    assert result["last_step"]["wear"]["rated_bytes"] == result["memory"]["wear"]["rated_bytes"] == 600 * 10**12
