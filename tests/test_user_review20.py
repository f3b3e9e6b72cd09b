"""What a new user tripped over in this session's verbs: ``write_back`` and ``prefetch`` given one
key as a str, ``write_back`` pointed at a tier it cannot write from, and its default tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.errors import InvalidKeyError, UnknownTierError


async def test_write_back_refuses_one_str_and_bad_keys(tmp_path: Path) -> None:
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        await store.put("ab", torch.ones(1000))
        with pytest.raises(TypeError, match=r"write_back\(\['ab'\]\)"):
            store.write_back("ab")
        with pytest.raises(InvalidKeyError):
            store.write_back([1])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="prefetch"):
            await store.prefetch("ab")
        assert store.write_back(["ab", "not there"]) == 1  # a key not in the store is skipped
        await store.aclose()
        await store.open()
        assert torch.equal(await store.read("ab"), torch.ones(1000))


async def test_write_back_defaults_to_the_tier_above_the_disk(tmp_path: Path) -> None:
    tiers = [DeviceTier("cpu", "1MiB"), HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]
    async with TierStore(tiers) as store:
        await store.put("k", torch.ones(1000), "host")
        assert store.write_back(["k"]) == 1  # host, not the fastest tier (the device)
        for wrong in ("device", "disk"):
            with pytest.raises(UnknownTierError, match="right above the disk tier"):
                store.write_back(["k"], wrong)
        await store.flush()
        assert "disk" in store.where("k") and "host" in store.where("k")


async def test_write_back_without_a_disk_tier_says_so() -> None:
    async with TierStore([HostTier("1MiB")]) as store:
        with pytest.raises(UnknownTierError, match="needs a memory tier above a disk tier"):
            store.write_back(["k"])


def test_the_sync_facade_checks_the_same(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        store.put("k", torch.ones(10))
        with pytest.raises(TypeError):
            store.write_back("k")
        assert store.write_back(["k"]) == 1


def test_sync_prefetch_refuses_one_str_too(tmp_path: Path) -> None:
    """The blocking facade turned the keys into a list first: "ab" became keys 'a' and 'b'."""
    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        for key in ("a", "b", "ab"):
            store.put(key, torch.ones(10))
        with pytest.raises(TypeError, match="prefetch"):
            store.prefetch("ab")
        assert store.prefetch(["ab"]).wait() is not None
