"""Swapping across the device boundary and through errors: crossings really copy under the
emulated device, a forward that raises leaves nothing behind, tied weights train exactly."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.device import TO_DEVICE, TO_HOST, link_for
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_activations, offload_parameters

pytestmark = pytest.mark.device_modes

VOCAB, SEQ, DIM = 32, 8, 16


class Mix(nn.Module):
    """Mixes positions with a learned (seq x seq) matrix: a shape error inside a unit's forward
    (after its weights are held) for a sequence of another length."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(SEQ, SEQ) / SEQ)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.einsum("st,btd->bsd", self.weight, x)


class Tied(nn.Module):
    """Embedding, two layers, and an output head sharing the embedding's weight (as GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.mix = Mix()
        self.down = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.up(self.embed(tokens)))
        return self.head(self.down(self.mix(x)))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step: int, seq: int = SEQ + 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, seq), generator=torch.Generator().manual_seed(step))


def make_store(tmp_path: Path, device: str = "1MiB", **tier: bool) -> SyncTierStore:
    return SyncTierStore([DeviceTier("cpu", device, **tier), HostTier("16MiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)]).open()


class Counter:
    """A link listener: bytes that crossed each way."""

    def __init__(self) -> None:
        self.bytes = {TO_HOST: 0, TO_DEVICE: 0}
        self._lock = threading.Lock()

    def __call__(self, direction: str, nbytes: int, started: float, ended: float) -> None:
        with self._lock:
            self.bytes[direction] += nbytes


def eventually(check: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_saved_activations_cross_the_link_as_copies(tmp_path: Path, device_mode: str) -> None:
    sync = make_store(tmp_path)
    link = link_for("cpu")  # the device tier's link (links are shared per device and speed)
    assert (sync.store.tier("device").link is link) == (device_mode == "emulated")
    counted = Counter()
    link.add_listener(counted)
    try:
        offload = offload_activations(sync, min_bytes=1024)
        x = torch.randn(64, 64, requires_grad=True)
        with offload:
            y = x.exp()  # saves its result
        assert eventually(lambda: offload.report.bytes_out == y.nbytes)  # the copy out has ended
        back = y.grad_fn._saved_result  # backward's view of it, brought back from the store
        assert torch.equal(back, y) and back.data_ptr() != y.data_ptr()
        y.sum().backward()
        torch.testing.assert_close(x.grad, y.detach(), rtol=0, atol=0)
        if device_mode == "emulated":  # over the link once each way (backward reuses what came back)
            assert counted.bytes == {TO_HOST: y.nbytes, TO_DEVICE: y.nbytes}
        else:  # the plain CPU lends: the store copies, nothing crosses a link
            assert counted.bytes == {TO_HOST: 0, TO_DEVICE: 0}
        assert len(sync) == 0
    finally:
        link.remove_listener(counted)
        sync.close()


def test_parameters_cross_the_link_out_once_and_in_for_each_hold(tmp_path: Path, device_mode: str) -> None:
    torch.manual_seed(0)
    model = Tied()
    weights = sum(p.nbytes for p in model.parameters())  # the tied weight counted once
    sync = make_store(tmp_path)
    link = link_for("cpu")
    counted = Counter()
    link.add_listener(counted)
    try:
        params = offload_parameters(model, sync, tier="host")
        assert eventually(lambda: counted.bytes[TO_HOST] == (weights if device_mode == "emulated" else 0))
        model.loss(batch(0)).backward()
        if device_mode == "emulated":  # every weight came to the device tier at least once
            assert counted.bytes[TO_DEVICE] >= weights
        else:
            assert counted.bytes[TO_DEVICE] == 0
        params.detach()
    finally:
        link.remove_listener(counted)
        sync.close()


@pytest.mark.parametrize("what", ["activations", "parameters"])
def test_emulate_device_must_agree_with_the_device_tier(tmp_path: Path, what: str, device_mode: str) -> None:
    emulated = device_mode == "emulated"
    sync = make_store(tmp_path, emulate_device=emulated)
    try:
        with pytest.raises(ValueError, match="contradicts the store's device tier"):
            if what == "activations":
                offload_activations(sync, emulate_device=not emulated)
            else:
                offload_parameters(Tied(), sync, emulate_device=not emulated)
        assert not [n for n in sync.run(sync.store.namespaces()) if n.live]  # refused before claiming one
        agreeing = offload_activations(sync, emulate_device=emulated) if what == "activations" else None
        if agreeing is not None:
            assert agreeing.link(torch.device("cpu")).lends == (not emulated)
            agreeing.close()
    finally:
        sync.close()


async def _held(store: TierStore) -> list[str]:
    """Keys someone holds (on the loop, which owns the store's state)."""
    return [key for key in store.keys() if store.info(key)["held"]]


async def _keys(store: TierStore, prefix: str) -> list[str]:
    return [key for key in store.keys() if key.startswith(prefix)]


def _no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_forward_that_raises_leaves_no_hooks_and_no_holds_and_training_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    twin = copy.deepcopy(model)
    sync = make_store(tmp_path, device="64KiB")
    params = offload_parameters(model, sync, tier="host")
    activations = offload_activations(sync, min_bytes=1024)
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=sync, min_offload_numel=64, fused=True)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)

    def step(tokens: torch.Tensor) -> None:
        opt.zero_grad()
        reference.zero_grad()
        with activations:
            loss = model.loss(tokens)
        loss.backward()
        opt.step()
        params.mark_step()
        expected = twin.loss(tokens)
        expected.backward()
        reference.step()
        assert loss.item() == expected.item()

    step(batch(0))
    for failing in range(2):  # a shape error inside Mix's forward, with its weights held
        with pytest.raises(RuntimeError, match="einsum"), activations:
            model.loss(batch(100 + failing, seq=SEQ + 3))
        assert _no_saved_tensor_hooks()
        x = torch.randn(32, 32, requires_grad=True)
        y = x.exp()
        assert y.grad_fn._saved_result.data_ptr() == y.data_ptr()  # saved as torch saves it
        y.sum().backward()
        # every hold the offloads took is let go (on the loop, once queued kernels are done)
        assert eventually(lambda: not sync.run(_held(sync.store)))
        for p in model.parameters():  # the weights are placeholders again
            assert p.numel() == 0
        # what the failed forward saved left the store (its graph may still be alive here)
        assert eventually(lambda: not sync.run(_keys(sync.store, activations.namespace.name)))
    for n in range(1, 4):
        step(batch(n))
    params.detach()
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    activations.close()
    opt.close()
    sync.close()


@pytest.mark.parametrize("in_backward", [False, True])
def test_tied_embeddings_are_stored_once_and_train_bit_for_bit(tmp_path: Path, in_backward: bool) -> None:
    torch.manual_seed(0)
    model = Tied()
    twin = copy.deepcopy(model)
    assert twin.head.weight is twin.embed.weight
    sync = make_store(tmp_path, device="64KiB")
    params = offload_parameters(model, sync, tier="host")
    stored = [k for k in sync.keys() if k.startswith(params.namespace.name)]
    assert len(stored) == len(list(model.parameters())) == 6  # the tied weight once
    opt = TieredAdamW(model.parameters(), lr=1e-2, store=sync, min_offload_numel=64, fused=True, step_in_backward=in_backward)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for n in range(4):
        tokens = batch(n)
        for net, o in ((model, opt), (twin, reference)):
            o.zero_grad()
            net.loss(tokens).backward()
            if o is reference:  # the gradient of the tied weight sums both uses
                torch.testing.assert_close(model.embed.weight.grad, twin.embed.weight.grad, rtol=0, atol=0)
            o.step()
        params.mark_step()
    params.detach()
    assert model.head.weight is model.embed.weight
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    opt.close()
    sync.close()
