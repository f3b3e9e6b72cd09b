"""A saved tensor the store cannot take (its tier has no room, and no disk below it): forward
went on, and backward raised the put's TierFullError although the tensor had never left memory:
the step was lost. Now backward gets the tensor itself (it stays in memory, counted as refused),
with one warning that says why; gradients are torch's, bit for bit."""

from __future__ import annotations

import copy
import gc
import time
import warnings
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.swap import offload_activations

pytestmark = pytest.mark.device_modes


@pytest.fixture
def small() -> Iterator[SyncTierStore]:
    store = SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("1MiB")]).open()
    yield store
    store.close()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _copies_ended(acts: object, timeout: float = 60.0) -> None:
    """Wait until every copy into the store has ended, stored or refused (each saved tensor
    here is 512 KiB)."""
    report = acts.report  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while report.bytes_out // (512 * 1024) + report.refused < report.offloaded + report.refused:
        assert time.monotonic() < deadline, report
        time.sleep(0.005)


def test_saved_tensors_a_full_tier_refuses_stay_in_memory_for_backward(small: SyncTierStore, device_mode: str) -> None:
    model, plain = _model(), _model()
    x = torch.randn(512, 256)  # (four saved activations of 512 KiB: the host tier holds one)
    plain(x).sum().backward()
    acts = offload_activations(small, min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acts:
            loss = model(x).sum()
        _copies_ended(acts)  # (else backward may take the tensors before their copies fail)
        loss.backward()  # (raised TierFullError before)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(plain), strict=True))
    report = acts.report
    assert report.refused >= 1
    assert report.kept >= report.refused and report.bytes_kept >= report.refused * 512 * 1024
    assert "refused by the store" in str(report)
    refusals = [w for w in caught if "refused a saved tensor" in str(w.message)]
    assert len(refusals) == 1, [str(w.message) for w in caught]  # (once, however many it refused)
    assert "TierFullError" in str(refusals[0].message) and "more room" in str(refusals[0].message)
    assert small.keys() == [] or all(not key.startswith(acts.prefix) for key in small.keys())

    # the store and the offloader go on: a step that fits is offloaded and exact
    again, reference = copy.deepcopy(model), copy.deepcopy(plain)
    for m in (again, reference):
        m.zero_grad()
    y = torch.randn(64, 256)
    reference(y).sum().backward()
    refused = report.refused
    with acts:
        loss = again(y).sum()
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(again), _grads(reference), strict=True))
    assert acts.report.refused == refused
    acts.close()


def test_a_refused_tensor_changed_in_place_before_backward_is_torchs_error(small: SyncTierStore, device_mode: str) -> None:
    acts = offload_activations(small, min_bytes=0)
    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with acts:
            hidden = [torch.tanh(x @ weight) for _ in range(4)]  # (tanh saves its output: 512 KiB each)
        loss = sum(h.sum() for h in hidden)
        with torch.no_grad():
            for h in hidden:
                h.add_(1.0)  # (during its copy or after the refusal: torch's error at backward either way)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        acts.close()
    assert acts.report.refused >= 1


def test_a_graph_with_refused_tensors_dropped_without_backward_is_freed(small: SyncTierStore, device_mode: str) -> None:
    """A refused output kept as itself (tanh saves its output) made a cycle through its grad_fn
    that the collector cannot see: a graph dropped without backward (an evaluation under grad
    mode, a skipped step) was never freed, nor the values it had stored, which filled the tier."""
    acts = offload_activations(small, min_bytes=0)
    weight = torch.randn(256, 256, requires_grad=True)
    alive = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            with acts:
                hidden = [torch.tanh(torch.randn(512, 256) @ weight) for _ in range(4)]
                loss = sum(h.sum() for h in hidden)
            alive += [weakref.ref(h) for h in hidden]
            del hidden, loss  # (no backward)
            gc.collect()
        acts.close()  # (waits for the copies; the values left are deleted)
    gc.collect()
    assert acts.report.refused >= 3
    assert [ref for ref in alive if ref() is not None] == []


def test_refused_tensors_are_not_counted_as_brought_back(device_mode: str) -> None:
    """Refused tensors were counted in ``bytes_in`` and ``prefetched`` (and took the ``ahead``
    budget meant for real prefetches)."""
    with SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("256KiB")]) as store:
        acts = offload_activations(store, min_bytes=0)
        model = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with acts:
                loss = model(torch.randn(512, 256)).sum()  # (every saved activation is 512 KiB: none fits)
            loss.backward()
        report = acts.report
        assert report.refused >= 2 and report.offloaded == 0 and report.bytes_out == 0
        assert report.bytes_in == 0 and report.prefetched == 0
        acts.close()
