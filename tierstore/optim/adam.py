"""``TieredAdam`` and ``TieredAdamW``: Adam with its fp32 master weights and moments paged
through a ``TierStore``.

Each parameter's state is one store entry of shape ``(rows, numel)`` in fp32: master weight,
``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), so one transfer moves all of
it. The math is torch's own ``torch.optim.adam.adam`` (fused CPU kernel by default), so results
match ``torch.optim.Adam``/``AdamW``: bit for bit with the same implementation (``fused=True``
against torch's ``fused=True``, ``fused=False`` against its default), within fp32 rounding
across implementations.

A parameter whose state is larger than a chunk (``chunk_bytes=``, see ``tierstore.optim.chunks``)
keeps it in one such entry per chunk of its elements, ``(rows, chunk numel)`` under
``<key>/c<i>``; Adam is elementwise, so the chunks' updates give the same bits as one update.
``read_state_rows``/``write_state_rows`` read and write a parameter's whole ``(rows, numel)``
state either way (checkpoints).

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
from .chunks import Chunk, chunk_key
from .clipping import inverse_scale
from .paging import PagedOptimizer, ParamSlot
from .pipeline import fill_weight_range


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
        #: A chunked parameter's step count before this step's update, and after it.
        self._chunk_steps: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
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
        if slot.chunks is not None:
            raise RuntimeError(f"internal error: parameter {slot.index} is paged in chunks; use _chunk_state")
        if not self._has(slot.key, rows, slot.numel):
            await self._create(slot.key, rows, slot, 0, slot.numel)
        async with self.store.hold(slot.key, self.state_tier, write=True) as packed:
            yield packed

    def _chunkable(self, slot: ParamSlot) -> bool:
        return type(slot.param) in (torch.Tensor, torch.nn.Parameter) and slot.param.is_contiguous()

    @asynccontextmanager
    async def _chunk_state(self, slot: ParamSlot, chunk: Chunk) -> AsyncIterator[torch.Tensor]:
        rows = self._rows(slot)
        if not self._has(chunk.key, rows, chunk.numel):
            await self._create(chunk.key, rows, slot, chunk.start, chunk.stop)
        async with self.store.hold(chunk.key, self.state_tier, write=True) as packed:
            yield packed

    def _has(self, key: str, rows: int, numel: int) -> bool:
        return key in self.store and self.store.info(key)["shape"] == (rows, numel)

    async def _create(self, key: str, rows: int, slot: ParamSlot, start: int, stop: int) -> None:
        """New state under ``key`` for elements ``start:stop`` of ``slot``, written in place on
        the state tier (no second copy of it, nor of the weight, is made): zero moments, the
        master weight copied from the parameter."""
        async with self.store.fill(key, (rows, stop - start), torch.float32, self.state_tier) as packed:
            packed[1:].zero_()
            await fill_weight_range(slot, start, stop, packed[0])

    async def read_state_rows(self, slot: ParamSlot) -> torch.Tensor:
        """A paged parameter's whole state, ``(rows, numel)`` fp32 (master, exp_avg, exp_avg_sq
        [, max_exp_avg_sq]), gathered from its chunks if it has them (on the store's loop)."""
        if slot.chunks is None:
            return await self.store.read(slot.key)
        packed = torch.empty(self._rows(slot), slot.numel, dtype=torch.float32)
        for chunk in slot.chunks:
            async with self.store.hold(chunk.key, self.state_tier) as part:
                packed[:, chunk.start : chunk.stop].copy_(part)
        return packed

    async def write_state_rows(self, slot: ParamSlot, packed: torch.Tensor) -> None:
        """Store a paged parameter's whole ``(rows, numel)`` state, split into its chunks if it
        has them (on the store's loop)."""
        if slot.chunks is None:
            await self.store.put(slot.key, packed, tier=self.state_tier)
            return
        for chunk in slot.chunks:
            await self.store.put(chunk.key, packed[:, chunk.start : chunk.stop].contiguous(), tier=self.state_tier)

    async def delete_state(self, slot: ParamSlot) -> None:
        """Forget a parameter's paged state (every chunk of it)."""
        for key in [slot.key, *(chunk.key for chunk in slot.chunks or [])]:
            if key in self.store:
                await self.store.delete(key)

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
                if step != step or not (slot.key in self.store or chunk_key(slot.key, 0) in self.store):  # NaN: never stepped
                    continue
                pieces = self._saved_pieces(slot)
                if pieces is None:
                    mismatched.append(slot.index)
                    continue
                keys = await self._relayout(slot, pieces)
                self._step_counts[slot.index] = torch.tensor(step)
                if slot.paged:
                    kept.update(keys)
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

    def _saved_pieces(self, slot: ParamSlot) -> list[tuple[str, int, int]] | None:
        """The entries holding a saved state of ``slot`` in whichever layout saved it (one
        entry, or chunks of any size: ``chunk_bytes`` may have changed since), as ``(key,
        start, stop)`` in element order; None unless they cover the parameter exactly."""
        rows = self._rows(slot)
        if self._has(slot.key, rows, slot.numel):
            return [(slot.key, 0, slot.numel)]
        pieces: list[tuple[str, int, int]] = []
        start = 0
        while (key := chunk_key(slot.key, len(pieces))) in self.store:
            shape = tuple(self.store.info(key)["shape"])
            if len(shape) != 2 or shape[0] != rows or shape[1] < 1:
                return None
            pieces.append((key, start, start + shape[1]))
            start += shape[1]
        return pieces if pieces and start == slot.numel else None

    async def _relayout(self, slot: ParamSlot, pieces: list[tuple[str, int, int]]) -> list[str]:
        """Rewrite the saved state in ``pieces`` into this optimizer's layout of ``slot`` (its
        chunks, or one entry) and return its keys. One saved piece and one new piece are in
        memory at a time; new pieces whose keys the old layout still uses are staged first."""
        targets = [(c.key, c.start, c.stop) for c in slot.chunks] if slot.paged and slot.chunks is not None else [(slot.key, 0, slot.numel)]
        if [p[1:] for p in pieces] == [t[1:] for t in targets]:
            return [key for key, _, _ in targets]
        old = {key for key, _, _ in pieces}
        staged: list[str] = []
        cached: tuple[str, torch.Tensor] | None = None
        for index, (key, start, stop) in enumerate(targets):
            out = torch.empty(self._rows(slot), stop - start, dtype=torch.float32)
            for source, first, last in pieces:
                if last <= start or first >= stop:
                    continue
                if cached is None or cached[0] != source:
                    cached = None  # the previous piece is freed before the next is read
                    cached = (source, await self.store.read(source))
                low, high = max(first, start), min(last, stop)
                out[:, low - start : high - start].copy_(cached[1][:, low - first : high - first])
            staged.append(f"{slot.key}/relayout{index}" if key in old else key)
            await self.store.put(staged[-1], out, tier=self.state_tier)
            del out
        cached = None
        for key in old:
            await self.store.delete(key)
        for temporary, (key, _, _) in zip(staged, targets, strict=True):
            if temporary != key:
                await self.store.put(key, await self.store.read(temporary), tier=self.state_tier)
                await self.store.delete(temporary)
        return [key for key, _, _ in targets]

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
            steps = [self._step_counts.setdefault(slots[i].index, torch.tensor(0.0)) for i in members]
            self._adam(self.param_groups[group_index], [states[i] for i in members], [grads[i] for i in members], steps, grad_scale)
        return [state[0] for state in states]

    def _adam(
        self, group: dict[str, Any], states: list[torch.Tensor], grads: list[torch.Tensor], steps: list[torch.Tensor],
        grad_scale: torch.Tensor | None,
    ) -> None:
        """One call of torch's Adam on packed ``states`` (rows: master, moments) of one group."""
        amsgrad = group["amsgrad"]
        fused = group["fused"] if group["fused"] is not None else not group["foreach"]
        beta1, beta2 = group["betas"]
        flat = [grad.reshape(-1) for grad in grads]
        if grad_scale is not None and not fused:
            inverse = inverse_scale(grad_scale)
            flat = [g.mul(inverse) for g in flat]
        adam(
            [state[0] for state in states], [g if g.dtype == torch.float32 else g.float() for g in flat],
            [state[1] for state in states], [state[2] for state in states],
            [state[3] for state in states] if amsgrad else [],
            steps,
            foreach=bool(group["foreach"]) and not fused, fused=bool(fused),
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"],
            decoupled_weight_decay=group.get("decoupled_weight_decay", self.decoupled_weight_decay),
            grad_scale=grad_scale if fused else None,
        )

    def _begin_chunks(self, slot: ParamSlot) -> None:
        """Before the first chunk of this step's update: every chunk starts from this count
        (a step resumed after a failure keeps the count its first chunks started from)."""
        if not slot.chunks_updated or slot.index not in self._chunk_steps:
            before = self._step_counts.get(slot.index, torch.tensor(0.0))
            self._chunk_steps[slot.index] = (before.clone(), None)

    def _apply_chunk(self, slot: ParamSlot, chunk: Chunk, state: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor | None) -> torch.Tensor:
        before, _ = self._chunk_steps[slot.index]
        step = before.clone()  # torch's Adam counts it up: each chunk from the same count
        self._adam(self.param_groups[slot.group], [state], [grad], [step], grad_scale)
        self._chunk_steps[slot.index] = (before, step)
        return state[0]

    def _end_chunks(self, slot: ParamSlot) -> None:
        before, after = self._chunk_steps.pop(slot.index, (None, None))
        if after is not None:
            self._step_counts[slot.index] = after

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
