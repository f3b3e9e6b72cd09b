"""The two policy protocols. Policies decide; the store moves bytes.

Policies are plain, synchronous objects with no I/O and no torch. An ``EvictionPolicy``
instance serves one tier: it is told which keys are resident there and which of them were hit,
and names a victim, among those the store says may go, when the store needs room. A
``PrefetchPolicy`` sees the store's accesses and suggests what to bring up next; the store
decides what to issue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses victims among the resident copies of one tier.

    The store tells the policy about every copy on its tier and every access to it:

    ``on_insert(key, nbytes)``
        a copy of ``key`` was installed on the tier (written, promoted, or written back from a
        faster tier); ``nbytes`` is what it occupies there. Inserting a tracked key again
        starts it afresh.
    ``on_hit(key)``
        the resident copy served an access: a get or hold hit on this tier, or the source of a
        promotion to another tier. Every hit, of any size, whether the copy is in use or not.
    ``on_remove(key)``
        the copy left for another reason than this policy's choice (deleted, overwritten,
        invalidated).
    ``victim(evictable=None)``
        the store needs room: choose a tracked key for which ``evictable(key)`` is true (any
        tracked key when ``evictable`` is None), forget it as *evicted* (ghost-keeping
        policies remember it) and return it; None when no tracked key may go. Keys for which
        the predicate is false stay tracked with their state (recency, frequency, queue
        position) as it was: a copy in use or held is excluded from victim choice by the
        store, never taken out of the policy. Each policy documents what a skipped key keeps.
    ``reset()``
        forget everything.

    Unknown keys given to ``on_hit`` or ``on_remove`` are ignored. Keys are hashable: ``str``
    in the store, ``int`` in the simulator. Policies are pure: no I/O, no clock of their own,
    no torch.

    Optional: ``set_capacity(nbytes)`` is called once with the tier's capacity, for policies that
    size internal queues (ARC, S3-FIFO); ``before_insert(key, nbytes)`` is called when ``key`` is
    about to be inserted, before the victims that make room for it are chosen (ARC adapts its
    target there on a ghost hit; an insert that then fails may follow it with no ``on_insert``);
    ``next_use(key)`` (policies that see the future) returns
    when the key is needed next, so prefetch and eviction can agree; ``on_release(key)`` is
    called when a use of ``key``'s copy ends (a hold, a transfer), so a policy that set aside
    a key ``victim`` passed over can take it back then instead of scanning it on every call
    (``MIN`` does); ``ranked(count)`` returns the ``count`` tracked keys ``victim`` would take
    first, in that order, changing nothing (``MIN`` and ``policies.LRU`` have it; the store's
    own LRU, the default, does not), so an optimizer writes back ahead of time the states the
    policy is about to evict rather than guess them.
    """

    def on_insert(self, key: str, nbytes: int) -> None: ...

    def on_hit(self, key: str) -> None: ...

    def on_remove(self, key: str) -> None: ...

    def victim(self, evictable: Callable[[str], bool] | None = None) -> str | None: ...

    def reset(self) -> None: ...


@runtime_checkable
class PrefetchPolicy(Protocol):
    """Watches accesses and suggests keys to bring up.

    ``on_access`` is called for every demand access (get, hold, or put) with the key, its size,
    the tier asked for (or landed on) and whether it was a hit (a put never is); ``on_step`` when the user marks the end of a
    repeated phase (``store.mark_step()``); ``suggest`` right after each access, returning
    ``(key, tier)`` pairs (``tier`` a tier name, or None for the tier of the access) in the order
    they should be fetched. The store skips keys already there or on their way. The simulator
    gives ``on_access`` the trace's int key ids, and takes a suggested key by that id or by its
    name (a ``str``, as the store takes it); it skips keys and tiers the trace lacks, as the store does.

    Optional: ``set_capacities({tier name: bytes})`` is called once with the tiers' sizes, so a
    policy can size how far it looks ahead; ``next_use(key)`` exposes the future it sees;
    ``expect(used, unused)`` is called by ``store.expect`` with what the phase beginning will
    access and will not (``TieredAdamW`` says so each step), until the next ``on_step``.
    """

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None: ...

    def on_step(self) -> None: ...

    def suggest(self) -> Iterable[tuple[str, str | None]]: ...

    def reset(self) -> None: ...


#: What the store accepts for ``eviction=``: a policy class (or any factory called once per tier
#: with no arguments), or a mapping from tier name to such a factory.
EvictionFactory = Callable[[], EvictionPolicy]


#: What the store calls of a prefetch policy at each access; ``on_step``, at ``mark_step``, is
#: warned of there if missing, and ``reset`` is the simulator's.
PREFETCH_CALLED = ("on_access", "suggest")


def missing_methods(policy: Any, names: Iterable[str]) -> list[str]:
    """Those of ``names`` that ``policy`` has no method for (no callable attribute)."""
    return [name for name in names if not callable(getattr(policy, name, None))]


def policy_name(policy: Any) -> str:
    """What messages call ``policy``: its class's own ``name``, else its class name (a subclass
    of a shipped policy inherits its ``name`` but is not that policy)."""
    own = vars(type(policy)).get("name")
    return own if isinstance(own, str) else type(policy).__name__
