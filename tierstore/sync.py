"""A blocking facade over ``TierStore`` for plain scripts and PyTorch autograd hooks.

The asynchronous store is the real one. ``SyncTierStore`` runs it on one named event-loop thread
(shared by every sync store in the process) and submits coroutines to it, the pattern zarr uses
for its sync API. Calling it from the loop thread itself would deadlock, so that raises; after
``fork`` (DataLoader workers) the child starts a fresh loop thread and cannot use stores opened
by the parent.

The facade cannot drift from the async class: every public verb of ``TierStore`` that has no
method written here is generated when this module is imported (same signature and docstring,
run on the loop thread), and the docstrings of the methods written here are the async ones.
``RENAMED`` lists the async names whose blocking counterpart has another name.

A sync store still open when the interpreter exits is flushed and closed then (see
``close_open_stores``): an acknowledged put is not lost because a script forgot ``close()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401  (imported before we register: see _register_exit_hook)
import contextlib
import functools
import inspect
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from . import holds
from .device.caller import marking_caller
from .errors import LoopDeadlockError, StoreClosedError
from .flags import require_flag
from .intra_op import run_ops_serially
from .namespaces import Namespace
from .prefetching import PrefetchHandle, PrefetchResult
from .store import TierRef, TierStore
from .tiers.base import Tier
from .warn import context_of_call

__all__ = [
    "EXTRAS",
    "FACADES",
    "RENAMED",
    "SyncNamespace",
    "SyncPrefetch",
    "SyncTierStore",
    "call_now",
    "close_at_exit",
    "close_open_stores",
    "loop_thread",
    "public_verbs",
    "run",
]

T = TypeVar("T")

#: Async names of ``TierStore`` whose blocking counterpart on ``SyncTierStore`` is named otherwise.
RENAMED: dict[str, str] = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
#: Facade members that mirror nothing: ``wrap`` builds a facade, ``run`` runs any coroutine.
EXTRAS = frozenset({"wrap", "run"})
#: Dunder methods that are verbs of the store (``key in store``, ``len(store)``).
_DUNDER_VERBS = ("__contains__", "__len__", "__aenter__", "__aexit__")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
# Strong references on purpose: an open store holds files and a folder lock that only close()
# releases, and a store dropped without close() must still have its puts flushed at exit.
_open_stores: dict[int, SyncTierStore] = {}
# Closed at exit before the stores (weakly held: one collected needs no closing).
_exit_closers: weakref.WeakSet[Any] = weakref.WeakSet()
_exit_hook_registered = False


def _reset_after_fork() -> None:
    global _loop, _thread, _lock, _open_stores, _exit_closers, _unfinished_lock
    _loop, _thread, _lock = None, None, threading.Lock()
    _exit_closers = weakref.WeakSet()
    _unfinished.clear()  # (the parent's releases: this process's loop never runs them)
    _unfinished_lock = threading.Lock()
    _open_stores = {}  # the parent's stores are not usable here; closing them is the parent's job


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    run_ops_serially()
    loop.run_forever()


def is_loop_thread_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether ``loop`` is the process's tierstore loop (``loop_thread``), without starting it."""
    return loop is not None and loop is _loop


def loop_thread() -> asyncio.AbstractEventLoop:
    """The process's tierstore event loop, started on first use in a daemon thread."""
    global _loop, _thread
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            # (``asyncio.to_thread`` runs here: its threads too leave the cores to torch)
            loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(thread_name_prefix="tierstore-default",
                                                                            initializer=run_ops_serially))
            thread = threading.Thread(target=_serve_loop, args=(loop,), name="tierstore-loop", daemon=True)
            thread.start()
            _loop, _thread = loop, thread
        return _loop


