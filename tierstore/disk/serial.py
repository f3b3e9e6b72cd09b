"""One thread that runs jobs in the order they are handed over: the catalog's writer.

``concurrent.futures.ThreadPoolExecutor(max_workers=1)`` does the same, but each ``submit``
also takes and gives back a semaphore that its worker releases as it finishes the job before
(``_adjust_thread_count``): in a put-and-await loop the two threads meet on that lock, which
cost about 40 us of a durable put's ~330 us here (measured: a hop through this class keeps
0.82x of raw LMDB's sync-on commit rate, one through the pool 0.63x). A ``SimpleQueue`` (a C
queue, no Python-level lock) is the only thing the two threads share here.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from ..intra_op import run_ops_serially

T = TypeVar("T")

_STOP = object()


class SerialExecutor(Executor):
    """A single named worker thread running jobs one at a time, first handed over first run.
    Usable with ``loop.run_in_executor`` (a job whose future was cancelled before it started is
    skipped, as with the standard pool); ``run_soon`` hands over a job with no future at all."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._pid = os.getpid()  # (a forked child has no such thread: see ``run_soon``)
        self._lock = threading.Lock()  # (only ``submit`` against ``shutdown``: never per job)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run_soon(self, job: Callable[[], None]) -> None:
        """Run ``job()`` on the thread after the jobs handed over before it. ``job`` reports
        its own outcome: an exception escaping it is lost."""
        if self._closed:
            raise RuntimeError("cannot hand a job over after shutdown")
        if os.getpid() != self._pid:
            raise RuntimeError(f"the thread {self._thread.name!r} is in the parent process: a forked child cannot use it")
        self._jobs.put(job)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        with self._lock:
            self.run_soon(job)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking jobs; the thread runs those handed over already, then ends (waited for
        if ``wait``). ``cancel_futures`` is not supported: every job handed over runs."""
        if os.getpid() != self._pid:  # (a forked child: no thread to stop; the lock may be a copy held)
            self._closed = True
            return
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(_STOP)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _work(self) -> None:
        run_ops_serially()
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is _STOP:
                return
            with contextlib.suppress(BaseException):  # (``run_soon``'s contract: the job reports its own outcome)
                job()
            del job
