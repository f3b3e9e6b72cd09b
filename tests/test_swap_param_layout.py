"""offload_parameters keeps a parameter as the plain module has it: a non-contiguous one (a
transposed weight, channels_last convolutions) computes, gets its gradient and comes back with
its strides (it came back contiguous: a reduction over a transposed weight summed in another
order, its gradient differed in the last bits, and detach() left it contiguous for good), and a
complex parameter may be used through its float views (``.real``, ``.imag``,
``torch.view_as_real``: backward raised a storage-bounds RuntimeError) and its conjugate
views (``w.conj()``, ``w.mH``: the lazy conjugate bit was lost, and x's gradient wrong)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tierstore import SyncTierStore
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(300, 500).t())  # (500, 300), laid out transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sum(0) + self.w.sum(0)  # (the column sums read it in its memory order)


def _channels_last() -> nn.Module:
    net = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1))
    return net.to(memory_format=torch.channels_last)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize(("make", "shape"), [(Transposed, (7, 500)), (_channels_last, (2, 16, 12, 12))], ids=["transposed", "channels_last"])
def test_a_non_contiguous_parameter_keeps_its_strides_and_bits(
    swap_store: SyncTierStore, device_mode: str, make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    strides = {name: p.stride() for name, p in model.named_parameters()}
    params = offload_parameters(model, swap_store)
    x = torch.randn(shape)
    if x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    for _ in range(2):  # (the second step holds the weights again)
        out, expected = model(x), plain(x)
        assert _same_bits(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert _same_bits(p.grad, q.grad), name  # type: ignore[arg-type]
        params.mark_step()
    state = model.state_dict()
    for name, q in plain.state_dict().items():
        assert _same_bits(state[name], q), name
    params.detach()
    for name, p in model.named_parameters():
        assert p.stride() == strides[name], name
        assert torch.equal(p, dict(plain.named_parameters())[name])


class Complex(nn.Module):
    def __init__(self, view: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=torch.complex64))
        self.view = view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.view in ("conj", "mH"):  # (complex views whose bytes are the weight's, their values not)
            return (x.to(torch.complex64) @ (self.w.conj() if self.view == "conj" else self.w.mH)).abs().sum()
        if self.view == "real":
            w = self.w.real
        elif self.view == "imag":
            w = self.w.imag
        elif self.view == "conj().imag":
            w = self.w.conj().imag  # (a negative view)
        else:
            w = torch.view_as_real(self.w)[..., 1]
        return (x @ w).pow(2).sum()  # (mm saves the float view for x's gradient)


@pytest.mark.parametrize("view", ["real", "imag", "view_as_real", "conj", "mH", "conj().imag"])
def test_a_complex_parameter_used_through_a_float_view(swap_store: SyncTierStore, device_mode: str, view: str) -> None:
    torch.manual_seed(0)
    model = Complex(view)
    plain = copy.deepcopy(model)
    offload_parameters(model, swap_store)
    x = torch.randn(3, 6, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    loss, expected = model(x * 1), plain(y * 1)
    assert torch.equal(loss, expected)
    loss.backward()  # (raised: the view rebuilt in the parameter's complex dtype ran past its storage)
    expected.backward()
    assert torch.equal(x.grad, y.grad)  # type: ignore[arg-type]
    assert torch.equal(model.w.grad, plain.w.grad)  # type: ignore[arg-type]
