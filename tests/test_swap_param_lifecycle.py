"""offload_parameters over a store's life: closing the store puts the weights back into the
module (a host-only store would otherwise take them with it), detach() twice is harmless, and a
cast of the module while offloaded is refused instead of half applied."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from failing_backward import FailingBackward
from torch import nn

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters
from tierstore.sync import run

pytestmark = pytest.mark.device_modes


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        torch.manual_seed(step)
        opt.zero_grad()
        m(torch.randn(8, 16)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("with_disk", [False, True])
def test_closing_the_store_puts_the_weights_back_into_the_module(tmp_path: Path, device_mode: str, with_disk: bool) -> None:
    plain, swapped = model(), model()
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True))
    tiers = [DeviceTier("cpu", "64KiB"), HostTier("8MiB")] + ([DiskTier(tmp_path / "d", "64MiB")] if with_disk else [])
    with SyncTierStore(tiers) as store:
        offload = offload_parameters(swapped, store)
        opt = TieredAdamW(swapped.parameters(), lr=1e-2, offload="host")
        train(swapped, opt)
        opt.close()
    for ours, theirs in zip(swapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    x = torch.randn(2, 16)
    assert torch.equal(swapped(x), plain(x))  # a plain module again: no hooks left
    offload.detach()  # (nothing left to do)
    if with_disk:  # the weights left the store with the module
        with SyncTierStore([HostTier("8MiB"), DiskTier(tmp_path / "d", "64MiB")]) as reopened:
            assert [key for key in reopened.keys() if key.startswith("swap/")] == []


def test_detach_twice_does_nothing_the_second_time(device_mode: str) -> None:
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        offload = offload_parameters(m, store)
        offload.detach()
        offload.detach()
        assert list(store.keys()) == []
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


def test_a_cast_while_offloaded_is_refused_and_detach_applies_it(device_mode: str) -> None:
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        offload = offload_parameters(m, store)
        m.double()
        with pytest.raises(RuntimeError, match="was cast to torch.float64 while offloaded"):
            m(torch.randn(2, 16, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="was cast to torch.float64 while offloaded"):
            m.state_dict()
        offload.detach()
    assert all(p.dtype == torch.float64 and torch.equal(p, b.double()) for p, b in zip(m.parameters(), before, strict=True))
    assert m(torch.randn(2, 16, dtype=torch.float64)).dtype == torch.float64


def test_a_close_hook_that_raises_fails_the_close_and_nothing_is_lost(tmp_path: Path, device_mode: str) -> None:
    async def main() -> None:
        store = await TierStore([HostTier("8MiB"), DiskTier(tmp_path / "d", "64MiB")]).open()
        calls = []

        async def failing() -> None:
            calls.append("failing")
            raise RuntimeError("not now")

        async def counting() -> None:
            calls.append("counting")

        handle = store.register_close_hook(failing)
        store.register_close_hook(counting)
        await store.put("k", torch.arange(10.0))
        with pytest.raises(RuntimeError, match="not now"):
            await store.aclose()
        assert store.is_open and torch.equal(await store.get("k"), torch.arange(10.0))
        handle.remove()
        await store.aclose()
        assert calls == ["failing", "counting"]
        async with TierStore([HostTier("8MiB"), DiskTier(tmp_path / "d", "64MiB")]) as reopened:
            assert torch.equal(await reopened.get("k"), torch.arange(10.0))

    asyncio.run(main())


class FlakyReads(TierStore):
    """A store whose second read fails once (a transient I/O error)."""

    reads = 0

    async def read(self, key: str) -> torch.Tensor:
        self.reads += 1
        if self.reads == 2:
            raise OSError("transient read error")
        return await super().read(key)


def test_a_put_back_that_fails_part_way_is_finished_by_the_next_close(device_mode: str) -> None:
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    store = run(FlakyReads([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]).open())
    offload_parameters(m, store)
    with pytest.raises(OSError, match="transient"):
        run(store.aclose())
    assert store.is_open
    run(store.aclose())
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))


def test_two_closes_at_once_both_wait_for_the_weights(device_mode: str) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    before = [p.detach().clone() for p in m.parameters()]
    store = run(TierStore([DeviceTier("cpu", "1MiB"), HostTier("64MiB")]).open())
    offload_parameters(m, store)

    async def both() -> list[object]:
        return await asyncio.gather(store.aclose(), store.aclose(), return_exceptions=True)

    assert run(both()) == [None, None]
    assert not store.is_open
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))


class SlowReads(TierStore):
    """A store whose reads take a while (a slow put-back)."""

    async def read(self, key: str) -> torch.Tensor:
        await asyncio.sleep(0.2)
        return await super().read(key)


def test_a_close_on_its_own_loop_while_detach_runs_on_another_thread_waits_for_it() -> None:
    """The put-back was guarded by an asyncio.Lock shared by two threads' loops: the close,
    on the user's loop, waited for a wake-up that never came."""
    import threading
    import time

    async def main() -> None:
        store = await SlowReads([HostTier("64MiB")]).open()
        m = model()
        before = [p.detach().clone() for p in m.parameters()]
        offload = await asyncio.to_thread(offload_parameters, m, store)
        detaching = threading.Thread(target=offload.detach)
        detaching.start()
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await asyncio.wait_for(store.aclose(), 60)
        assert time.monotonic() - started < 10, "the close was woken only by the timeout"  # (about 1 s of slow reads)
        detaching.join(30)
        assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))

    asyncio.run(main())


