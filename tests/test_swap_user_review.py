"""What a new user found in swapping: state_dict/load_state_dict under offload_parameters,
non-reentrant activation checkpointing with offloaded weights, and freeing offloaded
activations after their store closed."""

from __future__ import annotations

import copy
import gc
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from failing_backward import FailingBackward
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_activations, offload_parameters

pytestmark = pytest.mark.device_modes


class Net(nn.Module):
    """Embedding, two MLP blocks (optionally checkpointed), an output layer (optionally tied)."""

    def __init__(self, tied: bool = False, ckpt: str | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32)) for _ in range(2)])
        self.out = nn.Linear(32, 50, bias=False)
        if tied:
            self.out.weight = self.emb.weight
        self.ckpt = ckpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for i, block in enumerate(self.blocks):
            if self.ckpt is not None and i == 1:
                h = h + checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
            else:
                h = h + block(h)
        return self.out(h)


def store(tmp_path: Path, device: str = "64KiB") -> SyncTierStore:
    return SyncTierStore([DeviceTier("cpu", device), HostTier("8MiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)]).open()


def offloaded_twins(tmp_path: Path, model: nn.Module, device: str = "64KiB", **options: Any) -> tuple[nn.Module, SyncTierStore, Any]:
    """An untouched twin of ``model``, a fresh store, and ``model``'s weights offloaded into it."""
    twin = copy.deepcopy(model)
    sync = store(tmp_path, device)
    return twin, sync, offload_parameters(model, sync, **options)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(step))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, params: object = None) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = model(batch(step)).square().mean()
        loss.backward()
        opt.step()
        if params is not None:
            params.mark_step()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].device == theirs[key].device, key
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_state_dict_and_load_state_dict_follow_the_store_while_training(tmp_path: Path, tier: str) -> None:
    torch.manual_seed(0)
    model = Net()
    twin, sync, params = offloaded_twins(tmp_path, model, tier=tier)
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=sync, min_offload_numel=64, fused=True)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    assert train(model, opt, range(3), params) == train(twin, reference, range(3))
    assert all(p.numel() == 0 for p in model.parameters())  # the weights are in the store ...
    report = opt.time_report()  # (they went back into the store, crossing no link in the step)
    assert report.weights_to_device_bytes == 0
    assert report.weights_to_store_bytes == sum(p.numel() * p.element_size() for p in twin.parameters() if p.grad is not None)
    assert "weights into the store" in str(report)
    assert_same(model.state_dict(), twin.state_dict())  # ... and a checkpoint holds them
    assert_same(model.blocks[0].state_dict(), twin.blocks[0].state_dict())  # a submodule's too

    torch.manual_seed(1)
    other = Net().state_dict()
    assert str(model.load_state_dict(other)) == str(twin.load_state_dict(other))
    assert_same(model.state_dict(), other)
    assert train(model, opt, range(3, 6), params) == train(twin, reference, range(3, 6))
    assert_same(model.state_dict(), twin.state_dict())
    params.detach()
    assert_same(dict(model.named_parameters()), dict(twin.named_parameters()))
    opt.close()
    sync.close()


