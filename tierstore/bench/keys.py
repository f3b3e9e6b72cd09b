"""Many small values: put/get rates beside raw LMDB, memory per key, flush, reopen, hit latency.

Reproduce:  python benchmarks/bench_keys.py [--quick] [--only PART] [--keys N ...] [--dir DIR] [--json PATH] [--plot PATH]

Every figure stands beside a baseline measured in the same run, interleaved round by round
(the machine is shared and noisy), as the median over rounds of the per-round ratio:

- ``threshold``: put and get rates of one value size kept inline in the catalog against the
  same value in an extent (``DiskTier(inline_max=0)``), durable and not, at 256 B .. 64 KiB,
  and the catalog bytes an inline value costs; ``INLINE_MAX`` is chosen from it;
- ``rates``: 1 KiB puts and gets into a disk-only store, sequential awaits of the async API
  and the sync facade, against raw LMDB with the same sync setting (one transaction per put,
  one read transaction per get returning bytes); durable puts from ``CONCURRENT_WRITERS`` tasks
  at once (group commit) against the same LMDB figure; a run of some parts (``--only``) keeps
  the other parts' figures of the JSON it rewrites;
- ``memory``: anonymous memory (``RssAnon``) per key with 10^4, 10^5, 10^6 tiny values on the
  host tier, and per key of a disk-only store after reopening, each in a fresh process;
- ``flush``: ``flush()`` of 10^5 small dirty keys; the baseline is the extent path
  (``inline_max=0``) on a tenth of the keys, scaled up;
- ``reopen``: opening a store of 10^5 and 10^6 small keys, against scanning its LMDB catalog raw;
- ``hit``: a host-tier hit of a 4-byte and a 1 KiB value (async and sync) against a dict lookup
  and ``clone()``, the floor of a Python store of tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lmdb
import torch

from ..store import TierStore
from ..sync import SyncTierStore
from ..tiers import DiskTier, HostTier
from .common import environment, median, progress, table, write_json

HERE = Path(__file__).resolve().parents[2]
#: Tasks putting at once in the durable group-commit figure of ``rates``.
CONCURRENT_WRITERS = 8
SIZES = [256, 1024, 2048, 4096, 8192, 16384, 65536]


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _anon_bytes() -> int:
    """Anonymous resident memory of this process (the heap; not the catalog's file mapping)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


# -- rates -------------------------------------------------------------------------------------


def _timing_start() -> float:
    """Start a timed loop of the rates part from a collected heap (every side, baseline too):
    a full collection owed to what imports and earlier parts left would otherwise land in
    whichever loop happens to cross the collector's threshold (one pass over the ~200,000
    objects torch leaves costs as much as thousands of puts), not in the loop that caused it."""
    gc.collect()
    return time.perf_counter()


def lmdb_puts(folder: Path, n: int, size: int, sync: bool) -> float:
    """Puts per second into raw LMDB, one transaction each."""
    env = lmdb.open(str(_fresh(folder)), map_size=1 << 32, sync=sync, metasync=sync)
    value = os.urandom(size)
    keys = [f"k{i}".encode() for i in range(n)]
    started = _timing_start()
    for key in keys:
        with env.begin(write=True) as txn:
            txn.put(key, value)
    elapsed = time.perf_counter() - started
    env.close()
    return n / elapsed


def lmdb_gets(folder: Path, n: int) -> float:
    """Gets per second from the LMDB written by ``lmdb_puts``, one read transaction each."""
    env = lmdb.open(str(folder), map_size=1 << 32)
    keys = [f"k{i}".encode() for i in range(n)]
    started = _timing_start()
    for key in keys:
        with env.begin() as txn:
            txn.get(key)
    elapsed = time.perf_counter() - started
    env.close()
    return n / elapsed


async def store_rates(folder: Path, n: int, size: int, durable: bool, inline_max: int | None = None) -> tuple[float, float]:
    """Puts and gets per second of ``size``-byte values in a disk-only store (async API)."""
    options: dict[str, Any] = {} if inline_max is None else {"inline_max": inline_max}
    async with TierStore([DiskTier(_fresh(folder), "4GiB", durable=durable, **options)]) as store:
        value = torch.randint(0, 256, (size,), dtype=torch.uint8)
        keys = [f"k{i}" for i in range(n)]
        started = _timing_start()
        for key in keys:
            await store.put(key, value)
        puts = n / (time.perf_counter() - started)
        started = _timing_start()
        for key in keys:
            await store.get(key)
        gets = n / (time.perf_counter() - started)
    return puts, gets


async def concurrent_puts(folder: Path, n: int, size: int, writers: int = CONCURRENT_WRITERS) -> float:
    """Durable puts per second from ``writers`` tasks putting at once (each a sequential loop):
    what group commit gives, many puts sharing the sync of one transaction."""
    async with TierStore([DiskTier(_fresh(folder), "4GiB", durable=True)]) as store:
        value = torch.randint(0, 256, (size,), dtype=torch.uint8)

        async def write(first: int) -> None:
            for i in range(first, n, writers):
                await store.put(f"k{i}", value)

        started = _timing_start()
        await asyncio.gather(*(write(w) for w in range(writers)))
        return n / (time.perf_counter() - started)


def sync_rates(folder: Path, n: int, size: int, durable: bool) -> tuple[float, float]:
    """As ``store_rates`` through ``SyncTierStore`` (a loop thread per call)."""
    with SyncTierStore([DiskTier(_fresh(folder), "4GiB", durable=durable)]) as store:
        value = torch.randint(0, 256, (size,), dtype=torch.uint8)
        keys = [f"k{i}" for i in range(n)]
        started = _timing_start()
        for key in keys:
            store.put(key, value)
        puts = n / (time.perf_counter() - started)
        started = _timing_start()
        for key in keys:
            store.get(key)
        gets = n / (time.perf_counter() - started)
    return puts, gets


def catalog_bytes(folder: Path) -> int:
    return (folder / "catalog" / "data.mdb").stat().st_size


async def bench_threshold(root: Path, rounds: int, quick: bool) -> list[dict[str, Any]]:
    rows = []
    sizes = SIZES if not quick else [1024, 4096, 16384]
    bar = progress(total=len(sizes) * 2 * rounds, desc="threshold")
    for durable in (False, True):
        n = 60 if durable else 600
        for size in sizes:
            ratios_put, ratios_get, per_value = [], [], []
            for _ in range(rounds):
                inline_put, inline_get = await store_rates(root / "inline", n, size, durable, inline_max=1 << 30)
                per_value.append(catalog_bytes(root / "inline") / n)
                extent_put, extent_get = await store_rates(root / "extent", n, size, durable, inline_max=0)
                ratios_put.append(inline_put / extent_put)
                ratios_get.append(inline_get / extent_get)
                bar.update()
            rows.append({"durable": durable, "size": size, "put_inline_over_extent": median(ratios_put),
                         "get_inline_over_extent": median(ratios_get), "catalog_bytes_per_value": median(per_value)})
    bar.close()
    return rows


async def bench_rates(root: Path, rounds: int, quick: bool) -> list[dict[str, Any]]:
    rows = []
    bar = progress(total=2 * rounds, desc="1 KiB rates")
    for durable in (False, True):
        n = (150 if durable else 3000) // (3 if quick else 1)
        figures: dict[str, list[float]] = {name: [] for name in ("lmdb_put", "lmdb_get", "put", "get", "sync_put", "sync_get")}
        for _ in range(rounds):
            figures["lmdb_put"].append(lmdb_puts(root / "lmdb", n, 1024, durable))
            figures["lmdb_get"].append(lmdb_gets(root / "lmdb", n))
            put, get = await store_rates(root / "store", n, 1024, durable)
            figures["put"].append(put)
            figures["get"].append(get)
            put, get = await asyncio.to_thread(sync_rates, root / "sync", n, 1024, durable)
            figures["sync_put"].append(put)
            figures["sync_get"].append(get)
            if durable:
                figures.setdefault("concurrent_put", []).append(await concurrent_puts(root / "concurrent", 2 * n, 1024))
            bar.update()
        ratio = lambda a, b, figures=figures: median([x / y for x, y in zip(figures[a], figures[b], strict=True)])  # noqa: E731
        rows.append({
            "durable": durable,
            "put_per_s": median(figures["put"]), "lmdb_put_per_s": median(figures["lmdb_put"]), "put_ratio": ratio("put", "lmdb_put"),
            "sync_put_per_s": median(figures["sync_put"]), "sync_put_ratio": ratio("sync_put", "lmdb_put"),
            "get_per_s": median(figures["get"]), "lmdb_get_per_s": median(figures["lmdb_get"]), "get_ratio": ratio("get", "lmdb_get"),
            "sync_get_per_s": median(figures["sync_get"]), "sync_get_ratio": ratio("sync_get", "lmdb_get"),
            "goal": 0.8 if durable else 0.5,
        })
        if durable:  # group commit: concurrent puts share a transaction's sync
            rows[-1].update({"concurrent_writers": CONCURRENT_WRITERS, "concurrent_put_per_s": median(figures["concurrent_put"]),
                             "concurrent_put_ratio": ratio("concurrent_put", "lmdb_put")})
    bar.close()
    return rows


# -- memory, flush and reopen (each in a process of its own) -------------------------------------


async def _host_keys(folder: Path, n: int, inline_max: int | None = None, flush: bool = True) -> dict[str, float]:
    """Put ``n`` 4-byte values on a host tier (memory per key), flush them, close, reopen."""
    options: dict[str, Any] = {} if inline_max is None else {"inline_max": inline_max}
    tiers = lambda: [HostTier("8GiB"), DiskTier(folder, "8GiB", durable=False, **options)]  # noqa: E731
    store = await TierStore(tiers()).open()
    value = torch.zeros(1, dtype=torch.float32)
    gc.collect()
    before = _anon_bytes()
    for i in range(n):
        value.fill_(i)
        await store.put(f"layer{i % 97}/param{i}", value)
    gc.collect()
    result = {"keys": n, "host_bytes_per_key": (_anon_bytes() - before) / n}
    if flush:
        started = time.perf_counter()
        await store.flush()
        result["flush_s"] = time.perf_counter() - started
    await store.aclose(flush=False)
    return result


async def _reopen(folder: Path) -> dict[str, float]:
    gc.collect()
    before = _anon_bytes()
    started = time.perf_counter()
    store = await TierStore([DiskTier(folder, "8GiB", durable=False)]).open()
    opened = time.perf_counter() - started
    gc.collect()
    keys = len(store)
    per_key = (_anon_bytes() - before) / max(keys, 1)
    await store.aclose(flush=False)
    started = time.perf_counter()
    env = lmdb.open(str(folder / "catalog"), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"entries", create=False), buffers=True) as txn:
        for _ in txn.cursor():
            pass
    scan = time.perf_counter() - started
    env.close()
    return {"keys": keys, "reopen_s": opened, "lmdb_scan_s": scan, "disk_bytes_per_key": per_key}


