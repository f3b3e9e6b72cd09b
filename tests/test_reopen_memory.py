"""A store closed and opened again starts with its memory tiers empty: the close dropped its
entries without giving their buffers back, so a store opened a second time found its host
tier full of the bytes of the values it had held, and every put there failed as full ("12.0
MiB in values deleted or replaced that a read still uses"; found by a review)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from tierstore import DiskTier, HostTier, TierStore


async def test_a_store_opened_again_has_its_memory_tier_free(tmp_path: Path) -> None:
    store = TierStore([HostTier("12MiB"), DiskTier(tmp_path / "d", "256MiB", durable=False)])
    for round_ in range(3):
        await store.open()
        try:
            assert store.tier("host").used == 0, f"open #{round_ + 1}: {store.tier('host').used:,} bytes in use before any put"
            values = {f"r{round_}/{i}": torch.full((1 << 19,), float(i)) for i in range(20)}  # (2 MiB each: 40 MiB through 12)
            await asyncio.wait_for(asyncio.gather(*(store.put(key, value, "host") for key, value in values.items())), 60)
            for key, value in values.items():
                assert torch.equal(await store.get(key), value)
        finally:
            await store.aclose()
    await store.open()
    try:
        assert torch.equal(await store.get("r0/3"), torch.full((1 << 19,), 3.0))  # (the first round's values kept)
    finally:
        await store.aclose()


async def test_small_values_in_slabs_are_given_back_at_the_close_too(tmp_path: Path) -> None:
    store = TierStore([HostTier("64KiB"), DiskTier(tmp_path / "d", "64MiB", durable=False)])
    for round_ in range(3):
        await store.open()
        try:
            assert store.tier("host").used == 0
            for i in range(200):  # (256 B each, packed in slabs)
                await store.put(f"s{round_}/{i}", torch.full((64,), float(i)), "host")
            assert torch.equal(await store.get(f"s{round_}/7"), torch.full((64,), 7.0))
        finally:
            await store.aclose()
