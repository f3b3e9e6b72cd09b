"""Inputs a new user tried that the verbs took wrongly: a str subclass as a key, a non-tensor
``out=``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.errors import InvalidTensorError
from tierstore.sync import run


class OddKey(str):
    """A str subclass with a hash of its own (as a user's key type might have)."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OddKey) and str.__eq__(self, other)


def test_a_str_subclass_key_is_the_same_key_as_its_text(tmp_path: Path) -> None:
    """It made a second entry in memory (two 'good' in keys(), two values), which a reopen
    merged into one: one of the values vanished."""
    root = tmp_path / "d"
    with SyncTierStore([HostTier("64KiB"), DiskTier(root, "1MiB")]) as store:
        store.put("good", torch.tensor([1.0]))
        store.put(OddKey("good"), torch.tensor([2.0]))
        assert store.keys() == ["good"] and len(store) == 1
        assert OddKey("good") in store
        assert type(store.keys()[0]) is str
        assert store.get("good").item() == 2.0 and store.get(OddKey("good")).item() == 2.0
        store.delete(OddKey("good"))
        assert "good" not in store
        store.put(OddKey("kept"), torch.tensor([3.0]))
    with SyncTierStore([HostTier("64KiB"), DiskTier(root, "1MiB")]) as store:
        assert store.keys() == ["kept"] and store.get("kept").item() == 3.0


@pytest.mark.parametrize("out", [[0.0] * 10, np.zeros(10, dtype=np.float32), "x"])
async def test_a_non_tensor_out_is_an_invalid_tensor_error(out: object) -> None:
    """It raised torch's 'increment_version expects each element of the iterable to be a tensor'."""
    async with TierStore([HostTier("1MiB")]) as store:
        await store.put("good", torch.arange(10.0))
        with pytest.raises(InvalidTensorError, match="out must be a tensor"):
            await store.get("good", out=out)  # type: ignore[arg-type]
        assert torch.equal(await store.get("good"), torch.arange(10.0))


async def test_a_str_subclass_key_reaches_traces_and_reports_as_its_text(tmp_path: Path) -> None:
    """hold, pop and delete recorded the caller's object: the trace held one key under two ids
    (and 'before' was -1 on hits); info() returned the caller's object."""
    trace = tmp_path / "t.npz"
    big = torch.arange(100_000.0)
    async with TierStore([HostTier("8MiB"), DiskTier(tmp_path / "d", "64MiB")], trace=trace) as store:
        await store.put("good", big)
        await store.get(OddKey("good"))
        async with store.hold(OddKey("good")):
            pass
        assert type(store.info(OddKey("good"))["key"]) is str
        await store.put("p", big)
        await store.pop(OddKey("p"))
        await store.delete(OddKey("good"))
    recorded = np.load(trace)
    assert sorted(str(key) for key in recorded["keys"]) == ["good", "p"]
    hits = recorded["hit"] == 1
    assert hits.sum() >= 3 and (recorded["before"][hits] >= 0).all()


@pytest.mark.parametrize("where", ["optimizer", "claim", "store", "disk tier", "store verbs", "zarr and swap"])
def test_on_off_options_take_a_bool_only(tmp_path: Path, where: str) -> None:
    """``overwrite="no"`` deleted the keys it was meant to keep, ``step_in_backward="no"`` updated in
    backward, ``emulate_device="no"`` emulated: a string reads as true. Each is a ``TypeError``,
    nothing deleted."""
    from tierstore.optim import TieredAdamW

    store = SyncTierStore([HostTier("4MiB")]).open()
    store.put("run1/x", torch.ones(4))
    model = torch.nn.Linear(4, 4)
    if where == "optimizer":
        for option in ("overwrite", "step_in_backward", "emulate_device", "unscale_in_step"):
            with pytest.raises(TypeError, match=f"{option} must be True or False"):
                TieredAdamW(model.parameters(), store=store, namespace="run1", **{option: "no"})
    elif where == "claim":
        with pytest.raises(TypeError, match="overwrite must be True or False"):
            store.claim("run1", overwrite="no")
    elif where == "store":
        with pytest.raises(TypeError, match="flush_on_close must be True or False"):
            SyncTierStore([HostTier("1MiB")], flush_on_close="no")
    elif where == "store verbs":  # (a tryout: export_zarr(overwrite="no") replaced the snapshot, hold(write="no") took a write hold)
        store.export_zarr(tmp_path / "snap")
        with pytest.raises(TypeError, match="overwrite must be True or False"):
            store.export_zarr(tmp_path / "snap", overwrite="no")
        with pytest.raises(TypeError, match="write must be True or False"), store.hold("run1/x", write="no"):
            pass
        with pytest.raises(TypeError, match="write must be True or False"):
            run(_hold_async(store.store, "run1/x", write="no"))
        with pytest.raises(TypeError, match="dry_run must be True or False"):
            store.gc(dry_run="no")
        with pytest.raises(TypeError, match="flush must be True or False"):
            store.close(flush="no")
        assert store.is_open
    elif where == "zarr and swap":
        from tierstore.swap import offload_activations
        from tierstore.zarr import TierZarrStore

        for option in ("read_only", "prefetch"):
            with pytest.raises(TypeError, match=f"{option} must be True or False"):
                TierZarrStore(store, "z/", **{option: "no"})
        with pytest.raises(TypeError, match="emulate_device must be True or False"):
            offload_activations(store, emulate_device="no")
    else:
        for option in ("durable", "overcommit", "create"):
            with pytest.raises(TypeError, match=f"{option} must be True or False"):
                DiskTier(tmp_path / "d", "8MiB", **{option: "no"})
        from tierstore import DeviceTier
        from tierstore.device import emulate_device

        with pytest.raises(TypeError, match="emulate_device must be True or False"):
            DeviceTier("cpu", "1MiB", emulate_device="no")
        with pytest.raises(TypeError, match="enabled must be True or False"):
            emulate_device("no")  # type: ignore[arg-type]
    assert torch.equal(store.get("run1/x"), torch.ones(4))
    store.close()


async def _hold_async(store: TierStore, key: str, write: Any) -> None:
    async with store.hold(key, write=write):
        pass
