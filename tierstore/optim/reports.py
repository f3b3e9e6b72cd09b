"""What the paged optimizers report: where the bytes are, where the time went, and a timeline
of one step that Perfetto or chrome://tracing opens."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..units import distinct_sizes, format_bytes
from ..wear import DEFAULT_CAPACITY, DriveWear, drive_wear

if TYPE_CHECKING:
    from ..store import TierStore
    from .slots import ParamSlot


@dataclass
class MemoryReport:
    """Bytes per parameter and totals, by place.

    ``device``: the model's weights and gradients (they stay on the device in their own dtype);
    ``state_by_tier``: the optimizer's state (master weights and moments, as stored), by store tier;
    ``resident_state``: state of parameters too small to page, kept in host memory;
    ``state_contents``: what the state of a parameter holds (``"fp32 master + fp32 moments"``,
    ``"low 16 bits of the master + 8-bit moments"`` ...) -> the parameters (elements) stored so.
    """

    parameters: int
    paged_parameters: int
    device_weight_bytes: int
    device_grad_bytes: int
    state_by_tier: dict[str, int]
    resident_state_bytes: int
    resident_parameters: int
    state_bytes_per_param: float
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    #: What each tier and the process need (``MemoryPlan``), known before the first step.
    plan: MemoryPlan | None = None
    #: Bytes the last step wrote to the disk tier, and what that rate does to a typical drive
    #: (``TimeReport.wear``); None before a step that paged to disk.
    disk_write_bytes_per_step: int | None = None
    wear: DriveWear | None = None
    state_contents: dict[str, int] = field(default_factory=dict)
    #: Parameters whose weights ``tierstore.swap.offload_parameters`` keeps in the store (not
    #: counted on the device above: they come and go).
    swapped_parameters: int = 0
    #: Elements of frozen parameters (``requires_grad=False``): no state, as torch's AdamW keeps
    #: none (not in ``paged_parameters`` or the bytes per parameter of the state).
    frozen_parameters: int = 0

    def for_drive(self, capacity: int | str = DEFAULT_CAPACITY, rated_tbw: float | None = None) -> MemoryReport:
        """This report with its wear line describing a drive of ``capacity`` rated for
        ``rated_tbw`` terabytes written (``TimeReport.for_drive``)."""
        if self.wear is None:
            drive_wear(0, 0.0, capacity=capacity, rated_tbw=rated_tbw)  # (refuses a bad drive)
            return self
        wear = drive_wear(self.wear.bytes_written, self.wear.seconds, capacity=capacity, rated_tbw=rated_tbw)
        return replace(self, wear=wear)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        n = max(self.parameters, 1)
        frozen = f", {self.frozen_parameters:,} frozen: no state" if self.frozen_parameters else ""
        lines = [
            f"optimizer memory for {self.parameters:,} parameters ({self.paged_parameters:,} paged{frozen})",
            f"  model on the device: {self.device_weight_bytes / n:.1f} + {self.device_grad_bytes / n:.1f} bytes/param "
            f"(weights + grads) = {format_bytes(self.device_weight_bytes + self.device_grad_bytes)}",
            f"  optimizer state, {self.state_bytes_per_param:.0f} bytes/param{self._contents()}, by store tier:",
        ]
        trainable = max(self.parameters - self.frozen_parameters, 1)
        for tier, nbytes in self.state_by_tier.items():
            lines.append(f"    {tier:<8} {nbytes / trainable:5.1f} bytes/param = {format_bytes(nbytes)}")
        if self.resident_parameters:
            lines.append(
                f"    not paged: {format_bytes(self.resident_state_bytes)} in host memory for {self.resident_parameters} "
                "tensors below min_offload_numel"
            )
        if self.plan is not None:
            lines.append(str(self.plan))
        if self.wear is not None and self.disk_write_bytes_per_step is not None:
            lines.append(f"  last step wrote {format_bytes(self.disk_write_bytes_per_step)} to disk; {self.wear}")
        if self.swapped_parameters:
            lines.append(
                f"  Still on the device: the weights and grads above, plus, while their layers run (and as they are "
                f"prefetched), the weights of the {self.swapped_parameters} parameter tensors tierstore.swap offloads, "
                "plus the activations not offloaded."
            )
        else:
            lines.append(
                "  Still on the device: the weights and grads above, plus activations -- offloading optimizer state "
                "does not make those fit (tierstore.swap moves activations and parameters)."
            )
        return "\n".join(lines)

    def _contents(self) -> str:
        """`` (what is stored)`` for the state line: one setting, or each with its share."""
        if not self.state_contents:
            return ""
        if len(self.state_contents) == 1:
            return f" ({next(iter(self.state_contents))})"
        total = max(sum(self.state_contents.values()), 1)
        return " (" + "; ".join(f"{n / total:.0%}: {what}" for what, n in self.state_contents.items()) + ")"


def state_contents(optimizer: Any, slot: ParamSlot) -> str:
    """What the optimizer stores for ``slot``'s parameter, in words (``MemoryReport``)."""
    group = optimizer.param_groups[slot.group]
    precision, master = group.get("state_precision"), group.get("master_weights")
    if precision is None:  # an optimizer without storage choices keeps its own state as it is
        return "the optimizer's state as it keeps it"
    moments = {"fp32": "fp32 moments", "bf16": "bf16 moments", "8bit": "8-bit moments"}.get(precision, f"{precision} moments")
    if master == "lossless":
        kept = "low 16 bits of the master"  # (its high half is the bf16 weight itself)
    elif getattr(optimizer, "_param_is_master", lambda _: False)(slot):
        kept = "no master copy (the fp32 weight is the master)"
    else:
        kept = "fp32 master"
    return f"{kept} + {moments}"


