"""Running store calls on the store's event loop from zarr's (or anyone's) loop.

Every verb of a ``TierStore`` must run on the loop the store was opened on. zarr runs its
coroutines on its own loop thread (``zarr.core.sync``) or on the caller's loop (its async API).
``on_store_loop`` awaits a coroutine on the store's loop without blocking either loop: on the
same loop it is awaited in place; from another loop it is submitted with
``run_coroutine_threadsafe`` and awaited as a future.

One arrangement cannot work: zarr's *blocking* API called from code running on the store's
own loop (an async program that opened the store on its loop and then calls ``array[:]``).
That thread waits for zarr's loop, which waits for the store's loop: a deadlock. It is detected
(the store's loop thread is found waiting inside one ``zarr.core.sync.sync`` call for
``DEADLOCK_CONFIRM_S`` while the call stalls)
and raised as ``LoopDeadlockError`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, TypeVar

import zarr.core.sync

from tierstore.errors import LoopDeadlockError, StoreClosedError
from tierstore.store import TierStore

__all__ = ["DEADLOCK_CONFIRM_S", "LoopDeadlockError", "STALL_CHECK_S", "block_on_store_loop", "on_store_loop"]

T = TypeVar("T")

#: How long a submitted call may wait before the store's loop thread is checked for the deadlock.
STALL_CHECK_S = 0.2
#: How long the store's loop thread must stay in one blocking zarr call for a stalled call to raise.
DEADLOCK_CONFIRM_S = 1.0


def store_loop(store: TierStore) -> asyncio.AbstractEventLoop:
    """The loop ``store`` runs on; ``StoreClosedError`` when it is not open."""
    loop = store.loop
    if loop is None:
        raise StoreClosedError("the TierStore under this zarr store is not open; open it first")
    return loop


def _zarr_loop() -> asyncio.AbstractEventLoop | None:
    """The loop zarr's blocking API runs its coroutines on (None until it made one)."""
    import zarr.core.sync

    return zarr.core.sync.loop[0]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _zarr_wait_of(loop: asyncio.AbstractEventLoop) -> FrameType | None:
    """The frame of zarr's blocking ``sync()`` that the thread running ``loop`` is inside, if any."""
    ident = getattr(loop, "_thread_id", None)  # CPython's BaseEventLoop records its thread
    if ident is None:
        return None
    frame = sys._current_frames().get(ident)
    target = zarr.core.sync.sync.__code__
    while frame is not None:
        if frame.f_code is target:
            return frame
        frame = frame.f_back
    return None


def _submit(loop: asyncio.AbstractEventLoop, factory: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
    """``factory()`` submitted to ``loop``; ``StoreClosedError`` (nothing submitted) if the loop
    is not running, or closed as it was asked."""
    if loop.is_running():
        coroutine = factory()
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, loop)
        except RuntimeError:  # (closed between the check and the call)
            coroutine.close()
    raise StoreClosedError("the TierStore's event loop is not running (its thread is idle or gone): nothing was done; "
                           "a blocking call would wait for ever (run the loop, or use a SyncTierStore)")


def _stopped_meanwhile() -> StoreClosedError:
    return StoreClosedError("the TierStore's event loop stopped while a call waited for it: whether the call took "
                            "effect is unknown (it may have finished as the loop stopped)")


def _deadlock() -> LoopDeadlockError:
    return LoopDeadlockError(
        "zarr's blocking API was called from the thread that runs the TierStore's event loop; that "
        "thread waits for zarr, and zarr waits for the store. Use zarr's async API there "
        "(zarr.api.asynchronous, await array.getitem(...)) or a SyncTierStore"
    )


async def on_store_loop(store: TierStore, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Await ``factory()`` on ``store``'s loop, from whatever loop the caller runs on."""
    loop = store_loop(store)
    running = _running_loop()
    if running is loop or (running is not None and loop.is_closed() and running is not _zarr_loop()):
        # (on the store's loop; or its loop was closed, a second asyncio.run: the store runs on
        # the caller's from now on; not on zarr's own loop, which would keep it for good)
        return await factory()
    future = _submit(loop, factory)
    waiter = asyncio.wrap_future(future)
    # The loop thread inside sync() may be waiting for something else (a slow read of another
    # zarr store): only the same sync() call outlasting DEADLOCK_CONFIRM_S is taken as a deadlock.
    seen: FrameType | None = None
    since = 0.0
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=STALL_CHECK_S)
            if done:
                return waiter.result()
            if not loop.is_running():  # (it stopped meanwhile: nothing may ever finish the call)
                raise _stopped_meanwhile()
            wait = _zarr_wait_of(loop)
            if wait is None or wait is not seen:
                seen, since = wait, time.monotonic()
            elif time.monotonic() - since >= DEADLOCK_CONFIRM_S:
                future.cancel()
                raise _deadlock()
    except asyncio.CancelledError:
        future.cancel()  # the store's task is cancelled too; the store settles it
        raise


def block_on_store_loop(store: TierStore, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` on ``store``'s loop and wait for it (a blocking call; not on that loop)."""
    loop = store_loop(store)
    if getattr(loop, "_thread_id", None) == threading.get_ident() or _running_loop() is loop:
        raise LoopDeadlockError("a blocking call from the TierStore's own loop thread would wait for itself; await the async API")
    future = _submit(loop, factory)
    try:
        while True:
            try:
                return future.result(timeout=STALL_CHECK_S)
            except concurrent.futures.TimeoutError:
                if not loop.is_running():  # (it stopped meanwhile: nothing may ever finish the call)
                    raise _stopped_meanwhile() from None
    except concurrent.futures.CancelledError:
        raise asyncio.CancelledError() from None
