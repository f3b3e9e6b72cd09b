"""Requests for room on one tier that wait for it to change, woken a few at a time.

A request for room that looked for victims and found none waits in a queue, in the order
they came. A change that may make room (a copy becoming a victim; a demotion, fill, release or
read of the tier ending) wakes the first. Once it has looked again it passes the wake on: to
the next if it found victims (there may be more) or did not look; to every one if it found nothing it could
wait for (it fails as full: so may they); else to one whose value fits in the room free now,
if any does (the victims are the same for every request: where it found none, none would; but
the free room serves some sizes and not others). A request woken that leaves without looking
(cancelled) passes its wake to the next.

A request whose shortfall the room on its way covers does not look for victims: it waits for
that room, on one future of the tier's that every change ends (``covered``), woken with the
others like it. In the queue, such requests passed the wake to each other without end.

A close that seals wakes them all (``tierstore.eviction``). Woken all at once at every change,
each request looked for a victim and one found it: 2,000 puts of 16 KiB in flight into a tier
of 256 of them asked the policy's ``victim()`` 128,000 times (19,700 for 1,000: the time grew
with the square of the requests).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable


class RoomQueue:
    """The requests waiting for room on one tier (see the module)."""

    def __init__(self) -> None:
        #: Each queued request's future (ended to wake it) and the bytes of its value; one that
        #: left before it was woken stays until reached or swept (its future is done: skipped).
        self._waiting: deque[tuple[asyncio.Future[None], int]] = deque()
        #: How many queued requests, not woken yet, wait to store a value of each size.
        self._sizes: Counter[int] = Counter()
        self._left = 0  # (entries of requests that left unwoken, still in ``_waiting``)
        self._covered: asyncio.Future[None] | None = None

    def join(self, nbytes: int, *, first: bool = False) -> asyncio.Future[None]:
        """Queue a request that found no victim, for a value of ``nbytes``: a future that ends
        when it is woken. ``first``: at the front (it waited before, and was woken to find
        nothing: it keeps its place ahead of those that came after it)."""
        waiter = asyncio.get_running_loop().create_future()
        if first:
            self._waiting.appendleft((waiter, nbytes))
        else:
            self._waiting.append((waiter, nbytes))
        self._sizes[nbytes] += 1
        return waiter

    def covered(self) -> asyncio.Future[None]:
        """The future a request whose shortfall the room on its way covers waits on: the next
        change ends it."""
        if self._covered is None or self._covered.done():
            self._covered = asyncio.get_running_loop().create_future()
        return self._covered

    def leave(self, waiter: asyncio.Future[None], nbytes: int) -> None:
        """The request of ``waiter`` (``join``) stops waiting before it looked again: a wake
        it had goes on to the next request."""
        if waiter.done():
            if not waiter.cancelled():
                self.wake_first()
            return
        waiter.cancel()
        self._forget(nbytes)
        self._left += 1
        if self._left > len(self._waiting) // 2:
            self._waiting = deque(entry for entry in self._waiting if not entry[0].done())
            self._left = 0

    def changed(self) -> None:
        """Room may have changed: wake the first queued request, and those waiting for room
        on its way."""
        self.wake_first()
        if self._covered is not None and not self._covered.done():
            self._covered.set_result(None)

    def wake_first(self) -> None:
        """Wake the queued request at the front."""
        waiting = self._waiting
        while waiting:
            waiter, nbytes = waiting.popleft()
            if not waiter.done():
                self._forget(nbytes)
                waiter.set_result(None)
                return
            self._left -= 1

    def wake_all(self) -> None:
        """Wake every waiting request (a close seals; a request failed as full)."""
        while self._waiting:
            self.wake_first()
        self._left = 0
        if self._covered is not None and not self._covered.done():
            self._covered.set_result(None)

    def pass_on(self, wake_next: bool, fits: Callable[[int], bool]) -> None:
        """A request woken from the queue has looked: wake the next if ``wake_next`` (it found
        victims, or did not look), else the first whose value fits now (``fits(nbytes)``: the
        room free serves it), if one does (each size is checked once, not each request)."""
        if wake_next:
            self.wake_first()
            return
        fitting = {nbytes for nbytes in self._sizes if fits(nbytes)}
        if not fitting:
            return
        for index, (waiter, nbytes) in enumerate(self._waiting):
            if not waiter.done() and nbytes in fitting:
                del self._waiting[index]
                self._forget(nbytes)
                waiter.set_result(None)
                return

    def _forget(self, nbytes: int) -> None:
        left = self._sizes[nbytes] - 1
        if left:
            self._sizes[nbytes] = left
        else:
            del self._sizes[nbytes]
