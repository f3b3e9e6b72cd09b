"""The fused 8-bit AdamW kernel (``PackedState.update`` given the group's ``AdamHyper``): one
compiled kernel a tile that decodes both moments, runs AdamW and encodes them again, in place
(its C twin where a C compiler is found, the inductor kernel otherwise: both are checked).
Checked against the unfused path (the compiled codec around torch's fused AdamW) step by step,
and for the absence of recompiles across steps, tiles and learning rates."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch

from tierstore.optim import TieredAdam, TieredAdamW, native
from tierstore.optim import precision as codec
from tierstore.optim.precision import BLOCK, AdamHyper, PackedState, StateLayout

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def compiled_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernels on small entries and tiles (several tiles per entry)."""
    monkeypatch.setenv("TIERSTORE_COMPILE_CODEC", "1")
    monkeypatch.setattr(codec, "COMPILE_MIN_NUMEL", 1)
    monkeypatch.setattr(codec, "COMPILED_TILE", 4096)


def _require_compiled() -> None:
    """Skip where no C++ compiler exists; elsewhere the compiled kernels must have worked (a
    failure falls back to the unfused path with a warning, which would pass these tests)."""
    if codec._COMPILED.failed or codec._FUSED.failed:
        if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
            pytest.skip("no compiler for the compiled kernels here")
        pytest.fail("the compiled 8-bit kernels failed to compile (see the warning)")


def _torch_adam(hyper: AdamHyper):  # type: ignore[no-untyped-def]
    """What ``TieredAdam`` runs on a decoded tile without the fused kernel: torch's fused Adam."""
    from torch.optim.adam import adam

    def run(rows: list[torch.Tensor], grad: torch.Tensor, step: torch.Tensor) -> None:
        adam([rows[0]], [grad.float()], [rows[1]], [rows[2]], [], [step], foreach=False, fused=True, amsgrad=False,
             beta1=hyper.beta1, beta2=hyper.beta2, lr=hyper.lr, weight_decay=hyper.weight_decay, eps=hyper.eps,
             maximize=hyper.maximize, decoupled_weight_decay=hyper.decoupled, grad_scale=hyper.grad_scale)

    return run


def _state(layout: StateLayout, numel: int, generator: torch.Generator) -> PackedState:
    """A state after some steps: moments of a few magnitudes, one all-zero block in each."""
    high = torch.randn(numel, generator=generator).bfloat16() if layout.lossless else None
    state = PackedState(layout, layout.empty(numel), numel, high)
    rows = torch.randn(3, numel, generator=generator) * torch.tensor([[1.0], [1e-3], [1e-6]])
    rows[2].abs_()
    rows[1:, BLOCK : 2 * BLOCK] = 0.0
    if high is not None:
        rows[0] = high.float()
    state.encode(rows)
    return state


def _grad(numel: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    grad = torch.randn(numel, generator=generator) * 1e-3
    grad[BLOCK : 2 * BLOCK] = 0.0  # zero gradients over the block whose moments are zero
    grad[5 * BLOCK : 5 * BLOCK + 7] = 0.0
    return grad.to(dtype)


CASES = {
    "adamw": AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True),
    "tensor lr": AdamHyper(torch.tensor(3e-3), 0.8, 0.99, 1e-6, 0.05, True),
    "adam l2, maximize": AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, False, maximize=True),
    "grad scale": AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, grad_scale=torch.tensor(1024.0)),
}


