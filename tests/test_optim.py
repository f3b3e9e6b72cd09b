"""The tiered optimizers against torch's, step for step, with state paged to disk and back."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import DiskTier, HostTier, TierStore
from tierstore.models import GPT, GPTConfig, synthetic_batches
from tierstore.optim import OptimizerCapacityError, TieredAdam, TieredAdamW, TieredOptimizer
from tierstore.sync import run

pytestmark = pytest.mark.device_modes

CONFIG = GPTConfig(vocab=64, seq=16, dim=32, layers=2, heads=2)
STEPS = 8


class Partly(torch.nn.Module):
    """The small GPT plus an output bias used only on even steps (a parameter without a grad in
    some steps) and a frozen position table."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(CONFIG)
        self.gpt.positions.weight.requires_grad_(False)
        self.sometimes = torch.nn.Parameter(torch.zeros(CONFIG.vocab))
        self.use_sometimes = True

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(tokens[:, :-1])
        if self.use_sometimes:
            logits = logits + self.sometimes
        return torch.nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1))


def groups(model: Partly, decay: float) -> list[dict[str, Any]]:
    named = [(n, p) for n, p in model.named_parameters()]
    matrices = [p for n, p in named if p.ndim >= 2]
    vectors = [p for n, p in named if p.ndim < 2]
    return [{"params": matrices, "weight_decay": decay}, {"params": vectors, "weight_decay": 0.0, "lr": 5e-3}]


def paging_store(tmp_path: Path) -> TierStore:
    """A host tier far smaller than the state (about 370 KiB here): most of it lives on disk."""
    from policies import MIN, ScheduleLearned

    schedule = ScheduleLearned()
    return TierStore(
        [HostTier("150KiB"), DiskTier(tmp_path / "optim", "64MiB", chunk_size="64KiB", durable=False)],
        eviction=lambda: MIN(schedule), prefetch=schedule,
    )


def run_pair(
    tmp_path: Path,
    reference_class: type[torch.optim.Optimizer],
    ours_class: Callable[..., Any],
    options: dict[str, Any],
    *,
    accumulation: int = 1,
    clip: float | None = None,
    clip_by_call: bool = False,
    scheduler: bool = False,
    step_in_backward: bool = False,
    ours_extra: dict[str, Any] | None = None,
    reference_extra: dict[str, Any] | None = None,
) -> tuple[Partly, Partly, Any]:
    """Train a reference and a paged copy in lockstep; return both models and our optimizer."""
    reference = Partly()
    ours = copy.deepcopy(reference)
    ref_opt = reference_class(groups(reference, options.pop("weight_decay", 0.0)) if "groups" not in options else options.pop("groups"), **options, **(reference_extra or {}))
    paged = ours_class(
        groups(ours, ref_opt.param_groups[0]["weight_decay"]), **options, store=paging_store(tmp_path),
        min_offload_numel=64, gradient_accumulation_steps=accumulation, max_grad_norm=None if clip_by_call else clip,
        step_in_backward=step_in_backward, **(ours_extra or {}),
    )
    schedules = []
    if scheduler:
        schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5) for o in (ref_opt, paged)]
    batches = synthetic_batches(CONFIG, batch=4, seed=1)
    for step in range(STEPS):
        for model in (reference, ours):
            model.use_sometimes = step % 2 == 0
        micro = [next(batches) for _ in range(accumulation)]
        for model, opt in ((reference, ref_opt), (ours, paged)):
            opt.zero_grad()
            for tokens in micro:
                (model.loss(tokens) / accumulation).backward()
            if clip is not None and model is reference:
                expected = torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
            if clip_by_call and model is ours:
                got = opt.clip_grad_norm_(clip)
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
            opt.step()
        for schedule in schedules:
            schedule.step()
    return reference, ours, paged


