"""Epochs of a data loader over a zarr array 4x the host tier, through ``TierZarrStore``.

A float32 array of ``4 x host`` bytes, chunked along its rows, is written once to a tier store
(host tier + disk tier) and once to a plain ``zarr.storage.LocalStore`` in the same folder tree.
Each epoch reads it as a loader does: batches of rows, in an order shuffled once and kept for
every epoch (a fixed sampler seed). Per epoch and configuration: hits and misses of the host
tier, prefetches that served a read, seconds and MB/s. Configurations: LRU and S3-FIFO eviction
(with the adapter's burst prefetch), the learned schedule (``ScheduleLearned``, one
``mark_step()`` per epoch) with Belady's MIN over it, and LocalStore as the baseline. The
LocalStore reads go through the OS page cache (warm after its first epoch: the array is small
next to this machine's memory); the disk tier reads with O_DIRECT, so its misses reach the disk.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from policies import LRU, MIN, S3FIFO, ScheduleLearned
from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.bench.common import environment, median, progress, table, write_json
from tierstore.zarr import TierZarrStore

MiB = 1 << 20
COLUMNS = 256  # float32 columns: a row is 1 KiB


def _epoch_order(rows: int, batch: int, seed: int) -> list[int]:
    starts = np.arange(0, rows, batch)
    return [int(s) for s in np.random.default_rng(seed).permutation(starts)]


def _run_epochs(array: Any, order: list[int], batch: int, epochs: int, label: str, store: SyncTierStore | None,
                adapter: TierZarrStore | None) -> list[dict[str, Any]]:
    rows_out = []
    nbytes = array.nbytes
    for epoch in progress(range(epochs), desc=label, leave=False):
        before = store.stats() if store is not None else None
        started = time.perf_counter()
        checksum = 0.0
        for start in order:
            checksum += float(array[start : start + batch, 0].sum())
        seconds = time.perf_counter() - started
        row: dict[str, Any] = {"config": label, "epoch": epoch + 1, "seconds": seconds, "mb_per_s": nbytes / seconds / 1e6}
        if store is not None and before is not None:
            after = store.stats()
            hits = after["tiers"]["host"]["hits"] - before["tiers"]["host"]["hits"]
            misses = after["tiers"]["host"]["misses"] - before["tiers"]["host"]["misses"]
            row.update(hits=hits, misses=misses, hit_rate=hits / max(1, hits + misses),
                       prefetched=after["prefetch"]["useful"] - before["prefetch"]["useful"])
        if adapter is not None:
            adapter.mark_step()
        row["checksum"] = checksum
        rows_out.append(row)
    return rows_out


def _tier_store(root: Path, host: int, config: str) -> SyncTierStore:
    tiers = [HostTier(host), DiskTier(root, 64 * host)]
    if config == "lru":
        return SyncTierStore(tiers, eviction=LRU)
    if config == "s3fifo":
        return SyncTierStore(tiers, eviction=S3FIFO)
    schedule = ScheduleLearned()
    return SyncTierStore(tiers, eviction=lambda: MIN(schedule.next_use), prefetch=schedule)


def run(host_mib: int, chunk_rows: int, batch: int, epochs: int, folder: Path) -> dict[str, Any]:
    host = host_mib * MiB
    rows = 4 * host // (COLUMNS * 4)
    data = np.random.default_rng(0).standard_normal((rows, COLUMNS), dtype=np.float32)
    order = _epoch_order(rows, batch, seed=1)
    results: list[dict[str, Any]] = []

    local = zarr.create_array(zarr.storage.LocalStore(folder / "local.zarr"), shape=data.shape, chunks=(chunk_rows, COLUMNS), dtype="f4")
    local[:] = data
    results += _run_epochs(local, order, batch, epochs, "LocalStore", None, None)

    for config, label in [("lru", "LRU + burst prefetch"), ("s3fifo", "S3-FIFO + burst prefetch"), ("schedule", "schedule + MIN")]:
        with _tier_store(folder / config, host, config) as store:
            adapter = TierZarrStore(store, prefetch=config != "schedule")
            array = zarr.create_array(adapter, name="x", shape=data.shape, chunks=(chunk_rows, COLUMNS), dtype="f4")
            array[:] = data
            store.flush()
            results += _run_epochs(array, order, batch, epochs, label, store, adapter if config == "schedule" else None)
    checksums = {round(r["checksum"], 3) for r in results}
    if len(checksums) != 1:
        raise RuntimeError(f"configurations read different values: {checksums}")
    return {"rows": results, "array_mib": data.nbytes / MiB, "host_mib": host_mib, "chunk_kib": chunk_rows * COLUMNS * 4 / 1024,
            "batch_rows": batch, "epochs": epochs}


def summarise(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per configuration: median MB/s over the epochs after the first, against LocalStore's."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        by_config.setdefault(row["config"], []).append(row)
    base = median([r["mb_per_s"] for r in by_config["LocalStore"][1:]])
    summary = []
    for config, rows in by_config.items():
        later = rows[1:]
        speed = median([r["mb_per_s"] for r in later])
        summary.append({"config": config, "mb_per_s": speed, "vs_local": speed / base,
                        "hit_rate": median([r["hit_rate"] for r in later]) if "hit_rate" in later[0] else None})
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_zarr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-mib", type=int, default=64, help="host tier size (the array is 4x this)")
    parser.add_argument("--chunk-rows", type=int, default=1024, help="rows per zarr chunk (a row is 1 KiB)")
    parser.add_argument("--batch", type=int, default=4096, help="rows per loader batch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a 16 MiB host tier, 3 epochs")
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_zarr.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.host_mib, args.epochs = 16, 3
    if args.folder is not None:
        args.folder.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="bench_zarr-", dir=args.folder))
    try:
        result = run(args.host_mib, args.chunk_rows, args.batch, args.epochs, folder)
        env = environment(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = summarise(result)
    print(f"zarr array of {result['array_mib']:.0f} MiB (4x the {result['host_mib']} MiB host tier), chunks of "
          f"{result['chunk_kib']:.0f} KiB, batches of {result['batch_rows']} rows in a fixed shuffled order")
    print(table(result["rows"], [("config", "config", "s"), ("epoch", "epoch", "d"), ("hits", "hits", "d"), ("misses", "misses", "d"),
                                 ("hit_rate", "hit rate", ".1%"), ("prefetched", "prefetched", "d"),
                                 ("seconds", "s", ".2f"), ("mb_per_s", "MB/s", ".0f")]))
    print("\nMedian over epochs 2+ (the first epoch is cold or learning):")
    print(table(summary, [("config", "config", "s"), ("hit_rate", "hit rate", ".1%"), ("mb_per_s", "MB/s", ".0f"),
                          ("vs_local", "x LocalStore", ".2f")]))
    write_json(args.json, {"environment": env, "parameters": {k: v for k, v in result.items() if k != "rows"},
                           "epochs": result["rows"], "summary": summary})
    print(f"\nwrote {args.json}")
    return 0
