"""The fast paths of small values (issue 15, rates): a non-durable put queued for the next
catalog transaction with no await, a get of an inline value with no await, and the sync
facade's small get as one plain call on the loop thread. Each must behave as the full verb
does: visible at once, failures reported, nothing lost, every tensor kind taken as it is."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import SyncTierStore, TierStore
from tierstore.errors import (
    DiskFullError,
    EntryHeldError,
    InvalidKeyError,
    InvalidTensorError,
    KeyNotFoundError,
)
from tierstore.tiers import DiskTier, HostTier


def disk(root: Path, durable: bool = False) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=durable)




def kinds() -> dict[str, torch.Tensor]:
    """Small tensors of every shape of input the fast paths see or turn away."""
    complex_value = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    return {
        "u8": torch.arange(7, dtype=torch.uint8),
        "f32 2-d": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "0-d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "complex": complex_value,
        "conj view": complex_value.conj(),
        "neg view": complex_value.conj().imag,
        "strided": torch.arange(20.0)[::3],
        "parameter": torch.nn.Parameter(torch.ones(4)),
    }


async def test_a_small_put_is_read_before_its_commit_and_its_commit_follows(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        await store.put("k", torch.tensor([1.0, 2.0]))
        assert tier.queued_changes == 1  # type: ignore[attr-defined]  # acknowledged, not committed
        assert "k" not in tier.committed()  # type: ignore[attr-defined]
        assert torch.equal(await store.get("k"), torch.tensor([1.0, 2.0]))
        await store.put("k", torch.tensor([3.0]))  # replaced before the first one committed
        assert torch.equal(await store.get("k"), torch.tensor([3.0]))
        await store.flush()
        assert tier.queued_changes == 0  # type: ignore[attr-defined]
        assert torch.equal(await store.get("k"), torch.tensor([3.0]))
        await store.delete("k")
        with pytest.raises(KeyNotFoundError):
            await store.get("k")


@pytest.mark.parametrize("facade", ["async", "sync"])
def test_every_kind_of_tensor_reads_back_as_it_was_put(tmp_path: Path, facade: str) -> None:
    expected = {name: value.detach().resolve_conj().resolve_neg().clone() for name, value in kinds().items()}

    def check(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
        assert not got.requires_grad and got.is_contiguous(), name

    if facade == "sync":
        with SyncTierStore([disk(tmp_path / "d")]) as sync_store:
            for name, value in kinds().items():
                sync_store.put(name, value)
            for name, want in expected.items():
                check(sync_store.get(name), want, name)
    else:

        async def run() -> None:
            async with TierStore([disk(tmp_path / "d")]) as store:
                for name, value in kinds().items():
                    await store.put(name, value)
                for name, want in expected.items():
                    check(await store.get(name), want, name)

        asyncio.run(run())
    with SyncTierStore([disk(tmp_path / "d")]) as reopened:  # and they were committed on close
        for name, want in expected.items():
            check(reopened.get(name), want, name)


@pytest.mark.parametrize("facade", ["async", "sync"])
def test_bad_input_to_the_fast_paths_gets_the_full_verbs_errors(tmp_path: Path, facade: str) -> None:
    with SyncTierStore([HostTier("1MiB"), disk(tmp_path / "d")]) as store:
        call = store.run if facade == "async" else None

        def put(key: Any, value: Any, tier: str = "disk") -> None:
            store.put(key, value, tier) if call is None else call(store.store.put(key, value, tier))

        def get(key: Any, tier: str = "disk") -> torch.Tensor:
            return store.get(key, tier) if call is None else call(store.store.get(key, tier))

        with pytest.raises(InvalidKeyError):
            put("__tierstore__/x", torch.ones(2))  # a reserved key
        with pytest.raises(InvalidKeyError):
            put(3, torch.ones(2))
        with pytest.raises(InvalidTensorError):
            put("k", [1.0, 2.0])
        with pytest.raises(InvalidKeyError):
            get("__tierstore__/x")
        with pytest.raises(KeyNotFoundError):
            get("absent")
        put("k", torch.ones(2), tier="host")
        with store.hold("k", "host", write=True):  # from inside the caller's own write hold
            for tier in ("host", "disk"):
                with pytest.raises(EntryHeldError):
                    get("k", tier)
        assert torch.equal(get("k", "host"), torch.ones(2))
        assert torch.equal(get("k"), torch.ones(2))


async def test_a_failed_background_commit_fails_the_next_put_and_loses_nothing(tmp_path: Path, full_for: set[str]) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        full_for.add("k")
        await store.put("k", torch.tensor([1.0]))  # acknowledged; its transaction will fail
        for _ in range(500):
            if tier.commit_failed:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        assert tier.commit_failed  # type: ignore[attr-defined]
        for _ in range(2):  # every later call says so, until it commits
            with pytest.raises(DiskFullError):
                await store.put("j", torch.tensor([2.0]))
        assert "j" not in store  # the put that said it failed did nothing
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))  # what was acknowledged stays
        with pytest.raises(DiskFullError):
            await store.flush()
        full_for.clear()
        await store.put("j", torch.tensor([2.0]))  # tries the failed change again first
        assert not tier.commit_failed  # type: ignore[attr-defined]
        assert "k" in tier.committed()  # type: ignore[attr-defined]
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert torch.equal(await store.get("k"), torch.tensor([1.0]))
        assert torch.equal(await store.get("j"), torch.tensor([2.0]))


@pytest.mark.parametrize("facade", ["async", "sync"])
def test_close_commits_every_small_put_acknowledged_before_its_commit(tmp_path: Path, facade: str) -> None:
    count = 2000
    if facade == "sync":
        with SyncTierStore([disk(tmp_path / "d")], flush_on_close=False) as sync_store:
            for i in range(count):
                sync_store.put(f"k{i}", torch.tensor([float(i)]))
    else:

        async def run() -> None:
            store = await TierStore([disk(tmp_path / "d")], flush_on_close=False).open()
            for i in range(count):
                await store.put(f"k{i}", torch.tensor([float(i)]))
            assert store.tier("disk").queued_changes > 0  # type: ignore[attr-defined]
            await store.aclose()

        asyncio.run(run())
    with SyncTierStore([disk(tmp_path / "d")]) as reopened:
        assert len(reopened) == count
        assert all(reopened.get(f"k{i}").item() == float(i) for i in range(0, count, 97))


def test_sync_gets_of_small_values_are_counted_and_see_every_change(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("1MiB"), disk(tmp_path / "d")]) as store:
        store.put("k", torch.tensor([1.0]), tier="disk")
        before = store.stats()["tiers"]["disk"]["hits"]
        for _ in range(5):
            assert torch.equal(store.get("k", tier="disk"), torch.tensor([1.0]))
        assert store.stats()["tiers"]["disk"]["hits"] == before + 5
        store.put("k", torch.tensor([2.0]), tier="disk")
        assert torch.equal(store.get("k", tier="disk"), torch.tensor([2.0]))
        store.put("k", torch.tensor([3.0]), tier="disk", durable=True)
        assert torch.equal(store.get("k", tier="disk"), torch.tensor([3.0]))
        store.put("k", torch.tensor([4.0]))  # onto the host tier: the disk copy is old now
        assert torch.equal(store.get("k", tier="disk"), torch.tensor([4.0]))
        store.delete("k")
        with pytest.raises(KeyNotFoundError):
            store.get("k", tier="disk")


def test_sync_gets_beside_a_writer_thread_read_whole_values_only(tmp_path: Path) -> None:
    """Sync gets of small values from one thread while another thread overwrites them:
    each read is one value that was put, whole, and never an error."""
    with SyncTierStore([disk(tmp_path / "d")]) as store:
        keys = [f"k{i}" for i in range(8)]
        for key in keys:
            store.put(key, torch.zeros(64))
        stop = time.monotonic() + 1.5
        failures: list[BaseException] = []

        def write() -> None:
            i = 0
            try:
                while time.monotonic() < stop:
                    i += 1
                    store.put(keys[i % len(keys)], torch.full((64,), float(i)), durable=i % 5 == 0)
                    if i % 7 == 0:
                        store.flush()
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        reads = 0
        while time.monotonic() < stop:
            value = store.get(keys[reads % len(keys)])
            assert value.shape == (64,) and bool((value == value[0]).all()), value
            reads += 1
        writer.join()
        assert not failures and reads > 0
