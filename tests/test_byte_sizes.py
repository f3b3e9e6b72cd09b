"""Byte sizes given to tiers: ints, whole floats and strings with units; anything else is refused
with a message that says what to write."""

from __future__ import annotations

import numpy as np
import pytest

from tierstore import HostTier


@pytest.mark.parametrize("size, nbytes", [(4096, 4096), (1e6, 1_000_000), ("1.5 KiB", 1536), ("2MB", 2_000_000),
                                         (np.int64(8192), 8192), (np.uint32(4096), 4096), (np.float64(2e6), 2_000_000)])
def test_sizes_a_tier_takes(size: object, nbytes: int) -> None:
    """(numpy's integers, a sum over a config's sizes say, were refused as not an int)"""
    capacity = HostTier(size).capacity  # type: ignore[arg-type]
    assert capacity == nbytes and type(capacity) is int


@pytest.mark.parametrize("size, words", [(1.5, "must be whole.*'1.5GiB'"), (-1, "negative"), (float("inf"), "non-negative number"),
                                         (float("nan"), "non-negative number"), ("lots", "cannot read"), (True, "must be an int"),
                                         (np.int64(-1), "negative"), (np.float32(1.5), "must be an int"),
                                         ("0.5B", "must be whole"), ("1.7B", "must be whole"), ("1.5", "must be whole"),
                                         ("0.0001KiB", "less than a byte")])
def test_sizes_refused(size: object, words: str) -> None:
    """(a fraction of a byte in a string was dropped: "0.5B" made a tier of 0 bytes, "1.7B" one of
    1, while the float 1.5 was refused)"""
    with pytest.raises((ValueError, TypeError), match=words):
        HostTier(size)  # type: ignore[arg-type]


async def test_a_value_just_over_a_tiers_capacity_is_not_said_to_equal_it() -> None:
    """262,148 bytes on a 256 KiB tier read "256.0 KiB is more than ... (256.0 KiB)"."""
    import torch

    from tierstore import DeviceTier, TierFullError, TierStore

    async with TierStore([DeviceTier("cpu", "256KiB"), HostTier("1MiB")]) as store:
        with pytest.raises(TierFullError, match=r"^a value of 262,148 bytes takes 266,240 bytes on tier 'device' \(whole allocation units\), more than it holds \(262,144 bytes\)$"):
            await store.put("x", torch.zeros(262_148, dtype=torch.uint8), "device")
        with pytest.raises(TierFullError, match=r"^512\.0 KiB is more than tier 'device' holds \(256\.0 KiB\)$"):
            await store.put("x", torch.zeros(2 * 262_144, dtype=torch.uint8), "device")
        await store.put("x", torch.zeros(262_144, dtype=torch.uint8), "device")
