"""8-bit state trains the same wherever it is placed: kept in memory, one store entry a
parameter on the host tier, or paged through the disk tier in chunks. Whether a parameter's
elements take the fused 8-bit kernel is decided by the parameter, never by the entry its state
sits in, so the weights are bit for bit the same after every step, and a checkpoint saved under
one placement continues bit for bit under another."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore.optim import TieredAdamW, native
from tierstore.optim import precision as codec
from tierstore.optim.precision import BLOCK, COMPILE_MIN_NUMEL

pytestmark = [pytest.mark.device_modes, pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]

#: Parameter sizes: above the fused kernel's threshold with a partial last block, above it in
#: whole blocks, below it (but larger than a chunk), and one smaller than a chunk.
SIZES = (COMPILE_MIN_NUMEL + 7 * BLOCK + 64, COMPILE_MIN_NUMEL + BLOCK, COMPILE_MIN_NUMEL // 2 + 100, 1000)
#: Paged through the disk tier, 8-bit state in chunks of 2,048 elements (below the threshold).
DISK = {"offload": "disk", "host_capacity": "160KiB", "chunk_bytes": "16KiB", "min_offload_numel": 100}
PLACEMENTS: dict[str, dict[str, Any]] = {
    "memory": {"min_offload_numel": 1 << 30},  # not paged: each parameter's state kept whole in memory
    "host": {"offload": "host", "min_offload_numel": 100},  # one entry a parameter on the host tier
    "disk": DISK,
}


@pytest.fixture(autouse=True)
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The compiled kernels on, in tiles smaller than the larger parameters (several a
    parameter); the list returned counts the elements the fused kernel (inductor or C) updated
    (its last item)."""
    monkeypatch.setenv("TIERSTORE_COMPILE_CODEC", "1")
    monkeypatch.setattr(codec, "COMPILED_TILE", 8192)
    counted = [0]
    real = codec._FUSED.call

    def call(name: str, *args: Any) -> Any:
        counted[-1] += args[0].numel()
        return real(name, *args)

    monkeypatch.setattr(codec._FUSED, "call", call)
    real_c = native.adam8

    def call_c(master: Any, halves: Any, moments: Any, grad: torch.Tensor, *args: Any) -> bool:
        done = real_c(master, halves, moments, grad, *args)
        counted[-1] += grad.numel() if done else 0
        return done

    monkeypatch.setattr(native, "adam8", call_c)
    real_at = native.adam8_at

    def call_at(built: Any, numel: int, *args: Any) -> None:  # (the C kernel given addresses)
        real_at(built, numel, *args)
        counted[-1] += numel

    monkeypatch.setattr(native, "adam8_at", call_at)
    return counted


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(n, generator=generator) * 0.1).to(dtype)) for n in SIZES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=generator) * 10.0 ** -(1 + i % 3)).to(dtype) for i, n in enumerate(SIZES)]


def _optimizer(params: list[torch.nn.Parameter], master: str, where: str, tmp_path: Path) -> TieredAdamW:
    options = dict(PLACEMENTS[where])
    if where == "disk":
        options["disk_root"] = tmp_path / f"disk-{len(list(tmp_path.iterdir()))}"
    return TieredAdamW(params, lr=1e-2, weight_decay=0.1, state_precision="8bit", master_weights=master, **options)


def _train(opt: TieredAdamW, params: list[torch.nn.Parameter], steps: range) -> Iterator[list[torch.Tensor]]:
    """The weights after each of ``steps``."""
    for step in steps:
        for param, grad in zip(params, _grads(step, params[0].dtype), strict=True):
            param.grad = grad
        opt.step()
        yield [p.detach().clone() for p in params]


def _check_placement(opt: TieredAdamW, where: str) -> None:
    """The placement is the one the test means (else the comparison would prove nothing)."""
    slots = opt._slots
    if where == "memory":
        assert not any(slot.paged for slot in slots)
    elif where == "host":
        assert all(slot.paged and slot.chunks is None for slot in slots)
    else:
        assert all(slot.chunks is not None and len(slot.chunks) > 1 for slot in slots[:3])
        assert max(chunk.numel for chunk in slots[0].chunks) < COMPILE_MIN_NUMEL
        assert opt.store.stats()["tiers"]["disk"]["used"] > 0


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        differ = int((a.view(-1).view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32) != b.view(-1).view(
            torch.int16 if b.dtype == torch.bfloat16 else torch.int32)).sum())
        assert differ == 0, f"{what}: parameter {n} ({a.numel()} elements): {differ} elements differ"


def _require_fused() -> None:
    if codec._FUSED.failed or codec._COMPILED.failed:
        pytest.skip("the compiled 8-bit kernels are unavailable here (no compiler)")


@pytest.mark.parametrize("master", ["fp32", "lossless"])
def test_weights_are_bit_identical_whatever_the_placement(tmp_path: Path, device_mode: str, master: str, fused_calls: list[int]) -> None:
    dtype = torch.bfloat16 if master == "lossless" else torch.float32
    runs: dict[str, list[list[torch.Tensor]]] = {}
    for where in PLACEMENTS:
        params = _params(dtype)
        opt = _optimizer(params, master, where, tmp_path)
        try:
            runs[where] = list(_train(opt, params, range(4)))
            _check_placement(opt, where)
        finally:
            opt.close()
        fused_calls.append(0)
    _require_fused()
    # Every placement took the fused kernel for the same elements: the whole blocks of the
    # parameters at or above the threshold (the partial block and smaller parameters unfused).
    fused = sum(n // BLOCK * BLOCK for n in SIZES if n >= COMPILE_MIN_NUMEL)
    assert fused_calls[:-1] == [4 * fused] * len(PLACEMENTS)
    start = _params(dtype)
    for where in ("memory", "disk"):
        for step, (got, want) in enumerate(zip(runs[where], runs["host"], strict=True)):
            _assert_same(got, want, f"{where} against host, step {step}")
    assert all(not torch.equal(a, b) for a, b in zip(runs["host"][-1], start, strict=True))  # they trained


@pytest.mark.parametrize("master", ["fp32", "lossless"])
@pytest.mark.parametrize("first, second", [("disk", "host"), ("host", "disk")])
def test_a_checkpoint_continues_bit_for_bit_on_another_placement(tmp_path: Path, device_mode: str, master: str, first: str, second: str) -> None:
    dtype = torch.bfloat16 if master == "lossless" else torch.float32
    params = _params(dtype)
    opt = _optimizer(params, master, first, tmp_path)
    try:
        list(_train(opt, params, range(2)))
        saved = opt.state_dict()
        weights = [p.detach().clone() for p in params]
        straight = list(_train(opt, params, range(2, 4)))
    finally:
        opt.close()
    resumed = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = _optimizer(resumed, master, second, tmp_path)
    try:
        opt.load_state_dict(saved)
        continued = list(_train(opt, resumed, range(2, 4)))
        _check_placement(opt, second)
    finally:
        opt.close()
    _require_fused()
    for step, (got, want) in enumerate(zip(continued, straight, strict=True), start=2):
        _assert_same(got, want, f"{first} then {second}, step {step}")
