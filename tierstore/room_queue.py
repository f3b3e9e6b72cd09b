"""Requests for room on one tier that found nothing to evict, woken one at a time.

A change that may make room (a copy becoming a victim; a demotion, fill, release or read of the
tier ending) wakes the request that has waited longest. Once it has looked again it passes the
wake on: to the next request if it found victims (there may be more) or did not look for any
(room on its way covered it), else only to a request whose value fits in the room free now
(the victims are the same for every request: where it found none, none would). A close that
seals wakes them all (``tierstore.eviction``).

Woken all at once at every change, each request looked for a victim and one found it: 2,000
puts of 16 KiB in flight into a tier of 256 of them asked the policy's ``victim()`` 128,000
times (19,700 for 1,000: the time grew with the square of the requests).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque


class RoomQueue:
    """The requests waiting for room on one tier, in the order they came (see the module)."""

    def __init__(self) -> None:
        #: Each waiting request's future (ended to wake it) and the room its value takes; a
        #: cancelled one stays until it is reached (its future is done: skipped).
        self._waiting: deque[tuple[asyncio.Future[None], int]] = deque()
        #: How many requests not woken yet wait for each size of room.
        self._sizes: Counter[int] = Counter()

    def __len__(self) -> int:
        return self._sizes.total()

    def join(self, size: int, *, again: bool = False) -> asyncio.Future[None]:
        """A future that ends when the request (for ``size`` bytes of room) is woken; ``again``:
        it waited before (woken, it found nothing), and keeps its turn at the front."""
        waiter = asyncio.get_running_loop().create_future()
        if again:
            self._waiting.appendleft((waiter, size))
        else:
            self._waiting.append((waiter, size))
        self._sizes[size] += 1
        return waiter

    def leave(self, waiter: asyncio.Future[None], size: int, free: int) -> None:
        """The request of ``waiter`` stops waiting (cancelled, or the store closing): a wake it
        had goes on to the next request (``free``: the tier's free room now)."""
        if waiter.done():
            if not waiter.cancelled():
                self.pass_on(True, free)
            return
        waiter.cancel()
        self._forget(size)

    def wake_first(self) -> None:
        """Room may have changed: wake the request that has waited longest."""
        waiting = self._waiting
        while waiting:
            waiter, size = waiting.popleft()
            if not waiter.done():
                self._forget(size)
                waiter.set_result(None)
                return

    def wake_all(self) -> None:
        while self._waiting:
            self.wake_first()

    def pass_on(self, look_on: bool, free: int) -> None:
        """A woken request has looked: wake the next if ``look_on`` (it found victims, or did
        not look), else the first whose value fits in ``free`` bytes, if one does."""
        if look_on:
            self.wake_first()
            return
        if not self._sizes or free < min(self._sizes):
            return
        for index, (waiter, size) in enumerate(self._waiting):
            if not waiter.done() and size <= free:
                del self._waiting[index]
                self._forget(size)
                waiter.set_result(None)
                return

    def _forget(self, size: int) -> None:
        left = self._sizes[size] - 1
        if left:
            self._sizes[size] = left
        else:
            del self._sizes[size]
