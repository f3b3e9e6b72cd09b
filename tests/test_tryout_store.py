"""A new user's tryout of the store: each test failed before its fix."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, TierStore, WrongLoopError, parse_bytes


def test_a_verb_awaited_on_another_running_loop_is_refused_not_hung(tmp_path: Path) -> None:
    """(two loops at once: one side's puts never ended, or the whole process hung)"""
    store = TierStore([HostTier("256KiB"), DiskTier(tmp_path / "disk", "64MiB")])
    opened, stop, done = threading.Event(), threading.Event(), threading.Event()

    def loop_a() -> None:
        async def main() -> None:
            await store.open()
            opened.set()
            i = 0
            while not stop.is_set():
                await store.put(f"a{i % 8}", torch.full((30000,), float(i)))
                i += 1
                await asyncio.sleep(0)
            await store.aclose()
            done.set()

        asyncio.run(main())

    thread = threading.Thread(target=loop_a, daemon=True)
    thread.start()
    assert opened.wait(30)
    try:
        verbs = (lambda: store.put("b", torch.ones(4)), lambda: store.get("a0"), lambda: store.delete("a1"), lambda: store.flush(),
                 lambda: store.aclose(), lambda: store.open())
        for verb in verbs:
            with pytest.raises(WrongLoopError, match="opened on another event loop"):
                asyncio.run(asyncio.wait_for(verb(), 30))
        assert "b" not in store
    finally:
        stop.set()
        thread.join(30)
    assert done.is_set() and not thread.is_alive()


def test_a_paused_loop_keeps_its_store_and_a_small_durable_put_is_checked_too(tmp_path: Path) -> None:
    """(review: a loop paused between ``run_until_complete`` calls still owns the store's work, and
    another loop took the store over, its get failing with "attached to a different loop"; a small
    put onto a durable disk tier skipped the check)"""
    store = TierStore([DiskTier(tmp_path / "disk", "64MiB")])
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(store.open())
        first.run_until_complete(store.put("x", torch.ones(4)))
        for verb in (lambda: store.get("x"), lambda: store.put("k", torch.ones(4)), lambda: store.aclose()):
            with pytest.raises(WrongLoopError, match="not closed"):
                asyncio.run(verb())
        assert store.loop is first and "k" not in store
        first.run_until_complete(store.aclose())
    finally:
        first.close()


def test_a_store_whose_loop_ended_is_used_from_the_next_one(tmp_path: Path) -> None:
    """(the zarr adapter refused a later ``asyncio.run``: "the TierStore's event loop is not
    running", while the store's own verbs worked there)"""
    import numpy as np
    import zarr

    from tierstore.zarr import TierZarrStore

    store = TierStore([HostTier("1MiB")])

    async def first() -> None:
        await store.open()
        await store.put("x", torch.arange(4.0))
        array = await zarr.api.asynchronous.create_array(TierZarrStore(store), name="z", shape=(8,), chunks=(4,), dtype="f4")
        await array.setitem(slice(None), np.arange(8, dtype="f4"))

    async def second() -> tuple[torch.Tensor, np.ndarray, bool]:
        array = await zarr.api.asynchronous.open_array(store=TierZarrStore(store), path="z")
        read = await array.getitem(slice(2, 6))
        value = await store.get("x")
        here = store.loop is asyncio.get_running_loop()
        await store.aclose()
        return value, read, here

    asyncio.run(first())
    value, read, here = asyncio.run(second())
    assert torch.equal(value, torch.arange(4.0)) and read.tolist() == [2, 3, 4, 5] and here


@pytest.mark.parametrize(("shape", "dtype"), [((0,), torch.float32), ((0, 5_000_000), torch.float32), ((2**31, 0, 2**31), torch.float32),
                                              ((3, 0, 2), torch.bfloat16), ((0, 2**40), torch.bfloat16)])
def test_empty_values_round_trip_through_a_zarr_snapshot(tmp_path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """(``(0, 5_000_000)`` exported with 19 MiB chunks its import refused; ``(2**31, 0, 2**31)``:
    numpy's "array is too big" failed the export)"""

    async def run() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "a", "64MiB")]) as store:
            await store.put("empty", torch.empty(shape, dtype=dtype))
            await store.put("x", torch.ones(3))
            assert await store.export_zarr(tmp_path / "snap") == 2
        async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "b", "64MiB")]) as store:
            assert await store.import_zarr(tmp_path / "snap") == 2
            return [(key, tuple((value := await store.get(key)).shape), value.dtype) for key in sorted(store.keys())]

    assert asyncio.run(run()) == [("empty", shape, dtype), ("x", (3,), torch.float32)]


def test_petabyte_sizes_parse() -> None:
    """(``"1PiB"``: "cannot read '1PiB' as a byte size", where ``2**50`` was accepted)"""
    assert parse_bytes("1PiB") == 2**50 and parse_bytes("2PB") == 2 * 1000**5
