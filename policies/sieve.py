"""SIEVE (Zhang et al., NSDI 2024): a FIFO queue with one visited bit per key and a hand that
sweeps from old to new, sparing visited keys (and clearing their bit) and evicting the first
unvisited one. New keys enter at the new end; nothing ever moves in the queue."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any


class SIEVE:
    """SIEVE, as libCacheSim implements it (hits set the bit; the hand stays where the last
    eviction left it and wraps from the new end back to the old one).

    The queue is a doubly linked list kept in two dicts (``_newer``/``_older``), so that removing
    a key anywhere and moving the hand are O(1).

    ``victim(evictable)``: the hand passes over keys the predicate refuses without clearing
    their bit; they keep their place and their bit. Since the hand itself moves on, a history
    with a skipped key does not equal one where the chosen victim was simply removed."""

    name = "sieve"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._visited: dict[Hashable, bool] = {}
        self._newer: dict[Hashable, Hashable | None] = {}
        self._older: dict[Hashable, Hashable | None] = {}
        self._head: Hashable | None = None  # newest
        self._tail: Hashable | None = None  # oldest
        self._hand: Hashable | None = None  # None: start at the tail

    def on_insert(self, key: Hashable, nbytes: int) -> None:
        if key in self._visited:
            self._unlink(key)
        self._visited[key] = False
        self._older[key] = self._head
        self._newer[key] = None
        if self._head is not None:
            self._newer[self._head] = key
        else:
            self._tail = key
        self._head = key

    def on_hit(self, key: Hashable) -> None:
        if key in self._visited:
            self._visited[key] = True

    def on_remove(self, key: Hashable) -> None:
        if key in self._visited:
            self._unlink(key)

    def _unlink(self, key: Hashable) -> None:
        newer, older = self._newer.pop(key), self._older.pop(key)
        del self._visited[key]
        if self._hand == key:
            self._hand = newer
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer

    def victim(self, evictable: Callable[[Hashable], bool] | None = None) -> Hashable | None:
        if self._tail is None:
            return None
        visited, newer = self._visited, self._newer
        start = self._hand
        key = start if start is not None else self._tail
        refused = 0  # consecutive keys the predicate refused: a whole lap of them means none may go
        while True:
            if evictable is not None and not evictable(key):
                refused += 1
                if refused > len(visited):
                    self._hand = start
                    return None
            elif visited[key]:
                visited[key] = False
                refused = 0
            else:
                break
            following = newer[key]
            key = following if following is not None else self._tail
        self._hand = newer[key]
        self._unlink(key)
        return key

    def replay(self, keys: Sequence[Any], sizes: Sequence[int], capacity: int) -> tuple[int, int]:
        """The one-tier simulation of ``keys`` (one size per key) at ``capacity`` bytes, in one
        tight loop from an empty cache (it resets the policy first): ``(misses, missed bytes)``,
        the same answers as the simulator's loop over the protocol calls."""
        self.reset()
        visited, newer, older = self._visited, self._newer, self._older
        resident: dict[Hashable, int] = {}
        used = misses = missed = 0
        head, tail, hand = self._head, self._tail, self._hand
        for key, size in zip(keys, sizes, strict=True):
            if key in resident:
                visited[key] = True
                continue
            misses += 1
            missed += size
            if size > capacity:
                continue
            while used + size > capacity:
                victim = hand if hand is not None else tail
                while visited[victim]:
                    visited[victim] = False
                    victim = newer[victim]
                    if victim is None:
                        victim = tail
                hand = newer[victim]
                used -= resident.pop(victim)
                a, b = newer.pop(victim), older.pop(victim)
                del visited[victim]
                if a is None:
                    head = b
                else:
                    older[a] = b
                if b is None:
                    tail = a
                else:
                    newer[b] = a
            resident[key] = size
            used += size
            visited[key] = False
            older[key] = head
            newer[key] = None
            if head is not None:
                newer[head] = key
            else:
                tail = key
            head = key
        self._head, self._tail, self._hand = head, tail, hand
        return misses, missed

    def __len__(self) -> int:
        return len(self._visited)
