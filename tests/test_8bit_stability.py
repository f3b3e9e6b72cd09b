"""8-bit moments where a block's gradients span many decades: an element whose gradient is 10**4+
times smaller than its block's largest, then zero (an embedding row used once), must not step
thousands of times ``lr``. Its second moment, rounded to code 0, left ``m / eps`` (a new user's
finding); a positive second moment now takes at least the smallest code above 0, which can only
shorten the step. Checked for the small-entry codec and the fused kernel (C and compiled)."""

from __future__ import annotations

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _largest_steps(make: object, numel: int, small: float) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(numel))
    opt = make([p])  # type: ignore[operator]
    grad = torch.full((numel,), small)
    grad[::256] = 1.0
    steps = []
    try:
        for step in range(3):
            before = p.detach().clone()
            p.grad = grad.clone() if step == 0 else torch.zeros(numel)
            opt.step()
            opt.zero_grad()
            steps.append(float((p.detach() - before).abs().max()) / 1e-2)
    finally:
        if isinstance(opt, TieredAdamW):
            opt.close()
    return steps


@pytest.mark.parametrize("small", [1e-4, 1e-6])
@pytest.mark.parametrize("numel", [256, 1 << 16], ids=["small entry", "fused kernel"])
@pytest.mark.parametrize("kernel", ["default", "compiled"])
def test_a_gradient_far_below_its_block_max_takes_no_huge_step(device_mode: str, small: float, numel: int, kernel: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "compiled":
        monkeypatch.setenv("TIERSTORE_NATIVE_ADAM8", "0")
    exact = _largest_steps(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0), numel, small)
    ours = _largest_steps(lambda ps: TieredAdamW(ps, lr=1e-2, weight_decay=0.0, state_precision="8bit"), numel, small)
    assert all(o <= 1.2 * e for o, e in zip(ours, exact, strict=True)), (ours, exact)


def test_an_embedding_trains_without_huge_steps(device_mode: str) -> None:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(300, 64)
    opt = TieredAdamW(embedding.parameters(), lr=1e-3, state_precision="8bit")
    try:
        for _step in range(6):
            before = embedding.weight.detach().clone()
            rows = torch.randint(0, 300, (8,))
            embedding(rows).square().sum().backward()
            opt.step()
            opt.zero_grad()
            assert float((embedding.weight.detach() - before).abs().max()) / 1e-3 < 2.0
    finally:
        opt.close()


def _after_a_non_finite_weight(make: object, numel: int, bad: float | None) -> torch.Tensor:
    """Weights after three steps with finite gradients, one weight set to ``bad`` after the
    first (None: left as it is)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel))
    opt = make([p])  # type: ignore[operator]
    try:
        for step in range(3):
            p.grad = torch.randn(numel)
            opt.step()
            if step == 0 and bad is not None:
                with torch.no_grad():
                    p[7] = bad
    finally:
        if isinstance(opt, TieredAdamW):
            opt.close()
    return p.detach().clone()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("numel", [256, 1 << 16], ids=["small entry", "fused kernel"])
@pytest.mark.parametrize("kernel", ["default", "compiled"])
def test_a_non_finite_weight_stays_its_own_under_adamw(device_mode: str, bad: float, numel: int, kernel: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's AdamW adds no ``p * weight_decay`` to the gradient (its decay is decoupled), so a
    NaN or inf weight leaves the moments finite and the other weights untouched; the 8-bit
    kernels added ``p * 0``, a NaN that took the whole block's scale and every weight in it. Now
    the other weights are those of the same steps without it, bit for bit."""
    if kernel == "compiled":
        monkeypatch.setenv("TIERSTORE_NATIVE_ADAM8", "0")
    exact = _after_a_non_finite_weight(lambda ps: torch.optim.AdamW(ps, lr=1e-2), numel, bad)
    ours = _after_a_non_finite_weight(lambda ps: TieredAdamW(ps, lr=1e-2, state_precision="8bit"), numel, bad)
    others = torch.ones(numel, dtype=torch.bool)
    others[7] = False
    assert torch.isfinite(exact[others]).all()
    assert torch.isfinite(ours[others]).all(), f"{int((~torch.isfinite(ours[others])).sum())} other weights became non-finite"
    clean = _after_a_non_finite_weight(lambda ps: TieredAdamW(ps, lr=1e-2, state_precision="8bit"), numel, None)
    assert torch.equal(ours[others], clean[others])


@pytest.mark.parametrize("scale", [1e19, 4e19])
@pytest.mark.parametrize("kernel", ["default", "compiled"])
def test_huge_finite_gradients_keep_the_fused_kernels_finite(device_mode: str, scale: float, kernel: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused 8-bit kernels computed ``g * g * (1 - beta2)``: ``g * g`` overflows fp32 from
    |g| ~ 1.8e19, and the whole block's second moment and weights became NaN, where torch's
    AdamW (``(1 - beta2) * g`` first) and the eager codec stay finite (a tryout)."""
    if kernel == "compiled":
        monkeypatch.setenv("TIERSTORE_NATIVE_ADAM8", "0")
    torch.manual_seed(0)
    numel = 1 << 16
    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: TieredAdamW(ps, lr=1e-2, state_precision="8bit")):
        p = torch.nn.Parameter(torch.randn(numel))
        opt = make([p])
        try:
            for _ in range(3):
                p.grad = torch.randn(numel) * scale
                opt.step()
            state = opt.state_dict()["state"][0]
        finally:
            if isinstance(opt, TieredAdamW):
                opt.close()
        assert torch.isfinite(p).all(), type(opt).__name__
        assert torch.isfinite(state["exp_avg_sq"]).all() and torch.isfinite(state["exp_avg"]).all(), type(opt).__name__
