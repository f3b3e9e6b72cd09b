"""A disk tier folder deleted (and made again) while its store is open: the store stops
making and deleting files by name there, so a new store opened at that path keeps its data.

Re-running a notebook cell that deletes the folder and opens a store there, with the old store
still alive, once made both stores write one data file (the old one made its next segment file
by name in the new folder): the old store's values failed their checksums, and the new store's
empty tail files could be deleted by the old one's clean-up."""

from __future__ import annotations

import asyncio
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


async def check_reopened(root: Path, items: dict[str, torch.Tensor]) -> None:
    store = await open_store(root)
    await check(store, items)
    await store.aclose()


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
    await check_reopened(root, theirs)


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
    tier = old.tiers[0]
    assert isinstance(tier, DiskTier)
    for _ in range(500):  # (the clean-up runs in the background)
        if tier.reserved <= 16 * MiB:
            break
        await asyncio.sleep(0.01)
    assert tier.reserved == 16 * MiB
    # (its clean-up closed the file without deleting it by name: the old store goes on, and
    # its next data file is refused as any other)
    with pytest.raises(FolderReplacedError, match="cannot create data file segment-000001.bin"):
        await put_all(old, values("more", 20, 50.0))
    await old.aclose()
    await new.aclose()
    await check_reopened(root, theirs)


async def test_a_moved_folder_keeps_what_its_store_wrote(tmp_path: Path) -> None:
    root, moved = tmp_path / "store", tmp_path / "moved"
    store = await open_store(root)
    kept = values("k", 2, 0.0)
    await put_all(store, kept)
    root.rename(moved)
    with pytest.raises(FolderReplacedError, match=f"the disk tier folder {root} was deleted, moved or replaced"):
        await put_all(store, values("more", 20, 50.0))
    assert not root.exists()  # (nothing made at the old path)
    await check(store, kept)
    await store.aclose(flush=False)
    await check_reopened(moved, kept)


async def test_a_relative_root_stays_where_it_was_after_a_chdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = await open_store(Path("store"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    items = values("k", 24, 0.0)  # (a second data file, made after the chdir)
    await put_all(store, items)
    await store.aclose()
    assert not (tmp_path / "elsewhere" / "store").exists()
    await check_reopened(tmp_path / "store", items)
