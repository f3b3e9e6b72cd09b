"""(f) compressed Adam state: bytes, disk-paged step time and convergence per ``state_precision``
and ``master_weights`` setting, on the demo model and data (``tierstore demo``'s defaults).

Reproduce:  python benchmarks/bench_optim.py --parts f                      (default: 100 steps, ~6 min on 2 busy cores)
            python benchmarks/bench_optim.py --parts f --f-steps 250    (the committed results: 14 min at load ~10)
            python benchmarks/bench_optim.py --parts f --f-steps 1000 --f-long-steps 3000

Settings: an fp32 model with ``state_precision`` ``"fp32"`` (exact), ``"bf16"`` and ``"8bit"``;
a bf16 model with an fp32 master (fp32 moments), and a lossless master (low 16 bits beside the
bf16 weights) with bf16 and with 8-bit moments. Per setting, in one run:

- bytes stored per paged parameter (the store's entries, ``store.info(key)["nbytes"]``);
- with half of that setting's state on disk (a host tier of half its stored bytes, plus room for
  two gradients where they cross a link to the host; the disk tier in ``--dir``, use a real disk): bytes read + written on disk per paged parameter and step
  (``time_report()``) and their overhead over the need; the step time (forward, backward,
  step; median after warm-up) against max(compute: ``torch.optim.AdamW(fused=True)``'s whole
  step in memory on the same dtype, disk: the step's bytes at the raw pread/pwrite rates
  measured in the same run) and against the exact fp32 setting's step; the variants alternate
  step by step;
- the loss curve of ``--f-steps`` training steps with state in host memory (the numbers are
  the same as on disk: the run checks the disk-paged steps' losses against the same steps
  here), its final loss (mean over the last tenth of the steps) against exact fp32 and against
  torch's AdamW on the same dtype. ``--f-long-steps`` trains exact fp32 and 8-bit further.

The loss curves go to ``convergence.png`` beside the JSON (needs matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import torch

from ..device import emulation
from ..models import GPT, GPTConfig, synthetic_batches
from ..optim import TieredAdamW
from ..store import TierStore
from ..tiers import DiskTier, HostTier
from .common import environment, median, progress, table, write_json
from .tiers import raw_rates

MiB = 1 << 20
#: Steps before the timed ones (state creation, the schedule learned).
WARMUP = 3


@dataclass(frozen=True)
class Setting:
    """One compressed-state setting: the model's dtype and TieredAdamW's two options."""

    name: str
    dtype: str
    state_precision: str
    master_weights: str


SETTINGS = (
    Setting("fp32", "fp32", "fp32", "fp32"),
    Setting("bf16", "fp32", "bf16", "fp32"),
    Setting("8bit", "fp32", "8bit", "fp32"),
    Setting("bf16 model, fp32 master", "bf16", "fp32", "fp32"),
    Setting("bf16 model, lossless + bf16", "bf16", "bf16", "lossless"),
    Setting("bf16 model, lossless + 8bit", "bf16", "8bit", "lossless"),
)
#: The settings trained for ``--f-long-steps``.
LONG = ("fp32", "8bit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Part (f)'s options on ``bench_optim``'s parser."""
    group = parser.add_argument_group("part f (compressed state)")
    group.add_argument("--f-steps", type=int, default=100, help="training steps per setting for the loss curves (the issue asks 1000: ~1 h on 2 busy cores)")
    group.add_argument("--f-long-steps", type=int, default=0, help=f"train {' and '.join(LONG)} this far too (0: no longer run)")
    group.add_argument("--f-timed-steps", type=int, default=12, help="timed disk-paged steps per setting, after warm-up")
    group.add_argument("--f-layers", type=int, help="the model's layers (default: the demo's)")
    group.add_argument("--f-dim", type=int, help="the model's width (default: the demo's)")
    group.add_argument("--f-seq", type=int, help="the sequence length (default: the demo's)")


