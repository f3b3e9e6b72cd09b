"""Policy benchmark: ``tierstore simulate`` against libCacheSim end to end on the same CSV (one
process per run, import and parse included), miss ratios side by side; and how much of LRU's
demand misses prefetching removes on the optimizer's access pattern, with prefetch metrics.

Reproduce:  python benchmarks/bench_policies.py [--quick] [--repeats N] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..sim import optimizer_trace, simulate
from ..sim.links import LinkModel
from ..sim.report import plot_curves, plot_prefetch, run_all
from .common import environment, table, write_json

MiB = 1 << 20
KiB = 1 << 10
#: Ours and libCacheSim's names; speed is compared on the first two (the issue's goal).
HEAD_TO_HEAD = {"lru": "LRU", "s3fifo": "S3FIFO", "sieve": "Sieve", "clock": "Clock", "fifo": "FIFO", "slru": "SLRU",
                "2q": "TwoQ", "lirs": "LIRS", "tinylfu": "WTinyLFU", "arc": "ARC"}

_LCS_RUN = """
import sys, time, libcachesim as lcs
p = lcs.ReaderInitParam(has_header=True, delimiter=",")
p.obj_id_field, p.obj_size_field = 1, 2
reader = lcs.TraceReader(sys.argv[1], lcs.TraceType.CSV_TRACE, p)
miss, _ = getattr(lcs, sys.argv[2])(int(sys.argv[3])).process_trace(reader)
print(miss)
"""


def write_csv(path: Path, accesses: int, objects: int = 100_000, alpha: float = 0.9, seed: int = 0) -> int:
    """The issue's trace: zipf(alpha) over ``objects`` keys of 4-252 KiB; returns its working set."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, objects + 1) ** alpha
    ids = rng.permutation(objects)[rng.choice(objects, size=accesses, p=weights / weights.sum())]
    sizes = rng.integers(1, 64, size=objects) * 4 * KiB  # 4..252 KiB
    table = np.column_stack([ids, sizes[ids]])
    np.savetxt(path, table, fmt="%d", delimiter=",", header="key,size", comments="")
    return int(sizes[np.unique(ids)].sum())


def _timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, done.stdout


def head_to_head(csv_path: Path, capacity: int, repeats: int, policies: list[str]) -> list[dict[str, Any]]:
    """Per policy: medians of end-to-end seconds for ``tierstore simulate`` and for libCacheSim's
    Python package (one fresh process each), and both miss ratios."""
    from ..sim.external import available

    has_lcs = available()
    rows = []
    for name in tqdm(policies, desc="end to end", leave=False, disable=None):
        ours_s, theirs_s = [], []
        ours_miss = theirs_miss = None
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "r.json"
            for _ in range(repeats):
                seconds, _ = _timed([sys.executable, "-m", "tierstore.cli", "simulate", str(csv_path), "--capacity",
                                     f"host={capacity}B", "--eviction", name, "--json", str(out)])
                ours_s.append(seconds)
                ours_miss = json.loads(out.read_text())[0]["miss_ratio"]
                if has_lcs:
                    seconds, printed = _timed([sys.executable, "-c", _LCS_RUN, str(csv_path), HEAD_TO_HEAD[name], str(capacity)])
                    theirs_s.append(seconds)
                    theirs_miss = float(printed.split()[-1])
        requests = rows[0]["requests"] if rows else _count_rows(csv_path)
        row: dict[str, Any] = {"eviction": name, "requests": requests, "ours_s": statistics.median(ours_s),
                               "ours_kreq_s": requests / statistics.median(ours_s) / 1e3, "ours_miss_ratio": ours_miss}
        if theirs_s:
            row.update(lcs_s=statistics.median(theirs_s), lcs_kreq_s=requests / statistics.median(theirs_s) / 1e3,
                       lcs_miss_ratio=theirs_miss, ratio=statistics.median(theirs_s) / statistics.median(ours_s))
        rows.append(row)
    return rows


def _count_rows(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for _ in handle) - 1  # the header


