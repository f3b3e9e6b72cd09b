"""No wasted disk I/O in the disk-bound optimizer step (issue 13): a step reads and writes at most
1.1x twice the paged state not resident when it began, counted as ``time_report()`` counts it and
checked against the kernel's block-I/O counters of this process (``/proc/self/io``).

The setting is part g of ``bench_optim`` made small: a few large tensors whose gradients are set
directly (no backward, so no hook gives them an order of arrival), their state paged in chunks
through a host tier of an eighth of it, fp32 and 8-bit moments.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tierstore import TierStore
from tierstore.device import emulation
from tierstore.optim import TieredAdamW
from tierstore.optim.dcp import load_optimizer, save_optimizer
from tierstore.testing import block_io
from tierstore.tiers import DiskTier, HostTier

pytestmark = pytest.mark.device_modes  # tests taking ``device_mode`` run in both modes

TENSORS, PER = 8, 1 << 17  # 1M parameters: 8 MB of fp32 state, 2 MB with 8-bit moments (on the plain CPU the parameter is the master)
SLACK = 256 << 10  # catalog pages and the like, per step, beside megabytes of state
WARMUP = 3  # state created, then the two alternating orders the schedule learns


def _optimizer(root: Path, state_precision: str) -> TieredAdamW:
    from policies import MIN, ScheduleLearned

    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(PER, generator=generator) * 0.02) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn(PER, generator=generator) * 1e-3
    # An eighth of the state as part g counts it (12 bytes a parameter for fp32, though the
    # parameter is the master and 8 are stored; 6 for 8-bit moments and an fp32 master).
    host = TENSORS * PER * (12 if state_precision == "fp32" else 6) // 8
    if emulation()[0]:
        host += 2 * PER * 4  # gradients cross the emulated link and wait in the state's tier
    schedule = ScheduleLearned()
    store = TierStore([HostTier(host), DiskTier(root, 64 << 20, durable=False)], eviction=lambda: MIN(schedule), prefetch=schedule)
    opt = TieredAdamW(params, lr=1e-3, weight_decay=0.1, fused=True, store=store, state_precision=state_precision)
    if not store.tier("disk").direct_io:  # type: ignore[attr-defined]
        opt.close()
        pytest.skip(f"the disk tier cannot use O_DIRECT under {root} (tmpfs?): the kernel's counters would not see its I/O")
    return opt


@pytest.mark.parametrize("state_precision", ["fp32", "8bit"])
def test_disk_bound_step_moves_at_most_a_tenth_beyond_the_need(
    tmp_path: Path, counters: None, device_mode: str, state_precision: str
) -> None:
    """Before: the order of gradients set without backward never alternated (a stable sort,
    reversed, kept it), so the state resident at a step's start was pushed out and read back;
    and chunks prefetched beyond the room left were evicted before their update and read twice."""
    opt = _optimizer(tmp_path / "disk", state_precision)
    try:
        for _ in range(WARMUP):
            opt.step()
        moved = needed = kernel = 0
        for _ in range(4):
            before = block_io()
            opt.step()
            after = block_io()
            report = opt.time_report()
            assert report.disk_need_bytes > 0
            step_moved = report.disk_read_bytes + report.disk_write_bytes
            step_kernel = after[0] - before[0] + after[1] - before[1]
            assert abs(step_kernel - step_moved) <= SLACK + step_moved // 20, (step_kernel, step_moved)
            moved += step_moved
            kernel += step_kernel
            needed += report.disk_need_bytes
        assert moved <= 1.1 * needed, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
        assert kernel <= 1.1 * needed + 4 * SLACK, f"the kernel saw {kernel:,} bytes for {needed:,} needed"
    finally:
        opt.close()



def _paged_to_disk(model: torch.nn.Module, root: Path, host: str) -> TieredAdamW:
    """``TieredAdamW(offload="disk")`` for ``model`` with a ``host`` tier; the test is skipped
    where the disk tier cannot use O_DIRECT (the kernel's counters would not see its I/O)."""
    opt = TieredAdamW(model.parameters(), lr=1e-3, offload="disk", disk_root=root, host_capacity=host)
    if not opt.store.tier("disk").direct_io:  # type: ignore[attr-defined]
        opt.close()
        pytest.skip(f"the disk tier cannot use O_DIRECT under {root} (tmpfs?): the kernel's counters would not see its I/O")
    return opt


def _measured_step(opt: TieredAdamW) -> tuple[int, int, int]:
    """One step: the bytes the report says it moved, those the kernel saw, and its need."""
    before = block_io()
    opt.step()
    after = block_io()
    report = opt.time_report()
    return report.disk_read_bytes + report.disk_write_bytes, after[0] - before[0] + after[1] - before[1], report.disk_need_bytes


@pytest.mark.parametrize("state_precision", ["fp32", "8bit"])
def test_the_first_steps_and_those_after_a_load_move_at_most_a_tenth_beyond_the_need(
    tmp_path: Path, counters: None, device_mode: str, state_precision: str
) -> None:
    """Two defects a tryout found on every start and resume (a 2 MiB host tier, 68 MiB of state):
    - the second step (the first in the reversed order) read 2-4x the state: the learned
      schedule knew one order only, so it prefetched in the wrong one and its evictions threw
      out what came next. It now takes a phase that starts where the schedule ends as that
      schedule reversed, at its first access;
    - the step after ``load_state_dict()`` reported the load's writes as its own (134 MiB
      written where the kernel saw 68 MiB in the step) and half its need (the state did not
      exist when the window began), "3.06x of the need"."""
    opt = _optimizer(tmp_path / "disk", state_precision)
    try:
        opt.step()  # (the state is created)
        moved = needed = 0
        for _ in range(2):
            step_moved, _, need = _measured_step(opt)
            moved, needed = moved + step_moved, needed + need
        # (the steady state's tenth is test_disk_bound_step_moves_at_most_a_tenth_beyond_the_need's)
        assert moved <= 1.25 * needed, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"  # (was 2-4x)
        saved, steady_need = opt.state_dict(), needed / 2
    finally:
        opt.close()
    resumed = _optimizer(tmp_path / "resumed", state_precision)
    try:
        resumed.load_state_dict(saved)
        moved = needed = 0
        for index in range(3):
            step_moved, kernel, need = _measured_step(resumed)
            assert abs(kernel - step_moved) <= SLACK + step_moved // 20, f"reported {step_moved:,} bytes, the kernel saw {kernel:,}"
            assert need >= 0.9 * steady_need  # (as before the load: the state read and written, not only written)
            # (the load leaves the last parameters' state on the host tier: the first step went
            # from the first parameter, pushed that state out before its update and read it back,
            # 1.2-1.5x; a step now starts at the end of its order the tier holds, 1.0-1.2x)
            assert index or step_moved <= 1.25 * need, f"first step after the load: {step_moved:,} bytes moved for {need:,} needed"
            moved, needed = moved + step_moved, needed + need
        assert moved <= 1.25 * needed, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
        save_optimizer(resumed, tmp_path / "checkpoint")
    finally:
        resumed.close()
    streamed = _optimizer(tmp_path / "streamed", state_precision)
    try:  # the same through DCP's streaming load (a review found it left out of the fix)
        load_optimizer(streamed, tmp_path / "checkpoint")
        step_moved, kernel, need = _measured_step(streamed)
        assert abs(kernel - step_moved) <= SLACK + step_moved // 20, f"reported {step_moved:,} bytes, the kernel saw {kernel:,}"
        assert need >= 0.9 * steady_need
    finally:
        streamed.close()


def test_steps_after_a_load_with_backward_move_at_most_a_quarter_beyond_the_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    """After ``load_state_dict()`` on a new store, a model trained with backward (a tryout's GRU,
    here an MLP): the load's writes were recorded with the first step's accesses as one phase of
    the learned schedule, so the third step followed the load's order and read 1.7x its need.
    A checkpoint's accesses are no longer the schedule's to learn."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])
    batch = torch.randn(8, 256)

    def make(root: Path) -> TieredAdamW:
        return _paged_to_disk(model, root, "2MiB")  # (a quarter of the state)

    def step(opt: TieredAdamW) -> tuple[int, int, int]:
        model(batch).square().mean().backward()
        measured = _measured_step(opt)
        opt.zero_grad()
        return measured

    opt = make(tmp_path / "disk")
    try:
        for _ in range(3):
            step(opt)
        saved = opt.state_dict()
    finally:
        opt.close()
    resumed = make(tmp_path / "resumed")
    try:
        resumed.load_state_dict(saved)
        moved = needed = 0
        for _ in range(4):
            step_moved, _, need = step(resumed)
            moved, needed = moved + step_moved, needed + need
        assert moved <= 1.25 * needed, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
    finally:
        resumed.close()


def test_a_checkpoint_taken_on_another_thread_during_a_step_leaves_the_figures_whole(
    tmp_path: Path, counters: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``state_dict()`` on a checkpoint thread while the training thread steps (a review): the
    step ended inside the checkpoint's block, whose end then took the block's bytes off the
    next step's figures (-229,376 bytes written)."""
    import tierstore.optim.adam as adam_module

    opt = _optimizer(tmp_path / "disk", "fp32")
    inside, stepped = threading.Event(), threading.Event()
    original = adam_module.adam_state_dict

    def slow_state_dict(optimizer: TieredAdamW) -> dict:
        inside.set()
        stepped.wait(30)  # (the step runs while the checkpoint is inside its block)
        return original(optimizer)

    try:
        for _ in range(WARMUP):
            opt.step()
        monkeypatch.setattr(adam_module, "adam_state_dict", slow_state_dict)
        checkpoint = threading.Thread(target=opt.state_dict)
        checkpoint.start()
        assert inside.wait(30)
        _measured_step(opt)
        stepped.set()
        checkpoint.join(30)
        monkeypatch.setattr(adam_module, "adam_state_dict", original)
        report = None
        for _ in range(2):
            moved, kernel, need = _measured_step(opt)
            report = opt.time_report()
            assert report.disk_read_bytes >= 0 and report.disk_write_bytes >= 0, report
            assert abs(kernel - moved) <= SLACK + moved // 20, f"reported {moved:,} bytes, the kernel saw {kernel:,}"
    finally:
        stepped.set()
        opt.close()


def test_an_embedding_model_resumed_moves_near_its_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    """A tryout's embedding + head (two large tensors paged in chunks, a 4 MiB host tier,
    gradients set directly): its first steps, and those after a load, moved 1.35-3.1x their
    need (1.35-1.63x over four). ``MIN`` kept the next uses the learned schedule foresaw before it learned that the
    steps alternate (asked only at a key's insertion and hits), and the schedule, one step
    known, foretold the next one running the same way: both pushed out the state the reversed
    step needed first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(3000, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 3000))
    generator = torch.Generator().manual_seed(1)

    def make(root: Path) -> TieredAdamW:
        return _paged_to_disk(model, root, "4MiB")

    def steps(opt: TieredAdamW, count: int) -> tuple[int, int]:
        moved = needed = 0
        for _ in range(count):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator) * 1e-2
            step_moved, _, need = _measured_step(opt)
            moved, needed = moved + step_moved, needed + need
        return moved, needed

    opt = make(tmp_path / "disk")
    try:
        steps(opt, 1)  # (the state is created)
        moved, needed = steps(opt, 4)
        assert moved <= 1.25 * needed, f"first steps: {moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
        saved = opt.state_dict()
    finally:
        opt.close()
    resumed = make(tmp_path / "resumed")
    try:
        resumed.load_state_dict(saved)
        # (not the first: with no order learned yet it moves 1.35x, at times 2.35x; the note says so)
        steps(resumed, 1)
        moved, needed = steps(resumed, 3)
        assert moved <= 1.25 * needed, f"after a load: {moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
    finally:
        resumed.close()


def test_bytes_reported_are_the_kernels_for_entries_not_a_multiple_of_a_block(tmp_path: Path, counters: None, device_mode: str) -> None:
    """An 8-bit entry of 5,003 parameters is 10,166 bytes; the disk moves 12,288 (whole 4 KiB
    blocks). The report counted the entry's bytes: 1.21x fewer than the kernel saw, and the SSD
    wear figures as much too low."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5003, generator=generator)) for _ in range(60)]
    store = TierStore([HostTier(256 << 10), DiskTier(tmp_path / "disk", 64 << 20, durable=False)])
    opt = TieredAdamW(params, lr=1e-3, store=store, state_precision="8bit")
    if not store.tier("disk").direct_io:  # type: ignore[attr-defined]
        opt.close()
        pytest.skip(f"the disk tier cannot use O_DIRECT under {tmp_path} (tmpfs?): the kernel's counters would not see its I/O")
    try:
        for step in range(6):
            for p in params:
                p.grad = torch.randn(5003, generator=generator)
            before = block_io()
            opt.step()
            after = block_io()
            if step < 3:
                continue
            report = opt.time_report()
            reported, kernel = (report.disk_read_bytes, report.disk_write_bytes), (after[0] - before[0], after[1] - before[1])
            assert report.disk_read_bytes > 0 and report.disk_write_bytes > 0
            assert all(abs(k - r) <= (32 << 10) + r // 100 for k, r in zip(kernel, reported, strict=True)), (kernel, reported)
            assert report.disk_need_bytes % 4096 == 0  # (the need counts the blocks an entry's transfers move, too)
    finally:
        opt.close()


async def test_flushed_and_read_values_count_whole_blocks_as_the_kernel_does(tmp_path: Path, counters: None) -> None:
    """A flush counted each value's own bytes (10,166), where the disk wrote 12,288."""
    async with TierStore([HostTier(16 << 20), DiskTier(tmp_path / "disk", 64 << 20, durable=False)]) as store:
        if not store.tier("disk").direct_io:  # type: ignore[attr-defined]
            pytest.skip(f"the disk tier cannot use O_DIRECT under {tmp_path} (tmpfs?)")
        for i in range(4):
            await store.put(f"k{i}", torch.zeros(10_166, dtype=torch.uint8))
        before = block_io()
        await store.flush()
        after = block_io()
        links = store.stats()["links"]
        assert links["host->disk"]["nbytes"] == 4 * 12_288
        assert abs((after[1] - before[1]) - 4 * 12_288) <= 64 << 10  # (and the catalog's pages)
        for i in range(4):
            await store.put(f"e{i}", torch.zeros(10_166, dtype=torch.uint8), tier="disk")
        assert store.stats()["links"]["caller->disk"]["nbytes"] == 4 * 12_288


def test_a_frozen_layer_adds_no_write_backs_to_a_state_that_fits(tmp_path: Path, counters: None, device_mode: str) -> None:
    """The step's early write-backs counted the state of every paged parameter not on the host
    tier, a frozen one's too (it has none, and none is made): with the trainable state fitting
    the host tier, each step wrote 64-196 KiB back for a need of 0 (a tryout)."""
    torch.manual_seed(1)
    layers = [torch.nn.Linear(128, 128) for _ in range(3)] + [torch.nn.Linear(128, 16)]
    layers[2].requires_grad_(False)
    model = torch.nn.Sequential(*layers)
    # (the trainable state fits; under the emulated device, beside the gradients that cross the link)
    opt = _paged_to_disk(model, tmp_path / "disk", "512KiB" if emulation()[0] else "256KiB")
    try:
        moved = kernel = needed = 0
        for index in range(6):
            model(torch.randn(8, 128)).square().mean().backward()
            step_moved, step_kernel, need = _measured_step(opt)
            opt.zero_grad()
            if index >= 1:
                moved, kernel, needed = moved + step_moved, kernel + step_kernel, needed + need
        assert needed == 0
        assert moved == 0, f"{moved:,} bytes moved for none needed"
        assert kernel <= 5 * SLACK, f"the kernel saw {kernel:,} bytes for none needed"
    finally:
        opt.close()


def test_with_backward_the_state_is_written_back_before_its_room_is_needed(tmp_path: Path, device_mode: str) -> None:
    """The step's early write-backs are counted as its first gradient arrives, while backward
    makes the others: counting only parameters with a gradient then (to leave frozen ones out)
    counted almost none, and the writes moved into the evictions, on the step's critical path
    (a review: 4 evictions in 96 found their copy written back, against 95 before). Read from
    the store's trace: an evicted copy with a ``writeback`` row in the step went early (an
    eviction's own write has none). The row marks the write's end, so a write still under way
    when its copy is chosen lands after the ``evict`` row: with a slow disk (CI's), a fifth to a
    third of them, every one begun before (counted by hand)."""
    import numpy as np

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])
    host = "2MiB" if not emulation()[0] else "3MiB"  # (a third of the state or so; gradients cross the link beside it)
    store = TierStore([HostTier(host), DiskTier(tmp_path / "disk", "64MiB")], trace=tmp_path / "trace.npz")
    opt = TieredAdamW(model.parameters(), lr=1e-3, store=store)
    try:
        for _ in range(6):
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
        from tierstore.sync import run

        run(store.aclose())
    trace = np.load(tmp_path / "trace.npz")
    ops = list(trace["ops"])
    writeback, evict = ops.index("writeback"), ops.index("evict")
    early = late = 0
    for step in range(2, int(trace["step"].max())):  # (the state made, then the steady steps)
        rows = np.nonzero(trace["step"] == step)[0]
        written = {int(trace["key"][row]) for row in rows if trace["op"][row] == writeback}
        for row in rows:
            if trace["op"][row] == evict:
                early += int(trace["key"][row]) in written
                late += int(trace["key"][row]) not in written
    assert early + late > 20  # (the state pages: a quarter of it fits)
    assert early >= 0.8 * (early + late), f"{early} evictions of copies written back early, {late} not"


