"""What offload_activations brings back lives no longer than torch would keep it: each saved
tensor is freed once backward used it (and a freed graph's values leave the store), and saved
tensors that are not plain strided ones (sparse, nested) stay as they are."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.swap import offload_activations

pytestmark = pytest.mark.device_modes


@pytest.fixture
def sync() -> Iterator[SyncTierStore]:
    store = SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256MiB")]).open()
    yield store
    store.close()


class _Square(torch.autograd.Function):
    """x * x, noting (weakly) the memory of the tensor backward got back for x."""

    seen: list[int] = []  # weak references to storages (torch's: a tensor object is a fresh wrapper each time)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        _Square.seen.append(x.untyped_storage()._weak_ref())
        return 2 * x * grad


def _wait_empty(store: SyncTierStore) -> int:
    deadline = time.monotonic() + 10
    while len(store) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return len(store)


def test_what_backward_got_back_is_freed_once_it_was_used(sync: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(sync, min_bytes=1024)
    try:
        _Square.seen = []
        x = torch.randn(4, 4096, requires_grad=True)
        with acts:
            y = x
            for _ in range(4):
                y = _Square.apply(y.tanh())
            loss = y.sum()
        time.sleep(0.2)  # (the copies into the store end: backward gets them back from it)
        loss.backward()
        del loss, y
        gc.collect()
        assert len(_Square.seen) == 4
        alive = [ref for ref in _Square.seen if not torch.UntypedStorage._expired(ref)]
        assert not alive, f"{len(alive)} saved tensors brought back are still alive after backward"
        assert _wait_empty(sync) == 0
    finally:
        acts.close()


def test_a_graph_freed_without_backward_leaves_the_store_before_the_next_step(sync: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(sync, min_bytes=1024)
    try:
        x = torch.randn(4, 4096, requires_grad=True)
        with acts:
            loss = (x.tanh() * 3).tanh().sum()
        assert acts.report.offloaded > 0
        deadline = time.monotonic() + 10
        while len(sync) < acts.report.offloaded and time.monotonic() < deadline:  # (the copies land: else the
            time.sleep(0.01)  # store looks empty before they do)
        del loss
        gc.collect()
        assert _wait_empty(sync) == 0
    finally:
        acts.close()


def test_sparse_and_nested_saved_tensors_stay_as_they_are(sync: SyncTierStore, device_mode: str) -> None:
    torch.manual_seed(0)
    adjacency = ((torch.rand(100, 100) < 0.05).float()).to_sparse()
    layer = torch.nn.Linear(16, 16)
    features = torch.randn(100, 16)
    acts = offload_activations(sync, min_bytes=0)
    try:
        with acts:
            loss = torch.sparse.mm(adjacency, layer(features)).sum()
        loss.backward()
        offloaded = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        torch.sparse.mm(adjacency, layer(features)).sum().backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(offloaded, layer.parameters(), strict=True))
        nested = torch.nested.nested_tensor([torch.randn(3, 16), torch.randn(5, 16)], requires_grad=True)
        with acts:
            out = layer(nested)
        torch.nested.to_padded_tensor(out, 0.0).sum().backward()
        assert nested.grad is not None
    finally:
        acts.close()


def test_a_closed_offload_cannot_be_entered_again(sync: SyncTierStore) -> None:
    """A tryout: ``with offload:`` after ``offload.close()`` went on writing into the namespace
    it had given up, which the next ``offload_activations`` claimed: both wrote the same keys,
    and one graph's backward used the other's activations (wrong gradients, no error)."""
    first = offload_activations(sync, min_bytes=0)
    first.close()
    with pytest.raises(RuntimeError, match="was closed"), first:
        pass
    second = offload_activations(sync, min_bytes=0)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with second:
        loss = m(x).sum()
    loss.backward()
    second.close()


def test_a_put_that_failed_leaves_no_unretrieved_task_errors(device_mode: str) -> None:
    """A tryout: activations larger than the host tier failed at backward (they stay in
    memory for it now: ``tests/test_swap_refused.py``), and each saved tensor's clean-up task
    then raised the put's error again, which asyncio logged as "Task exception was never
    retrieved" with a full traceback (at exit)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import gc, torch
        from tierstore import DeviceTier, HostTier, SyncTierStore
        from tierstore.swap import offload_activations
        store = SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("1MiB")]).open()
        offload = offload_activations(store, min_bytes=0)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        with offload:
            loss = m(torch.randn(4096, 256)).square().mean()  # (4 MiB saved)
        loss.backward()
        print("backward ran, refused:", offload.report.refused > 0)
        del loss
        gc.collect()
        """
    )
    env = {**os.environ, "TIERSTORE_EMULATE_DEVICE": "1" if device_mode == "emulated" else "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backward ran, refused: True" in result.stdout
    assert "more than tier 'host' holds" in result.stderr  # (the warning says why)
    assert "never retrieved" not in result.stderr, result.stderr[-3000:]


def test_a_graph_whose_offloader_was_closed_raises_instead_of_reading_another_graphs_values(
    sync: SyncTierStore, device_mode: str
) -> None:
    """``close()`` while a graph still held offloaded activations dropped them, and a new
    offloader claimed the same namespace and wrote the same keys: the first graph's backward
    took the second forward's activations (wrong gradients, no error), its freed handles
    deleted the second's keys, and a backward after ``close()`` alone raised a bare
    ``KeyNotFoundError`` (a tryout). Now such a backward says what happened, and the second
    graph trains as if the first had never been."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64)
    expected = torch.autograd.grad(model(x2).sum(), list(model.parameters()))
    first = offload_activations(sync, min_bytes=0)
    with first:
        y1 = model(x1)
    first.close()
    second = offload_activations(sync, min_bytes=0)
    try:
        with second:
            y2 = model(x2)
        with pytest.raises(RuntimeError, match=r"offload_activations object that saved it was closed"):
            torch.autograd.grad(y1.sum(), list(model.parameters()))
        del y1
        gc.collect()
        time.sleep(0.1)  # (a freed handle's key would be deleted on the loop by now)
        got = torch.autograd.grad(y2.sum(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    finally:
        second.close()


def test_a_close_on_another_thread_between_backwards_check_and_its_read_is_refused(
    sync: SyncTierStore, device_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer: backward checked that its offloader was open, then read the value; a
    ``close()`` on another thread in between, and a new offloader writing the same key, gave
    the old backward the new forward's activation (wrong gradient, no error). The read now
    checks again on the store's loop, where the close's drop runs. The pause between backward's
    check and its read is injected by wrapping the offloader's fetch (the test's only use of an
    internal), as a thread switch there would place it."""
    import threading

    from tierstore.swap import activations

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256))
    x1, x2 = torch.randn(256, 256), torch.randn(256, 256) * 100
    first = offload_activations(sync, min_bytes=0)
    with first:
        y1 = (x1 @ w).sum()
    deadline = time.monotonic() + 10
    while first.report.bytes_out < x1.nbytes and time.monotonic() < deadline:
        time.sleep(0.005)  # (its copy into the store ended: backward reads it back, not the tensor itself)
    checked, go = threading.Event(), threading.Event()
    fetch = activations.ActivationOffload._fetch

    def paused(self: Any, saved: Any) -> None:
        if self is first:
            checked.set()
            go.wait(10)
        fetch(self, saved)

    monkeypatch.setattr(activations.ActivationOffload, "_fetch", paused)
    outcome: dict[str, Any] = {}

    def backward() -> None:
        try:
            outcome["grad"] = torch.autograd.grad(y1, [w])[0]
        except RuntimeError as error:
            outcome["error"] = str(error)

    thread = threading.Thread(target=backward)
    thread.start()
    assert checked.wait(10)
    first.close()
    second = offload_activations(sync, min_bytes=0)
    try:
        with second:
            y2 = (x2 @ w).sum()
        go.set()
        thread.join(30)
        assert "grad" not in outcome and "was closed before this backward" in outcome.get("error", ""), outcome
        assert torch.equal(torch.autograd.grad(y2, [w])[0], torch.autograd.grad((x2 @ w).sum(), [w])[0])
    finally:
        go.set()
        second.close()
