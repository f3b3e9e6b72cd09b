"""What a policy researcher fed ``tierstore simulate`` and ``simulate()`` in a tryout, and got a
wrong number, a traceback or silence for: totals past an int64, the largest size a trace holds,
arrays that describe no trace, odd bench and link figures, store traces with arrays of the wrong
types, deletes counted as accesses in the header, an empty policy list, a plot format only
refused after the simulation, no progress when not on a terminal, unreadable plots of many
combinations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierstore import HostTier, TierStore, TraceError
from tierstore.cli import main
from tierstore.sim import Trace, load_trace, simulate


def _trace(ids: list[int], sizes: list[Any], keys: tuple[str, ...] = ("a", "b", "c")) -> Trace:
    n = len(ids)
    return Trace(keys=list(keys), ids=np.array(ids), sizes=np.array(sizes), ops=np.zeros(n, np.uint8), steps=np.zeros(n, np.int64))


@pytest.mark.parametrize("eviction", ["lru", "min", "fifo"])
def test_byte_totals_past_an_int64_are_exact(eviction: str) -> None:
    """Each size fits an int64, their sum did not: LRU's total wrapped to a negative number
    (byte miss ratio -3.0) while MIN's was right."""
    trace = _trace([0, 1, 2] * 2, [2**62] * 6)
    result = simulate(trace, {"host": 2**63 - 1}, eviction)
    assert result.requested_bytes == 6 * 2**62
    assert result.missed_bytes == 6 * 2**62 and result.byte_miss_ratio == 1.0
    assert trace.working_set == 3 * 2**62


def test_the_cli_header_and_json_of_huge_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.csv"
    path.write_text("key,size\na,5000000000000000000\nb,5000000000000000000\na,5000000000000000000\nb,5000000000000000000\n")
    out = tmp_path / "r.json"
    assert main(["simulate", str(path), "--capacity", "host=6000000000000000000", "--eviction", "lru,min", "--json", str(out)]) == 0
    assert "-" not in capsys.readouterr().out.splitlines()[0]  # (a working set of -7682269.0 TiB)
    for record in json.loads(out.read_text()):
        assert record["requested_bytes"] == 20 * 10**18 and record["byte_miss_ratio"] == 1.0, record


def test_the_largest_size_a_trace_holds_is_read_exactly(tmp_path: Path) -> None:
    """2**63 - 1 was refused as 'more than 2**63 - 1' (read through a float, which rounds it up),
    and sizes above 2**53 were rounded."""
    path = tmp_path / "max.csv"
    path.write_text(f"key,size\na,{2**63 - 1}\nb,{2**53 + 1}\nc,1e3\n")
    assert load_trace(path).sizes.tolist() == [2**63 - 1, 2**53 + 1, 1000]
    path.write_text(f"key,size\na,{2**63}\n")
    with pytest.raises(TraceError, match="more bytes than a trace holds"):
        load_trace(path)
    path.write_text(f"key,size\na,1{'0' * 5000}\n")
    with pytest.raises(TraceError, match="more bytes than a trace holds"):
        load_trace(path)


@pytest.mark.parametrize("make, words", [
    (lambda: _trace([0, 0], [-5, -5]), "negative size"),
    (lambda: Trace(["a"], np.array([0, 0]), np.array([1]), np.zeros(2, np.uint8), np.zeros(2, np.int64)), "differ in length: ids 2, sizes 1"),
    (lambda: _trace([0, 3], [5, 5]), "outside its table of 3 keys"),
    (lambda: _trace([0, 0], [5.0, 5.0]), "sizes hold float64"),
    (lambda: Trace(["a"], np.array([0]), np.array([1]), np.array([7], np.uint8), np.zeros(1, np.int64)), "codes other than"),
], ids=["negative size", "lengths", "id outside", "float sizes", "unknown op"])
def test_simulate_refuses_arrays_that_describe_no_trace(make: Any, words: str) -> None:
    """Negative sizes were simulated (negative bytes moved), unequal arrays blamed the policy,
    an id outside the keys was a bare IndexError."""
    with pytest.raises(TraceError, match=words):
        simulate(make(), {"host": 10})


def test_simulate_refuses_a_negative_capacity_naming_the_tier() -> None:
    with pytest.raises(ValueError, match="capacity of tier 'host'.*negative"):
        simulate(_trace([0, 0], [10, 10]), {"host": -1})
    assert simulate(_trace([0, 0], [10, 10]), {"host": "1KiB"}).misses == 1  # (as the CLI reads it)


