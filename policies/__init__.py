"""Eviction and prefetch policies for tierstore.

Eviction (one instance per tier; see ``tierstore.protocols.EvictionPolicy``):
``LRU``, ``FIFO``, ``LFU``, ``ARC``, ``S3FIFO``, ``MIN`` (Belady, given an oracle of next uses).
Prefetch (see ``tierstore.protocols.PrefetchPolicy``): ``NoPrefetch``, ``Sequential``,
``ScheduleLearned``. None of them does I/O or touches tensors.
"""

from .arc import ARC
from .belady import MIN
from .fifo import FIFO
from .lfu import LFU
from .lru import LRU
from .noprefetch import NoPrefetch
from .s3fifo import S3FIFO
from .schedule import ScheduleLearned
from .sequential import Sequential

#: Eviction policies by the names the simulator and the command line use (MIN needs an oracle).
EVICTION = {"lru": LRU, "fifo": FIFO, "lfu": LFU, "arc": ARC, "s3fifo": S3FIFO}

__all__ = ["ARC", "EVICTION", "FIFO", "LFU", "LRU", "MIN", "NoPrefetch", "S3FIFO", "ScheduleLearned", "Sequential"]