def test_detach_between_forward_and_backward_gives_torch_gradients(device_mode: str) -> None:
    """backward after ``detach()`` raised ``KeyNotFoundError: no key 'swap/params/...'`` (its
    units' hooks asked the store for weights detach had put back); it uses them in place now."""
    plain, swapped = model(), model()
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    plain(inputs).square().mean().backward()
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        offload = offload_parameters(swapped, store)
        loss = swapped(inputs).square().mean()
        offload.detach()
        loss.backward()
    for ours, theirs in zip(swapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs) and torch.equal(ours.grad, theirs.grad)  # type: ignore[arg-type]


def test_offload_activations_on_a_closed_store_refuses_at_once(device_mode: str) -> None:
    """Forward ran on, counting saves that never left (the report doubled its counts with no
    bytes moved), and only backward raised."""
    from tierstore.errors import StoreClosedError
    from tierstore.swap import offload_activations

    store = SyncTierStore([HostTier("8MiB")])
    store.open()
    saved = offload_activations(store, min_bytes=1)
    store.close()
    with pytest.raises(StoreClosedError, match="offload_activations: its store is closed"), saved:
        pass
    assert saved.report.offloaded == 0
    # closed inside the with: the next save is refused, not counted (backward raised, later)
    store = SyncTierStore([HostTier("8MiB")])
    store.open()
    saved = offload_activations(store, min_bytes=1)
    m = model()
    with pytest.raises(StoreClosedError, match="closed during this forward"), saved:
        m[0](torch.randn(2, 16))
        store.close()
        m[2](m[1](m[0](torch.randn(2, 16))))
    assert saved.report.offloaded <= 2


def test_the_optimizers_memory_report_counts_the_swapped_weights(device_mode: str) -> None:
    """It advised moving parameters with tierstore.swap while they were being moved."""
    m = model()
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        offload = offload_parameters(m, store)
        opt = TieredAdamW(m.parameters(), lr=1e-2, offload="host")
        train(m, opt, steps=1)
        report = opt.memory_report()
        assert report.swapped_parameters == 4 and report.device_weight_bytes == 0
        assert "the 4 parameter tensors tierstore.swap offloads" in str(report) and "(tierstore.swap moves" not in str(report)
        opt.close()
        offload.detach()


@pytest.mark.parametrize("root_unit", [False, True], ids=["child", "root"])
@pytest.mark.parametrize("reparametrize", ["weight_norm", "prune", "spectral_norm"])
def test_a_forward_pre_hook_registered_before_offloading_sees_the_weights(device_mode: str, reparametrize: str, root_unit: bool) -> None:
    """A tryout: the old-style ``weight_norm``, ``prune`` and ``spectral_norm`` compute the
    weight in a forward pre-hook from the module's own parameters; registered before the
    offload's hold, theirs ran first on the size-0 placeholders (``weight_norm``: the process
    died of SIGFPE; the others raised about sizes). The hold now runs first."""
    import warnings

    import torch.nn.utils.prune as prune

    def make() -> nn.Module:
        m = model()
        if root_unit:  # (the root a unit itself: the review found a bare Linear broken by a first version)
            torch.manual_seed(0)
            m = nn.Linear(16, 4)
        layer = m if root_unit else m[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (weight_norm's deprecation)
            if reparametrize == "weight_norm":
                torch.nn.utils.weight_norm(layer)
            elif reparametrize == "prune":
                prune.l1_unstructured(layer, "weight", 0.3)
            else:
                torch.nn.utils.spectral_norm(layer)  # (its random start: model() seeds)
        return m

    plain, swapped = make(), make()  # (a deepcopy of these is refused by torch)
    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        offload_parameters(swapped, store)
        opts = [torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), TieredAdamW(swapped.parameters(), lr=1e-2, offload="host")]
        for step in range(3):
            torch.manual_seed(step)
            x = torch.randn(8, 16)
            for m, opt in zip((plain, swapped), opts, strict=True):
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(swapped.parameters(), plain.parameters(), strict=True)), step
        opts[1].close()
    for ours, theirs in zip(swapped.parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_a_failed_offload_leaves_the_store_as_it_was(device_mode: str) -> None:
    """One weight larger than the tier: ``TierFullError`` (the module untouched), but the
    weights put before it stayed in the store and its namespace stayed claimed, so a model that
    fits the empty tier was then refused too (a tryout)."""
    from tierstore import TierFullError

    with SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("512KiB")]) as store:
        big = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(512, 512))  # 256 KiB, 256 KiB, 1 MiB
        before = [p.detach().clone() for p in big.parameters()]
        with pytest.raises(TierFullError):
            offload_parameters(big, store)
        assert store.keys() == [] and run(store.store.namespaces()) == []
        assert all(torch.equal(a, b) for a, b in zip(before, big.parameters(), strict=True))
        small = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 200))  # fits the empty tier
        offloader = offload_parameters(small, store)
        offloader.detach()


