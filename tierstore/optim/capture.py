"""Gradients from the model to the host tier: taken speculatively when their hook fires,
checked against ``p.grad`` when ``step()`` runs, and taken again when they changed.

Torch's optimizers use ``p.grad`` as it is when ``step()`` runs: whatever the loop or a
framework did to it after backward (clipping, unscaling, DDP averaging, replacing it, setting it
to None) counts. A copy taken when the post-accumulate-grad hook fires is therefore a speculation
on the gradient not changing: ``step()`` reads each ``p.grad`` on the training thread, and a copy
counts only if ``p.grad`` is still the tensor it was taken from, at the same version (torch's
version counter moves with every in-place change). Otherwise the gradient is copied again, then.
A DTensor's local gradient (FSDP2) is a new view at each look, and foreach ops change it in place
without moving its version: its copy counts if the memory and a fingerprint of the values
(``slots.values_fingerprint``, taken in the hook) are the same.

Where the link lends (plain CPU: device memory is host memory) nothing is copied: the update
reads ``p.grad`` itself. Where state pages below the state tier (``defer``), a gradient is not
copied when its hook fires either: a gradient held as a value on the state tier competes with
the state for it, and pushed out it goes to the disk and back. The update copies it over the
link into a scratch buffer that lives as long as its bucket (``UpdatePipeline.grad_for_update``).

Threads: the hook runs on an autograd thread and only counts (under a lock), marks the link and
hands the gradient to the loop; everything else here runs on the loop. The hook wakes the loop
only when something there should start now: the first gradient of a pass (the step's prefetch
starts with it), a copy to take, a norm to take ahead or an update in backward. Other gradients
(lent ones, on the plain CPU) wait in a list the loop takes with the next wake-up, or at the
start of ``step()`` or ``zero_grad()`` (``take_pending``), in the order they came: a wake-up of
the loop on every parameter's hook took the GIL from backward about fifty times a pass.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ..store import TierStore
from .distributed import LocalShard
from .reports import Timeline, TimeReport, count_grad_transfer
from .slots import Capture, ParamSlot, memory_of, values_fingerprint

#: What step() saw of one parameter: ``(slot, p.grad, its version, a marker of the link, the
#: tensor to copy if it must be copied: p.grad, or a contiguous copy of it made on the device)``.
Observed = tuple[ParamSlot, "torch.Tensor | None", "int | None", Any, "torch.Tensor | None"]


def observe(slots: list[ParamSlot]) -> list[Observed]:
    """``p.grad`` of every slot as it is now, with its version and a marker of the work queued
    so far on its link (on the training thread, in ``step()``)."""
    markers: dict[int, Any] = {}
    observed = []
    for slot in slots:
        grad = slot.param.grad
        version = grad._version if grad is not None else None
        observed.append((slot, grad, version, None, grad))
    for slot, *_ in observed:
        if id(slot.link) not in markers:
            markers[id(slot.link)] = slot.link.mark()
    return [(slot, grad, version, markers[id(slot.link)], source) for slot, grad, version, _, source in observed]


class GradientCapture:
    """Takes gradients to ``state_tier`` of ``store`` (see the module docstring).

    ``arrived(slot, capture)`` runs on the loop once a hook's capture is on the host (prefetch,
    speculative norms, updates in backward). ``hint``: backward passes per step the user expects
    (``gradient_accumulation_steps``): hooks of other passes copy nothing. ``in_backward``: an
    update starts at the hint-th pass, so one more pass before ``step()`` raises in the hook.
    """

    def __init__(
        self, store: TierStore, state_tier: str, loop: asyncio.AbstractEventLoop, *, hint: int, in_backward: bool,
        arrived: Callable[[ParamSlot, Capture], Awaitable[None]], report: Callable[[], TimeReport], timeline: Timeline,
    ) -> None:
        self._store = store
        self._tier = state_tier
        self._loop = loop
        self._hint = hint
        self._in_backward = in_backward
        self._arrived = arrived
        #: ``arrived``'s work done on the spot where it has nothing to wait for (True), else
        #: nothing done (False): the capture's task awaits ``arrived``. The step's to set.
        self.arrived_now: Callable[[ParamSlot, Capture], bool] = lambda slot, capture: False
        self._report = report
        self._timeline = timeline
        # Hook side (autograd/training threads), under the lock: passes per slot this step.
        self._lock = threading.Lock()
        self._fired: dict[int, int] = {}
        #: Per slot: its gradient and that gradient's version when its hook last fired this step,
        #: recorded where ``changed_since_backward`` will be asked (``watch_changes``: ZeRO-2).
        self._at_hook: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.watch_changes = False
        #: Slots whose gradients come from DDP's communication hook (see ``tierstore.optim.ddp``).
        self._ddp: dict[int, ParamSlot] = {}
        self._end_queued = False
        #: Hooks handed over but not taken by the loop yet (``take_pending``), under the lock, by
        #: slot in the order they came (a later one replaces its slot's earlier one, as its
        #: ``_start`` would: passes without a step keep one each), and whether a wake-up of the
        #: loop to take them is on its way.
        self._pending: dict[int, tuple[ParamSlot, torch.Tensor, int, Any, bool, torch.Tensor | None]] = {}
        self._wake_sent = False
        #: Whether a hook fired since ``new_step`` (the first of a pass wakes the loop).
        self._hooked = False
        #: Whether every hook should wake the loop (norms ahead, updates in backward); the step's to set.
        self.wake_each: Callable[[], bool] = lambda: True
        #: Whether state pages below the state tier now (the optimizer sets it to its pipeline's
        #: ``pages_below``): contiguous gradients then stay where the model keeps them until
        #: their update (see the module docstring).
        self.pages_below: Callable[[], bool] = lambda: False

    # -- autograd thread -------------------------------------------------------------------------

    def hook(self, slot: ParamSlot, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook: count the pass, start the speculative copy."""
        grad = param.grad
        with self._lock:
            passes = self._fired[slot.index] = self._fired.get(slot.index, 0) + 1
            if grad is not None and self.watch_changes:
                self._at_hook[slot.index] = (weakref.ref(grad), grad._version)
            ddp = slot.index in self._ddp
            queue_end = ddp and not self._end_queued
            self._end_queued = self._end_queued or queue_end
        if self._in_backward and passes > self._hint:
            raise RuntimeError(
                f"parameter {slot.index}: backward pass {passes} before step(), but with step_in_backward=True its "
                f"update already ran in pass {self._hint}; pass gradient_accumulation_steps={passes} (or more) "
                "to accumulate, or use the default step_in_backward=False"
            )
        if queue_end:
            torch.autograd.Variable._execution_engine.queue_callback(self._after_finalize)
        if ddp or passes % self._hint or grad is None or grad.layout is not torch.strided:
            return  # DDP's hook captures it; or an earlier pass of several; or step() takes it (a sparse one: refuses it)
        # A DTensor's local shard (FSDP2): a new view each time and a version that in-place
        # foreach ops do not move; step() compares the values' fingerprint instead.
        # (Only where step() will ask: a copy taken now, or an update in backward; a lent
        # gradient is read as it is at step() otherwise.)
        fingerprint = values_fingerprint(grad) if isinstance(param, LocalShard) and (self._in_backward or not slot.link.lends) else None
        item = (slot, grad, grad._version, slot.link.mark(), False, fingerprint)
        now = not self._hooked or not slot.link.lends or self.wake_each()
        with self._lock:
            self._pending.pop(slot.index, None)  # (to the end: the order of arrival)
            self._pending[slot.index] = item
            self._hooked = True
            wake = now and not self._wake_sent
            self._wake_sent = self._wake_sent or wake
        if wake:
            self._loop.call_soon_threadsafe(self.take_pending)

    def take_pending(self) -> None:
        """On the loop: take the gradients hooks handed over (see the module docstring)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._wake_sent = False
        for item in pending.values():
            self._start(*item)

    def bucket_ready(self, slot: ParamSlot, view: torch.Tensor) -> None:
        """A DDP bucket's averaged gradient of ``slot`` (from the comm hook's ``then``)."""
        with self._lock:
            passes = self._fired.get(slot.index, 0)
        if passes and passes % self._hint == 0:
            self._loop.call_soon_threadsafe(self._start, slot, view, -1, slot.link.mark(), True)

    def _after_finalize(self) -> None:
        # Queued during backward, this runs among the engine's final callbacks; DDP queues its
        # finalize (which writes the averaged buckets into p.grad) before, so ours, queued from
        # here, runs after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._expect_ddp)

    def _expect_ddp(self) -> None:
        with self._lock:
            self._end_queued = False
            slots = list(self._ddp.values())
        expected = [(slot, weakref.ref(g), g._version) for slot in slots if (g := slot.param.grad) is not None]
        self._loop.call_soon_threadsafe(self._set_expected, expected)

    def watch_ddp(self, slots: list[ParamSlot]) -> None:
        """From now on the gradients of ``slots`` come from DDP's communication hook."""
        with self._lock:
            self._ddp.update({slot.index: slot for slot in slots})

    def new_step(self) -> None:
        """Forget the passes counted (step() ended, or zero_grad())."""
        with self._lock:
            self._fired.clear()
            self._at_hook.clear()
            self._hooked = False

    def changed_since_backward(self, slots: list[ParamSlot]) -> list[int]:
        """The slots (indices) whose ``p.grad`` is not what their hook last saw this step: another
        tensor, or changed in place since (torch's ``clip_grad_norm_``, a scaling)."""
        with self._lock:
            at_hook = dict(self._at_hook)
        changed = []
        for slot in slots:
            seen = at_hook.get(slot.index)
            grad = slot.param.grad
            if seen is not None and grad is not None and (seen[0]() is not grad or seen[1] != grad._version):
                changed.append(slot.index)
        return changed

    # -- the loop ---------------------------------------------------------------------------------

    def _start(
        self, slot: ParamSlot, grad: torch.Tensor, version: int, marker: Any, ddp: bool, fingerprint: torch.Tensor | None = None
    ) -> None:
        previous = slot.capture
        capture = Capture(None if ddp else weakref.ref(grad), version, marker=marker, ddp=ddp, memory=None if ddp else memory_of(grad),
                          fingerprint=fingerprint)
        if slot.link.lends:
            capture.lent = grad
        elif not ddp:
            capture.deferred = self._defers(grad)
        slot.capture = capture
        if capture.lent is not None and (previous is None or previous.task is None or previous.task.done()) and self.arrived_now(slot, capture):
            return  # nothing to copy or wait for: no task
        capture.task = asyncio.ensure_future(self._take(slot, capture, grad, previous, arrived=True))

    def _defers(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` stays where it is until its update copies it (a copy over the link
        reads contiguous memory: another layout is copied now, as it is)."""
        return grad.is_contiguous() and self.pages_below()

    def _set_expected(self, expected: list[tuple[ParamSlot, weakref.ref[torch.Tensor], int]]) -> None:
        for slot, ref, version in expected:
            capture = slot.capture
            if capture is not None and capture.ddp and capture.tensor is None:
                capture.tensor, capture.version = ref, version
                grad = ref()
                capture.memory = memory_of(grad) if grad is not None else None
                if capture.lent is not None:  # lend p.grad itself (the bucket's values, copied there)
                    capture.lent = ref()

    async def _take(self, slot: ParamSlot, capture: Capture, grad: torch.Tensor, previous: Capture | None, *, arrived: bool) -> None:
        if previous is not None and previous.task is not None:  # one copy into the key at a time
            await asyncio.gather(previous.task, return_exceptions=True)
        if capture.lent is None and slot.chunks is None and not capture.deferred:  # (else: crossing in its update)
            async with self._store.fill(slot.grad_key, grad.shape, grad.dtype, self._tier) as buffer:
                transfer = slot.link.to_host(buffer, grad, after=capture.marker)
                await transfer
            count_grad_transfer(self._report(), self._timeline, slot.index, transfer)
        if arrived:
            await self._arrived(slot, capture)

    def settles_at_once(self, observed: Observed, *, stale: bool = False) -> bool:
        """Whether ``settle(observed)`` has nothing to wait for (no copy to take or to finish):
        such settles run one after the other, without a task each."""
        slot, grad, version = observed[0], observed[1], observed[2]
        capture = slot.capture
        if capture is not None and capture.task is not None and not capture.task.done():
            return False
        if grad is None:  # (dropping a host copy is a delete in the store)
            return capture is None or capture.lent is not None
        return slot.link.lends or (capture is not None and not stale and capture.matches(grad, version))

    async def settle(self, observed: Observed, *, stale: bool = False) -> Capture | None:
        """The capture of ``p.grad`` as step() saw it (taken again if the one from backward is
        stale, or if ``stale``: changed in a way the version does not show), or None when
        ``p.grad`` is None (the parameter is not updated, as in torch)."""
        slot, grad, version, marker, source = observed
        capture = slot.capture
        if capture is not None and capture.task is not None and not capture.task.done():
            await asyncio.gather(capture.task, return_exceptions=True)
        if grad is None:
            await self.discard(slot)
            return None
        if capture is not None and not stale and capture.matches(grad, version):
            if capture.task is not None:
                await capture.task  # its error, if the copy failed
            if capture.deferred:
                # not copied yet: its copy orders after the device work step() saw queued
                # (the hook's marker is older: p.grad may have been written since, in place)
                capture.marker = marker
            return capture
        fresh = Capture(weakref.ref(grad), version or 0, marker=marker, memory=memory_of(grad))
        if slot.link.lends:  # nothing to copy, nothing to wait for
            fresh.lent = grad
            slot.capture = fresh
            return fresh
        fresh.deferred = (source is None or source is grad) and self._defers(grad)
        if not fresh.deferred:  # (a deferred one is copied once, by its update, as any)
            report = self._report()
            report.grad_retakes += 1
            report.grad_retake_bytes += grad.nbytes
        slot.capture = fresh
        fresh.task = asyncio.ensure_future(self._take(slot, fresh, source if source is not None else grad, None, arrived=False))
        await fresh.task
        return fresh

    async def discard(self, slot: ParamSlot) -> None:
        """Drop the slot's capture and its host copy."""
        capture, slot.capture = slot.capture, None
        if capture is not None and capture.task is not None and not capture.task.done():
            await asyncio.gather(capture.task, return_exceptions=True)
        if capture is not None and capture.lent is None and slot.grad_key in self._store:
            await self._store.delete(slot.grad_key)