@dataclass
class MemoryPlan:
    """Bytes the optimizer will need, computed from the parameters and the store before any step.

    ``tier_need``: per store tier, what it must be able to hold: on the state tier one update
    (the largest bucket unit or chunk) and the largest gradient copy arriving (more updates in
    flight and chunks prefetched ahead use whatever room is left), on the tier below it all
    paged state and gradient copies as stored there, and on a disk the room of the copies-on-write
    of as many as the memory tiers above it hold (a value written down again keeps its old extent
    until the new one is committed; a flush writes them all at once).
    ``process_bytes``: the process's bound with state paged: the model's weights and gradients
    (host memory where the device is the CPU), every memory tier's capacity, state kept
    resident, and the bounded working set (``working_bytes``: the disk tier's staging buffers,
    one chunk of bounce buffer per disk I/O thread, and the update's own buffers on each thread
    that runs it: compressed state's decoded tiles). ``chunk_bytes``: the state of the largest
    chunk of a chunked parameter (chunks are whole blocks of 1,024 elements: at least one block,
    otherwise at most the cap the pipeline set from ``chunk_bytes=``; the cap when none is
    chunked). ``problems``: why it cannot fit (empty: it fits).
    """

    tier_need: dict[str, int]
    tier_capacity: dict[str, int]
    process_bytes: int
    model_bytes: int
    working_bytes: int
    resident_state_bytes: int
    paged_state_bytes: int
    chunked_parameters: int
    chunk_bytes: int
    problems: list[str] = field(default_factory=list)
    #: Per tier, bytes held by values that are not this optimizer's (a store shared with other
    #: users): on the bottom tier, which evicts nothing, they are not the optimizer's to use.
    tier_used_by_others: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"memory plan ({'fits' if self.fits else 'does NOT fit'}):"]
        for name, need in self.tier_need.items():
            others = self.tier_used_by_others.get(name, 0)
            held = f" ({format_bytes(others)} of it held by other values)" if others else ""
            lines.append(f"  {name:<8} needs {format_bytes(need)} of {format_bytes(self.tier_capacity[name])}{held}")
        lines.append(
            f"  process  at most {format_bytes(self.process_bytes)} (model {format_bytes(self.model_bytes)}, tiers, "
            f"resident state {format_bytes(self.resident_state_bytes)}, working set {format_bytes(self.working_bytes)})"
        )
        if self.chunked_parameters:
            noun = "parameter" if self.chunked_parameters == 1 else "parameters"
            lines.append(f"  {self.chunked_parameters} {noun} paged in chunks of up to {format_bytes(self.chunk_bytes)} of state")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _trainable(slot: ParamSlot) -> bool:
    """Whether ``slot``'s parameter trains (``plan_memory``'s and ``memory_report``'s default
    ``planned``: a frozen parameter gets no state)."""
    return slot.param.requires_grad