async def _disk_keys(folder: Path, n: int) -> None:
    """A disk-only store of ``n`` small keys, written quickly (staged non-durable puts)."""
    async with TierStore([DiskTier(_fresh(folder), "8GiB", durable=False)]) as store:
        value = torch.zeros(4, dtype=torch.float32)
        for i in range(n):
            value.fill_(i)
            await store.put(f"layer{i % 97}/param{i}", value)


def _child(argv: list[str]) -> None:
    """Entry point of the measuring processes: prints one JSON object."""
    kind, folder, n = argv[0], Path(argv[1]), int(argv[2])
    if kind == "host":
        _fresh(folder)
        print(json.dumps(asyncio.run(_host_keys(folder, n, flush=argv[3] == "flush"))))
    elif kind == "host-extents":
        _fresh(folder)
        print(json.dumps(asyncio.run(_host_keys(folder, n, inline_max=0))))
    elif kind == "disk":
        asyncio.run(_disk_keys(folder, n))
        print(json.dumps(asyncio.run(_reopen(folder))))
    else:
        raise SystemExit(f"unknown measurement {kind!r}")


def _in_child(*args: object) -> dict[str, Any]:
    code = "import sys; from tierstore.bench.keys import _child; _child(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], check=True, capture_output=True, text=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def bench_scale(root: Path, counts: list[int], flush_keys: int) -> dict[str, Any]:
    memory, reopen = [], []
    for n in progress(counts, desc="keys"):
        memory.append(_in_child("host", root / "host", n, "flush" if n == flush_keys else "no"))
        reopen.append(_in_child("disk", root / "disk", n))
    flushed = next(m for m in memory if m["keys"] == flush_keys)
    base = _in_child("host-extents", root / "host-extents", flush_keys // 10)
    return {
        "memory": memory,
        "reopen": reopen,
        "flush": {"keys": flush_keys, "flush_s": flushed["flush_s"], "extent_path_keys": flush_keys // 10,
                  "extent_path_s": base["flush_s"], "extent_path_scaled_s": base["flush_s"] * 10, "goal_s": 3.0},
    }


# -- hit latency -------------------------------------------------------------------------------


async def bench_hits(rounds: int, calls: int) -> list[dict[str, Any]]:
    rows = []
    for size in (4, 1024):
        value = torch.randint(0, 256, (size,), dtype=torch.uint8)
        plain = {"k": value.clone()}
        ours, facade, floor = [], [], []
        async with TierStore([HostTier("64MiB")]) as store:
            await store.put("k", value)
            with SyncTierStore([HostTier("64MiB")]) as sync_store:
                sync_store.put("k", value)
                for _ in range(rounds):
                    started = time.perf_counter()
                    for _ in range(calls):
                        await store.get("k")
                    ours.append((time.perf_counter() - started) / calls * 1e6)
                    started = time.perf_counter()
                    for _ in range(calls // 10):
                        sync_store.get("k")
                    facade.append((time.perf_counter() - started) / (calls // 10) * 1e6)
                    started = time.perf_counter()
                    for _ in range(calls):
                        plain["k"].clone()
                    floor.append((time.perf_counter() - started) / calls * 1e6)
        rows.append({"size": size, "async_us": median(ours), "sync_us": median(facade), "dict_clone_us": median(floor),
                     "async_over_floor": median([a / b for a, b in zip(ours, floor, strict=True)])})
    return rows


# -- report ------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    from ..plotting import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    memory, reopen = result["scale"]["memory"], result["scale"]["reopen"]
    left.plot([m["keys"] for m in memory], [m["host_bytes_per_key"] for m in memory], "o-", label="host tier, per key")
    left.plot([r["keys"] for r in reopen], [r["disk_bytes_per_key"] for r in reopen], "s-", label="disk-only after reopen")
    left.axhline(500 + 64, color="grey", ls="--", label="goal: 500 B + 64 B slot")
    left.set(xscale="log", xlabel="keys", ylabel="bytes per key", title="memory per key")
    left.legend()
    right.plot([r["keys"] for r in reopen], [r["reopen_s"] for r in reopen], "o-", label="reopen")
    right.plot([r["keys"] for r in reopen], [r["lmdb_scan_s"] for r in reopen], "s-", label="raw LMDB scan")
    right.plot([r["keys"] for r in reopen], [r["keys"] / 1e5 for r in reopen], color="grey", ls="--", label="goal: 1 s per 100,000")
    right.set(xscale="log", yscale="log", xlabel="keys", ylabel="seconds", title="reopen")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, sizes and keys (up to 10^5)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", choices=["threshold", "rates", "scale", "hits"], action="append")
    parser.add_argument("--keys", type=int, nargs="+", default=None,
                        help="key counts of the scale measurements (default 10^4 10^5 10^6; --quick: 10^4 10^5)")
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench-keys"))
    parser.add_argument("--json", type=Path, default=HERE / "benchmarks/results/bench_keys.json")
    parser.add_argument("--plot", type=Path, default=HERE / "benchmarks/results/bench_keys.png")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    only = set(args.only or ["threshold", "rates", "scale", "hits"])
    root = args.dir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(root), "rounds": rounds}
    if "threshold" in only:
        result["threshold"] = asyncio.run(bench_threshold(root / "threshold", rounds, args.quick))
        print(table(result["threshold"], [("durable", "durable", ""), ("size", "bytes", "d"), ("put_inline_over_extent", "put inline/extent", ".2f"),
                                          ("get_inline_over_extent", "get inline/extent", ".2f"), ("catalog_bytes_per_value", "catalog B/value", ".0f")]))
    if "rates" in only:
        result["rates"] = asyncio.run(bench_rates(root / "rates", rounds, args.quick))
        print(table(result["rates"], [("durable", "durable", ""), ("put_per_s", "put/s", ".0f"), ("lmdb_put_per_s", "LMDB put/s", ".0f"),
                                      ("put_ratio", "ratio", ".2f"), ("sync_put_ratio", "sync ratio", ".2f"), ("goal", "goal", ".1f"),
                                      ("get_per_s", "get/s", ".0f"), ("lmdb_get_per_s", "LMDB get/s", ".0f"), ("get_ratio", "get ratio", ".2f"),
                                      ("sync_get_ratio", "sync get ratio", ".2f")]))
        for row in result["rates"]:
            if "concurrent_put_per_s" in row:
                print(f"durable puts from {row['concurrent_writers']} tasks at once: {row['concurrent_put_per_s']:.0f}/s, "
                      f"{row['concurrent_put_ratio']:.2f}x LMDB's one-at-a-time sync puts (group commit)")
    if "scale" in only:
        counts = args.keys or ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
        flush_keys = 100_000 if 100_000 in counts else min(counts)
        result["scale"] = bench_scale(root / "scale", sorted(counts), flush_keys)
        print(table(result["scale"]["memory"], [("keys", "keys", "d"), ("host_bytes_per_key", "host B/key", ".0f")]))
        print(table(result["scale"]["reopen"], [("keys", "keys", "d"), ("reopen_s", "reopen s", ".2f"), ("lmdb_scan_s", "LMDB scan s", ".2f"),
                                                ("disk_bytes_per_key", "disk-only B/key", ".0f")]))
        flush = result["scale"]["flush"]
        print(f"flush of {flush['keys']} small dirty keys: {flush['flush_s']:.2f} s (goal {flush['goal_s']} s); extent path: "
              f"{flush['extent_path_s']:.2f} s for {flush['extent_path_keys']} keys (x10: {flush['extent_path_scaled_s']:.1f} s)")
    if "hits" in only:
        result["hits"] = asyncio.run(bench_hits(rounds, 2000 if args.quick else 10000))
        print(table(result["hits"], [("size", "bytes", "d"), ("async_us", "async µs", ".1f"), ("sync_us", "sync µs", ".1f"),
                                     ("dict_clone_us", "dict+clone µs", ".2f"), ("async_over_floor", "async/floor", ".1f")]))
    if args.only and args.json.exists():  # a run of some parts keeps the others' last figures
        try:
            previous = json.loads(args.json.read_text())
        except (OSError, ValueError):
            previous = {}
        kept = {part: figures for part, figures in previous.items() if part not in result and part not in ("environment", "rounds", "kept")}
        if kept:
            result.update(kept)
            result["kept"] = {"parts": sorted(kept), "environment": previous.get("environment")}
    write_json(args.json, result)
    if "scale" in result:
        plot(result, args.plot)
    print(f"wrote {args.json}")
    return 0
