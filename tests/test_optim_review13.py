"""Review of issue 13's optimizer changes: ``zero_grad()`` right after a backward whose updates
ran in it (gradients left on the device until their update), a parameter whose layout changes
mid-training, and writes to parameters from outside the optimizer between steps."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from flipped import flipped_byte

from tierstore import DiskTier, HostTier, TierStore
from tierstore.errors import StepIncompleteError
from tierstore.optim import TieredAdamW
from tierstore.sync import run
from tierstore.testing import settle

pytestmark = pytest.mark.device_modes

Edit = Callable[[torch.nn.Module], None]


def _stack() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))


def _paged(model: torch.nn.Module, tmp_path: Path, **options: Any) -> TieredAdamW:
    """State paging to the disk below a host tier smaller than it (gradients stay on the
    device until their update, across a link)."""
    store = TierStore([HostTier("160KiB"), DiskTier(tmp_path / "d", "16MiB", chunk_size="4KiB", inline_max=0)])
    return TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True, min_offload_numel=64, store=store, **options)


# -- 1. zero_grad() after a backward whose updates started in it ---------------------------------


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad_after_backward_lets_updates_in_flight_use_backwards_gradients(tmp_path: Path, set_to_none: bool) -> None:
    model, reference = _stack(), _stack()
    opt = _paged(model, tmp_path, step_in_backward=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    model(x).pow(2).mean().backward()
    opt.zero_grad(set_to_none=set_to_none)  # abandons the step: the updates started stay, as backward left them
    # what one step from backward's gradients gives (torch's AdamW)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    reference(x).pow(2).mean().backward()
    ref_opt.step()
    updated = 0
    for index, (p, old, stepped) in enumerate(zip(model.parameters(), before, reference.parameters(), strict=True)):
        if torch.equal(p, old):
            continue  # its bucket had not started: dropped with the step
        torch.testing.assert_close(p, stepped, rtol=0, atol=0, msg=lambda m, i=index: f"parameter {i}: {m}")
        updated += 1
    assert updated, "no update started in backward: the test shows nothing"
    opt.close()


@pytest.mark.parametrize("abandon", ["zero_grad", "close"])
def test_abandoning_raises_an_update_in_backward_that_failed(tmp_path: Path, abandon: str) -> None:
    model = _stack()
    opt = _paged(model, tmp_path, step_in_backward=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    opt.step()
    run(settle(opt.store))
    on_disk = [slot for slot in opt._slots if slot.paged and opt.store.where(slot.key) == ["disk"]]
    assert len(on_disk) > 1
    # Every state on disk corrupt, before backward's updates read them: the bucket left open when
    # the step is abandoned (the last gradients' to arrive, in an order the captures decide) is
    # dropped unstarted, so which one of them fails is not known; the others' updates started.
    with contextlib.ExitStack() as flips:
        for slot in on_disk:
            flips.enter_context(flipped_byte(opt.store, slot.key))
        model(x).pow(2).mean().backward()
        with pytest.raises(StepIncompleteError, match=r"failed for parameters .*step was abandoned") as caught:
            opt.zero_grad() if abandon == "zero_grad" else opt.close()
    failed = set(caught.value.not_updated)
    assert failed and failed <= {slot.index for slot in on_disk} and caught.value.__cause__ is not None
    if abandon == "close":
        assert opt.namespace is not None and not opt.namespace.live  # closed all the same
        return
    assert all(p.grad is None for p in model.parameters())  # cleared all the same
    model(x).pow(2).mean().backward()  # the next step runs
    opt.step()
    opt.close()




# -- 2. a parameter whose layout changes mid-training --------------------------------------------


def _conv() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 4))


def _train_conv(model: torch.nn.Module, opt: Any, edit_at: int, edit: Edit, steps: int = 5) -> None:
    data = torch.randn(steps, 2, 8, 6, 6, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        if step == edit_at:
            edit(model)
        opt.zero_grad()
        model(data[step]).pow(2).mean().backward()
        opt.step()


def _channels_last(model: torch.nn.Module) -> None:
    model.to(memory_format=torch.channels_last)


@pytest.mark.parametrize("paged", [False, True])
def test_channels_last_mid_training_keeps_the_state(tmp_path: Path, paged: bool) -> None:
    # Against torch's for-loop AdamW: its fused CPU kernel runs on memory order, and after the
    # change its (contiguous) moments and the channels-last parameter no longer agree on it.
    reference, model = _conv(), _conv()
    _train_conv(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False), 2, _channels_last)
    options: dict[str, Any] = {"offload": "disk", "disk_root": tmp_path, "host_capacity": "64KiB"} if paged else {}
    opt = TieredAdamW(model.parameters(), lr=1e-2, fused=False, foreach=False, min_offload_numel=64, **options)
    _train_conv(model, opt, 2, _channels_last)
    assert not model[0].weight.is_contiguous()
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert float(opt.state_dict()["state"][0]["step"]) == 5  # never restarted
    opt.close()


# -- 3. writes to parameters from outside the optimizer ---------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _halve_in_place(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def _load_halved(model: torch.nn.Module) -> None:
    model.load_state_dict({k: v * 0.5 for k, v in _mlp().state_dict().items()})


def _assign_data(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.data = p.data * 0.5


@pytest.mark.parametrize("edit", [_halve_in_place, _load_halved, _assign_data], ids=["no_grad-mul_", "load_state_dict", "p.data="])
@pytest.mark.parametrize("paged", [False, True])
def test_writes_from_outside_count_as_in_torch(tmp_path: Path, edit: Edit, paged: bool) -> None:
    reference, model = _mlp(), _mlp()
    _train_mlp(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True), edit)
    options: dict[str, Any] = {"offload": "disk", "disk_root": tmp_path, "host_capacity": "160KiB"} if paged else {}
    opt = TieredAdamW(model.parameters(), lr=1e-2, fused=True, min_offload_numel=64, **options)
    _train_mlp(model, opt, edit)
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    opt.close()


def _train_mlp(model: torch.nn.Module, opt: Any, edit: Edit, steps: int = 4) -> None:
    data = torch.randn(steps, 4, 64, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        if step == 2:
            edit(model)
        opt.zero_grad()
        model(data[step]).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("master_weights", ["fp32", "lossless"])
def test_a_bf16_parameter_written_from_outside_reloads_its_master_and_warns_once(master_weights: str) -> None:
    model = _mlp().to(torch.bfloat16)
    opt = TieredAdamW(model.parameters(), lr=1e-3, min_offload_numel=64, master_weights=master_weights)
    data = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    opt.zero_grad()
    model(data[0]).float().pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            opt.zero_grad()
            model(data[step]).float().pow(2).mean().backward()
            opt.step()
    reloads = [w for w in caught if "written from outside" in str(w.message)]
    assert len(reloads) == 1
    # two steps of lr 1e-3 from zero, not from the old weights (about 0.1)
    assert max(p.detach().abs().max().item() for p in model.parameters()) < 2.5e-3
    opt.close()


# -- 5. the learned schedule across a phase boundary no on_step marked -----------------------------


def test_an_alternating_schedule_follows_the_next_phase_when_no_step_is_marked() -> None:
    from policies.schedule import ScheduleLearned

    forward = [f"k{i}" for i in range(10)]
    policy = ScheduleLearned()
    for phase in (forward, forward[::-1]):  # learned: alternating (forward next, then reversed)
        for key in phase:
            policy.on_access(key, 100, "host", False)
        policy.on_step()
    assert policy.period == 2 and policy.schedule == forward
    for key in forward:  # this phase, then the next one starts with no mark_step between
        policy.on_access(key, 100, "host", False)
    policy.on_access("k9", 100, "host", False)
    assert [key for key, _ in policy.suggest()][:3] == ["k8", "k7", "k6"]
