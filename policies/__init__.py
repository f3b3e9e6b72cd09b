"""Eviction and prefetch policies for tierstore (see ``tierstore.protocols`` for the protocols)."""

from .lru import LRU
from .noprefetch import NoPrefetch

__all__ = ["LRU", "NoPrefetch"]
