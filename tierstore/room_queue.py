"""Requests for room on one tier that wait for it to change, woken a few at a time.

A request for room that looked for victims and found none waits in one line; one that did not
look, its shortfall covered by the room on its way (demotions, releases), in another; each in
the order they came. A change that may make room (a copy becoming a victim; a demotion, fill,
release or read of the tier ending) wakes the first of each line. Once a woken request has
looked again it passes the wake on along its line: to the next if it found victims (there may
be more) or moves to the other line (the room on its way now covers it, or no longer does: the
next may be in the same case); else to one whose value fits in the room free now, if any does
(the victims are the same for every request: where it found none, none would; but the free
room serves some sizes and not others). A request that leaves, with its room, cancelled or
failed, wakes the next of each line it waited in; one that fails as full wakes every request
(each may find nothing left to wait for, too), and so does a close that seals
(``tierstore.eviction``).

Woken all at once at every change, each request looked again and one found what it needed:
2,000 puts of 16 KiB in flight into a tier of 256 of them asked the policy's ``victim()``
128,000 times above a disk (19,700 for 1,000: the time grew with the square of the requests),
and above a slower memory tier, where they count on the room on its way, went through the wait
1.5 million times.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable

#: The two lines: requests that looked for victims, and those whose shortfall the room on its way
#: covers.
LOOKED, COVERED = 0, 1


class _Waiter:
    """A request in a line: its future (ended to wake it), the bytes of its value, the slot size
    of its slab class (values below a page share slabs; None for one with a buffer of its own),
    and its place (lower comes first)."""

    __slots__ = ("future", "nbytes", "slot", "place")

    def __init__(self, future: asyncio.Future[None], nbytes: int, slot: int | None, place: int) -> None:
        self.future, self.nbytes, self.slot, self.place = future, nbytes, slot, place

    def __lt__(self, other: _Waiter) -> bool:  # (in the heap of those with buffers: smallest first)
        return (self.nbytes, self.place) < (other.nbytes, other.place)


class _Line:
    """Requests in the order they came, each woken alone; also found by what they need, so that
    the one the free room serves is found without going through them all (each waiting size
    checked at every wake made thousands of puts of distinct sizes take time with the square
    of their number). A request woken or gone stays in the structures it was not taken from
    until reached or swept (its future is done: skipped)."""

    def __init__(self) -> None:
        self._waiting: deque[_Waiter] = deque()
        #: Of those with values packed in slabs, by slot size, in their order (a free slot of
        #: a class serves its first).
        self._packed: dict[int, deque[_Waiter]] = {}
        #: Of those with buffers of their own, the smallest first (if it does not fit, none does).
        self._buffers: list[_Waiter] = []
        self._places = itertools.count(1)
        self._live = 0
        self._stale = 0  # (entries of requests woken or gone, left in the structures)

    def join(self, nbytes: int, slot: int | None, first: bool) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future, nbytes, slot, -next(self._places) if first else next(self._places))
        if first:
            self._waiting.appendleft(waiter)
        else:
            self._waiting.append(waiter)
        if slot is not None:
            line = self._packed.setdefault(slot, deque())
            line.appendleft(waiter) if first else line.append(waiter)
        else:
            heapq.heappush(self._buffers, waiter)
        self._live += 1
        return future

    def leave(self, future: asyncio.Future[None]) -> bool:
        """Take the request of ``future`` out; whether it had been woken (its wake goes on)."""
        if future.done():
            return not future.cancelled()
        future.cancel()
        self._gone()
        return False

    def wake_first(self) -> None:
        waiting = self._waiting
        while waiting:
            waiter = waiting.popleft()
            if not waiter.future.done():
                self._wake(waiter)
                self._stale -= 1  # (taken from the order here: left in one structure only)
                return
            self._stale -= 1

    def wake_fitting(self, fits: Callable[[int], bool]) -> None:
        """Wake the request that came first among those whose value fits now (``fits(nbytes)``):
        the first of each slab class, and the smallest of those with buffers, are asked."""
        found: _Waiter | None = None
        for slot, line in list(self._packed.items()):
            while line and line[0].future.done():
                line.popleft()
                self._stale -= 1
            if not line:
                del self._packed[slot]
            elif fits(line[0].nbytes) and (found is None or line[0].place < found.place):
                found = line[0]
        heap = self._buffers
        while heap and heap[0].future.done():
            heapq.heappop(heap)
            self._stale -= 1
        if heap and fits(heap[0].nbytes) and (found is None or heap[0].place < found.place):
            found = heap[0]
        if found is not None:
            self._wake(found)

    def wake_all(self) -> None:
        for waiter in self._waiting:
            if not waiter.future.done():
                waiter.future.set_result(None)
        self._waiting.clear()  # (every one woken: nothing left to find)
        self._packed.clear()
        self._buffers.clear()
        self._live = self._stale = 0

    def _wake(self, waiter: _Waiter) -> None:
        waiter.future.set_result(None)
        self._gone()

    def _gone(self) -> None:
        """A request is woken or gone: its entries stay (two: in the order, and by need) until
        reached, or until they outnumber the requests waiting, when all are swept."""
        self._live -= 1
        self._stale += 2
        if self._stale > 2 * self._live + 64:
            self._waiting = deque(w for w in self._waiting if not w.future.done())
            self._packed = {slot: kept for slot, line in self._packed.items() if (kept := deque(w for w in line if not w.future.done()))}
            self._buffers = [w for w in self._buffers if not w.future.done()]
            heapq.heapify(self._buffers)
            self._stale = 0


class RoomQueue:
    """The requests waiting for room on one tier, in two lines (see the module)."""

    def __init__(self) -> None:
        self._lines = (_Line(), _Line())

    def join(self, line: int, nbytes: int, slot: int | None, *, first: bool = False) -> asyncio.Future[None]:
        """Line a request up (``LOOKED`` or ``COVERED``) for a value of ``nbytes`` (``slot``:
        its slab class's slot size, for a value packed in slabs; else None): a future that ends
        when it is woken. ``first``: at the front (it waited in this line before and was woken
        to find nothing: it keeps its place ahead of those that came after it)."""
        return self._lines[line].join(nbytes, slot, first)

    def leave(self, line: int, waiter: asyncio.Future[None]) -> None:
        """The request of ``waiter`` stops waiting before it has looked again (cancelled): a
        wake it had goes on to the next in its line."""
        if self._lines[line].leave(waiter):
            self._lines[line].wake_first()

    def changed(self) -> None:
        """Room may have changed: wake the first of each line."""
        for line in self._lines:
            line.wake_first()

    def wake_all(self) -> None:
        """Wake every waiting request (a close seals; a request failed as full)."""
        for line in self._lines:
            line.wake_all()

    def pass_on(self, line: int, wake_next: bool, fits: Callable[[int], bool]) -> None:
        """A request woken from ``line`` has looked (or leaves with its room, an error or a
        cancellation): wake the next in the line if ``wake_next``, else the first whose value
        fits now (``fits(nbytes)``: the room free serves it), if one does."""
        if wake_next:
            self._lines[line].wake_first()
        else:
            self._lines[line].wake_fitting(fits)
