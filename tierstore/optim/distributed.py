"""Paged optimizers under ``torch.distributed``: sharded state (ZeRO-1/2), FSDP2's DTensor
parameters, global-norm clipping across ranks, and where each rank's store lives.

Sharded state (``process_group=``): every rank sees every parameter, but owns, pages and
updates the state of about 1/N of them, balanced by bytes (largest first, each to the rank with
the fewest bytes so far). A parameter larger than an even share of all the state (an embedding
that dominates the model) is split by rows instead, as DTensor's ``Shard(0)`` splits it, when
that leaves the largest rank smaller: each rank pages and updates its rows (``ParamRange``, in
chunks of ``chunk_bytes`` as any large state), and its state is handed out and checkpointed as a
DTensor sharded by rows, so DCP saves each rank's rows and reshards them on load. ZeRO-1
(default) updates after the usual all-reduce (DDP's); ZeRO-2 (``zero_stage=2``, with a model
*not* wrapped in DDP) reduce-scatters the gradients to their owners at ``step()`` (or
``clip_grad_norm_``) instead, so a sum's order differs from an all-reduce's (results agree to
fp32 rounding, not bit for bit); the reduce-scatter runs at ``step()``, after backward, not
overlapped with it. After the updates each owner broadcasts its new weights, packed per dtype.

A step is all-or-nothing across ranks: before any weight moves, the ranks agree (one small
all-reduce) on whether every rank's updates succeeded. If one failed (a disk error, a corrupt
record), it raises its own error and the others ``PeerStepError`` naming it, at once rather
than at gloo's timeout; ``step()`` again on every rank completes the step (nothing is applied
twice), ``zero_grad()`` on every rank abandons it with the weights exchanged as they are.
GradScaler's inf flag is agreed the same way, so every rank skips the same steps.

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

import hashlib
import os
import socket
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import StepIncompleteError
from ..tensors import PLAIN_TENSOR_TYPES

if TYPE_CHECKING:
    from .paging import PagedOptimizer
    from .slots import ParamSlot

__all__ = [
    "LocalShard", "ParamRange", "PeerStepError", "Sharding", "balance", "comm_device", "free_port", "is_dtensor", "rank_folder",
    "rank_summary",
]


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


def comm_device(group: Any = None) -> torch.device:
    """Where the small tensors of ``group``'s collectives (flags, norms) must live: the CPU when
    a backend of the group serves it (gloo, ``"cpu:gloo,cuda:nccl"``), else the accelerator
    (``init_process_group("nccl")`` alone registers no CPU backend: a CPU tensor's collective
    raises "No backend type associated with device type cpu")."""
    group = dist.group.WORLD if group is None or group is True else group
    kinds = [d.type for d in getattr(group, "_device_types", ())]
    if not kinds:  # (a torch without _device_types, or nothing registered yet)
        kinds = ["cpu" if "gloo" in str(dist.get_backend(group)) or "mpi" in str(dist.get_backend(group)) else "cuda"]
    if "cpu" in kinds:
        return torch.device("cpu")
    module = getattr(torch, kinds[0], None)
    available = module is not None and hasattr(module, "is_available") and module.is_available()
    return torch.device(kinds[0], module.current_device()) if available else torch.device(kinds[0])  # type: ignore[union-attr]


def rank_folder(root: str | os.PathLike[str]) -> Path:
    """``{root}/rank{r}`` under an initialized process group, or in a process that a launcher
    started as rank *r* (``RANK`` and ``WORLD_SIZE`` set, as torchrun and accelerate set them:
    the group may be initialized later, as transformers' ``TrainingArguments`` does); else
    ``root``. Ranks share nothing on disk."""
    if dist.is_available() and dist.is_initialized():
        return Path(root) / f"rank{dist.get_rank()}"
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isascii() and rank.isdigit() and world.isascii() and world.isdigit():
        return Path(root) / f"rank{int(rank)}"
    return Path(root)


#: The gradient dtypes ZeRO-2's reduce-scatter packs (each rank says its gradients' by an index here).
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.complex128)


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
    def parameter(self) -> torch.Tensor:
        """The parameter as the model holds it (the DTensor)."""
        return self.dtensor

    @property
    def data(self) -> torch.Tensor:
        return self.dtensor._local_tensor  # type: ignore[attr-defined,no-any-return]

    @property
    def grad(self) -> torch.Tensor | None:
        """A new view of ``p.grad``'s local tensor at every access. In-place foreach ops on
        DTensors (``clip_grad_norm_``'s) move no version counter, so the copy taken when the hook
        fired is matched at ``step()`` by the memory and a fingerprint of the values
        (``Capture.fingerprint``), not by the object and its version."""
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


class ParamRange:
    """This rank's rows of a parameter whose state is split across ranks (it dominates the
    model), as a plain flat tensor for the optimizer's machinery: ``data`` is a view of the
    parameter's elements ``start:stop`` (writes land in the parameter), ``grad`` the same
    elements of ``p.grad``. State is handed out as a DTensor sharded by rows over the group's
    mesh (``Shard(0)``), so DCP saves each rank's rows and reshards on load."""

    def __init__(self, param: torch.Tensor, rows: tuple[int, int], sharding: Sharding) -> None:
        self.param = param
        row = param.numel() // param.shape[0] if param.dim() and param.shape[0] else 1
        self.rows = rows
        self.start, self.stop = rows[0] * row, rows[1] * row
        self.dtype = param.dtype
        self.device = param.device
        self.shape = torch.Size([self.stop - self.start])
        self._sharding = sharding
        self._grad: tuple[Any, torch.Tensor, tuple[Any, ...]] | None = None

    @property
    def parameter(self) -> torch.Tensor:
        """The parameter as the model holds it."""
        return self.param

    @property
    def data(self) -> torch.Tensor:
        return self.param.data.view(-1)[self.start : self.stop]

    @property
    def grad(self) -> torch.Tensor | None:
        """The rows of ``p.grad``: the same view object while ``p.grad`` is the same tensor in
        the same memory (a view shares its version counter, so in-place changes still show);
        a new one otherwise. Forgotten at the end of each step (``Sharding.end_step``)."""
        base = self.param.grad
        if base is None:
            self._grad = None
            return None
        memory = (base.data_ptr(), tuple(base.shape), tuple(base.stride()))
        cached = self._grad
        if cached is not None and cached[0]() is base and cached[2] == memory:
            return cached[1]
        if not base.is_contiguous():  # a copy: no version shared, so step() takes it again
            return base.reshape(-1)[self.start : self.stop]
        view = base.view(-1)[self.start : self.stop]
        self._grad = (weakref.ref(base), view, memory)
        return view

    def forget_grad(self) -> None:
        self._grad = None

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    def detach(self) -> torch.Tensor:
        return self.data.detach()

    def element_size(self) -> int:
        return self.param.element_size()

    def is_complex(self) -> bool:
        return self.param.is_complex()

    def is_contiguous(self) -> bool:
        return True

    def local_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a whole (not split) state tensor of the parameter's size."""
        if tensor.numel() == self.param.numel():
            return tensor.reshape(-1)[self.start : self.stop]
        return tensor

    def as_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a flat tensor of this rank's elements) as a DTensor of the parameter's
        shape, sharded by rows over the group's mesh."""
        from torch.distributed.tensor import DTensor, Shard

        p = self.param
        shape = (self.rows[1] - self.rows[0], *p.shape[1:]) if p.dim() else ()
        return DTensor.from_local(
            local.view(shape), self._sharding.mesh(), [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
        )


def split_rows(rows: int, world: int) -> list[tuple[int, int]] | None:
    """The rows of each rank when a parameter of ``rows`` rows is split as DTensor's
    ``Shard(0)`` splits it (``torch.chunk``: ``ceil(rows / world)`` a rank), or None when that
    leaves a rank without rows."""
    per = -(-rows // world)
    if per * (world - 1) >= rows:
        return None
    return [(r * per, min((r + 1) * per, rows)) for r in range(world)]


def plan_ownership(params: Sequence[torch.Tensor], world: int) -> list[int | list[tuple[int, int]]]:
    """Who owns each parameter's state: a rank, or every rank, each its rows as ``split_rows``
    gives them. A parameter larger than an even share of all the state (no rank could hold it
    whole without exceeding the share) is split, the rest balanced by bytes around it, when that
    leaves the largest rank smaller than balancing whole parameters does."""
    sizes = [_state_size(p) for p in params]
    share = sum(sizes) / world
    plan: list[int | list[tuple[int, int]]] = list(balance(sizes, world))
    whole_peak = max(_loads(sizes, plan, params, world), default=0)
    split: list[int | list[tuple[int, int]]] = [0] * len(params)
    loads = [0] * world
    rest = []
    for i, p in enumerate(params):
        rows = split_rows(p.shape[0], world) if world > 1 and sizes[i] > share and p.dim() and _splittable(p) else None
        if rows is None:
            rest.append(i)
            continue
        split[i] = rows
        for r, (first, last) in enumerate(rows):
            loads[r] += (last - first) * (sizes[i] // p.shape[0])
    for i, rank in zip(rest, balance([sizes[i] for i in rest], world, loads), strict=True):
        split[i] = rank
    return split if max(_loads(sizes, split, params, world), default=0) < whole_peak else plan


def _loads(sizes: list[int], plan: Sequence[int | list[tuple[int, int]]], params: Sequence[torch.Tensor], world: int) -> list[int]:
    loads = [0] * world
    for size, owner, p in zip(sizes, plan, params, strict=True):
        if isinstance(owner, int):
            loads[owner] += size
        else:
            for r, (first, last) in enumerate(owner):
                loads[r] += (last - first) * (size // p.shape[0])
    return loads


def _splittable(param: torch.Tensor) -> bool:
    """A plain, contiguous parameter whose weight lives in the model (not ``offload_parameters``')."""
    from .pipeline import offloaded

    return type(param) in PLAIN_TENSOR_TYPES and param.is_contiguous() and offloaded(param) is None


def balance(sizes: Sequence[int], world: int, start: Sequence[int] | None = None) -> list[int]:
    """The owner rank of each size: largest first, each to the rank with the fewest bytes so far
    (``start``: the ranks' loads before; ties to the lower index and the lower rank), the same
    on every rank."""
    owners = [0] * len(sizes)
    loads = list(start) if start is not None else [0] * world
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
        self.group: Any = dist.group.WORLD if group is True else group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.zero_stage = zero_stage
        #: Where flags and norms cross (the CPU under gloo, the GPU under NCCL alone).
        self.device = comm_device(self.group)
        tensors = _tensors(groups)
        if any(is_dtensor(t) for t in tensors):
            raise ValueError("parameters are DTensors (FSDP2 shards them already): pass no process_group=")
        self.check_same(tensors)
        #: Each parameter's owner: a rank, or every rank's rows (a split parameter).
        self._owner: dict[int, int | list[tuple[int, int]]] = {
            id(t): o for t, o in zip(tensors, plan_ownership(tensors, self.world), strict=True)
        }
        #: Every parameter of the optimizer, in its order (owned or not).
        self.params: list[torch.Tensor] = []
        #: The global index (position in ``params``) of each owned slot, by slot index.
        self.global_index: list[int] = []
        self._ranges: list[ParamRange] = []
        self._mesh: Any = None
        self._reduced = False
        #: A step failed on some rank and is neither completed nor abandoned (all ranks know).
        self.pending = False
        #: This rank's updates of the current step are all applied (its weights not yet sent).
        self.local_done = False

    def check_same(self, params: Sequence[torch.Tensor]) -> None:
        """``ValueError`` on every rank unless every rank lists parameters of the same shapes,
        dtypes, ``requires_grad``, layout and class (a collective): each rank plans the owners from its own list,
        and lists that differ (a parameter frozen on one rank only) would split the model
        silently, each rank broadcasting weights the others do not expect."""
        described = [(tuple(p.shape), str(p.dtype), bool(p.requires_grad), p.is_contiguous(), type(p).__name__) for p in params]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, hashlib.blake2b(repr(described).encode(), digest_size=16).digest(), group=self.group)
        if len(set(everyone)) == 1:
            return
        dist.all_gather_object(everyone, described, group=self.group)
        counts = {len(listed) for listed in everyone}
        if len(counts) > 1:
            raise ValueError(f"the ranks list different numbers of parameters ({[len(listed) for listed in everyone]} by rank): "
                             "every rank must give the optimizer the same parameters, in the same order")
        differing = [i for i in range(len(described)) if len({listed[i] for listed in everyone}) > 1]
        first = differing[0]
        seen = "; ".join(f"rank {rank}: shape {listed[first][0]}, {listed[first][1]}, requires_grad={listed[first][2]}"
                         + ("" if listed[first][3] else ", not contiguous") + f", {listed[first][4]}"
                         for rank, listed in enumerate(everyone))
        raise ValueError(
            f"parameters {differing[:8]}{'...' if len(differing) > 8 else ''} differ across the ranks (parameter {first}: {seen}): "
            "with process_group= each rank plans who owns which state from its own list, so every rank must give the same "
            "parameters, frozen (requires_grad=False) on every rank or on none, before the optimizer is made"
        )

    def owner(self, param: torch.Tensor) -> int | list[tuple[int, int]]:
        """The rank owning ``param``, or each rank's rows of a split one (parameters added
        later go whole to the least loaded rank)."""
        if id(param) not in self._owner:
            loads = [0] * self.world
            for p in self.params:
                for rank, first, last in self.pieces(p):
                    loads[rank] += (last - first) * 4 if p.requires_grad else 0
            self._owner[id(param)] = min(range(self.world), key=lambda r: (loads[r], r))
        return self._owner[id(param)]

    def pieces(self, param: torch.Tensor) -> list[tuple[int, int, int]]:
        """``(rank, start, stop)``: who owns which elements of the flattened ``param``."""
        owner = self.owner(param)
        if isinstance(owner, int):
            return [(owner, 0, param.numel())]
        row = param.numel() // param.shape[0]
        return [(rank, first * row, last * row) for rank, (first, last) in enumerate(owner)]

    def add(self, param: torch.Tensor) -> torch.Tensor | ParamRange | None:
        """Record ``param`` (in the optimizer's order); what of it this rank updates: the
        parameter, its rows (``ParamRange``), or None (another rank owns its state)."""
        owner = self.owner(param)
        index = len(self.params)
        self.params.append(param)
        if isinstance(owner, int):
            if owner != self.rank:
                return None
            self.global_index.append(index)
            return param
        self.global_index.append(index)
        view = ParamRange(param, owner[self.rank], self)
        self._ranges.append(view)
        return view

    def forget_from(self, count: int) -> None:
        """Forget the parameters recorded after the first ``count`` (a group refused)."""
        dropped = self.params[count:]
        del self.params[count:]
        self.global_index = [index for index in self.global_index if index < count]
        self._ranges = [view for view in self._ranges if all(view.param is not p for p in dropped)]
        for param in dropped:
            self._owner.pop(id(param), None)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (a collective: every rank calls it)."""
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def split(self) -> list[torch.Tensor]:
        """The parameters whose state is split across the ranks."""
        return [p for p in self.params if not isinstance(self.owner(p), int)]

    def mesh(self) -> Any:
        """A one-dimensional ``DeviceMesh`` over the group (the layout of split state)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            device = self.params[0].device.type if self.params else "cpu"
            self._mesh = DeviceMesh.from_group(self.group, device)
        return self._mesh

    # -- ZeRO-2: gradients to their owners -------------------------------------------------------

    @property
    def reduced(self) -> bool:
        """Whether this step's gradients were reduce-scattered already (ZeRO-2)."""
        return self._reduced

    def reduce_gradients(self) -> None:
        """Average every gradient onto its owner (once a step, before norms or updates), packed
        per dtype in one reduce-scatter whose rank ``r`` segment holds rank ``r``'s elements.
        A gradient some ranks have and others not (a module used on some ranks only; or unused
        on all, after ``zero_grad(set_to_none=False)`` kept the zeros of the ranks that own it)
        counts as zeros where missing, as DDP counts an unused parameter's: the owner's gradient
        is the average over every rank. Other ranks' gradients of parameters they own nothing of
        are dropped (set to None)."""
        if self.zero_stage != 2 or self._reduced:
            return
        dtypes = self._agreed_grad_dtypes()  # (refused on every rank: step() again reduces)
        self._reduced = True
        with_grad = [(p, dtype) for p, dtype in zip(self.params, dtypes, strict=True) if dtype is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, dtype in with_grad:
            by_dtype.setdefault(dtype, []).append(p)
        for dtype, params in by_dtype.items():
            device = params[0].device
            segments: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in range(self.world)]
            for p in params:
                for rank, start, stop in self.pieces(p):
                    segments[rank].append((p, start, stop))
            width = max(sum(stop - start for _, start, stop in seg) for seg in segments)
            if width == 0:
                continue
            flat = torch.zeros(self.world * width, dtype=dtype, device=device)
            for r, seg in enumerate(segments):
                offset = r * width
                for p, start, stop in seg:
                    if p.grad is not None:  # (none here: zeros)
                        flat[offset : offset + stop - start].copy_(p.grad.reshape(-1)[start:stop])
                    offset += stop - start
            flat.div_(self.world)  # as DDP's all-reduce hook averages: divide, then sum
            mine = torch.empty(width, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(mine, flat, group=self.group)
            offset = 0
            for p, start, stop in segments[self.rank]:
                with torch.no_grad():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p, dtype=dtype)
                    if start == 0 and stop == p.numel():
                        p.grad.copy_(mine[offset : offset + stop - start].view(p.grad.shape))
                    else:  # our rows of a split parameter (the others' rows are left unreduced)
                        p.grad.view(-1)[start:stop].copy_(mine[offset : offset + stop - start])
                offset += stop - start
        for p, _ in with_grad:
            if all(rank != self.rank for rank, _, _ in self.pieces(p)):
                p.grad = None

    def _agreed_grad_dtypes(self) -> list[torch.dtype | None]:
        """Per parameter, the dtype of its gradient on the ranks that have one (None: no rank
        has one), gathered from every rank (a collective): the ranks must pack the same
        reduce-scatters, also where a rank has no gradient to say it by."""
        codes = torch.tensor([0 if p.grad is None else _GRAD_DTYPES.index(p.grad.dtype) + 1 if p.grad.dtype in _GRAD_DTYPES else -1
                              for p in self.params], dtype=torch.int32, device=self.device)
        gathered = [torch.empty_like(codes) for _ in range(self.world)]
        dist.all_gather(gathered, codes, group=self.group)
        table = torch.stack(gathered).tolist()
        dtypes: list[torch.dtype | None] = []
        for i, column in enumerate(zip(*table, strict=True)):
            if -1 in column:
                raise ValueError(f"zero_stage=2: parameter {i} has a gradient of a dtype the reduce-scatter does not take "
                                 f"(it takes {', '.join(str(d) for d in _GRAD_DTYPES)})")
            found = {code for code in column if code}
            if len(found) > 1:
                raise ValueError(f"zero_stage=2: parameter {i} has gradients of different dtypes on the ranks "
                                 f"({', '.join(str(_GRAD_DTYPES[code - 1]) for code in sorted(found))})")
            dtypes.append(_GRAD_DTYPES[found.pop() - 1] if found else None)
        return dtypes

    def end_step(self) -> None:
        self._reduced = False
        self.pending = self.local_done = False
        for view in self._ranges:
            view.forget_grad()

    # -- a step that failed on some rank -----------------------------------------------------------

    def agree(self, error: BaseException | None) -> None:
        """Every rank says whether its part of the step succeeded, before any weight moves (a
        collective, so a failing rank never leaves the others waiting in a broadcast). When one
        failed, the others raise ``PeerStepError`` naming it and its error; the failing ranks
        return, to raise their own error."""
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.device)
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
        flag = torch.tensor([int(found)], dtype=torch.int32, device=self.device)
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
        """Every owner sends the new values of its parameters (and rows of split ones) to the
        other ranks, packed per dtype."""
        for r in range(self.world):
            by_dtype: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, int, int]]] = {}
            for p in self.params:
                for rank, start, stop in self.pieces(p):
                    if rank == r and stop > start:
                        by_dtype.setdefault((p.dtype, p.device), []).append((p, start, stop))
            for (dtype, device), pieces in by_dtype.items():
                if r == self.rank:
                    flat = torch.cat([p.detach().reshape(-1)[start:stop] for p, start, stop in pieces])
                else:
                    flat = torch.empty(sum(stop - start for _, start, stop in pieces), dtype=dtype, device=device)
                dist.broadcast(flat, group_src=r, group=self.group)
                if r != self.rank:
                    offset = 0
                    with torch.no_grad():
                        for p, start, stop in pieces:
                            if start == 0 and stop == p.numel():
                                p.copy_(flat[offset : offset + stop].view_as(p))
                            else:
                                p.view(-1)[start:stop].copy_(flat[offset : offset + stop - start])
                            offset += stop - start

    # -- the global norm ---------------------------------------------------------------------------

    def total_norm(self, local: dict[int, torch.Tensor], norm_type: float) -> torch.Tensor:
        """The norm of all gradients from each owner's per-parameter norms (``local``: by global
        index), stacked in parameter order as ``clip_grad_norm_`` stacks them. A split
        parameter's norm is that of its whole gradient: with ZeRO-1 every rank has it, and the
        owner of its first rows computes it as torch does; with ZeRO-2 each rank has its rows
        reduced only, and the norms of the rows are combined (fp32 rounding apart, the same)."""
        # Row 0: each norm from its owner, 0 elsewhere; row 1: whether the owner has a gradient.
        # A sum adds exact zeros, so each entry arrives unchanged, NaN and inf included (a MAX
        # against a sentinel would drop a NaN, and clip_grad_norm_ returns NaN then).
        norms = torch.zeros((2, len(self.params)), dtype=torch.float32, device=self.device)
        split = {i for i, p in enumerate(self.params) if not isinstance(self.owner(p), int)}
        peak = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)  # ZeRO-2's split inf-norms
        for index, norm in local.items():
            if index not in split:
                norms[0, index] = norm.float()
                norms[1, index] = 1.0
            elif self.zero_stage == 2:  # this rank's rows: combined across ranks below
                norms[0, index] = norm.float() if norm_type == float("inf") else norm.float() ** norm_type
                peak[index] = norm.float()
                norms[1, index] = 1.0 / self.world
            elif self.rank == 0:  # ZeRO-1: rank 0 (its first rows' owner) has the whole gradient
                grad = self.params[index].grad
                assert grad is not None  # (every rank has it: DDP's all-reduce)
                norms[0, index] = torch.linalg.vector_norm(grad, norm_type).float()
                norms[1, index] = 1.0
        dist.all_reduce(norms, group=self.group)
        if self.zero_stage == 2 and split:
            if norm_type == float("inf"):
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
            for index in split:
                total = norms[0, index]  # (a NaN in any rank's rows stays NaN: MAX may drop it)
                norms[0, index] = total if total.isnan() else peak[index] if norm_type == float("inf") else total ** (1.0 / norm_type)
        present = norms[0][norms[1] > 0]
        if present.numel() == 0:
            return torch.tensor(0.0)
        # torch stacks the norms in the gradients' dtype (bf16 for a bf16 model): the fp32
        # round trip above is exact, so casting back gives clip_grad_norm_'s total exactly.
        dtypes = [self.params[int(i)].dtype for i in (norms[1] > 0).nonzero().flatten()]
        dtype = dtypes[0]
        for other in dtypes[1:]:
            dtype = torch.promote_types(dtype, other)
        return torch.linalg.vector_norm(present.to(dtype), norm_type)