def test_steps_that_leave_a_large_parameter_out_move_near_their_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    """An embedding with a gradient every other step beside a small MLP, a quarter of the state
    on the host (a tryout): the steps without the embedding's gradient moved 1.3-2.8x their
    need (1.26-1.45x over fifteen of them; now 0.84-0.93x, at times up to 1.2x). The step counted the bytes to write back early at the first gradient, from every
    trainable parameter's state, the embedding's included, and wrote back the MLP states it had
    just updated; they stayed, and the evictions wrote the embedding's chunks besides.

    Emulated, the gradients' room on the host leaves the MLP's state resident: those steps need
    nothing, and what they move is the next step's reads begun early (counted in the step that
    starts them), so there the steps are counted in pairs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20000, 128), torch.nn.Linear(128, 512), torch.nn.Linear(512, 128),
                                torch.nn.Linear(128, 512), torch.nn.Linear(512, 128))
    embedding = model[0].weight
    state = sum(p.numel() for p in model.parameters()) * 8
    generator = torch.Generator().manual_seed(1)
    opt = _paged_to_disk(model, tmp_path / "disk", str(state // 4))
    emulated = device_mode == "emulated"
    try:
        moved = needed = 0
        for step in range(34):  # (a step alone swings with the timing of reads begun early: 0.5-1.25x)
            for p in model.parameters():
                p.grad = None if p is embedding and step % 2 else torch.randn(p.shape, generator=generator) * 1e-2
            step_moved, _, need = _measured_step(opt)
            if step >= 4 and (step % 2 or emulated):
                moved, needed = moved + step_moved, needed + need
        assert needed > 0
        # (emulated, in pairs: the embedding's steps move up to 1.2x, see the README; plain, one
        # run in ten reached 1.2x, the timing of the reads begun early)
        bound = 1.25 if emulated else 1.2
        assert moved <= bound * needed + 5 * SLACK, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
    finally:
        opt.close()


def test_many_small_states_mostly_resident_move_their_need(tmp_path: Path, counters: None, device_mode: str) -> None:
    """A thousand small parameters, three quarters of their state on the host (a tryout of
    1,000-3,000 states of 4,096-8,192 parameters): from the fifth step on, steps moved 1.5-2x
    their need. The step updates the states on the host first, in one hold of them all, and
    took those holds sorted by key ("1", "10", "100", ...), not in the step's order: the learned
    schedule saw an order that changed with what was resident, flipped its period every step,
    and ``MIN`` evicted states the step then read back. They are held in the step's order now,
    as the pipeline's buckets hold theirs. (Emulated, 1.0x before the fix too.)"""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(1000)]
    state = 1000 * 4096 * 8  # (m and v: an fp32 parameter on the plain CPU is its own master)
    opt = _paged_to_disk(torch.nn.ParameterList(params), tmp_path / "disk", str(state * 3 // 4))
    generator = torch.Generator().manual_seed(1)
    try:
        moved = needed = 0
        for step in range(10):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator) * 1e-2
            step_moved, _, need = _measured_step(opt)
            if step >= 4:  # (before the fix: 1.5-1.8x over these, 1.0x every step since)
                moved, needed = moved + step_moved, needed + need
        assert needed > 0
        assert moved <= 1.1 * needed + 8 * SLACK, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
    finally:
        opt.close()


@pytest.mark.parametrize(("pattern", "host_part"), [("random quarter", 2), ("all, then a quarter", 2), ("a trunk and some experts", 2),
                                                ("random half", 2), ("all every third step", 2), ("random quarter", 4)])
def test_a_changing_part_of_the_parameters_each_step_moves_its_need(
    tmp_path: Path, counters: None, device_mode: str, pattern: str, host_part: int
) -> None:
    """A random quarter of the parameters has a gradient each step (the experts of a mixture):
    the learned schedule foresaw the keys of the step before, so the store prefetched states the
    step did not update, and ``MIN`` ranked as next victims, written back early, states the
    next steps updated again: 1.34x the need (1.49x emulated). A schedule that foresaw few of
    the last two steps' keys now foretells nothing (no prefetches; ``MIN`` evicts the least
    recently used). Every parameter, then the first quarter, in turns: states written back
    early were updated again before their eviction, and written again (1.2-1.3x; 1.36x with
    the schedule's fix alone). Early write-backs found written for nothing more than a third of
    the time now stop until they would pay (``tierstore.optim.early_writes``). A trunk every
    step and 8-16 of 48 experts (a tryout's mixture: the trunk kept the phases foreseen, so the
    schedule foretold the experts of the step before), a random half, and all every third step
    else a random quarter moved 1.18-1.46x: the step now tells the store which states it
    updates and which it does not (``TierStore.expect``), and the schedule foretells those."""
    import random

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(1 << 16)) for _ in range(64)]
    state = 64 * (1 << 16) * (12 if emulation()[0] else 8)  # (m and v, and a master of its own across a link)
    opt = _paged_to_disk(torch.nn.ParameterList(params), tmp_path / "disk", str(state // host_part))
    generator, chosen = torch.Generator().manual_seed(1), random.Random(0)
    try:
        moved = needed = 0
        for step in range(24):
            opt.zero_grad(set_to_none=True)
            if pattern == "random quarter" or pattern == "all every third step" and step % 3:
                updated = chosen.sample(range(len(params)), 16)
            elif pattern == "a trunk and some experts":  # (16 every step, 8-16 of the other 48)
                updated = list(range(16)) + chosen.sample(range(16, len(params)), chosen.randint(8, 16))
            elif pattern == "random half":
                updated = chosen.sample(range(len(params)), 32)
            elif pattern == "all every third step":
                updated = list(range(len(params)))
            else:
                updated = list(range(len(params) if step % 2 == 0 else 16))
            for index in updated:
                params[index].grad = torch.randn(1 << 16, generator=generator) * 1e-2
            step_moved, _, need = _measured_step(opt)
            if step >= 8:
                moved, needed = moved + step_moved, needed + need
        assert needed > 0
        # (the alternation: 1.03-1.09x on a quiet machine, 1.11-1.16x with three other processes
        # on its two cores; 1.36x with the early write-backs going on)
        bound = 1.2 if pattern in ("all, then a quarter", "all every third step") else 1.1
        if host_part == 4:  # (plain 1.00-1.04x, 1.07x on a disk slowed to 80 MB/s, 1.105-1.113x before the
            # fix; emulated 1.05-1.09x, 1.10-1.13x before)
            bound = 1.08 if device_mode == "plain" else 1.15
        assert moved <= bound * needed + 8 * SLACK, f"{moved:,} bytes moved for {needed:,} needed ({moved / needed:.2f}x)"
    finally:
        opt.close()
