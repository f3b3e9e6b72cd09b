"""zarr v3 over the tiers: ``TierZarrStore`` is a ``zarr.abc.store.Store`` whose keys live in a
``TierStore``, so any zarr array or group (and xarray, dask, data loaders reading zarr) has its
chunks cached in memory, evicted and prefetched by the store's policies, and kept on NVMe.

This package is ``tierstore.zarr``; inside it, ``import zarr`` is the zarr library (absolute
imports), never this package.
"""

from .bridge import LoopDeadlockError
from .store import StoreNotInProcessError, TierZarrStore

__all__ = ["LoopDeadlockError", "StoreNotInProcessError", "TierZarrStore"]
