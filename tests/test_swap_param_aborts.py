"""Parameter offload after a step that did not finish, with a device tier smaller than the
model's weights: the next steps train as a plain model's do, bit for bit. Torch runs a forward
hook marked ``always_call`` for an ``Exception`` only, so a ``KeyboardInterrupt`` (Ctrl-C) in a
unit's forward left its weights held and the saved-tensor hooks pushed; a backward that raised
left the units it held held. Either filled the device tier: every later step (Ctrl-C), or the
next one (backward), failed with ``TierFullError``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True) for _ in range(4))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


class Interrupt:
    """Raises ``error`` once, when armed, from a forward hook or a gradient hook."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.armed = False

    def __call__(self, *_: object) -> None:
        if self.armed:
            self.armed = False
            raise self.error


def _train_side_by_side(runs: list[tuple[nn.Module, torch.optim.Optimizer]], interrupts: list[Interrupt], error: type[BaseException],
                        params: object, steps: int, aborted: tuple[int, ...]) -> None:
    """Train the offloaded model and its plain twin on the same batches, the interrupts armed at
    the ``aborted`` steps: each step's losses equal (None where it raised ``error``), and no
    saved-tensor hooks stay pushed after a step that finished."""
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(4, 8, 64, generator=generator), torch.randint(0, 10, (4,), generator=generator)
        for interrupt in interrupts:
            interrupt.armed = step in aborted
        losses = []
        for net, optimizer in runs:
            try:
                loss = nn.functional.cross_entropy(net(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            except error:
                losses.append(None)
            optimizer.zero_grad()
        params.mark_step()  # type: ignore[attr-defined]
        assert losses[0] == losses[1] and (losses[0] is None) == (step in aborted), (step, losses)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None or step in aborted


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_a_step_that_raised_leaves_nothing_held_and_training_goes_on(device_mode: str, where: str, error: type[BaseException]) -> None:
    model = Encoder()
    twin = copy.deepcopy(model)
    interrupts = []
    for net in (model, twin):
        interrupt = Interrupt(error("injected"))
        if where == "forward":  # (inside a unit: a child of a transformer layer, one unit whole)
            net.layers[1].linear1.register_forward_hook(interrupt)
        else:  # (backward has passed the layers after it, holding their weights)
            net.layers[1].linear1.weight.register_hook(interrupt)
        interrupts.append(interrupt)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()  # (about 3 of the 4 layers)
    try:
        params = offload_parameters(model, store)
        opt = TieredAdamW(model.parameters(), lr=1e-3, store=store, min_offload_numel=1, fused=True)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-3, fused=True)
        _train_side_by_side([(model, opt), (twin, reference)], interrupts, error, params, steps=5, aborted=(1, 3))
        params.detach()
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        opt.close()
    finally:
        store.close()


def test_a_forward_running_inside_another_is_not_taken_for_one_that_ended(device_mode: str) -> None:
    """The root called again from inside its own forward (a model that runs itself on a second
    input) is still running: its holds and hooks are not let go."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.inner = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if not self.inner:
                self.inner = True
                h = h + self(x * 2)
                self.inner = False
            return self.b(h)

    torch.manual_seed(0)
    model = Twice()
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("16MiB")]).open()
    try:
        params = offload_parameters(model, store)
        x = torch.randn(4, 16)
        model(x).square().sum().backward()
        twin(x).square().sum().backward()
        params.detach()
        for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    finally:
        store.close()


def _no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_ctrl_c_under_torch_compile_is_recovered_too(device_mode: str) -> None:
    """Compiled, the forward hooks' Python was decided when traced: the aborted forward was never
    found, and every later step failed with ``TierFullError``."""
    model = Encoder()
    twin = copy.deepcopy(model)
    interrupt, twin_interrupt = Interrupt(KeyboardInterrupt("injected")), Interrupt(KeyboardInterrupt("injected"))
    model.layers[1].linear1.register_forward_hook(torch.compiler.disable(lambda *args: interrupt(*args)))
    twin.layers[1].linear1.register_forward_hook(twin_interrupt)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()
    try:
        params = offload_parameters(model, store)
        compiled = torch.compile(model, backend="eager")
        opt = TieredAdamW(model.parameters(), lr=1e-3, store=store, min_offload_numel=1, fused=True)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-3, fused=True)
        _train_side_by_side([(compiled, opt), (twin, reference)], [interrupt, twin_interrupt], KeyboardInterrupt, params,
                            steps=4, aborted=(1,))
        params.detach()
        opt.close()
    finally:
        store.close()


@pytest.mark.parametrize("then", ["train", "detach"])
def test_ctrl_c_inside_an_activation_offload_leaves_no_hooks_pushed(then: str) -> None:
    """The ``with`` block's exit popped the top hooks (parameter offload's, left by the aborted
    forward), so its own stayed pushed for good: autograd after the store closed raised
    ``StoreClosedError``. A ``detach()`` right after the abort (no forward to recover) left
    parameter offload's pushed."""
    from tierstore.swap import offload_activations

    model = Encoder()
    interrupt = Interrupt(KeyboardInterrupt("injected"))
    model.layers[1].linear1.register_forward_hook(interrupt)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()
    params = offload_parameters(model, store)
    activations = offload_activations(store, min_bytes=0)
    x = torch.randn(4, 8, 64)
    interrupt.armed = True
    with pytest.raises(KeyboardInterrupt), activations:
        model(x)
    if then == "train":
        model(x).sum().backward()
    params.detach()
    assert _no_saved_tensor_hooks()
    activations.close()
    store.close()
    a = torch.randn(1000, requires_grad=True)
    (a * a).sum().backward()  # (autograd after the store closed: no hook of ours in the way)
    assert torch.equal(a.grad, 2 * a.detach())


