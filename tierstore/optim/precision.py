"""Compressed Adam state: the packed byte layout of one store entry and its encode/decode.

``TieredAdam(state_precision=..., master_weights=...)`` keeps each parameter's (or chunk's)
state in one store entry, so one transfer moves all of it. With ``state_precision="fp32"`` and
``master_weights="fp32"`` that entry is today's ``(rows, numel)`` fp32 tensor. Otherwise it is a
flat ``uint8`` tensor whose fields lie one after the other, widest element first, so every field
is aligned for its dtype (the store's buffers are at least 64-byte aligned). For an entry of
``n`` elements with ``b = ceil(n / 256)`` quantisation blocks:

================  =================================================  ========================
field             dtype, count                                       bytes
================  =================================================  ========================
master            fp32, n (``master_weights="fp32"``, unless the     4n
                  parameter is the master: ``param_master``)
<moment>/scale    fp32, b per moment (``"8bit"``)                    4b each
master_low        int16, n: low 16 bits of the fp32 master           2n
                  (``master_weights="lossless"``)
<moment>          bf16, n (``"bf16"``) / fp32, n (``"fp32"`` moments) 2n / 4n each
<moment>/codes    uint8, n (``"8bit"``)                              n each
================  =================================================  ========================

with the moments ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) in that
order. Per parameter without amsgrad: ``"bf16"`` 8 B, ``"8bit"`` 6 B + 8 B per 256 elements;
with a lossless master 2 B less (``"8bit"``: about 4 B).

``param_master``: an fp32 parameter in host memory (plain CPU) is its own fp32 master, as with
fp32 state (``TieredAdam._param_is_master``): the entry leaves the master out (``"8bit"``: about
2 B a parameter, ``"bf16"`` 4 B) and ``PackedState`` reads and updates the parameter's own memory
(``master=``) in its place, so no copy of the master is made, stored or written back.

8-bit moments are blockwise quantised as in the 8-bit optimizer literature (Dettmers et al.,
arXiv:2110.02861; bitsandbytes, torchao's AdamW8bit): each block of 256 elements is divided by
its absolute maximum (its fp32 scale) and every value is replaced by the index of the nearest
entry of a 256-value "dynamic" code book (exponent and fraction, dense near zero): a signed one
for ``exp_avg``, an unsigned one for ``exp_avg_sq``/``max_exp_avg_sq``. Blocks start at the
entry's first element; chunks (``tierstore.optim.chunks.ALIGN_ELEMENTS``) are whole blocks, so a
chunked parameter quantises exactly as the same parameter in one entry would.

The lossless master keeps only the low 16 bits of the fp32 master; its high 16 bits are the
bf16 weight the model holds, which the update writes as the master's exact high half (its
truncation, not round-to-nearest), so master = weight bits << 16 | low bits, bit for bit.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache, lru_cache
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from tierstore.device.mode import emulation
from tierstore.optim import native
from tierstore.tensors import PLAIN_TENSOR_TYPES

#: The values of ``state_precision=``.
PRECISIONS = ("fp32", "bf16", "8bit")
#: The values of ``master_weights=``.
MASTER_WEIGHTS = ("fp32", "lossless")
#: Elements per quantisation block of 8-bit moments (each with one fp32 scale).
BLOCK = 256
#: The least block scale: the smallest normal fp32 number, so that an all-zero block still
#: divides. (It was 1e-12: a block of second moments below it, the squares of gradients below
#: 1e-6, was coded against that scale instead of its own, its values off by 2x at 1e-18.)
SMALLEST_SCALE = torch.finfo(torch.float32).tiny

_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic code book of 8-bit moments: for each of 7 decades
    ``10**-6 .. 10**0`` a linear run of fraction values (twice as many per decade as the one
    below; both signs when ``signed``), plus 0 and 1 (bitsandbytes' dynamic map; signed, its
    most negative value is -1)."""
    values: list[float] = [0.0, 1.0]
    for decade in range(7):
        items = 2**decade + 1 if signed else 2 ** (decade + 1) + 1
        bounds = torch.linspace(0.1, 1.0, items, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (decade - 6)).tolist()
        values += means
        if signed:
            values += [-m for m in means]
    assert len(values) == 256
    values.sort()
    if signed:
        # The block's absmax is reached on both sides (the book's own ends are -0.993 and 1):
        # a decoded block then has the same absmax, so encoding it again gives the same codes
        # and scale (checkpoints round-trip exactly).
        values[0] = -1.0
    return torch.tensor(values, dtype=torch.float32)


@cache
def _midpoints(signed: bool) -> torch.Tensor:
    """The boundaries between neighbouring codes (a value on one takes the lower code). For the
    unsigned book (``exp_avg_sq``) every positive value takes a code above 0: a second moment
    far below its block's absmax (a gradient 10**4 times smaller than the block's largest, or
    one that stopped) rounded to 0 would leave its first moment over ``eps`` alone, a step
    thousands of times ``lr``; the smallest code over-states it instead, a smaller step."""
    book = dynamic_map(signed)
    mid = (book[1:] + book[:-1]) / 2
    if not signed:
        mid[0] = 0.0
    return mid


