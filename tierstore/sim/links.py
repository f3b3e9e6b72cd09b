"""How long moving bytes takes: bandwidth and latency per link, for stall estimates."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..units import parse_bytes

#: Defaults (GB/s, seconds) when no `tierstore bench` figures are at hand; a PCIe 4 x16 GPU and
#: an NVMe drive like the one DESIGN.md assumes.
DEFAULTS: dict[str, tuple[float, float]] = {
    "disk->host": (2.5e9, 100e-6),
    "disk->device": (2.5e9, 100e-6),
    "host->disk": (4.0e9, 100e-6),
    "device->disk": (4.0e9, 100e-6),
    "host->device": (20e9, 10e-6),
    "device->host": (20e9, 10e-6),
}


@dataclass
class LinkModel:
    """Bandwidth (bytes/s) and latency (s) of each link ``"source->target"``."""

    links: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULTS))

    def seconds(self, link: str, nbytes: int) -> float:
        bandwidth, latency = self.links.get(link, (2.5e9, 100e-6))
        return latency + nbytes / bandwidth

    @classmethod
    def from_bench(cls, path: str | Path) -> LinkModel:
        """Take disk figures from a ``tierstore bench`` JSON (largest size measured)."""
        model = cls()
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"cannot read the bench figures in {path} ({exc}); give a `tierstore bench --json` output") from None
        rows = document.get("rows", []) if isinstance(document, dict) else None
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"{path} is not a `tierstore bench --json` output: it holds no list of rows")
        for what, links in (("disk get (into out=)", ("disk->host", "disk->device")), ("disk put (durable)", ("host->disk", "device->disk"))):
            # (a figure not measured is null in the JSON)
            measured = sorted((r["size_mib"], r["ours_gbs"]) for r in rows
                              if r.get("what") == what and _positive(r.get("size_mib")) and _positive(r.get("ours_gbs")))
            if measured:
                for link in links:
                    model.links[link] = (measured[-1][1] * 1e9, model.links[link][1])
        return model

    def override(self, spec: str, tiers: Iterable[str] | None = None) -> None:
        """Apply ``"disk->host=2.5GB/s@100us,host->device=20GB/s"``. With ``tiers`` (the memory
        tiers simulated), a link between others is refused: nothing would cross it."""
        known = None if tiers is None else {*tiers, "disk"}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            match = re.fullmatch(r"([\w.-]+)->([\w.-]+)=([0-9.]+\s*[kKMGT]?i?B)/s(?:@([0-9.]+)(us|ms|s))?", item)
            if match is None:
                raise ValueError(f"cannot read link {item!r}; write e.g. 'disk->host=2.5GB/s@100us'")
            source, target, rate, latency, unit = match.groups()
            unknown = [end for end in (source, target) if known is not None and end not in known]
            if unknown or source == target:
                problem = f"no tier {unknown[0]!r} is simulated" if unknown else "its two ends are one tier"
                raise ValueError(f"link {item!r}: {problem}; the tiers are {', '.join(sorted(known or {source}))}")
            bandwidth = float(parse_bytes(rate))
            if bandwidth <= 0:
                raise ValueError(f"link {item!r}: a bandwidth must be more than 0 bytes a second")
            link = f"{source}->{target}"
            old = self.links.get(link, (2.5e9, 100e-6))
            seconds = float(latency) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit] if latency else old[1]
            self.links[link] = (bandwidth, seconds)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
