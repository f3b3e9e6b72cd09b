"""The update pipeline: parameters updated in buckets, each holding its states and gradients on
the state tier, running the math in one call off the loop, and sending the new weights back to
the device before the holds are released.

A parameter whose state is paged in chunks (``tierstore.optim.chunks``) is updated chunk by
chunk instead: each chunk holds its state, its slice of the gradient and writes its slice of the
weight, taking one of the ``inflight`` places as a bucket does, so the state tier holds a few
chunks at a time, and the chunks after them are prefetched meanwhile.

A bucket is several parameters updated together (one fused call, one thread hop), as many as
``bucket_bytes`` of state and gradients hold, in the order the gradients arrived. ``inflight``
buckets run at once, so one's transfers overlap the other's math.

Where state pages to a disk below the state tier, the states updated first in a step are those
evicted to make room for the states read later in it (the order alternates each step, so they
are needed last in the next one). They are written back as their updates end, as many bytes as
the step's reads still need beyond the free room (``TierStore.write_back``, keeping the copy;
counted at the step's start and lowered as reads arrive: one that found its room by evicting on
demand needs no early write any more): the eviction that makes room
for a read then drops a clean copy, and the read is not queued behind a write on the critical
path. Where the eviction policy can say what it will evict (its optional ``ranked``: ``MIN``,
the optimizer's default), the states written are those among its next victims, as many bytes of
victims as the step still needs (up to three quarters of the room ahead), that this step has
updated (a victim not updated yet is left to its eviction: written now, it would be written
again); otherwise those just updated. The order does not always tell: a step that runs one
way every time a parameter is updated (one updated every other step), or that updates its
resident states first, kept some of those it wrote back and wrote them again the next step (a
tryout: 1.1-1.3x the I/O needed); where more than a third of those judged lately were written
for nothing, they stop, only picked, until fewer are (``tierstore.optim.early_writes``; the
picks are then in ``_written_early`` unwritten). Each slot records how far its update got
(state updated, weight written): a step that failed part-way is completed by running the
pipeline again, and no update is applied twice.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from functools import partial
from typing import Any, Protocol

import torch

from ..device import Transfer
from ..errors import TierFullError
from ..store import TierStore
from ..tensors import PLAIN_TENSOR_TYPES
from ..tiers import MemoryTier
from ..tiers.base import RoomTally
from ..units import format_bytes
from ..workers import CallerPool, Priority, WorkerPool
from .chunks import Chunk, plan_chunks
from .clipping import inverse_scale
from .distributed import LocalShard
from .early_writes import EarlyWriteJudge
from .reports import Timeline, TimeReport, count_grad_transfer
from .resident import ResidentStep
from .slots import Capture, ParamSlot

#: How many of the eviction policy's next victims an early write-back looks through (beyond
#: them, with many small states, the evictions write the rest).
RANKED_VICTIMS = 512


class OptimizerCapacityError(TierFullError):
    """The host tier cannot hold one parameter's state and gradient at once."""


