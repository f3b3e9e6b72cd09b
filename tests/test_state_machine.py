"""A hypothesis state machine drives the live store against a dict model, on tiny tiers.

Rules: puts (to any tier, durable or not, cancelled after a few loop turns, concurrent), gets
to every tier (cancelled, concurrent), reads, pops, deletes, prefetches (cancelled), flushes,
close and reopen, read and write holds -- entered and released within a step, or left open
across steps while other tasks' gets, reads, puts, holds and flushes wait for them -- and the
holder's own reads, which raise instead of waiting for themselves. After every step: no tier
holds more than its capacity, held buffers keep what the model says, the store is consistent
when quiet, and one key (in turn) reads back its model value.

The model keeps, per key, the values the key may hold: one, except after a cancelled put (the
old value or the new one, never a mix) or puts racing each other, until a read pins it down.
``None`` stands for "absent". Each example runs its own event loop (``asyncio.Runner``), so
tasks left open across steps (a holder, the tasks waiting for it) stay on it between steps.
``benchmarks/bench_faults.py`` runs this machine for ten thousand examples.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierstore import (
    DeviceTier,
    DiskTier,
    EntryHeldError,
    HostTier,
    KeyNotFoundError,
    StoreClosedError,
    TierFullError,
    TierStore,
    UnknownTierError,
)
from tierstore.testing import check_consistency, same_bytes, settle
from tierstore.tiers import MemoryTier

T = TypeVar("T")
Value = torch.Tensor | None  # None: the key is absent

KEY_NAMES = [f"k{i}" for i in range(6)]
KEYS = st.sampled_from(KEY_NAMES)
MEMORY_TIERS = st.sampled_from(["device", "host"])
TIERS = st.sampled_from(["device", "host", "disk"])
DTYPES = [torch.float32, torch.int64, torch.uint8, torch.bfloat16]
#: Seconds one step may take before the machine calls it a hang (a wait that never ends).
STEP_TIMEOUT = 10.0
#: Holds left open across steps at once (each pins up to 16 KiB of a 24/48 KiB tier).
MAX_OPEN_HOLDS = 3
#: Tasks waiting on one open write hold (and flushes waiting on all of them).
MAX_WAITERS = 3
#: Steps per example, here and in the benchmark (short examples, many of them).
STEPS = 25
#: What a caller writes into its tensor once a put gave control back: never seen in the store.
SCRIBBLE = 0xEE


def _scratch() -> str | None:
    """A memory-backed folder for the disk tier where there is one (examples stay fast)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


@st.composite
def values(draw: Any, sizes: tuple[int, ...] = (0, 1, 100, 1000, 2000)) -> torch.Tensor:
    numel = draw(st.sampled_from(sizes))
    return torch.full((numel,), draw(st.integers(0, 255)), dtype=draw(st.sampled_from(DTYPES)))


def fill(tensor: torch.Tensor, byte: int) -> None:
    """Set every byte of a 1-D contiguous tensor (any dtype) to ``byte``."""
    tensor.view(torch.uint8).fill_(byte)


def matches(allowed: list[Value], actual: Value) -> bool:
    return any((a is None) == (actual is None) and (a is None or same_bytes(a, actual)) for a in allowed)  # type: ignore[arg-type]


def describe(allowed: list[Value]) -> str:
    return ", ".join("absent" if a is None else f"{a.dtype}[{a.numel()}]={a.view(-1)[:1].tolist()}" for a in allowed)


async def _within(coro: Awaitable[T], seconds: float) -> T:
    async with asyncio.timeout(seconds):
        return await coro


@dataclass(eq=False)
class Waiter:
    """A task started by another task while a write hold is open: it must wait for the release."""

    kind: str
    task: asyncio.Task[Any]
    value: torch.Tensor | None = None  # what a waiting put writes


