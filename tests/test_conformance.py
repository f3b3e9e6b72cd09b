"""Every tier, alone and stacked, passes the conformance suite in tierstore.testing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier
from tierstore.testing import TierTests


class TestDeviceTierCPU(TierTests):
    def make_tiers(self, tmp_path: Path):
        return [DeviceTier("cpu", "64MiB")]


class TestHostTier(TierTests):
    def make_tiers(self, tmp_path: Path):
        return [HostTier("64MiB")]


class TestDiskTier(TierTests):
    def make_tiers(self, tmp_path: Path):
        return [DiskTier(tmp_path / "disk", "128MiB", chunk_size="256KiB")]


class TestDiskTierBuffered(TierTests):
    def make_tiers(self, tmp_path: Path):
        return [DiskTier(tmp_path / "disk", "128MiB", direct=False, durable=False)]


class TestTinyStack(TierTests):
    """Capacities so small that most values live on disk and every access moves bytes."""

    def make_tiers(self, tmp_path: Path):
        return [DeviceTier("cpu", "48KiB"), HostTier("96KiB"), DiskTier(tmp_path / "disk", "64MiB", chunk_size="64KiB")]


@pytest.mark.gpu
class TestDeviceTierCUDA(TierTests):
    def make_tiers(self, tmp_path: Path):
        return [DeviceTier("cuda", "256MiB"), HostTier("64KiB"), DiskTier(tmp_path / "disk", "128MiB")]

    async def test_get_is_on_the_device(self, store) -> None:
        await store.put("g", torch.arange(5.0))
        got = await store.get("g")
        assert got.device.type == "cuda" and torch.equal(got.cpu(), torch.arange(5.0))
