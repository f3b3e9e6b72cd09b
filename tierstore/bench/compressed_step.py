"""(g) compressed Adam state where the step is disk-bound: the update's cost per parameter, and
an optimizer step alone (gradients given) with most of the state on disk, per ``state_precision``.

Reproduce:  python benchmarks/bench_optim.py --parts g --dir <real-disk folder> --g-threads 1   (the committed results)
            python benchmarks/bench_optim.py --parts g --g-params 32M --g-update-sizes 64K 1M 16M

Three measurements, in one run:

- the update alone (``PackedState.update`` with torch's fused AdamW on each tile; fp32:
  torch's fused AdamW on the fp32 rows), per setting, entry size and codec (eager; for 8-bit
  moments also ``compiled``: the compiled codec around torch's fused AdamW, and ``fused``: one
  compiled kernel a tile that decodes, updates and encodes, as ``TieredAdamW`` runs it), in ns
  per parameter (median of repetitions after two untimed calls, so compiling is not timed); and,
  for the fused 8-bit kernel, the tile size (``precision.COMPILED_TILE``) against its cost;
- many small entries (``SMALL_ENTRIES``: the demo model's small parameters) updated one at a
  time and together (``tierstore.optim.batched``, as ``TieredAdamW`` runs them), per compressed
  setting, beside torch's fused AdamW over the same parameters with fp32 state;
- the disk-bound step: ``--g-params`` parameters in ``--g-tensors`` fp32 tensors (bf16 for the
  lossless master), their gradients set once, ``opt.step()`` alone with a host tier of
  ``1/--g-host-fraction`` of each setting's stored state in front of a disk tier in ``--dir``,
  and each compressed setting again with fp32's host tier (the same memory budget, where more of
  the smaller state stays in memory). The settings take turns block by block: ``BLOCK`` steps
  back to back, then the store settles (its write-backs and the next step's prefetch end), that
  time counted in the block, so no setting's background work runs in another's steps (taking
  turns step by step, it did). Per setting the median step time (a block's time over its
  steps), the disk bytes read +
  written per step (``time_report()``), those bytes' time at the raw pread/pwrite rates measured
  in the same run, how much of the step the update took (``host_update``), and the fp32 step
  time over this setting's (the goal of issue 13: >= 1.8 for ``"8bit"``); and what the machine
  allows: each step's floor, the larger of its disk time and its update alone, and the 8-bit
  gain at those floors (a fast disk with a slow CPU caps it below the goal, whatever the engine).
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.optim.adamw import adamw

from ..device import emulation
from ..optim import TieredAdamW, precision
from ..optim.batched import update_many
from ..store import TierStore
from ..sync import run as run_on_loop
from ..tiers import DiskTier, HostTier
from .common import environment, median, progress, settle_store, table, write_json
from .tiers import raw_rates

MiB = 1 << 20
#: Untimed steps first (state created, the schedule learned).
WARMUP = 3
#: Steps a setting runs back to back in one timed block of the disk-bound step.
BLOCK = 4

#: (name, model dtype, state_precision, master_weights)
SETTINGS = (
    ("fp32", torch.float32, "fp32", "fp32"),
    ("bf16", torch.float32, "bf16", "fp32"),
    ("8bit", torch.float32, "8bit", "fp32"),
    ("bf16 model, lossless + 8bit", torch.bfloat16, "8bit", "lossless"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Part (g)'s options on ``bench_optim``'s parser."""
    group = parser.add_argument_group("part g (compressed state, disk-bound step)")
    group.add_argument("--g-params", default="16M", help="parameters of the disk-bound step (K/M suffixes)")
    group.add_argument("--g-tensors", type=int, default=8, help="tensors they are split into")
    group.add_argument("--g-host-fraction", type=int, default=8, help="the host tier holds 1/this of each setting's state")
    group.add_argument("--g-steps", type=int, default=7,
                       help=f"timed blocks per setting, after warm-up (each {BLOCK} steps back to back, then the store settles)")
    group.add_argument("--g-update-sizes", nargs="+", default=["64K", "1M", "16M"], help="entry sizes of the update measurement")
    group.add_argument("--g-threads", type=int, help="torch threads (default: torch's); on a busy machine 1 avoids OpenMP's spin-waits")


