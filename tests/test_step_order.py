"""How a step's updates are grouped: many parameters in one bucket on a host-only store, and a
chunked parameter's chunks updated in runs (one math call for several chunks), exact against torch's AdamW in both device modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes  # tests taking ``device_mode`` run in both modes


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 4000, (64,), generator=generator)
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(4000, 33), torch.nn.Linear(33, 16))


def _updates(opt: TieredAdamW) -> list[str]:
    return [name for name, track, *_ in opt.last_timeline() if track == "host update"]


@pytest.mark.parametrize("where", ["host", "disk"])
def test_chunk_runs_are_exact_and_fewer_than_chunks(tmp_path: Path, device_mode: str, where: str) -> None:
    reference, paged = _model(), _model()
    expected = torch.optim.AdamW(reference.parameters(), fused=True)
    options: dict = {"chunk_bytes": "256KiB", "fused": True}
    if where == "disk":
        options.update(offload="disk", disk_root=tmp_path / "state", host_capacity="4MiB")
    opt = TieredAdamW(paged.parameters(), **options)
    try:
        chunks = opt._slots[0].chunks
        assert chunks is not None and len(chunks) >= 3
        assert chunks[-1].numel < chunks[0].numel  # a short last chunk
        _steps(reference, expected, 3)
        _steps(paged, opt, 3)
        for got, want in zip(paged.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got, want)
        runs = [name for name in _updates(opt) if name.startswith(f"update {opt._slots[0].index}/")]
        assert 1 <= len(runs) < len(chunks)  # several chunks a math call
    finally:
        opt.close()


def test_many_parameters_on_a_host_store_are_exact(device_mode: str) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(40)))
    paged = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(40)))
    paged.load_state_dict(reference.state_dict())
    expected = torch.optim.AdamW(reference.parameters(), fused=True)
    opt = TieredAdamW(paged.parameters(), fused=True, min_offload_numel=0)
    try:
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            for model, optimizer in ((reference, expected), (paged, opt)):
                model(x).square().mean().backward()
                if step == 1:  # one gradient dropped: that parameter is not updated, as in torch
                    model[3].bias.grad = None
                optimizer.step()
                optimizer.zero_grad()
        for got, want in zip(paged.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got, want)
    finally:
        opt.close()