def plan_memory(
    store: TierStore, slots: Sequence[ParamSlot], state_bytes: Callable[[ParamSlot], int], *, state_tier: str,
    unit_need: Callable[[ParamSlot], int], inflight: int, chunk_bytes: int, offloaded: Callable[[Any], Any],
    used_by_others: dict[str, int] | None = None, planned: Callable[[ParamSlot], bool] = _trainable,
    state_entries: Callable[[ParamSlot], list[int]] | None = None, update_scratch: int = 0,
) -> MemoryPlan:
    """The ``MemoryPlan`` of an optimizer's ``slots`` in ``store`` (see ``MemoryPlan``);
    ``used_by_others``: bytes of the bottom tier held by values that are not the optimizer's;
    ``planned``: whether a slot's state counts (not a frozen parameter's without state);
    ``state_entries``: the bytes of each store entry of a slot's state (default: one entry);
    ``update_scratch``: the update's own buffers, on all the threads that run it."""
    from ..tiers import DiskTier, MemoryTier

    tiers = store.tiers
    names = [tier.name for tier in tiers]
    position = names.index(state_tier)
    # Frozen parameters (``requires_grad=False``: a LoRA model's base) get no state, as torch's
    # AdamW makes none for them; one unfrozen later adds its state then.
    trainable = [slot for slot in slots if planned(slot)]
    paged = [slot for slot in trainable if slot.paged]
    paged_state = sum(state_bytes(slot) for slot in paged)
    copied_grads = [slot.numel * slot.param.element_size() for slot in trainable if not slot.link.lends and slot.chunks is None]
    resident = sum(state_bytes(slot) for slot in trainable if not slot.paged)
    largest = max((unit_need(slot) for slot in trainable), default=0)
    chunked = [slot for slot in trainable if slot.chunks is not None]
    need = {name: 0 for name in names}
    weights: dict[str, list[int]] = {}
    # What must fit: one update at a time and one more gradient arriving (the pipeline runs
    # fewer updates at once, and prefetches less, when the tier is small; that is slower, not
    # wrong). More buckets in flight and chunks prefetched ahead use what room is left.
    need[state_tier] = largest + max(copied_grads, default=0)
    # A chunked parameter whose weight is offloaded to this store has the whole weight held on
    # a memory tier while its chunks update (the store has no ranged reads).
    for slot in chunked:
        offload = offloaded(slot.param)
        if offload is not None and offload[0].store is store:
            weights.setdefault(offload[0].range_tier(), []).append(slot.numel * slot.param.element_size())
    for name, sizes in weights.items():
        need[name] += max(sizes)
    below = [t for t in tiers[position + 1 :]]
    if below:  # everything pages down to the tier below (the disk)
        bottom = below[-1]
        entries = [n for slot in paged for n in (state_entries(slot) if state_entries is not None else [state_bytes(slot)])]
        entries += copied_grads
        need[bottom.name] = _bottom_need(bottom, [t for t in tiers[:-1] if isinstance(t, MemoryTier)], entries)
    else:
        need[state_tier] = max(need[state_tier], paged_state + sum(copied_grads))
    capacity = {tier.name: tier.capacity for tier in tiers}
    others = {name: used for name, used in (used_by_others or {}).items() if used}
    problems = []
    for name in names:
        room = capacity[name] - others.get(name, 0)
        if need[name] > room:
            wanted, held = distinct_sizes(need[name], capacity[name])
            problems.append(
                f"the {name!r} tier needs {wanted} but holds {held}"
                + (f", {format_bytes(others[name])} of it other values (it evicts nothing: {distinct_sizes(room, 0)[0]} is left)"
                   if name in others else "")
            )
    working = sum(tier.io_threads * tier.chunk_size for tier in tiers if isinstance(tier, DiskTier)) + update_scratch
    model = sum(slot.numel * slot.param.element_size() for slot in slots if offloaded(slot.param) is None)
    model += sum(slot.numel * slot.param.element_size() for slot in slots if slot.param.requires_grad)
    memory = sum(tier.capacity for tier in tiers if isinstance(tier, MemoryTier))
    return MemoryPlan(
        tier_need=need, tier_capacity=capacity, process_bytes=model + memory + resident + working, model_bytes=model,
        working_bytes=working, resident_state_bytes=resident, paged_state_bytes=paged_state,
        chunked_parameters=len(chunked), problems=problems, tier_used_by_others=others,
        # (the state of the largest chunk made: a chunk is a whole number of blocks, so not quite the cap asked for)
        chunk_bytes=max((state_bytes(slot) * max(c.numel for c in slot.chunks) // slot.numel for slot in chunked if slot.chunks), default=chunk_bytes),
    )


def _bottom_need(bottom: Any, above: list[Any], entries: list[int]) -> int:
    """What the bottom tier must hold for values of ``entries`` bytes that page down to it:
    each as it is stored there, and on a disk room for the copies-on-write of as many of them as
    the memory tiers ``above`` it hold: a value written down again keeps its old extent until
    the new one is committed, and every value those tiers hold may be written at once (a step's
    write-backs and evictions; a flush writes them all). Extents are whole 4 KiB blocks, so
    that room is the most the values filling those tiers can take in blocks. A bound, not an
    estimate: smaller disks may work, but may fail mid-step."""
    from ..tiers import DiskTier

    if not isinstance(bottom, DiskTier):
        return sum(entries)
    stored = [bottom.stored_size(n) for n in entries]
    # The most disk the values a capacity of memory holds can take: those whose blocks exceed
    # their bytes the most first, the last one in part (a fractional knapsack: a true bound).
    room, rewritten = sum(tier.capacity for tier in above), 0
    for n, size in sorted(zip(entries, stored, strict=True), key=lambda pair: pair[1] / max(pair[0], 1), reverse=True):
        if room <= 0:
            break
        taken = min(n, room)
        rewritten += size if taken == n else math.ceil(size * taken / n)
        room -= taken
    # (and a block for the store's own small records, its namespaces' index: inline, it takes
    # capacity too)
    return sum(stored) + rewritten + bottom.extent_size(1)


@dataclass
class TimeReport:
    """Where the last step's time went (seconds). ``step_wall`` is the wall time from the end of
    this optimizer's previous step to the end of this one: a whole training iteration (forward,
    backward and step; and whatever else ran between its steps, such as other models trained in
    turn). Transfer times add up each transfer's own duration, so overlapping transfers count
    in full; ``stall`` is what the training loop waited in ``step()`` (and in ``clip_grad_norm_``).

    Disk bytes: ``disk_read_bytes``/``disk_write_bytes`` are what crossed the disk tier's links
    in the step (what the kernel's block-I/O counters see, the disk tier writing with
    ``O_DIRECT``, in whole 4 KiB blocks); ``disk_need_bytes`` is what the step had to move at
    least: twice the paged state (in the disk's blocks) of the parameters it updated that was
    not on the state tier when it began (read once, written back once), plus state created in
    the step beyond the room the state tier had free. ``io_overhead`` is their ratio (1.0: no byte wasted). Gradients, and the state of
    frozen or unused parameters, are not part of the need. The bytes moved are the whole
    store's: whatever else uses the optimizer's store (``offload_parameters``,
    ``offload_activations``, puts of your own) adds to them."""

    step: int = 0
    step_wall: float = 0.0
    stall: float = 0.0
    host_update: float = 0.0
    grads_to_host: float = 0.0
    weights_to_device: float = 0.0
    grads_to_host_bytes: int = 0
    weights_to_device_bytes: int = 0
    #: Updated weights of parameters ``offload_parameters`` keeps in a store, written there
    #: (they cross no link in the step: the next forward brings them to the device).
    weights_to_store: float = 0.0
    weights_to_store_bytes: int = 0
    #: Gradients copied to the host in ``step()`` rather than when their hook fired: changed
    #: after backward (clipped, unscaled, replaced), or never captured (no hook, a skipped pass).
    grad_retakes: int = 0
    grad_retake_bytes: int = 0
    disk_read: float = 0.0
    disk_write: float = 0.0
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    disk_need_bytes: int = 0
    updates: int = 0
    update_elements: int = 0
    mode: str = "after-backward"
    #: The drive the wear figures describe (``for_drive``; rated_tbw None: 600 TBW per TB).
    drive_capacity: int | str = DEFAULT_CAPACITY
    drive_tbw: float | None = None

    def for_drive(self, capacity: int | str = DEFAULT_CAPACITY, rated_tbw: float | None = None) -> TimeReport:
        """This report with its wear figures (``wear()``, the text, ``as_dict``) describing a
        drive of ``capacity`` rated for ``rated_tbw`` terabytes written."""
        drive_wear(0, 0.0, capacity=capacity, rated_tbw=rated_tbw)  # (refuses a bad drive here, not when printed)
        return replace(self, drive_capacity=capacity, drive_tbw=rated_tbw)

    @property
    def io_overhead(self) -> float:
        """Disk bytes moved over the bytes the step needed to move (1.0: none wasted; 0.0 when
        nothing was needed nor moved, ``inf`` when bytes moved that none were needed)."""
        moved = self.disk_read_bytes + self.disk_write_bytes
        if self.disk_need_bytes:
            return moved / self.disk_need_bytes
        return math.inf if moved else 0.0

    @property
    def disk_write_bytes_per_hour(self) -> float:
        """Bytes written to the disk tier per hour of training at this step's rate."""
        return self.disk_write_bytes / self.step_wall * 3600.0 if self.step_wall > 0 else 0.0

    def wear(self, capacity: int | str | None = None, rated_tbw: float | None = None) -> DriveWear:
        """What this step's disk writes, at this step's rate, do to a drive of ``capacity``
        rated for ``rated_tbw`` terabytes written (defaults: the report's drive, ``for_drive``,
        else 2 TB, 600 TBW per TB; see ``tierstore.wear``): bytes per hour, drive writes per
        day, days to the rating."""
        if capacity is None:
            capacity, rated_tbw = self.drive_capacity, self.drive_tbw if rated_tbw is None else rated_tbw
        return drive_wear(self.disk_write_bytes, self.step_wall, capacity=capacity, rated_tbw=rated_tbw)

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self), "io_overhead": self.io_overhead, "disk_write_bytes_per_hour": self.disk_write_bytes_per_hour,
            "wear": self.wear().as_dict(),
        }

    def __str__(self) -> str:
        text = (
            f"step {self.step} ({self.mode}): {self.step_wall * 1e3:.1f} ms wall since the last step, training loop stalled "
            f"{self.stall * 1e3:.1f} ms\n"
            f"  host updates {self.host_update * 1e3:.1f} ms ({self.updates} tensors, "
            f"{_rate(self.update_elements / max(self.host_update, 1e-9))} params/s) | grads to host "
            f"{self.grads_to_host * 1e3:.1f} ms ({format_bytes(self.grads_to_host_bytes)}; {self.grad_retakes} taken again in "
            f"step(), {format_bytes(self.grad_retake_bytes)}) | "
            + (f"weights to device {self.weights_to_device * 1e3:.1f} ms ({format_bytes(self.weights_to_device_bytes)})"
               if self.weights_to_device_bytes or not self.weights_to_device
               # (the plain CPU: parameters in host memory are written in place, crossing no link)
               else f"weights into parameters {self.weights_to_device * 1e3:.1f} ms (in place: no link crossed)")
            + (f" | weights into the store {self.weights_to_store * 1e3:.1f} ms ({format_bytes(self.weights_to_store_bytes)})"
               if self.weights_to_store_bytes else "")
            + "\n"
            f"  disk read {self.disk_read * 1e3:.1f} ms ({format_bytes(self.disk_read_bytes)}) | disk write "
            f"{self.disk_write * 1e3:.1f} ms ({format_bytes(self.disk_write_bytes)})"
        )
        if self.disk_need_bytes or self.disk_read_bytes or self.disk_write_bytes:
            overhead = self.io_overhead
            text += (
                f" | needed {format_bytes(self.disk_need_bytes)}"
                + (f", moved {overhead:.2f}x of it" if math.isfinite(overhead) else "")
                + f"\n  {self.wear()}"
            )
        return text


