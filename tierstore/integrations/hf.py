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

With sharded state (``process_group=``) a rank's ``state_dict()`` holds its own parameters'
state, and the Trainer saves rank 0's alone: ``TieredTrainer`` also saves every other rank's
(``optimizer.rank{r}-of-{n}.pt`` beside ``optimizer.pt``) and, resuming with the same number of
ranks, has each rank load its own, so a resumed run goes on as the uninterrupted one.

Needs ``pip install tierstore[hf]``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
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
        return optimizer.clip_grad_norm_(self.args.max_grad_norm, **_in_order_of(optimizer, model))

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        optimizer = self._host_clipping()
        if grad_norm is None and optimizer is not None:
            grad_norm = optimizer.clip_grad_norm_(float("inf"), **_in_order_of(optimizer, model))  # (a coefficient of exactly 1.0: the norm only)
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        sharding = _sharding(self.optimizer)
        with warnings.catch_warnings():
            if sharding is not None:  # (its warning is for a checkpoint of rank 0's dict alone)
                warnings.filterwarnings("ignore", "with process_group=, state_dict\\(\\) holds this rank's state only", RuntimeWarning)
            if sharding is not None and sharding.rank:  # (rank 0's own dict is the Trainer's optimizer.pt)
                os.makedirs(output_dir, exist_ok=True)
                torch.save(self.optimizer.state_dict(), _rank_file(output_dir, sharding))
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        optimizer, sharding = paged_optimizer(self.optimizer), _sharding(self.optimizer)
        own = _rank_file(checkpoint, sharding) if checkpoint is not None and sharding is not None and sharding.rank else None
        if optimizer is None or own is None or not os.path.isfile(own):
            # (another world size: rank 0's dict, refused on the other ranks, saying why)
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        state = torch.load(own, map_location="cpu", weights_only=True)
        # The Trainer loads optimizer.pt (rank 0's) into every rank: this rank takes its own instead.
        optimizer.load_state_dict = lambda _rank0s: type(optimizer).load_state_dict(optimizer, state)  # type: ignore[method-assign,assignment]
        try:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        finally:
            del optimizer.load_state_dict


def _in_order_of(optimizer: PagedOptimizer, model: Any) -> dict[str, Any]:
    """``clip_grad_norm_``'s ``parameters=``: the model's order, as the Trainer's own call sums
    (same bits); none with sharded state or FSDP2, which sum in the global parameter order and
    refuse it."""
    global_order = optimizer._sharding is not None or optimizer._mesh_group() is not None
    return {} if global_order else {"parameters": model.parameters()}


def _sharding(optimizer: Any) -> Any:
    """The tiered optimizer's sharding (``process_group=``), or None."""
    return getattr(paged_optimizer(optimizer), "_sharding", None)


def _rank_file(folder: str, sharding: Any) -> str:
    return os.path.join(folder, f"optimizer.rank{sharding.rank}-of-{sharding.world}.pt")


class TieredTrainer(TieredTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that leaves gradient clipping and norms to a tiered optimizer."""
