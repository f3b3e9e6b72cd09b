"""Memory of the trainers' checkpoint and placement paths with 34-50 MB of Adam state on disk,
measured as the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` before
each phase) in a fresh process per device mode:

- ``torch.save(opt.state_dict())`` (what the HF Trainer and Lightning do) and
  ``opt.load_state_dict(torch.load(...))``: at most one full copy of the state;
- ``accelerate``'s ``prepare()``, which round-trips ``state_dict()`` through ``load_state_dict``
  to move the state to the device (the Trainer prepares before the first step; an optimizer
  continuing a named namespace, or prepared after loading, holds state by then): it must grow by
  a bounded amount, not by the state's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

pytestmark = [
    pytest.mark.device_modes,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS"),
]

MiB = 1 << 20

SCRIPT = r"""
import json, sys, torch
from accelerate import Accelerator
from tierstore.optim import TieredAdamW

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

def reset():
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS
    return peak()

def measure(name, action):
    base = reset()
    result = action()
    growth[name] = peak() - base
    return result

root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.ModuleList([torch.nn.Linear(1024, 64, bias=False) for _ in range(64)])  # 4.2M parameters
opt = TieredAdamW(model.parameters(), lr=1e-3, offload="disk", disk_root=root + "/state", host_capacity="4MiB")
growth = {}
accelerator = Accelerator(cpu=True)
measure("prepare before the first step", lambda: accelerator.prepare_optimizer(opt))  # as the Trainer does
x = torch.randn(2, 1024)
sum(layer(x).sum() for layer in model).backward()
opt.step()
opt.zero_grad()
report = opt.memory_report()
measure("save", lambda: torch.save(opt.state_dict(), root + "/optimizer.pt"))
measure("load", lambda: opt.load_state_dict(torch.load(root + "/optimizer.pt", weights_only=True)))
measure("prepare_optimizer(device_placement=False)", lambda: accelerator.prepare_optimizer(opt, device_placement=False))
measure("prepare", lambda: accelerator.prepare(opt))
print(json.dumps({"growth": growth, "state": sum(report.state_by_tier.values()), "host": 4 << 20, "slot": 12 * 1024 * 64,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "disk": report.state_by_tier.get("disk", 0)}))
"""


@cache
def measured(mode: str, root: str) -> dict[str, Any]:
    # Large buffers mapped and unmapped one by one (glibc's adaptive threshold would keep freed
    # ones in the heap and let a later phase reuse them unseen).
    env = dict(os.environ, TIERSTORE_EMULATE_DEVICE="1" if mode == "emulated" else "0", MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([sys.executable, "-c", SCRIPT, root], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def figures(device_mode: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return measured(device_mode, str(tmp_path_factory.mktemp(f"memory-{device_mode}")))


def bounded(figures: dict[str, Any]) -> int:
    """What a phase that streams may add: the host tier, two parameters' state, 8 MiB of slack."""
    return int(figures["host"] + 2 * figures["slot"] + 8 * MiB)


def test_state_is_mostly_on_disk(device_mode: str, figures: dict[str, Any]) -> None:
    per_parameter = 8 if device_mode == "plain" else 12  # plain CPU: the fp32 parameter is its own master
    assert figures["state"] == figures["parameters"] * per_parameter
    assert figures["disk"] >= figures["state"] - 4 * MiB


def test_checkpoint_save_and_load_hold_at_most_one_copy(figures: dict[str, Any]) -> None:
    for phase in ("save", "load"):
        assert figures["growth"][phase] <= figures["state"] + bounded(figures), (phase, figures)


def test_prepare_optimizer_without_device_placement_is_bounded(figures: dict[str, Any]) -> None:
    assert figures["growth"]["prepare_optimizer(device_placement=False)"] <= bounded(figures), figures


def test_accelerate_prepare_is_bounded(figures: dict[str, Any]) -> None:
    assert figures["growth"]["prepare"] <= bounded(figures), figures


def test_accelerate_prepare_before_the_first_step_is_bounded(figures: dict[str, Any]) -> None:
    assert figures["growth"]["prepare before the first step"] <= bounded(figures), figures


def test_accelerate_placement_keeps_the_state_and_its_placeholder_loads_nowhere_else(device_mode: str) -> None:
    """accelerate's device placement round-trips state_dict() through load_state_dict(): the
    paged state stays as it is; the placeholder it got is refused by another optimizer."""
    import torch
    from accelerate import Accelerator

    from tierstore.optim import TieredAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = TieredAdamW(model.parameters(), lr=1e-2, min_offload_numel=16)
    model(torch.randn(4, 64)).pow(2).mean().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    placed = Accelerator(cpu=True).prepare_optimizer(opt)  # device_placement: state_dict round trip
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    other = TieredAdamW(torch.nn.Linear(64, 64).parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="placeholder"):
        other.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"],
                               "tierstore_state_stays_in_the_store": [1, 2]})
    placed.step  # noqa: B018 - the wrapper works as usual
    other.close()
    opt.close()
