"""Synthetic traces: the optimizer's pattern, zipf, scan and loop."""

from __future__ import annotations

import numpy as np

from .trace import Trace


def optimizer_trace(keys: int = 64, steps: int = 20, size: int | list[int] = 4 << 20, seed: int = 0) -> Trace:
    """What paging optimizer state looks like: each step reads every parameter's state in
    forward order, then again in reverse order (backward), repeated ``steps`` times, with a
    step mark after each step. ``size`` is one size for all keys or a list, one per key."""
    sizes = np.full(keys, size, dtype=np.int64) if isinstance(size, int) else np.asarray(size, dtype=np.int64)
    one_step = np.concatenate([np.arange(keys), np.arange(keys)[::-1]])
    ids = np.tile(one_step, steps)
    return _trace(ids, sizes[ids], np.repeat(np.arange(steps), len(one_step)), [f"layer{i}/state" for i in range(keys)])


def zipf_trace(keys: int = 10_000, accesses: int = 1_000_000, alpha: float = 1.0, size: int = 4096, seed: int = 0) -> Trace:
    """Independent accesses with zipf(alpha) popularity over ``keys`` keys of ``size`` bytes."""
    if accesses > 0 and keys < 1:
        raise ValueError(f"a zipf trace of {accesses} accesses needs keys= 1 or more, not {keys}")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, keys + 1) ** alpha
    ids = rng.choice(keys, size=accesses, p=weights / weights.sum())
    ids = rng.permutation(keys)[ids]  # popular keys are not the low numbers
    return _trace(ids, np.full(accesses, size, dtype=np.int64), np.zeros(accesses, dtype=np.int64), [f"k{i}" for i in range(keys)])


def scan_trace(keys: int = 1000, size: int = 4096) -> Trace:
    """Each key once, in order (no reuse: every policy misses everything)."""
    ids = np.arange(keys)
    return _trace(ids, np.full(keys, size, dtype=np.int64), np.zeros(keys, dtype=np.int64), [f"k{i}" for i in range(keys)])


def loop_trace(keys: int = 100, loops: int = 10, size: int = 4096) -> Trace:
    """``keys`` keys in the same order ``loops`` times (LRU's worst case below the loop size)."""
    ids = np.tile(np.arange(keys), loops)
    return _trace(ids, np.full(len(ids), size, dtype=np.int64), np.repeat(np.arange(loops), keys), [f"k{i}" for i in range(keys)])


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
