"""Traces for the simulator: the store's ``.npz`` access traces and plain CSV files.

A CSV trace has one access a line, ``key,size``, an optional header line and any further
columns ignored (libCacheSim's csv reader takes the same). A store trace (``TierStore(trace=...)``,
format in ``tierstore.tracing``) keeps get, hold and put rows as accesses, deletes as removals,
and its step marks; its prefetch rows are dropped (the simulator decides prefetches itself), and
so are its evict rows (what the store evicted; ``load_evictions`` reads them for comparison) and
its writeback and update rows; a pop counts as an access.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TraceError

ACCESS, DELETE = 0, 1


@dataclass
class Trace:
    """Accesses as parallel arrays; ``keys[ids[i]]`` is the key of access ``i``."""

    keys: list[str]
    ids: np.ndarray  # int64, one per access
    sizes: np.ndarray  # int64 bytes
    ops: np.ndarray  # uint8: ACCESS or DELETE
    steps: np.ndarray  # int64: step number of each access (mark_step count)
    times: np.ndarray | None = None  # float64 seconds, when known

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def working_set(self) -> int:
        """Bytes of all distinct keys (each at its largest size)."""
        largest = np.zeros(len(self.keys), dtype=np.int64)
        np.maximum.at(largest, self.ids, self.sizes)
        return int(largest.sum())

    @classmethod
    def from_accesses(cls, keys: list[str], sizes: list[int] | np.ndarray, steps: list[int] | np.ndarray | None = None) -> Trace:
        """A trace of plain accesses given as a key per access (and its size)."""
        table: dict[str, int] = {}
        ids = np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int64, count=len(keys))
        n = len(ids)
        return cls(
            keys=list(table),
            ids=ids,
            sizes=np.asarray(sizes, dtype=np.int64),
            ops=np.zeros(n, dtype=np.uint8),
            steps=np.asarray(steps, dtype=np.int64) if steps is not None else np.zeros(n, dtype=np.int64),
        )


def load_trace(path: str | Path) -> Trace:
    """Read a store ``.npz`` trace or a ``key,size`` CSV."""
    path = Path(path)
    if path.suffix == ".npz":
        return _load_npz(path)
    return _load_csv(path)


def _load_npz(path: Path) -> Trace:
    with np.load(path, allow_pickle=False) as data:
        ops_table = [str(op) for op in data["ops"]]
        op_names = np.asarray(ops_table)[data["op"]]
        keep = ~np.isin(op_names, ("prefetch", "evict", "writeback", "update"))
        ops = np.where(op_names[keep] == "delete", DELETE, ACCESS).astype(np.uint8)
        return Trace(
            keys=[str(k) for k in data["keys"]],
            ids=data["key"][keep].astype(np.int64),
            sizes=data["nbytes"][keep].astype(np.int64),
            ops=ops,
            steps=data["step"][keep].astype(np.int64),
            times=data["time"][keep].astype(np.float64),
        )


def load_evictions(path: str | Path) -> list[tuple[str, int]]:
    """The evictions a store recorded in its ``.npz`` trace, in order: ``(key, tier index)``
    (``tiers[index]`` of the file names the tier). Empty for traces made before the store
    recorded evictions."""
    with np.load(Path(path), allow_pickle=False) as data:
        ops_table = [str(op) for op in data["ops"]]
        if "evict" not in ops_table:
            return []
        rows = np.flatnonzero(data["op"] == ops_table.index("evict"))
        keys = data["keys"]
        return [(str(keys[k]), int(t)) for k, t in zip(data["key"][rows].tolist(), data["tier"][rows].tolist(), strict=True)]


def _load_csv(path: Path) -> Trace:
    keys: list[str] = []
    sizes: list[int] = []
    with open(path, newline="") as handle:
        for number, row in enumerate(csv.reader(handle)):
            if not row or row[0].startswith("#"):
                continue
            if len(row) < 2:
                raise TraceError(f"{path}:{number + 1}: expected 'key,size', got {row!r}")
            try:
                size = int(float(row[1]))
            except ValueError:
                if number == 0:
                    continue  # a header line
                raise TraceError(f"{path}:{number + 1}: size {row[1]!r} is not a number") from None
            if size < 0:
                raise TraceError(f"{path}:{number + 1}: negative size {size}")
            keys.append(row[0])
            sizes.append(size)
    if not keys:
        raise TraceError(f"{path} holds no accesses")
    return Trace.from_accesses(keys, sizes)
