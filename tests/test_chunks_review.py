"""Chunked state under review: a chunk of one element in the generic wrapper, and a restart
through a named namespace with another chunk size (state saved in one layout, adopted in another)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW, TieredOptimizer

pytestmark = pytest.mark.device_modes


def _pair(rows: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    reference = torch.nn.Linear(1, rows, bias=False)
    paged = torch.nn.Linear(1, rows, bias=False)
    paged.load_state_dict(reference.state_dict())
    return reference, paged


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        x = torch.randn(7, 1, generator=torch.Generator().manual_seed(seed))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_generic_wrapper_chunk_of_one_element(tmp_path: Path, device_mode: str) -> None:
    # 4097 elements in chunks of 1024: the last chunk holds one element, whose moments have the
    # shape of a scalar state (the step count) and must still be paged as moments.
    reference, paged = _pair(4097)
    expected = torch.optim.Adam(reference.parameters())
    opt = TieredOptimizer(
        paged.parameters(), torch.optim.Adam, offload="disk", disk_root=tmp_path / "s", host_capacity="256KiB", chunk_bytes="16KiB"
    )
    try:
        chunks = opt._slots[0].chunks
        assert chunks is not None and chunks[-1].numel == 1
        _steps(reference, expected, range(3))
        _steps(paged, opt, range(3))
        assert torch.equal(reference.weight, paged.weight)
        saved, want = opt.state_dict()["state"][0], expected.state_dict()["state"][0]
        assert set(saved) == set(want)
        for name, value in want.items():
            assert torch.equal(torch.as_tensor(saved[name]), value), name
    finally:
        opt.close()


@pytest.mark.parametrize("first, second", [("64KiB", "16KiB"), ("16KiB", "64KiB"), ("64KiB", None), (None, "16KiB")])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_restart_with_another_chunk_size_continues_exactly(
    tmp_path: Path, device_mode: str, first: str | None, second: str | None, amsgrad: bool
) -> None:
    reference, paged = _pair(15001)  # 15001 elements: no chunk size divides it
    expected = torch.optim.AdamW(reference.parameters(), fused=True, amsgrad=amsgrad)

    def run_with(chunk_bytes: str | None, seeds: range) -> list[int] | None:
        store = SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "store", "64MiB")]).open()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of the saved state may be dropped
            opt = TieredAdamW(paged.parameters(), store=store, namespace="g", chunk_bytes=chunk_bytes, fused=True, amsgrad=amsgrad)
        try:
            layout = [chunk.numel for chunk in opt._slots[0].chunks] if opt._slots[0].chunks is not None else None
            _steps(paged, opt, seeds)
        finally:
            opt.close()
            store.close()
        return layout

    before = run_with(first, range(2))
    after = run_with(second, range(2, 4))
    assert before != after  # the layouts differ
    _steps(reference, expected, range(4))
    assert torch.equal(reference.weight, paged.weight)
    store = SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "store", "64MiB")]).open()
    try:  # nothing of the old layout is left behind
        opt = TieredAdamW(paged.parameters(), store=store, namespace="g", chunk_bytes=second, fused=True, amsgrad=amsgrad)
        keys = set(opt.namespace.keys())
        slot = opt._slots[0]
        assert keys == ({c.key for c in slot.chunks} if slot.chunks is not None else {slot.key})
        want = expected.state_dict()["state"][0]
        saved = opt.state_dict()["state"][0]
        for name, value in want.items():
            assert torch.equal(saved[name], value), name
        opt.close()
    finally:
        store.close()
