"""Torch's fused Adam on a non-contiguous parameter, in the parameter's memory order.

The optimizer keeps a parameter's state flat in logical order (``param.reshape(-1)``). Torch's
fused CPU kernel walks a tensor in memory order and computes its last ``numel % vector width``
elements on a scalar path whose rounding differs from the vectorised one (``exp_avg_sq`` and
the weight by an ulp). For a transposed parameter those are other elements than the last ones in
logical order, so the same call on the logical-order state gives different bits. Handing the
kernel copies in the parameter's memory order gives torch's bits; the copies cost two passes
over the state of such parameters only (rare, and the kernels on contiguous ones are untouched).
"""

from __future__ import annotations

import torch

from ..tensors import memory_order

__all__ = ["InMemoryOrder", "memory_order"]


class InMemoryOrder:
    """Memory-order copies of a parameter's logical-order state ``rows`` (``rows``) and its
    gradient (``grad``); ``write_back`` copies the updated rows back."""

    def __init__(self, param: torch.Tensor, dims: list[int], rows: list[torch.Tensor], grad: torch.Tensor) -> None:
        self._shape, self._dims, self._logical = param.shape, dims, rows
        self.rows = [self._laid_out(row) for row in rows]
        self.grad = self._laid_out(grad)

    def _laid_out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(self._shape).permute(self._dims).reshape(-1)  # (a view where already laid out so)

    def write_back(self) -> None:
        permuted = [self._shape[d] for d in self._dims]
        for logical, laid in zip(self._logical, self.rows, strict=True):
            logical.view(self._shape).permute(self._dims).copy_(laid.view(permuted))
