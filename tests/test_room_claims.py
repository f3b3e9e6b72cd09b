"""Requests for room on a tier count on the room already on its way one at a time: each
counts only what no other request counts on, and evicts for the rest itself. Every request
counted all of it before, so while one eviction wrote its victim back, every other request
waited for that one value's room: evictions went one after another, and each that ended woke
every waiting request (a hundred small optimizer states waiting at once: steps of 2 s took
10-15 s, the loop busy waking them)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import torch

from policies import LRU
from tierstore import DiskTier, HostTier, TierStore
from tierstore.disk.files import FileIO

PATIENCE = 30.0
VALUE = 64 << 10


class GatedWrites(FileIO):
    """Disk writes that, once ``armed``, each wait for ``let_go()``, counting those waiting."""

    def __init__(self) -> None:
        self.armed = False
        self.waiting = 0
        self._lock = threading.Lock()
        self._gate = threading.Event()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        if self.armed:
            with self._lock:
                self.waiting += 1
            self._gate.wait(PATIENCE)
        return super().pwrite(fd, data, offset)

    def let_go(self) -> None:
        self._gate.set()


def value(i: int) -> torch.Tensor:
    return torch.full((VALUE // 4,), float(i))


async def test_requests_for_room_evict_side_by_side_while_a_write_back_waits(tmp_path: Path) -> None:
    io = GatedWrites()
    store = TierStore([HostTier(8 * VALUE), DiskTier(tmp_path / "d", "64MiB", io=io)])
    await store.open()
    try:
        for i in range(8):  # (the host tier full of values on no other tier: each eviction writes one back)
            await store.put(f"old{i}", value(i), "host", durable=False)
        io.armed = True
        puts = [asyncio.ensure_future(store.put(f"new{i}", value(100 + i), "host", durable=False)) for i in range(4)]
        began = time.monotonic()
        while io.waiting < 2 and time.monotonic() - began < 10.0:  # (one at a time before: one write, never two)
            await asyncio.sleep(0.01)
        side_by_side = io.waiting
        io.let_go()
        await asyncio.wait_for(asyncio.gather(*puts), PATIENCE)
        io.armed = False
        assert side_by_side >= 2, f"{side_by_side} eviction's write-back under way for 4 requests for room"
        for i in range(8):
            assert torch.equal(await store.get(f"old{i}"), value(i))
        for i in range(4):
            assert torch.equal(await store.get(f"new{i}"), value(100 + i))
    finally:
        io.let_go()
        await store.aclose()


async def test_small_values_that_share_a_new_slab_evict_for_one_slab(tmp_path: Path) -> None:
    """21 values of 192 B need one new 4 KiB slab between them: each request counting only the
    room no other counted on evicted a slab's worth for itself, 61 values where 5 do (a review)."""
    store = TierStore([HostTier("64KiB"), DiskTier(tmp_path / "d", "64MiB")])
    await store.open()
    try:
        i = 0
        while not store.counters.tier("host").evictions:  # (filled with 1 KiB values only there)
            await store.put(f"old{i}", torch.full((256,), float(i)), "host", durable=False)
            i += 1
        before = store.counters.tier("host").evictions
        await asyncio.wait_for(asyncio.gather(*(store.put(f"new{j}", torch.full((48,), float(j)), "host", durable=False)
                                                for j in range(21))), PATIENCE)
        evicted = store.counters.tier("host").evictions - before
        assert evicted <= 8, f"{evicted} values of 1 KiB evicted for 21 of 192 B"
        for j in range(21):
            assert torch.equal(await store.get(f"new{j}"), torch.full((48,), float(j)))
        for k in range(i):
            assert torch.equal(await store.get(f"old{k}"), torch.full((256,), float(k)))
    finally:
        await store.aclose()


class RecordingLRU(LRU):
    """``LRU`` noting the victims it chooses and the keys inserted into it."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: list[str] = []
        self.inserted: list[str] = []

    def victim(self, evictable=None):  # type: ignore[no-untyped-def]
        key = super().victim(evictable)
        if key is not None:
            self.chosen.append(key)
        return key

    def on_insert(self, key: str, nbytes: int) -> None:
        self.inserted.append(key)
        super().on_insert(key, nbytes)


class JitteredWrites(FileIO):
    """Disk writes that each take a random 0-50 ms: they end in any order."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        with self._lock:
            delay = self._random.random() * 0.05
        time.sleep(delay)
        return super().pwrite(fd, data, offset)


async def test_victims_reach_a_slower_memory_tier_in_the_order_chosen(tmp_path: Path) -> None:
    """Above a slower memory tier, victims are demoted one after another, each an insert into
    its policy in the order of the choices: with room counted on once, each request evicted for
    itself and they arrived in the order their write-backs below ended (a review)."""
    for seed in range(3):  # (the old code kept the order 3 times in 3; without it, 0 in 3)
        fast, slow = RecordingLRU(), RecordingLRU()
        store = TierStore([HostTier(4 * VALUE, name="fast"), HostTier(8 * VALUE, name="slow"),
                           DiskTier(tmp_path / str(seed), "64MiB", io=JitteredWrites(seed))],
                          eviction={"fast": lambda fast=fast: fast, "slow": lambda slow=slow: slow})
        await store.open()
        try:
            for i in range(8):  # (the slow tier full: each demotion into it writes one of these to the disk)
                await store.put(f"pre{i}", value(-1), "slow", durable=False)
            for i in range(4):
                await store.put(f"old{i}", value(i), "fast", durable=False)
            fast.chosen.clear()
            await asyncio.wait_for(asyncio.gather(*(store.put(f"new{i}", value(100 + i), "fast", durable=False)
                                                    for i in range(4))), PATIENCE)
            arrived = [key for key in slow.inserted if key.startswith("old")]
            assert arrived == fast.chosen == [f"old{i}" for i in range(4)], (fast.chosen, arrived)
        finally:
            await store.aclose()
