"""``PagedOptimizer``: the machinery shared by the tiered optimizers.

Per parameter, a post-accumulate-grad hook (on the autograd thread) hands the finished gradient
to the store's event loop, which copies it to the host tier and asks for the parameter's state
to be brought up. The update itself (holds on the state and the gradient, the math on a worker
thread, the new weight copied back to the device) runs either

- after backward (default): ``step()`` knows every gradient, so clipping by the global norm is
  exact; gradients and states have been moving during backward, and the updates then run in
  buckets (several parameters per fused call), two buckets at a time so one's transfers overlap
  the other's math; or
- in backward (``step_in_backward=True``): a bucket's update starts as soon as its gradients are
  ready and ``step()`` only waits for the last ones. Faster, but the update cannot depend on other
  gradients, so global-norm clipping is refused.

Subclasses say what the state is (``_state``) and how to update it (``_apply``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import warnings
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..copies import wait_event
from ..errors import TierFullError
from ..namespaces import Namespace
from ..store import TierStore
from ..sync import SyncTierStore, loop_thread, run
from ..tiers import DiskTier, HostTier, MemoryTier
from ..units import parse_bytes
from ..workers import CallerPool, Priority, WorkerPool
from .reports import MemoryReport, Timeline, TimeReport

#: Where the default disk store lives when no ``disk_root`` is given.
DEFAULT_DISK_ROOT = Path(".tierstore") / "optim"
#: Optimizers not given a namespace claim the first free ``optim/<n>/``.
DEFAULT_NAMESPACE_BASE = "optim/"


class OptimizerCapacityError(TierFullError):
    """The host tier cannot hold one parameter's state and gradient at once."""


@dataclass(eq=False)
class ParamSlot:
    """Everything the optimizer tracks for one parameter (one record, not parallel maps)."""

    index: int
    group: int
    param: torch.Tensor
    key: str
    #: The parameter's shape (its data may be a placeholder while ``offload_parameters`` keeps
    #: the weight in a store).
    shape: torch.Size
    paged: bool
    hook: Any = None
    accumulations: int = 0
    grad_task: asyncio.Task[None] | None = None
    arrival: int = 0
    norm: torch.Tensor | None = None
    #: The gradient itself when the parameter is in host memory (the CPU stands in for the
    #: device): copying it to the host tier would copy memory onto the same memory.
    grad: torch.Tensor | None = None
    #: State of a parameter too small to page, kept in host memory.
    resident: dict[str, Any] | None = None

    @property
    def grad_key(self) -> str:
        return f"{self.key}/grad"

    @property
    def numel(self) -> int:
        return self.shape.numel()


