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


def test_ctrl_c_before_the_loop_starts_a_call_cancels_it(tmp_path: Path) -> None:
    """A Ctrl-C while the loop was still to start a blocking call (busy with another) reached
    the caller at once and left the call to start later: a ``pop`` the caller was told had been
    interrupted still removed the value, and a hold taken so was never let go (later steps of a
    parameter offload ran out of room). It is now cancelled, and has finished, before the
    ``KeyboardInterrupt`` reaches the caller, as one interrupted while running is."""
    import signal
    import threading
    import time

    import torch

    from tierstore import HostTier, SyncTierStore

    store = SyncTierStore([HostTier("1MiB")]).open()

    async def hog_the_loop() -> None:
        time.sleep(0.6)  # (a blocking call on the loop: the next call cannot start until it returns)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    store.put("weights", torch.ones(16))
    previous = signal.signal(signal.SIGALRM, interrupt)
    hog = threading.Thread(target=store.run, args=(hog_the_loop(),))
    try:
        hog.start()
        time.sleep(0.1)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            store.pop("weights")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        hog.join()
    time.sleep(0.2)
    assert torch.equal(store.get("weights"), torch.ones(16))
    assert torch.equal(store.pop("weights"), torch.ones(16))  # the store is still usable
    store.close()
