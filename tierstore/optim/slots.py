"""``ParamSlot``: everything the optimizer tracks for one parameter, in one record.

A slot's step-scoped fields (capture, grad, progress) belong to the store's event loop: only
code running there reads or writes them. The training and autograd threads hand work to the loop
instead of touching them.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device import Link


@dataclass(eq=False)
class Capture:
    """A gradient taken to the host tier: a copy of ``tensor`` as it was at ``version``.

    The copy taken when the gradient's hook fires is speculative: it counts only if, when
    ``step()`` runs, ``p.grad`` is still that tensor object at that version (torch's version
    counter moves with every in-place change). A DDP capture is taken from the averaged bucket
    and gets its ``(tensor, version)`` at the end of backward, once DDP wrote ``p.grad``.
    """

    #: The gradient tensor the copy was taken from (weakly: a gradient the user dropped is freed).
    tensor: weakref.ref[torch.Tensor] | None
    version: int
    #: The copy into the store (``None`` when the link lends the gradient instead).
    task: asyncio.Task[None] | None = None
    #: The gradient itself, when the link lends (device memory is host memory).
    lent: torch.Tensor | None = None
    #: Its 2-norm, computed ahead for ``max_grad_norm`` (valid for this capture only).
    norm: torch.Tensor | None = None
    #: The link's marker of the producer's work before the capture (orders the weight write-back).
    marker: Any = None
    #: Taken from a DDP bucket (its tensor and version are set at the end of backward).
    ddp: bool = False
    #: Where the gradient's memory was and how it was laid out: ``p.grad.data = other`` keeps
    #: the tensor object and its version counter but not these.
    memory: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    #: Not copied when taken: the update copies it over the link into a scratch buffer.
    deferred: bool = False
    #: ``values_fingerprint`` of the gradient when taken, where its version counter does not
    #: tell (a DTensor's local shard: ``matches`` compares the values' fingerprint instead).
    fingerprint: torch.Tensor | None = None
    #: ``(gradient, whether its fingerprint is this one's)``, compared for many at once
    #: (``compare_fingerprints``: one wait for the device a step, not one per parameter).
    compared: tuple[torch.Tensor, bool] | None = None

    def matches(self, grad: torch.Tensor | None, version: int | None) -> bool:
        """Whether this copy is ``grad`` at ``version`` (``p.grad`` as ``step()`` sees it), in
        the same memory (with a fingerprint: in the same memory with the same values, the
        gradient a new view of them; not by version, which tells nothing there either way:
        foreach ops leave it, and FSDP2 moves it after the hook when accumulating, values kept)."""
        if grad is None or self.memory != memory_of(grad):
            return False
        if self.fingerprint is not None:
            if self.compared is not None and self.compared[0] is grad:
                return self.compared[1]
            return torch.equal(self.fingerprint, values_fingerprint(grad))
        return self.tensor is not None and self.tensor() is grad and self.version == version


def compare_fingerprints(pairs: list[tuple[Capture, torch.Tensor]]) -> None:
    """For each ``(capture, gradient)`` whose capture has a fingerprint: whether the gradient's
    values still have it, into ``capture.compared``, with one wait for the device in all."""
    by_device: dict[torch.device, list[tuple[Capture, torch.Tensor]]] = {}
    for capture, grad in pairs:
        if capture.fingerprint is not None:
            by_device.setdefault(capture.fingerprint.device, []).append((capture, grad))
    for device, group in by_device.items():  # (FSDP2's CPU offload of some modules: two devices)
        then = torch.stack([capture.fingerprint for capture, _ in group])  # type: ignore[misc]
        now = torch.stack([values_fingerprint(grad).to(device) for _, grad in group])
        for (capture, grad), same in zip(group, (then == now).all(dim=1).tolist(), strict=True):
            capture.compared = (grad, bool(same))


def memory_of(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """The address, shape and strides of ``tensor``'s data."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


_INTS_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: Segments whose sums ``values_fingerprint`` keeps apart (where the values sit matters).
FINGERPRINT_SEGMENTS = 16