@dataclass(eq=False)
class OpenHold:
    """A hold kept open across steps by a holder task, until ``release`` is set."""

    key: str
    tier: str
    write: bool
    buffer: torch.Tensor
    expected: torch.Tensor  # what the held buffer holds (a write hold's changes so far)
    release: asyncio.Event
    task: asyncio.Task[None]
    waiters: list[Waiter] = field(default_factory=list)
    #: A read hold whose key got a newer value holds the old one: the key is not held any more
    #: (True); None: a cancelled put may have replaced it.
    detached: bool | None = False


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="tierstore-sm-", dir=_scratch()))
        # One loop per example, driven step by step (not asyncio.Runner: it installs a SIGINT
        # handler on every run, a third of a fast step).
        self.loop = asyncio.new_event_loop()
        self.model: dict[str, list[Value]] = {}
        #: Values of cancelled puts whose commit may still land, until a later write of the key
        #: completes (from then on that write must win).
        self.late: dict[str, list[torch.Tensor]] = {}
        self.holds: list[OpenHold] = []
        #: Flushes started while write-held keys were not on the disk tier, and those holds:
        #: each waits for the release of all of them.
        self.flushes: list[tuple[asyncio.Task[None], list[OpenHold]]] = []
        self.steps = 0
        self.store = self.do(self._open())

    def do(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(_within(coro, STEP_TIMEOUT))

    async def _open(self) -> TierStore:
        tiers = [DeviceTier("cpu", "24KiB"), HostTier("48KiB"), DiskTier(self.folder / "d", "16MiB", chunk_size="16KiB", durable=False)]
        return await TierStore(tiers).open()

    # -- the model ------------------------------------------------------------------------------

    def allowed(self, key: str) -> list[Value]:
        return self.model.get(key, [None]) + list(self.late.get(key, []))

    def wrote(self, key: str, allowed: list[Value]) -> None:
        """A write of ``key`` completed: it holds one of ``allowed`` now, and keeps it."""
        self.model[key] = allowed
        self.late.pop(key, None)
        for hold in self.holds:
            if hold.key == key and not hold.write:
                hold.detached = True

    def hold_state(self, key: str) -> bool | None:
        """Whether ``key``'s value is held (None: a cancelled put may have replaced it)."""
        states = {hold.detached for hold in self.holds if hold.key == key}
        return True if False in states else (None if None in states else False)

    def writer(self, key: str) -> OpenHold | None:
        return next((h for h in self.holds if h.key == key and h.write), None)

    def held(self, key: str) -> bool:
        return any(h.key == key for h in self.holds)

    def pin(self, key: str, actual: Value, allowed: list[Value] | None = None) -> None:
        """``key`` was seen holding ``actual``: it must be one of the values allowed; it is the
        value from now on."""
        allowed = self.allowed(key) if allowed is None else allowed
        assert matches(allowed, actual), f"{key!r} holds {describe([actual])}; allowed: {describe(allowed)}"
        self.model[key] = [None if actual is None else actual.clone()]
        late = [value for value in self.late.get(key, []) if not matches([value], actual)]
        if len(late) < len(self.late.get(key, [])):  # a cancelled put landed after all
            for hold in self.holds:
                if hold.key == key and not hold.write:
                    hold.detached = True
        if late:
            self.late[key] = late
        else:
            self.late.pop(key, None)

    async def actual(self, key: str) -> Value:
        if key not in self.store:
            return None
        return await self.store.read(key)

    async def known(self, key: str) -> Value:
        """The value of ``key``, read (and pinned) if the model allows several."""
        allowed = self.allowed(key)
        if len(allowed) == 1:
            return allowed[0]
        if self.writer(key) is not None:
            raise AssertionError(f"{key!r} is write-held with an unknown value")  # holds start on known keys
        actual = await self.actual(key)
        self.pin(key, actual)
        return actual

    # -- puts -------------------------------------------------------------------------------------

    @rule(key=KEYS, value=values(), tier=st.none() | TIERS, durable=st.booleans())
    def put(self, key: str, value: torch.Tensor, tier: str | None, durable: bool) -> None:
        self.do(self._put(key, value, tier, durable))

    async def _put(self, key: str, value: torch.Tensor, tier: str | None, durable: bool) -> None:
        hold = self.writer(key)
        if hold is not None:
            if len(hold.waiters) < MAX_WAITERS:
                hold.waiters.append(Waiter("put", asyncio.ensure_future(self.store.put(key, value.clone(), tier)), value))
            return
        expected = value.clone()
        try:
            await self.store.put(key, value, tier, durable=durable)
        except TierFullError:
            if tier is None:
                raise  # the disk tier has room for every value here
            return  # the tier is full of held copies (or too small): refused, nothing changed
        fill(value, SCRIBBLE)  # the store owns its copy: the caller's memory is the caller's again
        self.wrote(key, [expected])
        if durable:
            assert "disk" in self.store.where(key), f"a durable put of {key!r} returned before reaching the disk"

    @rule(key=KEYS, value=values(sizes=(1000, 4096, 8192)), tier=st.none() | TIERS, turns=st.integers(0, 20))
    def cancelled_put(self, key: str, value: torch.Tensor, tier: str | None, turns: int) -> None:
        self.do(self._cancelled_put(key, value, tier, turns))

    async def _cancelled_put(self, key: str, value: torch.Tensor, tier: str | None, turns: int) -> None:
        if self.writer(key) is not None:
            return
        expected = value.clone()
        task = asyncio.ensure_future(self.store.put(key, value, tier))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task])
        fill(value, SCRIBBLE)  # a cancelled put has returned: it no longer reads the tensor
        if task.cancelled():
            self.late.setdefault(key, []).append(expected)  # it may or may not land, but whole
            for hold in self.holds:
                if hold.key == key and hold.detached is False:
                    hold.detached = None
        elif isinstance(task.exception(), TierFullError) and tier is not None:
            return
        else:
            task.result()  # raises what the put raised
            self.wrote(key, [expected])

    # -- reads ------------------------------------------------------------------------------------

    @rule(key=KEYS, tier=TIERS, how=st.sampled_from(["get", "read"]))
    def get(self, key: str, tier: str, how: str) -> None:
        self.do(self._get(key, tier, how))

    def _reader(self, key: str, tier: str, how: str) -> Coroutine[Any, Any, torch.Tensor]:
        return self.store.get(key, tier) if how == "get" else self.store.read(key)

    async def _get(self, key: str, tier: str, how: str) -> None:
        hold = self.writer(key)
        if hold is not None:
            if len(hold.waiters) < MAX_WAITERS:
                hold.waiters.append(Waiter(how, asyncio.ensure_future(self._reader(key, tier, how))))
            return
        expected = await self.known(key)
        if expected is None:
            with pytest.raises(KeyNotFoundError):
                await self._reader(key, tier, how)
            return
        got = await self._reader(key, tier, how)
        assert same_bytes(got, expected), f"{how} {key!r} to {tier}: stale or torn bytes"
        assert got.device.type == "cpu"

    @rule(key=KEYS, tier=TIERS, turns=st.integers(0, 10))
    def cancelled_get(self, key: str, tier: str, turns: int) -> None:
        self.do(self._cancelled_get(key, tier, turns))

    async def _cancelled_get(self, key: str, tier: str, turns: int) -> None:
        if self.writer(key) is not None or await self.known(key) is None:
            return
        expected = await self.known(key)
        task = asyncio.ensure_future(self.store.get(key, tier))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled():
            assert same_bytes(task.result(), expected)  # type: ignore[arg-type]

    @rule(keys=st.lists(KEYS, max_size=4, unique=True), tier=MEMORY_TIERS, cancel=st.booleans())
    def prefetch(self, keys: list[str], tier: str, cancel: bool) -> None:
        self.do(self._prefetch(keys, tier, cancel))

    async def _prefetch(self, keys: list[str], tier: str, cancel: bool) -> None:
        wanted = [key for key in keys if self.writer(key) is None and await self.known(key) is not None]
        if not wanted:
            return
        handle = await self.store.prefetch(wanted, tier)
        if cancel:
            handle.cancel()
        waiting = asyncio.ensure_future(handle.wait())
        await asyncio.wait([waiting])
        if not waiting.cancelled():
            result = waiting.result()
            assert not result.failed, f"prefetch failed: {result.failed}"

    # -- several tasks at once -------------------------------------------------------------------

    @rule(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "read"]), KEYS, values(), TIERS), min_size=2, max_size=4))
    def concurrent(self, ops: list[tuple[str, str, torch.Tensor, str]]) -> None:
        self.do(self._concurrent(ops))

    async def _concurrent(self, ops: list[tuple[str, str, torch.Tensor, str]]) -> None:
        ops = [op for op in ops if self.writer(op[1]) is None]
        for key in sorted({key for _, key, _, _ in ops}):
            await self.known(key)
        tasks = [self.store.put(key, value) if kind == "put" else self._reader(key, tier, kind) for kind, key, value, tier in ops]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        written: dict[str, list[Value]] = {}
        for kind, key, value, _ in ops:
            if kind == "put":
                written.setdefault(key, []).append(value)
        for (kind, key, _, _), result in zip(ops, results, strict=True):
            if kind == "put":
                if isinstance(result, BaseException):
                    raise AssertionError(f"a put of {key!r} among others failed") from result
                continue
            allowed = self.allowed(key) + written.get(key, [])  # a racing put may come first
            if isinstance(result, KeyNotFoundError) and None in allowed:
                continue
            if isinstance(result, BaseException):
                raise AssertionError(f"a {kind} of {key!r} among others failed") from result
            assert matches(allowed, result), f"{kind} {key!r} among others: {describe([result])}; allowed {describe(allowed)}"
        for key, allowed in written.items():
            self.wrote(key, allowed)  # one of the racing puts is last

    # -- removal -----------------------------------------------------------------------------------

    @rule(key=KEYS, tier=TIERS, how=st.sampled_from(["delete", "pop"]))
    def remove(self, key: str, tier: str, how: str) -> None:
        self.do(self._remove(key, tier, how))

    async def _remove(self, key: str, tier: str, how: str) -> None:
        remove = self.store.delete(key) if how == "delete" else self.store.pop(key, tier)
        held = self.hold_state(key)
        if held:
            with pytest.raises(EntryHeldError):
                await remove
            return
        expected = await self.known(key)
        if expected is None:
            with pytest.raises(KeyNotFoundError):
                await remove
            return
        try:
            got = await remove
        except EntryHeldError:
            if held is None:  # the cancelled put did not land: the held value is the value
                return
            raise
        if how == "pop":
            assert same_bytes(got, expected), f"pop {key!r}: stale or torn bytes"  # type: ignore[arg-type]
        assert key not in self.store
        self.wrote(key, [None])

    # -- holds within a step -------------------------------------------------------------------------

    @rule(
        key=KEYS,
        tier=MEMORY_TIERS,
        byte=st.integers(0, 255),
        inside=st.sampled_from(["get", "get-host", "get-disk", "read", "put", "hold", "read-hold", "child", "pop", "delete", "flush"]),
    )
    def write_hold(self, key: str, tier: str, byte: int, inside: str) -> None:
        self.do(self._write_hold(key, tier, byte, inside))

    async def _write_hold(self, key: str, tier: str, byte: int, inside: str) -> None:
        if self.held(key) or await self.known(key) is None:
            return
        expected = await self.known(key)
        on_disk = "disk" in self.store.where(key)
        entered = False
        try:
            async with self.store.hold(key, tier, write=True) as buffer:
                entered = True
                assert same_bytes(buffer, expected), f"write hold of {key!r}: the buffer is not the value"  # type: ignore[arg-type]
                fill(buffer, byte)
                written = buffer.clone()
                await self._own_access(key, inside, on_disk)
                assert same_bytes(buffer, written)
        except TierFullError:
            if entered:
                raise
            return  # everything on that tier is held: refused, nothing changed
        self.wrote(key, [written])

    async def _own_access(self, key: str, inside: str, on_disk: bool) -> None:
        """From inside our own write hold of ``key``, using ``key`` through the store raises."""
        store = self.store
        if inside == "flush":
            if any(h.write for h in self.holds):
                return  # it would wait for another task's write hold, which this step cannot release
            if on_disk:  # the value being written has a valid disk copy: nothing of ours to flush
                await store.flush()
                return
        actions = {
            "get": lambda: store.get(key),
            "get-host": lambda: store.get(key, "host"),
            "get-disk": lambda: store.get(key, "disk"),
            "read": lambda: store.read(key),
            "put": lambda: store.put(key, torch.zeros(3)),
            "hold": lambda: _enter(store.hold(key, "host", write=True)),
            "read-hold": lambda: _enter(store.hold(key, "host")),
            "child": lambda: asyncio.ensure_future(store.get(key, "host")),  # a task started inside is inside
            "pop": lambda: store.pop(key),
            "delete": lambda: store.delete(key),
            "flush": lambda: store.flush(),
        }
        with pytest.raises(EntryHeldError):
            await actions[inside]()

    @rule(key=KEYS, tier=MEMORY_TIERS, replacement=st.none() | values())
    def read_hold(self, key: str, tier: str, replacement: torch.Tensor | None) -> None:
        self.do(self._read_hold(key, tier, replacement))

    async def _read_hold(self, key: str, tier: str, replacement: torch.Tensor | None) -> None:
        if self.writer(key) is not None or await self.known(key) is None:
            return
        expected: torch.Tensor = await self.known(key)  # type: ignore[assignment]
        entered = False
        try:
            async with self.store.hold(key, tier) as buffer:
                entered = True
                assert same_bytes(buffer, expected), f"read hold of {key!r}: the buffer is not the value"
                assert same_bytes(await self.store.get(key, "host"), expected)  # reads go on inside read holds
                if replacement is not None:
                    await self.store.put(key, replacement)
                    self.wrote(key, [replacement.clone()])
                    assert same_bytes(buffer, expected), "a put changed a read-held buffer"
                    assert same_bytes(await self.store.get(key, "host"), replacement), "a put under a read hold was lost"
        except TierFullError:
            if entered:
                raise
            return

    @rule(key=KEYS)
    def refusals(self, key: str) -> None:
        self.do(self._refusals(key))

    async def _refusals(self, key: str) -> None:
        if self.writer(key) is not None or await self.known(key) is None:
            return
        with pytest.raises(UnknownTierError):
            await _enter(self.store.hold(key, "disk"))
        with pytest.raises(UnknownTierError):
            await self.store.get(key, "nowhere")

    # -- holds across steps (another task holds; this one waits) ----------------------------------------

    # No @precondition on these rules: whether a hold opens depends on timing (a tier may be full of
    # values in flight), and hypothesis refuses a rule choice that differs between replays of one example.
    @rule(key=KEYS, tier=MEMORY_TIERS, write=st.booleans())
    def open_hold(self, key: str, tier: str, write: bool) -> None:
        if len(self.holds) >= MAX_OPEN_HOLDS:
            return
        self.do(self._open_hold(key, tier, write))

    async def _open_hold(self, key: str, tier: str, write: bool) -> None:
        if self.writer(key) is not None or (write and (self.held(key) or self.flushes)) or await self.known(key) is None:
            return  # (a waiting flush would wait for this hold too, and is awaited before it ends)
        expected: torch.Tensor = await self.known(key)  # type: ignore[assignment]
        entered: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        release = asyncio.Event()

        async def holder() -> None:
            async with self.store.hold(key, tier, write=write) as buffer:
                entered.set_result(buffer)
                await release.wait()

        task = asyncio.ensure_future(holder())
        either: list[asyncio.Future[Any]] = [entered, task]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not entered.done():
            if isinstance(task.exception(), TierFullError):
                return  # everything on that tier is held: refused
            task.result()
        buffer = entered.result()
        assert same_bytes(buffer, expected), f"hold of {key!r}: the buffer is not the value"
        self.holds.append(OpenHold(key, tier, write, buffer, expected.clone(), release, task))

    @rule(which=st.integers(0, 100), byte=st.integers(0, 255))
    def change_held(self, which: int, byte: int) -> None:
        writes = [h for h in self.holds if h.write]
        if not writes:
            return
        hold = writes[which % len(writes)]
        fill(hold.buffer, byte)
        hold.expected = hold.buffer.clone()

    @rule(which=st.integers(0, 100), kind=st.sampled_from(["get", "read", "put", "hold", "flush"]), tier=TIERS, value=values())
    def wait_for_writer(self, which: int, kind: str, tier: str, value: torch.Tensor) -> None:
        writes = [h for h in self.holds if h.write]
        if not writes:
            return
        hold = writes[which % len(writes)]
        if kind == "flush":
            self.do(self._flush())
            return
        if len(hold.waiters) >= MAX_WAITERS:
            return
        if kind == "put":
            self.do(self._put(hold.key, value, None, False))  # joins the waiters
        elif kind == "hold":
            hold.waiters.append(Waiter("hold", self.do(_start(_held_value(self.store, hold.key)))))
        else:
            self.do(self._get(hold.key, tier, kind))  # joins the waiters

    @rule(which=st.integers(0, 100))
    def release(self, which: int) -> None:
        if not self.holds:
            return
        self.do(self._release(self.holds[which % len(self.holds)]))

    async def _release(self, hold: OpenHold) -> None:
        for waiter in hold.waiters:
            assert not waiter.task.done(), f"a {waiter.kind} of {hold.key!r} went ahead while another task held it for writing"
        for flush, blockers in self.flushes:
            if hold in blockers:
                assert not flush.done(), "a flush went ahead while another task held a key it had to write"
        assert same_bytes(hold.buffer, hold.expected)
        self.holds.remove(hold)
        hold.release.set()
        await hold.task
        if not hold.write:
            return
        results = await asyncio.gather(*(w.task for w in hold.waiters), return_exceptions=True)
        puts: list[Value] = [w.value for w in hold.waiters if w.kind == "put"]
        for waiter, result in zip(hold.waiters, results, strict=True):
            if isinstance(result, BaseException):
                raise AssertionError(f"a {waiter.kind} of {hold.key!r} waiting for a write hold failed") from result
            if waiter.kind != "put":
                allowed = [hold.expected, *puts]  # the released value, or a waiting put's
                assert matches(allowed, result), f"{waiter.kind} after a write hold: {describe([result])}; allowed {describe(allowed)}"
        self.wrote(hold.key, puts or [hold.expected])
        ready = [flush for flush, blockers in self.flushes if not any(h in self.holds for h in blockers)]
        self.flushes = [(flush, blockers) for flush, blockers in self.flushes if flush not in ready]
        await asyncio.gather(*ready)

    # -- flush, close, reopen ------------------------------------------------------------------------

    @rule()
    def flush(self) -> None:
        self.do(self._flush())

    async def _flush(self) -> None:
        blockers = [h for h in self.holds if h.write and "disk" not in self.store.where(h.key)]
        if blockers:
            if len(self.flushes) < MAX_WAITERS:  # it has held values to write: it waits
                self.flushes.append((asyncio.ensure_future(self.store.flush()), blockers))
            return
        await self.store.flush()  # write-held values that are on disk already need no wait
        for key in self.store.keys():
            assert "disk" in self.store.where(key), f"{key!r} is not on the disk tier after a flush"

    @rule(now=st.integers(0, 3))
    def close_and_reopen(self, now: int) -> None:
        if now == 0:  # one time in four: a reopen costs as much as ten other steps
            self.do(self._close_and_reopen())

    async def _close_and_reopen(self) -> None:
        while self.holds:
            await self._release(self.holds[0])
        await self.store.aclose()  # flushes
        with pytest.raises(StoreClosedError):
            await self.store.get("k0")
        with pytest.raises(StoreClosedError):
            await self.store.put("k0", torch.zeros(1))
        with pytest.raises(StoreClosedError):
            self.store.keys()
        self.store = await self._open()
        for key in KEY_NAMES:  # close drained every write: nothing lands late any more
            self.pin(key, await self.actual(key))
        self.late.clear()

    # -- after every step ----------------------------------------------------------------------------

    @invariant()
    def promises_hold(self) -> None:
        self.steps += 1
        self.do(self._check())

    async def _check(self) -> None:
        store = self.store
        for tier in store.tiers:
            assert tier.used <= tier.capacity, f"{tier.name}: {tier.used} > {tier.capacity}"
            if isinstance(tier, MemoryTier):
                assert tier.live_bytes <= tier.capacity
        for hold in self.holds:
            assert same_bytes(hold.buffer, hold.expected), f"the held buffer of {hold.key!r} changed"
            if hold.write:
                assert hold.tier in store.where(hold.key) and store.info(hold.key)["held"]
        if not self.holds and not self.flushes:
            await settle(store)
            check_consistency(store)
        key = KEY_NAMES[self.steps % len(KEY_NAMES)]
        if self.writer(key) is None:
            self.pin(key, await self.actual(key))

    def teardown(self) -> None:
        try:
            if self.store.is_open:
                self.do(self._shutdown())
        finally:
            try:
                _close_loop(self.loop)  # cancels what a failed step left behind
            finally:
                shutil.rmtree(self.folder, ignore_errors=True)

    async def _shutdown(self) -> None:
        while self.holds:
            await self._release(self.holds[0])
        await self.store.aclose(flush=False)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    left = asyncio.all_tasks(loop)
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left))  # cancelled: their outcome is not checked
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