def test_a_forward_called_from_deeper_code_after_ctrl_c_still_recovers(device_mode: str) -> None:
    """The next forward after the aborted one comes from a helper (an evaluation), deeper in the
    stack than the loop that was interrupted: the aborted forward is over all the same."""
    model = Encoder()
    twin = copy.deepcopy(model)
    interrupt = Interrupt(KeyboardInterrupt("injected"))
    model.layers[1].linear1.register_forward_hook(interrupt)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()
    try:
        params = offload_parameters(model, store)
        x = torch.randn(4, 8, 64)

        def evaluate(net: nn.Module) -> torch.Tensor:
            with torch.no_grad():
                return net(x)

        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            model(x)
        assert torch.equal(evaluate(model), evaluate(twin))
        assert _no_saved_tensor_hooks()
        params.detach()
    finally:
        store.close()


@pytest.mark.parametrize("then", ["close the store", "drop the model"])
def test_ctrl_c_in_a_forward_then_closing_or_dropping_lets_go_of_the_model(device_mode: str, then: str) -> None:
    """Torch's stack of saved-tensor hooks is the thread's own, so neither the store's close
    (on its loop) nor a dropped offloader could pop what the aborted forward pushed: the hooks
    held the offloader, and with it the model, for good, and every later saved tensor of the
    thread went through them. They now hold it weakly, and the first saved tensor after it is
    closed or collected takes them off the stack."""
    import gc
    import weakref

    model = Encoder()
    interrupt = Interrupt(KeyboardInterrupt("injected"))
    model.layers[1].linear1.register_forward_hook(interrupt)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()
    params = offload_parameters(model, store)
    interrupt.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(4, 8, 64))
    interrupt.error = KeyboardInterrupt()  # (the raised one's traceback holds the aborted forward's frames, as a notebook's %debug does)
    assert not _no_saved_tensor_hooks()  # (what the aborted forward left)
    if then == "close the store":
        store.close()
    model_ref, params_ref = weakref.ref(model), weakref.ref(params)
    del model, params
    gc.collect()
    assert model_ref() is None and params_ref() is None
    a = torch.randn(1000, requires_grad=True)
    (a.sin() * a).sum().backward()  # (saves tensors: the first one takes the hooks off)
    torch.testing.assert_close(a.grad, a.detach().cos() * a.detach() + a.detach().sin(), rtol=0, atol=0)
    assert _no_saved_tensor_hooks()
    if then == "drop the model":
        store.close()


def test_backward_of_a_graph_whose_offloader_was_dropped_still_runs(device_mode: str) -> None:
    """The graph, not the hooks, keeps the offloader alive for backward: the loss kept, the
    model and its offloader dropped, backward still finds the weights it saved."""
    import gc

    model = Encoder()
    twin = copy.deepcopy(model)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()
    try:
        offload_parameters(model, store)
        x = torch.randn(4, 8, 64)
        params = list(model.parameters())
        loss = model(x).square().mean()
        del model
        gc.collect()
        loss.backward()
        twin(x).square().mean().backward()
        for ours, theirs in zip(params, twin.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)
    finally:
        store.close()


def test_hooks_left_by_an_aborted_forward_hand_later_tensors_to_the_hooks_below(device_mode: str) -> None:
    """(From review.) Once their offloader was closed, the abandoned hooks kept the next saved
    tensor themselves: a ``saved_tensors_hooks`` block the user entered before the aborted
    forward never saw it. They now pass it to the hooks below, as torch would have."""
    seen: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> object:
        seen.append(tuple(t.shape))
        return ("mine", t)

    def unpack(packed: object) -> torch.Tensor:
        assert isinstance(packed, tuple) and packed[0] == "mine"
        return packed[1]

    model = Encoder()
    interrupt = Interrupt(KeyboardInterrupt("injected"))
    model.layers[1].linear1.register_forward_hook(interrupt)
    store = SyncTierStore([DeviceTier("cpu", "160KiB"), HostTier("64MiB")]).open()
    offload_parameters(model, store)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(4, 8, 64))
        store.close()
        a = torch.randn(7, requires_grad=True)
        seen.clear()
        (a.sin() * a).sum().backward()  # (sin saves a; mul saves sin(a) and a)
        assert seen == [(7,)] * 3
    torch.testing.assert_close(a.grad, a.detach().cos() * a.detach() + a.detach().sin(), rtol=0, atol=0)
    assert _no_saved_tensor_hooks()
