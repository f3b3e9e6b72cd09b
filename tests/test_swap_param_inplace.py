"""Parameter offload keeps torch's autograd graph as it is: a unit's output may be changed in
place (``ReLU(inplace=True)`` after a conv or batch norm, a residual ``out += x``: torch's full
backward hooks refused both), and gradients equal a plain model's bit for bit, through residual
streams too (with full backward hooks they differed in the last bits)."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters
from tierstore.swap.parameters import pop_abandoned_hooks

pytestmark = pytest.mark.device_modes


class BasicBlock(nn.Module):
    """torchvision's ResNet block: batch norm output changed in place twice."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        BasicBlock(8), BasicBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def test_a_resnet_with_in_place_changes_trains_as_torch_does(device_mode: str) -> None:
    model = _resnet()
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()
    try:
        params = offload_parameters(model, store)
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, min_offload_numel=1, fused=True)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)
            for net, optimizer in ((model, opt), (twin, reference)):
                nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
            params.mark_step()
        opt.close()
        params.detach()
        for ours, theirs in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
            assert torch.equal(ours, theirs)  # weights and batch norm statistics
    finally:
        store.close()


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_a_residual_stream_gets_a_plain_models_gradients(checkpointing: bool | None, device_mode: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train()
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]).open()
    try:
        offload_parameters(model, store)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            for net in (model, twin):
                net(input_ids=ids, labels=ids).loss.backward()
        pairs = [(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True) if q.grad is not None]
        assert pairs
        for ours, theirs in pairs:
            assert torch.equal(ours.grad, theirs.grad)
    finally:
        store.close()


