"""Chunked state: the state of a parameter larger than a chunk is paged in pieces.

A parameter whose optimizer state is larger than ``chunk_bytes`` (default ``DEFAULT_CHUNK_BYTES``)
keeps it in several store entries, one per run of consecutive elements of the flattened
parameter: ``<slot key>/c<i>``. Each chunk is paged, prefetched, updated and written back on its
own, so the state tier only needs room for a few chunks, not for the whole state of the largest
parameter (a 128k x 8192 embedding has 12 GiB of Adam state).

Chunked updates are exact for optimizers whose update is elementwise (Adam, AdamW, SGD ...):
every element's new value depends only on that element's gradient and state, and on per-tensor
scalars (the step count) that are the same for every chunk. ``ELEMENTWISE`` names the torch
optimizers that are; ``TieredOptimizer`` refuses to chunk any other unless told it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: State larger than this (bytes) is paged in chunks unless ``chunk_bytes=`` says otherwise.
DEFAULT_CHUNK_BYTES = 32 << 20
#: Chunks start on multiples of this many elements (4 KiB of fp32: page-aligned slices).
ALIGN_ELEMENTS = 1024

#: ``torch.optim`` classes whose update of one element reads only that element's gradient and
#: state (plus per-tensor scalars): their updates may run chunk by chunk.
ELEMENTWISE: frozenset[type[torch.optim.Optimizer]] = frozenset(
    cls
    for cls in (
        torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
        torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
        torch.optim.Adadelta,
    )
)


@dataclass(frozen=True)
class Chunk:
    """Elements ``start:stop`` of a flattened parameter, whose state lives under ``key``."""

    index: int
    start: int
    stop: int
    key: str

    @property
    def numel(self) -> int:
        return self.stop - self.start


def chunk_key(slot_key: str, index: int) -> str:
    """The store key of chunk ``index`` of the state under ``slot_key``."""
    return f"{slot_key}/c{index}"


def plan_chunks(slot_key: str, numel: int, bytes_per_element: float, chunk_bytes: int) -> list[Chunk] | None:
    """The chunks of a parameter of ``numel`` elements with ``bytes_per_element`` of state, or
    None when its state fits in one chunk of ``chunk_bytes`` (or ``chunk_bytes`` is 0: never)."""
    if chunk_bytes <= 0 or numel * bytes_per_element <= chunk_bytes:
        return None
    per_chunk = max(ALIGN_ELEMENTS, int(chunk_bytes // bytes_per_element) // ALIGN_ELEMENTS * ALIGN_ELEMENTS)
    return [
        Chunk(i, start, min(start + per_chunk, numel), chunk_key(slot_key, i))
        for i, start in enumerate(range(0, numel, per_chunk))
    ]


def is_elementwise(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer_class`` is known to update each element from its own state only."""
    return optimizer_class in ELEMENTWISE
