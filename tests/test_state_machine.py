"""A hypothesis state machine drives the live store with interleaved async operations and
cancellations, against a plain dict, on tiny tiers; the invariants hold after every step."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierstore import (
    DeviceTier,
    DiskTier,
    EntryHeldError,
    HostTier,
    KeyNotFoundError,
    SyncTierStore,
    TierFullError,
)
from tierstore.sync import loop_thread, run
from tierstore.testing import check_consistency, same_bytes, settle
from tierstore.tiers import MemoryTier

KEYS = st.sampled_from([f"k{i}" for i in range(6)])
TIERS = st.sampled_from(["device", "host"])


@st.composite
def values(draw: Any) -> torch.Tensor:
    numel = draw(st.sampled_from([0, 1, 100, 1000, 3000]))
    return torch.full((numel,), float(draw(st.integers(0, 1000))))


async def _start(coro: Any) -> asyncio.Task[Any]:
    return asyncio.ensure_future(coro)


async def _wait(tasks: list[asyncio.Task[Any]]) -> list[Any]:
    return await asyncio.gather(*tasks, return_exceptions=True)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="tierstore-sm-"))
        self.sync = SyncTierStore(
            [DeviceTier("cpu", "24KiB"), HostTier("48KiB"), DiskTier(self.folder / "d", "16MiB", chunk_size="16KiB", durable=False)]
        ).open()
        self.store = self.sync.store
        self.model: dict[str, torch.Tensor] = {}
        self.pending: list[tuple[str, str, asyncio.Task[Any], Any]] = []
        self.holds: dict[str, tuple[Any, torch.Tensor, int, int]] = {}

    def busy(self, key: str) -> bool:
        return key in self.holds or any(k == key and kind != "get" for kind, k, _, _ in self.pending)

    # -- operations started (they run while later rules run) ------------------------------------

    @rule(key=KEYS, value=values(), tier=st.none() | TIERS)
    def start_put(self, key: str, value: torch.Tensor, tier: str | None) -> None:
        if self.busy(key):
            return
        self.pending.append(("put", key, run(_start(self.store.put(key, value, tier))), value))

    @rule(key=KEYS, tier=TIERS)
    def start_get(self, key: str, tier: str) -> None:
        if key not in self.model or self.busy(key):
            return
        self.pending.append(("get", key, run(_start(self.store.get(key, tier))), self.model[key]))

    @rule(key=KEYS)
    def start_delete(self, key: str) -> None:
        if key not in self.model or self.busy(key):
            return
        self.pending.append(("delete", key, run(_start(self.store.delete(key))), None))

    @rule(keys=st.lists(KEYS, max_size=4), tier=TIERS)
    def start_prefetch(self, keys: list[str], tier: str) -> None:
        known = [k for k in keys if k in self.model and not self.busy(k)]
        if known:
            handle = run(self.store.prefetch(known, tier))
            self.pending.append(("prefetch", "", run(_start(handle.wait())), handle))

    @precondition(lambda self: bool(self.pending))
    @rule(which=st.integers(0, 100))
    def cancel_one(self, which: int) -> None:
        _, _, task, extra = self.pending[which % len(self.pending)]
        loop_thread().call_soon_threadsafe(task.cancel)
        if hasattr(extra, "cancel"):
            loop_thread().call_soon_threadsafe(extra.cancel)

    @precondition(lambda self: bool(self.pending))
    @rule()
    def finish(self) -> None:
        pending, self.pending = self.pending, []
        results = run(_wait([task for _, _, task, _ in pending]))
        for (kind, key, _, value), result in zip(pending, results, strict=True):
            cancelled = isinstance(result, asyncio.CancelledError)
            # A put told to land on a tier full of held entries is refused, and changes nothing.
            refused = kind == "put" and isinstance(result, TierFullError)
            if isinstance(result, BaseException) and not (cancelled or refused):
                raise AssertionError(f"{kind} {key!r} failed: {result!r}")
            if kind == "put" and refused:
                self.resolve(key, [self.model.get(key)])
            elif kind == "put":
                self.resolve(key, [value] + ([self.model[key]] if key in self.model else [None]) if cancelled else [value])
            elif kind == "delete":
                self.resolve(key, [None, self.model[key]] if cancelled else [None])
            elif kind == "get" and not cancelled:
                assert same_bytes(result, value), f"get {key!r} returned stale or torn bytes"
        if not self.holds:
            run(settle(self.store))
            run(_check(self.store))

    def resolve(self, key: str, allowed: list[torch.Tensor | None]) -> None:
        """After an operation: the key must hold one of ``allowed`` (a cancelled one may or may
        not have landed); the model adopts what it holds."""
        try:
            actual = self.sync.get(key, "host")
        except KeyNotFoundError:
            actual = None
        assert any((a is None and actual is None) or (a is not None and actual is not None and same_bytes(a, actual)) for a in allowed), key
        if actual is None:
            self.model.pop(key, None)
        else:
            self.model[key] = actual

    # -- holds ------------------------------------------------------------------------------------

    @rule(key=KEYS, tier=TIERS, write=st.booleans())
    def hold(self, key: str, tier: str, write: bool) -> None:
        if key not in self.model or self.busy(key):
            return
        manager = self.store.hold(key, tier, write)
        try:
            buffer = run(manager.__aenter__())
        except TierFullError:
            return  # everything on that tier is held: refused, nothing changed
        assert same_bytes(buffer, self.model[key])
        if write and buffer.numel():
            buffer.add_(1)
            self.model[key] = buffer.clone()
        self.holds[key] = (manager, buffer, self.store._index(tier), buffer.data_ptr())

    @precondition(lambda self: bool(self.holds))
    @rule(which=st.integers(0, 100))
    def release(self, which: int) -> None:
        key = sorted(self.holds)[which % len(self.holds)]
        manager, *_ = self.holds.pop(key)
        run(manager.__aexit__(None, None, None))

    @precondition(lambda self: bool(self.holds))
    @rule(which=st.integers(0, 100))
    def delete_held_is_refused(self, which: int) -> None:
        key = sorted(self.holds)[which % len(self.holds)]
        try:
            self.sync.delete(key)
        except EntryHeldError:
            return
        raise AssertionError("deleting a held key succeeded")

    # -- invariants -------------------------------------------------------------------------------------

    @invariant()
    def capacities_are_never_exceeded(self) -> None:
        for tier in self.store.tiers:
            assert tier.used <= tier.capacity, f"{tier.name}: {tier.used} > {tier.capacity}"
            if isinstance(tier, MemoryTier):
                assert tier.live_bytes <= tier.capacity

    @invariant()
    def held_entries_stay_put(self) -> None:
        for key, (_, buffer, tier, pointer) in self.holds.items():
            copy = self.store._entries[key].copies.get(tier)
            assert copy is not None and copy.holds > 0 and copy.buffer is not None
            assert same_bytes(buffer, self.model[key])
            if buffer.numel():  # an empty tensor has no memory to compare
                assert copy.buffer.data_ptr() == pointer

    def teardown(self) -> None:
        try:
            for manager, *_ in self.holds.values():
                run(manager.__aexit__(None, None, None))
            if self.pending:
                run(_wait([task for _, _, task, _ in self.pending]))
            self.sync.close(flush=False)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


async def _check(store: Any) -> None:
    check_consistency(store)


StoreMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachine = StoreMachine.TestCase
