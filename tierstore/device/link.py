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

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..tensors import as_bytes
from .transfer import Transfer

_log = logging.getLogger("tierstore.device")

#: ``listener(direction, nbytes, started, ended)``, called on the link's thread as each copy ends.
TransferListener = Callable[[str, int, float, float], None]

TO_HOST = "to_host"
TO_DEVICE = "to_device"


class _Ready:
    """See ``READY``."""

    def __repr__(self) -> str:
        return "READY"


#: A marker of no work to wait for: a copy ``after=READY`` may start at once (its source is a
#: buffer no kernel of the caller's is using, e.g. one tier's copy moving to another).
READY = _Ready()


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

    def passed(self, marker: Any) -> bool:
        """Whether the work before ``marker`` has run already (CUDA: the event completed); asks,
        never waits."""
        return self.when_done(marker).done()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Transfer:
        """Start copying device tensor ``src`` into host tensor ``dst``: the same byte size when
        both are contiguous; else (a channels-last or transposed tensor) the same dtype and number
        of elements, copied in logical (row-major) order, a contiguous side taking the other's shape."""
        return self._start(TO_HOST, dst, src, after)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: Any = None) -> Transfer:
        """Start copying host tensor ``src`` into device tensor ``dst`` (as ``to_host``)."""
        return self._start(TO_DEVICE, dst, src, after)

    def _start(self, direction: str, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Transfer:
        dst_view, src_view = _copy_views(dst, src)
        transfer = Transfer(direction, src_view.numel() * src_view.element_size(), keep=(dst, src))
        transfer.add_done_callback(self._count)
        self._submit(transfer, dst_view, src_view, after)
        return transfer

    @abstractmethod
    def _submit(self, transfer: Transfer, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Queue the copy of ``src`` into ``dst`` (byte views, or tensors of one shape and dtype
        when either is not contiguous: ``copy_into``); ``transfer.finish()`` when done."""

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
            try:
                listener(transfer.direction, transfer.nbytes, transfer.started or 0.0, transfer.ended or 0.0)
            except Exception:  # noqa: BLE001 - one listener's error: logged, the others still hear
                _log.exception("link listener %r raised", listener)

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
            copy_into(dst, src)
        except BaseException as exc:
            transfer.finish(exc)
            raise
        transfer.finish()


def _copy_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a copy of ``src`` into ``dst`` moves: their bytes when both are contiguous; else
    both as one shape (a weight kept flat on the host goes into a channels-last parameter element
    by element, not byte by byte, which would scramble it; a conjugate or negative view's bytes
    are not its values either: torch's copy resolves it)."""
    if dst.is_contiguous() and src.is_contiguous() and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg()):
        dst_bytes, src_bytes = as_bytes(dst), as_bytes(src)
        if dst_bytes.numel() != src_bytes.numel():
            raise ValueError(f"a copy of {src_bytes.numel():,} bytes into a buffer of {dst_bytes.numel():,}")
        return dst_bytes, src_bytes
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(
            f"a copy to or from a tensor that is not contiguous needs the same dtype and number of elements: "
            f"{src.numel():,} x {src.dtype} into {dst.numel():,} x {dst.dtype}"
        )
    dst, src = dst.detach(), src.detach()
    if dst.shape != src.shape:
        if dst.is_contiguous():
            dst = dst.view(src.shape)
        elif src.is_contiguous():
            src = src.view(dst.shape)
        else:
            raise ValueError(f"a copy between two tensors that are not contiguous needs one shape, not {tuple(src.shape)} and {tuple(dst.shape)}")
    return dst, src


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy on the CPU what ``Link._submit`` was given (byte views, or tensors of one shape)."""
    if dst.dtype == torch.uint8 and dst.is_contiguous() and src.is_contiguous():
        np.copyto(dst.numpy(), src.numpy())  # releases the GIL for the whole copy
    else:
        dst.copy_(src)
