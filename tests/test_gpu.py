"""CUDA: the device link, the store over a CUDA device tier, the optimizer and swapping on a GPU.

Every test needs CUDA (``gpu`` mark; skipped elsewhere) and runs in ``benchmarks/gpu_check.sh``.
Races with the caller's own stream are made visible by queuing a spin kernel
(``torch.cuda._sleep``) before the kernel that writes the data: a copy that does not wait for
the caller's stream then reads the bytes from before the write.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.device import link_for
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_activations, offload_parameters
from tierstore.testing import same_bytes, sample, supported_dtypes

pytestmark = pytest.mark.gpu

MiB = 1 << 20
# GPU cycles the spin kernel runs before the data is written: about 0.1-0.2 s at 1-2 GHz, far
# longer than starting a copy takes, so a copy that ignores the caller's stream is caught.
SPIN = 200_000_000


@pytest.fixture(autouse=True)
def _synchronized() -> Iterator[None]:
    """Each test starts and ends with the GPU idle (a failed test leaves nothing queued)."""
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()


def pattern(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(device)


# -- the link ----------------------------------------------------------------------------------


@pytest.mark.parametrize("marked", [True, False], ids=["after-mark", "current-stream"])
def test_to_host_waits_for_the_callers_non_default_stream(marked: bool) -> None:
    link = link_for("cuda")
    n = 4 * MiB // 4
    expected = pattern(n, 1)
    data = expected.cuda()
    src = torch.zeros(n, device="cuda")
    dst = torch.full((n,), -1.0).pin_memory()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        src.copy_(data)  # written on the caller's current stream, long after the copy was asked for
        transfer = link.to_host(dst, src, after=link.mark() if marked else None)
    transfer.wait(timeout=60)
    assert transfer.done() and transfer.nbytes == n * 4
    assert torch.equal(dst, expected)


def test_to_device_waits_for_the_callers_kernels_on_its_buffer() -> None:
    link = link_for("cuda")
    n = 4 * MiB // 4
    expected = pattern(n, 2)
    src = expected.pin_memory()
    dst = torch.zeros(n, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        dst.fill_(7.0)  # the caller's last use of the buffer: the copy must land after it
        transfer = link.to_device(dst, src, after=link.mark())
    transfer.wait(timeout=60)
    assert torch.equal(dst.cpu(), expected)


@contextmanager
def _no_polling(loop: asyncio.AbstractEventLoop) -> Iterator[list[int]]:
    """Count the event loop's wake-ups and refuse ``asyncio.sleep`` meanwhile: an await that
    polls (sleeps in a loop until the copy is done) wakes the loop at every round."""
    wakeups = [0]
    selector = getattr(loop, "_selector", None)
    original_sleep = asyncio.sleep

    async def refused(*_: Any, **__: Any) -> None:
        raise AssertionError("asyncio.sleep was called while awaiting a transfer (polling)")

    original_select = selector.select if selector is not None else None
    if selector is not None:

        def select(timeout: float | None = None) -> Any:
            wakeups[0] += 1
            return original_select(timeout)  # type: ignore[misc]

        selector.select = select
    setattr(asyncio, "sleep", refused)  # noqa: B010 - a module attribute, replaced for the test
    try:
        yield wakeups
    finally:
        setattr(asyncio, "sleep", original_sleep)  # noqa: B010
        if selector is not None:
            del selector.select  # the instance attribute: the class's method shows again


async def test_await_transfer_completes_without_polling() -> None:
    link = link_for("cuda")
    n = MiB // 4
    expected = pattern(n, 3)
    data = expected.cuda()
    src = torch.zeros(n, device="cuda")
    dst = torch.empty(n).pin_memory()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        src.copy_(data)
        transfer = link.to_host(dst, src, after=link.mark())
    assert not transfer.done()  # the spin kernel is still running
    started = time.perf_counter()
    with _no_polling(asyncio.get_running_loop()) as wakeups:
        await transfer
    waited = time.perf_counter() - started
    assert transfer.done() and torch.equal(dst, expected)
    # It waited for the GPU (tens of ms at least) and the loop woke a handful of times, not
    # once per polling round (a 1 ms poll would be ~100 wake-ups here).
    assert waited > 0.02
    assert wakeups[0] <= 10, wakeups[0]


async def test_when_done_ends_after_the_callers_queued_work() -> None:
    link = link_for("cuda")
    x = torch.zeros(MiB, device="cuda")
    stream = torch.cuda.Stream()
    called: list[bool] = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        x.fill_(3.0)
        marker = link.mark()
    done = link.when_done(marker)
    done.add_done_callback(lambda _: called.append(True))
    assert not done.done()
    await done
    assert done.done() and called == [True]
    assert marker.query()  # the event recorded after the fill has completed
    assert bool((x == 3.0).all())
    # a marker of nothing queued is done at once
    link.when_done(None).wait(timeout=5)


# -- the store over a CUDA device tier ---------------------------------------------------------


def _tiers(tmp_path: Path, device: int | str = "4MiB", host: int | str = "6MiB") -> list[Any]:
    return [DeviceTier("cuda", device), HostTier(host), DiskTier(tmp_path / "disk", "128MiB", durable=False)]


async def test_put_get_hold_and_eviction_round_trip_bit_exact(tmp_path: Path) -> None:
    dtypes = [d for d in supported_dtypes() if d.is_floating_point or d in (torch.int64, torch.uint8, torch.bool)]
    async with TierStore(_tiers(tmp_path)) as store:
        values = {f"v{i}/{dtype}": sample(dtype, (MiB // dtype.itemsize,), seed=i) for i, dtype in enumerate(dtypes * 2)}
        for key, value in values.items():
            await store.put(key, value.cuda())  # 1 MiB each: the device tier keeps the last 4
        places = {key: store.where(key) for key in values}
        assert any("device" not in p for p in places.values()), places  # evicted ...
        assert any("disk" in p for p in places.values()), places  # ... down to disk
        for key, value in values.items():
            got = await store.get(key)
            assert got.device.type == "cuda" and same_bytes(got, value), key
            async with store.hold(key, "host") as buffer:
                assert buffer.device.type == "cpu" and same_bytes(buffer, value), key
            out = torch.empty_like(value, device="cuda")
            assert (await store.get(key, out=out)) is out and same_bytes(out, value), key
            assert same_bytes(await store.read(key), value), key
        # A write hold on the device tier: the change becomes the value, and survives eviction.
        # (Finite numbers: NaN payloads after arithmetic differ between the GPU and the CPU.)
        key = "written"
        await store.put(key, pattern(MiB // 4, 9).cuda())
        async with store.hold(key, "device", write=True) as buffer:
            assert buffer.device.type == "cuda"
            buffer.add_(1.0)
        changed = pattern(MiB // 4, 9).add_(1.0)
        for other in values:  # everything else back through the device tier: key leaves it
            await store.get(other)
        assert same_bytes(await store.read(key), changed)
        assert same_bytes(await store.get(key), changed)


async def test_a_put_over_a_value_its_holders_kernels_still_read(tmp_path: Path) -> None:
    """A put that would copy over the value filling the device tier (``tierstore.overwrite``)
    does not while a kernel queued under a hold of it may still read it (its ``last_use`` event
    not complete): the holder's copy gets the old bytes, the store the new ones."""
    async with TierStore(_tiers(tmp_path, device="4MiB")) as store:
        await store.put("x", pattern(MiB, 1).cuda(), "device")  # 4 MiB: the device tier is full
        out = torch.empty(MiB, device="cuda")
        async with store.hold("x", "device") as held:
            torch.cuda._sleep(SPIN)
            out.copy_(held)
        await store.put("x", pattern(MiB, 2).cuda(), "device")
        await store.put("x", pattern(MiB, 3).cuda(), "device")  # (the event has completed by now, or not)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), pattern(MiB, 1))
        assert torch.equal(await store.read("x"), pattern(MiB, 3))


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
async def test_put_of_data_written_on_a_side_stream(tmp_path: Path, tier: str) -> None:
    """A put takes the bytes the caller's current stream wrote, on whatever stream that is."""
    expected = pattern(MiB, 4)
    data = expected.cuda()
    async with TierStore(_tiers(tmp_path, device="16MiB", host="16MiB")) as store:
        src = torch.zeros(MiB, device="cuda")
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN)
            src.copy_(data)
            await store.put("x", src, tier)
        assert torch.equal(await store.read("x"), expected)


