"""The memory plan's disk need includes the room of copies-on-write: a value written down again
keeps its old extent until the new one is committed. A tryout sized the disk tier as the plan
said (2 MiB for 2 MiB of state): the constructor took it, the second step failed with the disk
full on every retry, and ``state_dict()`` failed too (it made room on the host tier, whose
eviction had nowhere to write), so the state could not even be saved. Now a disk tier of exactly
the plan's need trains, saves and closes; a page less is refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore.optim import OptimizerCapacityError, TieredAdamW

pytestmark = pytest.mark.device_modes

CASES = {
    "chunked": dict(shapes=[(512, 512), (1000,)], host="1MiB", kwargs={}),
    "many": dict(shapes=[(300, 301)] * 4 + [(7,)] * 3, host="1MiB", kwargs={}),
    "8bit": dict(shapes=[(512, 512), (1000,)], host="512KiB", kwargs={"state_precision": "8bit"}),
}


def _params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]


def _make(root: Path, case: dict, disk: int | str) -> tuple[list[torch.nn.Parameter], TieredAdamW]:
    params = _params(case["shapes"])
    opt = TieredAdamW(params, lr=1e-3, offload="disk", disk_root=root, host_capacity=case["host"], disk_capacity=disk, **case["kwargs"])
    return params, opt


@pytest.mark.parametrize("name", CASES)
def test_a_disk_tier_of_the_planned_need_trains_saves_and_closes(tmp_path: Path, device_mode: str, name: str) -> None:
    case = CASES[name]
    _, probe = _make(tmp_path / "probe", case, "1GiB")
    need = probe.memory_plan().tier_need["disk"]
    probe.close()
    params, opt = _make(tmp_path / "exact", case, need)
    try:
        for step in range(4):
            for p in params:
                p.grad = torch.randn_like(p) * (step + 1)
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        assert all(saved["state"][i]["step"] == 4 for i in range(len(params)))
    finally:
        opt.close()
    with pytest.raises(OptimizerCapacityError, match="'disk' tier needs"):
        _make(tmp_path / "short", case, need - 4096)


def test_state_dict_reads_the_state_when_the_disk_is_full(tmp_path: Path, device_mode: str) -> None:
    """``state_dict()`` read the state of a chunked parameter by holding each chunk on the host
    tier, whose room came from evicting dirty values to the disk: with the disk full (the
    user's own values filled a shared store) it failed, and the state could not be saved. It
    now reads each chunk where it lies, moving nothing."""
    from tierstore import DiskTier, HostTier, SyncTierStore
    from tierstore.errors import TierFullError

    params = _params([(512, 512), (1000,)])
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW(twin, lr=1e-3)
    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "shared", "8MiB", durable=False)]) as store:
        opt = TieredAdamW(params, lr=1e-3, store=store, chunk_bytes="128KiB")
        try:
            for _ in range(2):
                for p, t in zip(params, twin, strict=True):
                    p.grad = torch.randn_like(p)
                    t.grad = p.grad.clone()
                opt.step()
                reference.step()
            filled = 0
            while True:  # the user's own values fill the disk (in pieces: its free space is not one extent)
                try:
                    store.put(f"mine/{filled}", torch.zeros(16 << 10), tier="disk")
                except TierFullError:
                    break
                filled += 1
            assert filled
            saved = opt.state_dict()
        finally:
            opt.close()
    expected = reference.state_dict()
    for i in range(len(params)):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][i][name], expected["state"][i][name]), (i, name)


def _train_then_flush(store_of: object, make_params: object, steps: int = 4, **kwargs: object) -> None:
    """Plan on a store with a 1 GiB disk, then train on one whose disk is the plan's need and
    flush everything at once (the copies-on-write of all the memory tiers hold)."""
    from tierstore import SyncTierStore

    probe_params = make_params()  # type: ignore[operator]
    probe: SyncTierStore = store_of("probe", "1GiB")  # type: ignore[operator]
    opt = TieredAdamW(probe_params, lr=1e-3, store=probe, **kwargs)
    need = opt.memory_plan().tier_need["disk"]
    opt.close()
    probe.close()
    params = make_params()  # type: ignore[operator]
    store: SyncTierStore = store_of("exact", need)  # type: ignore[operator]
    opt = TieredAdamW(params, lr=1e-3, store=store, **kwargs)
    try:
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        store.flush()
    finally:
        opt.close()
        store.close()


def test_the_need_covers_a_flush_of_many_small_values_in_whole_blocks(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: values of a few KiB take up to twice their size in disk blocks, and the host
    holds many of them: counting the largest values first undercounted a flush's room."""
    from tierstore import DiskTier, HostTier, SyncTierStore

    def store_of(name: str, disk: int | str) -> SyncTierStore:
        return SyncTierStore([HostTier("256KiB"), DiskTier(tmp_path / name, disk, durable=False)])

    def make_params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(270)) for _ in range(150)] + [torch.nn.Parameter(torch.randn(16384))]

    _train_then_flush(store_of, make_params, min_offload_numel=1)


def test_the_need_covers_every_memory_tier_above_the_disk(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: state on a device tier above the host tier; a flush writes the dirty values
    of both, and only the host tier's were counted."""
    from tierstore import DeviceTier, DiskTier, HostTier, SyncTierStore

    def store_of(name: str, disk: int | str) -> SyncTierStore:
        return SyncTierStore([DeviceTier("cpu", "1536KiB", emulate_device=True), HostTier("1536KiB"),
                              DiskTier(tmp_path / name, disk, durable=False)])

    def make_params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(300, 301)) for _ in range(8)]

    _train_then_flush(store_of, make_params, state_tier="device")


def test_a_store_without_a_disk_needs_no_room_for_copies_on_write(device_mode: str) -> None:
    """A reviewer: with state on a device tier over a host tier (no disk), the host's need got a
    disk's copy-on-write room, refusing a store that trains and saves."""
    from tierstore import DeviceTier, HostTier, SyncTierStore

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 301)) for _ in range(4)]
    # (the optimizer crosses the emulated device tier's link, in either mode: its state keeps an fp32 master row)
    with SyncTierStore([DeviceTier("cpu", "1MiB", emulate_device=True), HostTier("4400KiB")]) as store:
        opt = TieredAdamW(params, lr=1e-3, store=store, state_tier="device")
        try:
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn_like(p)
                opt.step()
            assert opt.state_dict()["state"][0]["step"] == 3
        finally:
            opt.close()
