"""The blocking facade cannot drift from the async store, a closed store refuses every verb,
``run`` does not leave a timed-out call running, and an open store is flushed at exit."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import DiskTier, HostTier, StoreClosedError, SyncTierStore, TierStore
from tierstore.namespaces import Namespace
from tierstore.sync import EXTRAS, FACADES, RENAMED, SyncNamespace, public_verbs, run

#: Names that are not verbs on data: lifecycle, the tiers (configuration, there before open), and
#: properties describing the store itself (its state, loop, counters, policy, transfer listener).
NOT_VERBS_ON_DATA = {"open", "aclose", "__aenter__", "__aexit__", "tier", "tiers", "is_open", "closed", "loop", "counters", "prefetch_policy", "on_transfer", "changes", "register_close_hook"}


def _parameters(member: Any) -> list[tuple[str, Any, Any]]:
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


MIRRORED = [(facade, async_cls, name) for facade, async_cls, _ in FACADES for name in sorted(public_verbs(async_cls))]


@pytest.mark.parametrize(("facade", "async_cls", "name"), MIRRORED, ids=lambda v: getattr(v, "__name__", v))
def test_every_async_verb_has_a_blocking_counterpart(facade: type, async_cls: type, name: str) -> None:
    member = public_verbs(async_cls)[name]
    target = RENAMED.get(name, name)
    assert hasattr(facade, target), f"{facade.__name__} lacks {target} ({async_cls.__name__}.{name})"
    mine = inspect.getattr_static(facade, target)
    if isinstance(member, property):
        assert isinstance(mine, property)
        return
    assert _parameters(mine) == _parameters(member), f"{facade.__name__}.{target} and {async_cls.__name__}.{name} take different parameters"
    if getattr(member, "__doc__", None):
        assert mine.__doc__, f"{facade.__name__}.{target} has no docstring"


def test_a_facade_adds_nothing_but_its_extras() -> None:
    with SyncTierStore([HostTier("1MiB")]) as store:
        instances = {TierStore: store.store, Namespace: store.claim("ns").namespace}
        for facade, async_cls, _ in FACADES:
            # what a facade adds must be a verb or an attribute of the async object, or an extra
            extras = {name for name in public_verbs(facade) if not hasattr(instances[async_cls], name)}
            extras -= set(RENAMED.values())
            assert extras <= EXTRAS, f"{facade.__name__} has verbs {async_cls.__name__} lacks: {sorted(extras - EXTRAS)}"


def test_namespaces_through_the_facade(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        with store.claim("optim", owner="me") as ns:
            assert isinstance(ns, SyncNamespace) and ns.name == "optim/" and ns.live
            store.put(ns.key("a"), torch.ones(2))
            assert ns.keys() == ["optim/a"]
        assert not ns.live  # leaving the block released the claim; the record and keys stay
        assert [info.name for info in store.namespaces()] == ["optim/"]
        again = store.claim("optim", owner="me")
        assert again.clear() == 1
        again.drop()
        assert store.namespaces() == []


def test_read_pop_where_and_zarr_through_the_facade(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "64MiB")]) as store:
        store.put("a", torch.arange(6.0), "disk")
        assert store.where("a") == ["disk"]
        assert torch.equal(store.read("a"), torch.arange(6.0))
        assert store.where("a") == ["disk"]  # read moves nothing
        store.put("b", torch.ones(3, dtype=torch.int16))
        assert store.export_zarr(tmp_path / "snap.zarr") == 2
        assert torch.equal(store.pop("b"), torch.ones(3, dtype=torch.int16))
        assert "b" not in store and len(store) == 1
    with SyncTierStore([HostTier("1MiB")]) as fresh:
        assert fresh.import_zarr(tmp_path / "snap.zarr") == 2
        assert sorted(fresh.keys()) == ["a", "b"]
        assert torch.equal(fresh.get("a"), torch.arange(6.0))


# -- a closed store refuses every verb -------------------------------------------------------------

#: How to call each verb on data; a new verb of TierStore fails the test below until added here.
CALLS: dict[str, Callable[[Any], Any]] = {
    "put": lambda s: s.put("k", torch.ones(2)),
    "get": lambda s: s.get("k"),
    "read": lambda s: s.read("k"),
    "pop": lambda s: s.pop("k"),
    "delete": lambda s: s.delete("k"),
    "flush": lambda s: s.flush(),
    "prefetch": lambda s: s.prefetch(["k"]),
    "write_back": lambda s: s.write_back(["k"]),
    "hold": lambda s: s.hold("k"),
    "fill": lambda s: s.fill("k", (2,), torch.float32),
    "keys": lambda s: s.keys(),
    "__contains__": lambda s: "k" in s,
    "__len__": lambda s: len(s),
    "info": lambda s: s.info("k"),
    "where": lambda s: s.where("k"),
    "stats": lambda s: s.stats(),
    "mark_step": lambda s: s.mark_step(),
    "expect": lambda s: s.expect(["k"]),
    "export_zarr": lambda s: s.export_zarr("unused.zarr"),
    "import_zarr": lambda s: s.import_zarr("unused.zarr"),
    "claim": lambda s: s.claim("ns"),
    "claim_unique": lambda s: s.claim_unique("ns"),
    "namespaces": lambda s: s.namespaces(),
    "gc": lambda s: s.gc(),
}
VERBS_ON_DATA = sorted(set(public_verbs(TierStore)) - NOT_VERBS_ON_DATA)


def test_every_verb_on_data_is_in_the_closed_store_table() -> None:
    assert set(VERBS_ON_DATA) <= set(CALLS), f"add calls for {sorted(set(VERBS_ON_DATA) - set(CALLS))}"


def _closed_stores(tmp_path: Path) -> dict[str, SyncTierStore]:
    never = SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "never", "16MiB")])
    closed = SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "closed", "16MiB")])
    with closed:
        closed.put("k", torch.ones(2))
    return {"never opened": never, "closed": closed}


@pytest.mark.parametrize("verb", VERBS_ON_DATA)
def test_a_closed_sync_store_refuses(verb: str, tmp_path: Path) -> None:
    for state, store in _closed_stores(tmp_path).items():
        with pytest.raises(StoreClosedError):
            result = CALLS[verb](store)
            if hasattr(result, "__enter__"):  # hold: refused on entry
                with result:
                    pass
            pytest.fail(f"{verb} on a {state} store answered {result!r}")


@pytest.mark.parametrize("verb", VERBS_ON_DATA)
async def test_a_closed_async_store_refuses(verb: str, tmp_path: Path) -> None:
    never = TierStore([HostTier("1MiB")])
    closed = TierStore([HostTier("1MiB")])
    async with closed:
        await closed.put("k", torch.ones(2))
    for state, store in {"never opened": never, "closed": closed}.items():
        with pytest.raises(StoreClosedError):
            result = CALLS[verb](store)
            if hasattr(result, "__aenter__"):
                async with result:
                    pass
            elif inspect.isawaitable(result):
                await result
            pytest.fail(f"{verb} on a {state} store answered {result!r}")


# -- run() does not leave a timed-out call running -------------------------------------------------


def test_run_waits_for_a_timed_out_call_to_finish_cancelling() -> None:
    finished_cleanup: list[bool] = []

    async def slow_to_cancel() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # e.g. a copy that must finish before the caller's memory is free
            finished_cleanup.append(True)
            raise

    with pytest.raises(TimeoutError):
        run(slow_to_cancel(), timeout=0.05)
    assert finished_cleanup == [True]


def test_run_returns_the_result_of_a_call_that_completes_despite_the_cancel() -> None:
    async def finishes_anyway() -> int:
        with contextlib.suppress(asyncio.CancelledError):  # a call that ignores the cancel
            await asyncio.sleep(30)
        return 7

    assert run(finishes_anyway(), timeout=0.05) == 7


_CALLER = contextvars.ContextVar("caller", default="unset")


def test_run_carries_the_callers_context_variables() -> None:
    async def seen() -> str:
        return _CALLER.get()

    token = _CALLER.set("set by the caller")
    try:
        assert run(seen()) == "set by the caller"
    finally:
        _CALLER.reset(token)


def test_run_reports_an_error_as_it_is() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run(fails(), timeout=5)


def test_a_timed_out_put_no_longer_reads_the_callers_tensor(tmp_path: Path) -> None:
    with SyncTierStore([DiskTier(tmp_path / "d", "512MiB", durable=False)]) as store:
        value = torch.full((32 << 20,), 1.0)  # 128 MiB: the write takes a while
        with pytest.raises(TimeoutError):
            store.run(store.store.put("big", value), timeout=0.02)
        value.fill_(2.0)  # the caller reuses its memory at once
        if "big" in store:
            assert torch.equal(store.get("big"), torch.full((32 << 20,), 1.0))


# -- an open store is flushed and closed at interpreter exit ---------------------------------------

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from tierstore import SyncTierStore, HostTier, DiskTier

    def main(root, ending):
        store = SyncTierStore([HostTier("64MiB"), DiskTier(root, "256MiB")]).open()
        store.put("x", torch.arange(10.0))
        if ending == "raise":
            raise RuntimeError("the script failed")
        if ending == "keep":
            return store
        if ending == "held":  # (a write hold entered and never left: the close at exit ended it)
            store.put("y", torch.zeros(4))
            held = store.hold("y", write=True)
            held.__enter__().fill_(7.0)
            return store, held

    kept = main(sys.argv[1], sys.argv[2])
    """
)


@pytest.mark.parametrize("ending", ["keep", "dropped", "raise", "held"])
def test_an_open_store_is_flushed_at_exit(ending: str, tmp_path: Path) -> None:
    root = tmp_path / "d"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(root), ending], capture_output=True, text=True, timeout=300)
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr
    assert "tierstore: closing" not in done.stderr
    with SyncTierStore([HostTier("64MiB"), DiskTier(root, "256MiB")]) as store:
        assert torch.equal(store.get("x"), torch.arange(10.0))
        if ending == "held":  # (before, EntryHeldError at exit: nothing in memory was saved)
            assert torch.equal(store.get("y"), torch.full((4,), 7.0))
