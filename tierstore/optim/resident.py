"""The resident step: one update of every parameter at once when all the state is in host
memory already and nothing crosses a link.

The pipeline (``tierstore.optim.pipeline``) is built to overlap transfers with math: buckets,
chunks run by run, a thread hop and a few tasks each. With every state entry resident on the
state tier and the gradients lent (plain CPU), there is nothing to overlap, and that machinery
is pure cost beside the update itself. Here instead the loop checks every entry at once (in
the store, on the state tier, held by no one), takes a write hold on each through the store
(``TierStore.hold``: its accounting, dirty tracking and read/write promises stay as they are),
and hands the whole update to the training thread in one call, which runs torch's Adam over all
of it (one fused kernel call per parameter group, grouped by device and dtype as torch groups
them). The numbers are the pipeline's: Adam is elementwise, so one call over every tensor (or
every chunk) gives the same bits as one call per bucket.

A step whose state is partly paged below (the disk-paged step) is mixed: the first slots in
update order whose entries are resident when it starts (those the step writes back early, up to
a bucket's share of the room: ``StepRunner``; none if the first one's state is more than that,
as a chunked parameter's can be the whole tier) are updated here in one call, in one of the
pipeline's places in flight as its first bucket would be, while the others go through the
pipeline as their reads land. Holding more of the resident entries at once was tried: the
reads of the others then evict resident states not held yet, which are read back later in the
step (I/O over the need). A pipeline bucket whose states are all resident when its turn comes
is updated here too (``UpdatePipeline._update_resident``): the same holds, taken in the bucket's
order and over the same time, but one hold and one math call for the bucket instead of a hold,
a gradient and a weight per parameter (the demo's disk-paged step: 41 of its 53 parameters
went through buckets one by one, ~8% of ``step()``'s time).

Anything else (state to create or paged below, a hold taken by someone else, a device link,
GradScaler's scale, updates in backward, an earlier attempt's progress) takes the pipeline,
whose step is the same update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..gcpause import gc_paused
from ..store import TierStore
from .reports import Timeline, TimeReport
from .slots import ParamSlot


@dataclass(frozen=True)
class Held:
    """Write holds on the state entries of ``slots`` (``ResidentStep.hold``), released by
    ``ResidentStep.update``."""

    slots: list[ParamSlot]
    pieces: list[list[Piece]]
    states: list[list[torch.Tensor]]
    stack: AsyncExitStack


@dataclass(frozen=True)
class Piece:
    """One part of a parameter's state updated by the resident step: elements ``start:stop``
    of the flat parameter, whose state is the store entry ``key`` (of ``shape`` and ``dtype``),
    or the slot's own in-memory state (``key`` None: a parameter too small to page)."""

    key: str | None
    start: int
    stop: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class ResidentUpdater(Protocol):
    """What the resident step asks of the optimizer (``TieredAdam``)."""

    def _resident_pieces(self, slot: ParamSlot) -> list[Piece] | None: ...
    def _update_resident(
        self, slots: list[ParamSlot], pieces: list[list[Piece]], states: list[list[torch.Tensor]], grads: list[torch.Tensor]
    ) -> None: ...


