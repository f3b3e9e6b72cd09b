"""Checkpoints of paged state: ``state_dict``/``load_state_dict`` in torch's format, ``opt.state``
as a mapping that reads on access, and what Distributed Checkpoint (DCP) needs of them.

``state_dict()`` is torch's: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[,
"max_exp_avg_sq"][, "master"]}}, "param_groups": [...]}`` with indices over every parameter of
the optimizer, so ``torch.optim.Adam``/``AdamW`` load it and ``get_optimizer_state_dict`` maps
the indices to parameter names. Where the parameter is a DTensor (FSDP2) its state is a DTensor
with the parameter's mesh and placements; DCP then saves each rank's shard and reshards on load.
With sharded state (``process_group=``) a rank's dict holds the state of the parameters it owns
and an empty entry for each of the others (DCP's strict loading wants an entry per parameter;
an empty one has nothing to save or load), so the ranks' dicts together are the whole state.

As in torch, ``state_dict()`` has no entry for a parameter never updated (no gradient yet, or
frozen). Through DCP (``get_optimizer_state_dict``, and this package's streaming
``optimizer_state_dict``) every trainable parameter has one, a fresh one (step 0, zero moments)
before its first update: DCP's state dict is also the template ``dcp.load`` fills, and
``set_optimizer_state_dict`` refuses one lacking a trainable parameter. Torch's AdamW gets those
entries from ``_init_optim_state``, which steps an optimizer whose ``opt.state`` is empty with
zero gradients; here that would write all the state into the store first, so ``opt.state`` is
never empty for an optimizer with trainable parameters (it reads a fresh entry for one never
updated). An entry at step 0 with zero moments loads as "not updated yet": nothing is written.

State tensors take the parameter's layout (its strides, as torch's ``zeros_like(p,
memory_format=torch.preserve_format)``): torch's fused Adam reads the state's memory in the
parameter's order. Loading reads a saved tensor element by element, whatever its strides. The
param groups save ``fused`` as the implementation the update uses (``saved_groups``).

Compressed state (``state_precision="bf16"``/``"8bit"``, ``master_weights="lossless"``) is
saved decompressed, in fp32, in the same format: ``exp_avg``/``exp_avg_sq`` are the dequantised
moments the optimizer is using (so ``torch.optim.AdamW`` loads them and continues from exactly
those values), ``master`` the exact fp32 master. The param groups leave ``state_precision`` and
``master_weights`` out (DCP's strict loading refuses keys one side lacks, so a checkpoint must
have torch's keys only); loading never changes them: the loading optimizer
compresses what it loads as it was built to (an fp32 checkpoint into an 8-bit optimizer is
quantised; our own compressed checkpoint re-encodes to the same codes, but for the blocks of
one saved while scales were raised to 1e-12 whose values lie below it). With a lossless master,
what is kept of a loaded ``master`` is its low 16 bits: the high half is the model's weight
(rounded from the master when the checkpoint's optimizer kept an fp32 master: taken back
exactly at the first update, ``tierstore.optim.lossless_load``).

Memory: ``state_dict()`` holds this rank's whole state at once (DCP's ``get_optimizer_state_dict``
needs the tensors), one parameter's state read from the store at a time; ``opt.state[p]`` reads
one parameter's; ``load_state_dict`` writes into the tiers one parameter at a time.
"""

from __future__ import annotations

import copy
import itertools
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..sync import run
from .distributed import LocalShard, ParamRange, is_dtensor
from .kernels import uses_fused
from .lossless_load import LoadedMaster

if TYPE_CHECKING:
    from .adam import TieredAdam
    from .paging import PagedOptimizer
    from .slots import ParamSlot

__all__ = ["LazyState", "adam_entry", "adam_load_entry", "adam_load_state_dict", "adam_state_dict", "saved_groups"]

#: Param-group keys that are the optimizer's storage choice, not hyperparameters: a loaded
#: state dict does not change them.
_STORAGE_KEYS = ("params", "state_precision", "master_weights")

