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

``state_precision="bf16"``/``"8bit"`` keeps the moments compressed (bf16, or blockwise 8-bit
with per-block scales) and ``master_weights="lossless"`` keeps only the low 16 bits of a bf16
parameter's fp32 master: the entry is then a flat ``uint8`` layout (``tierstore.optim.precision``)
and each update decodes one entry into fp32 temporaries, runs torch's Adam on them and encodes
the result back. An fp32 parameter in host memory (plain CPU) is its own fp32 master, with any
``state_precision``: its entry holds the moments only, and the update runs on it in place.

In a named namespace, ``close()`` leaves the step counts (and the state of parameters too small
to page) beside the paged state, and a later optimizer claiming the namespace continues from
them, as if never interrupted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Any, overload

import torch
from torch.optim.adam import adam

from ..sync import run
from ..tensors import PLAIN_TENSOR_TYPES
from ..warn import warn
from .batched import KEPT_MAPS_BYTES, batch_bytes, batched, update_many
from .batched import takes as batched_layout
from .checkpoint import adam_entry, adam_load_state_dict, adam_state_dict
from .chunks import Chunk, chunk_key
from .clipping import inverse_scale
from .distributed import ParamRange
from .kernels import uses_fused
from .lanes import Placed, on_whole_lanes
from .memory_order import InMemoryOrder, memory_order
from .paging import PagedOptimizer, ParamSlot
from .pipeline import (
    OptimizerCapacityError,
    fill_weight_range,
    offloaded,
    read_weight,
    read_weight_range,
)
from .precision import (
    CODEC_TABLES_BYTES,
    MASTER_WEIGHTS,
    PRECISIONS,
    AdamHyper,
    PackedState,
    StateLayout,
    can_be_master,
    plain_update_bytes,
    release_scratch,
    update_bytes,
    validate,
)
from .resident import Piece


