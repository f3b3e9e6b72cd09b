"""Copies between memory buffers (CPU, pinned host, CUDA), awaited from the event loop.

CPU-to-CPU copies run inline when small and on a worker thread when large (so the loop keeps
serving). A copy that touches a CUDA device runs on a side stream that first waits for the
current stream (the data may still be being produced there); the loop then awaits the copy's
event. A cancelled await still waits for the event before returning, so a buffer is never freed
while the GPU reads or writes it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from .workers import Priority, WorkerPool

#: CPU copies up to this size run inline on the loop (a thread hop costs more than the copy).
INLINE_COPY_BYTES = 1 << 20


async def copy_bytes(
    dst: torch.Tensor,
    src: torch.Tensor,
    *,
    pool: WorkerPool,
    stream: Any = None,
    priority: Priority = Priority.DEMAND,
) -> None:
    """Copy ``src`` into ``dst`` (same number of bytes, any devices)."""
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into a buffer of {dst.numel()}")
    if dst.device.type == "cpu" and src.device.type == "cpu":
        if dst.numel() <= INLINE_COPY_BYTES:
            cpu_copy(dst, src)
        else:
            await pool.run(lambda: cpu_copy(dst, src), priority)
        return
    device = dst.device if dst.device.type == "cuda" else src.device
    if stream is None:
        stream = torch.cuda.current_stream(device)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    await wait_event(event)


def cpu_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between CPU byte buffers with numpy: a single-threaded memcpy. ``torch.copy_`` would
    start an OpenMP team on this (loop or worker) thread that competes with the training
    thread's for the cores."""
    np.copyto(dst.numpy(), src.numpy())


async def wait_event(event: Any) -> None:
    """Wait for a CUDA event without blocking the loop (polling with a short back-off)."""
    delay = 20e-6
    try:
        while not event.query():
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1e-3)
    except asyncio.CancelledError:
        event.synchronize()  # never hand back a buffer the GPU is still using
        raise
