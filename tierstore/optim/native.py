"""The fused 8-bit AdamW update as a small C kernel (``adam8.c``), compiled at first use.

The inductor kernel of ``precision._adam8_fp32`` makes one pass over memory, but its code-book
lookups are vector gathers, slow on recent Intel cores (the "Downfall" microcode fix): about
half its time. On a CPU with AVX-512, ``adam8.c`` keeps both code books in registers (lookups
are permutes, an encode a binary search over the midpoints), block by block with the rows in
cache: 2.7 ns a parameter against the inductor kernel's 5.2 (fp32 master; 2.6x faster with a
lossless one), one core of this machine; a tile of at least 2 x ``PER_THREAD`` elements is shared
by up to torch's intra-op count of threads, which take its blocks in small batches (a thread the
machine is slow to run takes fewer, instead of delaying the call by a fixed part): the calling
thread and helpers of a pool that ``adam8.c`` starts at first need and keeps (at most one fewer
than the process's CPUs; none started per call; a forked child starts its own; a call made while
another thread's call holds the pool runs alone). It gives the same bits
(the same IEEE operations in the same order, no fused multiply-adds; a NaN takes code 255 as
the search tables give it), but for NaN payloads (a NaN in a block makes its scale and its
weights NaN in both, with other bits): ``tests/test_native_adam8.py`` checks
it against the inductor kernel, a plain reference and every thread count.

Without AVX-512 the portable loop runs, one block at a time as above, vectorised by the
compiler (256-bit registers with AVX2 under ``-march=native``, 128-bit SSE2 otherwise; its
lookups are scalar loads into the vectors): on an AMD EPYC (Zen 3, AVX2), 1M-element tiles,
3.4-5.0 ns a parameter on one thread and 2.3-3.8 on two, against the inductor kernel's 9-12 and
9-10 (the portable build without ``-march``: 6.8 and 3.5). Not measured on an Intel CPU without
AVX-512.

It is used wherever the fused kernel is (8-bit moments without amsgrad, parameters of at least
``precision.COMPILE_MIN_NUMEL`` elements, unless ``TIERSTORE_COMPILE_CODEC=0``) on x86 Linux:
built with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``; about 1 s, in the
first 8-bit step; the build is kept for the next processes: ``tierstore.cbuild``) and called
through ``ctypes`` (which lets the GIL go, so I/O threads run meanwhile). Elsewhere (not
measured there), or where the build fails (one warning), the inductor kernel runs.
``TIERSTORE_NATIVE_ADAM8=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import cbuild

_SOURCE = Path(__file__).with_name("adam8.c")
#: No contraction into fused multiply-adds (each product rounded, as torch's kernels do); no
#: errno from sqrtf, so its loop vectorises (results unchanged).
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]

_lock = threading.Lock()
_kernel: Kernel | None = None
_tried = False

#: Elements per quantisation block (``precision.BLOCK``; ``adam8.c``'s ``BLOCK``).
BLOCK = 256
#: Elements a thread takes at least: chosen when each call started its helpers (starting one cost
#: about a 16K-element tile's math); waking a helper of the pool costs less.
PER_THREAD = 1 << 16


def on_x86() -> bool:
    """Whether this machine is an x86 running Linux (where ``kernel()`` uses the C build)."""
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


class Kernel(NamedTuple):
    """A build of ``adam8.c``: its ``tierstore_adam8`` function, whether that is the AVX-512
    code, and whether its portable loop was compiled for AVX2."""

    function: Any
    avx512: bool
    avx2: bool = False


def build(*, vectorised: bool = True) -> Kernel:
    """Compile ``adam8.c`` (``kernel()`` does this once a process). ``vectorised``: for this
    machine's CPU (``-march=native``: its AVX-512 code where it has AVX-512, else the portable loop
    with this CPU's vectors, AVX2 say); False, the portable code for any CPU of its kind (also
    where ``TIERSTORE_NATIVE_MARCH=0``). Raises ``RuntimeError`` (with the compiler's
    message) where no C compiler builds it."""
    march = vectorised and os.environ.get("TIERSTORE_NATIVE_MARCH", "1") != "0"
    compiled = cbuild.build(_SOURCE, _FLAGS, optional=["-march=native"] if march else [])
    function = compiled.tierstore_adam8
    function.restype = None
    function.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 19
    compiled.tierstore_adam8_avx512.restype = ctypes.c_int
    compiled.tierstore_adam8_avx2.restype = ctypes.c_int
    return Kernel(function, bool(compiled.tierstore_adam8_avx512()), bool(compiled.tierstore_adam8_avx2()))


def kernel() -> Kernel | None:
    """This process's build of the kernel: built on first use on x86 Linux (warned once if that
    fails); None where it is turned off (``TIERSTORE_NATIVE_ADAM8=0``, read at each call), on
    other CPUs (the inductor kernel runs) or where the build failed."""
    global _kernel, _tried
    if os.environ.get("TIERSTORE_NATIVE_ADAM8", "1") == "0":
        return None
    if not _tried:
        with _lock:
            if not _tried:
                if on_x86():
                    try:
                        _kernel = build()
                    except Exception as exc:  # noqa: BLE001 - any build failure: the compiled kernel gives the same numbers
                        warnings.warn(f"the C 8-bit AdamW kernel is unavailable ({exc}); using the compiled one", stacklevel=4)
                _tried = True
    return _kernel


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _takes(tensor: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
    return tensor.dtype == dtype and tensor.numel() == numel and tensor.is_contiguous() and tensor.device.type == "cpu"


def adam8(
    master: torch.Tensor | None,
    halves: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
    scalars: torch.Tensor,
    built: Kernel | None = None,
    threads: int | None = None,
) -> bool:
    """One tile of whole blocks of the fused 8-bit update, in place: ``master`` (fp32) or
    ``halves`` (a lossless master's int16 low halves, the bf16 weight, the new weight's bf16
    out), ``moments`` (uint8 codes and fp32 scales of ``exp_avg``, then of ``exp_avg_sq``),
    ``grad`` (fp32 or bf16), ``scalars`` (``AdamHyper.scalars``). False, with nothing written,
    where the kernel cannot take them (not built; another dtype; sizes that are not whole blocks
    or do not agree; a tensor not contiguous or not in CPU memory): the caller then runs the
    compiled kernel. ``built``: a kernel from ``build`` (default: ``kernel()``); ``threads``
    (default: torch's intra-op threads), at most one per ``PER_THREAD`` elements: this one and
    helpers of the kernel's pool (see the module's notes). Safe from several threads at once."""
    built = built or kernel()
    numel = grad.numel()
    if built is None or numel % BLOCK or grad.dtype not in (torch.float32, torch.bfloat16):
        return False
    m_codes, m_scales, v_codes, v_scales = moments
    wanted = [(grad, grad.dtype, numel), (m_codes, torch.uint8, numel), (v_codes, torch.uint8, numel),
              (m_scales, torch.float32, numel // BLOCK), (v_scales, torch.float32, numel // BLOCK), (scalars, torch.float32, 10)]
    if master is not None:
        wanted.append((master, torch.float32, numel))
    elif halves is not None:
        wanted += list(zip(halves, (torch.int16, torch.bfloat16, torch.bfloat16), (numel,) * 3, strict=True))
    else:
        return False
    if not all(_takes(*want) for want in wanted):
        return False
    low, high, high_out = halves if halves is not None else (None, None, None)
    m_at, m_scales_at, v_at, v_scales_at = (t.data_ptr() for t in moments)
    _call(built, numel, _pointer(master), (_pointer(low), _pointer(high), _pointer(high_out)) if halves is not None else None,
          (m_at, m_scales_at, v_at, v_scales_at), grad.data_ptr(), grad.dtype == torch.bfloat16, scalars.data_ptr(), threads)
    return True


def adam8_at(
    built: Kernel,
    numel: int,
    master: int | None,
    halves: tuple[int | None, int | None, int | None] | None,
    moments: tuple[int, int, int, int],
    grad: int,
    grad_bf16: bool,
    scalars: int,
    threads: int | None = None,
) -> None:
    """``adam8`` on the addresses of its operands (``numel`` elements, whole blocks), for a
    caller that knows their dtypes, sizes and layout already (``PackedState``, whose fields lie
    at known offsets of one buffer): no tensor is made or looked at. Each torch call on the
    training thread lets go of the GIL, and getting it back waits for whichever thread holds it
    (the store's loop, an I/O worker) for up to the interpreter's switch interval: a chunk's
    views of its fields cost more than its kernel while the loop was busy (measured: about
    0.7 ms a chunk of the disk-bound 8-bit step, its kernel 0.9 ms). ``scalars``: ten fp32
    (``AdamHyper.scalar_values``)."""
    _call(built, numel, master, halves, moments, grad, grad_bf16, scalars, threads)


def _call(
    built: Kernel, numel: int, master: int | None, halves: tuple[int | None, int | None, int | None] | None,
    moments: tuple[int, int, int, int], grad: int, grad_bf16: bool, scalars: int, threads: int | None,
) -> None:
    low, high, high_out = halves if halves is not None else (None, None, None)
    grad32, grad16 = (None, grad) if grad_bf16 else (grad, None)
    threads = max(1, min(threads or torch.get_num_threads(), numel // PER_THREAD))
    built.function(threads, numel, master, low, high, high_out, *moments, grad32, grad16, scalars, *_tables())


#: ``adam8.c``'s search tables: magnitudes from 2**(LOW_EXPONENT - 127) to 1, by sign.
LOW_EXPONENT = 104
_LOWEST_HIGH, _ONE_HIGH = LOW_EXPONENT << 7, 0x3F80


#: The code-book tensors whose addresses ``_tables`` gives, and those addresses.
_table_tensors: tuple[torch.Tensor, ...] = ()
_table_addresses: tuple[int, ...] | None = None


def _tables() -> tuple[int, ...]:
    """The addresses ``tierstore_adam8`` takes, of each code book (signed, then unsigned): its
    values, its midpoints (+inf last) and ``search_tables``' two. The tensors are kept here,
    beside their addresses: the caches that make them keep one of the tensors that threads
    making them at once made, and the addresses taken from another thread's were of freed
    memory, read by every kernel call after (the moments came out wrong: a tryout, two
    optimizers' first steps at once)."""
    global _table_tensors, _table_addresses
    addresses = _table_addresses
    if addresses is None:
        from tierstore.optim.precision import _search_table, dynamic_map

        with _lock:
            if _table_addresses is None:
                _table_tensors = tuple(t for signed in (True, False)
                                       for t in (dynamic_map(signed), _search_table(signed)[1], *search_tables(signed)))
                _table_addresses = tuple(t.data_ptr() for t in _table_tensors)
            addresses = _table_addresses
    return addresses


@functools.cache
def search_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``precision._kernel_tables(signed)`` cut to what ``adam8.c`` indexes: the entries of
    normalised magnitudes from ``2**(LOW_EXPONENT - 127)`` to 1, for each sign. The C code
    clamps every smaller magnitude to the first entry, so that entry is the one that codes
    them all as the full table does (checked here on every such bucket's ends): zero's (the
    unsigned book gives 0 code 0 and any positive value a code above it), else the first
    bucket's own where every smaller one has the same."""
    from tierstore.optim.precision import _kernel_tables, _midpoints, exact_values

    table, above = _kernel_tables(signed)
    mid = _midpoints(signed).double()  # (compared in float64: ``exact_values``)
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    for sign in (0, 1):
        base = sign << 15
        high = torch.arange(base, base + _LOWEST_HIGH + 1, dtype=torch.int32)
        ends = exact_values(torch.cat([high << 16, (high << 16) | 0xFFFF]))
        want = torch.bucketize(ends, mid)
        for first in (base, base + _LOWEST_HIGH):  # (zero's rule, then the first bucket's)
            if torch.equal(table[first] + (ends > above[first].double()).long(), want):
                break
        else:
            raise AssertionError("internal error: the code book has codes below the C kernel's smallest magnitude")
        rest = slice(base + _LOWEST_HIGH + 1, base + _ONE_HIGH + 1)
        rows.append((torch.cat([table[first : first + 1], table[rest]]), torch.cat([above[first : first + 1], above[rest]])))
    return torch.cat([r[0] for r in rows]).contiguous(), torch.cat([r[1] for r in rows]).contiguous()
