"""A disk tier folder deleted (and made again) while its store is open: the store stops
making and deleting files by name there, so a new store opened at that path keeps its data.

Re-running a notebook cell that deletes the folder and opens a store there, with the old store
still alive, once made both stores write one data file (the old one made its next segment file
by name in the new folder): the old store's values failed their checksums, and the new store's
empty tail files could be deleted by the old one's clean-up."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, FolderReplacedError, TierStore

MiB = 1 << 20


def values(prefix: str, count: int, base: float) -> dict[str, torch.Tensor]:
    return {f"{prefix}{i}": torch.full((256 * 1024,), base + i) for i in range(count)}  # 1 MiB each


async def put_all(store: TierStore, items: dict[str, torch.Tensor]) -> None:
    for key, value in items.items():
        await store.put(key, value)


async def check(store: TierStore, items: dict[str, torch.Tensor]) -> None:
    for key, value in items.items():
        assert torch.equal(await store.get(key), value), key


async def open_store(root: Path) -> TierStore:
    store = TierStore([DiskTier(root, 96 * MiB, durable=False)])
    await store.open()
    return store


async def test_a_store_whose_folder_was_made_again_leaves_the_new_stores_files_alone(tmp_path: Path) -> None:
    root = tmp_path / "store"
    old = await open_store(root)
    kept = values("old", 2, 0.0)
    await put_all(old, kept)  # (its first data file, 16 MiB)
    shutil.rmtree(root)
    new = await open_store(root)
    theirs = values("new", 24, 100.0)  # (its first two data files)
    await put_all(new, theirs)
    with pytest.raises(FolderReplacedError, match="was deleted, moved or replaced while its store was open"):
        await put_all(old, values("more", 20, 50.0))  # (needs a second data file)
    await check(old, kept)  # what it had stays readable
    await check(new, theirs)
    await old.aclose()
    await new.aclose()
    again = await open_store(root)
    await check(again, theirs)
    await again.aclose()


async def test_a_store_whose_folder_was_deleted_says_so(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = await open_store(root)
    kept = values("k", 2, 0.0)
    await put_all(store, kept)
    shutil.rmtree(root)
    with pytest.raises(FolderReplacedError, match="cannot create data file segment-000001.bin"):
        await put_all(store, values("more", 20, 50.0))
    await check(store, kept)
    await store.aclose()
    assert not root.exists()


async def test_the_old_stores_clean_up_does_not_delete_the_new_stores_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    old = await open_store(root)
    await put_all(old, values("old", 24, 0.0))  # (two data files)
    shutil.rmtree(root)
    new = await open_store(root)
    theirs = values("new", 24, 100.0)
    await put_all(new, theirs)
    for key in list(old.keys()):  # (its second data file empties: removed in the background)
        await old.delete(key)
    with pytest.raises(FolderReplacedError, match="cannot delete its empty data files"):
        await old.aclose()  # (the clean-up's failure is the close's)
    assert old.closed
    await new.aclose()
    again = await open_store(root)
    await check(again, theirs)
    await again.aclose()
