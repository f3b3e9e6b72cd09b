"""The device boundary (``tierstore.device``): links, the emulation setting, and the store's
copies across a device tier's link; ``TierStore.fill``."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore, TierFullError, TierStore
from tierstore.device import (
    ENV_EMULATE,
    ENV_LINK,
    HostLink,
    LinkSpec,
    emulate_device,
    emulation,
    gather_transfers,
    link_for,
)
from tierstore.device.emulated import EmulatedLink

# -- the setting -----------------------------------------------------------------------------------


def test_link_spec_reads_bandwidth_and_latency() -> None:
    assert LinkSpec.parse("25GB/s,10us") == LinkSpec(25e9, 10e-6)
    assert LinkSpec.parse(" 12GiB/s ") == LinkSpec(12 * 2**30, 0.0)
    assert LinkSpec.parse("5ms") == LinkSpec(None, 5e-3)
    assert LinkSpec.parse("") == LinkSpec()
    assert LinkSpec(1e9, 1e-3).seconds(10**6) == pytest.approx(2e-3)
    for bad in ("25GB", "fast", "25GB/s,10", "-1GB/s", "0GB/s"):
        with pytest.raises(ValueError):
            LinkSpec.parse(bad)


def test_environment_and_python_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_EMULATE, "1")
    monkeypatch.setenv(ENV_LINK, "8GB/s")
    with emulate_device(False):
        assert emulation()[0] is False
        assert isinstance(link_for("cpu"), HostLink)
        with emulate_device(True, "1GB/s"):
            assert emulation() == (True, LinkSpec(1e9))
        assert emulation()[0] is False  # the inner block restored the outer setting
    assert emulation() == (True, LinkSpec(8e9))  # back to the environment's
    link = link_for("cpu")
    assert isinstance(link, EmulatedLink) and link.spec == LinkSpec(8e9) and not link.lends
    assert link_for("cpu") is link  # one link per speed, as a GPU has one set of copy engines
    assert isinstance(link_for("cpu", emulate=False), HostLink)
    monkeypatch.setenv(ENV_EMULATE, "maybe")
    with pytest.raises(ValueError, match=ENV_EMULATE):
        emulation()


# -- the emulated link ---------------------------------------------------------------------------------


def test_emulated_copies_are_real_and_in_order() -> None:
    link = link_for("cpu", emulate=True, spec="")
    src = torch.randn(1 << 16)
    dst = torch.empty_like(src)
    transfer = link.to_host(dst, src)
    transfer.wait()
    assert torch.equal(dst, src) and dst.data_ptr() != src.data_ptr()
    # A copy runs when its turn comes on the stream, reading the bytes as they are then.
    slow = link_for("cpu", emulate=True, spec="200MB/s")
    big_src, big_dst = torch.zeros(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)
    first = slow.to_host(big_dst, big_src)
    later_src, later_dst = torch.zeros(4), torch.empty(4)
    second = slow.to_host(later_dst, later_src)
    later_src.fill_(7.0)  # before its turn: the copy sees it (a GPU stream would too)
    second.wait()
    assert first.done() and first.ended <= second.started  # noqa: PLR2004 - FIFO per direction
    assert torch.equal(later_dst, torch.full((4,), 7.0))
    assert first.seconds >= 1e6 / 200e6  # stretched to the link's bandwidth (a lower bound only)


def test_a_copy_of_the_wrong_size_is_refused() -> None:
    link = link_for("cpu", emulate=True, spec="")
    with pytest.raises(ValueError, match="bytes into a buffer"):
        link.to_device(torch.empty(3), torch.empty(4))


async def test_awaiting_a_transfer_and_cancelling_the_wait() -> None:
    link = link_for("cpu", emulate=True, spec="100MB/s")
    src, dst = torch.ones(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)
    transfer = link.to_device(dst, src)

    async def waiter() -> None:
        await transfer

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert transfer.done()  # the cancelled wait still waited for the copy to end
    await gather_transfers([link.to_host(torch.empty(8), torch.ones(8)), link.to_host(torch.empty(8), torch.ones(8))])


def test_listeners_and_counters_see_every_copy() -> None:
    link = link_for("cpu", emulate=True, spec="")
    seen: list[tuple[str, int]] = []

    def listen(direction: str, nbytes: int, started: float, ended: float) -> None:
        assert started <= ended
        seen.append((direction, nbytes))

    before = link.moved["to_device"][0]
    link.add_listener(listen)
    try:
        link.to_device(torch.empty(100, dtype=torch.uint8), torch.ones(100, dtype=torch.uint8)).wait()
        link.to_host(torch.empty(10), torch.ones(10)).wait()
    finally:
        link.remove_listener(listen)
    assert ("to_device", 100) in seen and ("to_host", 40) in seen
    assert link.moved["to_device"][0] - before >= 100


# -- the store's device tier crosses its link ----------------------------------------------------------


async def test_an_emulated_device_tier_moves_its_bytes_over_the_link(tmp_path: object) -> None:
    device = DeviceTier("cpu", "1MiB", emulate_device=True)
    async with TierStore([device, HostTier("4MiB")]) as store:
        link = device.link
        assert isinstance(link, EmulatedLink)
        to_device, to_host = link.moved["to_device"][0], link.moved["to_host"][0]
        value = torch.randn(1000)
        await store.put("w", value, "host")
        async with store.hold("w", "device", write=True) as held:  # host -> device: over the link
            assert torch.equal(held, value)
            held.mul_(2)  # now only the device has the newest value
        assert link.moved["to_device"][0] - to_device >= value.nbytes
        await store.put("x", torch.ones(262_000), "device")  # pushes "w" down: device -> host
        assert link.moved["to_host"][0] - to_host >= value.nbytes
        assert store.where("w") == ["host"]
        assert torch.equal(await store.get("w"), value * 2)
    plain = DeviceTier("cpu", "1MiB", emulate_device=False)
    async with TierStore([plain]) as store:
        assert plain.link is None


# -- fill ---------------------------------------------------------------------------------------------------


async def test_fill_writes_a_value_in_place(tmp_path: object) -> None:
    async with TierStore([HostTier("1MiB")]) as store:
        async with store.fill("a", (2, 3), torch.float64) as buffer:
            assert buffer.shape == (2, 3) and buffer.dtype == torch.float64
            buffer.copy_(torch.arange(6.0).view(2, 3))
        assert torch.equal(await store.get("a"), torch.arange(6.0, dtype=torch.float64).view(2, 3))
        with pytest.raises(RuntimeError, match="producer failed"):
            async with store.fill("a", (2, 3), torch.float64) as buffer:
                buffer.fill_(-1)
                raise RuntimeError("producer failed")
        assert torch.equal(await store.get("a"), torch.arange(6.0, dtype=torch.float64).view(2, 3))  # old value kept
        used = store.stats()["tiers"]["host"]["used"]
        with pytest.raises(TierFullError):
            async with store.fill("big", (1 << 20,), torch.float32):
                pytest.fail("no buffer should be handed out")
        assert "big" not in store and store.stats()["tiers"]["host"]["used"] == used


async def test_fill_on_a_durable_store_writes_through(tmp_path: object) -> None:
    from pathlib import Path

    root = Path(str(tmp_path)) / "d"
    async with TierStore([HostTier("1MiB"), DiskTier(root, "16MiB")], durable=True) as store:
        async with store.fill("a", (4,), torch.int32) as buffer:
            buffer.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
        assert "disk" in store.where("a")
    async with TierStore([HostTier("1MiB"), DiskTier(root, "16MiB")]) as store:
        assert torch.equal(await store.get("a"), torch.tensor([1, 2, 3, 4], dtype=torch.int32))


def test_fill_through_the_facade() -> None:
    with SyncTierStore([HostTier("1MiB")]) as store:
        with store.fill("k", (3,), torch.float32) as buffer:
            buffer.fill_(2.5)
        assert torch.equal(store.get("k"), torch.full((3,), 2.5))


def test_cancelled_copy_wait_time_is_bounded() -> None:
    """A transfer's wait() with a timeout says so instead of hanging."""
    link = link_for("cpu", emulate=True, spec="1MB/s")
    transfer = link.to_host(torch.empty(1 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.uint8))
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        transfer.wait(timeout=0.01)
    assert time.perf_counter() - started < 5
    transfer.wait()


def test_pop_and_get_onto_an_emulated_device_tier_cross_the_link() -> None:
    """A host copy is not device memory when the device is behind a link: popping it onto the
    device tier copies it over the link rather than handing the host buffer over."""
    device = DeviceTier("cpu", "8MiB", emulate_device=True)
    with SyncTierStore([device, HostTier("32MiB")]) as store:
        link = device.link
        value = torch.randn(1000)
        store.put("a", value, "host")
        before = link.moved["to_device"][0]
        popped = store.pop("a", "device")
        assert torch.equal(popped, value)
        assert link.moved["to_device"][0] - before >= value.nbytes
        store.put("b", torch.ones(3_000_000), "host")  # too large for the device tier: read uncached
        before = link.moved["to_device"][0]
        assert torch.equal(store.get("b", "device"), torch.ones(3_000_000))
        assert link.moved["to_device"][0] - before >= 12_000_000


def test_a_copy_after_ready_starts_at_once() -> None:
    from tierstore.device import READY

    for link in (link_for("cpu", emulate=True, spec=""), link_for("cpu", emulate=False)):
        src, dst = torch.arange(8.0), torch.empty(8)
        link.to_host(dst, src, after=READY).wait()
        assert torch.equal(dst, src)