@pytest.fixture
def small_csv(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    path.write_text("a,100\nb,200\na,100\n")
    return path


@pytest.mark.parametrize("content, words", [
    ("[1, 2, 3]", "not a `tierstore bench --json` output"),
    ("null", "not a `tierstore bench --json` output"),
    ('{"rows": 5}', "not a `tierstore bench --json` output"),
    ('{"bad": ', "cannot read the bench figures in"),
])
def test_bench_figures_of_the_wrong_shape_are_a_usage_error(small_csv: Path, capsys: pytest.CaptureFixture[str], content: str, words: str) -> None:
    """A JSON list was an AttributeError traceback; a truncated file an error naming neither
    the file nor the option."""
    bench = small_csv.with_name("bench.json")
    bench.write_text(content)
    assert main(["simulate", str(small_csv), "--capacity", "host=150", "--bench-json", str(bench)]) == 1
    err = capsys.readouterr().err
    assert words in err and "bench.json" in err and "Traceback" not in err


@pytest.mark.parametrize("link, words", [
    ("disk->host=0GB/s", "bandwidth must be more than 0"),
    ("warp->host=1GB/s", "no tier 'warp' is simulated"),
    ("host->host=1GB/s", "its two ends are one tier"),
])
def test_links_that_nothing_crosses_or_take_forever_are_refused(small_csv: Path, capsys: pytest.CaptureFixture[str], link: str, words: str) -> None:
    """0 GB/s was a ZeroDivisionError traceback; a link to a tier not simulated was ignored."""
    assert main(["simulate", str(small_csv), "--capacity", "host=150", "--links", link]) == 1
    assert words in capsys.readouterr().err


def test_links_may_name_tiers_with_digits(small_csv: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", str(small_csv), "--capacity", "gpu0=150", "--links", "disk->gpu0=1MB/s", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["stall_seconds"] >= 300 / 1e6  # (300 bytes missed at the given 1 MB/s, not the default)


async def _store_trace(path: Path) -> dict[str, np.ndarray]:
    async with TierStore([HostTier("64KiB")], trace=path) as store:
        for key in "abc":
            await store.put(key, torch.zeros(16))
        await store.delete("a")
    with np.load(path) as archive:
        return {name: archive[name].copy() for name in archive.files}


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(keys=np.array(list(d["keys"]), dtype=object)), "'keys' array holds Python objects"),
    (lambda d: d.update(key=d["key"] + 0.7), "'key' array holds float64 values"),
    (lambda d: d.update(nbytes=d["nbytes"].astype(str)), "'nbytes' array holds <U"),
    (lambda d: d.update(time=d["time"].astype(str)), "'time' array holds <U"),
    (lambda d: d.update(step=d["step"][:1]), "columns of different lengths"),
])
async def test_a_store_trace_with_arrays_of_the_wrong_type_is_refused(tmp_path: Path, change: Any, words: str) -> None:
    """An object array gave numpy's message naming no file; float key indexes were truncated
    and strings parsed as sizes, silently."""
    path = tmp_path / "t.npz"
    data = await _store_trace(path)
    change(data)
    np.savez(path, **data)
    with pytest.raises(TraceError, match=words):
        load_trace(path)


async def test_the_header_counts_deletes_apart_from_accesses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The header said '4 accesses' (the delete among them) where the ratios are of 3."""
    path = tmp_path / "t.npz"
    await _store_trace(path)
    out = tmp_path / "r.json"
    assert main(["simulate", str(path), "--capacity", "host=1KiB", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("3 accesses and 1 delete, 3 keys")
    assert json.loads(out.read_text())[0]["requests"] == 3


@pytest.mark.parametrize("option", ["--eviction", "--prefetch"])
def test_an_empty_policy_list_is_a_usage_error(small_csv: Path, capsys: pytest.CaptureFixture[str], option: str) -> None:
    """``--eviction ''`` printed an empty table and exited 0."""
    assert main(["simulate", str(small_csv), "--capacity", "host=150", option, " , "]) == 1
    assert "policy named" in capsys.readouterr().err


def test_a_plot_format_matplotlib_lacks_is_refused_before_the_simulation(small_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", str(small_csv), "--capacity", "host=150", "--json", str(out), "--plot", str(tmp_path / "out.txt")]) == 1
    assert "writes no '.txt' images" in capsys.readouterr().err
    assert not out.exists()  # (refused before anything ran)


def test_a_sweep_shows_progress_when_not_on_a_terminal(small_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Piped, a 3-minute sweep printed nothing until its table."""
    assert main(["simulate", str(small_csv), "--capacity", "host=150", "--eviction", "lru,min", "--sweep"]) == 0
    assert "simulate (3 rows a run)" in capsys.readouterr().err


def test_plots_of_many_combinations_stay_readable(tmp_path: Path) -> None:
    """48 combinations: the legend ran off the curves' figure and the prefetch plot was 6288 px
    wide."""
    from PIL import Image

    plot = tmp_path / "many.png"
    evictions = "lru,fifo,lfu,arc,s3fifo,sieve,clock,slru,2q,lirs,tinylfu,min"
    assert main(["simulate", "loop:keys=40,loops=3", "--capacity", "host=64KiB", "--eviction", evictions,
                 "--prefetch", "none,sequential,amp,schedule", "--plot", str(plot)]) == 0
    curves, bars = Image.open(plot), Image.open(tmp_path / "many_prefetch.png")
    assert curves.width > 7 * 120  # (the legend beside the axes, not over them)
    assert bars.width <= 25 * 120, bars.size


def test_simulate_takes_a_capacity_of_a_fraction_of_the_working_set() -> None:
    """(The review: a float capacity, ``0.5 * trace.working_set``, ran before the capacities were
    checked; it is rounded down again, and a negative or infinite one refused.)"""
    trace = _trace([0, 1, 2, 0], [10, 20, 30, 10])
    assert simulate(trace, {"host": 0.5 * trace.working_set}).capacity == 30
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity of tier 'host'"):
            simulate(trace, {"host": bad})


def test_simulate_refuses_sizes_past_an_int64_and_arrays_of_two_dimensions() -> None:
    """(The review: uint64 sizes of 2**63 or more passed and made the working set negative; 2-D
    arrays passed and the policy was blamed.)"""
    with pytest.raises(TraceError, match="at most 2..63 - 1"):
        simulate(_trace([0], np.array([2**63], dtype=np.uint64)), {"host": 10})
    flat = _trace([0, 1], [5, 5])
    with pytest.raises(TraceError, match="ids are an array of 2 dimensions"):
        simulate(Trace(flat.keys, flat.ids.reshape(1, 2), flat.sizes, flat.ops, flat.steps), {"host": 10})
