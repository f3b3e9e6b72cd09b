"""Prefetching the chunks a zarr read will ask for next, from the burst of gets it is making.

zarr 3.1 reads a region as many concurrent per-chunk ``get`` calls (at most
``async.concurrency`` at a time, in C order of the chunk grid). The gets that reach the store
within one turn of its loop are one *burst*. When a burst holds several chunks of one array, or
continues where the last burst of that array stopped, the read is sequential: the chunks that
follow in C order are prefetched, ``BURSTS_AHEAD`` bursts deep, within a share of the target
tier. Random access (one chunk per burst, not following the last) prefetches nothing.

The grid comes from the array's ``zarr.json`` (read with ``store.read``: no promotion, no
hit or miss counted), for zarr v3's default chunk key encoding (``c/1/2`` or ``c.1.2``). Other
encodings, and keys that are not chunks, are served without prefetch.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass, field

import torch

from tierstore.errors import KeyNotFoundError, StoreClosedError
from tierstore.prefetching import PrefetchHandle
from tierstore.store import TierStore

__all__ = ["BurstPrefetcher"]

#: How many bursts of chunks ahead of the newest one to prefetch.
BURSTS_AHEAD = 2
#: Fewest chunks to look ahead once a read is known to be sequential.
MIN_AHEAD = 4
#: Share of the target tier's capacity that chunks prefetched ahead may take.
TIER_SHARE = 0.25
#: Prefetch handles kept (older, finished ones are dropped).
MAX_HANDLES = 64

_CHUNK_KEY = re.compile(r"^(?:(?P<array>.*)/)?c(?P<sep>[/.])(?P<coords>\d+(?:[/.]\d+)*)$")


@dataclass
class _Grid:
    """The chunk grid of one array: chunks per dimension and the key separator."""

    counts: tuple[int, ...]
    separator: str

    @property
    def total(self) -> int:
        return math.prod(self.counts)

    def linear(self, coords: tuple[int, ...]) -> int | None:
        if len(coords) != len(self.counts) or any(c >= n for c, n in zip(coords, self.counts, strict=True)):
            return None
        index = 0
        for c, n in zip(coords, self.counts, strict=True):
            index = index * n + c
        return index

    def key(self, array: str, index: int) -> str:
        coords = []
        for n in reversed(self.counts):
            index, c = divmod(index, n)
            coords.append(str(c))
        name = "c" + self.separator + self.separator.join(reversed(coords))
        return f"{array}/{name}" if array else name


@dataclass
class _Reads:
    """What is known of the reads of one array."""

    burst: list[int] = field(default_factory=list)
    last_top: int = -2  # highest chunk of the previous burst
    ahead_to: int = -1  # highest chunk requested or prefetched so far
    depth: int = MIN_AHEAD


class BurstPrefetcher:
    """Watches the adapter's chunk gets (on the store's loop) and prefetches what follows."""

    def __init__(self, store: TierStore, prefix: str, tier: int) -> None:
        self._store = store
        self._prefix = prefix
        self._tier = tier
        self._grids: dict[str, _Grid | None] = {}
        self._reads: dict[str, _Reads] = {}
        self._scheduled = False
        self._handles: list[PrefetchHandle] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.issued = 0

    def forget_metadata(self, key: str) -> None:
        """An array's ``zarr.json`` changed (or went): read its grid again when next needed."""
        if key == "zarr.json" or key.endswith("/zarr.json"):
            self._grids.pop(key[: -len("zarr.json")].rstrip("/"), None)

    async def on_get(self, key: str) -> None:
        """A demand get of the zarr key ``key`` is starting."""
        match = _CHUNK_KEY.match(key)
        if match is None:
            return
        array = match["array"] or ""
        grid = await self._grid(array)
        if grid is None or match["sep"] != grid.separator:
            return
        coords = tuple(int(c) for c in re.split(r"[/.]", match["coords"]))
        index = grid.linear(coords)
        if index is None:
            return
        self._reads.setdefault(array, _Reads()).burst.append(index)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._end_of_burst)

    async def _grid(self, array: str) -> _Grid | None:
        if array in self._grids:
            return self._grids[array]
        grid = None
        key = self._prefix + (f"{array}/zarr.json" if array else "zarr.json")
        try:
            raw = (await self._store.read(key)).reshape(-1).view(torch.uint8).numpy().tobytes()
            meta = json.loads(raw)
            if meta.get("node_type") == "array" and meta.get("chunk_grid", {}).get("name") == "regular":
                shape = [int(n) for n in meta["shape"]]
                chunks = [int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"]]
                encoding = meta.get("chunk_key_encoding", {})
                if encoding.get("name") == "default" and len(shape) == len(chunks) and all(c > 0 for c in chunks):
                    separator = encoding.get("configuration", {}).get("separator", "/")
                    grid = _Grid(tuple(-(-n // c) for n, c in zip(shape, chunks, strict=True)), separator)
        except (KeyNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            grid = None  # not an array we understand: no prefetch for it
        self._grids[array] = grid
        return grid

    def _end_of_burst(self) -> None:
        self._scheduled = False
        wanted: list[str] = []
        for array, reads in self._reads.items():
            burst, reads.burst = reads.burst, []
            if not burst:
                continue
            top = max(burst)
            sequential = len(burst) > 1 or min(burst) == reads.last_top + 1
            if min(burst) <= reads.last_top:
                # The read went back (the next epoch, a region read again): what was prefetched
                # ahead may be gone since; look ahead from this burst again.
                reads.ahead_to = -1
            reads.last_top = top
            if not sequential:
                continue
            reads.depth = max(MIN_AHEAD, BURSTS_AHEAD * len(burst), reads.depth if len(burst) == 1 else 0)
            grid = self._grids.get(array)
            if grid is None:
                continue
            start = max(top, reads.ahead_to) + 1
            end = min(top + reads.depth, grid.total - 1)
            wanted += [self._prefix + grid.key(array, i) for i in range(start, end + 1)]
            reads.ahead_to = max(reads.ahead_to, end)
        if wanted:
            self._issue(wanted)

    def _issue(self, keys: list[str]) -> None:
        budget = TIER_SHARE * self._store.tiers[self._tier].capacity
        chosen = []
        for key in keys:
            if key not in self._store:
                continue  # never written: zarr reads its fill value
            nbytes = self._store.info(key)["nbytes"]
            if nbytes > budget:
                break
            budget -= nbytes
            chosen.append(key)
        if chosen:
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.get_running_loop().create_task(self._prefetch(chosen)))

    async def _prefetch(self, keys: list[str]) -> None:
        try:
            handle = await self._store.prefetch(keys, self._tier)
        except (KeyNotFoundError, StoreClosedError):
            return  # deleted or closing meanwhile: nothing to bring up
        self.issued += len(keys)
        self._handles = [h for h in self._handles if not h.done()][-MAX_HANDLES:]
        self._handles.append(handle)

    def cancel(self) -> None:
        """Stop the prefetches still running (what arrived stays); on the store's loop."""
        for task in self._tasks:
            task.cancel()
        for handle in self._handles:
            handle.cancel()
        self._tasks, self._handles = [], []

