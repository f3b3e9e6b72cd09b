"""Running policy combinations over a trace, and reporting them: table, JSON, miss-ratio plot."""

from __future__ import annotations

import inspect
from fractions import Fraction
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


def open_trace(spec: str, columns: dict[str, int | str] | None = None) -> Trace:
    """A trace file (``.npz``, oracleGeneral or CSV, whose ``columns`` may be chosen), or a
    synthetic one: ``optimizer:keys=64,steps=20,size=4MiB``, ``zipf:keys=1000,accesses=100000,alpha=0.9``,
    ``scan:keys=1000``, ``loop:keys=100,loops=10``."""
    kind, _, params = spec.partition(":")
    if kind in GENERATORS and not Path(spec).exists():
        if columns:
            raise ValueError(f"columns (--columns) pick a CSV trace's columns, and {spec!r} is a synthetic trace; leave them out")
        trace = GENERATORS[kind](**_generator_arguments(kind, params, spec))
        if not len(trace):
            raise ValueError(f"the {kind} trace {spec!r} makes no accesses: give its counts (keys=, ...) 1 or more")
        return trace
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(f"no trace file {spec!r} (and not a synthetic trace: {', '.join(GENERATORS)})")
    return load_trace(path, columns)


def _generator_arguments(kind: str, params: str, spec: str) -> dict[str, Any]:
    """The keyword arguments ``name=value,...`` of a synthetic trace's generator, each a parameter
    it has, given once (a second one silently replaced the first), read as its kind of value."""
    known = list(inspect.signature(GENERATORS[kind]).parameters)
    arguments: dict[str, Any] = {}
    for item in filter(None, params.split(",")):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in known:
            raise ValueError(f"unknown parameter {name!r} for {kind} traces; valid: {', '.join(known)}")
        if name in arguments:
            raise ValueError(f"parameter {name!r} is given twice in {spec!r}; give each parameter once")
        if name == "alpha":
            try:
                arguments[name] = float(value)
            except ValueError:
                raise ValueError(f"{kind} trace: alpha={value!r} is not a number") from None
        elif name == "size":
            try:
                arguments[name] = parse_bytes(value)
            except ValueError as exc:
                raise ValueError(f"{kind} trace: size={value!r}: {exc}") from None
        elif value.strip().isdigit():
            arguments[name] = int(value)
        else:
            raise ValueError(f"{kind} trace: {name}={value!r} is not a count (a whole number of 0 or more)")
    return arguments


def parse_columns(spec: str | None) -> dict[str, int | str] | None:
    """``"key=0,size=3"`` or ``"key=obj_id,size=obj_size"`` (0-based indexes or header names)."""
    if not spec:
        return None
    columns: dict[str, int | str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        role, sep, value = item.partition("=")
        if not sep or role not in ("key", "size") or not value:
            raise ValueError(f"cannot read column choice {item!r}; write e.g. key=0,size=3 or key=obj_id,size=obj_size")
        columns[role] = int(value) if value.isdigit() else value
    return columns


def parse_capacities(spec: str) -> dict[str, int]:
    """``"host=2GiB"`` or ``"device=1GiB,host=4GiB"`` (fastest first)."""
    capacities: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"cannot read capacity {item!r}; write e.g. host=2GiB or device=1GiB,host=4GiB")
        if name.lower() == "disk":
            raise ValueError(f"{item!r}: the simulated disk holds everything and takes no capacity; "
                             "give the memory tiers above it, e.g. host=2GiB or device=1GiB,host=4GiB")
        if name in capacities:
            raise ValueError(f"tier {name!r} is given two capacities in {spec!r}; give each tier once")
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
    engines: tuple[str, ...] = ("tierstore",),
) -> list[SimResult]:
    """Every (eviction, prefetch) pair, at the given capacities or over a sweep of the first, on
    each engine: ``tierstore`` (ours) and ``libcachesim`` (its own policies, one cache, no
    prefetch). With both engines, a policy only one of them knows runs on that one."""
    from policies import EVICTION

    from .external import NAMES, simulate_libcachesim

    if not evictions or not prefetches:
        raise ValueError(f"no {'eviction' if not evictions else 'prefetch'} policy named; give one or more, "
                         f"e.g. {'--eviction lru,min' if not evictions else '--prefetch none,schedule'}")
    unknown_engines = set(engines) - {"tierstore", "libcachesim"}
    if unknown_engines or not engines:
        raise ValueError(f"unknown engine(s) {sorted(unknown_engines)}; choose tierstore and/or libcachesim")
    first = next(iter(capacities))
    # (exact: in floats the 100% point of a working set near 2**63 fell below it)
    sizes = [round(Fraction(str(f)) * trace.working_set) for f in SWEEP_FRACTIONS] if sweep else [capacities[first]]
    runs: list[tuple[str, str, str, int]] = []
    for eviction in evictions:
        ours = eviction in EVICTION or eviction == "min"
        chosen = [e for e in engines if e == "libcachesim" or ours or len(engines) == 1]
        if len(engines) > 1 and "libcachesim" in chosen and not ours and eviction.lower() not in NAMES:
            chosen = ["libcachesim"]  # its own name for a policy (checked when it runs)
        for engine in chosen:
            for prefetch in (prefetches if engine == "tierstore" else ["none"]):
                runs.extend((engine, eviction, prefetch, size) for size in sizes)
    results = []
    # (shown on stderr even when it is not a terminal: a long sweep is not mistaken for a hang)
    for engine, eviction, prefetch, size in tqdm(runs, desc=f"simulate ({len(trace):,} rows a run)", unit="run", leave=False,
                                                 disable=len(runs) < 2, mininterval=1.0):
        if engine == "libcachesim":
            results.append(simulate_libcachesim(trace, {**capacities, first: size}, eviction))
        else:
            results.append(simulate(trace, {**capacities, first: size}, eviction, prefetch, links, think))
    return results


