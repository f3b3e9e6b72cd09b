"""This process's pid, kept current across ``fork``: the engine and the disk tier compare it on
every verb and catalog access to refuse a parent's store in a forked child, and a cached value
spares a system call on the hot path of small values."""

from __future__ import annotations

import os

__all__ = ["this_process"]


class _ThisProcess:
    pid = os.getpid()

    @classmethod
    def forked(cls) -> None:
        cls.pid = os.getpid()


this_process = _ThisProcess
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ThisProcess.forked)
