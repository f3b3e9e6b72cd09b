"""What the store knows about a tensor: dtype names, validation, byte views and aligned buffers.

Tensors are stored as raw bytes plus ``TensorMeta`` (dtype name, shape, nbytes). Nothing is
pickled; dtypes are written by name and read back through a fixed table.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .errors import CorruptionError, InvalidTensorError
from .units import round_up

#: Alignment of the store's own buffers and disk extents (what O_DIRECT asks for).
ALIGNMENT = 4096

#: The classes of a plain tensor: ``type(t) in PLAIN_TENSOR_TYPES`` is false for a subclass
#: (a DTensor, a tensor wrapper, a user's subclass), whose memory may not hold its value as is.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex128,
        torch.complex64,
        torch.complex32,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint64,
        torch.uint32,
        torch.uint16,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2,
        torch.float8_e5m2fnuz,
        getattr(torch, "float8_e8m0fnu", torch.float8_e5m2),
    )
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The name under which ``dtype`` is stored, e.g. ``"bfloat16"``."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidTensorError(f"tensors of dtype {dtype} cannot be stored") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype stored under ``name``; raises ``ValueError`` for an unknown name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def supported_dtypes() -> list[torch.dtype]:
    """Every dtype the store can hold."""
    return list(_NAMES)


@dataclass(frozen=True)
class TensorMeta:
    """Dtype, shape and size of a stored tensor (always stored contiguous, C order)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @cached_property  # (asked for on every move of a value; a store keeps few distinct metas)
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tensor.dtype, tuple(tensor.shape))

    def to_json(self) -> dict[str, object]:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, record: dict[str, object]) -> TensorMeta:
        dtype = dtype_from_name(str(record["dtype"]))
        shape = record["shape"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad shape {shape!r}")
        return cls(dtype, tuple(shape))


def check_tensor(tensor: object) -> torch.Tensor:
    """Return ``tensor`` as the store holds it, or raise ``InvalidTensorError``.

    Accepted: dense (strided) tensors on the CPU or a CUDA device, of any dtype in
    :func:`supported_dtypes`, contiguous or not (non-contiguous ones are stored as a contiguous
    copy: their strides are not kept). Lazy conjugate and negative views (``x.conj()``,
    ``x.conj().imag``) are returned resolved, a copy holding the values they show, so their bytes
    are those values. Refused: non-tensors, sparse, meta, quantized, nested, and tensors on
    other devices.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise InvalidTensorError("nested tensors cannot be stored")
    if tensor.layout != torch.strided:
        raise InvalidTensorError(f"only dense (strided) tensors can be stored, not {tensor.layout}")
    if tensor.is_meta:
        raise InvalidTensorError("meta tensors have no data to store")
    if tensor.is_quantized:
        raise InvalidTensorError("quantized tensors cannot be stored; store their int_repr() and scales")
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidTensorError(f"tensors on {tensor.device} cannot be stored (cpu and cuda only)")
    dtype_name(tensor.dtype)
    # A conj or neg view shares the original's memory, which holds the unconjugated values:
    # its raw bytes are not its value (and torch refuses to reinterpret them).
    return tensor.resolve_conj().resolve_neg()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-d and empty tensors included)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


def memory_order(tensor: torch.Tensor) -> list[int] | None:
    """The order of dimensions in which ``tensor`` is contiguous (its memory order: a transposed
    or channels_last tensor's); None for a contiguous tensor, and for one with gaps or overlaps
    (no such order)."""
    if tensor.is_contiguous() or tensor.dim() < 2:
        return None
    dims = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return dims if tensor.permute(dims).is_contiguous() else None


def from_bytes(raw: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """View the first ``meta.nbytes`` bytes of a uint8 buffer as a tensor described by ``meta``."""
    data = raw[: meta.nbytes]
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=meta.dtype, device=raw.device)
    if data.numel() != meta.nbytes:  # (a record whose bytes disagree with its metadata; the view below would give a short value)
        raise CorruptionError(f"a {meta.dtype} value of shape {tuple(meta.shape)} needs {meta.nbytes} bytes; only {raw.numel()} were stored")
    if meta.dtype != torch.uint8:
        data = data.view(meta.dtype)
    # (a flat value is that view already: each torch call from the loop lets go of the GIL)
    return data if len(meta.shape) == 1 else data.view(meta.shape)


def aligned_empty(nbytes: int, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` (rounded up to ``ALIGNMENT``) whose address is 4096-aligned.

    CPU tensors are only 64-byte aligned, so we over-allocate and slice; the slice keeps the
    storage alive. CUDA and pinned allocations are already page aligned. (Tiers allocate with
    :func:`mapped_empty`, which has no slack; for transient buffers like these the heap is
    faster: it reuses memory already faulted in, where a new mapping faults every page.)
    """
    size = round_up(max(nbytes, 1), ALIGNMENT)
    device = torch.device(device)
    if device.type != "cpu" or pin_memory:
        return torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin_memory)
    raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGNMENT
    return advise_huge_pages(raw[start : start + size])


def page_empty(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of exactly ``nbytes`` rounded up to ``ALIGNMENT``, 4096-aligned, for a
    tier's buffers: from the C heap (``posix_memalign``) below ``HEAP_LIMIT``, else (and when
    pinned, or when the C library cannot be reached) a private mapping of its own.

    Small buffers come from the heap, which reuses memory the process already faulted in. Large
    ones are mappings because the heap does not give freed memory back: glibc raises its mmap
    threshold to the largest block freed (up to 32 MiB), after which every tier buffer up to
    that size is carved from per-thread arenas, and the buffers a tier drops (evicted or handed
    over) stayed in the process, fragmented across arenas: with weights and state paged through
    the tiers, RSS climbed by hundreds of MiB a step while the tiers' accounting stayed flat. A
    mapping goes back to the system when its last tensor is freed, so the process holds what the
    tiers count (the tiers' own pools keep warm buffers for reuse, inside their capacity). The
    storage is exactly the rounded size. Buffers of at least ``HUGE_PAGE`` ask for huge pages.
    """
    size = round_up(max(nbytes, 1), ALIGNMENT)
    if pin_memory or _libc is None or size >= HEAP_LIMIT:
        return mapped_empty(size, pin_memory=pin_memory)
    address = ctypes.c_void_p()
    if _libc.posix_memalign(ctypes.byref(address), ctypes.c_size_t(ALIGNMENT), ctypes.c_size_t(size)) != 0:
        raise MemoryError(f"posix_memalign of {size} bytes failed")
    block = (ctypes.c_uint8 * size).from_address(address.value)  # type: ignore[arg-type]
    # Freed when the last tensor on it goes, never at interpreter exit: weakref.finalize runs
    # what is pending then, while tensors (and I/O threads) may still use the block (a segfault).
    weakref.finalize(block, _libc.free, ctypes.c_void_p(address.value)).atexit = False
    return advise_huge_pages(torch.frombuffer(block, dtype=torch.uint8))


#: ``cudaHostRegisterPortable``: the pages are pinned for every CUDA context, as
#: ``torch.empty(..., pin_memory=True)`` memory is.
_CUDA_HOST_REGISTER_PORTABLE = 1


class _Mapping(mmap.mmap):
    """A private anonymous mapping that, once :meth:`pin` succeeds, stays page-locked for CUDA
    until it is unmapped (the lock is dropped first, as CUDA requires)."""

    _pinned_at: int = 0
    _pinned_by: int = 0

    def pin(self, address: int) -> None:
        error = int(torch.cuda.cudart().cudaHostRegister(address, len(self), _CUDA_HOST_REGISTER_PORTABLE))
        if error:
            raise RuntimeError(f"cudaHostRegister of {len(self)} bytes failed with cudaError {error}")
        self._pinned_at, self._pinned_by = address, os.getpid()

    def __del__(self) -> None:
        # A forked child's copy of the pages was never registered in the child; at interpreter
        # exit the CUDA runtime may be gone, and the process's pinned memory goes with it.
        if self._pinned_at and self._pinned_by == os.getpid() and not sys.is_finalizing():
            error = int(torch.cuda.cudart().cudaHostUnregister(self._pinned_at))
            if error:  # a finalizer cannot raise; say so rather than stay silent
                warnings.warn(f"cudaHostUnregister failed with cudaError {error}", ResourceWarning, stacklevel=1)


def mapped_empty(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` rounded up to ``ALIGNMENT``, in an anonymous private
    mapping of its own.

    A mapping starts on a page boundary, so nothing is allocated beyond the rounded size to
    align it, and it goes back to the system when the last tensor viewing it is freed. Buffers of
    at least ``HUGE_PAGE`` ask for transparent huge pages. ``pin_memory`` page-locks it for
    asynchronous CUDA copies (``cudaHostRegister``) for as long as it lives.

    Parameters
    ----------
    nbytes:
        Bytes needed; the buffer holds ``nbytes`` rounded up to a multiple of ``ALIGNMENT``.
    pin_memory:
        Page-lock the buffer (needs CUDA).

    Returns
    -------
    torch.Tensor
        A contiguous uint8 tensor whose storage is exactly the mapping (not resizable).
    """
    size = round_up(max(nbytes, 1), ALIGNMENT)
    # MAP_PRIVATE: a forked child (DataLoader workers fork) gets copy-on-write pages, not a view
    # that writes through to ours; shared anonymous memory would also never get huge pages.
    mapping = _Mapping(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = advise_huge_pages(torch.frombuffer(mapping, dtype=torch.uint8))  # before pinning faults pages in
    if pin_memory:
        mapping.pin(buffer.data_ptr())
    return buffer


#: Buffers at least this large ask the kernel for transparent huge pages.
HUGE_PAGE = 2 << 20
#: Tier buffers of at least this many bytes are mappings of their own (see ``page_empty``).
HEAP_LIMIT = 1 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(buffer: torch.Tensor) -> torch.Tensor:
    """Ask Linux to back a large, page-aligned CPU buffer with 2 MiB pages (where the system
    leaves that to madvise). Disk transfers into such memory measured about 1.5x faster here:
    O_DIRECT pins one page per 2 MiB instead of 512. Elsewhere this does nothing."""
    if buffer.numel() < HUGE_PAGE or buffer.device.type != "cpu" or _libc is None:
        return buffer
    _libc.madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel()), _MADV_HUGEPAGE)
    return buffer


def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_libc = _load_libc()


def empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor whose memory starts on a 4096-byte boundary and is padded to a whole block:
    ``store.put`` writes it to disk and ``store.get(..., out=)`` reads into it with no copy."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    meta = TensorMeta(dtype, shape)
    return from_bytes(aligned_empty(meta.nbytes), meta)


def storage_nbytes(buffer: torch.Tensor) -> int:
    """Bytes really allocated behind ``buffer`` (its whole storage, not just the view)."""
    return buffer.untyped_storage().nbytes()


def is_aligned(buffer: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """Whether ``buffer`` starts on an ``alignment`` boundary."""
    return buffer.data_ptr() % alignment == 0
