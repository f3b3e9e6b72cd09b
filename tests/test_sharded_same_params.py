"""Sharded state (``process_group=``, 2 gloo ranks) with a parameter frozen on one rank only:
each rank planned the owners from its own ``requires_grad`` flags, the plans disagreed, and the
model split silently (a parameter trained on every rank ended different on each). Now the ranks
compare their lists and every rank raises, at construction and in ``add_param_group``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from spawned import gloo_group, spawn_ranks

LIMIT_S = 180


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    with gloo_group(rank, world, port, timeout_s=30):
        Path(out, f"rank{rank}.json").write_text(json.dumps({**_frozen_on_one_rank(rank), **_resumed_optimizer_first()}))


def _resumed_optimizer_first() -> dict[str, Any]:
    """A bf16 weight split across the ranks, its optimizer state loaded before the model's
    weights: the master loaded (the weight still the fresh one) must not be taken as stale, as
    a sharded slot is not watched for the model's load that follows (it was reset to the
    fresh weight: every step lost)."""
    from tierstore.optim import TieredAdamW

    def make() -> torch.nn.Linear:
        return torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)

    torch.manual_seed(0)
    model = make()
    opt = TieredAdamW(model.parameters(), lr=1e-2, offload="host", process_group=True)
    for _ in range(3):
        model.weight.grad = torch.randn(256, 256).bfloat16()
        opt.step()
    trained, saved = model.state_dict()["weight"].clone(), opt.state_dict()
    opt.close()
    torch.manual_seed(1)
    resumed = make()
    fresh = resumed.weight.detach().clone()
    again = TieredAdamW(resumed.parameters(), lr=1e-2, offload="host", process_group=True)
    again.load_state_dict(saved)
    resumed.load_state_dict({"weight": trained})
    resumed.weight.grad = torch.zeros(256, 256, dtype=torch.bfloat16)
    again.step()
    again.close()
    return {"from_trained": (resumed.weight.float() - trained.float()).abs().max().item(),
            "from_fresh": (resumed.weight.float() - fresh.float()).abs().max().item()}


def _frozen_on_one_rank(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tierstore.optim import TieredAdamW

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(1000))
    result: dict[str, Any] = {}
    a.requires_grad_(rank == 0)
    try:
        TieredAdamW([a, b], lr=1e-2, offload="host", process_group=True)
        result["made"] = "yes"
    except ValueError as error:
        result["made"] = str(error)
    a.requires_grad_(False)  # frozen on every rank: fine
    opt = TieredAdamW([a, b], lr=1e-2, offload="host", process_group=True)
    extra = torch.nn.Parameter(torch.randn(500), requires_grad=rank == 1)
    try:
        opt.add_param_group({"params": [extra]})
        result["added"] = "yes"
    except ValueError as error:
        result["added"] = str(error)
    b.requires_grad_(rank == 0)  # frozen on one rank after construction: new owners would be planned apart
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(500))]})
        result["added_after_freeze"] = "yes"
    except ValueError as error:
        result["added_after_freeze"] = str(error)
    b.requires_grad_(True)
    result["groups"] = len(opt.param_groups)
    for _ in range(3):
        (a * 2 + b * 3).square().sum().backward()
        opt.step()
        opt.zero_grad()
    everyone = [torch.empty(1000) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, b.detach().clone())
    result["b_same_on_every_rank"] = all(torch.equal(everyone[0], other) for other in everyone)
    opt.close()
    return result


def test_a_parameter_frozen_on_one_rank_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S)
    for result in ranks:
        assert "parameters [0] differ across the ranks" in result["made"] and "requires_grad=False" in result["made"], result
        assert "parameters [2] differ across the ranks" in result["added"] and result["groups"] == 1, result
        assert "parameters [1] differ across the ranks" in result["added_after_freeze"], result
        assert result["b_same_on_every_rank"], result
        assert result["from_trained"] < 0.02 < result["from_fresh"], result  # (one step from the trained weight)
