"""``LinkSpec``: the bandwidth and latency an emulated link runs at, read from strings such as
``"25GB/s,10us"``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..units import parse_bytes

_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_LATENCY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(s|ms|us|µs|ns)\s*$")


@dataclass(frozen=True)
class LinkSpec:
    """A link's speed: ``bandwidth`` in bytes/s (None: as fast as memcpy) and ``latency`` in
    seconds per copy."""

    bandwidth: float | None = None
    latency: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"a link's bandwidth must be positive, not {self.bandwidth}")
        if not self.latency >= 0:
            raise ValueError(f"a link's latency cannot be negative: {self.latency}")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """``"25GB/s"``, ``"25GB/s,10us"``, ``"10us"``, or ``""`` (memcpy speed, no latency)."""
        bandwidth: float | None = None
        latency = 0.0
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            if part.lower().endswith("/s"):
                try:
                    bandwidth = float(parse_bytes(part[:-2]))
                except (TypeError, ValueError):
                    raise ValueError(f"cannot read {part!r} as a bandwidth; write e.g. '25GB/s' or '12GiB/s'") from None
                if bandwidth <= 0:
                    raise ValueError(f"a link's bandwidth must be positive: {part!r}")
                continue
            match = _LATENCY.match(part)
            if match is None:
                raise ValueError(f"cannot read {part!r} in link {text!r}; write e.g. '25GB/s,10us'")
            latency = float(match.group(1)) / _PER_SECOND[match.group(2)]
        return cls(bandwidth, latency)

    def seconds(self, nbytes: int) -> float:
        """How long a copy of ``nbytes`` takes on this link (0 for an unlimited one)."""
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)

    def __str__(self) -> str:
        if self.bandwidth is None and not self.latency:
            return "memcpy"
        parts = [f"{self.bandwidth / 1e9:g}GB/s"] if self.bandwidth else []
        if self.latency:
            parts.append(f"{self.latency * 1e6:g}us")
        return ",".join(parts)