def values_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``2 + FINGERPRINT_SEGMENTS`` int64 values on ``tensor``'s device that change when its
    values do: the sum of its elements' bit patterns, then the bits of the float64 sums of its
    values in ``FINGERPRINT_SEGMENTS`` equal segments (one element each if fewer) and of the
    rest. A negation or a move between segments changes a segment's sum where the plain sum of
    bit patterns can stay (balanced signs). A few reductions, no copy, no wait for the device.
    For gradients whose version counter does not move: torch's in-place foreach ops on a
    DTensor (``clip_grad_norm_``'s) leave the local tensor's version as it was. A change that
    keeps the bits (a scaling by 1.0) is no change; values exchanged within a segment are not
    seen."""
    flat = tensor.detach().contiguous().view(-1)
    ints = flat if flat.element_size() in _INTS_OF_SIZE else flat.view(torch.int64)  # (complex128: two int64 each)
    parts = [ints.view(_INTS_OF_SIZE[ints.element_size()]).sum(dtype=torch.int64).view(1)]
    real = torch.view_as_real(flat).view(-1) if flat.is_complex() else flat
    count = 0
    if real.is_floating_point() and real.element_size() >= 2 and real.numel():  # (float8: no sum kernel)
        count = min(FINGERPRINT_SEGMENTS, real.numel())
        length = real.numel() // count
        parts.append(real[: count * length].view(count, length).sum(dim=1, dtype=torch.float64).view(torch.int64))
        parts.append(real[count * length :].sum(dtype=torch.float64).view(torch.int64).view(1))
    else:
        parts.append(torch.zeros(1, dtype=torch.int64, device=flat.device))
    if count < FINGERPRINT_SEGMENTS:
        parts.append(torch.zeros(FINGERPRINT_SEGMENTS - count, dtype=torch.int64, device=flat.device))
    return torch.cat(parts)


@dataclass(eq=False)
class ParamSlot:
    """Everything the optimizer tracks for one parameter (one record, not parallel maps)."""

    index: int
    group: int
    param: torch.Tensor
    key: str
    #: The parameter's shape (its data may be a placeholder while ``offload_parameters`` keeps
    #: the weight in a store).
    shape: torch.Size
    paged: bool
    #: The boundary between the parameter's device and the host (``link.lends``: none).
    link: Link
    hook: Any = None
    #: Order of arrival of this step's gradient (updates follow it).
    arrival: int = 0
    #: This step's gradient on the host, if taken (see ``Capture``).
    capture: Capture | None = None
    #: The capture an update in backward used (``step_in_backward``): ``step()`` checks it still holds.
    used: Capture | None = None
    #: Progress of this step's update, so a step that failed part-way is completed, never repeated.
    updated: bool = False
    written: bool = False
    #: State of a parameter too small to page, kept in host memory.
    resident: dict[str, Any] | None = None
    #: The pieces its state is paged in when larger than a chunk (``tierstore.optim.chunks``);
    #: None: one entry for the whole parameter.
    chunks: list[Any] | None = None
    #: Chunks of this step's update already applied / whose weight is written (``chunks`` only).
    chunks_updated: set[int] = field(default_factory=set)
    chunks_written: set[int] = field(default_factory=set)
    #: Whether the parameter is its own fp32 master (the plain layout without a master row),
    #: decided once, when its state is first laid out (``TieredAdam``); None: not decided yet.
    param_master: bool | None = None
    #: The parameter's ``(version, data address)`` after the optimizer last wrote it: anything
    #: else means a write from outside (``load_state_dict``, ``p.mul_`` under ``no_grad``,
    #: ``p.data = ...``), which the update takes into its master (``foreign_write``).
    seen: tuple[int, int] | None = None
    #: This step's update reloads the master from the parameter (a write from outside).
    reload: bool = False
    #: The master was loaded from a checkpoint: the first update checks that the parameter holds
    #: what it rounds to, else restarts it from the parameter (``TieredAdam._reloads``); a
    #: chunked parameter, chunk by chunk (those checked in ``master_checked_chunks``).
    verify_master: bool = False
    #: The checkpoint had no master (torch's AdamW keeps none for a bf16 model): the one loaded
    #: is the weight at the load, and the first update takes the weight as it is then, silently
    #: (the model's weights may be loaded after the optimizer's state).
    master_from_weight: bool = False
    master_checked_chunks: set[int] = field(default_factory=set)
    #: With a lossless master, what the load kept to tell which weight the model holds
    #: (``tierstore.optim.lossless_load.LoadedMaster``), until the master is checked.
    loaded_master: Any = None

    @property
    def grad_key(self) -> str:
        return f"{self.key}/grad"

    @property
    def state_keys(self) -> list[str]:
        """The store keys of its paged state, in update order: one, or one a chunk."""
        return [self.key] if self.chunks is None else [chunk.key for chunk in self.chunks]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def master_to_check(self, chunk: Any) -> bool:
        """Whether the loaded master of ``chunk`` (None: the whole parameter) is still to check."""
        return self.verify_master and (chunk is None or chunk.index not in self.master_checked_chunks)

    def master_checked(self, chunk: Any) -> None:
        """The loaded master of ``chunk`` (None: of the whole parameter) was checked."""
        if chunk is not None:
            self.master_checked_chunks.add(chunk.index)
            if self.chunks is not None and len(self.master_checked_chunks) < len(self.chunks):
                return
        self.verify_master = self.master_from_weight = False
        self.master_checked_chunks.clear()
        self.loaded_master = None

    def note_written(self) -> None:
        """The optimizer wrote the parameter (or its master is the parameter's value now)."""
        self.verify_master = self.master_from_weight = False
        self.master_checked_chunks.clear()
        self.loaded_master = None
        self.note_seen()

    def note_seen(self) -> None:
        """The parameter as it is now is known to the master (no write from outside since)."""
        if isinstance(self.param, torch.Tensor):  # (a rank's view of a sharded one is not tracked)
            self.seen = (self.param._version, self.param.data_ptr())

    def foreign_write(self) -> bool:
        """Whether the parameter was written from outside since the optimizer last wrote it.
        Torch's version counter sees in-place writes to ``p`` (not those through ``p.data``,
        which has a counter of its own) and a new ``p.data`` changes its address."""
        return self.seen is not None and self.seen != (self.param._version, self.param.data_ptr())

    def reset_step(self) -> None:
        """Forget this step's gradient and progress (the step ended or was abandoned)."""
        self.capture = self.used = None
        self.updated = self.written = self.reload = False
        self.chunks_updated.clear()
        self.chunks_written.clear()
