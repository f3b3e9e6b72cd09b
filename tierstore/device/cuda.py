"""``CudaLink``: copies between a CUDA device and host memory on side streams.

Per direction one side stream (so a write-back never queues behind a prefetch). A copy first
waits for the caller's ``mark()`` (an event recorded on the caller's *current* stream, whatever
stream that is), or for the current stream of the thread that starts it. Device tensors a copy
touches are recorded on the side stream (``record_stream``), so the caching allocator does not
hand their memory out again before the copy ran. Completion comes from an event-waiting thread
per stream (``event.synchronize()``, no polling) that finishes the ``Transfer``.

``close()`` stops those threads once they finished what was queued to them (copies the GPU was
given run there regardless). A copy asked for after is refused (its transfer fails with
``LinkClosedError``, nothing is queued on the GPU); an event handed to a stopped waiter
(``when_done``, or a copy that raced the close) is waited for on a short-lived thread of its own.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from ..errors import LinkClosedError
from .link import READY, TO_DEVICE, TO_HOST, Link
from .transfer import Transfer


class CudaLink(Link):
    """See the module docstring."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaLink takes a CUDA device, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self._streams = {direction: torch.cuda.Stream(device) for direction in (TO_HOST, TO_DEVICE)}
        self._waiters = {direction: _EventWaiter(device, f"tierstore-cuda-{direction}") for direction in (TO_HOST, TO_DEVICE)}

    def stream(self, direction: str) -> Any:
        """The side stream copies in ``direction`` run on."""
        return self._streams[direction]

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def passed(self, marker: Any) -> bool:
        return marker is None or bool(marker.query())

    def when_done(self, marker: Any) -> Transfer:
        transfer = Transfer("marker", 0)
        if marker is None:
            transfer.finish()
        else:
            self._waiters[TO_HOST].put(marker, transfer)
        return transfer

    def _submit(self, transfer: Transfer, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        if self._waiters[transfer.direction].closed:
            transfer.finish(LinkClosedError(f"a {transfer.nbytes:,}-byte copy {transfer.direction} was asked of a closed CUDA link"))
            return
        stream = self._streams[transfer.direction]
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        elif after is READY:
            pass  # nothing queued elsewhere touches these buffers
        elif isinstance(after, Transfer):
            after.wait()  # another direction's copy: rare, and its event is not at hand
        else:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            for tensor in (dst, src):
                if tensor.is_cuda:
                    tensor.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        self._waiters[transfer.direction].put(event, transfer)

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.stop()


class _EventWaiter:
    """A thread that waits for CUDA events in order and finishes their transfers."""

    def __init__(self, device: torch.device, name: str) -> None:
        self._device = device
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: Set (under ``_lock``) together with the stop marker: nothing is queued after it.
        self.closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, event: Any, transfer: Transfer) -> None:
        with self._lock:
            if not self.closed:
                self._queue.put((event, transfer))
                return
        # The thread stopped: nothing would finish it. Waited for on a thread of its own, not
        # the caller's (the store's event loop gives buffers back through ``when_done``).
        threading.Thread(target=_finish_after, args=(event, transfer), name="tierstore-cuda-late-event", daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        torch.cuda.set_device(self._device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            event, transfer = job
            _finish_after(event, transfer)
            del job, event, transfer


def _finish_after(event: Any, transfer: Transfer) -> None:
    """Wait for ``event`` on this thread, then finish ``transfer`` (with the error, if any)."""
    try:
        event.synchronize()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the transfer
        transfer.finish(exc)
    else:
        transfer.finish()
