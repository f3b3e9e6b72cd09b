"""The helper pool of the C 8-bit AdamW kernel (``adam8.c``, through ``native.adam8``): the same
bits as one thread for every size and thread count; helpers started once, not at every call, at
most one fewer than the CPUs; calls from several Python threads at once; a forked child, whose
pool the fork left empty; a process that exits with the pool alive."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_native_adam8 import HYPER, _assert_same_bits, _run_c, _tile

from tierstore.optim import native
from tierstore.optim.precision import BLOCK

pytestmark = [
    pytest.mark.skipif(not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), reason="no C compiler here"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

#: The pool's threads, by the name ``adam8.c`` gives them.
HELPER = "tierstore-adam8"
SIZES = [2 * native.PER_THREAD, 3 * native.PER_THREAD + 5 * BLOCK, (1 << 20) + 3 * BLOCK]


@pytest.fixture(scope="module")
def built() -> native.Kernel:
    return native.build()  # (the AVX-512 code where this CPU has it, else the portable one)


def _helpers() -> int:
    count = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            count += (task / "comm").read_text().strip() == HELPER
    return count


def _most_helpers() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


@pytest.mark.parametrize("n", SIZES, ids=["2 x PER_THREAD", "3 x PER_THREAD + 5 blocks", "1M + 3 blocks"])
@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize(("lossless", "grad_dtype"), [(False, torch.float32), (True, torch.bfloat16)], ids=["fp32", "lossless bf16"])
def test_same_bits_as_one_thread(built: native.Kernel, n: int, threads: int, lossless: bool, grad_dtype: torch.dtype) -> None:
    one, many = _tile(lossless, grad_dtype, 11, n), _tile(lossless, grad_dtype, 11, n)
    for step in range(1, 4):  # (the same pool again at each step: a batch lost or done twice shows)
        s = HYPER.scalars(float(step))
        assert _run_c(one, s, built, 1) and _run_c(many, s, built, threads)
        _assert_same_bits(many, one)


def test_threads_are_started_once_not_at_every_call(built: native.Kernel) -> None:
    tile = _tile(False, torch.float32, 1, 4 * native.PER_THREAD)  # (native.adam8 asks for 4 threads at most)
    s = HYPER.scalars(1.0)
    assert _run_c(tile, s, built, 64)
    tasks = Path("/proc/self/task")
    before = {task.name for task in tasks.iterdir()}
    new: set[str] = set()
    most = len(before)
    for call in range(2000):
        assert _run_c(tile, s, built, 2 if call % 2 else 64)
        now = {task.name for task in tasks.iterdir()}
        new |= now - before
        most = max(most, len(now))
    assert len(new) <= 2, f"{len(new)} threads started over 2,000 calls"  # (2: any other thread of the process)
    assert most <= len(before) + 2, (most, len(before))
    # (a forked child's pool is this build's alone: the other builds' pools are the parent's)
    assert _in_child(lambda: _run_c(tile, s, built, 64) and _helpers()) == min(3, _most_helpers())


def test_concurrent_callers_get_the_same_bits(built: native.Kernel) -> None:
    n = 3 * native.PER_THREAD + 5 * BLOCK
    kinds = [(False, torch.float32), (True, torch.bfloat16), (False, torch.bfloat16)]
    tiles = [_tile(lossless, grad_dtype, 20 + i, n) for i, (lossless, grad_dtype) in enumerate(kinds)]
    wants = [_tile(lossless, grad_dtype, 20 + i, n) for i, (lossless, grad_dtype) in enumerate(kinds)]
    steps = 40
    for want in wants:
        for step in range(1, steps + 1):
            assert _run_c(want, HYPER.scalars(float(step)), built, 1)
    start = threading.Barrier(len(tiles))
    failures: list[BaseException] = []

    def calls(tile: dict[str, torch.Tensor], threads: int) -> None:
        try:
            start.wait()
            for step in range(1, steps + 1):
                assert _run_c(tile, HYPER.scalars(float(step)), built, threads)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failures.append(exc)

    callers = [threading.Thread(target=calls, args=(tile, 2 + i), daemon=True) for i, tile in enumerate(tiles)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=120)
        assert not caller.is_alive(), "a caller never returned"
    assert not failures, failures
    for tile, want in zip(tiles, wants, strict=True):
        _assert_same_bits(tile, want)


def test_a_forked_child_starts_a_pool_of_its_own(built: native.Kernel) -> None:
    # Forked while another thread calls the kernel again and again (its call holds the pool's
    # slot, or its lock, at the fork): the child's calls still get helpers and the same bits.
    n = 2 * native.PER_THREAD
    s = HYPER.scalars(3.0)
    want = _tile(True, torch.float32, 4, n)
    assert _run_c(want, s, built, 1)
    expected = _bytes(want)
    busy = _tile(False, torch.float32, 5, n)
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            _run_c(busy, s, built, 2)

    hammering = threading.Thread(target=hammer, daemon=True)
    hammering.start()
    try:
        for _ in range(4):
            tile = _tile(True, torch.float32, 4, n)
            time.sleep(0.01)
            report = _in_child(lambda tile=tile: _child_step(tile, s, built, expected))
            assert report == {"same": True, "helpers": 1}, report
    finally:
        stop.set()
        hammering.join(timeout=60)


def _child_step(tile: dict[str, torch.Tensor], s: torch.Tensor, built: native.Kernel, expected: dict[str, bytes]) -> dict[str, object]:
    assert _run_c(tile, s, built, 2)
    return {"same": _bytes(tile) == expected, "helpers": _helpers()}


def _bytes(tile: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Every field's bytes (no torch math: a forked child's torch pools are the parent's)."""
    return {name: value.view(torch.uint8).numpy().tobytes() for name, value in tile.items()}