def open_unless_closed(store: TierStore, what: str) -> bool:
    """Open ``store`` (a ``TierStore`` a user handed over) if it was never opened; return
    whether it opened it here. One the user closed stays closed: ``StoreClosedError`` naming
    ``what`` ("the store given as store=")."""
    if store.closed:
        raise StoreClosedError(f"{what} was closed: open it again (or make a new one) first")
    if store.is_open:
        return False
    run(store.open())
    return True


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the tierstore loop and wait for its result (not from the loop itself).

    Parameters
    ----------
    coro:
        The coroutine to run.
    timeout:
        Seconds to wait, or None to wait as long as it takes.

    Raises
    ------
    TimeoutError
        ``timeout`` passed. The coroutine was cancelled and has finished cancelling before
        this is raised, so it no longer uses anything the caller passed in (a put no longer
        reads the caller's tensor). If it completed regardless, its result is returned instead.
    KeyboardInterrupt
        Likewise re-raised once the cancelled coroutine has finished.
    LoopDeadlockError
        Called from the tierstore loop thread (it would wait for itself forever; a
        ``RuntimeError`` too).
    """
    loop = loop_thread()
    if threading.current_thread() is _thread:
        coro.close()
        raise _blocking_on_loop_thread()
    if sys.is_finalizing():  # (the loop's daemon thread runs no more: waiting for it would hang)
        coro.close()
        raise RuntimeError("a blocking tierstore call was made while the interpreter shuts down")
    finished = threading.Event()
    started: concurrent.futures.Future[asyncio.Task[T]] = concurrent.futures.Future()

    # The task runs in a copy of the caller's context, as code awaited in place would: context
    # variables set by the caller (e.g. the holds it is inside of) are seen on the loop; and the
    # caller's line, to which warnings emitted for it on the loop are attributed.
    context = context_of_call(sys._getframe(1))

    def start() -> None:
        task = context.run(loop.create_task, coro)
        task.add_done_callback(lambda _: finished.set())
        started.set_result(task)

    loop.call_soon_threadsafe(start)
    try:
        # (inside: a Ctrl-C before the loop got to ``start`` must cancel the call too, or it
        # would start after the caller has moved on, and a hold it takes be held for ever)
        task = started.result()
        completed = finished.wait(timeout)
    except KeyboardInterrupt:
        _cancel_and_wait(loop, started, finished)
        raise
    if not completed:
        _cancel_and_wait(loop, started, finished)
        if task.cancelled():
            raise TimeoutError(f"the tierstore call did not finish within {timeout} s and was cancelled")
    return task.result()  # the task is done: reading its outcome from this thread is safe


def _blocking_on_loop_thread() -> LoopDeadlockError:
    return LoopDeadlockError("a blocking tierstore call was made from the tierstore loop thread (it would wait for itself "
                             "for ever); await the async API there")


def call_now(function: Callable[..., T], *args: Any) -> T:
    """Call ``function(*args)``, a plain function that must not block, on the tierstore loop
    thread in a copy of the caller's context, and return its result (or raise its error): one
    hand-over each way and no task, for the parts of verbs that need no await. Not from the
    loop thread itself (``LoopDeadlockError``)."""
    loop = loop_thread()
    if threading.current_thread() is _thread:
        raise _blocking_on_loop_thread()
    if sys.is_finalizing():  # (as run(): the loop's daemon thread runs no more)
        raise RuntimeError("a blocking tierstore call was made while the interpreter shuts down")
    context = context_of_call(sys._getframe(1))
    finished = threading.Lock()
    finished.acquire()
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(context.run(function, *args))
        except BaseException as exc:  # (handed to the caller's thread)
            outcome.append(_Raised(exc))
        finally:
            finished.release()

    loop.call_soon_threadsafe(call)
    interrupted = False
    while True:  # the call may still be reading the caller's memory: wait for it regardless
        try:
            finished.acquire()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    result = outcome[0]
    if isinstance(result, _Raised):
        raise result.error
    return result


class _Raised:
    """The error a call on the loop thread raised, handed to the caller's thread."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _cancel_and_wait(
    loop: asyncio.AbstractEventLoop, started: concurrent.futures.Future[asyncio.Task[Any]], finished: threading.Event
) -> None:
    """Cancel the task ``started`` gives and wait until it has finished (it may defer the
    cancellation until it no longer uses the caller's memory). The task may not be made yet:
    the loop runs callbacks in order, so the one that makes it runs before this one."""
    loop.call_soon_threadsafe(lambda: started.result().cancel())
    finished.wait()


