"""Pausing the cyclic garbage collector while many long-lived objects are made at once."""

from __future__ import annotations

import gc
import threading

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0


class gc_paused:  # noqa: N801  (used as a context manager, like a function)
    """Pause the cyclic garbage collector for the ``with`` block: made for the loops that make
    an object or more per key (the entries of a reopened store, the records and copies of a
    flush), where each object made would count towards collections that walk every entry
    already there (at a million keys those walks cost more than the work).

    Pauses nest and overlap, across threads too: the collector comes back on when the last one
    ends. A collector someone else turned off stays off. Keep the block short (no waiting on
    others inside it): the whole process runs without cycle collection meanwhile."""

    __slots__ = ("_counted",)

    def __init__(self) -> None:
        self._counted = False

    def __enter__(self) -> None:
        global _depth
        with _lock:
            if _depth == 0 and not gc.isenabled():
                return  # turned off by someone else: theirs to turn on
            _depth += 1
            self._counted = True
            gc.disable()

    def __exit__(self, *exc_info: object) -> None:
        global _depth
        if not self._counted:
            return
        self._counted = False
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.enable()
