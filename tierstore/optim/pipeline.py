"""The update pipeline: parameters updated in buckets, each holding its states and gradients on
the state tier, running the math in one call off the loop, and sending the new weights back to
the device before the holds are released.

A bucket is several parameters updated together (one fused call, one thread hop), as many as
``bucket_bytes`` of state and gradients hold, in the order the gradients arrived. ``inflight``
buckets run at once, so one's transfers overlap the other's math. Each slot records how far its
update got (state updated, weight written): a step that failed part-way is completed by running
the pipeline again, and no update is applied twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, nullcontext
from functools import partial
from typing import Any, Protocol

import torch

from ..device import Transfer
from ..errors import TierFullError
from ..store import TierStore
from ..tiers import MemoryTier
from ..workers import CallerPool, Priority, WorkerPool
from .clipping import inverse_scale
from .reports import Timeline, TimeReport
from .slots import Capture, ParamSlot


class OptimizerCapacityError(TierFullError):
    """The host tier cannot hold one parameter's state and gradient at once."""


class Updater(Protocol):
    """What the pipeline asks of the optimizer (``PagedOptimizer`` and its subclasses)."""

    def _state(self, slot: ParamSlot) -> AbstractAsyncContextManager[Any]: ...
    def _state_bytes(self, slot: ParamSlot) -> int: ...
    def _apply_many(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> list[torch.Tensor]: ...
    def _master(self, slot: ParamSlot, state: Any) -> torch.Tensor: ...


class UpdatePipeline:
    """Buckets of updates on ``store``'s ``state_tier`` for ``owner`` (see the module docstring)."""

    def __init__(self, store: TierStore, state_tier: str, owner: Updater, *, report: Callable[[], TimeReport], timeline: Timeline) -> None:
        self._store = store
        self._tier = state_tier
        self._owner = owner
        self._report = report
        self._timeline = timeline
        # Math runs on the training thread while it waits in step(); during backward (norms,
        # updates in backward) on a worker thread. ``in_step`` is the loop's to set.
        self._compute = WorkerPool(1, "optimizer")
        self._compute.start()
        self._caller = CallerPool()
        self.in_step = False
        #: This step's GradScaler scale, when the gradients are still scaled (buckets launched
        #: from now on unscale their host copies). The loop's to set.
        self.scale: torch.Tensor | None = None
        self.bucket_bytes = 64 << 20
        self.inflight = 1
        self._gate: asyncio.Semaphore | None = None
        self._open: list[ParamSlot] = []
        self._after: Any = None
        self._running: list[tuple[list[ParamSlot], asyncio.Task[None]]] = []
        self._prefetched = False

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, slots: Sequence[ParamSlot], bucket_bytes: int, max_inflight: int, in_backward: bool) -> None:
        """Choose bucket size and buckets at once. Two buckets at once overlap one's transfers
        with the other's math; the state tier must hold them both, plus room for one more
        gradient. Raise ``OptimizerCapacityError`` if it cannot hold one parameter's update."""
        tier = self._store.tier(self._tier)
        if not isinstance(tier, MemoryTier) or not slots:
            self.bucket_bytes, self.inflight = bucket_bytes or (64 << 20), max_inflight
            return
        needs = [self.need(slot) for slot in slots]
        grads = [self._grad_bytes(slot, tier) for slot in slots]
        largest = max(needs)
        room = tier.capacity * 9 // 10 - max(grads)  # a tenth left for arrivals and state being created
        if largest > room:
            worst = slots[needs.index(largest)]
            raise OptimizerCapacityError(
                f"the {self._tier!r} tier ({tier.capacity:,} bytes) cannot hold the state and gradient of parameter "
                f"{worst.index} ({worst.numel:,} elements: {largest:,} bytes) beside another gradient; give it more capacity"
            )
        tiers = self._store.tiers
        if tiers.index(tier) == len(tiers) - 1 and all(slot.link.lends for slot in slots):
            # Nothing pages below the state tier and nothing crosses a link: no transfers to
            # overlap, and a second bucket's bookkeeping would only slow the math. One bucket
            # (four when updating in backward, so updates start while backward runs). Across a
            # link, buckets pipeline: one's new weights travel while the next one's math runs.
            whole = sum(needs) // (4 if in_backward else 1)
            self.bucket_bytes, self.inflight = max(bucket_bytes or whole, largest), 1
            return
        inflight = max(1, min(max_inflight, room // largest))
        # At least four buckets a step, so in-backward updates start early and transfers overlap;
        # and buckets in flight take at most a quarter of the tier, whose rest caches state.
        bucket = bucket_bytes or min(64 << 20, room // (4 * inflight), sum(needs) // 4)
        self.bucket_bytes, self.inflight = max(bucket, largest), inflight

    def _grad_bytes(self, slot: ParamSlot, tier: MemoryTier) -> int:
        return 0 if slot.link.lends else tier.value_size(slot.numel * slot.param.element_size())

    def need(self, slot: ParamSlot) -> int:
        """Bytes an update of ``slot`` holds on the state tier (state and, unless the link
        lends it, its gradient)."""
        tier = self._store.tier(self._tier)
        if not isinstance(tier, MemoryTier):
            return 0
        return self._grad_bytes(slot, tier) + (tier.value_size(self._owner._state_bytes(slot)) if slot.paged else 0)

    # -- math off the loop ---------------------------------------------------------------------------

    async def math(self, fn: Callable[[], Any]) -> Any:
        """Run torch math off the loop: on the training thread when it waits in step()."""
        if self.in_step:
            return await self._caller.run(fn)
        return await self._compute.run(fn, Priority.DEMAND)

    def drain_until(self, done: Any) -> None:
        """The training thread, waiting for ``done``: run math handed to it meanwhile."""
        self._caller.drain_until(done)

    # -- buckets ----------------------------------------------------------------------------------

    async def prefetch_first(self, order: list[ParamSlot]) -> None:
        """Once a step, when its first gradient arrives: bring up the states the first updates
        will need (``order``: last step's), up to half the state tier, behind every demand
        request. Later states come with the store's prefetch policy, following the holds."""
        if self._prefetched:
            return
        self._prefetched = True
        budget = self._store.tier(self._tier).capacity // 2
        keys = []
        for slot in order:
            if not slot.paged or slot.key not in self._store:
                continue
            budget -= self._owner._state_bytes(slot)
            if budget < 0:
                break
            keys.append(slot.key)
        if keys:
            await self._store.prefetch(keys, self._tier)

    def add(self, slot: ParamSlot, coef: torch.Tensor | None, after: Any = None) -> None:
        """Add ``slot`` to the open bucket, first launching it if ``slot`` would overfill it.
        ``after``: the link's marker of the device work that must end before weights are written."""
        if self._open and sum(self.need(s) for s in [*self._open, slot]) > self.bucket_bytes:
            self.launch(coef)
        self._open.append(slot)
        self._after = after

    def launch(self, coef: torch.Tensor | None) -> None:
        if self._open:
            bucket, self._open = self._open, []
            self._running.append((bucket, asyncio.ensure_future(self._update(bucket, coef, self.scale, self._after))))

    async def finish(self, *, drop_open: bool = False) -> list[tuple[list[ParamSlot], BaseException]]:
        """Wait for every bucket launched; return those that failed, with their errors (the
        others have finished: one bucket's failure does not stop the rest). ``drop_open``: forget
        the bucket not launched yet (the step is abandoned)."""
        if drop_open:
            self._open = []
        running, self._running = self._running, []
        results = await asyncio.gather(*(task for _, task in running), return_exceptions=True)
        self._prefetched = False
        return [(bucket, result) for (bucket, _), result in zip(running, results, strict=True) if isinstance(result, BaseException)]

    async def _update(self, slots: list[ParamSlot], coef: torch.Tensor | None, scale: torch.Tensor | None, after: Any) -> None:
        """Update a bucket: hold states and gradients, run the math (slots whose state was
        updated by an earlier, failed attempt only send their weight), write the weights."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.inflight)
        todo = [slot for slot in slots if not slot.updated]
        async with self._gate, AsyncExitStack() as stack:
            states = await _enter_all(stack, [self._owner._state(slot) for slot in slots])
            grads = await _enter_all(stack, [self.grad(slot) for slot in todo])
            job = partial(self._compute_bucket, slots, states, grads, coef, scale)
            outgoing, started, computed, ended = await self.math(job)
            for slot in todo:
                slot.updated = True
            report = self._report()
            report.host_update += computed - started
            report.updates += len(todo)
            report.update_elements += sum(s.numel for s in todo)
            self._timeline.add(f"update x{len(todo)}", "host update", started, computed, elements=sum(s.numel for s in todo))
            await self._write_weights(slots, outgoing, after, computed, ended)
        for slot in todo:
            capture = slot.capture
            if capture is not None and capture.lent is None and slot.grad_key in self._store:
                await self._store.delete(slot.grad_key)

    def grad(self, slot: ParamSlot, capture: Capture | None = None) -> AbstractAsyncContextManager[torch.Tensor]:
        """The gradient of ``slot`` its ``capture`` (default: this step's) took to the host:
        the model's own where the link lends, else held in the store."""
        capture = capture or slot.capture
        if capture is None:
            raise RuntimeError(f"internal error: parameter {slot.index} has no gradient to update from")
        if capture.lent is not None:
            return nullcontext(capture.lent)
        return self._store.hold(slot.grad_key, self._tier)

    def _compute_bucket(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], coef: torch.Tensor | None, scale: torch.Tensor | None
    ) -> tuple[list[torch.Tensor | None], float, float, float]:
        """The math of a bucket (training or worker thread); then the new weights: written into
        parameters whose link lends, converted to the parameter's dtype for the others (a link
        copies bytes). Returns what to send per slot and when each part ran."""
        started = time.perf_counter()
        todo = [i for i, slot in enumerate(slots) if not slot.updated]
        if scale is not None and coef is not None:  # unscale, then clip: as scaler.unscale_ + clip_grad_norm_
            inverse = inverse_scale(scale)
            grads, scale = [grad.mul(inverse) for grad in grads], None
        if coef is not None:
            grads = [grad.mul(coef.to(grad.device)) for grad in grads]
        masters: list[torch.Tensor] = [self._owner._master(slot, state) for slot, state in zip(slots, states, strict=True)]
        if todo:
            new = self._owner._apply_many([slots[i] for i in todo], [states[i] for i in todo], grads, scale)
            for i, master in zip(todo, new, strict=True):
                masters[i] = master
        computed = time.perf_counter()
        outgoing: list[torch.Tensor | None] = []
        for slot, master in zip(slots, masters, strict=True):
            weight = master.view(slot.shape)
            if slot.written or offloaded(slot.param) is not None:
                outgoing.append(weight)
            elif slot.link.lends:  # the parameter lives in host memory
                slot.param.data.copy_(weight)
                outgoing.append(None)
            else:
                outgoing.append(weight if slot.param.dtype == weight.dtype else weight.to(slot.param.dtype))
        return outgoing, started, computed, time.perf_counter()

    async def _write_weights(self, slots: list[ParamSlot], outgoing: list[torch.Tensor | None], after: Any, computed: float, ended: float) -> None:
        report = self._report()
        if ended - computed > 1e-4:  # weights written into lent parameters, on the math thread (no link crossed)
            report.weights_to_device += ended - computed
            self._timeline.add(f"weights x{len(slots)}", "weights into parameters", computed, ended)
        transfers: list[tuple[ParamSlot, Transfer]] = []
        errors: list[BaseException] = []
        for slot, weight in zip(slots, outgoing, strict=True):
            if slot.written:
                continue
            offload = offloaded(slot.param)
            if weight is None:
                slot.written = True
            elif offload is not None:  # the weight lives in a store (offload_parameters)
                started = time.perf_counter()
                await offload[0].write_weight(offload[1], weight.to(slot.param.dtype))
                report.weights_to_device += time.perf_counter() - started
                slot.written = True
            else:
                try:
                    transfers.append((slot, slot.link.to_device(slot.param.data, weight, after=after)))
                except BaseException as exc:  # noqa: BLE001 - the others still go; raised below
                    errors.append(exc)
        for slot, transfer in transfers:  # every copy ends before the holds on its source go
            try:
                await transfer
            except Exception as exc:  # noqa: BLE001 - raised once all ended
                errors.append(exc)
                continue
            slot.written = True
            report.weights_to_device += transfer.seconds
            report.weights_to_device_bytes += transfer.nbytes
            self._timeline.add(f"weights {slot.index}", "weights to device", transfer.started or 0.0, transfer.ended or 0.0, bytes=transfer.nbytes)
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        self._compute.shutdown()


async def read_weight(slot: ParamSlot) -> torch.Tensor:
    """The parameter's current value in host memory: across its link, or from its store if it
    is offloaded (``offload_parameters``); the parameter itself where the link lends."""
    offload = offloaded(slot.param)
    if offload is not None:
        return await offload[0].read_weight(offload[1])
    data = slot.param.detach()
    if slot.link.lends:
        return data
    host = torch.empty(data.shape, dtype=data.dtype)
    await slot.link.to_host(host, data.contiguous())
    return host


def offloaded(param: torch.Tensor) -> Any:
    """``(offloader, key)`` if ``param``'s weight lives in a store (``offload_parameters``)."""
    from ..swap import parameters

    return parameters.offloaded(param)


async def _enter_all(stack: AsyncExitStack, managers: list[AbstractAsyncContextManager[Any]]) -> list[Any]:
    """Enter several async context managers at once (their transfers overlap) into ``stack``;
    if one fails, the ones entered are still exited with the stack."""

    async def enter(manager: AbstractAsyncContextManager[Any]) -> Any:
        return await stack.enter_async_context(manager)

    results = await asyncio.gather(*(enter(m) for m in managers), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