@dataclass
class Residency:
    """Where the paged state is at one moment (a step's start): each state key's bytes and
    whether it is on the state tier, and the bytes free there."""

    state: dict[str, tuple[int, bool]]
    free: int


async def state_residency(store: TierStore, slots: Sequence[ParamSlot], state_tier: str) -> Residency | None:
    """The ``Residency`` of the paged state of ``slots`` (on the store's loop); None when no
    tier lies below ``state_tier`` (no state can be off it)."""
    from ..tiers import DiskTier, MemoryTier

    names = [tier.name for tier in store.tiers]
    if names.index(state_tier) == len(names) - 1:
        return None
    bottom = store.tiers[-1]
    # (a disk moves whole 4 KiB blocks: an entry's need is what its transfers move, as counted)
    moved = bottom.stored_size if isinstance(bottom, DiskTier) else int
    state: dict[str, tuple[int, bool]] = {}
    for slot in slots:
        if not slot.paged:
            continue
        for key in slot.state_keys:
            if key in store:
                info = store.info(key)
                state[key] = (moved(info["nbytes"]), state_tier in info["tiers"])
    tier = store.tier(state_tier)
    free = tier.free if isinstance(tier, MemoryTier) else 0
    return Residency(state=state, free=max(0, free))


def disk_need(start: Residency, end: Residency, updated: Sequence[ParamSlot]) -> int:
    """Bytes the step between ``start`` and ``end`` had to move to and from the disk for the
    ``updated`` slots (see ``TimeReport``)."""
    need = created = 0
    for slot in updated:
        if not slot.paged:
            continue
        for key in slot.state_keys:
            if key in start.state:
                nbytes, resident = start.state[key]
                need += 0 if resident else 2 * nbytes
            elif key in end.state:
                created += end.state[key][0]
    return need + max(0, created - start.free)