_ROWS = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def keep_decoupling(optimizer: PagedOptimizer, group: dict[str, Any]) -> None:
    """``decoupled_weight_decay`` of a param group just loaded: always True for ``TieredAdamW``
    (torch's AdamW sets it after any load: one loading ``torch.optim.Adam``'s checkpoint stays
    AdamW), the checkpoint's (or the optimizer's default) for ``TieredAdam``."""
    if type(optimizer).decoupled_weight_decay:  # type: ignore[attr-defined]
        group["decoupled_weight_decay"] = True
    else:
        group.setdefault("decoupled_weight_decay", optimizer.defaults.get("decoupled_weight_decay", False))


def saved_index(optimizer: PagedOptimizer, slot: ParamSlot) -> int:
    """The index of ``slot``'s parameter among all the optimizer's parameters (as saved)."""
    sharding = optimizer._sharding
    return sharding.global_index[slot.index] if sharding is not None else slot.index


def model_param(slot: ParamSlot) -> torch.Tensor:
    """The parameter as the model and ``param_groups`` hold it (the DTensor for a shard)."""
    return slot.param.parameter if isinstance(slot.param, (LocalShard, ParamRange)) else slot.param


def _laid_out(slot: ParamSlot, flat: torch.Tensor) -> torch.Tensor:
    """A flat state row (the elements in the parameter's logical order) as the parameter is
    laid out: its shape and its strides (a channels_last weight's state is channels_last), or a
    DTensor like it.

    Torch's Adam makes its state with ``zeros_like(p, memory_format=torch.preserve_format)``,
    and its fused kernel pairs the state's memory with the parameter's memory, strides unread:
    a contiguous state loaded beside a channels_last weight would update the wrong elements."""
    if isinstance(slot.param, (LocalShard, ParamRange)):
        return slot.param.as_dtensor(flat)
    shaped = flat.reshape(slot.shape)
    param = slot.param
    if param.is_contiguous():
        return shaped
    laid = torch.empty_like(param, dtype=flat.dtype, device=flat.device, memory_format=torch.preserve_format)
    return laid.copy_(shaped)  # element by element: the values land where the strides say


def _local(slot: ParamSlot, name: str, value: Any) -> torch.Tensor:
    """A loaded state tensor as this rank's flat fp32 row for ``slot``."""
    tensor = _this_ranks(slot, value, redistribute=True)
    assert tensor is not None
    if tensor.numel() != slot.numel:
        raise _wrong_size(slot, name, tensor.numel(), checked_first=False)
    return tensor.reshape(-1).to("cpu", torch.float32)


def _this_ranks(slot: ParamSlot, value: Any, *, redistribute: bool) -> torch.Tensor | None:
    """This rank's part of a loaded state tensor for ``slot``: a DTensor's local tensor
    (redistributed to a shard's placements first: a collective; None where that is needed and
    ``redistribute`` is False), a whole tensor's rows of a split parameter, else the tensor."""
    tensor = torch.as_tensor(value).detach()
    if is_dtensor(tensor):
        p = model_param(slot)
        if isinstance(slot.param, LocalShard) and tuple(tensor.placements) != tuple(p.placements):  # type: ignore[attr-defined]
            if not redistribute:
                return None
            tensor = tensor.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
        return tensor._local_tensor  # type: ignore[attr-defined]
    if isinstance(slot.param, ParamRange):  # a whole tensor (torch's AdamW's): our rows of it
        return slot.param.local_of(tensor)
    return tensor


def _wrong_size(slot: ParamSlot, name: str, numel: int, checked_first: bool = True) -> ValueError:
    if isinstance(slot.param, ParamRange):  # (a whole tensor, or this rank's rows of it)
        wanted = f"the parameter {slot.param.param.numel()} (this rank's rows of it {slot.numel})"
    elif isinstance(slot.param, LocalShard):
        wanted = f"this rank's shard of the parameter {slot.numel}"
    else:
        wanted = f"the parameter {slot.numel}"
    dtensor = "; a DTensor parameter loads its state as DTensors (get/set_optimizer_state_dict)"
    return ValueError(
        f"parameter {slot.index}: saved {name!r} has {numel} elements, {wanted}: the state dict is not this "
        f"model's, or lists its parameters in another order{dtensor if isinstance(slot.param, LocalShard) else ''}"
        + ("; nothing was loaded" if checked_first else "")
    )


