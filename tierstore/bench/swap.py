"""Swap benchmark: activation offload against none and against torch's ``save_on_cpu``, and
parameter offload from host and from disk against all weights resident.

Reproduce:  python benchmarks/bench_swap.py [--quick] [--json FILE] [--dir FOLDER]

Activations: forward + backward of the demo GPT (batch 32); per variant the median step time,
the bytes of saved activations left on the device at the peak (everything without offload; none
with save_on_cpu, which moves them all; for ours the small tensors kept in place, plus the
device tier at its fullest and the tensors brought back ahead of backward at their most), and the time the step waited on the store. Parameters: forward, backward and a
TieredAdamW step with the weights in the store (host, or disk under a small host tier), against
the same with the weights resident; the device tier holds a third of the weights.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..models import GPT, GPTConfig, synthetic_batches
from ..optim import TieredAdamW
from ..swap import offload_activations, offload_parameters
from ..sync import SyncTierStore
from ..tiers import DeviceTier, DiskTier, HostTier
from .common import environment, median, table, write_json

MiB = 1 << 20


def saved_bytes(model: GPT, tokens: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward (what stays on the device without offload)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter) and (t._base is None or not isinstance(t._base, torch.nn.Parameter)):
            total += t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(tokens).backward()
    model.zero_grad()
    return total


def activations(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = GPTConfig()
    torch.manual_seed(0)
    model = GPT(config)
    batches = synthetic_batches(config, args.batch, seed=2)
    total = saved_bytes(model, next(batches))
    root = args.dir / "swap-act"
    shutil.rmtree(root, ignore_errors=True)
    sync = SyncTierStore([DeviceTier("cpu", 64 * MiB), HostTier(4 * total + 64 * MiB), DiskTier(root, "1GiB", durable=False)]).open()
    offload = offload_activations(sync, min_bytes="64KiB")
    device = sync.store.tier("device")
    peaks: list[int] = []
    highest = [0]
    allocate = device.allocate  # type: ignore[attr-defined]

    def allocate_and_note(nbytes: int) -> torch.Tensor:
        buffer = allocate(nbytes)
        highest[0] = max(highest[0], device.live_bytes)  # type: ignore[attr-defined]
        return buffer

    device.allocate = allocate_and_note  # type: ignore[attr-defined]

    def step_none(tokens: torch.Tensor) -> None:
        model.loss(tokens).backward()

    def step_save_on_cpu(tokens: torch.Tensor) -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            loss = model.loss(tokens)
        loss.backward()

    def step_ours(tokens: torch.Tensor) -> None:
        kept = offload.report.bytes_kept
        with offload:
            loss = model.loss(tokens)
        kept = offload.report.bytes_kept - kept  # small tensors left on the device this step
        highest[0] = 0
        offload.report.bytes_ahead_peak = 0
        loss.backward()
        # on the device at the fullest: the tier, tensors popped ahead of backward, small ones kept
        peaks.append(highest[0] + offload.report.bytes_ahead_peak + kept)

    variants = {"no offload": step_none, "torch save_on_cpu": step_save_on_cpu, "tierstore, to host": step_ours}
    times: dict[str, list[float]] = {name: [] for name in variants}
    stalls: list[float] = []
    for step in range(args.steps):
        tokens = next(batches)
        for name, fn in variants.items():
            before = offload.report.stall
            started = time.perf_counter()
            fn(tokens)
            elapsed = time.perf_counter() - started
            model.zero_grad()
            if step >= 2:
                times[name].append(elapsed)
                if name.startswith("tierstore"):
                    stalls.append(offload.report.stall - before)
    kept = offload.report.kept
    sync.close()
    shutil.rmtree(root, ignore_errors=True)
    baseline = median(times["torch save_on_cpu"])
    rows = [
        {"what": "no offload", "step_ms": median(times["no offload"]) * 1e3, "vs_save_on_cpu": median(times["no offload"]) / baseline,
         "device_mib": total / MiB, "stall_ms": 0.0},
        {"what": "torch save_on_cpu", "step_ms": baseline * 1e3, "vs_save_on_cpu": 1.0, "device_mib": 0.0, "stall_ms": 0.0},
        {"what": "tierstore, to host", "step_ms": median(times["tierstore, to host"]) * 1e3,
         "vs_save_on_cpu": median(times["tierstore, to host"]) / baseline,
         "device_mib": max(peaks, default=0) / MiB, "stall_ms": median(stalls) * 1e3, "kept": kept},
    ]
    return rows


def parameters(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = GPTConfig()
    torch.manual_seed(0)
    template = GPT(config)
    weights = sum(p.nbytes for p in template.parameters())
    rows = []
    setups: dict[str, Any] = {"all resident": None, "tierstore, from host": "host", "tierstore, from disk": "disk"}
    results: dict[str, tuple[float, float]] = {}
    for name, tier in setups.items():
        model = copy.deepcopy(template)
        root = args.dir / f"swap-param-{tier}"
        shutil.rmtree(root, ignore_errors=True)
        host: int = 64 * MiB if tier != "disk" else weights // 2
        sync = SyncTierStore([DeviceTier("cpu", weights // 3), HostTier(host), DiskTier(root, "1GiB", durable=False)]).open()
        params = offload_parameters(model, sync, tier=tier) if tier else None
        opt = TieredAdamW(model.parameters(), lr=3e-3, store=sync, state_tier="host")
        batches = synthetic_batches(config, args.batch // 2, seed=3)
        times: list[float] = []
        stalls: list[float] = []
        for step in range(args.steps):
            tokens = next(batches)
            before = params.report.stall if params else 0.0
            started = time.perf_counter()
            opt.zero_grad()
            model.loss(tokens).backward()
            opt.step()
            if params:
                params.mark_step()
            if step >= 2:
                times.append(time.perf_counter() - started)
                stalls.append((params.report.stall if params else 0.0) - before)
        opt.close()
        if params:
            params.detach()
        sync.close()
        shutil.rmtree(root, ignore_errors=True)
        results[name] = (median(times), median(stalls))
    resident = results["all resident"][0]
    for name, (seconds, stall) in results.items():
        rows.append({"what": name, "step_ms": seconds * 1e3, "vs_resident": seconds / resident, "stall_ms": stall * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_swap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_swap.json"))
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench"))
    args = parser.parse_args(argv)
    args.steps = 8 if args.quick else 20
    args.batch = 32
    args.dir.mkdir(parents=True, exist_ok=True)
    print("activations ...", flush=True)
    act = activations(args)
    print("parameters ...", flush=True)
    par = parameters(args)
    print("\nactivation offload (forward + backward of the demo GPT, batch 32)")
    print(table(act, [("what", "variant", "s"), ("step_ms", "step ms", ".1f"), ("vs_save_on_cpu", "vs save_on_cpu", ".2f"),
                      ("device_mib", "saved MiB on device (peak)", ".1f"), ("stall_ms", "waited ms", ".1f")]))
    print("\nparameter offload (forward, backward, TieredAdamW step; device tier = a third of the weights)")
    print(table(par, [("what", "variant", "s"), ("step_ms", "step ms", ".1f"), ("vs_resident", "vs resident", ".2f"), ("stall_ms", "waited ms", ".1f")]))
    ours = act[2]
    goals = {"activation offload to host <= 1.1 x save_on_cpu step time, cutting as many device bytes":
             ours["vs_save_on_cpu"] <= 1.1 and ours["device_mib"] <= act[0]["device_mib"]}
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(args.json, {"benchmark": "bench_swap", "environment": environment(args.dir), "activations": act, "parameters": par, "goals": goals})
    print(f"\nJSON: {args.json}")
    return 0
