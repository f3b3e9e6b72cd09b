"""Keys: any non-empty str that encodes as UTF-8 (slashes, dots, NUL and non-ASCII included).

Keys are never used as file names. On disk a key is stored inside a catalog record, and the
record is found by a fixed-size digest of the key, so any key of any length is safe.
"""

from __future__ import annotations

import hashlib

from .errors import InvalidKeyError

#: Longest key accepted, in UTF-8 bytes. Generous, but bounded so a catalog record stays small.
MAX_KEY_BYTES = 64 * 1024


def check_key(key: object) -> str:
    """Return ``key`` if it is a usable key, else raise ``InvalidKeyError``."""
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
    return key


def key_digest(key: str) -> bytes:
    """The 20-byte catalog address of ``key``."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=20).digest()
