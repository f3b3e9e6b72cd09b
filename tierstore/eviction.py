"""Room on a memory tier: victims chosen by the tier's policy and demoted one tier down.

Victims are chosen in the policy's order until their sizes cover the shortfall, among the copies
no one uses or holds (and, above a last memory tier that evicts nothing, only those that fit
there). Victims written back into a slower *memory* tier are demoted one after another (each
arrival there is an insert into that tier's policy, which must come in the order of the choices);
write-backs to the disk run concurrently. A batch finishes before room is asked again, and the
room check is the last thing before the caller allocates: the tiers then look as the policy
decided, and as ``tierstore.sim.replay_store_trace`` replays.

A copy being read out (a get, a read, a load down the tiers: ``Engine.reading``) is no hold:
a request that finds nothing else to evict waits for such reads to end, up to ``READ_WAITS``
times (readers that start again at once would keep it waiting for ever), and not for reads of a
held copy (their end frees nothing), then fails as full.

A copy dropped from a tier behind a link while a kernel may still use it comes back to the tier
only when that kernel is done (``Engine._release_after``): those bytes count as room on its way,
as a demotion's do, and a request that finds nothing else to evict waits for them, until a
close of the store seals (``Engine.close``): a request still making room then waits for the
close's outcome instead, and fails with ``StoreClosedError``, allocating nothing, if the store
closed, or makes room again if the close failed. A demotion's write into the memory tier below
(which the close waits for) does not wait: it fails, changing nothing.

A request that finds no victim, and one whose shortfall the room on its way covers, wait in
the tier's queue and are woken a few at a time (``tierstore.room_queue``). Room on its way is
counted on once: a request waiting for it (or for its own demotions) claims
what its value still needs (``Engine.claimed``), and the others count only the rest, choosing
victims of their own for what it does not cover; requests for room then evict side by side.
Not a small value that needs a new slab (one slab serves all the requests of its size), nor
above a slower memory tier (its demotions go one after another): those count all of it.

An early write-back (``write_early``) writes a memory copy to the disk tier below ahead of its
eviction and keeps it: the eviction that later chooses it drops it without a write on the
requester's path. While the write runs the copy stays a candidate; a demotion that chooses it
waits for the write, then finds the value on the disk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .entry import Copy, Entry
from .errors import PolicyError, StoreClosedError, TierFullError, UnknownTierError
from .protocols import policy_name
from .room_queue import COVERED, LOOKED
from .tiers.base import MemoryTier, Tier
from .units import format_bytes
from .workers import Priority

if TYPE_CHECKING:
    from .engine import Engine

#: How many times a request for room that finds nothing to evict waits for reads of the tier's
#: copies to end (a read is no hold: its copy is a victim once it ends) before it fails as full.
READ_WAITS = 64


async def make_room(engine: Engine, t: int, nbytes: int, priority: Priority, wait_for_close: bool = False) -> None:
    """Evict from tier ``t`` until a value of ``nbytes`` can be allocated there (the rules are
    the module's); returns once every demotion it started has finished. ``wait_for_close``: a
    request that waits for a sealed close's outcome (else it is refused)."""
    tier = engine.tiers[t]
    if not isinstance(tier, MemoryTier):
        raise UnknownTierError(f"tier {tier.name!r} holds no buffers")
    if (size := tier.value_size(nbytes)) > tier.capacity:
        exact = len({format_bytes(n) for n in (nbytes, size, tier.capacity)}) < len({nbytes, size, tier.capacity})
        value, taken, capacity = (f"{n:,} bytes" if exact else format_bytes(n) for n in (nbytes, size, tier.capacity))
        if size == nbytes:
            raise TierFullError(f"{value} is more than tier {tier.name!r} holds ({capacity})")
        raise TierFullError(f"a value of {value} takes {taken} on tier {tier.name!r} (whole allocation units), "
                            f"more than it holds ({capacity})")
    while True:
        if engine.winding_down:  # (a request that made room while the store closed allocates nothing)
            if wait_for_close and engine.sealed:
                await engine.settled()  # (then closed, or open again: asked again)
                continue
            _refuse_closing(engine, tier)
        if tier.free >= tier.allocation_size(nbytes):  # checked last with no await before allocate
            return
        await _evict_for(engine, tier, t, nbytes, priority, wait_for_close)


def _refuse_closing(engine: Engine, tier: MemoryTier) -> None:
    """Raise ``StoreClosedError``: the store is closed, or sealed for a close that waits for the
    caller (a demotion). The close waits for no request that makes room (room on its way may
    never come: a kernel, a hold the caller keeps), and nothing may be allocated on a tier it
    closes. Nothing was changed (demotions leave values valid)."""
    if engine.sealed:
        raise StoreClosedError(f"the store is closing: no more room is made on tier {tier.name!r} (nothing was written; "
                               "should the close fail, the store stays open and this can be asked again)")
    raise StoreClosedError(f"the store closed while this waited for room on tier {tier.name!r} (nothing was written)")


async def _evict_for(engine: Engine, tier: MemoryTier, t: int, nbytes: int, priority: Priority, wait_for_close: bool) -> None:
    one_at_a_time = t + 1 < len(engine.tiers) and isinstance(engine.tiers[t + 1], MemoryTier)
    mine: list[asyncio.Task[None]] = []
    read_waits = 0  # (reads waited for: readers that start again at once, a loop of gets, would keep it waiting for ever)
    woken: int | None = None  # (the line of the tier's queue it was woken from: the wake goes on once it has looked)
    lined: set[int] = set()  # (the lines it waited in before: it keeps its place at their front)
    try:
        while tier.free < (size := tier.allocation_size(nbytes)):
            if engine.winding_down:
                break  # (no victims chosen for a store that closes: ``make_room`` waits or refuses)
            # Room on its way back, less what other requests count on; all of it for a small value
            # that needs a new slab (one slab serves every request of its size: each evicting a
            # slab's worth for itself emptied a tier for 21 values of 192 B), and above a memory
            # tier (demotions into it go one after another, in the order chosen).
            shared = one_at_a_time or tier.value_size(nbytes) < size
            coming = max(engine.freeing[t] + engine.releasing[t] - (0 if shared else engine.claimed[t]), 0)
            deficit = size - tier.free - coming
            batch: list[tuple[Entry, Copy]] = []
            started: list[asyncio.Task[None]] = []
            handled = 0
            try:
                looked = deficit > 0
                while deficit > 0:  # (a policy that raises part-way: those chosen go back below)
                    victim = _next_victim(engine, t)
                    if victim is None:
                        break
                    engine.use(*victim)
                    deficit -= victim[1].nbytes
                    batch.append(victim)
                if woken is not None:
                    # (one that moves to the other line lets the next of its line look in its place)
                    engine.room_looked(t, woken, bool(batch) or looked != (woken == LOOKED))
                    woken = None
                for entry, copy in batch:
                    if engine.winding_down:
                        break  # (sealed meanwhile: the rest stay, no demotion starts after the close's drain)
                    if not _demotion_waits(engine, entry, t, copy):
                        handled += 1
                        _demote_at_once(engine, entry, t, copy)  # (a task would only run it a moment later)
                        continue
                    task = _start_demotion(engine, entry, t, copy, priority)
                    handled += 1  # (before the wait: a cancelled wait leaves the task to finish it)
                    started.append(task)
                    mine.append(task)
                    if one_at_a_time:
                        await _counting_on_room(engine, t, size - tier.free, [task])
            finally:
                for entry, copy in batch[handled:]:  # cancelled before their turn: they stay
                    engine.unuse(entry, copy)
                    engine.policy_insert(entry, copy)
            if started:  # the whole batch goes before room is asked again (as the replay)
                await _counting_on_room(engine, t, size - tier.free, started)
            for task in mine:
                _raise_failed(tier, task, wait_for_close)
            if batch:
                continue  # (evicting packed values frees room only when a slab empties)
            reads = {read for read, copy in engine.reads[t].items() if not copy.holds} if read_waits < READ_WAITS else set()
            pending = engine.demotions[t] | engine.incoming[t] | engine.releases[t] | reads  # each ends with room or a victim
            if not pending:
                if tier.free >= tier.allocation_size(nbytes):
                    continue
                copies = [c for e in engine.entries.values() if (c := e.copy_on(t)) is not None]
                held = sum(c.nbytes for c in copies if c.users)
                # (a value deleted or replaced while a read, pop or write-back still uses its copy)
                retiring = max(tier.live_bytes - sum(c.nbytes for c in copies), 0)
                failure = engine.policy_failures.get(t)
                need = tier.allocation_size(nbytes)
                takes = ("" if need <= nbytes else f" (it takes a new slab of {format_bytes(need)}: values this small share slabs)"
                         if tier.value_size(nbytes) < need else f" (it takes {format_bytes(need)} with its alignment)")
                engine.room_unreachable(t)
                raise TierFullError(
                    f"tier {tier.name!r} cannot make room for {format_bytes(nbytes)}{takes}: {format_bytes(tier.free)} free, "
                    f"{format_bytes(held)} held or in transfer"
                    + (f", {format_bytes(retiring)} in values deleted or replaced that a read still uses" if retiring else "")
                    + (f" (its eviction policy's {failure})" if failure else "")
                )
            # A close that seals wakes the wait (``make_room`` then waits for its outcome or
            # refuses): room on its way may come only after it, or never (a kernel that never
            # ends, a hold kept open across the close).
            read_waits += bool(reads)
            line = LOOKED if looked else COVERED
            waiter, placed = engine.wait_for_room(t, nbytes, pending, line=line, first=line in lined)
            if placed:
                lined.add(line)
            try:
                await _counting_on_room(engine, t, size - tier.free if deficit <= 0 else 0, [waiter])
            except BaseException:
                if placed:
                    engine.leave_room_queue(t, line, waiter)
                raise
            woken = line if placed else None
    finally:
        for line in lined:  # (it leaves, with its room, a close or an error: the next of each line it was in looks)
            engine.room_looked(t, line, True)
        if any(not task.done() for task in mine):
            await asyncio.wait(mine)  # (they run on even if the request is cancelled)
    for task in mine:
        _raise_failed(tier, task, wait_for_close)


async def _counting_on_room(engine: Engine, t: int, nbytes: int, awaitables: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for ``awaitables`` counting on ``nbytes`` of the room on its way to tier ``t``
    (``Engine.claimed``: the part of its value's room it does not have yet). Counted by every
    request, one eviction's room kept a hundred requests for small values waiting on it:
    evictions went one after another, each that ended waking them all (an optimizer's step of
    3,000 states of 8,192 parameters: 2-13 s where 1.2-3 s now)."""
    nbytes = max(nbytes, 0)
    engine.claimed[t] += nbytes
    try:
        await asyncio.wait(awaitables)
    finally:
        engine.claimed[t] -= nbytes


def _next_victim(engine: Engine, t: int) -> tuple[Entry, Copy] | None:
    """The copy the tier's policy chooses among those no one uses or holds."""
    policy = engine.policies[t]
    if policy is None:
        return None
    entries = engine.entries

    below = engine.tiers[t + 1] if t + 1 < len(engine.tiers) else None
    # The last tier, if a memory tier, evicts nothing: a victim that would be written back
    # into it must fit there, or the request fails having changed nothing.
    last_memory = below if isinstance(below, MemoryTier) and engine.policies[t + 1] is None else None

    def evictable(key: str) -> bool:
        entry = entries.get(key)
        copy = entry.copy_on(t) if entry is not None else None
        if copy is None:
            return True
        if copy.users > (id(copy) in engine.early_writes) or not copy.in_policy:  # (an early write-back's use: it waits for it)
            return False
        if last_memory is None or entry.valid(t + 1) is not None:  # type: ignore[union-attr]
            return True
        return last_memory.free >= last_memory.allocation_size(entry.meta.nbytes)  # type: ignore[union-attr]

    # (every key it refuses is then in use, a use whose end ``Engine.unuse`` tells the policy)
    evictable.releases = last_memory is None  # type: ignore[attr-defined]
    stale: set[str] = set()
    while True:
        try:
            key = policy.victim(evictable)
        except Exception as exc:
            name = policy_name(policy)
            raise PolicyError(f"eviction policy {name!r} of tier {engine.names[t]!r} raised {exc!r} in victim(): the request "
                              "failed, having changed no value (the victims it had chosen stay)") from exc
        if key is None:
            if t in engine.policy_failures:
                return _untracked_victim(engine, t, evictable)
            _warn_if_none_was_wrong(engine, t, policy, evictable)
            return None
        if not isinstance(key, str):  # (an unhashable one raised TypeError from the lookup)
            name = policy_name(policy)
            raise PolicyError(f"eviction policy {name!r} of tier {engine.names[t]!r} named victim {key!r:.80}, which is not "
                              "a key: victim() must return a key given to on_insert, or None")
        entry = engine.entries.get(key)
        copy = entry.copy_on(t) if entry is not None else None
        if entry is None or copy is None or not copy.in_policy:
            # The policy knew a key the store no longer has here: ask again, but not forever (a
            # policy that names a key it never had, or one it did not forget, would be asked
            # on and on, the loop stuck with it).
            if key in stale or len(stale) > len(entries):
                name = policy_name(policy)
                raise PolicyError(
                    f"eviction policy {name!r} of tier {engine.names[t]!r} named victim {key!r}, which is not on that tier "
                    "(or named it before without forgetting it): victim() must forget and return a key given to "
                    "on_insert and not removed since"
                )
            stale.add(key)
            continue
        copy.in_policy = False  # victim() has forgotten it already
        if engine.trace is not None:
            engine.trace.evicted(key, copy.nbytes, t)
        return entry, copy


def _warn_if_none_was_wrong(engine: Engine, t: int, policy: object, evictable: Callable[[str], bool]) -> None:
    """Warn once per tier when ``victim()`` said None (no tracked key may go) while a value it
    was told of could have gone: the request then lands on a slower tier, with no error. Looked
    at the first, second, fourth, eighth... time it says None."""
    about = ("victim None", t)
    if engine.warned(about):
        return
    engine.none_victims[t] += 1
    if (count := engine.none_victims[t]) & (count - 1):
        return  # (the scan reads every entry: at each None, 4,000 puts in flight at once took 68 s, most of it here)
    could = [e.key for e in engine.entries.values() if (c := e.copy_on(t)) is not None and c.in_policy and evictable(e.key)]
    if could:
        engine.warn_once(about, (
            f"the eviction policy {policy_name(policy)} of tier {engine.names[t]!r} returned None from victim() while "
            f"{len(could)} value(s) it was told of could go (e.g. {could[0]!r}): requests that needed room there went "
            "to slower tiers; victim() returns None only when no key it tracks may go (warned once per tier)"))


def _untracked_victim(engine: Engine, t: int, evictable: Callable[[str], bool]) -> tuple[Entry, Copy] | None:
    """Where the tier's policy raised in ``on_insert`` (``Engine._eviction_policy_failed``),
    copies it was never told of are victims too once it has none left (the first found, no
    order kept): the tier does not fill up with them."""
    for entry in engine.entries.values():
        copy = entry.copy_on(t)
        if copy is not None and copy.in_memory and not copy.in_policy and copy.users == 0 and copy.holds == 0:
            copy.in_policy = True  # (what evictable() asks of a copy: the policy's own copies)
            usable = evictable(entry.key)
            copy.in_policy = False
            if usable:
                if engine.trace is not None:
                    engine.trace.evicted(entry.key, copy.nbytes, t)
                return entry, copy
    return None


def _start_demotion(engine: Engine, entry: Entry, t: int, copy: Copy, priority: Priority) -> asyncio.Task[None]:
    size = copy.nbytes
    engine.freeing[t] += size
    task = asyncio.ensure_future(_demote(engine, entry, t, copy, priority))
    engine.demotions[t].add(task)

    def finished(task: asyncio.Task[None]) -> None:
        engine.freeing[t] -= size
        engine.demotions[t].discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the requester reports it

    task.add_done_callback(finished)
    return task


def _taken(copy: Copy) -> bool:
    """Whether a hold or another use took ``copy`` since it was chosen (then it stays: a held
    buffer may be changing, and a write hold makes it the only current value)."""
    return copy.holds > 0 or copy.users > 1


def _needs_write_back(engine: Engine, entry: Entry, t: int, copy: Copy) -> bool:
    """Whether dropping ``copy`` from tier ``t`` would lose the current value (no slower tier holds it)."""
    current = engine.entries.get(entry.key) is entry and copy.version == entry.version
    return current and not any(s > t for s in entry.valid_tiers())


def _demotion_waits(engine: Engine, entry: Entry, t: int, copy: Copy) -> bool:
    """Whether ``_demote`` of ``copy`` would wait: for an early write-back of it under way, or
    to write its value one tier down."""
    if id(copy) in engine.early_writes:
        return True
    return not _taken(copy) and _needs_write_back(engine, entry, t, copy)


def _demote_at_once(engine: Engine, entry: Entry, t: int, copy: Copy) -> None:
    """``_demote`` of a copy whose demotion waits for nothing (``_demotion_waits``), run now."""
    try:
        if not _taken(copy):
            _drop(engine, entry, t, copy, copy.version)
    finally:
        _done_with(engine, entry, t, copy)


async def _demote(engine: Engine, entry: Entry, t: int, copy: Copy, priority: Priority) -> None:
    """Move ``copy`` (already in use by us) off tier ``t``: write it back one tier down
    unless a slower tier holds the value already, then drop it.

    The task starts a moment after the copy was chosen; if a hold took the copy meanwhile,
    or takes it during the write-back, the copy stays."""
    try:
        early = engine.early_writes.get(id(copy))
        if early is not None:
            await asyncio.wait([early])  # then the value is on the disk (unless it changed)
        if _taken(copy):
            return
        version = copy.version
        if _needs_write_back(engine, entry, t, copy):
            if t + 1 >= len(engine.tiers):
                raise TierFullError(f"tier {engine.names[t]!r} is the last tier; nothing can be evicted from it")
            await engine.write_back(entry, copy, priority)
        _drop(engine, entry, t, copy, version)
    finally:
        _done_with(engine, entry, t, copy)


def _drop(engine: Engine, entry: Entry, t: int, copy: Copy, version: int) -> None:
    """Retire ``copy`` from tier ``t`` unless it was replaced, held or changed since ``version``."""
    if entry.copy_on(t) is copy and copy.holds == 0 and copy.version == version:
        engine.retire(entry, t, copy)
        engine.counters.tier(engine.names[t]).evictions += 1


def _done_with(engine: Engine, entry: Entry, t: int, copy: Copy) -> None:
    """Let go of the demotion's use of ``copy``; one that stayed is known to the policy again."""
    engine.unuse(entry, copy)
    if not copy.retired and entry.copy_on(t) is copy:
        engine.policy_insert(entry, copy)


def write_early(engine: Engine, entry: Entry, t: int, priority: Priority = Priority.PREFETCH) -> bool:
    """Start writing ``entry``'s current copy on memory tier ``t`` to the disk tier right below
    it, keeping the copy (see the module docstring). Returns False, starting nothing, when there
    is nothing to do: no current copy there, a write hold open, the value already on a slower
    tier, a write-back of it under way, or no disk tier right below. The store's close waits
    for the write; a write that fails changes nothing (the eviction writes it then)."""
    copy = entry.valid(t)
    if copy is None or copy.writing or entry.writer is not None or id(copy) in engine.early_writes or copy.buffer is None:
        return False
    if engine.disk_index != t + 1 or any(s > t for s in entry.valid_tiers()):
        return False
    engine.use(entry, copy)
    key = id(copy)

    async def write() -> None:
        try:
            await engine.write_back(entry, copy, priority)
            if entry.valid(t + 1) is not None:
                engine.observe("writeback", entry.key, entry.meta.nbytes, t + 1, hit=None)
        finally:
            engine.early_writes.pop(key, None)
            engine.unuse(entry, copy)

    task = engine._track(write())
    engine.early_writes[key] = task
    task.add_done_callback(_retrieve)
    return True


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # (an early write-back that failed: the eviction writes the value itself)


def _raise_failed(tier: Tier, task: asyncio.Task[None], wait_for_close: bool) -> None:
    """Raise ``TierFullError`` if the demotion ``task`` ended with an error (``StoreClosedError``
    if the store closed under it; nothing for a request that waits for the close's outcome: the
    demotion changed nothing, and ``make_room`` waits, then evicts again if the close failed)."""
    if task.done() and not task.cancelled() and task.exception() is not None:
        if isinstance(task.exception(), StoreClosedError):
            if wait_for_close:
                return
            raise StoreClosedError(str(task.exception())) from task.exception()
        raise TierFullError(f"cannot make room on tier {tier.name!r}: {task.exception()}") from task.exception()
