"""Argument types for the command lines: a count or a time that cannot be negative is refused
by argparse with its usage line, not met later as a traceback (a division by zero)."""

from __future__ import annotations

import argparse
import math
import os

MiB = 1 << 20


def positive_int(text: str) -> int:
    """An ``int`` of at least 1."""
    return _whole(text, 1, "a positive whole number (1 or more)")


def non_negative_int(text: str) -> int:
    """An ``int`` of at least 0."""
    return _whole(text, 0, "a whole number of 0 or more")


def _whole(text: str, least: int, what: str, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


def non_negative_float(text: str) -> float:
    """A finite ``float`` of at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of 0 or more")
    return value


def positive_numbers(text: str) -> list[float]:
    """Comma-separated finite numbers above 0 (``"1,16,0.5"``)."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} in {text!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{part.strip()} in {text!r} is not a finite number above 0")
        values.append(value)
    return values


def sizes_in_mib(text: str, least: int = 1) -> list[int]:
    """Comma-separated sizes in MiB (``"1,16,0.5"``), as whole bytes: each at least ``least``
    bytes and at most this machine's memory (a value of that size is made in memory)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sizes = []
    for mib in positive_numbers(text):
        size = mib * MiB
        if not least <= size <= memory:
            raise argparse.ArgumentTypeError(
                f"{mib:g} MiB in {text!r} is not between {least:,} bytes and this machine's memory ({memory / MiB:,.0f} MiB)")
        sizes.append(int(size))
    return sizes


def bounded_int(text: str, least: int, most: int) -> int:
    """An ``int`` from ``least`` to ``most``; a whole float (``"32.0"``) counts."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return _whole(str(int(value)), least, f"a whole number from {least} to {most:,}", most)
