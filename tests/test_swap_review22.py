"""Defects a review found in offload_parameters: a reused state_dict destination got stale
weights, a partial load hid an in-place change of a parameter it did not cover, frozen weights
stayed held on the device tier after backward, and a checkpointed region larger than the
device tier failed with a message that did not say why."""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore import DeviceTier, HostTier, SyncTierStore, TierFullError
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes


class Net(nn.Module):
    """Embedding, two MLP blocks, an output layer tied to the embedding."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32)) for _ in range(2)])
        self.out = nn.Linear(32, 50, bias=False)
        self.out.weight = self.emb.weight
        self.ckpt = ckpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if self.ckpt:
            return self.out(checkpoint(self._blocks, h, use_reentrant=False))
        return self.out(self._blocks(h))

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + block(h)
        return h


def store(device: str = "64KiB") -> SyncTierStore:
    return SyncTierStore([DeviceTier("cpu", device), HostTier("8MiB")]).open()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(step))


def step(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    opt.zero_grad()
    model(batch(n)).square().mean().backward()
    opt.step()


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


def test_a_reused_destination_gets_the_current_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    sync = store()
    params = offload_parameters(model, sync)
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=sync, min_offload_numel=64, fused=True)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    n = 0

    def train() -> dict[str, torch.Tensor]:
        nonlocal n
        step(model, opt, n)
        step(twin, reference, n)
        params.mark_step()
        n += 1
        return {k: v.clone() for k, v in twin.state_dict().items()}

    # each way of asking, with its own dict given again after each step (nothing in between)
    reused: OrderedDict[str, torch.Tensor] = OrderedDict()
    for _ in range(2):
        expected = train()
        got = model.state_dict(destination=reused)
        assert got is reused
        assert_same(got, expected)  # (was: the first step's weights, from a cache of the dict)
        assert got["out.weight"] is got["emb.weight"]  # tied: one tensor under both names, as torch
    prefixed: OrderedDict[str, torch.Tensor] = OrderedDict()
    for _ in range(2):
        expected = train()
        model.state_dict(destination=prefixed, prefix="model.")
        assert_same(prefixed, {f"model.{k}": v for k, v in expected.items()})
    block: OrderedDict[str, torch.Tensor] = OrderedDict()
    for _ in range(2):
        expected = train()
        model.blocks[1].state_dict(destination=block, prefix="b.")
        assert_same(block, {f"b.{k[len('blocks.1.'):]}": v for k, v in expected.items() if k.startswith("blocks.1.")})
    for _ in range(2):
        expected = train()
        assert_same(model.state_dict(), expected)  # a new dict each time
    kept = model.state_dict(keep_vars=True)
    assert all(kept[name] is p for name, p in model.named_parameters())
    opt.close()
    params.detach()
    sync.close()


def test_a_partial_load_keeps_the_complaint_about_an_in_place_change_it_did_not_cover() -> None:
    torch.manual_seed(0)
    model = Net()
    sync = store()
    params = offload_parameters(model, sync)
    before = model.state_dict()
    with torch.no_grad():
        model.get_parameter("blocks.0.0.weight").mul_(2)  # a placeholder: the change cannot reach the store
    partial = {"blocks.1.0.bias": before["blocks.1.0.bias"] + 1}
    result = model.load_state_dict(partial, strict=False)
    assert "blocks.0.0.weight" in result.missing_keys
    with pytest.raises(RuntimeError, match=r"'blocks.0.0.weight'.*changed in place while offloaded"):
        model(batch(0))  # (was: silently trained on the unchanged weight)
    with pytest.raises(RuntimeError, match=r"'blocks.0.0.weight'.*changed in place while offloaded"):
        model.state_dict()
    # a load that covers it replaces the lost change, and the complaint goes
    model.load_state_dict({"blocks.0.0.weight": before["blocks.0.0.weight"] * 2}, strict=False)
    after = model.state_dict()
    assert torch.equal(after["blocks.0.0.weight"], before["blocks.0.0.weight"] * 2)
    assert torch.equal(after["blocks.1.0.bias"], before["blocks.1.0.bias"] + 1)
    model(batch(0))
    # a load that fails (size mismatch) does not count as an in-place change either
    with pytest.raises(RuntimeError, match="size mismatch for blocks.1.2.weight"):
        model.load_state_dict({"blocks.1.2.weight": torch.zeros(3, 3)}, strict=False)
    model(batch(0))
    params.detach()
    sync.close()


def held(sync: SyncTierStore, prefix: str) -> list[str]:
    return sorted(k for k in sync.keys() if k.startswith(prefix) and sync.info(k)["held"])


@pytest.mark.parametrize("ckpt", [False, True])
def test_frozen_weights_are_let_go_after_backward(ckpt: bool) -> None:
    torch.manual_seed(0)
    model = Net(ckpt=ckpt)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    twin = copy.deepcopy(model)
    sync = store()
    params = offload_parameters(model, sync)
    prefix = params.namespace.name
    opt = TieredAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, store=sync, min_offload_numel=64, fused=True)
    reference = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2, fused=True)
    for n in range(3):
        opt.zero_grad()
        reference.zero_grad()
        loss = model(batch(n)).square().mean()
        loss.backward()
        assert held(sync, prefix) == []  # (was: blocks.0's frozen weights, until its next forward)
        opt.step()
        params.mark_step()
        expected = twin(batch(n)).square().mean()
        expected.backward()
        reference.step()
        assert loss.item() == expected.item()
    assert_same(model.state_dict(), twin.state_dict())
    opt.close()
    params.detach()
    sync.close()


def test_a_checkpointed_region_larger_than_the_device_tier_says_so() -> None:
    torch.manual_seed(0)
    model = Net(ckpt=True)
    sync = store(device="40KiB")  # each unit fits, the two blocks together (~50 KiB) do not
    params = offload_parameters(model, sync)
    loss = model(batch(0)).square().mean()
    with pytest.raises(TierFullError, match=r"(?s)torch.utils.checkpoint.*recomput.*device tier"):
        loss.backward()
    params.detach()
    sync.close()


class Adapted(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter beside it (as LoRA)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(dim, 2) / dim)
        self.up = nn.Parameter(torch.zeros(2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.down @ self.up)


def test_a_frozen_base_larger_than_the_device_tier_trains_unit_by_unit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Adapted(64) for _ in range(8)))  # 8 x 16.25 KiB frozen
    twin = copy.deepcopy(model)
    sync = store(device="64KiB")  # (was: TierFullError in backward, every frozen unit still held)
    params = offload_parameters(model, sync)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = TieredAdamW(trainable, lr=1e-2, store=sync, min_offload_numel=64, fused=True)
    reference = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2, fused=True)
    for n in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(n))
        for net, optimizer in ((model, opt), (twin, reference)):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
        params.mark_step()
        assert held(sync, params.namespace.name) == []
    assert_same(model.state_dict(), twin.state_dict())
    opt.close()
    params.detach()
    sync.close()
