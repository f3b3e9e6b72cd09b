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
import _thread, json, signal, sys, threading, time, torch

def own_handler(signum, frame):  # (a program's own handler: not replaced in step(), it raises inside the math)
    raise KeyboardInterrupt

signal.signal(signal.SIGINT, own_handler if sys.argv[4] == "own handler" else signal.default_int_handler)
from tierstore.device import emulate_device
from tierstore.optim import TieredAdamW
from tierstore.optim import pipeline as pipeline_module

original = pipeline_module.UpdatePipeline._compute_chunks
armed = []

def compute_chunks(self, slot, chunks, *rest):
    if sys.argv[3].startswith("unbegun"):  # (a larger parameter: each run of chunks takes a while)
        time.sleep(0.05)
    result = original(self, slot, chunks, *rest)
    if sys.argv[3].startswith("unbegun") or sys.argv[3] == "mid-chunk":
        return result
    if sys.argv[3] == "worker":  # (a run started in backward, its math on the optimizer's worker)
        if armed and slot.chunks and threading.current_thread() is not threading.main_thread():
            armed.clear()
            in_step.wait(10)
            time.sleep(0.3)  # (the step waits for this run now)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a real Ctrl-C, before this job returns
            time.sleep(0.5)
        return result
    if armed and slot.chunks:
        armed[0] += len(chunks)
        if armed[0] == len(slot.chunks) or sys.argv[3] == "first":  # (that math ended: Ctrl-C now)
            armed.clear()
            _thread.interrupt_main()
            for _ in range(1000):  # (under the program's own handler, KeyboardInterrupt is raised here)
                pass
    return result

pipeline_module.UpdatePipeline._compute_chunks = compute_chunks
original_add = pipeline_module.UpdatePipeline.add

def add(self, slot, *rest, **kwargs):
    if sys.argv[3] == "before" and armed and slot.chunks:
        armed.clear()
        _thread.interrupt_main()
        time.sleep(0.3)  # (the training thread takes the Ctrl-C: the step is cancelled before this update starts)
    return original_add(self, slot, *rest, **kwargs)

pipeline_module.UpdatePipeline.add = add
from tierstore.optim import adam as adam_module
original_adam = adam_module.adam

def adam(*args, **kwargs):
    original_adam(*args, **kwargs)  # (a chunk's update applied in place)
    if sys.argv[3] == "mid-chunk" and armed and threading.current_thread() is threading.main_thread():
        armed[0] += 1
        if armed[0] == 2:  # (a Ctrl-C during the second chunk's kernel: Python's handlers run at the next line)
            armed.clear()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            for _ in range(1000):
                pass

adam_module.adam = adam
original_drain, in_step = pipeline_module.UpdatePipeline.drain_until, threading.Event()

def drain_until(self, *args, **kwargs):
    in_step.set()
    return original_drain(self, *args, **kwargs)

pipeline_module.UpdatePipeline.drain_until = drain_until

with emulate_device(sys.argv[2] == "emulated"):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(256, 1024))
    twin = torch.nn.Parameter(weight.detach().clone())
    opt = TieredAdamW([weight], lr=1e-2, offload="disk", disk_root=sys.argv[1], host_capacity="512KiB", chunk_bytes="64KiB",
                      step_in_backward=sys.argv[3] == "worker" or sys.argv[3].startswith("unbegun"))
    reference = torch.optim.AdamW([twin], lr=1e-2, fused=True)

    def backward():
        for p, o in ((weight, opt), (twin, reference)):
            o.zero_grad()
            (p * torch.arange(p.numel()).reshape(p.shape).sin()).square().mean().backward()

    for _ in range(2):
        backward(); opt.step(); reference.step()
    before = weight.detach().clone()
    in_step.clear()
    armed.append(0)
    backward()
    if sys.argv[3].startswith("unbegun"):  # (the loop busy a moment as the Ctrl-C lands: the step's task is cancelled before it begins)
        from tierstore.sync import loop_thread

        def ctrl_c():
            in_step.wait(5)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            if sys.argv[3] == "unbegun twice":  # (again, while the step's work ends)
                time.sleep(0.25)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        loop_thread().call_soon_threadsafe(time.sleep, 0.2)
        threading.Thread(target=ctrl_c).start()
    try:
        opt.step()
        outcome = "finished"
    except KeyboardInterrupt:
        outcome = "interrupted"
    armed.clear()  # (not fired in this step: not in the next ones either)
    left = weight.detach().clone()
    time.sleep(0.5)
    changed_after = float((weight.detach() != left).float().mean())  # (by work still running after step() left)
    moved = float((weight.detach() != before).float().mean())
    if moved == 1.0:
        reference.step()  # (the step the interrupted one applied)
    count = float(opt.state_dict()["state"][0]["step"])
    for _ in range(2):
        backward(); opt.step(); reference.step()
    print(json.dumps({"outcome": outcome, "moved": moved, "count": count, "same": torch.equal(weight.detach(), twin.detach()),
                      "changed_after": changed_after}))
    opt.close()