def test_sync_store_put_of_data_written_on_a_side_stream(tmp_path: Path) -> None:
    """The blocking facade runs the store's loop on another thread: the caller's stream must
    still be waited for (its current stream is not the loop thread's)."""
    expected = pattern(MiB, 5)
    data = expected.cuda()
    with SyncTierStore(_tiers(tmp_path, device="16MiB", host="16MiB")) as store:
        for tier in ("device", "host"):
            src = torch.zeros(MiB, device="cuda")
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SPIN)
                src.copy_(data)
                store.put(f"x/{tier}", src, tier)
            assert torch.equal(store.read(f"x/{tier}"), expected), tier
            assert torch.equal(store.get(f"x/{tier}").cpu(), expected), tier


# -- the optimizer on CUDA ---------------------------------------------------------------------


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., SyncTierStore]]:
    """``open_store(device=..., host=...)``: an open blocking store over CUDA, host and disk
    tiers, closed after the test even when it fails."""
    stores: list[SyncTierStore] = []

    def make(**capacities: int | str) -> SyncTierStore:
        stores.append(SyncTierStore(_tiers(tmp_path, **capacities)).open())
        return stores[-1]

    yield make
    for store in stores:
        store.close()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """A small residual MLP: no embeddings (their CUDA backward accumulates in any order), so
    two runs on the same inputs give the same gradients bit for bit."""

    def __init__(self, dim: int = 64, depth: int = 3, inputs: int = 32, outputs: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(seed: int, batch: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(batch, 32, generator=generator)
        y = torch.randn(batch, 16, generator=generator)
        yield x.cuda(), y.cuda()


def reference_of(model: nn.Module) -> list[nn.Parameter]:
    """fp32 CPU copies of the model's weights, stepped by torch's CPU AdamW as the reference."""
    return [nn.Parameter(p.detach().float().cpu().clone()) for p in model.parameters()]


def take_grads(model: nn.Module, reference: list[nn.Parameter]) -> None:
    for p, r in zip(model.parameters(), reference, strict=True):
        r.grad = None if p.grad is None else p.grad.detach().float().cpu().clone()


def assert_same_weights(model: nn.Module, reference: list[nn.Parameter], step: int) -> None:
    for (name, p), r in zip(model.named_parameters(), reference, strict=True):
        assert same_bytes(p.detach().cpu(), r.detach()), f"step {step}: {name} differs"


@pytest.mark.parametrize("clipping", ["user clip_grad_norm_", "max_grad_norm"])
def test_tiered_adamw_on_cuda_matches_torch_fused_bit_for_bit(open_store: Callable[..., SyncTierStore], clipping: str) -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    reference = reference_of(model)
    expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
    store = open_store(device="1MiB", host="4MiB")
    options: dict[str, Any] = {"max_grad_norm": 0.5} if clipping == "max_grad_norm" else {}
    opt = TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True, store=store, **options)
    data = batches(seed=1)
    for step in range(8):
        opt.zero_grad()
        for _ in range(2):  # two backward passes per step, no accumulation hint given
            x, y = next(data)
            F.mse_loss(model(x), y).backward()
        if clipping == "user clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # after the hooks fired
            take_grads(model, reference)
        else:
            take_grads(model, reference)
            torch.nn.utils.clip_grad_norm_(reference, 0.5)
        opt.step()
        expected.step()
        assert_same_weights(model, reference, step)
    opt.close()


def test_tiered_adamw_on_cuda_with_grad_scaler_fp16(open_store: Callable[..., SyncTierStore]) -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    reference = reference_of(model)
    expected = torch.optim.AdamW(reference, lr=1e-3, fused=True)
    store = open_store(device="1MiB", host="4MiB")
    opt = TieredAdamW(model.parameters(), lr=1e-3, fused=True, store=store)
    scaler = torch.amp.GradScaler("cuda")
    data = batches(seed=2)
    skipped = taken = 0
    for step in range(10):
        opt.zero_grad()
        for micro in range(2):
            x, y = next(data)
            if step in (3, 7) and micro == 1:
                x[0, 0] = float("inf")  # non-finite gradients: GradScaler skips this step
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)  # in place, after the hooks fired
        take_grads(model, reference)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:  # found an inf: the step was skipped
            skipped += 1
        else:
            taken += 1
            expected.step()
        assert_same_weights(model, reference, step)
    assert skipped >= 2 and taken >= 6, (skipped, taken)  # steps 3 and 7 at least were skipped
    opt.close()


