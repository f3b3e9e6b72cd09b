"""``add_param_group`` after construction with sharded state (``process_group=``, 2 gloo ranks):
a group whose parameter goes whole to one rank, and cannot fit there, was refused on that rank
only (the other took it: the ranks' groups disagreed) and the refusing rank's sharding kept the
refused parameter. Now every rank refuses together and forgets it; a group that fits after it is
taken by all and trains as torch's AdamW under the same all-reduce."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from spawned import gloo_group, spawn_ranks

LIMIT_S = 240


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    warnings.simplefilter("ignore")
    with gloo_group(rank, world, port, timeout_s=30):
        Path(out, f"rank{rank}.json").write_text(json.dumps(_ranks_agree(rank)))


def _ranks_agree(rank: int) -> dict[str, Any]:
    from tierstore.optim import OptimizerCapacityError, TieredAdamW

    torch.manual_seed(0)
    small = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(2)]
    opt = TieredAdamW(small, process_group=True, host_capacity="64KiB", min_offload_numel=16, weight_decay=0.0)
    big = torch.nn.Parameter(torch.randn(128, 128))  # 128 KiB of state: more than the tier holds
    result: dict[str, Any] = {}
    try:
        opt.add_param_group({"params": [big]})
        result["big"] = "accepted"
    except OptimizerCapacityError as error:
        result["big"] = "refused"
        result["message"] = str(error)
    # a parameter that fails on its owner only (no link for the meta device): the other rank
    # waited for it in the agreement until the process group's timeout
    meta = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    started = time.perf_counter()
    try:
        opt.add_param_group({"params": [meta]})
        result["meta"] = "accepted"
    except (ValueError, OptimizerCapacityError) as error:
        result["meta"] = type(error).__name__
    result["meta_s"] = time.perf_counter() - started
    fits = torch.nn.Parameter(torch.randn(16, 16))
    opt.add_param_group({"params": [fits]})
    result["groups"] = len(opt.param_groups)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in [*small, fits]]
    reference = torch.optim.AdamW(twins, fused=True, weight_decay=0.0)
    for step in range(2):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)) for i, p in enumerate(twins)]
        for p, q, g in zip([*small, fits], twins, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
    result["equal"] = all(torch.equal(p, q) for p, q in zip([*small, fits], twins, strict=True))
    opt.close()
    return result


def test_ranks_refuse_a_group_together_and_take_the_next(tmp_path: Path) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S)
    assert [r["big"] for r in ranks] == ["refused", "refused"], ranks
    assert any("another rank" in r["message"] for r in ranks) and any("cannot" in r["message"] for r in ranks), ranks
    assert all(r["groups"] == 2 and r["equal"] for r in ranks), ranks
    assert sorted(r["meta"] for r in ranks) == ["OptimizerCapacityError", "ValueError"] and all(r["meta_s"] < 10 for r in ranks), ranks
