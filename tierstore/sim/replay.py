"""Replay a store's own trace under the store's residency rules, to check what it evicted.

``simulate`` models a cache hierarchy in general (and matches libCacheSim); this module models
``TierStore`` itself, so that a store trace replayed here gives the same misses and the same
evictions, one by one, as the store that recorded it. The rules (``tierstore.engine``):

- Memory tiers have byte capacities. By default a copy occupies its ``nbytes``; given the
  store's memory tier objects (``accounting=``, fresh ones of the same classes and capacities),
  the replay allocates from them and so accounts exactly as the store does (page rounding,
  small values packed in slabs: room that depends on what the tier holds). A copy's size there
  is what its tier's policy is told. The last tier of the store has no eviction policy: a disk
  tier holds everything, a memory tier refuses when full.
- **put** (the row's tier is where it landed): room is made on that tier (the key's old copies
  still count and may be chosen as victims), then every other memory copy of the key is
  dropped (``on_remove``) and the new copy installed (``on_insert``); a put to the disk tier
  drops every memory copy. The new value is valid only where it was written. A put the store
  copied over the key's value on its tier (``tierstore.overwrite``; the row's ``hit`` is 1)
  makes no room: the key's other memory copies are dropped (``on_remove``) and that copy is a
  hit (``on_hit``).
- **get** / **hold** on tier ``t``: a hit when ``t`` holds the current value (``on_hit`` there).
  A miss reads the fastest other tier holding it, whose policy gets ``on_hit`` first; that copy
  is in use (not evictable) while room is made on ``t`` and the value is installed there. A
  value larger than ``t`` is read uncached. Reads on the disk tier count but move nothing.
- **making room** on tier ``t`` for the room a value needs, in rounds while the tier's free
  room is short: victims are chosen one after another (each ``victim(evictable)``, copies in
  use excluded) until their sizes cover the shortfall; then each victim in turn is written
  back to tier ``t + 1`` if no slower tier holds its current value (making room there the same
  way: a cascade), and dropped from ``t``. (Freeing a packed value frees room only when its
  slab empties, hence the rounds.)
- **pop** on tier ``t``: a hit when ``t`` holds the current value (``on_hit`` there); either
  way nothing is cached and the key is dropped everywhere.
- **writeback** (a flush or a write-through put committed the current value to the disk): the
  disk tier holds it from then on, so evicting its memory copies writes nothing back. A put
  followed by its writeback row is a write-through put when its ``hit`` is -1 (a write-back
  put's is 0 or 1: ``tierstore.tracing``): it commits on the disk first, so the key's old
  memory copies are gone before room is made for the new one.
- **update** (a write hold released on tier ``t``): the copy there is the only current value;
  the key's other memory copies are dropped (``on_remove``) and the disk's is stale.
- **prefetch** (recorded once a prefetch brought the value up to tier ``t``): as a get's miss
  on ``t`` (the source's ``on_hit``, room made, the copy installed), counted as no request.
- **delete** drops the key everywhere. Evict rows are not requests.

Keys present before the trace started are taken to be on the disk tier only. A hold's
duration is not in a trace, so traces with holds open across other requests do not replay
exactly; neither do concurrent requests (their order of admission is not
recorded). A write-back that finds no room below (only possible when the last tier is a full
memory tier, or every copy there is in use) raises ``TierFullError``: the replay does not model
what the store does then.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TierFullError, TraceError, UnknownTierError
from ..tensors import storage_nbytes
from ..tiers.base import MemoryTier
from .simulator import check_one_instance, make_eviction_policy
from .trace import store_npz, store_rows

#: The rows a replay applies besides prefetches (requests, and the writeback and update state
#: changes); evict rows are skipped (the replay chooses its own).
REQUESTS = ("get", "put", "delete", "hold", "pop", "writeback", "update")
#: Rows that move copies or change state but are no access (not counted, not in MIN's future).
_NOT_REQUESTS = ("writeback", "update", "prefetch")


class NextUse:
    """When each key is used next in a sequence of uses: ``oracle(key)`` is the first position
    after ``oracle.now`` where ``key`` occurs (``inf`` if none). The future ``MIN`` needs, for a
    replay (positions of request rows) and for a live run that knows its own future."""

    def __init__(self, keys: Sequence[Hashable]) -> None:
        self.positions: dict[Hashable, list[int]] = {}
        for position, key in enumerate(keys):
            self.positions.setdefault(key, []).append(position)
        self.now = 0

    def __call__(self, key: Hashable) -> float:
        positions = self.positions.get(key)
        if not positions:
            return float("inf")
        i = bisect.bisect_right(positions, self.now)
        return positions[i] if i < len(positions) else float("inf")


@dataclass
class ReplayResult:
    """What the replay saw: requests and misses per tier name, each request's hit or miss (get,
    hold and pop rows, in order), and the evictions ``(key, tier index)`` in the order chosen."""

    tiers: list[str]
    requests: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    hits: list[bool] = field(default_factory=list)
    evictions: list[tuple[str, int]] = field(default_factory=list)

    def evictions_on(self, tier: int | str) -> list[str]:
        """The keys evicted from one tier (by index or name), in order."""
        index = self.tiers.index(tier) if isinstance(tier, str) else tier
        return [key for key, t in self.evictions if t == index]


@dataclass
class _Row:
    op: str
    key: str
    nbytes: int
    tier: int
    hit: int = -1


def read_store_trace(path: str | Path) -> tuple[list[str], list[_Row]]:
    """The tier names and the rows a replay applies (``REQUESTS`` and prefetches) of a store
    ``.npz`` trace."""
    with store_npz(path) as data:
        ops, codes, keys, key_ids, sizes, _, _ = store_rows(data, path, timed=False)  # (checked as the simulator checks them)
        tiers = [str(name) for name in data["tiers"]]
        hits = data["hit"].tolist() if "hit" in data else [-1] * len(codes)
        columns = zip(codes.tolist(), key_ids.tolist(), sizes.tolist(), data["tier"].tolist(), hits, strict=True)
        rows = []
        for op_index, key, nbytes, tier, hit in columns:
            op = ops[op_index]
            if op in REQUESTS or op == "prefetch":
                rows.append(_Row(op, keys[key], int(nbytes), int(tier), int(hit)))
            elif op != "evict":
                raise TraceError(f"{path}: unknown op {op!r}")
    return tiers, rows


def replay_store_trace(
    trace: str | Path,
    capacities: Mapping[str, int] | Sequence[int],
    eviction: str | Callable[[], Any] = "lru",
    accounting: Sequence[MemoryTier] | None = None,
) -> ReplayResult:
    """Replay the store trace at ``trace`` with the store's own rules (module docstring).

    Parameters
    ----------
    trace:
        A ``.npz`` file written by ``TierStore(trace=...)``.
    capacities:
        Byte capacities of the store's memory tiers, fastest first, as a list or by tier name.
        If the trace names one tier more, that last tier is the disk tier.
    eviction:
        A policy name (lru, fifo, lfu, arc, s3fifo, min) or a factory called once per tier
        that evicts (an instance where one tier evicts); ``min`` sees the future of the trace's
        request rows (``NextUse``).
    accounting:
        Unopened memory tiers of the classes and capacities of the store's (one per capacity)
        to allocate from, so that room is accounted as the store accounts it; they are used up
        (copies stay allocated in them). Default: a value occupies its ``nbytes``.

    Returns
    -------
    ReplayResult
        Requests, misses, per-request hits and evictions.
    """
    if not isinstance(trace, str | os.PathLike):  # (a Trace has lost the rows this replay needs: tiers, write-backs)
        raise TypeError(f"replay_store_trace takes the path of a store's .npz trace, not a {type(trace).__name__}; "
                        "a Trace object (load_trace's) goes to simulate()")
    names, rows = read_store_trace(trace)
    if isinstance(capacities, Mapping):
        given = list(capacities)
        if given != names[: len(given)]:
            raise UnknownTierError(f"capacities are for tiers {given}; the trace's tiers are {names}")
        sizes = [int(capacities[name]) for name in given]
    else:
        sizes = [int(capacity) for capacity in capacities]
    if len(names) not in (len(sizes), len(sizes) + 1) or not sizes:
        raise UnknownTierError(f"{len(sizes)} memory tier capacities for a trace of tiers {names} (a disk tier may be one more)")
    check_one_instance(eviction, names[: len(sizes) if len(names) > len(sizes) else len(sizes) - 1])  # (the tiers that evict)
    if accounting is None:
        rooms: list[_Room] = [_Bytes(capacity) for capacity in sizes]
    else:
        if [tier.capacity for tier in accounting] != sizes:
            raise UnknownTierError(f"accounting tiers of {[t.capacity for t in accounting]} bytes for capacities {sizes}")
        rooms = [_TierRoom(tier) for tier in accounting]
    requests = [row for row in rows if row.op not in _NOT_REQUESTS]
    oracle = NextUse([row.key for row in requests])
    policies = [make_eviction_policy(eviction, oracle, capacity) for capacity in sizes[:-1]]
    if len(names) == len(sizes):
        policies.append(None)  # the last memory tier refuses when full
    else:
        policies.append(make_eviction_policy(eviction, oracle, sizes[-1]))
    replay = _StoreModel(names, rooms, policies, ReplayResult(names))
    position = 0
    for i, row in enumerate(rows):
        oracle.now = position
        following = rows[i + 1] if i + 1 < len(rows) else None
        # (a write-through put: its row's ``hit`` is -1 and its writeback row follows; a
        # write-back put's is 0 or 1, so a flush right after it is not taken for one)
        through = row.op == "put" and row.hit == -1 and following is not None and following.op == "writeback" and following.key == row.key
        replay.apply(row, through)
        position += row.op not in _NOT_REQUESTS
    return replay.result


class _Room:
    """Room on one memory tier: what a value needs, what is free, taking and giving back."""

    capacity: int

    def needed(self, nbytes: int) -> int:
        raise NotImplementedError

    def free(self) -> int:
        raise NotImplementedError

    def take(self, nbytes: int) -> tuple[Any, int]:
        """Allocate for a value: a handle and the bytes the copy occupies."""
        raise NotImplementedError

    def give(self, handle: Any) -> None:
        raise NotImplementedError


class _Bytes(_Room):
    """Each value occupies its size."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0

    def needed(self, nbytes: int) -> int:
        return nbytes

    def free(self) -> int:
        return self.capacity - self.used

    def take(self, nbytes: int) -> tuple[Any, int]:
        self.used += nbytes
        return nbytes, nbytes

    def give(self, handle: Any) -> None:
        self.used -= handle


