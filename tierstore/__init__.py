"""tierstore: an asyncio tiered tensor store for PyTorch (GPU, pinned host memory, NVMe).

>>> async with TierStore([DeviceTier("cpu", "1GiB"), HostTier("4GiB"), DiskTier("/tmp/ts", "100GiB")]) as store:
...     await store.put("w", torch.ones(3))
...     w = await store.get("w")
"""

from . import errors
from .errors import (
    BufferSharedError,
    CapacityError,
    CatalogError,
    ChecksumError,
    CorruptionError,
    DiskFullError,
    EntryHeldError,
    ForeignFolderError,
    InvalidKeyError,
    InvalidTensorError,
    KeyNotFoundError,
    NamespaceClaimedError,
    NotAStoreFolderError,
    StoreClosedError,
    StoreForkedError,
    StoreLockedError,
    TierFullError,
    TierStoreError,
    TraceError,
    UnknownTierError,
)
from .namespaces import Namespace
from .prefetching import PrefetchHandle, PrefetchResult
from .protocols import EvictionPolicy, PrefetchPolicy
from .store import TierStore
from .sync import SyncTierStore
from .tensors import empty
from .tiers import DeviceTier, DiskTier, HostTier, MemoryTier, Tier
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BufferSharedError",
    "CapacityError",
    "CatalogError",
    "ChecksumError",
    "CorruptionError",
    "DeviceTier",
    "DiskFullError",
    "DiskTier",
    "EntryHeldError",
    "EvictionPolicy",
    "ForeignFolderError",
    "HostTier",
    "InvalidKeyError",
    "InvalidTensorError",
    "KeyNotFoundError",
    "MemoryTier",
    "Namespace",
    "NamespaceClaimedError",
    "NotAStoreFolderError",
    "PrefetchHandle",
    "PrefetchPolicy",
    "PrefetchResult",
    "StoreClosedError",
    "StoreForkedError",
    "StoreLockedError",
    "SyncTierStore",
    "Tier",
    "TierFullError",
    "TierStore",
    "TierStoreError",
    "TraceError",
    "UnknownTierError",
    "empty",
    "errors",
    "format_bytes",
    "parse_bytes",
]
