"""The catalog's scan on open (``Catalog.scan``): the fast path over inline records refuses
what the full parser refuses, wherever the damaged record falls in the scan (the first record
of a dtype and shape is parsed in full, the next ones take the fast path), and finds what the
full parser finds (issue 15: reopen at 10^6 keys)."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
import torch

from tierstore import TierStore
from tierstore.disk.catalog import Catalog, DiskRecord
from tierstore.errors import CatalogError
from tierstore.tiers import DiskTier

KEYS = 40


def disk(root: Path) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", durable=False)


def _digests_in_scan_order(root: Path) -> list[bytes]:
    env = lmdb.open(str(root / "catalog"), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"entries", create=False)) as txn:
        digests = [bytes(digest) for digest, _ in txn.cursor()]
    env.close()
    return digests


def _damage(root: Path, digest: bytes, change: object) -> None:
    env = lmdb.open(str(root / "catalog"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"entries")) as txn:
        txn.put(digest, change(bytes(txn.get(digest))))  # type: ignore[operator]
    env.close()


async def _small_store(root: Path) -> dict[str, torch.Tensor]:
    # Keys of one length ("k10".."k49"), so a key can be swapped for another in place.
    values = {f"k{i}": torch.full((4,), float(i)) for i in range(10, 10 + KEYS)}
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            await store.put(key, value)
    return values


def _swap_key(raw: bytes, new: bytes) -> bytes:
    record = DiskRecord.from_bytes(raw)
    return raw.replace(record.key.encode(), new)


@pytest.mark.parametrize("where", [0, 1, KEYS // 2, KEYS - 1], ids=["first", "second", "middle", "last"])
@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: _swap_key(raw, b"k99"),  # filed under the address of a key that is not there
        lambda raw: _swap_key(raw, b"k\xff9"),  # a key that is not UTF-8
        lambda raw: raw[:-1],  # a byte of the value lost
        lambda raw: raw + b"\0",  # a byte too many
        lambda raw: raw[:2] + bytes([raw[2] + 1]) + raw[3:],  # one dimension more than written
        lambda raw: raw[:4] + b"\0\0\0\0" + raw[8:],  # an empty key
    ],
    ids=["misfiled", "not-utf8", "short", "long", "ndim", "empty-key"],
)
async def test_a_damaged_record_is_refused_wherever_it_is_scanned(tmp_path: Path, where: int, damage: object) -> None:
    await _small_store(tmp_path / "d")
    digest = _digests_in_scan_order(tmp_path / "d")[where]
    _damage(tmp_path / "d", digest, damage)
    with pytest.raises(CatalogError):
        async with TierStore([disk(tmp_path / "d")]):
            pass


async def test_a_record_under_another_existing_keys_address_is_refused(tmp_path: Path) -> None:
    """Two records naming one key (one filed under another key's address) never open as one."""
    await _small_store(tmp_path / "d")
    digests = _digests_in_scan_order(tmp_path / "d")
    env = lmdb.open(str(tmp_path / "d" / "catalog"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"entries")) as txn:
        txn.put(digests[-1], bytes(txn.get(digests[0])))  # the first record copied over the last one's
    env.close()
    with pytest.raises(CatalogError, match="wrong address"):
        async with TierStore([disk(tmp_path / "d")]):
            pass


async def test_the_scan_finds_what_the_full_parser_finds(tmp_path: Path) -> None:
    """Mixed dtypes and shapes, empty values, non-ASCII keys, values in extents: the scan's keys,
    metadata, versions and total inline size are the full parser's, and the store reads them."""
    values = {f"k{i}": torch.full((1 + i % 3,), float(i)) for i in range(30)}
    values.update({f"ключ/{i}": torch.arange(i % 4, dtype=torch.int16).reshape(1, -1) for i in range(12)})
    values["empty"] = torch.empty(0, 5)
    values["bool"] = torch.tensor([True, False])
    values["big"] = torch.rand(50_000)
    async with TierStore([disk(tmp_path / "d")]) as store:
        for key, value in values.items():
            await store.put(key, value)
        await store.put("k3", torch.ones(2, dtype=torch.float64))  # a newer version of another shape
        values["k3"] = torch.ones(2, dtype=torch.float64)
        inline_bytes = store.tier("disk").inline_bytes

    catalog = Catalog(tmp_path / "d" / "catalog", durable=False)
    catalog.open(None)
    try:
        full = {record.key: record for _, record in catalog.records()}
        extents, found = catalog.scan()
    finally:
        catalog.close()
    assert set(extents) == {"big"} and extents["big"] == full["big"]
    assert len(found) == len(values) - 1 and found.nbytes == inline_bytes
    for key, meta, version in found:
        assert (meta, version) == (full[key].meta, full[key].version), key
    async with TierStore([disk(tmp_path / "d")]) as store:
        assert store.tier("disk").inline_bytes == inline_bytes
        for key, value in values.items():
            got = await store.get(key)
            assert got.dtype == value.dtype and torch.equal(got, value), key
