"""Review of the resident and mixed steps: a failed resident step completed by ``step()`` again
applies no update twice; sparse gradients are refused before anything changes; stores whose
state tier has no disk right below it (early write-backs do not apply) step as any other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore
from tierstore.errors import StepIncompleteError
from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _pair() -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _groups(model: torch.nn.Sequential) -> list[dict]:
    return [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters()), "lr": 1e-2}]


def _backward(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 64, generator=generator)).square().mean().backward()


def test_a_failed_resident_step_run_again_updates_each_parameter_once(device_mode: str) -> None:
    model, twin = _pair()
    exact = torch.optim.AdamW(_groups(twin), fused=True)
    opt = TieredAdamW(_groups(model), offload="host", min_offload_numel=100)
    try:
        for seed in range(4):
            _backward(model, seed)
            _backward(twin, seed)
            exact.step()
            exact.zero_grad()
            if seed >= 2:  # one group's call fails (each group once: first or second in the call)
                group = opt.param_groups[seed - 2]
                betas, group["betas"] = group["betas"], (0.9,)
                with pytest.raises(StepIncompleteError) as raised:
                    opt.step()
                group["betas"] = betas
                assert raised.value.updated + raised.value.not_updated  # (every parameter in one or the other)
                assert not set(raised.value.updated) & set(raised.value.not_updated)
            opt.step()
            opt.zero_grad()
            for ours, torchs in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.equal(ours, torchs)
                assert float(opt.state[ours]["step"]) == float(exact.state[torchs]["step"]) == seed + 1
    finally:
        opt.close()


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_a_sparse_gradient_is_refused_before_anything_changes(device_mode: str, step_in_backward: bool) -> None:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(100, 16, sparse=True)
    dense = torch.nn.Linear(16, 4)
    before = [p.detach().clone() for p in (*embedding.parameters(), *dense.parameters())]
    opt = TieredAdamW([*embedding.parameters(), *dense.parameters()], offload="host", min_offload_numel=10)
    try:
        dense(embedding(torch.tensor([1, 2]))).sum().backward()
        with pytest.raises(RuntimeError, match="does not support sparse gradients.*SparseAdam"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip((*embedding.parameters(), *dense.parameters()), before, strict=True))
        assert opt.state_dict()["state"] == {}
        opt.zero_grad()
        dense(embedding.weight[:2].detach()).sum().backward()  # dense gradients only: steps
        opt.step()
    finally:
        opt.close()


def _stores(tmp_path: Path) -> list[SyncTierStore]:
    return [  # state on the device tier, paging to the host tier below it: no disk right below
        SyncTierStore([DeviceTier("cpu", "40KiB"), HostTier("64MiB")]),
        SyncTierStore([DeviceTier("cpu", "40KiB"), HostTier("64MiB"), DiskTier(tmp_path / "a", "64MiB", durable=False)]),
    ]


@pytest.mark.parametrize("which", [0, 1])
def test_a_state_tier_without_a_disk_right_below_steps(device_mode: str, tmp_path: Path, which: int) -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(1024)) for _ in range(8)]  # 64 KiB of state: pages below the 40 KiB tier
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    exact = torch.optim.AdamW(theirs, fused=True)
    store = _stores(tmp_path)[which].open()
    opt = TieredAdamW(ours, store=store, state_tier="device", min_offload_numel=100)
    try:
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p, q in zip(ours, theirs, strict=True):
                p.grad = torch.randn(1024, generator=generator)
                q.grad = p.grad.clone()
            exact.step()
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))
        assert any("host" in store.where(key) for key in store.keys())  # (it paged)
    finally:
        opt.close()
        store.close()


def test_a_tight_host_tier_with_state_growing_mid_run_steps(device_mode: str, tmp_path: Path) -> None:
    # A new user's shape: the host tier holds ~60% of the state, two parameters get their first
    # gradient only at step 4 (their state is created then), mixed steps with two groups.
    def make() -> list[torch.nn.Parameter]:
        torch.manual_seed(1)
        return [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(6)] + [torch.nn.Parameter(torch.randn(300))]

    def groups(params: list[torch.nn.Parameter]) -> list[dict]:
        return [{"params": params[:4]}, {"params": params[4:], "lr": 2e-3, "amsgrad": True, "weight_decay": 0.2}]

    theirs, ours = make(), make()
    exact = torch.optim.AdamW(groups(theirs), lr=1e-3, fused=True)
    store = SyncTierStore([HostTier("2200KiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)]).open()
    opt = TieredAdamW(groups(ours), lr=1e-3, store=store)
    try:
        generator = torch.Generator().manual_seed(3)
        for step in range(8):
            for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
                p.grad = None if i >= 4 and step < 4 else torch.randn(p.shape, generator=generator)
                q.grad = None if p.grad is None else p.grad.clone()
            exact.step()
            opt.step()
            assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True)), step
        assert any("disk" in store.where(key) for key in store.keys())  # (it paged)
    finally:
        opt.close()
        store.close()
