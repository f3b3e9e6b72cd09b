"""libCacheSim's own policies on our traces (the optional extra ``tierstore[libcachesim]``).

``simulate_libcachesim`` writes the trace once as an ``oracleGeneral`` file, lets libCacheSim
replay it with one of its policies at one capacity, and returns the result as a ``SimResult``
(``engine="libcachesim"``), so it sits in the same JSON, tables and plots as ours. libCacheSim
models one cache without prefetch: tiers, prefetchers and the live store are ours alone.
It sees the same requests as ours, zero-size ones included; deletes are not passed on (the
format has none), and a key requested again with another size is a hit there, a miss here.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from .simulator import SimResult
from .trace import ACCESS, Trace, save_oracle_general

#: Our names for libCacheSim's policies (any other class name it exports works too, any case).
NAMES = {
    "lru": "LRU", "fifo": "FIFO", "lfu": "LFU", "arc": "ARC", "s3fifo": "S3FIFO", "sieve": "Sieve", "clock": "Clock",
    "slru": "SLRU", "2q": "TwoQ", "lirs": "LIRS", "tinylfu": "WTinyLFU", "lhd": "LHD", "lecar": "LeCaR", "lfuda": "LFUDA",
    "cacheus": "Cacheus", "clockpro": "ClockPro", "gdsf": "GDSF", "hyperbolic": "Hyperbolic", "min": "Belady",
    "belady": "Belady", "beladysize": "BeladySize", "random": "Random", "mq": "MQ", "lruk": "LRUK", "size": "Size",
    "lruprob": "LRUProb", "flashprob": "FlashProb", "clock2qplus": "Clock2QPlus",
}

_folder: tempfile.TemporaryDirectory[str] | None = None


def available() -> bool:
    """Whether libCacheSim is installed (``pip install 'tierstore[libcachesim]'``)."""
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        return False
    return True


def _module() -> Any:
    try:
        import libcachesim
    except ImportError:
        raise ValueError("--engine libcachesim needs libCacheSim: pip install 'tierstore[libcachesim]'") from None
    return libcachesim


def policy_class(name: str) -> Any:
    """libCacheSim's cache class for ``name`` (ours, e.g. ``2q``, or its own, e.g. ``TwoQ``)."""
    lcs = _module()
    wanted = NAMES.get(name.lower(), name)
    classes = {n.lower(): getattr(lcs, n) for n in dir(lcs) if isinstance(getattr(lcs, n), type) and issubclass(getattr(lcs, n), lcs.CacheBase)}
    classes.pop("cachebase", None)
    classes.pop("pluginCache".lower(), None)
    cls = classes.get(wanted.lower())
    if cls is None:
        raise ValueError(f"libCacheSim has no policy {name!r}; choose from {sorted(set(NAMES) | set(classes))}")
    return cls


def trace_file(trace: Trace) -> Path:
    """The trace as an oracleGeneral file, written once per trace object (in a temporary folder)."""
    global _folder
    path: Path | None = getattr(trace, "_oracle_general_file", None)
    if path is None or not path.exists():
        if _folder is None:
            _folder = tempfile.TemporaryDirectory(prefix="tierstore-lcs-")
        path = save_oracle_general(trace, Path(_folder.name) / f"trace_{id(trace)}.oracleGeneral.bin")
        trace._oracle_general_file = path  # type: ignore[attr-defined]
    return path


def simulate_libcachesim(trace: Trace, capacities: dict[str, int], eviction: str, prefetch: str = "none") -> SimResult:
    """Replay ``trace`` with libCacheSim's policy ``eviction`` at the one capacity given."""
    if len(capacities) != 1 or prefetch != "none":
        raise ValueError("the libcachesim engine simulates one cache without prefetch: give one capacity and --prefetch none")
    trace.check()
    lcs = _module()
    cls = policy_class(eviction)
    (name, capacity), = capacities.items()
    path = trace_file(trace)
    started = time.perf_counter()
    # Zero-size requests count, as they do in ours (libCacheSim skips them by default).
    params = lcs.ReaderInitParam(ignore_size_zero_req=False)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE, reader_init_params=params)
    object_miss, byte_miss = cls(int(capacity)).process_trace(reader)
    seconds = time.perf_counter() - started
    accesses = trace.ops == ACCESS
    requests, requested = int(accesses.sum()), sum(trace.sizes[accesses].tolist())
    result = SimResult(eviction, "none", int(capacity), {name: int(capacity)}, engine="libcachesim")
    result.requests = requests
    result.misses = round(object_miss * requests)
    result.requested_bytes = requested
    result.missed_bytes = round(byte_miss * requested)
    result.hits_by_tier = {name: result.requests - result.misses}
    result.sim_seconds = seconds
    return result
