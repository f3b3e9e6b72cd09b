"""Put/get throughput of each tier and link, beside baselines measured in the same run; and
``--tune``: the I/O settings that move data fastest on a folder's device.

Reproduce:  tierstore bench [--quick] [--dir FOLDER] [--json FILE]
            tierstore bench --tune FOLDER [--tune-mib N] [--json FILE]
            (or: python benchmarks/bench_tiers.py ...)

The raw baseline is a plain loop on the same file system: ``os.pwrite``/``os.preadv`` of the
same sizes in the disk tier's chunk size from the same number of threads, with ``O_DIRECT`` when
the tier uses it, from and into the same preallocated aligned buffers, with ``fdatasync`` per
tensor when the tier is durable. After one unmeasured round (every file and extent written once),
ours and the baselines alternate, repetition by repetition;
each cell reports both rates (medians) and the median of the per-repetition ratios, and the
summary the geometric mean of the ratios over the disk cells of 4 MiB and more.

DeepSpeed's asynchronous I/O op (libaio) is a second baseline when ``deepspeed`` is importable,
at the settings its ``ds_nvme_tune`` found fastest in our runs (block 4 MiB, queue depth 32,
parallelism 2; ``--deepspeed-settings`` changes them). It moves the same buffers as ours and
the raw loop: its page-locked tensors (it bounces anything else through a copy), backed by huge
pages where the kernel can. To get it: ``apt-get install libaio-dev`` (the OS package), then
``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8`` (the source package,
built against the installed torch, not a project dependency); the op is compiled with g++ on
first use, which takes minutes (``ds_report`` shows whether it can be).

``--tune FOLDER`` sweeps chunk size, worker threads and queue depth (one at a time, keeping the
default of each unless another setting is clearly faster: ``tierstore.disk.tuning.choose_setting``)
with the disk tier's own put/get path on a scratch folder inside FOLDER, prints what each setting
reached and why each was chosen, and saves the choice in ``FOLDER/.tierstore-tuning.json``; a
``DiskTier(FOLDER, ...)`` uses those settings unless its arguments name others.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..arguments import bounded_int, positive_int, sizes_in_mib
from ..disk.tuning import (
    DEFAULTS,
    TUNING_FILE,
    IOSettings,
    choose_setting,
    load_tuning,
    save_tuning,
)
from ..outputs import check_output_file
from ..store import TierStore
from ..tiers import DeviceTier, DiskTier, HostTier
from ..units import format_bytes
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


class DeepSpeedAIO:
    """The second baseline: DeepSpeed's AIO op (libaio), each tensor a file of its own."""

    def __init__(self, folder: Path, block: int = 4 * MiB, queue_depth: int = 32, parallelism: int = 2) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder  # optional: see the module docstring

        # (block size, queue depth, single submit, overlap events, intra-op parallelism)
        self.handle = AsyncIOBuilder().load(verbose=False).aio_handle(block, queue_depth, False, True, parallelism)
        self.folder = folder
        self.settings = {"block": block, "queue_depth": queue_depth, "parallelism": parallelism, "single_submit": False, "overlap_events": True}

    def buffers(self, count: int, numel: int) -> list[torch.Tensor]:
        """``count`` float32 buffers DeepSpeed moves without its bounce copy (its page-locked
        tensors: on a CPU-only torch nothing else counts as pinned), asked for huge pages too;
        every side of the comparison uses these same buffers."""
        example = torch.empty(0, dtype=torch.float32)
        buffers = [self.handle.new_cpu_locked_tensor(numel, example) for _ in range(count)]
        for buffer in buffers:
            _collapse_huge_pages(buffer)
        return buffers

    def free(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self.handle.free_cpu_locked_tensor(buffer)

    def _path(self, index: int) -> str:
        return str(self.folder / f"deepspeed-{index}.bin")

    def prepare(self, buffers: list[torch.Tensor]) -> None:
        """Write each file once, unmeasured: the raw loop's file is preallocated, and the disk
        tier's segments are, so DeepSpeed's timed writes overwrite allocated blocks too."""
        for index, buffer in enumerate(buffers):
            self.handle.sync_pwrite(buffer, self._path(index))

    def write(self, buffer: torch.Tensor, index: int, fsync: bool) -> None:
        self.handle.sync_pwrite(buffer, self._path(index))
        if fsync:
            fd = os.open(self._path(index), os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def read(self, buffer: torch.Tensor, index: int) -> None:
        self.handle.sync_pread(buffer, self._path(index))

    def close(self, count: int) -> None:
        for index in range(count):
            Path(self._path(index)).unlink(missing_ok=True)


_MADV_COLLAPSE = 25  # Linux 6.1+: back a range with huge pages now, not when khugepaged gets to it


def _collapse_huge_pages(buffer: torch.Tensor) -> None:
    """Ask for huge pages behind a buffer allocated (and page-locked) elsewhere; best effort."""
    from ..tensors import _libc, advise_huge_pages

    advise_huge_pages(buffer.view(torch.uint8).reshape(-1))
    if _libc is not None:
        _libc.madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel() * buffer.element_size()), _MADV_COLLAPSE)


