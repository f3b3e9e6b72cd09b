"""Optimizer benchmark: host update throughput against torch's AdamW, and a training step of the
demo model with state in host memory and on disk against torch's AdamW all in memory.

Reproduce:  python benchmarks/bench_optim.py [--quick] [--json FILE] [--dir FOLDER]

(a) ``TieredAdamW.step()`` on parameters whose gradients are set, state in a host tier, against
    ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` on the same tensors, in the same
    process, alternating; parameters/s and GB/s (28 bytes moved per parameter: read weight,
    grad and two moments, write weight and two moments) beside the memory bandwidth measured
    in the same run (a large tensor copy, read + write bytes).
(b) a training step (forward, backward, step) of the demo GPT: torch AdamW in memory; ours with
    state in the host tier; ours with state paged to disk (host tier far smaller than the state),
    after and in backward. For disk the goal compares against the larger of the compute time
    (forward + backward, measured in the in-memory run) and the disk transfer time (bytes read and
    written per step at the disk bandwidth measured in the same run with the raw pread/pwrite loop).
    The optimizers take turns in blocks of ``BLOCK`` steps, each store settling at the end of its
    block (counted in it); a step's time is its block's over ``BLOCK``, the first block untimed.
(e) the two goals of the faster step, each side by side in one run (medians): the demo model
    with half its Adam state on disk (host tier of half the state, the disk tier in ``--dir``:
    use a real disk, not tmpfs) against torch's AdamW step in memory (forward + backward +
    update) and against the disk time of the step's bytes (read and written, from the store's
    link counters) at the raw pread/pwrite rates measured in the same run: step / max(both),
    taking turns in blocks as (b) does, beside the same store with its disk files in the page
    cache (``direct=False``: what of the gap is the store's rather than the disk's), with the CPU
    time of that store's ``step()`` by thread (``step_cpu``: training, loop, disk, OpenMP's
    spinning); and ``TieredAdamW.step()`` with all state resident in a host tier on 64M parameters (8 x 8M;
    ``--quick``: 8 x 1M) against ``torch.optim.AdamW(fused=True)`` on the same tensors,
    alternating: the throughput ratio.
(c) the same step on the emulated device (``--link``, default ``25GB/s,10us``: the CPU's tensors
    count as device memory behind a link, every crossing a real copy at that speed) beside the
    plain CPU (gradients lent, nothing crosses), state in host: the time the training loop waited
    in ``step()``, bytes over the link each way, and the fraction of transfer time hidden behind
    compute: the overlap of the transfer spans with the forward/backward spans (marked with
    ``opt.timeline.span``) over the total transfer time. In the same run, the cost of clipping
    with ``torch.nn.utils.clip_grad_norm_`` (which changes every gradient after backward, so each
    is copied again in ``step()``) against ``max_grad_norm=`` (norms of the copies taken in
    backward).
(f) compressed Adam state (``state_precision``/``master_weights``): see ``tierstore.bench.precision``.
(g) compressed state where the step is disk-bound: see ``tierstore.bench.compressed_step``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..device import emulate_device
from ..models import GPT, GPTConfig, synthetic_batches
from ..optim import TieredAdamW
from ..optim.precision import planned_state_bytes
from ..store import TierStore
from ..sync import run
from ..tiers import DiskTier, HostTier
from . import compressed_step, precision
from .common import environment, median, settle_store, table, write_json
from .tiers import raw_rates

MiB = 1 << 20
#: Training steps an optimizer runs back to back in one timed block of (b) and (e): the
#: optimizers take turns block by block, a store settling (its write-backs and the next step's
#: prefetch ended) before the next one's block starts, that time counted in its own block.
#: Taking turns step by step let one store's background work run in the other's steps.
BLOCK = 3


def memory_bandwidth(nbytes: int = 256 * MiB, reps: int = 5) -> float:
    """GB/s of a STREAM-like triad ``a = b + 2 c`` on large tensors (3 x nbytes moved)."""
    b = torch.empty(nbytes // 4).normal_()
    c = torch.empty_like(b).normal_()
    a = torch.empty_like(b)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        torch.add(b, c, alpha=2.0, out=a)
        times.append(time.perf_counter() - started)
    return 3 * nbytes / median(times) / 1e9


def disk_bandwidth(folder: Path, nbytes: int = 128 * MiB) -> tuple[float, float]:
    """(read, write) GB/s of the raw O_DIRECT pread/pwrite loop on ``folder``'s file system."""
    return raw_rates(folder, nbytes)


