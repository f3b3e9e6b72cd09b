"""One optimizer step, on the store's loop: the gradients that arrive during backward, then what
``step()`` does with ``p.grad`` as it found it (settle each capture, clip, run the buckets), and
the per-slot progress that lets a step that failed part-way be completed by ``step()`` again.

After backward, the update order alternates: arrival order one step, reversed the next (and a
chunked parameter's chunks with it). The state still on the host tier when a step starts is the
state updated last; updated first in the next step, it is read and written once, instead of
being pushed out for the first updates and read back at the end. Adam is elementwise and per
parameter, so the order changes no number.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from functools import partial

import torch

from ..errors import StepIncompleteError
from ..store import TierStore
from .capture import GradientCapture, Observed
from .clipping import clip_coefficient, inverse_scale, total_norm
from .pipeline import UpdatePipeline
from .resident import Held, ResidentStep
from .slots import Capture, ParamSlot, compare_fingerprints

#: GradScaler's ``(grad_scale, found an inf)`` when ``step()`` runs inside ``GradScaler.step``.
Scaling = tuple["torch.Tensor | None", bool]


class _StoreSteps:
    """What the optimizers sharing one store know of each other's steps."""

    def __init__(self) -> None:
        #: Lets one optimizer step at a time on the store. Each sizes its buckets by the room
        #: on the state tier as if the room were its own; two steps at once (from two threads)
        #: each took part of it and waited for the rest (a hang under the emulated device,
        #: ``TierFullError`` on the plain CPU). One at a time, they are the sequential steps
        #: that work.
        self.lock = asyncio.Lock()
        #: The step runners of the store's optimizers.
        self.runners: weakref.WeakSet[StepRunner] = weakref.WeakSet()
        #: The runner whose updates run in backward now (``StepRunner.may_update_in_backward``).
        self.in_backward_owner: weakref.ref[StepRunner] | None = None
        #: The runner whose step holds ``lock`` now.
        self.stepping: weakref.ref[StepRunner] | None = None
        #: The optimizer that made the store was dropped while others stepped on it: the last
        #: of them to close (or be dropped) closes it (``PagedOptimizer``).
        self.orphaned = False


_steps_of: weakref.WeakKeyDictionary[TierStore, _StoreSteps] = weakref.WeakKeyDictionary()


def closes_store(store: TierStore, runner: StepRunner | None, made_it: bool) -> bool:
    """On the loop, as an optimizer on ``store`` closes or is dropped (``runner``: its own, no
    longer counted among the store's): whether it closes the store now. The one that made it
    (``made_it``) does, unless others still step on it (``store=opt.store``): the last of them
    to go closes it then."""
    steps = _store_steps(store)
    if runner is not None:
        steps.runners.discard(runner)
    if not (made_it or steps.orphaned):
        return False
    steps.orphaned = bool(list(steps.runners))
    return not steps.orphaned


def _store_steps(store: TierStore) -> _StoreSteps:
    """The steps shared by ``store``'s optimizers (made at the first one's)."""
    steps = _steps_of.get(store)
    if steps is None:
        steps = _steps_of[store] = _StoreSteps()
    return steps


