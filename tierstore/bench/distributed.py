"""Scale-out on one machine: ``TieredAdamW`` with 1 rank against 2 ranks sharing one disk
(gloo on CPU, DDP, state sharded ZeRO-1 style across the 2).

Per rank: state bytes per tier, step time (median), bytes read and written on disk per step,
and the aggregate disk throughput of the ranks together against one rank alone (several ranks
paging to one disk contend for it: the ratio says how much). DCP checkpoints: save and load
times of the optimizer's state against ``torch.optim.AdamW``'s with the same model, the standard
way (``get/set_optimizer_state_dict``) and streaming (``tierstore.optim.dcp``, through a buffer
of ``--buffer-bytes``), and how far the process's resident memory grew while saving and loading,
against the rank's state bytes.

Reproduce:  python benchmarks/bench_distributed.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from ..optim.distributed import free_port
from .common import environment, median, progress, table, write_json

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench_distributed.json"


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


class PeakRSS:
    """The process's resident memory sampled every 2 ms: the highest value above the start."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _rank(rank: int, world: int, port: int, options: dict[str, Any], out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..optim import TieredAdamW, load_optimizer, save_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        width, depth, steps = options["width"], options["depth"], options["steps"]
        model = DDP(_model(width, depth))
        state_bytes = 12 * sum(p.numel() for p in model.parameters())
        root = Path(out) / f"disk{world}"
        opt = TieredAdamW(
            model.parameters(), lr=1e-3, fused=True, offload="disk", disk_root=root, process_group=True,
            # a quarter of the rank's state in host memory (room for the buckets in flight at least)
            host_capacity=max(4 * 16 * width * width, state_bytes // (4 * world)),
        )
        data = torch.randn(4, 8, width, generator=torch.Generator().manual_seed(rank))
        walls, reads, writes, disk_s = [], [], [], []
        for step in range(steps + 1):
            dist.barrier()
            started = time.perf_counter()
            opt.zero_grad()
            model(data[step % 4]).pow(2).mean().backward()
            opt.step()
            wall = time.perf_counter() - started
            report = opt.time_report()
            if step:  # the first step creates the state
                walls.append(wall)
                reads.append(report.disk_read_bytes)
                writes.append(report.disk_write_bytes)
                disk_s.append(report.disk_read + report.disk_write)
        memory = opt.memory_report()
        row: dict[str, Any] = {
            "world": world, "rank": rank, "parameters": memory.paged_parameters + memory.resident_parameters,
            "state_by_tier": memory.state_by_tier, "state_bytes": sum(memory.state_by_tier.values()) + memory.resident_state_bytes,
            "step_s": median(walls), "disk_read_bytes": median(reads), "disk_write_bytes": median(writes),
            "disk_busy_s": median(disk_s),
        }
        # DCP: our state against torch's AdamW's, the same model (its state made by one step);
        # ours the standard way (get/set_optimizer_state_dict) and streaming (tierstore.optim.dcp)
        plain = DDP(_model(width, depth))
        torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
        plain(data[0]).pow(2).mean().backward()
        torch_opt.step()
        buffer = options["buffer_bytes"]

        def standard_save(net: torch.nn.Module, optimizer: Any, path: Path) -> None:
            dcp.save({"optim": get_optimizer_state_dict(net, optimizer)}, checkpoint_id=str(path))

        def standard_load(net: torch.nn.Module, optimizer: Any, path: Path) -> None:
            state = {"optim": get_optimizer_state_dict(net, optimizer)}
            dcp.load(state, checkpoint_id=str(path))
            set_optimizer_state_dict(net, optimizer, state["optim"])

        variants = {
            "tiered": (model, opt, standard_save, standard_load),
            "stream": (
                model, opt, lambda n, o, p: save_optimizer(o, p, n, buffer_bytes=buffer),
                lambda n, o, p: load_optimizer(o, p, n, buffer_bytes=buffer),
            ),
            "torch": (plain, torch_opt, standard_save, standard_load),
        }
        for name, (net, optimizer, save, load) in variants.items():
            path = Path(out) / f"ckpt{world}-{name}"
            for verb, action in (("save", save), ("load", load)):
                dist.barrier()
                with PeakRSS() as peak:
                    started = time.perf_counter()
                    action(net, optimizer, path)
                    row[f"{name}_{verb}_s"] = time.perf_counter() - started
                row[f"{name}_{verb}_rss_growth"] = peak.growth
        opt.close()
        Path(out, f"rank{world}-{rank}.json").write_text(json.dumps(row))
    finally:
        dist.destroy_process_group()



def run(options: dict[str, Any], folder: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    rows: list[dict[str, Any]] = []
    if options["mmap_threshold"]:
        # glibc's own threshold rises to the size of a freed block, after which freed blocks of a
        # few MiB stay in its arenas and count in the RSS (tensors of 32 MiB and more are always
        # mapped); a fixed one makes the RSS growth measure the memory in use. The ranks inherit it.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(options["mmap_threshold"])
    for world in progress([1, 2], desc="ranks"):
        mp.spawn(_rank, args=(world, free_port(), options, str(folder)), nprocs=world, join=True)
        rows += [json.loads((folder / f"rank{world}-{r}.json").read_text()) for r in range(world)]
    for row in rows:
        row["disk_mb_s"] = (row["disk_read_bytes"] + row["disk_write_bytes"]) / max(row["step_s"], 1e-9) / 1e6
        row["host"] = row["state_by_tier"].get("host", 0)
        row["disk"] = row["state_by_tier"].get("disk", 0)
    one = [r for r in rows if r["world"] == 1]
    two = [r for r in rows if r["world"] == 2]
    alone = one[0]["disk_mb_s"]
    together = sum(r["disk_mb_s"] for r in two)
    return {
        "rows": rows,
        "aggregate_disk_mb_s": {"1 rank": alone, "2 ranks": together, "ratio": together / alone if alone else float("nan")},
        "state_share_2_ranks": max(r["state_bytes"] for r in two) / one[0]["state_bytes"],
        "step_ratio_2_vs_1": max(r["step_s"] for r in two) / one[0]["step_s"],
        "dcp_1_rank": {
            f"{name}_{verb}": {"s": one[0][f"{name}_{verb}_s"], "rss_growth": one[0][f"{name}_{verb}_rss_growth"],
                               "time_vs_torch": one[0][f"{name}_{verb}_s"] / one[0][f"torch_{verb}_s"]}
            for name in ("tiered", "stream", "torch") for verb in ("save", "load")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model and 3 steps (a smoke run)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--buffer-bytes", type=int, default=16 << 20, help="the streaming checkpoint's buffer (bytes)")
    parser.add_argument(
        "--mmap-threshold", type=int, default=128 << 10,
        help="MALLOC_MMAP_THRESHOLD_ for the ranks (0: glibc's dynamic default; see run())",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the ranks' disk tiers and checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    options = {
        "width": 256 if args.quick else args.width, "depth": 4 if args.quick else args.depth, "steps": 3 if args.quick else args.steps,
        "buffer_bytes": args.buffer_bytes, "mmap_threshold": args.mmap_threshold,
    }
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)  # (as the other benchmarks make their --dir)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = run(options, Path(tmp))
        result["environment"] = environment(Path(tmp))
    result["options"] = options
    columns = [
        ("world", "ranks", "d"), ("rank", "rank", "d"), ("host", "host B", ",d"), ("disk", "disk B", ",d"),
        ("step_s", "step s", ".3f"), ("disk_read_bytes", "read B/step", ",.0f"), ("disk_write_bytes", "write B/step", ",.0f"),
        ("disk_mb_s", "disk MB/s", ".1f"),
    ]
    print(table(result["rows"], columns))
    checkpoint_columns = [("world", "ranks", "d"), ("rank", "rank", "d"), ("state_bytes", "state B", ",d")] + [
        (f"{name}_{verb}_{what}", f"{label} {verb} {unit}", fmt)
        for name, label in (("tiered", "std"), ("stream", "stream"), ("torch", "torch"))
        for verb in ("save", "load")
        for what, unit, fmt in (("s", "s", ".3f"), ("rss_growth", "RSS+ MB", ",.1f"))
    ]
    print(table([{**r, **{k: v / 1e6 for k, v in r.items() if k.endswith("rss_growth")}} for r in result["rows"]], checkpoint_columns))
    agg = result["aggregate_disk_mb_s"]
    print(
        f"aggregate disk throughput: 1 rank {agg['1 rank']:.1f} MB/s, 2 ranks on one disk {agg['2 ranks']:.1f} MB/s "
        f"(x{agg['ratio']:.2f}); largest rank's state {result['state_share_2_ranks']:.2f} of one rank's; "
        f"step time 2 ranks / 1 rank x{result['step_ratio_2_vs_1']:.2f}"
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0
