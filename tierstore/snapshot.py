"""zarr v3 snapshots of a store: every entry as one array that plain ``zarr.open`` reads.

Each key becomes one array directly under the snapshot's root group; its name is the key with
every byte outside ``[A-Za-z0-9._-]`` percent-escaped (a leading ``.`` or ``_`` too), or, for keys
whose escaped form is too long for a file name, ``~`` plus a digest. The exact key is always in
the array's ``tierstore_key`` attribute. dtypes numpy lacks (bfloat16, float8, complex32) are
stored as unsigned integers of the same width, with ``tierstore_dtype`` naming the real one.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import zarr.api.asynchronous as zasync

from .tensors import dtype_from_name, dtype_name

if TYPE_CHECKING:
    from .store import TierRef, TierStore

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_MAX_NAME = 200
_SNAPSHOT_FORMAT = 1
_BITS_AS_UINT = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_NUMPY_NATIVE = {
    torch.float64, torch.float32, torch.float16, torch.complex128, torch.complex64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
}
_CONCURRENCY = 4


def array_name(key: str) -> str:
    """The zarr array name of ``key``."""
    raw = key.encode("utf-8")
    escaped = "".join(
        chr(b) if b in _SAFE and not (i == 0 and b in b"._") else f"%{b:02X}" for i, b in enumerate(raw)
    )
    if len(escaped) > _MAX_NAME:
        return "~" + hashlib.blake2b(raw, digest_size=16).hexdigest()
    return escaped


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in _NUMPY_NATIVE:
        return tensor.numpy()
    bits = _BITS_AS_UINT[tensor.element_size()]
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=bits).numpy()
    return tensor.view(bits).numpy()


def _from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.asarray(array, order="C"))  # ascontiguousarray would make 0-d 1-d
    if tensor.dtype == dtype:
        return tensor
    if tensor.numel() == 0:
        return torch.empty(tuple(tensor.shape), dtype=dtype)
    return tensor.view(dtype)


async def export_zarr(store: TierStore, path: str | Path, overwrite: bool = False) -> int:
    """Write every entry of ``store`` into a new zarr v3 group at ``path``; return the count."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to replace it")
    group = await zasync.open_group(str(path), mode="w", zarr_format=3, attributes={"tierstore_snapshot": _SNAPSHOT_FORMAT})
    names: dict[str, str] = {}
    limit = asyncio.Semaphore(_CONCURRENCY)

    async def write(key: str) -> None:
        name = array_name(key)
        if name in names:
            raise ValueError(f"keys {names[name]!r} and {key!r} map to the same array name")
        names[name] = key
        async with limit:
            value = await store.read(key)
            data = _to_numpy(value)
            chunks = tuple(max(1, n) for n in data.shape)
            array = await group.create_array(
                name,
                shape=data.shape,
                dtype=data.dtype,
                chunks=chunks,
                compressors=None,
                attributes={"tierstore_key": key, "tierstore_dtype": dtype_name(value.dtype)},
            )
            if data.size:
                await array.setitem(Ellipsis, data)

    await asyncio.gather(*(write(key) for key in store.keys()))
    return len(names)


async def import_zarr(store: TierStore, path: str | Path, tier: TierRef = None) -> int:
    """Put every array of the zarr group at ``path`` into ``store``; return the count.

    Arrays written by ``export_zarr`` come back with their exact keys and dtypes; other zarr
    arrays are imported under their names with their numpy dtypes.
    """
    group = await zasync.open_group(str(path), mode="r")
    limit = asyncio.Semaphore(_CONCURRENCY)
    count = 0

    async def load(name: str, array: Any) -> None:
        nonlocal count
        attrs = dict(array.attrs)
        key = str(attrs.get("tierstore_key", name))
        dtype_label = attrs.get("tierstore_dtype")
        async with limit:
            data = await array.getitem(Ellipsis) if array.size else np.empty(array.shape, dtype=array.dtype)
            dtype = dtype_from_name(str(dtype_label)) if dtype_label else torch.from_numpy(np.empty(0, dtype=data.dtype)).dtype
            await store.put(key, _from_numpy(np.asarray(data), dtype), tier=tier)
            count += 1

    members = [(name, node) async for name, node in group.members() if hasattr(node, "shape")]
    await asyncio.gather(*(load(name, node) for name, node in members))
    return count
