"""Review of the small-keys rework (issue 15): races between puts that need no await, flushes,
deletes, holds and eviction, on a host+disk store with a tiny host tier, checked against a
dict model (also through the sync facade from several threads)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.errors import EntryHeldError, KeyNotFoundError
from tierstore.tiers import DiskTier, HostTier


def tiers(root: Path, host: str = "256KiB", durable: bool = False) -> list:
    return [HostTier(host), DiskTier(root, "64MiB", chunk_size="64KiB", durable=durable)]


@pytest.mark.parametrize("yields", [2, 3, 4])
async def test_a_flush_writes_the_value_it_planned_when_a_small_put_grows_the_key_meanwhile(tmp_path: Path, yields: int) -> None:
    # 3000 bytes: packed in a slab slot on the host tier, an extent on disk (not inline).
    old, new = torch.full((750,), 1.0), torch.full((1000,), 2.0)
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("k", old)
        flush = asyncio.ensure_future(store.flush())
        for _ in range(yields):
            await asyncio.sleep(0)
        await store.put("k", new)  # done at once (no await): the flush's source keeps the old value
        await flush
        assert torch.equal(await store.get("k"), new)
        await store.flush()
    async with TierStore(tiers(tmp_path / "d")) as store:
        assert torch.equal(await store.get("k"), new)


async def test_a_pop_that_hands_its_buffer_over_leaves_the_value_readable_until_the_key_is_gone(tmp_path: Path) -> None:
    old, new = torch.full((5000,), 1.0), torch.full((5000,), 2.0)  # a buffer of its own on the host tier
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("k", old)
        await store.flush()
        await store.put("k", new)  # the disk keeps the old value until the pop commits the delete
        pop = asyncio.ensure_future(store.pop("k"))
        await asyncio.sleep(0)
        try:
            assert torch.equal(await store.get("k"), new)  # the pop has not deleted it yet
        except KeyNotFoundError:
            pass
        assert torch.equal(await pop, new)
        assert "k" not in store


async def test_a_hold_taken_while_a_pop_deletes_loses_no_value(tmp_path: Path) -> None:
    old, new = torch.full((5000,), 1.0), torch.full((5000,), 2.0)
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("k", old)
        await store.flush()
        await store.put("k", new)
        pop = asyncio.ensure_future(store.pop("k"))
        await asyncio.sleep(0)
        async with store.hold("k") as held:
            assert torch.equal(held, new)
            try:
                popped = await pop
            except EntryHeldError:  # refused: the key keeps its value
                popped = None
            if popped is not None:
                assert torch.equal(popped, new) and "k" not in store
                popped.fill_(3.0)  # the caller's own memory now, not the held buffer
                assert torch.equal(held, new)
        if popped is None:
            assert torch.equal(await store.get("k"), new)