def _alternating_steps(
    makers: dict[str, Callable[[list[torch.nn.Parameter]], Any]], numel: int, tensors: int, reps: int, progress: tqdm
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each optimizer ``makers`` builds steps on its own copy of the same ``tensors`` tensors and
    gradients, taking turns step by step, ``reps`` times after a first step that creates the
    state. Returns each one's step times and, for a ``TieredAdamW``, its host-update times."""
    torch.manual_seed(0)
    base = [torch.randn(numel) for _ in range(tensors)]
    grads = [torch.randn(numel) for _ in range(tensors)]
    runs: dict[str, tuple[list[torch.nn.Parameter], Any]] = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(p.clone()) for p in base]
        runs[name] = (params, make(params))
    times: dict[str, list[float]] = {name: [] for name in runs}
    host_updates: dict[str, list[float]] = {name: [] for name, (_, opt) in runs.items() if isinstance(opt, TieredAdamW)}
    for rep in range(reps + 1):
        for name, (params, opt) in runs.items():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            started = time.perf_counter()
            opt.step()
            if rep:  # the first step creates the state
                times[name].append(time.perf_counter() - started)
                if name in host_updates:
                    host_updates[name].append(opt.time_report().host_update)
        progress.update(1)
    for name in host_updates:
        runs[name][1].close()
    return times, host_updates


def update_throughput(numel: int, tensors: int, reps: int, progress: tqdm) -> list[dict[str, Any]]:
    """Torch's AdamW step against ours on the same tensors: ours as a whole ``step()`` and as its
    host update alone (the math on the store's buffers, from the time report)."""
    times, host_updates = _alternating_steps({
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "TieredAdamW step()": lambda ps: TieredAdamW(ps, lr=1e-3, offload="host"),
    }, numel, tensors, reps, progress)
    times["TieredAdamW host update"] = host_updates["TieredAdamW step()"]
    total = numel * tensors
    rows = []
    for name, samples in times.items():
        per_second = total / median(samples)
        rows.append({"what": name, "params": total, "gparams_s": per_second / 1e9, "gbs": 28 * per_second / 1e9})
    return rows


