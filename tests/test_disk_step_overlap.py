"""Early write-back (``TierStore.write_back``): a value written to the disk ahead of its eviction
stays on its memory tier, and the eviction that later chooses it writes nothing; the disk-paged
optimizer step writes back what it will evict as soon as its update ends, exact against torch."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstore import DiskTier, HostTier, TierStore
from tierstore.errors import UnknownTierError
from tierstore.optim import TieredAdamW
from tierstore.sync import run
from tierstore.testing import check_consistency, settle

pytestmark = pytest.mark.device_modes  # tests taking ``device_mode`` run in both modes

NUMEL = 64 << 10  # 256 KiB of fp32


def _written(store: TierStore) -> int:
    return sum(link.nbytes for name, link in store.counters.links.items() if name.endswith("->disk"))


def _store(tmp_path: Path) -> TierStore:
    return TierStore([HostTier("1MiB"), DiskTier(tmp_path / "disk", "64MiB")])


async def test_write_back_keeps_the_copy_and_its_eviction_writes_nothing(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        value = torch.arange(NUMEL, dtype=torch.float32)
        await store.put("a", value, tier="host")
        assert store.where("a") == ["host"]
        assert store.write_back(["a", "missing"], "host") == 1
        await settle(store)
        assert store.where("a") == ["host", "disk"]
        assert store.write_back(["a"], "host") == 0  # already on the disk: nothing to write
        written = _written(store)
        for i in range(4):  # a is the oldest: evicted first, as a clean copy
            await store.put(f"b{i}", torch.full((NUMEL,), float(i)), tier="host")
        await settle(store)
        assert store.where("a") == ["disk"]
        others = sum(store.where(f"b{i}") == ["disk"] for i in range(4))
        assert _written(store) - written == others * NUMEL * 4  # nothing more for a
        assert torch.equal(await store.get("a"), value)
        check_consistency(store)


async def test_an_eviction_during_the_early_write_waits_for_it_and_writes_once(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        value = torch.arange(NUMEL, dtype=torch.float32)
        await store.put("a", value, tier="host")
        written = _written(store)
        assert store.write_back(["a"], "host") == 1
        for i in range(4):  # at once: a is chosen while its write may still run
            await store.put(f"b{i}", torch.full((NUMEL,), float(i)), tier="host")
        await settle(store)
        assert store.where("a") == ["disk"]
        others = sum(store.where(f"b{i}") == ["disk"] for i in range(4))
        assert _written(store) - written == (1 + others) * NUMEL * 4
        assert torch.equal(await store.get("a"), value)
        check_consistency(store)


async def test_a_write_hold_after_the_write_back_makes_the_disk_copy_stale(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        value = torch.arange(NUMEL, dtype=torch.float32)
        await store.put("a", value, tier="host")
        store.write_back(["a"], "host")
        async with store.hold("a", "host", write=True) as held:  # waits for the write
            held.add_(1)
        assert store.where("a") == ["host"]
        for i in range(4):
            await store.put(f"b{i}", torch.full((NUMEL,), float(i)), tier="host")
        await settle(store)
        assert torch.equal(await store.get("a"), value + 1)
        check_consistency(store)


async def test_write_back_refuses_a_tier_the_store_lacks(tmp_path: Path) -> None:
    async with _store(tmp_path) as store:
        with pytest.raises(UnknownTierError):
            store.write_back(["a"], "device")


def test_disk_paged_step_writes_back_early_exact_and_once(tmp_path: Path, device_mode: str) -> None:
    """Half the state on disk, the demo's policies: each steady step's early write-backs cover
    what it evicts (no eviction writes on the step's path), nothing is written twice, and the
    parameters equal torch's AdamW bit for bit."""
    from policies import MIN, ScheduleLearned

    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(12)))
    paged = copy.deepcopy(reference)
    state_bytes = 8 * sum(p.numel() for p in paged.parameters())  # two moments; the parameter is the master
    schedule = ScheduleLearned()
    store = TierStore([HostTier(state_bytes // 2 + (64 << 10)), DiskTier(tmp_path / "disk", "64MiB", durable=False)],
                      eviction=lambda: MIN(schedule), prefetch=schedule, trace=tmp_path / "trace.npz")
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    opt = TieredAdamW(paged.parameters(), lr=1e-2, fused=True, store=store, min_offload_numel=0)
    steps, moved = 8, []
    try:
        for step in range(steps):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            before = (_written(store), sum(link.nbytes for name, link in store.counters.links.items() if name.startswith("disk->")))
            for model, optimizer in ((reference, expected), (paged, opt)):
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            after = (_written(store), sum(link.nbytes for name, link in store.counters.links.items() if name.startswith("disk->")))
            moved.append((after[0] - before[0], after[1] - before[1]))
        for got, want in zip(paged.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got, want)
    finally:
        opt.close()
        run(store.aclose(flush=False))  # (writes the trace)
    steady = moved[3:]
    assert all(read > 0 for _, read in steady)  # state pages every step
    assert sum(w for w, _ in steady) <= 1.1 * sum(r for _, r in steady)  # nothing written twice
    trace = np.load(tmp_path / "trace.npz")
    ops = [str(op) for op in trace["ops"]]
    rows = trace["op"][trace["step"] >= 3]
    assert (rows == ops.index("writeback")).sum() > 0  # the early write-backs ran
