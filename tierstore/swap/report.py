"""What swapping moved and how long the training loop waited for it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..units import format_bytes


@dataclass
class SwapReport:
    """Counts and times since the offloader was made (or ``reset()``)."""

    kind: str
    offloaded: int = 0
    kept: int = 0
    #: Bytes of the tensors kept in place: too small (parameters are kept too, not counted here),
    #: or refused by the store.
    bytes_kept: int = 0
    #: Saved tensors whose copy into the store failed (a tier without room, say): kept in memory
    #: for backward instead (counted in ``kept`` and ``bytes_kept`` too, no longer in ``offloaded``).
    refused: int = 0
    #: Most bytes brought back ahead of backward and not yet used, at any one time.
    bytes_ahead_peak: int = 0
    prefetched: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    #: Saved tensors backward used before their copy out had finished (they never left).
    early: int = 0
    bytes_early: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0
    #: Time the training loop (forward or backward) spent waiting on the store.
    stall: float = 0.0
    #: ``(started, ended)`` (``time.perf_counter()``) of each wait, when recording: set it to a
    #: list to start (for timelines: compute minus these spans is what hides transfers).
    waits: list[tuple[float, float]] | None = field(default=None, repr=False)

    def add_stall(self, started: float, ended: float) -> None:
        """The training loop waited from ``started`` to ``ended``."""
        self.stall += ended - started
        if self.waits is not None:
            self.waits.append((started, ended))

    def add_moved(self, nbytes: int, seconds: float, out: bool) -> None:
        if out:
            self.bytes_out += nbytes
            self.seconds_out += seconds
        else:
            self.bytes_in += nbytes
            self.seconds_in += seconds

    def reset(self) -> None:
        for name, value in asdict(SwapReport(self.kind)).items():
            if name != "waits":
                setattr(self, name, value)
        if self.waits is not None:
            self.waits = []

    def as_dict(self) -> dict[str, Any]:
        return {name: value for name, value in asdict(self).items() if name != "waits"}

    def __str__(self) -> str:
        if self.kind == "parameters":  # (weights leave once, at attach, and come back for each use)
            return (
                f"parameters: {self.offloaded} offloaded ({format_bytes(self.bytes_out)} out, {format_bytes(self.bytes_in)} "
                f"brought back for forward and backward), {self.prefetched} prefetched; "
                f"training loop waited {self.stall * 1e3:.1f} ms"
            )
        return (
            f"{self.kind}: {self.offloaded} offloaded ({format_bytes(self.bytes_out)} out, "
            f"{format_bytes(self.bytes_in)} back, {self.early} used before they left), {self.kept} kept in place"
            f"{f' ({self.refused} refused by the store)' if self.refused else ''}, "
            f"{self.prefetched} prefetched; "
            f"training loop waited {self.stall * 1e3:.1f} ms"
        )
