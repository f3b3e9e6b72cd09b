"""``TieredAdam`` and ``TieredAdamW``: Adam with its fp32 master weights and moments paged
through a ``TierStore``.

Each parameter's state is one store entry of shape ``(rows, numel)`` in fp32: master weight,
``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), so one transfer moves all of
it. The math is torch's own ``torch.optim.adam.adam`` (fused CPU kernel by default), so results
match ``torch.optim.Adam``/``AdamW``: bit for bit with the same implementation (``fused=True``
against torch's ``fused=True``, ``fused=False`` against its default), within fp32 rounding
across implementations.

In a named namespace, ``close()`` leaves the step counts (and the state of parameters too small
to page) beside the paged state, and a later optimizer claiming the namespace continues from
them, as if never interrupted.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import torch
from torch.optim.adam import adam

from ..sync import run
from .checkpoint import adam_entry, adam_load_state_dict, adam_state_dict
from .clipping import inverse_scale
from .paging import PagedOptimizer, ParamSlot


class TieredAdam(PagedOptimizer):
    """``torch.optim.Adam`` (L2 weight decay) with state paged through a store.

    Takes torch's arguments (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
    ``maximize``, ``foreach``, ``fused``, param groups) plus the store options of
    ``PagedOptimizer`` (``store=``, ``offload=``, ``disk_root=``, ``step_in_backward=``,
    ``max_grad_norm=``, ``gradient_accumulation_steps=`` ...). ``capturable`` and
    ``differentiable`` are not supported.
    """

    decoupled_weight_decay = False
    _supports_sharding = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        **paging: Any,
    ) -> None:
        if not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if capturable or differentiable:
            raise ValueError("capturable and differentiable are not supported: the update runs on the host")
        if fused and foreach:
            raise ValueError("fused and foreach cannot both be True")
        self._step_counts: dict[int, torch.Tensor] = {}
        defaults = {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
            "maximize": maximize, "foreach": foreach, "capturable": False, "differentiable": False,
            "fused": fused, "decoupled_weight_decay": self.decoupled_weight_decay,
        }
        super().__init__(params, defaults, **paging)

    # -- state layout ------------------------------------------------------------------------------

    def _rows(self, slot: ParamSlot) -> int:
        return 4 if self.param_groups[slot.group]["amsgrad"] else 3

    def _state_bytes(self, slot: ParamSlot) -> int:
        return self._rows(slot) * slot.numel * 4

    def _initial(self, slot: ParamSlot, weight: torch.Tensor) -> torch.Tensor:
        packed = torch.zeros(self._rows(slot), slot.numel, dtype=torch.float32)
        packed[0].copy_(weight.reshape(-1))
        return packed

    @asynccontextmanager
    async def _state(self, slot: ParamSlot) -> AsyncIterator[torch.Tensor]:
        rows = self._rows(slot)
        if not slot.paged:
            if slot.resident is None or slot.resident["packed"].shape[0] != rows:
                slot.resident = {"packed": self._initial(slot, await self._weight(slot))}
            yield slot.resident["packed"]
            return
        if slot.key not in self.store or self.store.info(slot.key)["shape"] != (rows, slot.numel):
            await self.store.put(slot.key, self._initial(slot, await self._weight(slot)), tier=self.state_tier)
        async with self.store.hold(slot.key, self.state_tier, write=True) as packed:
            yield packed

    # -- continuing an earlier run ------------------------------------------------------------------

    def _steps_key(self) -> str:
        return self.namespace.key("steps") if self.namespace is not None else ""

    async def _save_for_restart(self) -> None:
        steps = torch.full((len(self._slots),), float("nan"), dtype=torch.float64)
        for index, count in self._step_counts.items():
            steps[index] = float(count)
        for slot in self._slots:
            if not slot.paged and slot.resident is not None and slot.index in self._step_counts:
                await self.store.put(slot.key, slot.resident["packed"])
        await self.store.put(self._steps_key(), steps)

    async def _adopt(self) -> None:
        """Continue from the state ``close()`` left in our namespace: every parameter whose step
        count was saved and whose state has the right shape. Anything else there is deleted. The
        step counts are consumed, so state updated by a run that then never closed is not taken
        for a consistent one later."""
        namespace = self.namespace
        if namespace is None:
            return
        saved: torch.Tensor | None = None
        if self._steps_key() in self.store:
            saved = await self.store.read(self._steps_key())
            await self.store.delete(self._steps_key())
        kept: set[str] = set()
        mismatched: list[int] = []
        if saved is not None and saved.shape != (len(self._slots),):
            warnings.warn(
                f"namespace {namespace.name!r} holds optimizer state for {saved.shape[0]} parameters, not "
                f"{len(self._slots)}: starting over (its state is deleted)",
                stacklevel=2,
            )
        elif saved is not None:
            for slot in self._slots:
                step = float(saved[slot.index])
                if step != step or slot.key not in self.store:  # NaN: never stepped
                    continue
                if self.store.info(slot.key)["shape"] != (self._rows(slot), slot.numel):
                    mismatched.append(slot.index)
                    continue
                self._step_counts[slot.index] = torch.tensor(step)
                if slot.paged:
                    kept.add(slot.key)
                else:
                    slot.resident = {"packed": await self.store.read(slot.key)}
        if mismatched:
            warnings.warn(
                f"namespace {namespace.name!r}: the saved state of parameters {mismatched} has another shape; "
                "those start over",
                stacklevel=2,
            )
        for key in namespace.keys():
            if key not in kept:
                await self.store.delete(key)

    # -- the math --------------------------------------------------------------------------------------

    def _master(self, slot: ParamSlot, state: torch.Tensor) -> torch.Tensor:
        return state[0]

    def _apply(self, slot: ParamSlot, state: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return self._apply_many([slot], [state], [grad])[0]

    def _apply_many(
        self, slots: list[ParamSlot], states: list[torch.Tensor], grads: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """One call of torch's Adam per parameter group in the bucket (elementwise, so the same
        numbers as a call per parameter or one for all). GradScaler's ``grad_scale`` goes into
        the fused kernel, as torch's fused Adam takes it; the others multiply by its inverse, as
        ``GradScaler.unscale_`` does before torch's other kernels run."""
        by_group: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            by_group.setdefault(slot.group, []).append(i)
        for group_index, members in by_group.items():
            group = self.param_groups[group_index]
            amsgrad = group["amsgrad"]
            fused = group["fused"] if group["fused"] is not None else not group["foreach"]
            beta1, beta2 = group["betas"]
            flat = [grads[i].reshape(-1) for i in members]
            if grad_scale is not None and not fused:
                inverse = inverse_scale(grad_scale)
                flat = [g.mul(inverse) for g in flat]
            adam(
                [states[i][0] for i in members], [g if g.dtype == torch.float32 else g.float() for g in flat],
                [states[i][1] for i in members], [states[i][2] for i in members],
                [states[i][3] for i in members] if amsgrad else [],
                [self._step_counts.setdefault(slots[i].index, torch.tensor(0.0)) for i in members],
                foreach=bool(group["foreach"]) and not fused, fused=bool(fused),
                amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"],
                decoupled_weight_decay=group.get("decoupled_weight_decay", self.decoupled_weight_decay),
                grad_scale=grad_scale if fused else None,
            )
        return [state[0] for state in states]

    # -- checkpoints (tierstore.optim.checkpoint) -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Torch's format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}},
        "param_groups": [...]}``, loadable by ``torch.optim.Adam``/``AdamW``. Parameters whose dtype
        is not fp32 also carry their fp32 ``master`` weight (torch ignores it); DTensor parameters
        (FSDP2) get DTensor state. See ``tierstore.optim.checkpoint``."""
        return adam_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class or by ``torch.optim.Adam``/``AdamW``."""
        adam_load_state_dict(self, state_dict)

    def _entry_of(self, slot: ParamSlot) -> dict[str, torch.Tensor]:
        """One parameter's state in torch's format, read from the store (``opt.state[p]``)."""
        return run(adam_entry(self, slot))


class TieredAdamW(TieredAdam):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2) with state paged through a
    store. Same arguments as ``TieredAdam``."""

    decoupled_weight_decay = True

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
