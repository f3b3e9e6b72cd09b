"""Ctrl-C during ``opt.step()``: KeyboardInterrupt reaches the caller, and the optimizer, its store
and the process stay usable. The step's math runs on the training thread while it waits; an
interrupt there was handed to the step's coroutine, raised out of the store's event loop, ended
the loop thread, and the training thread waited for it forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import _thread, signal, sys, threading, time, torch
# (a process started in the background, as CI's may be, inherits SIGINT ignored: Python's own
# handler is what an interactive run has, and what Ctrl-C goes through)
signal.signal(signal.SIGINT, signal.default_int_handler)
from tierstore.device import emulate_device
from tierstore.optim import TieredAdamW

with emulate_device(sys.argv[2] == "emulated"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(12)))
    opt = TieredAdamW(model.parameters(), offload="disk", disk_root=sys.argv[1], host_capacity="4MiB")

    def step():
        opt.zero_grad()
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()

    step()
    started = time.perf_counter(); step(); took = time.perf_counter() - started
    interrupted = 0
    for fraction in (0.05, 0.2, 0.4, 0.6, 0.8):
        timer = threading.Timer(took * fraction, _thread.interrupt_main)
        try:
            opt.zero_grad()
            model(torch.randn(4, 512)).square().mean().backward()
            timer.start()
            opt.step()
            time.sleep(took)  # (an interrupt after the step lands here,
            timer.join()  # or here if the timer thread was starved)
        except KeyboardInterrupt:
            interrupted += 1
            timer.join()
    step()  # the store and the optimizer still work
    opt.close()
    print("interrupted", interrupted)
"""


@pytest.mark.parametrize("mode", ["plain", "emulated"])
def test_ctrl_c_during_step_leaves_everything_usable(tmp_path: Path, mode: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "s"), mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interrupted 5" in done.stdout, done.stdout + done.stderr[-2000:]
