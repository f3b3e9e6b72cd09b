"""Inputs the tiered optimizers refuse or take as torch's would: float64 parameters (refused:
the state is fp32 at best, so their updates would be rounded without a word) and
``process_group=False`` (no sharding, as ``None``)."""

from __future__ import annotations

import pytest
import torch

from tierstore.optim import TieredAdamW


def test_float64_parameters_are_refused_before_anything_is_made() -> None:
    model = torch.nn.Linear(4, 4).double()
    with pytest.raises(TypeError, match="float64 parameters are not supported.*fp32"):
        TieredAdamW(model.parameters(), offload="host")


def test_a_float64_group_added_later_is_refused_and_leaves_the_groups_as_they_were() -> None:
    opt = TieredAdamW(torch.nn.Linear(4, 4).parameters(), offload="host")
    try:
        with pytest.raises(TypeError, match="float64"):
            opt.add_param_group({"params": torch.nn.Linear(2, 2).double().parameters()})
        assert len(opt.param_groups) == 1
        extra = torch.nn.Linear(2, 2)
        opt.add_param_group({"params": extra.parameters(), "lr": 1e-2})  # still usable
        assert len(opt.param_groups) == 2
    finally:
        opt.close()


@pytest.mark.device_modes
def test_process_group_false_means_no_sharding(device_mode: str) -> None:
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    exact = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    opt = TieredAdamW(model.parameters(), lr=1e-2, offload="host", process_group=False)
    try:
        for seed in range(3):
            inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
            for m, o in ((model, opt), (twin, exact)):
                m(inputs).square().mean().backward()
                o.step()
                o.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True))
    finally:
        opt.close()


def test_two_optimizers_on_one_disk_root_are_told_how_to_share_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = TieredAdamW([torch.nn.Parameter(torch.randn(10))], offload="disk", disk_root=tmp_path / "d")
    try:
        from tierstore import StoreLockedError

        with pytest.raises(StoreLockedError, match="give each its own disk_root=, or make one TierStore"):
            TieredAdamW([torch.nn.Parameter(torch.randn(10))], offload="disk", disk_root=tmp_path / "d")
    finally:
        first.close()


def test_the_memory_plan_shows_the_chunks_made_not_the_cap_asked_for() -> None:
    param = torch.nn.Parameter(torch.randn(100_000))
    opt = TieredAdamW([param], offload="host", chunk_bytes=5000)
    try:
        plan = opt.memory_plan()
        # one block of 1,024 elements a chunk: 8 bytes of state each (moments; the fp32 parameter is
        # its own master on the plain CPU), 12 with a master copy
        assert plan.chunk_bytes in (1024 * 8, 1024 * 12)
        assert plan.chunked_parameters == 1 and f"chunks of up to {plan.chunk_bytes // 1024}.0 KiB" in str(plan)
    finally:
        opt.close()


def test_a_parameter_listed_twice_in_a_group_is_refused() -> None:
    """It was updated once per listing on the plain CPU but once on the emulated device, with
    one step count (torch warns that this will be an error; its fused and for-loop kernels
    disagree with each other too)."""
    weight = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="same parameter more than once"), pytest.warns(UserWarning):
        TieredAdamW([weight, weight])
    opt = TieredAdamW([torch.nn.Parameter(torch.ones(4))])
    with pytest.raises(ValueError, match=r"positions \[1\]"), pytest.warns(UserWarning):
        opt.add_param_group({"params": [weight, weight]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [weight]})
    weight.grad = torch.ones(4)
    opt.step()
    assert len(opt.param_groups) == 2 and float(opt.state[weight]["step"]) == 1
    opt.close()


def test_unscale_in_step_false_is_refused_with_zero_stage_2() -> None:
    """Each rank's GradScaler would check its own gradients before the reduce-scatter: one rank
    skipped its step while the other waited for it in a collective."""
    with pytest.raises(ValueError, match="unscale_in_step=False with zero_stage=2"):
        TieredAdamW([torch.nn.Parameter(torch.ones(4))], process_group=True, zero_stage=2, unscale_in_step=False)


def test_a_state_dict_of_another_model_is_refused_naming_the_parameter_and_leaves_the_state() -> None:
    model = torch.nn.Linear(4, 8)
    opt = TieredAdamW(model.parameters(), offload="host")
    try:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        before = opt.state_dict()
        other = TieredAdamW(torch.nn.Linear(5, 8).parameters(), offload="host")
        try:
            for p in other.param_groups[0]["params"]:  # (another model's state: 40 elements where ours has 32)
                p.grad = torch.ones_like(p)
            other.step()
            foreign = other.state_dict()
        finally:
            other.close()
        with pytest.raises(ValueError, match=r"parameter 0: saved 'exp_avg' has 40 elements, the parameter 32: the state dict is not this model's") as raised:
            opt.load_state_dict(foreign)
        assert "DTensor" not in str(raised.value)  # (a plain model's parameters are not DTensors)
        after = opt.state_dict()
        assert all(torch.equal(before["state"][0][name], after["state"][0][name]) for name in ("exp_avg", "exp_avg_sq"))
    finally:
        opt.close()
