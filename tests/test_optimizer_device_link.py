"""TieredAdamW on a store with a device tier crosses that tier's link, as swapping does: an
``emulate_device=`` that contradicts the tier is refused, and None follows the tier (not the
process setting)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.optim import TieredAdamW
from tierstore.sync import run
from tierstore.tiers import DeviceTier, DiskTier, HostTier

pytestmark = pytest.mark.device_modes


def _store(tmp_path: Path, emulated: bool) -> TierStore:
    return TierStore([DeviceTier("cpu", "1MiB", emulate_device=emulated), HostTier("16MiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)])


def test_an_emulate_device_that_contradicts_the_device_tier_is_refused(tmp_path: Path, device_mode: str) -> None:
    emulated = device_mode == "emulated"
    store = _store(tmp_path, emulated)
    model = torch.nn.Linear(64, 32)
    try:
        with pytest.raises(ValueError, match="contradicts the store's device tier 'device'.*TieredAdamW uses the device tier's link"):
            TieredAdamW(model.parameters(), store=store, min_offload_numel=10, emulate_device=not emulated)
        assert not [n for n in run(store.namespaces()) if n.live]  # refused before claiming one
        agreeing = TieredAdamW(model.parameters(), store=store, min_offload_numel=10, emulate_device=emulated)
        model(torch.randn(4, 64)).square().mean().backward()
        agreeing.step()
        agreeing.close()
    finally:
        run(store.aclose())


def test_the_optimizer_crosses_the_device_tiers_link_whatever_the_process_setting(tmp_path: Path, device_mode: str) -> None:
    tier_emulated = device_mode != "emulated"  # (the opposite of the process setting)
    store = _store(tmp_path, tier_emulated)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    reference = torch.nn.Linear(64, 32)
    reference.load_state_dict(model.state_dict())
    opt = TieredAdamW(model.parameters(), store=store, min_offload_numel=10)
    torch_opt = torch.optim.AdamW(reference.parameters(), fused=True)
    try:
        for step in range(3):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (reference, torch_opt)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
            crossed = opt.time_report().grads_to_host_bytes
            assert (crossed > 0) == tier_emulated, crossed  # gradients cross only an emulated link
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    finally:
        opt.close()
        run(store.aclose())
