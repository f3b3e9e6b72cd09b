"""Parameter offload under second-order backward (gradient penalties): what a create_graph
backward computes with is its own copy, not the store's buffer (which another model's weights
may take over before the second backward), and a penalty backpropagated on its own accumulates
into the weights, not their placeholders."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes


def _twin(module: nn.Module) -> nn.Module:
    """The same module with the hooks offload adds (backward hooks change torch's grad paths)."""
    twin = copy.deepcopy(module)
    for sub in twin.modules():
        if any(True for _ in sub.parameters(recurse=False)):
            sub.register_full_backward_pre_hook(lambda *_: None)
            sub.register_full_backward_hook(lambda *_: None)
    return twin


def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def test_a_penalty_gradient_is_exact_after_the_buffers_were_reused(device_mode: str) -> None:
    critic = _critic()
    twin = _twin(critic)
    store = SyncTierStore([DeviceTier("cpu", "40KiB"), HostTier("16MiB")]).open()
    try:
        offload_parameters(critic, store)
        other = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
        offload_parameters(other, store)

        def penalty_grad(model: nn.Module, churn: bool) -> torch.Tensor:
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
            if churn:  # another model's weights pass through the device tier meanwhile
                with torch.no_grad():
                    other(torch.randn(2, 64))
            return torch.autograd.grad(g.square().sum(), x)[0]

        assert torch.equal(penalty_grad(critic, True), penalty_grad(twin, False))
    finally:
        store.close()


def test_a_penalty_backpropagated_alone_accumulates_into_the_weights(device_mode: str) -> None:
    critic = _critic()
    twin = _twin(critic)
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()
    try:
        offload_parameters(critic, store)
        for model in (critic, twin):  # StyleGAN2's lazy R1: the penalty's own backward
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
            (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
            g.square().sum().backward()
        pairs = list(zip(critic.parameters(), twin.parameters(), strict=True))
        assert sum(reference.grad is not None for _, reference in pairs) >= 4  # (the last bias gets none)
        for offloaded, reference in pairs:
            assert (offloaded.grad is None) == (reference.grad is None)
            assert reference.grad is None or torch.equal(offloaded.grad, reference.grad)
    finally:
        store.close()


def test_a_gradient_with_respect_to_the_input_alone_fits_a_device_tier_smaller_than_the_model(device_mode: str) -> None:
    """FGSM or saliency: no weight gradient is accumulated, so nothing let go of the trainable
    weights until the backward ended, and a model larger than the device tier ran out of it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)], nn.Linear(64, 10))
    twin = copy.deepcopy(model)
    weights = sum(p.nbytes for p in model.parameters())
    store = SyncTierStore([DeviceTier("cpu", weights // 2), HostTier("16MiB")]).open()
    try:
        offload_parameters(model, store)
        generator = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        grads = []
        for net in (model, twin):
            x_ = x.clone().requires_grad_(True)
            grads.append(torch.autograd.grad(nn.functional.cross_entropy(net(x_), y), x_)[0])
        assert torch.equal(*grads)
        assert all(p.grad is None for p in model.parameters())
    finally:
        store.close()