class ResidentStep:
    """The resident step of ``owner`` over ``store``'s ``tier`` (see the module docstring).
    ``math`` runs a function on the training thread (``UpdatePipeline.math``)."""

    def __init__(
        self, store: TierStore, tier: str, owner: ResidentUpdater, math: Callable[[Callable[[], Any]], Any], *,
        report: Callable[[], TimeReport], timeline: Timeline,
    ) -> None:
        self._store = store
        self._tier = tier
        self._owner = owner
        self._math = math
        self._report = report
        self._timeline = timeline
        #: Steps the resident step ran whole (the others took the pipeline, or were mixed).
        self.steps = 0
        #: Mixed steps: their resident part updated here, the rest by the pipeline.
        self.mixed_steps = 0

    def pieces(self, slots: Sequence[ParamSlot]) -> list[list[Piece]] | None:
        """Each slot's pieces, if the resident step can update all of them now (``slot_pieces``
        gives them for every slot); else None."""
        result: list[list[Piece]] = []
        for slot in slots:
            pieces = self.slot_pieces(slot)
            if pieces is None:
                return None
            result.append(pieces)
        return result

    def slot_pieces(self, slot: ParamSlot) -> list[Piece] | None:
        """The pieces of ``slot``, if the resident step can update it now: its gradient lent, no
        progress of an earlier attempt, every entry on the state tier with its layout, held by
        no one; else None."""
        capture = slot.capture
        if capture is None or capture.lent is None or slot.updated or slot.written or slot.chunks_updated:
            return None
        pieces = self._owner._resident_pieces(slot)
        if pieces is None:
            return None
        store, tier = self._store, self._tier
        for piece in pieces:
            if piece.key is None:
                continue
            if store._holdable(piece.key, tier) != (piece.shape, piece.dtype):
                return None
        return pieces

    def split(self, slots: Sequence[ParamSlot]) -> tuple[list[ParamSlot], list[list[Piece]]]:
        """The slots of ``slots`` (in their order) the resident step can update now, with their
        pieces."""
        eligible = [(slot, parts) for slot in slots if (parts := self.slot_pieces(slot)) is not None]
        return [slot for slot, _ in eligible], [parts for _, parts in eligible]

    async def hold(self, slots: list[ParamSlot], pieces: list[list[Piece]]) -> Held | None:
        """Take a write hold on every state entry of ``slots`` (their ``pieces``, from
        ``pieces`` or ``split``) for ``update``; None, holding nothing, if one cannot be taken
        (a delete or a close meanwhile: the pipeline decides). In the order of ``slots``, the
        step's: the store's policies learn the step's order from its holds, and a learned
        schedule that saw them sorted by key mispredicted the next step's, its evictions reading
        states back (1.5-2x the I/O needed with a thousand small states, three quarters on the
        host). No two tasks hold the same state in a step, so no order is needed for deadlock."""
        stack = AsyncExitStack()
        states: list[list[Any]] = [[None] * len(parts) for parts in pieces]  # per slot: each piece's entry
        keyed: list[tuple[str, int, int]] = []
        for i, (slot, parts) in enumerate(zip(slots, pieces, strict=True)):
            for j, piece in enumerate(parts):
                if piece.key is None:
                    assert slot.resident is not None
                    states[i][j] = slot.resident["packed"]
                else:
                    keyed.append((piece.key, i, j))
        try:
            # (one hold of them all: a context manager each cost more than this step's math on small tensors)
            entries = await stack.enter_async_context(self._store._hold_all([key for key, _, _ in keyed], self._tier, write=True))
            for entry, (_, i, j) in zip(entries, keyed, strict=True):
                states[i][j] = entry
        except Exception:  # noqa: BLE001 - taken meanwhile (a delete, a close): the pipeline decides
            # (the holds taken are released as writes, a new version each: harmless, the
            # pipeline updates those same entries in this step, which versions them anyway)
            await stack.aclose()
            return None
        except BaseException:
            await stack.aclose()
            raise
        return Held(slots, pieces, states, stack)

    async def update(
        self, held: Held, coef: torch.Tensor | None, *, whole: bool = True, bucket: bool = False
    ) -> list[tuple[list[ParamSlot], BaseException]]:
        """Update the slots of ``held`` on the training thread (one call per parameter group,
        in one hop), then release their holds; return the failures: the slots of the group
        whose call failed and of those after it (the groups before it count as updated, so
        ``step()`` again does not update them twice). ``whole``: they are all the step updates
        (else the pipeline updates the others: a mixed step)."""
        slots = held.slots
        done: list[ParamSlot] = []  # (appended on the training thread, read here once it returned)
        failure: Exception | None = None
        started = computed = 0.0
        async with held.stack:
            grads = [slot.capture.lent for slot in slots]  # type: ignore[union-attr]
            try:
                started, computed = await self._math(lambda: self._compute(slots, held.pieces, held.states, grads, coef, done))
            except Exception as exc:  # noqa: BLE001 - the step reports it for the slots not updated
                failure = exc
            for slot in done:
                slot.updated = slot.written = True
                slot.note_written()
        if failure is not None:
            finished = set(done)
            return [([slot for slot in slots if slot not in finished], failure)]
        report = self._report()
        elements = sum(slot.numel for slot in slots)
        report.host_update += computed - started
        report.updates += len(slots)
        report.update_elements += elements
        name = "resident update" if whole else "resident bucket" if bucket else "resident part"
        self._timeline.add(f"{name} x{len(slots)}", "host update", started, computed, elements=elements)
        if whole:
            self.steps += 1
        elif not bucket:
            self.mixed_steps += 1
        return []

    def _compute(
        self, slots: list[ParamSlot], pieces: list[list[Piece]], states: list[list[torch.Tensor]], grads: list[Any],
        coef: torch.Tensor | None, done: list[ParamSlot],
    ) -> tuple[float, float]:
        started = time.perf_counter()
        # (the views and lists made per tensor die with the call: without a pause they start
        # collections, each a walk of every object the process tracks, torch's included)
        with gc_paused():
            if coef is not None:  # as the pipeline clips (and as clip_grad_norm_ multiplies)
                grads = [grad.mul(coef.to(grad.device)) for grad in grads]
            by_group: dict[int, list[int]] = {}
            for i, slot in enumerate(slots):
                by_group.setdefault(slot.group, []).append(i)
            for indices in by_group.values():  # (torch's Adam runs one call per group too)
                group = [slots[i] for i in indices]
                self._owner._update_resident(group, [pieces[i] for i in indices], [states[i] for i in indices], [grads[i] for i in indices])
                done.extend(group)
        return started, time.perf_counter()
