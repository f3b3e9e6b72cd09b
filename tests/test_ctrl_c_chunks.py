"""Ctrl-C during ``step()`` that lands after every chunk of a parameter paged in chunks took its
update, but before the update was closed: its weight and moments had moved, its step count
had not, so its next update counted this step again (a tryout: every parameter drifted from
torch's from then on). The abandoned step now closes such a parameter's update.

The interrupt is placed at that point by wrapping the pipeline's chunk math (the test's only
use of an internal): it fires as the parameter's last chunk's math ends, on the training
thread, as a real Ctrl-C there would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import _thread, json, signal, sys, torch
signal.signal(signal.SIGINT, signal.default_int_handler)
from tierstore.device import emulate_device
from tierstore.optim import TieredAdamW
from tierstore.optim import pipeline as pipeline_module

original = pipeline_module.UpdatePipeline._compute_chunks
armed = []

def compute_chunks(self, slot, chunks, *rest):
    result = original(self, slot, chunks, *rest)
    if armed and slot.chunks:
        armed[0] += len(chunks)
        if armed[0] == len(slot.chunks):  # (the last chunk's math ended: Ctrl-C now)
            armed.clear()
            _thread.interrupt_main()
    return result

pipeline_module.UpdatePipeline._compute_chunks = compute_chunks

with emulate_device(sys.argv[2] == "emulated"):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(256, 1024))
    twin = torch.nn.Parameter(weight.detach().clone())
    opt = TieredAdamW([weight], lr=1e-2, offload="disk", disk_root=sys.argv[1], host_capacity="512KiB", chunk_bytes="64KiB")
    reference = torch.optim.AdamW([twin], lr=1e-2, fused=True)

    def backward():
        for p, o in ((weight, opt), (twin, reference)):
            o.zero_grad()
            (p * torch.arange(p.numel()).reshape(p.shape).sin()).square().mean().backward()

    for _ in range(2):
        backward(); opt.step(); reference.step()
    backward()
    before = weight.detach().clone()
    armed.append(0)
    try:
        opt.step()
        outcome = "finished"
    except KeyboardInterrupt:
        outcome = "interrupted"
    moved = float((weight.detach() != before).float().mean())
    if moved == 1.0:
        reference.step()  # (the step the interrupted one applied)
    count = float(opt.state_dict()["state"][0]["step"])
    for _ in range(2):
        backward(); opt.step(); reference.step()
    print(json.dumps({"outcome": outcome, "moved": moved, "count": count, "same": torch.equal(weight.detach(), twin.detach())}))
    opt.close()
"""


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_after_every_chunk_took_the_step_counts_it(tmp_path: Path, mode: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "d"), mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "interrupted", result
    if 0.0 < result["moved"] < 1.0:
        pytest.skip(f"the interrupt ended the step with some chunks' weights not yet written ({result}): the README's known gap")
    assert result["count"] == (3.0 if result["moved"] == 1.0 else 2.0), result
    assert result["same"], result  # (and training goes on as torch's AdamW that took the same steps)
