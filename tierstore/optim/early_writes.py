"""Whether a step's early write-backs pay, judged by what became of the states written.

An early write-back (``tierstore.optim.pipeline``) bets that the state it writes is evicted
before its next update: the eviction then drops a clean copy, with no write on the critical
path. A state updated again while its copy is still on the state tier was written for nothing,
and is written again. Each state written early is judged at the first step that begins with it
evicted (the bet paid) or updates it with its copy still on the tier (it did not); one neither
updated nor evicted waits. Where more than ``WASTED`` of those judged lately (each step's count
halved) were written for nothing, the early write-backs stop: the step picks them as before but
writes none (its evictions write what they drop), and the picks are judged in the same way, so
they start again once they would pay. A random part of the parameters updated each step (the
experts of a mixture) wrote a fifth to a third more than the step needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: The share of recent early write-backs found written for nothing above which they stop.
WASTED = 1 / 3
#: Judged write-backs (halved each step) below which they go on regardless: too few to tell.
JUDGED = 4.0


class EarlyWriteJudge:
    """What became of the states written back early (see the module)."""

    def __init__(self) -> None:
        self._waiting: dict[str, None] = {}
        self._wasted = 0.0
        self._judged = 0.0

    @property
    def paying(self) -> bool:
        """Whether early write-backs are written (else only picked, and judged)."""
        return self._judged < JUDGED or self._wasted <= WASTED * self._judged

    def picked(self, key: str) -> None:
        """``key``'s state was written back early (or picked to be, while they do not pay)."""
        self._waiting[key] = None

    def judge(self, updated: Iterable[str], on_tier: Callable[[str], bool]) -> None:
        """As a step begins: judge the states it updates (``updated``: their keys) and those
        evicted (``on_tier`` false) since they were picked."""
        self._wasted /= 2
        self._judged /= 2
        keys = set(updated)
        for key in list(self._waiting):
            resident = on_tier(key)
            if key in keys:
                self._wasted += resident
            elif resident:
                continue
            del self._waiting[key]
            self._judged += 1
