"""Byte sizes given to tiers: ints, whole floats and strings with units; anything else is refused
with a message that says what to write."""

from __future__ import annotations

import pytest

from tierstore import HostTier


@pytest.mark.parametrize("size, nbytes", [(4096, 4096), (1e6, 1_000_000), ("1.5 KiB", 1536), ("2MB", 2_000_000)])
def test_sizes_a_tier_takes(size: object, nbytes: int) -> None:
    assert HostTier(size).capacity == nbytes  # type: ignore[arg-type]


@pytest.mark.parametrize("size, words", [(1.5, "must be whole.*'1.5GiB'"), (-1, "negative"), (float("inf"), "non-negative number"),
                                         (float("nan"), "non-negative number"), ("lots", "cannot read"), (True, "must be an int")])
def test_sizes_refused(size: object, words: str) -> None:
    with pytest.raises((ValueError, TypeError), match=words):
        HostTier(size)  # type: ignore[arg-type]
