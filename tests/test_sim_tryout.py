"""The policy workbench, as a new user tried it: a CSV key that starts with ``#`` (quoted) was
dropped as a comment; ``--plot`` of a trace whose accesses are all empty raised
ZeroDivisionError; ``--sweep``'s 100% point, computed in floats, fell below a working set near
2**63; a policy missing protocol methods failed in the middle of ``simulate()`` with a bare
AttributeError (the store refuses it at once); and hand-edited ``.npz`` traces were checked one
way by ``load_trace`` and another by ``replay_store_trace``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tierstore import TraceError
from tierstore.cli import main
from tierstore.sim import load_evictions, load_trace, loop_trace, replay_store_trace, simulate


def test_a_quoted_key_that_starts_with_a_hash_is_a_key(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text('key,size\n"line one\n#2 line two",5\n"c",20\n# a comment\n')  # (a quoted key's second line starts with #)
    trace = load_trace(path)
    assert [(trace.keys[i], int(n)) for i, n in zip(trace.ids.tolist(), trace.sizes.tolist(), strict=True)] == [("line one\n#2 line two", 5), ("c", 20)]
    path.write_text('# a comment line\n"#a",100\nb,100\n"#a",100\nb,oops\n')
    with pytest.raises(TraceError, match=r"t\.csv:5: size 'oops'"):  # (the line number counts the comment)
        load_trace(path)
    path.write_text('# a comment line\n"#a",100\nb,100\n"#a",100\nb,100\n')
    trace = load_trace(path)
    assert len(trace) == 4 and sorted(trace.keys) == ["#a", "b"]


def test_the_plot_of_a_trace_of_empty_values(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "zeros.csv"
    path.write_text("1,0\n2,0\n1,0\n")
    assert main(["simulate", str(path), "--capacity", "host=1KiB", "--plot", str(tmp_path / "zeros.png")]) == 0
    assert (tmp_path / "zeros.png").stat().st_size > 0


def test_the_sweeps_last_point_is_the_whole_working_set(tmp_path: Path) -> None:
    path = tmp_path / "max.csv"
    path.write_text("1,100\n2,9223372036854775807\n1,100\n")
    out = tmp_path / "sweep.json"
    assert main(["simulate", str(path), "--capacity", "host=1KiB", "--sweep", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert max(r["capacity"] for r in results) == 100 + (2**63 - 1)  # (a float rounded it to 9,223,372,036,854,775,808 - 99)
    assert results[-1]["misses"] == 2  # (two cold misses; it grew to 3 at "100%")


class Incomplete:
    def on_insert(self, key: str, nbytes: int) -> None:
        pass


class NoSuggestions:
    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
        pass

    def reset(self) -> None:
        pass


class NoSteps(NoSuggestions):
    """A prefetcher without ``on_step``, as the store takes one (it warns at ``mark_step``)."""

    def suggest(self) -> list[tuple[str, str | None]]:
        return []


def test_a_policy_missing_methods_is_refused_before_the_simulation(tmp_path: Path) -> None:
    trace = loop_trace(keys=10, loops=2, size=4096)
    with pytest.raises(TypeError, match=r"eviction policy 'Incomplete' does not implement EvictionPolicy: it has no on_hit, on_remove, victim"):
        simulate(trace, {"host": 16384}, Incomplete)
    with pytest.raises(TypeError, match=r"prefetch policy 'NoSuggestions' does not implement PrefetchPolicy: it has no suggest"):
        simulate(trace, {"host": 16384}, "lru", NoSuggestions())
    one_step = tmp_path / "one_step.csv"
    one_step.write_text("".join(f"{key},4096\n" for key in [1, 2, 3, 1, 2, 3]))
    assert simulate(load_trace(one_step), {"host": 16384}, "lru", NoSteps()).misses  # (one step: on_step is never asked)


@pytest.mark.parametrize("edit", ["unknown op", "negative size", "float sizes"])
def test_a_hand_edited_store_trace_is_refused_by_every_reader(tmp_path: Path, store_trace: dict[str, np.ndarray], edit: str) -> None:
    arrays = dict(store_trace)
    if edit == "unknown op":
        ops = arrays["ops"].astype("U16")
        ops[list(ops).index("put")] = "frobnicate"
        arrays["ops"] = ops
    elif edit == "negative size":
        arrays["nbytes"] = arrays["nbytes"].copy()
        arrays["nbytes"][0] = -1024
    else:
        arrays["nbytes"] = arrays["nbytes"].astype(float) + 0.5
    path = tmp_path / "edited.npz"
    np.savez(path, **arrays)
    with pytest.raises(TraceError):
        load_trace(path)
    with pytest.raises(TraceError):  # (it replayed: sizes -1024 and 1024.5, no misses)
        replay_store_trace(path, {"host": 16384}, "lru")
    with pytest.raises(TraceError):
        load_evictions(path)
