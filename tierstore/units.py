"""Byte sizes: parse "512MiB" / "1.5GB" / 4096, and format them for people."""

from __future__ import annotations

import numbers
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "p": 1000**5,
    "pb": 1000**5,
    "eb": 1000**6,  # (no bare "e": "1e" reads as a number cut short)
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    "eib": 1024**6,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(size: int | float | str) -> int:
    """Return ``size`` as a whole number of bytes.

    Accepts a non-negative int (numpy's too), or a string such as ``"512MiB"``, ``"1.5 GB"``, ``"4096"``.
    Decimal units (kB, MB, GB, TB, PB, EB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB, PiB, EiB) of 1024.
    """
    if isinstance(size, bool):
        raise TypeError(f"a byte size must be an int or a string like '512MiB', not {size!r}")
    if not isinstance(size, int) and isinstance(size, numbers.Integral):  # (numpy's integers, from a config or a sum)
        size = int(size)
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a byte size cannot be negative: {size}")
        return size
    if isinstance(size, float):
        if size < 0 or size != size or size == float("inf"):
            raise ValueError(f"a byte size must be a non-negative number: {size}")
        if not size.is_integer():  # (1.5 bytes: a unit left out, most likely)
            raise ValueError(f"a byte size in bytes must be whole, not {size}; for other units write e.g. '{size:g}GiB'")
        return int(size)
    if not isinstance(size, str):
        raise TypeError(f"a byte size must be an int or a string like '512MiB', not {type(size).__name__}")
    match = _PATTERN.match(size)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {size!r} as a byte size; write e.g. 4096, '512MiB' or '2GB'")
    value = float(match.group(1)) * _UNITS[unit]
    if _UNITS[unit] == 1 and not value.is_integer():
        raise ValueError(f"a byte size in bytes must be whole, not {size!r}; for other units write e.g. '{value:g}GiB'")
    if 0 < value < 1:
        raise ValueError(f"{size!r} is less than a byte")
    return int(value)  # (a fraction of a byte of a larger unit, "1.1MiB", is dropped)


def format_bytes(nbytes: float) -> str:
    """Return ``nbytes`` in binary units, e.g. ``"1.5 GiB"``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) < 1024 or unit == "EiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def distinct_sizes(a: int, b: int) -> tuple[str, str]:
    """``a`` and ``b`` as sizes (``format_bytes``), in exact bytes where the rounded forms read
    as the same size ("needs 6.0 MiB but holds 6.0 MiB", "1.0 MiB wanted, 1024.0 KiB free":
    each hid a shortfall of a few bytes)."""
    first, second = format_bytes(a), format_bytes(b)
    return (f"{a:,} B", f"{b:,} B") if parse_bytes(first) == parse_bytes(second) else (first, second)


def round_up(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple
