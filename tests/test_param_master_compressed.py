"""Compressed Adam state of an fp32 parameter in host memory keeps no master copy: the parameter
is the master (as with fp32 state), updated in place by the compressed update.

The reference is the same optimizer under the emulated device (``emulate_device()``), where
the parameter sits across a link and the state keeps its fp32 master, as every compressed state
did before: the numbers must be the same bit for bit, the entries 4 B a parameter smaller."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.adamw import adamw

from tierstore import SyncTierStore
from tierstore.device import emulate_device
from tierstore.optim import TieredAdamW
from tierstore.optim.precision import (
    BLOCK,
    AdamHyper,
    PackedState,
    StateLayout,
    keeps_no_master,
    planned_state_bytes,
)
from tierstore.tiers import DiskTier, HostTier

#: Compressed settings whose master may be the parameter (a lossless master needs bf16 ones).
PRECISIONS = ("bf16", "8bit")


def _model() -> torch.nn.Module:
    """A wide layer (the fused 8-bit kernels: 40,960 elements), a bias with a partial block,
    a small layer and a bias too small to page (min_offload_numel=100)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 160), torch.nn.Tanh(), torch.nn.Linear(160, 7))


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        if seed == 1:
            with torch.no_grad():  # a write from outside between steps: the next update starts from it
                next(model.parameters()).mul_(0.5)
        _backward(model, seed)
        opt.step()
        opt.zero_grad()


@contextmanager
def _kept_master(kept: bool) -> Iterator[None]:
    """Optimizers made inside keep the master in their state (emulated device) when ``kept``."""
    with emulate_device(kept):
        yield


def _run(kept: bool, make: Callable[[torch.nn.Module], TieredAdamW], seeds: range = range(4)) -> tuple[torch.nn.Module, dict[str, Any], int]:
    """Train a fresh model; return it, the optimizer's state_dict and its stored state bytes."""
    model = _model()
    with _kept_master(kept):
        opt = make(model)
        try:
            _train(model, opt, seeds)
            report = opt.memory_report()
            stored = sum(report.state_by_tier.values()) + report.resident_state_bytes
            return model, opt.state_dict(), stored
        finally:
            opt.close()


def _assert_same(a: tuple[torch.nn.Module, dict[str, Any], int], b: tuple[torch.nn.Module, dict[str, Any], int]) -> None:
    for (name, x), y in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert torch.equal(x, y), name
    state_a, state_b = a[1]["state"], b[1]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        assert state_a[index].keys() == state_b[index].keys()
        assert "master" not in state_a[index]  # fp32 parameters: torch's format has no master
        for key in state_a[index]:
            assert torch.equal(state_a[index][key], state_b[index][key]), (index, key)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_same_bits_as_with_a_master_kept_apart(precision: str, amsgrad: bool, chunked: bool) -> None:
    def make(model: torch.nn.Module) -> TieredAdamW:
        return TieredAdamW(model.parameters(), lr=3e-3, amsgrad=amsgrad, state_precision=precision, min_offload_numel=100,
                           chunk_bytes="16KiB" if chunked else None)

    own, kept = _run(False, make), _run(True, make)
    _assert_same(own, kept)
    numel = sum(p.numel() for p in _model().parameters())
    assert kept[2] - own[2] == 4 * numel  # the fp32 master, 4 B a parameter, is not stored


def test_the_same_bits_stepping_in_backward() -> None:
    def make(model: torch.nn.Module) -> TieredAdamW:
        return TieredAdamW(model.parameters(), lr=3e-3, state_precision="8bit", min_offload_numel=100, step_in_backward=True)

    _assert_same(_run(False, make), _run(True, make))


@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize("precision, per_param, words", [("bf16", 4.0, "bf16"), ("8bit", 2 + 8 / BLOCK, "8-bit")])
def test_bytes_stored_and_reported(precision: str, per_param: float, words: str, kept: bool) -> None:
    model = torch.nn.Linear(256, 64, bias=False)  # 16,384 elements: 64 blocks
    with _kept_master(kept):
        opt = TieredAdamW(model.parameters(), state_precision=precision, chunk_bytes=None)
        # (the estimate made before any optimizer, to size tiers, follows the optimizer's rule)
        estimate = planned_state_bytes(model.weight, precision)
        assert keeps_no_master(model.weight) is not kept
    kept_words = "fp32 master" if kept else "no master copy (the fp32 weight is the master)"
    per_param += 4.0 if kept else 0.0
    try:
        planned = opt.memory_plan().paged_state_bytes
        _backward_linear(model, opt)
        assert opt.namespace is not None
        (key,) = [k for k in opt.namespace.keys() if not k.endswith("/grad")]
        assert opt.store.info(key)["nbytes"] == per_param * model.weight.numel() == planned == estimate
        report = opt.memory_report()
        assert sum(report.state_by_tier.values()) == per_param * model.weight.numel()
        assert list(report.state_contents) == [f"{kept_words} + {words} moments"]
        assert StateLayout(precision, False, False, param_master=not kept).nbytes(model.weight.numel()) == per_param * model.weight.numel()
    finally:
        opt.close()


