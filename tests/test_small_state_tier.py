"""A plan the optimizer accepts trains, however small the state tier: a host tier of a few
chunks pages every step (slower, never failing), and the weights are those of a tier that
holds everything, bit for bit.

The setting: eight parameters whose whole state (8 B a parameter, fp32 moments, the parameter
its own master) is as large as the host tier or larger. At a step's end the last parameter's
state can fill the tier; the next step (order reversed) updates it first, and holding all of it
at once left the chunk runs in the other place in flight no room (``TierFullError`` at step 1
or 2, fp32 on the plain CPU: the resident step's case; 8-bit moments and the emulated device take
the pipeline, and are here so that they stay right).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.optim import TieredAdamW
from tierstore.tiers import DiskTier, HostTier

pytestmark = pytest.mark.device_modes  # tests taking ``device_mode`` run in both modes

TENSORS, PER, STEPS = 8, 1 << 17, 4
LARGE = 64 << 20  # holds every state: the reference run never pages


def _train(root: Path, host: int, state_precision: str) -> list[torch.Tensor]:
    """The weights after ``STEPS`` steps with a ``host``-byte host tier over a disk tier."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(PER, generator=generator) * 0.02) for _ in range(TENSORS)]
    store = TierStore([HostTier(host), DiskTier(root, 64 << 20, durable=False)])
    opt = TieredAdamW(params, lr=1e-3, weight_decay=0.1, store=store, state_precision=state_precision)
    try:
        assert opt.memory_plan().fits
        for _ in range(STEPS):
            for p in params:
                p.grad = torch.randn(PER, generator=generator) * 1e-3
            opt.step()
    finally:
        opt.close()
    return [p.detach().clone() for p in params]


@pytest.fixture(scope="module")
def references() -> dict[tuple[str | None, str], list[torch.Tensor]]:
    """The large-tier weights, per device mode and precision (filled by the first test of each)."""
    return {}


@pytest.mark.parametrize("state_precision", ["fp32", "8bit"])
@pytest.mark.parametrize(
    "host", [512 << 10, 1 << 20, 1152 << 10, 2 << 20, 3 << 20], ids=["512KiB", "1MiB", "1152KiB", "2MiB", "3MiB"]
)
def test_small_host_tier_trains_as_a_large_one(
    tmp_path: Path, device_mode: str, host: int, state_precision: str,
    references: dict[tuple[str | None, str], list[torch.Tensor]],
) -> None:
    reference = references.get((device_mode, state_precision))
    if reference is None:
        reference = references[device_mode, state_precision] = _train(tmp_path / "large", LARGE, state_precision)
    weights = _train(tmp_path / "small", host, state_precision)
    for index, (got, want) in enumerate(zip(weights, reference, strict=True)):
        assert torch.equal(got, want), f"parameter {index}: weights differ from the large-tier run"
