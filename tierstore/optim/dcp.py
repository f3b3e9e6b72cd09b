"""Distributed Checkpoint (DCP) of paged optimizer state through a bounded buffer.

``get_optimizer_state_dict(model, opt)`` followed by ``dcp.save`` holds a rank's whole state in
memory at once (the state dict's tensors). This module writes and reads the same checkpoint, key
for key and shape for shape, one parameter's state at a time:

- ``optimizer_state_dict(opt, model)`` is ``get_optimizer_state_dict(model, opt)`` (or, without a
  model, ``opt.state_dict()``) with *placeholders*: meta tensors (DTensors of meta shards under
  FSDP2) of the right shape and dtype, without data. DCP plans a checkpoint from shapes alone.
- ``StreamingSavePlanner``'s ``resolve_data`` reads a placeholder's parameter from the store when
  the writer asks for one of its tensors (``adam_entry``: one parameter's torch-format state), and
  forgets it once the writer has taken all of that parameter's tensors.
- ``StreamingLoadPlanner``'s ``resolve_tensor`` hands DCP a buffer for one tensor of one
  parameter; once every tensor of that parameter has arrived (``commit_tensor``), the state is
  written into the tiers and the buffers are dropped.
- ``StreamingFileSystemWriter`` writes a rank's tensors to files of at most ``buffer_bytes``
  (DCP's ``FileSystemWriter`` keeps every tensor of a file until the file is closed, so its one
  file per rank would hold the rank's whole state).
- ``save_optimizer`` / ``load_optimizer`` do it all for one optimizer. ``load_optimizer`` also
  splits the parameters into passes of at most ``buffer_bytes`` of state, so the bound holds
  whatever order the checkpoint's files hand the tensors over in (a checkpoint of several
  ranks may keep one parameter's tensors in different files, which DCP reads one after another).

Checkpoints are those of the standard path (the same keys, shapes, dtypes and chunks in DCP's
metadata; only the number of files differs): ``torch.optim.AdamW`` loads one written here
through ``get/set_optimizer_state_dict`` + ``dcp.load``, this module loads one written by it,
and DCP reshards both ways (another rank count, sharded state, FSDP2 DTensors).

Memory bound per rank, beyond the store's own tiers, with ``B`` = ``buffer_bytes``, ``S`` the
largest parameter's (or FSDP2 shard's) state in torch's format (``4 * numel * (2 + amsgrad +
master)`` bytes: ``exp_avg``, ``exp_avg_sq`` [, ``max_exp_avg_sq``] [, the fp32 ``master`` of a
non-fp32 parameter]) and ``T`` its largest tensor (``4 * numel``):

- save: ``B + T + 2 S`` (the file being written; ``adam_entry`` reading the state while it builds
  one parameter's entry). With ``thread_count`` writer threads, that many files at once; on a
  machine with CUDA, DCP's overlapping loader also keeps ``per_thread_copy_ahead`` bytes (10 MB by
  default) in flight.
- load: ``max(B, S) + S + T_saved`` (the entries being assembled, the packed state written into
  the store, and the tensor DCP's reader deserialised: a whole saved tensor, or a saved rank's
  shard of it). Usually one parameter's entry is assembled at a time; the passes cap the rest.

Not the state's size: what lives on disk stays there until its parameter's turn. Not with
``dcp.async_save``, which stages the whole state dict in memory first.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..sync import run
from .checkpoint import (
    _laid_out,
    _others,
    adam_entry,
    adam_load_entry,
    keep_decoupling,
    model_param,
    saved_groups,
    saved_index,
)
from .distributed import is_dtensor

if TYPE_CHECKING:
    import os

    from .adam import TieredAdam
    from .slots import ParamSlot

__all__ = [
    "DEFAULT_BUFFER_BYTES", "StreamingFileSystemWriter", "StreamingLoadPlanner", "StreamingSavePlanner", "load_optimizer",
    "optimizer_state_dict", "save_optimizer",
]

_PARAM_GROUPS = "param_groups"
#: Param-group keys that say how the optimizer stores its state: loading does not change them.
_STORAGE_KEYS = ("params", "state_precision", "master_weights")

#: The default budget (bytes) of tensors a save keeps per file (``StreamingFileSystemWriter``)
#: and of state a load assembles at once (``load_optimizer``).
DEFAULT_BUFFER_BYTES = 64 << 20


# -- placeholders --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """Where a placeholder's data lives: tensor ``name`` of ``slot``'s state in ``optimizer``."""

    optimizer: TieredAdam
    slot: ParamSlot
    name: str

    @property
    def owner(self) -> tuple[int, int]:
        """One key per parameter of one optimizer."""
        return id(self.optimizer), self.slot.index


#: id(placeholder) -> (a weak reference to it, its source). Weak: a placeholder dict dropped
#: by its user takes its entries along.
_placeholders: dict[int, tuple[weakref.ref[torch.Tensor], _Source]] = {}
_registry_lock = threading.Lock()


def _register(tensor: torch.Tensor, source: _Source) -> torch.Tensor:
    key = id(tensor)

    def forget(_: object) -> None:
        with _registry_lock:
            held = _placeholders.get(key)
            if held is not None and held[0]() is None:
                del _placeholders[key]

    with _registry_lock:
        _placeholders[key] = (weakref.ref(tensor, forget), source)
    return tensor


def _source(obj: Any) -> _Source | None:
    """The source of a placeholder made by ``optimizer_state_dict``, else None."""
    if not isinstance(obj, torch.Tensor):
        return None
    with _registry_lock:
        held = _placeholders.get(id(obj))
    if held is None or held[0]() is not obj:
        return None
    return held[1]


def _placeholder(slot: ParamSlot, name: str, source: _Source) -> torch.Tensor:
    """A meta tensor laid out as ``adam_entry`` lays out ``slot``'s state tensor ``name``: the
    parameter's shape, or a DTensor like the one it hands out (an FSDP2 shard, a parameter
    whose rows are split across ranks)."""
    if name == "step":
        return _register(torch.empty((), dtype=torch.float32, device="meta"), source)
    return _register(_laid_out(slot, torch.empty(slot.numel, dtype=torch.float32, device="meta")), source)


def _entry_names(optimizer: TieredAdam, slot: ParamSlot) -> list[str]:
    """The tensors of one parameter's state in torch's format, as ``adam_entry`` gives them."""
    names = ["step", "exp_avg", "exp_avg_sq"]
    if optimizer._rows(slot) > 3:
        names.append("max_exp_avg_sq")
    if slot.param.dtype != torch.float32:
        names.append("master")
    return names


def _placeholder_state_dict(optimizer: TieredAdam) -> dict[str, Any]:
    """``optimizer.state_dict()`` with placeholders for tensors (the same keys and shapes),
    between its ``register_state_dict_pre_hook``/``..._post_hook`` hooks as torch's
    ``state_dict`` runs them: a post-hook sees the placeholders (meta tensors), not values."""
    _check(optimizer)
    return optimizer._hooked_state_dict(lambda: _unhooked_placeholder_state_dict(optimizer))


def _unhooked_placeholder_state_dict(optimizer: TieredAdam) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for slot in optimizer._slots:
        if model_param(slot).requires_grad or slot.index in optimizer._step_counts:
            state[saved_index(optimizer, slot)] = {
                name: _placeholder(slot, name, _Source(optimizer, slot, name))
                for name in _entry_names(optimizer, slot)
            }
    for index in _others(optimizer):
        state[index] = {}
    return {"state": dict(sorted(state.items())), "param_groups": saved_groups(optimizer)}


def _check(optimizer: Any) -> None:
    from .adam import TieredAdam

    if not isinstance(optimizer, TieredAdam):
        raise TypeError(f"streaming checkpoints take a TieredAdam/TieredAdamW, not {type(optimizer).__name__}")
    if getattr(optimizer, "_closed", False):
        raise ValueError("the optimizer is closed")


@contextmanager
def _placeholders_for(optimizer: TieredAdam) -> Iterator[None]:
    """``optimizer.state_dict()`` answers placeholders while inside (for torch's
    ``get_optimizer_state_dict``, which maps its indices to parameter names)."""
    optimizer.state_dict = lambda: _placeholder_state_dict(optimizer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del optimizer.state_dict


def optimizer_state_dict(optimizer: TieredAdam, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The optimizer's state dict as DCP saves it, with placeholders instead of state tensors.

    With ``model``: ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model,
    optimizer)``'s keys (parameter names); without: ``optimizer.state_dict()``'s (indices). Each
    state tensor is a meta tensor of its shape (a DTensor of a meta shard for an FSDP2
    parameter) that ``StreamingSavePlanner`` reads from the store when DCP writes it, and
    ``StreamingLoadPlanner`` writes into the store when DCP has read it. To save the model and the
    optimizer in one checkpoint::

        dcp.save({"model": get_model_state_dict(model), "optim": optimizer_state_dict(opt, model)},
                 storage_writer=StreamingFileSystemWriter(path), planner=StreamingSavePlanner())

    Raises
    ------
    TypeError
        ``optimizer`` is not a ``TieredAdam``/``TieredAdamW``.
    """
    _check(optimizer)
    if model is None:
        return _placeholder_state_dict(optimizer)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _placeholders_for(optimizer):
        return get_optimizer_state_dict(model, optimizer)