class Updater(Protocol):
    """What the pipeline asks of the optimizer (``PagedOptimizer`` and its subclasses)."""

    def _state(self, slot: ParamSlot) -> AbstractAsyncContextManager[Any]: ...
    def _state_bytes(self, slot: ParamSlot) -> int: ...
    def _apply_many(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> list[torch.Tensor]: ...
    def _master(self, slot: ParamSlot, state: Any) -> torch.Tensor: ...
    def _chunk_state(self, slot: ParamSlot, chunk: Chunk) -> AbstractAsyncContextManager[Any]: ...
    def _begin_chunks(self, slot: ParamSlot) -> None: ...
    def _apply_chunk(self, slot: ParamSlot, chunk: Chunk, state: Any, grad: torch.Tensor, grad_scale: torch.Tensor | None) -> torch.Tensor: ...
    def _end_chunks(self, slot: ParamSlot) -> None: ...
    def _chunkable(self, slot: ParamSlot) -> bool: ...


class UpdatePipeline:
    """Buckets of updates on ``store``'s ``state_tier`` for ``owner`` (see the module docstring)."""

    def __init__(
        self, store: TierStore, state_tier: str, owner: Updater, *, report: Callable[[], TimeReport], timeline: Timeline,
        serial_update: bool = False,
    ) -> None:
        self._store = store
        self._tier = state_tier
        self._owner = owner
        self._report = report
        self._timeline = timeline
        # Math runs on the training thread while it waits in step(); during backward (norms,
        # updates in backward) on a worker thread, with torch's intra-op threads (on a GPU host
        # the update is the CPU's main work) unless ``serial_update`` (the model computes on
        # these cores too: a second OpenMP team would slow its backward, ``tierstore.intra_op``).
        # ``in_step`` is the loop's to set.
        self._compute = WorkerPool(1, "optimizer", serial_ops=serial_update)
        self._compute.start()
        self._caller = CallerPool()
        self.in_step = False
        #: This step's GradScaler scale, when the gradients are still scaled (buckets launched
        #: from now on unscale their host copies). The loop's to set.
        self.scale: torch.Tensor | None = None
        #: This step updates a chunked parameter's chunks last to first (the step's update order
        #: is reversed: ``StepRunner.reverse_for``). The loop's to set.
        self.reverse = False
        self.bucket_bytes = 64 << 20
        self.inflight = 1
        #: State bytes per chunk of the parameters paged in chunks (0: none is).
        self.chunk_bytes = 0
        #: The ``inflight`` places buckets and runs take (``inflight`` read at each take: a re-plan
        #: during a step may lower it).
        self._gate = Places(lambda: self.inflight)
        self._open: list[ParamSlot] = []
        self._open_bytes = 0
        #: Of ``_open_bytes``, what must come up to the state tier (not there when added).
        self._open_incoming = 0
        #: The room the open bucket's values take together (None: none yet, or no memory tier).
        self._open_room: RoomTally | None = None
        self._after: Any = None
        self._running: list[tuple[list[ParamSlot], asyncio.Task[None]]] = []
        #: The runs of chunks started (``_start_runs``), waited for by ``finish`` too: the task
        #: waiting for a parameter's runs, cancelled before it started, never saw them.
        self._runs: list[asyncio.Future[None]] = []
        self._prefetched = False
        #: Nothing pages below the state tier: holds never wait for a transfer (but creation).
        self._flat = False
        #: The state tier is a memory tier right above the disk tier (early write-backs apply).
        self._writes_early = False
        #: State-tier bytes the updates in flight may hold at once (from ``plan``).
        self._room = 0
        self._slots: list[ParamSlot] = []
        self._in_backward = False
        #: ``plan``'s arguments but the slots (``plan_added`` plans again with them).
        self._plan_args: tuple[int, int, bool, int] = (0, 1, False, 0)
        #: Bytes of state still to write back early this step (None: not counted yet this step).
        self._early_bytes: int | None = None
        #: State keys this step has updated (their early write-back is not undone by an update),
        #: and those it has started writing back early (counted off ``_early_bytes``).
        self._updated_keys: set[str] = set()
        self._written_early: set[str] = set()
        #: The states the step reads, missing from the state tier when counted, in update order,
        #: with their sizes there (dropped as they arrive or are updated: ``_reads_left``).
        self._to_read: dict[str, int] = {}
        #: Whether the early write-backs pay (else they are only picked: ``_write_back_early``).
        self._early_judge = EarlyWriteJudge()
        #: The optimizer's resident step: a bucket whose states are all resident takes it
        #: (``_update_resident``). Set by the optimizer.
        self.resident: ResidentStep | None = None

    @property
    def pages_below(self) -> bool:
        """Whether state can page below the state tier (as ``plan`` found the store)."""
        return not self._flat

    # -- planning ---------------------------------------------------------------------------------

    def plan_added(self, added: Sequence[ParamSlot]) -> None:
        """Plan again with ``added`` (an ``add_param_group`` after construction): those are
        chunked as the others were, and the buckets sized for all. The slots planned before
        keep their chunks (their state lives in them). Raises ``OptimizerCapacityError`` as
        ``plan`` does, with the plan as it was."""
        before = self._slots
        try:
            self.plan([*before, *added], *self._plan_args, only=added)
        except BaseException:
            for slot in added:
                slot.chunks = None
            self.plan(before, *self._plan_args, only=())
            raise

    def replan(self, without: Sequence[ParamSlot] = ()) -> None:
        """Size the buckets again (the state of a slot changed layout; slots were refused): for
        the slots planned less ``without``, none chunked again. ``OptimizerCapacityError`` as
        ``plan``."""
        self.plan([slot for slot in self._slots if all(slot is not other for other in without)], *self._plan_args, only=())

    def plan(
        self, slots: Sequence[ParamSlot], bucket_bytes: int, max_inflight: int, in_backward: bool, chunk_bytes: int = 0,
        only: Sequence[ParamSlot] | None = None,
    ) -> None:
        """Choose chunks, bucket size and buckets at once. Two buckets at once overlap one's
        transfers with the other's math; the state tier must hold them both, plus room for one
        more gradient. A parameter whose state and gradient exceed ``chunk_bytes`` (or what the
        tier holds for ``2 * max_inflight + 2`` chunks: those updating and those prefetched) is
        paged in chunks (``only``: those of ``slots`` alone, in chunks of the size chosen
        before). Raise ``OptimizerCapacityError`` if the tier cannot hold one update."""
        self._plan_args = (bucket_bytes, max_inflight, in_backward, chunk_bytes)
        tier = self._store.tier(self._tier)
        tiers = self._store.tiers
        self._flat = tiers.index(tier) == len(tiers) - 1
        # Early write-backs go from the memory tier right above the disk tier only (``write_back``
        # refuses any other: a device tier above the host, a store with no disk).
        self._writes_early = not self._flat and tiers[tiers.index(tier) + 1].kind == "disk"
        self._slots, self._in_backward = list(slots), in_backward
        if not isinstance(tier, MemoryTier) or not slots:
            self.bucket_bytes, self.inflight = bucket_bytes or (64 << 20), max_inflight
            return
        # A weight offloaded to this tier's store is held whole here while its chunks update
        # (no ranged reads): the chunks and updates in flight share what is left beside it.
        held = max((slot.numel * slot.param.element_size() for slot in slots if slot.paged
                    and (o := offloaded(slot.param)) is not None and o[0].store is self._store and o[0].range_tier() == self._tier), default=0)
        usable = tier.capacity * 9 // 10 - held
        if chunk_bytes > 0:
            if only is None:
                self.chunk_bytes = min(chunk_bytes, max(64 << 10, usable // (2 * max_inflight + 2)))
            for slot in slots if only is None else only:
                if slot.paged and slot.numel and self._owner._chunkable(slot):
                    per_element = self._owner._state_bytes(slot) / slot.numel + self._grad_bytes(slot, None) / slot.numel
                    slot.chunks = plan_chunks(slot.key, slot.numel, per_element, self.chunk_bytes)
        needs = [self.need(slot) for slot in slots]
        grads = [self._grad_bytes(slot, tier) for slot in slots if slot.chunks is None] or [0]
        largest = max(needs)
        room = usable - max(grads)  # a tenth left for arrivals and state being created
        self._room = max(room, 0)
        if largest > room:
            worst = slots[needs.index(largest)]
            what = (f"one chunk of the state and gradient of parameter {worst.index} ({worst.numel:,} elements in {len(worst.chunks)} "
                    f"chunks; the largest takes {largest:,} bytes)" if worst.chunks is not None else
                    f"the state and gradient of parameter {worst.index} ({worst.numel:,} elements: {largest:,} bytes)")
            raise OptimizerCapacityError(
                f"the {self._tier!r} tier ({tier.capacity:,} bytes) cannot hold {what} beside another gradient"
                + (f" and an offloaded weight held whole ({held:,} bytes)" if held else "")
                + f"; give it more capacity (at least {-(-(largest + max(grads) + held) * 10 // 9):,} bytes for this parameter,"
                + " where the rest of the state pages to a disk tier below)"
                + _chunk_advice(worst, self._owner._chunkable(worst), chunk_bytes, self.chunk_bytes)
            )
        if self._flat and all(slot.link.lends for slot in slots):
            # Nothing pages below the state tier and nothing crosses a link: no transfers to
            # overlap, and a second bucket's bookkeeping would only slow the math. One bucket
            # (four when updating in backward, so updates start while backward runs). Across a
            # link, buckets pipeline: one's new weights travel while the next one's math runs.
            whole = sum(needs) // (4 if in_backward else 1)
            self.bucket_bytes, self.inflight = max(bucket_bytes or whole, largest), 1
            return
        inflight = max(1, min(max_inflight, room // max(largest, 1)))  # (0: every parameter too small to page)
        # At least four buckets a step, so in-backward updates start early and transfers overlap;
        # and buckets in flight take at most a quarter of the tier, whose rest caches state.
        # A bucket larger than the tier holds for ``inflight`` of them would fail every step
        # with the tier full: a user's size is capped there.
        bucket = min(bucket_bytes, room // inflight) if bucket_bytes else min(64 << 20, room // (4 * inflight), sum(needs) // 4)
        self.bucket_bytes, self.inflight = max(bucket, largest), inflight

    def _grad_bytes(self, slot: ParamSlot, tier: MemoryTier | None, numel: int | None = None) -> int:
        nbytes = (slot.numel if numel is None else numel) * slot.param.element_size()
        return 0 if slot.link.lends else tier.value_size(nbytes) if tier is not None else nbytes

    def _held_values(self, slot: ParamSlot, chunk: Chunk | None = None) -> list[int]:
        """The sizes of the values an update of ``slot`` (of its ``chunk``) holds on the state
        tier: its state if paged and, unless the link lends it, its gradient."""
        numel = slot.numel if chunk is None else chunk.numel
        held = [] if slot.link.lends else [numel * slot.param.element_size()]
        if not slot.paged:
            return held
        state = self._owner._state_bytes(slot)
        return [*held, state if chunk is None else state * chunk.numel // max(slot.numel, 1)]

    def need(self, slot: ParamSlot) -> int:
        """Bytes an update of ``slot`` (of its largest chunk, if chunked) holds on the state
        tier: state and, unless the link lends it, its gradient (``MemoryTier.room_for``: small
        values take slabs)."""
        tier = self._store.tier(self._tier)
        if not isinstance(tier, MemoryTier):
            return 0
        if slot.chunks is not None:
            return max(self.chunk_need(slot, chunk) for chunk in slot.chunks)
        return tier.room_for(self._held_values(slot))

    def chunk_need(self, slot: ParamSlot, chunk: Chunk) -> int:
        """Bytes the update of one chunk holds on the state tier."""
        tier = self._store.tier(self._tier)
        if not isinstance(tier, MemoryTier):
            return 0
        return tier.room_for(self._held_values(slot, chunk))

    # -- math off the loop ---------------------------------------------------------------------------

    @property
    def math_threads(self) -> int:
        """The threads that run the updates' math (``math``): the training thread and the
        worker's."""
        return 1 + self._compute.threads

    async def math(self, fn: Callable[[], Any]) -> Any:
        """Run torch math off the loop: on the training thread when it waits in step()."""
        if self.in_step:
            return await self._caller.run(fn)
        return await self._compute.run(fn, Priority.DEMAND)

    def drain_until(self, done: Any, interrupt: Callable[[], object] | None = None) -> None:
        """The training thread, waiting for ``done``: run math handed to it meanwhile (Ctrl-C:
        ``CallerPool.drain_until``)."""
        self._caller.drain_until(done, interrupt)

    def interrupted(self) -> None:
        """Ctrl-C while ``drain_until`` runs (from a signal handler)."""
        self._caller.interrupt()

    def take_interrupts(self) -> bool:
        """After ``drain_until``: whether Ctrl-C came after the step's last job
        (``CallerPool.take_interrupts``)."""
        return self._caller.take_interrupts()

    # -- buckets ----------------------------------------------------------------------------------

    @property
    def prefetch_issued(self) -> bool:
        """Whether this step's ``prefetch_first`` ran."""
        return self._prefetched

    async def prefetch_first(self, order: list[ParamSlot], reverse: bool = False) -> None:
        """Once a step, when its first gradient arrives: bring up the states the first updates
        will need (``order``: the coming step's; ``reverse``: its chunks go last to first), up
        to half the state tier, behind every demand request. Later states come with the store's
        prefetch policy, following the holds."""
        if self._prefetched:
            return
        self._prefetched = True
        self._count_early_writes()
        budget = self._store.tier(self._tier).capacity // 2
        keys = []
        for slot in order:
            if not slot.paged:
                continue
            keys_of = self.state_keys(slot)
            for key, nbytes in reversed(keys_of) if reverse else keys_of:
                budget -= nbytes
                if budget < 0:
                    break
                if key in self._store:
                    keys.append(key)
            if budget < 0:
                break
        if keys:
            await self._store.prefetch(keys, self._tier)

    def _count_early_writes(self, updated: list[ParamSlot] | None = None) -> None:
        """Once a step, before its first update: the bytes of state to write back early, which
        is what the step's reads need beyond the room free on the state tier (none when updating
        in backward: the order does not alternate, so the states updated first are not the
        ones evicted), from the states of ``updated``, or where not known yet, of the trainable
        parameters: a frozen one's state is neither read nor made (counted, the step wrote back
        state that fitted, every step). (Not "has a gradient": this runs as the first gradient
        arrives, while backward makes the others; ``recount_early_writes`` counts again.)"""
        if self._early_bytes is not None:
            return
        self._early_bytes = 0
        tier = self._store.tier(self._tier)
        if not self._writes_early or self._in_backward or not isinstance(tier, MemoryTier):
            return
        slots = updated if updated is not None else [slot for slot in self._slots if slot.param.requires_grad]
        self._early_bytes = self._early_need(tier, slots)

    def recount_early_writes(self, updated: list[ParamSlot]) -> None:
        """``step()``, once it knows the parameters it updates (``updated``), before any update:
        count the bytes to write back early again from their states alone. Counted at the first
        gradient, while backward made the others, every trainable parameter's state counted:
        a step that updated a few small parameters while a large one had no gradient counted the
        large one's reads too, and wrote back states it then kept (the early write-backs of an
        embedding's every other step, beside a small MLP: 1.5-2x the I/O needed)."""
        if not self._updated_keys and self._writes_early:  # (once a step, before its updates)
            self._early_judge.judge((key for slot in updated if slot.paged for key, _ in self.state_keys(slot)),
                                    lambda key: self._store._copy_on_tier(key, self._tier))
        if self._early_bytes is None:  # (no gradient arrived through a hook: ``p.grad`` set directly)
            self._count_early_writes(updated)
            return
        if self._early_bytes <= 0 or self._updated_keys:
            return  # (none to write, or the updates have begun: the count stands)
        tier = self._store.tier(self._tier)
        assert isinstance(tier, MemoryTier)
        self._early_bytes = self._early_need(tier, updated)

    def _early_need(self, tier: MemoryTier, slots: list[ParamSlot]) -> int:
        """What reading the states of ``slots`` not on ``tier`` needs beyond its free room."""
        self._to_read = {key: tier.value_size(nbytes) for slot in slots if slot.paged
                         for key, nbytes in self.state_keys(slot) if not self._on_tier(key)}
        return max(0, sum(self._to_read.values()) - tier.free)

    def _reads_left(self, enough: int) -> int:
        """The bytes of the step's reads not done yet (``_to_read``'s states neither on the state
        tier nor updated), counted up to ``enough``. A state read and evicted again before its
        update is no longer counted (its room was found once: counting low costs time, never
        bytes)."""
        left, done = 0, []
        for key, size in self._to_read.items():
            if left >= enough:
                break
            if key in self._updated_keys or self._on_tier(key):
                done.append(key)
            else:
                left += size
        for key in done:
            del self._to_read[key]
        return left

    def _write_early(self, keys: list[tuple[str, int]]) -> None:
        """The states just updated (``keys``, in update order) may now be written back early:
        write back the eviction policy's next victims among the states updated so far, or where
        it cannot tell, ``keys``, while the step's early write-backs last (see the module
        docstring), counting off only the writes that started (a key already on the disk, or
        held, is skipped by the store)."""
        self._updated_keys.update(key for key, _ in keys)  # (also while none are left to write: picks give some back)
        if not self._early_bytes or self._early_bytes <= 0 or not self._store.is_open:
            return
        tier = self._store.tier(self._tier)
        assert isinstance(tier, MemoryTier)  # (early write-backs are counted on memory tiers only)
        # The room the step's reads still need: less than counted where a read found it by
        # evicting on demand (a prefetch late under load), and early writes beyond it were
        # wasted, kept states written (an embedding resumed, 1.27x its need in a CI run). The
        # cost: where each step updates a random part of the parameters, states written early
        # for the next step's reads (a guess: 1.11x the need) are now written by the evictions
        # of those reads, on their path (the same bytes once; slower on a slow disk).
        free = tier.free
        self._early_bytes = min(self._early_bytes, max(0, self._reads_left(self._early_bytes + free) - free))
        if self._early_bytes <= 0:
            return
        ranked = self._store._ranked_victims(self._tier, RANKED_VICTIMS)
        if ranked is not None:
            self._write_victims(ranked)
            return
        for key, nbytes in keys:
            if self._early_bytes <= 0:
                break
            if self._write_back_early(key):
                self._written_early.add(key)
                self._early_bytes -= tier.value_size(nbytes)

    def _write_victims(self, ranked: list[str]) -> None:
        """Write back early those of the policy's next victims (``ranked``, first first) this
        step has updated, going down them as far as the bytes still to write back reach, and
        no further than three quarters of the room (a victim not updated yet counts: its room
        comes from its own eviction). The states the step reads and updates later rank among
        the victims only then: going down the whole step's bytes at its start wrote back states
        the policy then kept (an embedding updated every other step beside an MLP: 1.4x the I/O
        needed in the steps without it). Half the room was too little lead in a 16-layer MLP
        with a third of its state on the host (a fifth of its evictions found no write begun).
        A victim straddling the bytes still to write is written (a whole copy must go for that
        room); one straddling the room's limit is not (the room may come before it)."""
        early, lead = self._early_bytes or 0, self._room * 3 // 4
        passed = 0  # (victims' bytes gone down so far)
        for key in ranked:
            if passed >= early or (self._early_bytes or 0) <= 0:
                break
            if key in self._written_early:
                continue  # (counted off when its write started)
            size = self._store._bytes_on_tier(key, self._tier)
            passed += size
            if passed > lead:
                break
            if size and key in self._updated_keys and self._write_back_early(key):
                self._written_early.add(key)
                self._early_bytes = (self._early_bytes or 0) - size

    def _write_back_early(self, key: str) -> bool:
        """Write ``key``'s state back early (``TierStore.write_back``, keeping its copy), or,
        while early write-backs do not pay, only pick it (``tierstore.optim.early_writes``);
        whether it counts as written."""
        if self._early_judge.paying and not self._store.write_back([key], self._tier):
            return False
        self._early_judge.picked(key, self._store._copy_on_tier(key, self._tier))
        return True

    def _pick_early(self, keys: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of ``keys`` (in update order), those the step writes back early, counted off now
        (``write_back`` counts back those whose write does not start), with their sizes on the
        state tier."""
        if not self._early_bytes or self._early_bytes <= 0:
            return []
        tier = self._store.tier(self._tier)
        assert isinstance(tier, MemoryTier)  # (early write-backs are counted on memory tiers only)
        picked = []
        for key, nbytes in keys:
            if self._early_bytes <= 0:
                break
            size = tier.value_size(nbytes)
            picked.append((key, size))
            self._early_bytes -= size
        return picked

    def write_back(self, picked: list[tuple[str, int]]) -> None:
        """The keys ``early_writes`` picked (counted off then) are updated: counted back, they
        are written back early as any keys just updated (``_write_early``: where the eviction
        policy can say what it will evict, its next victims instead)."""
        if not picked or not self._store.is_open or self._early_bytes is None:
            return
        self._early_bytes += sum(size for _, size in picked)
        self._write_early(picked)

    # -- updates outside the buckets (``tierstore.optim.resident``) -----------------------------------


    def share(self) -> int | None:
        """State-tier bytes one update in flight (a bucket, or an update outside the buckets
        taking one of the places) may hold: its share of the room (None: no bound, nothing
        pages below)."""
        return None if self._flat else max(self.bucket_bytes, self._room // max(self.inflight, 1))

    def state_held(self, slot: ParamSlot, tally: RoomTally | None = None) -> tuple[int, int]:
        """State-tier bytes of all of ``slot``'s state (every chunk of it) held at once: the
        room it takes beside what ``tally`` counts (then added to it; None: alone), and its
        values' bytes."""
        tier = self._store.tier(self._tier)
        if not slot.paged or not isinstance(tier, MemoryTier):
            return 0, 0
        sizes = [nbytes for _, nbytes in self.state_keys(slot)]
        tally = tally if tally is not None else RoomTally(tier)
        room = tally.cost(*sizes)
        for nbytes in sizes:
            tally.add(nbytes)
        return room, sum(tier.value_size(nbytes) for nbytes in sizes)

    def held_tally(self) -> RoomTally | None:
        """A ``RoomTally`` of the state tier (None: not a memory tier)."""
        tier = self._store.tier(self._tier)
        return RoomTally(tier) if isinstance(tier, MemoryTier) else None

    def early_pending(self) -> int:
        """State-tier bytes this step still writes back early (counted once a step)."""
        self._count_early_writes()
        return max(self._early_bytes or 0, 0)

    def early_writes(self, slots: list[ParamSlot]) -> list[tuple[str, int]]:
        """The state keys of ``slots`` (updated outside the buckets, in update order) that the
        step writes back early once their update ends, counted off now so the buckets after
        them are planned without them."""
        self._count_early_writes()
        if not self._early_bytes or self._early_bytes <= 0:
            return []  # (nothing to write early: the keys are not listed, a call per slot on the loop)
        return self._pick_early([key for slot in slots if slot.paged for key in self.state_keys(slot)])

    @asynccontextmanager
    async def place(self) -> AsyncIterator[None]:
        """One of the ``inflight`` places, as a bucket takes one."""
        async with self._gate:
            yield

    def state_keys(self, slot: ParamSlot) -> list[tuple[str, int]]:
        """The store keys of a slot's state with their bytes, in update order."""
        if slot.chunks is None:
            return [(slot.key, self._owner._state_bytes(slot))]
        per = self._owner._state_bytes(slot) / max(slot.numel, 1)
        return [(chunk.key, int(chunk.numel * per)) for chunk in slot.chunks]

    def resident_lead(self, order: list[ParamSlot]) -> int:
        """Bytes of paged state on the state tier in the first half of ``order`` (its slots'
        state keys in update order, halved by bytes) less those in its second half: positive
        when updating in ``order`` starts with what the tier holds, negative when updating it
        reversed does, 0 when the halves tell nothing (or nothing pages below the tier)."""
        if self._flat:
            return 0
        keys = [pair for slot in order if slot.paged for pair in self.state_keys(slot)]
        half = sum(nbytes for _, nbytes in keys) / 2
        lead = seen = 0
        for key, nbytes in keys:
            if self._on_tier(key):
                lead += nbytes if seen + nbytes / 2 <= half else -nbytes
            seen += nbytes
        return lead

    def add(self, slot: ParamSlot, coef: torch.Tensor | None, after: Any = None) -> None:
        """Add ``slot`` to the open bucket, first launching it if ``slot`` would overfill it.
        ``after``: the link's marker of the device work that must end before weights are written.
        A slot paged in chunks is updated on its own, chunk by chunk."""
        self._count_early_writes()
        if slot.chunks is not None:
            # In the step's order: the slots added before it go first (their bucket launched),
            # and its runs queue for the in-flight places now, before the slots added after it.
            self.launch(coef)
            task = asyncio.ensure_future(self._update_chunked(slot, self._start_runs(slot, coef, self.scale, after)))
            self._running.append(([slot], task))
            return
        need = self.need(slot)
        incoming = need - self._resident_state(slot)
        tier = self._store.tier(self._tier)
        held = self._held_values(slot) if isinstance(tier, MemoryTier) else []
        if self._open and self._bucket_full(incoming, held):
            self.launch(coef)
        if self._open_room is None and isinstance(tier, MemoryTier):
            self._open_room = RoomTally(tier)
        for nbytes in held:
            self._open_room.add(nbytes)  # type: ignore[union-attr]
        self._open.append(slot)
        self._open_bytes += need
        self._open_incoming += incoming
        self._after = after

    def _resident_state(self, slot: ParamSlot) -> int:
        """State-tier bytes of ``slot``'s state if it is on the state tier now, else 0."""
        if not slot.paged or self._flat or not self._on_tier(slot.key):
            return 0
        tier = self._store.tier(self._tier)
        return tier.room_for([self._owner._state_bytes(slot)]) if isinstance(tier, MemoryTier) else 0

    def _bucket_full(self, incoming: int, held: list[int]) -> bool:
        """Whether the open bucket must launch before a slot whose update holds values of
        ``held`` bytes (``incoming`` bytes of room to come up) joins it. ``bucket_bytes`` bounds
        what a bucket holds, resident or not (a bucket grown to its share of the room hung a
        step where two optimizers share one store: each counts the room as its own), counted
        with the slabs its small values take (counted by their bytes, a bucket of small values
        of distinct sizes took more than the tier on a small one and hung); it also launches
        once it holds what the step writes back early, so that those writes start after the
        first math call."""
        tally = self._open_room
        if tally is not None and tally.room + tally.cost(*held) > self.bucket_bytes:
            return True
        if self._open_incoming + incoming > self.bucket_bytes:
            return True
        early = self._early_bytes or 0  # (below 0 once the last early write-back is picked)
        return early > 0 and self._open_bytes - self._open_incoming >= early

    def launch(self, coef: torch.Tensor | None) -> None:
        if self._open:
            bucket, self._open, self._open_bytes, self._open_incoming, self._open_room = self._open, [], 0, 0, None
            self._running.append((bucket, asyncio.ensure_future(self._update(bucket, coef, self.scale, self._after))))

    async def launched_done(self) -> None:
        """Wait until the buckets launched so far have ended (their outcomes stay for ``finish``)."""
        tasks = [task for _, task in self._running if not task.done()]
        if tasks:
            await asyncio.wait(tasks)

    async def finish(self, *, drop_open: bool = False) -> list[tuple[list[ParamSlot], BaseException]]:
        """Wait for every bucket launched; return those that failed, with their errors (the
        others have finished: one bucket's failure does not stop the rest). ``drop_open``: forget
        the bucket not launched yet (the step is abandoned)."""
        if drop_open:
            self._open, self._open_bytes, self._open_incoming, self._open_room = [], 0, 0, None
        running, self._running = self._running, []
        results = await asyncio.gather(*(task for _, task in running), return_exceptions=True)
        runs, self._runs = self._runs, []
        await asyncio.gather(*runs, return_exceptions=True)  # (their errors are their waiting tasks')
        self._prefetched = False
        self._early_bytes = None
        self._updated_keys.clear()
        self._written_early.clear()
        self._to_read = {}
        return [(bucket, result) for (bucket, _), result in zip(running, results, strict=True) if isinstance(result, BaseException)]

    async def _update(self, slots: list[ParamSlot], coef: torch.Tensor | None, scale: torch.Tensor | None, after: Any) -> None:
        """Update a bucket: hold states and gradients, run the math (slots whose state was
        updated by an earlier, failed attempt only send their weight), write the weights."""
        todo = [slot for slot in slots if not slot.updated]
        async with self._gate, AsyncExitStack() as stack:
            if await self._update_resident(slots, todo, coef, scale):
                self._write_early([(slot.key, self._owner._state_bytes(slot)) for slot in todo if slot.paged])
                return
            states = await _enter_all(stack, [self._owner._state(slot) for slot in slots], at_once=self._flat,
                                      local=[not slot.paged for slot in slots])
            lent = all(slot.capture is not None and slot.capture.lent is not None for slot in todo)  # (nothing to wait for)
            grads = await _enter_all(stack, [self.grad_for_update(slot) for slot in todo], at_once=self._flat or lent)
            done: list[ParamSlot] = []  # (appended on the math thread, read here once it returned)
            job = partial(self._compute_bucket, slots, states, grads, coef, scale, done)
            try:
                outgoing, started, computed, ended = await self.math(job)
            finally:  # a group's call failed: the groups before it count as updated (not twice on a retry)
                for slot in done:
                    slot.updated = True
            report = self._report()
            report.host_update += computed - started
            report.updates += len(todo)
            report.update_elements += sum(s.numel for s in todo)
            self._timeline.add(f"update x{len(todo)}", "host update", started, computed, elements=sum(s.numel for s in todo))
            await self._write_weights(slots, outgoing, after, computed, ended)
        self._write_early([(slot.key, self._owner._state_bytes(slot)) for slot in todo if slot.paged])
        for slot in todo:
            capture = slot.capture
            if capture is not None and capture.lent is None and slot.grad_key in self._store:
                await self._store.delete(slot.grad_key)

    async def _update_resident(self, slots: list[ParamSlot], todo: list[ParamSlot], coef: torch.Tensor | None, scale: torch.Tensor | None) -> bool:
        """Update the bucket ``slots`` (in its place) as the resident step updates, if it can now:
        every state on the state tier, held by no one, every gradient lent (``ResidentStep.pieces``).
        One hold of them all and one math call, where the bucket's own way takes a hold, a
        gradient and a weight per slot; the same holds over the same time, and the same bits
        (Adam is elementwise). Returns whether it did; a failed update raises as the bucket's."""
        resident = self.resident
        if resident is None or scale is not None or self._in_backward or len(todo) != len(slots):
            return False
        pieces = resident.pieces(slots)
        # (in the bucket's order, as its own holds below take them: no new order between holders,
        # the buckets of a step hold disjoint keys, and none of these is held by anyone now)
        held = await resident.hold(slots, pieces) if pieces is not None else None
        if held is None:
            return False
        failures = await resident.update(held, coef, whole=False, bucket=True)
        if failures:
            raise failures[0][1]
        return True

    def grad(self, slot: ParamSlot, capture: Capture | None = None) -> AbstractAsyncContextManager[torch.Tensor]:
        """The gradient of ``slot`` its ``capture`` (default: this step's) took to the host:
        the model's own where the link lends, else held in the store."""
        capture = capture or slot.capture
        if capture is None:
            raise RuntimeError(f"internal error: parameter {slot.index} has no gradient to update from")
        if capture.lent is not None:
            return nullcontext(capture.lent)
        if slot.chunks is not None or capture.deferred:  # not copied whole (yet): its norm is taken where it is
            return nullcontext(_device_grad(slot, capture))
        return self._store.hold(slot.grad_key, self._tier)

    def grad_for_update(self, slot: ParamSlot) -> AbstractAsyncContextManager[torch.Tensor]:
        """This step's gradient of ``slot`` on the host, for its update: as ``grad``, but a
        deferred capture is copied over the link now, into a scratch buffer of the state tier
        that goes with the bucket (never a value, so never written to the disk)."""
        capture = slot.capture
        if capture is not None and capture.deferred and capture.lent is None and slot.chunks is None:
            grad = _device_grad(slot, capture)
            return self._grad_copy(slot, capture, grad.reshape(-1), slot.grad_key, grad.shape)
        return self.grad(slot)

    @asynccontextmanager
    async def _grad_copy(
        self, slot: ParamSlot, capture: Capture, source: torch.Tensor, key: str, shape: torch.Size
    ) -> AsyncIterator[torch.Tensor]:
        """``source`` (flat, on the device) copied over the link into a scratch buffer of ``shape``."""
        async with scratch(self._store, key, (source.numel(),), source.dtype, self._tier) as buffer:
            transfer = slot.link.to_host(buffer, source, after=capture.marker)
            await transfer
            count_grad_transfer(self._report(), self._timeline, slot.index, transfer)
            yield buffer.view(shape)

    # -- chunks -------------------------------------------------------------------------------------

    def _start_runs(self, slot: ParamSlot, coef: torch.Tensor | None, scale: torch.Tensor | None, after: Any) -> list[asyncio.Future[None]]:
        """Start updating ``slot`` chunk by chunk (chunks already done by a failed attempt are
        skipped): consecutive chunks in runs of up to ``bucket_bytes`` (one math call, one thread
        hop each), each run taking one of the ``inflight`` places in turn."""
        if not slot.updated:
            self._owner._begin_chunks(slot)
        chunks = [chunk for chunk in slot.chunks or [] if chunk.index not in slot.chunks_written]
        needs = self._chunk_needs(slot, chunks)
        runs = self._chunk_runs(chunks[::-1] if self.reverse else chunks, needs)
        sizes = [sum(needs[chunk.index] for chunk in run) for run in runs]
        tasks: list[asyncio.Future[None]] = [asyncio.ensure_future(self._update_run(slot, runs, sizes, i, coef, scale, after)) for i in range(len(runs))]
        self._runs = [task for task in self._runs if not task.done()] + tasks
        return tasks

    def _chunk_needs(self, slot: ParamSlot, chunks: list[Chunk]) -> dict[int, int]:
        """``chunk_need`` of each of ``chunks`` by index, asked once per element count (the
        chunks of a parameter have one or two counts)."""
        by_numel: dict[int, int] = {}
        needs: dict[int, int] = {}
        for chunk in chunks:
            need = by_numel.get(chunk.numel)
            if need is None:
                need = by_numel[chunk.numel] = self.chunk_need(slot, chunk)
            needs[chunk.index] = need
        return needs

    async def _update_chunked(self, slot: ParamSlot, tasks: list[asyncio.Future[None]]) -> None:
        """Wait for the runs of ``slot`` (``_start_runs``), then finish its update."""
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        if not slot.updated:
            self._owner._end_chunks(slot)
            slot.updated = True
            report = self._report()
            report.updates += 1
            report.update_elements += slot.numel
        slot.written = True
        slot.note_written()

    async def update_remaining_chunks(self, slot: ParamSlot, coef: torch.Tensor | None, after: Any) -> None:
        """Update the chunks of ``slot`` not updated yet in this step (those done are skipped,
        as in a retry), then close its update."""
        await self._update_chunked(slot, self._start_runs(slot, coef, self.scale, after))

    def close_finished_chunks(self, slots: Sequence[ParamSlot]) -> None:
        """Close the update of each slot paged in chunks whose every chunk's state was updated,
        though its update was not closed (the step was interrupted in between: a Ctrl-C cancels
        the wait, the chunks' work in flight ends): its step count moves on with its state, as all
        its chunks took the step; left as it was, its next update would count this step again.
        (Whether each chunk's weight copy was recorded does not decide it: on a device a Ctrl-C
        can cancel the wait for a copy that still lands.) A slot only some of whose chunks ran
        (the abandoned step finishes those first, ``update_remaining_chunks``; one an error
        left cut) stays as it is."""
        for slot in slots:
            if slot.updated or not slot.chunks:
                continue
            if {chunk.index for chunk in slot.chunks} <= slot.chunks_updated:
                self._owner._end_chunks(slot)
                slot.updated = slot.written = True

    def _chunk_runs(self, chunks: list[Chunk], needs: dict[int, int]) -> list[list[Chunk]]:
        """``chunks`` cut into runs of consecutive chunks needing at most ``bucket_bytes``, or two
        chunks' worth (so a short last chunk can go with a full one instead of being one more
        small read and math call of its own; the holds of ``inflight`` runs still fit in the
        ``2 * inflight + 2`` chunks the tier was planned for)."""
        runs: list[list[Chunk]] = []
        size = 0
        pair = 2 * max((needs[chunk.index] for chunk in chunks), default=0)
        limit = max(self.bucket_bytes, min(pair, self._room // max(self.inflight, 1)))
        for chunk in chunks:
            need = needs[chunk.index]
            if runs and size + need <= limit:
                runs[-1].append(chunk)
                size += need
            else:
                runs.append([chunk])
                size = need
        return runs

    async def _update_run(
        self, slot: ParamSlot, runs: list[list[Chunk]], sizes: list[int], index: int, coef: torch.Tensor | None,
        scale: torch.Tensor | None, after: Any,
    ) -> None:
        param = slot.param
        if isinstance(param, torch.Tensor) and not param.is_contiguous() and offloaded(param) is None:
            raise RuntimeError(
                f"parameter {slot.index} is paged in chunks of its flat elements, and it is no longer contiguous "
                "(model.to(memory_format=torch.channels_last) after the optimizer was made?): change the layout "
                "before making the optimizer, or pass chunk_bytes=None"
            )
        chunks = runs[index]
        async with self._gate:
            ahead = self._prefetch_runs(runs, sizes, index)
            if ahead:
                await self._store.prefetch(ahead, self._tier)  # (returns at once: the reads go on in the background)
            todo = [chunk.index not in slot.chunks_updated for chunk in chunks]
            async with AsyncExitStack() as stack:
                states = await _enter_all(stack, [self._owner._chunk_state(slot, chunk) for chunk in chunks], at_once=self._flat)
                capture = slot.capture
                if capture is not None and capture.lent is not None:  # views of the model's gradient: nothing to enter
                    flat = capture.lent if capture.lent.dim() == 1 else capture.lent.reshape(-1)
                    grads = [flat[chunk.start : chunk.stop] if do else None for chunk, do in zip(chunks, todo, strict=True)]
                else:
                    grads = await _enter_all(
                        stack, [self._grad_chunk(slot, chunk) if do else nullcontext(None) for chunk, do in zip(chunks, todo, strict=True)],
                        at_once=self._flat or slot.link.lends,
                    )
                took: list[Chunk] = []  # (appended on the math thread, chunk by chunk)
                job = partial(self._compute_chunks, slot, chunks, states, grads, coef, scale, took)
                try:
                    outgoing, error, started, computed, ended = await self.math(job)
                finally:
                    # (also when the wait ends cancelled, or an interrupt cut the job: the chunks
                    # it updated took the step in place, and a retry must not apply it again)
                    slot.chunks_updated.update(chunk.index for chunk in took)
                done = chunks[: len(outgoing)]
                applied = sum(chunk.numel for chunk, do in zip(done, todo, strict=False) if do)
                if applied:
                    self._report().host_update += computed - started
                    self._timeline.add(f"update {slot.index}/c{done[0].index}-{done[-1].index}", "host update", started, computed, elements=applied)
                self._report().weights_to_device += ended - computed  # (into lent parameters, on the math thread)
                for chunk, weight in zip(done, outgoing, strict=True):
                    if weight is not None:
                        await self._write_chunk(slot, chunk, weight, after)
                    slot.chunks_written.add(chunk.index)
                if error is not None:
                    raise error
            per = self._owner._state_bytes(slot) / max(slot.numel, 1)
            self._write_early([(chunk.key, int(chunk.numel * per)) for chunk, do in zip(done, todo, strict=False) if do])

    def _on_tier(self, key: str) -> bool:
        """Whether ``key``'s current value is on the state tier."""
        return self._store._on_tier(key, self._tier)

    def _prefetch_runs(self, runs: list[list[Chunk]], sizes: list[int], index: int) -> list[str]:
        """The keys to prefetch for the runs after run ``index`` (large requests, issued ahead, behind
        every demand read), so their reads overlap this run's math and writes: as many as fit in
        the room the ``inflight`` runs holding leave. More than that evicted chunks prefetched
        for a later run before their update (read twice, their writes too)."""
        budget = self._room - self.inflight * max(sizes)
        ahead: list[Chunk] = []
        for run, size in zip(runs[index + 1 :], sizes[index + 1 :], strict=True):
            budget -= size
            if budget < 0:
                break
            ahead += run
        return [chunk.key for chunk in ahead if chunk.key in self._store and not self._on_tier(chunk.key)]

    @asynccontextmanager
    async def _grad_chunk(self, slot: ParamSlot, chunk: Chunk) -> AsyncIterator[torch.Tensor]:
        """The chunk's slice of this step's gradient on the host: a view of the gradient where
        the link lends, else copied over the link into a scratch buffer of the state tier (the
        gradient of a chunked parameter is never copied whole)."""
        capture = slot.capture
        if capture is None:
            raise RuntimeError(f"internal error: parameter {slot.index} has no gradient to update from")
        if capture.lent is not None:
            yield capture.lent.reshape(-1)[chunk.start : chunk.stop]
            return
        source = _device_grad(slot, capture).reshape(-1)[chunk.start : chunk.stop]
        async with self._grad_copy(slot, capture, source, f"{chunk.key}/grad", source.shape) as buffer:
            yield buffer

    def _compute_chunks(
        self, slot: ParamSlot, chunks: list[Chunk], states: list[Any], grads: list[torch.Tensor | None], coef: torch.Tensor | None,
        scale: torch.Tensor | None, took: list[Chunk],
    ) -> tuple[list[torch.Tensor | None], BaseException | None, float, float, float]:
        """The math of a run of chunks, one by one (a chunk whose gradient is None was updated
        by an earlier attempt), each appended to ``took`` once its update is applied; then each
        new weight: written into the parameter where the link lends, else returned to be sent.
        Stops at the first error, returned with the weights of the chunks done before it (whose
        updates are applied)."""
        started = time.perf_counter()
        masters: list[torch.Tensor] = []
        error: BaseException | None = None
        for chunk, state, grad in zip(chunks, states, grads, strict=True):
            try:
                masters.append(self._update_one_chunk(slot, chunk, state, grad, coef, scale))
            except Exception as exc:  # noqa: BLE001 - the loop records the chunks done, then raises it
                error = exc
                break
            took.append(chunk)
        computed = time.perf_counter()
        outgoing: list[torch.Tensor | None] = []
        lent_here = slot.link.lends and offloaded(slot.param) is None
        for chunk, master in zip(chunks, masters, strict=False):
            if chunk.index in slot.chunks_written or lent_here and _updated_in_place(slot, master, chunk.start):
                outgoing.append(None)
            elif lent_here:
                _write_into(slot.param.data.view(-1)[chunk.start : chunk.stop], master)
                outgoing.append(None)
            else:
                outgoing.append(master if slot.param.dtype == master.dtype else master.to(slot.param.dtype))
        return outgoing, error, started, computed, time.perf_counter()

    def _update_one_chunk(
        self, slot: ParamSlot, chunk: Chunk, state: Any, grad: torch.Tensor | None, coef: torch.Tensor | None, scale: torch.Tensor | None
    ) -> torch.Tensor:
        if grad is None:
            return self._owner._master(slot, state)
        if scale is not None and coef is not None:
            grad, scale = grad.mul(inverse_scale(scale)), None
        if coef is not None:
            grad = grad.mul(coef.to(grad.device))
        return self._owner._apply_chunk(slot, chunk, state, grad, scale)

    async def _write_chunk(self, slot: ParamSlot, chunk: Chunk, weight: torch.Tensor, after: Any) -> None:
        report = self._report()
        offload = offloaded(slot.param)
        started = time.perf_counter()
        if offload is not None:
            await offload[0].write_weight_range(offload[1], chunk.start, weight)
            report.weights_to_store += time.perf_counter() - started
            report.weights_to_store_bytes += weight.nbytes
            return
        transfer = slot.link.to_device(slot.param.data.view(-1)[chunk.start : chunk.stop], weight, after=after)
        await transfer
        report.weights_to_device += transfer.seconds
        report.weights_to_device_bytes += transfer.nbytes

    def _compute_bucket(
        self, slots: list[ParamSlot], states: list[Any], grads: list[torch.Tensor], coef: torch.Tensor | None, scale: torch.Tensor | None,
        done: list[ParamSlot],
    ) -> tuple[list[torch.Tensor | None], float, float, float]:
        """The math of a bucket (training or worker thread), one call per parameter group, each
        group's slots appended to ``done`` once its call returned; then the new weights: written
        into parameters whose link lends, converted to the parameter's dtype for the others (a
        link copies bytes). Returns what to send per slot and when each part ran."""
        started = time.perf_counter()
        todo = [i for i, slot in enumerate(slots) if not slot.updated]
        if scale is not None and coef is not None:  # unscale, then clip: as scaler.unscale_ + clip_grad_norm_
            inverse = inverse_scale(scale)
            grads, scale = [grad.mul(inverse) for grad in grads], None
        if coef is not None:
            grads = [grad.mul(coef.to(grad.device)) for grad in grads]
        masters: list[torch.Tensor] = [self._owner._master(slot, state) for slot, state in zip(slots, states, strict=True)]
        by_group: dict[int, list[int]] = {}  # (positions in todo, as grads)
        for n, i in enumerate(todo):
            by_group.setdefault(slots[i].group, []).append(n)
        for members in by_group.values():
            chosen = [todo[n] for n in members]
            new = self._owner._apply_many([slots[i] for i in chosen], [states[i] for i in chosen], [grads[n] for n in members], scale)
            for i, master in zip(chosen, new, strict=True):
                masters[i] = master
            done.extend(slots[i] for i in chosen)
        computed = time.perf_counter()
        outgoing: list[torch.Tensor | None] = []
        for slot, master in zip(slots, masters, strict=True):
            if not slot.written and _updated_in_place(slot, master, 0):
                outgoing.append(None)  # (nothing to write: no view of either, each a torch call)
                continue
            weight = master.view(slot.shape)
            if slot.written or (slot.link.lends and offloaded(slot.param) is not None):
                outgoing.append(weight)
            elif slot.link.lends:  # the parameter lives in host memory
                _write_into(slot.param.data, weight)
                outgoing.append(None)
            else:
                outgoing.append(weight if slot.param.dtype == weight.dtype else weight.to(slot.param.dtype))
        return outgoing, started, computed, time.perf_counter()

    async def _write_weights(self, slots: list[ParamSlot], outgoing: list[torch.Tensor | None], after: Any, computed: float, ended: float) -> None:
        report = self._report()
        if ended - computed > 1e-4:  # weights written into lent parameters, on the math thread (no link crossed)
            report.weights_to_device += ended - computed
            self._timeline.add(f"weights x{len(slots)}", "weights into parameters", computed, ended)
        transfers: list[tuple[ParamSlot, Transfer]] = []
        errors: list[BaseException] = []
        for slot, weight in zip(slots, outgoing, strict=True):
            if slot.written:
                continue
            if weight is None:
                slot.written = True
                slot.note_written()
                continue
            offload = offloaded(slot.param)
            if offload is not None:  # the weight lives in a store (offload_parameters)
                started = time.perf_counter()
                written = weight.to(slot.param.dtype)
                await offload[0].write_weight(offload[1], written)
                report.weights_to_store += time.perf_counter() - started
                report.weights_to_store_bytes += written.nbytes
                slot.written = True
                slot.note_written()
            else:
                try:
                    transfers.append((slot, slot.link.to_device(slot.param.data, weight, after=after)))
                except BaseException as exc:  # noqa: BLE001 - the others still go; raised below
                    errors.append(exc)
        for slot, transfer in transfers:  # every copy ends before the holds on its source go
            try:
                await transfer
            except Exception as exc:  # noqa: BLE001 - raised once all ended
                errors.append(exc)
                continue
            slot.written = True
            slot.note_written()
            report.weights_to_device += transfer.seconds
            report.weights_to_device_bytes += transfer.nbytes
            self._timeline.add(f"weights {slot.index}", "weights to device", transfer.started or 0.0, transfer.ended or 0.0, bytes=transfer.nbytes)
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        self._compute.shutdown()

    @property
    def workers(self) -> WorkerPool:
        """The thread the math runs on outside ``step()`` (``tierstore.workers.WorkerPool``)."""
        return self._compute


async def read_weight(slot: ParamSlot) -> torch.Tensor:
    """The parameter's current value in host memory: across its link, or from its store if it
    is offloaded (``offload_parameters``); the parameter itself where the link lends."""
    offload = offloaded(slot.param)
    if offload is not None:
        return await offload[0].read_weight(offload[1])
    data = slot.param.detach()
    if slot.link.lends:
        return data
    host = torch.empty(data.shape, dtype=data.dtype)
    await slot.link.to_host(host, data.contiguous())
    return host


async def read_weight_range(slot: ParamSlot, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of the flattened parameter's current value, in host memory."""
    offload = offloaded(slot.param)
    if offload is not None:
        return await offload[0].read_weight_range(offload[1], start, stop)
    data = slot.param.detach().reshape(-1)[start:stop]
    if slot.link.lends:
        return data
    host = torch.empty(data.shape, dtype=data.dtype)
    await slot.link.to_host(host, data)
    return host


async def fill_weight_range(slot: ParamSlot, start: int, stop: int, out: torch.Tensor) -> None:
    """Write elements ``start:stop`` of the flattened parameter into ``out`` (an fp32 row of new
    state on the state tier): over the link straight into it where the dtypes agree, so no
    temporary copy of the weight is made."""
    offload = offloaded(slot.param)
    if offload is not None or slot.link.lends or slot.param.dtype != out.dtype:
        out.copy_((await read_weight_range(slot, start, stop)).reshape(-1))
        return
    await slot.link.to_host(out, slot.param.detach().reshape(-1)[start:stop])


class _Discard(Exception):
    """Ends a ``scratch`` block: its buffer is freed without becoming a value."""


@asynccontextmanager
async def scratch(store: TierStore, key: str, shape: tuple[int, ...], dtype: torch.dtype, tier: str) -> AsyncIterator[torch.Tensor]:
    """A buffer on memory tier ``tier``, counted in its budget while the block runs, that never
    becomes a value: it cannot be evicted, so it is never written to the disk (a fill whose
    block raises is freed, not installed; a value put and then deleted could be pushed out to
    the disk in between)."""
    try:
        async with store.fill(key, shape, dtype, tier, durable=False) as buffer:
            yield buffer
            raise _Discard
    except _Discard:
        pass


def _device_grad(slot: ParamSlot, capture: Capture) -> torch.Tensor:
    """The gradient a capture of a chunked parameter stands for, where the model keeps it."""
    grad = capture.tensor() if capture.tensor is not None else None
    if grad is None:
        grad = slot.param.grad
    if grad is None:
        raise RuntimeError(f"parameter {slot.index}: its gradient was freed before step() read it")
    return grad


_lookup: Callable[[torch.Tensor], Any] | None = None


def offloaded(param: torch.Tensor) -> Any:
    """``(offloader, key)`` if ``param``'s weight lives in a store (``offload_parameters``)."""
    global _lookup
    lookup = _lookup
    if lookup is None:  # (imported on first use: tierstore.swap imports this package)
        from ..swap.parameters import offloaded as lookup

        _lookup = lookup
    return lookup(param)


def _updated_in_place(slot: ParamSlot, master: torch.Tensor, start: int) -> bool:
    """Whether ``master`` (the new weight of ``slot``'s elements from ``start``) is the
    parameter's own memory there, contiguous, where the link lends: the update wrote the
    parameter (``_write_into`` would find nothing to copy)."""
    param = slot.param
    return (
        slot.link.lends and type(param) in PLAIN_TENSOR_TYPES and master.dtype == param.dtype
        and master.data_ptr() == param.data_ptr() + start * param.element_size() and master.is_contiguous()
        and param.is_contiguous() and offloaded(param) is None
    )


def _write_into(param: torch.Tensor, weight: torch.Tensor) -> None:
    """Write the new ``weight`` into the parameter's memory, unless it is that memory already
    (a state whose master is the parameter itself)."""
    if weight.data_ptr() != param.data_ptr() or weight.stride() != param.stride():
        param.copy_(weight)


async def _enter_all(
    stack: AsyncExitStack, managers: list[AbstractAsyncContextManager[Any]], *, at_once: bool = False, local: list[bool] | None = None,
) -> list[Any]:
    """Enter several async context managers at once (their transfers overlap) into ``stack``;
    if one fails, the ones entered are still exited with the stack. ``at_once``: there is
    nothing to overlap (all in memory): enter them one after the other, without a task each.
    ``local``: per manager, whether it asks nothing of the store (a state kept outside it):
    entered first, without a task."""
    if at_once:
        return [await stack.enter_async_context(manager) for manager in managers]

    async def enter(manager: AbstractAsyncContextManager[Any]) -> Any:
        return await stack.enter_async_context(manager)

    values: list[Any] = [None] * len(managers)
    local = local or [False] * len(managers)
    for i, here in enumerate(local):
        if here:
            values[i] = await stack.enter_async_context(managers[i])
    stored = [i for i, here in enumerate(local) if not here]
    # The rest each as a task, resident or not, one alone too: the store sees their requests in
    # the order given, and those of the updates in flight in the order the updates took their
    # places, as tasks run to their first wait in the order they were made (where nothing waits
    # before its hold is asked for: a close, a write hold on the key, a state being made).
    # Those resident (or alone) were entered at once before, ahead of the tasks made before
    # them, so a run's order in the learned schedule changed with what happened to be
    # resident, and after a load ``MIN`` evicted the state updated next to last instead of the
    # one written back early to go (and wrote it too). The cost: a task a state, and a resident
    # one is not held before the others' reads make room, so a policy that ranks it last (LRU;
    # ``MIN`` before it has learned the order) may evict it first.
    outcomes = await asyncio.gather(*(enter(managers[i]) for i in stored), return_exceptions=True)
    for i, outcome in zip(stored, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            raise outcome
        values[i] = outcome
    return values


def _chunk_advice(slot: ParamSlot, chunkable: bool, chunk_bytes: int, planned: int = 0) -> str:
    """What else lets ``slot`` fit a tier too small for its whole state (paging it in chunks;
    ``planned``: the chunks' size where it is paged in chunks already)."""
    if slot.chunks is not None:  # (chosen for the tier, chunks are never below 64 KiB; a user's may be)
        return f", or page it in smaller chunks (chunk_bytes= below the {format_bytes(planned)} used)" if planned > 4096 else ""
    if chunkable and chunk_bytes:
        return ""
    param = slot.param
    if isinstance(param, LocalShard):  # (FSDP2's sharded parameters)
        return ", or shard it over more ranks (an FSDP2 parameter's local shard is not paged in chunks: its whole state must fit)"
    if isinstance(param, torch.Tensor) and not param.is_contiguous():
        return (", or make it contiguous (p.data = p.data.contiguous() before making the optimizer): "
                "a non-contiguous parameter's state is not paged in chunks")
    if chunkable:
        return ", or page its state in chunks (chunk_bytes=)"
    return ", or page its state in chunks (chunk_bytes=; a TieredOptimizer only where its optimizer is elementwise)"


class Places:
    """At most ``limit()`` holders at once: an ``asyncio.Semaphore`` whose size is read at every
    take (a re-plan during a step changes ``inflight``: places already taken are kept, and no
    new one is given until fewer than the new limit are held). First come, first served: a
    newcomer waits behind anyone waiting, and a release gives its place to the longest waiter
    (one woken then cancelled passes its place on)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._held = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:
        if not self._waiting and self._held < max(self._limit(), 1):
            self._held += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._give()  # (the places free now go to those waiting, in order)
        try:
            await waiter  # (given: the place is counted as held)
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # given, then cancelled before it ran
                self._held -= 1
                self._give()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._held -= 1
        self._give()

    def _give(self) -> None:
        while self._waiting and self._held < max(self._limit(), 1):
            waiter = self._waiting.popleft()
            if not waiter.done():  # (a waiter cancelled meanwhile is passed over)
                self._held += 1
                waiter.set_result(None)