def engine_label(result: SimResult) -> str:
    """How a result is named in tables and plots: ``lru`` (ours), ``lru [libCacheSim]``."""
    return result.eviction if result.engine == "tierstore" else f"{result.eviction} [libCacheSim]"


def describe(trace: Trace) -> str:
    """``"1,000 accesses, 12 keys"``, and the deletes where there are some (they are not accesses:
    the miss ratios are of the accesses)."""
    deletes = trace.deletes
    removed = f" and {deletes:,} delete{'s' if deletes != 1 else ''}" if deletes else ""
    return f"{len(trace) - deletes:,} accesses{removed}, {len(trace.keys):,} keys"


def format_table(results: list[SimResult], trace: Trace) -> str:
    header = f"{describe(trace)}, working set {format_bytes(trace.working_set)}"
    width = max([9] + [len(engine_label(r)) for r in results])
    lines = [header, "", f"{'eviction':<{width}} {'prefetch':<11} {'capacity':>10} {'misses':>9} {'miss ratio':>10} "
             f"{'byte miss':>9} {'prefetches':>10} {'stall s':>9} {'k acc/s':>8}"]
    for r in results:
        lines.append(
            f"{engine_label(r):<{width}} {r.prefetch:<11} {format_bytes(r.capacity):>10} {r.misses:>9,} {r.miss_ratio:>10.4f} "
            f"{r.byte_miss_ratio:>9.4f} {r.prefetches:>10,} {r.stall_seconds:>9.3f} {r.accesses_per_second / 1e3:>8.0f}"
        )
    tiered = [r for r in results if len(r.capacities) > 1]
    if tiered:  # the table above speaks of the fastest tier only
        lines += ["", f"{'eviction':<{width}} {'prefetch':<11} requests served by each tier (its capacity), the rest from below"]
        for r in tiered:
            served = [f"{tier} ({format_bytes(capacity)}) {r.hits_by_tier.get(tier, 0) / max(r.requests, 1):.1%}"
                      for tier, capacity in r.capacities.items()]
            below = r.requests - sum(r.hits_by_tier.get(tier, 0) for tier in r.capacities)
            served.append(f"below {below / max(r.requests, 1):.1%}")
            lines.append(f"{engine_label(r):<{width}} {r.prefetch:<11} " + ", ".join(served))
    stats = [(r, tier, s) for r in results for tier, s in r.prefetch_stats.items()]
    if stats:
        lines += ["", f"{'prefetch':<11} {'eviction':<{width}} {'tier':<8} {'capacity':>10} {'issued':>8} {'accuracy':>8} "
                      f"{'coverage':>8} {'on time':>8} {'late':>6} {'late ms':>8} {'pollution':>9}"]
        for r, tier, s in stats:
            capacity = format_bytes(r.capacities.get(tier, r.capacity))
            lines.append(f"{r.prefetch:<11} {engine_label(r):<{width}} {tier:<8} {capacity:>10} {s['issued']:>8,} "
                         f"{s['accuracy']:>8.3f} {s['coverage']:>8.3f} "
                         f"{s['timeliness']:>8.3f} {s['late']:>6,} {1e3 * s['mean_lateness_seconds']:>8.2f} {s['pollution']:>9.3f}")
    return "\n".join(lines)


