"""Access traces: every store access as one row of a columnar ``.npz`` file.

Format (``numpy.load(path)`` reads it; ``pandas.DataFrame({k: f[k] for k in COLUMNS})`` too):

============  =========  =====================================================================
column        dtype      meaning
============  =========  =====================================================================
``time``      float64    seconds since the trace started
``op``        uint8      index into ``ops`` (get, put, ..., see ``OPS``)
``key``       int64      index into ``keys``
``nbytes``    int64      size of the value
``tier``      int8       tier the access asked for or landed on (index into ``tiers``), -1: none
``before``    int8       fastest tier holding the value before a get, hold or pop; -1: none
``hit``       int8       1 hit, 0 miss, -1 not a read (a put: see below)
``step``      int64      number of ``mark_step`` calls before the access
============  =========  =====================================================================

plus the tables ``keys`` (str), ``ops`` (str) and ``tiers`` (str). The simulator reads these
files and plain CSV traces alike (see ``tierstore.sim``).

An ``evict`` row is not an access: the store chose the copy of ``key`` on tier ``tier`` (of
``nbytes`` there) as an eviction victim, at the moment it chose it (``hit`` and ``before`` are
-1). The simulator skips these rows as requests and compares its own evictions with them
(``tierstore.sim.load_evictions``, ``tierstore.sim.replay_store_trace``). A ``pop`` row is a
read that removes the key (``hit``: whether the asked tier held it). A ``writeback`` row is not
an access either: the current value of ``key`` was committed to tier ``tier`` (the disk) by a
flush or a write-through put. A ``put`` row's ``hit`` says how a put landed on a memory tier: 1
copied over the key's value there (``tierstore.overwrite``: no room was made for it), 0 room made
for it (a write-back put or a fill); -1 for a put written through to the disk tier first (and in
traces from before tierstore recorded these). An ``update`` row is a write hold released on tier ``tier``: its
copy there is the key's only current value from then on. New ops are only ever
appended to ``OPS``, so the op indices of older traces keep their meaning (each file also
carries its own ``ops`` table).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import aiofiles
import aiofiles.os
import numpy as np

#: Op names by index; append only (indices are stored in traces).
OPS = ("get", "put", "delete", "prefetch", "hold", "evict", "pop", "writeback", "update")
COLUMNS = ("time", "op", "key", "nbytes", "tier", "before", "hit", "step")


class TraceRecorder:
    """Collects access rows in memory and writes them to ``path`` on ``close``."""

    def __init__(self, path: str | Path, tiers: list[str]) -> None:
        self.path = Path(path)
        self.tiers = list(tiers)
        self._start = time.perf_counter()
        self._key_ids: dict[str, int] = {}
        self._rows: dict[str, list[float | int]] = {name: [] for name in COLUMNS}
        self._step = 0

    def record(self, op: str, key: str, nbytes: int, tier: int | None, hit: bool | None, before: int | None = None) -> None:
        rows = self._rows
        rows["time"].append(time.perf_counter() - self._start)
        rows["op"].append(OPS.index(op))
        rows["key"].append(self._key_ids.setdefault(key, len(self._key_ids)))
        rows["nbytes"].append(nbytes)
        rows["tier"].append(-1 if tier is None else tier)
        rows["before"].append(-1 if before is None else before)
        rows["hit"].append(-1 if hit is None else int(hit))
        rows["step"].append(self._step)

    def evicted(self, key: str, nbytes: int, tier: int) -> None:
        """Record that the store chose the copy of ``key`` on tier index ``tier`` (``nbytes``
        there) as an eviction victim."""
        self.record("evict", key, nbytes, tier, None)

    def mark_step(self) -> None:
        self._step += 1

    def __len__(self) -> int:
        return len(self._rows["time"])

    def close(self) -> None:
        """Write the trace (atomically: a temporary file renamed into place)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "wb") as handle:
            self._savez(handle)
        partial.replace(self.path)

    async def aclose(self) -> None:
        """``close`` from the store's loop: the file is written and renamed through aiofiles, in
        its thread pool, so a long trace does not stall the loop's I/O while it is written."""
        buffer = io.BytesIO()
        self._savez(buffer)  # (columns in memory already; numpy's zip writer needs a sync file)
        await aiofiles.os.makedirs(self.path.parent, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        async with aiofiles.open(partial, "wb") as handle:
            await handle.write(buffer.getbuffer())
        await aiofiles.os.replace(partial, self.path)

    def _savez(self, handle: io.BufferedIOBase | io.BytesIO) -> None:
        dtypes = {"time": np.float64, "op": np.uint8, "key": np.int64, "nbytes": np.int64,
                  "tier": np.int8, "before": np.int8, "hit": np.int8, "step": np.int64}
        arrays = {name: np.asarray(self._rows[name], dtype=dtypes[name]) for name in COLUMNS}
        keys = np.empty(len(self._key_ids), dtype=object)
        for key, index in self._key_ids.items():
            keys[index] = key
        tables = {"keys": keys.astype(str), "ops": np.asarray(OPS), "tiers": np.asarray(self.tiers, dtype=str)}
        np.savez(handle, **arrays, **tables)  # type: ignore[arg-type]
