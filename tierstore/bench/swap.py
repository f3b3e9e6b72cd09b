"""Swap benchmark: activation offload against none and against torch's ``save_on_cpu``, and
parameter offload from host and from disk against all weights resident.

Reproduce:  python benchmarks/bench_swap.py [--quick] [--json FILE] [--dir FOLDER]

Activations: forward + backward of the demo GPT (batch 32); per variant the median step time,
the bytes of saved activations left on the device at the peak (everything without offload; none
with save_on_cpu, which moves them all; for ours the small tensors kept in place, plus the
device tier at its fullest and the tensors brought back ahead of backward at their most), and the time the step waited on the store. Parameters: forward, backward and a
TieredAdamW step with the weights in the store (host; host with room for half of them; disk), against
the same with the weights resident, and the bytes written into the disk tier a step; the device
tier holds a third of the weights.

Emulated link: beside the plain runs (the CPU lends its memory, nothing crosses), the same
offload over an emulated device (``tierstore.device``) whose link runs at ``--link`` (default
``25GB/s,10us``): every crossing a real copy on the link's copy threads. For those rows: the bytes
over the link each way per step, the time the training loop waited, and the share of the link's
transfer time hidden behind compute: the overlap of each transfer span (the link's listener)
with the forward and backward spans (measured around the calls) less the spans the loop waited
on the store, over the total transfer time.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..device import TO_DEVICE, TO_HOST, Link, emulate_device
from ..models import GPT, GPTConfig, synthetic_batches
from ..optim import TieredAdamW
from ..swap import offload_activations, offload_parameters
from ..sync import SyncTierStore
from ..tiers import DeviceTier, DiskTier, HostTier
from .common import environment, median, progress, table, write_json

MiB = 1 << 20
DEFAULT_LINK = "25GB/s,10us"


class Timeline:
    """Transfer spans from a link's listener, compute spans and wait spans, while ``recording``."""

    def __init__(self) -> None:
        self.recording = False
        self.transfers: list[tuple[str, int, float, float]] = []
        self.compute: list[tuple[float, float]] = []
        self.waits: list[tuple[float, float]] = []

    def __call__(self, direction: str, nbytes: int, started: float, ended: float) -> None:
        if self.recording:
            self.transfers.append((direction, nbytes, started, ended))

    def computed(self, started: float, ended: float) -> None:
        if self.recording:
            self.compute.append((started, ended))

    def summary(self, steps: int) -> dict[str, float]:
        """Bytes each way per step, transfer seconds, and the share hidden behind compute."""
        working = _subtract(_union(self.compute), _union(self.waits))
        total = sum(ended - started for _, _, started, ended in self.transfers)
        hidden = sum(_overlap(started, ended, working) for _, _, started, ended in self.transfers)
        per_step = {d: sum(n for direction, n, _, _ in self.transfers if direction == d) / max(steps, 1) for d in (TO_HOST, TO_DEVICE)}
        return {"to_host_mib": per_step[TO_HOST] / MiB, "to_device_mib": per_step[TO_DEVICE] / MiB,
                "transfer_ms": total * 1e3 / max(steps, 1), "hidden": hidden / total if total else float("nan")}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for started, ended in sorted(spans):
        if merged and started <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], ended))
        else:
            merged.append((started, ended))
    return merged


