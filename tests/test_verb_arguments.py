"""Arguments a store refuses instead of reading them loosely (``durable="no"``: a string is
true, it meant write-through), and a read into ``out=`` seen by autograd as ``out.copy_`` is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.errors import InvalidTensorError


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



@pytest.mark.parametrize("dtype, shape, words", [
    (torch.qint8, (2,), "dtype torch.qint8 cannot be stored"),
    (torch.bits8, (2,), "dtype torch.bits8 cannot be stored"),
    (torch.uint4, (2,), "dtype torch.uint4 cannot be stored"),
    ("float32", (2,), "needs a torch.dtype"),
    (torch.float32, (2.7,), "non-negative integer sizes"),
    (torch.float32, (True, 2), "non-negative integer sizes"),
    (torch.float32, (-1,), "non-negative integer sizes"),
    (torch.float32, None, "non-negative integer sizes"),
])
async def test_fill_refuses_what_put_refuses_and_the_store_still_flushes(tmp_path: Path, dtype: Any, shape: Any, words: str) -> None:
    """A tryout: ``fill`` installed a qint8 (bits8, uint4, ...) value a put refuses, and every
    later ``flush()`` and close raised, so the write-back values of an open ``SyncTierStore``
    were lost at exit; ``(2.7,)`` filled a (2,) tensor and ``(True, 2)`` a (1, 2) one."""
    root = tmp_path / "d"
    async with TierStore([HostTier("1MiB"), DiskTier(root, "16MiB")]) as store:
        await store.put("a", torch.arange(1000))
        with pytest.raises(InvalidTensorError, match=words):
            async with store.fill("b", shape, dtype):
                pass
        assert "b" not in store
        async with store.fill("c", np.int64(3), torch.float32) as buffer:  # (an int is a 1-D shape, numpy's too)
            buffer.copy_(torch.arange(3.0))
        await store.flush()
    async with TierStore([HostTier("1MiB"), DiskTier(root, "16MiB")]) as store:
        assert sorted(store.keys()) == ["a", "c"] and torch.equal(await store.get("c"), torch.arange(3.0))


@pytest.mark.parametrize("shared", ["host", "disk"])
async def test_a_tier_object_open_in_one_store_is_refused_by_another(tmp_path: Path, shared: str) -> None:
    """A tryout: one ``HostTier`` object given to two open stores: both opened and counted the
    same bytes, each as its own (a DiskTier object the same, silently). The second open is
    refused, and the first store is unharmed."""
    host, disk = HostTier("64KiB"), DiskTier(tmp_path / "d", "16MiB")
    async with TierStore([host, disk]) as first:
        await first.put("a", torch.ones(1024))
        again = [HostTier("64KiB"), disk] if shared == "disk" else [host]
        with pytest.raises(ValueError, match=f"tier.*'{shared}'.* open already, in another store"):
            async with TierStore(again):
                pass
        assert torch.equal(await first.get("a"), torch.ones(1024))
    async with TierStore([host, disk]) as reopened:  # (closed: its tiers may serve a store again)
        assert torch.equal(await reopened.get("a"), torch.ones(1024))


async def test_a_close_that_fails_in_the_disk_tier_closes_the_other_tiers_too(tmp_path: Path) -> None:
    """The review of the check above: a disk tier whose close raised (here giving freed blocks
    back fails, EIO) left the host tier open, and the store, or any store over those tiers,
    could never open again ("open already, in another store")."""
    import errno

    from tierstore.disk.files import FileIO

    class FailingPunch(FileIO):
        fail = False

        def punch_hole(self, fd: int, offset: int, length: int) -> None:
            if self.fail:
                raise OSError(errno.EIO, "Input/output error")
            super().punch_hole(fd, offset, length)

    io = FailingPunch()
    host, disk = HostTier("1MiB"), DiskTier(tmp_path / "d", "64MiB", io=io, inline_max=0)
    store = TierStore([host, disk])
    await store.open()
    await store.put("a", torch.ones(10), "disk")
    await store.put("b", torch.ones(100_000), "disk")
    await store.delete("b")  # (its blocks are given back at close)
    io.fail = True
    with pytest.raises(OSError, match="Input/output error"):
        await store.aclose()
    io.fail = False
    assert not host.is_open and not disk.is_open
    async with store:
        assert torch.equal(await store.get("a"), torch.ones(10))
