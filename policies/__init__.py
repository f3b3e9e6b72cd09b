"""Eviction and prefetch policies for tierstore.

Eviction (one instance per tier; see ``tierstore.protocols.EvictionPolicy``):
``LRU``, ``FIFO``, ``LFU``, ``ARC``, ``S3FIFO``, ``SIEVE``, ``CLOCK``, ``SLRU``, ``TwoQ``, ``LIRS``,
``WTinyLFU``, ``MIN`` (Belady, given an oracle of next uses).
Prefetch (see ``tierstore.protocols.PrefetchPolicy``): ``NoPrefetch``, ``Sequential``,
``AdaptiveSequential`` (AMP), ``ScheduleLearned``. None of them does I/O or touches tensors.
"""

from .amp import AdaptiveSequential
from .arc import ARC
from .belady import MIN
from .clock import CLOCK
from .fifo import FIFO
from .lfu import LFU
from .lirs import LIRS
from .lru import LRU
from .noprefetch import NoPrefetch
from .s3fifo import S3FIFO
from .schedule import ScheduleLearned
from .sequential import Sequential
from .sieve import SIEVE
from .slru import SLRU
from .tinylfu import CountMinSketch, WTinyLFU
from .twoq import TwoQ

#: Eviction policies by the names the simulator and the command line use (MIN needs an oracle).
EVICTION = {
    "lru": LRU, "fifo": FIFO, "lfu": LFU, "arc": ARC, "s3fifo": S3FIFO, "sieve": SIEVE, "clock": CLOCK,
    "slru": SLRU, "2q": TwoQ, "lirs": LIRS, "tinylfu": WTinyLFU,
}

#: Prefetch policies by name (the simulator's ``--prefetch``).
PREFETCH = {"none": NoPrefetch, "sequential": Sequential, "amp": AdaptiveSequential, "schedule": ScheduleLearned}

__all__ = [
    "ARC", "CLOCK", "CountMinSketch", "EVICTION", "FIFO", "LFU", "LIRS", "LRU", "MIN", "PREFETCH", "SIEVE", "SLRU",
    "S3FIFO", "AdaptiveSequential", "NoPrefetch", "ScheduleLearned", "Sequential", "TwoQ", "WTinyLFU",
]
