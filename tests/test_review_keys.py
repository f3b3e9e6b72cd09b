"""Review of the small-keys rework (issue 15): races between puts that need no await, flushes,
deletes, holds and eviction, on a host+disk store with a tiny host tier, checked against a
dict model (also through the sync facade from several threads)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import threading
from pathlib import Path

import pytest
import torch

from tierstore import SyncTierStore, TierStore
from tierstore.errors import EntryHeldError, KeyNotFoundError, NotAStoreFolderError, TierFullError
from tierstore.tiers import DiskTier, HostTier


def tiers(root: Path, host: str = "256KiB", durable: bool = False) -> list:
    return [HostTier(host), DiskTier(root, "64MiB", chunk_size="64KiB", durable=durable)]


@pytest.mark.parametrize("yields", [2, 3, 4])
async def test_a_flush_writes_the_value_it_planned_when_a_small_put_grows_the_key_meanwhile(
    tmp_path: Path, yields: int
) -> None:
    # 3000 bytes: packed in a slab slot on the host tier, an extent on disk (not inline).
    old, new = torch.full((750,), 1.0), torch.full((1000,), 2.0)
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("k", old)
        flush = asyncio.ensure_future(store.flush())
        for _ in range(yields):
            await asyncio.sleep(0)
        await store.put("k", new)  # done at once (no await): the flush's source keeps the old value
        await flush
        assert torch.equal(await store.get("k"), new)
        await store.flush()
    async with TierStore(tiers(tmp_path / "d")) as store:
        assert torch.equal(await store.get("k"), new)


async def test_a_pop_that_hands_its_buffer_over_leaves_the_value_readable_until_the_key_is_gone(
    tmp_path: Path,
) -> None:
    old, new = (
        torch.full((5000,), 1.0),
        torch.full((5000,), 2.0),
    )  # a buffer of its own on the host tier
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("k", old)
        await store.flush()
        await store.put("k", new)  # the disk keeps the old value until the pop commits the delete
        pop = asyncio.ensure_future(store.pop("k"))
        await asyncio.sleep(0)
        with contextlib.suppress(KeyNotFoundError):
            assert torch.equal(await store.get("k"), new)  # the pop has not deleted it yet
        assert torch.equal(await pop, new)
        assert "k" not in store


async def test_a_hold_taken_while_a_pop_deletes_loses_no_value(tmp_path: Path) -> None:
    old, new = torch.full((5000,), 1.0), torch.full((5000,), 2.0)
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("k", old)
        await store.flush()
        await store.put("k", new)
        pop = asyncio.ensure_future(store.pop("k"))
        await asyncio.sleep(0)
        async with store.hold("k") as held:
            assert torch.equal(held, new)
            try:
                popped = await pop
            except EntryHeldError:  # refused: the key keeps its value
                popped = None
            if popped is not None:
                assert torch.equal(popped, new) and "k" not in store
                popped.fill_(3.0)  # the caller's own memory now, not the held buffer
                assert torch.equal(held, new)
        if popped is None:
            assert torch.equal(await store.get("k"), new)


SIZES = [
    0,
    4,
    100,
    512,
    1024,
    2044,
    2048,
    2052,
    3000,
    4096,
    20000,
]  # bytes, around the inline threshold


def _value(rng: random.Random, tag: int) -> torch.Tensor:
    return torch.full((rng.choice(SIZES) // 4,), float(tag))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("durable", [False, True])
async def test_concurrent_small_and_large_puts_gets_deletes_pops_holds_and_flushes_match_a_dict(
    tmp_path: Path, durable: bool, seed: int
) -> None:
    keys = [f"k{i}" for i in range(24)]
    model: dict[str, torch.Tensor] = {}
    locks = {
        key: asyncio.Lock() for key in keys
    }  # one operation at a time per key: the model is exact
    tags = iter(range(1, 1 << 30))
    async with TierStore(tiers(tmp_path / "d", durable=durable)) as store:

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(200):
                key, op = rng.choice(keys), rng.random()
                async with locks[key]:
                    if op < 0.4 or (op >= 0.6 and key not in model):
                        value = _value(rng, next(tags))
                        try:
                            await store.put(
                                key,
                                value,
                                tier=rng.choice([None, None, "host", "disk"]),
                                durable=rng.random() < 0.2,
                            )
                        except (
                            TierFullError
                        ):  # (a tiny host tier with holds open): the old value stays
                            pass
                        else:
                            model[key] = value
                    elif op < 0.6:
                        if key in model:
                            assert torch.equal(await store.get(key), model[key]), key
                        else:
                            assert key not in store
                    elif op < 0.7:
                        await store.delete(key)
                        del model[key]
                    elif op < 0.8:
                        assert torch.equal(await store.pop(key), model.pop(key)), key
                    elif op < 0.9:
                        try:
                            async with store.hold(key) as held:
                                assert torch.equal(held, model[key]), key
                                await asyncio.sleep(0)
                        except TierFullError:
                            pass
                    else:
                        try:
                            async with store.hold(key, write=True) as held:
                                held.add_(1)
                                model[key] = model[key] + 1
                                await asyncio.sleep(0)
                        except TierFullError:
                            pass
                if rng.random() < 0.03:
                    await store.flush()

        async def reader(seed: int) -> None:  # reads and flushes racing everything, unordered
            rng = random.Random(seed)
            for _ in range(150):
                with contextlib.suppress(KeyNotFoundError):
                    await store.get(rng.choice(keys))
                if rng.random() < 0.1:
                    await store.flush()
                await asyncio.sleep(0)

        await asyncio.gather(
            *(worker(seed * 10 + i) for i in range(6)), reader(seed + 100), reader(seed + 200)
        )
        assert sorted(store.keys()) == sorted(model)
        for key, value in model.items():
            assert torch.equal(await store.get(key), value), key
        await store.flush()
        host = store.tier("host")
        assert host.live_bytes == sum(
            c.nbytes for e in store._engine.entries.values() for c in e.all_copies() if c.tier == 0
        )  # type: ignore[attr-defined]
    async with TierStore(tiers(tmp_path / "d", durable=durable)) as store:
        assert sorted(store.keys()) == sorted(model)
        for key, value in model.items():
            assert torch.equal(await store.get(key), value), key


def test_the_sync_facade_from_threads_matches_a_dict(tmp_path: Path) -> None:
    models: list[dict[str, torch.Tensor]] = [{} for _ in range(4)]
    errors: list[BaseException] = []

    def make() -> SyncTierStore:
        return SyncTierStore(tiers(tmp_path / "d", host="512KiB"))

    with make() as store:

        def worker(w: int) -> None:
            rng, model = random.Random(w), models[w]
            try:
                for i in range(150):
                    key, op = f"w{w}/k{rng.randrange(10)}", rng.random()
                    if op < 0.45:
                        value = _value(rng, i)
                        store.put(key, value)
                        model[key] = value
                    elif op < 0.75:
                        assert (
                            torch.equal(store.get(key), model[key])
                            if key in model
                            else key not in store
                        ), key
                    elif op < 0.85 and key in model:
                        store.delete(key)
                        del model[key]
                    elif op < 0.9 and key in model:
                        assert torch.equal(store.pop(key), model.pop(key)), key
                    elif op < 0.95:
                        store.flush()
                    elif key in model:
                        with store.hold(key) as held:
                            assert torch.equal(held, model[key]), key
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        expected = {key: value for model in models for key, value in model.items()}
        assert sorted(store.keys()) == sorted(expected)
    with make() as store:
        assert sorted(store.keys()) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(store.get(key), value), key


async def test_a_flush_waiting_for_a_write_hold_leaves_the_garbage_collector_on(
    tmp_path: Path,
) -> None:
    async with TierStore(tiers(tmp_path / "d")) as store:
        await store.put("a", torch.ones(4))
        await store.put("b", torch.ones(4))
        assert gc.isenabled()
        taken, release = asyncio.Event(), asyncio.Event()

        async def step() -> None:  # a training step holding "a" for writing
            async with store.hold("a", write=True) as held:
                taken.set()
                await release.wait()
                held.add_(1)

        holder = asyncio.ensure_future(step())
        await taken.wait()
        flush = asyncio.ensure_future(store.flush())  # waits for the hold
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            assert not flush.done()
            waiting_with_gc = gc.isenabled()
        finally:
            release.set()
            await holder
        assert waiting_with_gc
        await flush
        assert gc.isenabled()
    with pytest.raises(
        NotAStoreFolderError
    ):  # a reopen that fails (a file where the folder should be)
        (tmp_path / "f").write_bytes(b"x")
        async with TierStore(tiers(tmp_path / "f")):
            pass
    assert gc.isenabled()
