"""The resident step (``tierstore.optim.resident``): with every state entry resident on the host
tier and the gradients lent (plain CPU), one update of all parameters at once, bit for bit with
torch's fused AdamW; anything else (state on disk, an entry held by someone else, a device link)
takes the pipeline, with the same numbers."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    # 20,000 weights: chunked in 64 KiB chunks (3 pieces); 100 biases: too small to page
    model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Tanh(), torch.nn.Linear(100, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Tanh(), torch.nn.Linear(100, 8))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _groups(model: torch.nn.Module, **extra: object) -> list[dict[str, object]]:
    first, _, last = model
    return [
        {"params": list(first.parameters()), "lr": 3e-3, "weight_decay": 0.1, **extra},
        {"params": list(last.parameters()), "lr": 1e-2, "weight_decay": 0.0, "amsgrad": True},
    ]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(16, 200, generator=generator)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _resident_steps(opt: TieredAdamW) -> bool:
    return any(name.startswith("resident update") for name, *_ in opt.last_timeline())


def _assert_same(reference: torch.nn.Module, exact: torch.optim.Optimizer, model: torch.nn.Module, opt: TieredAdamW) -> None:
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
        theirs, ours = exact.state[p], opt.state[q]
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if name in theirs:
                assert torch.equal(theirs[name], ours[name]), name
        assert float(theirs["step"]) == float(ours["step"])


def test_resident_step_is_bit_for_bit_with_fused_adamw(device_mode: str) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(_groups(reference), fused=True)
    opt = TieredAdamW(_groups(model), offload="host", chunk_bytes="64KiB", min_offload_numel=1000)
    try:
        assert opt._slots[0].chunks is not None and len(opt._slots[0].chunks) > 1  # (the case under test)
        used = []
        for seed in range(5):
            _step(reference, exact, seed)
            _step(model, opt, seed)
            used.append(_resident_steps(opt))
        # the first step creates the state (the pipeline); then every step runs at once where
        # the gradients are lent, and never across a device link
        assert used == ([False] + [True] * 4 if device_mode == "plain" else [False] * 5)
        _assert_same(reference, exact, model, opt)
    finally:
        opt.close()


def test_clipping_in_the_resident_step(device_mode: str) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    opt = TieredAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05, min_offload_numel=1000)
    try:
        for seed in range(4):
            generator = torch.Generator().manual_seed(seed)
            reference(torch.randn(16, 200, generator=generator)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            exact.step()
            exact.zero_grad()
            _step(model, opt, seed)
        assert _resident_steps(opt) == (device_mode == "plain")
        _assert_same(reference, exact, model, opt)
    finally:
        opt.close()


def test_state_on_disk_takes_the_pipeline(tmp_path: Path, device_mode: str) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
    store = SyncTierStore([HostTier("64KiB"), DiskTier(tmp_path / "store", "16MiB")]).open()
    opt = TieredAdamW(model.parameters(), lr=3e-3, store=store, chunk_bytes="16KiB", min_offload_numel=1000)
    try:
        for seed in range(4):
            _step(reference, exact, seed)
            _step(model, opt, seed)
            assert not _resident_steps(opt)  # (the state does not fit: some of it is on disk)
        assert any("host" not in opt.store.where(key) for key in opt.namespace.keys())
        _assert_same(reference, exact, model, opt)
    finally:
        opt.close()
        store.close()


def test_entry_held_elsewhere_takes_the_pipeline(device_mode: str) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
    opt = TieredAdamW(model.parameters(), lr=3e-3, min_offload_numel=1000)
    try:
        _step(reference, exact, 0)
        _step(model, opt, 0)
        key = next(k for k in opt.namespace.keys() if not k.endswith("/grad"))
        held, release = threading.Event(), asyncio.Event()

        async def reader() -> None:
            async with opt.store.hold(key, "host"):
                held.set()
                await release.wait()

        loop = opt.store.loop
        assert loop is not None
        holding = asyncio.run_coroutine_threadsafe(reader(), loop)
        assert held.wait(10)
        # step() waits for the reader (a write hold is exclusive): release it from a timer,
        # started when only step() is left (under load, forward and backward took the 0.2 s)
        _step(reference, exact, 1)
        model(torch.randn(16, 200, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        timer = threading.Timer(0.2, lambda: loop.call_soon_threadsafe(release.set))
        timer.start()
        opt.step()
        opt.zero_grad()
        holding.result(10)
        assert not _resident_steps(opt)
        _step(reference, exact, 2)
        _step(model, opt, 2)
        assert _resident_steps(opt) == (device_mode == "plain")  # free again
        _assert_same(reference, exact, model, opt)
    finally:
        opt.close()


def test_resident_writes_reach_the_disk(tmp_path: Path, device_mode: str) -> None:
    # The updates are writes through the store's holds: an entry already flushed to the disk
    # is dirty again after a resident step, so the next flush writes it, and an optimizer
    # reopened on the disk continues from the new values (bit for bit with torch).
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)

    def open_store() -> SyncTierStore:
        return SyncTierStore([HostTier("8MiB"), DiskTier(tmp_path / "store", "16MiB")]).open()

    store = open_store()
    opt = TieredAdamW(model.parameters(), lr=3e-3, store=store, namespace="run", min_offload_numel=1000)
    for seed in range(2):
        _step(reference, exact, seed)
        _step(model, opt, seed)
    store.flush()
    for seed in range(2, 4):
        _step(reference, exact, seed)
        _step(model, opt, seed)
        assert _resident_steps(opt) == (device_mode == "plain")
    keys = [k for k in opt.namespace.keys() if not k.endswith("/grad")]
    assert keys and not any(opt.store.info(k)["held"] for k in keys)
    opt.close()
    store.flush()
    store.close()
    store = open_store()
    opt = TieredAdamW(model.parameters(), lr=3e-3, store=store, namespace="run", min_offload_numel=1000)
    try:
        for seed in range(4, 6):
            _step(reference, exact, seed)
            _step(model, opt, seed)
        _assert_same(reference, exact, model, opt)
    finally:
        opt.close()
        store.close()
