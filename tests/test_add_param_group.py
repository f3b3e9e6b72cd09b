"""``add_param_group`` after construction: the group is planned as the constructor plans one.
It skipped the plan: a group the constructor refuses was accepted and every ``step()`` failed
(``StepIncompleteError`` ... ``TierFullError``, the advice to call ``step()`` again failing the
same way), and a large parameter added later was not paged in chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore.optim import OptimizerCapacityError, TieredAdamW

pytestmark = pytest.mark.device_modes


def test_a_group_that_cannot_fit_is_refused_and_the_optimizer_goes_on(tmp_path: Path, device_mode: str) -> None:
    torch.manual_seed(0)
    small, big = torch.nn.Linear(8, 8), torch.nn.Linear(96, 64)
    options = {"offload": "disk", "host_capacity": "16KiB", "min_offload_numel": 16}
    with pytest.raises(OptimizerCapacityError):  # (the constructor's verdict on both)
        TieredAdamW([*small.parameters(), *big.parameters()], disk_root=tmp_path / "both", **options)
    opt = TieredAdamW(small.parameters(), disk_root=tmp_path / "one", weight_decay=0.0, **options)
    twin = torch.nn.Linear(8, 8)
    twin.load_state_dict(small.state_dict())
    reference = torch.optim.AdamW(twin.parameters(), fused=True, weight_decay=0.0)
    buckets = (opt.bucket_bytes, opt.inflight)
    with pytest.raises(OptimizerCapacityError, match="cannot hold"):
        opt.add_param_group({"params": list(big.parameters())})
    assert len(opt.param_groups) == 1 and big.weight not in opt.state
    assert (opt.bucket_bytes, opt.inflight) == buckets
    for _ in range(3):
        inputs = torch.randn(2, 8)
        for model, optimizer in ((small, opt), (twin, reference)):
            optimizer.zero_grad()
            model(inputs).sum().backward()
            optimizer.step()
    assert torch.equal(small.weight, twin.weight) and big.weight.grad is None
    opt.close()


def test_a_large_parameter_added_later_is_paged_in_chunks(tmp_path: Path, device_mode: str) -> None:
    torch.manual_seed(0)
    small, big = torch.nn.Linear(8, 8), torch.nn.Linear(512, 256)  # (its state: 1.5 MiB, more than the tier)
    opt = TieredAdamW(small.parameters(), offload="disk", disk_root=tmp_path / "s", host_capacity="1MiB", chunk_bytes="128KiB",
                      weight_decay=0.0)
    opt.add_param_group({"params": list(big.parameters())})
    assert "chunks" in str(opt.memory_plan())
    twins = (torch.nn.Linear(8, 8), torch.nn.Linear(512, 256))
    twins[0].load_state_dict(small.state_dict())
    twins[1].load_state_dict(big.state_dict())
    reference = torch.optim.AdamW([*twins[0].parameters(), *twins[1].parameters()], fused=True, weight_decay=0.0)
    for _ in range(3):
        a, b = torch.randn(2, 8), torch.randn(2, 512)
        for (one, two), optimizer in (((small, big), opt), (twins, reference)):
            optimizer.zero_grad()
            (one(a).sum() + two(b).pow(2).sum()).backward()
            optimizer.step()
    assert torch.equal(big.weight, twins[1].weight) and torch.equal(small.weight, twins[0].weight)
    opt.close()


def test_a_group_refused_by_the_memory_plan_leaves_the_buckets_as_they_were(tmp_path: Path, device_mode: str) -> None:
    """Refused by the whole memory plan (each update fits, all of them together not), the group
    stayed in the pipeline's plan: its buckets grew past the tier."""
    torch.manual_seed(0)
    opt = TieredAdamW(torch.nn.Linear(32, 32).parameters(), host_capacity="64KiB", min_offload_numel=16)
    buckets = (opt.bucket_bytes, opt.inflight)
    many = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(8)]
    with pytest.raises(OptimizerCapacityError):
        opt.add_param_group({"params": many})
    assert (opt.bucket_bytes, opt.inflight) == buckets and len(opt.param_groups) == 1
    opt.close()


def test_a_chunk_too_large_for_the_tier_suggests_smaller_chunks(tmp_path: Path, device_mode: str) -> None:
    """A tryout: on a 64 KiB tier the chunks chosen for the tier (never below 64 KiB) did not
    fit, and the error asked for more capacity only; chunk_bytes="16KiB" trains there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(120, 100)  # (12,000 elements)
    options = {"offload": "disk", "host_capacity": "64KiB", "min_offload_numel": 1}
    with pytest.raises(OptimizerCapacityError, match=r"or page it in smaller chunks \(chunk_bytes= below the 64.0 KiB used\)"):
        TieredAdamW(model.parameters(), disk_root=tmp_path / "a", **options)
    opt = TieredAdamW(model.parameters(), disk_root=tmp_path / "b", chunk_bytes="16KiB", **options)
    model(torch.randn(2, 120)).sum().backward()
    opt.step()
    opt.close()