class StepRunner:
    """The loop's side of the step for ``slots`` (see the module docstring). Everything here
    runs on the loop; ``capture`` is set once the optimizer made it."""

    def __init__(
        self, slots: list[ParamSlot], store: TierStore, pipeline: UpdatePipeline, *, max_grad_norm: float | None, in_backward: bool
    ) -> None:
        self._slots = slots
        self._store = store
        self._pipeline = pipeline
        self.max_grad_norm = max_grad_norm
        self._in_backward = in_backward
        self._capture: GradientCapture
        self._arrivals = itertools.count()
        #: The order gradients arrived in last step: this step's updates and prefetches follow it
        #: (or its reverse: ``reverse_for``).
        self.last_order: list[ParamSlot] = []
        #: Whether this step updates in reversed arrival order, once decided (``reverse_for``).
        self._reverse: bool | None = None
        #: The steps reverse when ``steps + _flipped`` is odd.
        self._flipped = 0
        #: Whether the next step takes its way by the state resident (``reverse_for``): the first
        #: step, and the first after a checkpoint's I/O (set by the optimizer between steps).
        self.by_residency = True
        #: This step's clipping coefficient (kept across a failed attempt: the norm was of all gradients).
        self.coef: torch.Tensor | None = None
        self.steps = 0
        #: All at once when every state is resident (``tierstore.optim.resident``); set by the optimizer.
        self.resident: ResidentStep | None = None
        self._resident_task: asyncio.Task[list[tuple[list[ParamSlot], BaseException]]] | None = None
        #: Whether ``step()`` was called since the last step ended.
        self._step_called = False
        #: Whether any of its parameters' state pages (only those take room the others plan with).
        self._pages = any(slot.paged for slot in slots)
        #: The parameters updated in backward although the step ended without ``step()``
        #: (``zero_grad()``; updates not launched yet are dropped then): set by ``end``.
        self.updated_without_step: list[int] = []
        self._shared = _store_steps(store)
        self._shared.runners.add(self)
        #: Whether the last step's ``finish`` began (``PagedOptimizer._finish_step`` abandons a
        #: step whose task Ctrl-C cancelled before that).
        self.begun = True
        #: The holds of the resident update started this step (closed by ``_abandon`` if its
        #: task was cancelled before it began).
        self._resident_held: Held | None = None

    @property
    def capture(self) -> GradientCapture:
        return self._capture

    @capture.setter
    def capture(self, capture: GradientCapture) -> None:
        self._capture = capture
        capture.arrived_now = self.arrived_now
        capture.wake_each = lambda: self.max_grad_norm is not None or self._in_backward

    def arrived_now(self, slot: ParamSlot, capture: Capture) -> bool:
        """``arrived``, done now if it has nothing to wait for (the step's prefetch issued, no
        norm to take ahead); else False, having done nothing."""
        if not self._pipeline.prefetch_issued or self.max_grad_norm is not None:
            return False
        slot.arrival = next(self._arrivals)
        if self._in_backward and slot.capture is capture and self.may_update_in_backward():
            slot.used = capture
            self._pipeline.add(slot, None, after=capture.marker)
        return True

    async def arrived(self, slot: ParamSlot, capture: Capture) -> None:
        """A hook's capture is on the host: prefetch, norm ahead, update in backward."""
        slot.arrival = next(self._arrivals)
        reverse = self.reverse_for(self.last_order)
        await self._pipeline.prefetch_first(self.last_order[::-1] if reverse else self.last_order, reverse)
        if self.max_grad_norm is not None and slot.capture is capture:
            capture.norm = await self.norm(slot, capture, 2.0)
        if self._in_backward and slot.capture is capture and self.may_update_in_backward():
            slot.used = capture
            self._pipeline.add(slot, None, after=capture.marker)

    def may_update_in_backward(self) -> bool:
        """Whether this optimizer's updates may start in backward now: one optimizer on a store
        at a time does (it claims the store until its step, or ``zero_grad``, ends), and none
        while another optimizer's step runs. Each plans its buckets with the whole room of the
        state tier; two streams of updates at once took parts of it and waited for the rest
        (``TierFullError``, or a hang under the emulated device). A gradient turned away here
        waits for its optimizer's ``step()``, as with ``step_in_backward=False`` (and a step
        first waits for the updates already started in backward)."""
        shared = self._shared
        stepping = shared.stepping
        if stepping is not None and stepping() is not self:
            return False
        if not self._pages:
            return True  # (its state stays where it is: it takes no room the others plan with)
        owner = shared.in_backward_owner
        runner = owner() if owner is not None else None
        if runner is None:
            shared.in_backward_owner = weakref.ref(self)
            return True
        return runner is self

    def release_backward(self) -> None:
        """Give up the claim to update in backward on the store, if this optimizer holds it."""
        owner = self._shared.in_backward_owner
        if owner is not None and owner() is self:
            self._shared.in_backward_owner = None

    def reverse_for(self, order: list[ParamSlot]) -> bool:
        """Whether this step updates in reversed arrival order (``order``: the arrival order
        expected), decided once a step (after backward only: updates in backward run as
        gradients arrive). Every other step: the state tier then holds the state updated last,
        which the next step updates first, and the store's learned schedule follows the
        alternation. On the first step, and the first after a checkpoint (a load writes the
        state in parameter order, a save reads it so), the way that starts with the state the
        tier holds, the alternation going on from there: from the first parameter, the state
        left by a load was pushed out before its update and read back."""
        if self._reverse is not None:
            return self._reverse
        reverse = not self._in_backward and (self.steps + self._flipped) % 2 == 1
        if not order:  # (the first step's first arrival: nothing to tell by yet)
            return reverse
        self._reverse = reverse
        if self.by_residency and not self._in_backward:
            self.by_residency = False
            lead = self._pipeline.resident_lead(order) if self._pages else 0
            if lead and (lead < 0) != reverse:
                self._flipped ^= 1
                reverse = self._reverse = not reverse
        return reverse

    async def norm(self, slot: ParamSlot, capture: Capture, norm_type: float, inverse: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of the captured gradient (unscaled by ``inverse`` first, if given)."""
        async with self._pipeline.grad(slot, capture) as grad:
            return await self._pipeline.math(partial(_norm, grad, norm_type, inverse))

    async def finish(self, observed: list[Observed], scaling: Scaling | None) -> None:
        self.begun = True  # (a task cancelled before its first line never gets here: ``abandon`` then)
        self.capture.take_pending()  # (the hooks' gradients not taken yet, before anything else)
        pipeline = self._pipeline
        pipeline.in_step = True
        self._step_called = True
        try:
            async with self._shared.lock:  # (one optimizer steps at a time on a store: see _StoreSteps)
                # (from here on no other optimizer's update starts in backward: see below)
                self._shared.stepping = weakref.ref(self)
                try:
                    await self._others_in_backward_done()
                    try:
                        await self._run(pipeline, observed, scaling)
                    except asyncio.CancelledError:  # Ctrl-C in step(): abandoned, once what it launched has ended
                        await self._abandon(observed)
                        raise
                finally:
                    self._shared.stepping = None
        finally:
            pipeline.in_step = False
            pipeline.scale = None

    async def _run(self, pipeline: UpdatePipeline, observed: list[Observed], scaling: Scaling | None) -> None:
        await self._captures_settled()  # their arrival may start an update in backward
        stale = False
        if scaling is not None:  # GradScaler
            if self._in_backward:
                await self.end()
                raise RuntimeError(
                    "GradScaler cannot be used with step_in_backward=True: the updates ran during backward on scaled "
                    "gradients; use the default step_in_backward=False"
                )
            if scaling[1]:  # an inf or NaN: the step is skipped, as torch's fused Adam skips it
                await self.end()
                return
            # scaler.unscale_() ran: it changed every p.grad in place without moving versions.
            stale = scaling[0] is None
            pipeline.scale = scaling[0]
        changed: list[int] = []  # updated in backward, then p.grad changed
        pending: list[Observed] = []
        compare_fingerprints([(capture, item[1]) for item in observed if item[1] is not None
                              for capture in {id(c): c for c in (item[0].used, item[0].capture) if c is not None}.values()])
        for item in observed:
            slot = item[0]
            if slot.used is not None:  # its update started in backward
                if not slot.used.matches(item[1], item[2]):
                    changed.append(slot.index)
            elif not slot.updated:
                pending.append(item)
        settled = await self._settle(pending, stale)
        failures: list[tuple[list[ParamSlot], BaseException]] = []
        ready = [slot for slot in self._slots if slot.updated and not slot.written]  # an earlier attempt's
        for item, result in zip(pending, settled, strict=True):
            if isinstance(result, BaseException):
                failures.append(([item[0]], result))
            elif result is not None:
                ready.append(item[0])
        coef = self.coef
        if coef is None and self.max_grad_norm is not None and not failures:
            captured = [(slot, slot.capture) for slot in self._slots if slot in ready and slot.capture is not None]
            norm_of = self.norm if pipeline.scale is None else partial(self.norm, inverse=inverse_scale(pipeline.scale))
            total = await total_norm(captured, norm_of, 2.0, ahead=pipeline.scale is None)
            coef = self.coef = clip_coefficient(self.max_grad_norm, total)
        if not failures or self.max_grad_norm is None:
            pipeline.launch(None)  # the open bucket of updates in backward
            # (index breaks ties: gradients set without a hook firing share one arrival, and a
            # stable sort reversed would keep their order, not alternate it)
            order = sorted(ready, key=lambda s: (s.arrival, s.index))
            pipeline.recount_early_writes(order)
            pipeline.reverse = self.reverse_for(order)
            if pipeline.reverse:
                order.reverse()
            if not self._in_backward:
                self._expect(order)
            resident = None
            if self.resident is not None and not self._in_backward and pipeline.scale is None:
                resident, order = await self._start_resident(pipeline, order, coef)
                self._resident_task = resident
            for slot in order:
                pipeline.add(slot, coef, after=observed[slot.index][3])
            pipeline.launch(coef)
            if resident is not None:
                failures += await resident
        failures += await pipeline.finish()
        if changed:
            await self.end()
            raise RuntimeError(
                f"step_in_backward=True: parameters {changed} were updated during backward from p.grad as backward left it, "
                "but p.grad changed before step() (replaced, set to None, or changed in place: clipping, unscaling, DDP "
                "averaging without tierstore.optim.attach_ddp); those changes cannot be applied. Use step_in_backward=False "
                "when the loop changes gradients after backward"
            )
        if failures:
            for bucket, _ in failures:
                for slot in bucket:
                    if not slot.updated:
                        slot.used = None  # not updated: step() again updates it from p.grad as it is then
            raise self._incomplete(failures)
        self.last_order = sorted((s for s in self._slots if s.updated), key=lambda s: (s.arrival, s.index))
        self._store.mark_step()
        self.steps += 1
        await self.end()

    def _expect(self, order: list[ParamSlot]) -> None:
        """Tell the store which paged states this step updates (``order``'s) and which it does
        not (``TierStore.expect``): with a part of the parameters with a gradient each step,
        the schedule learned from the steps before cannot tell, and foretold the others a use
        (read ahead, kept in memory) and these none (evicted before their update)."""
        updating = {slot.index for slot in order}
        used: list[str] = []
        unused: list[str] = []
        for slot in self._slots:
            if slot.paged:
                (used if slot.index in updating else unused).extend(slot.state_keys)
        self._store.expect(used, unused)

    async def _start_resident(
        self, pipeline: UpdatePipeline, order: list[ParamSlot], coef: torch.Tensor | None
    ) -> tuple[asyncio.Task[list[tuple[list[ParamSlot], BaseException]]] | None, list[ParamSlot]]:
        """Hold the states resident now and start their update in one call (``ResidentStep``);
        return its task and the slots left to the pipeline, in order. All of them when every
        slot is resident; else, as the pipeline's first bucket would be, those the step writes
        back early first (so those writes start after the call) in one of the places in flight,
        up to its share of the room (so the reads of the others find room; none if the first
        slot's state is more than the share)."""
        resident = self.resident
        assert resident is not None
        chosen, pieces = resident.split(order)
        if not chosen:
            return None, order
        if len(chosen) < len(order):
            share, pending = pipeline.share(), pipeline.early_pending()
            size = written = count = 0
            tally = pipeline.held_tally()  # (small states take slabs: counted as held together)
            for slot in chosen:
                need, nbytes = pipeline.state_held(slot, tally)
                # (the first too: a chunked parameter's whole state can be the whole tier, and
                # held at once it left the runs in the other places no room: TierFullError)
                if share is not None and size + need > share:
                    break
                size += need
                written += nbytes
                count += 1
                if share is not None and 0 < pending <= written:  # the early write-backs are all in
                    break
            chosen, pieces = chosen[:count], pieces[:count]
            if not chosen:  # (the first slot's state is over the share: the pipeline takes all)
                return None, order
        early = pipeline.early_writes(chosen)
        held = await resident.hold(chosen, pieces)
        if held is None:  # (taken meanwhile: these go through the pipeline, written back when evicted)
            return None, order
        self._resident_held = held
        taken = set(chosen)
        rest = [slot for slot in order if slot not in taken]
        return asyncio.ensure_future(self._update_resident(pipeline, held, coef, early, whole=not rest)), rest

    async def _update_resident(
        self, pipeline: UpdatePipeline, held: Held, coef: torch.Tensor | None, early: list[tuple[str, int]], *, whole: bool
    ) -> list[tuple[list[ParamSlot], BaseException]]:
        """The update of ``held`` in one of the pipeline's places, then the early write-backs of
        its states (``early``)."""
        assert self.resident is not None
        try:
            async with pipeline.place():
                failures = await self.resident.update(held, coef, whole=whole)
        except BaseException as exc:
            await held.stack.aclose()  # (already closed if the update ran)
            if not isinstance(exc, Exception):
                raise
            return [(held.slots, exc)]
        if early:
            done = {key for slot in held.slots if slot.written for key, _ in pipeline.state_keys(slot)}
            pipeline.write_back([(key, size) for key, size in early if key in done])
        return failures

    async def _settle(self, pending: list[Observed], stale: bool) -> list[Capture | None | BaseException]:
        """Settle every capture of ``pending`` (errors returned in place): those with nothing to
        wait for one after the other, the copies still to take or finish concurrently."""
        results: list[Capture | None | BaseException] = [None] * len(pending)
        waiting: list[int] = []
        for i, item in enumerate(pending):
            if not self.capture.settles_at_once(item, stale=stale):
                waiting.append(i)
                continue
            try:
                results[i] = await self.capture.settle(item, stale=stale)
            except Exception as exc:  # noqa: BLE001 - reported with the others
                results[i] = exc
        if waiting:
            settled = await asyncio.gather(*(self.capture.settle(pending[i], stale=stale) for i in waiting), return_exceptions=True)
            for i, result in zip(waiting, settled, strict=True):
                results[i] = result
        return results

    async def _captures_settled(self) -> None:
        """Wait for the captures still moving (errors are theirs to report, at settle)."""
        tasks = [s.capture.task for s in self._slots if s.capture is not None and s.capture.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    def _incomplete(self, failures: list[tuple[list[ParamSlot], BaseException]]) -> StepIncompleteError:
        updated = [slot.index for slot in self._slots if slot.updated and slot.written]
        failed = sorted({slot.index for bucket, _ in failures for slot in bucket if not (slot.updated and slot.written)})
        cause = failures[0][1]
        error = StepIncompleteError(
            f"step() did not finish: parameters {updated} were updated, {failed} were not ({type(cause).__name__}: {cause}); "
            "call step() again to complete this step (updates already applied are not repeated), or zero_grad() to abandon it",
            updated, failed,
        )
        error.__cause__ = cause
        return error

    async def _others_in_backward_done(self) -> None:
        """Wait for the updates other optimizers on this store launched in backward
        (``step_in_backward=True``; their own ``step()`` collects how they ended). This step
        plans its buckets with the whole room; run beside them, both waited for room the other
        held (one backward feeding two optimizers, stepped one after the other)."""
        for other in list(self._shared.runners):
            if other is not self and other._in_backward:
                await other._pipeline.launched_done()

    async def abandon(self, observed: list[Observed]) -> None:
        """Abandon a step whose ``finish`` was cancelled before it began (``_abandon``, under the
        store's step lock as ``finish`` takes it)."""
        async with self._shared.lock:
            await self._abandon(observed)

    async def _abandon(self, observed: list[Observed]) -> None:
        """After a cancelled step: wait for the updates it launched (their holds and the jobs
        they hand the training thread, which ``drain_until`` still runs), finish those of
        parameters paged in chunks that it cut part-way, then forget the step as ``end`` does;
        their errors are dropped (the step was interrupted, not failed)."""
        resident, self._resident_task = self._resident_task, None
        held, self._resident_held = self._resident_held, None
        if resident is not None and not resident.done():
            await asyncio.gather(resident, return_exceptions=True)
        if held is not None:  # (its task cancelled before it began never closed them; else a no-op)
            await held.stack.aclose()
        with contextlib.suppress(asyncio.CancelledError):  # (cancelled again: those stay cut, the step is forgotten)
            await self._finish_cut_chunks(observed)
        cleanup = asyncio.ensure_future(self.end())
        await asyncio.gather(cleanup, return_exceptions=True)

    async def _finish_cut_chunks(self, observed: list[Observed]) -> None:
        """Once the updates launched have ended: update the chunks not updated yet of each
        parameter paged in chunks whose update the interrupt cut part-way (some chunks took it,
        others not), from the same gradient, as the retry of a failed step would. Left so, the
        chunks would disagree on the step count, which moves once per parameter: the next update
        would count this step again in the chunks that took it. Errors leave it cut."""
        pipeline = self._pipeline
        await pipeline.finish(drop_open=True)
        for slot in self._slots:
            if slot.chunks and not slot.updated and slot.chunks_updated:
                with contextlib.suppress(Exception):
                    await pipeline.update_remaining_chunks(slot, self.coef, observed[slot.index][3])

    async def end(self) -> list[tuple[list[ParamSlot], BaseException]]:
        """Forget this step's gradients (and their host copies) and progress, once the updates
        already launched (in backward) have ended; return those that failed, with their errors
        (never reported otherwise: ``step()`` did not see them)."""
        self._reverse = None  # (the next step decides anew, even if this one fails here)
        try:
            self.capture.take_pending()
            await self._captures_settled()  # (an arrival may still add to a bucket)
            failures = await self._pipeline.finish(drop_open=True)
        finally:
            self.release_backward()
        self._pipeline.close_finished_chunks(self._slots)
        self._resident_held = None
        self.updated_without_step = [] if self._step_called else sorted(s.index for s in self._slots if s.updated)
        self._step_called = False
        for slot in self._slots:
            capture = slot.capture
            if capture is not None and (capture.lent is None or (capture.task is not None and not capture.task.done())):
                await self.capture.discard(slot)  # (a lent one has no copy to drop: no coroutine each)
            slot.reset_step()
        self.coef = None
        return failures

    def abandoned_error(self, failures: list[tuple[list[ParamSlot], BaseException]]) -> StepIncompleteError:
        """The error of updates launched in backward that failed in a step then abandoned."""
        failed = sorted({slot.index for bucket, _ in failures for slot in bucket})
        cause = failures[0][1]
        error = StepIncompleteError(
            f"updates started in backward failed for parameters {failed} ({type(cause).__name__}: {cause}); "
            "the step was abandoned (zero_grad() or close(); the other updates of it stay applied)",
            [], failed,
        )
        error.__cause__ = cause
        return error

    async def set_clip(self, coef: torch.Tensor) -> None:
        """The coefficient ``opt.clip_grad_norm_`` computed for this step's gradients."""
        self.coef = coef


def _norm(grad: torch.Tensor, norm_type: float, inverse: torch.Tensor | None) -> torch.Tensor:
    # (on the host: a chunked parameter's gradient is read where the model keeps it)
    return torch.linalg.vector_norm(grad if inverse is None else grad.mul(inverse.to(grad.device)), norm_type).cpu()
