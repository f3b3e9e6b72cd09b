"""Put/get throughput of each tier and link, beside a raw baseline measured in the same run.

Reproduce:  tierstore bench [--quick] [--dir FOLDER] [--json FILE]
            (or: python benchmarks/bench_tiers.py ...)

The raw baseline is a plain loop on the same file system: ``os.pwrite``/``os.preadv`` of the
same sizes in the disk tier's chunk size from the same number of threads, with ``O_DIRECT`` when
the tier uses it, from and into preallocated aligned buffers, with ``fdatasync`` per tensor when
the tier is durable. Ours and raw alternate, repetition by repetition; figures are medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..store import TierStore
from ..tiers import DeviceTier, DiskTier, HostTier
from .common import environment, median, table, write_json

MiB = 1 << 20


class RawFile:
    """The baseline: a preallocated file written and read in chunks by a thread pool."""

    def __init__(self, path: Path, size: int, direct: bool, chunk: int, threads: int) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, size)
        self.chunk = chunk
        self.pool = ThreadPoolExecutor(threads)

    def _spans(self, nbytes: int) -> list[tuple[int, int]]:
        return [(start, min(self.chunk, nbytes - start)) for start in range(0, nbytes, self.chunk)]

    def write(self, buffer: torch.Tensor, offset: int, fsync: bool) -> None:
        view = buffer.numpy().data
        list(self.pool.map(lambda s: os.pwrite(self.fd, view[s[0] : s[0] + s[1]], offset + s[0]), self._spans(len(view))))
        if fsync:
            os.fdatasync(self.fd)

    def read(self, buffer: torch.Tensor, offset: int) -> None:
        view = buffer.numpy().data
        list(self.pool.map(lambda s: os.preadv(self.fd, [view[s[0] : s[0] + s[1]]], offset + s[0]), self._spans(len(view))))

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


async def _time(coro_fn: Any) -> float:
    started = time.perf_counter()
    await coro_fn()
    return time.perf_counter() - started



def raw_rates(folder: Path, nbytes: int, reps: int = 3) -> tuple[float, float]:
    """(read, write) GB/s of the raw pread/pwrite loop on ``folder``'s file system: 4 MiB requests
    by 4 threads, O_DIRECT where the file system allows it, medians of ``reps``."""
    from ..tensors import aligned_empty

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "raw-rate.bin"
    try:
        raw = RawFile(path, nbytes, direct=True, chunk=4 * MiB, threads=4)
    except OSError:
        raw = RawFile(path, nbytes, direct=False, chunk=4 * MiB, threads=4)
    buffer = aligned_empty(nbytes)
    buffer.view(torch.float32).normal_()
    writes, reads = [], []
    try:
        raw.write(buffer, 0, fsync=False)
        for _ in range(reps):
            started = time.perf_counter()
            raw.write(buffer, 0, fsync=False)
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            raw.read(buffer, 0)
            reads.append(time.perf_counter() - started)
    finally:
        raw.close()
        path.unlink(missing_ok=True)
    return nbytes / median(reads) / 1e9, nbytes / median(writes) / 1e9


def _raw_time(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


async def measure_disk(folder: Path, size: int, count: int, reps: int, durable: bool, progress: tqdm) -> list[dict[str, Any]]:
    """Disk tier put and get of ``count`` tensors of ``size`` bytes vs the raw loop.

    Ours and raw move the same bytes from and into the same reused aligned buffers
    (``tierstore.empty``); the put of ordinary (64-byte aligned) tensors and the get into new
    tensors are measured too.
    """
    from ..tensors import empty

    root = folder / f"disk-{size}-{int(durable)}"
    shutil.rmtree(root, ignore_errors=True)
    disk = DiskTier(root, 3 * count * size + 64 * MiB, durable=durable)
    plain = [torch.randn(size // 4) for _ in range(count)]
    aligned = [empty(size // 4) for _ in range(count)]
    for a, p in zip(aligned, plain, strict=True):
        a.copy_(p)
    # The raw loop moves the same bytes between the same memory as ours: how memory was
    # allocated changes O_DIRECT speed (huge pages, physical layout), so it must not differ.
    raw_buffers = [a.view(torch.uint8).reshape(-1) for a in aligned]
    timings: dict[str, list[float]] = {
        name: [] for name in ("put", "put_plain", "put_4", "raw_write", "get", "get_new", "get_4", "raw_read")
    }
    async with TierStore([disk]) as store:
        raw = RawFile(folder / f"raw-{size}", count * size, disk.direct_io, disk.chunk_size, disk.io_threads)
        try:
            for rep in range(reps):
                async def puts(tensors: list[torch.Tensor] = aligned) -> None:
                    for i, tensor in enumerate(tensors):
                        await store.put(f"t{i}", tensor)

                async def puts_plain() -> None:
                    await puts(plain)

                async def gets() -> None:
                    for i, out in enumerate(aligned):
                        await store.get(f"t{i}", out=out)

                async def puts_4() -> None:
                    await _in_flight(4, [store.put(f"t{i}", t) for i, t in enumerate(aligned)])

                async def gets_4() -> None:
                    await _in_flight(4, [store.get(f"t{i}", out=out) for i, out in enumerate(aligned)])

                async def gets_new() -> None:
                    for i in range(count):
                        await store.get(f"t{i}")

                def raw_writes() -> None:
                    for i, buffer in enumerate(raw_buffers):
                        raw.write(buffer, i * size, fsync=durable)

                def raw_reads() -> None:
                    for i, buffer in enumerate(raw_buffers):
                        raw.read(buffer, i * size)

                steps = [("put", puts), ("raw_write", raw_writes), ("put_plain", puts_plain), ("put_4", puts_4),
                         ("get", gets), ("raw_read", raw_reads), ("get_new", gets_new), ("get_4", gets_4)]
                if rep % 2:  # alternate who goes first
                    steps = [steps[1], steps[0], *steps[2:4], steps[5], steps[4], *steps[6:]]
                for name, fn in steps:
                    elapsed = await _time(fn) if asyncio.iscoroutinefunction(fn) else await asyncio.to_thread(_raw_time, fn)
                    timings[name].append(elapsed)
                progress.update(1)
        finally:
            raw.close()
        direct = disk.direct_io
    shutil.rmtree(root, ignore_errors=True)
    (folder / f"raw-{size}").unlink(missing_ok=True)
    total = count * size
    label = "durable" if durable else "no fsync"
    measured = [
        ("put", "raw_write", f"disk put ({label})"),
        ("put_4", "raw_write", f"disk put, 4 in flight ({label})"),
        ("put_plain", "raw_write", f"disk put, unaligned tensor ({label})"),
    ]
    if durable:
        measured += [
            ("get", "raw_read", "disk get (into out=)"),
            ("get_4", "raw_read", "disk get, 4 in flight"),
            ("get_new", "raw_read", "disk get (new tensor)"),
        ]
    rows = []
    for ours, base, what in measured:
        pairs = [b / o for o, b in zip(timings[ours], timings[base], strict=True)]
        rows.append({
            "what": what, "size_mib": size // MiB, "ours_gbs": total / median(timings[ours]) / 1e9,
            "baseline": "raw pwrite" if "put" in what else "raw preadv",
            "baseline_gbs": total / median(timings[base]) / 1e9, "ratio": median(pairs), "direct": direct,
        })
    return rows


async def measure_links(folder: Path, size: int, count: int, reps: int, progress: tqdm) -> list[dict[str, Any]]:
    """Bytes moved between tiers: disk->host (promote), host->disk (write back), host<->device."""
    rows = []
    root = folder / f"links-{size}"
    total = count * size
    tensors = [torch.randn(size // 4) for _ in range(count)]
    timings: dict[str, list[float]] = {"disk->host": [], "host->disk": [], "host->device": [], "memcpy": []}
    for _ in range(reps):
        shutil.rmtree(root, ignore_errors=True)
        tiers = [DeviceTier("cpu", 2 * total + 64 * MiB), HostTier(2 * total + 64 * MiB), DiskTier(root, 3 * total + 64 * MiB)]
        async with TierStore(tiers) as store:
            keys = [f"t{i}" for i in range(count)]
            for key, tensor in zip(keys, tensors, strict=True):
                await store.put(key, tensor, tier="host")
            timings["host->disk"].append(await _time(store.flush))
            for key, tensor in zip(keys, tensors, strict=True):
                await store.put(key, tensor, tier="disk")
            timings["disk->host"].append(await _time(partial(_prefetch, store, keys, "host")))
            timings["host->device"].append(await _time(partial(_prefetch, store, keys, "device")))
            targets = [torch.empty_like(t) for t in tensors]
            timings["memcpy"].append(_raw_time(partial(_copy_all, targets, tensors)))
        progress.update(1)
    shutil.rmtree(root, ignore_errors=True)
    for link, baseline in (("host->disk", None), ("disk->host", None), ("host->device", "memcpy")):
        gbs = total / median(timings[link]) / 1e9
        row: dict[str, Any] = {"what": f"link {link}", "size_mib": size // MiB, "ours_gbs": gbs}
        if baseline:
            base = total / median(timings[baseline]) / 1e9
            row.update(baseline="tensor.copy_", baseline_gbs=base, ratio=gbs / base)
        rows.append(row)
    return rows


async def _in_flight(limit: int, coros: list[Any]) -> None:
    """Await ``coros`` with at most ``limit`` running at a time."""
    gate = asyncio.Semaphore(limit)

    async def one(coro: Any) -> None:
        async with gate:
            await coro

    await asyncio.gather(*(one(c) for c in coros))


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


async def _prefetch(store: TierStore, keys: list[str], tier: str) -> None:
    await (await store.prefetch(keys, tier))


async def measure_memory_tiers(size: int, count: int, reps: int, progress: tqdm) -> list[dict[str, Any]]:
    """Put and get on a host tier vs clone()."""
    rows = []
    tensors = [torch.randn(size // 4) for _ in range(count)]
    ours_put, ours_get, clone = [], [], []
    async with TierStore([HostTier(2 * count * size + 64 * MiB)]) as store:
        for _ in range(reps):
            async def puts() -> None:
                for i, tensor in enumerate(tensors):
                    await store.put(f"t{i}", tensor)

            async def gets() -> None:
                for i in range(count):
                    await store.get(f"t{i}")

            ours_put.append(await _time(puts))
            ours_get.append(await _time(gets))
            clone.append(_raw_time(lambda: [t.clone() for t in tensors]))
            progress.update(1)
    total = count * size
    for what, timing in (("host put", ours_put), ("host get", ours_get)):
        gbs = total / median(timing) / 1e9
        base = total / median(clone) / 1e9
        rows.append({"what": what, "size_mib": size // MiB, "ours_gbs": gbs, "baseline": "tensor.clone", "baseline_gbs": base, "ratio": gbs / base})
    return rows


async def measure_hit_latency(nbytes: int, gets: int) -> dict[str, Any]:
    """Median microseconds per host-tier hit (``await store.get``) vs a bare ``clone()``."""
    async with TierStore([HostTier(64 * MiB)]) as store:
        value = torch.randn(max(1, nbytes // 4))
        await store.put("hot", value)
        samples, clones = [], []
        for _ in range(gets):
            started = time.perf_counter()
            await store.get("hot")
            samples.append(time.perf_counter() - started)
            started = time.perf_counter()
            value.clone()
            clones.append(time.perf_counter() - started)
    return {
        "what": "host hit latency", "size_kib": nbytes // 1024,
        "median_us": statistics.median(samples) * 1e6, "p90_us": sorted(samples)[int(0.9 * len(samples))] * 1e6,
        "clone_median_us": statistics.median(clones) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB only, fewer repetitions (about a minute)")
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench"), help="scratch folder on the file system to test")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_tiers.json"), help="where to write the JSON")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 5, quick 3)")
    parser.add_argument("--volume-mib", type=int, default=None, help="MiB moved per repetition (default 512, quick 128)")
    args = parser.parse_args(argv)
    sizes = [1 * MiB, 16 * MiB] if args.quick else [1 * MiB, 16 * MiB, 64 * MiB]
    reps = args.reps or (3 if args.quick else 5)
    volume = (args.volume_mib or (128 if args.quick else 512)) * MiB
    args.dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []

    async def run() -> None:
        steps = len(sizes) * reps * 4 + 2
        with tqdm(total=steps, desc="tierstore bench", unit="run", leave=False, disable=None) as progress:
            for size in sizes:
                count = max(2, volume // size)
                rows.extend(await measure_disk(args.dir, size, count, reps, durable=True, progress=progress))
                rows.extend(await measure_disk(args.dir, size, count, reps, durable=False, progress=progress))
                rows.extend(await measure_links(args.dir, size, max(2, count // 2), reps, progress))
                rows.extend(await measure_memory_tiers(size, count, reps, progress))
            for nbytes in (4096, MiB):
                latency.append(await measure_hit_latency(nbytes, 2000 if not args.quick else 500))
                progress.update(1)

    asyncio.run(run())
    rows.sort(key=lambda r: (r["what"], r["size_mib"]))
    print(table(rows, [("what", "measurement", "s"), ("size_mib", "MiB", "d"), ("ours_gbs", "GB/s", ".2f"),
                       ("baseline", "baseline", "s"), ("baseline_gbs", "GB/s", ".2f"), ("ratio", "ours/base", ".2f")]))
    print("(ours/base: median over repetitions of the ratio of adjacent runs)")
    print()
    print(table(latency, [("what", "measurement", "s"), ("size_kib", "KiB", "d"), ("median_us", "median µs", ".1f"),
                          ("p90_us", "p90 µs", ".1f"), ("clone_median_us", "clone() µs", ".1f")]))
    goal_rows = ("disk put (no fsync)", "disk put, 4 in flight (durable)", "disk get (into out=)", "disk get, 4 in flight")
    disk_rows = [r for r in rows if r["what"] in goal_rows and r["size_mib"] >= 4]
    goals = {
        "disk put and get >= 0.90 x raw for tensors >= 4 MiB (" + ", ".join(goal_rows) + ")": all(r["ratio"] >= 0.9 for r in disk_rows),
        "host hit <= 50 us median (4 KiB)": latency[0]["median_us"] <= 50,
    }
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(args.json, {"benchmark": "bench_tiers", "environment": environment(args.dir), "sizes_mib": [s // MiB for s in sizes],
                           "reps": reps, "rows": rows, "hit_latency": latency, "goals": goals})
    print(f"\nJSON: {args.json}")
    return 0
