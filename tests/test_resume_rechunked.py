"""Resuming from a named namespace with another ``chunk_bytes``: the state is rewritten into
the new chunks (``TieredAdam._relayout``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


@pytest.mark.parametrize(("before", "after"), [(None, "4KiB"), ("4KiB", None)])
def test_a_state_that_becomes_one_chunk_or_stops_being_one_is_kept(tmp_path: Path, device_mode: str, before: str | None, after: str | None) -> None:
    """A tryout: a parameter of under 1,024 elements is one entry, or with a small
    ``chunk_bytes`` one chunk of the same elements under another key. Resumed across that
    change, the rewrite was skipped (same ranges), the old key deleted as unused, and the
    state lost while its count stayed: KeyNotFoundError, or steps from zero moments."""
    torch.manual_seed(0)
    model = torch.nn.Linear(40, 24, bias=False)  # (960 elements)
    twin = copy.deepcopy(model)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    for chunks, steps in ((before, range(3)), (after, range(3, 5))):
        opt = TieredAdamW(model.parameters(), lr=1e-2, offload="disk", disk_root=tmp_path / "d", namespace="n",
                          min_offload_numel=1, chunk_bytes=chunks)
        for step in steps:
            data = torch.Generator().manual_seed(step)
            opt.zero_grad()
            model(torch.randn(8, 40, generator=data)).square().mean().backward()
            opt.step()
        opt.close()
    for step in range(5):
        data = torch.Generator().manual_seed(step)
        reference.zero_grad()
        twin(torch.randn(8, 40, generator=data)).square().mean().backward()
        reference.step()
    torch.testing.assert_close(model.weight, twin.weight, rtol=0, atol=0)
