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
