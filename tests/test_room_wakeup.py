"""A request for room that found no victim waits for room to change; a copy that becomes a
victim (its last use ends) now wakes it. It waited only for transfers in flight, and under the
emulated device a 16 KiB host tier of small values hung the optimizer's first ``step()`` in
most runs: an update's second gradient copy waited for room, its first copy's buffer (in flight
until the update ends) was all it watched, and the state it could evict was in use when it
looked."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tierstore import HostTier

TRIAL = textwrap.dedent(
    """
    import sys, torch
    from tierstore import DiskTier, HostTier, SyncTierStore
    from tierstore.device import emulate_device
    from tierstore.optim import TieredAdamW
    with emulate_device(True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        store = SyncTierStore([HostTier("16KiB"), DiskTier(sys.argv[1], "64MiB", chunk_size="64KiB")]).open()
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, state_precision="bf16", min_offload_numel=1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 8)).pow(2).mean().backward()
            opt.step()
        opt.close()
        store.close()
    print("ok")
    """
)


def test_a_tiny_host_tier_under_the_emulated_device_never_hangs_a_step(tmp_path: Path) -> None:
    for trial in range(6):  # (it hung 3 runs in 4 before)
        try:
            done = subprocess.run([sys.executable, "-c", TRIAL, str(tmp_path / f"disk{trial}")], capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trial {trial}: step() hung") from None
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


ADDED_GROUP = textwrap.dedent(
    """
    import sys, torch
    from tierstore import DiskTier, HostTier, SyncTierStore
    from tierstore.device import emulate_device
    from tierstore.optim import TieredAdamW
    with emulate_device(True):
        torch.manual_seed(0)
        head, body = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)
        store = SyncTierStore([HostTier("16KiB"), DiskTier(sys.argv[1], "64MiB", chunk_size="64KiB")]).open()
        opt = TieredAdamW(head.parameters(), lr=1e-2, store=store, min_offload_numel=1)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": list(body.parameters())})
            opt.zero_grad()
            body(torch.tanh(head(torch.randn(8, 8)))).pow(2).mean().backward()
            opt.step()
        opt.close()
        store.close()
    print("ok")
    """
)


def test_a_bucket_of_small_values_of_distinct_sizes_fits_the_tier(tmp_path: Path) -> None:
    """Counted by their bytes, the states and gradients of the head's bias and the added
    group (48 to 1,536 bytes, five size classes) made one bucket of 2.7 KiB; their slabs take
    a page each, 20 KiB, more than the 16 KiB tier: every step after the group was added hung."""
    try:
        done = subprocess.run([sys.executable, "-c", ADDED_GROUP, str(tmp_path / "disk")], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("step() hung") from None
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_room_for_counts_the_slabs_small_values_take() -> None:
    tier = HostTier("16KiB")  # (slabs of one page on a tier this small)
    assert tier.room_for([48, 16]) == 4096  # (one class: one slab)
    assert tier.room_for([48, 384, 1536, 16, 128, 512]) == 5 * 4096
    assert tier.room_for([8192, 100]) == 8192 + 4096
    assert sum(tier.value_size(n) for n in [48, 384, 1536, 16, 128, 512]) < tier.capacity < tier.room_for([48, 384, 1536, 16, 128, 512])