def test_a_bf16_parameter_keeps_its_master() -> None:
    model = torch.nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    with _kept_master(False):
        opt = TieredAdamW(model.parameters(), state_precision="8bit", chunk_bytes=None)
    try:
        _backward_linear(model, opt)
        assert sum(opt.memory_report().state_by_tier.values()) == (6 + 8 / BLOCK) * model.weight.numel()
        assert "master" in opt.state_dict()["state"][0]
    finally:
        opt.close()


def _backward_linear(model: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, model.in_features, generator=torch.Generator().manual_seed(0), dtype=model.weight.dtype)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_checkpoint_continues_bit_for_bit(precision: str) -> None:
    def make(model: torch.nn.Module) -> TieredAdamW:
        return TieredAdamW(model.parameters(), lr=3e-3, state_precision=precision, min_offload_numel=100, chunk_bytes="16KiB")

    straight = _run(False, make, range(5))
    model = _model()
    with _kept_master(False):
        opt = make(model)
    try:
        _train(model, opt, range(3))
        saved, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
    model = _model()
    model.load_state_dict(weights)
    with _kept_master(False):
        opt = make(model)
    try:
        opt.load_state_dict(saved)
        _train(model, opt, range(3, 5))
        _assert_same((model, opt.state_dict(), 0), straight)
    finally:
        opt.close()


@pytest.mark.parametrize("first_kept", [False, True])
def test_a_named_namespace_continues_across_the_two_layouts(tmp_path: Path, first_kept: bool) -> None:
    """State left by ``close()`` with the master kept apart is continued where the parameter is
    the master, and the other way round: nothing dropped, the same bits as one run."""

    def make(model: torch.nn.Module) -> TieredAdamW:
        return TieredAdamW(model.parameters(), lr=3e-3, state_precision="8bit", min_offload_numel=100, chunk_bytes="16KiB")

    straight = _run(False, make)
    model = _model()
    for kept, seeds in ((first_kept, range(2)), (not first_kept, range(2, 4))):
        store = SyncTierStore([HostTier("128KiB"), DiskTier(tmp_path / "store", "16MiB")]).open()
        with _kept_master(kept), warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of the saved state may be dropped
            opt = TieredAdamW(model.parameters(), lr=3e-3, store=store, namespace="run", state_precision="8bit",
                              min_offload_numel=100, chunk_bytes="16KiB")
        try:
            with _kept_master(kept):
                _train(model, opt, seeds)
            last = opt.state_dict()
        finally:
            opt.close()
            store.close()
    _assert_same((model, last, 0), straight)


@pytest.mark.parametrize("kernel", ["C", "inductor", "unfused"])
def test_packed_state_updates_the_given_master_in_place(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PackedState`` over a ``param_master`` layout: the same bits as the layout with a master
    field, written into the given memory (the fused kernels, C or compiled, and the unfused path)."""
    if kernel == "inductor":
        monkeypatch.setenv("TIERSTORE_NATIVE_ADAM8", "0")
    numel = 33_000  # compiled sizes (COMPILE_MIN_NUMEL), whole blocks and a partial last one
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(numel, generator=generator) * 0.02
    hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, True)

    def adam(rows: list[torch.Tensor], grad: torch.Tensor, step: torch.Tensor) -> None:
        adamw([rows[0]], [grad], [rows[1]], [rows[2]], [], [step], foreach=False, fused=True, amsgrad=False,
              beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.1, eps=1e-8, maximize=False)

    stored = StateLayout("8bit", False, False)
    with_field = PackedState(stored, stored.empty(numel), numel)
    with_field.set_master(start)
    own = StateLayout("8bit", False, False, param_master=True)
    param = start.clone()
    address = param.data_ptr()
    lent = PackedState(own, own.empty(numel), numel, master=param)
    steps = [torch.tensor(0.0), torch.tensor(0.0)]
    for _ in range(3):
        grad = torch.randn(numel, generator=generator) * 1e-3
        given = None if kernel == "unfused" else hyper
        with_field.update(grad.clone(), steps[0], adam, given)
        lent.update(grad.clone(), steps[1], adam, given)
    assert param.data_ptr() == address and not torch.equal(param, start)
    assert torch.equal(param, with_field.master()) and lent.weight() is param
    assert torch.equal(lent.decode(), with_field.decode())
    assert float(steps[0]) == float(steps[1]) == 3
    assert lent.buffer.numel() == with_field.buffer.numel() - 4 * numel


def test_a_layout_whose_master_is_the_parameter_needs_it() -> None:
    own = StateLayout("bf16", False, False, param_master=True)
    with pytest.raises(ValueError, match="flat contiguous fp32"):
        PackedState(own, own.empty(512), 512)
    with pytest.raises(ValueError, match="flat contiguous fp32"):
        PackedState(own, own.empty(512), 512, master=torch.zeros(512, dtype=torch.bfloat16))
    stored = StateLayout("bf16", False, False)
    with pytest.raises(ValueError, match="stores its master"):
        PackedState(stored, stored.empty(512), 512, master=torch.zeros(512))
    with pytest.raises(ValueError, match="lossless"):
        StateLayout("8bit", True, False, param_master=True)