def training_steps(args: argparse.Namespace, progress: tqdm) -> tuple[list[dict[str, Any]], dict[str, float]]:
    config = GPTConfig()
    torch.manual_seed(0)
    template = GPT(config).to(args.device)
    state_bytes = _state_bytes(template)
    variants: dict[str, Any] = {
        "torch AdamW, in memory": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, fused=True),
        "tierstore, state in host": lambda m: TieredAdamW(m.parameters(), lr=3e-3, offload="host"),
    }
    for mode in ("after", "in"):
        label = f"tierstore, state on disk ({mode} backward)"
        root = args.dir / f"optim-{mode}"
        shutil.rmtree(root, ignore_errors=True)

        def make(m: GPT, root: Path = root, mode: str = mode) -> TieredAdamW:
            from policies import MIN, ScheduleLearned

            schedule = ScheduleLearned()
            store = TierStore([HostTier(state_bytes // 2), DiskTier(root, 4 * state_bytes, durable=False)],
                              eviction=lambda: MIN(schedule), prefetch=schedule)
            return TieredAdamW(m.parameters(), lr=3e-3, store=store, step_in_backward=mode == "in")

        variants[label] = make
    models = {name: copy.deepcopy(template) for name in variants}
    optimizers = {name: make(models[name]) for name, make in variants.items()}
    compute: list[float] = []
    steps, counted = _train_in_blocks(args, config, {name: (models[name], optimizers[name]) for name in variants},
                                      lambda name: (float(_disk_bytes(optimizers[name])),), progress, compute)
    disk_bytes = {name: [delta[0] for delta in deltas] for name, deltas in counted.items()}
    for opt in optimizers.values():
        if isinstance(opt, TieredAdamW):
            opt.close()
            run(opt.store.aclose())  # (closes only a store it made)
    rows = []
    reference = median(steps["torch AdamW, in memory"])
    for name in variants:
        rows.append({"what": name, "step_ms": median(steps[name]) * 1e3, "ratio": median(steps[name]) / reference,
                     "disk_mib": median([float(b) for b in disk_bytes[name]]) / MiB})
    return rows, {"compute_ms": median(compute) * 1e3, "state_mib": state_bytes / MiB}


def _train_in_blocks(
    args: argparse.Namespace, config: GPTConfig, runs: dict[str, tuple[GPT, Any]], count: Callable[[str], tuple[float, ...]],
    progress: tqdm, compute: list[float] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, ...]]]]:
    """Train each of ``runs`` (model, optimizer) on the same batches, taking turns block by block
    (``BLOCK`` steps back to back; a store settles at its block's end, counted in it); the first
    block warms up. Returns, per run, each timed block's time per step and the change per step
    of the counters ``count(name)`` reads; ``compute`` gets the forward + backward times of the
    runs named ``torch...``."""
    batches = {name: synthetic_batches(config, args.batch, seed=1, device=args.device) for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    counted: dict[str, list[tuple[float, ...]]] = {name: [] for name in runs}
    for block in range(args.steps // BLOCK):
        for name, (model, opt) in runs.items():
            before = count(name)
            started = time.perf_counter()
            for _ in range(BLOCK):
                tokens = next(batches[name])
                began = time.perf_counter()
                opt.zero_grad()
                model.loss(tokens).backward()
                if compute is not None and name.startswith("torch"):
                    _sync(args.device)
                    compute.append(time.perf_counter() - began)
                opt.step()
                _sync(args.device)
            if isinstance(opt, TieredAdamW):
                settle_store(opt.store)
            if block:  # the first block warms up: state creation, schedule learning
                times[name].append((time.perf_counter() - started) / BLOCK)
                counted[name].append(tuple((after - earlier) / BLOCK for after, earlier in zip(count(name), before, strict=True)))
        progress.update(BLOCK)
    return times, counted


def disk_step(args: argparse.Namespace, read_gbs: float, write_gbs: float, progress: tqdm) -> dict[str, Any]:
    """(e), first half: the demo step with half its state on disk against max(torch's in-memory
    step, the disk time of its bytes at the raw rates). Beside it, in the same blocks, the same
    store with the disk tier's files in the page cache (``direct=False``: its reads and writes
    are memory copies): where that step is as slow, the time is the store's, not the disk's."""
    from policies import MIN, ScheduleLearned

    config = GPTConfig()
    torch.manual_seed(0)
    template = GPT(config).to(args.device)
    state_bytes = _state_bytes(template)
    stores: dict[str, TierStore] = {}
    for name, direct in (("disk", "auto"), ("page cache", False)):
        root = args.dir / f"optim-e-{'direct' if direct else 'cached'}"
        shutil.rmtree(root, ignore_errors=True)
        schedule = ScheduleLearned()
        stores[name] = TierStore([HostTier(state_bytes // 2), DiskTier(root, 4 * state_bytes, durable=False, direct=direct)],
                                 eviction=lambda schedule=schedule: MIN(schedule), prefetch=schedule)
    models = {name: copy.deepcopy(template) for name in ("torch", *stores)}
    opts: dict[str, Any] = {"torch": torch.optim.AdamW(models["torch"].parameters(), lr=3e-3, fused=True)}
    opts.update({name: TieredAdamW(models[name].parameters(), lr=3e-3, store=store) for name, store in stores.items()})

    def moved(name: str) -> tuple[float, ...]:
        links = stores[name].counters.links if name in stores else {}
        return (float(_link_bytes(links, "disk->")), float(_link_bytes(links, "->disk")))

    times, counted = _train_in_blocks(args, config, {name: (models[name], opt) for name, opt in opts.items()}, moved, progress)
    cpu = {name: step_cpu(models[name], opts[name], synthetic_batches(config, args.batch, seed=2, device=args.device), stores.get(name))
           for name in ("torch", "page cache")}
    for name, store in stores.items():
        opts[name].close()
        run(store.aclose())
    store_read = median([delta[0] for delta in counted["disk"]])
    store_written = median([delta[1] for delta in counted["disk"]])
    transfer = store_read / (read_gbs * 1e9) + store_written / (write_gbs * 1e9)
    torch_step, disk_step_s, cached_step_s = median(times["torch"]), median(times["disk"]), median(times["page cache"])
    return {"state_mib": state_bytes / MiB, "torch_step_ms": torch_step * 1e3, "step_ms": disk_step_s * 1e3,
            "read_mib": store_read / MiB, "written_mib": store_written / MiB, "transfer_ms": transfer * 1e3,
            "vs_bound": disk_step_s / max(torch_step, transfer),
            "page_cache_step_ms": cached_step_s * 1e3, "page_cache_vs_torch": cached_step_s / torch_step,
            "step_cpu_ms": cpu}


#: Threads whose CPU time ``step_cpu`` reports apart (by name prefix), beside the training thread's.
_CPU_THREADS = {"store loop": "tierstore-loop", "disk threads": "tierstore-disk"}


def step_cpu(model: GPT, opt: Any, batches: Any, store: TierStore | None, steps: int = 9) -> dict[str, float]:
    """CPU time (ms, medians over ``steps``) that one ``opt.step()`` (and the store settling after
    it) costs: the whole process, the training thread, the store's loop and disk threads, and the
    rest (other threads: the training thread's OpenMP team, which spins after each parallel
    kernel). Unlike wall time, it does not grow with other processes' load, and it says where
    the step's work is."""
    def threads(prefix: str) -> float:
        return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threading.enumerate()
                   if t.name.startswith(prefix) and t.ident is not None)

    samples: dict[str, list[float]] = {name: [] for name in ("process", "training thread", *_CPU_THREADS, "other threads")}
    for _ in range(steps):
        opt.zero_grad()
        model.loss(next(batches)).backward()
        before = {name: threads(prefix) for name, prefix in _CPU_THREADS.items()}
        process, training = time.process_time(), time.thread_time()
        opt.step()
        if store is not None:
            settle_store(store)
        spent = {"process": time.process_time() - process, "training thread": time.thread_time() - training}
        spent.update({name: threads(prefix) - before[name] for name, prefix in _CPU_THREADS.items()})
        spent["other threads"] = spent["process"] - sum(value for name, value in spent.items() if name != "process")
        for name, value in spent.items():
            samples[name].append(value * 1e3)
    return {name: median(values) for name, values in samples.items()}


def host_step(numel: int, tensors: int, reps: int, progress: tqdm) -> dict[str, Any]:
    """(e), second half: the whole ``step()`` with all state resident in a host tier against
    ``torch.optim.AdamW(fused=True)`` on the same tensors, alternating step by step; the
    throughput ratio is the median of the steps' ratios (the machine's load moves both). Ours
    is split into its update (the math on the training thread, torch's Adam kernel and the
    views and lists it is given: ``time_report().host_update``) and the rest of ``step()`` (the
    checks, the hops to the store's loop and back, the holds and the bookkeeping)."""
    times, host_updates = _alternating_steps({
        "torch": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "tierstore": lambda ps: TieredAdamW(ps, lr=1e-3, offload="host"),
    }, numel, tensors, reps, progress)
    torch_s, ours_s = median(times["torch"]), median(times["tierstore"])
    ratios = [theirs / ours for theirs, ours in zip(times["torch"], times["tierstore"], strict=True)]
    update_s = median(host_updates["tierstore"])
    return {"params": numel * tensors, "tensors": tensors, "torch_fused_ms": torch_s * 1e3, "step_ms": ours_s * 1e3,
            "update_ms": update_s * 1e3, "rest_ms": (ours_s - update_s) * 1e3, "throughput_ratio": median(ratios)}


def _state_bytes(model: torch.nn.Module) -> int:
    """Bytes of exact Adam state ``TieredAdamW`` keeps for ``model``."""
    return sum(planned_state_bytes(p) for p in model.parameters())


def _link_bytes(links: dict[str, Any], part: str) -> int:
    return sum(link.nbytes for name, link in links.items() if part in name)


def link_runs(args: argparse.Namespace, progress: tqdm) -> list[dict[str, Any]]:
    """(c): per variant, medians over the steps after warm-up."""
    config = GPTConfig()
    torch.manual_seed(0)
    template = GPT(config).to(args.device)
    cuda = torch.device(args.device).type == "cuda"
    variants: dict[str, tuple[bool, dict[str, Any], bool]] = {  # emulated, options, user clip
        "plain CPU (lent), after backward": (False, {}, False),
        "emulated, after backward": (True, {}, False),
        "emulated, in backward": (True, {"step_in_backward": True}, False),
        "emulated, max_grad_norm=1.0": (True, {"max_grad_norm": 1.0}, False),
        "emulated, user clip_grad_norm_(1.0)": (True, {}, True),
    }
    if cuda:  # the link is the GPU's own: the emulated variants become CUDA ones, and no lending
        variants = {name.replace("emulated", "cuda"): spec for name, spec in variants.items() if spec[0]}
    models = {name: copy.deepcopy(template) for name in variants}
    optimizers = {}
    for name, (emulated, options, _) in variants.items():
        with emulate_device(emulated, link=args.link):
            optimizers[name] = TieredAdamW(models[name].parameters(), lr=3e-3, offload="host", **options)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    batches = synthetic_batches(config, args.batch, seed=1, device=args.device)
    for step in range(args.steps):
        tokens = next(batches)
        for name, (_, _, user_clip) in variants.items():
            model, opt = models[name], optimizers[name]
            started = time.perf_counter()
            opt.zero_grad()
            with opt.timeline.span("forward"):
                loss = model.loss(tokens)
            with opt.timeline.span("backward"):
                loss.backward()
            if user_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            _sync(args.device)
            wall = time.perf_counter() - started
            if step >= 3:
                report = opt.time_report()
                got = samples[name]
                figures = {"step_ms": wall * 1e3, "stall_ms": report.stall * 1e3, "to_host_mib": report.grads_to_host_bytes / MiB,
                           "to_device_mib": report.weights_to_device_bytes / MiB, "retaken_mib": report.grad_retake_bytes / MiB,
                           **hidden(opt.last_timeline())}
                for key, value in figures.items():
                    got.setdefault(key, []).append(value)
        progress.update(1)
    for opt in optimizers.values():
        opt.close()
    rows = []
    for name, got in samples.items():
        rows.append({"what": name, **{key: median(values) for key, values in got.items()}})
    return rows


def hidden(events: list[tuple[str, str, float, float, dict[str, Any]]]) -> dict[str, float]:
    """Fractions of the transfer time (grads to host, weights to device, both) that overlapped
    compute: the device's (forward, backward spans) or the host's (the updates, which a GPU run
    also overlaps with the link: one bucket's weights travel while the next one's math runs).
    ``hidden_device`` counts forward and backward only."""
    compute = _union([(start, end) for _, track, start, end, _ in events if track in ("compute", "host update")])
    device = _union([(start, end) for _, track, start, end, _ in events if track == "compute"])
    result: dict[str, float] = {}
    spans = [(start, end) for _, t, start, end, _ in events if t in ("grads to host", "weights to device")]
    total = sum(end - start for start, end in spans)
    result["hidden_device"] = sum(_overlap(span, device) for span in spans) / total if total else float("nan")
    both_total = both_hidden = 0.0
    for track, label in (("grads to host", "grads_hidden"), ("weights to device", "weights_hidden")):
        spans = [(start, end) for _, t, start, end, _ in events if t == track]
        total = sum(end - start for start, end in spans)
        covered = sum(_overlap(span, compute) for span in spans)
        result[label] = covered / total if total else float("nan")
        both_total += total
        both_hidden += covered
    result["hidden"] = both_hidden / both_total if both_total else float("nan")
    result["transfer_ms"] = both_total * 1e3
    return result


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(span: tuple[float, float], union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], end) - max(span[0], start)) for start, end in union)


