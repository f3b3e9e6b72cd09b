"""``TieredOptimizer``: page the per-parameter state of any torch optimizer through a store.

For each parameter the wrapper keeps an fp32 master weight and every state tensor the wrapped
optimizer creates with the parameter's shape (momentum buffers, sums of squares ...) in the
store; smaller state (step counters, scalars) stays in host memory. An update holds them on the
host tier, points a private copy of the wrapped optimizer at them, and calls its ``step()``.

A parameter whose state is larger than a chunk is paged in chunks (``tierstore.optim.chunks``,
keys ``<key>/c<i>/<name>``) when the wrapped optimizer is elementwise (``ELEMENTWISE``, or
``elementwise=True``): each chunk is stepped on its own, from the same small state (step
counts), which gives the same numbers as one step. Another optimizer's parameters are paged
whole, and a state tier too small for one of them is refused with ``OptimizerCapacityError``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import torch

from ..sync import run
from ..tensors import PLAIN_TENSOR_TYPES
from .checkpoint import (
    SHARD,
    _accelerate_placement,
    _dcp_state_dict,
    _others,
    _refuse_another_ranks_state,
    saved_index,
    shard_record,
    warn_once_of_a_rank_state,
)
from .chunks import Chunk, is_elementwise
from .clipping import inverse_scale
from .distributed import ParamRange, is_dtensor
from .paging import PagedOptimizer, ParamSlot
from .pipeline import read_weight_range

_PAGING_OPTIONS = set(inspect.signature(PagedOptimizer.__init__).parameters) - {"self", "params", "defaults"}



def _refuse_unpageable(optimizer_class: type[torch.optim.Optimizer]) -> None:
    """``ValueError`` for an optimizer whose ``step()`` cannot run per parameter as this class
    runs it: one that needs a closure (LBFGS re-evaluates the loss within its step, over all
    parameters at once) or sparse gradients (SparseAdam; the state is paged dense). Accepted,
    each failed at every ``step()``, saying to call it again."""
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"{optimizer_class.__name__}.step() needs a closure (it evaluates the loss itself, over every "
                         "parameter): TieredOptimizer runs step() a parameter at a time and cannot page its state")
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        raise ValueError("SparseAdam updates with sparse gradients; TieredOptimizer pages state dense and takes dense "
                         "gradients only: use TieredAdam (or TieredOptimizer(params, torch.optim.Adam, ...)) instead")


class TieredOptimizer(PagedOptimizer):
    """``TieredOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9, store=...)``.

    ``optimizer_class`` is any ``torch.optim.Optimizer`` whose ``step()`` needs no closure;
    keyword arguments go to it, except the store options of ``PagedOptimizer`` (``store=``,
    ``offload=``, ``step_in_backward=``, ``max_grad_norm=`` ...). ``state_dict()`` is in the
    wrapped optimizer's own format, so checkpoints move between the two. ``elementwise``: whether
    the wrapped optimizer updates each element from its own state only, so that a large
    parameter's state may be paged in chunks (default: known for torch's own optimizers).
    """

    def __init__(
        self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], *, elementwise: bool | None = None, **kwargs: Any
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, not {optimizer_class!r}")
        _refuse_unpageable(optimizer_class)
        paging = {k: kwargs.pop(k) for k in list(kwargs) if k in _PAGING_OPTIONS}
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **kwargs)
        self.optimizer_class = optimizer_class
        self._options = kwargs
        self._inner: dict[int, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
        self._paged_names: dict[int, list[str]] = {}
        self._small_state: dict[int, dict[str, Any]] = {}
        #: Whether the update of one element reads only that element's state (chunks allowed).
        self.elementwise = is_elementwise(optimizer_class) if elementwise is None else bool(elementwise)
        self._chunk_small: dict[int, tuple[dict[str, Any], dict[str, Any] | None]] = {}
        if paging.get("process_group") is not None and not self.elementwise:
            raise ValueError(
                f"process_group= needs an elementwise optimizer (torch's SGD, Adam, Adagrad, RMSprop ...; or pass "
                f"elementwise=True if {optimizer_class.__name__} updates each element from its own state only): a "
                "parameter that dominates the model has its rows updated on different ranks"
            )
        self._supports_sharding = self.elementwise
        super().__init__(params, dict(probe.defaults), **paging)

    # -- state layout ------------------------------------------------------------------------------

    def _state_bytes(self, slot: ParamSlot) -> int:
        names = self._paged_names.get(slot.index)
        # Before the first step the state is unknown: assume two tensors (like Adam's moments).
        return slot.numel * 4 * (1 + (len(names) if names is not None else 2))

    def _key(self, slot: ParamSlot, name: str, chunk: Chunk | None = None) -> str:
        return f"{chunk.key if chunk is not None else slot.key}/{name}"

    def _chunkable(self, slot: ParamSlot) -> bool:
        return self.elementwise and type(slot.param) in (*PLAIN_TENSOR_TYPES, ParamRange) and slot.param.is_contiguous()

    @asynccontextmanager
    async def _chunk_state(self, slot: ParamSlot, chunk: Chunk) -> AsyncIterator[dict[str, Any]]:
        box: dict[str, Any] = {"tensors": {}, "new": {}}
        master_key = self._key(slot, "master", chunk)
        if master_key not in self.store:
            weight = await read_weight_range(slot, chunk.start, chunk.stop)
            async with self.store.fill(master_key, (chunk.numel,), torch.float32, self.state_tier) as master:
                master.copy_(weight)
        async with AsyncExitStack() as stack:
            box["master"] = await stack.enter_async_context(self.store.hold(master_key, self.state_tier, write=True))
            for name in self._paged_names.get(slot.index, []):
                key = self._key(slot, name, chunk)
                if key in self.store:
                    box["tensors"][name] = await stack.enter_async_context(self.store.hold(key, self.state_tier, write=True))
            yield box
        for name, tensor in box["new"].items():
            await self.store.put(self._key(slot, name, chunk), tensor, tier=self.state_tier)

    def _begin_chunks(self, slot: ParamSlot) -> None:
        if not slot.chunks_updated or slot.index not in self._chunk_small:
            self._chunk_small[slot.index] = (dict(self._small_state.get(slot.index, {})), None)

    def _apply_chunk(self, slot: ParamSlot, chunk: Chunk, box: dict[str, Any], grad: torch.Tensor, grad_scale: torch.Tensor | None) -> torch.Tensor:
        before, _ = self._chunk_small[slot.index]
        # every chunk steps from the same small state (step counts): as one step would
        self._small_state[slot.index] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in before.items()}
        if grad_scale is not None:
            grad = grad.mul(inverse_scale(grad_scale))
        master = self._step_inner(slot, box, grad, self.param_groups[slot.group], torch.Size([chunk.numel]))
        self._chunk_small[slot.index] = (before, self._small_state[slot.index])
        return master

    def _end_chunks(self, slot: ParamSlot) -> None:
        _, after = self._chunk_small.pop(slot.index, ({}, None))
        if after is not None:
            self._small_state[slot.index] = after

    @asynccontextmanager
    async def _state(self, slot: ParamSlot) -> AsyncIterator[dict[str, Any]]:
        box: dict[str, Any] = {"tensors": {}, "new": {}}
        if not slot.paged:
            if slot.resident is None:
                slot.resident = {"master": (await self._weight(slot)).float().reshape(-1).clone()}
            box["master"] = slot.resident["master"]
            box["tensors"] = {k: v for k, v in slot.resident.items() if k != "master"}
            yield box
            slot.resident.update(box["new"])
            return
        master_key = self._key(slot, "master")
        if master_key not in self.store:
            await self.store.put(master_key, (await self._weight(slot)).float().reshape(-1), tier=self.state_tier)
        async with AsyncExitStack() as stack:
            box["master"] = await stack.enter_async_context(self.store.hold(master_key, self.state_tier, write=True))
            for name in self._paged_names.get(slot.index, []):
                box["tensors"][name] = await stack.enter_async_context(self.store.hold(self._key(slot, name), self.state_tier, write=True))
            yield box
        for name, tensor in box["new"].items():  # created or replaced by the wrapped optimizer
            await self.store.put(self._key(slot, name), tensor, tier=self.state_tier)

    # -- the math --------------------------------------------------------------------------------------

    def _master(self, slot: ParamSlot, box: dict[str, Any]) -> torch.Tensor:
        return box["master"]

    def _apply(self, slot: ParamSlot, box: dict[str, Any], grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return self._step_inner(slot, box, grad, group, slot.shape)

    def _step_inner(self, slot: ParamSlot, box: dict[str, Any], grad: torch.Tensor, group: dict[str, Any], shape: torch.Size) -> torch.Tensor:
        """Step the wrapped optimizer on ``box`` (the state of the slot, or of one of its chunks,
        of ``shape``)."""
        master: torch.Tensor = box["master"]
        numel = shape.numel()
        shadow = self._shadow(slot)
        shadow.data = master.view(shape)
        shadow.grad = grad.float().reshape(shape) if grad.dtype != torch.float32 else grad.reshape(shape)
        inner = self._inner_for(slot, shadow)
        inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        state = dict(self._small_state.get(slot.index, {}))
        state.update({name: t.view(shape) for name, t in box["tensors"].items()})
        inner.state[shadow] = state
        try:
            inner.step()
            if shadow.data.data_ptr() != master.data_ptr():  # the optimizer replaced the tensor
                master.copy_(shadow.data.reshape(-1))
            small, new = {}, {}
            for name, value in inner.state[shadow].items():
                # by shape, not size: a chunk of one element has moments the size of a step count
                if torch.is_tensor(value) and value.shape == shape and (numel > 1 or shape != slot.shape):
                    held = box["tensors"].get(name)
                    if held is None or value.data_ptr() != held.data_ptr():
                        new[name] = value.detach().reshape(-1).float().clone()
                else:
                    small[name] = value
            self._small_state[slot.index] = small
            box["new"] = new
            self._paged_names[slot.index] = sorted(set(box["tensors"]) | set(new))
        finally:  # never keep views of store buffers past the hold
            inner.state.clear()
            shadow.grad = None
            shadow.data = torch.empty(0)
        return master

    def _shadow(self, slot: ParamSlot) -> torch.Tensor:
        if slot.index not in self._inner:
            return torch.empty(0)
        return self._inner[slot.index][1]

    def _inner_for(self, slot: ParamSlot, shadow: torch.Tensor) -> torch.optim.Optimizer:
        if slot.index not in self._inner:
            inner = self.optimizer_class([shadow], **self._options)
            inner.state.clear()  # some optimizers (Adagrad) build state eagerly; ours is restored per step
            self._inner[slot.index] = (inner, shadow)
        return self._inner[slot.index][0]

    # -- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's format: ``{"state": {index: {name: value}}, "param_groups": [...]}``
        (the hooks of ``register_state_dict_pre_hook``/``..._post_hook`` run around it, as torch's)."""
        self._require_open("state_dict")
        template = _dcp_state_dict()  # (DCP's template: it fills each rank's own, so no rank record)
        saved = self._hooked_state_dict(lambda: run(self._state_dict(record=not template)))
        if SHARD in saved and not _accelerate_placement():  # (a round trip to the device: no checkpoint)
            warn_once_of_a_rank_state(self, stacklevel=2)
        return saved

    async def _state_dict(self, record: bool = True) -> dict[str, Any]:
        state: dict[int, dict[str, Any]] = {}
        for slot in self._slots:
            if slot.index in self._small_state or slot.index in self._paged_names:
                state[saved_index(self, slot)] = await self._entry(slot)
        for index in _others(self):  # (sharded: another rank's, as TieredAdam's dict has them)
            state[index] = {}
        saved: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": self._groups_for_saving()}
        if self._sharding is not None and record:
            saved[SHARD] = shard_record(self)
        return saved

    async def _entry(self, slot: ParamSlot) -> dict[str, Any]:
        """One parameter's state in the wrapped optimizer's format ({} before its first step);
        a split parameter's rows as a DTensor sharded by rows (``ParamRange``)."""
        entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self._small_state.get(slot.index, {}).items()}
        for name in self._paged_names.get(slot.index, []):
            value: torch.Tensor | None
            if slot.paged:
                value = await self._read_named(slot, name)
            else:
                value = slot.resident.get(name) if slot.resident else None
            if value is not None:
                flat = value.reshape(-1).clone()
                entry[name] = slot.param.as_dtensor(flat) if isinstance(slot.param, ParamRange) else flat.reshape(slot.shape)
        return entry

    def _entry_of(self, slot: ParamSlot) -> dict[str, Any]:
        """One parameter's state, read from the store (``opt.state[p]``)."""
        return run(self._entry(slot))

    async def _read_named(self, slot: ParamSlot, name: str) -> torch.Tensor | None:
        """The paged state tensor ``name`` of ``slot`` (flat), gathered from its chunks if any."""
        if slot.chunks is None:
            return await self.store.read(self._key(slot, name)) if self._key(slot, name) in self.store else None
        value = torch.empty(slot.numel, dtype=torch.float32)
        for chunk in slot.chunks:
            key = self._key(slot, name, chunk)
            if key not in self.store:
                return None
            # (read where it lies, moving nothing: room made on the state tier could need a
            # write to a full disk)
            value[chunk.start : chunk.stop].copy_(await self.store.read(key))
        return value

    async def _write_named(self, slot: ParamSlot, name: str, value: torch.Tensor) -> None:
        if slot.chunks is None:
            await self.store.put(self._key(slot, name), value, tier=self.state_tier)
            return
        for chunk in slot.chunks:
            await self.store.put(self._key(slot, name, chunk), value[chunk.start : chunk.stop].contiguous(), tier=self.state_tier)

    async def _delete_named(self, slot: ParamSlot, name: str) -> None:
        for chunk in slot.chunks or [None]:
            key = self._key(slot, name, chunk)
            if key in self.store:
                await self.store.delete(key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of the wrapped optimizer class (with the hooks of
        ``register_load_state_dict_pre_hook``/``..._post_hook``, as torch's)."""
        self._require_open("load_state_dict")
        self._hooked_load(state_dict, self._load)

    def _load(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError("loaded state dict does not match the optimizer's parameter groups")
        _refuse_another_ranks_state(self, state_dict)
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})  # as torch: never shared
        ids = [i for saved in groups for i in saved["params"]]
        run(self._load_state({slot: state_dict["state"].get(ids[saved_index(self, slot)]) for slot in self._slots}))

    async def _load_state(self, saved_state: dict[ParamSlot, dict[str, Any] | None]) -> None:
        for slot, saved in saved_state.items():
            self._small_state.pop(slot.index, None)
            for name in self._paged_names.pop(slot.index, []):
                if slot.paged:
                    await self._delete_named(slot, name)
            master = (await self._weight(slot)).float().reshape(-1).clone()
            slot.resident = None if slot.paged else {"master": master}
            if slot.paged:
                await self._write_named(slot, "master", master)
            if saved is None:
                continue
            small, names = {}, []
            for name, value in saved.items():
                value = _ours(slot, value)
                if torch.is_tensor(value) and value.numel() == slot.numel and value.numel() > 1:
                    tensor = value.detach().float().cpu().reshape(-1).clone()
                    names.append(name)
                    if slot.paged:
                        await self._write_named(slot, name, tensor)
                    else:
                        slot.resident[name] = tensor  # type: ignore[index]
                else:
                    small[name] = value.clone() if torch.is_tensor(value) else value
            self._small_state[slot.index] = small
            self._paged_names[slot.index] = sorted(names)


def _ours(slot: ParamSlot, value: Any) -> Any:
    """A loaded state value as this rank holds it: a DTensor's local part; a whole tensor's
    rows of a split parameter (``ParamRange``)."""
    if is_dtensor(value):
        return value._local_tensor
    if isinstance(slot.param, ParamRange) and torch.is_tensor(value):
        return slot.param.local_of(value)
    return value
