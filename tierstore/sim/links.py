"""How long moving bytes takes: bandwidth and latency per link, for stall estimates."""

from __future__ import annotations

import json
import re
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
        rows = json.loads(Path(path).read_text()).get("rows", [])
        for what, links in (("disk get (into out=)", ("disk->host", "disk->device")), ("disk put (durable)", ("host->disk", "device->disk"))):
            # (a figure not measured is null in the JSON)
            measured = sorted((r["size_mib"], r["ours_gbs"]) for r in rows
                              if r.get("what") == what and r.get("size_mib") is not None and r.get("ours_gbs"))
            if measured:
                for link in links:
                    model.links[link] = (measured[-1][1] * 1e9, model.links[link][1])
        return model

    def override(self, spec: str) -> None:
        """Apply ``"disk->host=2.5GB/s@100us,host->device=20GB/s"``."""
        for item in filter(None, (part.strip() for part in spec.split(","))):
            match = re.fullmatch(r"([a-z]+->[a-z]+)=([0-9.]+\s*[kKMGT]?i?B)/s(?:@([0-9.]+)(us|ms|s))?", item)
            if match is None:
                raise ValueError(f"cannot read link {item!r}; write e.g. 'disk->host=2.5GB/s@100us'")
            link, rate, latency, unit = match.groups()
            old = self.links.get(link, (2.5e9, 100e-6))
            seconds = float(latency) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit] if latency else old[1]
            self.links[link] = (float(parse_bytes(rate)), seconds)
