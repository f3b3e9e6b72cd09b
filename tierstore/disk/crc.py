"""The disk tier's chunk checksum, CRC-32C, computed faster where the CPU allows.

The ``crc32c`` package runs the SSE4.2 crc32 instruction (about 25 GB/s on one core here);
``crc32c.c`` folds the buffer with carry-less multiplications (AVX-512 VPCLMULQDQ) first and
gives the same value about 2x faster (here 50-56 GB/s against 28 on a chunk in cache, 32
against 15 on one that is not). On this 2-core machine the package's checksum in each job of a
raw pwrite/preadv loop cost it 7-15% of its speed; with this one the disk tier's large-value
cells went from 0.77x to 0.83x of the raw loop, interleaved A/B
(``benchmarks/results/bench_tiers_disk_ab.json``). Same polynomial, same value: stores written
before read the same.

The C file is compiled at the first large checksum, on a thread of its own (the package serves
meanwhile), with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``; a fraction of
a second), and the library kept in ``$XDG_CACHE_HOME/tierstore`` (else ``~/.cache/tierstore``)
for the next processes (``tierstore.cbuild``); it is called
through ``ctypes`` (which lets the GIL go, as the package does). Where the CPU lacks
AVX-512 or VPCLMULQDQ, where no compiler builds it (one warning), or with
``TIERSTORE_NATIVE_CRC=0``, the ``crc32c`` package computes every checksum.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

from .. import cbuild

_SOURCE = Path(__file__).with_name("crc32c.c")
_FLAGS = ["-O2", "-fPIC", "-shared"]
#: Buffers of at least this many bytes go to the C code (below it a ctypes call's fixed cost,
#: about a microsecond, is a large part of the work).
NATIVE_MIN = 64 << 10
_CPU_FLAGS = ("avx512f", "avx512vl", "vpclmulqdq", "pclmulqdq", "sse4_2")

_lock = threading.Lock()
_function: Callable[[int, int, int], int] | None = None
_tried = False
_builder: threading.Thread | None = None


def cpu_supports() -> bool:
    """Whether this CPU has what ``crc32c.c`` uses (Linux's ``/proc/cpuinfo``; elsewhere: False)."""
    flags = cbuild.cpu_flags()
    return all(flag in flags for flag in _CPU_FLAGS)


def build() -> Callable[[int, int, int], int]:
    """Compile ``crc32c.c`` (or load this machine's earlier build of it from the user's cache
    folder: ``tierstore.cbuild``) and return ``f(crc, address, length)``. Raises
    ``RuntimeError`` (with the compiler's message) where it cannot be built."""
    function = cbuild.build(_SOURCE, _FLAGS).tierstore_crc32c
    function.restype = ctypes.c_uint32
    function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return function  # type: ignore[no-any-return]


def _build_once() -> None:
    global _function, _tried
    try:
        if os.environ.get("TIERSTORE_NATIVE_CRC", "1") != "0" and cpu_supports():
            try:
                _function = build()
            except Exception as exc:  # noqa: BLE001 - the crc32c package gives the same values
                warnings.warn(f"the fast CRC-32C is unavailable ({exc}); using the crc32c package", stacklevel=2)
    finally:
        _tried = True


def native(wait: bool = True) -> Callable[[int, int, int], int] | None:
    """This process's build of the C checksum, built (or loaded from the cache) on first use;
    None where it is turned off (``TIERSTORE_NATIVE_CRC=0``, read at the first call), the CPU
    lacks the instructions, or the build failed (warned once). ``wait=False``: start the build
    on a thread of its own and return None until it is done (a checksum never waits for a
    compiler: the package computes it meanwhile)."""
    global _builder
    if _tried:
        return _function
    with _lock:
        if _builder is None:
            _builder = threading.Thread(target=_build_once, name="tierstore-crc32c-build", daemon=True)
            _builder.start()
        builder = _builder
    if wait:
        builder.join()
    return _function if _tried else None


def crc32c_array(data: np.ndarray, crc: int = 0) -> int:
    """The CRC-32C of an array's bytes (in C order), continuing from ``crc`` (as
    ``crc32c.crc32c(data, crc)``)."""
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    nbytes = data.nbytes
    if nbytes >= NATIVE_MIN:
        function = _function if _tried else native(wait=False)
        if function is not None:
            return int(function(crc, data.__array_interface__["data"][0], nbytes))
    return int(crc32c.crc32c(data.data, crc))