def _check_size(slot: ParamSlot, name: str, value: Any) -> None:
    """Raise ``_local``'s ``ValueError`` if ``value`` is not of ``slot``'s size, as ``_local``
    sees it, converting nothing that costs: a DTensor that ``_local`` would redistribute (a
    collective) is checked by its global shape, which decides the shard it becomes."""
    tensor = _this_ranks(slot, value, redistribute=False)
    if tensor is None:
        # (its global shape decides the shard it becomes: of another shape, even of as many
        # elements, the shards may differ, and it is not this parameter's state anyway)
        shape, wanted = tuple(torch.as_tensor(value).shape), tuple(model_param(slot).shape)
        if shape != wanted:
            raise ValueError(
                f"parameter {slot.index}: saved {name!r} has shape {shape}, the parameter {wanted}: "
                "the state dict is not this model's, or lists its parameters in another order; nothing was loaded"
            )
        return
    if tensor.numel() != slot.numel:
        raise _wrong_size(slot, name, tensor.numel())


# -- TieredAdam ---------------------------------------------------------------------------------


async def adam_entry(optimizer: TieredAdam, slot: ParamSlot) -> dict[str, torch.Tensor]:
    """One parameter's state in torch's format, read from the store (a fresh entry if the
    parameter was never updated); fp32, decompressed where the optimizer compresses it."""
    step = optimizer._step_counts.get(slot.index)
    rows = optimizer._rows(slot)
    if step is None:
        zeros = torch.zeros(slot.numel, dtype=torch.float32)
        entry = {"step": torch.tensor(0.0), "exp_avg": _laid_out(slot, zeros), "exp_avg_sq": _laid_out(slot, zeros.clone())}
        if rows > 3:
            entry["max_exp_avg_sq"] = _laid_out(slot, zeros.clone())
        if slot.param.dtype != torch.float32:
            entry["master"] = _laid_out(slot, (await optimizer._weight(slot)).reshape(-1).float().clone())
        return entry
    packed = await optimizer.read_state_rows(slot)
    entry = {"step": step.clone()}
    for row, name in enumerate(_ROWS[: packed.shape[0]]):
        if row == 0 and slot.param.dtype == torch.float32:
            continue  # the weight itself is the master: torch keeps none
        entry[name] = _laid_out(slot, packed[row].clone())
    if slot.master_from_weight and not slot.master_checked_chunks:
        # (a checkpoint without a master, loaded before the model maybe: the first update takes
        # the weight as it is then, and so does a state dict taken before it)
        entry["master"] = _laid_out(slot, (await optimizer._weight(slot)).reshape(-1).float().clone())
    return entry


#: The key of the placeholder state dict handed to accelerate's device placement (see below).
UNMOVED = "tierstore_state_stays_in_the_store"


def adam_state_dict(optimizer: TieredAdam) -> dict[str, Any]:
    """``TieredAdam.state_dict`` (see the module docstring)."""
    optimizer._require_open("state_dict")
    if _accelerate_placement():
        # accelerate "moves" an optimizer's state to its device with
        # load_state_dict(move_to_device(state_dict())). Paged state stays where the store keeps
        # it: moving it would read all of it into memory (onto the GPU, on a GPU) and write it
        # all back. So that round trip gets a placeholder, which load_state_dict recognises.
        token = optimizer._unmoved_token = (id(optimizer), next(_tokens))
        return {"state": {}, "param_groups": saved_groups(optimizer), UNMOVED: list(token)}
    saved = run(_adam_state_dict(optimizer, every_trainable=_dcp_state_dict()))
    if SHARD in saved:
        warn_once_of_a_rank_state(optimizer, stacklevel=3)
    return saved


def saved_groups(optimizer: TieredAdam) -> list[dict[str, Any]]:
    """``param_groups`` as saved: torch's keys, with ``fused`` the implementation the update
    uses. ``fused=None`` means "the default" to torch too, but torch's default for AdamW is the
    for-loop (CPU) or foreach (CUDA) kernel and ours is the fused one, so a torch optimizer
    loading a saved None would continue with other arithmetic (ulp-level differences from the
    first step on); saving the choice made keeps the continuation bit for bit."""
    groups = optimizer._groups_for_saving()
    for group in groups:
        if group.get("fused") is None:
            group["fused"] = uses_fused(group)  # TieredAdam's rule: fused unless foreach= asked for another kernel
    return groups


_tokens = itertools.count()


