"""transformers' ``Trainer`` with a tiered optimizer: the gradient norm on the host copies.

Every optimizer step the Trainer (transformers 5) calls ``clip_grad_norm_`` on the model's
parameters: to clip (``max_grad_norm > 0``), or with an infinite bound only to log the norm,
which still multiplies every gradient in place by 1.0. Both change ``p.grad`` after backward, so
a tiered optimizer whose gradients cross a link (a GPU, the emulated device) takes every gradient
to the host a second time at ``step()``. ``TieredTrainer`` hands both calls to the optimizer's
``clip_grad_norm_`` instead: the same total norm and the same clipped update (torch's formula,
on the host copies), the gradients on the device untouched and copied once. With any other
optimizer it is the plain ``Trainer``, and so it is under fp16 loss scaling (accelerate's
``GradScaler``): the norm and the clipping are of the unscaled gradients, which only the
Trainer's own path (``unscale_`` on ``p.grad``, then ``clip_grad_norm_``) gives.

Needs ``pip install tierstore[hf]``.
"""

from __future__ import annotations

from typing import Any

import transformers

from ..optim import PagedOptimizer

__all__ = ["TieredTrainer", "TieredTrainerMixin"]


def paged_optimizer(optimizer: Any) -> PagedOptimizer | None:
    """The tiered optimizer inside accelerate's wrapper (or as it is), else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, PagedOptimizer) else None


class TieredTrainerMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to measure and clip gradient
    norms on the tiered optimizer's host copies (see the module docstring)."""

    optimizer: Any
    args: Any

    accelerator: Any

    def _host_clipping(self) -> PagedOptimizer | None:
        """The tiered optimizer when it may measure and clip, else None (the Trainer's own path)."""
        optimizer = paged_optimizer(self.optimizer)
        if optimizer is None or optimizer.step_in_backward:
            return None
        # The scaler's pending scale is in p.grad (and the host copies): the norm must be of
        # unscaled gradients, and unscale_ rewrites p.grad; the Trainer's path does that.
        if getattr(self.accelerator, "scaler", None) is not None:
            return None
        return optimizer

    def _clip_grad_norm(self, model: Any) -> Any:
        optimizer = self._host_clipping()
        if optimizer is None:
            return super()._clip_grad_norm(model)  # type: ignore[misc]
        return optimizer.clip_grad_norm_(self.args.max_grad_norm, parameters=model.parameters())  # (its order: same bits)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        optimizer = self._host_clipping()
        if grad_norm is None and optimizer is not None:
            grad_norm = optimizer.clip_grad_norm_(float("inf"), parameters=model.parameters())  # (a coefficient of exactly 1.0: the norm only)
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]


class TieredTrainer(TieredTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that leaves gradient clipping and norms to a tiered optimizer."""