def _count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _adam(rows: list[torch.Tensor], grad: torch.Tensor, step: torch.Tensor) -> None:
    _adam_many([rows], [grad], [step])


def _adam_many(rows: list[list[torch.Tensor]], grads: list[torch.Tensor], steps: list[torch.Tensor]) -> None:
    adamw([r[0] for r in rows], [g.float() for g in grads], [r[1] for r in rows], [r[2] for r in rows], [], steps, foreach=False, fused=True,
          amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.1, eps=1e-8, maximize=False)


#: The settings of ``_adam``, for the fused 8-bit kernel.
HYPER = precision.AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, True)


def _update_call(setting: tuple[str, torch.dtype, str, str], numel: int, fused: bool = True) -> Callable[[], object]:
    """One update of an entry of ``numel`` elements in ``setting``'s stored form (``fused``:
    given ``_adam``'s settings, as ``TieredAdamW`` runs it: one compiled kernel a tile for
    8-bit moments where the codec is compiled)."""
    _, dtype, state_precision, master = setting
    grad = (torch.randn(numel) * 1e-3).to(dtype)
    step = torch.tensor(0.0)
    if state_precision == "fp32" and master == "fp32":
        rows = [torch.randn(numel), torch.zeros(numel), torch.zeros(numel)]
        return lambda: _adam(rows, grad, step)
    layout = precision.StateLayout(state_precision, master == "lossless", False)
    high = torch.randn(numel).to(dtype) if master == "lossless" else None
    state = precision.PackedState(layout, layout.empty(numel), numel, high)
    if master != "lossless":
        state.view("master").normal_()
    hyper = HYPER if fused else None
    return lambda: state.update(grad, step, _adam, hyper)


def _time(call: Callable[[], object], reps: int) -> float:
    call()
    call()  # compiles (first call) and warms: outside the timed ones
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return median(times)


