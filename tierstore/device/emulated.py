"""``EmulatedLink``: the CPU standing in for a device behind a link (PCIe, NVLink-C2C).

Each direction has a copy thread (a GPU's copy engine): copies run one after another in the
order they were started, each a real memcpy of the bytes as they are when the copy runs (not
when it was asked for, as on a GPU stream), stretched to the link's bandwidth and latency when
those are set. The pace is kept on a virtual clock (each copy ends ``spec.seconds(nbytes)`` after
the previous one ended or it started, whichever is later), so the link's throughput is exact
even where the operating system cannot sleep as briefly as one small copy takes. Work on the
CPU is synchronous, so a caller's ``mark()`` is always complete; a
copy ``after`` another ``Transfer`` waits for it (ordering across the two directions).

``close()`` lets a copy that is moving bytes end as usual; copies queued behind it, and any
asked for later, do not run: their transfers fail with ``LinkClosedError`` (none stays pending).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from ..errors import LinkClosedError
from ..intra_op import run_ops_serially
from .link import TO_DEVICE, TO_HOST, Link, copy_into
from .spec import LinkSpec
from .transfer import Transfer

#: Below this, a copy does not sleep off what it owes the link's pace but leaves it to the copies
#: queued after it (a sleep this short overshoots by more than it lasts).
_MIN_SLEEP = 5e-4


class EmulatedLink(Link):
    """See the module docstring. ``spec`` sets bandwidth and latency (None: memcpy speed)."""

    def __init__(self, spec: LinkSpec | None = None) -> None:
        super().__init__(torch.device("cpu"))
        self.spec = spec or LinkSpec()
        self._streams = {direction: _CopyStream(f"tierstore-link-{direction}", self.spec) for direction in (TO_HOST, TO_DEVICE)}

    @property
    def name(self) -> str:
        return f"EmulatedLink({self.spec})"

    def _submit(self, transfer: Transfer, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        self._streams[transfer.direction].put(transfer, dst, src, after)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.stop()


class _CopyStream:
    """One copy thread: a FIFO of copies, each run after its ``after`` transfer, at ``spec``'s pace."""

    def __init__(self, name: str, spec: LinkSpec) -> None:
        self._spec = spec
        self._free_at = 0.0  # when the link finishes what it was given, on the virtual clock
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False  # set (under _lock) together with the stop marker: nothing is queued after it
        self._wake = threading.Event()  # (a copy waiting for its ``after`` transfer: see _run)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, transfer: Transfer, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        with self._lock:
            if not self._closed and self._thread.is_alive():
                self._queue.put((transfer, dst, src, after))
                return
        transfer.finish(LinkClosedError(f"a {transfer.nbytes:,}-byte copy {transfer.direction} was asked of a closed emulated link"))

    def stop(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        run_ops_serially()  # (a copy engine, not the CPU's cores)
        while True:
            job = self._queue.get()
            if job is None:
                return
            transfer, dst, src, after = job
            try:
                if isinstance(after, Transfer):
                    # Woken by its end or by the link's close (a copy still waiting for it then
                    # does not run): the callback and ``stop`` both set ``_wake``.
                    after.add_done_callback(lambda _: self._wake.set())
                    while True:
                        self._wake.clear()
                        if after.done() or self._closed:
                            break
                        self._wake.wait()
                    if after.done():
                        after.wait()  # its error, if it failed
                if self._closed:
                    raise LinkClosedError(f"the emulated link was closed before this {transfer.nbytes:,}-byte copy {transfer.direction} started")
                transfer.started = started = time.perf_counter()
                if transfer.nbytes:
                    copy_into(dst, src)
                self._free_at = max(self._free_at, started) + self._spec.seconds(transfer.nbytes)
                pause = self._free_at - time.perf_counter()
                if pause > _MIN_SLEEP or (pause > 0 and self._queue.empty()):
                    time.sleep(pause)  # shorter debts carry over to the next copy: sleep overshoots
            except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the transfer
                transfer.finish(exc)
            else:
                transfer.finish()
            del job, transfer, dst, src, after  # do not keep the last copy's buffers alive
