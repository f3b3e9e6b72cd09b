"""A closed (or closing) device link never leaves a transfer pending: a copy already moving
bytes ends as usual, copies queued behind it and any asked for after fail with
``LinkClosedError`` at once, so whoever waits on them (a put, a buffer given back after its last
use, the interpreter's exit) goes on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tierstore import DeviceTier, HostTier, TierStore
from tierstore.device import TO_DEVICE, LinkSpec, Transfer
from tierstore.device.emulated import EmulatedLink
from tierstore.errors import LinkClosedError, TierStoreError

VALUE = 64 * 1024
SLOW = "1MB/s"  # a VALUE-byte copy takes ~65 ms
WAIT = 3.0  # seconds any transfer here may take, at most, before the test fails (it never hangs)


def value(n: int) -> torch.Tensor:
    return torch.full((VALUE // 4,), float(n))


def ended(transfer: Transfer) -> BaseException | None:
    """The error ``transfer`` ended with (None: it succeeded); fails if it does not end in time."""
    try:
        transfer.wait(WAIT)
    except TimeoutError:
        pytest.fail("the transfer never ended")
    except BaseException as exc:  # noqa: BLE001 - what the test looks at
        return exc
    return None


def closing(close: Callable[[], None]) -> threading.Thread:
    """``close()`` (a link's, a waiter's stop) on another thread, returned once it has started."""
    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    time.sleep(0.02)
    return closer


def test_error_type() -> None:
    assert issubclass(LinkClosedError, TierStoreError)
    assert issubclass(LinkClosedError, RuntimeError)  # what the emulated link raised before


def test_a_copy_asked_for_while_the_link_closes_fails_at_once() -> None:
    link = EmulatedLink(LinkSpec.parse(SLOW))
    running = link.to_device(torch.empty(4 * VALUE, dtype=torch.uint8), torch.ones(4 * VALUE, dtype=torch.uint8))  # ~260 ms
    time.sleep(0.02)
    closer = closing(link.close)  # waits for the running copy
    late = link.to_device(torch.empty(VALUE, dtype=torch.uint8), torch.ones(VALUE, dtype=torch.uint8))
    assert late.done(), "a copy asked of a closing link was queued"
    assert isinstance(ended(late), LinkClosedError)
    assert ended(running) is None  # the copy under way when the close started ends as usual
    closer.join(WAIT)
    assert not closer.is_alive()


def test_a_copy_asked_for_after_the_close_fails_at_once() -> None:
    link = EmulatedLink()
    link.close()
    for start in (link.to_device, link.to_host):
        transfer = start(torch.empty(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8))
        assert transfer.done()
        assert isinstance(ended(transfer), LinkClosedError)
    assert link.moved[TO_DEVICE] == [0, 0.0]  # nothing counted as moved


def test_copies_queued_behind_a_running_one_fail_when_the_link_closes() -> None:
    link = EmulatedLink(LinkSpec.parse(SLOW))
    dst = [torch.zeros(VALUE, dtype=torch.uint8) for _ in range(3)]
    transfers = [link.to_device(d, torch.ones(VALUE, dtype=torch.uint8)) for d in dst]
    time.sleep(0.02)  # the first is under way
    link.close()
    assert ended(transfers[0]) is None and bool(dst[0].eq(1).all())
    for transfer, d in zip(transfers[1:], dst[1:], strict=True):
        assert isinstance(ended(transfer), LinkClosedError), "a copy queued behind the close still ran"
        assert bool(d.eq(0).all())


def test_a_copy_waiting_for_its_after_when_the_link_closes_fails() -> None:
    link = EmulatedLink()
    kernels = Transfer("marker", 0)  # a caller's work that never ends
    waiting = link.to_host(torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8), after=kernels)
    behind = link.to_host(torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8))
    started = time.perf_counter()
    closer = closing(link.close)
    assert isinstance(ended(waiting), LinkClosedError)
    assert isinstance(ended(behind), LinkClosedError)
    closer.join(WAIT)
    assert not closer.is_alive() and time.perf_counter() - started < 2.0
    kernels.finish()


def test_done_callbacks_run_for_a_transfer_failed_by_the_close() -> None:
    link = EmulatedLink(LinkSpec.parse(SLOW))
    link.to_device(torch.empty(VALUE, dtype=torch.uint8), torch.ones(VALUE, dtype=torch.uint8))
    queued = link.to_device(torch.empty(VALUE, dtype=torch.uint8), torch.ones(VALUE, dtype=torch.uint8))
    seen: list[BaseException | None] = []
    queued.add_done_callback(lambda transfer: seen.append(ended(transfer)))
    link.close()
    assert len(seen) == 1 and isinstance(seen[0], LinkClosedError), f"the done-callback saw {seen}"


def _in_a_thread(coro: Any) -> Any:
    """Run ``coro`` on its own loop in a daemon thread; fail (instead of hanging the suite) if it
    does not end in time."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(15)
    if thread.is_alive():
        pytest.fail("the store hung on a copy the closed link never ran")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def test_a_put_started_while_the_link_closes_fails_and_the_store_closes() -> None:
    async def scenario() -> tuple[BaseException | None, BaseException | None, list[str]]:
        device = DeviceTier("cpu", 4 * VALUE, emulate_device=True)
        store = TierStore([device, HostTier("1MiB")])
        await store.open()
        link = device.link = EmulatedLink(LinkSpec.parse(SLOW))
        outcomes: list[BaseException | None] = []
        try:
            first = asyncio.ensure_future(store.put("a", value(1), tier="device"))
            await asyncio.sleep(0.01)
            closer = threading.Thread(target=link.close, daemon=True)
            closer.start()
            await asyncio.sleep(0.01)
            second = asyncio.ensure_future(store.put("b", value(2), tier="device"))
            for put in (first, second):
                try:
                    await asyncio.wait_for(asyncio.shield(put), WAIT)
                    outcomes.append(None)
                except BaseException as exc:  # noqa: BLE001 - what the test looks at
                    outcomes.append(exc)
            closer.join(WAIT)
            where_a = store.where("a")
        finally:
            await asyncio.wait_for(store.aclose(), WAIT)
        return outcomes[0], outcomes[1], where_a

    first, second, where_a = _in_a_thread(scenario())
    assert first is None and where_a == ["device"]
    assert isinstance(second, LinkClosedError), f"the put asked of a closing link: {second!r}"


