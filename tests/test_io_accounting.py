"""Disk bytes per optimizer step, checked against the kernel's block-I/O counters of this process
(``/proc/self/io``): what ``time_report()`` counts is what reached the disk, what it says was
needed (``disk_need_bytes``: twice the paged state not resident at the step's start) bounds it,
frozen and unused parameters' state moves no byte, and with everything in the host tier nothing
moves at all.

The counters see block I/O only where the page cache is bypassed: the tests run where the disk
tier uses O_DIRECT (not on tmpfs) and skip elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierstore.optim import TieredAdamW
from tierstore.testing import block_io

pytestmark = pytest.mark.device_modes  # tests taking ``device_mode`` run in both modes

WIDTH, LAYERS = 128, 8  # 132k parameters: 1.6 MB of Adam state, paged through a 256 KiB host tier
HOST = 256 << 10
SLACK = 64 << 10  # catalog pages and the like, beside megabytes of state
#: What the kernel may count beside the state for each catalog transaction: the catalog is LMDB,
#: written through the page cache, so its pages reach the counters when the kernel writes them
#: back (a leaf, a branch, the meta page: measured 2-3 KiB a transaction on average, in bursts).
PER_TRANSACTION = 4 << 10


def _model(layers: int = LAYERS) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _optimizer(model: torch.nn.Module, root: Path, host: int = HOST, params: object = None) -> TieredAdamW:
    opt = TieredAdamW(params if params is not None else model.parameters(), lr=1e-3, offload="disk", disk_root=root, host_capacity=host)
    if not opt.store.tier("disk").direct_io:  # type: ignore[attr-defined]
        opt.close()
        pytest.skip(f"the disk tier cannot use O_DIRECT under {root} (tmpfs?): the kernel's counters would not see its I/O")
    return opt


def _steps(model: torch.nn.Sequential, opt: TieredAdamW, count: int, use: int | None = None) -> Iterator[tuple[int, int]]:
    """Run ``count`` steps (through the first ``use`` layers only, if given); yield each step's
    kernel (read, write) bytes."""
    x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(1))
    layers = model if use is None else model[:use]
    for _ in range(count):
        read, write = block_io()
        layers(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after = block_io()
        yield after[0] - read, after[1] - write


def test_report_matches_the_kernel_and_the_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    model = _model()
    opt = _optimizer(model, tmp_path / "disk")
    disk = opt.store.tier("disk")
    try:
        transactions = disk.transactions  # type: ignore[attr-defined]
        first = next(_steps(model, opt, 1))
        report = opt.time_report()
        # The first step creates the state: what does not fit in the host tier is written once
        # (each parameter's record committed on its own: the catalog's pages ride along).
        slack = SLACK + PER_TRANSACTION * (disk.transactions - transactions)  # type: ignore[attr-defined]
        assert report.disk_read_bytes == 0 and first[0] <= SLACK
        assert report.disk_need_bytes > 0
        assert abs(first[1] - report.disk_write_bytes) <= slack
        assert report.disk_write_bytes <= 1.1 * report.disk_need_bytes
        list(_steps(model, opt, 1))  # (the schedule is learned from the first step)
        per_param = opt.memory_report().state_bytes_per_param  # (8 where the parameter is the master)
        moved = needed = reported = 0
        for read, write in _steps(model, opt, 4):
            report = opt.time_report()
            assert abs(read - report.disk_read_bytes) <= SLACK and abs(write - report.disk_write_bytes) <= SLACK
            assert report.disk_need_bytes >= 2 * (per_param * sum(p.numel() for p in model.parameters()) - HOST) * 0.9
            moved += read + write
            needed += report.disk_need_bytes
            reported += report.disk_read_bytes + report.disk_write_bytes
        assert report.io_overhead == pytest.approx((report.disk_read_bytes + report.disk_write_bytes) / report.disk_need_bytes)
        # Nothing is moved more than a third beyond the need (the goal, 1.1x, is the next test).
        assert moved <= 1.35 * needed, f"{moved:,} bytes moved for {needed:,} needed"
        assert abs(moved - reported) <= 4 * SLACK
    finally:
        opt.close()


def test_io_within_a_tenth_of_the_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    """The update order alternates each step (the state resident at a step's start is updated
    first) and the learned schedule follows the two-step pattern: no state is pushed out before
    its update and read again."""
    model = _model()
    opt = _optimizer(model, tmp_path / "disk")
    try:
        list(_steps(model, opt, 3))  # state created, then the two orders the schedule learns
        moved = needed = 0
        for read, write in _steps(model, opt, 4):
            moved += read + write
            needed += opt.time_report().disk_need_bytes
        assert moved <= 1.1 * needed, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
    finally:
        opt.close()


def test_frozen_and_unused_state_moves_no_byte(tmp_path: Path, counters: None, device_mode: str) -> None:
    """Three layers are frozen; of the rest, the last two are used only in the first step.
    The state of the others is all that is read or written."""
    model = _model()
    for layer in model[1:4]:
        layer.requires_grad_(False)
    opt = _optimizer(model, tmp_path / "disk")
    try:
        list(_steps(model, opt, 1))  # every trainable layer gets state
        trained = [p for layer in (model[0], *model[4:6]) for p in layer.parameters()]
        live_state = opt.memory_report().state_bytes_per_param * sum(p.numel() for p in trained)
        # Layers 6 and 7 get no gradient from now on. Their state, written at the first step,
        # may still be in the host tier and goes to the disk once; and the schedule learned
        # from the first step prefetches it once more: the next step learns the new order.
        list(_steps(model, opt, 1, use=6))
        for read, write in _steps(model, opt, 2, use=6):
            report = opt.time_report()
            # Frozen or unused state, if touched, would add 1.2 MB: more than the margin the
            # update order costs today (see test_io_within_a_tenth_of_the_need).
            assert report.disk_need_bytes <= 2 * live_state
            assert read + write <= 1.35 * 2 * live_state + SLACK
            assert report.updates == len(trained)
        for p in (p for layer in model[1:4] for p in layer.parameters()):
            assert opt.state[p] == {}
    finally:
        opt.close()


def test_no_disk_bytes_when_everything_fits(tmp_path: Path, counters: None, device_mode: str) -> None:
    model = _model()
    opt = _optimizer(model, tmp_path / "disk", host=16 << 20)
    try:
        for read, write in _steps(model, opt, 3):
            report = opt.time_report()
            assert report.disk_read_bytes == report.disk_write_bytes == report.disk_need_bytes == 0
            assert read + write <= SLACK
            assert report.io_overhead == 0.0
            assert report.wear().days_to_rated == float("inf")
    finally:
        opt.close()


def test_the_demo_tiers_stay_within_a_tenth_of_the_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    """The README demo's store: a device tier in front of a small host tier and the disk, MIN
    eviction and the learned schedule sharing one schedule, a small GPT with clipping. Across a
    link the gradients cross to the host for their updates only (never as store values pushed
    to the disk), and the alternating order keeps what stays resident useful."""
    from policies import MIN, ScheduleLearned
    from tierstore import TierStore
    from tierstore.models import GPT, GPTConfig, synthetic_batches
    from tierstore.tiers import DeviceTier, DiskTier, HostTier

    config = GPTConfig(vocab=128, seq=16, dim=64, layers=3, heads=4)
    torch.manual_seed(0)
    model = GPT(config)
    state = 12 * sum(p.numel() for p in model.parameters())  # ~2 MB; the host tier holds about half
    schedule = ScheduleLearned()
    store = TierStore(
        [DeviceTier("cpu", 4 << 20), HostTier(state // 2), DiskTier(tmp_path / "disk", 8 * state, durable=False)],
        eviction=lambda: MIN(schedule), prefetch=schedule,
    )
    opt = TieredAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True, store=store, max_grad_norm=1.0)
    try:
        if not store.tier("disk").direct_io:  # type: ignore[attr-defined]
            pytest.skip(f"the disk tier cannot use O_DIRECT under {tmp_path}: the kernel's counters would not see its I/O")
        batches = synthetic_batches(config, 4, seed=1)
        disk = store.tier("disk")
        moved = needed = catalog = 0
        for step in range(9):
            read, write, transactions = *block_io(), disk.transactions  # type: ignore[attr-defined]
            opt.zero_grad()
            model.loss(next(batches)).backward()
            opt.step()
            after = block_io()
            report = opt.time_report()
            if step >= 5:  # state created, then the alternating orders learned
                assert report.disk_need_bytes > 0
                moved += after[0] - read + after[1] - write
                needed += report.disk_need_bytes
                # (the catalog's pages, not state, as in the first test: a full run once counted
                # one 4 KiB page past the bound)
                catalog += PER_TRANSACTION * (disk.transactions - transactions)  # type: ignore[attr-defined]
        assert moved <= 1.1 * needed + catalog, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x; catalog pages {catalog:,})"
    finally:
        opt.close()
        from tierstore.sync import run

        run(store.aclose(flush=False))
