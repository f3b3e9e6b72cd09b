"""Synthetic traces: the optimizer's pattern, zipf, scan and loop."""

from __future__ import annotations

import math
import numbers
import os
import re
import resource
from pathlib import Path

import numpy as np

from ..units import format_bytes
from .trace import Trace

#: What making a trace holds at its peak (its arrays, the copies made on the way, the keys'
#: names), measured: about 49 bytes an access, 80 to 120 a key.
_BYTES_PER_ACCESS, _BYTES_PER_KEY = 56, 128
_MAX_SIZE = 2**63 - 1


def optimizer_trace(keys: int = 64, steps: int = 20, size: int | list[int] = 4 << 20, seed: int = 0) -> Trace:
    """What paging optimizer state looks like: each step reads every parameter's state in
    forward order, then again in reverse order (backward), repeated ``steps`` times, with a
    step mark after each step. ``size`` is one size for all keys or a list, one per key."""
    _check_room("optimizer", 2 * keys * steps, keys, keys=keys, steps=steps)
    sizes = np.full(keys, _checked_size(size), dtype=np.int64) if isinstance(size, int | np.integer) else _checked_sizes(size, keys)
    one_step = np.concatenate([np.arange(keys), np.arange(keys)[::-1]])
    ids = np.tile(one_step, steps)
    return _trace(ids, sizes[ids], np.repeat(np.arange(steps), len(one_step)), [f"layer{i}/state" for i in range(keys)])


def zipf_trace(keys: int = 10_000, accesses: int = 1_000_000, alpha: float = 1.0, size: int = 4096, seed: int = 0) -> Trace:
    """Independent accesses with zipf(alpha) popularity over ``keys`` keys of ``size`` bytes
    (``alpha`` 0: every key as popular; the larger, the more skewed)."""
    if accesses > 0 and keys < 1:
        raise ValueError(f"a zipf trace of {accesses} accesses needs keys= 1 or more, not {keys}")
    if not (isinstance(alpha, numbers.Real) and math.isfinite(alpha) and alpha >= 0):
        # (a negative one ranks popularity upside down, a NaN makes numpy's "probabilities contain NaN")
        raise ValueError(f"zipf trace: alpha={alpha!r} is no popularity skew; give a finite number of 0 or more (0: uniform, 1: classic zipf)")
    _check_room("zipf", accesses, keys, keys=keys, accesses=accesses)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, keys + 1) ** alpha
    ids = rng.choice(keys, size=accesses, p=weights / weights.sum())
    ids = rng.permutation(keys)[ids]  # popular keys are not the low numbers
    return _trace(ids, np.full(accesses, _checked_size(size), dtype=np.int64), np.zeros(accesses, dtype=np.int64),
                  [f"k{i}" for i in range(keys)])


def scan_trace(keys: int = 1000, size: int = 4096) -> Trace:
    """Each key once, in order (no reuse: every policy misses everything)."""
    _check_room("scan", keys, keys, keys=keys)
    ids = np.arange(keys)
    return _trace(ids, np.full(keys, _checked_size(size), dtype=np.int64), np.zeros(keys, dtype=np.int64), [f"k{i}" for i in range(keys)])


def loop_trace(keys: int = 100, loops: int = 10, size: int = 4096) -> Trace:
    """``keys`` keys in the same order ``loops`` times (LRU's worst case below the loop size)."""
    _check_room("loop", keys * loops, keys, keys=keys, loops=loops)
    ids = np.tile(np.arange(keys), loops)
    return _trace(ids, np.full(len(ids), _checked_size(size), dtype=np.int64), np.repeat(np.arange(loops), keys),
                  [f"k{i}" for i in range(keys)])


def _checked_size(size: int) -> int:
    if not 0 <= size <= _MAX_SIZE:
        raise ValueError(f"size={size} is not a size a trace holds; give 0 to 2**63 - 1 bytes")
    return size


def _checked_sizes(sizes: list[int], keys: int) -> np.ndarray:
    if len(sizes) != keys:
        raise ValueError(f"size= gives {len(sizes)} sizes for keys={keys}; give one size, or one per key")
    for size in sizes:
        _checked_size(size)
    return np.asarray(sizes, dtype=np.int64)


def _check_room(kind: str, accesses: int, distinct: int, /, **counts: int) -> None:
    """``ValueError`` naming ``counts`` when a trace of ``accesses`` over ``distinct`` keys would
    not fit the memory left (numpy's ``MemoryError`` traceback, or a machine swapping, came)."""
    need = accesses * _BYTES_PER_ACCESS + distinct * _BYTES_PER_KEY
    room = available_memory()
    if room is not None and need > room:
        given = ", ".join(f"{name}={value}" for name, value in counts.items())
        raise ValueError(f"{kind} trace: {given} make {accesses:,} accesses of {distinct:,} keys, about {format_bytes(need)} "
                         f"of memory, more than the {format_bytes(room)} available; make {' or '.join(counts)} smaller")


def available_memory() -> int | None:
    """Bytes this process can still allocate: the memory the system has available (where it
    does not say, its memory), within the process's address-space limit (``ulimit -v``); None
    where neither is known."""
    room = _system_memory()
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        left = max(0, limit - _address_space_used())
        room = left if room is None else min(room, left)
    return room


def _system_memory() -> int | None:
    """Linux's ``MemAvailable``, else the machine's memory, else None."""
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match:
        return int(match.group(1)) * 1024
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _address_space_used() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def _trace(ids: np.ndarray, sizes: np.ndarray, steps: np.ndarray, names: list[str]) -> Trace:
    used = np.unique(ids)
    remap = np.full(len(names), -1, dtype=np.int64)
    remap[used] = np.arange(len(used))
    return Trace(
        keys=[names[i] for i in used],
        ids=remap[ids].astype(np.int64),
        sizes=sizes.astype(np.int64),
        ops=np.zeros(len(ids), dtype=np.uint8),
        steps=steps.astype(np.int64),
    )
