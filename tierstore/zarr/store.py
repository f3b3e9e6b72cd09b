"""``TierZarrStore``: a zarr v3 store whose keys live in a ``TierStore``.

Each zarr key is one entry of the tier store, a 1-D ``uint8`` tensor under ``prefix + key``, so
a zarr hierarchy and other data can share a store and every key can be read with the plain
verbs. Chunks are promoted to memory when read, evicted by the store's policy, prefetched
(``tierstore.zarr.prefetch``, and the store's own prefetch policy, e.g. ``ScheduleLearned``
with ``mark_step()``) and kept on the disk tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import numpy as np
import torch
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from tierstore.engine import TierRef
from tierstore.errors import InvalidKeyError, KeyNotFoundError, TierFullError, TierStoreError
from tierstore.flags import require_flag
from tierstore.keys import check_key
from tierstore.store import TierStore
from tierstore.sync import SyncTierStore
from tierstore.tiers.base import MemoryTier

from .bridge import block_on_store_loop, on_store_loop
from .index import KeyIndex, index_of
from .prefetch import BurstPrefetcher

__all__ = ["StoreNotInProcessError", "TierZarrStore"]


class StoreNotInProcessError(TierStoreError, RuntimeError):
    """A pickled ``TierZarrStore`` was unpickled where its ``TierStore`` does not exist."""


# Pickling: an adapter pickles to a token naming its TierStore in this process (the store's open
# files and loop cannot travel); unpickling looks the token up, here or nowhere.
_TOKENS: weakref.WeakKeyDictionary[TierStore, str] = weakref.WeakKeyDictionary()
_BY_TOKEN: weakref.WeakValueDictionary[str, TierStore] = weakref.WeakValueDictionary()
_token_lock = threading.Lock()


def _token(store: TierStore) -> str:
    with _token_lock:
        token = _TOKENS.get(store)
        if token is None:
            token = _TOKENS[store] = uuid.uuid4().hex
            _BY_TOKEN[token] = store
        return token


def _unpickle(token: str, pid: int, prefix: str, read_only: bool, tier: TierRef, prefetch: bool) -> TierZarrStore:
    store = _BY_TOKEN.get(token) if pid == os.getpid() else None
    if store is None:
        raise StoreNotInProcessError(
            "a TierZarrStore unpickles only in the process that pickled it, while its TierStore exists: "
            "a tier store's memory, open files and event loop cannot be sent to another process. Open the "
            "store's disk folder there and build a TierZarrStore over it instead"
        )
    return TierZarrStore(store, prefix, read_only=read_only, tier=tier, prefetch=prefetch)


def _normalise_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise InvalidKeyError(f"prefix is a str, not {type(prefix).__name__}")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    if prefix:
        check_key(prefix)
    return prefix


def _as_bytes(value: torch.Tensor) -> torch.Tensor:
    """Any stored tensor as its raw bytes (keys under the prefix may be written by plain verbs)."""
    flat = value.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _check_byte_range(byte_range: ByteRequest | None) -> None:
    """``TypeError`` for what is not a ``ByteRequest``; ``ValueError`` for negative offsets, which
    zarr does not define (zarr's stores disagree: Python slicing from the end, or an OSError)."""
    if byte_range is None:
        return
    if isinstance(byte_range, RangeByteRequest):
        bounds = (byte_range.start, byte_range.end)
    elif isinstance(byte_range, OffsetByteRequest):
        bounds = (byte_range.offset,)
    elif isinstance(byte_range, SuffixByteRequest):
        bounds = (byte_range.suffix,)
    else:
        raise TypeError(f"Unexpected byte_range, got {byte_range!r}")
    if any(bound < 0 for bound in bounds):
        raise ValueError(f"byte_range {byte_range!r} has a negative bound; byte offsets and lengths are >= 0")


def _byte_slice(size: int, byte_range: ByteRequest | None) -> tuple[int, int]:
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        start, end = byte_range.start, byte_range.end
    elif isinstance(byte_range, OffsetByteRequest):
        start, end = byte_range.offset, size
    elif isinstance(byte_range, SuffixByteRequest):
        start, end = max(0, size - byte_range.suffix), size
    else:
        raise TypeError(f"Unexpected byte_range, got {byte_range!r}")
    start = max(0, start)
    return min(start, size), max(min(end, size), min(start, size))


class TierZarrStore(Store):
    """A zarr v3 ``Store`` over a ``TierStore`` (or ``SyncTierStore``).

    Parameters
    ----------
    store:
        An open ``TierStore`` or ``SyncTierStore``; the adapter never opens or closes it.
    prefix:
        Zarr key ``k`` is the store key ``prefix + k`` (a ``"/"`` is added to a non-empty prefix).
    read_only:
        Refuse writes and deletes (``ValueError``, as every zarr store does).
    tier:
        Tier that reads promote chunks to (default: the fastest memory tier in CPU memory, which
        zarr's CPU buffers can use without a copy across devices).
    prefetch:
        Prefetch the chunks that follow a sequential burst of reads (``tierstore.zarr.prefetch``).

    Two adapters over the same tier store and prefix compare equal (``read_only`` aside, as for
    zarr's ``LocalStore``) and may coexist: they share one key index. Closing an adapter does not
    close the tier store. An adapter pickles, and unpickles to an equal adapter in the same
    process while its tier store exists; elsewhere unpickling raises ``StoreNotInProcessError``.
    """

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    def __init__(
        self,
        store: TierStore | SyncTierStore,
        prefix: str = "zarr/",
        read_only: bool = False,
        *,
        tier: TierRef = None,
        prefetch: bool = True,
    ) -> None:
        super().__init__(read_only=require_flag("read_only", read_only))
        base = store.store if isinstance(store, SyncTierStore) else store
        if not isinstance(base, TierStore):
            raise TypeError(f"store must be a TierStore or SyncTierStore, not {type(store).__name__}")
        if tier is not None and not isinstance(base.tier(tier), MemoryTier):  # (UnknownTierError for a name it lacks)
            memory = [t.name for t in base.tiers if isinstance(t, MemoryTier)]
            raise ValueError(f"tier={tier!r} is not a memory tier: reads promote chunks to a memory tier (this store's: {memory})")
        self._base = base
        self._sync = store if isinstance(store, SyncTierStore) else None
        self._prefix = _normalise_prefix(prefix)
        self._tier_ref = tier
        self._prefetch = require_flag("prefetch", prefetch)
        self._index: KeyIndex = index_of(base, self._prefix)
        self._prefetcher: BurstPrefetcher | None = None

    # -- identity -------------------------------------------------------------------------------

    @property
    def tier_store(self) -> TierStore:
        """The (asynchronous) tier store the keys live in."""
        return self._base

    @property
    def prefix(self) -> str:
        """What every zarr key is prefixed with in the tier store."""
        return self._prefix

    def with_read_only(self, read_only: bool = False) -> TierZarrStore:
        """A new adapter over the same store and prefix (not open) with this ``read_only``."""
        # Not ``self._sync or self._base``: the truth of a SyncTierStore is its len(), a blocking
        # round trip to the store's loop (a deadlock when zarr calls this from that loop's thread).
        store = self._sync if self._sync is not None else self._base
        return type(self)(store, self._prefix, read_only, tier=self._tier_ref, prefetch=self._prefetch)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TierZarrStore) and other._base is self._base and other._prefix == self._prefix

    def __hash__(self) -> int:
        return hash((id(self._base), self._prefix))

    def __reduce__(self) -> tuple[Any, ...]:
        args = (_token(self._base), os.getpid(), self._prefix, self.read_only, self._tier_ref, self._prefetch)
        return (_unpickle, args)

    def __str__(self) -> str:
        return f"tierstore://{_token(self._base)[:8]}/{self._prefix}"

    def __repr__(self) -> str:
        return f"TierZarrStore({self._base!r}, prefix={self._prefix!r}, read_only={self.read_only})"

    # -- lifecycle ------------------------------------------------------------------------------

    async def _open(self) -> None:
        await super()._open()
        await on_store_loop(self._base, self._refresh)

    async def _refresh(self) -> None:
        self._index.refresh(self._base)

    def close(self) -> None:
        """Close the adapter (running prefetches are stopped); the tier store stays open."""
        prefetcher, self._prefetcher = self._prefetcher, None
        loop = self._base.loop
        if prefetcher is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(prefetcher.cancel)
        super().close()

    def mark_step(self) -> None:
        """End of a repeated phase (an epoch of a data loader): the store's prefetch policy
        (e.g. ``ScheduleLearned``) learns the order of the reads since the last mark."""

        async def mark() -> None:
            self._base.mark_step()

        if self._base.loop is not None and threading.get_ident() == getattr(self._base.loop, "_thread_id", None):
            self._base.mark_step()
        else:
            block_on_store_loop(self._base, mark)

    # -- keys -----------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"zarr keys are str, not {type(key).__name__}")
        return check_key(self._prefix + key)

    def _read_tier(self) -> int:
        if self._tier_ref is not None:
            return self._base.tiers.index(self._base.tier(self._tier_ref))
        for t, tier in enumerate(self._base.tiers):
            if isinstance(tier, MemoryTier) and tier.device.type == "cpu":
                return t
        return 0

    # -- reading --------------------------------------------------------------------------------

    async def get(
        self, key: str, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """The bytes of ``key`` (or of ``byte_range`` of them), or None if there is no such key."""
        await self._ensure_open()
        _check_byte_range(byte_range)
        prototype = prototype or default_buffer_prototype()
        try:
            name = self._key(key)
        except InvalidKeyError:
            return None
        data = await on_store_loop(self._base, lambda: self._read(key, name, byte_range))
        if data is None:
            return None
        return prototype.buffer.from_array_like(data)

    async def _read(self, key: str, name: str, byte_range: ByteRequest | None) -> np.ndarray | None:
        """On the store's loop: promote ``name`` to the read tier and copy out the bytes asked."""
        store = self._base
        if name not in store:
            return None
        t = self._read_tier()
        if self._prefetch:
            if self._prefetcher is None:
                self._prefetcher = BurstPrefetcher(store, self._prefix, t)
            await self._prefetcher.on_get(key)
        try:
            if byte_range is None:
                value = await store.get(name, t)
                return _as_bytes(value).cpu().numpy()
            # A range: pin the value where it is promoted to and copy out only the range; one
            # larger than the tier, or a store with no memory tier (a disk tier holds nothing),
            # reads the value whole.
            if isinstance(store.tiers[t], MemoryTier):
                try:
                    async with store.hold(name, t) as held:
                        raw = _as_bytes(held)
                        start, end = _byte_slice(raw.numel(), byte_range)
                        return raw[start:end].cpu().numpy().copy()
                except TierFullError:
                    pass
            raw = _as_bytes(await store.get(name, t))
            start, end = _byte_slice(raw.numel(), byte_range)
            return raw[start:end].cpu().numpy()
        except KeyNotFoundError:
            return None  # deleted while we waited

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        """Several (possibly partial) values; the whole list is prefetched before reading."""
        key_ranges = list(key_ranges)
        await self._prefetch_list([key for key, _ in key_ranges])
        return list(await asyncio.gather(*(self.get(key, prototype, byte_range) for key, byte_range in key_ranges)))

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        requests = list(requests)
        await self._prefetch_list([key for key, _, _ in requests])
        for future in asyncio.as_completed([self._get_one(*request) for request in requests]):
            yield await future

    async def _get_one(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None) -> tuple[str, Buffer | None]:
        return key, await self.get(key, prototype, byte_range)

    async def _prefetch_list(self, keys: list[str]) -> None:
        """Bring ``keys`` up in the background, behind the demand reads that follow."""
        await self._ensure_open()
        if not self._prefetch or len(keys) < 2:
            return

        async def start() -> None:
            names = []
            for key in keys:
                try:
                    name = self._key(key)
                except InvalidKeyError:
                    continue
                if name in self._base:
                    names.append(name)
            if names:
                await self._base.prefetch(dict.fromkeys(names), self._read_tier())

        await on_store_loop(self._base, start)

    async def exists(self, key: str) -> bool:
        """Whether ``key`` has a value."""
        await self._ensure_open()
        try:
            name = self._key(key)
        except InvalidKeyError:
            return False

        async def check() -> bool:
            return name in self._base

        return await on_store_loop(self._base, check)

    async def getsize(self, key: str) -> int:
        """Bytes of the value of ``key`` (``FileNotFoundError`` when there is none)."""
        await self._ensure_open()
        try:
            name = self._key(key)
        except InvalidKeyError:
            raise FileNotFoundError(key) from None

        async def size() -> int:
            try:
                return int(self._base.info(name)["nbytes"])
            except KeyNotFoundError:
                raise FileNotFoundError(key) from None

        return await on_store_loop(self._base, size)

    async def getsize_prefix(self, prefix: str) -> int:
        """Bytes of every value whose key starts with ``prefix``."""
        await self._ensure_open()

        async def total() -> int:
            self._index.refresh(self._base)
            size = 0
            for key in self._index.under(prefix):
                try:
                    size += int(self._base.info(self._prefix + key)["nbytes"])
                except KeyNotFoundError:
                    continue
            return size

        return await on_store_loop(self._base, total)

    # -- writing --------------------------------------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key`` (replacing any value it had)."""
        self._check_writable()
        await self._ensure_open()
        if not isinstance(value, Buffer):
            raise TypeError(f"TierZarrStore.set(): value must be a zarr Buffer, not {type(value).__name__}")
        name = self._key(key)
        data = value.as_numpy_array()
        if not data.flags.writeable or not data.flags.c_contiguous:
            data = np.array(data)  # torch wants a writable array; the put copies it anyway
        tensor = torch.from_numpy(data.reshape(-1).view(np.uint8))
        await on_store_loop(self._base, lambda: self._write(key, name, tensor))

    async def _write(self, key: str, name: str, tensor: torch.Tensor) -> None:
        await self._base.put(name, tensor)
        self._index.added(key)
        if self._prefetcher is not None:
            self._prefetcher.forget_metadata(key)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key`` unless it has a value (or another call is writing one)."""
        self._check_writable()
        await self._ensure_open()
        name = self._key(key)
        index = self._index

        async def claim() -> bool:
            if name in self._base or key in index.pending:
                return False
            index.pending.add(key)
            return True

        if not await on_store_loop(self._base, claim):
            return
        try:
            await self.set(key, value)
        finally:

            async def release() -> None:
                index.pending.discard(key)

            await on_store_loop(self._base, release)

    async def delete(self, key: str) -> None:
        """Remove ``key``; a key that has no value is not an error."""
        self._check_writable()
        await self._ensure_open()
        try:
            self._key(key)
        except InvalidKeyError:
            return  # not a key the store could hold: nothing to delete
        await on_store_loop(self._base, lambda: self._remove([key]))

    async def _remove(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(KeyNotFoundError):
                await self._base.delete(self._prefix + key)
            self._index.removed(key)
            if self._prefetcher is not None:
                self._prefetcher.forget_metadata(key)

    async def delete_dir(self, prefix: str) -> None:
        """Remove every key under the directory ``prefix``."""
        self._check_writable()
        await self._ensure_open()
        if prefix and not prefix.endswith("/"):
            prefix += "/"

        async def remove() -> None:
            self._index.refresh(self._base)
            await self._remove(self._index.under(prefix))

        await on_store_loop(self._base, remove)

    async def clear(self) -> None:
        """Remove every key under this adapter's prefix."""
        await self.delete_dir("")

    # -- listing --------------------------------------------------------------------------------

    async def _listing(self, fn: Any) -> list[str]:
        await self._ensure_open()

        async def run() -> list[str]:
            self._index.refresh(self._base)
            return list(fn())

        return await on_store_loop(self._base, run)

    async def list(self) -> AsyncIterator[str]:
        """Every zarr key, sorted."""
        for key in await self._listing(lambda: self._index.under("")):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every zarr key starting with ``prefix``, sorted."""
        for key in await self._listing(lambda: self._index.under(prefix)):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """Keys and directories directly under the directory ``prefix``."""
        prefix = prefix.rstrip("/")
        directory = prefix + "/" if prefix else ""
        for name in await self._listing(lambda: self._index.children(directory)):
            yield name

    # -- blocking protocol (zarr's SupportsSyncStore) --------------------------------------------

    def get_sync(
        self, key: str, *, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """``get``, blocking (not from the store's loop thread)."""
        return block_on_store_loop(self._base, lambda: self.get(key, prototype, byte_range))

    def set_sync(self, key: str, value: Buffer) -> None:
        """``set``, blocking (not from the store's loop thread)."""
        self._check_writable()
        block_on_store_loop(self._base, lambda: self.set(key, value))

    def delete_sync(self, key: str) -> None:
        """``delete``, blocking (not from the store's loop thread)."""
        self._check_writable()
        block_on_store_loop(self._base, lambda: self.delete(key))
