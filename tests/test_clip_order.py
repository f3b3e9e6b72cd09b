"""The global norm summed in the model's order: param groups that reorder the parameters (a
trainer's weight-decay groups: weights first, then biases) gave a total a last bit off
``clip_grad_norm_(model.parameters())`` on about half the steps, and once clipping bit, the
weights drifted from torch's."""

from __future__ import annotations

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(6)])


def _groups(model: torch.nn.Module) -> list[dict[str, object]]:
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]


def test_clip_grad_norm_given_the_model_order_is_torchs_to_the_bit(device_mode: str) -> None:
    reference, model = _model(), _model()
    exact = torch.optim.AdamW(_groups(reference), lr=1e-2, fused=True)
    opt = TieredAdamW(_groups(model), lr=1e-2, offload="host")
    try:
        generator = torch.Generator().manual_seed(1)
        for _ in range(12):
            inputs = torch.randn(4, 48, generator=generator)
            reference(inputs).pow(2).sum().backward()
            model(inputs).pow(2).sum().backward()
            theirs = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            ours = opt.clip_grad_norm_(0.05, parameters=model.parameters())
            assert torch.equal(theirs, ours)
            exact.step()
            opt.step()
            exact.zero_grad()
            opt.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(reference.parameters(), model.parameters(), strict=True))
    finally:
        opt.close()


def test_the_trainer_clips_in_the_models_order() -> None:
    transformers = pytest.importorskip("transformers")
    from tierstore.integrations.hf import TieredTrainer

    model = _model()
    opt = TieredAdamW(_groups(model), lr=1e-2, offload="host")
    try:
        trainer = TieredTrainer.__new__(TieredTrainer)  # (only what _clip_grad_norm reads)
        trainer.optimizer, trainer.accelerator = opt, None
        trainer.args = transformers.TrainingArguments("unused", max_grad_norm=0.05, report_to=[])
        reference = _model()
        generator = torch.Generator().manual_seed(1)
        for _ in range(6):
            inputs = torch.randn(4, 48, generator=generator)
            model(inputs).pow(2).sum().backward()
            reference(inputs).pow(2).sum().backward()
            assert torch.equal(trainer._clip_grad_norm(model), torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
            opt.zero_grad()
            reference.zero_grad()
    finally:
        opt.close()


def test_clip_grad_norm_takes_one_tensor_as_torchs_does(device_mode: str) -> None:
    """A tensor was iterated by rows: a norm of 0.0, and nothing clipped."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    twin = torch.nn.Parameter(weight.detach().clone())
    opt = TieredAdamW([weight], lr=1e-2, offload="host")
    try:
        weight.grad = torch.full((8, 8), 100.0)
        twin.grad = weight.grad.clone()
        assert torch.equal(opt.clip_grad_norm_(1.0, parameters=weight), torch.nn.utils.clip_grad_norm_(twin, 1.0))
    finally:
        opt.close()
