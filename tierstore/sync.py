"""A blocking facade over ``TierStore`` for plain scripts and PyTorch autograd hooks.

The asynchronous store is the real one. ``SyncTierStore`` runs it on one named event-loop thread
(shared by every sync store in the process) and submits coroutines with
``asyncio.run_coroutine_threadsafe``, the pattern zarr uses for its sync API. Calling it from
the loop thread itself would deadlock, so that raises; after ``fork`` (DataLoader workers) the
child starts a fresh loop thread and cannot use stores opened by the parent.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Coroutine, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from .prefetching import PrefetchHandle, PrefetchResult
from .store import TierRef, TierStore
from .tiers.base import Tier

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def _reset_after_fork() -> None:
    global _loop, _thread, _lock
    _loop, _thread, _lock = None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def loop_thread() -> asyncio.AbstractEventLoop:
    """The process's tierstore event loop, started on first use in a daemon thread."""
    global _loop, _thread
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="tierstore-loop", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the tierstore loop and wait for its result (not from the loop itself)."""
    loop = loop_thread()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("a blocking tierstore call was made from the tierstore loop thread; await the async API there")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


class SyncPrefetch:
    """A prefetch started from blocking code: ``wait()`` or ``cancel()``."""

    def __init__(self, handle: PrefetchHandle) -> None:
        self._handle = handle

    def wait(self, timeout: float | None = None) -> PrefetchResult:
        return run(self._handle.wait(), timeout)

    def cancel(self) -> None:
        loop_thread().call_soon_threadsafe(self._handle.cancel)

    def done(self) -> bool:
        return self._handle.done()


class SyncTierStore:
    """The verbs of ``TierStore`` as blocking calls. Safe to use from any thread.

    ``SyncTierStore(tiers, **options)`` takes the same arguments as ``TierStore``; or wrap an
    unopened store with ``SyncTierStore.wrap(store)``. Use it as ``with SyncTierStore(...) as s:``.
    """

    def __init__(self, tiers: Iterable[Tier] | None = None, *, store: TierStore | None = None, **options: Any) -> None:
        if (tiers is None) == (store is None):
            raise TypeError("pass either tiers (and TierStore options) or store=")
        self.store = store if store is not None else TierStore(list(tiers or ()), **options)

    @classmethod
    def wrap(cls, store: TierStore) -> SyncTierStore:
        return cls(store=store)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run any coroutine on the store's loop (e.g. a batch of async calls at once)."""
        return run(coro, timeout)

    def open(self) -> SyncTierStore:
        run(self.store.open())
        return self

    def close(self, flush: bool | None = None) -> None:
        run(self.store.aclose(flush))

    def __enter__(self) -> SyncTierStore:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def put(self, key: str, tensor: torch.Tensor, tier: TierRef = None) -> None:
        run(self.store.put(key, tensor, tier))

    def get(self, key: str, tier: TierRef = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return run(self.store.get(key, tier, out=out))

    def delete(self, key: str) -> None:
        run(self.store.delete(key))

    def prefetch(self, keys: Iterable[str], tier: TierRef = None) -> SyncPrefetch:
        return SyncPrefetch(run(self.store.prefetch(list(keys), tier)))

    def flush(self) -> None:
        run(self.store.flush())

    @contextmanager
    def hold(self, key: str, tier: TierRef = None, write: bool = False) -> Iterator[torch.Tensor]:
        manager = self.store.hold(key, tier, write)
        tensor = run(manager.__aenter__())
        try:
            yield tensor
        except BaseException:
            run(manager.__aexit__(*sys.exc_info()))
            raise
        run(manager.__aexit__(None, None, None))

    def mark_step(self) -> None:
        run(_call(self.store.mark_step))

    def stats(self) -> dict[str, Any]:
        return run(_call(self.store.stats))

    def keys(self) -> list[str]:
        return run(_call(self.store.keys))

    def info(self, key: str) -> dict[str, Any]:
        return run(_call(self.store.info, key))

    def __contains__(self, key: object) -> bool:
        return run(_call(self.store.__contains__, key))

    def __len__(self) -> int:
        return run(_call(self.store.__len__))


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)