def mesh_total_norm(local_norms: list[torch.Tensor], norm_type: float, groups: Sequence[Any]) -> torch.Tensor:
    """The global norm of DTensor gradients from this rank's per-shard norms, reduced as
    DTensor's partial norm is (``x**p``, summed over the mesh's sharded dimensions, ``**(1/p)``;
    max for inf). ``groups``: one process group per sharded mesh dimension (replicas hold the
    same shard, so a replicated dimension (HSDP's) is not reduced over)."""
    if len(groups) == 1 and norm_type != float("inf") and _same_count(len(local_norms), groups[0]) and local_norms:
        # As torch's clip_grad_norm_ on DTensor gradients: each parameter's norm reduced over the
        # ranks first, then the norm of those (the same bits; the sum of the ranks' totals
        # differs in the last bit).
        powered = (torch.stack(local_norms) ** norm_type).to(comm_device(groups[0]))
        dist.all_reduce(powered, group=groups[0])
        return torch.linalg.vector_norm(powered ** (1.0 / norm_type), norm_type)
    local = torch.linalg.vector_norm(torch.stack(local_norms), norm_type) if local_norms else torch.tensor(0.0)
    if groups:  # (a rank without gradients, or FSDP2's CPU offload under NCCL: where the group reduces)
        local = local.to(comm_device(groups[0]))
    if norm_type == float("inf"):
        for group in groups:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local**norm_type
    for group in groups:
        dist.all_reduce(powered, group=group)
    return powered ** (1.0 / norm_type)


