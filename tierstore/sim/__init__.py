"""The policy simulator: replay access traces against tier capacities and policies, no tensors.

Semantics (one place, used everywhere): each tier is a cache of byte capacity. A demand access
to a key not resident on the fastest tier is a miss there and admits the key, evicting victims
chosen by the tier's eviction policy until it fits; an object larger than the tier's capacity is
not admitted (and evicts nothing). Victims of a tier that is not the last move one tier down
(admitted there the same way); the slowest level, the disk, holds everything. A hit on a slower
tier copies the key up and leaves it there. Prefetches admit keys the same way but are not
requests; a demand access to a key whose prefetch is still in flight is a hit that stalls until
the bytes arrive. Time: each access first spends ``think`` seconds of compute; each link carries
one transfer at a time (latency + bytes / bandwidth); a demand miss stalls until its transfer ends. With one tier this is the textbook cache: LRU and FIFO match their definitions, and
MIN (furthest next use) misses least when all objects have the same size.

``replay_store_trace`` is the other replay: it follows ``TierStore``'s own rules (write-back
only when no slower tier holds the value, puts that invalidate other copies, promotion from
the fastest copy, copies in use never chosen) so that a store's trace replays to the very
misses and evictions the store had (``load_evictions`` reads those from the trace).
"""

from typing import Any

from .generators import loop_trace, optimizer_trace, scan_trace, zipf_trace
from .links import LinkModel
from .simulator import PolicyError, PrefetchStats, SimResult, simulate
from .trace import Trace, load_evictions, load_oracle_general, load_trace, save_oracle_general

_REPLAY = ("NextUse", "ReplayResult", "replay_store_trace")  # imported on use: they need torch


def __getattr__(name: str) -> Any:
    if name in _REPLAY:
        from . import replay

        return getattr(replay, name)
    raise AttributeError(f"module 'tierstore.sim' has no attribute {name!r}")

__all__ = [
    "LinkModel",
    "NextUse",
    "PolicyError",
    "PrefetchStats",
    "ReplayResult",
    "SimResult",
    "Trace",
    "load_evictions",
    "load_oracle_general",
    "load_trace",
    "loop_trace",
    "optimizer_trace",
    "replay_store_trace",
    "save_oracle_general",
    "scan_trace",
    "simulate",
    "zipf_trace",
]
