"""A bounded pool of worker threads with priorities, awaited from the event loop.

Disk I/O, large memory copies and the optimizer's math run here, off the loop. Jobs wait in a
priority queue, so demand reads go before prefetches even when the pool is busy; a job not yet
started when its awaiting coroutine is cancelled is skipped, and one already running is waited
for before the cancellation propagates, so no thread ever writes into a buffer that was freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")


class Priority(IntEnum):
    """Order of service in every queue: lower goes first."""

    DEMAND = 0
    PREFETCH = 1
    BACKGROUND = 2


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    fn: Callable[[], Any] = field(compare=False)
    loop: asyncio.AbstractEventLoop = field(compare=False)
    future: asyncio.Future[Any] = field(compare=False)
    skip: bool = field(default=False, compare=False)


_SKIPPED = object()
_STOP = None


class WorkerPool:
    """``threads`` daemon threads serving jobs by priority, then by arrival."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a worker pool needs at least one thread, not {threads}")
        self.name = name
        self.threads = threads
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        if self._workers:
            return
        for i in range(self.threads):
            worker = threading.Thread(target=self._serve, name=f"tierstore-{self.name}-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def shutdown(self) -> None:
        """Stop the threads once the queued jobs are done."""
        for _ in self._workers:
            self._queue.put((1 << 30, next(self._seq), _STOP))
        for worker in self._workers:
            worker.join()
        self._workers.clear()

    @property
    def running(self) -> bool:
        return bool(self._workers)

    async def run(self, fn: Callable[[], T], priority: Priority = Priority.DEMAND) -> T:
        """Run ``fn`` on a worker thread and return its result."""
        (result,) = await self.run_all([fn], priority)
        return result

    async def run_all(self, fns: Sequence[Callable[[], T]], priority: Priority = Priority.DEMAND) -> list[T]:
        """Run every function concurrently on the pool; return their results in order.

        If any raises, the first exception is raised after all have finished. If the caller is
        cancelled, jobs not yet started are skipped and running ones are waited for first.
        """
        if not self._workers:
            raise RuntimeError(f"worker pool {self.name!r} is not running")
        loop = asyncio.get_running_loop()
        jobs = []
        for fn in fns:
            job = _Job(int(priority), next(self._seq), fn, loop, loop.create_future())
            self._queue.put((job.priority, job.seq, job))
            jobs.append(job)
        together = asyncio.gather(*(job.future for job in jobs), return_exceptions=True)
        try:
            results = await asyncio.shield(together)
        except asyncio.CancelledError:
            for job in jobs:
                job.skip = True
            await wait_uncancelled(together)
            raise
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # type: ignore[return-value]  # exceptions were raised above

    def _serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            if job.skip:
                _resolve(job, _SKIPPED, None)
                continue
            try:
                result = job.fn()
            except BaseException as exc:  # delivered to the awaiting coroutine
                _resolve(job, None, exc)
            else:
                _resolve(job, result, None)
            # An idle thread must not keep its last job (and the buffers its function names)
            # alive until the next one: a freed tier buffer would stay allocated outside every budget.
            job = result = None  # type: ignore[assignment]


def _resolve(job: _Job, result: Any, exc: BaseException | None) -> None:
    def deliver() -> None:
        if job.future.done():
            return
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        job.loop.call_soon_threadsafe(deliver)


class CallerPool:
    """Jobs run by a thread that is waiting anyway: the training thread blocked in
    ``optimizer.step()`` drains them with ``drain_until``.

    Torch kernels on a fresh thread start a second OpenMP team that fights the training
    thread's own (still spinning) team for the cores; running the optimizer's math on the
    training thread avoids that and is as fast as ``torch.optim`` itself.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None] = queue.SimpleQueue()

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, loop, future))
        await wait_uncancelled(future)  # a job handed out is always waited for
        return future.result()

    def drain_until(self, done: Any) -> None:
        """Run jobs on this thread until ``done`` (a concurrent.futures.Future) completes."""
        done.add_done_callback(lambda _: self._jobs.put(None))
        while True:
            item = self._jobs.get()
            if item is None:
                if done.done():
                    return
                continue
            fn, loop, future = item
            try:
                result = fn()
            except BaseException as exc:  # delivered to the awaiting coroutine
                loop.call_soon_threadsafe(_settle_future, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle_future, future, result, None)
            item = fn = result = None  # type: ignore[assignment]  # (see WorkerPool._serve)


def _settle_future(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def wait_uncancelled(awaitable: asyncio.Future[Any]) -> None:
    """Wait for ``awaitable`` to finish, absorbing cancellations meanwhile (cleanup paths use this
    so that buffers are never freed under a running transfer)."""
    while not awaitable.done():
        try:
            await asyncio.shield(awaitable)
        except asyncio.CancelledError:
            continue
        except BaseException:
            return