async def memory_report(
    store: TierStore, slots: Sequence[ParamSlot], state_bytes: Callable[[ParamSlot], int], offloaded: Callable[[Any], Any],
    plan: MemoryPlan | None = None, last: TimeReport | None = None, *,
    planned: Callable[[ParamSlot], bool] = _trainable,
) -> MemoryReport:
    """The ``MemoryReport`` of an optimizer's ``slots`` (on the store's loop); ``last``: the
    last step's ``TimeReport``, for its disk writes."""
    by_tier: dict[str, int] = {tier.name: 0 for tier in store.tiers}
    resident = resident_params = paged = 0
    trainable = [slot for slot in slots if planned(slot)]  # (a frozen parameter without state gets none)
    for slot in trainable:
        size = state_bytes(slot)
        if not slot.paged:
            resident += size if slot.resident is not None else 0
            resident_params += 1
            continue
        paged += slot.numel
        parts = [(slot.key, size)] if slot.chunks is None else [(c.key, size * c.numel // slot.numel) for c in slot.chunks]
        for key, nbytes in parts:
            if key in store:
                for tier in store.where(key)[:1]:
                    by_tier[tier] += nbytes
    params = sum(slot.numel for slot in slots)
    frozen = params - sum(slot.numel for slot in trainable)
    # the optimizer these slots are of: its bound _state_bytes (how to store is a group setting)
    owner = getattr(state_bytes, "__self__", None)
    contents: dict[str, int] = {}
    if owner is not None and hasattr(owner, "param_groups"):
        for slot in trainable:
            what = state_contents(owner, slot)
            contents[what] = contents.get(what, 0) + slot.numel
    weights = sum(slot.numel * slot.param.element_size() for slot in slots if offloaded(slot.param) is None)
    grads = sum(slot.numel * slot.param.element_size() for slot in slots if slot.param.requires_grad)
    state = sum(state_bytes(slot) for slot in trainable)
    tiers = {name: {"used": t["used"], "capacity": t["capacity"]} for name, t in store.stats()["tiers"].items()}
    paged_to_disk = last is not None and last.step_wall > 0 and last.disk_write_bytes > 0
    written = last.disk_write_bytes if last is not None and paged_to_disk else None
    return MemoryReport(
        parameters=params, paged_parameters=paged, device_weight_bytes=weights, device_grad_bytes=grads,
        state_by_tier=by_tier, resident_state_bytes=resident, resident_parameters=resident_params,
        state_bytes_per_param=state / max(params - frozen, 1), tiers=tiers, plan=plan,
        disk_write_bytes_per_step=written, wear=last.wear() if last is not None and paged_to_disk else None,
        state_contents=contents, swapped_parameters=sum(1 for slot in slots if offloaded(slot.param) is not None),
        frozen_parameters=frozen,
    )


class Timeline:
    """Spans of one step on named tracks, written as Chrome trace JSON."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, float, float, dict[str, Any]]] = []
        self._origin = time.perf_counter()

    def clear(self) -> None:
        with self._lock:
            self._events = []

    def add(self, name: str, track: str, start: float, end: float, **args: Any) -> None:
        """Record a span (``start``/``end`` from ``time.perf_counter()``)."""
        with self._lock:
            self._events.append((name, track, start, end, args))

    @contextmanager
    def span(self, name: str, track: str = "compute") -> Iterator[None]:
        """``with opt.timeline.span("forward"):`` marks the training loop's own work."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start, time.perf_counter())

    def events(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        with self._lock:
            return list(self._events)

    def write(self, path: str | Path) -> None:
        """Write the spans as a Chrome trace (``{"traceEvents": [...]}``)."""
        events = self.events()
        tracks = sorted({track for _, track, *_ in events}, key=_track_order)
        tid = {track: i for i, track in enumerate(tracks)}
        trace: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[t], "args": {"name": t}} for t in tracks
        ]
        trace += [
            {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid[t], "args": {"sort_index": tid[t]}} for t in tracks
        ]
        for name, track, start, end, args in events:
            trace.append({
                "name": name, "cat": track, "ph": "X", "pid": 1, "tid": tid[track],
                "ts": (start - self._origin) * 1e6, "dur": max(0.0, end - start) * 1e6, "args": args,
            })
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


def count_grad_transfer(report: TimeReport, timeline: Timeline, index: int, transfer: Any) -> None:
    """Count a finished gradient copy to the host (a link ``Transfer``) in the step's report
    and timeline."""
    report.grads_to_host += transfer.seconds
    report.grads_to_host_bytes += transfer.nbytes
    timeline.add(f"grad {index}", "grads to host", transfer.started or 0.0, transfer.ended or 0.0, bytes=transfer.nbytes)


def _track_order(track: str) -> tuple[int, str]:
    order = ["compute", "train loop", "host update"]
    return (order.index(track) if track in order else len(order), track)


class StepWindow:
    """The reports of one step at a time: ``report`` and ``timeline`` fill up from the end of the
    last step to the end of this one (``close``), when they become ``last``/``last_events``."""

    def __init__(self, mode: str) -> None:
        self.timeline = Timeline()
        self.report = TimeReport(mode=mode)
        self.last = TimeReport(mode=mode)
        self.last_events: list[tuple[str, str, float, float, dict[str, Any]]] = []
        self._start = time.perf_counter()
        self._links: dict[str, tuple[int, float]] = {}
        self._measure: Callable[[], Residency | None] | None = None
        self._residency: Residency | None = None
        #: Windows closed so far (``not_counted`` leaves a block alone that a close ran inside).
        self._closes = 0

    def watch(self, measure: Callable[[], Residency | None]) -> None:
        """Count each step's ``disk_need_bytes`` from ``measure()`` (the paged state's
        ``Residency``), taken now and at the end of every step."""
        self._measure = measure
        self._residency = measure()

    @contextmanager
    def not_counted(self, links: Callable[[], dict[str, Any]]) -> Iterator[None]:
        """Leave what crosses the store's links (``links()``: its link counters) inside the
        block out of the step's disk figures, and measure the paged state's residency anew
        after it: a checkpoint's save or load between steps is not the step's work, and a load
        changes where the state lies."""
        before = {name: (s.nbytes, s.seconds) for name, s in links().items()}
        closes = self._closes
        try:
            yield
        finally:
            if self._closes == closes:  # (else a step ended meanwhile, on another thread: it counted the block's bytes)
                for name, stats in links().items():
                    was_bytes, was_seconds = before.get(name, (0, 0.0))
                    base_bytes, base_seconds = self._links.get(name, (0, 0.0))
                    self._links[name] = (base_bytes + stats.nbytes - was_bytes, base_seconds + stats.seconds - was_seconds)
                if self._measure is not None:
                    with suppress(Exception):  # (the store closed meanwhile, say: the block's own error stands)
                        self._residency = self._measure()

    def on_transfer(self, link: str, nbytes: int, start: float, end: float) -> None:
        """A store's transfer between tiers (``TierStore.on_transfer``)."""
        self.timeline.add(f"{nbytes:,} B", link, start, end, bytes=nbytes)

    def close(self, now: float, step: int, links: dict[str, Any], updated: Sequence[ParamSlot] = ()) -> None:
        """End the window: disk figures from the store's link counters ``links``; the need
        from the residency at the window's start and now, for the ``updated`` slots."""
        report = self.report
        if self._measure is not None:
            residency = self._measure()
            if self._residency is not None and residency is not None:
                report.disk_need_bytes = disk_need(self._residency, residency, updated)
            self._residency = residency
        for name, stats in links.items():
            before_bytes, before_seconds = self._links.get(name, (0, 0.0))
            if name.startswith("disk->"):
                report.disk_read += stats.seconds - before_seconds
                report.disk_read_bytes += stats.nbytes - before_bytes
            elif name.endswith("->disk"):
                report.disk_write += stats.seconds - before_seconds
                report.disk_write_bytes += stats.nbytes - before_bytes
        self._links = {name: (s.nbytes, s.seconds) for name, s in links.items()}
        report.step = step
        report.step_wall = now - self._start
        self.last, self.report = report, TimeReport(mode=report.mode)
        self.last_events = self.timeline.events()
        self.timeline.clear()
        self._start = now
        self._closes += 1

    def write(self, path: str | Path) -> None:
        """Write the last step as a Chrome trace."""
        timeline = Timeline()
        timeline._origin = self.timeline._origin
        for name, track, start, end, args in self.last_events:
            timeline.add(name, track, start, end, **args)
        timeline.write(Path(path))


def _rate(per_second: float) -> str:
    """``per_second`` with the prefix that keeps it readable: "1.62 G", "588 M", "43.1 k"."""
    for scale, prefix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if per_second >= scale * 0.9995:  # (999.7k is "1 M", not "1e+03 k")
            value = per_second / scale
            return (f"{value:.3g}" if value < 999.5 else f"{value:.0f}") + prefix
    return f"{per_second:.3g}"