class TieredAdam(PagedOptimizer):
    """``torch.optim.Adam`` (L2 weight decay) with state paged through a store.

    Takes torch's arguments (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
    ``maximize``, ``foreach``, ``fused``, param groups) plus the store options of
    ``PagedOptimizer`` (``store=``, ``offload=``, ``disk_root=``, ``step_in_backward=``,
    ``max_grad_norm=``, ``gradient_accumulation_steps=`` ...). ``capturable`` and
    ``differentiable`` are not supported.

    state_precision:
        How the moments are stored on the tiers: ``"fp32"`` (default: exact, torch's numbers),
        ``"bf16"`` (rounded to bf16: 8 B a parameter with the fp32 master instead of 12) or
        ``"8bit"`` (blockwise-quantised with a dynamic code book and an fp32 scale per 256
        elements: about 6 B a parameter). The update itself runs in fp32.
    master_weights:
        ``"fp32"`` (default): a full fp32 master weight (4 B a parameter). ``"lossless"``, for
        bf16 parameters only: store the master's low 16 bits (2 B) beside the bf16 weight the
        model holds, which becomes the master's exact high half: the weight is the master
        *truncated* (not rounded to nearest, as with ``"fp32"``), and the master is exact.
    Both may be set per parameter group; they are this optimizer's storage choice, so a loaded
    state dict does not change them (its moments are compressed as this optimizer stores them).

    Writes to a parameter from outside between steps (``model.load_state_dict``, ``p.mul_``
    under ``torch.no_grad()``, ``p.data = ...``, ``model.to(memory_format=...)``) count, as in
    torch: where the fp32 master is kept apart from the parameter (a device, a bf16 parameter,
    an offloaded one), the next update reloads it from the parameter (exactly for an fp32 one;
    a bf16 one loses the master's extra bits, with a warning). They are seen by torch's version
    counter and the parameter's address; an in-place write through ``p.data`` (``p.data.mul_``)
    is seen by neither and is overwritten by the next step's weight. Where the parameter is its
    own master (an fp32 parameter on the plain CPU), every write counts, as in torch.
    """

    decoupled_weight_decay = False
    _supports_sharding = True
    _sparse_advice = ", please consider torch.optim.SparseAdam instead"
    _unsaved_group_keys = ("state_precision", "master_weights")

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
        decoupled_weight_decay: bool | None = None,
        state_precision: str = "fp32",
        master_weights: str = "fp32",
        **paging: Any,
    ) -> None:
        # (torch's checks, in its order: a str lr is a TypeError here, not at the first step)
        if isinstance(lr, torch.Tensor):
            if foreach and not capturable:
                raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (all(isinstance(beta, float) for beta in betas) or all(isinstance(beta, torch.Tensor) for beta in betas)):
            raise ValueError("betas must be either both floats or both Tensors")
        for index, beta in enumerate(betas):  # (as torch refuses them: every step() would fail otherwise)
            if isinstance(beta, torch.Tensor) and foreach and not capturable:
                raise ValueError(f"betas[{index}] as a Tensor is not supported for capturable=False and foreach=True")
        if capturable or differentiable:
            raise ValueError("capturable and differentiable are not supported: the update runs on the host")
        if fused and foreach:
            raise ValueError("fused and foreach cannot both be True")
        validate(state_precision, master_weights)
        self._step_counts: dict[int, torch.Tensor] = {}
        #: Per group index: its ``_layout_keys`` values when its state was laid out (``_refuse_changed_layouts``).
        self._laid_out_as: dict[int, tuple[Any, ...]] = {}
        #: Per slot index: the resident step's pieces, with the layout they were made for
        #: ``(rows, paged, chunks)`` (``_resident_pieces``; read only: they are shared).
        self._pieces_made: dict[int, tuple[int, bool, Any, list[Piece]]] = {}
        self._warned_foreign = False
        #: Parameters whose loaded master restarted from the weight: warned once each (not once a chunk).
        self._warned_restarts: set[int] = set()
        #: Per slot index: the move of its master out of a parameter no longer fp32 (``_keep_master_apart``).
        self._master_moves: dict[int, asyncio.Lock] = {}
        #: Per slot index: its state with the master apart, moved but not yet written whole.
        self._master_rows_unwritten: dict[int, torch.Tensor] = {}
        #: A chunked parameter's step count before this step's update (a tensor, and as a
        #: number), and after it (a number where its chunks' 8-bit kernels took no tensor).
        self._chunk_steps: dict[int, tuple[torch.Tensor, float, torch.Tensor | float | None]] = {}
        #: Saved state of parameters past the constructor's, kept for ``add_param_group`` until
        #: the first ``step()`` (``_adopt``).
        self._saved_for_later: _SavedForLater | None = None
        defaults = {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
            "maximize": maximize, "foreach": foreach, "capturable": False, "differentiable": False,
            "fused": fused,
            "decoupled_weight_decay": self.decoupled_weight_decay if decoupled_weight_decay is None else bool(decoupled_weight_decay),
            "state_precision": state_precision, "master_weights": master_weights,
        }
        super().__init__(params, defaults, **paging)

    # -- state layout ------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Torch's, checking the group's ``state_precision``/``master_weights`` first."""
        defaults = getattr(self, "defaults", {})
        precision = param_group.get("state_precision", defaults.get("state_precision", "fp32"))
        master = param_group.get("master_weights", defaults.get("master_weights", "fp32"))
        validate(precision, master)
        if param_group.get("capturable") or param_group.get("differentiable"):  # (as the constructor refuses them)
            raise ValueError("capturable and differentiable are not supported: the update runs on the host")
        if param_group.get("fused") and param_group.get("foreach"):
            raise ValueError("fused and foreach cannot both be True")
        foreach = param_group.get("foreach", defaults.get("foreach"))
        for index, beta in enumerate(param_group.get("betas", ())):  # (as the constructor refuses them)
            if isinstance(beta, torch.Tensor) and foreach:
                raise ValueError(f"betas[{index}] as a Tensor is not supported for capturable=False and foreach=True")
        params = param_group["params"]
        if not isinstance(params, set):  # (torch's own check refuses a set, with its message)
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = params
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.float64 for p in params):
                # (torch keeps float64 moments; ours are fp32 at best, so the updates would be
                # rounded to fp32 without a word)
                raise TypeError(
                    "float64 parameters are not supported by TieredAdam/TieredAdamW: the master and moments are kept in "
                    "fp32, so their updates would be rounded to fp32; use torch.optim.AdamW for them, or train in fp32"
                )
        _require_bf16_for_lossless(master, params)
        super().add_param_group(param_group)
        self._laid_out_as[len(self.param_groups) - 1] = _layout_settings(self.param_groups[-1])

    #: Group keys that decide how a group's state is stored (``_layout``).
    _layout_keys = ("state_precision", "master_weights", "amsgrad")

    def _refuse_changed_layouts(self) -> None:
        """``ValueError`` if a group's ``state_precision``, ``master_weights`` or ``amsgrad`` was
        changed in ``param_groups`` (or the group replaced) after its state was made: the state
        would be read in the new layout (moments restarting from zero, or a failure part-way).
        Before a group has state, as with torch, a change is taken."""
        for index, group in enumerate(self.param_groups):
            now = _layout_settings(group)
            was = self._laid_out_as.setdefault(index, now)
            if now == was:
                continue
            if not any(self._has_state(slot) for slot in self._slots if slot.group == index):
                validate(now[0], now[1])  # (no state yet: made in the new layout, if it is one)
                _require_bf16_for_lossless(now[1], group["params"])
                self._laid_out_as[index] = now
                continue
            changed = ", ".join(f"{key} from {a!r} to {b!r}" for key, a, b in zip(self._layout_keys, was, now, strict=True) if a != b)
            raise ValueError(
                f"param group {index}'s {changed} was changed in param_groups after its state was laid out; the state "
                "cannot change layout in place. Set it back, or save opt.state_dict() and load it into a new optimizer "
                "made with the new setting (load_state_dict converts the state)")

    def _has_state(self, slot: ParamSlot) -> bool:
        return slot.index in self._step_counts

    def _layout(self, slot: ParamSlot) -> StateLayout | None:
        """The packed layout of ``slot``'s state; None for the plain ``(rows, numel)`` fp32 one."""
        group = self.param_groups[slot.group]
        if group["state_precision"] == "fp32" and group["master_weights"] == "fp32":
            return None
        lossless = group["master_weights"] == "lossless"
        return _state_layout(group["state_precision"], lossless, bool(group["amsgrad"]), not lossless and self._param_is_master(slot))

    def _release_thread_buffers(self) -> None:
        release_scratch()

    def _update_buffer_bytes(self, threads: int) -> int:
        """The most the updates take beside their state on ``threads`` threads at once: per
        thread the largest scratch an update keeps plus the largest it makes and drops
        (``update_bytes`` of a compressed entry, an entry being a chunk of a chunked parameter;
        ``batch_bytes`` of small entries updated together; ``plain_update_bytes`` of plain fp32
        state), and what the threads share: the 8-bit codec's tables, 8-bit batches' block maps."""
        kept = passing = 0
        tables = maps = False
        for slot in self._slots:
            if not self._in_plan(slot):
                continue
            group = self.param_groups[slot.group]
            fused, grad_fp32 = uses_fused(group), slot.param.dtype == torch.float32
            entry = max(chunk.numel for chunk in slot.chunks) if slot.chunks else slot.numel
            layout = self._layout(slot)
            if layout is None:
                passing = max(passing, plain_update_bytes(entry, fused=fused, grad_fp32=grad_fp32))
                continue
            sizes = [update_bytes(layout, entry, slot.numel, fused=fused, grad_fp32=grad_fp32)]
            together = batched_layout(layout, entry, slot.numel)
            if together:
                sizes.append(batch_bytes(layout, fused=fused, grad_fp32=grad_fp32))
            eight_bit = layout.precision == "8bit"
            tables, maps = tables or eight_bit, maps or (eight_bit and together)
            kept = max(kept, *(k for k, _ in sizes))
            passing = max(passing, *(p for _, p in sizes))
        return threads * (kept + passing) + tables * CODEC_TABLES_BYTES + maps * KEPT_MAPS_BYTES

    def _rows(self, slot: ParamSlot) -> int:
        """Rows of the decoded state: master and moments."""
        return 4 if self.param_groups[slot.group]["amsgrad"] else 3

    def _param_is_master(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s state leaves the master out (the plain fp32 entry its row, a
        compressed one its field): an fp32 parameter in host memory (plain CPU: the link lends)
        is the fp32 master itself, so the update runs in place on it (as torch's AdamW does),
        saving a copy per step and 4 B a parameter of state (every state_precision).
        Decided once per parameter, when its state is first laid out: a parameter that later
        stops being usable in place (``model.to(memory_format=torch.channels_last)``, a later
        ``offload_parameters``) keeps this layout, its master row built from it at each update
        (``_wrap``), so its state is never reset by a change of layout."""
        if slot.param_master is None:
            group = self.param_groups[slot.group]
            param = slot.param
            slot.param_master = (
                group["master_weights"] == "fp32" and slot.link.lends and can_be_master(param) and offloaded(param) is None
            )
        return slot.param_master

    @staticmethod
    def _in_place(slot: ParamSlot) -> bool:
        """Whether the update can run on the parameter's own memory (its master row)."""
        param = slot.param
        return param.dtype == torch.float32 and param.is_contiguous() and offloaded(param) is None

    def _stored_rows(self, slot: ParamSlot) -> int:
        """Rows of the plain fp32 entry as stored: the moments, and the master unless the
        parameter is the master."""
        return self._rows(slot) - (1 if self._param_is_master(slot) else 0)

    def _state_bytes(self, slot: ParamSlot) -> int:
        layout = self._layout(slot)
        return layout.nbytes(slot.numel) if layout is not None else self._stored_rows(slot) * slot.numel * 4

    def _entry_shape(self, slot: ParamSlot, numel: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the store entry holding ``numel`` elements' state of ``slot``."""
        layout = self._layout(slot)
        if layout is None:
            return (self._stored_rows(slot), numel), torch.float32
        return (layout.nbytes(numel),), torch.uint8

    def _initial(self, slot: ParamSlot, weight: torch.Tensor) -> torch.Tensor:
        layout = self._layout(slot)
        if layout is not None:
            packed = layout.empty(slot.numel)
            if not layout.param_master:
                PackedState(layout, packed, slot.numel).set_master(weight.reshape(-1).float())
            return packed
        packed = torch.zeros(self._stored_rows(slot), slot.numel, dtype=torch.float32)
        if not self._param_is_master(slot):
            packed[0].copy_(weight.reshape(-1))
        return packed

    async def _wrap(self, slot: ParamSlot, packed: torch.Tensor, start: int, stop: int, chunk: Chunk | None = None,
                    *, for_update: bool = True) -> Any:
        """What the update gets of an entry: the fp32 rows themselves (the parameter's own
        elements first where it is the master), or a ``PackedState`` (with a lossless master,
        holding the model's weight for those elements; where the parameter is the master, its
        own elements as the master). ``for_update=False``: for a read (``state_dict``), which
        leaves a loaded master to be checked by the first update (the model's weights may not be
        loaded yet)."""
        layout = self._layout(slot)
        fresh = chunk.index not in slot.chunks_updated if chunk is not None else not slot.updated
        fresh = fresh and (for_update or not slot.master_to_check(chunk))
        if layout is None:
            if packed.shape[0] != self._rows(slot):  # the parameter is the master
                if self._in_place(slot):
                    return _MasterRows(slot, packed, start, stop)
                return [await self._param_master(slot, start, stop), *packed.unbind(0)]
            if fresh and self._may_reload(slot, chunk) and await self._reloads(slot, chunk, start, stop, packed[0]):
                await fill_weight_range(slot, start, stop, packed[0])
            return packed
        high = None
        if layout.lossless:
            if chunk is not None and chunk.index in slot.chunks_updated and chunk.index not in slot.chunks_written or (
                chunk is None and slot.updated and not slot.written
            ):
                # The update's new high halves were in the weight that was never written: only
                # the low halves were kept.
                warn(
                    f"parameter {slot.index}: a step that failed after its update and before its weight was written "
                    "is completed with the weight as it was (master_weights='lossless' keeps only the master's low half)",
                )
            high = await (read_weight(slot) if (start, stop) == (0, slot.numel) else read_weight_range(slot, start, stop))
        if layout.param_master:
            master = await self._param_master(slot, start, stop)
            return PackedState(layout, packed, stop - start, param_numel=slot.numel, master=master)
        state = PackedState(layout, packed, stop - start, high, param_numel=slot.numel)  # (its kernels: the parameter's)
        if slot.loaded_master is not None and slot.master_to_check(chunk):
            state.high = await self._high_as_loaded(slot, state, start, update=fresh)
        if fresh and self._may_reload(slot, chunk) and await self._reloads(slot, chunk, start, stop, None if layout.lossless else state.master()):
            state.set_master((high if high is not None else await read_weight_range(slot, start, stop)).reshape(-1).float())
        return state

    async def _high_as_loaded(self, slot: ParamSlot, state: PackedState, start: int, *, update: bool) -> torch.Tensor:
        """The high halves of a lossless master loaded from a checkpoint, for ``state``'s
        elements from ``start`` (``tierstore.optim.lossless_load``): the weight the model holds
        if it is the master truncated; turned back into the master's high halves if it is the
        master rounded (a checkpoint of an fp32 master); if neither, at an update (``update``),
        the weight, with the low halves restarted at zero and a warning once for the parameter."""
        loaded = slot.loaded_master
        high = state.high
        assert loaded is not None and high is not None
        which = loaded.which(high, start)
        if which is None:  # (a range planned after the load: decided on the whole weight)
            which = loaded.which(await read_weight(slot), 0)
        if which == "rounded":
            return loaded.high_of_rounded(high, state.view("master_low"), start)
        if which == "neither" and update:
            state.view("master_low").zero_()
            if slot.index not in self._warned_restarts:
                self._warned_restarts.add(slot.index)
                warn(
                    f"parameter {slot.index}: the model's weight is neither the loaded master truncated (a lossless "
                    "master's checkpoint) nor rounded (an fp32 master's), so the master restarts from the weight (its "
                    "low halves lost): the weight moved since the master was saved, or the model's weights loaded are "
                    "not the checkpoint's", RuntimeWarning)
        return high

    @staticmethod
    def _may_reload(slot: ParamSlot, chunk: Chunk | None) -> bool:
        """Whether ``_reloads`` is to be asked (no await made per update where not): the master
        was loaded from a checkpoint, or the parameter written from outside."""
        if slot.master_to_check(chunk):
            return True
        if offloaded(slot.param) is not None:  # its data comes and goes (placeholder, held buffer): the version counts
            return slot.seen is not None and slot.seen[0] != slot.param._version  # (load_state_dict bumps it)
        return slot.foreign_write()

    async def _reloads(self, slot: ParamSlot, chunk: Chunk | None, start: int, stop: int, master: torch.Tensor | None) -> bool:
        """Whether the master (kept apart from the parameter) of elements ``start:stop`` must be
        reloaded from the parameter before this update (``_may_reload`` said it may). Yes where
        the parameter was written from outside since the optimizer wrote it
        (``ParamSlot.foreign_write``): torch's optimizer would update what it holds now. Where
        the master was loaded from a checkpoint (``verify_master``), only if the weight is not
        what that ``master`` rounds to: where it is, the model's weights were loaded from the same
        checkpoint (before or after the optimizer's state) and the master's extra bits are kept.
        An fp32 parameter reloads exactly; a lower-precision one loses the master's extra bits (a
        lossless master's low halves restart at zero), with a warning, once."""
        if slot.master_to_check(chunk):
            if master is None and slot.loaded_master is not None:
                # (lossless: its high half is the weight, read as loaded by ``_high_as_loaded``
                # until the update writes the weight: a step that fails before asks again)
                slot.note_seen()
                return False
            from_weight = slot.master_from_weight
            slot.master_checked(chunk)  # (decided once: a retry or a later step does not ask again)
            slot.note_seen()  # (the model's load after the optimizer's is taken into account here, not again)
            if master is None:  # (lossless: its high half is the weight now, its loaded low half kept)
                return False
            weight = (await read_weight_range(slot, start, stop)).reshape(-1)
            if torch.equal(master.to(weight.dtype), weight) or weight.dtype == torch.bfloat16 and torch.equal(_truncated(master), weight):
                return False  # (rounded: our own checkpoint; truncated: a lossless master's, exact too)
            if from_weight:
                return True  # (no master was saved: the weight as it is now, the model loaded after the optimizer)
            if slot.index in self._warned_restarts:
                return True
            self._warned_restarts.add(slot.index)
            warn(
                f"parameter {slot.index}: the master weight loaded from the checkpoint does not round to the parameter's "
                "value at the first step, so it restarts from the weight (its extra bits lost): the weight moved since "
                "the master was saved (trained by another optimizer, e.g. torch's AdamW, which keeps a 'master' entry it "
                "never updates), or the model's weights loaded are not the checkpoint's",
                RuntimeWarning,
            )
            return True
        if slot.param.dtype != torch.float32 and not self._warned_foreign:
            self._warned_foreign = True
            warn(
                f"parameter {slot.index} ({slot.param.dtype}) was written from outside the optimizer since its last "
                "step (load_state_dict, an in-place change under no_grad, p.data = ...): its fp32 master is reloaded "
                "from it, and the bits the master held beyond the parameter's precision are lost (a resume keeps them: "
                "load the model's weights and the optimizer's state_dict from the same checkpoint, in either order)",
            )
        return True

    async def _keep_master_apart(self, slot: ParamSlot) -> None:
        """A parameter that is its own fp32 master and is no longer fp32 (``model.to(torch.bfloat16)``
        after some steps) cannot hold the master any more: rebuilt from it at every update, the
        master would lose every change smaller than the parameter's precision, and the parameter
        would stop training. Its state is rewritten once into the layout that keeps the master
        apart, loaded from the parameter as it is now (the bits the cast dropped are gone, as
        they are for an optimizer that keeps its master apart and reloads it after the cast),
        with a warning. Called before the state is held (on the loop; a chunked parameter's runs
        wait for the first one's move)."""
        while (moving := self._master_moves.get(slot.index)) is not None:
            async with moving:  # (another run of its chunks is moving it: wait, then look again)
                pass
        unwritten = self._master_rows_unwritten.get(slot.index)
        if unwritten is None and (not slot.param_master or slot.param.dtype == torch.float32 or offloaded(slot.param) is not None):
            return
        self._master_moves[slot.index] = moving = asyncio.Lock()
        async with moving:
            try:
                if unwritten is None:
                    has_state = slot.resident is not None if not slot.paged else self._saved_pieces(slot) is not None
                    rows = (await self.read_state_rows(slot)).clone() if has_state else None  # (master: the parameter now)
                    self._master_apart(slot)
                    if rows is not None:
                        # (kept until written whole: a write that fails part-way is done again by the next step)
                        self._master_rows_unwritten[slot.index] = unwritten = rows
                    # (after the rows are kept: a filter that makes it an error fails this step, and the
                    # next one writes them, where the state was left unmoved and trained on as it was)
                    warn(
                        f"parameter {slot.index} is {slot.param.dtype} now, and it was its own fp32 master: the optimizer "
                        "keeps an fp32 master apart from it from now on, loaded from it as it is (the bits the cast dropped "
                        "are lost; cast the model before making the optimizer to keep a master from the start)",
                    )
                    if rows is None:
                        return
                assert unwritten is not None
                await self.write_state_rows(slot, unwritten)
                self._master_rows_unwritten.pop(slot.index, None)
            finally:
                del self._master_moves[slot.index]

    def _master_apart(self, slot: ParamSlot) -> None:
        """Lay ``slot``'s state out with the master apart from the parameter, and size the
        buckets for it (its chunks keep their elements and grow by the master); if one of its
        updates can no longer fit, ``OptimizerCapacityError`` with the layout as it was."""
        slot.param_master = False
        self._pieces_made.pop(slot.index, None)
        pipeline = self._pipeline
        if pipeline is None:
            return
        try:
            pipeline.replan()
        except OptimizerCapacityError as error:
            slot.param_master = True
            pipeline.replan()
            raise OptimizerCapacityError(
                f"parameter {slot.index} is {slot.param.dtype} now and can no longer be its own fp32 master; keeping the "
                f"master apart makes its state larger, and it does not fit: {error} (or cast the model before making the "
                "optimizer)"
            ) from None

    @asynccontextmanager
    async def _state(self, slot: ParamSlot) -> AsyncIterator[Any]:
        await self._keep_master_apart(slot)
        if not slot.paged:
            shape, dtype = self._entry_shape(slot, slot.numel)
            if slot.resident is None or tuple(slot.resident["packed"].shape) != shape or slot.resident["packed"].dtype != dtype:
                slot.resident = {"packed": self._initial(slot, await self._weight(slot))}
            yield await self._wrap(slot, slot.resident["packed"], 0, slot.numel)
            return
        if slot.chunks is not None:
            raise RuntimeError(f"internal error: parameter {slot.index} is paged in chunks; use _chunk_state")
        if not self._has(slot.key, slot, slot.numel):
            await self._create(slot.key, slot, 0, slot.numel)
        async with self.store.hold(slot.key, self.state_tier, write=True) as packed:
            yield await self._wrap(slot, packed, 0, slot.numel)

    def _chunkable(self, slot: ParamSlot) -> bool:
        return type(slot.param) in (*PLAIN_TENSOR_TYPES, ParamRange) and slot.param.is_contiguous()

    @asynccontextmanager
    async def _chunk_state(self, slot: ParamSlot, chunk: Chunk) -> AsyncIterator[Any]:
        await self._keep_master_apart(slot)
        if not self._has(chunk.key, slot, chunk.numel):
            await self._create(chunk.key, slot, chunk.start, chunk.stop)
        async with self.store.hold(chunk.key, self.state_tier, write=True) as packed:
            yield await self._wrap(slot, packed, chunk.start, chunk.stop, chunk)

    def _has(self, key: str, slot: ParamSlot, numel: int) -> bool:
        stored = self.store._shape_and_dtype(key)
        return stored is not None and stored == self._entry_shape(slot, numel)

    async def _create(self, key: str, slot: ParamSlot, start: int, stop: int) -> None:
        """New state under ``key`` for elements ``start:stop`` of ``slot``, written in place on
        the state tier (no second copy of it, nor of the weight, is made): zero moments, the
        master weight copied from the parameter (with a lossless master: zero low halves)."""
        shape, dtype = self._entry_shape(slot, stop - start)
        layout = self._layout(slot)
        async with self.store.fill(key, shape, dtype, self.state_tier) as packed:
            if layout is None:
                if self._param_is_master(slot):
                    packed.zero_()
                    return
                packed[1:].zero_()
                await fill_weight_range(slot, start, stop, packed[0])
                return
            packed.zero_()
            if not layout.lossless and not layout.param_master:
                await fill_weight_range(slot, start, stop, PackedState(layout, packed, stop - start).view("master"))

    async def _param_master(self, slot: ParamSlot, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the fp32 master of a parameter that is its own master: its
        memory, updated in place; a copy of its weight where it is no longer usable in place
        (the update's new weight is then written back as any weight)."""
        if self._in_place(slot):
            return _elements(slot.param.data, start, stop)
        return (await read_weight_range(slot, start, stop)).to(torch.float32, copy=True).reshape(-1)

    async def _decode(self, slot: ParamSlot, packed: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of ``slot``'s state as ``(rows, n)`` fp32 (a view of
        ``packed`` when that is the plain layout). An entry without the master (saved where the
        parameter was the master) gets the parameter's current elements as master; a compressed
        entry in the other of the two layouts (with and without the master) is read as saved."""
        if packed.dtype == torch.float32 and packed.dim() == 2:
            if packed.shape[0] == self._rows(slot):
                return packed
            rows = torch.empty(self._rows(slot), stop - start, dtype=torch.float32)
            rows[0].copy_((await read_weight_range(slot, start, stop)).reshape(-1))
            rows[1:].copy_(packed)
            return rows
        layout = self._layout(slot)
        if layout is not None and not layout.lossless and packed.numel() != layout.nbytes(stop - start):
            saved = replace(layout, param_master=not layout.param_master)
            master = await self._param_master(slot, start, stop) if saved.param_master else None  # (read: decode copies it)
            return PackedState(saved, packed, stop - start, master=master).decode()
        state = await self._wrap(slot, packed, start, stop, for_update=False)
        return state.decode() if isinstance(state, PackedState) else state

    def _encode(self, slot: ParamSlot, rows: torch.Tensor) -> torch.Tensor:
        """``(rows, n)`` fp32 state as ``slot``'s entry holds it (compressed, if so)."""
        layout = self._layout(slot)
        if layout is None:
            return rows[1:].contiguous() if self._param_is_master(slot) else rows.contiguous()
        packed = layout.empty(rows.shape[1])
        # (where the parameter is the master, the master row is its value: nothing of it is stored)
        master = rows[0].contiguous() if layout.param_master else None
        PackedState(layout, packed, rows.shape[1], master=master).encode(rows)
        return packed

    async def read_state_rows(self, slot: ParamSlot) -> torch.Tensor:
        """A parameter's whole state, ``(rows, numel)`` fp32 (master, exp_avg, exp_avg_sq
        [, max_exp_avg_sq]), decompressed, gathered from its chunks if it has them (on the
        store's loop). A state kept in memory (too small to page) may be returned itself."""
        if not slot.paged:
            if slot.resident is None:
                raise RuntimeError(f"internal error: parameter {slot.index} has no state")
            return await self._decode(slot, slot.resident["packed"], 0, slot.numel)
        if slot.chunks is None:
            return await self._decode(slot, await self.store.read(slot.key), 0, slot.numel)
        rows = torch.empty(self._rows(slot), slot.numel, dtype=torch.float32)
        for chunk in slot.chunks:
            # (read where it lies, moving nothing, as an unchunked state is: room made on the
            # state tier could need a write to a full disk, and the state could not be saved)
            part = await self.store.read(chunk.key)
            rows[:, chunk.start : chunk.stop].copy_(await self._decode(slot, part, chunk.start, chunk.stop))
        return rows

    async def write_state_rows(self, slot: ParamSlot, packed: torch.Tensor) -> None:
        """Store a parameter's whole ``(rows, numel)`` fp32 state, compressed as this optimizer
        keeps it, split into its chunks if it has them (on the store's loop); kept in memory
        for a parameter too small to page. Where the parameter is the master, the master row is
        written into the parameter (one no longer fp32 cannot hold the master: it is kept apart
        from then on, as ``_keep_master_apart`` does)."""
        if slot.param_master and slot.param.dtype != torch.float32 and offloaded(slot.param) is None:
            self._master_apart(slot)  # (before anything is written: OptimizerCapacityError if it cannot fit)
        if self._param_is_master(slot):
            offload = offloaded(slot.param)
            if offload is not None:
                await offload[0].write_weight(offload[1], packed[0].view(slot.shape).to(slot.param.dtype))
            elif slot.param.data.data_ptr() != packed[0].data_ptr():
                slot.param.data.copy_(packed[0].view(slot.shape))
        slot.note_written()  # the master is loaded: a later write to the parameter replaces it
        if self._master_rows_unwritten.get(slot.index) is not packed:  # (another whole state: an unfinished move is superseded)
            self._master_rows_unwritten.pop(slot.index, None)
        if not slot.paged:
            slot.resident = {"packed": self._encode(slot, packed)}
            return
        if slot.chunks is None:
            await self.store.put(slot.key, self._encode(slot, packed), tier=self.state_tier)
            return
        for chunk in slot.chunks:
            await self.store.put(chunk.key, self._encode(slot, packed[:, chunk.start : chunk.stop]), tier=self.state_tier)

    async def delete_state(self, slot: ParamSlot) -> None:
        """Forget a parameter's paged state (every chunk of it)."""
        await self._delete_present([slot.key, *(chunk.key for chunk in slot.chunks or [])])

    async def _delete_present(self, keys: Iterable[str]) -> None:
        """Delete those of ``keys`` that are in the store."""
        for key in keys:
            if key in self.store:
                await self.store.delete(key)

    # -- continuing an earlier run ------------------------------------------------------------------

    def _steps_key(self) -> str:
        return self.namespace.key("steps") if self.namespace is not None else ""

    def _settings_key(self) -> str:
        """Where ``close()`` saves, beside the step counts, each parameter's ``state_precision``,
        ``master_weights`` and ``amsgrad`` as its state was laid out: an entry's shape alone
        cannot tell them apart (a plain fp32 entry of three rows is the master and two moments
        or amsgrad's three moments; 4 elements of bf16 moments and of 8-bit ones with their
        scales both take 16 bytes)."""
        return self.namespace.key("settings") if self.namespace is not None else ""

    def _settings_code(self, settings: tuple[Any, ...]) -> tuple[int, int, int]:
        """``_layout_settings`` as the numbers ``_settings_key`` holds."""
        precision, master_weights, amsgrad = settings
        return PRECISIONS.index(precision), MASTER_WEIGHTS.index(master_weights), int(bool(amsgrad))

    def _groups_key(self) -> str:
        """Where ``close()`` saves how many parameters each param group has, so that a run
        rebuilt the same way (the constructor, then ``add_param_group``) is told from another
        model (``_adopt``)."""
        return self.namespace.key("groups") if self.namespace is not None else ""

    def _marker_keys(self) -> tuple[str, str, str]:
        """The records ``close()`` leaves beside the state: while they are there, the state is
        taken for one a run closed."""
        return self._steps_key(), self._settings_key(), self._groups_key()

    def _group_sizes(self) -> list[int]:
        return [sum(1 for slot in self._slots if slot.group == index) for index in range(len(self.param_groups))]

    async def _save_for_restart(self) -> None:
        steps = torch.full((len(self._slots),), float("nan"), dtype=torch.float64)
        for index, count in self._step_counts.items():
            steps[index] = float(count)
        for slot in self._slots:
            if not slot.paged and slot.resident is not None and slot.index in self._step_counts:
                await self.store.put(slot.key, slot.resident["packed"])
        # (as laid out: a change in param_groups after the state was made has not reached it)
        laid_out = torch.tensor([self._settings_code(self._laid_out_as.get(slot.group, _layout_settings(self.param_groups[slot.group])))
                                 for slot in self._slots], dtype=torch.uint8).reshape(len(self._slots), 3)
        groups = torch.tensor(self._group_sizes(), dtype=torch.int64)
        later = self._saved_for_later
        if later is not None:  # (never stepped: the state no group has taken yet is kept, as saved)
            assert later.settings is not None and later.groups is not None  # (``_adopt`` waits only with both)
            steps = torch.cat([steps, later.steps[len(self._slots):]])
            laid_out = torch.cat([laid_out, later.settings[len(self._slots):]])
            groups = torch.cat([groups, later.groups[len(self.param_groups):]])
        await self.store.put(self._settings_key(), laid_out)
        await self.store.put(self._groups_key(), groups)
        await self.store.put(self._steps_key(), steps)

    async def _adopt(self) -> None:
        """Continue from the state ``close()`` left in our namespace: every parameter whose step
        count was saved and whose state has the right shape. Anything else there is deleted. The
        step counts are consumed, so state updated by a run that then never closed is not taken
        for a consistent one later. Where the constructor's groups are the first of the saved
        run's (a run that added groups as it went, rebuilt the same way), the state of the
        others waits for ``add_param_group`` until the first ``step()``."""
        namespace = self.namespace
        if namespace is None:
            return
        saved: torch.Tensor | None = None
        if self._steps_key() in self.store:
            saved = await self.store.read(self._steps_key())
            if saved.dim() != 1:
                saved = saved.reshape(-1)  # (a count that matches nothing: the warning below)
        count = saved.shape[0] if saved is not None else 0
        saved_settings: torch.Tensor | None = None  # (None: saved by a version that did not record them)
        if self._settings_key() in self.store:
            saved_settings = await self.store.read(self._settings_key())
            if saved_settings.shape != (count, 3):
                saved_settings = None
        saved_groups: torch.Tensor | None = None  # (None: saved by a version that did not record them)
        if self._groups_key() in self.store:
            saved_groups = await self.store.read(self._groups_key())
            if saved_groups.dim() != 1 or int(saved_groups.sum()) != count:
                saved_groups = None
        sizes = self._group_sizes()
        # (not sharded: which rank owns an added parameter depends on the flags at the time, so
        # a rank's own counts cannot tell its parameters from another rank's)
        waits = (saved is not None and count > len(self._slots) and saved_settings is not None and saved_groups is not None
                 and self._sharding is None
                 and saved_groups.tolist()[: len(sizes)] == sizes)
        # The warnings come before anything changes: one a filter makes an error refuses the
        # constructor and leaves the namespace as it was.
        if saved is None and any(True for _ in namespace.keys()):
            warn(
                f"namespace {namespace.name!r} holds optimizer state but no step counts: the run that wrote it did not "
                "close() its optimizer (a crash, a kill, a close that failed), or the counts were lost, so the state may be "
                "part-way through a step; starting over (its state is deleted)",
            )
        elif saved is not None and count != len(self._slots) and not waits:
            warn(
                f"namespace {namespace.name!r} holds optimizer state for {count} parameter{'' if count == 1 else 's'}, not "
                f"{len(self._slots)}: starting over (its state is deleted)"
                + (f"; its groups held {saved_groups.tolist()} parameters, these {sizes}" if saved_groups is not None else ""),
            )
        later = _SavedForLater(saved, saved_settings, saved_groups, count) if saved is not None and (waits or count == len(self._slots)) else None
        kept = await self._adopt_saved(self._slots, later) if later is not None else set()
        if waits:
            self._saved_for_later = later
            kept.update(self._saved_keys(range(len(self._slots), count)))
            kept.update(self._marker_keys())
        elif saved is not None:
            # The step counts go once every state is rebuilt: a failure before (a value failing
            # its checksums, Ctrl-C) leaves them, and the saved state, for the next try.
            await self.store.delete(self._steps_key())
        for key in namespace.keys():
            if key not in kept:
                await self.store.delete(key)

    async def _adopt_added(self, group: int, added: list[ParamSlot]) -> None:
        later = self._saved_for_later
        first = len(self._slots) - len(added)
        if later is None or first >= later.count:
            return
        assert later.groups is not None
        expected = int(later.groups[group]) if group < later.groups.shape[0] else 0
        if len(added) != expected:  # (an empty group too: the groups after it would take others' state)
            left = list(range(first, later.count))
            warn(
                f"namespace {self.namespace.name!r}: param group {group} has {len(added)} parameter{'' if len(added) == 1 else 's'}"  # type: ignore[union-attr]
                f"; the saved run's group {group} had {expected}: the saved state of parameters {_listed(left)} (of its groups "
                f"{group} to {later.groups.shape[0] - 1}) starts over "
                "(it is deleted). Add the groups in the order and with the parameters the saved run had",
            )
            self._saved_for_later = None
            await self._forget_saved(left)
            return
        saved_keys = self._saved_keys(slot.index for slot in added)
        kept = await self._adopt_saved(added, later)
        await self._delete_present(saved_keys - kept)  # (a re-chunked state's old keys went in its relayout)

    def _forget_slots(self, removed: list[ParamSlot]) -> None:
        for slot in removed:
            self._step_counts.pop(slot.index, None)
            self._pieces_made.pop(slot.index, None)
            self._chunk_steps.pop(slot.index, None)

    def _settle_saved_state(self) -> None:
        later = self._saved_for_later
        if later is None:
            return
        namespace = self.namespace
        assert namespace is not None
        left = list(range(len(self._slots), later.count))
        if left:
            warn(
                f"namespace {namespace.name!r} holds optimizer state for {later.count} parameters; {len(self._slots)} "
                f"{'was' if len(self._slots) == 1 else 'were'} given (to the constructor and add_param_group) before the first "
                f"step(), so the state of parameters {_listed(left)} is deleted (the saved run's later groups not added again)",
            )
        self._drop_saved_for_later()

    def _unmark_saved(self) -> None:
        """Before a load writes the state: the saved step counts go, so a run killed part-way is
        not taken for one that closed (the state waiting for groups stays, for a load that fails
        its checks; ``close()`` writes the counts again)."""
        if self._saved_for_later is not None:
            run(self._delete_present(self._marker_keys()))

    def _drop_saved_for_later(self) -> None:
        """Forget the saved state no group took (``_adopt``), and the saved step counts."""
        later, self._saved_for_later = self._saved_for_later, None
        if later is not None:
            run(self._forget_saved(range(len(self._slots), later.count)))

    async def _forget_saved(self, indices: Iterable[int]) -> None:
        await self._delete_present({*self._saved_keys(indices), *self._marker_keys()})

    def _saved_keys(self, indices: Iterable[int]) -> set[str]:
        """The keys in the store holding the saved state of the parameters ``indices`` of our
        namespace (one entry, or its chunks)."""
        assert self.namespace is not None
        keys = set()
        for index in indices:
            key = self.namespace.key(str(index))
            if key in self.store:
                keys.add(key)
            chunk = 0
            while chunk_key(key, chunk) in self.store:
                keys.add(chunk_key(key, chunk))
                chunk += 1
        return keys

    async def _adopt_saved(self, slots: list[ParamSlot], later: _SavedForLater) -> set[str]:
        """Rebuild the saved state of ``slots`` (indices below ``later.count``) in this
        optimizer's layout, warning first of any that starts over; return the keys now
        holding it."""
        namespace = self.namespace
        assert namespace is not None
        saved, saved_settings = later.steps, later.settings
        unrecorded = saved_settings is None
        counted = [slot for slot in slots if float(saved[slot.index]) == float(saved[slot.index])]  # (NaN: never stepped)
        stepped = [slot for slot in counted if slot.key in self.store or chunk_key(slot.key, 0) in self.store]
        found = {slot.index for slot in stepped}
        missing = [slot.index for slot in counted if slot.index not in found]
        if missing:
            warn(
                f"namespace {namespace.name!r}: the saved state of parameters {missing} is not in the store (lost, e.g. "
                "dropped by `tierstore repair`, or deleted); those start over",
            )
        other_settings = {slot.index for slot in stepped if saved_settings is not None
                          and tuple(saved_settings[slot.index].tolist()) != self._settings_code(_layout_settings(self.param_groups[slot.group]))}
        mismatched = [slot.index for slot in stepped if slot.index in other_settings or self._saved_pieces(slot, unrecorded) is None]
        if mismatched:
            warn(
                f"namespace {namespace.name!r}: the saved state of parameters {mismatched} is laid out for other settings "
                "(another state_precision, master_weights or amsgrad, or parameters of another size) or incomplete (a chunk "
                "of it missing); those start over "
                "(their saved state is deleted). To carry state across a change of settings, take the state_dict() of the "
                "optimizer with the old ones (before its close()) and load it into one made with the new ones",
            )
        kept: set[str] = set()
        for slot in stepped:
            pieces = None if slot.index in other_settings else self._saved_pieces(slot, unrecorded)
            if pieces is None:
                continue
            keys = await self._relayout(slot, pieces)
            self._step_counts[slot.index] = torch.tensor(float(saved[slot.index]))
            if slot.paged:
                kept.update(keys)
            else:
                slot.resident = {"packed": await self.store.read(slot.key)}
        return kept

    def _saved_pieces(self, slot: ParamSlot, unrecorded: bool = False) -> list[tuple[str, int, int]] | None:
        """The entries holding a saved state of ``slot`` in whichever layout saved it (one
        entry, or chunks of any size: ``chunk_bytes`` may have changed since; with or without
        the master: saved where the parameter was the master, or where it was not), as ``(key,
        start, stop)`` in element order; None unless they cover the parameter exactly.
        ``unrecorded``: saved by a tierstore that did not record the settings (before
        ``_settings_key``), so an entry another layout would have of the same shape is not
        taken: a plain entry of three rows only in the layout this optimizer writes (the master
        and two moments, or amsgrad's three moments), a packed one only if no other
        ``state_precision`` or ``master_weights`` the parameter could have had packs that many
        elements into as many bytes (amsgrad taken as unchanged)."""
        layout = self._layout(slot)
        saved = [layout] if layout is None or layout.lossless else [layout, replace(layout, param_master=not layout.param_master)]
        for candidate in saved:
            if slot.key in self.store and self._saved_numel(slot, slot.key, candidate, unrecorded) == slot.numel:
                return [(slot.key, 0, slot.numel)]
            pieces: list[tuple[str, int, int]] = []
            start = 0
            while (key := chunk_key(slot.key, len(pieces))) in self.store:
                numel = self._saved_numel(slot, key, candidate, unrecorded)
                if numel is None:
                    break
                pieces.append((key, start, start + numel))
                start += numel
            else:
                if pieces and start == slot.numel:
                    return pieces
        return None

    def _saved_numel(self, slot: ParamSlot, key: str, layout: StateLayout | None, unrecorded: bool = False) -> int | None:
        """Elements of ``slot``'s state the entry ``key`` holds, if it is in ``layout`` (None:
        the plain fp32 one)."""
        info = self.store.info(key)
        shape, dtype = tuple(info["shape"]), info["dtype"]
        if layout is None:
            # with or without the master row: a state saved on the plain CPU, where the
            # parameter is the master, or under a device link, where it is not
            rows: tuple[int, ...] = (self._rows(slot), self._rows(slot) - 1)
            if unrecorded:  # (three rows: taken only as this optimizer would write them)
                rows = tuple(r for r in rows if r != 3 or r == self._stored_rows(slot))
            ok = dtype == torch.float32 and len(shape) == 2 and shape[0] in rows and (shape[1] >= 1 or slot.numel == 0)
            return shape[1] if ok else None
        numel = layout.numel_of(shape[0]) if dtype == torch.uint8 and len(shape) == 1 else None
        if numel is None or (numel == 0 and slot.numel != 0):
            return None
        # (without the record: amsgrad taken as unchanged, or every bf16 or lossless state would
        # collide with another amsgrad's, at every size; the other settings collide at a size or two)
        if unrecorded and any(other.nbytes(numel) == shape[0] for other in _packed_layouts()
                              if other != layout and other.amsgrad == layout.amsgrad and _could_have(slot, other)):
            return None
        return numel

    async def _relayout(self, slot: ParamSlot, pieces: list[tuple[str, int, int]]) -> list[str]:
        """Rewrite the saved state in ``pieces`` into this optimizer's layout of ``slot`` (its
        chunks, or one entry) and return its keys. One saved piece and one new piece are in
        memory at a time; new pieces whose keys the old layout still uses are staged first."""
        targets = [(c.key, c.start, c.stop) for c in slot.chunks] if slot.paged and slot.chunks is not None else [(slot.key, 0, slot.numel)]
        if pieces == targets and all(
            self._has(key, slot, stop - start) for key, start, stop in pieces
        ):
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
                    cached = (source, await self._decode(slot, await self.store.read(source), first, last))
                low, high = max(first, start), min(last, stop)
                out[:, low - start : high - start].copy_(cached[1][:, low - first : high - first])
            staged.append(f"{slot.key}/relayout{index}" if key in old else key)
            await self.store.put(staged[-1], self._encode(slot, out), tier=self.state_tier)
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

    def _master(self, slot: ParamSlot, state: Any) -> torch.Tensor:
        """The weight to write from ``state``: its fp32 master (a lossless one: the bf16 weight)."""
        return state.weight() if isinstance(state, PackedState) else state[0]

    def _apply(self, slot: ParamSlot, state: Any, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        return self._apply_many([slot], [state], [grad])[0]

    def _apply_many(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """One call of torch's Adam per parameter group in the bucket (elementwise, so the same
        numbers as a call per parameter or one for all). GradScaler's ``grad_scale`` goes into
        the fused kernel, as torch's fused Adam takes it; the others multiply by its inverse, as
        ``GradScaler.unscale_`` does before torch's other kernels run. Compressed states are
        updated one at a time (their fp32 temporaries are one entry's), but for the small ones,
        updated together (``tierstore.optim.batched``: the same bits)."""
        by_group: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            by_group.setdefault(slot.group, []).append(i)
        for group_index, members in by_group.items():
            group = self.param_groups[group_index]
            steps = [self._step_count(slots[i].index) for i in members]
            plain = [(i, step) for i, step in zip(members, steps, strict=True) if not isinstance(states[i], PackedState)]
            if plain:
                rows, tiles = [list(states[i]) for i, _ in plain], [grads[i] for i, _ in plain]
                laid = self._in_memory_order(group, [slots[i] for i, _ in plain], rows, tiles)
                self._adam(group, rows, tiles, [step for _, step in plain], grad_scale, [_placed(slots[i]) for i, _ in plain])
                for copy in laid:
                    copy.write_back()
            together: list[tuple[int, torch.Tensor]] = []  # (small entries: one decode, Adam call and encode for them all)
            for i, step in zip(members, steps, strict=True):
                if isinstance(states[i], PackedState):
                    if batched(states[i]):
                        together.append((i, step))
                    else:
                        self._adam_packed(group, states[i], grads[i], step, grad_scale)
            if together:
                update_many([states[i] for i, _ in together], [grads[i] for i, _ in together], [step for _, step in together],
                            lambda rows, tiles, counts, group=group: self._adam(group, rows, tiles, counts, grad_scale))
        return [self._master(slot, state) for slot, state in zip(slots, states, strict=True)]

    def _step_count(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s step count (a new one at 0 the first time: a torch call, made
        only then)."""
        count = self._step_counts.get(index)
        if count is None:
            count = self._step_counts[index] = torch.tensor(0.0)
        return count

    def _in_memory_order(
        self, group: dict[str, Any], slots: list[ParamSlot], rows: list[list[torch.Tensor]], grads: list[torch.Tensor]
    ) -> list[InMemoryOrder]:
        """For torch's fused kernel, replace (in ``rows`` and ``grads``) the state and gradient of
        each non-contiguous parameter by copies in its memory order, as torch's fused Adam
        updates it (``tierstore.optim.memory_order``); return the copies, to write back."""
        if not uses_fused(group):
            return []
        laid: list[InMemoryOrder] = []
        for n, slot in enumerate(slots):
            param = slot.param
            if type(param) not in PLAIN_TENSOR_TYPES or (dims := memory_order(param)) is None:
                continue
            if any(row.numel() != param.numel() for row in rows[n]) or grads[n].numel() != param.numel():
                continue
            copy = InMemoryOrder(param, dims, rows[n], grads[n])
            rows[n], grads[n] = copy.rows, copy.grad
            laid.append(copy)
        return laid

    def _adam_packed(
        self, group: dict[str, Any], state: PackedState, grad: torch.Tensor, step: torch.Tensor | float, grad_scale: torch.Tensor | None
    ) -> torch.Tensor | float:
        """Torch's Adam on ``state``, decoded and encoded back tile by tile (``PackedState.update``;
        8-bit moments: one compiled kernel a tile, given the group's settings as ``AdamHyper``);
        the count after it (``step`` counted up, if a tensor)."""
        beta1, beta2 = group["betas"]
        hyper = AdamHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                          bool(group.get("decoupled_weight_decay", self.decoupled_weight_decay)), bool(group["maximize"]), grad_scale)
        return state.update(grad, step, lambda rows, tile, count: self._adam(group, [rows], [tile], [count], grad_scale), hyper)

    def _adam(
        self, group: dict[str, Any], states: list[list[torch.Tensor]], grads: list[torch.Tensor], steps: list[torch.Tensor],
        grad_scale: torch.Tensor | None, placed: list[Placed | None] | None = None,
    ) -> None:
        """One call of torch's Adam on ``states`` (per parameter: fp32 master, exp_avg,
        exp_avg_sq[, max_exp_avg_sq]) of one group; ``placed``: where each entry's elements lie
        in a parameter split across ranks (``tierstore.optim.lanes``: for the fused kernel, each
        element takes the code path it takes in torch's update of the whole parameter; the
        foreach and for-loop kernels give every element the same bits wherever it lies)."""
        amsgrad = group["amsgrad"]
        fused = uses_fused(group)
        beta1, beta2 = group["betas"]
        flat = [grad if grad.dim() == 1 else grad.reshape(-1) for grad in grads]
        if grad_scale is not None and not fused:
            inverse = inverse_scale(grad_scale)
            flat = [g.mul(inverse) for g in flat]
        flat = [g if g.dtype == torch.float32 else g.float() for g in flat]
        copy_back = None
        if fused and placed is not None and any(where is not None for where in placed):
            states, flat, steps, copy_back = on_whole_lanes(placed, states, flat, steps)
        adam(
            [state[0] for state in states], flat,
            [state[1] for state in states], [state[2] for state in states],
            [state[3] for state in states] if amsgrad else [],
            steps,
            foreach=bool(group["foreach"]) and not fused, fused=bool(fused),
            amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"],
            decoupled_weight_decay=group.get("decoupled_weight_decay", self.decoupled_weight_decay),
            grad_scale=grad_scale if fused else None,
        )
        if copy_back is not None:
            copy_back()

    def _resident_pieces(self, slot: ParamSlot) -> list[Piece] | None:
        """The pieces of ``slot``'s state for the resident step (``tierstore.optim.resident``):
        the plain fp32 state of a parameter that is its own master and updated in place (plain
        CPU); None for any other (its master to reload or write back, compressed state). Asked
        of every slot each step, on the loop: the checks are inlined and the pieces made once
        per layout."""
        group = self.param_groups[slot.group]
        if (group["state_precision"] != "fp32" or group["master_weights"] != "fp32" or not self._param_is_master(slot)
                or not self._in_place(slot)):
            return None  # (the packed layout, or a master to reload or write back)
        rows = 3 if group["amsgrad"] else 2  # (``_stored_rows``: the moments, the parameter is the master)
        if not slot.paged:
            packed = slot.resident["packed"] if slot.resident is not None else None
            if packed is None or packed.shape != (rows, slot.numel) or packed.dtype != torch.float32:
                return None  # (created by the pipeline's first update)
        made = self._pieces_made.get(slot.index)
        if made is not None and made[0] == rows and made[1] == slot.paged and made[2] is slot.chunks:
            return made[3]
        shape = (rows, slot.numel)
        if not slot.paged:
            pieces = [Piece(None, 0, slot.numel, shape, torch.float32)]
        elif slot.chunks is None:
            pieces = [Piece(slot.key, 0, slot.numel, shape, torch.float32)]
        else:
            pieces = [Piece(chunk.key, chunk.start, chunk.stop, (rows, chunk.numel), torch.float32) for chunk in slot.chunks]
        self._pieces_made[slot.index] = (rows, slot.paged, slot.chunks, pieces)
        return pieces

    def _update_resident(
        self, slots: list[ParamSlot], pieces: list[list[Piece]], states: list[list[torch.Tensor]], grads: list[torch.Tensor]
    ) -> None:
        """Torch's Adam over every piece of ``slots`` at once, one call per parameter group,
        in place on the parameters (each their own master) and the held ``states``. A chunked
        parameter's pieces each start from its count, as its chunks do in the pipeline."""
        by_group: dict[int, tuple[list[list[torch.Tensor]], list[torch.Tensor], list[torch.Tensor], list[Placed | None]]] = {}
        for slot, parts, entries, grad in zip(slots, pieces, states, grads, strict=True):
            rows, tiles, steps, placed = by_group.setdefault(slot.group, ([], [], [], []))
            count = self._step_count(slot.index)
            param = _flat(slot.param.data)
            flat = grad if grad.dim() == 1 else grad.reshape(-1)
            if len(parts) == 1:
                rows.append([param, *entries[0].unbind(0)])
                tiles.append(flat)
                steps.append(count)
                placed.append(_placed(slot))
                continue
            for piece, entry in zip(parts, entries, strict=True):
                rows.append([param[piece.start : piece.stop], *entry.unbind(0)])
                tiles.append(flat[piece.start : piece.stop])
                steps.append(count.clone())
                placed.append(_placed(slot, piece.start))
            self._step_counts[slot.index] = steps[-1]  # (counted up by the update, as every piece's)
        for group_index, (rows, tiles, steps, placed) in by_group.items():
            self._adam(self.param_groups[group_index], rows, tiles, steps, None, placed)

    def _begin_chunks(self, slot: ParamSlot) -> None:
        """Before the first chunk of this step's update: every chunk starts from this count
        (a step resumed after a failure keeps the count its first chunks started from)."""
        if not slot.chunks_updated or slot.index not in self._chunk_steps:
            before = self._step_counts.get(slot.index)
            before = before.clone() if before is not None else torch.tensor(0.0)
            self._chunk_steps[slot.index] = (before, float(before), None)

    def _apply_chunk(self, slot: ParamSlot, chunk: Chunk, state: Any, grad: torch.Tensor, grad_scale: torch.Tensor | None) -> torch.Tensor:
        before, count, _ = self._chunk_steps[slot.index]
        group = self.param_groups[slot.group]
        after: torch.Tensor | float
        if isinstance(state, PackedState):  # (from the count as a number: its fused kernels make no tensor of it)
            after = self._adam_packed(group, state, grad, count, grad_scale)
        else:
            after = before.clone()  # torch's Adam counts it up: each chunk from the same count
            self._adam(group, [list(state)], [grad], [after], grad_scale, [_placed(slot, chunk.start)])
        self._chunk_steps[slot.index] = (before, count, after)
        return self._master(slot, state)

    def _end_chunks(self, slot: ParamSlot) -> None:
        before, _, after = self._chunk_steps.pop(slot.index, (None, 0.0, None))
        if before is None or after is None:
            return
        if isinstance(after, torch.Tensor) and after.dtype == before.dtype:
            self._step_counts[slot.index] = after
        else:  # (counted as a number, or in a tensor of another dtype: the count keeps its own)
            self._step_counts[slot.index] = torch.full_like(before, float(after))

    # -- checkpoints (tierstore.optim.checkpoint) -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Torch's format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}},
        "param_groups": [...]}``, loadable by ``torch.optim.Adam``/``AdamW``. Parameters whose dtype
        is not fp32 also carry their fp32 ``master`` weight (torch ignores it); DTensor parameters
        (FSDP2) get DTensor state. See ``tierstore.optim.checkpoint``. The hooks of
        ``register_state_dict_pre_hook``/``..._post_hook`` run around it, as torch's do."""
        self._refuse_changed_layouts()
        return self._hooked_state_dict(lambda: adam_state_dict(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this class or by ``torch.optim.Adam``/``AdamW`` (with the
        hooks of ``register_load_state_dict_pre_hook``/``..._post_hook``, as torch's)."""
        self._refuse_changed_layouts()
        self._hooked_load(state_dict, self._load)

    def _load(self, state_dict: dict[str, Any]) -> None:
        self._unmark_saved()
        adam_load_state_dict(self, state_dict)
        self._drop_saved_for_later()  # (the loaded state is the state from now on; groups added later start over)
        self._laid_out_as = dict(enumerate(map(_layout_settings, self.param_groups)))  # (as loaded)

    def _entry_of(self, slot: ParamSlot) -> dict[str, torch.Tensor]:
        """One parameter's state in torch's format, read from the store (``opt.state[p]``)."""
        self._refuse_changed_layouts()
        return run(adam_entry(self, slot))


class TieredAdamW(TieredAdam):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2) with state paged through a
    store. Same arguments as ``TieredAdam``. Its update is torch's fused CPU kernel unless
    ``fused=False``: compare it bit for bit with ``torch.optim.AdamW(..., fused=True)`` (torch's
    own default on the CPU is its for-loop kernel, whose results differ in the last bits), or
    pass ``fused=False`` to both."""

    decoupled_weight_decay = True

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        if "decoupled_weight_decay" in kwargs:  # (torch's AdamW takes none: it is always decoupled)
            raise TypeError("TieredAdamW got an unexpected keyword argument 'decoupled_weight_decay' (it is always "
                            "decoupled; TieredAdam takes it)")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


def _require_bf16_for_lossless(master: str, params: Iterable[torch.Tensor]) -> None:
    """``ValueError`` unless a group with ``master_weights='lossless'`` holds bf16 parameters only."""
    if master == "lossless":
        wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16})
        if wrong:
            raise ValueError(
                f"master_weights='lossless' keeps the master's high half in the bf16 weight: it needs bf16 parameters, "
                f"and this group has {', '.join(wrong)} ones; put those in a group with master_weights='fp32'"
            )


def _layout_settings(group: dict[str, Any]) -> tuple[Any, ...]:
    """A group's values of ``TieredAdam._layout_keys``."""
    return group.get("state_precision"), group.get("master_weights"), bool(group.get("amsgrad"))


def _truncated(master: torch.Tensor) -> torch.Tensor:
    """The bf16 weight a lossless master keeps beside fp32 ``master``: its high halves."""
    return master.reshape(-1).view(torch.int32).bitwise_and(-65536).view(torch.float32).bfloat16()


def _could_have(slot: ParamSlot, layout: StateLayout) -> bool:
    """Whether ``slot``'s parameter, of its dtype now, could have had its state in ``layout``
    (a lossless master is for bf16 parameters; a parameter is its own master in fp32 only): the
    layouts a saved size is told apart from where the settings were not recorded."""
    dtype = slot.param.dtype
    return (not layout.lossless or dtype == torch.bfloat16) and (not layout.param_master or dtype == torch.float32)


@cache
def _packed_layouts() -> tuple[StateLayout, ...]:
    """Every packed layout there is (``_saved_numel``: which of them a saved size fits)."""
    return tuple(StateLayout(precision, lossless, amsgrad, param_master)
                 for precision in PRECISIONS for lossless in (False, True) if precision != "fp32" or lossless
                 for amsgrad in (False, True) for param_master in (False, True) if not (lossless and param_master))


@lru_cache(maxsize=64)
def _state_layout(precision: str, lossless: bool, amsgrad: bool, param_master: bool) -> StateLayout:
    """The (immutable) layout of these settings, made once: the loop asks for a slot's layout
    several times per chunk it updates."""
    return StateLayout(precision, lossless, amsgrad, param_master)


@dataclass(frozen=True)
class _SavedForLater:
    """What ``_adopt`` read of an earlier run's namespace: its step counts (NaN: never
    stepped), its settings record (None: saved before there was one), for ``count``
    parameters."""

    steps: torch.Tensor
    settings: torch.Tensor | None
    #: Parameters per param group (None: saved before there was a record).
    groups: torch.Tensor | None
    count: int


def _listed(indices: list[int]) -> str:
    """Parameter indices for a message: the first eight."""
    return f"{indices[:8]}".rstrip("]") + (", ...]" if len(indices) > 8 else "]")


class _MasterRows(Sequence[torch.Tensor]):
    """The rows an update of a plain entry gets where the parameter is its own master (updated
    in place): the parameter's elements ``start:stop``, then the entry's moment rows. The views
    are made at first use, on the thread that runs the math, not on the loop where the hold
    is taken: on the loop, each torch call lets go of the GIL, and getting it back waits for
    the math and I/O threads. They are made of the parameter's data as it is then: data
    replaced since the hold (``p.data = ...``) that can no longer be updated in place (another
    dtype, not contiguous) gets an fp32 copy as master (its new weight written back as any
    weight's, as ``_param_master`` does); data of another size, or no longer in host memory,
    raises ``RuntimeError`` (an update of the wrong size would write past the data's end)."""

    __slots__ = ("_slot", "_packed", "_start", "_stop", "_rows")

    def __init__(self, slot: ParamSlot, packed: torch.Tensor, start: int, stop: int) -> None:
        self._slot, self._packed, self._start, self._stop = slot, packed, start, stop
        self._rows: list[torch.Tensor] | None = None

    def _made(self) -> list[torch.Tensor]:
        rows = self._rows
        if rows is None:
            slot = self._slot
            data = slot.param.data
            if data.numel() != slot.numel or data.device.type != "cpu" or offloaded(slot.param) is not None:
                raise RuntimeError(
                    f"parameter {slot.index}: its data was replaced during the step (now {tuple(data.shape)}, "
                    f"{data.dtype}, on {data.device}; its state is for {slot.numel} elements in host memory); "
                    "replace a parameter's data between steps only"
                )
            if TieredAdam._in_place(slot):
                master = _elements(data, self._start, self._stop)
            else:  # (the copy _param_master makes where the update cannot run in place)
                master = data.reshape(-1)[self._start : self._stop].to(torch.float32, copy=True)
            rows = self._rows = [master, *self._packed.unbind(0)]
        return rows

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        return self._made()[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._made())

    def __len__(self) -> int:
        return 1 + self._packed.shape[0]


def _elements(data: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of a contiguous parameter's ``data``, a flat view of its memory
    (the whole of it without a slice: on the loop, each torch call lets go of the GIL)."""
    flat = _flat(data)
    return flat if start == 0 and stop == flat.numel() else flat[start:stop]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor`` as a flat view: itself if it is flat already (on the loop, a
    torch call lets go of the GIL, and getting it back waits for the math threads)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def _placed(slot: ParamSlot, start: int = 0) -> Placed | None:
    """Where elements ``start:`` of ``slot``'s flat state lie in a parameter split across ranks
    (``tierstore.optim.lanes``); None for a whole parameter (its chunks start on lanes)."""
    param = slot.param
    return Placed(param.start + start, param.param.numel()) if isinstance(param, ParamRange) else None
