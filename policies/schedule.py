"""ScheduleLearned: record one repeated phase (a training step), then prefetch along it.

Between two ``store.mark_step()`` calls the policy records the order of demand accesses, with
each key's size and tier. From the next phase on, it follows that schedule: each access moves
its position (re-synchronising within a window if a few accesses differ) and it suggests the
keys coming next, up to ``ahead`` bytes (default: a quarter of the target tier), for the tier
each was accessed on. Every phase's order
replaces the last one, so a changed order is learned one phase later; ``changes`` counts phases
whose order differed from the schedule followed.

``next_use(key)`` says when a key is needed next (an absolute access count, ``inf`` if not in
the schedule), so ``MIN(schedule)`` evicts exactly what the schedule needs last.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from tierstore.units import parse_bytes


class ScheduleLearned:
    """Prefetch along the order recorded in the previous phase."""

    name = "schedule"

    def __init__(self, ahead: int | str | None = None, max_keys: int = 64, window: int = 32, share: float = 0.25) -> None:
        self.ahead = parse_bytes(ahead) if ahead is not None else None
        self.max_keys = max_keys
        self.window = window
        self.share = share
        self._capacities: dict[str, int] = {}
        self.reset()

    def set_capacities(self, capacities: dict[str, int]) -> None:
        """Tier sizes (the store and the simulator call this): without an explicit ``ahead``,
        the policy looks ``share`` of the target tier's capacity ahead (64 MiB if unknown)."""
        self._capacities = dict(capacities)

    def _budget(self, tier: str) -> int:
        if self.ahead is not None:
            return self.ahead
        capacity = self._capacities.get(tier)
        return int(self.share * capacity) if capacity else 64 << 20

    def reset(self) -> None:
        self._recording: list[tuple[str, int, str]] = []
        self._schedule: list[tuple[str, int, str]] = []
        self._positions: dict[str, list[int]] = {}
        self._pos = 0  # index in the schedule of the next expected access
        self._clock = 0  # demand accesses seen so far
        self._misaligned = 0
        self.changes = 0
        self.phases = 0

    @property
    def schedule(self) -> list[str]:
        """The keys of the schedule being followed, in order."""
        return [key for key, _, _ in self._schedule]

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
        self._clock += 1
        self._recording.append((key, nbytes, tier))
        if not self._schedule:
            return
        length = len(self._schedule)
        for offset in range(min(self.window, length)):
            if self._schedule[(self._pos + offset) % length][0] == key:
                self._pos = (self._pos + offset + 1) % length
                if offset:
                    self._misaligned += 1
                return
        self._misaligned += 1  # not in the schedule nearby: stay put

    def on_step(self) -> None:
        if not self._recording:
            return
        recorded = [key for key, _, _ in self._recording]
        if self._schedule and (recorded != self.schedule or self._misaligned):
            self.changes += 1
        self._schedule = self._recording
        self._positions = {}
        for index, (key, _, _) in enumerate(self._schedule):
            self._positions.setdefault(key, []).append(index)
        self._recording = []
        self._pos = 0
        self._misaligned = 0
        self.phases += 1

    def suggest(self) -> Iterable[tuple[str, str | None]]:
        if not self._schedule:
            return []
        length = len(self._schedule)
        budget = self._budget(self._schedule[self._pos % length][2])
        seen: set[str] = set()
        out: list[tuple[str, str | None]] = []
        for offset in range(length):
            key, nbytes, tier = self._schedule[(self._pos + offset) % length]
            if key in seen:
                continue
            if nbytes > budget or len(out) >= self.max_keys:
                break
            seen.add(key)
            budget -= nbytes
            out.append((key, tier))
        return out

    def next_use(self, key: str) -> float:
        positions = self._positions.get(key)
        if not positions:
            return math.inf
        length = len(self._schedule)
        i = bisect.bisect_left(positions, self._pos)
        distance = positions[i] - self._pos if i < len(positions) else positions[0] + length - self._pos
        return self._clock + distance
