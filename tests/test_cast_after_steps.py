"""A model cast to bf16 after some steps (``model.to(torch.bfloat16)``). On the plain CPU an fp32
parameter is its own fp32 master; after the cast the master was rebuilt from the bf16 parameter
at every update, so every change smaller than a bf16 step was lost and the parameter stopped
training (a constant gradient left it at 1.0 for good). The optimizer now keeps an fp32 master
apart from then on, loaded once from the cast parameter, as the emulated device (whose master
is always apart) did: both are checked against torch's AdamW on an fp32 master."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes

SETTINGS: dict[str, dict[str, Any]] = {
    "host": {},
    "disk, chunked": {"offload": "disk", "min_offload_numel": 1, "chunk_bytes": "16KiB", "host_capacity": "64KiB"},
    "in backward": {"step_in_backward": True},
}


def _grads(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(shape, generator=generator) * 1e-3 + 1.0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_training_goes_on_after_a_cast_to_bf16(setting: str, device_mode: str, tmp_path: Path) -> None:
    shape = (64, 96)
    torch.manual_seed(0)
    model = torch.nn.Linear(shape[1], shape[0], bias=False)
    start = model.weight.detach().clone()
    options = dict(SETTINGS[setting])
    if options.get("offload") == "disk":
        options["disk_root"] = tmp_path / "disk"
    opt = TieredAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True, **options)
    # the reference: torch's AdamW on an fp32 master, its weight cast to bf16 where ours is
    master = torch.nn.Parameter(start.clone())
    reference = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.01, fused=True)
    inputs = torch.ones(1, shape[1])

    def step(index: int, dtype: torch.dtype) -> None:
        model.weight.grad = None
        grad = _grads(index, shape).to(dtype)
        if options.get("step_in_backward"):  # (the gradient comes from backward, where the update runs)
            out = (model(inputs.to(dtype)) * 0).sum()
            handle = model.weight.register_hook(lambda g, grad=grad: grad)
            out.backward()
            handle.remove()
        else:
            model.weight.grad = grad
        opt.step()
        master.grad = grad.float()
        reference.step()

    for index in range(3):
        step(index, torch.float32)
    assert torch.equal(model.weight.detach(), master.detach())
    model.to(torch.bfloat16)
    with torch.no_grad():
        master.copy_(master.to(torch.bfloat16).float())  # (the cast: the master's bits beyond bf16 are gone)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(3, 40):
            step(index, torch.bfloat16)
    assert torch.equal(model.weight.detach(), master.detach().to(torch.bfloat16))
    assert not torch.equal(model.weight.detach(), start.to(torch.bfloat16))
    saved = opt.state_dict()["state"][0]
    assert torch.equal(saved["exp_avg"], reference.state[master]["exp_avg"])
    if "master" in saved:
        assert torch.equal(saved["master"], master.detach())
    if device_mode == "plain":  # (the emulated device always kept its master apart: nothing moves)
        assert any("keeps an fp32 master apart" in str(w.message) for w in caught)
    opt.close()


def test_a_master_loaded_after_the_cast_is_kept_whole(device_mode: str) -> None:
    """An fp32 master loaded (``load_state_dict``) into a parameter that was its own master and
    is bf16 now was written into the parameter and lost its low bits; it is kept apart now."""
    shape = (16, 24)
    torch.manual_seed(0)
    ours = torch.nn.Linear(shape[1], shape[0], bias=False)
    theirs = torch.nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    opt = TieredAdamW(ours.parameters(), lr=1e-3)
    other = TieredAdamW(theirs.parameters(), lr=1e-3)
    for index in range(3):
        ours.weight.grad = _grads(index, shape)
        opt.step()
        theirs.weight.grad = _grads(index, shape).to(torch.bfloat16)
        other.step()
    saved = other.state_dict()
    assert not torch.equal(saved["state"][0]["master"], saved["state"][0]["master"].to(torch.bfloat16).float())
    ours.to(torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.load_state_dict(saved)
    assert torch.equal(opt.state_dict()["state"][0]["master"], saved["state"][0]["master"])
    for index in range(3, 6):
        for model, optimizer in ((ours, opt), (theirs, other)):
            model.weight.grad = _grads(index, shape).to(torch.bfloat16)
            optimizer.step()
    assert torch.equal(ours.weight, theirs.weight)
    assert torch.equal(opt.state_dict()["state"][0]["master"], other.state_dict()["state"][0]["master"])
    opt.close()
    other.close()


def _tight_8bit_optimizer(tmp_path: Path) -> tuple[torch.nn.Linear, TieredAdamW]:
    """An fp32 layer with 8-bit state paged in chunks planned for a host tier with little room
    beyond them, after two steps (the parameter its own master on the plain CPU)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    opt = TieredAdamW(model.parameters(), state_precision="8bit", offload="disk", disk_root=tmp_path / "d", min_offload_numel=1,
                      chunk_bytes="64KiB", host_capacity="128KiB")
    for _ in range(2):
        model.weight.grad = torch.randn(256, 256)
        opt.step()
    return model, opt


