"""Many small compressed entries updated together, with the same bits as one at a time.

``PackedState.update`` updates one entry: for a small one (a LayerNorm weight, a bias) the
decode, torch's Adam and the encode are a couple of dozen torch calls on a few hundred
elements, so a model's small parameters cost far more than their elements. ``update_many``
updates the small entries of one layout as one: each moment of all of them decoded into one
fp32 row (and a lossless master rebuilt), one call of torch's Adam over the lists, each moment
encoded back in one pass, then copied into each entry's fields (``torch._foreach_copy_`` where
torch has it).

The same bits as ``PackedState.update`` on each entry: every step of the codec is elementwise
or a block's maximum. 8-bit blocks stay each entry's own: an entry's partial last block is
padded with zeros to a whole block (``abs`` of a padding is 0: the block's maximum does not
change, a NaN still wins), and each element is divided by its own block's scale. Entries it
takes: ``batched``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import NamedTuple

import torch

from .precision import (
    BLOCK,
    SMALLEST_SCALE,
    TILE,
    PackedState,
    StateLayout,
    _nearest_codes,
    _scratch_rows,
    _use_compiled,
    dynamic_map,
    plain_update_bytes,
)

#: The elements of one batch: its fp32 rows (one per moment) are twice ``TILE`` (half a MiB
#: each), still in a core's L2 cache (``TILE`` each: 12% slower on the demo's small parameters).
BATCH_ELEMENTS = 2 * TILE

#: Runs torch's Adam: ``adam(rows, grads, steps)``, per entry its fp32 rows (master, then the
#: moments; updated in place), its flat gradient and its step count (counted up).
AdamMany = Callable[[list[list[torch.Tensor]], list[torch.Tensor], list[torch.Tensor]], None]


def batched(state: PackedState) -> bool:
    """Whether ``update_many`` updates ``state`` with others: an entry of ``TILE`` elements or
    fewer of bf16 moments, of 8-bit moments on the eager codec (a parameter below
    ``COMPILE_MIN_NUMEL`` elements, or the compiled codec off), or of fp32 moments beside a
    lossless master."""
    return takes(state.layout, state.numel, state.param_numel)


def takes(layout: StateLayout, numel: int, param_numel: int) -> bool:
    """``batched`` for an entry of ``layout`` and ``numel`` elements, of a parameter of
    ``param_numel``."""
    if not 0 < numel <= TILE:
        return False
    if layout.precision == "8bit":
        return not _use_compiled(None, param_numel)
    return layout.precision == "bf16" or layout.lossless


def batch_bytes(layout: StateLayout, *, fused: bool, grad_fp32: bool) -> tuple[int, int]:
    """At most the bytes one thread's ``update_many`` of entries of ``layout`` takes beside the
    entries: ``(kept, passing)``. Kept: a batch's decoded moments (``_scratch_rows``). Passing:
    a batch's concatenated fields, 8-bit codes, padding and quotients, a lossless master's
    words and halves, gradients cast to fp32 (``grad_fp32`` False) and a non-fused AdamW's
    temporaries (``fused`` False), each at most an fp32 row of a batch (a batch counts its
    8-bit entries padded to whole blocks). 8-bit batches also keep their block maps, shared by
    the threads (``KEPT_MAPS_BYTES``)."""
    passing = (6 + 2 * layout.lossless) * BATCH_ELEMENTS * 4 + plain_update_bytes(BATCH_ELEMENTS, fused=fused, grad_fp32=grad_fp32)
    return len(layout.moments) * BATCH_ELEMENTS * 4, passing


def update_many(states: Sequence[PackedState], grads: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], adam: AdamMany) -> None:
    """``PackedState.update`` of each of ``states`` (each ``batched``; any mix of layouts) with
    its gradient and step count, in batches of one layout and at most ``BATCH_ELEMENTS``
    elements: the same bits as one at a time. A batch whose math raises leaves its step counts
    as they were, and its 8-bit and bf16 moments (decoded copies); the math writes masters and
    fp32 moments where they are, as one at a time (the batches before it stay updated). An
    entry given twice is refused (``ValueError``: one at a time, it would be updated twice)."""
    if len({state.buffer.data_ptr() for state in states}) < len(states):
        raise ValueError("an entry is given twice (its buffer is another's): each is updated once a call")
    for state, grad in zip(states, grads, strict=True):
        if grad.numel() != state.numel:
            raise ValueError(f"a gradient of {grad.numel()} elements for a state of {state.numel}")
        if state.layout.lossless and state.high is None:
            raise RuntimeError("internal error: a lossless master needs the model's bf16 weight")
    by_layout: dict[object, list[int]] = {}
    for i, state in enumerate(states):
        by_layout.setdefault(state.layout, []).append(i)
    batches: list[list[int]] = []
    for members in by_layout.values():
        size = BATCH_ELEMENTS  # (the first entry of a layout starts a batch)
        for i in members:
            # (8-bit entries count padded to whole blocks, as their encode pads them: a batch
            # of one-element entries would otherwise pad to 256 times its elements)
            numel = states[i].numel
            span = -(-numel // BLOCK) * BLOCK if states[i].layout.precision == "8bit" else numel
            if size + span > BATCH_ELEMENTS:
                batches.append([])
                size = 0
            batches[-1].append(i)
            size += span
    for batch in batches:
        _update_batch([states[j] for j in batch], [grads[j] for j in batch], [steps[j] for j in batch], adam)


class _Blocks(NamedTuple):
    """Where the elements of a batch of 8-bit entries are: each entry's blocks, each element's
    block (in the batch's scales), and its place in the batch padded to whole blocks per entry."""

    blocks: list[int]
    block_of: torch.Tensor
    padded_at: torch.Tensor | None  # (None: every entry is whole blocks, padded and flat agree)
    total: int


#: Batches' block maps kept (a step's buckets repeat from step to step; each map is at most
#: 12 bytes an element of a batch, 1.5 MiB).
_KEPT_MAPS = 8
#: Bytes of the block maps kept, at most (``_blocks``: 12 B an element of a batch each).
KEPT_MAPS_BYTES = _KEPT_MAPS * 12 * BATCH_ELEMENTS


@lru_cache(maxsize=_KEPT_MAPS)
def _blocks(sizes: tuple[int, ...]) -> _Blocks:
    blocks = [-(-n // BLOCK) for n in sizes]
    starts = torch.tensor([0, *blocks[:-1]]).cumsum(0).tolist()
    block_of = torch.cat([start + torch.arange(n, dtype=torch.int32) // BLOCK for start, n in zip(starts, sizes, strict=True)])
    whole = all(n % BLOCK == 0 for n in sizes)
    padded_at = None if whole else torch.cat([start * BLOCK + torch.arange(n) for start, n in zip(starts, sizes, strict=True)])
    return _Blocks(blocks, block_of, padded_at, sum(blocks))


def _copy_all(targets: list[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(targets, list(sources))
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def _update_batch(states: list[PackedState], grads: list[torch.Tensor], steps: list[torch.Tensor], adam: AdamMany) -> None:
    layout = states[0].layout
    moments = layout.moments
    sizes = [state.numel for state in states]
    total = sum(sizes)
    eight_bit, coded = layout.precision == "8bit", layout.precision != "fp32"
    # Each entry's fields, asked once (views of its buffer; the encode writes into the same).
    fields = [[state.view(f"{name}/codes" if eight_bit else name) for state in states] for name in moments]
    scales = [[state.view(f"{name}/scale") for state in states] for name in moments] if eight_bit else []
    rows = list(_scratch_rows(len(moments), total)) if coded else []  # (this thread's: the update runs on one thread)
    plan = _blocks(tuple(sizes)) if eight_bit else None
    for n, (row, name) in enumerate(zip(rows, moments, strict=False)):
        if plan is not None:
            torch.index_select(dynamic_map(name == "exp_avg"), 0, torch.cat(fields[n]).int(), out=row)
            row.mul_(torch.cat(scales[n]).index_select(0, plan.block_of))
        else:
            row.copy_(torch.cat(fields[n]))
    pieces = [row.split(sizes) for row in rows] if coded else fields  # (fp32 moments: updated where they are)
    if layout.lossless:  # each master rebuilt from its stored low halves and the weight, its high halves
        lows = [state.view("master_low") for state in states]
        words = torch.empty(total, 2, dtype=torch.int16)
        words[:, 0] = torch.cat(lows)
        words[:, 1] = torch.cat([state.high.reshape(-1).view(torch.int16) for state in states])  # type: ignore[union-attr]
        masters = list(words.view(torch.float32).view(-1).split(sizes))
    else:
        masters = [state.master() for state in states]
    counted = [step.clone() for step in steps]  # (the entries' counts change only once encoded)
    adam([[masters[i], *(piece[i] for piece in pieces)] for i in range(len(states))], [grad.reshape(-1) for grad in grads], counted)
    for n, (row, name) in enumerate(zip(rows, moments, strict=False)):
        if plan is None:
            _copy_all(fields[n], pieces[n])  # (to bf16: round to nearest, as set_moment)
            continue
        if plan.padded_at is None:
            absmax = row.view(-1, BLOCK).abs().amax(dim=1)
        else:
            padded = row.new_zeros(plan.total * BLOCK)
            padded.index_copy_(0, plan.padded_at, row)
            absmax = padded.view(-1, BLOCK).abs().amax(dim=1)
        absmax.clamp_(min=SMALLEST_SCALE)  # an all-zero block still divides
        codes = _nearest_codes(row / absmax.index_select(0, plan.block_of), name == "exp_avg").to(torch.uint8)
        _copy_all(fields[n], codes.split(sizes))
        _copy_all(scales[n], absmax.split(plan.blocks))
    if layout.lossless:  # the new weight: the master truncated, its high halves (as ``set_master``)
        _copy_all(lows, words[:, 0].split(sizes))
        highs = torch.empty(total, dtype=torch.bfloat16)  # (its own memory: a weight's bytes are sent as they lie)
        highs.view(torch.int16).copy_(words[:, 1])
        for state, high in zip(states, highs.split(sizes), strict=True):
            state.high = high
    _copy_all(list(steps), counted)
