"""A value loaded while a hold waits for that load is the hold's: a request for room served
before the hold's task ran evicted the copy just loaded, and the hold read it again (with
``step_in_backward=True`` a few chunks of optimizer state were read twice a step: a write hold
of a chunk waited for the prefetch reading it, MIN evicted the prefetched copy first)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import torch

from tierstore import DiskTier, HostTier, TierStore

VALUE = 64 << 10  # (bytes: large enough to take buffers of their own, not slab slots)


class EvictsAFirst:
    """An eviction policy that gives up ``"a"`` before anything else it may evict."""

    name = "a-first"

    #: Called with each key inserted (the test asks for room there: at once, before anything
    #: waiting for the insert runs).
    inserted: Callable[[str], None] = staticmethod(lambda key: None)

    def __init__(self) -> None:
        self.keys: list[str] = []

    def on_insert(self, key: str, nbytes: int) -> None:
        self.keys.append(key)
        EvictsAFirst.inserted(key)

    def on_hit(self, key: str) -> None:
        pass

    def on_remove(self, key: str) -> None:
        if key in self.keys:
            self.keys.remove(key)

    def victim(self, evictable=None):  # type: ignore[no-untyped-def]
        for key in sorted(self.keys, key=lambda k: k != "a"):
            if evictable is None or evictable(key):
                self.keys.remove(key)
                return key
        return None

    def reset(self) -> None:
        self.keys.clear()


def _reads(store: TierStore) -> int:
    link = store.counters.links.get("disk->host")
    return link.transfers if link is not None else 0


async def test_a_value_loaded_for_a_waiting_hold_is_not_evicted_before_the_hold_takes_it(tmp_path: Path) -> None:
    numel = VALUE // 4
    async with TierStore([HostTier(2 * VALUE), DiskTier(tmp_path / "d", "16MiB")], eviction=EvictsAFirst) as store:
        for name, fill in (("a", 1.0), ("b", 2.0), ("x", 3.0), ("y", 4.0)):
            await store.put(name, torch.full((numel,), fill))  # (the host keeps two: "a" and "b" go to the disk)
        assert "host" not in store.where("a") and "host" not in store.where("b")
        async with store.hold("y", "host"):  # (the host's other copy cannot go)
            before = _reads(store)
            seen: list[float] = []

            async def hold(key: str) -> None:
                async with store.hold(key, "host") as value:
                    seen.append(float(value[0]))

            others: list[asyncio.Task[None]] = []

            def ask_for_room(key: str) -> None:  # as "a" lands on the host: a hold of "b" needs its room
                if key == "a" and not others:
                    others.append(asyncio.ensure_future(hold("b")))

            EvictsAFirst.inserted = staticmethod(ask_for_room)
            try:
                await store.prefetch(["a"], "host")  # "a" starts loading (in place of "x")
                for _ in range(3):
                    await asyncio.sleep(0)
                await asyncio.wait_for(hold("a"), timeout=60)  # waits for the prefetch's load
                await asyncio.wait_for(others[0], timeout=60)
            finally:
                EvictsAFirst.inserted = staticmethod(lambda key: None)
            assert sorted(seen) == [1.0, 2.0]
            assert _reads(store) - before == 2, f"{_reads(store) - before} reads from the disk for two values"


async def test_a_write_hold_waiting_for_a_load_goes_before_a_hold_that_asked_after_it(tmp_path: Path) -> None:
    """Each request waiting for the load gets a use of the copy until it runs: the write hold
    that asked first saw the later hold's use as a user of the copy, let it go first and
    waited for it to end (a review: first come, first served is kept)."""
    numel = VALUE // 4
    async with TierStore([HostTier(4 * VALUE), DiskTier(tmp_path / "d", "16MiB")]) as store:
        for index, name in enumerate("abcdef"):
            await store.put(name, torch.full((numel,), float(index + 1)))
        assert "host" not in store.where("a")
        order: list[str] = []

        async def writer() -> None:
            async with store.hold("a", "host", write=True) as value:
                order.append("write")
                value.fill_(7.0)
                await asyncio.sleep(0.05)

        async def reader() -> None:
            async with store.hold("a", "host") as value:
                order.append(f"read {float(value[0])}")

        await store.prefetch(["a"], "host")  # "a" starts loading
        for _ in range(3):
            await asyncio.sleep(0)
        first = asyncio.ensure_future(writer())
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(first, reader()), timeout=60)
        assert order == ["write", "read 7.0"]


async def test_a_get_waiting_for_a_load_a_write_hold_started_returns_no_half_written_value(tmp_path: Path) -> None:
    """The get checked for a write hold before it waited for the load, not after: a write hold
    that started the load (or waited for it ahead of the get) was open when the get ran on, and
    the get copied its buffer half-written (a tryout: [0.0, 7.0])."""
    numel = VALUE // 4
    async with TierStore([HostTier(4 * VALUE), DiskTier(tmp_path / "d", "16MiB")]) as store:
        for index, name in enumerate("abcdef"):
            await store.put(name, torch.full((numel,), float(index)))
        assert "host" not in store.where("a")

        async def writer() -> None:
            async with store.hold("a", "host", write=True) as value:
                value[: numel // 2].fill_(7.0)
                await asyncio.sleep(0.05)  # (open: every other reader waits)
                value[numel // 2 :].fill_(7.0)

        for prefetched in (False, True):
            if prefetched:
                await store.put("a", torch.zeros(numel))
                for name in "bcde":  # (the host holds four: "a" goes back down)
                    await store.put(name, torch.full((numel,), 5.0))
                assert "host" not in store.where("a")
                await store.prefetch(["a"], "host")
                for _ in range(3):
                    await asyncio.sleep(0)
            writing = asyncio.ensure_future(writer())
            await asyncio.sleep(0)
            got = await asyncio.wait_for(store.get("a", "host"), timeout=60)
            await asyncio.wait_for(writing, timeout=60)
            assert got.unique().tolist() == [7.0], (prefetched, got.unique().tolist())


async def test_requests_waiting_for_a_load_when_the_store_closes_are_told_it_closed(tmp_path: Path) -> None:
    """They were told the key was deleted (KeyNotFoundError), which no one did."""
    from tierstore import KeyNotFoundError, StoreClosedError

    numel = VALUE // 4
    store = TierStore([HostTier(3 * VALUE), DiskTier(tmp_path / "d", "16MiB")])
    await store.open()
    for index, name in enumerate("abcdef"):
        await store.put(name, torch.full((numel,), float(index)))
    await store.prefetch(["a"], "host")
    await asyncio.sleep(0)

    async def hold() -> None:
        async with store.hold("a", "host"):
            pass

    waiting = [asyncio.ensure_future(hold()), asyncio.ensure_future(store.get("a", "host")), asyncio.ensure_future(hold())]
    await asyncio.sleep(0)
    await asyncio.wait_for(store.aclose(), timeout=60)
    outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), timeout=60)
    assert not any(isinstance(outcome, KeyNotFoundError) for outcome in outcomes), outcomes
    assert all(outcome is None or isinstance(outcome, StoreClosedError) for outcome in outcomes), outcomes
    async with TierStore([HostTier(3 * VALUE), DiskTier(tmp_path / "d", "16MiB")]) as again:
        assert "a" in again


async def test_a_get_waiting_for_a_write_hold_as_the_store_closes_is_told_it_closed(tmp_path: Path) -> None:
    """It was told the key was not in the store (KeyNotFoundError): the close forgets every
    entry (a review). The value on the host, or on the disk (the write hold loads it)."""
    from tierstore import StoreClosedError

    numel = VALUE // 4
    for on_disk in (False, True):
        store = TierStore([HostTier(4 * VALUE), DiskTier(tmp_path / f"d{on_disk}", "16MiB")])
        await store.open()
        for index, name in enumerate("abcdef"):
            await store.put(name, torch.full((numel,), float(index)))
        if not on_disk:
            await store.get("a", "host")
        assert ("host" in store.where("a")) != on_disk
        release = asyncio.Event()

        async def writer(release: asyncio.Event = release, store: TierStore = store) -> None:
            async with store.hold("a", "host", write=True) as value:
                value.fill_(7.0)
                await release.wait()

        writing = asyncio.ensure_future(writer())
        await asyncio.sleep(0)
        getting = asyncio.ensure_future(store.get("a", "host"))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(store.aclose(flush=False))
        await asyncio.sleep(0.05)
        release.set()
        outcomes = await asyncio.wait_for(asyncio.gather(writing, getting, closing, return_exceptions=True), timeout=60)
        assert outcomes[0] is None and outcomes[2] is None, outcomes
        assert isinstance(outcomes[1], StoreClosedError), (on_disk, outcomes[1])
