"""``Link``: the boundary between device memory and host memory, and the copies across it.

A link copies bytes between a device buffer and a host buffer on a *stream*: copies start in
the order they are asked for, after the caller's work that was queued before (a ``mark``), and
complete on the link's own thread, which resolves their ``Transfer``. Three implementations:

- ``CudaLink``: a CUDA device, one side stream per direction, completion from an event-waiting
  thread.
- ``EmulatedLink``: the CPU standing in for a device behind a link (``TIERSTORE_EMULATE_DEVICE=1``):
  every crossing is a real copy on a copy thread per direction, optionally at a set bandwidth
  and latency, so the timing of a GPU run (and its overlap with compute) is reproduced.
- ``HostLink``: no boundary at all (plain CPU). ``lends`` is True: code that would copy may use
  the memory itself.

The optimizer and ``tierstore.swap`` only ever talk to a ``Link``; which one is chosen by the
device and the emulation setting (``tierstore.device.link_for``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..tensors import as_bytes
from .transfer import Transfer

#: ``listener(direction, nbytes, started, ended)``, called on the link's thread as each copy ends.
TransferListener = Callable[[str, int, float, float], None]

TO_HOST = "to_host"
TO_DEVICE = "to_device"


class Link(ABC):
    """Copies between ``device`` memory and host memory (see the module docstring)."""

    #: True when device memory is host memory: a "copy" may lend the memory instead.
    lends: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._listeners: list[TransferListener] = []
        self._lock = threading.Lock()
        #: Bytes and seconds moved per direction, since the link was made.
        self.moved: dict[str, list[float]] = {TO_HOST: [0, 0.0], TO_DEVICE: [0, 0.0]}

    @property
    def name(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def mark(self) -> Any:
        """A point in the calling thread's queued work: a copy started ``after`` it reads what
        that work wrote. Call it on the thread that produced the data (CUDA: the current stream)."""
        return None

    def when_done(self, marker: Any) -> Transfer:
        """A ``Transfer`` of no bytes that ends when the work before ``marker`` has run (CUDA:
        the event completed), e.g. before a buffer the caller's kernels read may be reused."""
        return Transfer.completed("marker", 0)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Transfer:
        """Start copying device tensor ``src`` into host tensor ``dst`` (same byte size)."""
        return self._start(TO_HOST, dst, src, after)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Transfer:
        """Start copying host tensor ``src`` into device tensor ``dst`` (same byte size)."""
        return self._start(TO_DEVICE, dst, src, after)

    def _start(self, direction: str, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Transfer:
        dst_bytes, src_bytes = _bytes_of(dst), _bytes_of(src)
        if dst_bytes.numel() != src_bytes.numel():
            raise ValueError(f"a copy of {src_bytes.numel():,} bytes into a buffer of {dst_bytes.numel():,}")
        transfer = Transfer(direction, src_bytes.numel(), keep=(dst, src))
        transfer.add_done_callback(self._count)
        self._submit(transfer, dst_bytes, src_bytes, after)
        return transfer

    @abstractmethod
    def _submit(self, transfer: Transfer, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Queue the copy of ``src`` into ``dst`` (byte views); ``transfer.finish()`` when done."""

    def add_listener(self, listener: TransferListener) -> None:
        """Tell ``listener`` about each copy as it ends (for timelines and reports)."""
        with self._lock:
            self._listeners = [*self._listeners, listener]

    def remove_listener(self, listener: TransferListener) -> None:
        with self._lock:
            self._listeners = [x for x in self._listeners if x is not listener]

    def _count(self, transfer: Transfer) -> None:
        if transfer._error is not None:
            return
        with self._lock:
            moved = self.moved[transfer.direction]
            moved[0] += transfer.nbytes
            moved[1] += transfer.seconds
            listeners = self._listeners
        for listener in listeners:
            listener(transfer.direction, transfer.nbytes, transfer.started or 0.0, transfer.ended or 0.0)

    def close(self) -> None:
        """Stop the link's threads (links are shared per process; this is for tests)."""
        return None


class HostLink(Link):
    """No boundary: the "device" is host memory (plain CPU). Copies run at once on the caller's
    thread; ``lends`` tells callers they need not copy at all."""

    lends = True

    def _submit(self, transfer: Transfer, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        transfer.started = transfer.queued
        try:
            np.copyto(dst.numpy(), src.numpy())
        except BaseException as exc:
            transfer.finish(exc)
            raise
        transfer.finish()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("a link copies contiguous tensors only")
    return as_bytes(tensor)