def plot_curves(results: list[SimResult], trace: Trace, path: Path) -> None:
    """Miss-ratio curves: miss ratio against capacity, one line per combination."""
    from ..plotting import pyplot

    plt = pyplot()

    curves: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        # (a working set of 0 bytes, every access an empty value: any capacity holds all of it)
        share = r.capacity / trace.working_set if trace.working_set else 1.0
        curves.setdefault(f"{engine_label(r)} + {r.prefetch}", []).append((share, r.miss_ratio))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    # (a sweep of every policy draws more curves than the default cycle's 10 colours: 20
    # colours, 10 markers, and dashed lines past the 20th, so no two curves look alike)
    colours = plt.get_cmap("tab20").colors
    markers, dashes = "os^vDP*Xph", ["-", "--", "-.", ":"]
    for n, (label, points) in enumerate(sorted(curves.items())):
        points.sort()
        axes.plot([100 * x for x, _ in points], [y for _, y in points], marker=markers[n % len(markers)], markersize=3, label=label,
                  color=colours[n % len(colours)], linestyle=dashes[(n // len(colours)) % len(dashes)])
    axes.set_xlabel("capacity (% of working set)")
    axes.set_ylabel("miss ratio")
    axes.set_ylim(bottom=0)
    axes.set_title(f"miss-ratio curves ({describe(trace)}, working set {format_bytes(trace.working_set)})", fontsize=10)
    axes.grid(alpha=0.3)
    if len(curves) <= 10:
        axes.legend(fontsize=8)
    else:  # (beside the axes, in as many columns as it takes: inside, it would cover the curves)
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + (len(curves) - 1) // 24, borderaxespad=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def plot_prefetch(results: list[SimResult], path: Path) -> bool:
    """Bars of accuracy, coverage, timeliness and pollution per prefetcher, eviction and tier
    (at each combination's largest capacity). False, and no file, when nothing prefetched."""
    chosen: dict[tuple[str, str, str], dict[str, float]] = {}
    largest: dict[tuple[str, str, str], int] = {}
    for r in results:
        for tier, stats in r.prefetch_stats.items():
            key = (r.prefetch, engine_label(r), tier)
            capacity = r.capacities.get(tier, r.capacity)  # (as the table shows it)
            if capacity >= largest.get(key, -1):
                largest[key], chosen[key] = capacity, stats
    if not chosen:
        return False
    from ..plotting import pyplot

    plt = pyplot()
    import numpy as np

    metrics = ["accuracy", "coverage", "timeliness", "pollution"]
    names = [f"{p} / {e} / {t} ({format_bytes(largest[(p, e, t)])})" for p, e, t in chosen]
    many = len(names) > 8  # (then narrower groups, labels upright: the figure stays readable on a screen)
    figure, axes = plt.subplots(figsize=(min(max(6, (0.45 if many else 1.4) * len(names) + 2), 24), 4.5))
    x = np.arange(len(names))
    for i, metric in enumerate(metrics):
        axes.bar(x + (i - 1.5) * 0.2, [stats[metric] for stats in chosen.values()], width=0.2, label=metric)
    axes.set_xticks(x, names, rotation=90 if many else 20, ha="center" if many else "right", fontsize=7 if many else 8)
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("share")
    axes.set_title("prefetch: accuracy, coverage, on-time share, pollution (prefetcher / eviction / tier)", fontsize=9)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=8, **({"loc": "upper left", "bbox_to_anchor": (1.005, 1.0), "borderaxespad": 0} if many else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return True
