"""``PagedOptimizer``: the machinery shared by the tiered optimizers.

Per parameter, a post-accumulate-grad hook (on the autograd thread) hands the finished gradient
to the store's event loop, which copies it to the host tier and asks for the parameter's state
to be brought up. The update itself (holds on the state and the gradient, the math on a worker
thread, the new weight copied back to the device) runs either

- after backward (default): ``step()`` knows every gradient, so clipping by the global norm is
  exact; gradients and states have been moving during backward, and the updates then run
  pipelined, ``max_inflight`` at a time; or
- in backward (``step_in_backward=True``): each update starts as soon as its gradient is ready
  and ``step()`` only waits for the last ones. Faster, but the update cannot depend on other
  gradients, so global-norm clipping is refused.

Subclasses say what the state is (``_state``) and how to update it (``_apply``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..copies import wait_event
from ..errors import TierFullError
from ..store import TierStore
from ..sync import SyncTierStore, loop_thread, run
from ..tiers import DiskTier, HostTier, MemoryTier
from ..workers import Priority, WorkerPool
from .reports import MemoryReport, Timeline, TimeReport

#: Where the default disk store lives when no ``disk_root`` is given.
DEFAULT_DISK_ROOT = Path(".tierstore") / "optim"


class OptimizerCapacityError(TierFullError):
    """The host tier cannot hold one parameter's state and gradient at once."""


