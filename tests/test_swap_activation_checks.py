"""offload_activations refuses what would go wrong later: a `with` inside its own `with`, a tier
the store lacks, and a saved tensor changed in place while it was being copied (torch raises for
that without hooks; behind a background copy the gradient would depend on timing)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tierstore import DeviceTier, HostTier, SyncTierStore, UnknownTierError
from tierstore.swap import offload_activations
from tierstore.sync import loop_thread

pytestmark = pytest.mark.device_modes


@pytest.fixture
def sync() -> Iterator[SyncTierStore]:
    store = SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]).open()
    yield store
    store.close()


@contextmanager
def loop_blocked() -> Iterator[None]:
    """The store's loop thread busy (no copy into the store makes progress) until the block ends."""
    started, release = threading.Event(), threading.Event()

    async def block() -> None:
        started.set()
        release.wait(30)  # (blocking the loop on purpose)

    future = asyncio.run_coroutine_threadsafe(block(), loop_thread())
    started.wait(30)
    try:
        yield
    finally:
        release.set()
        future.result(30)


def test_a_with_inside_its_own_with_is_refused_and_leaves_no_hooks(sync: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(sync, min_bytes=0)
    w = torch.randn(64, 64, requires_grad=True)
    with acts:
        with pytest.raises(RuntimeError, match="entered already"), acts:
            pass
        (w * 2).sin().sum().backward()
    offloaded = acts.report.offloaded
    (w * 2).sin().sum().backward()  # outside any `with`: nothing is offloaded
    assert acts.report.offloaded == offloaded
    acts.close()


@pytest.mark.parametrize("argument", ["tier", "device_tier"])
def test_a_tier_the_store_lacks_is_refused_at_once(sync: SyncTierStore, device_mode: str, argument: str) -> None:
    with pytest.raises(UnknownTierError, match=f"{argument}='nope'"):
        offload_activations(sync, min_bytes=0, **{argument: "nope"})


def test_a_change_in_place_before_the_copy_ended_raises_in_backward(sync: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(sync, min_bytes=0)
    w = torch.randn(256, 256, requires_grad=True)
    for _ in range(3):  # every time, not by chance
        with loop_blocked():
            with acts:
                x = w * 2
                y = x.sin()
            x.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()  # asked again: still refused, as torch refuses it again
    # The offload and the store go on as before.
    w.grad = None
    with acts:
        loss = (w * 2).sin().sum()
    loss.backward()
    assert torch.equal(w.grad, torch.cos(w.detach() * 2) * 2)
    acts.close()


def test_a_change_after_the_copy_ended_gives_the_gradient_of_the_value_saved(sync: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(sync, min_bytes=0)
    w = torch.randn(256, 256, requires_grad=True)
    with acts:
        x = w * 2
        y = x.sin()
    deadline = time.monotonic() + 30
    while acts.report.bytes_out < x.nbytes and time.monotonic() < deadline:  # its copy has ended
        time.sleep(0.01)
    x.add_(1)
    y.sum().backward()
    assert torch.equal(w.grad, torch.cos(w.detach() * 2) * 2)  # as torch's save_on_cpu gives
    acts.close()


def test_a_change_after_backward_took_the_tensor_itself_raises_in_the_next_backward(sync: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(sync, min_bytes=0)
    w = torch.randn(256, 256, requires_grad=True)
    with loop_blocked():  # backward comes while the copy has not ended: it takes the tensor itself
        with acts:
            x = w * 2
            y = x.sin()
        y.sum().backward(retain_graph=True)
    assert acts.report.early == 1
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    acts.close()


class _SavesStrides(torch.autograd.Function):
    """``x @ w`` saving both; its backward records the strides it got them with."""

    seen: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        _SavesStrides.seen = [x.stride(), w.stride()]
        return grad @ w.t(), x.t() @ grad


def test_a_saved_tensor_comes_back_with_its_strides(sync: SyncTierStore, device_mode: str) -> None:
    """A transposed or channels_last activation came back from the store contiguous: backward's
    kernels took other paths (a matmul sums in another order) and the gradients of a compiled
    T5 with TieredAdamW differed in the last bits, depending on whether the copy had ended
    before backward took the tensor. It is stored in its memory order and given back so."""
    acts = offload_activations(sync, min_bytes=0)
    torch.manual_seed(0)
    base, w = torch.randn(96, 64), torch.randn(64, 32, requires_grad=True)
    x = base.t().contiguous().t().requires_grad_()  # (strides (1, 96): a transposed layout)
    image = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    with acts:
        y = _SavesStrides.apply(x, w)
        z = (image * 3).sin()
    deadline = time.monotonic() + 30
    while acts.report.bytes_out < x.nbytes + image.nbytes and time.monotonic() < deadline:  # (w is a leaf: kept)
        time.sleep(0.01)  # (every copy ended: backward gets the stored values)
    assert acts.report.early == 0
    (y.sum() + z.sum()).backward()
    assert _SavesStrides.seen == [x.stride(), w.stride()]
    expected_x, expected_w = torch.ones(96, 32) @ w.detach().t(), x.detach().t() @ torch.ones(96, 32)
    assert torch.equal(x.grad, expected_x) and torch.equal(w.grad, expected_w)
    assert torch.equal(image.grad, (image.detach() * 3).cos() * 3)
    acts.close()


def test_a_saved_tensor_with_gaps_comes_back_dense_in_its_order_of_strides(sync: SyncTierStore, device_mode: str) -> None:
    """A slice of a transposed tensor has no memory order (it has gaps): it came back row-major,
    the other way round from what backward got when it took the tensor before its copy ended.
    It comes back dense with its dimensions in the same order of strides."""
    acts = offload_activations(sync, min_bytes=0)
    torch.manual_seed(0)
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(64, 96).t()[:48].requires_grad_()  # (48, 64) with strides (1, 96): gaps
    with acts:
        y = _SavesStrides.apply(x, w)
    deadline = time.monotonic() + 30
    while acts.report.bytes_out < x.nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert acts.report.early == 0
    y.sum().backward()
    assert _SavesStrides.seen == [(1, 48), w.stride()]
    assert torch.equal(x.grad, torch.ones(48, 32) @ w.detach().t())
    assert torch.equal(w.grad, x.detach().t() @ torch.ones(48, 32))
    acts.close()


def test_an_expanded_view_comes_back_laid_out_as_torch_copies_it(sync: SyncTierStore, device_mode: str) -> None:
    """Ordered by strides alone, an expanded view's broadcast dimension (stride 0) went innermost
    and the reduction over it in backward summed in another order: gradients off by 5e-5. It is
    laid out as ``torch.empty_like`` lays out its copy (row-major here), as before."""
    acts = offload_activations(sync, min_bytes=0)
    torch.manual_seed(0)
    b = torch.randn(1, 517, requires_grad=True)

    def grad(offloaded: bool) -> torch.Tensor:
        b.grad = None
        with acts if offloaded else contextlib.nullcontext():
            loss = (b * 1.0).expand(300, 517).logsumexp(-1).pow(2).sum()
        deadline = time.monotonic() + 30
        while offloaded and acts.report.bytes_out < (300 * 517 + 2 * 300) * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        loss.backward()
        return b.grad.clone()

    assert torch.equal(grad(False), grad(True))
    assert acts.report.early == 0 and acts.report.offloaded >= 1
    acts.close()


@pytest.mark.parametrize("which", ["activations", "parameters"])
def test_a_store_the_user_closed_is_refused_not_opened_again(device_mode: str, which: str) -> None:
    """``offload_activations``/``offload_parameters`` opened a store the user had closed again
    (a tryout), where ``TieredAdamW`` refuses it; a store never opened is still opened."""
    from tierstore import StoreClosedError
    from tierstore.swap import offload_parameters

    def make(store: SyncTierStore) -> object:
        return offload_activations(store) if which == "activations" else offload_parameters(torch.nn.Linear(4, 4), store)

    store = SyncTierStore([DeviceTier("cpu", "8MiB"), HostTier("8MiB")]).open()
    store.close()
    with pytest.raises(StoreClosedError, match=f"offload_{which}: the store given was closed"):
        make(store)
    assert not store.store.is_open
    fresh = SyncTierStore([DeviceTier("cpu", "8MiB"), HostTier("8MiB")])
    offloader = make(fresh)
    try:
        assert fresh.store.is_open
    finally:
        offloader.detach() if which == "parameters" else offloader.close()  # type: ignore[attr-defined]
        fresh.close()
