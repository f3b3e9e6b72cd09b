"""A byte of a stored value flipped on disk, for the tests that a corrupt optimizer state is
caught before an update reads it."""

from __future__ import annotations

from pathlib import Path

from tierstore import TierStore
from tierstore.sync import run


class flipped_byte:  # noqa: N801 (used as a context manager, like a function)
    """Flip a byte of ``key``'s record on disk, and flip it back on exit."""

    def __init__(self, store: TierStore, key: str) -> None:
        disk = store.tier("disk")

        async def locate() -> tuple[Path, int]:
            extent = disk.committed()[key].extent  # type: ignore[attr-defined]
            return disk.segment_path(extent.segment), extent.offset + 100  # type: ignore[attr-defined]

        self.path, self.offset = run(locate())

    def _flip(self) -> None:
        with open(self.path, "r+b") as handle:
            handle.seek(self.offset)
            byte = handle.read(1)
            handle.seek(self.offset)
            handle.write(bytes([byte[0] ^ 0x10]))

    def __enter__(self) -> None:
        self._flip()

    def __exit__(self, *exc: object) -> None:
        self._flip()