@dataclass(eq=False)
class ParamSlot:
    """Everything the optimizer tracks for one parameter (one record, not parallel maps)."""

    index: int
    group: int
    param: torch.Tensor
    key: str
    paged: bool
    hook: Any = None
    accumulations: int = 0
    grad_task: asyncio.Task[None] | None = None
    arrival: int = 0
    norm: torch.Tensor | None = None
    #: State of a parameter too small to page, kept in host memory.
    resident: dict[str, Any] | None = None

    @property
    def grad_key(self) -> str:
        return f"{self.key}/grad"

    @property
    def numel(self) -> int:
        return self.param.numel()


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
    max_inflight:
        Updates holding state on the host at once.
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
        max_inflight: int = 4,
        key_prefix: str = "optim",
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
        self._slots: list[ParamSlot] = []
        self._key_prefix = key_prefix
        self._min_offload_numel = min_offload_numel
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.max_inflight = max_inflight
        self.state_tier = state_tier
        self._loop = loop_thread()
        self._compute = WorkerPool(1, "optimizer")
        self._compute.start()
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
            self.inflight = self._concurrency()
            self._gate: asyncio.Semaphore = run(_make_semaphore(self.inflight))
        except BaseException:
            self._remove_hooks()  # a half-built optimizer must not keep listening to the model
            self._compute.shutdown()
            raise

    def _concurrency(self) -> int:
        """Updates at once: as many as ``max_inflight``, but never more than the state tier can
        hold together (state and gradient held by each, plus room for one more gradient)."""
        tier = self.store.tier(self.state_tier)
        if not isinstance(tier, MemoryTier) or not self._slots:
            return self.max_inflight
        grads = [tier.allocation_size(slot.numel * slot.param.element_size()) for slot in self._slots]
        needs = [tier.allocation_size(self._state_bytes(slot)) * slot.paged + grad for slot, grad in zip(self._slots, grads, strict=True)]
        largest = max(needs)
        if largest + max(grads) > tier.capacity:
            worst = self._slots[needs.index(largest)]
            raise OptimizerCapacityError(
                f"the {self.state_tier!r} tier ({tier.capacity:,} bytes) cannot hold the state and gradient of parameter "
                f"{worst.index} ({worst.numel:,} elements: {largest:,} bytes) beside another gradient; give it more capacity"
            )
        return max(1, min(self.max_inflight, (tier.capacity - max(grads)) // largest))

    # -- construction --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = len(self.param_groups) - 1
        for param in self.param_groups[group]["params"]:
            if param.is_complex():
                raise TypeError("complex parameters are not supported by the tiered optimizers")
            slot = ParamSlot(
                index=len(self._slots), group=group, param=param, key=f"{self._key_prefix}/{len(self._slots)}",
                paged=param.numel() >= self._min_offload_numel,
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
        elif store._loop is not self._loop:
            raise ValueError("the store was opened on another event loop; open it through tierstore.SyncTierStore or pass it unopened")
        if self.state_tier not in [tier.name for tier in store.tiers] or not isinstance(store.tier(self.state_tier), MemoryTier):
            raise ValueError(f"state_tier {self.state_tier!r} must name a memory tier of the store ({[t.name for t in store.tiers]})")
        store.on_transfer = self._on_transfer
        return store

    def _default_store(self, offload: str, disk_root: Any, host_capacity: Any, disk_capacity: Any) -> TierStore:
        from policies import MIN, ScheduleLearned

        state = sum(self._state_bytes(slot) for slot in self._slots if slot.paged)
        grads = sum(slot.numel * slot.param.element_size() for slot in self._slots)
        if offload == "host":
            return TierStore([HostTier(host_capacity if host_capacity is not None else state + grads + (64 << 20))])
        schedule = ScheduleLearned()
        host = host_capacity if host_capacity is not None else max(64 << 20, (state + grads) // 4)
        root = Path(disk_root) if disk_root is not None else DEFAULT_DISK_ROOT
        disk = disk_capacity if disk_capacity is not None else 2 * (state + grads) + (256 << 20)
        return TierStore([HostTier(host), DiskTier(root, disk)], eviction=lambda: MIN(schedule), prefetch=schedule)

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
        await self.store.put(slot.grad_key, grad, tier=self.state_tier)
        ended = time.perf_counter()
        self._report.grads_to_host += ended - started
        self.timeline.add(f"grad {slot.index}", "grads to host", started, ended, bytes=grad.nbytes)
        slot.arrival = next(self._arrivals)
        if self.max_grad_norm is not None:
            slot.norm = await self._grad_norm(slot, 2.0)
        if slot.paged and slot.key in self.store:
            await self.store.prefetch([slot.key], self.state_tier)
        if self.step_in_backward:
            await self._update(slot, None)

    # -- the step --------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the step: wait for gradients still moving, clip if asked, run (or wait for)
        every update. The time spent here is the training loop's stall."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        run(self._finish_step())
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
            if not self.step_in_backward:
                taken = sorted((s for s in self._slots if s.grad_task is not None), key=lambda s: s.arrival)
                await asyncio.gather(*(self._update(slot, coef) for slot in taken))
            self.store.mark_step()
        finally:
            for slot in self._slots:
                slot.accumulations, slot.grad_task, slot.norm = 0, None, None
            self._clip_coef = None
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
        async with self.store.hold(slot.grad_key, self.state_tier) as grad:
            return await self._compute.run(partial(torch.linalg.vector_norm, grad, norm_type))

    async def _update(self, slot: ParamSlot, coef: torch.Tensor | None) -> None:
        """One parameter's update; at most ``self.inflight`` hold state at once."""
        async with self._gate:
            await self._update_once(slot, coef)

    async def _update_once(self, slot: ParamSlot, coef: torch.Tensor | None) -> None:
        group = self.param_groups[slot.group]
        async with self._state(slot) as state, self.store.hold(slot.grad_key, self.state_tier) as grad:
            started = time.perf_counter()
            on_device = slot.param.device.type != "cpu"
            job = partial(self._apply_and_copy, slot, state, grad, group, coef, not on_device)
            master = await self._compute.run(job, Priority.DEMAND)
            ended = time.perf_counter()
            self._report.host_update += ended - started
            self._report.updates += 1
            self.timeline.add(f"update {slot.index}", "host update", started, ended, elements=slot.numel)
            if on_device:
                await self._copy_to_device(slot, master)
        await self.store.delete(slot.grad_key)

    def _apply_and_copy(self, slot: ParamSlot, state: Any, grad: torch.Tensor, group: dict[str, Any], coef: Any, copy: bool) -> torch.Tensor:
        if coef is not None:
            grad = grad.mul(coef.to(grad.device))
        master = self._apply(slot, state, grad, group)
        if copy:  # the parameter lives in host memory (the CPU stands in for the device)
            slot.param.data.copy_(master.view_as(slot.param))
        return master

    async def _copy_to_device(self, slot: ParamSlot, master: torch.Tensor) -> None:
        started = time.perf_counter()
        device = slot.param.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            slot.param.data.copy_(master.view_as(slot.param), non_blocking=True)
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
            slot.accumulations, slot.grad_task, slot.norm = 0, None, None

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
        weights = sum(slot.numel * slot.param.element_size() for slot in self._slots)
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
        """Remove the hooks, stop the worker thread, and close the store if the optimizer made it."""
        self._remove_hooks()
        self._compute.shutdown()
        if self._owns_store and self.store.is_open:
            run(self.store.aclose(flush=False))

    def _remove_hooks(self) -> None:
        for slot in self._slots:
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled; save opt.state_dict() instead")


def _hook(optimizer: weakref.ref[PagedOptimizer], slot: ParamSlot, param: torch.Tensor) -> None:
    """The hook holds the optimizer weakly: one the program dropped stops listening."""
    live = optimizer()
    if live is not None:
        live._on_grad(slot, param)


def _clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """Exactly what ``torch.nn.utils.clip_grads_with_norm_`` multiplies the gradients by."""
    clip_coef = max_norm / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


async def _make_semaphore(value: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(value)
