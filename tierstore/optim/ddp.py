"""DDP: take each gradient to the host after its all-reduce, while backward still runs.

Under ``DistributedDataParallel`` a gradient's hook fires with the rank's own gradient; DDP
averages it across ranks in buckets and writes the average into ``p.grad`` at the end of
backward. The optimizer would see that change at ``step()`` (the version counter moves) and copy
every gradient again, after backward. ``attach_ddp`` instead registers a communication hook that
chains the copy onto the all-reduce's future: each bucket's averaged gradients start their trip
to the host as soon as the bucket is reduced, overlapping the rest of backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .distributed import ParamRange

if TYPE_CHECKING:
    from .paging import PagedOptimizer

#: A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``.
CommHook = Callable[[Any, Any], "torch.futures.Future[torch.Tensor]"]


def average_as_ddp(process_group, bucket):  # (DDP checks annotations: none)
    """A communication hook that averages a bucket's gradients as DDP's own reducer does when no
    hook is registered: multiplied by 1/world, then summed over the ranks. (Torch's
    ``allreduce_hook`` divides by the world size instead, which rounds differently where it is
    not a power of two: training with it is not bit for bit what plain DDP gives.) One case
    still differs so: DDP made with ``gradient_as_bucket_view=True`` whose gradients are zeroed
    with ``set_to_none=False`` accumulates into the bucket and divides it in place."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def attach_ddp(optimizer: PagedOptimizer, ddp_model: torch.nn.Module, hook: CommHook | None = None, state: Any = None) -> None:
    """Take the gradients of ``ddp_model``'s parameters after their all-reduce.

    Registers a communication hook on ``ddp_model`` (a ``DistributedDataParallel``) that runs
    ``hook(state, bucket)`` (default: ``average_as_ddp``, which averages as DDP does with no hook,
    with ``state`` the process group or None for the default one) and, when its future completes, starts the
    copies of the bucket's averaged gradients to the host; the bucket goes back to DDP unchanged.
    A hook of your own (compression, say) is passed here as ``hook=``/``state=`` rather than
    registered on the model: DDP takes one communication hook, and one registered already raises
    ``ValueError``.

    Without ``attach_ddp`` the results are the same: ``step()`` sees that DDP changed every
    ``p.grad`` after its hook fired and copies each again, after backward (slower, not wrong).
    With ``step_in_backward=True`` only attached DDP can work: updates start from the averaged
    gradients.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"attach_ddp takes a DistributedDataParallel model, not {type(ddp_model).__name__}")
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError(
            "the DDP model has a communication hook registered already; register none and pass yours to "
            "attach_ddp(optimizer, model, hook=your_hook, state=your_state): it runs first, then the copies"
        )
    params = {id(p) for p in ddp_model.parameters() if p.requires_grad}
    slots: dict[int, list[Any]] = {}  # by parameter: its slot, or (sharded) the slot of our rows of it
    for slot in optimizer._slots:
        param = slot.param.parameter if isinstance(slot.param, ParamRange) else slot.param
        if id(param) in params:
            slots.setdefault(id(param), []).append(slot)
    if not slots:
        raise ValueError("none of the optimizer's parameters belongs to this DDP model")
    capture = optimizer._capture
    chained = _Chained(hook or average_as_ddp, state, weakref.ref(capture), slots)
    try:
        ddp_model.register_comm_hook(chained, _comm_hook)
    except RuntimeError as exc:  # a built-in hook registered in C++ is not listed in _comm_hooks
        raise ValueError(f"cannot register the copying hook on this DDP model ({exc}); pass your hook as attach_ddp(..., hook=)") from exc
    capture.watch_ddp([slot for group in slots.values() for slot in group])


class _Chained:
    """The state of our communication hook: the user's hook and where the gradients go."""

    def __init__(self, hook: CommHook, state: Any, capture: Any, slots: dict[int, Any]) -> None:
        self.hook = hook
        self.state = state
        self.capture = capture
        self.slots = slots


def _comm_hook(chained, bucket):  # DDP checks these annotations: none
    """Run the user's hook, then start the copies of the reduced bucket's gradients."""
    buffer = bucket.buffer()
    layout = [
        # DDP lays each gradient out in the bucket with its parameter's strides (a channels-last
        # weight's too), whatever strides the views bucket.gradients() returns have
        (param, grad.storage_offset() - buffer.storage_offset(), grad.numel(), param.shape,
         param.stride() if _dense(param) else grad.stride())
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True)
    ]
    future = chained.hook(chained.state, bucket)

    def reduced(done: torch.futures.Future[Any]) -> torch.Tensor:
        value = done.value()
        tensor = value[0] if isinstance(value, (list, tuple)) else value
        capture = chained.capture()
        if capture is not None:
            flat = tensor.view(-1)
            for param, offset, numel, shape, stride in layout:
                for slot in chained.slots.get(id(param), ()):
                    grad = flat[offset : offset + numel].as_strided(shape, stride)
                    if isinstance(slot.param, ParamRange):  # (a split parameter is contiguous)
                        grad = grad.reshape(-1)[slot.param.start : slot.param.stop]
                    capture.bucket_ready(slot, grad)
        return tensor

    return future.then(reduced)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s strides lay its elements out densely, without overlap, in some order
    of its dimensions (DDP then lays the gradient out in the bucket with those strides)."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.shape[d])):
        if tensor.shape[dim] != 1 and tensor.stride(dim) != expected:
            return False
        expected *= tensor.shape[dim]
    return True
