"""Non-contiguous parameters updated bit for bit as torch's fused AdamW updates them.

Torch's fused CPU kernel walks a tensor in memory order, and its last elements take a scalar
path that rounds differently; the optimizer's state is flat in logical order, so a transposed
parameter's state came out an ulp apart (``tierstore.optim.memory_order``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 9, generator=g).t()),  # small: state on the host
        torch.nn.Parameter(torch.randn(3, 33, generator=g).t()),
        torch.nn.Parameter(torch.randn(101, 97, generator=g).t()),  # paged through the disk
        torch.nn.Parameter(torch.randn(7, 3, 45, generator=g).permute(2, 0, 1)),
        torch.nn.Parameter(torch.randn(33, 7, generator=g)),  # contiguous, beside them
    ]


def _train(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:  # gradients with the parameter's strides, as autograd makes them
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))
        opt.step()


def test_transposed_parameters_match_torch_fused_adamw(tmp_path: Path, device_mode: str) -> None:
    ref, mine = _params(0), _params(0)
    assert not all(p.is_contiguous() for p in mine)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt = TieredAdamW(mine, lr=1e-2, weight_decay=0.1, offload="disk", disk_root=tmp_path / "s", host_capacity="256KiB")
    _train(ref, ref_opt, 25)
    _train(mine, opt, 25)
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    for i, (a, b) in enumerate(zip(ref, mine, strict=True)):
        assert torch.equal(a, b), f"parameter {i} {tuple(a.shape)}"
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_state[i][name], state[i][name]), f"{name} of parameter {i}"
    opt.close()


def test_only_parameters_too_small_to_page_with_state_on_disk(tmp_path: Path, device_mode: str) -> None:
    """Every parameter below ``min_offload_numel``: nothing pages, and the planner divided by
    the largest paged state (0): ZeroDivisionError in the constructor."""
    ref, mine = _params(1)[:2], _params(1)[:2]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    opt = TieredAdamW(mine, lr=1e-2, offload="disk", disk_root=tmp_path / "s", host_capacity="256KiB")
    _train(ref, ref_opt, 5)
    _train(mine, opt, 5)
    for a, b in zip(ref, mine, strict=True):
        assert torch.equal(a, b)
    opt.close()


def test_a_non_contiguous_parameter_too_large_for_the_tier_gets_the_right_advice(tmp_path: Path, device_mode: str) -> None:
    """Its state is never paged in chunks, so the error told the user to set the ``chunk_bytes``
    they had set; it says to make the parameter contiguous (which then fits, in chunks)."""
    from tierstore.optim.pipeline import OptimizerCapacityError

    weight = torch.randn(96, 80)
    options = {"offload": "disk", "host_capacity": "96KiB", "chunk_bytes": "16KiB"}
    with pytest.raises(OptimizerCapacityError, match="make it contiguous") as raised:
        TieredAdamW([torch.nn.Parameter(weight.t())], disk_root=tmp_path / "a", **options)
    assert "page its state in chunks" not in str(raised.value)
    TieredAdamW([torch.nn.Parameter(weight.t().contiguous())], disk_root=tmp_path / "b", **options).close()
