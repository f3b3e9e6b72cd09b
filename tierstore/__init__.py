"""tierstore: an asyncio tiered tensor store for PyTorch (GPU, pinned host memory, NVMe).

>>> async with TierStore([DeviceTier("cpu", "1GiB"), HostTier("4GiB"), DiskTier("/tmp/ts", "100GiB")]) as store:
...     await store.put("w", torch.ones(3))
...     w = await store.get("w")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names are imported on first use (PEP 562), so that torch-free parts (the policy simulator, the
# command line) start without importing torch.
_LAZY = {
    "errors": None,
    **{name: ".errors" for name in (
        "BufferSharedError", "CapacityError", "CatalogError", "ChecksumError", "CorruptionError", "DiskFullError",
        "EntryHeldError", "FolderPermissionError", "FolderReplacedError", "ForeignFolderError", "InvalidKeyError", "InvalidTensorError", "KeyNotFoundError", "LinkClosedError",
        "LoopDeadlockError", "NamespaceClaimedError", "NotAStoreFolderError", "OptimizerClosedError", "PolicyError", "StepIncompleteError", "StoreClosedError",
        "StoreForkedError",
        "StoreLockedError", "TierFullError", "TierStoreError", "TraceError", "UnknownTierError", "WrongLoopError",
    )},
    "Namespace": ".namespaces",
    "PrefetchHandle": ".prefetching",
    "PrefetchResult": ".prefetching",
    "EvictionPolicy": ".protocols",
    "PrefetchPolicy": ".protocols",
    "TierStore": ".store",
    "SyncTierStore": ".sync",
    "empty": ".tensors",
    "DeviceTier": ".tiers",
    "DiskTier": ".tiers",
    "HostTier": ".tiers",
    "MemoryTier": ".tiers",
    "Tier": ".tiers",
    "format_bytes": ".units",
    "parse_bytes": ".units",
}

if TYPE_CHECKING:
    from . import errors
    from .errors import (
        BufferSharedError,
        CapacityError,
        CatalogError,
        ChecksumError,
        CorruptionError,
        DiskFullError,
        EntryHeldError,
        FolderPermissionError,
        FolderReplacedError,
        ForeignFolderError,
        InvalidKeyError,
        InvalidTensorError,
        KeyNotFoundError,
        LinkClosedError,
        LoopDeadlockError,
        NamespaceClaimedError,
        NotAStoreFolderError,
        OptimizerClosedError,
        StepIncompleteError,
        StoreClosedError,
        StoreForkedError,
        StoreLockedError,
        TierFullError,
        TierStoreError,
        TraceError,
        UnknownTierError,
        WrongLoopError,
    )
    from .namespaces import Namespace
    from .prefetching import PrefetchHandle, PrefetchResult
    from .protocols import EvictionPolicy, PrefetchPolicy
    from .store import TierStore
    from .sync import SyncTierStore
    from .tensors import empty
    from .tiers import DeviceTier, DiskTier, HostTier, MemoryTier, Tier
    from .units import format_bytes, parse_bytes


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tierstore' has no attribute {name!r}")
    module = _LAZY[name]
    value = importlib.import_module(f".{name}", __name__) if module is None else getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "FolderPermissionError",
    "FolderReplacedError",
    "ForeignFolderError",
    "HostTier",
    "InvalidKeyError",
    "InvalidTensorError",
    "KeyNotFoundError",
    "LinkClosedError",
    "LoopDeadlockError",
    "MemoryTier",
    "Namespace",
    "NamespaceClaimedError",
    "NotAStoreFolderError",
    "OptimizerClosedError",
    "PolicyError",
    "StepIncompleteError",
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
    "WrongLoopError",
    "empty",
    "errors",
    "format_bytes",
    "parse_bytes",
]
