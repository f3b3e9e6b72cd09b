"""Exceptions raised by tierstore.

Every error derives from :class:`TierStoreError`; most also derive from the builtin they refine
(``KeyNotFoundError`` is a ``KeyError``, ``InvalidTensorError`` a ``TypeError`` ...), so callers can
catch either. An operation that raises one of these leaves the store usable with nothing lost.
"""

from __future__ import annotations


class TierStoreError(Exception):
    """Base class of every tierstore error."""


class KeyNotFoundError(TierStoreError, KeyError):
    """The key is not in the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; a sentence reads better
        return str(self.args[0]) if self.args else "key not found"


class InvalidKeyError(TierStoreError, ValueError):
    """The key is not a usable key (not a str, empty, not encodable as UTF-8, too long)."""


class InvalidTensorError(TierStoreError, TypeError):
    """The value is not a storable tensor (not a tensor, sparse, meta, quantized, nested ...)."""


class UnknownTierError(TierStoreError, ValueError):
    """A tier was named that the store does not have, or cannot serve the request."""


class TierFullError(TierStoreError, MemoryError):
    """No room can be made on a tier: the request is larger than its capacity, or every resident
    entry is held. Nothing was changed."""


class BufferSharedError(TierStoreError, ValueError):
    """A tier buffer cannot be handed over to a caller: it is a slot of a slab whose memory
    other values share. Copy the value instead."""


class DiskFullError(TierStoreError, OSError):
    """The file system under a disk tier is full (ENOSPC, EDQUOT or EFBIG). Nothing was changed;
    the store stays usable and freeing entries makes room again."""


class EntryHeldError(TierStoreError, RuntimeError):
    """The operation needs an entry that is held (leased) and cannot proceed while it is."""


class CorruptionError(TierStoreError):
    """Stored bytes or metadata do not match what was written."""


class ChecksumError(CorruptionError, OSError):
    """The bytes read from disk do not match the checksum recorded when they were written."""


class CatalogError(CorruptionError, OSError):
    """The on-disk catalog or data files are unreadable, inconsistent or of an unknown format."""


class FolderPermissionError(TierStoreError, PermissionError):
    """A disk tier's catalog cannot be opened by this user (or its file system is mounted
    read-only): the folder's permissions, not damage; nothing was changed. (The folder's other
    files refused raise the plain ``PermissionError`` of the call.)"""


class StoreLockedError(TierStoreError, OSError):
    """The store folder is open already: in another process, or in another object of this one."""


class FolderReplacedError(TierStoreError, OSError):
    """A disk tier's folder was deleted, moved or replaced while its store was open: the store
    stops creating or deleting files at that path, where another store may live now."""


class StoreForkedError(TierStoreError, RuntimeError):
    """A disk tier opened by another process was used in this one (a forked child, such as a
    DataLoader worker): the child neither holds the folder's lock nor may touch its files. Open
    a new store in the child if it needs one."""


class NotAStoreFolderError(TierStoreError, NotADirectoryError):
    """The path given as a disk tier's folder is not a folder (a file is in the way)."""


class ForeignFolderError(TierStoreError, FileExistsError):
    """The folder holds files but is not a tierstore folder; it is not taken over."""


class CapacityError(TierStoreError, ValueError):
    """A disk tier's capacity cannot be honoured: more than the file system can still give, or
    less than the live data in the folder (which cannot be compacted into it). Nothing was
    changed."""


class StoreClosedError(TierStoreError, RuntimeError):
    """The store (or tier) is not open."""


class LinkClosedError(TierStoreError, RuntimeError):
    """A device link (``tierstore.device``) was closed: a copy asked of it after, or queued on it
    but not yet started when it closed, does not run and its ``Transfer`` fails with this."""


class OptimizerClosedError(StoreClosedError):
    """The optimizer was closed (``opt.close()``): it steps, reports and saves no more."""


class NamespaceClaimedError(TierStoreError, RuntimeError):
    """A key namespace is claimed by someone else (live in this process, or recorded by an
    earlier run for another owner), or overlaps one that is; nothing was changed."""


class LoopDeadlockError(TierStoreError, RuntimeError):
    """A call to the store cannot run: the store's loop thread is blocked waiting for it (a
    blocking call made on that thread, e.g. from a policy or a zarr codec it runs)."""


class WrongLoopError(TierStoreError, RuntimeError):
    """A verb of an async ``TierStore`` was called on another event loop than the one it was
    opened on, while that one is not closed: the store's work and wake-ups belong to its own loop (use
    ``SyncTierStore`` from several threads, or ``asyncio.run_coroutine_threadsafe`` onto
    ``store.loop``)."""


class PolicyError(TierStoreError, RuntimeError):
    """An eviction policy broke the protocol: it named no victim, or a key it does not track
    (or one it returned before without forgetting it), or its ``victim()`` raised, while a
    tier needed room. In the
    simulator, which excludes no key, one must go; a live store's request fails with it
    instead of asking the policy forever."""


class TraceError(TierStoreError, ValueError):
    """An access trace is malformed, or does not fit the replay asked of it (other tiers, ops
    the reader does not know)."""


class StepIncompleteError(TierStoreError, RuntimeError):
    """An optimizer step failed part-way (a full disk, a checksum error): ``updated`` lists the
    indices of the parameters it updated, ``not_updated`` those it did not; the cause is
    chained. Calling ``step()`` again completes the step without applying any update twice."""

    def __init__(self, message: str, updated: list[int], not_updated: list[int]) -> None:
        super().__init__(message)
        self.updated = updated
        self.not_updated = not_updated
