"""Arguments a store refuses instead of reading them loosely (``durable="no"``: a string is
true, it meant write-through), and a read into ``out=`` seen by autograd as ``out.copy_`` is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore


@pytest.mark.parametrize("durable", ["no", 0, 1, "False"])
def test_durable_takes_a_bool_only(tmp_path: Path, durable: object) -> None:
    with pytest.raises(TypeError, match="durable must be True or False"):
        SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "4MiB")], durable=durable)
    with SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "4MiB")]) as store:
        with pytest.raises(TypeError, match="durable must be True or False"):
            store.put("k", torch.ones(4), durable=durable)
        with pytest.raises(TypeError, match="durable must be True or False"), store.fill("f", (4,), torch.float32, durable=durable):
            pass
        assert "k" not in store and "f" not in store
        store.put("k", torch.ones(4), durable=True)  # (usable, nothing lost)
        assert torch.equal(store.get("k"), torch.ones(4))


def test_a_read_into_out_moves_its_version_as_copy_does() -> None:
    """A parameter saved for backward and then read into: backward raised nothing and gave
    gradients of the old value (torch's ``copy_`` moves the version, and backward refuses)."""
    with SyncTierStore([HostTier("1MiB")]) as store:
        store.put("w", torch.full((4,), 2.0))
        weight = torch.nn.Parameter(torch.ones(4))
        loss = (weight * weight).sum()  # (saves weight for backward)
        with torch.no_grad():
            assert store.get("w", out=weight) is weight  # (loading stored weights into a model: allowed)
        assert torch.equal(weight.detach(), torch.full((4,), 2.0))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()

