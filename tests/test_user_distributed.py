"""Sharded TieredAdamW used as a new user would (issue 11), on inputs the other distributed tests
do not use: gloo, 2 processes spawned from pytest under a time limit, both device modes.

- A bf16 model clipped by the global norm with ``process_group=`` (``max_grad_norm=`` and
  ``opt.clip_grad_norm_``) gives the weights of the same model clipped by torch's
  ``clip_grad_norm_`` (which takes the norm of bf16 norms in bf16), bit for bit, and the same
  total norm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from spawned import gloo_group, spawn_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

LIMIT_S = 90  # the whole spawned job (about 30 s on 2 shared cores)
STEPS, LR, MAX_NORM = 3, 1e-2, 0.05


def bf16_model() -> DDP:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)]
    return DDP(torch.nn.Sequential(*layers).to(torch.bfloat16))


def bf16_clipping(rank: int) -> dict[str, Any]:
    """Weights after STEPS steps and the first step's total norm, for each way of clipping."""
    from tierstore.optim import TieredAdamW

    result: dict[str, Any] = {}
    weights = {}
    for name in ("torch_clip", "max_grad_norm", "opt_clip"):
        model = bf16_model()
        options: dict[str, Any] = {"lr": LR, "fused": True, "min_offload_numel": 64}
        options["process_group"] = True
        if name == "max_grad_norm":
            options["max_grad_norm"] = MAX_NORM
        opt = TieredAdamW(model.parameters(), **options)
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(torch.bfloat16)
            model(x).float().pow(2).mean().backward()
            if name == "torch_clip":
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif name == "opt_clip":
                total = opt.clip_grad_norm_(MAX_NORM)
            if step == 0 and name in ("torch_clip", "opt_clip"):
                result[f"{name}_total"] = [str(total.dtype), float(total)]
            opt.step()
            opt.zero_grad()
        weights[name] = [p.detach().clone() for p in model.parameters()]
        opt.close()
    for name, ws in weights.items():
        result[name] = all(torch.equal(a, b) for a, b in zip(ws, weights["torch_clip"], strict=True))
    return result


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    from tierstore.device import emulate_device

    with gloo_group(rank, world, port, LIMIT_S):
        result = {}
        for mode in ("plain", "emulated"):
            with emulate_device(mode == "emulated"):
                result[mode] = {"bf16_clipping": bf16_clipping(rank)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_sharded_user_cases(tmp_path: Path) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S)
    for r in ranks:
        for mode in ("plain", "emulated"):
            clip = r[mode]["bf16_clipping"]
            # the same weights as torch's clip_grad_norm_ on the bf16 gradients
            assert clip["max_grad_norm"] and clip["opt_clip"], (mode, clip)
            assert clip["opt_clip_total"] == clip["torch_clip_total"], (mode, clip)
