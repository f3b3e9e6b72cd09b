"""What a write rate means for an SSD: bytes per hour, drive writes per day, and days until the
drive's rated endurance (TBW, terabytes written) is used up.

An SSD's warranty rates it for a total of bytes written (TBW). Paging optimizer state through a
drive writes the state that does not fit in memory at every step, so a long run can write that
rating in weeks: ``drive_wear(bytes_written, seconds)`` says how many days it takes at a
measured rate. The defaults describe a typical 2 TB TLC NVMe drive (rated 1200 TBW: 600 TBW
per TB of capacity, as the Samsung 990 Pro and WD SN850X 2 TB are).

>>> round(drive_wear(1_000_000_000, 1.0).days_to_rated, 1)    # 1 GB/s on a 2 TB, 1200 TBW drive
13.9
"""

from __future__ import annotations

import decimal
import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

import numpy

from .units import format_bytes, parse_bytes

#: A typical NVMe drive: 2 TB.
DEFAULT_CAPACITY = 2 * 1000**4
#: Rated endurance per byte of capacity of a typical TLC drive (600 TBW per TB).
DEFAULT_TBW_PER_CAPACITY = 600
_TB = 1000**4
_DAY = 86400.0


@dataclass(frozen=True)
class DriveWear:
    """A write rate and what it does to one drive.

    ``bytes_per_hour``: bytes written per hour at the measured rate; ``drive_writes_per_day``:
    full drive capacities written per day (DWPD, the other way drives are rated);
    ``days_to_rated``: days of writing at this rate until ``rated_bytes`` (the drive's TBW in
    bytes) is reached (``inf`` when nothing is written).
    """

    bytes_written: int
    seconds: float
    capacity: int
    rated_bytes: int

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_hour(self) -> float:
        return self.bytes_per_second * 3600.0

    @property
    def bytes_per_day(self) -> float:
        return self.bytes_per_second * _DAY

    @property
    def drive_writes_per_day(self) -> float:
        return self.bytes_per_day / self.capacity

    @property
    def days_to_rated(self) -> float:
        rate = self.bytes_per_day
        return self.rated_bytes / rate if rate > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self), "bytes_per_hour": self.bytes_per_hour, "drive_writes_per_day": self.drive_writes_per_day,
            "days_to_rated": self.days_to_rated,
        }

    def __str__(self) -> str:
        drive = f"a {self.capacity / _TB:g} TB drive rated {self.rated_bytes / _TB:g} TBW"
        if self.bytes_written and not self.seconds:
            return f"SSD wear: {format_bytes(self.bytes_written)} written in no measured time (no rate) to {drive}"
        if self.bytes_per_second <= 0:
            return f"SSD wear: nothing written to {drive}"
        days = self.days_to_rated
        span = f"{days:,.0f} days" if days >= 10 else f"{days:.1f} days" if days >= 1 else f"{days * 24:.1f} hours"
        return (
            f"SSD wear: {format_bytes(self.bytes_per_hour)}/hour written ({self.drive_writes_per_day:.2f} drive writes/day): "
            f"{drive} reaches its rating in {span}"
        )


def _as_float(value: object) -> float | None:
    """A real number (numpy's, ``Fraction`` and ``Decimal`` too; not a bool) as a float; None
    for anything else, and for one no float holds (a signalling NaN, a Fraction past 1e308)."""
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError, ArithmeticError):
        return None


def valid_rating(rated_tbw: object) -> bool:
    """Whether ``rated_tbw`` (terabytes written) is a rating ``drive_wear`` takes: a number of at
    least a byte's worth whose bytes are finite."""
    rating = _as_float(rated_tbw)
    return rating is not None and 1 <= rating * _TB < math.inf


def drive_wear(
    bytes_written: int, seconds: float, *, capacity: int | str = DEFAULT_CAPACITY, rated_tbw: float | None = None
) -> DriveWear:
    """The wear of writing ``bytes_written`` every ``seconds`` (e.g. one training step's disk
    writes and its wall time) on a drive of ``capacity`` (bytes or ``"2TB"``) rated for
    ``rated_tbw`` terabytes written (default: 600 per TB of capacity, a typical TLC drive).
    Raises ``ValueError`` for a negative count or time, or a capacity or rating not above 0."""
    if isinstance(bytes_written, bool) or not isinstance(bytes_written, numbers.Integral) or bytes_written < 0:
        raise ValueError(f"bytes_written must be a non-negative int, not {bytes_written!r}")
    bytes_written = int(bytes_written)
    elapsed = _as_float(seconds)
    if elapsed is None or not 0 <= elapsed < math.inf:
        raise ValueError(f"seconds must be a finite number of 0 or more, not {seconds!r}")
    size = parse_bytes(capacity)
    if size <= 0:
        raise ValueError(f"capacity must be above 0, not {capacity!r}")
    if rated_tbw is None:
        rated = size * DEFAULT_TBW_PER_CAPACITY
    else:
        if not valid_rating(rated_tbw):
            raise ValueError(f"rated_tbw (terabytes written) must be a finite number of at least a byte's worth, not {rated_tbw!r}")
        rated = int(float(rated_tbw) * _TB)
    return DriveWear(bytes_written=bytes_written, seconds=elapsed, capacity=size, rated_bytes=rated)