def max_relative_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def assert_same_weights(reference: torch.nn.Module, ours: torch.nn.Module, exact: bool) -> None:
    if exact:
        for x, y in zip(ours.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    else:
        assert max_relative_error(ours, reference) <= 1e-6


def used_disk(opt: Any) -> bool:
    links = opt.store.stats()["links"]
    return links.get("disk->host", {}).get("nbytes", 0) > 0 and links.get("host->disk", {}).get("nbytes", 0) > 0


@pytest.mark.parametrize("step_in_backward", [False, True], ids=["after-backward", "in-backward"])
@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_adamw_matches_torch(tmp_path: Path, step_in_backward: bool, fused: bool) -> None:
    # The same kernel as torch's (its default for-loop one, or its fused one): bit for bit.
    reference, ours, opt = run_pair(
        tmp_path, torch.optim.AdamW, TieredAdamW, {"lr": 1e-2, "weight_decay": 0.1},
        step_in_backward=step_in_backward, ours_extra={"fused": fused}, reference_extra={"fused": fused}, scheduler=True,
    )
    assert_same_weights(reference, ours, exact=True)
    assert used_disk(opt)
    assert not ours.gpt.positions.weight.requires_grad
    torch.testing.assert_close(ours.gpt.positions.weight, reference.gpt.positions.weight, rtol=0, atol=0)
    opt.close()


def test_adam_with_amsgrad_maximize_off_and_l2_decay(tmp_path: Path) -> None:
    reference, ours, opt = run_pair(tmp_path, torch.optim.Adam, TieredAdam, {"lr": 3e-3, "weight_decay": 0.05, "amsgrad": True}, ours_extra={"fused": False})
    assert_same_weights(reference, ours, exact=True)
    assert used_disk(opt)
    opt.close()


def test_adamw_with_accumulation_and_clipping(tmp_path: Path) -> None:
    reference, ours, opt = run_pair(
        tmp_path, torch.optim.AdamW, TieredAdamW, {"lr": 1e-2, "weight_decay": 0.1}, accumulation=2, clip=0.5, ours_extra={"fused": False}
    )
    assert_same_weights(reference, ours, exact=True)
    opt.close()


def test_clip_grad_norm_call_matches_torch(tmp_path: Path) -> None:
    reference, ours, opt = run_pair(
        tmp_path, torch.optim.AdamW, TieredAdamW, {"lr": 1e-2}, clip=0.3, clip_by_call=True, ours_extra={"fused": False}
    )
    assert_same_weights(reference, ours, exact=True)
    opt.close()


def test_fused_default_with_everything(tmp_path: Path) -> None:
    # Our default (fused) against torch's fused, with every feature at once: bit for bit.
    reference, ours, opt = run_pair(
        tmp_path, torch.optim.AdamW, TieredAdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True},
        accumulation=2, clip=1.0, scheduler=True, reference_extra={"fused": True},
    )
    assert_same_weights(reference, ours, exact=True)
    opt.close()


def test_fused_default_against_torch_default_is_within_fp32_rounding(tmp_path: Path) -> None:
    # Across kernels (fused vs for-loop) results differ by rounding only; a short run of a
    # well-conditioned problem keeps that under 1e-6 relative (a long chaotic run amplifies it).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    twin = copy.deepcopy(model)
    ours = TieredAdamW(model.parameters(), lr=1e-3, store=paging_store(tmp_path), min_offload_numel=64)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    data = torch.randn(30, 16, 64)
    for batch in data:
        for net, opt in ((model, ours), (twin, reference)):
            opt.zero_grad()
            net(batch).pow(2).mean().backward()
            opt.step()
    assert max_relative_error(model, twin) <= 1e-6
    ours.close()


def test_state_dict_round_trips_both_ways(tmp_path: Path) -> None:
    reference, ours, opt = run_pair(tmp_path, torch.optim.AdamW, TieredAdamW, {"lr": 1e-2, "weight_decay": 0.1}, ours_extra={"fused": False})
    ref_state = opt_state = None
    torch_opt = torch.optim.AdamW(groups(copy.deepcopy(ours), 0.1), lr=1e-2)
    # ours -> torch
    torch_opt.load_state_dict(opt.state_dict())
    ref_state = torch_opt.state_dict()
    # torch -> ours (a fresh paged optimizer)
    fresh_model = copy.deepcopy(ours)
    fresh = TieredAdamW(groups(fresh_model, 0.1), lr=1e-2, store=paging_store(tmp_path / "again"), min_offload_numel=64, fused=False)
    fresh.load_state_dict(ref_state)
    opt_state = fresh.state_dict()
    original = opt.state_dict()
    assert original["param_groups"] == opt_state["param_groups"]
    assert original["state"].keys() == opt_state["state"].keys()
    for index, entry in original["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(opt_state["state"][index][name], value, rtol=0, atol=0)
    # and training continues identically from the loaded state
    batches = synthetic_batches(CONFIG, batch=4, seed=9)
    for _ in range(3):
        tokens = next(batches)
        for model, o in ((ours, opt), (fresh_model, fresh)):
            o.zero_grad()
            model.loss(tokens).backward()
            o.step()
    assert_same_weights(ours, fresh_model, exact=True)
    opt.close()
    fresh.close()


def test_bf16_model_keeps_fp32_master(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG).to(torch.bfloat16)
    opt = TieredAdamW(model.parameters(), lr=1e-3, store=paging_store(tmp_path), min_offload_numel=64)
    batches = synthetic_batches(CONFIG, batch=4)
    for _ in range(3):
        opt.zero_grad()
        model.loss(next(batches)).float().backward()
        opt.step()
    state = opt.state_dict()["state"]
    assert all(entry["master"].dtype == torch.float32 for entry in state.values())
    report = opt.memory_report()
    assert report.device_weight_bytes == 2 * report.parameters and report.state_bytes_per_param == pytest.approx(12)
    assert "2.0 + 2.0 bytes/param" in str(report) and "by store tier" in str(report)
    opt.close()


@pytest.mark.parametrize(
    ("optimizer_class", "options"),
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}), (torch.optim.Adagrad, {"lr": 0.05}), (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5})],
    ids=["sgd-momentum", "adagrad", "rmsprop"],
)
def test_generic_wrapper_matches(tmp_path: Path, optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any]) -> None:
    reference, ours, opt = run_pair(
        tmp_path, optimizer_class, lambda params, **kw: TieredOptimizer(params, optimizer_class, **kw), dict(options), scheduler=True
    )
    assert_same_weights(reference, ours, exact=True)
    assert used_disk(opt)
    # its state dict is the wrapped optimizer's own
    plain = optimizer_class(groups(copy.deepcopy(ours), options.get("weight_decay", 0.0)), **options)
    plain.load_state_dict(opt.state_dict())
    opt.close()


