"""Whether a step's early write-backs pay, judged by what became of the states written.

An early write-back (``tierstore.optim.pipeline``) bets that the state it writes is evicted
before its next update: the eviction then drops a clean copy, with no write on the critical
path. A state updated again while its copy is still on the state tier was written for nothing,
and is written again. Each state written early is judged at the first ``step()`` that updates
it (as the step's updates begin, after backward) or finds its copy gone; one neither updated nor
evicted waits. A copy evicted and read back is another copy: its write paid (judged by whether
the copy is the one written, a third to two thirds of the writes judged wasted had paid, their
states read back ahead of the step). A state evicted later in the step that updates it is still
taken for one never evicted: stopping early costs time (the evictions then write on the critical
path), never bytes. Where more than ``STOP_ABOVE`` of those judged lately (each step's count
weighed by ``KEPT``) were written for nothing, the early write-backs stop: the step picks them
as before but writes none, and the picks are judged in the same way; they start again below
``START_BELOW`` (between the two the decision stands: an embedding updated every other step
made a judge of two steps' memory stop and start again every step, 10% slower). A random
part of the parameters updated each step (the experts of a mixture) wrote a fifth to a third
more than the step needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: The share of recent early write-backs found written for nothing above which they stop, and
#: the share below which they start again.
STOP_ABOVE, START_BELOW = 1 / 3, 1 / 6
#: What each step keeps of the counts of the steps before it (a memory of about five steps).
KEPT = 0.8
#: Judged write-backs (so weighed) below which they go on regardless: too few to tell.
JUDGED = 4.0


class EarlyWriteJudge:
    """What became of the states written back early (see the module)."""

    def __init__(self) -> None:
        #: The states picked and not judged yet, with what stood for their copy when picked.
        self._waiting: dict[str, object | None] = {}
        self._wasted = 0.0
        self._judged = 0.0
        self._stopped = False

    @property
    def paying(self) -> bool:
        """Whether early write-backs are written (else only picked, and judged)."""
        return not self._stopped

    def picked(self, key: str, copy: object | None) -> None:
        """``key``'s state was written back early (or picked to be, while they do not pay);
        ``copy`` stands for its copy on the state tier (``TierStore._copy_on_tier``)."""
        self._waiting[key] = copy

    def judge(self, updated: Iterable[str], copy_on_tier: Callable[[str], object | None]) -> None:
        """Once a ``step()``, before its updates: judge the states it updates (``updated``:
        their keys) and those whose copy is gone (``copy_on_tier``: what stands for it now)
        since they were picked, and decide whether this step's early write-backs are written."""
        self._wasted *= KEPT
        self._judged *= KEPT
        keys = set(updated)
        for key, copy in list(self._waiting.items()):
            resident = copy is not None and copy_on_tier(key) is copy
            if key in keys:
                self._wasted += resident
            elif resident:
                continue
            del self._waiting[key]
            self._judged += 1
        if self._judged < JUDGED:
            self._stopped = False
        elif self._wasted > STOP_ABOVE * self._judged:
            self._stopped = True
        elif self._wasted < START_BELOW * self._judged:
            self._stopped = False
