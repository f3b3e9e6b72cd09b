"""Replay a trace against tiers, an eviction policy and a prefetch policy (semantics: see the
package docstring). No tensors move: only keys, sizes and a clock."""

from __future__ import annotations

import bisect
import math
import numbers
import operator
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

import numpy as np

from ..errors import PolicyError
from ..protocols import (
    PREFETCH_CALLED,
    EvictionPolicy,
    PrefetchPolicy,
    missing_methods,
    policy_name,
)
from ..suggestions import read_suggestions
from ..units import parse_bytes
from .links import LinkModel
from .trace import DELETE, Trace


@dataclass
class SimResult:
    """One combination's outcome. Ratios are of demand requests at the fastest tier."""

    eviction: str
    prefetch: str
    capacity: int
    capacities: dict[str, int]
    requests: int = 0
    misses: int = 0
    requested_bytes: int = 0
    missed_bytes: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    link_bytes: dict[str, int] = field(default_factory=dict)
    prefetches: int = 0
    prefetches_dropped: int = 0
    stall_seconds: float = 0.0
    compute_seconds: float = 0.0
    sim_seconds: float = 0.0
    #: Per tier the prefetches went to: ``PrefetchStats.to_json()`` (accuracy, coverage, ...).
    prefetch_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Who simulated: ``tierstore``, or ``libcachesim`` for its own policies.
    engine: str = "tierstore"

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.requests if self.requests else 0.0

    @property
    def byte_miss_ratio(self) -> float:
        return self.missed_bytes / self.requested_bytes if self.requested_bytes else 0.0

    @property
    def accesses_per_second(self) -> float:
        return self.requests / self.sim_seconds if self.sim_seconds else math.inf

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record.update(miss_ratio=self.miss_ratio, byte_miss_ratio=self.byte_miss_ratio, accesses_per_second=self.accesses_per_second)
        return record


@dataclass
class PrefetchStats:
    """What the prefetches to one tier did.

    ``issued``: prefetches admitted to the tier. ``useful``: of those, used by a demand access
    before leaving the tier; ``late`` of the useful ones were still in flight then (the access
    waited ``late_seconds`` in all); ``unused``: evicted before any use. ``demand_misses``:
    demand accesses that found the key neither on this tier nor on a faster one.
    ``polluting_misses``: demand misses on keys a prefetch had pushed out of the tier.

    accuracy = useful / issued; coverage = useful / (useful + demand misses), the share of
    this tier's misses that prefetching removed; timeliness = on-time share of the useful ones;
    pollution = polluting misses / demand misses."""

    issued: int = 0
    useful: int = 0
    late: int = 0
    late_seconds: float = 0.0
    unused: int = 0
    demand_misses: int = 0
    polluting_misses: int = 0

    @property
    def accuracy(self) -> float:
        return self.useful / self.issued if self.issued else 0.0

    @property
    def coverage(self) -> float:
        return self.useful / (self.useful + self.demand_misses) if self.useful + self.demand_misses else 0.0

    @property
    def timeliness(self) -> float:
        return (self.useful - self.late) / self.useful if self.useful else 0.0

    @property
    def pollution(self) -> float:
        return self.polluting_misses / self.demand_misses if self.demand_misses else 0.0

    def to_json(self) -> dict[str, float]:
        record: dict[str, float] = asdict(self)
        record.update(accuracy=self.accuracy, coverage=self.coverage, timeliness=self.timeliness, pollution=self.pollution,
                      mean_lateness_seconds=self.late_seconds / self.late if self.late else 0.0)
        return record