def plot_speed(rows: list[dict[str, Any]], path: Path) -> None:
    from ..plotting import pyplot

    plt = pyplot()

    names = [r["eviction"] for r in rows]
    x = np.arange(len(rows))
    figure, (speed, misses) = plt.subplots(1, 2, figsize=(11, 4))
    speed.bar(x - 0.2, [r["ours_kreq_s"] for r in rows], 0.4, label="tierstore simulate")
    misses.bar(x - 0.2, [r["ours_miss_ratio"] for r in rows], 0.4, label="tierstore")
    if "lcs_kreq_s" in rows[0]:
        speed.bar(x + 0.2, [r["lcs_kreq_s"] for r in rows], 0.4, label="libCacheSim")
        misses.bar(x + 0.2, [r["lcs_miss_ratio"] for r in rows], 0.4, label="libCacheSim")
    for axes, title in ((speed, "k requests/s end to end (same CSV, one process per run)"), (misses, "miss ratio")):
        axes.set_xticks(x, names, fontsize=8)
        axes.set_title(title, fontsize=9)
        axes.grid(axis="y", alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_policies", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 200k-request trace, one run each, four policies")
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs per policy and tool (median)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_policies.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/mrc_optimizer.png"))
    args = parser.parse_args(argv)
    accesses = 200_000 if args.quick else 1_000_000
    repeats = 1 if args.quick else args.repeats
    policies = ["lru", "s3fifo", "sieve", "tinylfu"] if args.quick else list(HEAD_TO_HEAD)

    with tempfile.TemporaryDirectory() as folder:
        csv_path = Path(folder) / "zipf.csv"
        working_set = write_csv(csv_path, accesses)
        speed_rows = head_to_head(csv_path, working_set // 10, repeats, policies)
    speed_png = args.plot.with_name("bench_policies_speed.png")
    plot_speed(speed_rows, speed_png)

    steps = 40
    trace = optimizer_trace(keys=64, steps=steps, size=4 * MiB)
    first_step = optimizer_trace(keys=64, steps=1, size=4 * MiB)
    capacity = trace.working_set // 2
    combos = [(e, p) for e in ("lru", "fifo", "arc", "s3fifo", "sieve", "min") for p in ("none", "sequential", "amp", "schedule")]
    pattern_rows: list[dict[str, Any]] = []
    results_for_plot = []
    baseline = simulate(trace, {"host": capacity}, "lru", "none", think=2e-3)
    cold = simulate(first_step, {"host": capacity}, "lru", "none").misses
    for eviction, prefetch in tqdm(combos, desc="optimizer pattern", leave=False, disable=None):
        r = simulate(trace, {"host": capacity}, eviction, prefetch, think=2e-3)
        pattern_rows.append({
            "eviction": eviction, "prefetch": prefetch, "misses": r.misses, "miss_ratio": r.miss_ratio,
            "removed": 1 - r.misses / baseline.misses,
            "removed_after_step1": 1 - max(0, r.misses - cold) / max(1, baseline.misses - cold),
            "stall_s": r.stall_seconds, "prefetches": r.prefetches,
            **{f"prefetch_{k}": v for k, v in r.prefetch_stats.get("host", {}).items()
               if k in ("accuracy", "coverage", "timeliness", "pollution", "late", "mean_lateness_seconds")},
        })
        results_for_plot.append(r)
    curves = run_all(trace, {"host": capacity}, ["lru", "arc", "min"], ["none", "schedule"], LinkModel(), sweep=True, think=2e-3)
    plot_curves(curves, trace, args.plot)
    prefetch_png = args.plot.with_name("bench_policies_prefetch.png")
    plot_prefetch([r for r in results_for_plot if r.eviction in ("lru", "min")], prefetch_png)
    print(f"plots: {args.plot} (miss-ratio curves), {prefetch_png} (prefetch)")

    print(f"End to end on one {accesses:,}-request CSV (zipf 0.9, 100k objects of 4-252 KiB), capacity 10% of the working set;")
    compared = "lcs_kreq_s" in speed_rows[0]
    print(f"median of {repeats} run(s), each a fresh process (start, import, parse, simulate)"
          + ("; ratio = ours / libCacheSim req/s" if compared else "; libCacheSim is not installed here, so no ratio "
             "(pip install 'tierstore[libcachesim]' adds it)"))
    columns = [("eviction", "eviction", "s"), ("ours_kreq_s", "ours k req/s", ".0f"), ("ours_miss_ratio", "ours miss", ".4f")]
    if compared:
        columns += [("lcs_kreq_s", "libCacheSim k req/s", ".0f"), ("lcs_miss_ratio", "libCacheSim miss", ".4f"), ("ratio", "ratio", ".2f")]
    print(table(speed_rows, columns))
    print(f"\nOptimizer pattern: 64 keys x 4 MiB, forward then backward, {steps} steps; host capacity 50% of the working set;")
    print("2 ms of compute per access; 'removed' = share of LRU+none's demand misses gone")
    print(table(pattern_rows, [("eviction", "eviction", "s"), ("prefetch", "prefetch", "s"), ("misses", "misses", "d"),
                               ("miss_ratio", "miss ratio", ".4f"), ("removed", "removed", ".1%"),
                               ("removed_after_step1", "after step 1", ".1%"), ("stall_s", "stall s", ".2f"),
                               ("prefetch_accuracy", "accuracy", ".3f"), ("prefetch_coverage", "coverage", ".3f"),
                               ("prefetch_timeliness", "on time", ".3f"), ("prefetch_pollution", "pollution", ".3f")]))
    best = next(r for r in pattern_rows if (r["eviction"], r["prefetch"]) == ("min", "schedule"))
    by_name = {r["eviction"]: r for r in speed_rows}
    goals = {"schedule + MIN removes >= 95% of LRU + none's misses": best["removed"] >= 0.95}
    if "ratio" in by_name["lru"]:
        goals["LRU end to end >= 0.5x libCacheSim's requests/s"] = by_name["lru"]["ratio"] >= 0.5
        goals["S3-FIFO end to end >= 0.5x libCacheSim's requests/s"] = by_name["s3fifo"]["ratio"] >= 0.5
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(args.json, {"benchmark": "bench_policies", "environment": environment(), "end_to_end": speed_rows, "speed_plot": str(speed_png), "prefetch_plot": str(prefetch_png),
                           "optimizer_pattern": pattern_rows, "plot": str(args.plot), "goals": goals})
    print(f"\nJSON: {args.json}\nplots: {args.plot}, {speed_png}")
    return 0
