"""``TierStore.changes``: a counter of key-set changes, for caches of the key set (the zarr
adapter's listing index uses it to skip a scan of every key)."""

from __future__ import annotations

from pathlib import Path

import torch

from tierstore import DiskTier, HostTier, TierStore


async def test_changes_moves_when_keys_appear_or_disappear_only(tmp_path: Path) -> None:
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as store:
        start = store.changes
        await store.put("a", torch.ones(4))
        after_put = store.changes
        assert after_put > start
        await store.put("a", torch.zeros(4))  # a new value of a known key: same key set
        async with store.hold("a", write=True) as held:
            held.add_(1)
        await store.get("a")
        assert store.changes == after_put
        await store.delete("a")
        assert store.changes > after_put
        gone = store.changes
        await store.put("b", torch.ones(2), "disk")
        assert store.changes > gone
        await store.pop("b")
        assert "b" not in store and store.changes > gone + 1
        await store.put("kept", torch.ones(2))
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")]) as reopened:
        assert reopened.keys() == ["kept"] and reopened.changes > 0


async def test_zarr_listing_sees_plain_verb_keys_through_the_counter(tmp_path: Path) -> None:
    import zarr  # noqa: F401 - the adapter needs it

    from tierstore.zarr import TierZarrStore

    async with TierStore([HostTier("8MiB")]) as store:
        adapter = TierZarrStore(store, prefix="z/")
        await store.put("z/a/b", torch.zeros(3, dtype=torch.uint8))
        assert [k async for k in adapter.list_dir("a/")] == ["b"]
        await store.put("z/a/c", torch.zeros(3, dtype=torch.uint8))  # the counter moved: listed
        assert sorted([k async for k in adapter.list_dir("a/")]) == ["b", "c"]
        await store.delete("z/a/b")
        assert [k async for k in adapter.list_dir("a/")] == ["c"]
