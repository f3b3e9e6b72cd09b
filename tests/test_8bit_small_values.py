"""8-bit moments of small values keep their precision: each block is scaled by its own absolute
maximum, however small (down to the smallest normal fp32 number). Block scales were raised to
1e-12, so a block of second moments below it (the squares of gradients below 1e-6: rarely used
embedding rows, say) was coded against 1e-12 instead: off by 2x at 1e-18, and AdamW with
gradients scaled by 2^-30 moved weights 0.14 away from the unscaled run's. Scaled by a power of
two, a block now codes to the same codes and an exactly scaled scale, so AdamW with an eps below
every moment gives the same weights bit for bit, as with fp32 state."""

from __future__ import annotations

import pytest
import torch

from tierstore import HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.optim import precision as codec

pytestmark = pytest.mark.device_modes


@pytest.mark.parametrize("signed", [True, False], ids=["first moment", "second moment"])
@pytest.mark.parametrize("exponent", [-40, -60, -100])
def test_a_block_scaled_by_a_power_of_two_codes_the_same(signed: bool, exponent: int, device_mode: str) -> None:
    torch.manual_seed(0)
    values = torch.randn(4 * codec.BLOCK + 37)
    values = values if signed else values.square()
    codes, scales = torch.empty(values.numel(), dtype=torch.uint8), torch.empty(5)
    small_codes, small_scales = torch.empty_like(codes), torch.empty_like(scales)
    codec.quantize(values, signed, codes, scales, compiled=False)
    codec.quantize(values * 2.0**exponent, signed, small_codes, small_scales, compiled=False)
    assert torch.equal(small_codes, codes)
    assert torch.equal(small_scales, scales * 2.0**exponent)
    back = codec.dequantize(small_codes, small_scales, signed, torch.empty_like(values), compiled=False)
    expected = codec.dequantize(codes, scales, signed, torch.empty_like(values), compiled=False) * 2.0**exponent
    assert torch.equal(back, expected)


def test_an_all_zero_block_still_codes_to_zero(device_mode: str) -> None:
    codes, scales = torch.empty(codec.BLOCK, dtype=torch.uint8), torch.empty(1)
    for signed in (True, False):
        codec.quantize(torch.zeros(codec.BLOCK), signed, codes, scales, compiled=False)
        assert scales.item() > 0
        assert torch.equal(codec.dequantize(codes, scales, signed, torch.empty(codec.BLOCK), compiled=False), torch.zeros(codec.BLOCK))


@pytest.mark.parametrize("numel", [3000, 70_001], ids=["small", "large"])  # (the eager update; the native or compiled one)
def test_8bit_adamw_gives_the_same_weights_for_gradients_scaled_by_a_power_of_two(numel: int, device_mode: str) -> None:
    torch.manual_seed(0)
    start = torch.randn(numel)
    grads = [torch.randn(numel) for _ in range(4)]
    weights = []
    for scale in (1.0, 2.0**-20, 2.0**-30):
        param = torch.nn.Parameter(start.clone())
        with SyncTierStore([HostTier("64MiB")]) as store:
            opt = TieredAdamW([param], lr=1e-2, eps=1e-30, weight_decay=0.0, state_precision="8bit", store=store)
            for grad in grads:
                param.grad = grad * scale
                opt.step()
            opt.close()
        weights.append(param.detach().clone())
    assert torch.equal(weights[1], weights[0])  # (2^-20: moments near 1e-12; they differed by 0.008)
    assert torch.equal(weights[2], weights[0])  # (2^-30: second moments near 1e-18; by 0.14)