def _disk_bytes(opt: Any) -> int:
    if not isinstance(opt, TieredAdamW):
        return 0
    return sum(link.nbytes for name, link in opt.store.counters.links.items() if "disk" in name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_optim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller measurements")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_optim.json"))
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench"), help="scratch folder for the disk tier")
    parser.add_argument("--link", default="25GB/s,10us", help="the emulated link's speed for (c)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (plain and emulated device) or cuda")
    parser.add_argument("--parts", default="abcd",
                        help="which parts to run (default abcd): a (update), b (training step), c (the link), d (HF Trainer-driven steps), "
                             "e (disk-paged step against its bound; host-resident step against fused AdamW), "
                             "f (compressed state: bytes, disk step, convergence; tierstore.bench.precision), "
                             "g (compressed state, disk-bound optimizer step; tierstore.bench.compressed_step)")
    precision.add_arguments(parser)
    compressed_step.add_arguments(parser)
    args = parser.parse_args(argv)
    if set(args.parts) <= {"f", "g"}:
        return (precision.run(args) if "f" in args.parts else 0) | (compressed_step.run(args) if "g" in args.parts else 0)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    args.steps = 12 if args.quick else 30
    args.batch = 16
    reps = 3 if args.quick else 7
    numel, tensors = (1 << 20, 8) if args.quick else (4 << 20, 8)
    with tqdm(total=reps + 1 + 2 * args.steps, desc="bench_optim", leave=False, disable=None) as progress:
        bandwidth = memory_bandwidth()
        read_gbs, write_gbs = disk_bandwidth(args.dir)
        updates = update_throughput(numel, tensors, reps, progress) if "a" in args.parts else []
        steps, facts = training_steps(args, progress) if "b" in args.parts else ([], {})
        links = link_runs(args, progress) if "c" in args.parts else []
        faster: dict[str, Any] = {}
        if "e" in args.parts:
            faster = {"disk": disk_step(args, read_gbs, write_gbs, progress),
                      "host": host_step(1 << 20 if args.quick else 8 << 20, 8, reps, progress),
                      "host_small": host_step(1 << 14 if args.quick else 1 << 16, 200, reps, progress)}
    status = report(args, bandwidth, read_gbs, write_gbs, updates, steps, facts, links, faster)
    if "d" in args.parts:  # steps/s through transformers' Trainer (tierstore.bench.trainer)
        from .trainer import main as trainer_main

        print("\n(d) HF Trainer-driven steps")
        status |= trainer_main([*(["--quick"] if args.quick else []), "--json", str(args.json.with_name("bench_trainer.json")),
                                "--dir", str(args.dir)])
    if "f" in args.parts:
        status |= precision.run(args)
    if "g" in args.parts:
        status |= compressed_step.run(args)
    return status