def demo_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The demo's options (model, data, optimizer), with part f's size overrides."""
    from ..demo import build_parser

    demo = build_parser().parse_args([])
    for name in ("layers", "dim", "seq"):
        if getattr(args, f"f_{name}", None) is not None:
            setattr(demo, name, getattr(args, f"f_{name}"))
    demo.device = args.device
    demo.clip = 1.0 if demo.clip is None else demo.clip  # (the demo's default after backward)
    return demo


def make_model(demo: argparse.Namespace, dtype: str) -> GPT:
    config = GPTConfig(vocab=demo.vocab, seq=demo.seq, dim=demo.dim, layers=demo.layers, heads=demo.heads)
    torch.manual_seed(demo.seed)
    return GPT(config).to(demo.device, DTYPES[dtype])


def stored_bytes(setting: Setting, demo: argparse.Namespace) -> tuple[int, int]:
    """(bytes the store holds for ``setting``'s paged state of the demo model, paged parameters),
    from one step with the state in a host tier (``store.info(key)["nbytes"]`` of its entries)."""
    model = make_model(demo, setting.dtype)
    optimizer = make_optimizer(model, demo, setting)
    try:
        tokens = next(synthetic_batches(model.config, demo.batch, seed=demo.seed + 1, device=demo.device))
        train_step(model, optimizer, tokens, demo.clip)
        store = optimizer.store
        return sum(store.info(key)["nbytes"] for key in store.keys()), optimizer.memory_report().paged_parameters
    finally:
        optimizer.close()


def make_optimizer(model: GPT, demo: argparse.Namespace, setting: Setting | None, store: TierStore | None = None) -> Any:
    """The demo's optimizer for ``setting`` (None: torch's AdamW in memory); state in ``store``,
    or in a host tier without one."""
    if setting is None:
        return torch.optim.AdamW(model.parameters(), lr=demo.lr, weight_decay=0.1, fused=True)
    where: dict[str, Any] = {"store": store} if store is not None else {"offload": "host"}
    return TieredAdamW(model.parameters(), lr=demo.lr, weight_decay=0.1, fused=True, max_grad_norm=demo.clip,
                       state_precision=setting.state_precision, master_weights=setting.master_weights, **where)


def train_step(model: GPT, optimizer: Any, tokens: torch.Tensor, clip: float) -> float:
    """One demo step (torch's AdamW clips with ``clip_grad_norm_``, ours with ``max_grad_norm``)."""
    optimizer.zero_grad()
    loss = model.loss(tokens)
    loss.backward()
    if not isinstance(optimizer, TieredAdamW):
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    if loss.is_cuda:
        torch.cuda.synchronize()
    return loss.item()


def disk_steps(args: argparse.Namespace, demo: argparse.Namespace, read_gbs: float, write_gbs: float, bar: Any) -> dict[str, Any]:
    """Each setting with half of its state on disk, and torch's AdamW in memory per dtype,
    alternating step by step: medians of step time, means of disk bytes, and the losses."""
    from policies import MIN, ScheduleLearned

    variants: dict[str, tuple[GPT, Any, Setting | None]] = {}
    facts: dict[str, dict[str, Any]] = {}
    for dtype in DTYPES:
        model = make_model(demo, dtype)
        variants[f"torch {dtype}"] = (model, make_optimizer(model, demo, None), None)
    for setting in SETTINGS:
        state, paged = stored_bytes(setting, demo)
        model = make_model(demo, setting.dtype)
        host = state // 2
        if emulation()[0] or torch.device(demo.device).type == "cuda":
            # gradients cross to the host and wait in the state's tier: room for two beside its half
            host += 2 * max(p.numel() * p.element_size() for p in model.parameters())
        root = args.dir / "optim-f" / setting.name.replace(" ", "_").replace(",", "").replace("+", "and")
        shutil.rmtree(root, ignore_errors=True)
        schedule = ScheduleLearned()
        disk = DiskTier(root, max(4 * state, 64 * MiB), durable=False)
        store = TierStore([HostTier(host), disk], eviction=lambda s=schedule: MIN(s), prefetch=schedule)
        variants[setting.name] = (model, make_optimizer(model, demo, setting, store), setting)
        facts[setting.name] = {"host_tier_bytes": host, "paged_parameters": paged, "stored_bytes_per_param": state / paged}
    batches = synthetic_batches(variants["torch fp32"][0].config, demo.batch, seed=demo.seed + 1, device=demo.device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    moved: dict[str, dict[str, list[float]]] = {name: {"read": [], "write": [], "need": []} for name in variants}
    try:
        for step in range(WARMUP + args.f_timed_steps):
            tokens = next(batches)
            for name, (model, optimizer, _) in variants.items():
                started = time.perf_counter()
                losses[name].append(train_step(model, optimizer, tokens, demo.clip))
                elapsed = time.perf_counter() - started
                if step >= WARMUP:
                    times[name].append(elapsed)
                    if isinstance(optimizer, TieredAdamW):
                        report = optimizer.time_report()
                        moved[name]["read"].append(float(report.disk_read_bytes))
                        moved[name]["write"].append(float(report.disk_write_bytes))
                        moved[name]["need"].append(float(report.disk_need_bytes))
                bar.update(1)
    finally:
        for _, optimizer, kind in variants.values():
            if kind is not None:
                optimizer.close()
    rows: dict[str, Any] = {}
    for name, (_, _, measured) in variants.items():
        row: dict[str, Any] = {"step_ms": median(times[name]) * 1e3, "losses": losses[name]}
        if measured is not None:
            # Means, not medians: bytes are not noisy, and a step's reads and writes may alternate
            # (an entry read in one step is written back in the next), so the median of each
            # alone can pair one step's reads with another's writes.
            read, write, need = (fmean(moved[name][k]) for k in ("read", "write", "need"))
            paged = facts[name]["paged_parameters"]
            compute = median(times[f"torch {measured.dtype}"])
            transfer = read / (read_gbs * 1e9) + write / (write_gbs * 1e9)
            row.update(facts[name], disk_read_bytes=read, disk_write_bytes=write, disk_need_bytes=need,
                       disk_bytes_per_param_step=(read + write) / paged, io_overhead=(read + write) / need if need else None,
                       compute_ms=compute * 1e3, transfer_ms=transfer * 1e3,
                       vs_bound=median(times[name]) / max(compute, transfer), vs_fp32=median(times[name]) / median(times["fp32"]))
        rows[name] = row
    return rows


def curves(args: argparse.Namespace, demo: argparse.Namespace, bar: Any) -> dict[str, list[float]]:
    """Loss per step of each setting with state in host memory, and torch's AdamW per dtype."""
    runs: list[tuple[str, str, Setting | None, int]] = [(f"torch {d}", d, None, args.f_steps) for d in DTYPES]
    runs += [(s.name, s.dtype, s, max(args.f_steps, args.f_long_steps) if s.name in LONG else args.f_steps) for s in SETTINGS]
    result: dict[str, list[float]] = {}
    for name, dtype, setting, steps in runs:
        model = make_model(demo, dtype)
        optimizer = make_optimizer(model, demo, setting)
        batches = synthetic_batches(model.config, demo.batch, seed=demo.seed + 1, device=demo.device)
        bar.set_postfix_str(name)
        try:
            losses = []
            for _ in range(steps):
                losses.append(train_step(model, optimizer, next(batches), demo.clip))
                bar.update(1)
        finally:
            if setting is not None:
                optimizer.close()
        result[name] = losses
    return result


def final_loss(losses: list[float], steps: int) -> float:
    """The mean loss over the last tenth of the first ``steps`` steps (less noisy than one step's)."""
    head = losses[:steps]
    tail = max(1, len(head) // 10)
    return sum(head[-tail:]) / tail


def run(args: argparse.Namespace) -> int:
    """Part (f): measure, print the table, write ``<json stem>_f.json`` and ``convergence.png``."""
    for name in ("f_steps", "f_timed_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    demo = demo_defaults(args)
    long_steps = max(args.f_steps, args.f_long_steps)
    total = (WARMUP + args.f_timed_steps) * (len(SETTINGS) + len(DTYPES)) + args.f_steps * (len(SETTINGS) + len(DTYPES) - len(LONG))
    total += long_steps * len(LONG)
    read_gbs, write_gbs = raw_rates(args.dir, 64 * MiB)
    with progress(total=total, desc="bench_optim (f)", unit="step", leave=False) as bar:
        timed = disk_steps(args, demo, read_gbs, write_gbs, bar)
        losses = curves(args, demo, bar)
    rows = []
    reference = final_loss(losses["fp32"], args.f_steps)
    for setting in SETTINGS:
        row = {"setting": setting.name, "dtype": setting.dtype, "state_precision": setting.state_precision,
               "master_weights": setting.master_weights, **{k: v for k, v in timed[setting.name].items() if k != "losses"}}
        ours, theirs = final_loss(losses[setting.name], args.f_steps), final_loss(losses[f"torch {setting.dtype}"], args.f_steps)
        disk_losses = timed[setting.name]["losses"]
        row.update(final_loss=ours, vs_fp32=ours - reference, vs_torch=ours - theirs, torch_final_loss=theirs,
                   step_vs_fp32=row.pop("vs_fp32"),
                   # the same steps' losses with state on disk and in host memory: the same math
                   disk_vs_host_loss_gap=max(abs(a - b) for a, b in zip(disk_losses, losses[setting.name], strict=False)))
        rows.append(row)
    torch_ms = {dtype: timed[f"torch {dtype}"]["step_ms"] for dtype in DTYPES}
    print(f"(f) compressed state: demo GPT ({demo.layers} layers, dim {demo.dim}), {rows[0]['paged_parameters']:,} paged parameters, "
          f"half of each setting's state on disk ({args.dir}; raw {read_gbs:.2f} GB/s read, {write_gbs:.2f} GB/s write); "
          f"torch AdamW in memory: fp32 {torch_ms['fp32']:.1f} ms, bf16 {torch_ms['bf16']:.1f} ms a step; "
          f"final loss = mean of steps {args.f_steps - max(1, args.f_steps // 10) + 1}-{args.f_steps}")
    print(table(rows, [("setting", "setting", "s"), ("stored_bytes_per_param", "stored B/param", ".2f"),
                       ("disk_bytes_per_param_step", "disk B/param/step", ".2f"), ("io_overhead", "of need", ".2f"),
                       ("step_ms", "step ms", ".1f"), ("vs_bound", "vs max(compute, disk)", ".2f"), ("step_vs_fp32", "vs fp32", ".2f"),
                       ("final_loss", f"loss@{args.f_steps}", ".4f"), ("vs_fp32", "vs fp32", "+.4f"), ("vs_torch", "vs torch", "+.4f"),
                       ("disk_vs_host_loss_gap", "disk/host gap", ".1e")]))
    long_run = {}
    if args.f_long_steps > args.f_steps:
        long_run = {name: final_loss(losses[name], long_steps) for name in LONG}
        print(f"  longer run, loss@{long_steps}: " + ", ".join(f"{name} {value:.4f}" for name, value in long_run.items()))
    out = args.json.with_name(f"{args.json.stem}_f.json")
    plot_path = args.json.with_name("convergence.png")
    plotted = plot(plot_path, losses, args.f_steps)
    write_json(out, {"benchmark": "bench_optim part f", "environment": environment(args.dir), "device": args.device,
                     "model": {"layers": demo.layers, "dim": demo.dim, "seq": demo.seq, "batch": demo.batch, "lr": demo.lr, "seed": demo.seed},
                     "disk_read_gbs": read_gbs, "disk_write_gbs": write_gbs, "steps": args.f_steps, "timed_steps": args.f_timed_steps,
                     "torch_step_ms": torch_ms, "settings": rows, "long_steps": long_steps if long_run else 0, "long_final_loss": long_run,
                     "losses": losses, "plot": str(plot_path) if plotted else None})
    print(f"\nJSON: {out}" + (f"; loss curves: {plot_path}" if plotted else ""))
    return 0


def plot(path: Path, losses: dict[str, list[float]], steps: int) -> bool:
    """Loss curves per setting against exact fp32 (a moving average of 1/50 of the steps, at least 5).
    False, with a message, without matplotlib."""
    try:
        from ..plotting import pyplot

        plt = pyplot()
    except ImportError as exc:
        print(f"no convergence plot: {exc}")
        return False

    def smooth(values: list[float]) -> list[float]:
        window = max(5, len(values) // 50)
        series = torch.tensor(values, dtype=torch.float64)
        sums = torch.cat([torch.zeros(1, dtype=torch.float64), series.cumsum(0)])
        counts = torch.arange(1, len(values) + 1).clamp(max=window)
        ends = torch.arange(1, len(values) + 1)
        return ((sums[ends] - sums[ends - counts]) / counts).tolist()

    long_steps = max(len(losses[name]) for name in LONG)
    panels = [("fp32 model", ["fp32", "bf16", "8bit", "torch fp32"]),
              ("bf16 model", ["bf16 model, fp32 master", "bf16 model, lossless + bf16", "bf16 model, lossless + 8bit", "torch bf16"])]
    if long_steps > steps:
        panels.append((f"longer run ({long_steps} steps)", list(LONG)))
    figure, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 7.5), squeeze=False, sharex="col")
    for column, (title, names) in enumerate(panels):
        limit = long_steps if title.startswith("longer") else steps
        exact = smooth(losses["fp32"][:limit])
        top, bottom = axes[0][column], axes[1][column]
        if "fp32" not in names:
            top.plot(exact, color="black", linewidth=2.5, alpha=0.35, label="fp32 (exact, fp32 model)")
        for name in names:
            curve = smooth(losses[name][:limit])
            style = dict(linestyle="--" if name.startswith("torch") else "-", linewidth=1.3,
                         label=("torch.optim.AdamW " + name.split()[1]) if name.startswith("torch") else name)
            top.plot(curve, **style)
            bottom.plot([a - b for a, b in zip(curve, exact, strict=True)], **style)
        top.set_title(title)
        top.set_ylabel("loss (moving average)")
        top.set_yscale("log")
        bottom.axhline(0.0, color="black", linewidth=0.8, alpha=0.5)
        bottom.set_ylabel("minus exact fp32's")
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
    figure.suptitle("TieredAdamW state_precision / master_weights against exact fp32 (demo GPT, same seed and data)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
