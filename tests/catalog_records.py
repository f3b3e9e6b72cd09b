"""Catalog records changed behind a closed store's back, for the tests of damaged folders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lmdb


def rewrite_record(root: Path, key: str, change: Callable[[bytes], bytes]) -> None:
    """Replace the catalog record naming ``key`` with ``change(record)`` (LMDB pages carry no
    checksum of their own)."""
    env = lmdb.open(str(root / "catalog"), max_dbs=2, map_size=1 << 31)
    try:
        with env.begin(write=True, db=env.open_db(b"entries", create=False)) as txn:
            for address, raw in list(txn.cursor()):
                if key.encode() in bytes(raw):
                    txn.put(bytes(address), change(bytes(raw)))
                    return
    finally:
        env.close()
    raise AssertionError(f"no record of {key!r}")


def flip_in_record(root: Path, key: str, byte: int, bit: int = 0) -> None:
    """Flip one bit of ``key``'s catalog record."""

    def flipped(raw: bytes) -> bytes:
        changed = bytearray(raw)
        changed[byte] ^= 1 << bit
        return bytes(changed)

    rewrite_record(root, key, flipped)