def _same_count(count: int, group: Any) -> bool:
    """Whether every rank of ``group`` has ``count`` norms (a collective: a rank whose gradient
    list differs must not reduce vectors of other lengths, which would hang or mix them)."""
    bounds = torch.tensor([count, -count], dtype=torch.int64, device=comm_device(group))
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    return bounds.tolist() == [count, -count]


def mesh_group(slots: Sequence[ParamSlot]) -> tuple[Any, ...] | None:
    """The process groups of the DTensor parameters' mesh dimensions that shard them (FSDP2's
    one; HSDP's shard dimension, not its replicate one), or None without DTensor parameters."""
    for slot in slots:
        if isinstance(slot.param, LocalShard):
            p = slot.param.dtensor
            mesh = p.device_mesh  # type: ignore[attr-defined]
            sharded = [dim for dim, placement in enumerate(p.placements) if not placement.is_replicate()]  # type: ignore[attr-defined]
            return tuple(mesh.get_group(dim) for dim in sharded)
    return None


def rank_summary(optimizer: PagedOptimizer, group: Any = None) -> str | None:
    """Every rank's state bytes by tier and last step's time, gathered; the table on the
    group's first rank (None on the others). A collective: call it on every rank of ``group``."""
    memory = optimizer.memory_report()
    time_report = optimizer.time_report()
    row = {
        "rank": dist.get_rank(), "params": memory.paged_parameters, "state_by_tier": memory.state_by_tier,
        "resident": memory.resident_state_bytes, "step_wall": time_report.step_wall, "stall": time_report.stall,
    }
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, row, group=group)
    if dist.get_rank(group) != 0:  # (the group's first rank, not global rank 0: it may be outside the group)
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
