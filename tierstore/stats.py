"""Counters the store keeps: hits and misses per tier, bytes and seconds per link, prefetches."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LinkStats:
    """Transfers over one link (e.g. ``"host->disk"``): how many, how many bytes, how long.

    ``seconds`` adds up the duration of each transfer, so overlapping transfers count in full:
    ``nbytes / seconds`` is the bandwidth one transfer saw, not the link's aggregate.
    """

    transfers: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.nbytes += nbytes
        self.seconds += seconds


@dataclass
class TierCounters:
    """Demand requests (get, hold, pop) made of one tier: a hit found the value there, a miss
    brought it from another tier."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    writebacks: int = 0


@dataclass
class PrefetchCounters:
    issued: int = 0
    completed: int = 0
    already_there: int = 0
    dropped: int = 0
    cancelled: int = 0
    failed: int = 0
    #: Demand requests that hit a copy a prefetch had brought up and nothing had read yet.
    useful: int = 0


@dataclass
class StoreCounters:
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    links: dict[str, LinkStats] = field(default_factory=dict)
    prefetch: PrefetchCounters = field(default_factory=PrefetchCounters)

    def tier(self, name: str) -> TierCounters:
        found = self.tiers.get(name)  # (asked on every access: no counters made to be thrown away)
        if found is None:
            found = self.tiers[name] = TierCounters()
        return found

    def link(self, source: str, target: str) -> LinkStats:
        return self.links.setdefault(f"{source}->{target}", LinkStats())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
