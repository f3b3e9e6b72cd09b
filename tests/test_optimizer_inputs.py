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
