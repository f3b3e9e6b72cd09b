"""Review of the device boundary: copies of tensors that are not contiguous (channels-last
weights) cross a link element by element, and a callback that raises never stops a link."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from tierstore.device import emulate_device, link_for
from tierstore.optim import TieredAdamW


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_channels_last_tensor_crosses_in_logical_order(dtype: torch.dtype) -> None:
    link = link_for("cpu", emulate=True, spec="")
    value = torch.randn(4, 3, 5, 2).to(dtype)
    device = torch.empty_like(value).to(memory_format=torch.channels_last)
    assert not device.is_contiguous()
    link.to_device(device, value.reshape(-1)).wait()  # a flat host copy, as the optimizer keeps it
    assert torch.equal(device, value)
    host = torch.empty(value.numel(), dtype=dtype)
    transfer = link.to_host(host, device)
    transfer.wait()
    assert torch.equal(host, value.reshape(-1)) and transfer.nbytes == value.nbytes
    transposed = torch.randn(6, 7).t()
    back = torch.empty(7, 6)
    link.to_host(back, transposed).wait()
    assert torch.equal(back, transposed)


def test_a_copy_that_is_not_contiguous_needs_one_dtype_and_size() -> None:
    link = link_for("cpu", emulate=True, spec="")
    strided = torch.empty(4, 6).t()
    with pytest.raises(ValueError, match="same dtype and number of elements"):
        link.to_host(torch.empty(24, dtype=torch.float64), strided)
    with pytest.raises(ValueError, match="same dtype and number of elements"):
        link.to_device(strided, torch.empty(23))
    with pytest.raises(ValueError, match="one shape"):
        link.to_device(strided, torch.empty(3, 8).t())


def test_channels_last_weights_train_bit_for_bit_on_the_emulated_device() -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
        return net.to(memory_format=torch.channels_last)

    results = []
    for ours in (False, True):
        net = model()
        with emulate_device(True, ""):  # the setting around construction only: the links stay
            opt = (TieredAdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=True, min_offload_numel=64) if ours
                   else torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=True))
        assert not net[0].weight.is_contiguous()
        for step in range(3):
            x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(step)).to(memory_format=torch.channels_last)
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            if step == 1:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
            opt.step()
        if ours:
            assert opt.time_report().grads_to_host_bytes > 0  # the copies crossed the link
            opt.close()
        results.append([p.detach().clone() for p in net.parameters()])
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


async def test_a_raising_callback_does_not_stop_the_link(caplog: pytest.LogCaptureFixture) -> None:
    link = link_for("cpu", emulate=True, spec="")

    def broken(direction: str, nbytes: int, started: float, ended: float) -> None:
        raise RuntimeError("a broken timeline")

    heard: list[int] = []

    def hear(direction: str, nbytes: int, started: float, ended: float) -> None:
        heard.append(nbytes)

    link.add_listener(broken)
    link.add_listener(hear)
    try:
        with caplog.at_level(logging.ERROR, logger="tierstore.device"):
            first = link.to_host(torch.empty(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8))
            first.add_done_callback(lambda _: (_ for _ in ()).throw(RuntimeError("a callback of the caller")))
            await first
            loop = asyncio.new_event_loop()
            loop.close()
            # A wake-up of a loop that closed meanwhile raises on the link's thread.
            stale = link.to_host(torch.empty(1 << 20, dtype=torch.uint8), torch.ones(1 << 20, dtype=torch.uint8))
            stale.add_done_callback(lambda _: loop.call_soon_threadsafe(print))
            await stale
            later = link.to_host(torch.empty(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8))
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(_settle(later))), timeout=10)
    finally:
        link.remove_listener(broken)
        link.remove_listener(hear)
    assert 8 in heard  # the second listener still heard every copy
    assert "a broken timeline" in caplog.text


async def _settle(transfer: object) -> None:
    await transfer  # type: ignore[misc]
