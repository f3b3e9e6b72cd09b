"""``TieredAdamW`` inside transformers' ``Trainer`` (and so accelerate), with the real packages:
a small GPT-2 built from a config, gradient accumulation 2 and ``max_grad_norm``, bit for bit
against ``optim="adamw_torch_fused"``; the Trainer's scheduler; checkpoints saved and resumed.
Both device modes (the emulated device copies every gradient over a link when its hook fires,
and takes it again at ``step()`` when the Trainer's clipping changed it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tierstore.integrations.hf import TieredTrainerMixin  # noqa: E402
from tierstore.optim import TieredAdamW  # noqa: E402

pytestmark = pytest.mark.device_modes

STEPS = 4
LR = 1e-3
DECAY = 0.1


def make_model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=1,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class RecordingTrainer(transformers.Trainer):
    """Keeps every micro-batch's loss (the logged ones are rounded averages)."""

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


class RecordingTieredTrainer(TieredTrainerMixin, RecordingTrainer):
    """``tierstore.integrations.hf.TieredTrainer``, recording."""


@dataclass
class Run:
    trainer: Any
    model: Any
    losses: list[float]
    lr: list[float]

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def train(
    output: Path, *, optimizers: tuple[Any, Any] | None = None, resume: str | None = None, model: Any = None,
    trainer_class: type[RecordingTrainer] = RecordingTrainer, **args: Any,
) -> Run:
    model = model if model is not None else make_model()
    options: dict[str, Any] = {
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": STEPS, "max_grad_norm": 1.0,
        "learning_rate": LR, "weight_decay": DECAY, "seed": 0, "report_to": [], "save_strategy": "no", "use_cpu": True,
        "dataloader_num_workers": 0, "disable_tqdm": True, "logging_steps": 1, "optim": "adamw_torch_fused",
    }
    options.update(args)
    extra = {"optimizers": optimizers} if optimizers is not None else {}
    if "optimizer_cls_and_kwargs" in options:
        extra["optimizer_cls_and_kwargs"] = options.pop("optimizer_cls_and_kwargs")
    trainer = trainer_class(model=model, args=transformers.TrainingArguments(output_dir=str(output), **options), train_dataset=Tokens(), **extra)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return Run(trainer, model, [float(x) for x in trainer.losses], trainer.lr_scheduler.get_last_lr())


