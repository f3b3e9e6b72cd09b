"""The mixed step (``tierstore.optim.resident``, ``tierstore.optim.steps``): with part of the
state paged to disk, the states resident when the step starts are updated in one call while the
pipeline updates the others as their reads land; bit for bit with torch's fused AdamW, and each
parameter updated once a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
    twin = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _parts(opt: TieredAdamW) -> list[int]:
    """The sizes of the last step's resident parts (mixed steps only)."""
    return [int(name.split("x")[-1]) for name, *_ in opt.last_timeline() if name.startswith("resident part")]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_mixed_steps_are_bit_for_bit_with_fused_adamw(tmp_path: Path, device_mode: str, clip: float | None) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    state = 12 * sum(p.numel() for p in model.parameters())
    store = SyncTierStore([HostTier(state // 2), DiskTier(tmp_path / "disk", 8 * state, durable=False)]).open()
    opt = TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True, store=store, max_grad_norm=clip)
    try:
        mixed = []
        for step in range(6):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            reference(x).square().mean().backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            exact.step()
            opt.step()
            exact.zero_grad()
            opt.zero_grad()
            parts = _parts(opt)
            assert len(parts) <= 1
            mixed.append(bool(parts))
            for p, q in zip(reference.parameters(), model.parameters(), strict=True):
                assert torch.equal(p, q), f"step {step}"
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            theirs, ours = exact.state[p], opt.state[q]
            assert torch.equal(theirs["exp_avg"], ours["exp_avg"]) and torch.equal(theirs["exp_avg_sq"], ours["exp_avg_sq"])
            assert float(theirs["step"]) == float(ours["step"]) == 6.0  # each parameter once a step
        assert any("host" not in store.where(key) for key in opt.namespace.keys())  # (some state is on disk)
        # lent gradients (plain CPU): after the step creating the state, the resident part goes
        # at once; across a device link, never (the pipeline copies the gradients)
        assert any(mixed[1:]) == (device_mode == "plain") and not mixed[0]
    finally:
        opt.close()
        store.close()
