"""Train a small GPT-2 with transformers' ``Trainer`` and ``TieredAdamW``, its Adam state on disk.

The model is built from a ``GPT2Config`` (nothing is downloaded) and learns a synthetic language
(each token follows from the one before). The optimizer goes in through ``optimizers=``; the
Trainer's gradient accumulation, ``max_grad_norm``, linear schedule and checkpoints work as
with ``optim="adamw_torch_fused"``. At the end it prints where the optimizer's bytes are and
where the last step's time went.

Run:  pip install -e '.[hf]' && python examples/hf_trainer.py [--steps 40] [--dir .tierstore/hf_example]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from tierstore.optim import TieredAdamW


class Successors(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sequences where token t+1 = (3 * token t + 1) mod vocab: learnable in a few dozen steps."""

    def __init__(self, count: int, seq: int, vocab: int) -> None:
        start = torch.randint(0, vocab, (count, 1), generator=torch.Generator().manual_seed(0))
        tokens = [start]
        for _ in range(seq - 1):
            tokens.append((3 * tokens[-1] + 1) % vocab)
        self.tokens = torch.cat(tokens, dim=1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dir", type=Path, default=Path(".tierstore/hf_example"), help="checkpoints and the disk tier")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()

    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)

    # Adam's fp32 master weights and moments (12 bytes/param) live in a host tier of 1 MiB over a
    # disk tier; the Trainer's weight-decay groups (no decay for biases and LayerNorm weights).
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = TieredAdamW(groups, lr=3e-3, offload="disk", disk_root=args.dir / "optim-state", host_capacity="1MiB")

    training = transformers.TrainingArguments(
        output_dir=str(args.dir / "checkpoints"), max_steps=args.steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=3e-3, warmup_steps=4,
        logging_steps=10, save_steps=args.steps // 2, save_total_limit=1, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), seed=0,
    )
    trainer = transformers.Trainer(model=model, args=training, train_dataset=Successors(512, 64, 512), optimizers=(optimizer, None))
    try:
        result = trainer.train()
        print(f"\nfinal training loss {result.training_loss:.3f} after {result.global_step} steps")
        print(optimizer.memory_report())
        print(optimizer.time_report())
    finally:
        optimizer.close()


if __name__ == "__main__":
    main()