def deepspeed_aio(folder: Path, block: int = 4 * MiB, queue_depth: int = 32, parallelism: int = 2) -> DeepSpeedAIO | None:
    """DeepSpeed's AIO baseline, or None where ``deepspeed`` (or its op) is not available."""
    try:
        return DeepSpeedAIO(folder, block, queue_depth, parallelism)
    except Exception:  # not installed, or the op cannot be built here (no libaio-dev)
        return None


#: The cells the speed goal is over: these rows, for values of at least GOAL_MIN_BYTES.
GOAL_ROWS = (
    "disk put (durable)", "disk put (no fsync)", "disk put, 4 in flight (durable)", "disk put, 4 in flight (no fsync)",
    "disk get (into out=)", "disk get, 4 in flight",
)
GOAL_MIN_BYTES = 4 * MiB


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


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


async def measure_disk(
    folder: Path, size: int, count: int, reps: int, durable: bool, progress: tqdm, deepspeed: DeepSpeedAIO | None = None,
    settings: IOSettings | None = None,
) -> list[dict[str, Any]]:
    """Disk tier put and get of ``count`` tensors of ``size`` bytes vs the raw loop (and
    DeepSpeed's AIO op, if given).

    Ours and raw move the same bytes from and into the same reused aligned buffers
    (``tierstore.empty``); the put of ordinary (64-byte aligned) tensors and the get into new
    tensors are measured too.
    """
    from ..tensors import empty

    root = folder / f"disk-{size}-{int(durable)}"
    shutil.rmtree(root, ignore_errors=True)
    io = settings or DEFAULTS
    disk = DiskTier(root, 3 * count * size + 64 * MiB, durable=durable, chunk_size=io.chunk_size, io_threads=io.io_threads, queue_depth=io.queue_depth)
    plain = [torch.randn(size // 4) for _ in range(count)]
    # With DeepSpeed measured, all sides use its page-locked buffers (see DeepSpeedAIO.buffers).
    aligned = deepspeed.buffers(count, size // 4) if deepspeed is not None else [empty(size // 4) for _ in range(count)]
    for a, p in zip(aligned, plain, strict=True):
        a.copy_(p)
    # The raw loop moves the same bytes between the same memory as ours: how memory was
    # allocated changes O_DIRECT speed (huge pages, physical layout), so it must not differ.
    raw_buffers = [a.view(torch.uint8).reshape(-1) for a in aligned]
    timings: dict[str, list[float]] = {
        name: [] for name in ("put", "put_plain", "put_4", "raw_write", "get", "get_new", "get_4", "raw_read", "ds_write", "ds_read")
    }
    # CPU seconds of the whole process per phase: what the checksums and the orchestration cost,
    # a figure a busy machine disturbs far less than the elapsed times.
    cpu_times: dict[str, list[float]] = {name: [] for name in timings}
    async with TierStore([disk]) as store:
        raw = RawFile(folder / f"raw-{size}", count * size, disk.direct_io, disk.chunk_size, disk.io_threads)
        if deepspeed is not None:
            deepspeed.prepare(raw_buffers)
        try:
            # One unmeasured round first: the raw file is preallocated and DeepSpeed's files are
            # written (``prepare``); the disk tier's segments are created and both extents of
            # each value written once (a put is copy-on-write) before any round counts.
            for rep in range(reps + 1):
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

                def ds_writes() -> None:
                    for i, buffer in enumerate(raw_buffers):
                        deepspeed.write(buffer, i, fsync=durable)  # type: ignore[union-attr]

                def ds_reads() -> None:
                    for i, buffer in enumerate(raw_buffers):
                        deepspeed.read(buffer, i)  # type: ignore[union-attr]

                steps = [("put", puts), ("raw_write", raw_writes), ("put_plain", puts_plain), ("put_4", puts_4),
                         ("get", gets), ("raw_read", raw_reads), ("get_new", gets_new), ("get_4", gets_4)]
                if rep % 2:  # alternate who goes first
                    steps = [steps[1], steps[0], *steps[2:4], steps[5], steps[4], *steps[6:]]
                if deepspeed is not None:
                    steps[1:1] = [("ds_write", ds_writes)]
                    steps[-3:-3] = [("ds_read", ds_reads)]
                for name, fn in steps:
                    cpu = time.process_time()
                    elapsed = await _time(fn) if asyncio.iscoroutinefunction(fn) else await asyncio.to_thread(_raw_time, fn)
                    if rep:
                        timings[name].append(elapsed)
                        cpu_times[name].append(time.process_time() - cpu)
                if rep:
                    progress.update(1)
        finally:
            raw.close()
            if deepspeed is not None:
                deepspeed.close(count)
        direct = disk.direct_io
    if deepspeed is not None:
        deepspeed.free(aligned)
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
        row = {
            "what": what, "size_mib": size // MiB, "ours_gbs": total / median(timings[ours]) / 1e9,
            "baseline": "raw pwrite" if "put" in what else "raw preadv",
            "baseline_gbs": total / median(timings[base]) / 1e9, "ratio": median(pairs), "direct": direct,
            "goal_cell": what in GOAL_ROWS and size >= GOAL_MIN_BYTES,
            "ours_cpu_s_per_gb": median(cpu_times[ours]) / (total / 1e9), "baseline_cpu_s_per_gb": median(cpu_times[base]) / (total / 1e9),
        }
        ds = "ds_write" if "put" in what else "ds_read"
        if timings[ds]:
            row["deepspeed_gbs"] = total / median(timings[ds]) / 1e9
            row["ratio_deepspeed"] = median([d / o for o, d in zip(timings[ours], timings[ds], strict=True)])
        rows.append(row)
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
        try:
            async with gate:
                await coro
        finally:
            coro.close()  # (one cancelled at the gate, Ctrl-C, never started: no "never awaited" warning)

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


#: What ``--tune`` tries, one setting at a time (each with the best of those before it).
TUNE_CHUNKS = (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
TUNE_THREADS = (1, 2, 4, 8, 16)
TUNE_DEPTHS = (1, 2, 4, 8, 16)
_TUNE_SCRATCH = ".tierstore-tune-scratch"


async def measure_settings(
    folder: Path, candidates: list[IOSettings], value_bytes: int, count: int, reps: int
) -> list[dict[str, Any]]:
    """Write and read GB/s of the disk tier's own large-value path (checksums included) with
    each of ``candidates``: ``count`` values of ``value_bytes`` from the same buffers, two
    transfers in flight, no fsync (the device's rate, not its flush latency). The candidates
    take turns repetition by repetition (the order reversed every other one), so a disk that
    drifts does not favour one; medians of ``reps`` after one unmeasured round."""
    shutil.rmtree(folder, ignore_errors=True)
    buffers = [_random_buffer(value_bytes) for _ in range(count)]
    tiers = []
    records: list[list[Any]] = []
    timings: list[tuple[list[float], list[float]]] = [([], []) for _ in candidates]
    try:
        for i, settings in enumerate(candidates):
            tier = DiskTier(folder / str(i), count * value_bytes + 64 * MiB, durable=False, chunk_size=settings.chunk_size,
                            io_threads=settings.io_threads, queue_depth=settings.queue_depth)
            await tier.open()
            tiers.append(tier)
            records.append([await tier.allocate(value_bytes) for _ in range(count)])
        for rep in range(reps + 1):
            order = list(range(len(tiers)))
            for i in order if rep % 2 else reversed(order):
                tier, extents = tiers[i], records[i]
                started = time.perf_counter()
                sums = await _in_flight_results(2, [tier.write(e, b, value_bytes, sync=False) for e, b in zip(extents, buffers, strict=True)])
                write_time = time.perf_counter() - started
                reads = [_record(f"t{n}", value_bytes, e, c) for n, (e, c) in enumerate(zip(extents, sums, strict=True))]
                started = time.perf_counter()
                await _in_flight(2, [tier.read(r, b) for r, b in zip(reads, buffers, strict=True)])
                if rep:
                    timings[i][0].append(write_time)
                    timings[i][1].append(time.perf_counter() - started)
        direct = [tier.direct_io for tier in tiers]
    finally:
        for tier in tiers:
            await tier.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    total = count * value_bytes
    rows = []
    for settings, (writes, reads), is_direct in zip(candidates, timings, direct, strict=True):
        write_gbs, read_gbs = total / median(writes) / 1e9, total / median(reads) / 1e9
        # each repetition's score too: the choice compares settings repetition by repetition
        per_rep = [total / math.sqrt(w * r) / 1e9 for w, r in zip(writes, reads, strict=True)]
        rows.append({**settings.to_json(), "write_gbs": write_gbs, "read_gbs": read_gbs,
                     "score_gbs": math.sqrt(write_gbs * read_gbs), "score_reps_gbs": per_rep, "direct": is_direct})
    return rows


def _record(key: str, nbytes: int, extent: Any, checksums: tuple[int, ...]) -> Any:
    """A catalog record for bytes written straight into ``extent`` (the sweep reads them back
    through the tier's verified read path, without a catalog commit)."""
    from ..disk.catalog import DiskRecord
    from ..tensors import TensorMeta

    return DiskRecord(key, TensorMeta(torch.uint8, (nbytes,)), extent, 1, checksums)


async def tune(
    folder: Path, value_bytes: int = 64 * MiB, volume: int = 256 * MiB, reps: int = 3,
    chunks: tuple[int, ...] = TUNE_CHUNKS, threads: tuple[int, ...] = TUNE_THREADS, depths: tuple[int, ...] = TUNE_DEPTHS,
    progress: tqdm | None = None,
) -> tuple[IOSettings, list[dict[str, Any]], dict[str, str]]:
    """Sweep chunk size, then threads, then queue depth on ``folder``'s device (each with the
    choice of the earlier ones; the score is the geometric mean of write and read GB/s) and
    return the chosen settings, every measurement and, per sweep, why its setting was chosen.
    A sweep keeps the default unless another setting is clearly faster
    (``tierstore.disk.tuning.choose_setting``): a disk's figures can swing more between runs
    than the settings differ."""
    scratch = folder / _TUNE_SCRATCH
    count = max(2, volume // value_bytes)
    rows: list[dict[str, Any]] = []
    reasons: dict[str, str] = {}
    best = DEFAULTS

    async def sweep(stage: str, candidates: list[IOSettings], label: Any) -> IOSettings:
        measured = await measure_settings(scratch, candidates, value_bytes, count, reps)
        for row in measured:
            row["stage"] = stage
        rows.extend(measured)
        if progress is not None:
            progress.update(1)
        default = candidates.index(best) if best in candidates else None  # the setting carried in: the default's
        choice = choose_setting([row["score_reps_gbs"] for row in measured], default, [label(c) for c in candidates])
        measured[choice.index]["chosen"] = True
        reasons[stage] = choice.reason
        return candidates[choice.index]

    try:
        best = await sweep("chunk_size", [IOSettings(c, best.io_threads, best.queue_depth) for c in chunks if c <= value_bytes],
                           lambda s: f"chunk {format_bytes(s.chunk_size)}")
        best = await sweep("io_threads", [IOSettings(best.chunk_size, t, t) for t in threads], lambda s: f"{s.io_threads} threads")
        best = await sweep("queue_depth", [IOSettings(best.chunk_size, best.io_threads, d) for d in depths if d <= best.io_threads],
                           lambda s: f"queue depth {s.queue_depth}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return best, rows, reasons


def _random_buffer(nbytes: int) -> torch.Tensor:
    from ..tensors import aligned_empty

    buffer = aligned_empty(nbytes)
    buffer[:nbytes].view(torch.float32).normal_()
    return buffer


async def _in_flight_results(limit: int, coros: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(limit)

    async def one(coro: Any) -> Any:
        try:
            async with gate:
                return await coro
        finally:
            coro.close()  # (as in ``_in_flight``)

    return list(await asyncio.gather(*(one(c) for c in coros)))


def tune_main(folder: Path, volume_mib: int, json_path: Path | None) -> int:
    """``tierstore bench --tune FOLDER``: sweep, print, save the best beside the store."""
    problem = _unusable("--tune", folder, json_path, mode=0o700)  # (a store's folder: 0700, as DiskTier makes it)
    if problem is not None:
        print(f"tierstore bench: {problem}", file=sys.stderr)
        return 2
    # (values of at least the default chunk, so every sweep measures the default beside the others:
    # a chunk size never compared with it is not saved, and the folder's chunk size is for good)
    value_bytes = max(DEFAULTS.chunk_size, min(64 * MiB, volume_mib * MiB // 2))
    started = time.perf_counter()
    with tqdm(total=3, desc="tierstore bench --tune (chunk size, threads, queue depth)", unit="sweep", leave=False, disable=None) as bar:
        best, rows, reasons = asyncio.run(tune(folder, value_bytes=value_bytes, volume=volume_mib * MiB, progress=bar))
    elapsed = time.perf_counter() - started
    for row in rows:
        row["chunk"] = format_bytes(row["chunk_size"])
        row["best"] = "<- chosen" if row.get("chosen") else ""
    print(table(rows, [("stage", "sweeping", "s"), ("chunk", "chunk", "s"), ("io_threads", "threads", "d"), ("queue_depth", "queue depth", "d"),
                       ("write_gbs", "write GB/s", ".2f"), ("read_gbs", "read GB/s", ".2f"), ("score_gbs", "geomean", ".2f"), ("best", "", "s")]))
    details = {
        "measured": [{k: v for k, v in row.items() if k not in ("chunk", "best")} for row in rows],
        "choices": reasons,
        "method": f"disk tier write+read of {len(rows) and max(2, volume_mib * MiB // value_bytes)} values of "
                  f"{format_bytes(value_bytes)}, 2 in flight, no fsync, O_DIRECT where supported; the settings of a sweep interleaved, medians of 3 repetitions",
        "seconds": round(elapsed, 1), "environment": environment(folder),
    }
    path = save_tuning(folder, best, details)
    print("\nwhy (a setting must beat the default in most repetitions and by more than their spread):")
    for stage, reason in reasons.items():
        print(f"  {stage}: {reason}")
    print(f"\nbest: {best.describe()}  ({elapsed:.0f} s)\nsaved: {path} (a DiskTier on {folder} uses it unless its arguments say otherwise)")
    if (folder / "catalog").is_dir():
        print("note: this folder holds a store already; its chunk size was fixed when it was created (threads and queue depth apply)")
    if json_path is not None:
        write_json(json_path, {"benchmark": "bench_tiers --tune", "folder": str(folder), "best": best.to_json(), **details})
        print(f"JSON: {json_path}")
    return 0


def _deepspeed_settings(text: str) -> tuple[int, int, int]:
    """``BLOCK_MIB,QUEUE_DEPTH,PARALLELISM``: a block of at least a page (4 KiB) and a queue depth
    and a parallelism of 1 to 1,024 (DeepSpeed's own sweeps stay far inside these), as bytes
    and two counts."""
    parts = text.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r} is not BLOCK_MIB,QUEUE_DEPTH,PARALLELISM (e.g. 4,32,2)")
    (block,) = sizes_in_mib(parts[0], least=4096)
    return block, bounded_int(parts[1], 1, 1024), bounded_int(parts[2], 1, 1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB only, fewer repetitions (about a minute)")
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench"), help="scratch folder on the file system to test")
    parser.add_argument("--json", type=Path, default=None, help="where to write the JSON (default benchmarks/results/bench_tiers.json; "
                        "with --tune: none besides the tuning file)")
    parser.add_argument("--reps", type=positive_int, default=None, help="repetitions per figure (default 5, quick 3)")
    parser.add_argument("--volume-mib", type=positive_int, default=None, help="MiB moved per repetition (default 512, quick 128)")
    parser.add_argument("--sizes-mib", type=sizes_in_mib, default=None,
                        help="value sizes in MiB, comma-separated (default 1,16,64; quick 1,16)")
    parser.add_argument("--disk-only", action="store_true", help="measure the disk tier only (no links, memory tiers or hit latency)")
    parser.add_argument("--tune", type=Path, metavar="DIR", default=None,
                        help=f"sweep chunk size, threads and queue depth on DIR's device and save the best in DIR/{TUNING_FILE}")
    parser.add_argument("--tune-mib", type=positive_int, default=256,
                        help="MiB moved per setting and direction by --tune (default 256; at least twice the default chunk, 8; "
                             "chunks up to half of it are swept: below 32, not all of 1-16 MiB)")
    parser.add_argument("--deepspeed-settings", type=_deepspeed_settings, default="4,32,2", metavar="BLOCK_MIB,QUEUE_DEPTH,PARALLELISM",
                        help="DeepSpeed AIO baseline settings (default 4,32,2), used when deepspeed is importable")
    args = parser.parse_args(argv)
    if args.tune is not None:
        return tune_main(args.tune, args.tune_mib, args.json)
    json_path = args.json or Path("benchmarks/results/bench_tiers.json")
    sizes = [1 * MiB, 16 * MiB] if args.quick else [1 * MiB, 16 * MiB, 64 * MiB]
    if args.sizes_mib:
        sizes = args.sizes_mib
    reps = args.reps or (3 if args.quick else 5)
    volume = (args.volume_mib or (128 if args.quick else 512)) * MiB
    problem = _unusable("--dir", args.dir, json_path)
    if problem is not None:
        print(f"tierstore bench: {problem}", file=sys.stderr)
        return 2
    try:
        return _bench(args, json_path, sizes, reps, volume)
    finally:
        _remove_scratch(args.dir, sizes)  # (also when interrupted: each run removes its own as it ends)


def _unusable(option: str, folder: Path, json_path: Path | None, mode: int = 0o777) -> str | None:
    """Why the benchmark cannot work in ``folder`` (given as ``option``; it makes it, with
    ``mode``) or write its JSON at ``json_path``, or None: checked before it measures, not
    after."""
    if folder.exists() and not folder.is_dir():
        return f"{option} {folder} is not a folder"
    try:
        folder.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as error:
        return f"{option}: cannot make the folder {folder}: {error.strerror or error}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{option} {folder}: this user cannot write in it"
    if json_path is not None:
        try:
            check_output_file(json_path)
        except ValueError as exc:
            return f"--json: {exc}"
    return None


def _remove_scratch(folder: Path, sizes: list[int]) -> None:
    """The files and folders the benchmark makes in ``folder`` (only those: it may hold others)."""
    for size in sizes:
        for name in (f"disk-{size}-0", f"disk-{size}-1", f"links-{size}"):
            shutil.rmtree(folder / name, ignore_errors=True)
        (folder / f"raw-{size}").unlink(missing_ok=True)
    (folder / "raw-rate.bin").unlink(missing_ok=True)


def _bench(args: argparse.Namespace, json_path: Path, sizes: list[int], reps: int, volume: int) -> int:
    """The measurements, table and JSON of ``tierstore bench`` (``main``'s arguments)."""
    rows: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []

    block, depth, parallelism = args.deepspeed_settings
    deepspeed = deepspeed_aio(args.dir, block, depth, parallelism)
    # The disk cells use the settings `--tune` saved for this folder, if it did (the raw loop
    # takes the same chunk size and threads).
    tuned = load_tuning(args.dir)
    settings = tuned or DEFAULTS
    print(f"disk tier I/O settings: {settings.describe()} ({'tuning file in ' + str(args.dir) if tuned else 'defaults'})")

    async def run() -> None:
        steps = len(sizes) * reps * (2 if args.disk_only else 4) + (0 if args.disk_only else 2)
        with tqdm(total=steps, desc="tierstore bench", unit="run", leave=False, disable=None) as progress:
            for size in sizes:
                count = max(2, volume // size)
                for durable in (True, False):
                    rows.extend(await measure_disk(args.dir, size, count, reps, durable, progress, deepspeed, settings))
                if args.disk_only:
                    continue
                rows.extend(await measure_links(args.dir, size, max(2, count // 2), reps, progress))
                rows.extend(await measure_memory_tiers(size, count, reps, progress))
            if not args.disk_only:
                for nbytes in (4096, MiB):
                    latency.append(await measure_hit_latency(nbytes, 2000 if not args.quick else 500))
                    progress.update(1)

    asyncio.run(run())
    rows.sort(key=lambda r: (r["what"], r["size_mib"]))
    shown = [{**r, "counted": "*" if r.get("goal_cell") else ""} for r in rows]
    columns = [("counted", "goal", "s"), ("what", "measurement", "s"), ("size_mib", "MiB", "d"), ("ours_gbs", "GB/s", ".2f"),
               ("baseline", "baseline", "s"), ("baseline_gbs", "GB/s", ".2f"), ("ratio", "ours/base", ".2f"),
               ("ours_cpu_s_per_gb", "CPU s/GB", ".3f"), ("baseline_cpu_s_per_gb", "base CPU s/GB", ".3f")]
    if deepspeed is not None:
        columns += [("deepspeed_gbs", "DeepSpeed AIO GB/s", ".2f"), ("ratio_deepspeed", "ours/DeepSpeed", ".2f")]
    print(table(shown, columns))
    print("(ours/base: median over repetitions of the ratio of adjacent runs; CPU s/GB: process CPU time per GB moved;\n"
          f" goal *: the cells the goal below counts, the disk tier's puts and gets of {GOAL_MIN_BYTES // MiB} MiB and more; "
          "the others are for reference)")
    if deepspeed is None:
        print("(DeepSpeed AIO baseline: deepspeed is not importable here; see `tierstore bench --help` to add it)")
    if latency:
        print()
        print(table(latency, [("what", "measurement", "s"), ("size_kib", "KiB", "d"), ("median_us", "median µs", ".1f"),
                              ("p90_us", "p90 µs", ".1f"), ("clone_median_us", "clone() µs", ".1f")]))
    cells = [r for r in rows if r.get("goal_cell")]
    summary: dict[str, Any] = {"goal_cells": len(cells)}
    goals: dict[str, bool] = {}
    for key, against in (("ratio", "raw loop"), ("ratio_deepspeed", "DeepSpeed AIO")):
        ratios = [r[key] for r in cells if key in r]
        if not ratios:
            continue
        low = min(cells, key=lambda r: r.get(key, math.inf))
        summary[f"geomean_{key}"] = geometric_mean(ratios)
        summary[f"min_{key}"] = {"ratio": low[key], "what": low["what"], "size_mib": low["size_mib"]}
        goals[f"disk cells >= 4 MiB vs the {against}: geometric mean of ratios >= 0.95"] = summary[f"geomean_{key}"] >= 0.95
        goals[f"disk cells >= 4 MiB vs the {against}: no cell below 0.85"] = low[key] >= 0.85
        print(f"\nvs the {against}: geometric mean of ratios over {len(ratios)} disk cells >= 4 MiB = {summary[f'geomean_{key}']:.3f}, "
              f"lowest {low[key]:.2f} ({low['what']}, {low['size_mib']} MiB)")
    if latency:
        goals["host hit <= 50 us median (4 KiB)"] = latency[0]["median_us"] <= 50
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(json_path, {"benchmark": "bench_tiers", "environment": environment(args.dir), "sizes_mib": [s / MiB for s in sizes],
                           "io_settings": {**settings.to_json(), "from": "tuning file" if tuned else "defaults"},
                           "reps": reps, "volume_mib": volume // MiB, "goal_rows": list(GOAL_ROWS), "summary": summary,
                           "deepspeed": deepspeed.settings if deepspeed is not None else None,
                           "rows": rows, "hit_latency": latency, "goals": goals})
    print(f"\nJSON: {json_path}")
    return 0