"""


def _interrupted(tmp_path: Path, mode: str, where: str, handler: str = "default handler") -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "d"), mode, where, handler], capture_output=True, text=True, timeout=300)
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


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_as_the_update_of_a_chunked_parameter_is_launched_leaves_nothing_running(tmp_path: Path, mode: str) -> None:
    """Cancelled before the task that waits for a chunked parameter's runs started, the step
    left its runs running on after ``KeyboardInterrupt``: they went on with the next step's
    gradients, or none ("internal error: ... no gradient to update from"), and the parameter's
    chunks and step count parted from torch's (a tryout, rare: a Ctrl-C early in the step)."""
    result = _interrupted(tmp_path, mode, "before")
    assert result["count"] == (3.0 if result["moved"] == 1.0 else 2.0), result
    assert result["moved"] in (0.0, 1.0), result  # whole or not at all
    assert result["same"], result


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_inside_the_math_under_a_programs_own_handler_applies_no_chunk_twice(tmp_path: Path, mode: str) -> None:
    """A program's own SIGINT handler that raises is left in place in ``step()``: the
    KeyboardInterrupt then leaves the math of a run of chunks that had updated them in place,
    and they were not recorded: the step's finish updated them a second time (a review)."""
    result = _interrupted(tmp_path, mode, "first", "own handler")
    assert result["moved"] == 1.0, result
    assert result["count"] == 3.0, result
    assert result["same"], result



def test_ctrl_c_while_a_run_started_in_backward_computes_applies_no_chunk_twice(tmp_path: Path) -> None:
    """With ``step_in_backward=True`` a run's math runs on the optimizer's worker thread; a
    Ctrl-C while it runs ended the run's wait cancelled once the job returned, its chunks
    unrecorded, and the step's finish updated them a second time (a review: 3 runs in 4)."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "d"), "plain", "worker", "default handler"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["outcome"] != "interrupted":
        pytest.skip(f"the interrupt landed after the step ended ({result})")
    assert result["count"] == 3.0, result
    assert result["same"], result


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_in_a_chunks_kernel_under_a_programs_own_handler_applies_it_once(tmp_path: Path, mode: str) -> None:
    """Raised by a program's own handler right after a chunk's kernel changed its state in
    place, KeyboardInterrupt left the chunk unrecorded, and the step's finish applied its update
    again (a review). Such a handler now runs once the step's work has ended."""
    result = _interrupted(tmp_path, mode, "mid-chunk", "own handler")
    assert result["moved"] == 1.0, result
    assert result["count"] == 3.0, result
    assert result["same"], result


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_before_the_step_began_ends_what_backward_launched(tmp_path: Path, mode: str) -> None:
    """With ``step_in_backward=True``, a Ctrl-C that cancelled the step's task before it began
    skipped the abandon: the runs of chunks launched in backward kept updating the parameter
    after ``KeyboardInterrupt`` left (a review)."""
    result = _interrupted(tmp_path, mode, "unbegun")
    assert result["changed_after"] == 0.0, result
    assert result["moved"] in (0.0, 1.0), result
    assert result["count"] == (3.0 if result["moved"] == 1.0 else 2.0), result
    assert result["same"], result


def test_a_second_ctrl_c_while_an_unbegun_step_is_abandoned_is_ignored(tmp_path: Path) -> None:
    """The abandon of a step cancelled before it began ran under the default handler again: a
    second Ctrl-C cut it, and the runs launched in backward went on after KeyboardInterrupt
    (a review: 4 runs in 5)."""
    result = _interrupted(tmp_path, "plain", "unbegun twice")
    assert result["changed_after"] == 0.0, result
    assert result["moved"] in (0.0, 1.0), result
    assert result["count"] == (3.0 if result["moved"] == 1.0 else 2.0), result
    assert result["same"], result