# -- swapping over a CUDA device tier ----------------------------------------------------------


def _grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters() if p.grad is not None]


def _assert_same_grads(ours: list[tuple[str, torch.Tensor]], theirs: list[tuple[str, torch.Tensor]], step: int) -> None:
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (name, a), (_, b) in zip(ours, theirs, strict=True):
        assert a.device.type == "cuda" and same_bytes(a, b), f"step {step}: gradient of {name} differs"


def test_activation_offload_on_cuda_gives_the_same_gradients(open_store: Callable[..., SyncTierStore]) -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    twin = copy.deepcopy(model)
    store = open_store(device="2MiB", host="32MiB")
    acts = offload_activations(store, min_bytes=4096)
    data = batches(seed=3)
    for step in range(3):  # the first step prefetches in reverse save order, later ones learned
        x, y = next(data)
        with acts:
            loss = F.mse_loss(model(x), y)
        loss.backward()
        F.mse_loss(twin(x), y).backward()
        _assert_same_grads(_grads(model), _grads(twin), step)
        model.zero_grad()
        twin.zero_grad()
    assert acts.report.offloaded > 0
    assert len(store) == 0  # every saved tensor came back and left the store


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_parameter_offload_on_cuda_gives_the_same_gradients_and_weights(open_store: Callable[..., SyncTierStore], tier: str) -> None:
    """Offloaded weights give the gradients of resident ones, and TieredAdamW's updates written
    into the store are those of torch's CPU AdamW (same kernel) on the same gradients."""
    torch.manual_seed(0)
    model = Net().cuda()
    twin = copy.deepcopy(model)
    reference = reference_of(twin)
    expected = torch.optim.AdamW(reference, lr=1e-2, fused=True)
    weights = sum(p.nbytes for p in model.parameters())
    store = open_store(device=weights // 3, host="32MiB")
    params = offload_parameters(model, store, tier=tier)
    opt = TieredAdamW(model.parameters(), lr=1e-2, fused=True, store=store, min_offload_numel=64)
    data = batches(seed=4)
    for step in range(4):
        x, y = next(data)
        opt.zero_grad()
        twin.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        reference_loss = F.mse_loss(twin(x), y)
        reference_loss.backward()
        assert loss.item() == reference_loss.item(), step
        _assert_same_grads(_grads(model), _grads(twin), step)
        opt.step()
        params.mark_step()
        take_grads(twin, reference)
        expected.step()
        with torch.no_grad():
            for p, r in zip(twin.parameters(), reference, strict=True):
                p.copy_(r)  # the twin computes the next step with the reference's weights
    params.detach()
    for (name, ours), theirs in zip(model.named_parameters(), reference, strict=True):
        assert ours.device.type == "cuda" and same_bytes(ours.detach(), theirs.detach()), name
    opt.close()
