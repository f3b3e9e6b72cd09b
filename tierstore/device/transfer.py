"""``Transfer``: one copy in flight on a link, awaited from any thread or from the event loop
without polling."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

_log = logging.getLogger("tierstore.device")


class Transfer:
    """A copy started on a link. It completes on the link's own thread (a CUDA event waiter,
    or the emulated link's copy thread); callers block on ``wait()`` or ``await`` it.

    An ``await`` that is cancelled still waits for the copy to end before it re-raises, so a
    buffer is never reused while a copy reads or writes it.
    """

    __slots__ = ("direction", "nbytes", "queued", "started", "ended", "_done", "_error", "_callbacks", "_lock", "_keep")

    def __init__(self, direction: str, nbytes: int, keep: Any = None) -> None:
        #: ``"to_host"`` or ``"to_device"``.
        self.direction = direction
        self.nbytes = nbytes
        #: ``time.perf_counter()`` when the copy was asked for, started moving, and ended.
        self.queued = time.perf_counter()
        self.started: float | None = None
        self.ended: float | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Transfer], None]] = []
        self._lock = threading.Lock()
        self._keep = keep  # tensors the copy reads or writes stay alive until it ends

    @classmethod
    def completed(cls, direction: str, nbytes: int, started: float | None = None) -> Transfer:
        """A transfer that already happened (a synchronous copy)."""
        transfer = cls(direction, nbytes)
        transfer.started = transfer.queued if started is None else started
        transfer.finish()
        return transfer

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block this thread until the copy ended; raise its error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"a {self.nbytes:,}-byte transfer did not finish in {timeout} s")
        if self._error is not None:
            raise self._error

    def add_done_callback(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(self)`` when the copy ends (at once if it has), on the completing thread.
        A callback that raises is logged (``tierstore.device``); it never stops the link's thread."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        _call(callback, self)

    def finish(self, error: BaseException | None = None) -> None:
        """Mark the copy ended (the link's thread calls this)."""
        with self._lock:
            if self._done.is_set():
                return
            self.ended = time.perf_counter()
            if self.started is None:
                self.started = self.ended
            self._error = error
            self._keep = None
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _call(callback, self)

    async def _settled(self) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def wake(_: Transfer) -> None:
            loop.call_soon_threadsafe(_resolve, future)

        self.add_done_callback(wake)
        cancelled = False
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                cancelled = True  # wait on: the buffers stay in use until the copy ends
        if cancelled:
            raise asyncio.CancelledError
        if self._error is not None:
            raise self._error

    def __await__(self) -> Generator[Any, None, None]:
        return self._settled().__await__()

    @property
    def seconds(self) -> float:
        """How long the copy moved data (0 while in flight)."""
        if self.ended is None or self.started is None:
            return 0.0
        return self.ended - self.started


def _call(callback: Callable[[Transfer], None], transfer: Transfer) -> None:
    # A link's thread finishes every transfer in turn: one callback's error (a listener's, or a
    # wake-up of a loop that closed meanwhile) must not kill it and hang every later copy.
    try:
        callback(transfer)
    except Exception:  # noqa: BLE001 - logged; the transfer and the link go on
        _log.exception("a callback of a %s transfer of %d bytes raised", transfer.direction, transfer.nbytes)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def gather_transfers(transfers: list[Transfer]) -> None:
    """Await several transfers (each one's error, the first raised, after all ended)."""
    errors: list[BaseException] = []
    cancelled = False
    for transfer in transfers:
        try:
            await transfer
        except asyncio.CancelledError:
            cancelled = True  # the rest still end before their buffers may go
        except BaseException as exc:  # noqa: BLE001 - re-raised below once every copy ended
            errors.append(exc)
    if cancelled:
        raise asyncio.CancelledError
    if errors:
        raise errors[0]
