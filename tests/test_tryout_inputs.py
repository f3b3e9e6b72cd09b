"""Inputs a tryout gave that were taken silently or refused with a misleading reason."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, TierStore
from tierstore.errors import CapacityError
from tierstore.optim import TieredAdamW


def test_a_negative_min_offload_numel_is_refused() -> None:
    params = [torch.nn.Parameter(torch.randn(8))]
    with pytest.raises(ValueError, match="min_offload_numel must be at least 0, not -1"):
        TieredAdamW(params, offload="host", min_offload_numel=-1)  # (was taken: every tensor paged, as with 0)
    with pytest.raises(TypeError, match="min_offload_numel must be a whole number"):
        TieredAdamW(params, offload="host", min_offload_numel="4096")
    opt = TieredAdamW(params, offload="host", min_offload_numel=0)  # (0: page every tensor)
    opt.close()


@pytest.mark.skipif(not os.path.ismount("/proc"), reason="needs /proc, where no folder can be made")
async def test_a_folder_that_cannot_be_made_is_said_so() -> None:
    tier = DiskTier("/proc/tierstore-tryout/store", "1MiB")
    with pytest.raises(OSError, match="cannot create the disk tier folder /proc/tierstore-tryout/store"):
        await TierStore([tier]).open()  # (was a CapacityError: "0 B free")


async def test_a_refused_capacity_leaves_no_folder_behind(tmp_path: Path) -> None:
    root = tmp_path / "new" / "store"
    with pytest.raises(CapacityError, match="more than the file system can give"):
        await TierStore([DiskTier(root, 1 << 62)]).open()
    assert not (tmp_path / "new").exists()
    store = TierStore([DiskTier(root, "1MiB")])  # (and the folder is made when the capacity fits)
    await store.open()
    await store.put("x", torch.arange(4.0))
    assert torch.equal(await store.get("x"), torch.arange(4.0))
    await store.aclose()


async def test_a_folder_made_part_way_is_removed_again(tmp_path: Path) -> None:
    root = tmp_path / "p1" / "p2" / ("x" * 300)  # (p1 and p2 are made, then the name is too long)
    with pytest.raises(OSError, match="cannot create the disk tier folder"):
        await TierStore([DiskTier(root, "1MiB")]).open()
    assert not (tmp_path / "p1").exists()


def test_an_infinite_min_offload_numel_pages_nothing() -> None:
    params = [torch.nn.Parameter(torch.randn(8192))]
    opt = TieredAdamW(params, offload="host", min_offload_numel=math.inf)  # (taken before the count check came)
    params[0].grad = torch.ones(8192)
    opt.step()
    assert opt.memory_plan().paged_state_bytes == 0
    opt.close()
