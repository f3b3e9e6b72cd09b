"""The policy workbench, as a second new user tried it: a prefetch policy that suggests keys by
name (as a live store's must) had every suggestion dropped, silently; synthetic traces too large
for memory, with a NaN alpha or an unknown parameter ended in numpy's or Python's words;
``--plot out`` said ``out`` and wrote ``out.png``; an empty store trace reported a perfect
cache; a prefetch class or an eviction instance (the store takes both) were refused with wrong
names; ``--json`` into ``/proc`` failed after the run; ``--columns`` and unknown tier names went
unheeded on a store trace; a hand-edited trace's tier indexes and duplicate keys passed; and
sizes past 1024 TiB were shown in TiB."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierstore import TraceError
from tierstore.cli import main
from tierstore.sim import (
    Trace,
    load_evictions,
    load_trace,
    loop_trace,
    replay_store_trace,
    simulate,
    zipf_trace,
)
from tierstore.units import distinct_sizes, format_bytes, parse_bytes


class NextLayer:
    """Suggests the key after the one accessed, by name (``by_name``) or by id."""

    def __init__(self, names: list[str], by_name: bool = True) -> None:
        self.names, self.by_name, self.last = names, by_name, 0

    def on_access(self, key: int, nbytes: int, tier: str, hit: bool) -> None:
        self.last = key

    def on_step(self) -> None:
        pass

    def suggest(self) -> list[tuple[Any, str | None]]:
        following = (self.last + 1) % len(self.names)
        return [(self.names[following] if self.by_name else following, None)]

    def reset(self) -> None:
        self.last = 0


class Named:
    """Suggests one key name, whatever was accessed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_access(self, key: int, nbytes: int, tier: str, hit: bool) -> None:
        pass

    def on_step(self) -> None:
        pass

    def suggest(self) -> list[tuple[Any, str | None]]:
        return [(self.name, None)]

    def reset(self) -> None:
        pass


def test_a_prefetch_policy_may_suggest_keys_by_name_as_in_a_live_store() -> None:
    """(0 prefetches, 400 misses of 400: every suggestion by name was dropped, with no word)"""
    trace = Trace.from_accesses([f"layer{i % 20}" for i in range(400)], [1000] * 400)
    by_name = simulate(trace, {"host": 5000}, "lru", prefetch=NextLayer(trace.keys))
    by_id = simulate(trace, {"host": 5000}, "lru", prefetch=NextLayer(trace.keys, by_name=False))
    assert by_name.prefetches == by_id.prefetches > 0 and by_name.misses == by_id.misses == 1
    plain = simulate(trace, {"host": 5000, "spill": 1 << 20}).misses
    assert simulate(trace, {"host": 5000, "spill": 1 << 20}, prefetch=Named("layer99")).misses == plain  # (a name the trace lacks)