def _dcp_state_dict() -> bool:
    """Whether the caller is DCP's ``get_optimizer_state_dict``: the state dict it builds is the
    template ``dcp.load`` fills, and ``set_optimizer_state_dict`` refuses one without an entry for
    every trainable parameter (torch's own AdamW gets them from ``_init_optim_state``, which
    steps a stateless optimizer with zero gradients; here that would write every parameter's state
    into the store first)."""
    return _called_from("_get_optim_state_dict", "torch.distributed.checkpoint.state_dict")


def _accelerate_placement() -> bool:
    """Whether the caller is accelerate's ``AcceleratedOptimizer`` placing the state on its device
    (its ``__init__`` with ``device_placement=True``, what ``Accelerator.prepare`` runs)."""
    return _called_from("__init__", "accelerate.optimizer")


def _called_from(function: str, module: str, depth: int = 6) -> bool:
    """Whether ``module.function`` is among the ``depth`` frames above the caller of the
    function that calls this (a library's call into ours that its API does not tell apart)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
    return False


async def _adam_state_dict(optimizer: TieredAdam, every_trainable: bool) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for slot in optimizer._slots:
        stepped = slot.index in optimizer._step_counts
        if stepped or (every_trainable and model_param(slot).requires_grad):
            state[saved_index(optimizer, slot)] = await adam_entry(optimizer, slot)
    for index in _others(optimizer):
        state[index] = {}
    saved: dict[str, Any] = {"state": dict(sorted(state.items())), "param_groups": saved_groups(optimizer)}
    if optimizer._sharding is not None and not every_trainable:  # (DCP's template gets none: it fills each rank's own)
        saved[SHARD] = shard_record(optimizer)
    return saved


#: The key of a sharded optimizer's state dict (``process_group=``) naming the rank it came from
#: (torch's optimizers ignore it): where that dict's entry of a parameter this optimizer updates
#: is empty (another rank's), loading it is refused instead of restarting that state. (Through
#: DCP every rank's record has this key: one rank's comes back to all, so only the entries decide.)
SHARD = "tierstore_shard"


def shard_record(optimizer: PagedOptimizer) -> dict[str, Any]:
    """``SHARD``'s value for a sharded optimizer's state dict."""
    sharding = optimizer._sharding
    assert sharding is not None
    return {"rank": sharding.rank, "world_size": sharding.world}


def warn_once_of_a_rank_state(optimizer: PagedOptimizer, stacklevel: int) -> None:
    """The warning a sharded optimizer's ``state_dict()`` gives once (``stacklevel``: the caller's
    frame, as ``warnings.warn`` counts from here)."""
    if optimizer._warned_rank_state:
        return
    optimizer._warned_rank_state = True
    warnings.warn(
        "with process_group=, state_dict() holds this rank's state only (the parameters it updates; the others' "
        "entries are empty): a checkpoint of one rank's dict (what the HF Trainer and accelerate save from rank 0) "
        "cannot resume the others, and loading it there raises. Checkpoint with tierstore.optim.save_optimizer/"
        "load_optimizer (or DCP's get/set_optimizer_state_dict) on every rank, or save each rank's own dict",
        RuntimeWarning, stacklevel=stacklevel + 1,
    )


def _refuse_another_ranks_state(optimizer: PagedOptimizer, state_dict: Mapping[str, Any]) -> None:
    """``ValueError``, before anything changes, for a sharded optimizer's state dict (``SHARD``)
    that lacks the state of parameters this optimizer updates: another rank's, or loaded under
    another world size or without ``process_group=``."""
    record = state_dict.get(SHARD)
    if not isinstance(record, Mapping):
        return
    ids = [i for saved in state_dict["param_groups"] for i in saved["params"]]
    state = state_dict["state"]
    lacking = []
    for slot in optimizer._slots:  # (a split parameter's rows are not told apart: its entry is a DTensor either way)
        index = saved_index(optimizer, slot)
        entry = state.get(ids[index])
        if entry is not None and len(entry) == 0 and model_param(slot).requires_grad and not isinstance(slot.param, ParamRange):
            lacking.append(index)
    if lacking:
        sharding = optimizer._sharding
        here = f"rank {sharding.rank} of {sharding.world}" if sharding is not None else "this optimizer (no process_group=)"
        shown = ", ".join(map(str, lacking[:8])) + (f" ... ({len(lacking)} in all)" if len(lacking) > 8 else "")
        raise ValueError(
            f"this state dict is rank {record.get('rank')}'s of {record.get('world_size')} under process_group=: its entries "
            f"of parameters {shown}, which {here} updates, are empty (another rank held their state); loaded, their "
            "moments and step counts would restart from zero. Nothing was loaded. Checkpoint a sharded optimizer "
            "with tierstore.optim.save_optimizer/load_optimizer (or DCP's get/set_optimizer_state_dict) on every rank, "
            "or load each rank's own state_dict() on that rank with the same world size"
        )


def _others(optimizer: PagedOptimizer) -> list[int]:
    """Indices of trainable parameters whose state another rank owns."""
    sharding = optimizer._sharding
    if sharding is None:
        return []
    mine = set(sharding.global_index)
    return [i for i, p in enumerate(sharding.params) if i not in mine and p.requires_grad]


def adam_load_state_dict(optimizer: TieredAdam, state_dict: dict[str, Any]) -> None:
    """``TieredAdam.load_state_dict``: a state dict of this class (any rank count, through DCP)
    or of ``torch.optim.Adam``/``AdamW``; written into the store one parameter at a time."""
    optimizer._require_open("load_state_dict")
    groups = state_dict["param_groups"]
    unmoved = state_dict.get(UNMOVED)
    if unmoved is not None:
        if tuple(unmoved) != getattr(optimizer, "_unmoved_token", None):
            raise ValueError("this state dict is a placeholder this optimizer gave accelerate's device placement; it holds no state")
        optimizer._unmoved_token = None
        return  # our own placeholder back from accelerate: the state never left the store
    if len(groups) != len(optimizer.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for saved, group in zip(groups, optimizer.param_groups, strict=True):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
    _refuse_another_ranks_state(optimizer, state_dict)
    ids = [i for saved in groups for i in saved["params"]]
    saved_state = {slot: state_dict["state"].get(ids[saved_index(optimizer, slot)]) for slot in optimizer._slots}
    _require_entries(optimizer, saved_state, groups)
    for saved, group in zip(groups, optimizer.param_groups, strict=True):
        # deep copies, as torch takes: a tensor lr shared with the source would follow its scheduler
        group.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in _STORAGE_KEYS})
        keep_decoupling(optimizer, group)
    run(_adam_load(optimizer, saved_state))


def _require_entries(optimizer: TieredAdam, saved_state: dict[ParamSlot, Any], groups: list[dict[str, Any]]) -> None:
    """Raise ``KeyError``, before anything changes, if a parameter's saved state lacks what Adam
    needs (``step``, both moments, ``max_exp_avg_sq`` under amsgrad): torch's AdamW fails on such
    an entry at its next step; filled with zeros, the update would be silently wrong. Raise
    ``ValueError`` if a saved tensor is not of its parameter's size (``_local`` would, part-way
    through the load, the parameters before it loaded)."""
    for slot, saved in saved_state.items():
        if not saved:
            continue
        needed = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if groups[slot.group].get("amsgrad") else [])
        missing = [name for name in needed if name not in saved]
        if missing:
            raise KeyError(f"the state dict's entry for parameter {saved_index(optimizer, slot)} lacks {', '.join(map(repr, missing))} "
                           f"(it has {', '.join(map(repr, saved))}): nothing was loaded")
        if _fresh(saved):
            continue  # (loaded as no state: its tensors are not read)
        for name in _ROWS[: optimizer._rows(slot)]:
            if name in saved:
                _check_size(slot, name, saved[name])


def _fresh(saved: Mapping[str, Any]) -> bool:
    """An entry at step 0 with zero moments: the parameter was never updated."""
    step = saved.get("step", 0)
    if float(step.item() if torch.is_tensor(step) else step) != 0.0:
        return False
    return not any(name in saved and bool(torch.as_tensor(saved[name]).detach().any()) for name in _ROWS[1:])


async def _adam_load(optimizer: TieredAdam, saved_state: dict[ParamSlot, dict[str, Any] | None]) -> None:
    # (each slot's step count is replaced as it loads: a failure part-way loses no old state)
    for slot, saved in saved_state.items():
        await adam_load_entry(optimizer, slot, saved or {})


async def adam_load_entry(optimizer: TieredAdam, slot: ParamSlot, entry: Mapping[str, Any]) -> None:
    """Write one parameter's state from torch-format ``entry`` (``step``, ``exp_avg``,
    ``exp_avg_sq``[, ``max_exp_avg_sq``][, ``master``]: tensors of the parameter's shape, or
    DTensors like it) into the store, compressed as the optimizer keeps it (on the store's
    loop). An empty entry, or one at step 0 with zero moments, leaves the parameter without
    state (as never updated); a missing ``master`` is the parameter's current weight."""
    if not entry or _fresh(entry):
        slot.resident = None
        slot.verify_master, slot.master_from_weight, slot.loaded_master = False, False, None  # (an earlier load's master is gone)
        slot.master_checked_chunks.clear()
        optimizer._step_counts.pop(slot.index, None)
        await optimizer.delete_state(slot)
        return
    rows = torch.zeros(optimizer._rows(slot), slot.numel, dtype=torch.float32)
    weight = (await optimizer._weight(slot)).reshape(-1)
    rows[0].copy_(weight)
    for row, name in enumerate(_ROWS[: rows.shape[0]]):
        if name in entry:
            rows[row].copy_(_local(slot, name, entry[name]))
    step = entry.get("step", 0)
    optimizer._step_counts[slot.index] = torch.tensor(float(step.item() if torch.is_tensor(step) else step))
    await optimizer.write_state_rows(slot, rows)
    # A lower-precision parameter's master is checked against the weight at its first update,
    # once the model's weights are loaded too, in whichever order (``TieredAdam._reloads``).
    slot.verify_master = weight.dtype != torch.float32
    slot.master_from_weight = slot.verify_master and "master" not in entry
    layout = optimizer._layout(slot)
    ranges = [(chunk.start, chunk.stop) for chunk in slot.chunks] if slot.chunks is not None else []
    lossless = slot.verify_master and not slot.master_from_weight and layout is not None and layout.lossless
    slot.loaded_master = LoadedMaster.of(rows[0], ranges) if lossless else None
    slot.master_checked_chunks.clear()
    optimizer._warned_restarts.discard(slot.index)  # (a new master: its restart is warned of again)


