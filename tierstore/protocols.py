"""The two policy protocols. Policies decide; the store moves bytes.

Policies are plain, synchronous objects with no I/O and no torch. An ``EvictionPolicy``
instance serves one tier: it is told which keys are resident and evictable there, and names a
victim when the store needs room. A ``PrefetchPolicy`` sees the store's accesses and suggests
what to bring up next; the store decides what to issue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses victims among the evictable keys of one tier.

    The store calls ``on_insert`` when a key becomes evictable on the tier (written, promoted,
    or released by its last holder), ``on_hit`` when an evictable key is read there,
    ``on_remove`` when it leaves for another reason than this policy's choice (deleted,
    overwritten, or taken by a hold or a transfer), and ``victim`` when it needs room: ``victim``
    chooses a key, forgets it as *evicted* (ghost-keeping policies remember it) and returns it,
    or returns None when it tracks nothing. Keys the policy is told about are always evictable,
    so a policy never has to know about holds; a hold ends with a fresh ``on_insert``.

    Optional: ``set_capacity(nbytes)`` is called once with the tier's capacity, for policies that
    size internal queues (ARC, S3-FIFO); ``next_use(key)`` (policies that see the future) returns
    when the key is needed next, so prefetch and eviction can agree.
    """

    def on_insert(self, key: str, nbytes: int) -> None: ...

    def on_hit(self, key: str) -> None: ...

    def on_remove(self, key: str) -> None: ...

    def victim(self) -> str | None: ...

    def reset(self) -> None: ...


@runtime_checkable
class PrefetchPolicy(Protocol):
    """Watches accesses and suggests keys to bring up.

    ``on_access`` is called for every demand access (get, hold, or put) with the key, its size,
    the tier asked for (or landed on) and whether it was a hit (a put never is); ``on_step`` when the user marks the end of a
    repeated phase (``store.mark_step()``); ``suggest`` right after each access, returning
    ``(key, tier)`` pairs (``tier`` a tier name, or None for the tier of the access) in the order
    they should be fetched. The store skips keys already there or on their way.

    Optional: ``set_capacities({tier name: bytes})`` is called once with the tiers' sizes, so a
    policy can size how far it looks ahead; ``next_use(key)`` exposes the future it sees.
    """

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None: ...

    def on_step(self) -> None: ...

    def suggest(self) -> Iterable[tuple[str, str | None]]: ...

    def reset(self) -> None: ...


#: What the store accepts for ``eviction=``: a policy class (or any factory called once per tier
#: with no arguments), or a mapping from tier name to such a factory.
EvictionFactory = Callable[[], EvictionPolicy]