def exact_values(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values with the bit patterns ``bits`` (int32), as float64 decoded from their
    fields: exact, subnormals included, whatever the thread's flush-to-zero and
    denormals-are-zero (``torch.set_flush_denormal`` sets them on the calling thread alone, so a
    threaded fp32 op on subnormals gives other results on each part; every float32 value is a
    normal float64). NaN patterns give NaN."""
    word = bits.to(torch.int64) & 0xFFFFFFFF
    exponent = (word >> 23) & 0xFF
    fraction = word & 0x7FFFFF
    subnormal = exponent == 0
    magnitude = torch.where(subnormal, fraction, fraction | (1 << 23)).double()
    power = torch.where(subnormal, torch.full_like(exponent, -149), exponent - 150)
    value = magnitude * ((power + 1023) << 52).view(torch.float64)  # (a power of two, built from its bits: exact)
    value = torch.where(exponent == 255, torch.where(fraction == 0, float("inf"), float("nan")), value)
    return torch.where((word >> 31) == 1, -value, value)


@cache
def _search_table(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A faster ``bucketize(x, midpoints)``: indexed by the high 16 bits of an fp32 ``x``, the
    number of midpoints below every value with those bits; one more comparison, with the next
    midpoint, finishes the search (the code book's midpoints are further apart than such a
    bucket is wide, which is checked here). Returns the table and the midpoints (+inf last).
    Compared in float64 (``exact_values``): under flush-to-zero the subnormal buckets' ends
    compared as 0, on the threads that flush."""
    mid = _midpoints(signed)
    exact_mid = mid.double()
    high = torch.arange(-32768, 32768, dtype=torch.int32)
    lowest = exact_values((high << 16) | (high < 0).to(torch.int32) * 0xFFFF)  # bucket ends, in value order
    highest = exact_values((high << 16) | (high >= 0).to(torch.int32) * 0xFFFF)
    below = torch.bucketize(lowest, exact_mid)
    finite = ~torch.isnan(lowest)
    if int((torch.bucketize(highest, exact_mid) - below)[finite].max()) > 1:
        raise AssertionError("internal error: two code-book midpoints within one bf16 bucket")
    table = torch.empty(65536, dtype=torch.int32)
    table[high & 0xFFFF] = below.to(torch.int32)
    return table, torch.cat([mid, torch.tensor([float("inf")])])


@cache
def _kernel_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``_search_table``'s table and, for the compiled codec, the midpoint each entry is compared
    with (``midpoints[table]``), both indexed by the high 16 bits: two independent lookups
    instead of one feeding the next (the same bits, 14% faster)."""
    table, mid = _search_table(signed)
    return table, mid[table.long()].contiguous()


def _nearest_codes(normal: torch.Tensor, signed: bool) -> torch.Tensor:
    """The index of the nearest code of each value of flat fp32 ``normal`` (ties: the lower;
    what ``torch.bucketize(normal, midpoints)`` gives, three times faster on a CPU)."""
    table, mid = _search_table(signed)
    high = normal.view(torch.int32).bitwise_right_shift(16).bitwise_and_(0xFFFF)
    below = table.index_select(0, high)
    return below.add_(normal > mid.index_select(0, below))


# -- the 8-bit codec, eager and compiled ---------------------------------------------------------
#
# The eager codec makes ~10 passes over an entry's memory; the same math as one fused kernel
# (torch.compile, inductor) makes one, and gives the same bits (the same IEEE division and
# comparisons; tests/test_precision.py checks it), except the scale of a block holding a NaN: a
# NaN either way, its payload may differ (such a block is lost to the update anyway). Entries
# below ``COMPILE_MIN_NUMEL`` stay eager (a compiled call's fixed cost). ``TIERSTORE_COMPILE_CODEC=0`` keeps everything eager; a
# compile that fails (no compiler, an unsupported platform) warns once and falls back to eager.
# ``PackedState.update`` given the group's ``AdamHyper`` goes one further for 8-bit moments
# without amsgrad: one kernel a tile decodes both moments, runs AdamW and encodes them, written in
# place (``_adam8_fp32``/``_adam8_lossless``); its rounding is its own, not torch's fused AdamW's
# bit for bit (tests/test_fused_8bit.py bounds the difference). On x86 Linux the same kernel
# runs as C (``native.py``, ``adam8.c``: about 2x faster, the same bits but for NaN payloads);
# the compiled one otherwise. So the update chooses it by the
# parameter's size (``PackedState.param_numel``), not its entry's: the same run then gives the same
# bits with its state in memory, on the host or paged in chunks (tests/test_8bit_placement.py).

#: Entries of at least this many elements use the compiled codec (when enabled).
COMPILE_MIN_NUMEL = 1 << 15


def _coded(values: torch.Tensor, table: torch.Tensor, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of flat fp32 ``values`` as their codes and scales: the eager
    ``_quantize_eager``'s math, written as one expression for the compiler to fuse."""
    # Flat in, blocks made here: a (blocks, BLOCK) input's second size would be a symbol under
    # dynamic shapes, and each element's scale an integer division by it (2.6x slower).
    values = values.view(-1, BLOCK)
    absmax = values.abs().amax(dim=1).clamp(min=SMALLEST_SCALE)  # an all-zero block still divides
    normal = (values / absmax.unsqueeze(1)).reshape(-1)
    high = normal.view(torch.int32).bitwise_right_shift(16).bitwise_and(0xFFFF)
    return (table[high] + (normal > above[high]).to(torch.int32)).to(torch.uint8), absmax


def _decoded(codes: torch.Tensor, scales: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Whole blocks of ``codes`` and their ``scales`` as flat fp32 values."""
    # int32 indices: int64 ones make the compiled lookup widen every vector of codes (3x slower).
    return (book[codes.int()].view(-1, BLOCK) * scales.unsqueeze(1)).view(-1)


def _encode_blocks(values: torch.Tensor, table: torch.Tensor, above: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Whole blocks of fp32 ``values`` into ``codes`` and ``scales`` (``_coded``)."""
    coded, absmax = _coded(values, table, above)
    codes.copy_(coded)
    scales.copy_(absmax)


def _decode_blocks(codes: torch.Tensor, scales: torch.Tensor, book: torch.Tensor, out: torch.Tensor) -> None:
    """Whole blocks of ``codes`` and their ``scales`` into flat fp32 ``out``."""
    out.copy_(_decoded(codes, scales, book))


def _encode_pair(m: torch.Tensor, v: torch.Tensor, signed: tuple[torch.Tensor, torch.Tensor],
                 unsigned: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Both moments of a tile (flat, whole blocks) in one kernel: their codes and
    scales as new tensors. Returned, not written into the entry's views: inputs that are views
    of one buffer and mutated would make the compiled function rebuild their common base on
    every call."""
    return (*_coded(m, *signed), *_coded(v, *unsigned))


def _decode_pair(m_codes: torch.Tensor, m_scales: torch.Tensor, v_codes: torch.Tensor, v_scales: torch.Tensor,
                 signed: torch.Tensor, unsigned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both moments of a tile of whole blocks decoded into new fp32 tensors."""
    return _decoded(m_codes, m_scales, signed), _decoded(v_codes, v_scales, unsigned)


class AdamHyper(NamedTuple):
    """One parameter group's AdamW settings, for the fused 8-bit update (``PackedState.update``):
    ``lr`` may be a tensor; ``decoupled``: AdamW's weight decay (else Adam's L2 term);
    ``grad_scale``: GradScaler's scale, the gradient divided by it first."""

    lr: float | torch.Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool = False
    grad_scale: torch.Tensor | None = None

    def scalars(self, step: float) -> torch.Tensor:
        """The kernel's scalars for count ``step`` (after counting this update), computed in
        float64 and rounded to fp32 as torch's fused AdamW does: one tensor, so new values
        (a scheduled lr, the bias corrections of every step) are new data, not a recompile."""
        return _KernelScalars(self.scalar_values(step)).tensor()

    def scalar_values(self, step: float) -> tuple[Any, ...]:
        """``scalars`` before rounding: Python floats (0-d tensors where the group's betas are)."""
        lr = float(self.lr)
        bias1 = 1 - self.beta1**step
        bias2_sqrt = math.sqrt(1 - self.beta2**step)
        gmul = 1.0 if self.grad_scale is None else float(self.grad_scale.double().reciprocal().float())
        if self.maximize:
            gmul = -gmul
        decay = 1 - lr * self.weight_decay if self.decoupled else 1.0
        l2 = 0.0 if self.decoupled else self.weight_decay
        return (lr / bias1, decay, l2, self.beta1, 1 - self.beta1, self.beta2, 1 - self.beta2, bias2_sqrt, self.eps, gmul)


class _KernelScalars:
    """``AdamHyper.scalars`` of one update, made once, as the fused kernel that runs takes them:
    a tensor (the compiled kernel) or an fp32 array's address (the C kernel, with no torch call:
    see ``native.adam8_at``). The C cast rounds each value to fp32 as ``torch.tensor`` does."""

    __slots__ = ("_values", "_tensor", "_array")

    def __init__(self, values: tuple[Any, ...]) -> None:
        self._values = values
        self._tensor: torch.Tensor | None = None
        self._array: ctypes.Array[ctypes.c_float] | None = None

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self._values, dtype=torch.float32)
        return self._tensor

    def address(self) -> int:
        if self._array is None:
            self._array = (ctypes.c_float * len(self._values))(*self._values)
        return ctypes.addressof(self._array)


def _adam_math(master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
               s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW on fp32 values (``AdamHyper.scalars``' order), as torch's fused CPU kernel writes it
    (``p * weight_decay`` added only where it is not 0, as there: ``p * 0`` is NaN for a NaN or
    inf weight, which would take its block's moments with it)."""
    g = grad.float() * s[9]
    g = torch.where(s[2] != 0, g + master * s[2], g)
    m = m * s[3] + g * s[4]
    v = v * s[5] + g * s[6] * g  # ((1 - beta2) first, as torch: g * g overflows from |g| ~ 1.8e19)
    denom = v.sqrt() / s[7] + s[8]
    return master * s[1] - s[0] * m / denom, m, v


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as a tensor with a storage of its own (offset 0)."""
    return torch.from_dlpack(tensor.detach())


def _for_compiler(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, as a compiled kernel's argument. A dtype view of an entry whose bytes
    are no whole number of its elements (an 8-bit entry of an odd size: its fp32 scales) gets a
    storage of its own: inductor rebuilt the view from the entry's storage and failed an internal
    assertion (``nbytes % dtype_size == 0``), and the compiled codec was off for the process."""
    tensor = tensor.detach()
    return _own_storage(tensor) if tensor.untyped_storage().nbytes() % tensor.element_size() else tensor


def _same_tile(elements: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...]) -> None:
    """Tell the compiler that ``elements`` all have one size, a tile's, and ``scales`` one
    element per block of it. Traced without duck sizing, each input's size is a symbol of its
    own, and loops over different symbols do not fuse (a loop, a pass over memory, per input);
    these equalities hold on every call, so their guards never fail."""
    size = elements[0].shape[0]
    for tensor in elements[1:]:
        torch._check(tensor.shape[0] == size)
    for tensor in scales:
        torch._check(tensor.shape[0] * BLOCK == size)


def _adam8_fp32(master: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor, v_codes: torch.Tensor, v_scales: torch.Tensor,
                grad: torch.Tensor, s: torch.Tensor, signed: tuple[torch.Tensor, torch.Tensor],
                unsigned: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One tile of the 8-bit update with an fp32 master in one kernel: both moments decoded
    (``signed``/``unsigned``: ``_codebook``), AdamW, the master and the
    moments' codes and scales written in place (the entry's views)."""
    _same_tile((master, m_codes, v_codes, grad), (m_scales, v_scales))
    m = _decoded(m_codes, m_scales, signed[0])
    v = _decoded(v_codes, v_scales, unsigned[0])
    new_master, m, v = _adam_math(master, m, v, grad, s)
    m_new, m_absmax = _coded_packed(m, signed[1])
    v_new, v_absmax = _coded_packed(v, unsigned[1])
    master.copy_(new_master)
    m_codes.copy_(m_new)
    m_scales.copy_(m_absmax)
    v_codes.copy_(v_new)
    v_scales.copy_(v_absmax)


def _adam8_lossless(low: torch.Tensor, high: torch.Tensor, high_out: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor,
                    v_codes: torch.Tensor, v_scales: torch.Tensor, grad: torch.Tensor, s: torch.Tensor,
                    signed: tuple[torch.Tensor, torch.Tensor], unsigned: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``_adam8_fp32`` with a lossless master: read as the bf16 weight's bits (``high``) over the
    stored low halves, written back as both halves (``high_out``: the new weight, truncated)."""
    _same_tile((low, high, high_out, m_codes, v_codes, grad), (m_scales, v_scales))
    words = (high.view(torch.int16).to(torch.int32) << 16) | (low.to(torch.int32) & 0xFFFF)
    m = _decoded(m_codes, m_scales, signed[0])
    v = _decoded(v_codes, v_scales, unsigned[0])
    new_master, m, v = _adam_math(words.view(torch.float32), m, v, grad, s)
    m_new, m_absmax = _coded_packed(m, signed[1])
    v_new, v_absmax = _coded_packed(v, unsigned[1])
    bits = new_master.view(torch.int32)
    low.copy_((bits & 0xFFFF).to(torch.int16))
    high_out.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    m_codes.copy_(m_new)
    m_scales.copy_(m_absmax)
    v_codes.copy_(v_new)
    v_scales.copy_(v_absmax)


@cache
def _codebook(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's code book and ``_kernel_tables`` packed into one int64 table: the
    midpoint's bits high, the code below it low (one lookup an element instead of two)."""
    table, mid = _kernel_tables(signed)
    return dynamic_map(signed), (mid.view(torch.int32).to(torch.int64) << 32) | table.to(torch.int64)


def _coded_packed(values: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_coded`` with ``_codebook``'s packed table: the same codes and scales."""
    values = values.view(-1, BLOCK)
    absmax = values.abs().amax(dim=1).clamp(min=SMALLEST_SCALE)
    normal = (values / absmax.unsqueeze(1)).reshape(-1)
    entry = packed[normal.view(torch.int32).bitwise_right_shift(16).bitwise_and(0xFFFF)]
    above = (entry >> 32).to(torch.int32).view(torch.float32)
    return ((entry & 0xFF).to(torch.int32) + (normal > above).to(torch.int32)).to(torch.uint8), absmax


#: Inductor options: no bounds check on the code-book lookups (their indices are a uint8 code
#: or the high 16 bits of a word, in range by construction; the check costs a pass per vector).
_OPTIONS = {"assert_indirect_indexing": False}


class _Compiled:
    """Kernels (``kernels``, by name), compiled on first use (once for any size: dynamic
    shapes); ``failed`` once compiling one failed (``what`` is then unavailable, ``instead`` runs)."""

    def __init__(self, kernels: dict[str, Callable[..., Any]], what: str, instead: str) -> None:
        self._lock = threading.Lock()
        self._source = kernels
        self._what, self._instead = what, instead
        self._kernels: dict[str, Callable[..., Any]] | None = None
        self._traced: set[tuple[Any, ...]] = set()
        self.failed = False

    def enabled(self) -> bool:
        return not self.failed and os.environ.get("TIERSTORE_COMPILE_CODEC", "1") != "0"

    def call(self, name: str, *args: Any) -> Any:
        """Run kernel ``name`` on ``args``: its result (True if None); False (and eager from now
        on) if compiling failed."""
        # Detached: a view's base (the whole entry, different for every entry and tile) would
        # add guards on it that take longer to check than a tile's kernel runs.
        args = tuple(_for_compiler(a) if isinstance(a, torch.Tensor) else a for a in args)
        with self._lock:
            if self._kernels is None:
                self._kernels = {name: torch.compile(kernel, dynamic=True, options=_OPTIONS) for name, kernel in self._source.items()}
        # (A kernel traces again for other dtypes, e.g. a bf16 model's gradient: also undisturbed.)
        traced = (name, *(a.dtype for a in args if isinstance(a, torch.Tensor)))
        try:
            if traced in self._traced:
                result = self._kernels[name](*args)
            else:
                # Traced without duck sizing: a tile's sizes and its views' offsets into the
                # entry's buffer that happen to be equal would otherwise become guards, and a
                # recompile per tile. Only the first call traces (dynamic shapes): the later
                # ones skip the config patch, which costs as much as a small tile's kernel.
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    result = self._kernels[name](*args)
                self._traced.add(traced)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the fallback gives the same numbers
            self.failed = True
            warnings.warn(f"{self._what} is unavailable ({type(exc).__name__}: {exc}); using {self._instead}", stacklevel=3)
            return False
        return True if result is None else result


_KERNELS: dict[str, Callable[..., Any]] = {"encode": _encode_blocks, "decode": _decode_blocks, "encode_pair": _encode_pair, "decode_pair": _decode_pair}
_COMPILED = _Compiled(_KERNELS, "the compiled 8-bit codec", "the eager one")
#: The fused 8-bit AdamW kernels: failing, they leave the compiled codec (the unfused update) on.
_FUSED = _Compiled({"adam8_fp32": _adam8_fp32, "adam8_lossless": _adam8_lossless}, "the fused 8-bit AdamW kernel", "the unfused update")


def _use_compiled(compiled: bool | None, numel: int) -> bool:
    if compiled is None:
        return numel >= COMPILE_MIN_NUMEL and _COMPILED.enabled()
    return compiled and not _COMPILED.failed


def _quantize_eager(values: torch.Tensor, signed: bool, codes: torch.Tensor, scales: torch.Tensor) -> None:
    for_blocks = values.view(-1, values.numel()) if values.numel() < BLOCK else values.view(-1, BLOCK)
    absmax = for_blocks.abs().amax(dim=1).clamp_(min=SMALLEST_SCALE)  # an all-zero block still divides
    scales.copy_(absmax)
    normal = (for_blocks / absmax.unsqueeze(1)).view(-1)
    codes.copy_(_nearest_codes(normal, signed))


def quantize(values: torch.Tensor, signed: bool, codes: torch.Tensor, scales: torch.Tensor, *, compiled: bool | None = None) -> None:
    """Blockwise 8-bit quantisation of flat fp32 ``values`` into ``codes`` (uint8, same count)
    and ``scales`` (fp32, one per block of ``BLOCK``; the last block may be partial).
    ``compiled``: use the compiled kernel (True), the eager one (False), or the compiled one
    for large entries where enabled (None); all give the same bits."""
    n = values.numel()
    full = n // BLOCK * BLOCK
    if full:
        blocks, block_codes, block_scales = values[:full], codes[:full], scales[: full // BLOCK]
        if not (_use_compiled(compiled, n) and _COMPILED.call("encode", blocks, *_kernel_tables(signed), block_codes, block_scales)):
            _quantize_eager(blocks, signed, block_codes, block_scales)
    if full < n:
        _quantize_eager(values[full:], signed, codes[full:], scales[full // BLOCK :])


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool, out: torch.Tensor, *, compiled: bool | None = None) -> torch.Tensor:
    """The fp32 values of ``codes`` and their block ``scales``, written into flat ``out``
    (``compiled`` as for ``quantize``)."""
    n = codes.numel()
    full = n // BLOCK * BLOCK
    if full and _use_compiled(compiled, n) and _COMPILED.call("decode", codes[:full], scales[: full // BLOCK], dynamic_map(signed), out[:full]):
        if full < n:
            torch.index_select(dynamic_map(signed), 0, codes[full:].int(), out=out[full:])
            out[full:].mul_(scales[full // BLOCK :])
        return out
    torch.index_select(dynamic_map(signed), 0, codes.int(), out=out)
    out[:full].view(-1, BLOCK).mul_(scales[: full // BLOCK].unsqueeze(1))
    if full < n:
        out[full:].mul_(scales[full // BLOCK :])
    return out


#: Elements of an entry updated together with others (``tierstore.optim.batched``): a batch's
#: fp32 rows stay in a core's L2 cache.
TILE = 1 << 16
#: Elements per tile of ``PackedState.update`` on the eager codec (bf16 moments, fp32 ones beside
#: a lossless master, 8-bit ones without the compiled codec): a tile's decode, AdamW and encode
#: are ~10 torch calls, which cost more than its rows leaving the L2 cache (bf16 alone, AMD EPYC
#: Zen 3, two threads: 2.6-3.2 ns a parameter on 64K-element tiles, 1.2-1.4 on 256K, 0.8-1.3 on
#: 1M; each call on the training thread also lets go of the GIL while the loop is busy). 256K:
#: most of the gain, for a per-thread scratch of at most 4 MiB (in ``memory_plan()``'s working set).
UPDATE_TILE = 1 << 18
#: Elements per tile where the compiled 8-bit codec runs: a compiled call has a fixed cost
#: (its guards) of about a 64K-element tile's math, so its tiles are larger (measured with
#: ``bench_optim --parts g``: 1M-element tiles 4x cheaper per parameter than 64K ones).
COMPILED_TILE = 1 << 20

_SCRATCH = threading.local()


def _tiles(numel: int, tile: int, *, split_partial: bool) -> list[tuple[int, int]]:
    """The ``(start, stop)`` tiles of an entry of ``numel`` elements: ``tile`` elements each
    (at least one tile, if empty); ``split_partial``: a partial last block is a tile of its own,
    so the same elements are whole-block tiles however the parameter is split into entries."""
    full = numel // BLOCK * BLOCK if split_partial else numel
    tiles = [(start, min(start + tile, full)) for start in range(0, full, tile)]
    if full < numel or not tiles:
        tiles.append((full, numel))
    return tiles


def _scratch_rows(rows: int, size: int) -> torch.Tensor:
    """This thread's fp32 tile scratch of ``(rows, size)`` (kept: one allocation a thread, as
    large as the largest asked for)."""
    held = getattr(_SCRATCH, "flat", None)
    if held is None or held.numel() < rows * size:
        held = _SCRATCH.flat = torch.empty(rows * size)
    return held[: rows * size].view(rows, size)


#: fp32 rows of a tile an update makes and drops beside its scratch, at most (``update_bytes``):
#: the eager codec's passes (absolute values, block maxima, quotients, code indices of 8 B),
#: a gradient made fp32, and a non-fused AdamW's own temporaries (per ``grad_fp32``/``fused``).
_CODEC_ROWS = 4


def update_bytes(layout: StateLayout, numel: int, param_numel: int, *, fused: bool, grad_fp32: bool) -> tuple[int, int]:
    """At most the bytes one thread's ``PackedState.update`` of an entry of ``numel`` elements
    (of a parameter of ``param_numel``) takes beside the entry: ``(kept, passing)``. Kept: the
    thread's fp32 scratch (``_scratch_rows``, a tile of every decoded row, as large as the
    largest asked for; 1M-element tiles for an 8-bit parameter the compiled codec takes, or
    took before it failed). Passing, made and dropped by the update: each tile's temporaries
    (``_CODEC_ROWS`` rows; a gradient cast to fp32 with ``grad_fp32`` False; a non-fused
    AdamW's, ``fused`` False) and, with a lossless master, the weight's new high halves
    (``numel`` bf16)."""
    tile = COMPILED_TILE if layout.precision == "8bit" and param_numel >= COMPILE_MIN_NUMEL else UPDATE_TILE
    width = min(numel, tile)
    rows = layout.rows if layout.precision != "fp32" else int(layout.lossless)  # (fp32 moments are updated where they lie)
    passing = _CODEC_ROWS * width * 4 + plain_update_bytes(width, fused=fused, grad_fp32=grad_fp32)
    return rows * width * 4, passing + (numel * 2 if layout.lossless else 0)


#: Bytes of the 8-bit codec's tables, at most, built once and shared by the threads (its code
#: maps, codebooks and search tables, both signs: 1.6 MiB).
CODEC_TABLES_BYTES = 2 << 20


def plain_update_bytes(numel: int, *, fused: bool, grad_fp32: bool) -> int:
    """At most the bytes torch's AdamW makes and drops updating plain fp32 state of ``numel``
    elements in one call: the gradient cast to fp32 (``grad_fp32`` False) and, unless
    ``fused``, the foreach or for-loop kernel's temporaries (two rows: measured 1 and 1.5)."""
    return ((not grad_fp32) + (0 if fused else 2)) * numel * 4


def release_scratch() -> None:
    """Let go of this thread's scratch (``_scratch_rows``): a thread that ran updates in a
    step keeps none after it, so only the threads ``memory_plan()`` counts hold one."""
    _SCRATCH.flat = None


def can_be_master(param: torch.Tensor) -> bool:
    """Whether ``param``'s memory can serve as its fp32 master (the update in place on it): a
    plain, contiguous fp32 tensor (not a DTensor or another subclass)."""
    return type(param) in PLAIN_TENSOR_TYPES and param.dtype == torch.float32 and param.is_contiguous()


def keeps_no_master(param: torch.Tensor, master_weights: str = "fp32", *, weights_offloaded: bool = False) -> bool:
    """Whether ``TieredAdam`` will keep no master copy for ``param``, known before an optimizer
    exists (its ``_param_is_master`` rule, to size tiers): ``can_be_master``, in CPU memory with
    no device link between it and the state (the plain CPU, not the emulated device),
    ``master_weights="fp32"``, its weights not offloaded to a store."""
    return (master_weights == "fp32" and not weights_offloaded and param.device.type == "cpu" and not emulation()[0]
            and can_be_master(param))


def planned_state_bytes(param: torch.Tensor, state_precision: str = "fp32", master_weights: str = "fp32", amsgrad: bool = False,
                        *, weights_offloaded: bool = False) -> int:
    """Bytes of Adam state ``TieredAdam`` will store for ``param`` with these settings (moments,
    and the master unless ``keeps_no_master``)."""
    own = keeps_no_master(param, master_weights, weights_offloaded=weights_offloaded)
    if state_precision == "fp32" and master_weights == "fp32":
        return 4 * (len(_MOMENTS) - (not amsgrad) + (not own)) * param.numel()
    return StateLayout(state_precision, master_weights == "lossless", amsgrad, own).nbytes(param.numel())


def validate(state_precision: str, master_weights: str) -> None:
    """Raise ``ValueError`` for values of ``state_precision=``/``master_weights=`` we do not have."""
    if state_precision not in PRECISIONS:
        raise ValueError(f"state_precision must be one of {PRECISIONS}, not {state_precision!r}")
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}, not {master_weights!r}")
    if master_weights == "lossless" and sys.byteorder != "little":
        raise ValueError("master_weights='lossless' splits fp32 words into halves and needs a little-endian host")


@dataclass(frozen=True)
class Field:
    """One field of a packed entry: ``count`` elements of ``dtype`` from byte ``offset``."""

    name: str
    dtype: torch.dtype
    offset: int
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


@dataclass(frozen=True)
class StateLayout:
    """How one entry of compressed Adam state is laid out (see the module docstring).
    ``param_master``: the fp32 master is the parameter itself, not a field of the entry."""

    precision: str
    lossless: bool
    amsgrad: bool
    param_master: bool = False

    def __post_init__(self) -> None:
        if self.lossless and self.param_master:
            raise ValueError("a lossless master is stored in part (its low halves): it cannot be the parameter itself")

    @property
    def moments(self) -> tuple[str, ...]:
        return _MOMENTS if self.amsgrad else _MOMENTS[:2]

    @property
    def rows(self) -> int:
        """Rows of the decoded state: master and moments."""
        return 1 + len(self.moments)

    def fields(self, numel: int) -> Mapping[str, Field]:
        """The fields of an entry of ``numel`` elements, by name, in byte order (read-only:
        shared by every caller asking for that count)."""
        return _fields_of(self, numel)

    def nbytes(self, numel: int) -> int:
        """Bytes of an entry of ``numel`` elements."""
        return _nbytes_of(self, numel)

    def _fields(self, numel: int) -> Mapping[str, Field]:
        blocks = math.ceil(numel / BLOCK)
        wanted: list[tuple[str, torch.dtype, int]] = []
        if not self.lossless and not self.param_master:
            wanted.append(("master", torch.float32, numel))
        if self.precision == "8bit":
            wanted += [(f"{m}/scale", torch.float32, blocks) for m in self.moments]
        if self.lossless:
            wanted.append(("master_low", torch.int16, numel))
        if self.precision == "8bit":
            wanted += [(f"{m}/codes", torch.uint8, numel) for m in self.moments]
        else:
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
            wanted += [(m, dtype, numel) for m in self.moments]
        wanted.sort(key=lambda f: -f[1].itemsize)  # stable: widest first keeps every field aligned
        fields, offset = {}, 0
        for name, dtype, count in wanted:
            fields[name] = Field(name, dtype, offset, count)
            offset += count * dtype.itemsize
        return MappingProxyType(fields)

    def numel_of(self, nbytes: int) -> int | None:
        """The element count of an entry of ``nbytes`` bytes (None if no count has that size)."""
        def size(numel: int) -> int:  # (not through the cache: these counts are no entry's)
            return sum(f.nbytes for f in self._fields(numel).values())

        low, high = 0, nbytes  # (an entry has at least a byte an element; its size grows with its count)
        while low < high:
            middle = (low + high) // 2
            if size(middle) < nbytes:
                low = middle + 1
            else:
                high = middle
        return low if size(low) == nbytes else None

    def empty(self, numel: int) -> torch.Tensor:
        """A zeroed buffer for an entry of ``numel`` elements."""
        return torch.zeros(self.nbytes(numel), dtype=torch.uint8)


# The loop asks for entry sizes at every chunk it plans (a few hundred times a step): built once
# per layout and count (a step's chunks have a few counts).
@lru_cache(maxsize=4096)
def _fields_of(layout: StateLayout, numel: int) -> Mapping[str, Field]:
    return layout._fields(numel)


@lru_cache(maxsize=4096)
def _nbytes_of(layout: StateLayout, numel: int) -> int:
    return sum(f.nbytes for f in _fields_of(layout, numel).values())


class PackedState:
    """One entry's compressed state: ``buffer`` (uint8, held in the store or resident) read and
    written through its ``layout``. ``high``: with a lossless master, the bf16 weight the model
    holds for these elements (the master's high halves), in host memory. ``master``: with a
    ``param_master`` layout, the fp32 master's memory (flat, contiguous: the parameter's own
    elements, which the update then writes in place). ``param_numel``: the
    elements of the whole parameter whose state this entry is (a piece of; default ``numel``):
    the update chooses its kernels by it, never by the entry's size, so a parameter's numbers
    do not depend on how its state is split into entries (kept whole, or paged in chunks)."""

    def __init__(self, layout: StateLayout, buffer: torch.Tensor, numel: int, high: torch.Tensor | None = None,
                 param_numel: int | None = None, *, master: torch.Tensor | None = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.numel() != layout.nbytes(numel):
            raise ValueError(f"a packed state of {numel} elements is {layout.nbytes(numel)} uint8 bytes, not {buffer.numel()} {buffer.dtype}")
        if param_numel is not None and param_numel < numel:
            raise ValueError(f"a packed state of {numel} elements cannot be a piece of a parameter of {param_numel}")
        if layout.param_master:
            if master is None or master.dtype != torch.float32 or master.dim() != 1 or master.numel() != numel or not master.is_contiguous():
                got = "none" if master is None else f"{master.dtype} of shape {tuple(master.shape)}"
                raise ValueError(f"a packed state whose master is the parameter needs it as a flat contiguous fp32 tensor of {numel} elements, got {got}")
        elif master is not None:
            raise ValueError("master= is for a layout whose master is the parameter (param_master=True); this one stores its master")
        self.layout = layout
        self.buffer = buffer
        self.numel = numel
        self.param_numel = numel if param_numel is None else param_numel
        self.high = high
        self._master = master
        self._fields = layout.fields(numel)
        #: Whether the buffer (and the master, if the parameter's) can be addressed by offsets
        #: (``_c_tile``).
        self._contiguous = buffer.is_cpu and buffer.is_contiguous() and (master is None or master.is_cpu)

    def view(self, name: str) -> torch.Tensor:
        """The field ``name`` as a tensor of its dtype (a view of the buffer)."""
        f = self._fields[name]
        return self.buffer[f.offset : f.offset + f.nbytes].view(f.dtype)

    # -- master ------------------------------------------------------------------------------------

    def master(self) -> torch.Tensor:
        """The fp32 master: the parameter's memory (``param_master``), a view of the buffer, or
        (lossless) rebuilt from the weight's bits and the stored low halves into a new tensor."""
        if self._master is not None:
            return self._master
        if not self.layout.lossless:
            return self.view("master")
        if self.high is None:
            raise RuntimeError("internal error: a lossless master needs the model's bf16 weight")
        words = torch.empty(self.numel, 2, dtype=torch.int16)
        words[:, 0] = self.view("master_low")
        words[:, 1] = self.high.reshape(-1).view(torch.int16)
        return words.view(torch.float32).view(-1)

    def set_master(self, master: torch.Tensor) -> None:
        """Store fp32 ``master`` (lossless: its low halves; its high halves are ``weight_of``;
        ``param_master``: into the parameter's memory)."""
        if not self.layout.lossless:
            view = self._master if self._master is not None else self.view("master")
            if view.data_ptr() != master.data_ptr():
                view.copy_(master)
            return
        halves = master.reshape(-1).view(torch.int16).view(-1, 2)
        self.view("master_low").copy_(halves[:, 0])
        self.high = halves[:, 1].clone().view(torch.bfloat16)  # the weight: the master truncated

    def weight(self) -> torch.Tensor:
        """What the model's weight becomes: the fp32 master, or (lossless) its high halves as
        bf16 (the weight the model holds, until ``set_master`` stores a new master)."""
        if not self.layout.lossless:
            return self.master()
        assert self.high is not None
        return self.high.reshape(-1)

    # -- moments -----------------------------------------------------------------------------------

    def moment(self, name: str) -> torch.Tensor:
        """Moment ``name`` decoded into a new fp32 tensor."""
        if self.layout.precision == "8bit":
            out = torch.empty(self.numel, dtype=torch.float32)
            return dequantize(self.view(f"{name}/codes"), self.view(f"{name}/scale"), name == "exp_avg", out)
        return self.view(name).float() if self.layout.precision == "bf16" else self.view(name).clone()

    def set_moment(self, name: str, value: torch.Tensor) -> None:
        """Encode fp32 ``value`` into moment ``name`` (bf16: round to nearest)."""
        if self.layout.precision == "8bit":
            quantize(value.reshape(-1), name == "exp_avg", self.view(f"{name}/codes"), self.view(f"{name}/scale"))
        else:
            self.view(name).copy_(value.reshape(-1))

    # -- the update, tile by tile ------------------------------------------------------------------

    def update(self, grad: torch.Tensor, step: torch.Tensor | float, adam: Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor], None],
               hyper: AdamHyper | None = None) -> torch.Tensor | float:
        """One optimizer step on this entry: ``adam(rows, grad, step)`` (fp32 rows: master, then
        the moments; updated in place, ``step`` counted up) runs on tiles of ``UPDATE_TILE`` elements,
        each decoded into a per-thread fp32 scratch and encoded back right after, so no
        full-size fp32 copy exists. Every
        tile's ``adam`` starts from the same count; ``step`` ends as the last left it. Elementwise
        math, so the numbers are those of one call on the whole entry.

        Not all-or-nothing: an exception in a tile leaves the tiles before it updated in the
        entry, and an update retried on it (``step()`` after ``StepIncompleteError``) updates
        them again (the error is one of the math itself, not of the store: those are raised
        before the update starts).

        ``step`` may instead be the count as a number (a chunk's update, whose caller keeps the
        count): then it is not changed, and the count after this update is returned, a number
        where every tile took the fused kernel (no torch call for it), else a new tensor. With a
        tensor ``step``, that tensor is returned, counted up.

        With ``hyper`` (the AdamW that ``adam`` runs, its settings), 8-bit moments without
        amsgrad and the compiled codec, a tile of whole blocks is instead one compiled kernel
        that decodes, updates and encodes in one pass over memory, in place (``_adam8_fp32``):
        the same math, its rounding not torch's bit for bit (within fp32 tolerance before the
        moments are quantised). Which elements take it is the parameter's, not the entry's:
        all of a parameter of at least ``COMPILE_MIN_NUMEL`` elements (``param_numel``) but a
        partial last block, which is its own tile (chunks are whole blocks, so only a
        parameter's last chunk holds it)."""
        # (Each torch call on the training thread lets go of the GIL, and getting it back may
        # wait for the loop: none is made that the chunk's math does not need.)
        flat = grad if grad.dim() == 1 else grad.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"a gradient of {flat.numel()} elements for a state of {self.numel}")
        layout = self.layout
        if layout.lossless and self.high is None:
            raise RuntimeError("internal error: a lossless master needs the model's bf16 weight")
        compiled = layout.precision == "8bit" and _use_compiled(None, self.param_numel)
        tile = COMPILED_TILE if compiled else UPDATE_TILE
        high = torch.empty(self.numel, dtype=torch.bfloat16) if layout.lossless else None
        before = float(step)  # (the fused tiles need no tensor of the count)
        counted: torch.Tensor | float | None = None
        fused = hyper is not None and compiled and len(layout.moments) == 2
        scalars = _KernelScalars(hyper.scalar_values(before + 1)) if fused and hyper is not None else None
        for start, stop in _tiles(self.numel, tile, split_partial=compiled):
            if scalars is not None and not _FUSED.failed and stop > start and (stop - start) % BLOCK == 0 and self._fused_tile(start, stop, flat, scalars, high):
                counted = before + 1  # (as torch's Adam counts)
                continue
            rows = self._decode_tile(start, stop, compiled)
            # (not counted yet: each tile from the same count)
            counted = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(before)
            adam(rows, flat[start:stop], counted)
            self._encode_tile(start, stop, rows, high, compiled)
        if high is not None:
            self.high = high
        assert counted is not None  # (``_tiles`` gives at least one tile)
        if not isinstance(step, torch.Tensor):
            return counted
        if isinstance(counted, torch.Tensor):
            step.copy_(counted)
        else:
            step.fill_(counted)
        return step

    def _fused_tile(self, start: int, stop: int, grad: torch.Tensor, scalars: _KernelScalars, high: torch.Tensor | None) -> bool:
        """The 8-bit update of elements ``start:stop`` (whole blocks) as one compiled kernel,
        written in place; False if the compiled kernels are unavailable (nothing written)."""
        built = native.kernel()
        if built is not None and self._addressable(grad, high):
            self._c_tile(built, start, stop, grad, scalars, high)
            return True
        return self._fused_tile_of_views(start, stop, grad, scalars.tensor(), high)

    def _addressable(self, grad: torch.Tensor, high: torch.Tensor | None) -> bool:
        """Whether the C kernel can take this entry's operands by address (``_c_tile``): every
        one contiguous, in CPU memory, of the dtype and size it takes (else they go as views to
        ``native.adam8``, which checks them again, or to the compiled kernel). The gradient's
        size was checked by ``update``."""
        if not self._contiguous or not grad.is_cpu or not grad.is_contiguous() or grad.dtype not in (torch.float32, torch.bfloat16):
            return False
        if self.layout.lossless:
            weight = self.high
            return (weight is not None and high is not None and weight.is_cpu and weight.is_contiguous() and weight.dtype == torch.bfloat16
                    and weight.numel() == self.numel and high.is_contiguous() and high.numel() == self.numel)
        return True

    def _c_tile(self, built: native.Kernel, start: int, stop: int, grad: torch.Tensor, scalars: _KernelScalars,
                high: torch.Tensor | None) -> None:
        """``_fused_tile`` by the C kernel given the addresses of the tile's fields, computed
        from the buffer's (``native.adam8_at``; the same memory ``_fused_tile_of_views`` would
        view, with no torch call)."""
        base, fields, first = self.buffer.data_ptr(), self._fields, start // BLOCK

        def at(name: str, index: int) -> int:
            field = fields[name]
            return base + field.offset + index * field.dtype.itemsize

        moments = (at("exp_avg/codes", start), at("exp_avg/scale", first), at("exp_avg_sq/codes", start), at("exp_avg_sq/scale", first))
        master: int | None = None
        halves: tuple[int, int, int] | None = None
        if high is None:
            master = self._master.data_ptr() + start * 4 if self._master is not None else at("master", start)
        else:
            assert self.high is not None
            halves = (at("master_low", start), self.high.data_ptr() + start * 2, high.data_ptr() + start * 2)
        native.adam8_at(built, stop - start, master, halves, moments, grad.data_ptr() + start * grad.element_size(),
                        grad.dtype == torch.bfloat16, scalars.address())

    def _fused_tile_of_views(self, start: int, stop: int, grad: torch.Tensor, scalars: torch.Tensor, high: torch.Tensor | None) -> bool:
        """``_fused_tile`` on views of the fields: the C kernel where it takes them, else the
        compiled one."""
        # Written in place: the fields of this tile are disjoint pieces of one buffer, each
        # passed as a tensor of its own storage (DLPack: the same memory), so the compiler sees
        # unrelated inputs. As views of one storage, the dtype views' offsets into it became
        # guards (alignment of one field's end), a recompile per entry layout, one of which
        # failed inside the compiler.
        blocks = slice(start // BLOCK, stop // BLOCK)
        moments = (self.view("exp_avg/codes")[start:stop], self.view("exp_avg/scale")[blocks],
                   self.view("exp_avg_sq/codes")[start:stop], self.view("exp_avg_sq/scale")[blocks])
        books = (_codebook(True), _codebook(False))
        if high is None:
            master = self.master()[start:stop]
            if native.adam8(master, None, moments, grad[start:stop], scalars):
                return True
            tensors = (master, *moments, grad[start:stop])
            return _FUSED.call("adam8_fp32", *map(_own_storage, tensors), scalars, *books) is not False
        assert self.high is not None
        halves = (self.view("master_low")[start:stop], self.high.reshape(-1)[start:stop], high[start:stop])
        if native.adam8(None, halves, moments, grad[start:stop], scalars):
            return True
        return _FUSED.call("adam8_lossless", *map(_own_storage, (*halves, *moments, grad[start:stop])), scalars, *books) is not False

    def _decode_tile(self, start: int, stop: int, compiled: bool) -> list[torch.Tensor]:
        """Elements ``start:stop`` as fp32 rows: views of the buffer where a field is fp32 (an
        fp32 master, fp32 moments), decoded into this thread's scratch rows (the tile's
        elements each) otherwise; the compiled 8-bit kernels return their moments, so then only a
        lossless master takes a scratch row."""
        size = stop - start
        moments = self.layout.moments
        pair = compiled and self.layout.precision == "8bit" and size % BLOCK == 0 and len(moments) == 2
        needed = int(self.layout.lossless) if pair or self.layout.precision == "fp32" else self.layout.rows
        scratch = _scratch_rows(needed, size) if needed else None
        rows = [self.master()[start:stop] if not self.layout.lossless else scratch[0, :size]]  # type: ignore[index]
        if self.layout.lossless:
            words = rows[0].view(torch.int16).view(-1, 2)
            words[:, 0].copy_(self.view("master_low")[start:stop])
            words[:, 1].copy_(self.high.reshape(-1)[start:stop].view(torch.int16))  # type: ignore[union-attr]
        if self.layout.precision == "fp32":
            return rows + [self.view(name)[start:stop] for name in moments]
        if pair:
            decoded = _COMPILED.call("decode_pair", self.view("exp_avg/codes")[start:stop], self.view("exp_avg/scale")[start // BLOCK : stop // BLOCK],
                                     self.view("exp_avg_sq/codes")[start:stop], self.view("exp_avg_sq/scale")[start // BLOCK : stop // BLOCK],
                                     dynamic_map(True), dynamic_map(False))
            if decoded is not False:
                return [rows[0], *decoded]
            scratch = _scratch_rows(self.layout.rows, size)  # (a lossless master's row stays where it was decoded)
        assert scratch is not None
        rows += [scratch[i, :size] for i in range(1, 1 + len(moments))]
        if self.layout.precision == "bf16":
            for name, row in zip(moments, rows[1:], strict=True):
                row.copy_(self.view(name)[start:stop])
            return rows
        blocks = slice(start // BLOCK, -(-stop // BLOCK))
        for name, row in zip(moments, rows[1:], strict=True):
            dequantize(self.view(f"{name}/codes")[start:stop], self.view(f"{name}/scale")[blocks], name == "exp_avg", row, compiled=compiled)
        return rows

    def _encode_tile(self, start: int, stop: int, rows: list[torch.Tensor], high: torch.Tensor | None, compiled: bool) -> None:
        """Store updated ``rows`` of elements ``start:stop`` (fields that are views already are);
        a lossless master's high halves go to ``high``."""
        if high is not None:
            words = rows[0].view(torch.int16).view(-1, 2)
            self.view("master_low")[start:stop].copy_(words[:, 0])
            high[start:stop].view(torch.int16).copy_(words[:, 1])
        moments = self.layout.moments
        if self.layout.precision == "bf16":
            for name, row in zip(moments, rows[1:], strict=True):
                self.view(name)[start:stop].copy_(row)  # round to nearest, as set_moment
        elif self.layout.precision == "8bit":
            size, blocks = stop - start, slice(start // BLOCK, -(-stop // BLOCK))
            if compiled and size % BLOCK == 0 and len(moments) == 2:
                encoded = _COMPILED.call("encode_pair", rows[1], rows[2], _kernel_tables(True), _kernel_tables(False))
                if encoded is not False:
                    for name, codes, scales in ((moments[0], *encoded[:2]), (moments[1], *encoded[2:])):
                        self.view(f"{name}/codes")[start:stop].copy_(codes)
                        self.view(f"{name}/scale")[blocks].copy_(scales)
                    return
            for name, row in zip(moments, rows[1:], strict=True):
                quantize(row, name == "exp_avg", self.view(f"{name}/codes")[start:stop], self.view(f"{name}/scale")[blocks], compiled=compiled)

    # -- whole rows (checkpoints, restarts) --------------------------------------------------------

    def decode(self) -> torch.Tensor:
        """The state as ``(rows, numel)`` fp32: master, then the moments."""
        rows = torch.empty(self.layout.rows, self.numel, dtype=torch.float32)
        rows[0].copy_(self.master())
        for i, name in enumerate(self.layout.moments, start=1):
            rows[i].copy_(self.moment(name))
        return rows

    def encode(self, rows: torch.Tensor) -> None:
        """Store ``(rows, numel)`` fp32 state (master, moments) into the buffer."""
        self.set_master(rows[0].contiguous())
        for i, name in enumerate(self.layout.moments, start=1):
            self.set_moment(name, rows[i].contiguous())