def _subtract(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` (disjoint, sorted) without ``holes`` (disjoint, sorted)."""
    out = []
    for started, ended in spans:
        cursor = started
        for hole_start, hole_end in holes:
            if hole_end <= cursor or hole_start >= ended:
                continue
            if hole_start > cursor:
                out.append((cursor, hole_start))
            cursor = max(cursor, hole_end)
        if cursor < ended:
            out.append((cursor, ended))
    return out


def _overlap(started: float, ended: float, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(ended, b) - max(started, a)) for a, b in spans)


def _emulated_store(tiers: list[Any], link: str) -> tuple[SyncTierStore, Link]:
    """A store whose device tier is behind a link: the emulated device at ``link``'s speed, or
    a CUDA device's own link."""
    with emulate_device(True, link=link):
        sync = SyncTierStore(tiers).open()
    device_link = sync.store.tier("device").link  # type: ignore[attr-defined]
    assert device_link is not None
    return sync, device_link


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
    model = GPT(config).to(args.device)
    batches = synthetic_batches(config, args.batch, seed=2, device=args.device)
    total = saved_bytes(model, next(batches))
    root = args.dir / "swap-act"
    shutil.rmtree(root, ignore_errors=True)
    sync = SyncTierStore([DeviceTier(args.device, 64 * MiB, emulate_device=False), HostTier(4 * total + 64 * MiB),
                          DiskTier(root, "1GiB", durable=False)]).open()
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

    emulated_root = args.dir / "swap-act-emulated"
    shutil.rmtree(emulated_root, ignore_errors=True)
    emulated, link = _emulated_store([DeviceTier(args.device, 64 * MiB), HostTier(4 * total + 64 * MiB), DiskTier(emulated_root, "1GiB", durable=False)], args.link)
    over_link = offload_activations(emulated, min_bytes="64KiB")
    timeline = Timeline()
    link.add_listener(timeline)
    over_link.report.waits = timeline.waits
    emulated_peaks: list[int] = []

    def step_over_link(tokens: torch.Tensor) -> None:
        kept = over_link.report.bytes_kept
        started = time.perf_counter()
        with over_link:
            loss = model.loss(tokens)
        middle = time.perf_counter()
        over_link.report.bytes_ahead_peak = 0
        loss.backward()
        timeline.computed(started, middle)
        timeline.computed(middle, time.perf_counter())
        # on the device: what came back ahead of backward at its most, and the small tensors kept
        emulated_peaks.append(over_link.report.bytes_ahead_peak + over_link.report.bytes_kept - kept)

    emulated_name = f"tierstore, to host, link {args.link}"
    variants = {"no offload": step_none, "torch save_on_cpu": step_save_on_cpu, "tierstore, to host": step_ours, emulated_name: step_over_link}
    reports = {"tierstore, to host": offload.report, emulated_name: over_link.report}
    times: dict[str, list[float]] = {name: [] for name in variants}
    stalls: dict[str, list[float]] = {name: [] for name in reports}
    for step in progress(range(args.steps), desc="activations"):
        tokens = next(batches)
        timeline.recording = step >= 2
        for name, fn in variants.items():
            before = reports[name].stall if name in reports else 0.0
            started = time.perf_counter()
            fn(tokens)
            _sync(args.device)
            elapsed = time.perf_counter() - started
            model.zero_grad()
            if step >= 2:
                times[name].append(elapsed)
                if name in reports:
                    stalls[name].append(reports[name].stall - before)
    kept = offload.report.kept
    link.remove_listener(timeline)
    measured = max(args.steps - 2, 1)
    sync.close()
    emulated.close()
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(emulated_root, ignore_errors=True)
    baseline = median(times["torch save_on_cpu"])
    rows = [
        {"what": "no offload", "step_ms": median(times["no offload"]) * 1e3, "vs_save_on_cpu": median(times["no offload"]) / baseline,
         "device_mib": total / MiB, "stall_ms": 0.0},
        {"what": "torch save_on_cpu", "step_ms": baseline * 1e3, "vs_save_on_cpu": 1.0, "device_mib": 0.0, "stall_ms": 0.0},
        {"what": "tierstore, to host", "step_ms": median(times["tierstore, to host"]) * 1e3,
         "vs_save_on_cpu": median(times["tierstore, to host"]) / baseline,
         "device_mib": max(peaks, default=0) / MiB, "stall_ms": median(stalls["tierstore, to host"]) * 1e3, "kept": kept},
        {"what": emulated_name, "step_ms": median(times[emulated_name]) * 1e3, "vs_save_on_cpu": median(times[emulated_name]) / baseline,
         "device_mib": max(emulated_peaks, default=0) / MiB, "stall_ms": median(stalls[emulated_name]) * 1e3, "link": args.link,
         **timeline.summary(measured)},
    ]
    return rows


def parameters(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = GPTConfig()
    torch.manual_seed(0)
    template = GPT(config).to(args.device)
    weights = sum(p.nbytes for p in template.parameters())
    rows = []
    # (the weights' tier, over the emulated link, the host tier's capacity)
    setups: dict[str, tuple[Any, bool, int]] = {
        "all resident": (None, False, 64 * MiB), "tierstore, from host": ("host", False, 64 * MiB),
        "tierstore, from host, host tier = half the weights": ("host", False, weights // 2),
        "tierstore, from disk": ("disk", False, weights // 2), f"tierstore, from host, link {args.link}": ("host", True, 64 * MiB),
    }
    results: dict[str, tuple[float, float, dict[str, float], float]] = {}
    for name, (tier, over_link, host) in progress(setups.items(), total=len(setups), desc="parameters"):
        model = copy.deepcopy(template)
        root = args.dir / f"swap-param-{tier}"
        shutil.rmtree(root, ignore_errors=True)
        tiers = [DeviceTier(args.device, weights // 3, emulate_device=over_link), HostTier(host), DiskTier(root, "1GiB", durable=False)]
        timeline = Timeline()
        link: Link | None = None
        if over_link:
            sync, link = _emulated_store(tiers, args.link)
            link.add_listener(timeline)
        else:
            sync = SyncTierStore(tiers).open()
        params = offload_parameters(model, sync, tier=tier) if tier else None
        if params is not None:
            params.report.waits = timeline.waits
        opt = TieredAdamW(model.parameters(), lr=3e-3, store=sync, state_tier="host")
        batches = synthetic_batches(config, args.batch // 2, seed=3, device=args.device)
        times: list[float] = []
        stalls: list[float] = []
        written = 0
        for step in range(args.steps):
            tokens = next(batches)
            timeline.recording = step >= 2
            if step == 2:
                written = -_to_disk(sync)
            before = params.report.stall if params else 0.0
            started = time.perf_counter()
            opt.zero_grad()
            loss = model.loss(tokens)
            middle = time.perf_counter()
            loss.backward()
            timeline.computed(started, middle)
            timeline.computed(middle, time.perf_counter())
            opt.step()
            _sync(args.device)
            if params:
                params.mark_step()
            if step >= 2:
                times.append(time.perf_counter() - started)
                stalls.append((params.report.stall if params else 0.0) - before)
        written += _to_disk(sync)
        if link is not None:
            link.remove_listener(timeline)
        opt.close()
        if params:
            params.detach()
        sync.close()
        shutil.rmtree(root, ignore_errors=True)
        results[name] = (median(times), median(stalls), timeline.summary(max(args.steps - 2, 1)) if over_link else {},
                         written / max(args.steps - 2, 1))
    resident = results["all resident"][0]
    for name, (seconds, stall, crossings, to_disk) in results.items():
        rows.append({"what": name, "step_ms": seconds * 1e3, "vs_resident": seconds / resident, "stall_ms": stall * 1e3,
                     "disk_written_mib": to_disk / MiB, **crossings})
    return rows


def _to_disk(store: SyncTierStore) -> int:
    """Bytes the store has written into its disk tier so far (every link into it)."""
    return sum(link["nbytes"] for name, link in store.stats()["links"].items() if name.endswith("->disk"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_swap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_swap.json"))
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench"))
    parser.add_argument("--link", default=DEFAULT_LINK, help=f"the emulated link's speed (default {DEFAULT_LINK!r})")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (plain, and the emulated device) or cuda (its own link)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
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
    print(table(par, [("what", "variant", "s"), ("step_ms", "step ms", ".1f"), ("vs_resident", "vs resident", ".2f"), ("stall_ms", "waited ms", ".1f"),
                      ("disk_written_mib", "disk written MiB/step", ".1f")]))
    crossing = [row for row in act + par if "hidden" in row]
    print(f"\nover the emulated link ({args.link}), per step: bytes each way, link busy time, share hidden behind compute")
    print(table(crossing, [("what", "variant", "s"), ("to_host_mib", "to host MiB", ".1f"), ("to_device_mib", "to device MiB", ".1f"),
                           ("transfer_ms", "transfer ms", ".1f"), ("stall_ms", "waited ms", ".1f"), ("hidden", "hidden", ".0%")]))
    ours = act[2]
    goals = {"activation offload to host <= 1.1 x save_on_cpu step time, cutting as many device bytes":
             ours["vs_save_on_cpu"] <= 1.1 and ours["device_mib"] <= act[0]["device_mib"]}
    print()
    for goal, met in goals.items():
        print(f"  [{'met' if met else 'MISSED'}] {goal}")
    write_json(args.json, {"benchmark": "bench_swap", "environment": environment(args.dir), "link": args.link, "device": args.device, "activations": act, "parameters": par, "goals": goals})
    print(f"\nJSON: {args.json}")
    return 0


def _sync(device: str) -> None:
    """Wait for the device's queued work before reading a timer (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