def test_a_cast_whose_master_cannot_fit_is_refused_clearly_and_loses_nothing(tmp_path: Path, device_mode: str) -> None:
    """Keeping the master apart makes 8-bit state three times larger: chunks planned for the
    smaller layout no longer fit the host tier. Every step then failed with a TierFullError and
    advice to call step() again that failed the same way; now it says why, with the state as it
    was (the cast parameter's moments and count unchanged)."""
    if device_mode == "emulated":
        pytest.skip("on a device the master is always apart: nothing moves")
    from tierstore.optim import StepIncompleteError

    model, opt = _tight_8bit_optimizer(tmp_path)
    before = opt.state_dict()["state"][0]
    model.to(torch.bfloat16)
    model.weight.grad = torch.randn(256, 256).to(torch.bfloat16)
    for _ in range(2):  # (and again: the same answer, not a different failure)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(StepIncompleteError, match="can no longer be its own fp32 master"):
                opt.step()
    opt.zero_grad()
    after = opt.state_dict()["state"][0]
    assert torch.equal(after["exp_avg"], before["exp_avg"]) and torch.equal(after["step"], before["step"])
    assert opt.memory_plan().fits
    opt.close()


def test_a_state_loaded_after_the_cast_that_cannot_fit_is_refused_before_anything_is_written(tmp_path: Path, device_mode: str) -> None:
    """``load_state_dict`` after the cast moved the master apart without planning for it: the load
    failed part-way with a TierFullError and every later step with it."""
    if device_mode == "emulated":
        pytest.skip("on a device the master is always apart: nothing moves")
    from tierstore.optim import OptimizerCapacityError

    model, opt = _tight_8bit_optimizer(tmp_path)
    saved = opt.state_dict()
    model.to(torch.bfloat16)
    with pytest.raises(OptimizerCapacityError, match="can no longer be its own fp32 master"):
        opt.load_state_dict(saved)
    assert opt.memory_plan().fits
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    opt.close()


@pytest.mark.parametrize("capacity", ["80KiB", "160KiB"])
def test_steps_after_a_cast_that_shrinks_the_buckets_in_flight_succeed(tmp_path: Path, device_mode: str, capacity: str) -> None:
    """Once the master moved apart, fewer updates fit in flight; the places they take kept their
    old number, and later steps failed with TierFullError (for good at 80 KiB). The step in which
    the move happens may still need ``step()`` again (its runs were cut for the smaller state)."""
    from tierstore.optim import StepIncompleteError

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    opt = TieredAdamW(model.parameters(), state_precision="8bit", offload="disk", disk_root=tmp_path / "d", min_offload_numel=1,
                      chunk_bytes="16KiB", host_capacity=capacity, max_inflight=4)
    for _ in range(2):
        model.weight.grad = torch.randn(256, 256)
        opt.step()
    model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(4):
            model.weight.grad = torch.randn(256, 256).to(torch.bfloat16)
            try:
                opt.step()
            except StepIncompleteError:
                assert index == 0, "only the step that moved the master may need a second call"
                opt.step()
    assert opt.memory_plan().fits
    opt.close()