# -- opt.state ----------------------------------------------------------------------------------


class LazyState(Mapping[torch.Tensor, dict[str, Any]]):
    """``opt.state``: the state of each parameter, read from the store when it is accessed
    (``opt.state[p]`` gives a fresh dict of tensors; changing it changes nothing). Parameters
    whose state another rank owns, and the optimizer's parameters without state (frozen ones),
    map to an empty dict, as in torch."""

    def __init__(self, optimizer: PagedOptimizer) -> None:
        self._opt = optimizer
        entry = getattr(optimizer, "_entry_of", None)
        self._slots: dict[int, ParamSlot] = {}
        if entry is not None:
            for slot in optimizer._slots:
                if model_param(slot).requires_grad:
                    self._slots[id(model_param(slot))] = slot
        self._params: list[torch.Tensor] = []
        if entry is None:  # a class without per-parameter reads: what its state_dict holds
            self._saved = run(optimizer._state_dict())["state"]  # type: ignore[attr-defined]
            for slot in optimizer._slots:
                if slot.index in self._saved:
                    self._slots[id(model_param(slot))] = slot
        others = set(_others(optimizer))
        #: Parameters of the optimizer (frozen, say) with no state: ``{}``, as torch's defaultdict gives.
        self._stateless: set[int] = set()
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in self._slots:
                    self._params.append(param)
                else:
                    self._stateless.add(id(param))
        if others:
            sharding = optimizer._sharding
            assert sharding is not None
            self._empty = {id(sharding.params[i]) for i in others}
            self._params.extend(sharding.params[i] for i in sorted(others))
        else:
            self._empty = set()

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        if id(param) in self._empty:
            return {}
        slot = self._slots.get(id(param))
        if slot is None:
            if id(param) in self._stateless:
                return {}
            raise KeyError("not a parameter of this optimizer")
        entry = getattr(self._opt, "_entry_of", None)
        if entry is not None:
            return dict(entry(slot))
        return dict(self._saved[slot.index])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __contains__(self, param: object) -> bool:
        return id(param) in self._slots or id(param) in self._empty

    def __repr__(self) -> str:
        return f"LazyState({len(self)} parameters, read on access)"
