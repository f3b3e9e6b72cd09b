"""Parameter offloading: a module's weights live in the store and visit the device tier only
while a submodule computes with them.

``offload_parameters(module, store)`` moves every parameter into the store (``tier``, host by
default, or disk) and leaves a zero-size placeholder in the module. Around each submodule that
owns parameters (a *unit*), hooks hold its parameters on the device tier -- the store's own
buffers, no copy -- for its forward, release them after it, hold them again before its backward
and release each once its gradient is accumulated. Autograd would keep a reference to the
forward-time buffers of the weights it saves for backward (and read them there, after the store
reused them), so while the module runs forward, ``saved_tensors_hooks`` replace each saved
parameter, or view of one, by a reference that backward resolves against the weights held again
then; other saved tensors go to the ``offload_activations`` context active around the forward,
if any, or stay as they are. Each parameter must be used inside the module that owns it. While a unit computes, the units that come
next are prefetched to the device tier, in the order recorded in the previous step (forward
order, then backward order). The device tier's capacity bounds what is resident at once, so a
model whose weights exceed it still trains.

Gradients land in ``param.grad`` as usual; ``TieredAdamW`` (or any ``PagedOptimizer``) sees
that a parameter is offloaded and writes its updated weight into the store instead of into the
placeholder. ``detach()`` puts the weights back into the module.

The weights live in a namespace it claims in the store (``namespace=``, default a fresh
``swap/params/<n>/``); ``detach()`` drops it.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..namespaces import Namespace
from ..store import TierStore
from ..sync import SyncTierStore, loop_thread, run
from ..tiers import MemoryTier
from ..units import parse_bytes
from .activations import _claim, _Saved, active_activation_offload
from .report import SwapReport

# Keyed by identity (tensors compare elementwise, so a plain WeakKeyDictionary cannot hold them).
_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()

# Our backward pre-hook on the first unit (whose inputs, token ids, need no gradient) makes torch
# say so on every backward; the hook only fetches weights, so the remark does not apply.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")


def offloaded(param: torch.Tensor) -> tuple[ParameterOffload, str] | None:
    """``(offloader, key)`` if ``param`` lives in a store through ``offload_parameters``."""
    return _REGISTRY.get(param)


@dataclass(frozen=True, eq=False)
class _ParamRef:
    """What backward keeps instead of a saved parameter (or a strided view of one)."""

    param: torch.Tensor
    unit: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    whole: bool


@dataclass(eq=False)
class _Unit:
    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    #: Bytes of its weights (their data is a zero-size placeholder while they are in the store).
    nbytes: int = 0
    holds: dict[str, Any] = field(default_factory=dict)  # key -> the hold's context manager


class ParameterOffload:
    """See the module docstring; make one with ``offload_parameters``."""

    def __init__(
        self,
        module: nn.Module,
        store: TierStore | SyncTierStore,
        tier: str = "host",
        device_tier: str | None = None,
        ahead: int | str = "64MiB",
        namespace: str | None = None,
    ) -> None:
        self.module = module
        self.store = store.store if isinstance(store, SyncTierStore) else store
        if not self.store.is_open:
            run(self.store.open())
        self.namespace: Namespace = run(_claim(self.store, namespace, "swap/params/", type(self).__name__))
        self.tier = tier
        self.device_tier = device_tier or self.store.tiers[0].name
        device = self.store.tier(self.device_tier)
        if not isinstance(device, MemoryTier):
            raise ValueError(f"device_tier {self.device_tier!r} must be a memory tier")
        self.device = device.device
        self.ahead = parse_bytes(ahead)
        self.prefix = self.namespace.name.rstrip("/")
        self.report = SwapReport("parameters")
        self._loop = loop_thread()
        self._units: list[_Unit] = []
        self._shapes: dict[str, torch.Size] = {}
        self._unit_of: dict[int, int] = {}
        self._key_of: dict[int, str] = {}
        self._saving: list[Any] = []
        self._releasing: list[Any] = []  # holds being let go on the loop
        self._hooks: list[Any] = []
        self._order: list[int] = []  # units in the order they were held this step
        self._learned: list[int] = []
        self._cursor = 0
        self._attach()

    # -- moving the weights in and out -------------------------------------------------------------

    def _attach(self) -> None:
        for name, sub in self.module.named_modules():
            own = [(f"{name}.{n}" if name else n, p) for n, p in sub.named_parameters(recurse=False)]
            if own:
                self._units.append(_Unit(name or "<root>", sub, own, sum(p.nbytes for _, p in own)))
        run(self._store_all())
        self._unit_of = {id(param): index for index, unit in enumerate(self._units) for _, param in unit.params}
        self._key_of = {id(param): f"{self.prefix}/{name}" for unit in self._units for name, param in unit.params}
        self._hooks.append(self.module.register_forward_pre_hook(lambda *_: self._enter_saving()))
        self._hooks.append(self.module.register_forward_hook(lambda *_: self._exit_saving()))
        for index, unit in enumerate(self._units):
            self._hooks.append(unit.module.register_forward_pre_hook(lambda *_, i=index: self._hold(i)))
            self._hooks.append(unit.module.register_forward_hook(lambda *_, i=index: self._release(i)))
            self._hooks.append(unit.module.register_full_backward_pre_hook(lambda *_, i=index: self._hold(i)))
            for name, param in unit.params:
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(lambda p, i=index, n=name: self._release(i, n)))

    async def _store_all(self) -> None:
        for unit in self._units:
            for name, param in unit.params:
                key = f"{self.prefix}/{name}"
                await self.store.put(key, param.detach(), tier=self.tier)
                self._shapes[key] = param.shape
                self.report.offloaded += 1
                self.report.bytes_out += param.nbytes
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                _REGISTRY[param] = (self, key)

    def detach(self) -> None:
        """Remove the hooks and put every weight back into the module (from the store)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for index in range(len(self._units)):
            self._release(index)
        for releasing in self._releasing:
            releasing.result()
        for unit in self._units:
            for name, param in unit.params:
                key = f"{self.prefix}/{name}"
                value = run(self.store.read(key))
                param.data = value.to(param.device)
                run(self.store.delete(key))
                _REGISTRY.pop(param, None)
        if self.namespace.live:
            run(self.namespace.drop())

    # -- what autograd saves -------------------------------------------------------------------------------

    def _enter_saving(self) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._saving.append(hooks)

    def _exit_saving(self) -> None:
        if self._saving:
            self._saving.pop().__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor if id(tensor) in self._unit_of else tensor._base
        if base is not None and id(base) in self._unit_of and offloaded(base) is not None:
            return _ParamRef(base, self._unit_of[id(base)], tuple(tensor.size()), tuple(tensor.stride()),
                             int(tensor.storage_offset() - base.storage_offset()), tensor is base)
        activations = active_activation_offload()
        return activations._pack(tensor) if activations is not None else tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _ParamRef):
            if self._key_of[id(packed.param)] not in self._units[packed.unit].holds:
                self._hold(packed.unit)  # used in backward outside its unit's own backward
            data = packed.param.data
            if packed.whole:
                return data
            return data.as_strided(packed.size, packed.stride, data.storage_offset() + packed.offset)
        if isinstance(packed, _Saved):
            return packed.owner._unpack(packed)
        return packed

    # -- around each unit --------------------------------------------------------------------------------

    def _hold(self, index: int) -> None:
        """Hold the unit's weights on the device tier (one round trip to the loop for all)."""
        unit = self._units[index]
        started = time.perf_counter()
        self._order.append(index)
        self._prefetch_after(len(self._order) - 1, index)
        todo = [(f"{self.prefix}/{name}", param) for name, param in unit.params if f"{self.prefix}/{name}" not in unit.holds]
        if not todo:
            return
        managers = [self.store.hold(key, self.device_tier) for key, _ in todo]
        values = run(_enter_all(managers))
        moved = 0
        for (key, param), manager, value in zip(todo, managers, values, strict=True):
            unit.holds[key] = manager
            param.data = value if value.device == param.device else value.to(param.device)
            moved += value.nbytes
        elapsed = time.perf_counter() - started
        self.report.stall += elapsed
        self.report.add_moved(moved, elapsed, out=False)

    def _release(self, index: int, only: str | None = None) -> None:
        """Put placeholders back and let the holds go (without waiting for the loop)."""
        unit = self._units[index]
        managers = []
        for name, param in unit.params:
            if only is not None and name != only:
                continue
            manager = unit.holds.pop(f"{self.prefix}/{name}", None)
            if manager is not None:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                managers.append(manager)
        if managers:
            self._releasing = [f for f in self._releasing if not f.done()]
            self._releasing.append(asyncio.run_coroutine_threadsafe(_exit_all(managers), self._loop))

    def _prefetch_after(self, position: int, index: int) -> None:
        """Prefetch the units that follow, in last step's order (or, in the first step, the
        next ones in module order), within ``ahead`` bytes (and a quarter of the device tier).
        Each unit is asked for once per pass: a cursor remembers how far requests went."""
        following: list[tuple[int | None, int]]
        if self._learned and position + 1 < len(self._learned):
            following = list(enumerate(self._learned[position + 1 :], start=position + 1))
        else:  # the first step: the next units in module order (no cursor: positions unknown)
            following = [(None, i) for i in range(index + 1, len(self._units))]
        keys, budget = [], min(self.ahead, self.store.tier(self.device_tier).capacity // 4)
        for where, nxt in following:
            unit = self._units[nxt]
            if unit.nbytes > budget:
                break
            budget -= unit.nbytes
            if where is not None and where < self._cursor:
                continue  # already requested in this pass
            keys += [f"{self.prefix}/{name}" for name, _ in unit.params]
            if where is not None:
                self._cursor = max(self._cursor, where + 1)
        if keys:
            self._loop.call_soon_threadsafe(_start_prefetch, self.store, keys, self.device_tier)
            self.report.prefetched += len(keys)

    def mark_step(self) -> None:
        """End of a training step: this step's order of units becomes next step's prefetch order."""
        if self._order:
            self._learned, self._order = self._order, []
        self._cursor = 0

    # -- for the optimizer ----------------------------------------------------------------------------------

    def shape_of(self, key: str) -> torch.Size:
        """The shape of the parameter stored under ``key``."""
        return self._shapes[key]

    async def read_weight(self, key: str) -> torch.Tensor:
        return await self.store.read(key)

    async def write_weight(self, key: str, value: torch.Tensor) -> None:
        """Store a parameter's new value (the optimizer calls this after its update)."""
        await self.store.put(key, value, tier=self.tier)


def _start_prefetch(store: TierStore, keys: list[str], tier: str) -> None:
    """On the loop: prefetch those of ``keys`` that exist and are not on ``tier`` already."""
    wanted = [key for key in keys if key in store and tier not in store.where(key)]
    if wanted:
        asyncio.ensure_future(store.prefetch(wanted, tier))


async def _enter_all(managers: list[Any]) -> list[torch.Tensor]:
    entered = await asyncio.gather(*(m.__aenter__() for m in managers), return_exceptions=True)
    failed = [e for e in entered if isinstance(e, BaseException)]
    if failed:  # let go of the ones that did enter, then report
        await _exit_all([m for m, e in zip(managers, entered, strict=True) if not isinstance(e, BaseException)])
        raise failed[0]
    return entered  # type: ignore[return-value]


async def _exit_all(managers: list[Any]) -> None:
    for manager in managers:
        await manager.__aexit__(None, None, None)


def offload_parameters(
    module: nn.Module,
    store: TierStore | SyncTierStore,
    tier: str = "host",
    device_tier: str | None = None,
    ahead: int | str = "64MiB",
    namespace: str | None = None,
) -> ParameterOffload:
    """Keep ``module``'s parameters in ``store`` (``tier``: host or disk) and bring each
    submodule's onto ``device_tier`` (default: the store's fastest) only while it computes;
    their keys go into ``namespace``, claimed in the store (default: a fresh ``swap/params/<n>/``)."""
    return ParameterOffload(module, store, tier, device_tier, ahead, namespace)
