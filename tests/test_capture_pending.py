"""Gradients whose hooks do not wake the loop wait for it one per parameter: backward passes
with no ``opt.step()`` or ``opt.zero_grad()`` between them (``model.zero_grad()``, saliency
probes) kept every pass's gradient alive in the waiting list."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def test_passes_without_a_step_keep_one_gradient_per_parameter_waiting(device_mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    twin.load_state_dict(model.state_dict())
    opt = TieredAdamW(model.parameters(), lr=1e-2, offload="host")
    exact = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    try:
        grads: list[weakref.ref[torch.Tensor]] = []
        for seed in range(30):
            model.zero_grad(set_to_none=True)  # (the model's, not the optimizer's: no new step)
            model(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
            grads += [weakref.ref(p.grad) for p in model.parameters()]
        # Copies still crossing the link hold their source until they end (on a loaded machine,
        # a pass or two behind): wait for them, not for ever (before: every pass's, 120, for good).
        deadline = time.monotonic() + 20
        while True:
            gc.collect()
            alive = sum(ref() is not None for ref in grads)
            if alive <= 2 * len(list(model.parameters())) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert alive <= 2 * len(list(model.parameters()))
        twin(torch.randn(8, 16, generator=torch.Generator().manual_seed(29))).square().mean().backward()
        opt.step()  # the last pass's gradients, as torch's
        exact.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    finally:
        opt.close()