# -- saving --------------------------------------------------------------------------------------


def _item_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    return data.chunk.sizes.numel() * torch.empty((), dtype=data.properties.dtype).element_size()


def _buckets(items: list[WriteItem], budget: int) -> list[list[WriteItem]]:
    """``items`` in order, in runs of at most ``budget`` tensor bytes (a larger item alone)."""
    buckets: list[list[WriteItem]] = [[]]
    used = 0
    for item in items:
        size = _item_bytes(item)
        if buckets[-1] and size and used + size > budget:
            buckets.append([])
            used = 0
        buckets[-1].append(item)
        used += size
    return buckets


class StreamingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, writing a rank's items to files of at most ``buffer_bytes``
    of tensors each (the last item may take a file past it) instead of one file per rank.

    DCP's writer keeps every tensor of a file until the file is closed, so one file per rank
    would keep the rank's whole state. The checkpoint has the same keys, shapes and metadata;
    only the storage is spread over more files (any DCP reader reads them).
    """

    def __init__(self, path: str | os.PathLike[str], buffer_bytes: int = DEFAULT_BUFFER_BYTES, **kwargs: Any) -> None:
        if buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
        super().__init__(path, **kwargs)
        self.buffer_bytes = buffer_bytes

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        from torch.distributed.checkpoint.filesystem import _StoragePrefix

        prefix = plan.storage_data.prefix
        results: list[WriteResult] = []
        for index, bucket in enumerate(_buckets(plan.items, self.buffer_bytes)):
            part = dataclasses.replace(plan, items=bucket, storage_data=_StoragePrefix(f"{prefix}{index}_"))
            results += super().write_data(part, planner).wait()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done



def _shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that placeholders (``optimizer_state_dict``) are
    read from the store when the writer asks for them, one parameter's state at a time, and
    dropped once the writer has taken all of that parameter's tensors. Everything else in the
    state dict (the model's tensors, ``param_groups``) is saved as the default planner does.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sources: dict[str, _Source] = {}
        self._remaining: Counter[tuple[int, int]] = Counter()
        self._cached: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()  # the writer's threads (thread_count > 1) share the cache

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._sources = {fqn: source for fqn, obj in self.state_dict.items() if (source := _source(obj)) is not None}

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        # what this rank writes after deduplication: a parameter is forgotten after its last tensor
        self._remaining = Counter(self._sources[item.index.fqn].owner for item in plan.items if item.index.fqn in self._sources)
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        source = self._sources.get(write_item.index.fqn)
        if source is None:
            return super().resolve_data(write_item)
        with self._lock:
            self._remaining[source.owner] -= 1
            last = self._remaining[source.owner] <= 0
            if source.name == "step":
                # The count is in memory: reading the whole state for it would read each
                # parameter twice where the writer asks for tensors by size (DCP's overlapping
                # loader does, wherever CUDA is available: every step scalar first).
                if last and self._cached is not None and self._cached[0] == source.owner:
                    self._cached = None
                step = source.optimizer._step_counts.get(source.slot.index)
                return torch.tensor(0.0) if step is None else step.clone()
            if self._cached is None or self._cached[0] != source.owner:
                self._cached = None  # the previous parameter's state is freed before the next is read
                self._cached = (source.owner, run(adam_entry(source.optimizer, source.slot)))
            entry = self._cached[1]
            if last:
                self._cached = None
        if source.name not in entry:
            raise RuntimeError(f"parameter {source.slot.index}: its state has no {source.name!r} (it changed since the state dict was made)")
        tensor = _shard(entry[source.name])
        expected = write_item.tensor_data.chunk.sizes if write_item.tensor_data is not None else None
        if expected is not None and tuple(tensor.shape) != tuple(expected):
            raise RuntimeError(
                f"parameter {source.slot.index}: {source.name!r} has shape {tuple(tensor.shape)}, planned {tuple(expected)}"
            )
        return tensor


def save_optimizer(
    optimizer: TieredAdam,
    checkpoint_id: str | os.PathLike[str],
    model: torch.nn.Module | None = None,
    *,
    key: str = "optim",
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    **save_kwargs: Any,
) -> Any:
    """Save the optimizer's state with DCP, one parameter's state in memory at a time.

    The checkpoint is ``dcp.save({key: get_optimizer_state_dict(model, optimizer)})``'s (with
    ``model``; ``opt.state_dict()``'s keys without), so ``torch.optim.AdamW`` loads it through
    ``dcp.load`` + ``set_optimizer_state_dict``. Memory: ``buffer_bytes`` plus about twice the
    largest parameter's state, not the rank's state (see the module docstring). Call it on every
    rank, as ``dcp.save``.

    Parameters
    ----------
    optimizer:
        A ``TieredAdam``/``TieredAdamW`` (plain, DDP, sharded with ``process_group=``, FSDP2).
    checkpoint_id:
        The checkpoint folder (``dcp.save``'s ``checkpoint_id``).
    model:
        The model, for parameter names as keys (``get_optimizer_state_dict``'s layout).
    key:
        The top-level key the state dict is saved under.
    buffer_bytes:
        Tensor bytes per file (``StreamingFileSystemWriter``; unless ``storage_writer=`` is given).
    save_kwargs:
        Passed to ``dcp.save`` (``storage_writer=``, ``process_group=`` ...; not ``planner=``).
    """
    import torch.distributed.checkpoint as dcp

    if "planner" in save_kwargs:
        raise TypeError("save_optimizer brings its own planner (StreamingSavePlanner)")
    state = {key: optimizer_state_dict(optimizer, model)}
    if "storage_writer" not in save_kwargs:
        save_kwargs["storage_writer"] = StreamingFileSystemWriter(checkpoint_id, buffer_bytes)
    with optimizer._checkpoint_io():  # (its reads from the tiers are not the next step's)
        return dcp.save(state, checkpoint_id=checkpoint_id, planner=StreamingSavePlanner(), **save_kwargs)


# -- loading -------------------------------------------------------------------------------------


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that placeholders (``optimizer_state_dict``) get a
    buffer when DCP reads one of their tensors, and once every tensor of a parameter has
    arrived, its state is written into the store and the buffers are dropped. Placeholders are
    never materialised all at once (the default planner allocates every meta tensor up front).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sources: dict[str, _Source] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._remaining: Counter[tuple[int, int]] = Counter()
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        #: The parameters written into the store.
        self.loaded: list[_Source] = []

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

        # DefaultLoadPlanner.set_up_planner without _init_state_dict (which allocates every meta tensor)
        self.original_state_dict = state_dict
        if self.flatten_sharded_tensors:
            state_dict = _flatten_sharded_tensors(state_dict)
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._sources = {fqn: source for fqn, obj in state_dict.items() if (source := _source(obj)) is not None}
        self._shapes = {fqn: _shard(state_dict[fqn]).shape for fqn in self._sources}

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is not None and self.flatten_state_dict:
            # param-group settings another optimizer does not save (torch's AdamW has no
            # state_precision) keep their values, as load_state_dict keeps them
            saved = self.metadata.state_dict_metadata
            for fqn in [f for f, obj in self.state_dict.items() if f not in saved and not isinstance(obj, torch.Tensor)]:
                if _PARAM_GROUPS in self.mappings.get(fqn, ()):
                    del self.state_dict[fqn]
            # an fp32 master torch's AdamW does not keep (a bf16 model's: its weight is its
            # state) starts from the parameter's weight, as load_state_dict starts it
            for fqn in [f for f, source in self._sources.items() if source.name == "master" and f not in saved]:
                del self.state_dict[fqn], self._sources[fqn], self._shapes[fqn]
        plan = super().create_local_plan()
        if any(fqn not in self.state_dict for fqn in self._sources):
            raise ValueError("a checkpoint in DCP's format of torch < 2.4 cannot be loaded streaming")
        return plan

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        self._remaining = Counter(self._sources[item.dest_index.fqn].owner for item in plan.items if item.dest_index.fqn in self._sources)
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        source = self._sources.get(fqn)
        if source is None:
            return super().resolve_tensor(read_item)
        buffers = self._buffers.setdefault(source.owner, {})
        if source.name not in buffers:
            buffers[source.name] = torch.empty(self._shapes[fqn], dtype=torch.float32)
        return _narrow(buffers[source.name], read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        source = self._sources.get(read_item.dest_index.fqn)
        if source is None:
            super().commit_tensor(read_item, tensor)
            return
        self._remaining[source.owner] -= 1
        if self._remaining[source.owner] > 0:
            return
        entry = self._buffers.pop(source.owner)
        run(adam_load_entry(source.optimizer, source.slot, entry))
        self.loaded.append(source)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _passes(state: dict[Any, dict[str, Any]], budget: int) -> list[list[Any]]:
    """The state dict's parameters (keys of ``state``) in groups of at most ``budget`` bytes of
    state each (a larger parameter alone)."""
    groups: list[list[Any]] = [[]]
    used = 0
    for fqn, entry in state.items():
        size = sum(4 * _shard(t).numel() for t in entry.values() if isinstance(t, torch.Tensor))
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(fqn)
        used += size
    return groups


def _pass_count(mine: int, problem: str | None, process_group: Any) -> int:
    """The largest pass count of all ranks (every rank calls ``dcp.load`` as often); a
    ``ValueError`` on every rank where one found ``problem`` (none goes on into a collective
    the others have left)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if problem is not None:
            raise ValueError(problem)
        return mine
    answers: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(answers, (mine, problem), group=process_group)
    problems = [(rank, said) for rank, (_, said) in enumerate(answers) if said is not None]
    if problems:
        raise ValueError(problem if problem is not None else f"rank {problems[0][0]}: {problems[0][1]}")
    return max(count for count, _ in answers)


def load_optimizer(
    optimizer: TieredAdam,
    checkpoint_id: str | os.PathLike[str],
    model: torch.nn.Module | None = None,
    *,
    key: str = "optim",
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    **load_kwargs: Any,
) -> None:
    """Load the optimizer's state from a DCP checkpoint into the tiers, one parameter at a time.

    Loads what ``save_optimizer`` or ``dcp.save({key: get_optimizer_state_dict(model, opt)})``
    wrote (from ``TieredAdamW`` or ``torch.optim.AdamW``, with any rank count: DCP reshards),
    as ``set_optimizer_state_dict`` would: the state, the step counts and the param groups'
    hyperparameters, except that a checkpoint saved with another ``amsgrad`` is refused
    (``ValueError`` on every rank, nothing loaded: the state is written in the layout the
    optimizer has). Load the model's weights first: the fp32 master weight of an fp32 parameter
    is the parameter itself. A lower-precision parameter's master that the checkpoint lacks
    (torch's AdamW keeps none) is the weight as the first update finds it. At most ``max(buffer_bytes, largest parameter's state)`` of state
    is assembled at once (the parameters are loaded in that many passes of ``dcp.load``); see the
    module docstring for the whole bound. Call it on every rank, as ``dcp.load``.

    The optimizer's ``register_load_state_dict_post_hook`` hooks run after it, as
    ``load_state_dict`` runs them; its pre-hooks, which take (and may replace) the whole state
    dict, cannot run on a streamed load: a ``ValueError`` before anything is loaded.

    If it fails part-way (a disk error, say: DCP raises a ``CheckpointException``), nothing is
    lost, but the state is mixed: each parameter has either its loaded state or its state from
    before the call. Load again to finish.

    Parameters
    ----------
    optimizer:
        A ``TieredAdam``/``TieredAdamW`` (plain, DDP, sharded with ``process_group=``, FSDP2).
    checkpoint_id:
        The checkpoint folder.
    model:
        The model, when the checkpoint's keys are parameter names (``get_optimizer_state_dict``).
    key:
        The top-level key the optimizer's state dict was saved under.
    buffer_bytes:
        State assembled per pass (bytes).
    load_kwargs:
        Passed to ``dcp.load`` (``storage_reader=``, ``process_group=`` ...; not ``planner=``).
    """
    if "planner" in load_kwargs:
        raise TypeError("load_optimizer brings its own planner (StreamingLoadPlanner)")
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    _check(optimizer)
    if optimizer._optimizer_load_state_dict_pre_hooks:
        names = ", ".join(getattr(h, "__name__", repr(h)) for h in optimizer._optimizer_load_state_dict_pre_hooks.values())
        raise ValueError(
            f"load_optimizer streams the state into the tiers as DCP reads it, so the load_state_dict pre-hooks "
            f"registered on the optimizer ({names}), which take and may replace the whole state dict, cannot run; "
            "nothing was loaded. Remove them, or load through dcp.load + set_optimizer_state_dict (the whole state in memory)"
        )
    with optimizer._checkpoint_io():  # (its writes into the tiers are not the next step's)
        _stream_in(optimizer, checkpoint_id, model, key, buffer_bytes, load_kwargs)
    optimizer._run_load_post_hooks()


def _stream_in(
    optimizer: TieredAdam, checkpoint_id: str | os.PathLike[str], model: torch.nn.Module | None, key: str, buffer_bytes: int,
    load_kwargs: dict[str, Any],
) -> None:
    """``load_optimizer`` after its checks, up to its post-hooks."""
    import torch.distributed.checkpoint as dcp

    placeholders = optimizer_state_dict(optimizer, model)
    state = {fqn: entry for fqn, entry in placeholders["state"].items() if entry}
    groups = _passes(state, buffer_bytes)
    loaded: set[int] = set()
    # The param groups first (a pass of their own): a checkpoint whose groups do not fit is
    # refused, on every rank, before anything changes.
    settings: dict[str, Any] = {"param_groups": placeholders["param_groups"]}
    dcp.load({key: settings}, checkpoint_id=checkpoint_id, planner=StreamingLoadPlanner(), **load_kwargs)
    loaded_groups = settings["param_groups"]
    count = _pass_count(len(groups), _groups_problem(optimizer, loaded_groups), load_kwargs.get("process_group"))
    optimizer._unmark_saved()  # (state saved for groups still to come: its counts go before any is written)
    # (no step count is cleared up front: each parameter's is replaced as its state is written,
    # so a load that fails part-way leaves every parameter with its loaded or its old state)
    for index in range(count):
        part: dict[str, Any] = {"state": {fqn: state[fqn] for fqn in (groups[index] if index < len(groups) else [])}}
        planner = StreamingLoadPlanner()
        dcp.load({key: part} if part["state"] else {}, checkpoint_id=checkpoint_id, planner=planner, **load_kwargs)
        loaded.update(source.slot.index for source in planner.loaded)
    for slot in optimizer._slots:
        if slot.index not in loaded:  # frozen, or another rank's: nothing of it is kept here
            slot.resident = None
            optimizer._step_counts.pop(slot.index, None)
            run(optimizer.delete_state(slot))
    _set_groups(optimizer, loaded_groups)
    optimizer._drop_saved_for_later()  # (the loaded state is the state from now on; groups added later start over)


def _groups_problem(optimizer: TieredAdam, saved: list[dict[str, Any]]) -> str | None:
    """Why the saved param groups do not fit the optimizer's (None: they do): another number of
    groups or of parameters in one (torch's checks), or another ``amsgrad`` (the state would
    have to change layout: ``load_state_dict`` converts it, a streamed load writes each
    parameter's state in the layout it has)."""
    if len(saved) != len(optimizer.param_groups):
        return "loaded state dict has a different number of parameter groups"
    for index, (group, own) in enumerate(zip(saved, optimizer.param_groups, strict=True)):
        if len(group["params"]) != len(own["params"]):
            return "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        if "amsgrad" in group and bool(group["amsgrad"]) != bool(own["amsgrad"]):
            return (f"param group {index} was saved with amsgrad={bool(group['amsgrad'])} and is amsgrad={bool(own['amsgrad'])} "
                    "here: load_optimizer writes the state in the layout the optimizer has, so nothing was loaded. Make the "
                    "optimizer with the checkpoint's amsgrad (opt.load_state_dict of a whole state dict converts it)")
    return None


def _set_groups(optimizer: TieredAdam, saved: list[dict[str, Any]]) -> None:
    """The saved hyperparameters into the optimizer's param groups (as ``load_state_dict``)."""
    problem = _groups_problem(optimizer, saved)
    if problem is not None:
        raise ValueError(problem)
    for group, own in zip(saved, optimizer.param_groups, strict=True):
        own.update({k: v for k, v in group.items() if k not in _STORAGE_KEYS})
        keep_decoupling(optimizer, own)
