"""The simulator: trace formats, multi-tier replay, prefetch, the command line."""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierstore import HostTier, TierStore
from tierstore.cli import main
from tierstore.sim import (
    LinkModel,
    load_trace,
    loop_trace,
    optimizer_trace,
    scan_trace,
    simulate,
)


def test_csv_with_header_and_extra_columns(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("key,size,timestamp\na,10,1\nb,20,2\na,10,3\n# comment\nc,5,4\n")
    trace = load_trace(path)
    assert trace.keys == ["a", "b", "c"] and trace.ids.tolist() == [0, 1, 0, 2] and trace.sizes.tolist() == [10, 20, 10, 5]
    result = simulate(trace, {"host": 30})
    assert result.requests == 4 and result.misses == 3


@pytest.mark.parametrize("third", ["get,set,get", "1,2,3"])
def test_csv_without_header_and_extra_columns(tmp_path: Path, third: str) -> None:
    """(refused: the first access, ``a,10,get``, was taken for a header of three columns without
    a key and a size by their names; the README says extra columns are ignored)"""
    path = tmp_path / "t.csv"
    path.write_text("".join(f"{key},{size},{extra}\n" for key, size, extra in zip("aba", (10, 20, 10), third.split(","), strict=True)))
    trace = load_trace(path)
    assert trace.keys == ["a", "b"] and trace.ids.tolist() == [0, 1, 0] and trace.sizes.tolist() == [10, 20, 10]
    path.write_text("key,2024,size\na,1,100\nb,1,200\na,1,100\n")  # (a header with a numeric name: still a header)
    assert load_trace(path).sizes.tolist() == [100, 200, 100]


def test_simulate_refuses_an_output_it_cannot_write_before_it_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(a ``FileExistsError`` traceback, after the simulation had run)"""
    path = tmp_path / "t.csv"
    path.write_text("a,10\nb,10\na,10\n")
    (tmp_path / "afile").write_text("x")
    for option in ("--json", "--plot"):
        assert main(["simulate", str(path), "--capacity", "host=30", option, str(tmp_path / "afile" / "out")]) == 1
        err = capsys.readouterr().err
        assert err.strip() == f"tierstore simulate: cannot write {tmp_path / 'afile' / 'out'}: {tmp_path / 'afile'} is a file, not a folder"
    assert main(["simulate", str(path), "--capacity", "host=30", "--json", str(tmp_path)]) == 1
    assert "is a folder" in capsys.readouterr().err


def test_a_trace_path_that_is_a_folder_is_refused_when_the_store_is_made(tmp_path: Path) -> None:
    """(accepted, and at close an ``IsADirectoryError`` lost the trace and left ``<folder>.partial``)"""
    with pytest.raises(IsADirectoryError, match="is a folder; give the path of the file to write"):
        TierStore([HostTier("1MiB")], trace=tmp_path)
    assert not tmp_path.with_name(tmp_path.name + ".partial").exists()


def test_csv_without_header_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("x,1\ny,2\n")
    assert load_trace(path).keys == ["x", "y"]
    path.write_text("x,1\ny,lots\n")
    with pytest.raises(ValueError, match="not a number"):
        load_trace(path)
    path.write_text("")
    with pytest.raises(ValueError, match="no accesses"):
        load_trace(path)


async def test_a_live_store_trace_replays(tmp_path: Path) -> None:
    path = tmp_path / "trace.npz"
    async with TierStore([HostTier("1MiB")], trace=path) as store:
        for step in range(3):
            for i in range(5):
                await store.put(f"k{i}", torch.full((256,), float(step)))
                await store.get(f"k{i}")
            store.mark_step()
        await store.delete("k0")
    with np.load(path) as data:  # one line of numpy reads the columns
        assert set(data.files) >= {"time", "op", "key", "nbytes", "tier", "before", "hit", "step", "keys", "ops", "tiers"}
        assert list(data["ops"][data["op"][:2]]) == ["put", "get"]
    trace = load_trace(path)
    assert len(trace) == 31 and trace.steps.max() == 3
    result = simulate(trace, {"host": 4096}, "lru")
    assert result.requests == 30


def test_scan_and_loop_extremes() -> None:
    scan = simulate(scan_trace(100, 10), {"host": 500}, "lru")
    assert scan.misses == 100
    loop = loop_trace(keys=10, loops=5, size=1)
    assert simulate(loop, {"host": 9}, "lru").misses == 50  # LRU's worst case
    assert simulate(loop, {"host": 9}, "min").misses < 50
    assert simulate(loop, {"host": 10}, "lru").misses == 10


def test_two_tiers_move_victims_down() -> None:
    trace = loop_trace(keys=10, loops=3, size=100)
    result = simulate(trace, {"device": 300, "host": 1000}, "lru")
    assert result.misses == 30  # the device is too small for the loop
    assert result.hits_by_tier["host"] == 20  # but the host holds it after the first pass
    assert result.link_bytes["device->host"] > 0 and result.link_bytes["host->device"] == 2000


def test_schedule_prefetch_with_min_removes_the_misses_of_lru() -> None:
    trace = optimizer_trace(keys=32, steps=40, size=1 << 20)
    capacity = trace.working_set // 2
    lru = simulate(trace, {"host": capacity}, "lru", "none")
    best = simulate(trace, {"host": capacity}, "min", "schedule")
    assert lru.misses > 0 and best.prefetches > 0
    assert best.misses <= 0.05 * lru.misses
    # Both miss the same in the first step (cold, and nothing learned yet); after it, none.
    first = simulate(optimizer_trace(keys=32, steps=1, size=1 << 20), {"host": capacity}, "lru", "none")
    assert best.misses == first.misses
    # With compute between accesses the prefetches hide their transfers; without, nothing can.
    lru_timed = simulate(trace, {"host": capacity}, "lru", "none", think=1e-3)
    best_timed = simulate(trace, {"host": capacity}, "min", "schedule", think=1e-3)
    assert best_timed.stall_seconds < 0.1 * lru_timed.stall_seconds


def test_link_model_parsing() -> None:
    model = LinkModel()
    model.override("disk->host=1GB/s@1ms, host->device=10GiB/s")
    assert model.links["disk->host"] == (1e9, 1e-3)
    assert model.seconds("disk->host", 10**9) == pytest.approx(1.001)
    with pytest.raises(ValueError):
        model.override("disk->host=fast")


def test_command_line_sweep_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv = tmp_path / "t.csv"
    trace = optimizer_trace(keys=16, steps=6, size=4096)
    csv.write_text("".join(f"{trace.keys[i]},{s}\n" for i, s in zip(trace.ids.tolist(), trace.sizes.tolist(), strict=True)))
    out, png = tmp_path / "r.json", tmp_path / "mrc.png"
    code = main(["simulate", str(csv), "--capacity", "host=32KiB", "--eviction", "lru,fifo,min",
                 "--prefetch", "none,sequential", "--sweep", "--json", str(out), "--plot", str(png)])
    assert code == 0
    records = json.loads(out.read_text())
    assert {r["eviction"] for r in records} == {"lru", "fifo", "min"}
    assert {"eviction", "prefetch", "capacity", "requests", "misses", "miss_ratio", "byte_miss_ratio"} <= set(records[0])
    assert len({r["capacity"] for r in records}) > 5  # the sweep
    assert png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "miss ratio" in printed and "lru" in printed


def test_command_line_synthetic_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "optimizer:keys=8,steps=4,size=1024", "--capacity", "host=4KiB", "--eviction", "lru,min", "--prefetch", "none,schedule"]) == 0
    assert "schedule" in capsys.readouterr().out


def test_command_line_reports_every_tier(capsys: pytest.CaptureFixture[str]) -> None:
    """With two tiers the table shows where requests were served, the second tier's too (it
    showed the first tier alone)."""
    assert main(["simulate", "optimizer:keys=8,steps=4,size=1024", "--capacity", "device=2KiB,host=4KiB", "--eviction", "min"]) == 0
    printed = capsys.readouterr().out
    served = [line for line in printed.splitlines() if line.startswith("min ") and "below" in line]
    assert len(served) == 1 and "device (2.0 KiB)" in served[0] and "host (4.0 KiB)" in served[0], printed
    shares = [float(part.rsplit(" ", 1)[1].rstrip("%")) for part in served[0].split("none", 1)[1].split(",")]
    assert sum(shares) == pytest.approx(100, abs=0.3) and shares[1] > 0


def test_bad_inputs_get_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tmp_path / "missing.csv"), "--capacity", "host=1MiB"]) != 0
    assert main(["simulate", "optimizer:keys=4", "--capacity", "host=1MiB", "--eviction", "nope"]) != 0
    assert main(["simulate", "optimizer:keys=4", "--capacity", "1MiB"]) != 0
    err = capsys.readouterr().err
    assert "nope" in err and "host=" in err
    # the disk holds everything: a capacity for it would simulate a disk-sized cache tier
    assert main(["simulate", "optimizer:keys=4", "--capacity", "disk=1MiB"]) != 0
    assert "the simulated disk holds everything" in capsys.readouterr().err
    # a folder (a traceback before), a count read as a byte size, a tier given twice (the last one won)
    assert main(["simulate", str(tmp_path), "--capacity", "host=1MiB"]) != 0
    assert "is a folder" in capsys.readouterr().err
    assert main(["simulate", "optimizer:keys=-1", "--capacity", "host=1MiB"]) != 0
    assert "is not a count" in capsys.readouterr().err
    assert main(["simulate", "scan:keys=10", "--capacity", "host=1KiB,host=2KiB"]) != 0
    assert "two capacities" in capsys.readouterr().err
    # an .npz that is not a store trace (numpy's words on pickles before)
    garbage, other = tmp_path / "garbage.npz", tmp_path / "other.npz"
    garbage.write_bytes(bytes(range(256)))
    np.savez(other, a=np.arange(3))
    for path, says in ((garbage, "not a numpy archive"), (other, "lacks the trace's arrays")):
        assert main(["simulate", str(path), "--capacity", "host=1MiB"]) != 0
        err = capsys.readouterr().err
        assert "is not a store trace" in err and says in err and "pickle" not in err
    assert main(["simulate", "optimizer:keys=0", "--capacity", "host=1MiB"]) == 1  # (it printed an empty table)
    assert "makes no accesses" in capsys.readouterr().err
    (tmp_path / "one.csv").write_text("a,abc\n")  # one line, taken as a header: no accesses, said so
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (numpy's own "input contained no data" leaked out)
        assert main(["simulate", str(tmp_path / "one.csv"), "--capacity", "host=1MiB"]) == 1
    assert "taken as a header" in capsys.readouterr().err


def test_the_custom_policy_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    runpy.run_path(str(Path(__file__).parent.parent / "examples" / "custom_policy.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "clock: miss ratio" in out and "resident on the first tier" in out


def test_the_policy_workbench_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "policy_workbench.py"))
    png = tmp_path / "mrc.png"
    example["main"](["zipf:keys=300,accesses=4000,alpha=0.9", "--plot", str(png)])
    out = capsys.readouterr().out
    assert "probation-lru" in out and "sieve" in out and png.stat().st_size > 1000
    policy = example["ProbationLRU"]()  # the policy itself: a one-hit wonder leaves before a hit key
    policy.set_capacity(50)  # probation's share is 5 bytes: b (10) is over it
    for key in "ab":
        policy.on_insert(key, 10)
    policy.on_hit("a")
    assert policy.victim() == "b" and policy.victim(lambda key: key != "a") is None and policy.victim() == "a"
    policy.set_capacity(1000)  # probation's share is 100 bytes: b (10) is within it, main's a goes
    policy.reset()  # forgets the keys, not the capacity
    for key in "ab":
        policy.on_insert(key, 10)
    policy.on_hit("a")
    assert policy.victim() == "a"


def test_suggestions_the_trace_cannot_take_are_skipped_as_a_live_store_skips_them() -> None:
    """A suggestion for a tier the trace lacks was prefetched into the fastest tier (1 miss in 40
    where the live store, skipping it, had 40); one for a key the trace lacks raised IndexError."""
    from tierstore.sim import Trace, simulate

    class Suggests:
        def __init__(self, suggest: Any) -> None:
            self.suggestion, self.last = suggest, 0

        def on_access(self, key: Any, nbytes: int, tier: str, hit: bool) -> None:
            self.last = key

        def on_step(self) -> None:
            pass

        def suggest(self) -> list[tuple[Any, str | None]]:
            return self.suggestion(self.last)

        def reset(self) -> None:
            pass

    trace = Trace.from_accesses([f"k{i % 8}" for i in range(40)], [4096] * 40)
    capacities = {"fast": 3 * 4096, "slow": 1 << 20}
    plain = simulate(trace, capacities).misses
    for odd in ([((1, "nosuchtier"))], [(999, None)], [(-1, None)], [("k99", None)]):
        assert simulate(trace, capacities, prefetch=Suggests(lambda key, odd=odd: odd)).misses == plain, odd
    useful = simulate(trace, capacities, prefetch=Suggests(lambda key: [((key + 1) % 8, "fast")])).misses
    assert useful < plain


async def test_a_pop_in_a_store_trace_removes_the_key_in_the_simulator(tmp_path: Path) -> None:
    """A pop read as a plain access left the key cached: the put after it counted as a hit."""
    for verb in ("pop", "delete"):
        path = tmp_path / f"{verb}.npz"
        async with TierStore([HostTier("64KiB")], trace=path) as store:
            await store.put("a", torch.zeros(16))
            await getattr(store, verb)("a")
            await store.put("a", torch.zeros(16))
            await store.get("a")
        result = simulate(load_trace(path), {"host": 65536}, eviction="lru")
        assert result.misses == 2, verb  # both puts of "a": after the pop or delete it is a new key
        assert result.requests == (4 if verb == "pop" else 3)  # (a pop reads the value: an access)


@pytest.mark.parametrize("damage, words", [
    (lambda d: d.update(nbytes=-d["nbytes"]), "negative sizes"),
    (lambda d: d.update(time=d["time"][::-1].copy()), "times that go backwards"),
    (lambda d: d["time"].__setitem__(1, np.nan), "times that are not finite"),
    (lambda d: d["op"].__setitem__(0, 200), "operation codes outside"),
    (lambda d: d["key"].__setitem__(0, 99), "key indexes outside"),
])
async def test_a_store_trace_edited_into_rows_no_store_writes_is_refused(tmp_path: Path, damage: Any, words: str) -> None:
    from tierstore import TraceError

    path = tmp_path / "t.npz"
    async with TierStore([HostTier("64KiB")], trace=path) as store:
        for key in "abc":
            await store.put(key, torch.zeros(16))
    with np.load(path) as archive:
        data = {name: archive[name].copy() for name in archive.files}
    damage(data)
    np.savez(path, **data)
    with pytest.raises(TraceError, match=words):
        load_trace(path)


def test_a_policy_that_raises_in_the_simulator_is_named_with_its_method() -> None:
    from policies import LRU, NoPrefetch
    from tierstore import PolicyError

    class HitRaises(LRU):
        def on_hit(self, key: Any) -> None:
            raise ValueError("bug in on_hit")

    class ListVictim(LRU):
        def victim(self, evictable: Any = None) -> Any:
            return [super().victim(evictable)]

    class ResetRaises(NoPrefetch):
        def reset(self) -> None:
            raise RuntimeError("bug in reset")

    class BareKeys:
        def on_access(self, key: Any, nbytes: int, tier: str, hit: bool) -> None:
            pass

        def on_step(self) -> None:
            pass

        def reset(self) -> None:
            pass

        def suggest(self) -> Any:
            return ["k"]

    trace = loop_trace(4, 3, 10)
    with pytest.raises(PolicyError, match=r"eviction policy 'HitRaises' raised ValueError\('bug in on_hit'\) in on_hit\(\)"):
        simulate(trace, {"host": 40}, HitRaises)  # (a subclass is not 'lru')
    with pytest.raises(PolicyError, match=r"eviction policy 'ListVictim' named victim \[0\]"):
        simulate(trace, {"host": 20}, ListVictim)  # (unhashable: TypeError came from the lookup)
    with pytest.raises(PolicyError, match=r"prefetch policy 'ResetRaises' raised RuntimeError\('bug in reset'\) setting up"):
        simulate(trace, {"host": 20}, "lru", prefetch=ResetRaises())
    with pytest.raises(PolicyError, match=r"prefetch policy 'BareKeys': suggest\(\) gave 'k', not a \(key"):
        simulate(trace, {"host": 20}, "lru", prefetch=BareKeys())


async def test_a_store_takes_an_eviction_policy_by_name_as_the_simulator_does() -> None:
    """``eviction="lru"`` was refused ("does not implement EvictionPolicy: 'lru'")."""
    from tierstore import HostTier, TierStore

    tiers = [HostTier("64KiB"), HostTier("1MiB", name="spill")]
    async with TierStore(tiers, eviction="fifo") as store:
        for i in range(5):
            await store.put(f"k{i}", torch.zeros(4096))  # 16 KiB each: the fifth pushes k0 out
        assert store.where("k0") == ["spill"] and store.where("k4") == ["host"]
    with pytest.raises(ValueError, match=r"unknown eviction policy 'nonsense'.*choose from .*'sieve'"):
        async with TierStore([HostTier("64KiB"), HostTier("1MiB", name="spill")], eviction={"host": "nonsense"}):
            pass
    # (a store of one tier evicts nothing, and took any name: a typo showed only once a tier was added)
    for eviction in ("nonsense", {"host": "nonsense"}):
        with pytest.raises(ValueError, match=r"unknown eviction policy 'nonsense'"):
            TierStore([HostTier("64KiB")], eviction=eviction)


async def test_a_store_takes_a_prefetch_policy_by_name_or_class_and_refuses_what_is_none() -> None:
    """``prefetch="sequential"``, ``prefetch=Sequential`` and ``prefetch=42`` were accepted: the
    first access then warned that the policy raised, and prefetching was off (a tryout)."""
    from policies import Sequential
    from tierstore import HostTier, TierStore

    for prefetch in ("sequential", Sequential, lambda: Sequential(2)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a policy that failed was only warned of)
            async with TierStore([HostTier("1MiB"), HostTier("4MiB", name="spill")], prefetch=prefetch) as store:
                for i in range(8):
                    await store.put(f"k{i}", torch.zeros(16384), "spill")  # 64 KiB each, on the slower tier
                await store.get("k0", "host")
                for _ in range(1000):  # (the prefetch runs in the background)
                    if store.where("k1")[0] == "host":
                        break
                    await asyncio.sleep(0.005)
                assert store.where("k1")[0] == "host"  # read ahead after k0
                assert isinstance(store.prefetch_policy, Sequential)
    with pytest.raises(ValueError, match=r"unknown prefetch policy 'sequentail'; choose from .*'schedule'"):
        TierStore([HostTier("1MiB")], prefetch="sequentail")
    for wrong in (42, object(), [Sequential()]):
        with pytest.raises(TypeError, match=r"is not a prefetch policy: give an instance, a class or a name"):
            TierStore([HostTier("1MiB")], prefetch=wrong)


def test_replay_store_trace_says_it_takes_a_path() -> None:
    from tierstore.sim import replay_store_trace

    with pytest.raises(TypeError, match="path of a store's .npz trace, not a Trace.*simulate"):
        replay_store_trace(loop_trace(3, 2, 4), [8])


def test_command_line_numbers_that_cannot_be_negative_are_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["simulate", "t.csv", "--capacity", "host=1", "--think", "-1"], "--think: -1 is not a finite number"),
                        (["bench", "--tune", "x", "--tune-mib", "0"], "--tune-mib: 0 is not a positive whole number")):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and words in capsys.readouterr().err


def test_a_csv_size_beyond_int64_is_a_trace_error(tmp_path: Path) -> None:
    from tierstore import TraceError

    path = tmp_path / "t.csv"
    path.write_text("key,size\na,10\nb,99999999999999999999\n")
    with pytest.raises(TraceError, match=r"t.csv:3: size '99999999999999999999' is more bytes than a trace holds"):
        load_trace(path)


def test_csv_keys_are_the_same_key_whatever_the_other_lines_hold(tmp_path: Path) -> None:
    """``01`` and ``1`` were one key in a CSV of numbers only (read as int64) and two once any
    line held a key that is not a number (read as text): the miss counts of the same accesses
    changed with an unrelated line."""
    numbers, mixed = tmp_path / "numbers.csv", tmp_path / "mixed.csv"
    numbers.write_text("01,100\n1,100\n+1,100\n 1,100\n")
    mixed.write_text("01,100\n1,100\n+1,100\n 1,100\nx,100\n")
    assert len(load_trace(numbers).keys) == 1
    assert len(load_trace(mixed).keys) == 2


def test_a_csv_key_of_thousands_of_digits_is_a_key_and_bad_text_a_trace_error(tmp_path: Path) -> None:
    """A key of 5,000 digits made ``int()`` raise Python's own digit-limit ValueError; a CSV in
    Latin-1 raised UnicodeDecodeError. The first is a key like any other, the second a TraceError."""
    from tierstore import TraceError

    long = tmp_path / "long.csv"
    long.write_text(f"{'7' * 5000},100\nx,100\n{'7' * 5000},100\n")
    trace = load_trace(long)
    assert len(trace) == 3 and len(trace.keys) == 2
    latin = tmp_path / "latin.csv"
    latin.write_bytes("clé,100\nclé,100\n".encode("latin-1"))
    with pytest.raises(TraceError, match="not UTF-8 text .byte 0xe9 at offset 2[)]"):
        load_trace(latin)
    zeros = tmp_path / "zeros.csv"  # (leading zeros count in int()'s limit too)
    zeros.write_text(f"{'0' * 5000}7,100\nx,100\n+0007,100\n")
    assert len(load_trace(zeros).keys) == 2
    far = tmp_path / "far.csv"  # (the offset is the file's, not the decoder's block's)
    far.write_bytes(b"k,100\n" * 50_000 + "clé,100\n".encode("latin-1"))
    with pytest.raises(TraceError, match="byte 0xe9 at offset 300,002[)]"):
        load_trace(far)


def test_a_csv_with_a_byte_order_mark_keeps_its_header_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A spreadsheet's UTF-8 export starts with a byte-order mark: the header's first name was
    read as '\\ufeffkey' and ``--columns key=key`` said there is no such column."""
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfkey,size\n1,100\n2,100\n1,100\n")
    trace = load_trace(path, {"key": "key", "size": "size"})
    assert len(trace) == 3 and len(trace.keys) == 2
    assert main(["simulate", str(path), "--capacity", "host=1KiB", "--columns", "key=key,size=size"]) == 0
    assert "3 accesses, 2 keys" in capsys.readouterr().out


def test_a_zipf_trace_without_keys_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "zipf:keys=0", "--capacity", "host=1MiB"]) != 0
    assert "needs keys= 1 or more" in capsys.readouterr().err


def test_min_of_a_learned_schedule_is_replayed_as_the_store_runs_it() -> None:
    """The simulator told the prefetch policy of an access after the eviction policy's hit or
    insertion; the store tells it first. ``MIN(schedule)`` asked the schedule before it had
    seen the access, and every next use it kept was in the past: 1,735 misses on an
    optimizer's trace where the trace's own MIN has 359 (a review)."""
    from policies import MIN, ScheduleLearned
    from tierstore.sim import optimizer_trace, simulate

    trace = optimizer_trace(keys=256, steps=8, size=4096)
    capacity = {"host": int(0.6 * trace.working_set)}
    oracle = simulate(trace, capacity, eviction="min", prefetch="schedule")
    schedule = ScheduleLearned()
    learned = simulate(trace, capacity, eviction=lambda: MIN(schedule), prefetch=schedule)
    assert learned.misses <= 1.1 * oracle.misses, (learned.misses, oracle.misses)