class PagedOptimizer(torch.optim.Optimizer):
    """Base of ``TieredAdam``/``TieredAdamW``/``TieredOptimizer`` (see the module docstring).

    Store options (all keyword-only):

    store:
        A ``TierStore`` (opened here if it is not), a ``SyncTierStore``, or None for a default
        store: ``offload="host"`` keeps all state in host memory, ``offload="disk"`` adds a
        ``DiskTier`` at ``disk_root`` (default ``.tierstore/optim``) under a host tier of
        ``host_capacity`` (default a quarter of the state), with learned prefetch and MIN eviction.
    state_tier:
        The tier updates run on (default ``"host"``).
    step_in_backward:
        Update each parameter as soon as its gradient is ready (see above).
    max_grad_norm:
        Clip gradients to this global 2-norm at every step (as ``clip_grad_norm_`` would).
    gradient_accumulation_steps:
        Backward passes per step; hooks act on the last one. ``step()`` also handles any
        parameter whose gradient arrived another way.
    min_offload_numel:
        Parameters with fewer elements keep their state in host memory, outside the store.
    namespace:
        The key namespace (prefix) of this optimizer in the store, claimed for it (see
        ``tierstore.namespaces``). Default: a fresh ``optim/<n>/`` per optimizer, so several
        optimizers share a store (a GAN's two), dropped with its keys by ``close()``. A named
        namespace outlives the optimizer: ``close()`` leaves the state in it, and a later
        optimizer of the same class claiming the same name (after a restart too) continues
        from it where the class can (``TieredAdam``/``TieredAdamW``); other keys found in it
        are deleted, being its own. A namespace claimed live elsewhere, recorded for another
        owner, or holding keys nobody claimed raises ``NamespaceClaimedError``.
    overwrite:
        Take the named namespace over even in those last two cases (deleting what is there).
    key_prefix:
        Deprecated alias of ``namespace``.
    max_inflight:
        Buckets of updates holding state on the host at once (default 2: one loads while the
        other computes).
    bucket_bytes:
        State and gradient bytes updated together in one call (default: what the state tier
        can hold for ``max_inflight`` buckets, at most 64 MiB).
    """

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        store: TierStore | SyncTierStore | None = None,
        offload: str = "host",
        disk_root: str | os.PathLike[str] | None = None,
        host_capacity: int | str | None = None,
        disk_capacity: int | str | None = None,
        state_tier: str = "host",
        step_in_backward: bool = False,
        max_grad_norm: float | None = None,
        gradient_accumulation_steps: int = 1,
        min_offload_numel: int = 4096,
        max_inflight: int = 2,
        bucket_bytes: int | str | None = None,
        namespace: str | None = None,
        overwrite: bool = False,
        key_prefix: str | None = None,
    ) -> None:
        if offload not in ("host", "disk"):
            raise ValueError(f"offload must be 'host' or 'disk', not {offload!r}")
        if step_in_backward and max_grad_norm is not None:
            raise ValueError(
                "max_grad_norm needs every gradient before any update, so it cannot be combined with "
                "step_in_backward=True; use the default (updates after backward, still pipelined)"
            )
        if gradient_accumulation_steps < 1 or max_inflight < 1:
            raise ValueError("gradient_accumulation_steps and max_inflight must be at least 1")
        if key_prefix is not None:
            warnings.warn("key_prefix is deprecated; pass namespace=", DeprecationWarning, stacklevel=3)
            if namespace is not None and namespace != key_prefix:
                raise ValueError("pass namespace= only (key_prefix is its deprecated alias)")
            namespace = key_prefix
        self._slots: list[ParamSlot] = []
        #: The claimed key namespace (set once the store is bound; slot keys live under it).
        self.namespace: Namespace | None = None
        self._min_offload_numel = min_offload_numel
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_inflight = max_inflight
        self.bucket_bytes = parse_bytes(bucket_bytes) if bucket_bytes is not None else 0
        self._bucket: list[ParamSlot] = []
        #: The order gradients arrived in last step: this step's updates will follow it.
        self._last_order: list[ParamSlot] = []
        self._prefetched_this_step = False
        self._bucket_tasks: list[asyncio.Task[None]] = []
        self.state_tier = state_tier
        self._loop = loop_thread()
        # Math runs on the training thread while it waits in step(); during backward (norms,
        # step_in_backward updates) on a worker thread.
        self._compute = WorkerPool(1, "optimizer")
        self._compute.start()
        self._caller = CallerPool()
        self._streams: dict[torch.device, Any] = {}
        self._in_step = False
        self.timeline = Timeline()
        self._last_timeline: list[Any] = []
        self._report = TimeReport(mode="in-backward" if step_in_backward else "after-backward")
        self._last_report = TimeReport(mode=self._report.mode)
        self._arrivals = itertools.count()
        self._clip: tuple[float, float] | None = None
        self._clip_coef: torch.Tensor | None = None
        self._steps = 0
        self._window_start = time.perf_counter()
        self._links_at_window: dict[str, tuple[int, float]] = {}
        self._owns_store = store is None
        try:
            super().__init__(params, defaults)
            self.store: TierStore = self._bind_store(store, offload, disk_root, host_capacity, disk_capacity)
            self.namespace = run(self._claim(namespace, overwrite))
            for slot in self._slots:
                slot.key = self.namespace.key(str(slot.index))
            self.bucket_bytes, self.inflight = self._plan()
            self._gate: asyncio.Semaphore = run(_make_semaphore(self.inflight))
            run(self._adopt())
        except BaseException:
            self._remove_hooks()  # a half-built optimizer must not keep listening to the model
            self._compute.shutdown()
            if self.namespace is not None:  # nor keep its namespace
                run(self.namespace.drop() if self.namespace.auto else self.namespace.release())
            raise

    async def _weight(self, slot: ParamSlot) -> torch.Tensor:
        """The parameter's current value as a CPU tensor (from its store if it is offloaded)."""
        offload = _offloaded(slot.param)
        if offload is not None:
            return await offload[0].read_weight(offload[1])
        return slot.param.detach().cpu()

    def _plan(self) -> tuple[int, int]:
        """(bucket bytes, buckets at once). A bucket is parameters updated together (one fused
        call, one thread hop): as many as ``bucket_bytes`` of state and gradients hold, in the
        order the gradients arrive. Two buckets at once overlap one's transfers with the other's
        math; the state tier must hold them both, plus room for one more gradient."""
        tier = self.store.tier(self.state_tier)
        if not isinstance(tier, MemoryTier) or not self._slots:
            return self.bucket_bytes or (64 << 20), self.max_inflight
        needs = [self._need(slot, tier) for slot in self._slots]
        grads = [tier.value_size(slot.numel * slot.param.element_size()) * (slot.param.device.type != "cpu") for slot in self._slots]
        largest = max(needs)
        room = tier.capacity * 9 // 10 - max(grads)  # a tenth left for arrivals and state being created
        if largest > room:
            worst = self._slots[needs.index(largest)]
            raise OptimizerCapacityError(
                f"the {self.state_tier!r} tier ({tier.capacity:,} bytes) cannot hold the state and gradient of parameter "
                f"{worst.index} ({worst.numel:,} elements: {largest:,} bytes) beside another gradient; give it more capacity"
            )
        tiers = self.store.tiers
        if tiers.index(tier) == len(tiers) - 1:
            # Nothing pages below the state tier: no transfers to overlap, and a second bucket's
            # bookkeeping would only slow the math. One bucket (four when updating in backward,
            # so updates start while backward runs).
            whole = sum(needs) // (4 if self.step_in_backward else 1)
            return max(self.bucket_bytes or whole, largest), 1
        inflight = max(1, min(self.max_inflight, room // largest))
        # At least four buckets a step, so in-backward updates start early and transfers overlap;
        # and buckets in flight take at most a quarter of the tier, whose rest caches state.
        bucket = self.bucket_bytes or min(64 << 20, room // (4 * inflight), sum(needs) // 4)
        return max(bucket, largest), inflight

    def _need(self, slot: ParamSlot, tier: MemoryTier) -> int:
        """Bytes an update of ``slot`` holds on the state tier (state and, for a parameter on a
        device, its gradient)."""
        grad = tier.value_size(slot.numel * slot.param.element_size()) if slot.param.device.type != "cpu" else 0
        return grad + (tier.value_size(self._state_bytes(slot)) if slot.paged else 0)

    # -- construction --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = len(self.param_groups) - 1
        for param in self.param_groups[group]["params"]:
            if param.is_complex():
                raise TypeError("complex parameters are not supported by the tiered optimizers")
            offload = _offloaded(param)
            shape = offload[0].shape_of(offload[1]) if offload is not None else param.shape
            index = len(self._slots)
            slot = ParamSlot(
                index=index, group=group, param=param, key=self.namespace.key(str(index)) if self.namespace is not None else "",
                shape=shape, paged=shape.numel() >= self._min_offload_numel,
            )
            if param.requires_grad:
                slot.hook = param.register_post_accumulate_grad_hook(partial(_hook, weakref.ref(self), slot))
            self._slots.append(slot)

    def _bind_store(self, store: Any, offload: str, disk_root: Any, host_capacity: Any, disk_capacity: Any) -> TierStore:
        if isinstance(store, SyncTierStore):
            store = store.store
        if store is None:
            store = self._default_store(offload, disk_root, host_capacity, disk_capacity)
        if not isinstance(store, TierStore):
            raise TypeError(f"store must be a TierStore or SyncTierStore, not {type(store).__name__}")
        if not store.is_open:
            run(store.open())
        elif store.loop is not self._loop:
            raise ValueError("the store was opened on another event loop; open it through tierstore.SyncTierStore or pass it unopened")
        if self.state_tier not in [tier.name for tier in store.tiers] or not isinstance(store.tier(self.state_tier), MemoryTier):
            raise ValueError(f"state_tier {self.state_tier!r} must name a memory tier of the store ({[t.name for t in store.tiers]})")
        store.on_transfer = self._on_transfer
        return store

    async def _claim(self, name: str | None, overwrite: bool) -> Namespace:
        owner = type(self).__name__
        if name is None:
            return await self.store.claim_unique(DEFAULT_NAMESPACE_BASE, owner=owner)
        return await self.store.claim(name, owner=owner, overwrite=overwrite)

    async def _adopt(self) -> None:
        """Take up what an earlier optimizer left in our (named) namespace. This class cannot
        continue from it, and the keys are ours: delete them. Subclasses that can, override."""
        if self.namespace is not None:
            await self.namespace.clear()

    async def _save_for_restart(self) -> None:
        """Put what lives outside the store (step counts, small states) into the namespace,
        so a later optimizer claiming it continues from it (``close()`` calls this for a
        named namespace). Subclasses that can adopt state override it."""

    def _default_store(self, offload: str, disk_root: Any, host_capacity: Any, disk_capacity: Any) -> TierStore:
        from policies import MIN, ScheduleLearned

        state = sum(self._state_bytes(slot) for slot in self._slots if slot.paged)
        grads = sum(slot.numel * slot.param.element_size() for slot in self._slots if slot.param.device.type != "cpu")
        if offload == "host":
            return TierStore([HostTier(host_capacity if host_capacity is not None else state + grads + (64 << 20))])
        schedule = ScheduleLearned()
        host = host_capacity if host_capacity is not None else max(64 << 20, (state + grads) // 4)
        root = Path(disk_root) if disk_root is not None else DEFAULT_DISK_ROOT
        disk = disk_capacity if disk_capacity is not None else 2 * (state + grads) + (256 << 20)
        # Paged state is scratch (checkpoints go through state_dict): no fsync per write-back.
        return TierStore([HostTier(host), DiskTier(root, disk, durable=False)], eviction=lambda: MIN(schedule), prefetch=schedule)

    # -- what subclasses provide ---------------------------------------------------------------

    @abstractmethod
    def _state_bytes(self, slot: ParamSlot) -> int:
        """Bytes of optimizer state for ``slot`` (for default capacities and reports)."""

    @abstractmethod
    def _state(self, slot: ParamSlot) -> AbstractAsyncContextManager[Any]:
        """An async context (on the loop) giving the slot's state, writable, created if absent."""

    @abstractmethod
    def _apply(self, slot: ParamSlot, state: Any, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Update ``state`` with ``grad`` (worker thread); return the fp32 master weight."""

    # -- backward: gradients arrive ------------------------------------------------------------

    def _on_grad(self, slot: ParamSlot, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook (autograd thread): hand the gradient to the loop."""
        slot.accumulations += 1
        if slot.accumulations < self.gradient_accumulation_steps:
            return
        if slot.accumulations > self.gradient_accumulation_steps:
            raise RuntimeError(
                f"parameter {slot.index} got more backward passes ({slot.accumulations}) than "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} before step()"
            )
        grad = param.grad
        if grad is None:
            return
        event = None
        if grad.is_cuda:  # the copy to host must follow the kernels that produced the gradient
            event = torch.cuda.Event()
            event.record()
        self._loop.call_soon_threadsafe(self._start_grad, slot, grad, event)

    def _start_grad(self, slot: ParamSlot, grad: torch.Tensor, event: Any) -> None:
        if slot.grad_task is None:
            slot.grad_task = asyncio.ensure_future(self._take_grad(slot, grad, event))

    async def _take_grad(self, slot: ParamSlot, grad: torch.Tensor, event: Any) -> None:
        if event is not None:
            await wait_event(event)
        started = time.perf_counter()
        if grad.device.type == "cpu":
            slot.grad = grad
        else:
            await self.store.put(slot.grad_key, grad, tier=self.state_tier)
        ended = time.perf_counter()
        self._report.grads_to_host += ended - started
        self.timeline.add(f"grad {slot.index}", "grads to host", started, ended, bytes=grad.nbytes)
        slot.arrival = next(self._arrivals)
        if not self._prefetched_this_step:
            self._prefetched_this_step = True
            await self._prefetch_first_states()
        if self.max_grad_norm is not None:
            slot.norm = await self._grad_norm(slot, 2.0)
        if self.step_in_backward:
            self._add_to_bucket(slot, None)

    async def _prefetch_first_states(self) -> None:
        """When backward starts, bring up the states the first updates will need (the order is
        last step's), up to half the state tier, behind every demand request. Later states come
        with the store's prefetch policy, which follows the holds as the updates run."""
        tier = self.store.tier(self.state_tier)
        budget = tier.capacity // 2
        keys = []
        for slot in self._last_order:
            if not slot.paged or slot.key not in self.store:
                continue
            budget -= self._state_bytes(slot)
            if budget < 0:
                break
            keys.append(slot.key)
        if keys:
            await self.store.prefetch(keys, self.state_tier)

    def _groups_for_saving(self) -> list[dict[str, Any]]:
        """``param_groups`` as torch saves them: hyperparameters, and parameter indices."""
        groups, index = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(saved)
        return groups

    # -- the step --------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the step: wait for gradients still moving, clip if asked, run (or wait for)
        every update. The time spent here is the training loop's stall."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        self._in_step = True
        try:
            finishing = asyncio.run_coroutine_threadsafe(self._finish_step(), self._loop)
            self._caller.drain_until(finishing)
            finishing.result()
        finally:
            self._in_step = False
        ended = time.perf_counter()
        self._report.stall += ended - started
        self.timeline.add("step() wait", "train loop", started, ended)
        self._close_window(ended)
        return loss

    async def _finish_step(self) -> None:
        try:
            await self._gather_grads()
            coef = self._clip_coef
            if coef is None and self.max_grad_norm is not None:
                coef = _clip_coefficient(self.max_grad_norm, await self._total_norm(2.0))
            if self.step_in_backward:
                self._launch_bucket(None)
            else:
                for slot in sorted((s for s in self._slots if s.grad_task is not None), key=lambda s: s.arrival):
                    self._add_to_bucket(slot, coef)
                self._launch_bucket(coef)
            tasks, self._bucket_tasks = self._bucket_tasks, []
            await asyncio.gather(*tasks)
            self._last_order = sorted((s for s in self._slots if s.grad_task is not None), key=lambda s: s.arrival)
            self.store.mark_step()
        finally:
            for slot in self._slots:
                slot.accumulations, slot.grad_task, slot.norm, slot.grad = 0, None, None, None
            self._clip_coef = None
            self._bucket = []
            self._prefetched_this_step = False
            self._steps += 1

    async def _gather_grads(self) -> None:
        """Take gradients the hooks did not hand over (no hook, or fewer backward passes)."""
        for slot in self._slots:
            if slot.grad_task is None and slot.param.grad is not None:
                slot.grad_task = asyncio.ensure_future(self._take_grad(slot, slot.param.grad, None))
        tasks = [slot.grad_task for slot in self._slots if slot.grad_task is not None]
        await asyncio.gather(*tasks)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip this step's gradients to a global norm, like ``torch.nn.utils.clip_grad_norm_``
        on the model's parameters; call it between backward and ``step()``. Returns the total
        norm. The gradients on the device are left as they are; the update uses clipped ones."""
        if self.step_in_backward:
            raise RuntimeError("with step_in_backward=True the updates already ran during backward; clipping is not possible")
        started = time.perf_counter()
        total = run(self._clip_now(float(max_norm), float(norm_type)))
        self._report.stall += time.perf_counter() - started
        return total

    async def _clip_now(self, max_norm: float, norm_type: float) -> torch.Tensor:
        await self._gather_grads()
        total = await self._total_norm(norm_type)
        self._clip_coef = _clip_coefficient(max_norm, total)
        return total

    async def _total_norm(self, norm_type: float) -> torch.Tensor:
        norms = []
        for slot in self._slots:
            if slot.grad_task is None:
                continue
            if slot.norm is None or norm_type != 2.0:
                slot.norm = await self._grad_norm(slot, norm_type)
            norms.append(slot.norm)
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    async def _grad_norm(self, slot: ParamSlot, norm_type: float) -> torch.Tensor:
        async with self._grad(slot) as grad:
            return await self._math(partial(torch.linalg.vector_norm, grad, norm_type))

    def _grad(self, slot: ParamSlot) -> AbstractAsyncContextManager[torch.Tensor]:
        """This step's gradient of ``slot`` on the host: held in the store, or the model's own."""
        if slot.grad is not None:
            return nullcontext(slot.grad)
        return self.store.hold(slot.grad_key, self.state_tier)

    async def _math(self, fn: Callable[[], Any]) -> Any:
        """Run torch math off the loop: on the training thread when it waits in step()."""
        if self._in_step:
            return await self._caller.run(fn)
        return await self._compute.run(fn, Priority.DEMAND)

    def _add_to_bucket(self, slot: ParamSlot, coef: torch.Tensor | None) -> None:
        """Add ``slot`` to the open bucket, first launching it if ``slot`` would overfill it."""
        if self._bucket and self._bucket_size([*self._bucket, slot]) > self.bucket_bytes:
            self._launch_bucket(coef)
        self._bucket.append(slot)

    def _bucket_size(self, slots: list[ParamSlot]) -> int:
        tier = self.store.tier(self.state_tier)
        return sum(self._need(slot, tier) for slot in slots) if isinstance(tier, MemoryTier) else 0

    def _launch_bucket(self, coef: torch.Tensor | None) -> None:
        if self._bucket:
            bucket, self._bucket = self._bucket, []
            self._bucket_tasks.append(asyncio.ensure_future(self._update(bucket, coef)))

    async def _update(self, slots: list[ParamSlot], coef: torch.Tensor | None) -> None:
        """Update a bucket of parameters: hold their states and gradients on the state tier,
        run the math in one call, copy the new weights to the device. At most ``self.inflight``
        buckets hold state at once."""
        async with self._gate, AsyncExitStack() as stack:
            states = await _enter_all(stack, [self._state(slot) for slot in slots])
            grads = await _enter_all(stack, [self._grad(slot) for slot in slots])
            offloads = [_offloaded(slot.param) for slot in slots]
            copy_here = [slot.param.device.type == "cpu" and offload is None for slot, offload in zip(slots, offloads, strict=True)]
            job = partial(self._apply_and_copy, slots, states, grads, coef, copy_here)
            masters, started, computed, ended = await self._math(job)
            self._report.host_update += computed - started
            self._report.updates += len(slots)
            self._report.update_elements += sum(s.numel for s in slots)
            self.timeline.add(f"update x{len(slots)}", "host update", started, computed, elements=sum(s.numel for s in slots))
            if ended > computed:  # the CPU stands in for the device: this copy is the weights' trip
                self._report.weights_to_device += ended - computed
                self.timeline.add(f"weights x{len(slots)}", "weights to device", computed, ended)
            for slot, master, here, offload in zip(slots, masters, copy_here, offloads, strict=True):
                if offload is not None:  # the weight lives in a store (offload_parameters)
                    started = time.perf_counter()
                    await offload[0].write_weight(offload[1], master.view(slot.shape).to(slot.param.dtype))
                    self._report.weights_to_device += time.perf_counter() - started
                elif not here:
                    await self._copy_to_device(slot, master)
        for slot in slots:
            if slot.grad is None:
                await self.store.delete(slot.grad_key)

    def _apply_and_copy(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], coef: Any, copy_here: list[bool]
    ) -> tuple[list[torch.Tensor], float, float, float]:
        """The math of a bucket (training or worker thread), then the copy of new weights into
        parameters that live in host memory; returns the masters and when each part ran."""
        started = time.perf_counter()
        if coef is not None:
            grads = [grad.mul(coef.to(grad.device)) for grad in grads]
        masters = self._apply_many(slots, states, grads)
        computed = time.perf_counter()
        for slot, master, here in zip(slots, masters, copy_here, strict=True):
            if here:  # the parameter lives in host memory (the CPU stands in for the device)
                slot.param.data.copy_(master.view(slot.shape))
        return masters, started, computed, time.perf_counter()

    def _apply_many(self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Update several parameters; subclasses that can batch the math override this."""
        return [self._apply(slot, state, grad, self.param_groups[slot.group]) for slot, state, grad in zip(slots, states, grads, strict=True)]

    async def _copy_to_device(self, slot: ParamSlot, master: torch.Tensor) -> None:
        started = time.perf_counter()
        device = slot.param.device
        stream = self._streams.get(device)
        if stream is None:  # one side stream per device, reused for every copy
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            slot.param.data.copy_(master.view(slot.shape), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        await wait_event(event)
        ended = time.perf_counter()
        self._report.weights_to_device += ended - started
        self.timeline.add(f"weights {slot.index}", "weights to device", started, ended)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and any the optimizer took this step without stepping."""
        super().zero_grad(set_to_none)
        if any(slot.grad_task is not None or slot.accumulations for slot in self._slots):
            run(self._discard_grads())

    async def _discard_grads(self) -> None:
        tasks = [slot.grad_task for slot in self._slots if slot.grad_task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in self._slots:
            if slot.grad_task is not None and slot.grad_key in self.store:
                await self.store.delete(slot.grad_key)
            slot.accumulations, slot.grad_task, slot.norm, slot.grad = 0, None, None, None

    # -- reports ---------------------------------------------------------------------------------

    def _on_transfer(self, link: str, nbytes: int, start: float, end: float) -> None:
        self.timeline.add(f"{nbytes:,} B", link, start, end, bytes=nbytes)

    def _close_window(self, now: float) -> None:
        report = self._report
        links = self.store.counters.links
        for name, stats in links.items():
            before_bytes, before_seconds = self._links_at_window.get(name, (0, 0.0))
            if name.startswith("disk->"):
                report.disk_read += stats.seconds - before_seconds
                report.disk_read_bytes += stats.nbytes - before_bytes
            elif name.endswith("->disk"):
                report.disk_write += stats.seconds - before_seconds
                report.disk_write_bytes += stats.nbytes - before_bytes
        self._links_at_window = {name: (s.nbytes, s.seconds) for name, s in links.items()}
        report.step = self._steps
        report.step_wall = now - self._window_start
        self._last_report, self._report = report, TimeReport(mode=report.mode)
        self._last_timeline = self.timeline.events()
        self.timeline.clear()
        self._window_start = now

    def time_report(self) -> TimeReport:
        """Where the last step's time went (from the end of the step before to the end of it)."""
        return self._last_report

    def write_timeline(self, path: str | os.PathLike[str]) -> None:
        """Write the last step as a Chrome trace (open in Perfetto or chrome://tracing)."""
        timeline = Timeline()
        timeline._origin = self.timeline._origin
        for name, track, start, end, args in self._last_timeline:
            timeline.add(name, track, start, end, **args)
        timeline.write(Path(path))

    def memory_report(self) -> MemoryReport:
        """Bytes per parameter and totals: weights and grads on the device, state by tier."""
        return run(self._memory_report())

    async def _memory_report(self) -> MemoryReport:
        by_tier: dict[str, int] = {tier.name: 0 for tier in self.store.tiers}
        resident = resident_params = paged = 0
        for slot in self._slots:
            size = self._state_bytes(slot)
            if not slot.paged:
                resident += size if slot.resident is not None else 0
                resident_params += 1
                continue
            paged += slot.numel
            if slot.key in self.store:
                for tier in self.store.where(slot.key)[:1]:
                    by_tier[tier] += size
        params = sum(slot.numel for slot in self._slots)
        weights = sum(slot.numel * slot.param.element_size() for slot in self._slots if _offloaded(slot.param) is None)
        grads = sum(slot.numel * slot.param.element_size() for slot in self._slots if slot.param.requires_grad)
        state = sum(self._state_bytes(slot) for slot in self._slots)
        tiers = {name: {"used": t["used"], "capacity": t["capacity"]} for name, t in self.store.stats()["tiers"].items()}
        return MemoryReport(
            parameters=params, paged_parameters=paged, device_weight_bytes=weights, device_grad_bytes=grads,
            state_by_tier=by_tier, resident_state_bytes=resident, resident_parameters=resident_params,
            state_bytes_per_param=state / max(params, 1), tiers=tiers,
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks, stop the worker thread, end the namespace's claim, and close the
        store if the optimizer made it. A default namespace is dropped with its keys; a named
        one keeps the state (and step counts) for a later optimizer claiming it."""
        self._remove_hooks()
        self._compute.shutdown()
        namespace = self.namespace
        if not self.store.is_open:
            return
        if namespace is not None and namespace.live:
            if namespace.auto:
                run(namespace.drop())
            else:
                run(self._save_for_restart())
                run(namespace.release())
        if self._owns_store:
            run(self.store.aclose(flush=namespace is not None and not namespace.auto))

    def _remove_hooks(self) -> None:
        for slot in self._slots:
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled; save opt.state_dict() instead")


def _offloaded(param: torch.Tensor) -> Any:
    from ..swap.parameters import offloaded

    return offloaded(param)


def _hook(optimizer: weakref.ref[PagedOptimizer], slot: ParamSlot, param: torch.Tensor) -> None:
    """The hook holds the optimizer weakly: one the program dropped stops listening."""
    live = optimizer()
    if live is not None:
        live._on_grad(slot, param)


def _clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """Exactly what ``torch.nn.utils.clip_grads_with_norm_`` multiplies the gradients by."""
    clip_coef = max_norm / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


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


async def _make_semaphore(value: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(value)
