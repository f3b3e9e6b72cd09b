"""Review of this session's optimizer changes: what ``load_state_dict`` takes from a saved
state dict (torch copies its param groups: a tensor ``lr`` is never shared with the source)."""

from __future__ import annotations

import pytest
import torch

from tierstore.optim import TieredAdamW, TieredOptimizer

pytestmark = pytest.mark.device_modes


def _source_state() -> tuple[torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    source = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=torch.tensor(1e-3), fused=True)
    return source, source.state_dict()


def test_a_loaded_tensor_lr_is_not_the_sources_tensor(device_mode: str) -> None:
    source, saved = _source_state()
    opt = TieredAdamW(torch.nn.Linear(4, 4).parameters(), lr=torch.tensor(1e-3), offload="host")
    try:
        opt.load_state_dict(saved)
        source.param_groups[0]["lr"].fill_(0.5)  # what an LR scheduler does to a tensor lr
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-3)
        assert opt.param_groups[0]["lr"] is not source.param_groups[0]["lr"]
    finally:
        opt.close()


def test_a_generic_optimizer_loads_groups_as_copies_too(device_mode: str) -> None:
    model = torch.nn.Linear(4, 4)
    opt = TieredOptimizer(model.parameters(), torch.optim.SGD, lr=torch.tensor(0.1), offload="host")
    other = TieredOptimizer(torch.nn.Linear(4, 4).parameters(), torch.optim.SGD, lr=torch.tensor(0.1), offload="host")
    try:
        saved = opt.state_dict()
        other.load_state_dict(saved)
        saved["param_groups"][0]["lr"].fill_(0.5)
        assert float(other.param_groups[0]["lr"]) == pytest.approx(0.1)
    finally:
        opt.close()
        other.close()
