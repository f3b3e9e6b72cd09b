"""Activation offloading: tensors saved for backward go to the store and come back in time.

``offload_activations(store)`` returns a reusable context manager built on
``torch.autograd.graph.saved_tensors_hooks``. In forward, each saved tensor of at least
``min_bytes`` (and not a parameter) is put into the store on the loop thread while forward goes
on (at most ``max_in_flight`` bytes being copied at once); the forward pass keeps only a small
handle. In backward, each handle is popped back onto the device, and the ones needed next are
popped ahead of time (within ``ahead`` bytes), in the order backward used them in the previous
step (learned), or in reverse order of saving in the first step. Values come back bit for bit.

Use one object for the whole run, entered once per step, so the order learned carries over::

    offload = offload_activations(store, min_bytes=1 << 20)
    for batch in data:
        with offload:
            loss = model(batch)
        loss.backward()
    offload.close()

Its keys live in a namespace it claims in the store (``namespace=``, default a fresh
``swap/act/<n>/``); ``close()`` drops it with whatever is left in it.

Crossing the device boundary (``crossing.py``): where the device's link lends (the plain CPU),
a saved tensor is ``put`` into the store and ``pop``-ped back as before. Otherwise (CUDA, the
emulated device) forward takes a ``mark()`` of its queued work when the tensor is saved, and
the copy to the host runs over the link after it, straight into the store buffer that becomes
the value (through an aligned staging buffer for the disk tier); the tensor stays alive until
the copy ended. Backward copies the value over the link from the store's host buffer into a
new device tensor, then deletes the key.

Threads: forward and backward run on the training (or autograd) thread, the copies on the
store's loop; what both look at (is a tensor still being copied out, did backward take it
meanwhile, bytes in flight, the report) changes under one lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from ..device import Link
from ..errors import KeyNotFoundError, StoreClosedError, TierFullError, UnknownTierError
from ..flags import require_flag
from ..namespaces import Namespace
from ..store import TierStore
from ..sync import SyncTierStore, loop_thread, open_unless_closed, run
from ..tensors import memory_order
from ..tiers import DeviceTier, MemoryTier
from ..units import format_bytes, parse_bytes
from ..warn import warn
from .crossing import swap_link, to_device, to_store
from .report import SwapReport


@dataclass(eq=False)
class _Saved:
    """What forward keeps instead of a saved tensor."""

    index: int
    key: str
    nbytes: int
    device: torch.device
    tensor: torch.Tensor | None  # kept until its copy into the store is done (under the lock)
    link: Link | None = None  # the device's link (None: no boundary, ``put`` and ``pop``)
    stored: Any = None  # concurrent future of the put
    finalizer: Any = None
    taken: bool = False  # backward took the tensor itself before its copy finished (under the lock)
    fetched: Any = None  # concurrent future of the pop that brings it back
    used: bool = False  # backward has unpacked it (a second unpack, retain_graph, reuses it)
    dropped: bool = False  # the forward that saved it raised: it left the store unused
    owner: Any = None  # the ActivationOffload that packed it
    version: int = 0  # the tensor's version counter when it was saved
    changed: int | None = None  # its version when its copy ended, if an in-place change came first
    #: The order of dimensions in which the tensor lay in memory (a transposed one's), stored so
    #: and given back so: backward's kernels pick their paths (and rounding) by strides.
    order: list[int] | None = None
    #: The tensor (detached, as ``kept``), when its copy into the store failed (a tier without
    #: room, say): backward gets it, as if it had been too small to offload.
    fallback: torch.Tensor | None = None
    ahead: bool = False  # fetched ahead of backward's asking (``_fetch_ahead``)


class ActivationOffload:
    """See the module docstring; make one with ``offload_activations``."""

    def __init__(
        self,
        store: TierStore | SyncTierStore,
        min_bytes: int | str = "1MiB",
        tier: str = "host",
        device_tier: str | None = None,
        max_in_flight: int | str = "256MiB",
        ahead: int | str = "64MiB",
        namespace: str | None = None,
        emulate_device: bool | None = None,
    ) -> None:
        self.store = store.store if isinstance(store, SyncTierStore) else store
        open_unless_closed(self.store, "offload_activations: the store given")  # (as TieredAdamW's store=)
        names = [t.name for t in self.store.tiers]
        for argument, name in (("tier", tier), ("device_tier", device_tier)):
            if name is not None and name not in names:
                raise UnknownTierError(f"offload_activations: {argument}={name!r} is not a tier of the store (its tiers: {names})")
        self.emulate_device = require_flag("emulate_device", emulate_device, none="the device tier's link, else tierstore.device.emulate_device")
        self._links: dict[torch.device, Link] = {}
        for tier_ in self.store.tiers:  # a contradicting emulate_device raises here, not in forward
            if isinstance(tier_, DeviceTier):
                self.link(tier_.device)
        # (the sizes read before the claim: a typo in one leaves no namespace claimed)
        self.min_bytes = parse_bytes(min_bytes)
        self.max_in_flight = parse_bytes(max_in_flight)
        self.ahead = parse_bytes(ahead)
        self.tier = tier
        self.device_tier = device_tier
        self.namespace: Namespace = run(_claim(self.store, namespace, "swap/act/", type(self).__name__))
        self.prefix = self.namespace.name.rstrip("/")
        self.report = SwapReport("activations")
        self._warned_refusal = False  # (once per offloader: a full tier refuses many in a row)
        self._loop = loop_thread()
        self._generation = itertools.count()
        self._step = 0
        self._counter = itertools.count()
        # Held weakly: a handle lives as long as the graph that saved it (autograd frees it once
        # backward used it, or with the graph), and with it what it brought back.
        self._saved: weakref.WeakValueDictionary[int, _Saved] = weakref.WeakValueDictionary()
        self._order: list[int] = []  # this step's unpack order (pack indices)
        self._ahead_bytes = 0  # bytes popped ahead of backward and not yet taken
        self._learned: dict[int, list[int]] = {}  # previous step: index -> the indices after it
        self._in_flight = 0
        self._under_way: set[concurrent.futures.Future[Any]] = set()  # copies into and out of the store
        self._lock = threading.Condition()
        self._hooks: Any = None

    # -- the context ------------------------------------------------------------------------------

    def __enter__(self) -> ActivationOffload:
        if self._hooks is not None:
            raise RuntimeError(
                "this offload_activations object is entered already (a `with` inside its own `with`): "
                "nest two offload_activations objects instead, or use one `with` per forward"
            )
        if not self.store.is_open:  # (else forward ran on, counting saves that never left, and backward raised)
            raise StoreClosedError("offload_activations: its store is closed; make a new one on an open store")
        if not self.namespace.live:  # (it wrote on into the namespace it gave up, which a new one claims: the same keys)
            raise RuntimeError("this offload_activations object was closed (its namespace given up); make a new one")
        if self._order:  # the previous step's backward order becomes what we prefetch along
            order = self._order
            self._learned = {index: order[position + 1 :] for position, index in enumerate(order)}
        self._order = []
        self._saved = weakref.WeakValueDictionary()
        self._ahead_bytes = 0
        self._step = next(self._generation)
        self._counter = itertools.count()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _active.stack = [*getattr(_active, "stack", []), self]
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is not None:  # (a Ctrl-C in a forward under offload_parameters left its hooks above ours)
            from .parameters import pop_abandoned_hooks

            pop_abandoned_hooks((self._pack, self._unpack))
        self._hooks.__exit__(exc_type, *exc_info)
        self._hooks = None
        _active.stack = getattr(_active, "stack", [])[:-1]
        if exc_type is not None:  # the forward failed: drop what it saved now, not when its graph is freed
            for saved in list(self._saved.values()):
                if saved.fetched is None and saved.finalizer.alive:
                    saved.dropped = True
                    saved.finalizer()
            self._saved = weakref.WeakValueDictionary()

    def close(self) -> None:
        """End the claim on the namespace, deleting what is left in it (activations of a step
        whose backward never ran)."""
        if self.namespace.live and self.store.is_open:
            run(self._drop())

    async def _drop(self) -> None:
        with self._lock:
            under_way = list(self._under_way)
        # (a copy into the store would land its key after the drop listed the namespace's keys; one
        # out of it, fetched ahead of a backward that then failed, holds its key)
        await asyncio.gather(*(asyncio.wrap_future(future) for future in under_way), return_exceptions=True)
        await self.namespace.drop()

    # -- forward -------------------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self.store.is_open:  # (closed inside the with: refused now, not at backward, counting nothing)
            raise StoreClosedError("offload_activations: its store closed during this forward")
        if tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized:  # (no raw bytes to store)
            with self._lock:
                self.report.kept += 1
            return kept(tensor)
        if tensor.nbytes < self.min_bytes or _is_parameter(tensor) or tensor.device.type not in ("cpu", "cuda"):
            with self._lock:
                self.report.kept += 1
                if not _is_parameter(tensor):
                    self.report.bytes_kept += tensor.nbytes
            return kept(tensor)
        link = self.link(tensor.device)
        waited = time.perf_counter()
        self._wait_for_room(tensor.nbytes)
        room = time.perf_counter()
        index = next(self._counter)
        order = _stored_order(tensor)
        saved = _Saved(index, f"{self.prefix}/{self._step}/{index}", tensor.nbytes, tensor.device, tensor, owner=self,
                       version=tensor._version, order=order)
        laid = tensor if order is None else tensor.permute(order)  # (contiguous: its bytes as they lie)
        if link.lends:
            saved.stored = asyncio.run_coroutine_threadsafe(self._put(saved, self.store.put(saved.key, laid, tier=self.tier)), self._loop)
        else:
            saved.link = link
            source = laid if laid.is_contiguous() else laid.contiguous()
            marker = link.mark()  # after the kernels that produced it (and made it contiguous)
            stored = to_store(self.store, saved.key, source, self.tier, link, marker)
            saved.stored = asyncio.run_coroutine_threadsafe(self._put(saved, stored), self._loop)
        self._track(saved.stored)
        saved.finalizer = weakref.finalize(saved, _forget, self._loop, self.store, saved.key, saved.stored, self.namespace)
        self._saved[index] = saved
        with self._lock:
            self.report.offloaded += 1
            self.report.add_stall(waited, room)
        return saved

    def link(self, device: torch.device) -> Link:
        """The link ``device``'s tensors cross (see ``crossing.swap_link``)."""
        link = self._links.get(device)
        if link is None:
            link = self._links[device] = swap_link(self.store, device, self.emulate_device)
        return link

    def _track(self, future: concurrent.futures.Future[Any]) -> None:
        """Count ``future`` (a copy into or out of the store) as under way until it is done."""
        with self._lock:
            self._under_way.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._under_way.discard(future)

    def _wait_for_room(self, nbytes: int) -> None:
        """Block forward while more than ``max_in_flight`` bytes are still being copied."""
        with self._lock:
            while self._in_flight and self._in_flight + nbytes > self.max_in_flight:
                self._lock.wait()
            self._in_flight += nbytes

    async def _put(self, saved: _Saved, storing: Any) -> None:
        """On the loop: run ``storing`` (the copy into the store); then forward's tensor may go,
        unless backward took it meanwhile, in which case the stored copy is not needed."""
        started = time.perf_counter()
        stored = False
        refused: Exception | None = None
        try:
            await storing
            stored = True
        except Exception as exc:  # (raised below, for those waiting for the copy)
            refused = exc
        finally:
            with self._lock:
                if saved.tensor is not None and saved.tensor._version != saved.version:
                    saved.changed = saved.tensor._version  # (the copy may hold the change, or part of it)
                if refused is not None and saved.tensor is not None:
                    # (it never left: raised at backward, the step was lost for a value still in
                    # memory; one changed in place meanwhile is torch's error there, ``_unchanged``)
                    saved.fallback = kept(saved.tensor)  # (detached: the tensor itself would keep its graph alive)
                    self.report.offloaded -= 1
                    self.report.kept += 1
                    self.report.bytes_kept += saved.nbytes
                    self.report.refused += 1
                saved.tensor = None
                taken = saved.taken
                self._in_flight -= saved.nbytes
                if stored:
                    self.report.add_moved(saved.nbytes, time.perf_counter() - started, out=True)
                self._lock.notify_all()
        if stored and taken and self.namespace.live and saved.key in self.store:  # backward did not wait for this copy
            with contextlib.suppress(KeyNotFoundError):  # (close() dropped the namespace meanwhile)
                await self.store.delete(saved.key)
        if refused is not None:
            _clear_frames(refused)  # (kept in ``saved.stored``: its frames held the tensor, a cycle through its grad_fn)
            raise refused

    # -- backward ------------------------------------------------------------------------------------

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if saved.dropped:
            raise RuntimeError("this saved tensor was dropped from the store: the forward that saved it raised inside offload_activations")
        if not self.namespace.live:
            if saved.fetched is not None and saved.fetched.done() and not saved.fetched.cancelled() and saved.fetched.exception() is None:
                return _unchanged(saved, saved.fetched.result())  # (back before the close: its value is in memory)
            # Its key may be another graph's now: a new offloader claims the namespace given up.
            raise _closed_before_backward()
        started = time.perf_counter()
        self._order.append(saved.index)
        with self._lock:  # the copy is still in flight: the tensor never left, use it
            still_here = saved.tensor if saved.fetched is None else None
            if still_here is not None and still_here._version != saved.version:
                raise _changed_in_place(saved, still_here._version)
            if still_here is not None:
                saved.taken = True
                self.report.early += 1
                self.report.bytes_early += saved.nbytes
        if still_here is not None:
            saved.used = True
            saved.fetched = concurrent.futures.Future()
            saved.fetched.set_result(still_here)
            saved.finalizer.detach()
            self._fetch_ahead(saved.index, saved.device)
            return still_here
        if saved.used:  # (a second backward through the graph, retain_graph or a retry)
            return _unchanged(saved, saved.fetched.result())
        saved.used = True
        if saved.fetched is None:
            self._fetch(saved)
        else:
            self._ahead_bytes -= saved.nbytes
        self._fetch_ahead(saved.index, saved.device)
        value = saved.fetched.result()
        saved.finalizer.detach()
        _unchanged(saved, value)
        refused = value is saved.fallback
        if refused:
            self._warn_refused(saved)
        ended = time.perf_counter()
        with self._lock:
            self.report.add_stall(started, ended)
            if not refused:
                self.report.add_moved(saved.nbytes, ended - started, out=False)
            elif saved.ahead:  # (fetched ahead before its copy failed: nothing was brought back)
                self.report.prefetched -= 1
        return value

    def _warn_refused(self, saved: _Saved) -> None:
        """Once per offloader, on backward's thread (the warning names the user's line): the
        store refused ``saved``, which backward took from memory instead."""
        if self._warned_refusal:
            return
        self._warned_refusal = True
        refused = saved.stored.exception()
        advice = ": give the store's tier more room, or a disk tier below it" if isinstance(refused, TierFullError) else ""
        warn(f"offload_activations: the store refused a saved tensor of {format_bytes(saved.nbytes)} "
             f"({type(refused).__name__}: {refused}); it stayed in memory for backward, as do any others refused "
             f"(report.refused counts them){advice}")

    def _fetch(self, saved: _Saved) -> None:
        """Start bringing ``saved`` back from the store onto its device (on the loop)."""
        if saved.link is None:
            coroutine = _pop_when_stored(self.store, saved, self._device_tier(saved.device))
        else:
            coroutine = _cross_when_stored(self.store, saved, saved.link)
        saved.fetched = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        self._track(saved.fetched)

    def _fetch_ahead(self, index: int, device: torch.device) -> None:
        """Pop the saved tensors backward will want next, within ``ahead`` bytes (and a quarter
        of the device tier): when backward asks for them they are already here, and asking
        costs no round trip to the loop."""
        following = self._learned.get(index)
        if following is None:  # first step: assume the reverse of the order of saving
            following = list(range(index - 1, -1, -1))
        limit = min(self.ahead, self.store.tier(self._device_tier(device)).capacity // 4)
        for nxt in following:
            saved = self._saved.get(nxt)
            if saved is None or saved.finalizer is None or not saved.finalizer.alive:
                continue
            if saved.fetched is not None or saved.fallback is not None:  # (a refused one never left)
                continue
            if self._ahead_bytes + saved.nbytes > limit:
                break
            self._ahead_bytes += saved.nbytes
            self.report.bytes_ahead_peak = max(self.report.bytes_ahead_peak, self._ahead_bytes)
            self._fetch(saved)
            saved.ahead = True
            self.report.prefetched += 1

    def _device_tier(self, device: torch.device) -> str:
        """The store tier on the activations' device (a DeviceTier), else the fastest tier."""
        if self.device_tier is not None:
            return self.device_tier
        for tier in self.store.tiers:
            if isinstance(tier, MemoryTier) and tier.device.type == device.type and tier.name != self.tier:
                return tier.name
        return self.store.tiers[0].name


_active = threading.local()


def active_activation_offload() -> ActivationOffload | None:
    """The innermost ``ActivationOffload`` entered on this thread (``offload_parameters``
    hands it the saved tensors that are not parameters)."""
    stack = getattr(_active, "stack", [])
    return stack[-1] if stack else None


def offload_activations(
    store: TierStore | SyncTierStore,
    min_bytes: int | str = "1MiB",
    tier: str = "host",
    device_tier: str | None = None,
    max_in_flight: int | str = "256MiB",
    ahead: int | str = "64MiB",
    namespace: str | None = None,
    emulate_device: bool | None = None,
) -> ActivationOffload:
    """Offload saved activations of at least ``min_bytes`` to ``tier`` of ``store`` (see the
    module docstring); ``device_tier`` is where they come back (default: the store's device tier).
    The keys go into ``namespace``, claimed in the store (default: a fresh ``swap/act/<n>/``).
    ``emulate_device``: for CPU tensors, cross an emulated link (True) or none (False); None
    follows the process setting. A store's ``DeviceTier`` on the same device decides instead
    (its link is the device's link), and a contradicting True/False raises ``ValueError``."""
    return ActivationOffload(store, min_bytes, tier, device_tier, max_in_flight, ahead, namespace, emulate_device)


async def _claim(store: TierStore, name: str | None, base: str, owner: str) -> Namespace:
    """Claim ``name`` (leftovers in it are ours to delete: swapped tensors do not outlive a
    run) or, without one, the first free ``{base}<n>/``."""
    if name is None:
        return await store.claim_unique(base, owner=owner)
    namespace = await store.claim(name, owner=owner)
    await namespace.clear()
    return namespace


def _unchanged(saved: _Saved, value: torch.Tensor) -> torch.Tensor:
    """``value``, what backward gets for ``saved``, unless the tensor was changed in place
    while its copy was under way, or is the tensor itself (backward took it before its copy
    ended) changed since: then torch's error."""
    if saved.changed is not None:
        raise _changed_in_place(saved, saved.changed)
    if (saved.taken or value is saved.fallback) and value._version != saved.version:
        raise _changed_in_place(saved, value._version)
    return value


def _changed_in_place(saved: _Saved, version: int) -> RuntimeError:
    """Torch's error for a saved tensor changed in place (it checks none saved through hooks):
    a change made before the tensor's copy into the store ended may be in the copy, or half of
    it. (One made after it is not seen: backward gets the value saved.)"""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a tensor of {saved.nbytes} bytes saved for backward under offload_activations is at version {version}; "
        f"expected version {saved.version} instead (it was changed in place while it was being copied into the store; "
        "without offload_activations torch raises this too: change a clone instead)"
    )


