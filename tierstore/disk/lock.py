"""The lock that makes one disk tier folder belong to one open store in one process.

An exclusive ``flock`` on ``<root>/lock``, taken without waiting, and one on the folder itself:
a lock file deleted while its store is open (a clean-up of "stale" lock files) would let a
second store take a new one and write the same extents; the folder cannot be deleted so
(where the file system cannot lock a folder, the file's lock alone stands). A folder deleted
whole and made again is a new folder, with a new lock: its old store must no longer use its
names (``SegmentFiles`` checks before making or deleting a file). ``flock`` locks
belong to the open file description, which ``fork`` shares with the child: while any process keeps a copy of
the descriptor open, the lock stays taken. So a forked child (a DataLoader worker) closes its
copy right after the fork, without unlocking (an unlock would release the parent's lock too);
then the lock lives exactly as long as the parent keeps it.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path

from ..errors import StoreLockedError

_PID_BYTES = 32

#: Every lock held by this process, so a forked child can let go of its copies.
_HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()


class FolderLock:
    """The held lock of one folder; ``release`` (or dropping the object) lets it go.

    The descriptor lives only in this object and is closed once, so a finalizer that calls
    ``release`` late can never close a descriptor number the process has reused meanwhile.
    """

    def __init__(self, path: Path, fd: int, folder_fd: int | None = None) -> None:
        self.path = path
        self.pid = os.getpid()
        self._fd: int | None = fd
        self._folder_fd = folder_fd
        _HELD.add(self)

    @classmethod
    def acquire(cls, path: Path) -> FolderLock:
        """Take the lock at ``path`` (created if absent) and record our pid in it.

        Raises
        ------
        StoreLockedError
            If it is held: by another process (named by its pid) or by another open store on the
            same folder in this process.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, _PID_BYTES, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            folder = path.parent
            if holder == str(os.getpid()):
                raise _in_this_process(StoreLockedError(
                    f"{folder} is already open in this process (another DiskTier or TierStore on the same "
                    "folder); close that one first. A SyncTierStore opened earlier and no longer at hand (a "
                    "notebook cell run again) is closed by tierstore.sync.close_open_stores()"
                )) from None
            raise StoreLockedError(f"{folder} is open in another process (pid {holder})") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            folder_fd = _lock_folder(path.parent)
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # closing the only descriptor releases the lock
            if folder_fd is not None:
                os.close(folder_fd)
            raise
        return cls(path, fd, folder_fd)

    @property
    def held(self) -> bool:
        """Whether this process holds the lock through this object."""
        return self._fd is not None and self.pid == os.getpid()

    def release(self) -> None:
        """Let the lock go (idempotent). Closing is enough: it is the last descriptor of the
        open file description in this process, and a forked child closed its copy already."""
        fd, self._fd = self._fd, None
        folder_fd, self._folder_fd = self._folder_fd, None
        _HELD.discard(self)
        for descriptor in (fd, folder_fd):
            if descriptor is not None:
                os.close(descriptor)

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited copies without unlocking (the parent holds them)."""
        self.release()  # (closing a copy does not unlock: the parent's descriptors hold the locks)


def _lock_folder(folder: Path) -> int | None:
    """A descriptor of ``folder`` holding an exclusive ``flock`` on it; None where its file
    system cannot lock a folder (NFS maps ``flock`` to byte-range locks, which need a file
    open for writing).

    Raises ``StoreLockedError`` if another open store holds it: its lock file was deleted."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreLockedError(
            f"{folder} is open in another store (which process is not known: the lock file {folder / 'lock'} was deleted "
            "while that store was open); close it first"
        ) from None
    except OSError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _after_fork_in_child() -> None:
    for lock in list(_HELD):
        lock._forget_after_fork()
    _HELD.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_this_process(error: StoreLockedError) -> StoreLockedError:
    """``error``, marked as naming a holder in this process (``in_this_process``)."""
    error.in_this_process = True  # type: ignore[attr-defined]
    return error
