"""``memory_plan()`` counts the update's own buffers in its working set. Compressed state is
decoded tile by tile into fp32 rows that a thread keeps (12 MiB for 8-bit moments with amsgrad
on 1M-element tiles), each tile's math makes and drops more (the codec's passes, a gradient cast
to fp32, a non-fused AdamW's temporaries), a lossless master's update makes the weight's new
high halves, and small entries are updated in batches. Before, the plan left all of it out
(0 B for a host-only optimizer), and then counted the kept and dropped parts of different
parameters as if they never met, a batch of one-element 8-bit entries as if it were not padded
to whole blocks (39 MiB for 20,000 of them), and every thread that ever called ``step()`` as
if it let its scratch go (it kept it).

Measured with torch's profiler (its memory events: what torch allocates and frees), on the
thread that calls ``step()``, where the step's updates run."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tierstore.optim import TieredAdamW

MiB = 1 << 20


def _held(call: Callable[[], Any]) -> tuple[int, int]:
    """The most bytes torch held during ``call`` beyond what it held before, and those it still
    held after."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak, held


def _peak(call: Callable[[], Any]) -> int:
    return _held(call)[0]


def _params(kind: str) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    if kind == "small":  # many parameters smaller than a block of 256: updated in batches
        return [torch.nn.Parameter(torch.randn(n)) for n in [1, 3, 255, 257, 1000] * 60]
    if kind == "tiny":  # one element each: an 8-bit batch pads each to a block
        return [torch.nn.Parameter(torch.randn(1)) for _ in range(4000)]
    if kind == "mixed":  # one group's update keeps a large scratch, the other's makes a large weight
        return [torch.nn.Parameter(torch.randn(2_000_003)), torch.nn.Parameter(torch.randn(2_500_000).bfloat16())]
    if kind == "lossless":
        return [torch.nn.Parameter(torch.randn(1_000_003).bfloat16()), torch.nn.Parameter(torch.randn(5000).bfloat16())]
    return [torch.nn.Parameter(torch.randn(2_000_003)), torch.nn.Parameter(torch.randn(700))]  # (a partial last block: decoded)


CASES = {
    "bf16": ("plain", {"state_precision": "bf16"}),
    "bf16 foreach=False": ("plain", {"state_precision": "bf16", "foreach": False}),
    "8bit amsgrad": ("plain", {"state_precision": "8bit", "amsgrad": True}),
    "8bit small entries": ("small", {"state_precision": "8bit"}),
    "8bit one-element entries": ("tiny", {"state_precision": "8bit"}),
    "8bit amsgrad, then a lossless master": ("mixed", {}),
    "bf16 small entries": ("small", {"state_precision": "bf16"}),
    "lossless + 8bit": ("lossless", {"state_precision": "8bit", "master_weights": "lossless"}),
    "lossless + fp32 moments": ("lossless", {"master_weights": "lossless"}),
    "fp32 foreach=False": ("plain", {"foreach": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_steps_own_buffers_stay_within_the_plans_working_set(case: str) -> None:
    kind, options = CASES[case]
    params = _params(kind)
    groups: Any = params
    if kind == "mixed":
        groups = [{"params": params[:1], "state_precision": "8bit", "amsgrad": True}, {"params": params[1:], "master_weights": "lossless"}]
    opt = TieredAdamW(groups, lr=1e-3, offload="host", **options)
    try:
        plan = opt.memory_plan()
        peaks = []
        for _ in range(3):  # (the first creates the state; the kept scratch is let go after each step)
            for p in params:
                p.grad = torch.randn_like(p)
            peaks.append(_peak(opt.step))
        assert max(peaks[1:]) > 0, "nothing measured: the case no longer exercises what it should"
        assert max(peaks[1:]) <= plan.working_bytes, (case, [p / MiB for p in peaks], plan.working_bytes / MiB)
    finally:
        opt.close()


def test_plain_fp32_state_adds_nothing() -> None:
    """fp32 moments with torch's fused kernel are updated where they lie: no buffer of the
    update's own, and the plan says so."""
    params = _params("plain")
    opt = TieredAdamW(params, lr=1e-3, offload="host")
    try:
        assert opt.memory_plan().working_bytes == 0
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    finally:
        opt.close()


def test_threads_that_call_step_keep_no_scratch_after_it() -> None:
    """The plan counts the threads that run updates (the caller's, the optimizer's worker):
    a step called from a thread that lives on (a trainer's pool, say) leaves it holding none
    of its scratch. Before, each such thread kept its own (3 MiB here) for good."""
    params = _params("plain")
    opt = TieredAdamW(params, lr=1e-3, offload="host", state_precision="bf16")

    def step() -> tuple[int, int]:
        for p in params:
            p.grad = torch.randn_like(p)
        return _held(opt.step)

    try:
        step()  # (the state is made)
        with ThreadPoolExecutor(1) as first, ThreadPoolExecutor(1) as second:
            for pool in (first, second, first, second):
                peak, after = pool.submit(step).result()
                assert peak >= MiB, "nothing measured: the case no longer exercises what it should"
                assert after <= 64 << 10, after / MiB
    finally:
        opt.close()