def _stored_order(tensor: torch.Tensor) -> list[int] | None:
    """The order of dimensions to store ``tensor`` in: its memory order; for one with gaps or
    overlaps (a slice, an expanded view), the memory order of the dense layout torch gives such
    a tensor's copy (``torch.empty_like``: by its strides, a broadcast dimension left in place)."""
    order = memory_order(tensor)
    if order is not None or tensor.is_contiguous() or tensor.dim() < 2:
        return order
    return memory_order(torch.empty_like(tensor, device="meta"))


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


async def _stored(saved: _Saved) -> bool:
    """Wait for ``saved``'s copy into the store: True once it is there, False if it failed and
    backward gets the tensor itself (``fallback``, kept for any failure of the copy while the
    tensor was still held); raises only where nothing was kept."""
    try:
        await asyncio.wrap_future(saved.stored)
    except Exception:
        if saved.fallback is None:
            raise
        return False
    return True


async def _pop_when_stored(store: TierStore, saved: _Saved, tier: str) -> torch.Tensor:
    if not await _stored(saved):
        return saved.fallback  # type: ignore[return-value]
    async with _owned(saved):
        value = await store.pop(saved.key, tier)
    return _as_saved(saved, value if value.device == saved.device else value.to(saved.device))


async def _cross_when_stored(store: TierStore, saved: _Saved, link: Link) -> torch.Tensor:
    if not await _stored(saved):
        return saved.fallback  # type: ignore[return-value]
    async with _owned(saved):
        value = await to_device(store, saved.key, saved.device, link)
        await store.delete(saved.key)
    return _as_saved(saved, value)