async def _start(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    return asyncio.ensure_future(coro)


async def _enter(manager: Any) -> None:
    async with manager:
        pass


async def _held_value(store: TierStore, key: str) -> torch.Tensor:
    async with store.hold(key, "host") as buffer:
        return buffer.clone()


@pytest.mark.parametrize("turns", range(6))
async def test_a_cancelled_put_of_a_new_key_leaves_the_store_consistent(tmp_path: Path, turns: int) -> None:
    """Found by the machine: a put of a new key to the disk tier, cancelled after ``turns``
    loop turns. Once its write is over, the key is in the store with its value (and on disk)
    or absent from both; the disk tier counts no extent that no key owns."""
    tiers = lambda: [HostTier("48KiB"), DiskTier(tmp_path / "d", "16MiB", chunk_size="16KiB", durable=False)]  # noqa: E731
    value = torch.arange(8192, dtype=torch.int64)  # 64 KiB: more than the host tier holds
    async with TierStore(tiers()) as store:
        put = asyncio.ensure_future(store.put("k", value.clone()))
        for _ in range(turns):
            await asyncio.sleep(0)
        put.cancel()
        await asyncio.wait([put])
        await settle(store)  # the write goes on in the background: wait for it to end
        check_consistency(store)
        present = "k" in store
        if present:
            assert same_bytes(await store.get("k"), value)
    async with TierStore(tiers()) as store:
        assert ("k" in store) == present, "the key came back after a reopen" if not present else "the key was lost"


@pytest.mark.parametrize("how", ["delete", "pop"])
async def test_removing_a_key_another_task_holds_for_writing_is_refused(how: str) -> None:
    """Found by the machine: delete and pop of a held key raise ``EntryHeldError`` at once,
    also while the hold is another task's write hold (pop waited for its release)."""
    async with TierStore([DeviceTier("cpu", "24KiB"), HostTier("48KiB")]) as store:
        await store.put("k", torch.arange(10.0))
        entered, release = asyncio.Event(), asyncio.Event()

        async def writer() -> None:
            async with store.hold("k", write=True) as buffer:
                buffer.fill_(1.0)
                entered.set()
                await release.wait()

        holder = asyncio.ensure_future(writer())
        await entered.wait()
        try:
            with pytest.raises(EntryHeldError):
                await asyncio.wait_for(store.delete("k") if how == "delete" else store.pop("k"), 5)
        finally:
            release.set()
            await holder
        assert same_bytes(await store.get("k"), torch.ones(10))


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=STEPS, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachine = StoreMachine.TestCase