class _Oracle:
    """The trace's future: when is key ``k`` next accessed after the current position."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._positions: dict[int, list[int]] | None = None  # built on first use (MIN, prefetch)
        self.now = 0

    @property
    def positions(self) -> dict[int, list[int]]:
        if self._positions is None:
            ids = self.trace.ids
            order = np.argsort(ids, kind="stable")
            boundaries = np.flatnonzero(np.diff(ids[order])) + 1
            self._positions = {}
            for chunk in np.split(order, boundaries):
                if len(chunk):
                    self._positions[int(ids[chunk[0]])] = chunk.tolist()
        return self._positions

    def __call__(self, key: int) -> float:
        positions = self.positions.get(key)
        if not positions:
            return math.inf
        i = bisect.bisect_right(positions, self.now)
        return positions[i] if i < len(positions) else math.inf


@dataclass
class _Tier:
    name: str
    capacity: int
    policy: Any
    resident: dict[int, int] = field(default_factory=dict)
    used: int = 0


def simulate(
    trace: Trace,
    capacities: dict[str, int],
    eviction: str | EvictionPolicy | Callable[[], Any] = "lru",
    prefetch: str | PrefetchPolicy | Callable[[], Any] = "none",
    links: LinkModel | None = None,
    think: float | None = None,
) -> SimResult:
    """Replay ``trace``. ``capacities`` maps tier names to bytes, fastest first (the disk below
    them holds everything; any names: a store's trace may be replayed against other tiers than
    its store's). ``eviction`` is a policy
    name (``policies.EVICTION``, or ``min``), a class or factory called once per tier, or, with
    one tier, an instance; ``prefetch`` a name (``policies.PREFETCH``), an instance, or a class
    or factory, as ``TierStore`` takes them. An instance is ``reset()`` first. ``think`` is
    compute time per access in seconds (default: the trace's own gaps, else 0).

    Policies see the trace's keys as int ids (``trace.keys[id]`` is the name); a prefetch policy
    may suggest a key by its id or, as in a live store, by its name.

    One tier without prefetch is the hot path: a policy with a ``replay(keys, sizes, capacity)``
    method runs the whole trace in its own loop when the trace has no deletes and one size per
    key (tests hold each such method to the protocol loop's answers)."""
    from policies import NoPrefetch

    if not capacities:
        raise ValueError("give at least one tier capacity, e.g. {'host': 2 << 30}")
    capacities = {name: _capacity(name, capacity) for name, capacity in capacities.items()}
    trace.check()
    check_one_instance(eviction, list(capacities))
    links = links or LinkModel()
    oracle = _Oracle(trace)
    eviction_name = _label(eviction)

    tiers = []
    for name, capacity in capacities.items():
        tiers.append(_Tier(name, int(capacity), make_eviction_policy(eviction, oracle, capacity)))
    prefetcher = make_prefetch_policy(prefetch)
    prefetch_name = prefetch if isinstance(prefetch, str) else getattr(prefetcher, "name", type(prefetcher).__name__)
    try:
        if not isinstance(prefetch, str):
            prefetcher.reset()
        if hasattr(prefetcher, "set_capacities"):
            prefetcher.set_capacities({t.name: t.capacity for t in tiers})
    except Exception as exc:
        raise PolicyError(f"prefetch policy {policy_name(prefetcher)!r} raised {exc!r} setting up: the simulation did not start") from exc
    result = SimResult(eviction_name, prefetch_name, tiers[0].capacity, {t.name: t.capacity for t in tiers})
    result.hits_by_tier = {t.name: 0 for t in tiers}
    started = time.perf_counter()
    try:
        if len(tiers) == 1 and isinstance(prefetcher, NoPrefetch):
            _run_single(trace, tiers[0], oracle, links, result, think)
        else:
            _Replay(trace, tiers, prefetcher, oracle, links, result, think).run()
    except PolicyError:
        raise
    except Exception as exc:
        raised = _raised_in(exc, {id(t.policy): "eviction" for t in tiers} | {id(prefetcher): "prefetch"})
        if raised is None:
            raise
        role, policy, method = raised
        raise PolicyError(f"{role} policy {policy_name(policy)!r} raised {exc!r} in {method}(): the simulation stopped "
                          "(a live store warns about advice it cannot take and goes on)") from exc
    result.sim_seconds = time.perf_counter() - started
    return result


def _capacity(tier: str, capacity: Any) -> int:
    """A tier's capacity in bytes: a byte size (``2 << 30``, ``"2GiB"``), or a real number of
    bytes, rounded down (``0.5 * trace.working_set``)."""
    if isinstance(capacity, numbers.Real) and not isinstance(capacity, (bool, numbers.Integral)):
        value = float(capacity)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"capacity of tier {tier!r}: {capacity!r} is not a number of bytes of 0 or more")
        return int(value)
    try:
        return parse_bytes(capacity)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"capacity of tier {tier!r}: {exc}") from None


def _raised_in(exc: BaseException, roles: dict[int, str]) -> tuple[str, Any, str] | None:
    """``(role, policy, method)`` of the outermost frame of ``exc``'s traceback that ran a
    method of one of the policies (by ``id`` in ``roles``), or None if none did."""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in roles:
            return roles[id(owner)], owner, tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return None


def _is_factory(spec: Any, methods: tuple[str, ...]) -> TypeGuard[Callable[[], Any]]:
    """Whether a policy argument is to be called for a policy (a class, or a factory: a callable
    with none of the protocol's ``methods``) rather than used as the policy itself."""
    return isinstance(spec, type) or callable(spec) and not any(hasattr(spec, name) for name in methods)


def check_one_instance(eviction: Any, tiers: list[str]) -> None:
    """``TypeError`` for one eviction policy instance given for several tiers (as the store
    refuses it): each tier needs a policy of its own."""
    if not isinstance(eviction, str) and not _is_factory(eviction, _METHODS[EvictionPolicy]) and len(tiers) > 1:
        raise TypeError(f"one eviction policy instance ({policy_name(eviction)!r}) cannot serve the {len(tiers)} tiers "
                        f"{', '.join(tiers)}: pass its class or a factory")


def _label(eviction: Any) -> str:
    """What results call an eviction policy argument: its name, or the policy's (or factory's)."""
    if isinstance(eviction, str):
        return eviction
    if _is_factory(eviction, _METHODS[EvictionPolicy]):
        return getattr(eviction, "name", getattr(eviction, "__name__", "custom"))
    return getattr(eviction, "name", type(eviction).__name__)


def make_eviction_policy(eviction: str | EvictionPolicy | Callable[[], Any], oracle: Callable[[Any], float], capacity: int) -> Any:
    """An eviction policy from a name (``policies.EVICTION``, or ``min``), a class or factory,
    or an instance (``reset()`` here: it may have served before), sized for ``capacity``;
    ``min`` sees the future through ``oracle``."""
    from policies import EVICTION, MIN

    policy: Any
    given = False  # (an instance: not made here)
    if isinstance(eviction, str):
        if eviction == "min":
            policy = MIN(oracle)
        elif eviction in EVICTION:
            policy = EVICTION[eviction]()
        else:
            raise ValueError(f"unknown eviction policy {eviction!r}; choose from {sorted(EVICTION) + ['min']}")
    elif _is_factory(eviction, _METHODS[EvictionPolicy]):
        policy = eviction()
    else:
        policy, given = eviction, True
    _refuse_incomplete(policy, EvictionPolicy, "eviction")
    if given:
        try:
            policy.reset()
        except Exception as exc:
            raise PolicyError(f"eviction policy {policy_name(policy)!r} raised {exc!r} in reset(): the simulation did not start") from exc
    if hasattr(policy, "set_capacity"):
        policy.set_capacity(capacity)
    return policy


def make_prefetch_policy(prefetch: str | PrefetchPolicy | Callable[[], Any]) -> Any:
    """A prefetch policy from a name (``policies.PREFETCH``), an instance, or a class or factory
    (called once), as ``TierStore(prefetch=...)`` takes them."""
    from policies import PREFETCH

    if isinstance(prefetch, str):
        if prefetch not in PREFETCH:
            raise ValueError(f"unknown prefetch policy {prefetch!r}; choose from {sorted(PREFETCH)}")
        return PREFETCH[prefetch]()
    policy: Any = prefetch() if _is_factory(prefetch, (*_METHODS[PrefetchPolicy], "on_step")) else prefetch
    _refuse_incomplete(policy, PrefetchPolicy, "prefetch")
    return policy


def _refuse_incomplete(policy: Any, protocol: type, role: str) -> None:
    """Refuse a policy missing a method of ``protocol`` (the store refuses it too): it failed
    in the middle of the replay with a bare ``AttributeError``."""
    if isinstance(policy, type):  # (a factory that gave a class)
        raise TypeError(f"{role} policy {policy.__name__!r} does not implement {protocol.__name__}: "
                        "a factory gave the class, not an instance")
    missing = missing_methods(policy, _METHODS[protocol])
    if missing:
        raise TypeError(f"{role} policy {policy_name(policy)!r} does not implement {protocol.__name__}: it has no {', '.join(missing)}")


def _no_victim(policy: Any, victim: Any, tier: str, used: int, size: int, capacity: int) -> str:
    name = policy_name(policy)
    what = "no victim (None)" if victim is None else f"victim {victim!r}, which is not resident"
    return (f"eviction policy {name!r} named {what} while tier {tier!r} holds {used} of {capacity} bytes and "
            f"needs {size} more; victim() must forget and return a key given to on_insert and not removed since")


_PROTOCOL = ("on_insert", "on_hit", "on_remove", "victim", "reset", "set_capacity", "before_insert")
#: The methods the simulator calls of each kind of policy.
_METHODS: dict[type, tuple[str, ...]] = {
    EvictionPolicy: ("on_insert", "on_hit", "on_remove", "victim", "reset"),
    PrefetchPolicy: (*PREFETCH_CALLED, "reset"),  # (as the store asks, and ``reset``: on_step only where a trace has steps)
}


def _batch_path_applies(policy: Any) -> bool:
    """Whether ``policy.replay`` stands for its protocol methods: not when a subclass (or the
    instance) replaces one of them below the class that wrote ``replay``, as a researcher who
    subclasses ``LRU`` to change ``victim`` does."""
    mro = type(policy).__mro__
    owner = next((i for i, cls in enumerate(mro) if "replay" in vars(cls)), None)
    if owner is None or any(name in vars(policy) for name in _PROTOCOL):
        return False
    return not any(name in vars(cls) for cls in mro[:owner] for name in _PROTOCOL)


def _one_size_per_key(trace: Trace) -> bool:
    last = np.zeros(len(trace.keys), dtype=np.int64)
    last[trace.ids] = trace.sizes
    return bool((last[trace.ids] == trace.sizes).all())


def _run_single(trace: Trace, tier: _Tier, oracle: _Oracle, links: LinkModel, result: SimResult, think: float | None) -> None:
    """The textbook one-tier cache without prefetch, kept tight (the simulator's speed)."""
    resident, policy, capacity = tier.resident, tier.policy, tier.capacity
    link = f"disk->{tier.name}"
    bandwidth, latency = links.links.get(link, (2.5e9, 100e-6))
    if _batch_path_applies(policy) and not (trace.ops == DELETE).any() and _one_size_per_key(trace):
        sizes = trace.sizes.tolist()
        misses, missed = policy.replay(trace.ids.tolist(), sizes, capacity)
        requests, requested = len(trace), sum(sizes)  # (Python integers: each size fits an int64, their total need not)
        _fill(result, tier, link, requests, misses, requested, missed, latency, bandwidth, trace, think)
        return
    on_hit, on_insert, on_remove, victim = policy.on_hit, policy.on_insert, policy.on_remove, policy.victim
    before_insert = getattr(policy, "before_insert", None)
    used = requests = misses = requested = missed = 0
    track_time = hasattr(policy, "oracle")  # MIN reads the clock through its oracle
    for position, (key, size, op) in enumerate(zip(trace.ids.tolist(), trace.sizes.tolist(), trace.ops.tolist(), strict=True)):
        if track_time:
            oracle.now = position
        if op == DELETE:
            if key in resident:
                used -= resident.pop(key)
                on_remove(key)
            continue
        requests += 1
        requested += size
        held = resident.get(key)
        if held == size:
            on_hit(key)
            continue
        if held is not None:  # size changed: the old bytes go
            used -= resident.pop(key)
            on_remove(key)
        misses += 1
        missed += size
        if size > capacity:
            continue
        if before_insert is not None:
            before_insert(key, size)
        while used + size > capacity:
            gone = victim()
            try:
                freed = resident.pop(gone, None)
            except TypeError:  # (unhashable: not a key)
                freed = None
            if freed is None:
                raise PolicyError(_no_victim(policy, gone, tier.name, used, size, capacity))
            used -= freed
        resident[key] = size
        used += size
        on_insert(key, size)
    tier.used = used
    _fill(result, tier, link, requests, misses, requested, missed, latency, bandwidth, trace, think)


def _fill(result: SimResult, tier: _Tier, link: str, requests: int, misses: int, requested: int, missed: int,
          latency: float, bandwidth: float, trace: Trace, think: float | None) -> None:
    result.requests, result.misses, result.requested_bytes, result.missed_bytes = requests, misses, requested, missed
    result.hits_by_tier[tier.name] = requests - misses
    result.link_bytes[link] = missed
    result.stall_seconds = misses * latency + missed / bandwidth
    result.compute_seconds = _compute_time(trace, think)


def _compute_time(trace: Trace, think: float | None) -> float:
    if think is not None:
        return think * len(trace)
    if trace.times is not None and len(trace.times) > 1:
        return float(trace.times[-1] - trace.times[0])
    return 0.0


class _Replay:
    """The general replay: several tiers, prefetches, and a clock with one queue per link."""

    def __init__(self, trace: Trace, tiers: list[_Tier], prefetcher: Any, oracle: _Oracle, links: LinkModel, result: SimResult, think: float | None) -> None:
        self.trace, self.tiers, self.prefetcher, self.oracle, self.links, self.result = trace, tiers, prefetcher, oracle, links, result
        self.index = {tier.name: i for i, tier in enumerate(tiers)}
        self.sizes = np.zeros(len(trace.keys), dtype=np.int64)
        np.maximum.at(self.sizes, trace.ids, trace.sizes)
        self.size_of = self.sizes.tolist()
        self.clock = 0.0
        self.link_free: dict[str, float] = {}
        #: Prefetched copies not yet used: (tier index, key) -> when the bytes arrive there.
        self.ready: dict[tuple[int, int], float] = {}
        self.think = think
        self.stats = [PrefetchStats() for _ in tiers]
        #: Keys a prefetch pushed out of each tier (until they are admitted there again).
        self.pushed_out: list[set[int]] = [set() for _ in tiers]
        self.prefetching = False
        #: The trace's key ids by name, for suggestions by name (built at the first one).
        self.ids_by_name: dict[str, int] | None = None

    def run(self) -> None:
        trace, result, tiers = self.trace, self.result, self.tiers
        top = tiers[0]
        times = trace.times.tolist() if trace.times is not None and self.think is None else None
        step = int(trace.steps[0]) if len(trace) else 0
        for position, (key, size, op, mark) in enumerate(
            zip(trace.ids.tolist(), trace.sizes.tolist(), trace.ops.tolist(), trace.steps.tolist(), strict=True)
        ):
            self.oracle.now = position
            if mark != step:
                self.prefetcher.on_step()
                step = mark
            if times is not None and position:
                self.clock += max(0.0, times[position] - times[position - 1])
            elif self.think:
                self.clock += self.think
            if op == DELETE:
                for tier in tiers:
                    self._drop(tier, key)
                continue
            result.requests += 1
            result.requested_bytes += size
            hit = top.resident.get(key) == size
            # (first, as the store tells its prefetch policy: a ``MIN(schedule)`` asks the
            # schedule at the hit or insertion, which must have seen this access by then)
            self.prefetcher.on_access(key, size, top.name, hit)
            if hit:
                top.policy.on_hit(key)
                result.hits_by_tier[top.name] += 1
                arrival = self._use_prefetch(0, key)
                if arrival > self.clock:
                    result.stall_seconds += arrival - self.clock
                    self.clock = arrival
            else:
                result.misses += 1
                result.missed_bytes += size
                source = self._source(key, 1)
                self._count_misses(key, source)
                if source < len(tiers):
                    tiers[source].policy.on_hit(key)
                    result.hits_by_tier[tiers[source].name] += 1
                    arrival = self._use_prefetch(source, key)
                    if arrival > self.clock:  # the copy below is still on its way up there
                        result.stall_seconds += arrival - self.clock
                        self.clock = arrival
                end = self._transfer(source, 0, size)
                result.stall_seconds += end - self.clock
                self.clock = end
                self._drop(top, key)
                self._admit(0, key, size)
            self._prefetch()
        result.compute_seconds = _compute_time(trace, self.think)
        result.prefetch_stats = {tier.name: stats.to_json() for tier, stats in zip(tiers, self.stats, strict=True) if stats.issued}

    def _use_prefetch(self, t: int, key: int) -> float:
        """A demand access used the copy of ``key`` on tier ``t``: if a prefetch put it there,
        count it useful (late if it has not arrived) and return its arrival, else 0."""
        arrival = self.ready.pop((t, key), None)
        if arrival is None:
            return 0.0
        stats = self.stats[t]
        stats.useful += 1
        if arrival > self.clock:
            stats.late += 1
            stats.late_seconds += arrival - self.clock
        return arrival

    def _count_misses(self, key: int, source: int) -> None:
        """A demand access found ``key`` first on tier ``source``: a miss on every tier above."""
        for t in range(min(source, len(self.tiers))):
            stats = self.stats[t]
            stats.demand_misses += 1
            if key in self.pushed_out[t]:
                stats.polluting_misses += 1

    def _source(self, key: int, start: int) -> int:
        for j in range(start, len(self.tiers)):
            if key in self.tiers[j].resident:
                return j
        return len(self.tiers)  # the disk

    def _name(self, j: int) -> str:
        return self.tiers[j].name if j < len(self.tiers) else "disk"

    def _transfer(self, source: int, target: int, size: int) -> float:
        link = f"{self._name(source)}->{self._name(target)}"
        self.result.link_bytes[link] = self.result.link_bytes.get(link, 0) + size
        start = max(self.clock, self.link_free.get(link, 0.0))
        end = start + self.links.seconds(link, size)
        self.link_free[link] = end
        return end

    def _drop(self, tier: _Tier, key: int) -> None:
        size = tier.resident.pop(key, None)
        if size is not None:
            tier.used -= size
            tier.policy.on_remove(key)

    def _admit(self, t: int, key: int, size: int) -> bool:
        tier = self.tiers[t]
        if size > tier.capacity:
            return False
        before_insert = getattr(tier.policy, "before_insert", None)
        if before_insert is not None:
            before_insert(key, size)
        while tier.used + size > tier.capacity:
            victim = tier.policy.victim()
            try:
                gone = tier.resident.pop(victim, None)
            except TypeError:  # (unhashable: not a key)
                gone = None
            if gone is None:
                raise PolicyError(_no_victim(tier.policy, victim, tier.name, tier.used, size, tier.capacity))
            tier.used -= gone
            if self.ready.pop((t, victim), None) is not None:
                self.stats[t].unused += 1
            if self.prefetching:
                self.pushed_out[t].add(victim)
            if t + 1 < len(self.tiers) and victim not in self.tiers[t + 1].resident:
                self._transfer(t, t + 1, gone)
                self._admit(t + 1, victim, gone)
        tier.resident[key] = size
        tier.used += size
        tier.policy.on_insert(key, size)
        self.pushed_out[t].discard(key)
        return True

    def _key_id(self, key: Any) -> int | None:
        """The id of a suggested key: an id as policies are given them (numpy's integers too), or
        a key's name as a live store's policy suggests it; None for one the trace lacks."""
        if isinstance(key, str):
            if self.ids_by_name is None:
                self.ids_by_name = {name: i for i, name in enumerate(self.trace.keys)}
            return self.ids_by_name.get(key)
        try:
            key = operator.index(key)
        except TypeError:
            return None
        return key if 0 <= key < len(self.size_of) else None

    def _prefetch(self) -> None:
        try:
            suggestions = read_suggestions(self.prefetcher)
        except TypeError as exc:
            if _raised_in(exc, {id(self.prefetcher): "prefetch"}) is not None:
                raise
            raise PolicyError(f"prefetch policy {policy_name(self.prefetcher)!r}: {exc}") from exc
        for suggested, tier_name in suggestions:
            t = self.index.get(tier_name, -1) if tier_name is not None else 0
            key = self._key_id(suggested)
            if t < 0 or key is None:
                continue  # a tier or key the trace lacks: skipped, as a live store skips it
            tier = self.tiers[t]
            if key in tier.resident:
                continue
            size = self.size_of[key]
            full = tier.used + size > tier.capacity
            if full and hasattr(tier.policy, "furthest_next_use") and tier.policy.furthest_next_use() < self.oracle(key):
                self.result.prefetches_dropped += 1  # it would push out something needed sooner
                continue
            source = self._source(key, t + 1)
            self.prefetching = True
            admitted = self._admit(t, key, size)
            self.prefetching = False
            if not admitted:
                self.result.prefetches_dropped += 1
                continue
            self.result.prefetches += 1
            self.stats[t].issued += 1
            self.ready[(t, key)] = self._transfer(source, t, size)