def test_load_state_dict_reports_as_torch_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    twin, sync, params = offloaded_twins(tmp_path, model)
    before = model.state_dict()

    wrong = dict(twin.state_dict(), **{"blocks.0.0.weight": torch.zeros(5, 32)})
    with pytest.raises(RuntimeError) as ours:
        model.load_state_dict(wrong)
    with pytest.raises(RuntimeError) as theirs:
        twin.load_state_dict(wrong)
    assert "size mismatch for blocks.0.0.weight: copying a param with shape torch.Size([5, 32]) from checkpoint, " \
        "the shape in current model is torch.Size([96, 32])." in str(ours.value)
    assert str(ours.value) == str(theirs.value)

    partial = {k: v + 1 for k, v in before.items() if k != "out.weight"}
    partial["extra"] = torch.ones(1)
    with pytest.raises(RuntimeError, match="(?s)Missing key.*out.weight.*Unexpected key.*extra"):
        model.load_state_dict(partial)
    result = model.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["out.weight"] and result.unexpected_keys == ["extra"]
    after = model.state_dict()
    assert torch.equal(after["out.weight"], before["out.weight"])
    assert torch.equal(after["emb.weight"], before["emb.weight"] + 1)
    with pytest.raises(ValueError, match="assign=True"):  # (an optimizer's own master would not see such a load)
        model.load_state_dict(dict(before), assign=True)  # (a copy: torch marks assign in the dict's _metadata)
    assert torch.equal(model.state_dict()["emb.weight"], before["emb.weight"] + 1)  # nothing loaded
    model.load_state_dict(before)
    assert_same(model.state_dict(), before)
    params.detach()
    sync.close()


def test_tied_weights_and_keep_vars(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net(tied=True)
    twin, sync, params = offloaded_twins(tmp_path, model)
    state = model.state_dict()
    assert_same(state, twin.state_dict())
    assert state["out.weight"] is state["emb.weight"]  # one stored weight, one tensor, as torch aliases them
    new = (state["emb.weight"] * 3).clone()
    model.load_state_dict({**state, "emb.weight": new, "out.weight": new})
    assert torch.equal(model.state_dict()["out.weight"], new)
    tokens = batch(0)
    twin.load_state_dict({**state, "emb.weight": new, "out.weight": new})
    assert torch.equal(model(tokens), twin(tokens))
    # keep_vars=True asks for the Parameter objects: those stay (a placeholder outside forward)
    kept = model.state_dict(keep_vars=True)
    assert kept["emb.weight"] is model.emb.weight and kept["emb.weight"].numel() == 0
    params.detach()
    sync.close()


def test_an_in_place_change_of_a_placeholder_raises_instead_of_being_lost(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    sync = store(tmp_path)
    params = offload_parameters(model, sync)
    tokens = batch(0)
    model(tokens)
    with torch.no_grad():
        model.blocks[0][0].weight.mul_(2)
    with pytest.raises(RuntimeError, match=r"'blocks.0.0.weight'.*changed in place while offloaded.*load_state_dict"):
        model(tokens)
    with pytest.raises(RuntimeError, match="changed in place while offloaded"):
        model.state_dict()
    # the way to change a weight: load it (which also clears the complaint)
    twin = Net()
    model.load_state_dict(twin.state_dict())
    assert torch.equal(model(tokens), twin(tokens))
    params.detach()
    sync.close()


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_checkpointed_blocks_with_offloaded_weights_give_torch_gradients(tmp_path: Path, ckpt: str) -> None:
    torch.manual_seed(0)
    model = Net(tied=True, ckpt=ckpt)
    twin, sync, params = offloaded_twins(tmp_path, model, device="48KiB")  # less than the weights: units come and go
    activations = offload_activations(sync, min_bytes=1024)
    for step in range(3):
        with activations:
            loss = model(batch(step)).square().mean()
        loss.backward()
        expected = twin(batch(step)).square().mean()
        expected.backward()
        assert loss.item() == expected.item()
        for (name, ours), theirs in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0, msg=name)
        model.zero_grad()
        twin.zero_grad()
        params.mark_step()
    activations.close()
    params.detach()
    sync.close()


def test_freeing_offloaded_activations_after_the_store_closed_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    with SyncTierStore([HostTier("8MiB")]) as sync:
        activations = offload_activations(sync, min_bytes=4096)
        with activations:
            loss = model(torch.randn(64, 256)).square().sum()
    # (puts the close refused keep their tensors in memory for backward: refused, not offloaded)
    assert activations.report.offloaded + activations.report.refused > 0
    with caplog.at_level(logging.ERROR):
        del loss, activations  # the graph and the offloader go: what the graph saved is dropped
        gc.collect()
        with SyncTierStore([HostTier("1MiB")]) as other:  # a round trip through the loop: the drops ran
            other.put("x", torch.ones(1))
        gc.collect()  # an unretrieved task's exception is logged when the task is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage() or r.exc_info], caplog.text


def test_conjugate_and_negative_views_are_offloaded_with_their_values() -> None:
    """A complex product saves ``z.conj()``: a view whose bytes are not its values. On the emulated
    device the copy over the link viewed those bytes as uint8 and failed in backward."""
    torch.manual_seed(0)
    x = torch.randn(256, 128, requires_grad=True)

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(x, x.flip(1))
        return (z * z.conj()).real.sum() + (torch._neg_view(z) * z).imag.sum()

    loss_of(x).backward()
    expected, x.grad = x.grad, None
    with SyncTierStore([DeviceTier("cpu", "8MiB"), HostTier("8MiB")]) as store:
        activations = offload_activations(store, min_bytes=0)
        with activations:
            loss = loss_of(x)
        time.sleep(0.3)  # (the copies start before backward asks for the values back)
        loss.backward()
        activations.close()
    assert activations.report.offloaded >= 2 and activations.report.early == 0  # (each came back over the link)
    assert torch.equal(x.grad, expected)


def test_close_right_after_a_graph_is_freed_deletes_what_is_left_without_racing_the_frees() -> None:
    """A freed graph drops what it saved from the event loop; ``close()`` right after it listed
    those keys too and raised ``KeyNotFoundError`` for one dropped meanwhile."""
    with SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]) as store:
        for round in range(20):
            activations = offload_activations(store, min_bytes=0)
            x = torch.randn(64, 64, requires_grad=True)
            with activations:
                loss = sum((x * x.roll(i, 1)).exp().sum() for i in range(16))
            del loss  # (no backward: the graph goes, and with it what it saved)
            activations.close()
            assert not [key for key in store.keys() if key.startswith(activations.namespace.name)], round


