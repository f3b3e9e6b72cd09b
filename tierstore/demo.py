"""``tierstore demo``: train a small GPT with its Adam state paged through device, host and disk
tiers small enough to force paging, then report where the bytes and the time went.

Reproduce:  tierstore demo [--steps 200] [--compare] [--timeline step.json] [--plot loss.png]
            tierstore demo --dtype bf16 --state-precision 8bit --master-weights lossless --compare
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .bench.common import milestones, progress
from .models import GPT, GPTConfig, synthetic_batches
from .optim import TieredAdamW
from .optim.precision import MASTER_WEIGHTS, PRECISIONS, keeps_no_master, planned_state_bytes
from .outputs import check_image_format
from .store import TierStore
from .sync import run
from .tensors import ALIGNMENT
from .tiers import DeviceTier, DiskTier, HostTier
from .units import format_bytes, parse_bytes, round_up
from .wear import drive_wear, valid_rating

DEFAULT_ROOT = Path(".tierstore") / "demo"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model and training")
    model.add_argument("--steps", type=int, default=200)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--dim", type=int, default=128)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--vocab", type=int, default=256)
    model.add_argument("--seq", type=int, default=64)
    model.add_argument("--batch", type=int, default=16)
    model.add_argument("--lr", type=float, default=3e-3)
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--clip", type=float, help="clip gradients to this global norm (0: off; default 1.0, off with --step-in-backward)")
    model.add_argument("--step-in-backward", action="store_true", help="update each tensor as soon as its gradient is ready (no clipping)")
    model.add_argument("--offload-params", action="store_true", help="keep the weights in the store too; each layer visits the device tier only while it computes")
    model.add_argument("--offload-activations", action="store_true", help="send activations saved for backward to the host tier")
    model.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's weights and compute")
    model.add_argument("--state-precision", choices=PRECISIONS, default="fp32", help="how Adam's moments are stored (TieredAdamW(state_precision=))")
    model.add_argument("--master-weights", choices=MASTER_WEIGHTS, default="fp32",
                       help="lossless: keep only the master's low 16 bits beside the bf16 weights (needs --dtype bf16)")
    tiers = parser.add_argument_group("tiers")
    tiers.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the model runs (the device tier's device)")
    tiers.add_argument("--device-capacity", default="16MiB")
    tiers.add_argument("--host-capacity", help="default: half of the optimizer's state (at least 1 MiB), so about half of it pages to disk")
    tiers.add_argument("--disk-capacity", default="1GiB")
    tiers.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"the disk tier's folder (default {DEFAULT_ROOT}, created if absent)")
    out = parser.add_argument_group("output")
    out.add_argument("--compare", action="store_true", help="also train with torch.optim.AdamW in memory and compare the losses")
    out.add_argument("--timeline", type=Path, help="write the last step as a Chrome trace (Perfetto, chrome://tracing)")
    out.add_argument("--plot", type=Path, help="write the loss curve(s) as a PNG")
    out.add_argument("--json", type=Path, help="write losses and reports as JSON")
    out.add_argument("--drive-capacity", default="2TB", help="the SSD the wear figures describe: its capacity")
    out.add_argument("--drive-tbw", type=float, help="its rated endurance in terabytes written (default: 600 per TB of capacity)")
    return parser


def make_store(args: argparse.Namespace) -> TierStore:
    """The demo's tiers, with learned prefetch and MIN eviction sharing one schedule."""
    from policies import MIN, ScheduleLearned

    schedule = ScheduleLearned()
    # Paged optimizer state is scratch (checkpoints go through state_dict), so no fsync per write.
    disk = DiskTier(args.root, args.disk_capacity, durable=False)
    tiers = [DeviceTier(args.device, args.device_capacity), HostTier(args.host_capacity), disk]
    return TierStore(tiers, eviction=lambda: MIN(schedule), prefetch=schedule)