def grouped(model: Any) -> list[dict[str, Any]]:
    """The Trainer's own parameter groups (no decay for biases and LayerNorm weights)."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": DECAY},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def tiered(model: Any, **options: Any) -> TieredAdamW:
    return TieredAdamW(grouped(model), lr=LR, weight_decay=DECAY, fused=True, min_offload_numel=64, **options)


def assert_same(run: Run, reference: Run) -> None:
    assert run.losses == reference.losses
    assert run.lr == reference.lr
    got, expected = run.weights(), reference.weights()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def grad_norms(run: Run) -> list[float]:
    norms = [entry["grad_norm"] for entry in run.trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == STEPS
    return norms


def close(run: Run) -> None:
    optimizer = run.trainer.optimizer
    getattr(optimizer, "optimizer", optimizer).close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``optim="adamw_torch_fused"``: torch's fused AdamW, made and driven by the Trainer."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    run = train(tmp_path_factory.mktemp("reference"))
    assert len(run.losses) == 2 * STEPS
    return run


def test_optimizers_argument_matches_adamw_torch_fused(device_mode: str, reference: Run, tmp_path: Path) -> None:
    model = make_model()
    run = train(tmp_path, model=model, optimizers=(tiered(model), None))
    assert_same(run, reference)
    if device_mode == "emulated":  # the Trainer's clip_grad_norm_ changed every p.grad after backward
        assert run.trainer.optimizer.optimizer.time_report().grad_retakes > 0
    assert run.lr != [LR]  # the Trainer's linear schedule drove our param groups
    close(run)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "norm only"])
def test_tiered_trainer_copies_each_gradient_once(device_mode: str, reference: Run, tmp_path: Path, max_grad_norm: float) -> None:
    """``TieredTrainer`` clips (and, with ``max_grad_norm=0``, only measures the norm, as the
    Trainer does every step) on the host copies: the same numbers, and no gradient taken to the
    host a second time at ``step()``."""
    model = make_model()
    run = train(tmp_path, model=model, optimizers=(tiered(model), None), trainer_class=RecordingTieredTrainer, max_grad_norm=max_grad_norm)
    if not max_grad_norm:
        reference = train(tmp_path / "reference", max_grad_norm=0.0)
    assert_same(run, reference)
    # what the Trainer logs (summed in another order than torch's foreach norm: fp32 rounding)
    assert grad_norms(run) == pytest.approx(grad_norms(reference), rel=1e-6)
    assert run.trainer.optimizer.optimizer.time_report().grad_retakes == 0
    close(run)


def test_optimizer_cls_and_kwargs_with_state_on_disk(device_mode: str, reference: Run, tmp_path: Path) -> None:
    kwargs = {"lr": LR, "fused": True, "min_offload_numel": 64, "offload": "disk", "disk_root": tmp_path / "state", "host_capacity": "160KiB"}
    run = train(tmp_path / "out", optimizer_cls_and_kwargs=(TieredAdamW, kwargs))
    assert_same(run, reference)
    opt = run.trainer.optimizer.optimizer
    assert isinstance(opt, TieredAdamW)
    assert opt.memory_report().state_by_tier.get("disk", 0) > 0
    close(run)


def test_checkpoint_and_resume(device_mode: str, reference: Run, tmp_path: Path) -> None:
    """Save at step 2 (``torch.save(optimizer.state_dict())`` inside the Trainer), resume in a new
    Trainer with a new optimizer: the same final weights as the uninterrupted run (which are
    torch's)."""
    model = make_model()
    whole = train(tmp_path, model=model, optimizers=(tiered(model), None), save_strategy="steps", save_steps=2)
    assert_same(whole, reference)
    checkpoint = tmp_path / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert set(saved["state"]) == set(range(len(list(model.parameters()))))
    close(whole)

    model = make_model()
    resumed = train(tmp_path, model=model, optimizers=(tiered(model), None), resume=str(checkpoint), save_strategy="no")
    assert resumed.losses == reference.losses[2 * 2:]
    assert resumed.lr == reference.lr
    expected = reference.weights()
    for name, value in resumed.weights().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    close(resumed)


def test_state_is_visible_to_tools(device_mode: str, reference: Run, tmp_path: Path) -> None:
    """``opt.state`` (through the Trainer's accelerate wrapper) holds torch's numbers."""
    model = make_model()
    run = train(tmp_path, model=model, optimizers=(tiered(model), None))
    close_later = run.trainer.optimizer.optimizer
    try:
        torch_state = reference.trainer.optimizer.optimizer.state
        ours = run.trainer.optimizer.state
        assert len(ours) == len(torch_state)
        for p, q in zip(model.parameters(), reference.model.parameters(), strict=True):
            torch.testing.assert_close(ours[p]["exp_avg"], torch_state[q]["exp_avg"], rtol=0, atol=0)
    finally:
        close_later.close()


class FP16ScaledTrainer(transformers.Trainer):
    """The Trainer as fp16 runs it on a GPU: accelerate's ``GradScaler`` scales the loss, and
    ``clip_grad_norm_`` unscales ``p.grad`` first. accelerate builds a scaler only on a GPU, so
    a CPU one is given to it here (the accelerator is prepared in ``train()``)."""

    def train(self, *args: Any, **kwargs: Any) -> Any:
        accelerator = self.accelerator
        accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu", init_scale=1024.0)
        before, accelerator.state._mixed_precision = accelerator.state._mixed_precision, "fp16"
        try:
            return super().train(*args, **kwargs)
        finally:
            accelerator.state._mixed_precision = before  # a process-wide singleton


class FP16ScaledRecordingTrainer(FP16ScaledTrainer, RecordingTrainer):
    pass


class FP16ScaledTieredTrainer(TieredTrainerMixin, FP16ScaledRecordingTrainer):
    pass


def test_tiered_trainer_under_fp16_loss_scaling(device_mode: str, tmp_path: Path) -> None:
    """Under a ``GradScaler`` the norm and the clipping are of the unscaled gradients: the
    logged norms and the weights are those of torch's fused AdamW in the plain Trainer (the
    mixin once clipped by the norm of the scaled gradients, 1024 times too large)."""
    reference = train(tmp_path / "reference", trainer_class=FP16ScaledRecordingTrainer)
    model = make_model()
    run = train(tmp_path / "tiered", model=model, optimizers=(tiered(model), None), trainer_class=FP16ScaledTieredTrainer)
    assert_same(run, reference)
    assert grad_norms(run) == grad_norms(reference)
    assert max(grad_norms(run)) < 10  # unscaled, and clipped (max_grad_norm=1.0) by that norm
    close(run)
