"""zarr v3 snapshots of a store: every entry as one array that plain ``zarr.open`` reads.

Each key becomes one array directly under the snapshot's root group; its name is the key with
every byte outside ``[A-Za-z0-9._-]`` percent-escaped (a leading ``.`` or ``_`` too), or, for keys
whose escaped form is too long for a file name, ``~`` plus a digest. The exact key is always in
the array's ``tierstore_key`` attribute. dtypes numpy lacks (bfloat16, float8, complex32) are
stored as unsigned integers of the same width, with ``tierstore_dtype`` naming the real one.

Both directions stream: an array is split along its first dimension into chunks of at most
``CHUNK_BYTES`` and written or read a slab at a time, and values in flight at once are bounded
by ``INFLIGHT_BYTES`` (one larger value runs alone), so memory holds about one value and a slab,
never the whole snapshot.

An export is written into a hidden temporary folder beside ``path`` and renamed into place once
complete: an export that fails or is interrupted leaves the previous snapshot (if any) as it
was. Its keys are those in the store when it starts; each value is whole, read as it is when
the export reaches it (a put racing the export may or may not be in it; a key deleted meanwhile
is left out).

An import checks every array before reading any: its key, its dtype, and its size against the
store's capacity (a value must fit in one tier, all of them in the store), so an oversized or
crafted zarr is refused (``TierFullError``, ``InvalidKeyError``, ``ValueError``, ``TypeError``)
before anything large is allocated and before anything is put.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import math
import os
import shutil
import sys
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import zarr.api.asynchronous as zasync
from zarr.errors import ContainsArrayError

from .errors import KeyNotFoundError, TierFullError
from .keys import check_key
from .tensors import dtype_from_name, dtype_name, empty
from .units import format_bytes
from .workers import wait_uncancelled

T = TypeVar("T")

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
#: Largest zarr chunk an export writes (arrays are split along their first dimension).
CHUNK_BYTES = 16 << 20
#: Bytes of values being exported or imported at once (a larger value goes alone).
INFLIGHT_BYTES = 256 << 20


def array_name(key: str) -> str:
    """The zarr array name of ``key``."""
    raw = key.encode("utf-8")
    # (a leading "." or "_", and a first letter of "zarr.json", the group's own metadata file, escaped)
    clash = raw == b"zarr.json"
    escaped = "".join(
        chr(b) if b in _SAFE and not (i == 0 and (b in b"._" or clash)) else f"%{b:02X}" for i, b in enumerate(raw)
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


async def _whole(write: Awaitable[T]) -> T:
    """Await one of zarr's writes to its end, even when cancelled meanwhile (then re-raise):
    zarr writes its files on threads, which a cancellation does not stop, and a write still
    running after a cancelled export removed its partial folder made that folder again."""
    task = asyncio.ensure_future(write)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await wait_uncancelled(task)
        raise


async def _all(coros: list[Any]) -> list[Any]:
    """Run ``coros`` concurrently; when one fails (or this is cancelled), cancel the others and
    wait for them before raising, so nothing is left writing."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class _ByteBudget:
    """At most ``limit`` bytes in flight; a request larger than the limit waits to run alone."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._changed = asyncio.Condition()

    async def acquire(self, nbytes: int) -> int:
        nbytes = min(nbytes, self._limit)
        async with self._changed:
            await self._changed.wait_for(lambda: self._used + nbytes <= self._limit)
            self._used += nbytes
        return nbytes

    async def release(self, nbytes: int) -> None:
        async with self._changed:
            self._used -= nbytes
            self._changed.notify_all()


def _rows_per_chunk(shape: tuple[int, ...], itemsize: int) -> int:
    row = itemsize * math.prod(shape[1:])
    return max(1, CHUNK_BYTES // max(1, row))


def _chunks_for(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if not shape:
        return ()
    if 0 in shape:  # (no chunk is ever written; one as large as the other dimensions would be refused on import)
        return (1,) * len(shape)
    return (min(max(1, shape[0]), _rows_per_chunk(shape, itemsize)), *(max(1, n) for n in shape[1:]))


def _slabs(length: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, length)) for i in range(0, length, step)]


async def export_zarr(store: TierStore, path: str | Path, overwrite: bool = False) -> int:
    """Write every entry of ``store`` into a new zarr v3 group at ``path``; return the count.

    The group is built in a temporary folder beside ``path`` and renamed into place when
    complete; on failure or cancellation the temporary folder is removed and ``path`` is as it
    was. ``FileExistsError`` if ``path`` is a non-empty folder and not ``overwrite``, or a
    non-empty folder without a zarr group at its top (even with ``overwrite``).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to replace it")
    if path.is_dir() and any(path.iterdir()) and not any((path / name).is_file() for name in ("zarr.json", ".zgroup")):
        # overwrite replaces a snapshot, never a folder of something else given by mistake
        raise FileExistsError(f"{path} is a non-empty folder that holds no zarr group; refusing to replace it")
    keys = store.keys()
    names: dict[str, str] = {}
    for key in keys:
        name = array_name(key)
        if name in names:
            raise ValueError(f"keys {names[name]!r} and {key!r} map to the same array name")
        names[name] = key
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:12]}"
    try:
        group = await _whole(zasync.open_group(
            str(partial), mode="w-", zarr_format=3, attributes={"tierstore_snapshot": _SNAPSHOT_FORMAT}
        ))
        budget = _ByteBudget(INFLIGHT_BYTES)
        limit = asyncio.Semaphore(_CONCURRENCY)
        written = await _all([_export_one(store, group, name, key, budget, limit) for name, key in names.items()])
        _replace(partial, path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # the previous snapshot, if any, is untouched
        raise
    return sum(written)


async def _export_one(store: TierStore, group: Any, name: str, key: str, budget: _ByteBudget, limit: asyncio.Semaphore) -> int:
    try:
        nbytes = int(store.info(key)["nbytes"])
    except KeyNotFoundError:
        return 0  # deleted since the export began
    async with limit:
        taken = await budget.acquire(nbytes)
        try:
            try:
                value = await store.read(key)
            except KeyNotFoundError:
                return 0
            # (no elements: no chunks, no numpy array, which refuses shapes like (2**31, 0, 2**31))
            data = _to_numpy(value if value.numel() else torch.empty(0, dtype=value.dtype))
            shape = tuple(value.shape)
            array = await _whole(group.create_array(
                name,
                shape=shape,
                dtype=data.dtype,
                chunks=_chunks_for(shape, data.itemsize),
                compressors=None,
                attributes={"tierstore_key": key, "tierstore_dtype": dtype_name(value.dtype)},
            ))
            if value.numel() and data.ndim == 0:
                await _whole(array.setitem(Ellipsis, data))
            elif value.numel():
                for start, stop in _slabs(data.shape[0], array.chunks[0]):
                    await _whole(array.setitem(slice(start, stop), data[start:stop]))
            return 1
        finally:
            await budget.release(taken)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one step (Linux ``renameat2``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False  # a libc without renameat2 (glibc < 2.28, musl < 1.2.6)
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False  # the file system or kernel cannot exchange: rename in two steps
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _replace(partial: Path, path: Path) -> None:
    """Put the finished ``partial`` folder at ``path``, replacing what is there.

    Where the system can swap two folders in one step, ``path`` always holds a whole snapshot,
    even if the process dies meanwhile; elsewhere the old one is renamed away first, and a crash
    between the two renames leaves it beside ``path`` under a hidden ``.old-`` name."""
    if path.is_dir() and _exchange(partial, path):
        shutil.rmtree(partial, ignore_errors=True)  # now the previous snapshot
        return
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(path, old)
    try:
        os.replace(partial, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class _Plan:
    """One array of a snapshot to import, checked before anything is read."""

    array: Any
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _plan(name: str, array: Any) -> _Plan:
    attrs = dict(array.attrs)
    key = check_key(attrs.get("tierstore_key", name))
    np_dtype = np.dtype(array.dtype)
    if np_dtype.kind not in "biufc" or np_dtype.hasobject or np_dtype.fields is not None:
        raise TypeError(f"array {name!r} has dtype {np_dtype}, which is not a tensor dtype")
    label = attrs.get("tierstore_dtype")
    if label is not None:
        dtype = dtype_from_name(str(label))
    else:
        dtype = torch.from_numpy(np.empty(0, dtype=np_dtype.newbyteorder("="))).dtype
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if itemsize != np_dtype.itemsize:
        raise ValueError(f"array {name!r}: tierstore_dtype {label!r} is {itemsize} bytes, its data {np_dtype.itemsize}")
    shape = tuple(int(n) for n in array.shape)
    return _Plan(array, key, dtype, shape, math.prod(shape) * itemsize)


def _check_room(store: TierStore, plans: list[_Plan]) -> None:
    largest = max((tier.capacity for tier in store.tiers), default=0)
    total = sum(tier.capacity for tier in store.tiers)
    for plan in plans:
        array = plan.array
        chunk = math.prod(getattr(array, "shards", None) or array.chunks or (1,)) * np.dtype(array.dtype).itemsize
        if not plan.nbytes:
            continue  # (no elements: no chunk is read)
        if plan.nbytes > largest or chunk > max(largest, CHUNK_BYTES):
            raise TierFullError(
                f"{plan.key!r} ({format_bytes(plan.nbytes)}, zarr chunks of {format_bytes(chunk)}) does not fit "
                f"in any tier of the store (the largest holds {format_bytes(largest)}); nothing was imported"
            )
        # Reading any element decodes a whole chunk: a chunk far larger than its array (a few
        # compressed bytes declaring gigabytes) would be allocated in full before any put.
        if chunk > max(CHUNK_BYTES, plan.nbytes):
            raise ValueError(
                f"array {plan.key!r} holds {format_bytes(plan.nbytes)} but declares zarr chunks of "
                f"{format_bytes(chunk)}; reading it would decode a whole chunk; nothing was imported"
            )
    needed = sum(plan.nbytes for plan in plans)
    replaced = {plan.key for plan in plans}
    kept = 0  # keys the import does not replace keep their room
    for key in store.keys():
        if key not in replaced:
            try:
                kept += int(store.info(key)["nbytes"])
            except KeyNotFoundError:
                continue
    if needed + kept > total:
        raise TierFullError(
            f"the snapshot holds {format_bytes(needed)}; the store's tiers hold {format_bytes(total)} in all, "
            f"{format_bytes(kept)} of it taken by keys the import keeps; nothing was imported"
        )


async def import_zarr(store: TierStore, path: str | Path, tier: TierRef = None) -> int:
    """Put every array of the zarr group at ``path`` into ``store``; return the count.

    Arrays written by ``export_zarr`` come back with their exact keys and dtypes; other zarr
    arrays are imported under their names with their numpy dtypes, those of sub-groups under
    their paths in the group (``"sub/b"``). Every array is checked (key, dtype, size against
    the store's capacity) before any is read.
    """
    try:
        group = await zasync.open_group(str(path), mode="r")
    except ContainsArrayError:
        raise ValueError(
            f"{path} is a zarr array, not a group: import_zarr reads the arrays of a group (as export_zarr writes); "
            "read this one with zarr and put it"
        ) from None
    members = [(name, node) async for name, node in group.members(max_depth=None) if hasattr(node, "shape")]
    plans = [_plan(name, node) for name, node in members]
    seen: dict[str, str] = {}
    for (name, _), plan in zip(members, plans, strict=True):
        if plan.key in seen:
            raise ValueError(f"arrays {seen[plan.key]!r} and {name!r} both hold key {plan.key!r}")
        seen[plan.key] = name
    _check_room(store, plans)
    budget = _ByteBudget(INFLIGHT_BYTES)
    limit = asyncio.Semaphore(_CONCURRENCY)

    async def load(plan: _Plan) -> None:
        async with limit:
            taken = await budget.acquire(plan.nbytes)
            try:
                value = empty(plan.shape, plan.dtype)
                view = _to_numpy(value) if plan.nbytes else None  # (numpy refuses some empty shapes)
                if view is not None and not plan.shape:
                    view[...] = await plan.array.getitem(())
                elif view is not None:
                    step = max(plan.array.chunks[0], _rows_per_chunk(plan.shape, view.itemsize) // plan.array.chunks[0] * plan.array.chunks[0])
                    for start, stop in _slabs(plan.shape[0], step):
                        view[start:stop] = await plan.array.getitem(slice(start, stop))
                await store.put(plan.key, value, tier=tier)
            finally:
                await budget.release(taken)

    await _all([load(plan) for plan in plans])
    return len(plans)
