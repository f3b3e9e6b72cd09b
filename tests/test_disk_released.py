"""A store rewritten in place for a long time keeps a bounded record of the space it freed."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from tierstore import DiskTier, TierStore
from tierstore.disk.extents import Extent


def _live_extents() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Extent)


async def test_overwrites_do_not_pile_up_freed_extents(tmp_path: Path) -> None:
    values = [torch.randn(1024) for _ in range(4)]  # 4 KiB each: extents, not inline
    async with TierStore([DiskTier(tmp_path, "64MiB", durable=False, inline_max=0)]) as store:
        # a store more than a quarter full is not emptying: nothing freed is given back yet
        await store.put("filler", torch.zeros(8 << 20, dtype=torch.uint8))
        for i, value in enumerate(values):
            await store.put(f"k{i}", value)
        before = _live_extents()
        for n in range(12_000):  # copy-on-write: each put frees the extent of the value before
            await store.put(f"k{n % 4}", values[n % 4])
        grown = _live_extents() - before
        assert grown < 8_000, f"{grown} more extents alive after 12,000 overwrites of 4 keys"
        for i, value in enumerate(values):
            assert torch.equal(await store.get(f"k{i}"), value)
