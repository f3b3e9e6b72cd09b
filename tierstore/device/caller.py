"""The caller's queued device work, carried across the hop to the store's loop.

A copy that reads memory the caller's kernels wrote (a put from a CUDA tensor, a device-tier
buffer a hold changed) must start after those kernels, which were queued on the caller's
*current* stream, on the caller's thread. The store's verbs run on its loop thread, whose
current stream is another one. So the caller's side marks its work (``marking_caller``) in a
context variable, which ``tierstore.sync.run`` carries into the task it starts on the loop, and
the engine orders its copies ``after=caller_work(link)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .link import Link

_marks: ContextVar[tuple[torch.device, Any] | None] = ContextVar("tierstore_caller_work", default=None)


@contextmanager
def marking_caller(device: torch.device | None) -> Iterator[None]:
    """On the caller's thread: mark its queued work on ``device`` (a CUDA device; no-op for
    others) for the store calls started inside the block."""
    if device is None or device.type != "cuda":
        yield
        return
    from .mode import link_for

    token = _marks.set((device, link_for(device).mark()))
    try:
        yield
    finally:
        _marks.reset(token)


def caller_work(link: Link) -> Any:
    """A marker of the caller's queued work on ``link``'s device: the one ``marking_caller``
    carried here, else a mark of this thread's own queued work."""
    carried = _marks.get()
    if carried is not None and carried[0] == link.device:
        return carried[1]
    return link.mark()
