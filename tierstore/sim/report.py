"""Running policy combinations over a trace, and reporting them: table, JSON, miss-ratio plot."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..units import format_bytes, parse_bytes
from .generators import loop_trace, optimizer_trace, scan_trace, zipf_trace
from .links import LinkModel
from .simulator import SimResult, simulate
from .trace import Trace, load_trace

GENERATORS: dict[str, Any] = {"optimizer": optimizer_trace, "zipf": zipf_trace, "scan": scan_trace, "loop": loop_trace}
SWEEP_FRACTIONS = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def open_trace(spec: str) -> Trace:
    """A trace file (``.npz`` or CSV), or a synthetic one: ``optimizer:keys=64,steps=20,size=4MiB``,
    ``zipf:keys=1000,accesses=100000,alpha=0.9``, ``scan:keys=1000``, ``loop:keys=100,loops=10``."""
    kind, _, params = spec.partition(":")
    if kind in GENERATORS and not Path(spec).exists():
        kwargs: dict[str, Any] = {}
        for item in filter(None, params.split(",")):
            name, _, value = item.partition("=")
            kwargs[name] = float(value) if name == "alpha" else parse_bytes(value)
        try:
            return GENERATORS[kind](**kwargs)
        except TypeError as exc:
            raise ValueError(f"bad parameters for the {kind} trace: {exc}") from None
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"no trace file {spec!r} (and not a synthetic trace: {', '.join(GENERATORS)})")
    return load_trace(path)


def parse_capacities(spec: str) -> dict[str, int]:
    """``"host=2GiB"`` or ``"device=1GiB,host=4GiB"`` (fastest first)."""
    capacities: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"cannot read capacity {item!r}; write e.g. host=2GiB or device=1GiB,host=4GiB")
        capacities[name] = parse_bytes(value)
    if not capacities:
        raise ValueError("no capacity given; write e.g. host=2GiB")
    return capacities


def run_all(
    trace: Trace,
    capacities: dict[str, int],
    evictions: list[str],
    prefetches: list[str],
    links: LinkModel,
    sweep: bool = False,
    think: float | None = None,
) -> list[SimResult]:
    """Every (eviction, prefetch) pair, at the given capacities or over a sweep of the first."""
    first = next(iter(capacities))
    sizes = [round(f * trace.working_set) for f in SWEEP_FRACTIONS] if sweep else [capacities[first]]
    combos = list(itertools.product(evictions, prefetches, sizes))
    results = []
    for eviction, prefetch, size in tqdm(combos, desc="simulate", unit="run", leave=False, disable=True if len(combos) < 4 else None):
        results.append(simulate(trace, {**capacities, first: size}, eviction, prefetch, links, think))
    return results


def format_table(results: list[SimResult], trace: Trace) -> str:
    header = f"{len(trace):,} accesses, {len(trace.keys):,} keys, working set {format_bytes(trace.working_set)}"
    lines = [header, "", f"{'eviction':<9} {'prefetch':<11} {'capacity':>10} {'misses':>9} {'miss ratio':>10} "
             f"{'byte miss':>9} {'prefetches':>10} {'stall s':>9} {'k acc/s':>8}"]
    for r in results:
        lines.append(
            f"{r.eviction:<9} {r.prefetch:<11} {format_bytes(r.capacity):>10} {r.misses:>9,} {r.miss_ratio:>10.4f} "
            f"{r.byte_miss_ratio:>9.4f} {r.prefetches:>10,} {r.stall_seconds:>9.3f} {r.accesses_per_second / 1e3:>8.0f}"
        )
    return "\n".join(lines)


def plot_curves(results: list[SimResult], trace: Trace, path: Path) -> None:
    """Miss-ratio curves: miss ratio against capacity, one line per combination."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        curves.setdefault(f"{r.eviction} + {r.prefetch}", []).append((r.capacity / trace.working_set, r.miss_ratio))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(curves.items()):
        points.sort()
        axes.plot([100 * x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=label)
    axes.set_xlabel("capacity (% of working set)")
    axes.set_ylabel("miss ratio")
    axes.set_ylim(bottom=0)
    axes.set_title(f"miss-ratio curves ({len(trace):,} accesses, working set {format_bytes(trace.working_set)})", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
