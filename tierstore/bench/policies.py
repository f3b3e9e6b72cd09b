"""Policy benchmark: simulator speed per eviction policy, and how much of LRU's demand misses
learned prefetch with MIN removes on the optimizer's access pattern.

Reproduce:  python benchmarks/bench_policies.py [--quick] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..sim import optimizer_trace, simulate, zipf_trace
from ..sim.links import LinkModel
from ..sim.report import plot_curves, run_all
from .common import environment, table, write_json

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_policies", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 200k-access trace instead of 1M")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_policies.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/mrc_optimizer.png"))
    args = parser.parse_args(argv)
    accesses = 200_000 if args.quick else 1_000_000

    zipf = zipf_trace(keys=20_000, accesses=accesses, alpha=0.9, size=4096, seed=1)
    speed_rows: list[dict[str, Any]] = []
    for name in tqdm(["lru", "fifo", "lfu", "arc", "s3fifo", "min"], desc="simulator speed", leave=False, disable=None):
        result = simulate(zipf, {"host": zipf.working_set // 10}, name)
        speed_rows.append({"eviction": name, "accesses": len(zipf), "kacc_per_s": result.accesses_per_second / 1e3, "miss_ratio": result.miss_ratio})

    steps = 40
    trace = optimizer_trace(keys=64, steps=steps, size=4 * MiB)
    first_step = optimizer_trace(keys=64, steps=1, size=4 * MiB)
    capacity = trace.working_set // 2
    combos = [(e, p) for e in ("lru", "fifo", "arc", "s3fifo", "min") for p in ("none", "sequential", "schedule")]
    pattern_rows: list[dict[str, Any]] = []
    baseline = simulate(trace, {"host": capacity}, "lru", "none", think=2e-3)
    cold = simulate(first_step, {"host": capacity}, "lru", "none").misses
    for eviction, prefetch in tqdm(combos, desc="optimizer pattern", leave=False, disable=None):
        r = simulate(trace, {"host": capacity}, eviction, prefetch, think=2e-3)
        pattern_rows.append({
            "eviction": eviction, "prefetch": prefetch, "misses": r.misses, "miss_ratio": r.miss_ratio,
            "removed": 1 - r.misses / baseline.misses,
            "removed_after_step1": 1 - max(0, r.misses - cold) / max(1, baseline.misses - cold),
            "stall_s": r.stall_seconds, "prefetches": r.prefetches,
        })
    curves = run_all(trace, {"host": capacity}, ["lru", "arc", "min"], ["none", "schedule"], LinkModel(), sweep=True, think=2e-3)
    plot_curves(curves, trace, args.plot)

    print(f"Simulator speed on a {len(zipf):,}-access zipf(0.9) trace, capacity 10% of the working set")
    print(table(speed_rows, [("eviction", "eviction", "s"), ("kacc_per_s", "k accesses/s", ".0f"), ("miss_ratio", "miss ratio", ".4f")]))
    print(f"\nOptimizer pattern: 64 keys x 4 MiB, forward then backward, {steps} steps; host capacity 50% of the working set;")
    print("2 ms of compute per access; 'removed' = share of LRU+none's demand misses gone")
    print(table(pattern_rows, [("eviction", "eviction", "s"), ("prefetch", "prefetch", "s"), ("misses", "misses", "d"),
                               ("miss_ratio", "miss ratio", ".4f"), ("removed", "removed", ".1%"),
                               ("removed_after_step1", "after step 1", ".1%"), ("stall_s", "stall s", ".2f")]))
    lru_speed = next(r for r in speed_rows if r["eviction"] == "lru")["kacc_per_s"]
    best = next(r for r in pattern_rows if (r["eviction"], r["prefetch"]) == ("min", "schedule"))
    goals = {"LRU simulates >= 500k accesses/s": lru_speed >= 500, "schedule + MIN removes >= 95% of LRU + none's misses": best["removed"] >= 0.95}
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(args.json, {"benchmark": "bench_policies", "environment": environment(), "speed": speed_rows,
                           "optimizer_pattern": pattern_rows, "plot": str(args.plot), "goals": goals})
    print(f"\nJSON: {args.json}\nplot: {args.plot}")
    return 0
