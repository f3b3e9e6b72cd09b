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
from enum import IntEnum
from typing import Any, TypeVar

from .intra_op import run_ops_serially

T = TypeVar("T")


class Priority(IntEnum):
    """Order of service in every queue: lower goes first."""

    DEMAND = 0
    PREFETCH = 1
    BACKGROUND = 2


class _Batch:
    """The jobs of one ``run_all`` call: at most ``limit`` of them queued or running at a time
    (the next is queued by the thread that finishes one), and one wake-up of the event loop when
    the last finishes (after ``then``), not one per job."""

    def __init__(
        self,
        pool: WorkerPool,
        fns: Sequence[Callable[[], Any]],
        priority: int,
        limit: int,
        then: Callable[[], Any] | None,
        loop: asyncio.AbstractEventLoop,
        finish: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.pool = pool
        self.fns: list[Callable[[], Any]] | None = list(fns)
        self.priority = priority
        self.limit = limit
        self.then = then
        self.finish = finish
        self.loop = loop
        self.future: asyncio.Future[list[Any]] = loop.create_future()
        self.results: list[Any] = [None] * len(self.fns)
        self.errors: dict[int, BaseException] = {}
        self.skip = False
        #: Whether the outcome went to ``future`` (under the lock: a cancelled caller swaps in
        #: a new future to wait on, unless it was)
        self.delivered = False
        self._left = len(self.fns)
        self._next = 0
        self._lock = threading.Lock()

    def submit_first(self) -> None:
        with self._lock:
            count = min(self.limit, self._left)
            self._next = count
        for index in range(count):
            self.pool._put(self, index)

    def run(self, index: int) -> None:
        """Run job ``index`` (or skip it), then queue the next one or finish the batch."""
        fns = self.fns
        if not self.skip and fns is not None:
            try:
                self.results[index] = fns[index]()
            except BaseException as exc:  # delivered to the awaiting coroutine
                self.errors[index] = exc
        with self._lock:
            self._left -= 1
            following = None
            if self.skip:  # cancelled: jobs never queued count as done
                self._left -= len(self.results) - self._next
                self._next = len(self.results)
            elif self._next < len(self.results):
                following = self._next
                self._next += 1
            last = self._left == 0
        if following is not None:
            self.pool._put(self, following)
        if last:
            self._finish()

    def _finish(self) -> None:
        if self.then is not None and not self.errors and not self.skip:
            try:
                self.then()
            except BaseException as exc:
                self.errors[len(self.results)] = exc
        if self.finish is not None and not self.errors and not self.skip:
            try:
                self.finish(self.results)
            except BaseException as exc:
                self.errors[len(self.results) + 1] = exc
        # An idle thread must not keep the batch's functions (and the buffers they name) alive
        # until the next job: a freed tier buffer would stay allocated outside every budget.
        self.fns = None
        self.then = self.finish = None
        error = self.errors[min(self.errors)] if self.errors else None
        with self._lock:
            self.delivered = True
            future = self.future
        _deliver(self.loop, future, self.results, error)


_STOP = None


class WorkerPool:
    """``threads`` daemon threads serving jobs by priority, then by arrival. With
    ``serial_ops`` (the default) the torch ops a job calls run on its thread alone
    (``tierstore.intra_op``); without, with torch's intra-op threads, for math that is the
    user's compute (the optimizer's update in backward)."""

    def __init__(self, threads: int, name: str, serial_ops: bool = True) -> None:
        if threads < 1:
            raise ValueError(f"a worker pool needs at least one thread, not {threads}")
        self.name = name
        self.threads = threads
        self.serial_ops = serial_ops
        self._queue: queue.PriorityQueue[tuple[int, int, _Batch | None, int]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        if self._workers:
            return
        for i in range(self.threads):
            worker = threading.Thread(target=self._serve, name=f"tierstore-{self.name}-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def shutdown(self, wait: bool = True) -> list[threading.Thread]:
        """Stop the threads once the queued jobs are done (``wait``: and wait for them to end;
        without, this may run on one of them, from a finalizer say); return them."""
        for _ in self._workers:
            self._queue.put((1 << 30, next(self._seq), _STOP, 0))
        if wait:
            for worker in self._workers:
                worker.join()
        stopped, self._workers = list(self._workers), []
        return stopped

    @property
    def running(self) -> bool:
        return bool(self._workers)

    def waiting(self, priority: int) -> bool:
        """Whether a job of ``priority`` or a more urgent one waits for a thread (approximate:
        the threads take them as this is read)."""
        return any(job[0] <= priority for job in list(self._queue.queue))  # (list(): one call, a copy under the GIL)

    async def run(self, fn: Callable[[], T], priority: Priority = Priority.DEMAND) -> T:
        """Run ``fn`` on a worker thread and return its result."""
        (result,) = await self.run_all([fn], priority)
        return result

    async def run_all(
        self,
        fns: Sequence[Callable[[], T]],
        priority: Priority = Priority.DEMAND,
        limit: int | None = None,
        then: Callable[[], Any] | None = None,
        finish: Callable[[list[T]], Any] | None = None,
    ) -> list[T]:
        """Run every function concurrently on the pool; return their results in order.

        ``limit``: at most this many of them queued or running at once (default: all; the
        pool's threads bound it anyway). ``then``: run on a worker thread once every function
        has returned without error, before the results come back (e.g. an fdatasync after the
        writes: no extra trip through the event loop). ``finish``: run on that thread after
        ``then``, given the results (e.g. the catalog commit of what was written); an exception
        it raises is raised here.

        If any raises, the first exception (in the order of ``fns``) is raised after all have
        finished. If the caller is cancelled, jobs not yet started are skipped, ``then`` is not
        run, and running jobs are waited for first.
        """
        if not self._workers:
            raise RuntimeError(f"worker pool {self.name!r} is not running")
        if not fns:
            if then is not None or finish is not None:
                await self.run(lambda: _then_finish(then, finish), priority)
            return []
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        batch = _Batch(self, fns, int(priority), limit or len(fns), then, asyncio.get_running_loop(), finish)
        batch.submit_first()
        try:
            # (not shielded: one turn of the loop less; a cancellation cancels this future,
            # and the jobs still running report to a new one)
            return await batch.future
        except asyncio.CancelledError:
            with batch._lock:
                batch.skip = True
                rest = None if batch.delivered else batch.loop.create_future()
                if rest is not None:
                    batch.future = rest
            if rest is not None:
                await wait_uncancelled(rest)
            raise

    def _put(self, batch: _Batch, index: int) -> None:
        self._queue.put((batch.priority, next(self._seq), batch, index))

    def _serve(self) -> None:
        if self.serial_ops:
            run_ops_serially()
        while True:
            _, _, batch, index = self._queue.get()
            if batch is None:
                return
            batch.run(index)
            batch = None  # (see _Batch._finish)


def _then_finish(then: Callable[[], Any] | None, finish: Callable[[list[Any]], Any] | None) -> None:
    if then is not None:
        then()
    if finish is not None:
        finish([])


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(_settle_future, future, result, exc)


class CallerPool:
    """Jobs run by a thread that is waiting anyway: the training thread blocked in
    ``optimizer.step()`` drains them with ``drain_until``.

    Torch kernels on a fresh thread start a second OpenMP team that fights the training
    thread's own (still spinning) team for the cores; running the optimizer's math on the
    training thread avoids that and is as fast as ``torch.optim`` itself.
    """

    def __init__(self) -> None:
        #: Jobs; a None once ``drain_until``'s future is done; ``_INTERRUPTED`` for Ctrl-C.
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | _Interrupted | None] = (
            queue.SimpleQueue()
        )

    async def run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, loop, future))
        await wait_uncancelled(future)  # a job handed out is always waited for
        return future.result()

    def interrupt(self) -> None:
        """Tell ``drain_until`` that Ctrl-C was pressed (``SimpleQueue.put`` is reentrant: a
        signal handler may call this)."""
        self._jobs.put(_INTERRUPTED)

    def take_interrupts(self) -> bool:
        """Once ``drain_until`` returned: empty the queue (only its markers can be left, an
        interrupt's among them when Ctrl-C came after the last job) and say whether Ctrl-C was
        pressed, so that it neither is lost nor cancels the next ``drain_until``'s work."""
        pressed = False
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return pressed
            pressed = pressed or isinstance(item, _Interrupted)

    def drain_until(self, done: Any, interrupt: Callable[[], object] | None = None) -> None:
        """Run jobs on this thread until ``done`` (a concurrent.futures.Future) completes.

        Ctrl-C (``interrupt()`` from a SIGINT handler, or a KeyboardInterrupt raised by a job)
        is not handed to the coroutine (raised on the loop it would end the loop thread, and this
        thread would wait for it forever): ``interrupt()`` is called once (to cancel what
        ``done`` waits for), jobs are run on until ``done`` completes, and then
        KeyboardInterrupt is raised here."""
        done.add_done_callback(lambda _: self._jobs.put(None))
        interrupted = False
        while True:
            item = self._jobs.get()
            if item is None:
                if done.done():
                    break
                continue
            if isinstance(item, _Interrupted):
                if not interrupted and interrupt is not None:
                    interrupt()
                interrupted = True
                continue
            fn, loop, future = item
            try:
                result = fn()
            except KeyboardInterrupt:  # the job stopped: its awaiter is cancelled, nothing runs on
                loop.call_soon_threadsafe(future.cancel)
                self._jobs.put(_INTERRUPTED)
            except BaseException as exc:  # delivered to the awaiting coroutine
                loop.call_soon_threadsafe(_settle_future, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle_future, future, result, None)
            item = fn = result = None  # type: ignore[assignment]  # (see WorkerPool._serve)
        if interrupted:
            raise KeyboardInterrupt



class _Interrupted:
    """The marker ``CallerPool.interrupt`` queues (Ctrl-C)."""


_INTERRUPTED = _Interrupted()


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
