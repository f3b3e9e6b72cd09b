"""Warnings that name the user's line, also when the store's loop thread emits them.

``warnings.warn(..., stacklevel=n)`` names a frame of the thread that warns. Much of tierstore
runs on its loop thread, on behalf of a call a user's thread made and waits for (the sync facade,
``tierstore.sync.run``): there the frames are asyncio's, and a warning was attributed to
``asyncio/events.py``, so a filter on the user's module (``warnings.filterwarnings(...,
module="train")``) or ``-W error::UserWarning:train`` missed it. ``run`` marks the copy of the
caller's context its task runs in with the caller's line (``context_of_call``); ``warn``
attributes a warning to the first frame outside tierstore, torch and the standard library's
plumbing: of its own thread, or, on the loop thread, the marked line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import sys
import threading
import warnings
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import Any

import torch

#: Where the call the loop serves came from: (file, line, module globals). Not the frame itself:
#: tasks the call starts (a store's background work) keep a copy of the context, and a frame
#: would keep the caller's locals (an optimizer, say) alive with them.
_caller: ContextVar[tuple[str, int, dict[str, Any]] | None] = ContextVar("tierstore_caller", default=None)

#: Folders (and files) whose frames are plumbing between the user's line and the warning.
_INTERNAL = (
    *(str(Path(str(module.__file__)).parent.resolve()) + os.sep for module in (sys.modules[__package__], torch, asyncio, concurrent.futures)),
    *(str(Path(str(module.__file__)).resolve()) for module in (contextlib, threading)),
)


def context_of_call(frame: FrameType | None) -> contextvars.Context:
    """On the caller's thread: a copy of its context for a call to the loop, marked with where
    the call came from: ``frame``, or the first of its callers outside tierstore, torch and
    asyncio (``warn`` on the loop attributes warnings to it)."""
    context = contextvars.copy_context()
    outside = _outside(frame)
    if outside is not None:
        context.run(_caller.set, _where(outside))
    return context


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the first frame outside
    tierstore, torch and asyncio, of this thread, or on the loop thread of the call it serves;
    where there is none (the loop's own work), as ``warnings.warn(..., stacklevel=2)`` in the
    function that calls ``warn`` names its caller."""
    frame = _outside(sys._getframe(1))
    where = _where(frame) if frame is not None else _caller.get()
    if where is None:
        warnings.warn(message, category, stacklevel=3)
        return
    filename, lineno, module_globals = where
    # (no module_globals=: the source line is looked up by file name; through the module's
    # loader, ``python -c``'s __main__ raised ImportError before any filter was asked)
    warnings.warn_explicit(
        message, category, filename, lineno, module=module_globals.get("__name__", "<unknown>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )


def _where(frame: FrameType) -> tuple[str, int, dict[str, Any]]:
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


def _outside(frame: FrameType | None) -> FrameType | None:
    """The first of ``frame`` and its callers that is not plumbing (None: all of them are)."""
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


@functools.lru_cache(maxsize=4096)
def _internal(filename: str) -> bool:
    """Whether code from ``filename`` is plumbing (asked of a few frames on every blocking call)."""
    if filename.startswith("<frozen "):
        return True
    if filename.startswith("<"):
        return False
    return os.path.realpath(filename).startswith(_INTERNAL)  # (realpath: never raises, a symlink loop included)