@pytest.mark.parametrize("spec, words", [
    ("loop:keys=100000000000", "loop trace: keys=100000000000, loops=10 make 1,000,000,000,000 accesses"),
    ("zipf:keys=100000000000,accesses=10", "zipf trace: keys=100000000000, accesses=10 make 10 accesses"),
    ("zipf:alpha=nan", "zipf trace: alpha=nan is no popularity skew; give a finite number of 0 or more"),
    ("zipf:alpha=-1", "zipf trace: alpha=-1.0 is no popularity skew"),
    ("zipf:alpha=inf", "zipf trace: alpha=inf is no popularity skew"),
    ("zipf:alpha=steep", "zipf trace: alpha='steep' is not a number"),
    ("optimizer:bogus=3", "unknown parameter 'bogus' for optimizer traces; valid: keys, steps, size, seed"),
    ("optimizer:keys=64,keys=3", "parameter 'keys' is given twice in 'optimizer:keys=64,keys=3'; give each parameter once"),
    ("loop:size=10000PiB", "size=11258999068426240000 is not a size a trace holds"),
])
def test_synthetic_trace_parameters_are_checked_before_the_trace_is_made(
    spec: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """(numpy's ArrayMemoryError traceback, "Probabilities contain NaN", "optimizer_trace() got an
    unexpected keyword argument", an OverflowError traceback; alpha=-1 and keys given twice ran)"""
    assert main(["simulate", spec, "--capacity", "host=64MiB"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tierstore simulate: {words}") and err.count("\n") == 1, err
    if "memory" in err:
        assert "more than the" in err and "available" in err


def test_the_generators_check_their_parameters_too() -> None:
    with pytest.raises(ValueError, match=r"loop trace: keys=100000000000, loops=10 make .* of memory"):
        loop_trace(keys=100_000_000_000)
    with pytest.raises(ValueError, match=r"alpha=nan is no popularity skew"):
        zipf_trace(keys=10, accesses=10, alpha=float("nan"))
    assert len(zipf_trace(keys=10, accesses=100, alpha=0)) == 100  # (0: every key as popular)


def test_a_plot_without_a_suffix_is_written_and_named_as_matplotlib_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(it said "plot: out" and matplotlib wrote out.png)"""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(["simulate", "loop:keys=3", "--capacity", "host=1MiB", "--plot", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"plot: {out}.png"
    assert (tmp_path / "out.png").stat().st_size > 0 and not out.exists()


def test_an_empty_store_trace_is_refused_as_an_empty_csv_is(
    tmp_path: Path, store_trace: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    """(``miss ratio 0.0000``, exit 0: 0 of 0 shown as a perfect cache)"""
    path = tmp_path / "empty.npz"
    np.savez(path, **{name: array[:0] if name not in ("keys", "ops", "tiers") else array for name, array in store_trace.items()})
    assert main(["simulate", str(path), "--capacity", "host=1MiB"]) == 1
    assert capsys.readouterr().err == f"tierstore simulate: {path} holds no accesses\n"
    with pytest.raises(TraceError, match="holds no accesses"):
        load_trace(path)


class Prefetcher:
    def __init__(self) -> None:
        self.last = 0

    def on_access(self, key: int, nbytes: int, tier: str, hit: bool) -> None:
        self.last = key

    def on_step(self) -> None:
        pass

    def suggest(self) -> list[tuple[Any, str | None]]:
        return [(self.last + 1, None)]

    def reset(self) -> None:
        self.last = 0


class MyLRU:
    def __init__(self) -> None:
        self.queue: OrderedDict[int, int] = OrderedDict()

    def on_insert(self, key: int, nbytes: int) -> None:
        self.queue[key] = nbytes

    def on_hit(self, key: int) -> None:
        if key in self.queue:
            self.queue.move_to_end(key)

    def on_remove(self, key: int) -> None:
        self.queue.pop(key, None)

    def victim(self, evictable: Any = None) -> int | None:
        return self.queue.popitem(last=False)[0] if self.queue else None

    def reset(self) -> None:
        self.queue.clear()


class HalfLRU:
    def on_insert(self, key: int, nbytes: int) -> None:
        pass


def test_simulate_takes_policies_as_the_store_takes_them() -> None:
    """(a prefetch class: "prefetch policy 'type' does not implement PrefetchPolicy"; an eviction
    instance: "unknown eviction policy <__main__.MyLRU object at 0x...>; choose from [...]")"""
    trace = loop_trace(keys=10, loops=4, size=4096)
    by_instance = simulate(trace, {"host": 4096 * 3}, "lru", prefetch=Prefetcher())
    for prefetch in (Prefetcher, lambda: Prefetcher()):
        result = simulate(trace, {"host": 4096 * 3}, "lru", prefetch=prefetch)
        assert (result.prefetches, result.misses) == (by_instance.prefetches, by_instance.misses) and result.prefetches
    assert simulate(trace, {"host": 4096 * 3}, "lru", prefetch=Prefetcher).prefetch == "Prefetcher"

    policy = MyLRU()
    first = simulate(trace, {"host": 4096 * 3}, policy)
    assert first.eviction == "MyLRU" and first.misses == simulate(trace, {"host": 4096 * 3}, MyLRU).misses == 40
    policy.on_insert(12345, 1)  # (what a run left behind is reset first)
    assert simulate(trace, {"host": 4096 * 3}, policy).misses == 40
    with pytest.raises(TypeError, match=r"one eviction policy instance \('MyLRU'\) cannot serve the 2 tiers host, spill: pass its class"):
        simulate(trace, {"host": 4096 * 3, "spill": 4096 * 6}, MyLRU())
    with pytest.raises(TypeError, match=r"eviction policy 'HalfLRU' does not implement EvictionPolicy: it has no on_hit"):
        simulate(trace, {"host": 4096 * 3}, HalfLRU())
    with pytest.raises(TypeError, match=r"prefetch policy 'HalfLRU' does not implement PrefetchPolicy: it has no on_access"):
        simulate(trace, {"host": 4096 * 3}, "lru", prefetch=HalfLRU)


def test_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(``[Errno 2] No such file or directory: '/proc/x.json'``, once the simulation had run)"""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc, where no file can be made")
    assert main(["simulate", "loop:keys=3", "--capacity", "host=1MiB", "--json", "/proc/x.json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # (no table: refused before the run)
    assert captured.err == "tierstore simulate: --json /proc/x.json: cannot write there (No such file or directory)\n"
    kept, new = tmp_path / "kept.json", tmp_path / "new.json"
    kept.write_text("earlier results")
    for path in (kept, new):  # (the check leaves a file there as it was, and none where there was none)
        assert main(["simulate", "loop:keys=3", "--capacity", "host=1MiB", "--eviction", "nonsense", "--json", str(path)]) == 1
    assert kept.read_text() == "earlier results" and not new.exists()


def test_columns_a_store_trace_cannot_take_are_refused_and_any_tiers_simulated(
    tmp_path: Path, store_trace: dict[str, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    """(``--columns`` was ignored for a .npz.) Capacities may name other tiers than the trace's
    store had: a what-if, as for any trace (the simulator sends every access to the first)."""
    path = tmp_path / "t.npz"
    np.savez(path, **store_trace)
    bin_path = tmp_path / "t.oracleGeneral.bin"
    bin_path.write_bytes(b"")
    for trace, what in ((path, "a store trace (.npz)"), (bin_path, "an oracleGeneral trace")):
        assert main(["simulate", str(trace), "--capacity", "host=1MiB", "--columns", "key=1,size=2"]) == 1
        assert capsys.readouterr().err == (f"tierstore simulate: columns (--columns) pick a CSV trace's columns, and {trace} is {what}, "
                                           "whose columns are fixed; leave them out\n")
    assert main(["simulate", "loop:keys=3", "--capacity", "host=1MiB", "--columns", "key=1"]) == 1
    assert "'loop:keys=3' is a synthetic trace; leave them out" in capsys.readouterr().err
    assert main(["simulate", str(path), "--capacity", "device=8KiB,host=16KiB"]) == 0
    assert simulate(load_trace(path), {"device": 8 << 10, "host": 1 << 20}).requests == simulate(load_trace(path), {"host": 1 << 20}).requests
    assert main(["simulate", str(path), "--capacity", "host=8KiB"]) == 0


def test_store_trace_tables_no_store_writes_are_refused_by_every_reader(tmp_path: Path, store_trace: dict[str, np.ndarray]) -> None:
    """(a tier index outside the trace's tiers passed; a key named twice in its keys table was
    counted as two keys)"""
    for name, edit, words in (
        ("tier", lambda d: d["tier"].__setitem__(0, 5), r"its 'tier' column holds tier index 5, outside its table of 2 tiers"),
        ("before", lambda d: d["before"].__setitem__(-1, -3), r"its 'before' column holds tier index -3"),
        ("keys", lambda d: d["keys"].__setitem__(1, d["keys"][0]), r"its keys table names 'k0' twice"),
    ):
        arrays = {key: value.copy() for key, value in store_trace.items()}
        edit(arrays)
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        for read in (load_trace, load_evictions, lambda p: replay_store_trace(p, {"host": 16384})):
            with pytest.raises(TraceError, match=words):
                read(path)


def test_sizes_past_a_thousand_tebibytes_are_shown_in_larger_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(``16777216.0 TiB``)"""
    assert format_bytes(2**50) == "1.0 PiB" and format_bytes(2**64) == "16.0 EiB" and format_bytes(1023 * 2**40) == "1023.0 TiB"
    assert parse_bytes("1EiB") == 2**60 and parse_bytes("2EB") == 2 * 1000**6
    assert distinct_sizes(2**62, 2**62 + 1) == ("4,611,686,018,427,387,904 B", "4,611,686,018,427,387,905 B")
    path = tmp_path / "big.csv"
    path.write_text("1,9223372036854775807\n2,9223372036854775807\n")
    assert main(["simulate", str(path), "--capacity", "host=1KiB"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "2 accesses, 2 keys, working set 16.0 EiB"


def test_the_store_trace_replay_takes_an_eviction_instance_where_one_tier_evicts(
    tmp_path: Path, store_trace: dict[str, np.ndarray]
) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, **store_trace)
    assert replay_store_trace(path, {"host": 16384}, MyLRU()).evictions == replay_store_trace(path, {"host": 16384}, MyLRU).evictions
    np.savez(path, **(store_trace | {"tiers": np.array(["host", "spill", "disk"])}))
    with pytest.raises(TypeError, match=r"one eviction policy instance \('MyLRU'\) cannot serve the 2 tiers host, spill: pass its class"):
        replay_store_trace(path, {"host": 16384, "spill": 1 << 20}, MyLRU())
