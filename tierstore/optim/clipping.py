"""Clipping by the global gradient norm, computed on the host copies of the gradients.

The same numbers as ``torch.nn.utils.clip_grad_norm_``: one norm per gradient, the norm of
those, and the coefficient ``clip_grads_with_norm_`` multiplies by. With ``max_grad_norm=`` a
gradient's norm is computed as soon as it reaches the host (during backward) and reused at
``step()`` if the gradient did not change since; the update applies the coefficient to its
host copy, so the gradients on the device are never rewritten (nor copied again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch

from .slots import Capture, ParamSlot


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """Exactly what ``torch.nn.utils.clip_grads_with_norm_`` multiplies the gradients by."""
    clip_coef = max_norm / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


def inverse_scale(grad_scale: torch.Tensor) -> torch.Tensor:
    """What ``GradScaler.unscale_`` multiplies the gradients by (computed as it does)."""
    return grad_scale.double().reciprocal().float()


async def total_norm(
    captured: list[tuple[ParamSlot, Capture]], norm_of: Callable[[ParamSlot, Capture, float], Awaitable[torch.Tensor]], norm_type: float,
    *, ahead: bool = True,
) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients ``captured`` (in parameter order, as torch stacks
    them), reusing each capture's 2-norm computed ahead unless ``ahead`` is False."""
    norms = []
    for slot, capture in captured:
        if norm_type == 2.0 and ahead:
            if capture.norm is None:
                capture.norm = await norm_of(slot, capture, 2.0)
            norms.append(capture.norm)
        else:
            norms.append(await norm_of(slot, capture, norm_type))
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)
