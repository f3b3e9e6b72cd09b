"""Steps per second of transformers' ``Trainer`` driving ``TieredAdamW`` (state in host memory;
state on disk) against the same Trainer with ``optim="adamw_torch_fused"``: the same small GPT-2
(built from a config), the same data, in the same run.

Each round trains every variant (each variant first in turn) for ``--steps`` optimizer steps (gradient accumulation 2,
``max_grad_norm=1.0``, the Trainer's linear schedule), in turn; a callback times each optimizer
step from ``on_step_begin`` to ``on_step_end`` (forward, backward, clipping and the update of
that step), the first two of every run left out as warm-up. The table gives medians over all
rounds and their ratio to ``adamw_torch_fused``. Needs ``pip install tierstore[hf]``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .common import environment, median, progress, table, write_json

WARMUP = 2


def _model(args: argparse.Namespace) -> Any:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
        bos_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int, seq: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (count, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _timer() -> Any:
    import transformers

    class StepTimer(transformers.TrainerCallback):
        """Seconds of each optimizer step, as the Trainer's loop sees them."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._started = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self._started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.seconds.append(time.perf_counter() - self._started)

    return StepTimer()


def _run(args: argparse.Namespace, template: Any, variant: str, data: Any, scratch: Path) -> list[float]:
    """One Trainer run of ``variant``; the per-step seconds after warm-up."""
    import transformers

    from ..optim import TieredAdamW

    model = copy.deepcopy(template)
    options: dict[str, Any] = {}
    if variant != "adamw_torch_fused":
        kwargs: dict[str, Any] = {"lr": 1e-3, "fused": True}
        if variant == "TieredAdamW, state on disk":
            shutil.rmtree(scratch, ignore_errors=True)
            kwargs.update(offload="disk", disk_root=scratch)
        options["optimizer_cls_and_kwargs"] = (TieredAdamW, kwargs)
    training = transformers.TrainingArguments(
        output_dir=str(scratch.parent / "trainer-out"), per_device_train_batch_size=args.batch, gradient_accumulation_steps=2,
        max_steps=args.steps + WARMUP, max_grad_norm=1.0, learning_rate=1e-3, optim="adamw_torch_fused", seed=0,
        report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        disable_tqdm=True, logging_strategy="no",
    )
    timer = _timer()
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=[timer], **options)
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if isinstance(optimizer, TieredAdamW):
        optimizer.close()
    return timer.seconds[WARMUP:]


VARIANTS = ("adamw_torch_fused", "TieredAdamW, state in host", "TieredAdamW, state on disk")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps and rounds")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_trainer.json"))
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/bench"), help="scratch folder for the disk tier")
    args = parser.parse_args(argv)
    try:
        import transformers
    except ImportError:
        parser.error("needs transformers and accelerate: pip install 'tierstore[hf]'")
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    args.vocab, args.seq, args.heads = 2048, 128, 4
    args.dim, args.layers, args.batch = (128, 2, 4) if args.quick else (256, 4, 8)
    args.steps = 6 if args.quick else 15
    rounds = 3 if args.quick else 6
    template = _model(args)
    params = sum(p.numel() for p in template.parameters())
    data = _Tokens(2 * args.batch * (args.steps + WARMUP), args.seq, args.vocab)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    bar = progress(total=rounds * len(VARIANTS), desc="bench_trainer", unit="run")
    for round_ in range(rounds):
        for name in VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]:  # each variant first in turn (drift, warm caches)
            seconds[name] += _run(args, template, name, data, args.dir / "trainer-state")
            bar.update(1)
            if bar.disable:
                print(f"  round {round_ + 1}/{rounds}: {name} done", flush=True)
    bar.close()
    reference = median(seconds["adamw_torch_fused"])
    rows = [
        {"what": name, "steps_s": 1.0 / median(s), "step_ms": median(s) * 1e3, "ratio": median(s) / reference, "steps": len(s)}
        for name, s in seconds.items()
    ]
    print(f"Trainer-driven steps, GPT-2 {params / 1e6:.1f} M parameters ({12 * params / 2**20:.0f} MiB of Adam state), "
          f"batch {args.batch} x {args.seq} tokens, accumulation 2, max_grad_norm 1.0, on {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(table(rows, [("what", "optimizer", "s"), ("steps_s", "steps/s", ".2f"), ("step_ms", "step ms (median)", ".1f"),
                       ("ratio", "vs adamw_torch_fused", ".2f"), ("steps", "steps timed", "d")]))
    write_json(args.json, {"benchmark": "bench_trainer", "environment": environment(args.dir), "parameters": params,
                           "config": {k: getattr(args, k) for k in ("vocab", "seq", "dim", "layers", "heads", "batch", "steps")},
                           "rounds": rounds, "rows": rows, "seconds": seconds})
    print(f"\nJSON: {args.json}")
    return 0