def _inductor_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled (inductor) fused kernel, not its C twin (tierstore/optim/native.py)."""
    monkeypatch.setenv("TIERSTORE_NATIVE_ADAM8", "0")


@pytest.mark.parametrize("kernel", ["C", "inductor"])
@pytest.mark.parametrize("master", ["fp32", "lossless"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernel_agrees_with_the_unfused_update_step_by_step(case: str, master: str, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each step from the same stored state: the master within fp32 rounding of torch's fused
    # AdamW, the moments' scales within rounding, and their codes the same but for values that
    # fell on the other side of a code-book midpoint by a rounding (then the neighbouring code).
    if kernel == "inductor":
        _inductor_only(monkeypatch)
    elif native.kernel() is None:
        pytest.skip("no C kernel here (no AVX-512 or no C compiler): the inductor case covers it")
    hyper = CASES[case]
    numel = 3 * 4096 + 2 * BLOCK + 100  # whole tiles, a tile of whole blocks, a partial block (the unfused path)
    layout = StateLayout("8bit", master == "lossless", False)
    generator = torch.Generator().manual_seed(1)
    state = _state(layout, numel, generator)
    dtype = torch.bfloat16 if layout.lossless else torch.float32
    if hyper.grad_scale is not None:
        dtype = torch.float32
    for count in range(4):
        grad = _grad(numel, generator, dtype)
        if hyper.grad_scale is not None:
            grad = grad * hyper.grad_scale
        fused = PackedState(layout, state.buffer.clone(), numel, state.high)
        plain = PackedState(layout, state.buffer.clone(), numel, state.high)
        steps = [torch.tensor(float(count)), torch.tensor(float(count))]
        # (clones: torch's fused Adam writes the unscaled gradient back into the one it is given)
        fused.update(grad.clone(), steps[0], _torch_adam(hyper), hyper)
        plain.update(grad.clone(), steps[1], _torch_adam(hyper))
        _require_compiled()
        assert float(steps[0]) == float(steps[1]) == count + 1
        want, got = plain.master(), fused.master()
        assert torch.isfinite(got).all()
        # fp32 rounding of an update of about lr (lossless: the master's low half's rounding
        # may carry into the bf16 weight: one of its ulps)
        tolerance = 2**-7 if layout.lossless else 1e-6
        torch.testing.assert_close(got, want, rtol=tolerance, atol=1e-4 * float(hyper.lr))
        assert not torch.equal(got, state.master())  # it did update
        for name in layout.moments:
            torch.testing.assert_close(fused.view(f"{name}/scale"), plain.view(f"{name}/scale"), rtol=1e-5, atol=0.0)
            codes = (fused.view(f"{name}/codes").int(), plain.view(f"{name}/codes").int())
            differ = codes[0] != codes[1]
            assert int(differ.sum()) <= max(2, numel // 1000), (name, int(differ.sum()))
            assert int((codes[0] - codes[1]).abs().max()) <= 1
            assert torch.isfinite(fused.moment(name)).all()
        if hyper.decoupled:  # zero moments, zero gradient (no L2 term): still zero, no NaN
            assert torch.equal(fused.moment("exp_avg")[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
        state = plain


def test_fused_kernel_traces_once_for_steps_tiles_and_learning_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    _inductor_only(monkeypatch)
    # Scalars (a scheduled lr, the step's bias corrections) are a tensor input, tile sizes and
    # views' offsets dynamic: new values are new data, never a new graph.
    from torch._dynamo.utils import counters

    layout = StateLayout("8bit", False, False)
    generator = torch.Generator().manual_seed(2)

    def updates(sizes: list[int], lrs: list[float]) -> None:
        for numel, lr in zip(sizes, lrs, strict=True):
            state = _state(layout, numel, generator)
            hyper = AdamHyper(torch.tensor(lr), 0.9, 0.999, 1e-8, 0.1, True)
            step = torch.tensor(0.0)
            for _ in range(2):
                state.update(_grad(numel, generator, torch.float32), step, _torch_adam(hyper), hyper)

    # traced: a tile of many blocks, one of one block (its own graph), and a last block cut short
    # (alone, the file's other tests had not traced that one: a graph more below)
    updates([4096 + 2 * BLOCK, 2 * 4096 + BLOCK, 4096 + 3 * BLOCK + 5], [1e-3, 2e-3, 4e-3])
    _require_compiled()
    graphs = counters["stats"]["unique_graphs"]
    updates([3 * 4096 + 5 * BLOCK, 4 * BLOCK, 4096 + 7 * BLOCK + 11, 6 * 4096], [1e-4, 3e-2, 5e-3, 1e-3])
    assert counters["stats"]["unique_graphs"] == graphs


def _one_update(seed: int) -> Callable[[AdamHyper | None], torch.Tensor]:
    """An 8-bit state of two tiles and a gradient (from ``seed``): the function returned runs one
    AdamW update on a fresh copy of the state, offering the fused kernel its settings (given
    ``CASES["adamw"]``) or not (None), and returns the updated buffer."""
    layout = StateLayout("8bit", False, False)
    generator = torch.Generator().manual_seed(seed)
    numel = 2 * 4096
    start = _state(layout, numel, generator)
    hyper = CASES["adamw"]
    grad = _grad(numel, generator, torch.float32)

    def update(given: AdamHyper | None) -> torch.Tensor:
        state = PackedState(layout, start.buffer.clone(), numel)
        state.update(grad.clone(), torch.tensor(0.0), _torch_adam(hyper), given)
        return state.buffer

    return update


def test_without_the_compiler_the_update_is_the_unfused_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSTORE_COMPILE_CODEC", "0")
    update = _one_update(3)
    assert torch.equal(update(CASES["adamw"]), update(None))


@pytest.mark.device_modes
@pytest.mark.parametrize("cls, amsgrad", [(TieredAdamW, False), (TieredAdam, False), (TieredAdamW, True)])
def test_tiered_adam_8bit_with_the_fused_kernel_follows_torch(device_mode: str, cls: type, amsgrad: bool) -> None:
    # Through the optimizer (amsgrad: the unfused path), a tensor lr: close to torch's own
    # Adam/AdamW over a few steps (8-bit moments: the weights drift by a fraction of the lr).
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3 * 4096 + 256) * 0.1), torch.nn.Parameter(torch.randn(64, 65))]
    start = [p.detach().clone() for p in params]
    reference = [torch.nn.Parameter(p.clone()) for p in start]
    lr = 1e-3
    opt = cls(params, lr=torch.tensor(lr), weight_decay=0.1, amsgrad=amsgrad, state_precision="8bit", min_offload_numel=1)
    exact = (torch.optim.AdamW if cls is TieredAdamW else torch.optim.Adam)(reference, lr=lr, weight_decay=0.1, amsgrad=amsgrad)
    try:
        for _ in range(5):
            for p, q in zip(params, reference, strict=True):
                q.grad = torch.randn_like(q) * 1e-2
                p.grad = q.grad.clone()
            opt.step()
            exact.step()
        for p, q, before in zip(params, reference, start, strict=True):
            assert float((q.detach() - before).abs().mean()) > 2 * lr  # (the steps moved the weights)
            drift = (p.detach() - q.detach()).abs()
            assert float(drift.mean()) < 0.05 * lr and float(drift.max()) < lr, (float(drift.mean()) / lr, float(drift.max()) / lr)
    finally:
        opt.close()


def test_a_fused_kernel_that_fails_to_compile_leaves_the_unfused_update(monkeypatch: pytest.MonkeyPatch) -> None:
    # A compiler failure in the fused kernel warns once and falls back to the unfused update,
    # with the compiled codec still on: the same bits as never asking for the fused kernel.
    _inductor_only(monkeypatch)
    update = _one_update(4)
    plain = update(None)

    def broken(*args: object) -> None:
        raise RuntimeError("no such compiler (injected)")

    fused = codec._Compiled({"adam8_fp32": broken, "adam8_lossless": broken}, "the fused 8-bit AdamW kernel", "the unfused update")
    fused._kernels = {"adam8_fp32": broken, "adam8_lossless": broken}  # (as compiled: calling them fails)
    monkeypatch.setattr(codec, "_FUSED", fused)
    with pytest.warns(UserWarning, match="fused 8-bit AdamW kernel is unavailable"):
        tried = update(CASES["adamw"])
    assert fused.failed and not codec._COMPILED.failed
    assert torch.equal(tried, plain)
