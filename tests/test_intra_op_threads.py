"""The store's threads run torch ops serially: they start no OpenMP teams of their own.

Each thread that calls a parallel torch CPU op gets an OpenMP worker pool for its lifetime.
With more OpenMP threads than CPUs, libgomp shortens every team's spin-wait, and the user's
forward and backward slowed by 1.3-2x on a 2-core machine once the store had copied one
large value (``tierstore/intra_op.py``). These tests count the process's OS threads that no
Python thread accounts for: OpenMP workers. The user's own team is formed before the count.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from policies import MIN, ScheduleLearned
from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.device import emulation
from tierstore.models import GPT, GPTConfig, synthetic_batches
from tierstore.optim import TieredAdamW

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2 or not torch.backends.openmp.is_available(),
                       reason="needs torch's OpenMP with at least 2 threads"),
]

LARGE = 4_000_000  # elements: far above torch's grain size, so an op on it runs in parallel


def _os_threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _workers_started_since(before: set[int]) -> set[int]:
    """OS threads started since ``before`` that are not Python threads: OpenMP workers."""
    python_threads = {thread.native_id for thread in threading.enumerate()}
    return _os_threads() - before - python_threads


@pytest.fixture
def baseline() -> set[int]:
    (torch.randn(LARGE) * 2).sum()  # the test thread's own team, which the store may not change
    return _os_threads()


@pytest.mark.parametrize("in_backward", [False, True])
def test_paged_optimizer_starts_no_openmp_workers(tmp_path: Path, baseline: set[int], in_backward: bool) -> None:
    """A paged step on a model that computes on the CPU: the store's loop, I/O and copy
    threads add no OpenMP workers, nor does the thread that updates in backward (it shares the
    model's cores). Behind a device link (the emulated device) that thread keeps torch's
    intra-op threads on purpose: there the update is the CPU's main work."""
    if in_backward and emulation()[0]:
        pytest.skip("behind a link the update in backward keeps torch's intra-op threads")
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config)  # (the demo's model: its updates in backward run in parallel ops)
    batches = synthetic_batches(config, 8, seed=1)
    state = 2 * 4 * sum(p.numel() for p in model.parameters())
    schedule = ScheduleLearned()  # (the demo benchmark's policies)
    tiers = [HostTier(state // 2), DiskTier(tmp_path / "o", 4 * state, durable=False)]
    with SyncTierStore(tiers, eviction=lambda: MIN(schedule), prefetch=schedule) as store:
        opt = TieredAdamW(model.parameters(), lr=1e-3, store=store, step_in_backward=in_backward)
        for _ in range(4):
            model.loss(next(batches)).backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        started = _workers_started_since(baseline)
    assert not started, f"the store's threads started {len(started)} OpenMP worker(s)"
    # The user's threads keep torch's count: this one, and one started after the store's work.
    assert torch.get_num_threads() == threads
    seen: list[int] = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [threads]
