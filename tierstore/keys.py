"""Keys: any non-empty str that encodes as UTF-8 (slashes, dots, NUL and non-ASCII included).

Keys are never used as file names. On disk a key is stored inside a catalog record, and the
record is found by a fixed-size digest of the key, so any key of any length is safe.

Keys under ``RESERVED_PREFIX`` hold the store's own records (the namespace index of
``tierstore.namespaces``); the verbs refuse them unless the store itself asks, inside
``reserved_keys()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

from .errors import InvalidKeyError

#: Longest key accepted, in UTF-8 bytes. Generous, but bounded so a catalog record stays small.
MAX_KEY_BYTES = 64 * 1024

#: Keys the store keeps for itself; user verbs refuse them and ``keys()`` does not list them.
RESERVED_PREFIX = "__tierstore__/"

# A context variable, not a flag on the store: it is set only in the task doing the store's own
# bookkeeping, so a user call running at the same time on the loop is still refused.
_reserved_allowed: ContextVar[bool] = ContextVar("tierstore_reserved_keys", default=False)


def is_reserved(key: str) -> bool:
    """Whether ``key`` is one of the store's own (under ``RESERVED_PREFIX``)."""
    return key.startswith(RESERVED_PREFIX)


@contextmanager
def reserved_keys() -> Iterator[None]:
    """Let the verbs called (and awaited) inside accept reserved keys: for the store's own records."""
    token = _reserved_allowed.set(True)
    try:
        yield
    finally:
        _reserved_allowed.reset(token)


def check_key(key: object) -> str:
    """Return ``key`` if it is a usable key, else raise ``InvalidKeyError``."""
    if key.__class__ is str and 0 < len(key) <= MAX_KEY_BYTES and key.isascii() and not key.startswith(RESERVED_PREFIX):
        return key  # (the common key: ASCII is UTF-8 byte for character)
    if not isinstance(key, str):
        raise InvalidKeyError(f"keys are str, not {type(key).__name__}: {key!r:.80}")
    if not key:
        raise InvalidKeyError("the empty string is not a key")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"key {key!r:.80} is not valid UTF-8 ({exc.reason})") from None
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key is {len(encoded)} bytes long; the limit is {MAX_KEY_BYTES}")
    if is_reserved(key) and not _reserved_allowed.get():
        raise InvalidKeyError(f"keys under {RESERVED_PREFIX!r} are the store's own records: {key!r:.80}")
    return plain_text(key)


def plain_text(key: str) -> str:
    """``key`` as a plain ``str``: a str subclass is stored as its text (its own ``__eq__`` or
    ``__hash__`` would make a second entry in memory for what the catalog, which addresses keys
    by their bytes, holds once)."""
    return key if key.__class__ is str else str.__str__(key)


#: The hash of a key's UTF-8 bytes whose ``digest()`` is its catalog address (for loops over
#: encoded keys, such as the catalog's scan on open: no decoding and encoding back).
address_hash = partial(hashlib.blake2b, digest_size=20)


def key_digest(key: str) -> bytes:
    """The 20-byte catalog address of ``key``."""
    return address_hash(key.encode("utf-8")).digest()