def test_a_refused_offload_gives_its_namespace_back(device_mode: str) -> None:
    """A reviewer: offloading a module whose weights another offload_parameters holds is
    refused, but the refused call kept its namespace claimed, so the corrected call with the
    same ``namespace=`` was refused for the rest of the process."""
    with SyncTierStore([DeviceTier("cpu", "64MiB"), HostTier("64MiB")]) as store:
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        first = offload_parameters(m, store, namespace="p1")
        with pytest.raises(ValueError, match="offloaded already"):
            offload_parameters(m[0], store, namespace="p2")
        assert [info.name for info in run(store.store.namespaces())] == ["p1/"]
        first.detach()
        offload_parameters(m, store, namespace="p2").detach()


def test_a_model_dropped_without_detach_lets_go_of_its_weights_in_the_store(device_mode: str) -> None:
    """A tryout: a model and its offload_parameters dropped without detach() (a re-fit, a
    hyper-parameter search) kept the module and its weights in the store until the store closed:
    the store's close hook and the registry of offloaded weights held the offloader."""
    import gc
    import weakref

    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        for _ in range(3):
            m = model()
            offload = offload_parameters(m, store)
            m(torch.randn(8, 16)).square().mean().backward()
            dropped, offloader = weakref.ref(m), weakref.ref(offload)
            params = [weakref.ref(p) for p in m.parameters()]  # (and their gradients with them)
            del m, offload
            gc.collect()
            assert dropped() is None and offloader() is None  # they went with the program's last reference
            assert [p for p in params if p() is not None] == []
            _wait_for(lambda: not [key for key in store.keys() if key.startswith("swap/")])  # (on the store's loop)
            assert [key for key in store.keys() if key.startswith("swap/")] == []
            assert not [n for n in store.namespaces() if n.live]
        kept = model()  # a model kept still trains, its weights in the store
        offload = offload_parameters(kept, store)
        kept(torch.randn(8, 16)).square().mean().backward()
        gc.collect()
        assert [key for key in store.keys() if key.startswith("swap/")]
        offload.detach()


def test_parameters_kept_past_their_dropped_model_get_their_weights_back(device_mode: str) -> None:
    """A reviewer: parameters something else still holds (an optimizer, a list) when their
    model and offload are dropped get their weights back, as from detach(), not placeholders."""
    import gc

    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        m = model()
        expected = [p.detach().clone() for p in m.parameters()]
        offload = offload_parameters(m, store)
        kept = list(m.parameters())
        del m, offload
        gc.collect()
        _wait_for(lambda: not [n for n in store.namespaces() if n.live])
        assert not [n for n in store.namespaces() if n.live]
        for param, value in zip(kept, expected, strict=True):
            assert torch.equal(param.detach(), value)
        torch.optim.AdamW(kept).step()  # (a plain parameter again: torch's optimizers take it)


def test_a_model_dropped_after_a_failed_backward_lets_go_too(device_mode: str) -> None:
    """A reviewer: a trial whose backward raised kept its offload alive (its graph held itself
    through the saved tensors), so its namespace and device-tier room were never given back."""
    import gc

    with SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("8MiB")]) as store:
        for _ in range(4):
            m = model()
            offload = offload_parameters(m, store)
            loss = FailingBackward.apply(m(torch.randn(8, 16))).square().mean()
            with pytest.raises(ValueError, match="backward failed"):
                loss.backward()
            del m, offload, loss
            gc.collect()
            _wait_for(lambda: not [n for n in store.namespaces() if n.live])
            assert not [n for n in store.namespaces() if n.live]


def _wait_for(done: Callable[[], bool], seconds: float = 10) -> None:
    """Wait until ``done()`` (a dropped offload's weights leave the store on the store's loop),
    ``seconds`` at most; the assertion after it says whether it came."""
    import time

    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
