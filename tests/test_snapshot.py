"""zarr v3 export and import."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from tierstore import DeviceTier, DiskTier, HostTier, TierStore
from tierstore.snapshot import array_name
from tierstore.tensors import supported_dtypes
from tierstore.testing import ODD_KEYS, same_bytes, sample


def tiers(tmp_path: Path, name: str = "disk") -> list:
    return [DeviceTier("cpu", "64KiB"), HostTier("128KiB"), DiskTier(tmp_path / name, "64MiB")]


async def test_every_dtype_and_odd_keys_round_trip(tmp_path: Path) -> None:
    values = {f"dtype/{dtype}": sample(dtype, (4, 3), seed=i) for i, dtype in enumerate(supported_dtypes())}
    values.update({key: torch.tensor([i, i + 0.5]) for i, key in enumerate(ODD_KEYS)})
    values["zero-d"] = torch.tensor(3.25, dtype=torch.bfloat16)
    values["empty"] = torch.empty(0, 5, dtype=torch.float8_e4m3fn)
    values["big"] = torch.randn(50_000)
    async with TierStore(tiers(tmp_path)) as store:
        for key, value in values.items():
            await store.put(key, value)
        assert await store.export_zarr(tmp_path / "snap.zarr") == len(values)
        with pytest.raises(FileExistsError):
            await store.export_zarr(tmp_path / "snap.zarr")
    async with TierStore(tiers(tmp_path, "other")) as fresh:
        assert await fresh.import_zarr(tmp_path / "snap.zarr") == len(values)
        assert sorted(fresh.keys()) == sorted(values)
        for key, value in values.items():
            assert same_bytes(await fresh.get(key), value), key


async def test_plain_zarr_reads_the_snapshot(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        await store.put("layers.0.w/exp_avg", torch.arange(6.0).reshape(2, 3))
        await store.put("bf", torch.ones(3, dtype=torch.bfloat16))
        await store.export_zarr(tmp_path / "snap.zarr")
    group = zarr.open_group(tmp_path / "snap.zarr", mode="r")
    array = group[array_name("layers.0.w/exp_avg")]
    np.testing.assert_array_equal(array[:], np.arange(6.0, dtype=np.float32).reshape(2, 3))
    assert array.attrs["tierstore_key"] == "layers.0.w/exp_avg"
    bf = group[array_name("bf")]
    assert bf.dtype == np.uint16 and bf.attrs["tierstore_dtype"] == "bfloat16"
    assert (bf[:] == 0x3F80).all()  # 1.0 in bfloat16


def test_array_names_are_safe_file_names() -> None:
    for key in ODD_KEYS:
        name = array_name(key)
        assert "/" not in name and "\x00" not in name and name not in (".", "..") and len(name) <= 200
        assert not name.startswith((".", "_"))
    assert array_name("a.b-c_d") == "a.b-c_d" and array_name("a/b") == "a%2Fb"
    assert array_name("a/b") != array_name("a%2Fb")


async def test_export_does_not_move_entries(tmp_path: Path) -> None:
    async with TierStore(tiers(tmp_path)) as store:
        for i in range(20):
            await store.put(f"k{i}", torch.full((2048,), float(i)))
        before = {key: store.where(key) for key in store.keys()}
        await store.export_zarr(tmp_path / "snap.zarr")
        assert {key: store.where(key) for key in store.keys()} == before
