"""Argument types for the command lines: a count or a time that cannot be negative is refused
by argparse with its usage line, not met later as a traceback (a division by zero)."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An ``int`` of at least 1."""
    return _whole(text, 1, "a positive whole number (1 or more)")


def non_negative_int(text: str) -> int:
    """An ``int`` of at least 0."""
    return _whole(text, 0, "a whole number of 0 or more")


def _whole(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
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
