"""A parameter that is its own fp32 master (plain CPU, fp32 state) whose ``.data`` is replaced
after its state was held for an update and before the math ran (``p.data = ...`` from the
training thread while a bucket of ``step_in_backward`` is queued, a ``model.to(...)``). The rows
of that update are made on the math thread (``adam._MasterRows``): data of another dtype or not
contiguous is updated through a copy and written back, as it was before the rows were made
lazily; data of another size fails the step clearly instead of the fused kernel (which checks
no sizes) reading and writing past its end.

The replacement is made at the one point between the hold and the math: just before the
pipeline's ``_compute_bucket`` runs (the test's only use of an internal)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierstore.device import emulate_device
from tierstore.optim import StepIncompleteError, TieredAdamW
from tierstore.optim import pipeline as pipeline_module

SHAPE = (64, 128)


def _step_replacing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]:
    """One step of a paged parameter whose data ``replace`` swaps between the hold and the
    math; returns the parameter, the data put in and the gradient."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(SHAPE))
    grad = torch.randn(SHAPE)
    swapped: list[torch.Tensor] = []
    original = pipeline_module.UpdatePipeline._compute_bucket

    def compute_bucket(self, slots, states, *rest):  # type: ignore[no-untyped-def]
        if not swapped:
            param.data = replace(param.data)
            swapped.append(param.data.clone())
        return original(self, slots, states, *rest)

    monkeypatch.setattr(pipeline_module.UpdatePipeline, "_compute_bucket", compute_bucket)
    with emulate_device(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = TieredAdamW([param], lr=0.1, offload="disk", disk_root=tmp_path, min_offload_numel=1)
        try:
            param.grad = grad.clone()
            try:
                opt.step()
            finally:
                param.grad = None
        finally:
            opt.close()
    assert swapped, "the update never ran"
    return param, swapped[0], grad


def _torch_step(start: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    ref = torch.nn.Parameter(start.float().clone())
    ref.grad = grad.clone()
    torch.optim.AdamW([ref], lr=0.1, fused=True).step()
    return ref.detach()


@pytest.mark.parametrize(
    "replace",
    [lambda data: (data + 1).to(torch.bfloat16), lambda data: (data + 1).t().contiguous().t()],
    ids=["bf16", "not contiguous"],
)
def test_data_that_cannot_be_updated_in_place_is_updated_through_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replace: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    param, start, grad = _step_replacing(tmp_path, monkeypatch, replace)
    assert param.dtype == start.dtype and param.stride() == replace(torch.zeros(SHAPE)).stride()
    if start.dtype == torch.bfloat16:
        assert torch.equal(param.detach(), _torch_step(start, grad).to(start.dtype))
    else:  # (which gradient element meets which weight is moot once the layout changed under the
        # step: every element took one first Adam step, lr * sign, plus the decay's share)
        moved = (param.detach() - start * (1 - 0.1 * 1e-2)).abs()
        assert torch.allclose(moved, torch.full(SHAPE, 0.1), atol=1e-5), moved


@pytest.mark.parametrize("shape", [(64, 64), (65, 128), (8192 * 4,)], ids=["smaller", "larger", "larger, flat"])
def test_data_of_another_size_fails_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]) -> None:
    with pytest.raises(StepIncompleteError, match="replaced during the step"):
        _step_replacing(tmp_path, monkeypatch, lambda data: torch.full(shape, 3.0))
