"""Ctrl-C during ``step()`` that lands while a parameter paged in chunks is part-way through its
update.

- After every chunk took the update, but before the update was closed: its weight and moments
  had moved, its step count had not, so its next update counted this step again (a tryout:
  every parameter drifted from torch's from then on). The abandoned step now closes such a
  parameter's update.
- After some of its chunks took the update: those chunks had moved, the others had not, and
  the step count stayed, so the next update counted this step again in the chunks that had
  taken it (the README's known gap until then). The abandoned step now finishes the update
  of a parameter it cut part-way (its other chunks, from the same gradient) before
  ``KeyboardInterrupt`` leaves, as it lets the work in flight end.

The interrupt is placed by wrapping the pipeline's chunk math (the test's only use of an
internal): it fires as the math of the parameter's first run of chunks, or of its last
chunk, ends, on the training thread, as a real Ctrl-C there would."""

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
        if armed[0] == len(slot.chunks) or sys.argv[3] == "first":  # (that math ended: Ctrl-C now)
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


def _interrupted(tmp_path: Path, mode: str, where: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "d"), mode, where], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"] == "interrupted", result
    return result


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_after_every_chunk_took_the_step_counts_it(tmp_path: Path, mode: str) -> None:
    result = _interrupted(tmp_path, mode, "last")
    assert result["moved"] == 1.0, result  # (chunks whose weights were not written yet get them before the interrupt leaves)
    assert result["count"] == 3.0, result
    assert result["same"], result  # (and training goes on as torch's AdamW that took the same steps)


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_part_way_through_a_parameter_finishes_its_update(tmp_path: Path, mode: str) -> None:
    result = _interrupted(tmp_path, mode, "first")
    assert result["moved"] == 1.0, result  # every chunk, not only those before the interrupt
    assert result["count"] == 3.0, result
    assert result["same"], result
