"""Prefetches: explicit ones (``store.prefetch``) and the ones a prefetch policy suggests.

A prefetch is a promotion at ``Priority.PREFETCH``: its disk reads and copies queue behind every
demand request. Each runs as a task the store owns; cancelling it skips the work not yet started
and waits for what is in flight, so buffers are released and the store stays consistent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .errors import KeyNotFoundError, TierFullError, UnknownTierError
from .workers import Priority

if TYPE_CHECKING:
    from .entry import Entry
    from .stats import StoreCounters

#: Promotions a prefetch runs at once (enough to keep the disk queue full).
PREFETCH_CONCURRENCY = 4
#: Most suggested prefetches waiting at a time; older suggestions are dropped beyond it.
SUGGESTION_QUEUE = 1024


@dataclass
class PrefetchResult:
    """What a prefetch did: keys brought up, already there, dropped for lack of room, failed;
    each list in the order the keys were asked (not the order the reads ended)."""

    fetched: list[str] = field(default_factory=list)
    already_there: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    failed: dict[str, BaseException] = field(default_factory=dict)
    cancelled: bool = False


class PrefetchHandle:
    """A running prefetch. ``await handle`` waits for it and returns a ``PrefetchResult``;
    ``handle.cancel()`` stops it (what already arrived stays)."""

    def __init__(self, task: asyncio.Task[PrefetchResult]) -> None:
        self._task = task

    def cancel(self) -> None:
        self._task.cancel()

    def done(self) -> bool:
        return self._task.done()

    async def wait(self) -> PrefetchResult:
        return await asyncio.shield(self._task)

    def __await__(self) -> Generator[Any, None, PrefetchResult]:
        return self.wait().__await__()


class PrefetchTarget(Protocol):
    """What the issuer needs of the engine (and nothing more)."""

    counters: StoreCounters

    def lookup(self, key: str) -> Entry | None:
        """The visible entry of ``key``, or None."""

    def tier_index(self, tier: str | int) -> int:
        """A tier's index from its name or index (``UnknownTierError`` if none)."""

    def can_hold_copies(self, t: int) -> bool:
        """Whether tier ``t`` takes promoted copies (a memory tier)."""

    def would_push_out_sooner(self, entry: Entry, t: int) -> bool:
        """Whether bringing ``entry`` up to ``t`` would evict something needed sooner."""

    async def promote(self, entry: Entry, t: int, priority: Priority) -> None:
        """Return once ``entry`` has a valid copy on tier ``t``."""

    def prefetched(self, entry: Entry, t: int) -> None:
        """Note a completed prefetch (for usefulness counters and the trace)."""

    def own(self, task: asyncio.Task[Any]) -> None:
        """Keep ``task`` until it ends; the store cancels it on close."""


class PrefetchIssuer:
    """Runs the store's prefetches: explicit batches and a queue of policy suggestions."""

    def __init__(self, store: PrefetchTarget) -> None:
        self._store = store
        self._queue: deque[tuple[str, int]] = deque()
        self._queued: set[tuple[str, int]] = set()
        self._runner: asyncio.Task[None] | None = None

    def start(self, entries: list[Entry], t: int) -> PrefetchHandle:
        task = asyncio.ensure_future(self._run_batch(entries, t))
        self._store.own(task)
        return PrefetchHandle(task)

    def follow(self, suggestions: Iterable[tuple[str, str | None]], default_tier: int) -> None:
        """Queue a policy's suggestions (skipping what is there or on its way)."""
        store = self._store
        for key, tier in suggestions:
            try:
                t = store.tier_index(tier) if tier is not None else default_tier
            except UnknownTierError:
                continue  # a policy's suggestion for a tier this store lacks
            entry = store.lookup(key)
            if entry is None or entry.valid(t) is not None or t in entry.loading:
                continue
            if (key, t) in self._queued or not store.can_hold_copies(t):
                continue
            if len(self._queue) >= SUGGESTION_QUEUE:
                self._queued.discard(self._queue.popleft())
            self._queue.append((key, t))
            self._queued.add((key, t))
        if self._queue and (self._runner is None or self._runner.done()):
            self._runner = asyncio.ensure_future(self._drain())
            store.own(self._runner)

    async def _drain(self) -> None:
        store = self._store
        running: set[asyncio.Task[Any]] = set()
        try:
            while self._queue or running:
                while self._queue and len(running) < PREFETCH_CONCURRENCY:
                    key, t = self._queue.popleft()
                    self._queued.discard((key, t))
                    entry = store.lookup(key)
                    if entry is None:
                        continue
                    running.add(asyncio.ensure_future(self._fetch(entry, t, PrefetchResult())))
                if running:
                    _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise

    async def _run_batch(self, entries: list[Entry], t: int) -> PrefetchResult:
        result = PrefetchResult()
        limit = asyncio.Semaphore(PREFETCH_CONCURRENCY)

        async def one(entry: Entry) -> None:
            async with limit:
                await self._fetch(entry, t, result)

        tasks = [asyncio.ensure_future(one(entry)) for entry in entries]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            result.cancelled = True
            self._store.counters.prefetch.cancelled += 1
        rank = {entry.key: i for i, entry in enumerate(entries)}
        for keys in (result.fetched, result.already_there, result.dropped):
            keys.sort(key=rank.__getitem__)
        return result

    async def _fetch(self, entry: Entry, t: int, result: PrefetchResult) -> None:
        store = self._store
        counters = store.counters.prefetch
        if entry.valid(t) is not None:
            counters.already_there += 1
            result.already_there.append(entry.key)
            return
        if store.would_push_out_sooner(entry, t):
            counters.dropped += 1
            result.dropped.append(entry.key)
            return
        counters.issued += 1
        try:
            await store.promote(entry, t, Priority.PREFETCH)
        except (TierFullError, KeyNotFoundError):
            counters.dropped += 1
            result.dropped.append(entry.key)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported in the result; the demand read will raise it
            counters.failed += 1
            result.failed[entry.key] = exc
            return
        counters.completed += 1
        result.fetched.append(entry.key)
        store.prefetched(entry, t)
