"""Torch's CPU ops on the store's own threads run on those threads alone.

A thread that calls a parallel torch CPU op gets an OpenMP team of its own: libgomp keeps a
pool of worker threads for each calling thread, for the life of that thread. Once the process
has more OpenMP threads than CPUs, libgomp shortens every team's spin-wait (its "throttled"
spin count), so the training thread's forward and backward put their workers to sleep and
wake them through the kernel at nearly every op. Measured on a 2-core machine: the demo
model's forward + backward went from 24 ms to 32-52 ms once two idle threads had each run one
large copy, and stayed at 22-24 ms when those threads ran it serially.

So every thread the store starts (event loop, I/O and copy workers, the catalog's writer, the
emulated link) calls :func:`run_ops_serially` first: the store's threads work in parallel with
each other and with the user's threads, never inside one op. The one exception is the thread
that runs the optimizer's update during backward: that math is the user's compute, and on a
GPU host it is the CPU's main work. The user's threads are left as torch set them.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

import torch

_OPENMP_LIBRARIES = ("libgomp", "libomp", "libiomp")


@functools.cache
def _omp_set_num_threads() -> Any:
    """The ``omp_set_num_threads`` of the OpenMP runtime torch uses, or None (no OpenMP)."""
    if not torch.backends.openmp.is_available():
        return None
    candidates: list[str | None] = []
    if sys.platform.startswith("linux"):
        # The runtime torch loaded (its wheel ships one): a symbol looked up globally could
        # belong to another library's OpenMP, whose setting torch would never read.
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if any(name in line for name in _OPENMP_LIBRARIES)}
        except OSError:
            paths = set()
        candidates += [path for path in paths if "torch" in path] + [path for path in paths if "torch" not in path]
    candidates.append(None)  # the process's global symbols
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def run_ops_serially() -> None:
    """Make the torch CPU ops this thread calls run on this thread alone (OpenMP's
    per-thread team size set to 1); a no-op where torch has no OpenMP runtime. Other
    threads, and ``torch.get_num_threads()`` on them, are not changed."""
    setter = _omp_set_num_threads()
    if setter is None:
        return
    # Torch sets a thread's team size when the thread first asks for it; asking first keeps
    # that first-use setting from overwriting this one later.
    torch.get_num_threads()
    setter(1)
