"""An autograd function whose backward raises: a training step whose backward fails."""

from __future__ import annotations

from typing import Any

import torch


class FailingBackward(torch.autograd.Function):
    """The identity (a copy) forward; backward raises ``ValueError("backward failed")``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed")
