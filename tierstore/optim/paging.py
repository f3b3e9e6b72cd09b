"""``PagedOptimizer``: the machinery shared by the tiered optimizers, composed of

- ``slots``: one record per parameter;
- ``capture``: gradients to the host tier, speculatively when their hook fires, checked against
  ``p.grad`` at ``step()`` (torch's semantics: what the loop did to ``p.grad`` counts);
- ``clipping``: the global norm, computed ahead on the host copies;
- ``pipeline``: updates in buckets (holds, math off the loop, weights back to the device);
- ``reports``: where the bytes are and where the time went.

The updates run either after backward (default: ``step()`` knows every gradient, so clipping by
the global norm is exact; gradients and states have been moving during backward, and the
updates then run in buckets, two at a time so one's transfers overlap the other's math), or in
backward (``step_in_backward=True``): a bucket's update starts as soon as its gradients are
ready and ``step()`` only waits for the last ones. Faster, but the update uses ``p.grad`` as
backward left it: a loop that changes gradients after backward (clipping, unscaling, DDP
averaging without ``attach_ddp``, replacing one or setting it to None) gets a ``RuntimeError``
from ``step()`` saying which parameters, and more backward passes than
``gradient_accumulation_steps`` before ``step()`` raise in backward.

Every crossing between the model's device and the host goes through the parameter's link
(``tierstore.device.link_for``): CUDA, the emulated device, or none (plain CPU, where the
gradients are lent and the weights written in place). Subclasses say what the state is
(``_state``, ``_master``) and how to update it (``_apply``/``_apply_many``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import numbers
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..device import Link
from ..errors import OptimizerClosedError, StepIncompleteError, StoreLockedError, TierFullError
from ..flags import require_flag
from ..namespaces import Namespace
from ..store import TierStore
from ..sync import (
    SyncTierStore,
    call_now,
    close_at_exit,
    finish_at_exit,
    loop_thread,
    run,
    wait_unfinished,
)
from ..tensors import PLAIN_TENSOR_TYPES
from ..tiers import MemoryTier
from ..tiers.memory import device_link
from ..units import parse_bytes
from ..warn import context_of_call, warn
from ..workers import WorkerPool
from .capture import GradientCapture, observe
from .chunks import DEFAULT_CHUNK_BYTES
from .clipping import clip_coefficient, inverse_scale
from .distributed import (
    LocalShard,
    Sharding,
    is_dtensor,
    materialize,
    mesh_group,
    mesh_total_norm,
    rank_folder,
)
from .pipeline import OptimizerCapacityError, UpdatePipeline, offloaded, read_weight
from .reports import (
    MemoryPlan,
    MemoryReport,
    StepWindow,
    Timeline,
    TimeReport,
    memory_report,
    plan_memory,
    state_residency,
)
from .resident import Piece, ResidentStep
from .setup import DEFAULT_DISK_ROOT, bind_store, default_store
from .slots import ParamSlot
from .steps import StepRunner, closes_store

#: Optimizers not given a namespace claim the first free ``optim/<n>/``.
DEFAULT_NAMESPACE_BASE = "optim/"
__all__ = ["DEFAULT_DISK_ROOT", "DEFAULT_NAMESPACE_BASE", "OptimizerCapacityError", "PagedOptimizer", "ParamSlot"]


class PagedOptimizer(torch.optim.Optimizer):
    """Base of ``TieredAdam``/``TieredAdamW``/``TieredOptimizer`` (see the module docstring).

    Store options (all keyword-only):

    store:
        A ``TierStore`` (opened here if it is not), a ``SyncTierStore``, or None for a default
        store: ``offload="host"`` keeps all state in host memory, ``offload="disk"`` adds a
        ``DiskTier`` at ``disk_root`` (default ``.tierstore/optim``) under a host tier of
        ``host_capacity`` (default a quarter of the paged state plus the gradients' host copies,
        at least 64 MiB), with learned prefetch and MIN eviction.
    state_tier:
        The tier updates run on (default ``"host"``).
    step_in_backward:
        Update each parameter as soon as its gradient is ready (see above).
    max_grad_norm:
        Clip gradients to this global 2-norm at every step (as ``clip_grad_norm_`` would), on
        the host copies: faster than clipping ``p.grad`` yourself, which changes every gradient
        after backward so that each is copied to the host again. The norms are summed in this
        optimizer's parameter order (its groups one after the other): the same bits as
        ``clip_grad_norm_`` given the parameters in that order (``clip_grad_norm_(x,
        parameters=model.parameters())`` sums in the model's).
    gradient_accumulation_steps:
        A hint: backward passes per step. Hooks of the other passes copy nothing (saving
        copies); any number of passes is still right without it, except with step_in_backward.
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
        State and gradient bytes updated together in one call (default: a quarter of what the
        state tier holds for ``max_inflight`` buckets, at most 64 MiB). Where buckets pipeline
        (state pages below the state tier, or crosses a device link), a larger value is capped
        at what the tier holds for ``max_inflight`` buckets (``bucket_bytes`` says the size used).
    chunk_bytes:
        A parameter whose state (and host gradient) is larger than this (default 32 MiB, and
        at most what the state tier holds for ``2 * max_inflight + 2`` chunks) is paged, prefetched,
        updated and written back in chunks of it (``tierstore.optim.chunks``), so the state tier
        can be far smaller than the largest parameter's state. None: never chunk.
    emulate_device:
        CPU parameters count as device memory behind an emulated link (True), as host memory
        (False), or as the process setting says (None: ``tierstore.device.emulate_device``,
        ``TIERSTORE_EMULATE_DEVICE``). On a store with a ``DeviceTier`` on the parameters'
        device, that tier's link decides, as for swapping; a True/False that contradicts it
        raises ``ValueError``.
    process_group:
        Shard the state across this ``torch.distributed`` group (``True``: the default group;
        ``None`` or ``False``: no sharding):
        each rank owns, pages and updates about 1/N of the parameters (by bytes) and broadcasts
        their new weights after ``step()``; see ``tierstore.optim.distributed``. Under an
        initialized process group the default disk store lives in ``{disk_root}/rank{r}``.
        FSDP2's DTensor parameters need no option: each rank pages its local shards.
    zero_stage:
        With ``process_group``: 1 (default) updates after the model's all-reduce (DDP's); 2
        reduce-scatters the gradients to their owners itself (for a model not wrapped in DDP).
    unscale_in_step:
        With a ``GradScaler``, take its scale and inf flag into ``step()`` and unscale the host
        copies of the gradients (default), as torch's fused optimizers do; False: the scaler
        unscales ``p.grad`` itself first (on a device each gradient then crosses to the host
        again at ``step()``). Lightning refuses gradient clipping with an optimizer that
        unscales in ``step()`` (torch's fused AdamW too), under any mixed precision, bf16 too:
        pass False there.

    A ``step()`` that fails part-way (a full disk, a checksum error) raises
    ``StepIncompleteError`` naming the parameters it updated; calling ``step()`` again completes
    it without applying any update twice (``zero_grad()`` abandons it instead).
    """

    #: The memory plan last made (what ``memory_plan()`` gives once closed).
    _plan: MemoryPlan
    #: ``GradScaler.step`` hands us its scale and inf flag (``grad_scale``/``found_inf``
    #: attributes) instead of unscaling ``p.grad`` itself: the host copies are unscaled.
    _step_supports_amp_scaling = True
    #: Whether the subclass keeps its checkpoints by global parameter index (``process_group=``).
    _supports_sharding = False
    #: Param-group keys that choose how state is stored, not how it is updated: not saved.
    _unsaved_group_keys: tuple[str, ...] = ()
    #: It writes the updated weights of ``offload_parameters``' parameters into their store
    #: (another optimizer meets their size-0 placeholders: ``tierstore.swap`` refuses its step).
    writes_offloaded_weights = True

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
        chunk_bytes: int | str | None = DEFAULT_CHUNK_BYTES,
        namespace: str | None = None,
        overwrite: bool = False,
        key_prefix: str | None = None,
        emulate_device: bool | None = None,
        process_group: Any = None,
        zero_stage: int = 1,
        unscale_in_step: bool = True,
    ) -> None:
        for name, flag in (("unscale_in_step", unscale_in_step), ("step_in_backward", step_in_backward), ("overwrite", overwrite)):
            require_flag(name, flag)
        require_flag("emulate_device", emulate_device, none="as tierstore.device.emulate_device or TIERSTORE_EMULATE_DEVICE says")
        if not unscale_in_step and process_group not in (None, False) and zero_stage == 2:
            raise ValueError(
                "unscale_in_step=False with zero_stage=2: each rank's GradScaler would check its own gradients before "
                "the reduce-scatter, so ranks would disagree on skipped steps (and wait for each other); use zero_stage=1 "
                "with DDP (its all-reduce comes first), or the default unscale_in_step=True"
            )
        if step_in_backward and process_group not in (None, False) and zero_stage == 2:
            raise ValueError(
                "step_in_backward=True with zero_stage=2: zero_stage=2 reduce-scatters the gradients in step(), after "
                "backward, so an update in backward would use this rank's own gradients, not the averaged ones; use "
                "zero_stage=1 with DDP and attach_ddp (updates start as DDP's buckets are averaged), or step_in_backward=False"
            )
        self._step_supports_amp_scaling = unscale_in_step
        if offload not in ("host", "disk"):
            raise ValueError(f"offload must be 'host' or 'disk', not {offload!r}")
        if store is None and offload == "host":
            ignored = [name for name, value in (("disk_root", disk_root), ("disk_capacity", disk_capacity)) if value is not None]
            if ignored:
                raise ValueError(f"{', '.join(f'{name}=' for name in ignored)} {'places' if len(ignored) == 1 else 'place'} the disk "
                                 "tier of offload='disk'; offload='host' makes none, so they would do nothing")
        if store is not None:  # (they describe the store made when none is given: with one, they did nothing)
            ignored = [name for name, value in (("offload", offload != "host"), ("disk_root", disk_root), ("host_capacity", host_capacity),
                                                ("disk_capacity", disk_capacity)) if value not in (None, False)]
            if ignored:
                raise ValueError(f"{', '.join(f'{name}=' for name in ignored)} {'describes' if len(ignored) == 1 else 'describe'} "
                                 "the store the optimizer makes when none "
                                 "is given; with store= they would do nothing: size and place the store's own tiers instead")
        if max_grad_norm is not None:
            what = f"max_grad_norm must be a number of 0 or more (inf: measure the norm only; None: no clipping), not {max_grad_norm!r}"
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
                raise TypeError(what)
            if not max_grad_norm >= 0:  # (NaN too: every weight would become NaN)
                raise ValueError(what)
        if step_in_backward and max_grad_norm is not None:
            raise ValueError(
                "max_grad_norm needs every gradient before any update, so it cannot be combined with "
                "step_in_backward=True; use the default (updates after backward, still pipelined)"
            )
        gradient_accumulation_steps = _count("gradient_accumulation_steps", gradient_accumulation_steps)
        max_inflight = _count("max_inflight", max_inflight)
        if min_offload_numel != math.inf:  # (inf: page nothing)
            min_offload_numel = _count("min_offload_numel", min_offload_numel, least=0)
        if chunk_bytes is not None and parse_bytes(chunk_bytes) <= 0:
            raise ValueError(f"chunk_bytes must be a positive size (None: never chunk), not {chunk_bytes!r}")
        if bucket_bytes is not None and parse_bytes(bucket_bytes) <= 0:  # (0 silently meant the default)
            raise ValueError(f"bucket_bytes must be a positive size (None: the default), not {bucket_bytes!r}")
        if key_prefix is not None:
            warnings.warn("key_prefix is deprecated; pass namespace=", DeprecationWarning, stacklevel=3)
            if namespace is not None and namespace != key_prefix:
                raise ValueError("pass namespace= only (key_prefix is its deprecated alias)")
            namespace = key_prefix
        self._slots: list[ParamSlot] = []
        self._sharding: Sharding | None = None
        if process_group is False:
            process_group = None  # (as True is the default group: a flag set from a condition)
        if process_group is not None:
            if not self._supports_sharding:
                raise NotImplementedError(f"{type(self).__name__} does not support process_group= (TieredAdam/TieredAdamW do)")
            params = materialize(params)
            self._sharding = Sharding(params, process_group, zero_stage)
        elif zero_stage != 1:
            raise ValueError("zero_stage= needs process_group=")
        #: The claimed key namespace (set once the store is bound; slot keys live under it).
        self.namespace: Namespace | None = None
        self._min_offload_numel = min_offload_numel
        self._emulate = emulate_device
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.state_tier = state_tier
        #: Held by step() and close(): a close from another thread waits for the step.
        self._lifecycle = threading.RLock()
        self._loop = loop_thread()
        self._window = StepWindow("in-backward" if step_in_backward else "after-backward")
        #: Spans of this step; mark the loop's own work with ``opt.timeline.span("forward")``.
        self.timeline: Timeline = self._window.timeline
        self._owns_store = store is None
        self._pipeline: UpdatePipeline | None = None
        #: Whether the constructor has ended (an ``add_param_group`` after it plans the group).
        self._constructed = False
        self._warned_zero2_changes = False
        #: Whether a sharded ``state_dict()`` has said it holds this rank's state only.
        self._warned_rank_state = False
        #: With step_in_backward: this step's settings were checked at its first gradient.
        self._checked_in_backward = False
        try:
            super().__init__(params, defaults)
            if store is None:
                # (frozen parameters get no state: a LoRA model's base would size a disk for nothing)
                state = sum(self._state_bytes(slot) for slot in self._slots if slot.paged and self._in_plan(slot))
                grads = sum(slot.numel * slot.param.element_size() for slot in self._slots
                            if not slot.link.lends and slot.param.requires_grad)
                root = rank_folder(Path(disk_root).expanduser() if disk_root is not None else DEFAULT_DISK_ROOT)
                store = default_store(offload, state, grads, root, host_capacity, disk_capacity)
            try:
                self.store: TierStore = bind_store(store, self._loop, state_tier)
            except StoreLockedError:
                if not self._owns_store:
                    raise
                # An optimizer dropped without close() may hold the folder until the cycle
                # collector finds it and its release runs: let both happen, and try again.
                gc.collect()
                wait_unfinished()
                store = default_store(offload, state, grads, root, host_capacity, disk_capacity)
                try:
                    self.store = bind_store(store, self._loop, state_tier)
                except StoreLockedError as error:
                    if not getattr(error, "in_this_process", False):
                        if dist.is_available() and dist.is_initialized():
                            raise
                        raise StoreLockedError(
                            f"{error}. If that process is another rank of this job: no process group was "
                            "initialized when this optimizer was made, so every rank chose the same folder; make "
                            "the optimizer after torch.distributed.init_process_group (or under a launcher that "
                            "sets RANK), or give each rank its own disk_root="
                        ) from None
                    raise StoreLockedError(
                        f"{error}. Another open optimizer uses this disk folder: give each its own disk_root=, "
                        "or make one TierStore and pass it to both as store= (each keeps its state in its own namespace)"
                    ) from None
            for slot in self._slots:  # (made before the store was bound: its device tier's link decides)
                slot.link = self._link(slot.param.device)
            self.store.on_transfer = self._window.on_transfer
            self.namespace = run(self._claim(namespace, overwrite))
            for slot in self._slots:
                slot.key = self.namespace.key(str(slot.index))
            # Where the model computes on the CPU too (device memory is host memory), the update in
            # backward shares its cores with backward itself: one core of them, not a second team.
            self._pipeline = UpdatePipeline(self.store, state_tier, self, report=lambda: self._window.report, timeline=self.timeline,
                                            serial_update=all(slot.link.lends for slot in self._slots))
            self._pipeline.plan(
                self._slots, parse_bytes(bucket_bytes) if bucket_bytes is not None else 0, max_inflight, step_in_backward,
                chunk_bytes=parse_bytes(chunk_bytes) if chunk_bytes is not None else 0,
            )
            plan = self.memory_plan()
            if not plan.fits:  # refused now rather than failing mid-step
                raise OptimizerCapacityError("this configuration cannot fit: " + "; ".join(plan.problems) + f"\n{plan}")
            self._planned = self._planned_slots()
            self._runner = StepRunner(self._slots, self.store, self._pipeline, max_grad_norm=max_grad_norm, in_backward=step_in_backward)
            self._runner.resident = self._pipeline.resident = ResidentStep(
                self.store, state_tier, self, self._pipeline.math, report=lambda: self._window.report, timeline=self.timeline
            )
            self._capture = self._runner.capture = GradientCapture(
                self.store, state_tier, self._loop, hint=gradient_accumulation_steps, in_backward=step_in_backward,
                arrived=self._runner.arrived, report=lambda: self._window.report, timeline=self.timeline,
            )
            pipeline = self._pipeline
            self._capture.pages_below = lambda: pipeline.pages_below
            self._capture.watch_changes = self._sharding is not None and self._sharding.zero_stage == 2
            run(self._adopt())
            # (a loop round trip at the end of every step, saved where no tier lies below the state's)
            # (its store holds the window, which must not hold the optimizer: see _release_dropped)
            store, slots, tier, paging = self.store, self._slots, self.state_tier, weakref.ref(pipeline)
            self._window.watch(lambda: run(state_residency(store, slots, tier)) if getattr(paging(), "pages_below", False) else None)
        except BaseException:
            self._remove_hooks()  # a half-built optimizer must not keep listening to the model
            if self._pipeline is not None:
                self._pipeline.shutdown()
            if self.namespace is not None:  # nor keep its namespace
                run(self.namespace.drop() if self.namespace.auto else self.namespace.release())
            if self._owns_store and isinstance(store, TierStore) and store.is_open:
                # nor the store it made: open, it keeps the folder locked against the retry
                run(store.aclose(flush=self.namespace is not None and not self.namespace.auto))
            raise
        self._constructed = True
        close_at_exit(self)  # its store's background I/O must not outlive the interpreter (see there)
        # Dropped without close() (a trainer's hyper-parameter search, a re-fit), it lets go of
        # what close() would: otherwise its store (state, threads, the folder's lock) outlived it.
        self._finalizer = weakref.finalize(
            self, _release_dropped, self._loop, self._slots, self._pipeline.workers, self.namespace, self.store, self._owns_store,
        )
        self._finalizer.atexit = False  # (at exit, close_at_exit closes the live ones)

    @property
    def inflight(self) -> int:
        """Buckets of updates holding state at once."""
        return self._pipeline.inflight if self._pipeline is not None else 1

    @property
    def bucket_bytes(self) -> int:
        """State and gradient bytes updated together in one call."""
        return self._pipeline.bucket_bytes if self._pipeline is not None else 0

    # -- construction --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Torch's. After construction the group is planned with the others (its large
        parameters chunked as theirs were) and refused with ``OptimizerCapacityError``, the
        optimizer as it was, where the constructor would have refused it."""
        self._require_open("add_param_group")
        first = len(self._slots)
        super().add_param_group(param_group)
        listed = self.param_groups[-1]["params"]
        if len({id(param) for param in listed}) != len(listed):
            self.param_groups.pop()
            repeated = sorted({i for i, param in enumerate(listed) if any(other is param for other in listed[:i])})
            raise ValueError(
                f"a parameter group lists the same parameter more than once (positions {repeated[:8]}): torch's "
                "optimizers update it once per listing (their fused kernel differently again) and warn that this "
                "will be an error; list each parameter once"
            )
        sharded = len(self._sharding.params) if self._sharding is not None else 0
        error: BaseException | None = None
        planned = False
        try:
            if self._constructed and self._sharding is not None:
                # (all of them: the owners of the new ones are planned from the others' flags now)
                self._sharding.check_same([*self._sharding.params, *listed])
            self._add_slots()
            if self._constructed:  # (during construction, the constructor plans every group)
                self._plan_added(self._slots[first:])
                planned = True
                run(self._adopt_added(len(self.param_groups) - 1, self._slots[first:]))
        except BaseException as exc:  # noqa: BLE001 - raised below, once every rank has said how it went
            error = exc
        if self._constructed and self._sharding is not None and self._sharding.any_rank(error is not None) and error is None:
            # (each rank holds other parameters of the group: a rank that failed has refused it,
            # and so do the others, rather than wait for it in a later collective)
            error = OptimizerCapacityError("this parameter group could not be added on another rank (its error says why there)")
        if error is None:
            return
        if planned:
            assert self._pipeline is not None
            self._pipeline.replan(without=self._slots[first:])
        self._forget_slots(self._slots[first:])
        for slot in self._slots[first:]:
            if slot.hook is not None:
                slot.hook.remove()
        del self._slots[first:]
        if self._sharding is not None:
            self._sharding.forget_from(sharded)
        self.param_groups.pop()
        raise error

    def _plan_added(self, added: list[ParamSlot]) -> None:
        """Plan a group added after construction, or raise ``OptimizerCapacityError`` with the
        plan as it was."""
        assert self._pipeline is not None
        pipeline = self._pipeline
        pipeline.plan_added(added)  # (OptimizerCapacityError: the plan as it was)
        in_force = getattr(self, "_plan", None)
        plan = self.memory_plan()
        if not plan.fits:
            if in_force is not None:
                self._plan = in_force  # (what memory_plan() gives once closed)
            pipeline.replan(without=added)
            raise OptimizerCapacityError("this parameter group cannot fit: " + "; ".join(plan.problems) + f"\n{plan}")
        self._planned = self._planned_slots()

    def _add_slots(self) -> None:
        """A slot for each parameter of the last group (this rank's part of it)."""
        group = len(self.param_groups) - 1
        for param in self.param_groups[group]["params"]:
            if param.is_complex():
                raise TypeError("complex parameters are not supported by the tiered optimizers")
            # FSDP2: the rank's shard; sharded: the parameter, its rows, or None (another rank's)
            view = self._sharding.add(param) if self._sharding is not None else LocalShard(param) if is_dtensor(param) else param
            if view is None:
                continue
            offload = offloaded(param)
            shape = offload[0].shape_of(offload[1]) if offload is not None else view.shape
            index = len(self._slots)
            slot = ParamSlot(
                index=index, group=group, param=view, key=self.namespace.key(str(index)) if self.namespace is not None else "",
                shape=shape, paged=shape.numel() >= self._min_offload_numel, link=self._link(view.device),
            )
            if param.requires_grad:
                slot.hook = param.register_post_accumulate_grad_hook(partial(_hook, weakref.ref(self), slot))
            self._slots.append(slot)

    def _link(self, device: torch.device) -> Link:
        """The link between ``device`` and the host: the store's device tier's where it has one
        on ``device`` (``device_link``; an ``emulate_device=`` that contradicts it is refused),
        else as ``emulate_device=`` says (also before the store is bound)."""
        store = getattr(self, "store", None)
        return device_link(store.tiers if store is not None else (), device, self._emulate, type(self).__name__)

    async def _claim(self, name: str | None, overwrite: bool) -> Namespace:
        owner = type(self).__name__
        try:
            if name is None:
                return await self.store.claim_unique(DEFAULT_NAMESPACE_BASE, owner=owner)
            return await self.store.claim(name, owner=owner, overwrite=overwrite)
        except TierFullError as error:  # (the namespace's record, a few hundred bytes, did not fit)
            # (records live on the disk tier where there is one: its room was short, not the host's)
            on_disk = any(not isinstance(tier, MemoryTier) for tier in self.store.tiers)
            advice = ("give the disk tier more capacity (disk_capacity=, or a larger DiskTier in store=)" if on_disk
                      else "give the state tier more capacity (host_capacity=)")
            raise OptimizerCapacityError(
                f"this configuration cannot fit: the store cannot hold even the optimizer's namespace record ({error}); {advice}"
            ) from error

    async def _adopt(self) -> None:
        """Take up what an earlier optimizer left in our (named) namespace. This class cannot
        continue from it, and the keys are ours: delete them. Subclasses that can, override."""
        if self.namespace is not None:
            await self.namespace.clear()

    async def _adopt_added(self, group: int, added: list[ParamSlot]) -> None:
        """Take up the saved state of parameters of a group added after construction (an
        earlier run's, kept by ``_adopt``). Subclasses that can adopt state override it."""

    def _settle_saved_state(self) -> None:
        """At the first ``step()``: forget saved state no group took up (``_adopt_added``)."""

    def _forget_slots(self, removed: list[ParamSlot]) -> None:
        """The slots of a group ``add_param_group`` refused go: forget what is kept of them
        outside the store (subclasses keeping such things override)."""

    async def _save_for_restart(self) -> None:
        """Put what lives outside the store (step counts, small states) into the namespace,
        so a later optimizer claiming it continues from it (``close()`` calls this for a
        named namespace). Subclasses that can adopt state override it."""

    async def _weight(self, slot: ParamSlot) -> torch.Tensor:
        """The parameter's current value in host memory."""
        return await read_weight(slot)

    def _groups_for_saving(self) -> list[dict[str, Any]]:
        """``param_groups`` as torch saves them: hyperparameters, and parameter indices. The
        storage choices (``_unsaved_group_keys``) are left out: a checkpoint with keys torch's
        optimizer lacks would not load into it, nor its checkpoint into us, through DCP's strict
        loading."""
        groups, index = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params" and k not in self._unsaved_group_keys}
            saved["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(saved)
        return groups

    # -- what subclasses provide ---------------------------------------------------------------

    @abstractmethod
    def _state_bytes(self, slot: ParamSlot) -> int:
        """Bytes of optimizer state for ``slot`` (for default capacities and reports)."""

    def _release_thread_buffers(self) -> None:
        """After a step, on the thread that called it: let go of what its updates on this
        thread kept (the thread is the caller's: ``memory_plan()`` counts one such thread, not
        every thread that ever stepped)."""

    def _update_buffer_bytes(self, threads: int) -> int:
        """At most the bytes the updates take beside the state they update, running on
        ``threads`` threads at once (buffers of their own, kept or passing; none here: a
        subclass whose update makes them says)."""
        return 0

    @abstractmethod
    def _state(self, slot: ParamSlot) -> AbstractAsyncContextManager[Any]:
        """An async context (on the loop) giving the slot's state, writable, created if absent."""

    @abstractmethod
    def _master(self, slot: ParamSlot, state: Any) -> torch.Tensor:
        """The fp32 master weight (flat) in ``state``."""

    @abstractmethod
    def _apply(self, slot: ParamSlot, state: Any, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Update ``state`` with ``grad`` (worker thread); return the fp32 master weight."""

    def _resident_pieces(self, slot: ParamSlot) -> list[Piece] | None:
        """The pieces of ``slot``'s state the resident step (``tierstore.optim.resident``) may
        update now; None (the default): it may not, the pipeline updates it."""
        return None

    def _update_resident(
        self, slots: list[ParamSlot], pieces: list[list[Piece]], states: list[list[torch.Tensor]], grads: list[torch.Tensor]
    ) -> None:
        """The resident step's math (training thread); subclasses giving pieces provide it."""
        raise NotImplementedError

    def _apply_many(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Update several parameters with ``grads`` (divided by GradScaler's ``grad_scale`` if
        given); subclasses that can batch the math override this."""
        if grad_scale is not None:
            inverse = inverse_scale(grad_scale)
            grads = [grad.mul(inverse) for grad in grads]
        return [self._apply(slot, state, grad, self.param_groups[slot.group]) for slot, state, grad in zip(slots, states, grads, strict=True)]

    # -- the step ----------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter whose ``p.grad`` is not None, with ``p.grad`` as it is now.
        The time spent here is the training loop's stall. A ``close()`` from another thread
        meanwhile waits for the step to end."""
        with self._lifecycle:
            return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        self._require_open("step")
        self._settle_saved_state()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        sharding = self._sharding
        resumed = sharding is not None and sharding.local_done  # our part ran; another rank's failed
        if not resumed and (sharding is not None or self._mesh_group() is not None):
            self._before_distributed_step()
        scaling = None
        if getattr(self, "found_inf", None) is not None:  # inside GradScaler.step
            found = bool(self.found_inf.item())  # type: ignore[attr-defined]
            scaling = (getattr(self, "grad_scale", None), sharding.found_inf(found) if sharding is not None else found)
        if not resumed:
            self._refuse_unusable_gradients()
            self._refuse_changed_layouts()
        try:
            if not resumed:
                self._refuse_unplanned_unfreezing()  # (in here: with sharded state, the other ranks are told)
                self._finish_step(scaling)
        except StepIncompleteError as exc:
            if sharding is not None:
                sharding.agree(exc)  # the other ranks raise too, instead of waiting for our weights
            raise  # the step stays open: step() again completes it
        except BaseException as exc:
            self._capture.new_step()
            if sharding is not None and isinstance(exc, Exception):  # (not on Ctrl-C: no collectives then)
                sharding.agree(exc)
            raise
        finally:
            self._checked_in_backward = False
            ended = time.perf_counter()
            self._report.stall += ended - started
            self.timeline.add("step() wait", "train loop", started, ended)
        self._capture.new_step()
        if sharding is not None:
            sharding.agree(None)  # raises PeerStepError if another rank's part failed
            sharding.broadcast_weights()
            sharding.end_step()
        self._close_window(ended)
        return loss

    def _finish_step(self, scaling: Any) -> None:
        """Run the step's loop side (``StepRunner.finish``), draining the math it hands this
        thread. On Ctrl-C, wherever it lands here, the step's task is cancelled and its cleanup
        (holds, jobs handed to this thread) runs to the end before KeyboardInterrupt leaves:
        otherwise the task would wait for this thread forever, holding the store's room."""
        pipeline = self._pipeline
        assert pipeline is not None
        observed = observe(self._slots)
        self._runner.begun = False
        step = self._runner.finish(observed, scaling)
        finishing = None
        cancel = partial(self._loop.call_soon_threadsafe, _cancel_task_of, step)
        try:
            with _sigint_to(pipeline.interrupted):  # (the cleanups below too: a second Ctrl-C must not cut them)
                try:
                    # (in a copy of this thread's context marked with the caller's line: the step's
                    # warnings name it, ``tierstore.warn``)
                    finishing = context_of_call(sys._getframe(1)).run(asyncio.run_coroutine_threadsafe, step, self._loop)
                    pipeline.drain_until(finishing, cancel)
                except KeyboardInterrupt:  # (Ctrl-C stands, or a job raised it)
                    if finishing is None:
                        with contextlib.suppress(ValueError, RuntimeError):  # (never scheduled; or running: let it be)
                            step.close()
                    elif not finishing.done():
                        cancel()
                        pipeline.drain_until(finishing)
                    if not self._runner.begun:
                        self._abandon_unbegun(observed)
                    raise
                if not self._runner.begun:  # (cancelled before it began: what backward launched ends here)
                    self._abandon_unbegun(observed)
        finally:
            pressed = pipeline.take_interrupts()
            self._release_thread_buffers()
        if pressed:  # after the step's last job: the step is done, and Ctrl-C stands
            raise KeyboardInterrupt
        finishing.result()

    def _abandon_unbegun(self, observed: list[Any]) -> None:
        """Abandon a step whose task Ctrl-C cancelled before it began, as it would have: the
        updates launched in backward end (a chunked parameter's cut ones finished), then the
        step is forgotten."""
        pipeline = self._pipeline
        assert pipeline is not None
        abandoning = asyncio.run_coroutine_threadsafe(self._runner.abandon(observed), self._loop)
        pipeline.drain_until(abandoning)

    def _has_state(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s parameter may have state in the store (a subclass that knows says
        exactly: ``TieredAdam``)."""
        return True

    def _in_plan(self, slot: ParamSlot) -> bool:
        """Whether the memory plan counts ``slot``'s state: a trainable parameter's, or one that
        has state (frozen since). A frozen parameter without state gets none, as with torch."""
        return slot.param.requires_grad or self._has_state(slot)

    def _planned_slots(self) -> frozenset[int]:
        return frozenset(slot.index for slot in self._slots if self._in_plan(slot))

    def _refuse_unplanned_unfreezing(self) -> None:
        """The memory plan leaves frozen parameters without state out: when the parameters it
        counts changed since it was made (some unfrozen), plan again, and raise
        ``OptimizerCapacityError`` before anything changes if it no longer fits (state the
        store cannot hold would fail part-way through the step)."""
        planned = self._planned_slots()
        if planned == getattr(self, "_planned", planned):
            return
        plan = self.memory_plan()
        if not plan.fits:
            raise OptimizerCapacityError("the parameters made trainable since this optimizer was made cannot fit: "
                                         + "; ".join(plan.problems) + f"\n{plan}")
        self._planned = planned

    def _refuse_changed_layouts(self) -> None:
        """Raise, before anything changes, if a param group's setting that decides how its
        state is stored was changed in ``param_groups`` since the state was laid out (a
        subclass with such settings says how: ``TieredAdam``)."""

    #: Appended to the error on a sparse gradient (TieredAdam names torch's SparseAdam, as torch does).
    _sparse_advice = ""

    def _refuse_unusable_gradients(self) -> None:
        """Raise ``RuntimeError``, before anything changes, if a ``p.grad`` is sparse (as torch's
        Adam does: the state is paged dense, and a sparse gradient cannot be copied to it), or
        if a parameter's data was replaced by data of another size (``p.data = ...``): its state
        is for the old size, and torch's fused kernel, given tensors of unequal sizes, writes
        past the end of the smaller ones (the process aborted, its memory corrupt)."""
        for slot in self._slots:
            param = slot.param
            grad = param.grad
            if grad is None:
                continue
            if grad.layout is not torch.strided:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (parameter {slot.index} has a {grad.layout} "
                    f"gradient){self._sparse_advice}")
            _refuse_resized(slot)

    # -- across ranks ----------------------------------------------------------------------------

    def _mesh_group(self) -> Any:
        """The process group of FSDP2's mesh when the parameters are DTensors, else None."""
        if not hasattr(self, "_mesh"):
            self._mesh = mesh_group(self._slots)
        return self._mesh

    def _reduce_gradients(self) -> None:
        """ZeRO-2's reduce-scatter (once a step; nothing for ZeRO-1). Gradients the training
        loop changed after backward are changed before the reduce-scatter, on this rank's own
        gradients: torch's ``clip_grad_norm_`` then clips by this rank's norm, not the global
        one (a warning, once: a change that is the same on every rank, a constant scale, is right)."""
        sharding = self._sharding
        assert sharding is not None
        if sharding.zero_stage == 2 and not sharding.reduced and not self._warned_zero2_changes:
            changed = self._capture.changed_since_backward(self._slots)
            if changed:
                self._warned_zero2_changes = True
                warn(
                    f"zero_stage=2: p.grad of parameters {changed[:8]}{' ...' if len(changed) > 8 else ''} changed after "
                    "backward, before step() averages the gradients across ranks. If the model is wrapped in DDP: "
                    "zero_stage=2 is for a model not wrapped in it (step() averages the gradients itself: DDP's average "
                    "is averaged again, with other roundings, and its all-reduce is wasted); use zero_stage=1 with DDP. "
                    "If it is clipping: with zero_stage=2, p.grad holds this rank's own gradient until step(), so "
                    "torch's clip_grad_norm_ clips by this rank's norm, not the global one; clip with max_grad_norm= or "
                    "opt.clip_grad_norm_() (they use the global norm). A change that is the same on every rank, such as "
                    "a constant scale, is fine",
                    RuntimeWarning,
                )
        sharding.reduce_gradients()

    def _before_distributed_step(self) -> None:
        """ZeRO-2's reduce-scatter; the clipping coefficient from the norm across ranks."""
        if self._sharding is not None:
            self._reduce_gradients()
        if self.max_grad_norm is not None and self._runner.coef is None:
            self._distributed_clip(float(self.max_grad_norm), 2.0)

    def _distributed_clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The norm of every rank's gradients (``p.grad`` as it is now), as ``clip_grad_norm_``
        computes it on the whole model; sets this step's clipping coefficient."""
        norms = [(slot, torch.linalg.vector_norm(slot.param.grad, norm_type)) for slot in self._slots if slot.param.grad is not None]
        if self._sharding is not None:
            index = self._sharding.global_index
            total = self._sharding.total_norm({index[slot.index]: norm for slot, norm in norms}, norm_type)
        else:
            total = mesh_total_norm([norm for _, norm in norms], norm_type, self._mesh_group())
        run(self._runner.set_clip(clip_coefficient(max_norm, total)))
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, parameters: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        """Clip this step's gradients to a global norm, like ``torch.nn.utils.clip_grad_norm_``
        on the model's parameters; call it between backward and ``step()``. Returns the total
        norm. The gradients on the device are left as they are; the update uses clipped ones
        (and no gradient is copied again, as after the user's own ``clip_grad_norm_``).

        ``parameters``: those torch's ``clip_grad_norm_`` would be given (``model.parameters()``),
        in its order: the total is the same to the last bit (a sum of floats depends on its
        order; the default is this optimizer's, its groups one after the other, which differs
        where the groups reorder the model's parameters, as a trainer's weight-decay groups
        do). Not with sharded state (``process_group=``) or FSDP2 (``ValueError``): the norm is
        summed in the global parameter order there."""
        if self.step_in_backward:
            raise RuntimeError("with step_in_backward=True the updates already ran during backward; clipping is not possible")
        started = time.perf_counter()
        if parameters is not None and (self._sharding is not None or self._mesh_group() is not None):
            raise ValueError("clip_grad_norm_(parameters=) is not supported with sharded state (process_group=) or FSDP2: "
                             "the norm is summed in the global parameter order there")
        if self._sharding is not None or self._mesh_group() is not None:
            if self._sharding is not None:
                self._reduce_gradients()
            total = self._distributed_clip(float(max_norm), float(norm_type))
            self._report.stall += time.perf_counter() - started
            return total
        # The norm of p.grad as it is now, computed as torch computes it: the copies on the host
        # may be stale in a way no version counter shows (GradScaler.unscale_ rewrites p.grad in
        # place without moving it); step() takes such gradients again.
        if isinstance(parameters, torch.Tensor):  # (one parameter, as torch's clip_grad_norm_ takes it)
            parameters = [parameters]
        params = list(parameters) if parameters is not None else [slot.param for slot in self._slots]
        grads = [param.grad for param in params if param.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, float(norm_type)) if grads else torch.tensor(0.0)
        run(self._runner.set_clip(clip_coefficient(float(max_norm), total)))
        self._report.stall += time.perf_counter() - started
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and anything this optimizer took of them without stepping
        (a step left incomplete by an error is abandoned: its updates so far stay).

        With ``step_in_backward=True``, updates that backward started are waited for first:
        they were launched with the gradients backward left, as if ``step()`` had run, and
        complete with them (never with the cleared ones). One that failed raises
        ``StepIncompleteError`` here, after the gradients are cleared and the step abandoned.
        Once the optimizer is closed it only clears the gradients, as torch's does."""
        if getattr(self, "_closed", False):
            super().zero_grad(set_to_none)
            return
        self._capture.new_step()
        failures = run(self._runner.end())  # before the gradients go: updates in flight read them
        super().zero_grad(set_to_none)
        if self._sharding is not None:
            self._sharding.abandon()  # (a step failed on a rank: the weights so far are exchanged)
        if failures:
            raise self._runner.abandoned_error(failures)
        unstepped = self._runner.updated_without_step
        if unstepped:
            shown = ", ".join(map(str, unstepped[:8])) + (", ..." if len(unstepped) > 8 else "")
            warn(
                f"step_in_backward=True: parameters {shown} were updated during a backward although step() was not "
                "called before zero_grad(): every backward that reaches a parameter updates it. A loss that should not "
                "train these parameters (a GAN's generator loss reaching the discriminator) needs them frozen "
                "(requires_grad_(False)) around its backward, or use step_in_backward=False",
                RuntimeWarning,
            )

    # -- state ---------------------------------------------------------------------------------

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The state by parameter, read from the store on access (``tierstore.optim.checkpoint.LazyState``)."""
        from .checkpoint import LazyState

        if getattr(self, "_closed", False):
            return {}  # (trainers read it at teardown: a closed optimizer has no state, like a fresh torch one)
        return LazyState(self)

    @state.setter
    def state(self, value: Any) -> None:
        """Ignored: torch's ``Optimizer.__init__`` assigns a dict; the state lives in the store."""

    # -- reports ---------------------------------------------------------------------------------

    @property
    def _report(self) -> TimeReport:
        return self._window.report

    def _close_window(self, now: float) -> None:
        self._window.close(now, self._runner.steps, self.store.counters.links, self._runner.last_order)

    def time_report(self) -> TimeReport:
        """Where the last step's time went (from the end of the step before to the end of it)."""
        return self._window.last

    def last_timeline(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        """The spans of the last step: ``(name, track, start, end, args)``."""
        return list(self._window.last_events)

    def write_timeline(self, path: str | os.PathLike[str]) -> None:
        """Write the last step as a Chrome trace (open in Perfetto or chrome://tracing)."""
        self._window.write(Path(path))

    def memory_plan(self) -> MemoryPlan:
        """Bytes each tier and the process will need (``MemoryPlan``), from the parameters and
        the store alone: known before the first step (the constructor refuses a plan that
        cannot fit)."""
        if getattr(self, "_closed", False):  # (the store may be closed: the last plan made)
            return self._plan
        pipeline = self._pipeline
        assert pipeline is not None
        self._plan = plan_memory(
            self.store, self._slots, self._state_bytes, state_tier=self.state_tier, unit_need=pipeline.need,
            inflight=pipeline.inflight, chunk_bytes=pipeline.chunk_bytes, offloaded=offloaded,
            used_by_others=run(self._used_by_others()), planned=self._in_plan,
            state_entries=lambda slot: [nbytes for _, nbytes in pipeline.state_keys(slot)],
            update_scratch=self._update_buffer_bytes(pipeline.math_threads),
        )
        return self._plan

    async def _used_by_others(self) -> dict[str, int]:
        """Bytes of the store's bottom tier (which evicts nothing) that values other than this
        optimizer's hold: a store shared with the user's own keys or another optimizer."""
        from ..namespaces import INDEX_KEY

        bottom = self.store.tiers[-1]
        namespace = getattr(self, "namespace", None)
        mine = [*(namespace.keys() if namespace is not None else []), INDEX_KEY]
        # (only what they hold there: a key of ours on a memory tier alone takes none of it, and
        # one updated in a memory tier keeps its older copy's extent until written back)
        sizes = [self.store._bytes_on_tier(key, bottom.name) for key in mine]
        if isinstance(bottom, MemoryTier):  # (what values take: not pooled buffers nor a slab's free slots)
            return {bottom.name: max(0, bottom.live_bytes - sum(bottom.value_size(n) for n in sizes if n))}
        return {bottom.name: max(0, bottom.used - sum(sizes))}

    def memory_report(self) -> MemoryReport:
        """Bytes per parameter and totals: weights and grads on the device, state by tier."""
        self._require_open("memory_report")
        plan = self.memory_plan() if self._pipeline is not None else None
        return run(memory_report(self.store, self._slots, self._state_bytes, offloaded, plan, self._window.last, planned=self._in_plan))

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks, stop the worker thread, end the namespace's claim, and close the
        store if the optimizer made it (once no other optimizer is on it: the last of those
        closes it then). A default namespace is dropped with its keys; a named one keeps the
        state (and step counts) for a later optimizer claiming it. Called from another thread
        while ``step()`` runs, it waits for that step to end. An optimizer dropped without it
        lets go of the same once it is garbage-collected, in the background."""
        with self._lifecycle:
            self._close()

    def _close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self._remove_hooks()
        self._closed = True
        failures: list[Any] = []
        if getattr(self, "_runner", None) is not None and self.store.is_open:
            with contextlib.suppress(Exception):  # a step left half done (its error was raised then)
                failures = run(self._runner.end())
        if getattr(self, "_runner", None) is not None:
            self._runner.release_backward()  # (also when end() failed: others may update in backward)
        if self._pipeline is not None:
            self._pipeline.shutdown()
        namespace = self.namespace
        if not self.store.is_open:
            return
        if namespace is not None and namespace.live:
            if namespace.auto:
                run(namespace.drop())
            else:
                run(self._save_for_restart())
                run(namespace.release())
        if call_now(closes_store, self.store, getattr(self, "_runner", None), self._owns_store):  # (the runners are the loop's)
            run(self.store.aclose(flush=namespace is not None and not namespace.auto))
        if failures:  # updates started in backward, never stepped, that failed: closed, then said
            raise self._runner.abandoned_error(failures)

    @contextlib.contextmanager
    def _checkpoint_io(self) -> Iterator[None]:
        """A block whose disk I/O is a checkpoint's (a save's reads, a load's writes): left out
        of the step figures of ``time_report()``, and the paged state's residency measured anew
        after it (``StepWindow.not_counted``); its accesses are not the store's learned
        schedule's to follow (a load's writes, recorded with the first step's accesses, were
        taken for a step's order: the third step after a load read 1.7x its need); the next step
        starts where the state it left resident is (``StepRunner.reverse_for``)."""
        try:
            with self._window.not_counted(lambda: self.store.counters.links), self.store._unobserved():
                yield
        finally:
            self._runner.by_residency = True  # (the state it left resident, if only part, may not be the step's first)

    def _hooked_state_dict(self, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``make()`` between the hooks of ``register_state_dict_pre_hook`` and
        ``..._post_hook``, as torch's ``state_dict`` runs them (a post-hook may return the
        dict to use instead)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        with self._checkpoint_io():
            state_dict = make()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _hooked_load(self, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
        """``load(state_dict)`` between the hooks of ``register_load_state_dict_pre_hook`` (given
        a shallow copy, as torch's; one may return the dict to load instead) and ``..._post_hook``."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        with self._checkpoint_io():
            load(state_dict)
        self._run_load_post_hooks()

    def _run_load_post_hooks(self) -> None:
        """The hooks of ``register_load_state_dict_post_hook``, once a load ended (as torch's
        ``load_state_dict`` runs them; the streaming ``load_optimizer`` too)."""
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _require_open(self, verb: str) -> None:
        """Raise ``OptimizerClosedError`` naming ``verb`` once ``close()`` ran."""
        if getattr(self, "_closed", False):
            namespace = self.namespace
            kept = (f"its state stays in namespace {namespace.name!r} for a new optimizer that claims it"
                    if namespace is not None and not namespace.auto else "its state was dropped")
            raise OptimizerClosedError(f"{type(self).__name__}.{verb}(): this optimizer was closed (opt.close()); {kept}; make a new one")

    def _remove_hooks(self) -> None:
        for slot in self._slots:
            if slot.hook is not None:
                slot.hook.remove()
                slot.hook = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled; save opt.state_dict() instead")


@contextlib.contextmanager
def _sigint_to(handler: Callable[[], None]) -> Iterator[None]:
    """Within, Ctrl-C calls ``handler`` instead of raising KeyboardInterrupt wherever the main
    thread happens to be (between taking a job and running it, a job would be lost; raised
    in the math, after a kernel changed state in place, its record would be). On the main
    thread only. A program's own SIGINT handler is called once on the way out instead, after
    the step's work ended (raising inside the math, it cut an update the step could neither
    redo nor count; one that only sets a flag sees no difference); ``SIG_IGN`` and
    ``SIG_DFL`` are left alone."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    caught: list[tuple[int, Any]] = []
    if previous is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda *_: handler())
    else:
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(*caught[0])


def _release_dropped(
    loop: asyncio.AbstractEventLoop, slots: list[ParamSlot], workers: WorkerPool, namespace: Namespace | None, store: TierStore,
    owned: bool,
) -> None:
    """What ``close()`` releases, for an optimizer collected without it (it may run on any
    thread, the loop's or a worker's too: nothing here waits). Its state is dropped with a
    default namespace, as by ``close()``; a named one is released as it is (the last steps'
    counts kept by ``close()`` are not saved: close an optimizer whose state is to be resumed)."""
    for slot in slots:
        if slot.hook is not None:
            slot.hook.remove()
            slot.hook = None
    stopped = workers.shutdown(wait=False)

    async def release() -> None:
        try:
            with contextlib.suppress(Exception):  # (a store closed meanwhile: nothing is left to release)
                if namespace is not None and namespace.live:
                    await (namespace.drop() if namespace.auto else namespace.release())
        finally:
            if store.is_open and closes_store(store, None, owned):
                await store.aclose(flush=namespace is not None and not namespace.auto)

    if not loop.is_closed():
        with contextlib.suppress(RuntimeError):  # (the loop stopped meanwhile: at exit)
            finish_at_exit(asyncio.run_coroutine_threadsafe(release(), loop), stopped)


def _cancel_task_of(coroutine: Any) -> None:
    """Cancel the task running ``coroutine`` (on the loop thread)."""
    for task in asyncio.all_tasks():
        if task.get_coro() is coroutine:
            task.cancel()


def _refuse_resized(slot: ParamSlot) -> None:
    """``RuntimeError`` if ``slot``'s parameter has data of another size than its state's."""
    param = slot.param
    if param.__class__ in PLAIN_TENSOR_TYPES and param.numel() != slot.numel and offloaded(param) is None:  # (a shard's rows: no numel)
        raise RuntimeError(
            f"parameter {slot.index} now has {param.numel():,} elements ({tuple(param.shape)}); its optimizer state "
            f"is for {slot.numel:,} ({tuple(slot.shape)}): its data was replaced by data of another size. Give it data "
            "of its size again, or make a new optimizer for the new parameters")


def _hook(optimizer: weakref.ref[PagedOptimizer], slot: ParamSlot, param: torch.Tensor) -> None:
    """The hook holds the optimizer weakly: one the program dropped stops listening."""
    live = optimizer()
    if live is not None:
        if live.step_in_backward:  # (its update may start now)
            _refuse_resized(slot)
            if not live._checked_in_backward:  # (the step's first gradient)
                live._settle_saved_state()
                live._refuse_changed_layouts()
                live._refuse_unplanned_unfreezing()
                live._checked_in_backward = True
        live._capture.hook(slot, slot.param)  # (for a DTensor, the view of its local shard)


def _count(name: str, value: Any, least: int = 1) -> int:
    """``value`` as a count of at least ``least`` (a whole float from a config file too), or a clear error."""
    whole = (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    if not whole:
        raise TypeError(f"{name} must be a whole number, not {value!r}")
    count = int(value)
    if count < least:
        raise ValueError(f"{name} must be at least {least}, not {value}")
    return count
