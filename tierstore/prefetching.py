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
from typing import TYPE_CHECKING, Any

from .errors import KeyNotFoundError, TierFullError
from .workers import Priority

if TYPE_CHECKING:
    from .engine import Engine
    from .entry import Entry

#: Promotions a prefetch runs at once (enough to keep the disk queue full).
PREFETCH_CONCURRENCY = 4
#: Most suggested prefetches waiting at a time; older suggestions are dropped beyond it.
SUGGESTION_QUEUE = 1024


@dataclass
class PrefetchResult:
    """What a prefetch did: keys brought up, already there, dropped for lack of room, failed."""

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


class PrefetchIssuer:
    """Runs the store's prefetches: explicit batches and a queue of policy suggestions."""

    def __init__(self, store: Engine) -> None:
        self._store = store
        self._queue: deque[tuple[str, int]] = deque()
        self._queued: set[tuple[str, int]] = set()
        self._runner: asyncio.Task[None] | None = None

    def start(self, entries: list[Entry], t: int) -> PrefetchHandle:
        task = asyncio.ensure_future(self._run_batch(entries, t))
        self._store._background.add(task)
        task.add_done_callback(self._store._background.discard)
        return PrefetchHandle(task)

    def follow(self, suggestions: Iterable[tuple[str, str | None]], default_tier: int) -> None:
        """Queue a policy's suggestions (skipping what is there or on its way)."""
        store = self._store
        for key, tier in suggestions:
            try:
                t = store._index(tier) if tier is not None else default_tier
            except Exception:
                continue
            entry = store._entries.get(key)
            if entry is None or not entry.visible or entry.valid(t) is not None or t in entry.loading:
                continue
            if (key, t) in self._queued or store._index(t) == store._disk_index:
                continue
            if len(self._queue) >= SUGGESTION_QUEUE:
                self._queued.discard(self._queue.popleft())
            self._queue.append((key, t))
            self._queued.add((key, t))
        if self._queue and (self._runner is None or self._runner.done()):
            self._runner = asyncio.ensure_future(self._drain())
            store._background.add(self._runner)
            self._runner.add_done_callback(store._background.discard)

    async def _drain(self) -> None:
        store = self._store
        running: set[asyncio.Task[Any]] = set()
        try:
            while self._queue or running:
                while self._queue and len(running) < PREFETCH_CONCURRENCY:
                    key, t = self._queue.popleft()
                    self._queued.discard((key, t))
                    entry = store._entries.get(key)
                    if entry is None or not entry.visible:
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
        return result

    def _would_push_out_sooner(self, entry: Entry, t: int) -> bool:
        """With a future-seeing eviction policy (MIN), a prefetch that needs room must not evict
        a key needed before the one it fetches."""
        store = self._store
        policy = store._policies[t]
        next_use = getattr(store.prefetch_policy, "next_use", None)
        furthest = getattr(policy, "furthest_next_use", None)
        tier = store.tiers[t]
        if next_use is None or furthest is None or tier.free >= entry.meta.nbytes:
            return False
        return bool(furthest() < next_use(entry.key))

    async def _fetch(self, entry: Entry, t: int, result: PrefetchResult) -> None:
        store = self._store
        counters = store.counters.prefetch
        if entry.valid(t) is not None:
            counters.already_there += 1
            result.already_there.append(entry.key)
            return
        if self._would_push_out_sooner(entry, t):
            counters.dropped += 1
            result.dropped.append(entry.key)
            return
        counters.issued += 1
        try:
            await store._ensure(entry, t, Priority.PREFETCH)
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
        store._prefetched.add((entry.key, t))
        if store.trace is not None:
            store.trace.record("prefetch", entry.key, entry.meta.nbytes, t, None)