def _register_exit_hook() -> None:
    """Have ``close_open_stores`` run when the interpreter exits, while it still can.

    ``atexit`` handlers run too late: by then ``concurrent.futures`` has shut its thread pools
    (the catalog's writer, ``asyncio.to_thread``) and refuses new work. ``threading`` runs its own
    exit hooks earlier, in reverse order of registration, so registering after
    ``concurrent.futures.thread`` (imported above) puts ours first. The loop thread is a daemon
    and runs until the interpreter is finalized, after both.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython: the plain atexit hook is the best available
        import atexit

        atexit.register(close_open_stores)
    else:
        register(_close_at_exit)
    _exit_hook_registered = True


def _close_at_exit() -> None:
    """The interpreter is exiting: first wait, as it is about to, for the program's other
    non-daemon threads (they may still be using a store), then close the stores."""
    import concurrent.futures.thread as pool_threads

    for thread in threading.enumerate():
        # (the pools' own idle workers end only after this hook, when their pools shut down)
        if thread is threading.current_thread() or thread.daemon or getattr(thread, "_target", None) is pool_threads._worker:
            continue
        thread.join()
    close_open_stores()


def close_at_exit(closable: Any) -> None:
    """Have ``closable.close()`` called at interpreter exit, before the sync stores close, if it
    is still alive then (it is held weakly). For owners of a store that the exit hook does not
    see, e.g. an optimizer's own ``TierStore``: its prefetches and write-backs run on daemon
    threads, and a daemon thread still freeing tensors when the interpreter finalizes is ended
    inside a C++ destructor, which aborts the process ("terminate called without an active
    exception")."""
    _register_exit_hook()
    _exit_closers.add(closable)


#: Work a finalizer started and did not wait for (``finish_at_exit``): futures to wait for and
#: threads to join before the stores close at exit.
_unfinished: list[tuple[concurrent.futures.Future[Any], list[threading.Thread]]] = []
_unfinished_lock = threading.Lock()


def finish_at_exit(future: concurrent.futures.Future[Any], threads: Sequence[threading.Thread] = ()) -> None:
    """Have ``close_open_stores`` wait for ``future`` and join ``threads`` (stopping) at exit: a
    finalizer's release, which must not wait where it runs, still ends before the interpreter
    does (a daemon thread still working then aborts the process). ``wait_unfinished`` waits for
    them earlier."""
    _register_exit_hook()
    with _unfinished_lock:
        _drop_finished()
        _unfinished.append((future, list(threads)))


def wait_unfinished(timeout: float = 60.0) -> None:
    """Wait for what ``finish_at_exit`` was given (each up to ``timeout`` seconds; errors are
    the finalizer's, not the caller's)."""
    with _unfinished_lock:  # (finalizers append from any thread; another caller may wait too)
        waiting = list(_unfinished)
    for future, threads in waiting:
        with contextlib.suppress(BaseException):  # (a release that failed leaves nothing to wait for)
            future.result(timeout)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
    with _unfinished_lock:
        _drop_finished()


def _drop_finished() -> None:
    """Forget what ``finish_at_exit`` was given that has ended (under ``_unfinished_lock``)."""
    _unfinished[:] = [(future, threads) for future, threads in _unfinished
                      if not future.done() or any(thread.is_alive() for thread in threads)]


def close_open_stores() -> None:
    """Close what ``close_at_exit`` registered, then flush and close every ``SyncTierStore``
    still open (run at interpreter exit).

    Each is closed even if another fails; a failure is printed to stderr with its traceback, as
    Python reports any error at exit.
    """
    wait_unfinished()
    for closable in list(_exit_closers):
        try:
            closable.close()
        except Exception:
            print(f"tierstore: closing {closable!r} at exit failed:", file=sys.stderr)
            traceback.print_exc()
    for store in list(_open_stores.values()):
        try:
            store._close_at_exit()
        except Exception:
            print(f"tierstore: closing {store.store!r} at exit failed:", file=sys.stderr)
            traceback.print_exc()


class SyncPrefetch:
    """A prefetch started from blocking code: ``wait()`` or ``cancel()``."""

    def __init__(self, handle: PrefetchHandle) -> None:
        self._handle = handle

    def wait(self, timeout: float | None = None) -> PrefetchResult:
        """Wait for the prefetch and return what it did (the prefetch goes on after a timeout)."""
        return run(self._handle.wait(), timeout)

    def cancel(self) -> None:
        """Stop what has not started (what already arrived stays)."""
        loop_thread().call_soon_threadsafe(self._handle.cancel)

    def done(self) -> bool:
        """Whether the prefetch has finished."""
        return self._handle.done()


class SyncNamespace:
    """A claimed key namespace, from ``SyncTierStore.claim`` or ``claim_unique``: the blocking
    form of ``tierstore.namespaces.Namespace``; ``with`` releases the claim."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace

    @property
    def name(self) -> str:
        """The namespace, a key prefix ending in ``"/"``."""
        return self.namespace.name

    @property
    def owner(self) -> str:
        """Who claimed it."""
        return self.namespace.owner

    @property
    def auto(self) -> bool:
        """Whether ``claim_unique`` chose the name."""
        return self.namespace.auto

    def __enter__(self) -> SyncNamespace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        run(self.namespace.__aexit__(*exc_info))

    def __repr__(self) -> str:
        return f"SyncNamespace({self.namespace!r})"


class SyncTierStore:
    """The verbs of ``TierStore`` as blocking calls. Safe to use from any thread.

    ``SyncTierStore(tiers, **options)`` takes the same arguments as ``TierStore``; or wrap an
    unopened store with ``SyncTierStore.wrap(store)``. Use it as ``with SyncTierStore(...) as s:``
    or call ``open()`` and ``close()``; one still open at interpreter exit is flushed and closed
    then. Each verb's docstring is the async verb's.
    """

    def __init__(self, tiers: Iterable[Tier] | None = None, *, store: TierStore | None = None, **options: Any) -> None:
        if (tiers is None) == (store is None):
            raise TypeError("pass either tiers (and TierStore options) or store=")
        self.store = store if store is not None else TierStore(list(tiers or ()), **options)

    @classmethod
    def wrap(cls, store: TierStore) -> SyncTierStore:
        """A blocking facade over ``store`` (not yet open)."""
        return cls(store=store)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run any coroutine on the store's loop (e.g. a batch of async calls at once)."""
        return run(coro, timeout)

    # -- lifecycle ----------------------------------------------------------------------------

    def open(self) -> SyncTierStore:
        run(self.store.open())
        _register_exit_hook()
        _open_stores[id(self)] = self
        return self

    def close(self, flush: bool | None = None) -> None:
        try:
            run(self.store.aclose(flush))
        finally:
            _open_stores.pop(id(self), None)

    def _close_at_exit(self) -> None:
        """``close`` at interpreter exit (``TierStore._aclose_at_exit``: this thread's own write
        holds left open end first)."""
        try:
            run(self.store._aclose_at_exit())
        finally:
            _open_stores.pop(id(self), None)

    def __enter__(self) -> SyncTierStore:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- verbs whose blocking form differs ----------------------------------------------------

    @contextmanager
    def hold(self, key: str, tier: TierRef = None, write: bool = False) -> Iterator[torch.Tensor]:
        # This thread is the holder: calls it makes inside the hold carry the mark to the loop,
        # so a read of the key raises there instead of waiting for this very hold.
        token = holds.new_token()
        manager = self.store._hold(key, tier, require_flag("write", write), token, mark=False)
        tensor = run(manager.__aenter__())
        holds.enter(token)
        device = tensor.device
        try:
            yield tensor
        except BaseException:
            holds.leave(token)
            if not self.store.is_open:  # (ended by the close at exit: collected at shutdown)
                raise
            with marking_caller(device):  # the buffer's last use: this thread's queued kernels
                if not run(manager.__aexit__(*sys.exc_info())):
                    raise
        else:
            holds.leave(token)
            with marking_caller(device):
                run(manager.__aexit__(None, None, None))

    @contextmanager
    def fill(
        self, key: str, shape: Sequence[int], dtype: torch.dtype, tier: TierRef = None, *, durable: bool | None = None
    ) -> Iterator[torch.Tensor]:
        """``TierStore.fill``: a buffer this thread writes, ``key``'s value when the block ends."""
        manager = self.store.fill(key, shape, dtype, tier, durable=durable)
        tensor = run(manager.__aenter__())
        try:
            yield tensor
        except BaseException:
            with marking_caller(tensor.device):
                if not run(manager.__aexit__(*sys.exc_info())):
                    raise
        else:
            with marking_caller(tensor.device):
                run(manager.__aexit__(None, None, None))

    def prefetch(self, keys: Iterable[str], tier: TierRef = None) -> SyncPrefetch:
        # (one str is refused by the store, as a key, not read as its characters)
        return SyncPrefetch(run(self.store.prefetch(keys if isinstance(keys, (str, bytes)) else list(keys), tier)))

    # -- the rest forward as they are (written out for type checkers and readers) -------------

    def put(self, key: str, tensor: torch.Tensor, tier: TierRef = None, *, durable: bool | None = None) -> None:
        if (
            isinstance(tensor, torch.Tensor)
            and tensor.device.type == "cpu"
            and (durable is False or (durable is None and not self.store.durable))  # (anything else: put() checks it)
            and call_now(self.store._put_small_now, key, tensor, tier, durable) is not None
        ):
            return  # a small write-back put, done on the loop thread with no task (one hand-over)
        with marking_caller(tensor.device if isinstance(tensor, torch.Tensor) else None):  # copy after this thread's kernels
            run(self.store.put(key, tensor, tier, durable=durable))

    def get(self, key: str, tier: TierRef = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            # A small value (inline in the disk tier's catalog, or in CPU memory) is read on the
            # loop thread with no task: one hand-over each way. (Only the loop touches the
            # store's state, the catalog's memory map included: see DESIGN.md.)
            value = call_now(self.store._get_small_now, key, tier, None)
            if value is not None:
                return value
        return run(self.store.get(key, tier, out=out))

    def read(self, key: str) -> torch.Tensor:
        return run(self.store.read(key))

    def pop(self, key: str, tier: TierRef = None) -> torch.Tensor:
        return run(self.store.pop(key, tier))

    def delete(self, key: str) -> None:
        run(self.store.delete(key))

    def flush(self) -> None:
        run(self.store.flush())

    def export_zarr(self, path: str | Path, overwrite: bool = False) -> int:
        return run(self.store.export_zarr(path, overwrite))

    def import_zarr(self, path: str | Path, tier: TierRef = None) -> int:
        return run(self.store.import_zarr(path, tier))

    def mark_step(self) -> None:
        _on_loop(self.store.mark_step)

    def expect(self, used: Iterable[str], unused: Iterable[str] = ()) -> None:
        _on_loop(self.store.expect, *(keys if isinstance(keys, (str, bytes)) else list(keys) for keys in (used, unused)))

    def stats(self) -> dict[str, Any]:
        return _on_loop(self.store.stats)

    def keys(self) -> list[str]:
        return _on_loop(self.store.keys)

    def info(self, key: str) -> dict[str, Any]:
        return _on_loop(self.store.info, key)

    def where(self, key: str) -> list[str]:
        return _on_loop(self.store.where, key)

    def __contains__(self, key: object) -> bool:
        return _on_loop(self.store.__contains__, key)

    def __len__(self) -> int:
        return _on_loop(self.store.__len__)

    def claim(self, name: str, *, owner: str = "user", overwrite: bool = False, adopt: bool = False) -> SyncNamespace:
        return SyncNamespace(run(self.store.claim(name, owner=owner, overwrite=overwrite, adopt=adopt)))

    def claim_unique(self, base: str, *, owner: str = "user") -> SyncNamespace:
        return SyncNamespace(run(self.store.claim_unique(base, owner=owner)))

    def __repr__(self) -> str:
        return f"SyncTierStore({self.store!r})"


def _on_loop(fn: Callable[..., T], *args: Any) -> T:
    """Call a synchronous method of the store on the loop thread, which owns the store's state."""

    async def call() -> T:
        return fn(*args)

    return run(call())


def public_verbs(cls: type) -> dict[str, Any]:
    """The public verbs of ``cls``: names not starting with ``_`` and the dunder verbs (``in``,
    ``len``, ``async with``), each mapped to its class attribute."""
    verbs = {}
    for name in dir(cls):
        if (not name.startswith("_") or name in _DUNDER_VERBS) and name in _defined(cls):
            verbs[name] = inspect.getattr_static(cls, name)
    return verbs


def _defined(cls: type) -> set[str]:
    """Names defined by ``cls`` or a base other than ``object``."""
    return {name for klass in cls.__mro__ if klass is not object for name in vars(klass)}


def _forwarder(attr: str, name: str, member: Any, owner: str) -> Any:
    """A blocking member that runs ``<wrapped>.<name>`` on the loop (the wrapped object is the
    facade's attribute ``attr``), with the async member's signature and docstring."""
    if isinstance(member, property):
        return property(lambda self: _on_loop(getattr, getattr(self, attr), name), doc=member.__doc__)
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    if inspect.iscoroutinefunction(function):

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return run(getattr(getattr(self, attr), name)(*args, **kwargs))

    else:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _on_loop(functools.partial(getattr(getattr(self, attr), name), *args, **kwargs))

    functools.update_wrapper(forward, function)
    forward.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
    forward.__qualname__ = f"{owner}.{name}"
    return forward


def _mirror(sync_cls: type, async_cls: type, attr: str) -> None:
    """Give ``sync_cls`` (a facade over an ``async_cls`` kept in its attribute ``attr``) every
    public verb of ``async_cls`` it lacks, and the async docstrings where its own have none."""
    mine = _defined(sync_cls)
    for name, member in public_verbs(async_cls).items():
        target = RENAMED.get(name, name)
        if target not in mine:
            setattr(sync_cls, target, _forwarder(attr, name, member, sync_cls.__name__))
            continue
        own = inspect.getattr_static(sync_cls, target)
        function = own.fget if isinstance(own, property) else own
        function = function.__func__ if isinstance(function, (staticmethod, classmethod)) else function
        source = member.fget if isinstance(member, property) else member
        source = source.__func__ if isinstance(source, (staticmethod, classmethod)) else source
        if getattr(function, "__doc__", "") is None and getattr(source, "__doc__", None):
            function.__doc__ = source.__doc__


#: Each facade class, the async class it mirrors, and the attribute holding the async object.
FACADES: list[tuple[type, type, str]] = [(SyncTierStore, TierStore, "store"), (SyncNamespace, Namespace, "namespace")]
for _facade, _async_cls, _attr in FACADES:
    _mirror(_facade, _async_cls, _attr)
