"""Every tier, alone and stacked, passes the conformance suite in tierstore.testing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier, MemoryTier
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


class TorchAllocatedHostTier(MemoryTier):
    """A memory tier of a user's own, written as the README's "Your own memory tier" shows:
    host memory from torch's allocator (no page rounding), counting its allocations."""

    def __init__(self, capacity: int | str) -> None:
        super().__init__(capacity, "mine")
        self.allocations = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _buffer_size(self, nbytes: int) -> int:
        return max(nbytes, 1)

    def _new_buffer(self, size: int) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8)


class TestUsersOwnMemoryTier(TierTests):
    """Above a disk tier, small enough that values move between the two."""

    def make_tiers(self, tmp_path: Path):
        return [TorchAllocatedHostTier("256KiB"), DiskTier(tmp_path / "disk", "64MiB", chunk_size="64KiB")]

    async def test_it_allocates_the_buffers(self, store) -> None:
        tier = store.tier("mine")
        await store.put("x", torch.arange(1000.0))
        assert tier.allocations >= 1 and tier.used >= 4000
        assert torch.equal(await store.get("x"), torch.arange(1000.0))


@pytest.mark.gpu
class TestDeviceTierCUDA(TierTests):
    def make_tiers(self, tmp_path: Path):
        return [DeviceTier("cuda", "256MiB"), HostTier("64KiB"), DiskTier(tmp_path / "disk", "128MiB")]

    async def test_get_is_on_the_device(self, store) -> None:
        await store.put("g", torch.arange(5.0))
        got = await store.get("g")
        assert got.device.type == "cuda" and torch.equal(got.cpu(), torch.arange(5.0))


def test_the_suite_runs_in_a_project_without_asyncio_mode_auto(tmp_path: Path) -> None:
    """A user's own project (no asyncio_mode = "auto" in its pytest settings) collected every
    inherited test as an error: 'requested an async fixture ... with no plugin'."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_mine.py").write_text(textwrap.dedent("""
        from tierstore import HostTier
        from tierstore.testing import TierTests

        class TestMine(TierTests):
            def make_tiers(self, tmp_path):
                return [HostTier("64MiB")]
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "roundtrip or shapes", "test_mine.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "error" not in done.stdout.lower()
