"""Verbs on one key racing each other from many tasks, as a new user found: a get whose key was
deleted or popped meanwhile said the store was corrupt, and a put onto a tier whose only value
was being popped was refused though the pop was about to give the room back."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch

from tierstore import DeviceTier, DiskTier, HostTier, KeyNotFoundError, TierStore, TierStoreError


async def _race(store: TierStore, verbs: list[str], rounds: int, seed: int) -> list[str]:
    """``rounds`` rounds of six verbs at once on two keys; the errors other than a missing key."""
    rng = random.Random(seed)
    errors: list[str] = []
    for i in range(rounds):
        calls = []
        for _ in range(6):
            key, verb = rng.choice("ab"), rng.choice(verbs)
            if verb == "put":
                value = torch.full((rng.choice([40_000, 5_000]),), i, dtype=torch.int32)
                calls.append(store.put(key, value, rng.choice(["device", None, "host", "disk"])))
            elif verb == "get":
                calls.append(store.get(key, "device"))
            else:
                calls.append(getattr(store, verb)(key))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, TierStoreError) and not isinstance(outcome, KeyNotFoundError):
                errors.append(f"{type(outcome).__name__}: {outcome}")
            elif isinstance(outcome, BaseException) and not isinstance(outcome, KeyNotFoundError):
                raise outcome
    return errors


async def _workers(store: TierStore, verbs: list[str], seed: int) -> list[str]:
    """32 tasks doing 100 verbs each on three keys; the errors other than a missing key."""
    rng = random.Random(seed)
    errors: list[str] = []

    async def worker() -> None:
        for i in range(100):
            key, verb, size = f"k{rng.randrange(3)}", rng.choice(verbs), rng.choice([1, 100, 5000, 40_000])
            try:
                if verb == "put":
                    await store.put(key, torch.full((size,), i, dtype=torch.int32), rng.choice([None, "device", "host", "disk"]))
                else:
                    await getattr(store, verb)(key)
            except KeyNotFoundError:
                pass
            except TierStoreError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

    await asyncio.gather(*(worker() for _ in range(32)))
    return errors


async def test_gets_racing_deletes_and_pops_never_report_corruption(tmp_path: Path) -> None:
    async with TierStore([DeviceTier("cpu", "256KiB"), HostTier("512KiB"), DiskTier(tmp_path / "d", "8MiB")]) as store:
        errors = [*await _workers(store, ["put", "get", "pop"], 1), *await _workers(store, ["put", "get", "delete"], 2)]
        await store.put("k0", torch.ones(3))  # (still usable)
        assert torch.equal(await store.get("k0"), torch.ones(3))
    assert not [error for error in errors if error.startswith("CorruptionError")], errors[:3]


async def test_a_put_racing_a_pop_of_the_tiers_only_value_waits_for_its_room(tmp_path: Path) -> None:
    # (156 KiB values: the 256 KiB device tier holds one)
    async with TierStore([DeviceTier("cpu", "256KiB"), HostTier("2MiB"), DiskTier(tmp_path / "d", "8MiB")]) as store:
        errors = await _race(store, ["put", "pop"], 300, 0)
    assert errors == []
