"""The C twin of the fused 8-bit AdamW kernel (tierstore/optim/native.py, adam8.c): the same
bits as a plain reference written here and as the inductor kernel, for both masters and both
gradient dtypes, in its AVX-512 build and its portable one; and the same training run whether
it is on or off."""

from __future__ import annotations

import shutil
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from tierstore.optim import TieredAdamW, native
from tierstore.optim import precision as codec
from tierstore.optim.precision import BLOCK, SMALLEST_SCALE, AdamHyper, dynamic_map

pytestmark = [
    pytest.mark.skipif(not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")), reason="no C compiler here"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

N = 6 * BLOCK
NAN_ELEMENT = 4 * BLOCK + 17
HYPER = AdamHyper(3e-3, 0.9, 0.999, 1e-8, 0.1, True)


def _tile(lossless: bool, grad_dtype: torch.dtype, seed: int, n: int = N) -> dict[str, torch.Tensor]:
    """A tile of stored state: codes of every value, scales of a few magnitudes, one block all
    zero (moments and gradient), one holding a NaN gradient (its scales become NaN), one a
    gradient so large that its ``exp_avg_sq`` overflows (its scale becomes inf)."""
    generator = torch.Generator().manual_seed(seed)
    tile = {
        "m_codes": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator),
        "m_scales": torch.rand(n // BLOCK, generator=generator) * 1e-2,
        "v_codes": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator),
        "v_scales": torch.rand(n // BLOCK, generator=generator) * 1e-5,
        "grad": (torch.randn(n, generator=generator) * 1e-2).to(grad_dtype),
    }
    if n >= N:
        tile["m_scales"][1] = tile["v_scales"][1] = 0.0
        tile["grad"][BLOCK : 2 * BLOCK] = 0.0
        tile["grad"][NAN_ELEMENT] = float("nan")
        tile["grad"][5 * BLOCK + 3] = 1e20 if grad_dtype != torch.float16 else 6e4
    if lossless:
        tile["low"] = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=generator)
        tile["high"] = torch.randn(n, generator=generator).bfloat16()
        tile["high_out"] = torch.empty(n, dtype=torch.bfloat16)
    else:
        tile["master"] = torch.randn(n, generator=generator)
    return tile


def _reference(tile: dict[str, torch.Tensor], s: torch.Tensor) -> dict[str, torch.Tensor]:
    """The update written plainly: decode, AdamW in the order of ``precision._adam_math``,
    encode each block by its absmax to the nearest code (ties: the lower; a positive second
    moment at least the smallest code above 0)."""
    if "master" in tile:
        master = tile["master"]
    else:
        words = (tile["high"].view(torch.int16).to(torch.int32) << 16) | (tile["low"].to(torch.int32) & 0xFFFF)
        master = words.view(torch.float32)
    m = (dynamic_map(True)[tile["m_codes"].long()].view(-1, BLOCK) * tile["m_scales"][:, None]).view(-1)
    v = (dynamic_map(False)[tile["v_codes"].long()].view(-1, BLOCK) * tile["v_scales"][:, None]).view(-1)
    g = tile["grad"].float() * s[9]
    if float(s[2]) != 0:  # (as torch: no p * 0, NaN for a non-finite weight)
        g = g + master * s[2]
    m = m * s[3] + g * s[4]
    v = v * s[5] + g * s[6] * g
    root = torch.from_numpy(np.sqrt(v.numpy()))  # (IEEE's rounding, as the kernels' sqrtf; torch's vectorised sqrt may be 1 ulp off)
    updated = master * s[1] - s[0] * m / (root / s[7] + s[8])
    out = {}
    for name, values, signed in (("m", m, True), ("v", v, False)):
        blocks = values.view(-1, BLOCK)
        absmax = blocks.abs().amax(dim=1).clamp(min=SMALLEST_SCALE)
        book = dynamic_map(signed)
        mid = (book[1:] + book[:-1]) / 2
        if not signed:
            mid[0] = 0.0  # (a positive second moment never takes code 0: its step would be m / eps)
        out[f"{name}_codes"] = torch.bucketize(blocks / absmax[:, None], mid).view(-1).to(torch.uint8)
        out[f"{name}_scales"] = absmax
    if "master" in tile:
        out["master"] = updated
    else:
        bits = updated.view(torch.int32)
        out["low"] = (bits & 0xFFFF).to(torch.int16)
        out["high_out"] = (bits >> 16).to(torch.int16).view(torch.bfloat16)
    return out


def _run_c(tile: dict[str, torch.Tensor], s: torch.Tensor, built: native.Kernel, threads: int = 1) -> bool:
    moments = (tile["m_codes"], tile["m_scales"], tile["v_codes"], tile["v_scales"])
    if "master" in tile:
        return native.adam8(tile["master"], None, moments, tile["grad"], s, built, threads)
    return native.adam8(None, (tile["low"], tile["high"], tile["high_out"]), moments, tile["grad"], s, built, threads)


def _assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every field bit for bit, codes included (also of the blocks with a NaN or inf scale), but
    for a NaN's payload (a NaN scale is NaN on both sides; the NaN gradient's own weight too)."""
    for name, value in want.items():
        have = got[name]
        assert have.dtype == value.dtype and have.shape == value.shape, name
        if have.dtype in (torch.float32, torch.bfloat16):
            nan = torch.isnan(have)
            assert torch.equal(nan, torch.isnan(value)), (name, int((nan != torch.isnan(value)).sum()))
            bits = (have.view(torch.int16) if have.element_size() == 2 else have.view(torch.int32),
                    value.view(torch.int16) if value.element_size() == 2 else value.view(torch.int32))
            assert torch.equal(bits[0][~nan], bits[1][~nan]), (name, int((bits[0][~nan] != bits[1][~nan]).sum()))
        else:
            assert torch.equal(have, value), (name, int((have != value).sum()))


@pytest.fixture(scope="module", params=["avx512", "avx2", "portable"])
def built(request: pytest.FixtureRequest) -> native.Kernel:
    kernel = native.build(vectorised=request.param != "portable")
    if request.param == "avx512" and not kernel.avx512:
        pytest.skip("this CPU has no AVX-512")
    if request.param == "avx2" and (kernel.avx512 or not kernel.avx2):
        pytest.skip("this CPU has AVX-512 (its own code runs) or no AVX2")
    return kernel


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32 grad", "bf16 grad"])
@pytest.mark.parametrize("lossless", [False, True], ids=["fp32 master", "lossless master"])
@pytest.mark.parametrize("hyper", [HYPER, AdamHyper(1e-3, 0.8, 0.99, 1e-6, 0.01, False, maximize=True)], ids=["adamw", "adam l2 maximize"])
def test_same_bits_as_a_plain_reference(built: native.Kernel, lossless: bool, grad_dtype: torch.dtype, hyper: AdamHyper) -> None:
    for seed in range(3):
        tile = _tile(lossless, grad_dtype, seed)
        s = hyper.scalars(float(seed + 1))
        want = _reference(tile, s)
        assert _run_c(tile, s, built)
        _assert_same_bits(tile, want)
        assert not torch.equal(want["m_codes"], _tile(lossless, grad_dtype, seed)["m_codes"])  # (the codes moved)


@pytest.mark.parametrize("hyper", [HYPER, AdamHyper(1e-3, 0.8, 0.99, 1e-6, 0.01, False, maximize=True)], ids=["adamw", "adam l2 maximize"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32 grad", "bf16 grad"])
@pytest.mark.parametrize("lossless", [False, True], ids=["fp32 master", "lossless master"])
def test_same_bits_as_the_inductor_kernel(built: native.Kernel, lossless: bool, grad_dtype: torch.dtype, hyper: AdamHyper) -> None:
    for seed in (7, 8):
        tile = _tile(lossless, grad_dtype, seed)
        if not lossless:  # non-finite weights: with l2 their moments are NaN in both, without it finite in both
            tile["master"][3] = float("nan")
            tile["master"][BLOCK + 5] = float("inf")
        twin = {name: value.clone() for name, value in tile.items()}
        s = hyper.scalars(float(seed))
        books = (codec._codebook(True), codec._codebook(False))
        moments = (twin["m_codes"], twin["m_scales"], twin["v_codes"], twin["v_scales"])
        if lossless:
            ran = codec._FUSED.call("adam8_lossless", twin["low"], twin["high"], twin["high_out"], *moments, twin["grad"], s, *books)
        else:
            ran = codec._FUSED.call("adam8_fp32", twin["master"], *moments, twin["grad"], s, *books)
        if ran is False:
            pytest.skip("the inductor kernel does not compile here")
        assert _run_c(tile, s, built)
        _assert_same_bits(tile, {name: twin[name] for name in tile if name not in ("grad", "high")})


def test_a_value_on_a_midpoint_takes_the_lower_code(built: native.Kernel) -> None:
    # Scalars that make the new exp_avg the gradient itself (beta1 0, no lr): a block of the
    # code book's 255 midpoints and 1 (its absmax) encodes each midpoint to the code below it,
    # as the reference (bucketize: the count of midpoints below) and the eager codec do.
    book = dynamic_map(True)
    mid = (book[1:] + book[:-1]) / 2
    tile = _tile(False, torch.float32, 3, n=BLOCK)
    tile["grad"] = torch.cat([mid, torch.tensor([1.0])])
    #                  lr/bias1, decay, l2, beta1, 1-beta1, beta2, 1-beta2, sqrt(bias2), eps, gmul
    s = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.999, 0.001, 1.0, 1e-8, 1.0])
    assert _run_c(tile, s, built)
    lower = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(tile["m_codes"], lower)
    assert torch.equal(torch.bucketize(tile["grad"], mid).to(torch.uint8), lower)
    assert float(tile["m_scales"][0]) == 1.0


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_bits(built: native.Kernel, threads: int) -> None:
    n = 3 * native.PER_THREAD + 5 * BLOCK
    one, many = _tile(False, torch.float32, 5, n), _tile(False, torch.float32, 5, n)
    s = HYPER.scalars(2.0)
    assert _run_c(one, s, built, 1) and _run_c(many, s, built, threads)
    _assert_same_bits(many, one)


def test_refuses_what_it_cannot_take(built: native.Kernel) -> None:
    # (the caller then runs the inductor kernel: nothing written here)
    s = HYPER.scalars(1.0)
    cases = []
    tile = _tile(False, torch.float16, 0)
    cases.append(tile)  # fp16 gradient
    tile = _tile(False, torch.float32, 0)
    tile["grad"] = torch.randn(2 * N)[::2]
    cases.append(tile)  # not contiguous
    tile = _tile(False, torch.float32, 0)
    tile["master"] = tile["master"].double()
    cases.append(tile)  # fp64 master
    tile = _tile(False, torch.float32, 0)
    tile["master"], tile["grad"], tile["m_codes"], tile["v_codes"] = (tile[k][:300] for k in ("master", "grad", "m_codes", "v_codes"))
    cases.append(tile)  # not whole blocks
    tile = _tile(False, torch.float32, 0)
    tile["m_scales"] = tile["m_scales"][:-1]
    cases.append(tile)  # sizes that disagree
    for tile in cases:
        before = {name: value.clone() for name, value in tile.items()}
        assert not _run_c(tile, s, built)
        for name, value in tile.items():
            assert torch.equal(value, before[name]) or torch.isnan(value).any(), name
    assert not _run_c(_tile(False, torch.float32, 0), s.double(), built)  # fp64 scalars


@pytest.mark.parametrize("compiler", ["false", "/nonexistent/cc"])
def test_a_compiler_that_fails_is_reported(monkeypatch: pytest.MonkeyPatch, compiler: str) -> None:
    monkeypatch.setenv("CC", compiler)  # ($CC is what a user asked for: no other compiler instead)
    with pytest.raises(RuntimeError, match="failed") as raised:
        native.build()
    if compiler == "false":  # (it prints nothing: the exit status says what happened)
        assert "failed (exit status 1), with no message" in str(raised.value)


@pytest.mark.device_modes
def test_training_gives_the_same_weights_with_it_on_or_off(device_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Through the optimizer: parameters large enough for the fused kernel, a partial last block.
    # On: the C kernel (on an x86 CPU); off: the inductor kernel.
    ran = [0]
    real = native.adam8

    def counted(*args: object) -> bool:
        done = real(*args)  # type: ignore[arg-type]
        ran[0] += done
        return done

    monkeypatch.setattr(native, "adam8", counted)
    real_at = native.adam8_at

    def counted_at(*args: Any) -> None:  # (the C kernel given addresses: a chunk's state in the store)
        real_at(*args)
        ran[0] += 1

    monkeypatch.setattr(native, "adam8_at", counted_at)
    weights = []
    for on in ("1", "0"):
        monkeypatch.setenv("TIERSTORE_NATIVE_ADAM8", on)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(200, 300), torch.nn.GELU(), torch.nn.Linear(300, 7))
        opt = TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, state_precision="8bit", min_offload_numel=1)
        try:
            for _ in range(4):
                model(torch.randn(16, 200)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            opt.close()
        weights.append([p.detach().clone() for p in model.parameters()])
        if on == "1":
            assert ran[0] > 0 or not native.on_x86()
    if codec._FUSED.failed:
        pytest.skip("the inductor kernel does not compile here: off is the unfused update")
    for on, off in zip(*weights, strict=True):
        assert torch.equal(on, off)


def test_a_lossless_weight_shorter_than_its_entry_is_refused_not_read_past_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel given a chunk's addresses read the bf16 weight for as many elements as the
    entry has, without the size check its views had: a weight half as long was read past its
    end, into NaN weights (a review). It now goes to the views, which refuse it."""
    monkeypatch.setenv("TIERSTORE_COMPILE_CODEC", "1")
    monkeypatch.setattr(codec._FUSED, "failed", codec._FUSED.failed)  # (a refused tile turns the compiled kernel off: restored after)
    layout = codec.StateLayout("8bit", True, False)
    numel = codec.COMPILE_MIN_NUMEL  # (the fused kernels' smallest parameter)
    state = codec.PackedState(layout, layout.empty(numel), numel, torch.zeros(numel // 2, dtype=torch.bfloat16), param_numel=numel)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="size"):
        warnings.simplefilter("ignore")  # (the compiled kernel's, refusing it too)
        state.update(torch.randn(numel), torch.tensor(0.0), lambda *args: None, HYPER)


TWO_FIRST_STEPS = r"""
import threading, torch
from tierstore.optim import TieredAdamW
N = 1 << 20

def make():
    p = torch.nn.Parameter(torch.zeros(N))
    p.grad = torch.zeros(N)
    p.grad[: N // 2] = torch.randn(N // 2, generator=torch.Generator().manual_seed(0))
    return p, TieredAdamW([p], lr=1e-3, state_precision="8bit", offload="host")

pairs = [make() for _ in range(2)]
barrier = threading.Barrier(2)
threads = [threading.Thread(target=lambda opt=opt: (barrier.wait(), opt.step())) for _, opt in pairs]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
for p, opt in pairs:
    state = opt.state_dict()["state"][0]
    print(int((state["exp_avg"][N // 2 :] != 0).sum()), int((state["exp_avg_sq"][N // 2 :] != 0).sum()))
    opt.close()
"""


def test_two_optimizers_first_steps_at_once_keep_the_moments_of_zero_gradients_zero() -> None:
    """The C kernel's code books were passed by addresses taken once a process from tensors
    that two threads making them at once could each make: the caches kept one thread's, and
    the addresses of the other's were freed memory, read by every call after. Two 8-bit
    optimizers taking their first steps at once in a fresh process then coded moments from
    garbage (a tryout: 5 runs in 6): half of each gradient is zero, so half of each moment must
    stay 0."""
    import subprocess
    import sys

    for _ in range(3):  # (each in a fresh process: the code books are made once a process)
        done = subprocess.run([sys.executable, "-c", TWO_FIRST_STEPS], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["0"] * 4, done.stdout