def test_reports_and_timeline(tmp_path: Path, device_mode: str) -> None:
    import json

    _, _, opt = run_pair(tmp_path, torch.optim.AdamW, TieredAdamW, {"lr": 1e-2})
    report = opt.time_report()
    assert report.step == STEPS and report.updates > 0 and report.host_update > 0 and report.stall > 0
    assert report.disk_read_bytes > 0 and "disk read" in str(report)
    # the update rate with a prefix that keeps it readable ("0.000588 G params/s" before)
    assert re.search(r"tensors, [1-9][0-9.]* [GMk]? ?params/s\)", str(report)), str(report)
    crossing = {"grads to host", "weights to device"} if device_mode == "emulated" else set()
    grads = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"] if p.grad is not None)
    # Emulated: every gradient crossed the link once (at its hook) and every weight came back;
    # plain CPU: the gradients were lent, nothing crossed.
    assert report.grads_to_host_bytes == (grads if crossing else 0) and report.grad_retakes == 0
    assert report.weights_to_device_bytes == (grads if crossing else 0)
    memory = opt.memory_report()
    assert memory.paged_parameters > 0 and sum(memory.state_by_tier.values()) > 0
    path = tmp_path / "step.json"
    opt.write_timeline(path)
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"host update", "train loop", "disk->host", *crossing} <= tracks
    opt.close()


def test_errors_are_clear(tmp_path: Path) -> None:
    model = GPT(CONFIG)
    with pytest.raises(ValueError, match="step_in_backward"):
        TieredAdamW(model.parameters(), max_grad_norm=1.0, step_in_backward=True)
    # (NaN made every weight NaN, -1 flipped the gradients' sign, "1" failed at the first step)
    for norm, error in ((float("nan"), ValueError), (-1.0, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_grad_norm must be a number of 0 or more"):
            TieredAdamW(model.parameters(), max_grad_norm=norm)
    with pytest.raises(OptimizerCapacityError, match="cannot hold") as raised:
        TieredAdamW(model.parameters(), store=TierStore([HostTier("16KiB")]))
    enough = int(re.search(r"at least ([\d,]+) bytes", str(raised.value)).group(1).replace(",", ""))  # type: ignore[union-attr]
    paged = TierStore([HostTier(enough), DiskTier(tmp_path / "enough", "16MiB")])  # (the capacity it names fits)
    TieredAdamW(model.parameters(), store=paged).close()
    run(paged.aclose())
    with pytest.raises(ValueError, match="Invalid learning rate"):
        TieredAdamW(model.parameters(), lr=-1)
    with pytest.raises(TypeError):  # as torch: at construction, not as a failed step
        TieredAdamW(model.parameters(), lr="0.001")
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        TieredAdamW(model.parameters(), lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        TieredAdamW(model.parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        TieredAdamW(model.parameters(), betas=(torch.tensor(0.9), 0.999))
    with pytest.raises(ValueError, match="foreach=True"):
        TieredAdamW(model.parameters(), lr=torch.tensor(1e-3), foreach=True)
    opt = TieredAdamW(model.parameters(), store=paging_store(tmp_path), min_offload_numel=64, step_in_backward=True)
    tokens = next(synthetic_batches(CONFIG, 2))
    model.loss(tokens).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
        model.loss(tokens).backward()  # a second backward before step(): the updates already ran
    opt.zero_grad()
    model.loss(tokens).backward()
    opt.step()  # still usable
    opt.close()
