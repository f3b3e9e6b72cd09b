"""The order in which a step's updates ask the store for their states is the update order,
whichever of them happen to be resident: the learned schedule (and ``MIN`` following it) sees
the same order every time the step runs that way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from policies import MIN, ScheduleLearned
from tierstore import DiskTier, HostTier, TierStore
from tierstore.optim import TieredAdamW
from tierstore.sync import run
from tierstore.testing import settle

pytestmark = pytest.mark.device_modes


class RecordingSchedule(ScheduleLearned):
    """``ScheduleLearned`` that keeps each phase's accesses, as the store reports them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[str]] = [[]]
        #: The test's own accesses: neither kept nor followed (nothing prefetched after them).
        self.paused = False

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
        if self.paused:
            return
        self.seen[-1].append(key)
        super().on_access(key, nbytes, tier, hit)

    def on_step(self) -> None:
        self.seen.append([])
        super().on_step()


def _chunk_indices(keys: list[str]) -> list[int]:
    return [int(match.group(1)) for key in keys if (match := re.search(r"/c(\d+)$", key))]


def test_a_run_with_one_state_resident_asks_in_update_order(tmp_path: Path, device_mode: str) -> None:
    """A run of chunks some of whose states were on the host tier, the others on disk, asked
    for the resident ones first (entered at once, the others as tasks): the schedule learned the
    run's order swapped, and after a load ``MIN`` evicted the state updated next to last instead
    of the one written back early to go, writing it too (1.27-1.48x the need, not 1.06x, on a
    busy machine: ``test_io_waste``'s embedding model). Here the resident state is put there
    by hand."""
    schedule = RecordingSchedule()
    store = TierStore([HostTier("1MiB"), DiskTier(tmp_path / "disk", "64MiB", durable=False)],
                      eviction=lambda: MIN(schedule), prefetch=schedule)
    param = torch.nn.Parameter(torch.randn(512 * 1024, generator=torch.Generator().manual_seed(0)))
    opt = TieredAdamW([param], lr=1e-3, store=store)
    try:
        param.grad = torch.full_like(param, 1e-3)
        opt.step()  # (the state is created, in chunks)
        chunks = sorted((key for key in store.keys() if re.search(r"/c\d+$", key)), key=lambda k: _chunk_indices([k])[0])
        assert len(chunks) >= 4, chunks
        # Every chunk's state pushed to the disk by a value of the user's, then the second
        # chunk's brought back alone: the run holding the first two has one state on the host
        # and one on disk (the runs after it, as their reads and evictions leave them).
        schedule.paused = True
        filler = torch.zeros(int(store.tier("host").capacity * 0.85) // 4)
        run(store.put("filler", filler, "host"))
        run(store.delete("filler"))
        run(settle(store))
        run(store.prefetch([chunks[1]], "host"))
        run(settle(store))
        schedule.paused = False
        assert "host" in store.where(chunks[1]) and store.where(chunks[0]) == ["disk"], [store.where(key) for key in chunks]
        param.grad = torch.full_like(param, 2e-3)
        opt.step()
        order = _chunk_indices(schedule.seen[-2])
        assert order in (sorted(order), sorted(order, reverse=True)), f"the step asked for its chunks' states in the order {order}"
    finally:
        opt.close()
        run(store.aclose())
