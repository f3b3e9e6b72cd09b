"""Paged optimizers under ``torch.distributed``: sharded state (ZeRO-1/2), FSDP2's DTensor
parameters, global-norm clipping across ranks, and where each rank's store lives.

Sharded state (``process_group=``): every rank sees every parameter, but owns, pages and
updates the state of about 1/N of them, balanced by bytes (largest first, each to the rank with
the fewest bytes so far). A parameter is owned whole: a parameter that dominates the model
makes its rank the largest (its state is not split in chunks yet). ZeRO-1 (default) updates
after the usual all-reduce (DDP's); ZeRO-2 (``zero_stage=2``, with a model *not* wrapped in
DDP) reduce-scatters the gradients to their owners at ``step()`` (or ``clip_grad_norm_``)
instead, so a sum's order differs from an all-reduce's (results agree to fp32 rounding, not bit
for bit). After the updates each owner broadcasts its new weights, packed per dtype.

FSDP2 (``fully_shard``): parameters are DTensors, and each rank pages the state of its local
shard. ``LocalShard`` shows the shard to the optimizer's machinery as a plain tensor (its data,
``p.grad``'s local tensor) so nothing else needs to know about DTensors; state is handed out as
DTensors with the parameter's mesh and placements. Torch's in-place foreach ops on DTensor
gradients move no version counter, so across a device link each shard's gradient is copied at
``step()`` (the copy its hook started is not trusted).

Clipping by the global norm needs every rank: the sharded optimizer gathers the per-parameter
norms (each from its owner), FSDP2 reduces the local norms as DTensor's own partial-norm
reduction does, so both give ``clip_grad_norm_``'s numbers.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import StepIncompleteError

if TYPE_CHECKING:
    from .paging import PagedOptimizer
    from .slots import ParamSlot

__all__ = ["LocalShard", "PeerStepError", "Sharding", "balance", "free_port", "is_dtensor", "rank_folder", "rank_summary"]


class PeerStepError(StepIncompleteError):
    """Raised by a sharded ``step()`` on the ranks whose own part of the step succeeded when
    another rank's failed: ``failed`` maps each failing rank to its error (``"Type: message"``).
    This rank's updates are applied but no weights were exchanged; ``step()`` again on every
    rank completes the step (the failed ranks apply what they had not, nothing is applied
    twice), ``zero_grad()`` on every rank abandons it (the weights as updated so far are
    exchanged, so the ranks still agree)."""

    def __init__(self, failed: dict[int, str]) -> None:
        causes = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(failed.items()))
        super().__init__(
            f"step() failed on another rank ({causes}); this rank's updates are applied, the new weights were not "
            "exchanged: call step() again on every rank to complete the step, or zero_grad() on every rank to abandon it",
            [], [],
        )
        self.failed = failed


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for ``MASTER_PORT`` of a process group on one machine
    (tests, benchmarks)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2's parameters are)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def rank_folder(root: str | os.PathLike[str]) -> Path:
    """``{root}/rank{r}`` under an initialized process group (ranks share nothing on disk),
    else ``root``."""
    if dist.is_available() and dist.is_initialized():
        return Path(root) / f"rank{dist.get_rank()}"
    return Path(root)


class LocalShard:
    """The rank's shard of a DTensor parameter, as a plain tensor for the optimizer's machinery:
    ``data`` is the local tensor (writes land in the parameter), ``grad`` a view of ``p.grad``'s
    local tensor as it is now."""

    def __init__(self, param: torch.Tensor) -> None:
        self.dtensor = param
        local = param._local_tensor  # type: ignore[attr-defined]
        self.dtype = local.dtype
        self.device = local.device
        self.shape = local.shape

    @property
    def data(self) -> torch.Tensor:
        return self.dtensor._local_tensor  # type: ignore[attr-defined,no-any-return]

    @property
    def grad(self) -> torch.Tensor | None:
        """A new view of ``p.grad``'s local tensor at every access: in-place foreach ops on
        DTensors (``clip_grad_norm_``'s) move no version counter, so a copy taken when the hook
        fired cannot be told current; a new object makes ``step()`` take the gradient again."""
        grad = self.dtensor.grad
        if grad is None:
            return None
        local = grad._local_tensor  # type: ignore[attr-defined]
        return local.view(local.shape)  # type: ignore[no-any-return]

    @property
    def requires_grad(self) -> bool:
        return self.dtensor.requires_grad

    def detach(self) -> torch.Tensor:
        return self.data.detach()

    def element_size(self) -> int:
        return self.data.element_size()

    def is_complex(self) -> bool:
        return self.data.is_complex()

    def as_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a tensor of the shard's shape) as a DTensor laid out like the parameter."""
        from torch.distributed.tensor import DTensor

        p = self.dtensor
        return DTensor.from_local(
            local.view(self.shape), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()  # type: ignore[attr-defined]
        )


def balance(sizes: Sequence[int], world: int) -> list[int]:
    """The owner rank of each size: largest first, each to the rank with the fewest bytes so far
    (ties to the lower index and the lower rank), the same on every rank."""
    owners = [0] * len(sizes)
    loads = [0] * world
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def materialize(params: Iterable[Any]) -> list[Any]:
    """The parameter groups as a list (generators consumed once, here), for planning ownership."""
    items = list(params)
    return [dict(item, params=list(item["params"])) if isinstance(item, dict) else item for item in items]


def _tensors(groups: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for item in groups:
        params = item["params"] if isinstance(item, dict) else [item]
        for p in params:
            out.append(p[1] if isinstance(p, tuple) else p)
    return out


def _state_size(param: torch.Tensor) -> int:
    """What ownership balances: a trainable parameter's size, 0 for a frozen one (it has no
    state; counting it would leave its owner with less state than the others)."""
    return param.numel() * 4 if param.requires_grad else 0


class Sharding:
    """Which rank owns which parameter's state, and the collectives around a sharded step."""

    def __init__(self, groups: list[Any], group: Any, zero_stage: int) -> None:
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 (update after the all-reduce) or 2 (reduce-scatter to owners), not {zero_stage!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("process_group= needs an initialized torch.distributed process group (init_process_group)")
        self.group = dist.group.WORLD if group is True else group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.zero_stage = zero_stage
        tensors = _tensors(groups)
        if any(is_dtensor(t) for t in tensors):
            raise ValueError("parameters are DTensors (FSDP2 shards them already): pass no process_group=")
        owners = balance([_state_size(t) for t in tensors], self.world)
        self._owner: dict[int, int] = {id(t): r for t, r in zip(tensors, owners, strict=True)}
        #: Every parameter of the optimizer, in its order (owned or not).
        self.params: list[torch.Tensor] = []
        #: The global index (position in ``params``) of each owned slot, by slot index.
        self.global_index: list[int] = []
        self._reduced = False
        #: A step failed on some rank and is neither completed nor abandoned (all ranks know).
        self.pending = False
        #: This rank's updates of the current step are all applied (its weights not yet sent).
        self.local_done = False

    def owner(self, param: torch.Tensor) -> int:
        """The rank owning ``param`` (parameters added later go to the least loaded rank)."""
        if id(param) not in self._owner:
            loads = [0] * self.world
            for p in self.params:
                loads[self._owner[id(p)]] += _state_size(p)
            self._owner[id(param)] = min(range(self.world), key=lambda r: (loads[r], r))
        return self._owner[id(param)]

    def add(self, param: torch.Tensor) -> bool:
        """Record ``param`` (in the optimizer's order); whether this rank owns it."""
        mine = self.owner(param) == self.rank
        if mine:
            self.global_index.append(len(self.params))
        self.params.append(param)
        return mine

    # -- ZeRO-2: gradients to their owners -------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average every gradient onto its owner (once a step, before norms or updates), packed
        per dtype in one reduce-scatter whose rank ``r`` segment holds rank ``r``'s parameters.
        Other ranks' gradients of parameters they do not own are dropped (set to None)."""
        if self.zero_stage != 2 or self._reduced:
            return
        self._reduced = True
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        dist.all_reduce(present, group=self.group)
        uneven = [i for i, n in enumerate(present.tolist()) if n not in (0, self.world)]
        if uneven:
            raise RuntimeError(f"zero_stage=2: parameters {uneven} have a gradient on some ranks only")
        with_grad = [p for p, n in zip(self.params, present.tolist(), strict=True) if n]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in with_grad:
            by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)  # type: ignore[union-attr]
        for (dtype, device), params in by_dtype.items():
            segments = [[p for p in params if self._owner[id(p)] == r] for r in range(self.world)]
            width = max(sum(p.numel() for p in seg) for seg in segments)
            if width == 0:
                continue
            flat = torch.zeros(self.world * width, dtype=dtype, device=device)
            for r, seg in enumerate(segments):
                offset = r * width
                for p in seg:
                    flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))  # type: ignore[union-attr]
                    offset += p.numel()
            flat.div_(self.world)  # as DDP's all-reduce hook averages: divide, then sum
            mine = torch.empty(width, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(mine, flat, group=self.group)
            offset = 0
            for p in segments[self.rank]:
                p.grad.copy_(mine[offset : offset + p.numel()].view_as(p.grad))  # type: ignore[union-attr]
                offset += p.numel()
        for p in with_grad:
            if self._owner[id(p)] != self.rank:
                p.grad = None

    def end_step(self) -> None:
        self._reduced = False
        self.pending = self.local_done = False

    # -- a step that failed on some rank -----------------------------------------------------------

    def agree(self, error: BaseException | None) -> None:
        """Every rank says whether its part of the step succeeded, before any weight moves (a
        collective, so a failing rank never leaves the others waiting in a broadcast). When one
        failed, the others raise ``PeerStepError`` naming it and its error; the failing ranks
        return, to raise their own error."""
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, group=self.group)
        if error is None:
            self.local_done = True
        if int(flag.item()) == 0:
            return
        self.pending = True
        causes: list[str | None] = [None] * self.world
        dist.all_gather_object(causes, None if error is None else f"{type(error).__name__}: {error}", group=self.group)
        if error is None:
            raise PeerStepError({dist.get_global_rank(self.group, r): c for r, c in enumerate(causes) if c is not None})

    def found_inf(self, found: bool) -> bool:
        """GradScaler's inf/NaN flag, true on every rank if true on any (every rank skips the
        step together). ZeRO-2 is refused: each rank's scaler checks its own unreduced
        gradients, so the ranks' scales would drift apart."""
        if self.zero_stage == 2:
            raise ValueError(
                "GradScaler with zero_stage=2: each rank's scaler checks its own gradients before the reduce-scatter, so "
                "ranks would disagree on skipped steps and scales; use zero_stage=1 with DDP (its all-reduce comes first)"
            )
        flag = torch.tensor([int(found)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def abandon(self) -> None:
        """``zero_grad()``: a step that failed on some rank is abandoned; the weights as updated
        so far are exchanged (on every rank: all know of the failure), so the ranks agree."""
        if self.pending:
            self.broadcast_weights()
        self.end_step()

    # -- weights from their owners ---------------------------------------------------------------

    def broadcast_weights(self) -> None:
        """Every owner sends its parameters' new values to the other ranks, packed per dtype."""
        for r in range(self.world):
            owned = [p for p in self.params if self._owner[id(p)] == r]
            by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in owned:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
            for (dtype, device), params in by_dtype.items():
                if r == self.rank:
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                else:
                    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
                dist.broadcast(flat, group_src=r, group=self.group)
                if r != self.rank:
                    offset = 0
                    with torch.no_grad():
                        for p in params:
                            p.copy_(flat[offset : offset + p.numel()].view_as(p))
                            offset += p.numel()

    # -- the global norm ---------------------------------------------------------------------------

    def total_norm(self, local: dict[int, torch.Tensor], norm_type: float) -> torch.Tensor:
        """The norm of all gradients from each owner's per-parameter norms (``local``: by global
        index), stacked in parameter order as ``clip_grad_norm_`` stacks them."""
        # Row 0: each norm from its owner, 0 elsewhere; row 1: whether the owner has a gradient.
        # A sum adds exact zeros, so each entry arrives unchanged, NaN and inf included (a MAX
        # against a sentinel would drop a NaN, and clip_grad_norm_ returns NaN then).
        norms = torch.zeros((2, len(self.params)), dtype=torch.float32)
        for index, norm in local.items():
            norms[0, index] = norm.float()
            norms[1, index] = 1.0
        dist.all_reduce(norms, group=self.group)
        present = norms[0][norms[1] > 0]
        if present.numel() == 0:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(present, norm_type)


def mesh_total_norm(local_norms: list[torch.Tensor], norm_type: float, group: Any) -> torch.Tensor:
    """The global norm of DTensor gradients from this rank's per-shard norms, reduced as
    DTensor's partial norm is (``x**p``, sum across ranks, ``**(1/p)``; max for inf)."""
    local = torch.linalg.vector_norm(torch.stack(local_norms), norm_type) if local_norms else torch.tensor(0.0)
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local**norm_type
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)


def mesh_group(slots: Sequence[ParamSlot]) -> Any:
    """The process group of the DTensor parameters' (one-dimensional) mesh, or None."""
    for slot in slots:
        if isinstance(slot.param, LocalShard):
            mesh = slot.param.dtensor.device_mesh  # type: ignore[attr-defined]
            if mesh.ndim != 1:
                raise NotImplementedError("clipping across a mesh of more than one dimension (HSDP) is not supported")
            return mesh.get_group()
    return None


def rank_summary(optimizer: PagedOptimizer, group: Any = None) -> str | None:
    """Every rank's state bytes by tier and last step's time, gathered; the table on rank 0
    (None on the others). A collective: call it on every rank."""
    memory = optimizer.memory_report()
    time_report = optimizer.time_report()
    row = {
        "rank": dist.get_rank(), "params": memory.paged_parameters, "state_by_tier": memory.state_by_tier,
        "resident": memory.resident_state_bytes, "step_wall": time_report.step_wall, "stall": time_report.stall,
    }
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, row, group=group)
    if dist.get_rank() != 0:
        return None
    from ..units import format_bytes

    tiers = sorted({t for r in rows for t in r["state_by_tier"]})
    lines = [f"{'rank':>4} {'paged':>6} " + " ".join(f"{t:>10}" for t in tiers) + f" {'resident':>10} {'step s':>8} {'stall s':>8}"]
    for r in rows:
        lines.append(
            f"{r['rank']:>4} {r['params']:>6} " + " ".join(f"{format_bytes(r['state_by_tier'].get(t, 0)):>10}" for t in tiers)
            + f" {format_bytes(r['resident']):>10} {r['step_wall']:8.3f} {r['stall']:8.3f}"
        )
    return "\n".join(lines)