class _TierRoom(_Room):
    """A memory tier's own allocator, so that room is what the store sees."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier, self.capacity = tier, tier.capacity

    def needed(self, nbytes: int) -> int:
        return self.tier.allocation_size(nbytes)

    def free(self) -> int:
        return self.tier.free

    def take(self, nbytes: int) -> tuple[Any, int]:
        buffer = self.tier.allocate(nbytes)
        return buffer, storage_nbytes(buffer)

    def give(self, handle: Any) -> None:
        self.tier.release(handle)


class _StoreModel:
    """Keys, copies and policies of a store, without values."""

    def __init__(self, names: list[str], rooms: list[_Room], policies: list[Any], result: ReplayResult) -> None:
        self.names, self.rooms, self.policies, self.result = names, rooms, policies, result
        self.memory = len(rooms)
        self.disk = self.memory if len(names) > self.memory else None
        #: Per memory tier: key -> (allocation handle, bytes the copy occupies).
        self.resident: list[dict[str, tuple[Any, int]]] = [{} for _ in rooms]
        self.valid: dict[str, set[int]] = {}
        self.nbytes: dict[str, int] = {}
        self.in_use: set[tuple[str, int]] = set()
        result.requests = {name: 0 for name in names}
        result.misses = {name: 0 for name in names}

    def apply(self, row: _Row, through: bool = False) -> None:
        """Apply one row; ``through``: a put whose writeback row follows (a write-through put)."""
        if row.op == "put":
            self._put(row.key, row.nbytes, self._tier(row), through, over=row.hit == 1)
        elif row.op == "delete":
            self._forget(row.key)
        elif row.op == "pop":
            self._pop(row.key, self._tier(row))
        elif row.op == "writeback":
            if row.key in self.valid and self.disk is not None:
                self.valid[row.key].add(self.disk)
        elif row.op == "prefetch":  # a copy brought up ahead (recorded once there): no request
            self._get(row.key, row.nbytes, self._tier(row), request=False)
        elif row.op == "update":  # a write hold released: its copy is the only current one
            t = self._tier(row)
            self._drop_memory(row.key, keep=t)
            self.valid[row.key] = {t}
        else:
            self._get(row.key, row.nbytes, self._tier(row))

    def _tier(self, row: _Row) -> int:
        if not 0 <= row.tier < len(self.names):
            raise TraceError(f"a {row.op} of {row.key!r} names tier {row.tier}; the trace has tiers {self.names}")
        return row.tier

    def _put(self, key: str, nbytes: int, t: int, through: bool = False, over: bool = False) -> None:
        """A put landed on tier ``t``; ``over``: copied over the key's value there."""
        if through:  # committed on the disk first: the old memory copies are gone before room is made
            self._drop_memory(key)
            self.valid[key] = {self.disk} if self.disk is not None else set()
        elif over and t != self.disk and t in self.valid.get(key, ()) and key in self.resident[t]:
            self._drop_memory(key, keep=t)
            self.nbytes[key] = nbytes
            self.valid[key] = {t}
            self._hit(t, key)
            return
        if t != self.disk:
            self._make_room(t, nbytes, key)
            taken = self.rooms[t].take(nbytes)
        self._drop_memory(key)
        self.nbytes[key] = nbytes
        self.valid[key] = {t}
        if t != self.disk:
            self._install(t, key, taken)

    def _get(self, key: str, nbytes: int, t: int, request: bool = True) -> None:
        """A read on tier ``t`` (``request=False``: a prefetch, which counts nothing)."""
        name = self.names[t]
        if request:
            self.result.requests[name] += 1
        if key not in self.valid:
            if self.disk is None:
                raise TraceError(f"{key!r} is read before it is written, and the store has no disk tier to hold it")
            self.valid[key], self.nbytes[key] = {self.disk}, nbytes
        valid = self.valid[key]
        if t in valid:
            if request:  # (a prefetch finding the copy there touches nothing)
                self.result.hits.append(True)
                if t != self.disk:
                    self._hit(t, key)
            return
        if request:
            self.result.hits.append(False)
            self.result.misses[name] += 1
        if t == self.disk:
            return
        source = min(valid)
        if source != self.disk:
            self._hit(source, key)
        needed = self.rooms[t].needed(nbytes)
        if needed > self.rooms[t].capacity:
            return  # read uncached
        self.in_use.add((key, source))
        try:
            self._make_room(t, nbytes, key)
        finally:
            self._release(key, source)
        taken = self.rooms[t].take(nbytes)
        valid.add(t)
        self._install(t, key, taken)

    def _pop(self, key: str, t: int) -> None:
        self.result.requests[self.names[t]] += 1
        hit = t in self.valid.get(key, ())
        self.result.hits.append(hit)
        if hit and t != self.disk:
            self._hit(t, key)
        elif not hit:
            self.result.misses[self.names[t]] += 1
        self._forget(key)

    def _forget(self, key: str) -> None:
        self._drop_memory(key)
        self.valid.pop(key, None)
        self.nbytes.pop(key, None)

    def _hit(self, t: int, key: str) -> None:
        policy = self.policies[t]
        if policy is not None:
            policy.on_hit(key)

    def _install(self, t: int, key: str, taken: tuple[Any, int]) -> None:
        self.resident[t][key] = taken
        policy = self.policies[t]
        if policy is not None:
            policy.on_insert(key, taken[1])

    def _drop(self, t: int, key: str) -> bool:
        taken = self.resident[t].pop(key, None)
        if taken is None:
            return False
        self.rooms[t].give(taken[0])
        return True

    def _drop_memory(self, key: str, keep: int | None = None) -> None:
        """Drop ``key``'s memory copies (but the one on tier ``keep``), telling their policies."""
        for t in range(self.memory):
            if t != keep and self._drop(t, key):
                policy = self.policies[t]
                if policy is not None:
                    policy.on_remove(key)

    def _make_room(self, t: int, nbytes: int, key: str) -> None:
        """Evict from tier ``t`` until a value of ``nbytes`` (of ``key``, about to be inserted)
        can be allocated; what that takes is asked again after each round (a freed slot of the
        value's slab class is room enough)."""
        room, policy = self.rooms[t], self.policies[t]
        before = getattr(policy, "before_insert", None)
        if before is not None:
            before(key, nbytes)
        if room.needed(nbytes) > room.capacity:
            raise TierFullError(f"{room.needed(nbytes)} bytes is more than tier {self.names[t]!r} holds ({room.capacity})")
        while room.free() < (needed := room.needed(nbytes)):
            shortfall = needed - room.free()
            chosen: list[str] = []
            while shortfall > 0:
                victim = policy.victim(self._evictable_on(t)) if policy is not None else None
                if victim is None:
                    break
                self.result.evictions.append((victim, t))
                shortfall -= self.resident[t][victim][1]
                chosen.append(victim)
            if not chosen:
                raise TierFullError(f"replay: no room for {needed} bytes on tier {self.names[t]!r} (the store would refuse here)")
            for victim in chosen:
                self._demote(t, victim)

    def _evictable_on(self, t: int) -> Callable[[str], bool]:
        """``_evictable`` of tier ``t``, marked as the store marks its own (``releases``: every
        key it refuses is in use, a use whose end ``on_release`` tells) where it is so."""
        def evictable(key: str) -> bool:
            return self._evictable(key, t)

        below = t + 1
        evictable.releases = below >= self.memory or self.policies[below] is not None  # type: ignore[attr-defined]
        return evictable

    def _release(self, key: str, t: int) -> None:
        """End the use of ``key``'s copy on tier ``t``, telling its policy as the store does
        (``Engine.unuse``: an optional ``on_release``)."""
        self.in_use.discard((key, t))
        release = getattr(self.policies[t], "on_release", None) if t < len(self.policies) else None  # (the disk: none)
        if release is not None and key in self.resident[t]:
            release(key)

    def _evictable(self, key: str, t: int) -> bool:
        """Not in use; and if it would be written back into a last memory tier (which evicts
        nothing), it fits there -- as the store asks."""
        if (key, t) in self.in_use:
            return False
        below = t + 1
        if below >= self.memory or self.policies[below] is not None or any(s > t for s in self.valid.get(key, ())):
            return True
        return self.rooms[below].free() >= self.rooms[below].needed(self.nbytes[key])

    def _demote(self, t: int, key: str) -> None:
        valid = self.valid[key]
        if not any(s > t for s in valid):
            below = t + 1
            if below == self.disk:
                valid.add(below)
            else:
                nbytes = self.nbytes[key]
                self.in_use.add((key, t))
                try:
                    self._make_room(below, nbytes, key)
                finally:
                    self._release(key, t)
                taken = self.rooms[below].take(nbytes)
                valid.add(below)
                self._install(below, key, taken)
        self._drop(t, key)
        valid.discard(t)
