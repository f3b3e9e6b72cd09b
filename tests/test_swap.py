"""Swapping activations and parameters: exact gradients, device capacity, optimizer agreement."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore
from tierstore.models import GPT, GPTConfig, synthetic_batches
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_activations, offload_parameters
from tierstore.testing import watch_capacity

pytestmark = pytest.mark.device_modes

CONFIG = GPTConfig(vocab=64, seq=32, dim=64, layers=3, heads=2)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(32 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Checkpointed(nn.Module):
    """The GPT with each block under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CONFIG)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1])
        x = self.gpt.tokens(inputs) + self.gpt.positions(positions)
        for block in self.gpt.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.gpt.head(self.gpt.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), targets.reshape(-1))


def store(tmp_path: Path, device: int | str = "8MiB", host: str = "64MiB") -> SyncTierStore:
    return SyncTierStore([DeviceTier("cpu", device), HostTier(host), DiskTier(tmp_path / "d", "256MiB", durable=False)]).open()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["transformer", "cnn", "checkpointed"])
def test_gradients_are_bitwise_identical_with_activation_offload(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    model: nn.Module = {"transformer": lambda: GPT(CONFIG), "cnn": SmallCNN, "checkpointed": Checkpointed}[kind]()
    twin = copy.deepcopy(model)
    sync = store(tmp_path)
    offload = offload_activations(sync, min_bytes=4096)
    for step in range(3):  # the first step prefetches in reverse save order, later ones learned
        if kind == "cnn":
            x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(step))
            loss_of = lambda m, x=x: m(x).square().mean()  # noqa: E731
        else:
            tokens = next(synthetic_batches(CONFIG, 4, seed=step))
            loss_of = lambda m, t=tokens: m.loss(t)  # noqa: E731
        with offload:
            loss = loss_of(model)
        loss.backward()
        loss_of(twin).backward()
        for ours, theirs in zip(grads(model), grads(twin), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        model.zero_grad()
        twin.zero_grad()
    report = offload.report
    assert report.offloaded > 0 and report.bytes_in + report.bytes_early == report.bytes_out
    assert len(sync) == 0  # every saved tensor came back and left the store
    sync.close()


def test_training_past_the_device_capacity_stays_within_it_and_matches(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    twin = copy.deepcopy(model)
    weights = sum(p.nbytes for p in model.parameters())
    sync = store(tmp_path, device=weights // 3, host="2MiB")
    breaches = watch_capacity(sync.store)
    params = offload_parameters(model, sync, tier="host")
    activations = offload_activations(sync, min_bytes=8192)
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=sync, min_offload_numel=64, fused=True)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    batches = synthetic_batches(CONFIG, 8)
    saved_bytes = 0
    for step in range(20):
        tokens = next(batches)
        opt.zero_grad()
        reference.zero_grad()
        with activations:
            loss = model.loss(tokens)
        if step == 0:
            saved_bytes = activations.report.bytes_out
        loss.backward()
        opt.step()
        params.mark_step()
        expected = twin.loss(tokens)
        expected.backward()
        reference.step()
        assert loss.item() == expected.item(), step
    # what was moved through the device tier far exceeds it, and it was never overrun
    device = sync.store.tier("device")
    assert weights + saved_bytes > 2 * device.capacity
    assert not breaches
    params.detach()
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert "parameters:" in str(params.report) and params.report.bytes_in > weights
    # (weights are not saved tensors: no "used before they left", no "kept in place")
    assert "before they left" not in str(params.report) and "kept in place" not in str(params.report)
    opt.close()
    sync.close()


def test_parameters_from_disk_with_after_and_in_backward_updates(tmp_path: Path) -> None:
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = GPT(CONFIG)
        twin = copy.deepcopy(model)
        sync = store(tmp_path / str(in_backward), device="1MiB", host="1MiB")
        params = offload_parameters(model, sync, tier="disk")
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=sync, min_offload_numel=64, fused=True, step_in_backward=in_backward)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
        batches = synthetic_batches(CONFIG, 4)
        for _ in range(20):
            tokens = next(batches)
            for net, o in ((model, opt), (twin, reference)):
                o.zero_grad()
                net.loss(tokens).backward()
                o.step()
            params.mark_step()
        params.detach()
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        opt.close()
        sync.close()
