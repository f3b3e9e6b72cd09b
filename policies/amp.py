"""AdaptiveSequential: AMP-style adaptive sequential prefetching (Gill and Bathen, FAST 2007),
for named keys: readahead whose depth grows while its prefetches are used and shrinks when they
are wasted."""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class AdaptiveSequential:
    """Keys are numbered in the order they are first accessed (as ``Sequential`` does). An
    access to key ``i`` right after key ``i - 1`` continues a sequential stream; while it does,
    the keys after ``i`` are suggested, ``degree`` of them. The degree adapts, AMP's way:

    - an access that hits a key this policy suggested, and arrives on the tier (a hit): the
      prefetch was useful and on time, so the degree grows by one (up to ``max_degree``);
    - an access to a suggested key that misses (it was evicted before use, or never admitted):
      the degree is halved, prefetching too far ahead wastes room;
    - a suggested key the stream jumps over counts as wasted too.

    Outside a stream nothing is suggested and the degree decays back to ``min_degree``."""

    name = "amp"

    def __init__(self, min_degree: int = 1, max_degree: int = 32) -> None:
        if not 1 <= min_degree <= max_degree:
            raise ValueError(f"need 1 <= min_degree <= max_degree, not {min_degree}, {max_degree}")
        self.min_degree, self.max_degree = min_degree, max_degree
        self.reset()

    def reset(self) -> None:
        self._order: list[Hashable] = []
        self._index: dict[Hashable, int] = {}
        self._pending: set[int] = set()  # indexes suggested and not yet accessed
        self._last: tuple[int, str | None] = (-1, None)
        self._streaming = False
        self.degree = self.min_degree
        self.grown = self.shrunk = 0

    def on_access(self, key: Hashable, nbytes: int, tier: str, hit: bool) -> None:
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._order)
            self._order.append(key)
        previous = self._last[0]
        self._streaming = index == previous + 1
        if index in self._pending:
            self._pending.discard(index)
            if hit:
                self.degree = min(self.max_degree, self.degree + 1)
                self.grown += 1
            else:
                self._shrink()
        skipped = [i for i in self._pending if i < index] if self._streaming else list(self._pending)
        if skipped:  # suggested and passed over (or the stream broke): wasted
            self._pending.difference_update(skipped)
            self._shrink()
        if not self._streaming:
            self.degree = max(self.min_degree, self.degree - 1)
        self._last = (index, tier)

    def _shrink(self) -> None:
        self.degree = max(self.min_degree, self.degree // 2)
        self.shrunk += 1

    def on_step(self) -> None:
        pass

    def suggest(self) -> Iterable[tuple[Hashable, str | None]]:
        if not self._streaming:
            return []
        index, tier = self._last
        upcoming = range(index + 1, min(len(self._order), index + 1 + self.degree))
        self._pending.update(upcoming)
        return [(self._order[i], tier) for i in upcoming]