def update_costs(sizes: list[int], bar: Any) -> list[dict[str, Any]]:
    """ns per parameter of the update per setting, size and codec; then 8-bit per tile size."""
    rows = []
    saved_tile, saved_compiled_tile, saved_min = precision.UPDATE_TILE, precision.COMPILED_TILE, precision.COMPILE_MIN_NUMEL
    try:
        for numel in sizes:
            reps = max(3, min(15, (1 << 24) // numel))
            for setting in SETTINGS:
                codecs = ("eager", "compiled", "fused") if setting[2] == "8bit" else ("eager",)
                for codec in codecs:
                    precision.COMPILE_MIN_NUMEL = 1 << 62 if codec == "eager" else 1
                    seconds = _time(_update_call(setting, numel, fused=codec == "fused"), reps)
                    rows.append({"setting": setting[0], "numel": numel, "codec": codec,
                                 "tile": min(numel, precision.UPDATE_TILE if codec == "eager" else precision.COMPILED_TILE),
                                 "ns_per_param": seconds / numel * 1e9, "mparams_s": numel / seconds / 1e6})
                    bar.update(1)
        numel = 1 << 20
        precision.COMPILE_MIN_NUMEL = 1
        for tile in (1 << 14, 1 << 16, 1 << 18, 1 << 20):
            precision.COMPILED_TILE = tile
            seconds = _time(_update_call(SETTINGS[2], numel), 5)
            rows.append({"setting": "8bit", "numel": numel, "codec": "fused", "tile": tile,
                         "ns_per_param": seconds / numel * 1e9, "mparams_s": numel / seconds / 1e6})
            bar.update(1)
    finally:
        precision.UPDATE_TILE, precision.COMPILED_TILE, precision.COMPILE_MIN_NUMEL = saved_tile, saved_compiled_tile, saved_min
    return rows


#: Entry sizes of many small parameters: those of the demo model (``tierstore.demo.GPT``), its
#: LayerNorm weights and biases, attention and MLP biases and smaller matrices.
SMALL_ENTRIES = [128] * 26 + [384] * 4 + [512] * 4 + [16384] * 4 + [8192]


def small_entry_costs(reps: int, bar: Any) -> list[dict[str, Any]]:
    """The update of ``SMALL_ENTRIES`` (fp32 parameters, each its own master): torch's fused
    AdamW over them in one call (fp32 moments), and per compressed setting their entries one
    at a time (``PackedState.update``) and together (``tierstore.optim.batched.update_many``,
    what ``TieredAdamW`` runs)."""
    numel = sum(SMALL_ENTRIES)
    grads = [torch.randn(n) * 1e-3 for n in SMALL_ENTRIES]
    fp32 = [[torch.randn(n), torch.zeros(n), torch.zeros(n)] for n in SMALL_ENTRIES]
    fp32_steps = [torch.tensor(0.0) for _ in SMALL_ENTRIES]
    calls: list[tuple[str, str, Callable[[], None]]] = [("fp32", "torch fused AdamW, one call", lambda: _adam_many(fp32, grads, fp32_steps))]
    for name in ("bf16", "8bit"):
        layout = precision.StateLayout(name, False, False, param_master=True)
        entries = [precision.PackedState(layout, layout.empty(n), n, master=torch.randn(n)) for n in SMALL_ENTRIES]
        steps = [torch.tensor(0.0) for _ in SMALL_ENTRIES]

        def alone(entries: list[precision.PackedState] = entries, steps: list[torch.Tensor] = steps) -> None:
            for entry, grad, step in zip(entries, grads, steps, strict=True):
                entry.update(grad, step, _adam, HYPER)

        calls += [(name, "one at a time", alone),
                  (name, "together", partial(update_many, entries, grads, steps, _adam_many))]
    rows = []
    for setting, how, call in calls:
        seconds = _time(call, reps)
        rows.append({"setting": setting, "how": how, "entries": len(SMALL_ENTRIES), "params": numel,
                     "us": seconds * 1e6, "ns_per_param": seconds / numel * 1e9})
        bar.update(1)
    return rows


def reachable_ratio(steps: list[dict[str, Any]], updates: list[dict[str, Any]]) -> dict[str, float]:
    """The most the 8-bit step can gain over fp32 on this machine: each step takes at least the
    larger of its disk time (its bytes at the raw rates) and its update alone (the update's ns
    per parameter at the largest entry size measured, the codec ``TieredAdamW`` runs: fused for
    8-bit), however well the rest is hidden."""
    def floor(setting: str, codec: str) -> tuple[float, float]:
        row = next(r for r in steps if r["setting"] == setting)
        cost = max((r for r in updates if r["setting"] == setting and r["codec"] == codec), key=lambda r: r["numel"])
        return max(row["transfer_ms"], row["params"] * cost["ns_per_param"] / 1e6), cost["ns_per_param"]

    fp32, _ = floor("fp32", "eager")
    eight, ns = floor("8bit", "fused")
    measured = next(r for r in steps if r["setting"] == "fp32")["step_ms"]
    return {"fp32_floor_ms": fp32, "8bit_floor_ms": eight, "8bit_ns_per_param": ns, "at_floors": fp32 / eight, "vs_measured": measured / eight}


def disk_steps(args: argparse.Namespace, read_gbs: float, write_gbs: float, bar: Any) -> list[dict[str, Any]]:
    """Each setting's ``opt.step()`` with gradients given and 1/host_fraction of its state on the
    host, the rest on disk; then each compressed setting again with the host tier of fp32's
    setting (the same memory budget: more of the smaller state fits); all taking turns block by
    block."""
    from policies import MIN, ScheduleLearned

    total = _count(args.g_params)
    per = -(-total // args.g_tensors)
    runs: dict[str, tuple[TieredAdamW, dict[str, Any]]] = {}
    generator = torch.Generator().manual_seed(0)
    try:
        fp32_host = 0
        for (name, dtype, state_precision, master), budget in [(setting, "fraction") for setting in SETTINGS] + [
            (setting, "fp32's") for setting in SETTINGS[1:]
        ]:
            params = [torch.nn.Parameter((torch.randn(per, generator=generator) * 0.02).to(dtype)) for _ in range(args.g_tensors)]
            for p in params:
                p.grad = (torch.randn(per, generator=generator) * 1e-3).to(dtype)
            state = args.g_tensors * precision.planned_state_bytes(params[0], state_precision, master)
            host = state // args.g_host_fraction if budget == "fraction" else fp32_host
            if name == "fp32":
                fp32_host = host
            label = name if budget == "fraction" else f"{name}, fp32's host bytes"
            if emulation()[0]:
                host += 2 * per * params[0].element_size()  # gradients cross a link and wait in the state's tier
            root = args.dir / "optim-g" / label.replace(" ", "_").replace(",", "").replace("+", "and").replace("'", "")
            shutil.rmtree(root, ignore_errors=True)
            schedule = ScheduleLearned()
            store = TierStore([HostTier(host), DiskTier(root, max(2 * state, 64 * MiB), durable=False)],
                              eviction=lambda s=schedule: MIN(s), prefetch=schedule)
            opt = TieredAdamW(params, lr=1e-3, weight_decay=0.1, fused=True, store=store,
                              state_precision=state_precision, master_weights=master)
            runs[label] = (opt, {"setting": label, "dtype": str(dtype).removeprefix("torch."), "state_precision": state_precision,
                                 "master_weights": master, "params": per * args.g_tensors, "stored_bytes": state, "host_tier_bytes": host,
                                 "times": [], "read": [], "write": [], "need": [], "update": [], "disk_read_s": [], "disk_write_s": []})
        for _ in range(WARMUP):
            for opt, _ in runs.values():
                opt.step()
                settle_store(opt.store)
                bar.update(1)
        for _ in range(args.g_steps):
            for opt, row in runs.values():
                started = time.perf_counter()
                for _ in range(BLOCK):
                    opt.step()
                    report = opt.time_report()
                    row["read"].append(float(report.disk_read_bytes))
                    row["write"].append(float(report.disk_write_bytes))
                    row["need"].append(float(report.disk_need_bytes))
                    row["update"].append(report.host_update)
                    row["disk_read_s"].append(report.disk_read)
                    row["disk_write_s"].append(report.disk_write)
                settle_store(opt.store)  # (its background work counted in its own block)
                row["times"].append((time.perf_counter() - started) / BLOCK)
                bar.update(1)
    finally:
        for opt, _ in runs.values():
            opt.close()
            run_on_loop(opt.store.aclose())  # (a store passed in stays open after the optimizer closes)
    rows = []
    for _, row in runs.values():
        step_s, read, write = median(row.pop("times")), median(row.pop("read")), median(row.pop("write"))
        need = median(row.pop("need"))
        transfer = read / (read_gbs * 1e9) + write / (write_gbs * 1e9)
        row.update(step_ms=step_s * 1e3, disk_read_bytes=read, disk_write_bytes=write, disk_need_bytes=need,
                   disk_bytes_per_param=(read + write) / row["params"], transfer_ms=transfer * 1e3,
                   update_ms=median(row.pop("update")) * 1e3, disk_read_ms=median(row.pop("disk_read_s")) * 1e3,
                   disk_write_ms=median(row.pop("disk_write_s")) * 1e3, vs_transfer=step_s / transfer if transfer else None)
        rows.append(row)
    fp32 = rows[0]["step_ms"]
    for row in rows:
        row["fp32_over_this"] = fp32 / row["step_ms"]
    return rows


def run(args: argparse.Namespace) -> int:
    """Part (g): measure, print the tables, write ``<json stem>_g.json``."""
    if args.g_steps < 1 or args.g_tensors < 1 or args.g_host_fraction < 1:
        raise ValueError("--g-steps, --g-tensors and --g-host-fraction must be at least 1")
    if args.g_threads is not None:
        torch.set_num_threads(args.g_threads)
    sizes = [_count(s) for s in args.g_update_sizes]
    total = _count(args.g_params)
    state_fp32 = 12 * total
    read_gbs, write_gbs = raw_rates(args.dir, min(256 * MiB, max(64 * MiB, state_fp32 // 2)))
    jobs = len(sizes) * (len(SETTINGS) + 4) + 4 + 5 + (WARMUP + args.g_steps) * (2 * len(SETTINGS) - 1)
    with progress(total=jobs, desc="bench_optim (g)", unit="job", leave=False) as bar:
        updates = update_costs(sizes, bar)
        small = small_entry_costs(15, bar)
        steps = disk_steps(args, read_gbs, write_gbs, bar)
    print(f"(g) the update alone, ns per parameter (torch threads: {torch.get_num_threads()}; tiles of {precision.UPDATE_TILE:,} elements, "
          f"{precision.COMPILED_TILE:,} compiled, for entries from {precision.COMPILE_MIN_NUMEL:,} elements; the last rows: fused 8-bit per tile size)")
    print(table(updates, [("setting", "setting", "s"), ("numel", "elements", ",d"), ("codec", "codec", "s"), ("tile", "tile", ",d"),
                          ("ns_per_param", "ns/param", ".2f"), ("mparams_s", "M params/s", ".0f")]))
    fp32_us = small[0]["us"]
    for row in small:
        row["vs_torch"] = row["us"] / fp32_us
    print(f"\n(g) the update of {len(SMALL_ENTRIES)} small entries ({small[0]['params']:,} parameters: the demo model's small ones), "
          "median us a call; vs torch: over torch's fused AdamW on fp32 state")
    print(table(small, [("setting", "setting", "s"), ("how", "how", "s"), ("us", "us", ".0f"), ("ns_per_param", "ns/param", ".1f"),
                        ("vs_torch", "vs torch", ".1f")]))
    print(f"\n(g) disk-bound step: {total:,} parameters in {args.g_tensors} tensors, gradients given, "
          f"1/{args.g_host_fraction} of the state on the host, the rest on disk ({args.dir}; raw {read_gbs:.2f} GB/s read, {write_gbs:.2f} GB/s write)")
    for row in steps:
        row["host_mib"] = row["host_tier_bytes"] / MiB
    print(table(steps, [("setting", "setting", "s"), ("stored_bytes", "state B (all)", ",.0f"), ("host_mib", "host MiB", ".1f"),
                        ("disk_bytes_per_param", "disk B/param/step", ".2f"),
                        ("step_ms", "step ms", ".0f"), ("transfer_ms", "disk time ms", ".0f"), ("vs_transfer", "step/disk", ".2f"),
                        ("update_ms", "update ms", ".0f"), ("fp32_over_this", "fp32/this", ".2f")]))
    eight = next(row for row in steps if row["setting"] == "8bit")
    same = next(row for row in steps if row["setting"] == "8bit, fp32's host bytes")
    print(f"goal: 8bit >= 1.8x faster than fp32 disk-bound: {eight['fp32_over_this']:.2f}x "
          f"({'met' if eight['fp32_over_this'] >= 1.8 else 'not met'}) with 1/{args.g_host_fraction} of each one's state on the host; "
          f"{same['fp32_over_this']:.2f}x with fp32's host bytes ({same['host_mib']:.1f} MiB, the same memory budget)")
    ceiling = reachable_ratio(steps, updates)
    print(f"what this machine allows: a step takes at least the larger of its disk time and its update alone: "
          f"fp32 {ceiling['fp32_floor_ms']:.0f} ms, 8bit {ceiling['8bit_floor_ms']:.0f} ms (its update at {ceiling['8bit_ns_per_param']:.2f} ns/param); "
          f"both at those floors, 8bit would be {ceiling['at_floors']:.2f}x faster than fp32")
    out = args.json.with_name(f"{args.json.stem}_g.json")
    write_json(out, {"benchmark": "bench_optim part g", "environment": environment(args.dir), "torch_threads": torch.get_num_threads(),
                     "disk_read_gbs": read_gbs, "disk_write_gbs": write_gbs, "tile": precision.UPDATE_TILE, "compiled_tile": precision.COMPILED_TILE,
                     "compile_min_numel": precision.COMPILE_MIN_NUMEL, "params": total, "tensors": args.g_tensors,
                     "host_fraction": args.g_host_fraction, "timed_steps": args.g_steps, "updates": updates, "small_entries": small, "disk_steps": steps,
                     "goal_8bit_vs_fp32": {"want": 1.8, "got": eight["fp32_over_this"], "same_host_bytes": same["fp32_over_this"]}, "reachable_8bit_vs_fp32": ceiling})
    print(f"\nJSON: {out}")
    return 0