def train(
    model: GPT, optimizer: Any, args: argparse.Namespace, label: str, clip_with_torch: bool, swaps: tuple[Any, Any] = (None, None)
) -> tuple[list[float], list[float]]:
    """Train for ``args.steps``; return per-step losses and step times (seconds). ``swaps`` are
    the parameter and activation offloaders, if used."""
    params, activations = swaps
    batches = synthetic_batches(model.config, args.batch, seed=args.seed + 1, device=args.device)
    timeline = getattr(optimizer, "timeline", None)
    losses, times = [], []
    bar = progress(range(args.steps), desc=label, unit="step", dynamic_ncols=True)
    log_after = milestones(args.steps) if bar.disable else set()
    for step in bar:
        started = time.perf_counter()
        tokens = next(batches)
        optimizer.zero_grad()
        with timeline.span("forward") if timeline else _nothing(), activations if activations else _nothing():
            loss = model.loss(tokens)
        with timeline.span("backward") if timeline else _nothing():
            loss.backward()
        if args.clip and clip_with_torch:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if params is not None:
            params.mark_step()
        losses.append(loss.item())
        times.append(time.perf_counter() - started)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", ms=f"{times[-1] * 1e3:.0f}")
        if step + 1 in log_after:  # no bar (not a terminal): a few lines for the log instead
            print(f"{label}: step {step + 1}/{args.steps}, loss {losses[-1]:.3f}, {times[-1] * 1e3:.0f} ms", flush=True)
    return losses, times


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options before anything is built, or None."""
    for name in ("steps", "layers", "dim", "heads", "vocab", "seq", "batch"):
        if getattr(args, name) < 1:
            return f"--{name} must be at least 1, not {getattr(args, name)}"
    if args.dim % args.heads:
        return f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        return f"--device {args.device!r} is not a device name (cpu, cuda, cuda:1 ...)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {args.device}: CUDA is not available here (torch {torch.__version__} finds no GPU); use --device cpu"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"--device {args.device}: there are {torch.cuda.device_count()} CUDA devices"
    elif device.type != "cpu":
        return f"--device {args.device}: the demo runs on cpu or cuda"
    if args.drive_tbw is not None and not valid_rating(args.drive_tbw):
        return f"--drive-tbw must be a finite number above 0 (terabytes), not {args.drive_tbw}"
    if not args.lr >= 0 or args.lr == float("inf"):  # (torch's AdamW refuses a negative one; nan fails this too)
        return f"--lr must be a finite number >= 0, not {args.lr}"
    if args.clip is not None and not args.clip >= 0:
        return f"--clip is a gradient norm: a number >= 0 (0: off), not {args.clip}"
    if args.step_in_backward and args.clip:
        return "--clip needs the whole gradient before any update: it cannot be used with --step-in-backward"
    for name in ("device_capacity", "host_capacity", "disk_capacity", "drive_capacity"):
        if getattr(args, name) is None:
            continue  # (--host-capacity: sized from the state below)
        try:
            size = parse_bytes(getattr(args, name))
        except ValueError as exc:
            return f"--{name.replace('_', '-')}: {exc}"
        if name == "drive_capacity" and size <= 0:
            return f"--drive-capacity must be above 0, not {getattr(args, name)}"
    if args.master_weights == "lossless" and args.dtype != "bf16":
        return "--master-weights lossless keeps the master's high half in bf16 weights: it needs --dtype bf16"
    problem = _unmakeable(Path(args.root))
    if problem:
        return f"--root {args.root}: the disk tier's folder cannot be made there ({problem})"
    for name in ("timeline", "plot", "json"):  # (checked now, not after the whole run)
        problem = _unwritable(getattr(args, name))
        if problem:
            return f"--{name} {getattr(args, name)}: {problem}"
    if args.plot is not None:
        try:
            check_image_format(args.plot)
        except (ValueError, ImportError) as exc:
            return str(exc)
    return None


def _unmakeable(folder: Path, file: str | None = None) -> str | None:
    """Why ``folder`` (and ``file`` in it) cannot be made, or None. It tries, and removes what it
    made: a run refused later leaves nothing behind."""
    missing = []
    here = folder
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    made = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if file is not None and not (folder / file).exists() and not (folder / file).is_symlink():
            with open(folder / file, "ab"):
                made = folder / file
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        if made is not None:
            made.unlink()
        for empty in missing:  # (deepest first)
            if empty.is_dir():
                empty.rmdir()
    return None


def _unwritable(path: Path | None) -> str | None:
    """Why a file cannot be written at ``path``, or None (see ``_unmakeable``)."""
    if path is None:
        return None
    if path.is_dir():
        return "is a folder; give a file name"
    problem = _unmakeable(path.parent, path.name)
    return f"cannot be written ({problem})" if problem else None


def state_bytes(args: argparse.Namespace, param: torch.Tensor) -> int:
    """Bytes of Adam state the optimizer keeps for ``param`` (no master copy where the parameter
    is its own: the plain CPU, weights not offloaded)."""
    return planned_state_bytes(param, args.state_precision, args.master_weights, weights_offloaded=args.offload_params)


def check_disk(args: argparse.Namespace, model: torch.nn.Module) -> str | None:
    """Whether the disk tier can hold what the demo pages to it, or what is missing."""
    sizes = [round_up(state_bytes(args, p), ALIGNMENT) for p in model.parameters()]
    if args.offload_params:
        sizes += [round_up(p.numel() * p.element_size(), ALIGNMENT) for p in model.parameters()]
    # Writes are copy-on-write and free space fragments as values are rewritten: ask for twice
    # the values (what the optimizer's own default store reserves, too).
    needed = round_up(2 * sum(sizes), 1 << 20)
    if parse_bytes(args.disk_capacity) < needed:
        return (f"--disk-capacity {args.disk_capacity} is too small for what this model pages to disk "
                f"({format_bytes(sum(sizes))}; each write is copy-on-write, so it needs room for twice that); give at least {format_bytes(needed)}")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem is None:
        if args.clip is None:
            args.clip = 0.0 if args.step_in_backward else 1.0
        config = GPTConfig(vocab=args.vocab, seq=args.seq, dim=args.dim, layers=args.layers, heads=args.heads)
        torch.manual_seed(args.seed)
        model = GPT(config).to(args.device, DTYPES[args.dtype])
        problem = check_disk(args, model)
    if problem is not None:
        print(f"tierstore demo: error: {problem}", file=sys.stderr)
        return 2
    reference = copy.deepcopy(model) if args.compare else None
    params = sum(p.numel() for p in model.parameters())
    state = sum(state_bytes(args, p) for p in model.parameters())
    own = all(keeps_no_master(p, args.master_weights, weights_offloaded=args.offload_params) for p in model.parameters())
    master = "no master copy (the fp32 weights are the master)" if own else f"{args.master_weights} master"
    if args.host_capacity is None:
        args.host_capacity = max(1 << 20, round_up(state // 2, 1 << 16))
    print(
        f"GPT: {params:,} {args.dtype} parameters ({config.layers} layers, dim {config.dim}); Adam state {format_bytes(state)} "
        f"({state / params:.2f} B/param: {master}, {args.state_precision} moments)\n"
        f"tiers: device {args.device} {format_bytes(parse_bytes(args.device_capacity))} | host {format_bytes(parse_bytes(args.host_capacity))} | "
        f"disk {args.root} {format_bytes(parse_bytes(args.disk_capacity))}"
    )
    store = make_store(args)
    swaps: tuple[Any, Any] = (None, None)
    if args.offload_params or args.offload_activations:
        from .swap import offload_activations, offload_parameters

        swaps = (
            offload_parameters(model, store, tier="host") if args.offload_params else None,
            offload_activations(store, min_bytes="64KiB") if args.offload_activations else None,
        )
    optimizer = TieredAdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, fused=True, store=store,
        max_grad_norm=args.clip or None, step_in_backward=args.step_in_backward,
        state_precision=args.state_precision, master_weights=args.master_weights,
    )
    try:
        print(f"updates {'during backward' if args.step_in_backward else 'after backward, pipelined'}, "
              f"{optimizer.inflight} at a time; clipping {'off' if not args.clip else f'at norm {args.clip}'}"
              + ("\n(the first step builds the 8-bit codec's kernels: it takes seconds longer, once)" if args.state_precision == "8bit" else "")
              + "\n")
        losses, times = train(model, optimizer, args, "tiered", clip_with_torch=False, swaps=swaps)
        drive = {"capacity": args.drive_capacity, "rated_tbw": args.drive_tbw}
        memory, timing = optimizer.memory_report().for_drive(**drive), optimizer.time_report().for_drive(**drive)
        swapped = [str(s.report) for s in swaps if s is not None]
        swap_reports = {s.report.kind: s.report.as_dict() for s in swaps if s is not None}
        stats = optimizer.store.stats()
        if args.timeline:
            optimizer.write_timeline(args.timeline)
    finally:
        optimizer.close()
        if swaps[0] is not None:
            swaps[0].detach()
        run(store.aclose(flush=False))  # the state is scratch: nothing to write back
    print()
    print(memory)
    print()
    print("last step:", timing)
    if any(s is not None for s in swaps):
        print("  (disk figures are the whole store's: they include the swapped weights and activations)")
    for line in swapped:
        print(line)
    middle = sorted(times[len(times) // 10 :] or times)
    print(f"\nstep time: median {middle[len(middle) // 2] * 1e3:.1f} ms; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    moved = ", ".join(f"{name} {format_bytes(link['nbytes'])}" for name, link in stats["links"].items())
    print(f"moved: {moved}")
    # The whole run's disk writes over its training time: steady paging, not one step's sample.
    written = sum(link["nbytes"] for name, link in stats["links"].items() if name.endswith("->disk"))
    wear = drive_wear(written, sum(times), capacity=args.drive_capacity, rated_tbw=args.drive_tbw)
    print(f"over the run, {format_bytes(written / len(times))} written to disk a step; {wear}")
    result: dict[str, Any] = {"losses": losses, "step_seconds": times, "memory": memory.as_dict(), "last_step": timing.as_dict(),
                              "wear": wear.as_dict(), **({"swap": swap_reports} if swap_reports else {})}
    if reference is not None:
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.1, fused=True)
        ref_losses, ref_times = train(reference, ref_optimizer, args, "torch AdamW", clip_with_torch=True)
        gap = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        ref_middle = sorted(ref_times[len(ref_times) // 10 :] or ref_times)
        exact = args.dtype == "fp32" and args.state_precision == "fp32"
        tail = max(1, len(losses) // 10)  # the last tenth's mean, as a final loss less noisy than the last step's
        final, ref_final = sum(losses[-tail:]) / tail, sum(ref_losses[-tail:]) / tail
        last = "the last step" if tail == 1 else f"mean of the last {tail} steps"
        print(f"\ncompare with torch.optim.AdamW in memory ({args.dtype} parameters): largest loss difference {gap:.2e} over "
              f"{args.steps} steps, final loss ({last}) {final:.4f} against {ref_final:.4f} ({final - ref_final:+.4f}); "
              f"its median step {ref_middle[len(ref_middle) // 2] * 1e3:.1f} ms")
        result["reference_losses"] = ref_losses
        result["reference_step_seconds"] = ref_times
        result["final_loss_gap"] = final - ref_final
        if exact:  # the same math on the same numbers: the curves must agree
            agree = gap <= 1e-4 * max(1.0, max(abs(v) for v in ref_losses))
            print("the curves agree" if agree else "THE CURVES DIFFER")
            if not agree:
                return 1
        else:
            why = [f"{args.state_precision} moments"] if args.state_precision != "fp32" else []
            if args.dtype == "bf16":
                why.append(f"a {'lossless' if args.master_weights == 'lossless' else 'fp32'} master and "
                           f"{'truncated' if args.master_weights == 'lossless' else 'rounded'} bf16 weights here, "
                           "torch's AdamW updating the bf16 weights themselves")
            print(f"the curves are not expected to agree exactly ({'; '.join(why)}): the gap above is the measured difference")
    if args.timeline:
        print(f"timeline of the last step: {args.timeline} (open in https://ui.perfetto.dev)")
    if args.plot:
        master = "the fp32 weights are the master" if args.dtype == "fp32" else f"{args.master_weights} master"
        _plot(args.plot, losses, result.get("reference_losses"), f"{args.dtype}, {args.state_precision} moments, {master}")
        print(f"loss plot: {args.plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"losses and reports: {args.json}")
    return 0


def _plot(path: Path, losses: list[float], reference: list[float] | None, setting: str) -> None:
    from .plotting import pyplot

    plt = pyplot()

    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(7, 4))
    steps = range(1, len(losses) + 1)  # (as the text counts them)
    axes.plot(steps, losses, label="TieredAdamW (state paged to disk)", linewidth=2)
    if reference is not None:
        axes.plot(range(1, len(reference) + 1), reference, "--", label="torch.optim.AdamW (in memory)", linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.set_title(setting, fontsize=10)
    axes.legend(loc="best", framealpha=0.9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
