"""Which holds the running code is inside of, so a store can tell its own holder from others.

A write hold makes an entry unreadable to everyone else until it is released: another task or
thread that reads, copies, flushes or holds the key waits for the release. The holder itself
would wait forever, so a read of the key from inside its own write hold raises instead. The
holder is recognised by a context variable: asyncio copies it into tasks started inside the
hold, and ``SyncTierStore`` marks the calling thread's context, so "inside the hold" means the
same thing for async code, its child tasks and blocking code.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar

#: Tokens of the holds the current context is inside of.
_INSIDE: ContextVar[frozenset[int]] = ContextVar("tierstore_inside_holds", default=frozenset())
_tokens = itertools.count(1)


def new_token() -> int:
    """A process-unique token naming one hold."""
    return next(_tokens)


def enter(token: int) -> None:
    """Mark the current context as inside the hold ``token``."""
    _INSIDE.set(_INSIDE.get() | {token})


def leave(token: int) -> None:
    """Mark the current context as no longer inside the hold ``token``."""
    _INSIDE.set(_INSIDE.get() - {token})


def inside(token: int) -> bool:
    """Whether the current context is inside the hold ``token``."""
    return token in _INSIDE.get()