class _Conditioned(nn.Module):
    """A frozen base whose every block also reads one trainable conditioning (a diffusion
    model's time embedding, FiLM): the conditioning's gradient is complete only at the end."""

    def __init__(self, blocks: int = 8, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.mains = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.projections = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.mains.requires_grad_(False)
        self.projections.requires_grad_(False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        e = self.embed(t)
        for main, projection in zip(self.mains, self.projections, strict=True):
            x = torch.relu(main(x) + projection(e)) + x
        return x


def test_a_frozen_unit_reading_a_shared_input_goes_once_its_own_backward_is_done(device_mode: str) -> None:
    """Waiting for the shared input's whole gradient held every projection to the end of
    backward: a frozen base three times the device tier ran out of room."""
    torch.manual_seed(0)
    model = _Conditioned()
    twin = copy.deepcopy(model)
    frozen = sum(p.nbytes for p in model.mains.parameters()) + sum(p.nbytes for p in model.projections.parameters())
    store = SyncTierStore([DeviceTier("cpu", frozen // 3), HostTier("64MiB")]).open()
    try:
        offload_parameters(model, store)
        x, t = torch.randn(4, 128), torch.randn(4, 4)
        for net in (model, twin):
            net(x, t).square().sum().backward()
        for ours, theirs in zip(model.embed.parameters(), twin.embed.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)
    finally:
        store.close()


def test_a_leaf_input_keeps_no_hook_of_the_offload(device_mode: str) -> None:
    """An iterative attack on a persistent leaf input: hooks on the leaf outlived each graph
    (one more every step) and kept the offload alive after detach()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()
    try:
        params = offload_parameters(model, store)
        x = torch.randn(8, 16, requires_grad=True)
        for _ in range(5):
            (grad,) = torch.autograd.grad(model(x).sum(), x)
            with torch.no_grad():
                x += 0.01 * grad.sign()
        alive = weakref.ref(params)
        params.detach()
        del params
        gc.collect()
        assert alive() is None
    finally:
        store.close()


class _Gate(nn.Module):
    """Reads its own weight twice, with a path to its input that skips the second read."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g + torch.tanh(x) * self.g


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_frozen_unit_keeps_its_weight_until_its_whole_backward_ran(reentrant: bool, device_mode: str) -> None:
    """The first node passing a gradient out of the unit ended it: the other read met the placeholder."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Gate(), nn.Linear(8, 1))
    model[1].requires_grad_(False)
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()
    try:
        offload_parameters(model, store)
        x = torch.randn(3, 8)
        for net in (model, twin):
            net[2](checkpoint(net[1], net[0](x), use_reentrant=reentrant)).sum().backward()
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            assert (ours.grad is None and theirs.grad is None) or torch.equal(ours.grad, theirs.grad)
    finally:
        store.close()


class _Residual(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w)


def test_frozen_units_with_a_residual_inside_go_one_by_one(device_mode: str) -> None:
    """A residual inside a unit ended its backward at once; the weights its later nodes read
    were held again to the end of backward, and a frozen stack 3x the device tier ran out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), *[_Residual() for _ in range(12)])
    model[1:].requires_grad_(False)
    twin = copy.deepcopy(model)
    unit = 64 * 64 * 4
    store = SyncTierStore([DeviceTier("cpu", 4 * unit), HostTier("16MiB")]).open()
    try:
        offload_parameters(model, store)
        x = torch.randn(4, 64)
        for net in (model, twin):
            net(x).square().sum().backward()
        for ours, theirs in zip(model[0].parameters(), twin[0].parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)
    finally:
        store.close()


def _forward_into(model: nn.Module, x: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    outputs.append(model(x))


def test_a_forward_on_another_thread_hooks_nothing_of_the_callers_graph(device_mode: str) -> None:
    """Sequence numbers are per thread: the walk of a unit's graph went on into the caller's
    (kept) graph, left a hook there every step and kept the offload alive."""
    torch.manual_seed(0)
    before = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()
    try:
        params = offload_parameters(model, store)
        x = torch.randn(4, 16)
        for _ in range(300):  # (the caller's numbers run ahead of a fresh thread's)
            x.detach().requires_grad_().view(-1)
        condition = before(x)
        for _ in range(3):
            outputs: list[torch.Tensor] = []
            worker = threading.Thread(target=_forward_into, args=(model, condition, outputs))
            worker.start()
            worker.join()
            outputs.pop().square().sum().backward(retain_graph=True)
        alive = weakref.ref(params)
        params.detach()
        del params
        gc.collect()
        assert alive() is None
    finally:
        store.close()


class _Lookup(nn.Module):
    """An embedding that renormalises the rows it looks up, in place in its forward
    (``max_norm``), before a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16, max_norm=1.0)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


@pytest.mark.parametrize("stored_on", ["host", "disk"])
def test_a_weight_changed_in_place_by_its_forward_is_kept(device_mode: str, stored_on: str, tmp_path) -> None:
    """A tryout: ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place in
    its forward; offloaded, the change went into the held buffer only and was lost when the
    hold ended (the next forward, the optimizer and ``state_dict()`` saw the old rows). It is
    stored now: training equals torch's AdamW bit for bit, and a forward alone (no optimizer)
    leaves the renormalised rows in the store."""
    from tierstore import DiskTier

    plain, swapped = _Lookup(), _Lookup()
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("64KiB"), DiskTier(tmp_path / "d", "8MiB")]) as store:
        offload = offload_parameters(swapped, store, tier=stored_on)
        with torch.no_grad():
            swapped(torch.tensor([[3, 4, 5]]))
            plain(torch.tensor([[3, 4, 5]]))
        assert torch.equal(swapped.state_dict()["embed.weight"], plain.state_dict()["embed.weight"])
        assert plain.embed.weight[3].norm() <= 1.0 + 1e-6  # (the forward did renormalise)
        opts = [torch.optim.AdamW(plain.parameters(), lr=5e-2, fused=True),
                TieredAdamW(swapped.parameters(), lr=5e-2, store=store, min_offload_numel=1, fused=True)]
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            tokens = torch.randint(0, 32, (4, 6), generator=generator)
            for m, opt in zip((plain, swapped), opts, strict=True):
                opt.zero_grad()
                nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
                opt.step()
            offload.mark_step()
        opts[1].close()
        offload.detach()
    for ours, theirs in zip(swapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs)


class _Doubling(nn.Linear):
    """Doubles its held weight in place, then is interrupted (torch runs no ``always_call``
    forward hook for a ``KeyboardInterrupt``: the weight stays held)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.mul_(2.0)
        raise KeyboardInterrupt


def test_a_change_still_held_when_the_store_closes_is_kept(device_mode: str) -> None:
    """The review: closing the store while a changed weight was still held (a forward
    interrupted) stored the change from the loop's thread, which cannot wait for itself: the
    close failed (LoopDeadlockError), and a second close lost the change."""
    torch.manual_seed(0)
    model = nn.Sequential(_Doubling(4, 4))
    doubled = model[0].weight.detach() * 2
    store = SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("64KiB")]).open()
    offload_parameters(model, store)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(torch.randn(1, 4))
    store.close()  # (puts the weights back into the module first)
    assert torch.equal(model[0].weight.detach(), doubled)
    # (the interrupted forward's saved-tensor hooks are this thread's: the close, on the loop's
    # thread, cannot pop them; a next forward or detach() on this thread would)
    pop_abandoned_hooks((None, None))


def test_a_change_is_written_over_the_stored_weight_without_a_second_copy(device_mode: str) -> None:
    """The review: the change was put as a new value, which needs room for a second copy: a
    host tier holding the weights, not twice the changed one, failed every forward
    (``TierFullError``) where it trained before."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(64, 64, max_norm=0.5))  # 16 KiB
    swapped = copy.deepcopy(plain)
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("24KiB")]) as store:
        offload_parameters(swapped, store)
        for tokens in ([1, 2], [3, 1]):
            with torch.no_grad():
                plain(torch.tensor(tokens))
                swapped(torch.tensor(tokens))
        assert torch.equal(swapped.state_dict()["0.weight"], plain.state_dict()["0.weight"])


class _UseThenClamp(nn.Module):
    """Computes with its weight, then changes it in place: torch refuses the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        with torch.no_grad():
            self.w.clamp_(-1, 1)
        return y


def test_a_weight_changed_after_a_forward_saved_it_is_refused_in_backward_as_torch_does(device_mode: str) -> None:
    """A tryout: offloaded, the backward silently computed the input's gradient with the
    changed weight (torch's saved-tensor check does not see through the offload's saved
    references); torch raises. Now the same error, naming the parameter."""
    torch.manual_seed(0)
    plain = _UseThenClamp()
    swapped = copy.deepcopy(plain)
    x = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain(x).sum().backward()
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("64KiB")]) as store:
        offload = offload_parameters(swapped, store)
        with pytest.raises(RuntimeError, match="modified by an inplace operation: parameter 'w'"):
            swapped(x).sum().backward()
        offload.detach()
    assert torch.equal(swapped.w, plain.w)  # (the change itself is kept, as torch keeps it)
