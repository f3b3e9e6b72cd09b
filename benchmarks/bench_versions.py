"""Compare `tierstore bench` figures of this checkout against an earlier revision, in one run.

Reproduce:  python benchmarks/bench_versions.py --base REV [--pairs 3] [--quick]

The earlier revision is checked out into a temporary git worktree. Runs of the old and the new
code alternate (old, new, old, new ...), each a full `tierstore bench` in its own process on
the same scratch folder, so drifts of the machine (page cache, other load) hit both alike.
Each figure's ratio new/old is taken per adjacent pair and the median over pairs is reported;
JSON goes to benchmarks/results/bench_versions.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def run_bench(tree: Path, scratch: Path, quick: bool, out: Path) -> dict[str, float]:
    """One `tierstore bench` of the code in ``tree``; figures by name (GB/s, or µs for latency)."""
    args = ["--dir", str(scratch), "--json", str(out)] + (["--quick"] if quick else [])
    command = [sys.executable, "-c", f"from tierstore.bench.tiers import main; raise SystemExit(main({args!r}))"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    figures = {f"{r['what']} {r['size_mib']} MiB (GB/s)": r["ours_gbs"] for r in result["rows"]}
    figures.update({f"{r['what']} {r['size_kib']} KiB (median µs)": r["median_us"] for r in result["hit_latency"]})
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare against (e.g. the commit before a change)")
    parser.add_argument("--pairs", type=int, default=3, help="old/new pairs of runs (default 3)")
    parser.add_argument("--quick", action="store_true", help="pass --quick to each bench run")
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench-versions"), help="scratch folder for the disk tiers")
    parser.add_argument("--json", type=Path, default=HERE / "benchmarks/results/bench_versions.json")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tierstore-base-") as temp:
        base_tree = Path(temp) / "base"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", "-q", str(base_tree), args.base], check=True)
        try:
            pairs: list[tuple[dict[str, float], dict[str, float]]] = []
            for i in range(args.pairs):
                print(f"pair {i + 1}/{args.pairs}: base ...", flush=True)
                old = run_bench(base_tree, args.dir.resolve(), args.quick, Path(temp) / "old.json")
                print(f"pair {i + 1}/{args.pairs}: this checkout ...", flush=True)
                new = run_bench(HERE, args.dir.resolve(), args.quick, Path(temp) / "new.json")
                pairs.append((old, new))
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base_tree)], check=False)
    rows: list[dict[str, Any]] = []
    for name in pairs[0][0]:
        if not all(name in old and name in new for old, new in pairs):
            continue
        lower_is_better = "µs" in name
        ratios = [(o[name] / n[name]) if lower_is_better else (n[name] / o[name]) for o, n in pairs if o[name] and n[name]]
        rows.append({"figure": name, "old": statistics.median(o[name] for o, _ in pairs),
                     "new": statistics.median(n[name] for _, n in pairs), "ratio": statistics.median(ratios)})
    width = max(len(r["figure"]) for r in rows)
    print(f"\n{'figure':<{width}}  {'old':>8}  {'new':>8}  new/old (speed, median of {len(pairs)} pairs)")
    for r in rows:
        flag = "  <-- slower by more than 5%" if r["ratio"] < 0.95 else ""
        print(f"{r['figure']:<{width}}  {r['old']:8.2f}  {r['new']:8.2f}  {r['ratio']:.3f}{flag}")
    worst = min(rows, key=lambda r: r["ratio"])
    print(f"\nworst: {worst['figure']} at {worst['ratio']:.3f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "bench_versions", "base": args.base, "pairs": len(pairs), "rows": rows}, indent=2))
    print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