def _in_child(work: object, timeout: float = 60.0) -> object:
    """``work()`` in a forked child, its result back through a pipe; fails on a child that hangs."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: never back into pytest)
        code = 1
        try:
            os.close(read)
            with os.fdopen(write, "wb") as out:
                pickle.dump(work(), out)  # type: ignore[operator]
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail("the forked child hung")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as done:
        data = done.read()
    assert data, "the forked child failed"
    return pickle.loads(data)


def test_a_process_exits_with_the_pool_alive() -> None:
    script = (
        "import torch, test_native_adam8 as t; from tierstore.optim import native; "
        "tile = t._tile(False, torch.float32, 0, 2 * native.PER_THREAD); "
        "assert t._run_c(tile, t.HYPER.scalars(1.0), native.build(), 2); print('called')"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "called", done.stderr[-2000:]


def test_helpers_compute_under_the_callers_flush_to_zero(built: native.Kernel) -> None:
    # torch.set_flush_denormal sets the calling thread's floating-point control alone; helpers
    # started before it kept theirs, so the moments of tiny gradients (subnormal values) came
    # out flushed or not by which thread took their block: different bits from run to run.
    n = 1 << 20
    generator = torch.Generator().manual_seed(0)
    base = {"master": torch.randn(n, generator=generator), "grad": torch.randn(n, generator=generator) * 1e-20,
            "m_codes": torch.full((n,), 127, dtype=torch.uint8), "m_scales": torch.zeros(n // BLOCK),
            "v_codes": torch.zeros(n, dtype=torch.uint8), "v_scales": torch.zeros(n // BLOCK)}
    s = HYPER.scalars(1.0)

    def call(threads: int) -> dict[str, torch.Tensor]:
        tile = {name: value.clone() for name, value in base.items()}
        assert _run_c(tile, s, built, threads)
        return tile

    call(2)  # (the pool's helpers start under the default control)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        one = call(1)
        for _ in range(6):
            _assert_same_bits(call(2), one)
    finally:
        torch.set_flush_denormal(False)