@contextlib.asynccontextmanager
async def _owned(saved: _Saved) -> AsyncIterator[None]:
    """On the loop, around taking ``saved``'s value from the store: refuse it once its
    offloader's namespace was dropped (``close()`` on another thread after backward's own check:
    a new offloader may own the key now, and is only given it once the drop, which runs on this
    loop, has ended), and say so if the drop deleted it meanwhile."""
    namespace = saved.owner.namespace
    if not namespace.live:
        raise _closed_before_backward()
    try:
        yield
    except KeyNotFoundError:
        if not namespace.live:
            raise _closed_before_backward() from None
        raise


def _closed_before_backward() -> RuntimeError:
    return RuntimeError(
        "this saved tensor was dropped from the store: the offload_activations object that saved it was closed "
        "before this backward (close() deletes what its graphs still hold); close it once backward has run"
    )


def _as_saved(saved: _Saved, value: torch.Tensor) -> torch.Tensor:
    """The stored ``value`` with the strides of the tensor saved (stored in its memory order)."""
    if saved.order is None:
        return value
    inverse = [0] * len(saved.order)
    for position, dim in enumerate(saved.order):
        inverse[dim] = position
    return value.permute(inverse)


def _forget(loop: asyncio.AbstractEventLoop, store: TierStore, key: str, stored: Any, namespace: Namespace) -> None:
    """A saved tensor backward never used (its graph was freed): drop it from the store (unless
    its offloader was closed: the namespace's drop deleted it, and the key may be a new one's)."""
    async def drop() -> None:
        try:
            await asyncio.wrap_future(stored)
        except Exception:  # noqa: BLE001 - the put failed (raised where the value was needed): nothing to drop
            return
        try:
            if namespace.live and store.is_open and key in store:
                await store.delete(key)
        except (StoreClosedError, KeyNotFoundError):  # the store closed, or its namespace was dropped: nothing left
            pass

    if not loop.is_closed():
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(drop()))


def _clear_frames(error: BaseException) -> None:
    """Drop the local variables of the frames in ``error``'s tracebacks (its causes' too): the
    lines stay for the message, the tensors the frames held are let go."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def kept(tensor: torch.Tensor) -> torch.Tensor:
    """What a pack hook keeps of a tensor it does not store: the tensor without its autograd
    history (the same memory and version counter; torch gives the unpacked tensor its history
    back). The tensor itself would be a reference cycle torch keeps where the collector does not
    look: an output a backward formula saves (ReLU's, Tanh's) -> its grad_fn -> the saved
    object -> the output. A graph dropped without backward (an evaluation under grad mode, a
    skipped step) was then never freed, nor what it saved."""
    return tensor.detach() if tensor.grad_fn is not None else tensor
