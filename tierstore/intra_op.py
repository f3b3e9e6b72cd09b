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
that runs the optimizer's update during backward behind a device link: that math is the user's
compute, and on a GPU host it is the CPU's main work (where the model computes on the CPU too,
it runs serially like the others). The user's threads are left as torch set them.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Any

import torch

_OPENMP_LIBRARIES = ("libgomp", "libomp", "libiomp")
#: The setter found to work on an earlier thread (tried first on the next).
_working: Any = None


@functools.cache
def _setters() -> tuple[Any, ...]:
    """Every ``omp_set_num_threads`` that may be the one of the OpenMP runtime torch uses: the
    OpenMP libraries mapped into the process (those under torch's folder first), then the
    process's global symbol; none without OpenMP."""
    if not torch.backends.openmp.is_available():
        return ()
    paths: list[str] = []
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    path = fields[5].strip() if len(fields) == 6 else ""
                    if any(name in path.rsplit("/", 1)[-1] for name in _OPENMP_LIBRARIES) and path not in paths:
                        paths.append(path)
        except OSError:
            pass
    torch_folder = str(Path(torch.__file__).parent)
    candidates: list[str | None] = [*sorted(paths, key=lambda path: not path.startswith(torch_folder)), None]
    found = []
    for candidate in candidates:
        try:
            found.append(ctypes.CDLL(candidate).omp_set_num_threads)
        except Exception:  # (not loadable, no such symbol; on Windows CDLL(None) is a TypeError)
            continue
    return tuple(found)


def run_ops_serially() -> None:
    """Make the torch CPU ops this thread calls run on this thread alone (OpenMP's
    per-thread team size set to 1); a no-op where torch has no OpenMP runtime or none of the
    runtimes found is the one torch reads. Other threads, and ``torch.get_num_threads()`` on
    them, are not changed. Never raises: it only saves cores.

    Not covered: MKL's own thread count (``torch.set_num_threads`` sets it per thread too, for
    matrix products) and ``torch.compile``d CPU kernels (their thread count is fixed when
    compiled); the store's threads run neither."""
    global _working
    try:
        # Torch sets a thread's team size when the thread first asks for it; asking first keeps
        # that first-use setting from overwriting this one later.
        if torch.get_num_threads() == 1:
            return
        setters = _setters()
        for setter in ([_working] if _working is not None else []) + [s for s in setters if s is not _working]:
            setter(1)
            if torch.get_num_threads() == 1:  # (torch reads the runtime it linked: this one)
                _working = setter
                return
    except Exception:
        return