def report(
    args: argparse.Namespace, bandwidth: float, read_gbs: float, write_gbs: float, updates: list[dict[str, Any]],
    steps: list[dict[str, Any]], facts: dict[str, float], links: list[dict[str, Any]], faster: dict[str, Any] | None = None,
) -> int:
    """Print the tables and the goals of the parts that ran, and write the JSON."""
    goals: dict[str, bool] = {}
    if updates:
        for row in updates:
            row["of_bandwidth"] = row["gbs"] / bandwidth
        print(f"(a) host update throughput, {updates[0]['params'] / 1e6:.0f} M parameters; memory bandwidth {bandwidth:.1f} GB/s (triad)")
        print(table(updates, [("what", "optimizer", "s"), ("gparams_s", "G params/s", ".2f"), ("gbs", "GB/s", ".1f"), ("of_bandwidth", "of bandwidth", ".0%")]))
        fastest_torch = max(r["gparams_s"] for r in updates if r["what"].startswith("torch"))
        ours = next(r for r in updates if r["what"] == "TieredAdamW host update")
        goals["host update throughput >= 1.0 x the faster torch AdamW"] = ours["gparams_s"] >= fastest_torch
    if steps:
        print(f"\n(b) demo model step on {args.device} ({facts['state_mib']:.1f} MiB of Adam state; compute {facts['compute_ms']:.1f} ms; "
              f"raw disk {read_gbs:.2f} GB/s read, {write_gbs:.2f} GB/s write)")
        for row in steps:
            transfer = row["disk_mib"] * MiB / 2 / (read_gbs * 1e9) + row["disk_mib"] * MiB / 2 / (write_gbs * 1e9)
            row["bound_ms"] = max(facts["compute_ms"], transfer * 1e3)
            row["vs_bound"] = row["step_ms"] / row["bound_ms"]
        print(table(steps, [("what", "variant", "s"), ("step_ms", "step ms", ".1f"), ("ratio", "vs in-memory", ".2f"),
                            ("disk_mib", "disk MiB/step", ".1f"), ("bound_ms", "max(compute, disk) ms", ".1f"), ("vs_bound", "vs bound", ".2f")]))
        host = next(r for r in steps if r["what"] == "tierstore, state in host")
        disk_best = min((r for r in steps if "disk" in r["what"]), key=lambda r: r["vs_bound"])
        goals["state in host: step <= 1.15 x torch in memory"] = host["ratio"] <= 1.15
        goals[f"state on disk: step <= 1.2 x max(compute, disk transfer) ({disk_best['what']})"] = disk_best["vs_bound"] <= 1.2
    clip_cost = float("nan")
    if links:
        where = "CUDA" if torch.device(args.device).type == "cuda" else f"the emulated device ({args.link}) beside the plain CPU"
        print(f"\n(c) the step on {where}, state in host (medians; hidden = transfer time overlapping forward, backward or "
              "the host updates; 'behind fwd/bwd' counts forward and backward only)")
        print(table(links, [("what", "variant", "s"), ("step_ms", "step ms", ".1f"), ("stall_ms", "waited in step() ms", ".1f"),
                            ("to_host_mib", "to host MiB", ".2f"), ("to_device_mib", "to device MiB", ".2f"), ("retaken_mib", "taken again MiB", ".2f"),
                            ("transfer_ms", "transfer ms", ".2f"), ("grads_hidden", "grads hidden", ".0%"), ("weights_hidden", "weights hidden", ".0%"),
                            ("hidden", "all hidden", ".0%"), ("hidden_device", "behind fwd/bwd", ".0%")]))
        by_name = {r["what"].replace("cuda", "emulated"): r for r in links}
        clip_cost = by_name["emulated, user clip_grad_norm_(1.0)"]["step_ms"] / by_name["emulated, max_grad_norm=1.0"]["step_ms"]
        print(f"  user clip_grad_norm_ step / max_grad_norm= step: {clip_cost:.2f}x")
        for mode in ("after", "in"):
            goals[f"{args.link if 'emulated' in where else 'cuda'}, state in host: >= 90% of transfer time hidden ({mode} backward)"] = (
                by_name[f"emulated, {mode} backward"]["hidden"] >= 0.9)
    if faster:
        disk, host = faster["disk"], faster["host"]
        print(f"\n(e) demo step with half of its {disk['state_mib']:.1f} MiB of state on disk ({args.dir}): {disk['step_ms']:.1f} ms; "
              f"torch AdamW in memory {disk['torch_step_ms']:.1f} ms; disk {disk['read_mib']:.1f} MiB read + {disk['written_mib']:.1f} MiB "
              f"written a step = {disk['transfer_ms']:.1f} ms at the raw rates; step / max(both) = {disk['vs_bound']:.2f}")
        if "page_cache_step_ms" in disk:
            print(f"    the same store with its disk files in the page cache (reads and writes are memory copies): "
                  f"{disk['page_cache_step_ms']:.1f} ms, {disk['page_cache_vs_torch']:.2f}x torch's step (the part of the gap that is not the disk's)")
        if "step_cpu_ms" in disk:
            ours, theirs = disk["step_cpu_ms"]["page cache"], disk["step_cpu_ms"]["torch"]
            print(f"    CPU time of one step() (page cache; torch's: {theirs['process']:.1f} ms): {ours['process']:.1f} ms = training thread "
                  f"{ours['training thread']:.1f} + store loop {ours['store loop']:.1f} + disk threads {ours['disk threads']:.1f} + "
                  f"other threads (OpenMP's spinning) {ours['other threads']:.1f}")
        print(f"    host-resident step(), {host['params'] / 1e6:.0f}M parameters in {host['tensors']} tensors: {host['step_ms']:.1f} ms; "
              f"torch AdamW(fused=True) {host['torch_fused_ms']:.1f} ms; throughput {host['throughput_ratio']:.2f}x torch's; "
              f"ours: update {host['update_ms']:.1f} ms + the rest of step() {host['rest_ms']:.1f} ms")
        small = faster["host_small"]
        print(f"    the same with {small['tensors']} small tensors ({small['params'] / 1e6:.1f}M parameters): {small['step_ms']:.1f} ms; "
              f"torch {small['torch_fused_ms']:.1f} ms; throughput {small['throughput_ratio']:.2f}x torch's (no goal: per-tensor costs); "
              f"ours: update {small['update_ms']:.1f} ms + the rest {small['rest_ms']:.1f} ms")
        goals["(e) state half on disk: step <= 1.1 x max(torch in-memory step, disk time of its bytes)"] = disk["vs_bound"] <= 1.1
        goals["(e) host-resident step() >= 0.95 x torch AdamW(fused=True) throughput"] = host["throughput_ratio"] >= 0.95
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(args.json, {"benchmark": "bench_optim", "environment": environment(args.dir), "device": args.device,
                           "memory_bandwidth_gbs": bandwidth, "disk_read_gbs": read_gbs, "disk_write_gbs": write_gbs, "updates": updates,
                           "steps": steps, "facts": facts, "link": args.link, "link_runs": links, "user_clip_vs_max_grad_norm": clip_cost, "faster_step": faster or {},
                           "goals": goals})
    print(f"\nJSON: {args.json}")
    return 0


def _sync(device: str) -> None:
    """Wait for the device's queued work before reading a timer (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
