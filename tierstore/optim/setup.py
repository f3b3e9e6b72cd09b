"""The store a paged optimizer works in: the default one it makes, or the one it is given."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from ..store import TierStore
from ..sync import SyncTierStore, open_unless_closed
from ..tiers import DiskTier, HostTier, MemoryTier

#: Where the default disk store lives when no ``disk_root`` is given.
DEFAULT_DISK_ROOT = Path(".tierstore") / "optim"


def default_store(offload: str, state: int, grads: int, disk_root: str | os.PathLike[str] | None, host_capacity: Any, disk_capacity: Any) -> TierStore:
    """``offload="host"``: all ``state`` (bytes) and ``grads`` in a host tier; ``"disk"``: a disk
    tier at ``disk_root`` under a host tier of a quarter of them, with learned prefetch and MIN
    eviction."""
    from policies import MIN, ScheduleLearned

    if offload == "host":
        return TierStore([HostTier(host_capacity if host_capacity is not None else state + grads + (64 << 20))])
    schedule = ScheduleLearned()
    host = host_capacity if host_capacity is not None else max(64 << 20, (state + grads) // 4)
    root = Path(disk_root) if disk_root is not None else DEFAULT_DISK_ROOT
    disk = disk_capacity if disk_capacity is not None else 2 * (state + grads) + (256 << 20)
    # Paged state is scratch (checkpoints go through state_dict): no fsync per write-back.
    return TierStore([HostTier(host), DiskTier(root, disk, durable=False)], eviction=lambda: MIN(schedule), prefetch=schedule)


def bind_store(store: Any, loop: asyncio.AbstractEventLoop, state_tier: str) -> TierStore:
    """``store`` (a ``TierStore``, opened here if it is not, or a ``SyncTierStore``) checked for
    being on the optimizer's ``loop`` and having ``state_tier`` as a memory tier."""
    if isinstance(store, SyncTierStore):
        store = store.store
    if not isinstance(store, TierStore):
        raise TypeError(f"store must be a TierStore or SyncTierStore, not {type(store).__name__}")
    if not open_unless_closed(store, "the store given as store=") and store.loop is not loop:
        raise ValueError("the store was opened on another event loop; open it through tierstore.SyncTierStore or pass it unopened")
    if state_tier not in [tier.name for tier in store.tiers] or not isinstance(store.tier(state_tier), MemoryTier):
        raise ValueError(f"state_tier {state_tier!r} must name a memory tier of the store ({[t.name for t in store.tiers]})")
    return store
