"""Catalog transactions of many small changes (issue 15, put rates): each transaction writes its
puts in key order in one call, applying only each key's last change, and a small one with no
sync is committed on the loop's thread. Puts, overwrites and deletes of the same keys mixed in
one transaction must leave what the process read before closing, after reopening; so must a
flush too large to commit on the loop."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.errors import KeyNotFoundError
from tierstore.tiers import DiskTier, HostTier


def disk(root: Path) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=False)


def small(seed: int) -> torch.Tensor:
    return torch.full((64,), seed, dtype=torch.int32)


async def read_all(store: TierStore, keys: list[str]) -> dict[str, int | None]:
    seen: dict[str, int | None] = {}
    for key in keys:
        try:
            seen[key] = int((await store.get(key))[0])
        except KeyNotFoundError:
            seen[key] = None
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_mixed_puts_and_deletes_of_few_keys_reopen_as_read(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(12)]
    async with TierStore([disk(tmp_path / "d")]) as store:
        for round_ in range(30):
            ops = []
            for j in range(rng.randint(1, 10)):
                key = rng.choice(keys)
                if rng.random() < 0.3:
                    ops.append(store.delete(key))
                else:
                    ops.append(store.put(key, small(round_ * 100 + j)))
            await asyncio.gather(*ops, return_exceptions=True)  # (a delete of a missing key raises)
            if rng.random() < 0.3:
                await asyncio.sleep(0.003)  # (a commit window passes)
        seen = await read_all(store, keys)
        assert any(v is not None for v in seen.values())
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert await read_all(store, keys) == seen


async def test_a_flush_too_large_for_the_loop_commits_every_key(tmp_path: Path) -> None:
    keys = [f"f{i}" for i in range(1500)]  # (more changes than a transaction committed on the loop)
    async with TierStore([HostTier("64MiB"), disk(tmp_path / "d")], flush_on_close=False) as store:
        for i, key in enumerate(keys):
            await store.put(key, small(i))
        await store.delete("f7")
        await store.put("f8", small(-8))
        await store.flush()
    async with TierStore([disk(tmp_path / "d")]) as store:
        seen = await read_all(store, keys)
    assert seen["f7"] is None and seen["f8"] == -8
    assert all(seen[key] == i for i, key in enumerate(keys) if key not in ("f7", "f8"))
