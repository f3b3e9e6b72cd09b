"""The fast CRC-32C (``tierstore.disk.crc``, carry-less multiplication) gives the crc32c
package's values: stores written with either read with the other, and corruption still fails."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from tierstore import DiskTier, TierStore
from tierstore.disk import crc
from tierstore.disk.files import checksum
from tierstore.errors import ChecksumError

MiB = 1 << 20

needs_native = pytest.mark.skipif(crc.native() is None, reason="no AVX-512/VPCLMULQDQ CPU or no C compiler here")


@needs_native
def test_the_native_checksum_equals_the_package_on_every_length_offset_and_start_value() -> None:
    function = crc.native()
    assert function is not None
    data = np.frombuffer(os.urandom(5 * MiB), dtype=np.uint8)
    rng = random.Random(3)
    # every tail length around the 256-byte folding step and the 512-byte threshold, then big ones
    lengths = [*range(0, 1300), 4095, 4096, 65535, 65536, MiB - 1, MiB, MiB + 257, 4 * MiB]
    lengths += [rng.randint(0, 5 * MiB - 64) for _ in range(50)]
    for length in lengths:
        offset = rng.choice((0, 1, 7, 63))
        piece = data[offset : offset + length]
        start = rng.choice((0, 0xFFFFFFFF, rng.getrandbits(32)))
        address = piece.__array_interface__["data"][0]
        assert function(start, address, piece.nbytes) == crc32c.crc32c(piece.data, start), (length, offset, start)


def test_a_chunk_checksum_is_the_crc32c_of_its_bytes() -> None:
    for length in (0, 100, crc.NATIVE_MIN - 1, crc.NATIVE_MIN, 4 * MiB + 3):
        data = np.frombuffer(os.urandom(length), dtype=np.uint8)
        assert checksum(data) == crc32c.crc32c(data.data)
    strided = np.frombuffer(os.urandom(2 * crc.NATIVE_MIN), dtype=np.uint8)[::2]  # (not contiguous: the package)
    assert crc.crc32c_array(strided) == crc32c.crc32c(strided.tobytes())


def test_turned_off_by_the_environment() -> None:
    code = "from tierstore.disk import crc; print(crc.native() is None)"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TIERSTORE_NATIVE_CRC": "0"},
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


@needs_native
@pytest.mark.parametrize("written_native", [False, True])
async def test_a_store_written_with_one_implementation_reads_with_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_native: bool
) -> None:
    function = crc.native()
    value = torch.randn(3 * MiB + 11)  # three 4 MiB chunks, the last short

    def use(native: bool) -> None:
        monkeypatch.setattr(crc, "_function", function if native else None)

    use(written_native)
    async with TierStore([DiskTier(tmp_path, "128MiB", chunk_size="4MiB")]) as store:
        await store.put("v", value)
    use(not written_native)
    disk = DiskTier(tmp_path, "128MiB", chunk_size="4MiB")
    async with TierStore([disk]) as store:
        assert torch.equal(await store.get("v"), value)
        extent = disk.committed()["v"].extent
        assert extent is not None
        path = disk.segment_path(extent.segment)
    with open(path, "r+b") as handle:  # one flipped bit in the middle chunk
        handle.seek(extent.offset + 6 * MiB + 12345)
        byte = handle.read(1)
        handle.seek(extent.offset + 6 * MiB + 12345)
        handle.write(bytes([byte[0] ^ 0x10]))
    async with TierStore([DiskTier(tmp_path, "128MiB", chunk_size="4MiB")]) as store:
        with pytest.raises(ChecksumError):
            await store.get("v")


@needs_native
def test_a_build_is_kept_for_the_next_process(tmp_path: Path) -> None:
    code = "from tierstore.disk import crc; f = crc.native(); print(f(0, 0, 0))"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert done.stdout.strip() == "0"
    kept = list((tmp_path / "tierstore").glob("crc32c-*.so"))
    assert len(kept) == 1
    assert (tmp_path / "tierstore").stat().st_mode & 0o077 == 0


def test_a_checksum_never_waits_for_the_build() -> None:
    # (a fresh process: the first large checksum starts the build and is computed by the package)
    code = ("import numpy as np, crc32c; from tierstore.disk import crc; "
            "d = np.ones(1 << 20, dtype=np.uint8); print(crc.crc32c_array(d) == crc32c.crc32c(d.data))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"