# -- the CUDA link's event waiter, with stand-in events (its logic needs no GPU) --------------------


class _Event:
    """Stands in for a ``torch.cuda.Event``: ``synchronize()`` returns once ``fire()`` is called."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._fired = threading.Event()
        self._error = error

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        self._fired.wait()
        if self._error is not None:
            raise self._error


@pytest.fixture
def waiter(monkeypatch: pytest.MonkeyPatch) -> Any:
    from tierstore.device import cuda

    monkeypatch.setattr(cuda.torch.cuda, "set_device", lambda device: None)
    made = cuda._EventWaiter(torch.device("cpu"), "test-waiter")
    yield made
    made.stop()


def test_cuda_waiter_finishes_what_was_queued_before_its_stop_and_what_comes_after(waiter: Any) -> None:
    before, after = Transfer("to_host", 8), Transfer("to_host", 8)
    queued = _Event()
    waiter.put(queued, before)
    closer = closing(waiter.stop)  # stop() waits for the queued event
    queued.fire()  # (the GPU copy it marks ends: it had been given to the GPU)
    closer.join(WAIT)
    assert ended(before) is None
    fired = _Event()
    fired.fire()
    waiter.put(fired, after)  # a stopped waiter: waited for here, not left pending
    assert ended(after) is None
    failed = Transfer("to_host", 8)
    broken = _Event(RuntimeError("device lost"))
    broken.fire()
    waiter.put(broken, failed)
    assert isinstance(ended(failed), RuntimeError)


def test_cuda_link_refuses_a_copy_after_close(waiter: Any) -> None:
    from tierstore.device import cuda

    link = object.__new__(cuda.CudaLink)  # (no GPU here: the parts a refused copy touches)
    super(cuda.CudaLink, link).__init__(torch.device("cpu"))
    link._waiters = {TO_DEVICE: waiter}
    link._streams = {}
    waiter.stop()
    transfer = link.to_device(torch.empty(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8))
    assert transfer.done() and isinstance(ended(transfer), LinkClosedError)
