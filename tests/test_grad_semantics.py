"""Torch's gradient semantics: whatever the loop does to ``p.grad`` between backward and
``step()`` counts, bit for bit as with ``torch.optim.AdamW``, on the plain CPU (gradients lent)
and on the emulated device (gradients copied over a link when their hook fires, taken again at
``step()`` when they changed)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from flipped import flipped_byte

from tierstore import DiskTier, HostTier, TierStore
from tierstore.device import link_for
from tierstore.errors import StepIncompleteError
from tierstore.optim import TieredAdamW
from tierstore.sync import run
from tierstore.testing import settle

pytestmark = pytest.mark.device_modes

STEPS = 4
Mutation = Callable[[torch.nn.Module, int], None]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def train(
    model: torch.nn.Module, opt: Any, mutate: Mutation | None = None, *, passes: int = 1, scaler: Any = None, autocast: bool = False
) -> None:
    data = torch.randn(STEPS, passes, 4, 16, generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        opt.zero_grad()
        for i in range(passes):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = model(data[step, i]).float().pow(2).mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if mutate is not None:
            mutate(model, step)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()


def ours(model: torch.nn.Module, fused: bool, **options: Any) -> TieredAdamW:
    return TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused, min_offload_numel=64, **options)


def compare(
    mutate: Mutation | None, fused: bool, *, passes: int = 1, scaled: bool = False, autocast: bool = False,
    reference_mutate: Mutation | None = None, **options: Any,
) -> TieredAdamW:
    """Train torch's AdamW and ours alike (``reference_mutate`` instead of ``mutate`` for torch's,
    if given); the weights must be equal bit for bit."""
    reference, model = make_model(), make_model()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None for _ in range(2)]
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=fused), reference_mutate or mutate,
          passes=passes, scaler=scalers[0], autocast=autocast)
    opt = ours(model, fused, **options)
    train(model, opt, mutate, passes=passes, scaler=scalers[1], autocast=autocast)
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    return opt


def clip(model: torch.nn.Module, step: int) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def scale_in_place(model: torch.nn.Module, step: int) -> None:
    for p in model.parameters():
        p.grad.mul_(0.5 + step)


def replace(model: torch.nn.Module, step: int) -> None:
    model[0].weight.grad = model[0].weight.grad * 0.25  # a new tensor, version 0 like the old one


def set_none(model: torch.nn.Module, step: int) -> None:
    if step % 2:
        model[2].weight.grad = None


def inf_at_step_2(model: torch.nn.Module, step: int) -> None:
    if step == 2:
        model[0].weight.grad[0, 0] = math.inf


MUTATIONS = {"clip_grad_norm_": clip, "in-place scaling": scale_in_place, "replaced": replace, "set to None": set_none}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_changes_after_backward_count(name: str, fused: bool, device_mode: str) -> None:
    opt = compare(MUTATIONS[name], fused)
    report = opt.time_report()
    if device_mode == "emulated" and name != "set to None":
        assert report.grad_retakes > 0 and report.grad_retake_bytes > 0  # the speculative copies were taken again
    if name == "set to None":
        assert report.grad_retakes == 0
    opt.close()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_unchanged_gradients_are_not_copied_again(fused: bool, device_mode: str) -> None:
    opt = compare(None, fused, reference_mutate=clip, max_grad_norm=0.05)  # clipping on the host copies: nothing taken again
    report = opt.time_report()
    assert report.grad_retakes == 0
    assert (report.grads_to_host_bytes > 0) == (device_mode == "emulated")
    opt.close()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_grad_scaler_with_a_skipped_step(fused: bool) -> None:
    compare(inf_at_step_2, fused, scaled=True).close()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_grad_scaler_with_autocast_to_float16(fused: bool) -> None:
    compare(inf_at_step_2, fused, scaled=True, autocast=True).close()


def test_grad_scaler_unscale_then_clip(device_mode: str) -> None:
    # unscale_ changes every p.grad in place without moving versions: all are taken again
    for fused in (True, False):
        reference, model = make_model(), make_model()
        for net, opt in ((reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)), (model, ours(model, fused))):
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
            data = torch.randn(STEPS, 4, 16, generator=torch.Generator().manual_seed(1))
            for step in range(STEPS):
                opt.zero_grad()
                scaler.scale(net(data[step]).pow(2).mean()).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
                scaler.step(opt)
                scaler.update()
        for x, y in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_grad_scaler_unscale_then_our_clip_grad_norm(device_mode: str) -> None:
    # opt.clip_grad_norm_ after scaler.unscale_: the norm is of the unscaled p.grad (the host
    # copies are stale in a way no version counter shows), as torch's clip_grad_norm_ computes it
    reference, model = make_model(), make_model()
    opt = ours(model, True)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    data = torch.randn(STEPS, 4, 16, generator=torch.Generator().manual_seed(1))
    for net, o in ((reference, ref_opt), (model, opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for step in range(STEPS):
            o.zero_grad()
            scaler.scale(net(data[step]).pow(2).mean()).backward()
            scaler.unscale_(o)
            if o is opt:
                total = opt.clip_grad_norm_(0.05)
            else:
                total = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            assert torch.isfinite(total)
            scaler.step(o)
            scaler.update()
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    opt.close()


def test_a_gradient_that_is_not_contiguous(device_mode: str) -> None:
    # a gradient laid out otherwise than its parameter (as a framework may leave it) counts too
    def transpose_layout(model: torch.nn.Module, step: int) -> None:
        grad = model[0].weight.grad
        model[0].weight.grad = grad.t().contiguous().t()  # same values, column-major strides

    # (for-loop kernel: torch's fused CPU kernel reads such a gradient in memory order, not as
    # the tensor it is -- a torch quirk we do not copy; ours takes the gradient's values)
    opt = compare(transpose_layout, False)
    assert not opt.param_groups[0]["params"][0].grad.is_contiguous()
    opt.close()


def test_max_grad_norm_with_grad_scaler_unscales_first() -> None:
    # scaler.step hands us the scale; the norm is of the unscaled gradients, as
    # scaler.unscale_ + clip_grad_norm_ + scaler.step computes it
    reference, model = make_model(), make_model()
    data = torch.randn(STEPS, 4, 16, generator=torch.Generator().manual_seed(1))
    opt = ours(model, False, max_grad_norm=0.05)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=False)
    for net, o, by_hand in ((reference, ref_opt, True), (model, opt, False)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for step in range(STEPS):
            o.zero_grad()
            scaler.scale(net(data[step]).pow(2).mean()).backward()
            if by_hand:
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            scaler.step(o)
            scaler.update()
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    opt.close()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_two_backward_passes_need_no_hint(fused: bool) -> None:
    compare(None, fused, passes=2).close()
    compare(scale_in_place, fused, passes=2, gradient_accumulation_steps=2).close()  # the hint saves copies only


# -- step_in_backward ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_in_backward_where_it_applies(fused: bool) -> None:
    compare(None, fused, step_in_backward=True).close()
    compare(None, fused, passes=3, step_in_backward=True, gradient_accumulation_steps=3).close()


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_in_backward_refuses_changes_after_backward(name: str) -> None:
    model = make_model()
    opt = ours(model, True, step_in_backward=True)
    with pytest.raises(RuntimeError, match=r"step_in_backward=True: parameters \[.*\] were updated during backward"):
        train(model, opt, MUTATIONS[name])
    # the optimizer goes on (the step ended; the updates that ran stay)
    train(model, opt)
    opt.close()


def test_in_backward_refuses_grad_scaler_and_extra_passes() -> None:
    model = make_model()
    opt = ours(model, True, step_in_backward=True)
    with pytest.raises(RuntimeError, match="GradScaler cannot be used with step_in_backward"):
        train(model, opt, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps=2"):
        train(model, opt, passes=2)
    opt.close()


# -- which path ran ---------------------------------------------------------------------------------------------------


def test_a_change_the_version_counter_does_not_see(device_mode: str) -> None:
    # ``.data`` has its own version counter: p.grad.data.mul_ is invisible to the check. On the
    # emulated device the update uses the copy taken at hook time (as a GPU would); on the plain
    # CPU the gradient is lent, so the change shows.
    data = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    moved_before = link_for("cpu").moved["to_host"][0]
    for variant in ("ours", "unchanged", "changed"):
        model = make_model()
        opt = ours(model, True) if variant == "ours" else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        model(data).pow(2).mean().backward()
        if variant == "ours" and device_mode == "emulated":  # let the copies started in backward end
            link, need = link_for("cpu"), sum(p.grad.nbytes for p in model.parameters())
            deadline = time.monotonic() + 30
            while link.moved["to_host"][0] - moved_before < need and time.monotonic() < deadline:
                time.sleep(0.01)
        version = model[0].weight.grad._version
        if variant != "unchanged":
            for p in model.parameters():
                p.grad.data.mul_(2)
        assert model[0].weight.grad._version == version
        opt.step()
        results[variant] = [p.detach().clone() for p in model.parameters()]
        if variant == "ours":
            opt.close()
    expected = results["unchanged" if device_mode == "emulated" else "changed"]
    for x, y in zip(results["ours"], expected, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- faults during step() ---------------------------------------------------------------------------------------------


def test_a_checksum_error_in_step_names_the_parameters_and_step_again_completes(tmp_path: Path) -> None:
    def wide() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)))

    reference, model = wide(), wide()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    # a host tier smaller than the state (4 x 48 KiB): some of it lives on disk
    store = TierStore([HostTier("128KiB"), DiskTier(tmp_path / "d", "16MiB", chunk_size="4KiB", inline_max=0)])
    opt = TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True, min_offload_numel=64, store=store)
    data = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(1))
    for step in range(6):
        for net, o in ((reference, ref_opt), (model, opt)):
            if o is ref_opt or step != 3:
                o.zero_grad()
                net(data[step]).pow(2).mean().backward()
                o.step()
                continue
            run(settle(opt.store))
            slot = next(slot for slot in opt._slots if slot.paged and opt.store.where(slot.key) == ["disk"])
            with flipped_byte(opt.store, slot.key):  # its state, before this step reads it
                o.zero_grad()
                net(data[step]).pow(2).mean().backward()
                with pytest.raises(StepIncompleteError, match=r"were updated, \[.*\] were not \(ChecksumError") as caught:
                    o.step()
            assert slot.index in caught.value.not_updated and caught.value.updated
            assert not set(caught.value.updated) & set(caught.value.not_updated)
            assert caught.value.__cause__ is not None
            o.step()  # completes the step: the rest, and nothing twice
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    opt.close()




def test_a_gradient_given_new_memory_through_data_counts(device_mode: str) -> None:
    # p.grad.data = other keeps the tensor object and its version counter; its memory moves
    def reassign_data(model: torch.nn.Module, step: int) -> None:
        grad = model[0].weight.grad
        grad.data = grad.data * 0.5

    opt = compare(reassign_data, True)
    opt.close()


@pytest.mark.parametrize("in_backward", [False, True], ids=["after", "in-backward"])
def test_close_between_backward_and_step(in_backward: bool, device_mode: str, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    opt = TieredAdamW(model.parameters(), lr=1e-2, min_offload_numel=64, step_in_backward=in_backward)
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.close()  # the step's work in flight is let go first: no error, nothing left running
    assert "never retrieved" not in caplog.text


def test_channels_last_gradients_overlap_backward(device_mode: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
    model = model.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    opt = TieredAdamW(model.parameters(), lr=1e-2, fused=True, min_offload_numel=16)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step)).to(memory_format=torch.channels_last)
        for net, o in ((reference, ref_opt), (model, opt)):
            o.zero_grad()
            net(x).pow(2).mean().backward()
            o.step()
        assert opt.time_report().grad_retakes == 0  # copied when their hooks fired, not again in step()
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    opt.close()


DDP_CHANNELS_LAST = r"""
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tierstore.optim import TieredAdamW, attach_ddp
dist.init_process_group("gloo", rank=0, world_size=1)

def model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
    return net.to(memory_format=torch.channels_last)

out = []
for ours in (False, True):
    m = DDP(model())
    if ours:
        opt = TieredAdamW(m.parameters(), lr=1e-2, fused=True, min_offload_numel=16)
        attach_ddp(opt, m)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step)).to(memory_format=torch.channels_last)
        m(x).pow(2).mean().backward()
        opt.step()
    out.append([p.detach().clone() for p in m.parameters()])
    if ours:
        opt.close()
dist.destroy_process_group()
sys.exit(0 if all(torch.equal(a, b) for a, b in zip(*out)) else 1)
"""


def test_attach_ddp_with_channels_last_gradients(device_mode: str, tmp_path: Path) -> None:
    # DDP lays a channels-last gradient out in its bucket with the parameter's strides
    import os
    import subprocess
    import sys

    from tierstore.optim.distributed import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TIERSTORE_EMULATE_DEVICE": "1" if device_mode == "emulated" else "0"}
    done = subprocess.run([sys.executable, "-c", DDP_CHANNELS_LAST], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