def test_a_torch_optimizer_on_offloaded_parameters_is_refused_clearly(tmp_path: Path) -> None:
    """torch's AdamW met the size-0 placeholders: "The size of tensor a (0) must match ..."."""
    torch.manual_seed(0)
    model = Net()
    twin, sync, params = offloaded_twins(tmp_path, model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(batch(0)).square().mean().backward()
    with pytest.raises(TypeError, match=r"AdamW.step\(\): .*offload_parameters keeps in a store.*TieredAdamW.*detach\(\)"):
        opt.step()
    opt.zero_grad()  # (without gradients the offloaded weights are skipped, as torch skips them:
    for p in model.parameters():  # a frozen offloaded backbone beside a torch-trained head)
        p.requires_grad_(False)
    opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
    model(batch(0)).square().mean().backward()
    params.detach()  # the weights back in the module: torch's optimizer takes them again
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin(batch(0)).square().mean().backward()
    opt.step()
    reference.step()
    assert_same(dict(model.named_parameters()), dict(twin.named_parameters()))
    sync.close()


def test_close_after_a_failed_backward_waits_for_what_was_fetched_ahead() -> None:
    """Values fetched ahead of a backward that then raised held their keys: close() right after
    raised EntryHeldError and left the namespace claimed, its keys behind."""
    with SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]) as store:
        for round in range(8):
            activations = offload_activations(store, min_bytes=0, ahead="64MiB")
            x = torch.randn(256, 512, requires_grad=True)
            with activations:
                h = x
                for _ in range(4):
                    h = (h * 1.0001).tanh()
                h = FailingBackward.apply(h)
                for _ in range(4):
                    h = (h * 1.0001).tanh()
                loss = h.sum()
            time.sleep(0.05)
            with pytest.raises(ValueError, match="backward failed"):
                loss.backward()
            activations.close()
            assert not activations.namespace.live, round
            assert not [key for key in store.keys() if key.startswith(activations.namespace.name)], round
            del loss, h
