"""``TieredAdamW`` returned by a LightningModule's ``configure_optimizers``, with the real package:
automatic optimisation (Lightning calls ``step(closure)``), ``accumulate_grad_batches=2``,
``gradient_clip_val`` and a scheduler, bit for bit against torch's fused AdamW; a checkpoint
saved with ``Trainer.save_checkpoint`` and resumed reaches the uninterrupted run's weights."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from tierstore.optim import TieredAdamW  # noqa: E402

pytestmark = [
    pytest.mark.device_modes,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice on workers, loggers, tips
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

EPOCHS = 2


class Regression(pl.LightningModule):
    def __init__(self, tiered: bool, **options: Any) -> None:
        super().__init__()
        self.options = {"fused": True, **options}
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
        self.tiered = tiered
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        if self.tiered:
            opt: torch.optim.Optimizer = TieredAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, min_offload_numel=64, **self.options)
        else:
            fused = self.options["fused"]
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}


def loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def fit(
    tiered: bool, *, epochs: int = EPOCHS, resume: Path | None = None, save: Path | None = None, precision: str = "32-true",
    **options: Any,
) -> Regression:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = Regression(tiered, **options)
    trainer = pl.Trainer(
        max_epochs=epochs, accumulate_grad_batches=2, gradient_clip_val=0.5, accelerator="cpu", devices=1, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(), ckpt_path=str(resume) if resume is not None else None, weights_only=True)
    if save is not None:
        trainer.save_checkpoint(save)
    if tiered:
        trainer.optimizers[0].close()
    return module


@pytest.fixture(scope="module")
def reference() -> Regression:
    return fit(tiered=False)


def assert_same_weights(module: Regression, reference: Regression) -> None:
    for (name, x), y in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_fit_matches_torch_adamw(device_mode: str, reference: Regression) -> None:
    module = fit(tiered=True)
    assert len(module.losses) == EPOCHS * 8
    assert module.losses == reference.losses
    assert_same_weights(module, reference)


def test_checkpoint_and_resume(device_mode: str, reference: Regression, tmp_path: Path) -> None:
    checkpoint = tmp_path / "epoch1.ckpt"
    first = fit(tiered=True, epochs=1, save=checkpoint)
    assert first.losses == reference.losses[:8]
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]
    assert all(float(entry["step"]) == 4 for entry in saved["state"].values())  # 8 batches, 2 per step
    resumed = fit(tiered=True, resume=checkpoint)
    assert resumed.losses == reference.losses[8:]
    assert_same_weights(resumed, reference)


def test_bf16_mixed_precision_with_clipping(device_mode: str) -> None:
    """Lightning refuses clipping with an optimizer that unscales in ``step()`` (torch's fused
    AdamW too), under bf16 as well, where no scaler exists: ``unscale_in_step=False`` is the way
    (``fused=False`` was no way out: the refusal held whatever it was)."""
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(tiered=True, epochs=1, precision="bf16-mixed", fused=False)
    ours = fit(tiered=True, precision="bf16-mixed", fused=False, unscale_in_step=False)
    theirs = fit(tiered=False, precision="bf16-mixed", fused=False)
    assert ours.losses == theirs.losses and len(ours.losses) == EPOCHS * 8
    assert_same_weights(ours, theirs)


def test_unscale_in_step_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="unscale_in_step"):
        TieredAdamW(torch.nn.Linear(2, 2).parameters(), unscale_in_step="no")  # type: ignore[arg-type]
