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
from collections import Counter, deque
from collections.abc import Callable

#: The two lines: requests that looked for victims, and those whose shortfall the room on its way
#: covers.
LOOKED, COVERED = 0, 1


class _Line:
    """Requests in the order they came, each woken alone."""

    def __init__(self) -> None:
        #: Each request's future (ended to wake it) and the bytes of its value; one that left
        #: before it was woken stays until reached or swept (its future is done: skipped).
        self._waiting: deque[tuple[asyncio.Future[None], int]] = deque()
        #: How many requests in the line, not woken yet, wait to store a value of each size.
        self._sizes: Counter[int] = Counter()
        self._left = 0  # (entries of requests that left unwoken, still in ``_waiting``)

    def join(self, nbytes: int, first: bool) -> asyncio.Future[None]:
        waiter = asyncio.get_running_loop().create_future()
        if first:
            self._waiting.appendleft((waiter, nbytes))
        else:
            self._waiting.append((waiter, nbytes))
        self._sizes[nbytes] += 1
        return waiter

    def leave(self, waiter: asyncio.Future[None], nbytes: int) -> bool:
        """Take the request of ``waiter`` out; whether it had been woken (its wake goes on)."""
        if waiter.done():
            return not waiter.cancelled()
        waiter.cancel()
        self._forget(nbytes)
        self._left += 1
        if self._left > len(self._waiting) // 2:
            self._waiting = deque(entry for entry in self._waiting if not entry[0].done())
            self._left = 0
        return False

    def wake_first(self) -> None:
        waiting = self._waiting
        while waiting:
            waiter, nbytes = waiting.popleft()
            if not waiter.done():
                self._forget(nbytes)
                waiter.set_result(None)
                return
            self._left -= 1

    def wake_fitting(self, fits: Callable[[int], bool]) -> None:
        """Wake the first whose value fits now (each size is checked once, not each request)."""
        fitting = {nbytes for nbytes in self._sizes if fits(nbytes)}
        if not fitting:
            return
        for index, (waiter, nbytes) in enumerate(self._waiting):
            if not waiter.done() and nbytes in fitting:
                del self._waiting[index]
                self._forget(nbytes)
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        while self._waiting:
            self.wake_first()
        self._left = 0

    def _forget(self, nbytes: int) -> None:
        left = self._sizes[nbytes] - 1
        if left:
            self._sizes[nbytes] = left
        else:
            del self._sizes[nbytes]


class RoomQueue:
    """The requests waiting for room on one tier, in two lines (see the module)."""

    def __init__(self) -> None:
        self._lines = (_Line(), _Line())

    def join(self, line: int, nbytes: int, *, first: bool = False) -> asyncio.Future[None]:
        """Line a request up (``LOOKED`` or ``COVERED``) for a value of ``nbytes``: a future
        that ends when it is woken. ``first``: at the front (it waited in this line before and
        was woken to find nothing: it keeps its place ahead of those that came after it)."""
        return self._lines[line].join(nbytes, first)

    def leave(self, line: int, waiter: asyncio.Future[None], nbytes: int) -> None:
        """The request of ``waiter`` stops waiting before it has looked again (cancelled): a
        wake it had goes on to the next in its line."""
        if self._lines[line].leave(waiter, nbytes):
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
