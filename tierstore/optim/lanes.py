"""Torch's Adam on a part of a parameter, each element taking the code path it takes in the whole.

Torch's CPU kernels run a tensor in full vectors and the elements past its last full vector in
a scalar loop that rounds differently (the fused Adam's vector body computes the first moment
with a fused multiply-add, its scalar loop without; its tasks are whole cache lines). Run on a
slice that starts or ends inside the whole tensor's vector body, the kernel takes some of those
elements through the scalar loop, and their last bits differ from torch's on the whole tensor:
a parameter split across ranks (``ParamRange``) is cut at a row, not at a vector.

``on_whole_lanes`` splits each such entry into its elements before the whole tensor's first
multiple of ``LANE_ELEMENTS`` in it, those from there to its last multiple (or to the whole
tensor's end), and those after. The middle runs in place; each edge runs in a zero-padded
scratch row that stands for the whole tensor's lanes around it (from a lane boundary to the
next, or to the whole tensor's end, where its scalar tail is), and is copied back after the
call. ``LANE_ELEMENTS`` (64) is a multiple of every vector width and task unit torch's CPU
kernels use for fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

#: Elements of the whole tensor that lie in one run of full vectors in every torch CPU kernel.
LANE_ELEMENTS = 64


class Placed(NamedTuple):
    """Where an entry's elements lie in its whole parameter: from element ``start`` of ``total``."""

    start: int
    total: int


#: A piece of an entry: its elements ``first:stop``, run in place (None) or in a scratch row
#: (the piece's offset in it, the row's length).
_Piece = tuple[int, int, "tuple[int, int] | None"]


def on_whole_lanes(
    placed: list[Placed | None], rows: list[list[torch.Tensor]], grads: list[torch.Tensor], steps: list[torch.Tensor],
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[torch.Tensor], Callable[[], None]]:
    """``rows``, ``grads`` and ``steps`` (per entry: its fp32 rows, flat gradient and step
    count, as torch's Adam takes them), each entry that ``placed`` puts inside its whole
    parameter split as the module docstring says; and the function that copies the edges' new
    values (and gradients, which the fused kernel unscales in place) back once the update ran.
    An entry's first piece counts its step count up; the others count copies of it. Entries
    placed at None (a whole parameter) or on lane boundaries are passed through."""
    out_rows: list[list[torch.Tensor]] = []
    out_grads: list[torch.Tensor] = []
    out_steps: list[torch.Tensor] = []
    back: list[tuple[list[torch.Tensor], list[torch.Tensor], int]] = []
    for where, entry, grad, step in zip(placed, rows, grads, steps, strict=True):
        pieces = _pieces(where, grad.numel())
        if pieces is None:
            out_rows.append(entry)
            out_grads.append(grad)
            out_steps.append(step)
            continue
        for n, (first, stop, scratch) in enumerate(pieces):
            out_steps.append(step if n == 0 else step.clone())  # (cloned before any is counted up)
            originals = [row[first:stop] for row in entry] + [grad[first:stop]]
            if scratch is None:
                out_rows.append(originals[:-1])
                out_grads.append(originals[-1])
                continue
            offset, length = scratch
            copies = [_placed_copy(part, offset, length) for part in originals]
            out_rows.append(copies[:-1])
            out_grads.append(copies[-1])
            back.append((originals, copies, offset))

    def copy_back() -> None:
        for originals, copies, offset in back:
            for original, copy in zip(originals, copies, strict=True):
                original.copy_(copy[offset : offset + original.numel()])

    return out_rows, out_grads, out_steps, copy_back


def _pieces(where: Placed | None, numel: int) -> list[_Piece] | None:
    """The pieces of an entry of ``numel`` elements placed at ``where``; None: run it whole."""
    if where is None or numel == 0:
        return None
    start, total = where
    stop = start + numel
    core_start = _lane_up(start)
    core_stop = max(core_start, stop if stop == total else _lane_down(stop))
    if core_start == start and core_stop == stop:
        return None
    pieces: list[_Piece] = []
    if start < min(core_start, stop):
        pieces.append((0, min(core_start, stop) - start, _window(start, min(core_start, stop), total)))
    if core_stop > core_start:
        pieces.append((core_start - start, core_stop - start, None))
    if core_stop < stop:
        pieces.append((core_stop - start, numel, _window(core_stop, stop, total)))
    return pieces


def _window(first: int, stop: int, total: int) -> tuple[int, int]:
    """(offset, row length) of a scratch row for the whole parameter's elements ``first:stop``:
    the row stands for its elements from the lane that holds ``first`` to the lane boundary
    after ``stop``, or to its end (where its scalar tail is), so each element keeps its lane."""
    base = _lane_down(first)
    return first - base, min(_lane_up(stop), total) - base


def _lane_down(index: int) -> int:
    return index - index % LANE_ELEMENTS


def _lane_up(index: int) -> int:
    return -(-index // LANE_ELEMENTS) * LANE_ELEMENTS


def _placed_copy(part: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    row = torch.zeros(length, dtype=part.dtype, device=part.device)
    row[offset : offset + part.numel()].copy_(part)
    return row
