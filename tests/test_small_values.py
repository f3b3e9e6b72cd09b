"""Small values: kept inline in the catalog, through every path, mixed with large ones."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import lmdb
import pytest
import torch

from tierstore import TierStore
from tierstore.disk.catalog import DiskRecord
from tierstore.errors import ChecksumError, TierFullError
from tierstore.faults.powercut import CommitBegin, Recorder, power_cuts
from tierstore.keys import key_digest
from tierstore.tiers import DiskTier, HostTier
from tierstore.tiers.disk import INLINE_MAX

SMALL = INLINE_MAX // 4  # float32 elements of a value that is inline
LARGE = 50_000  # float32 elements of one that is not


def disk(root: Path, **options: object) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="64KiB", **options)  # type: ignore[arg-type]


def values(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 3, SMALL, LARGE, SMALL - 1, 17]
    return {f"k{i}": torch.rand(sizes[i % len(sizes)], generator=generator) for i in range(count)}


async def check(store: TierStore, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(store.keys()) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(await store.get(key), value), key


@pytest.mark.parametrize("durable", [True, False])
async def test_small_and_large_values_through_put_overwrite_delete_and_reopen(tmp_path: Path, durable: bool) -> None:
    expected = values(21)
    async with TierStore([disk(tmp_path / "d", durable=durable)]) as store:
        for key, value in expected.items():
            await store.put(key, value)
        await check(store, expected)
        for key in ("k0", "k3", "k4"):  # small -> large, small -> small, large -> small
            expected[key] = torch.rand(LARGE if key != "k4" else 5)
            await store.put(key, expected[key])
        await store.delete("k1")
        del expected["k1"]
        await check(store, expected)
    async with TierStore([disk(tmp_path / "d", durable=durable)]) as store:
        await check(store, expected)
        records = store.tier("disk").committed()  # type: ignore[attr-defined]
        for key, value in expected.items():
            small = value.numel() * 4 <= INLINE_MAX
            assert records[key].inline == small and (records[key].extent is None) == small, key
        assert store.tier("disk").used == sum(  # type: ignore[attr-defined]
            r.meta.nbytes if r.inline else r.extent.length for r in records.values()  # type: ignore[union-attr]
        )


async def test_a_non_durable_put_is_read_before_its_commit_and_kept_on_close(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d", durable=False)]) as store:
        tier = store.tier("disk")
        for i in range(200):
            await store.put(f"k{i}", torch.tensor([float(i)]))
        assert tier.queued_changes > 0  # type: ignore[attr-defined]  # acknowledged, not yet committed
        assert torch.equal(await store.get("k199"), torch.tensor([199.0]))
        await tier.drain()  # type: ignore[attr-defined]
        assert tier.queued_changes == 0  # type: ignore[attr-defined]
        await store.put("last", torch.tensor([7.0]))
    async with TierStore([disk(tmp_path / "d", durable=False)]) as store:
        assert len(store) == 201
        assert torch.equal(await store.get("last"), torch.tensor([7.0]))


async def test_concurrent_durable_puts_share_transactions(tmp_path: Path) -> None:
    async with TierStore([disk(tmp_path / "d")]) as store:
        tier = store.tier("disk")
        before = tier.transactions  # type: ignore[attr-defined]
        await asyncio.gather(*(store.put(f"k{i}", torch.tensor([float(i)])) for i in range(40)))
        assert tier.transactions - before < 40  # type: ignore[attr-defined]  # later puts joined a transaction
        for i in range(40):
            assert torch.equal(await store.get(f"k{i}"), torch.tensor([float(i)]))


async def test_flush_of_many_small_dirty_keys_is_one_transaction(tmp_path: Path) -> None:
    recorder = Recorder()
    expected = {f"p{i}": torch.tensor([float(i)]) for i in range(2000)} | {"big": torch.rand(LARGE)}
    async with TierStore([HostTier("64MiB"), disk(tmp_path / "d", io=recorder)]) as store:
        await store.put("first", torch.rand(LARGE), tier="disk")  # its segment file is there now
        await store.delete("first")
        recorder.events.clear()
        for key, value in expected.items():
            await store.put(key, value)
        before = store.tier("disk").transactions  # type: ignore[attr-defined]
        await store.flush()
        assert store.tier("disk").transactions == before + 1  # type: ignore[attr-defined]
        commits = [e for e in recorder.events if isinstance(e, CommitBegin) and e.changes]
        assert len(commits) == 1 and len(commits[0].changes) == len(expected)
        assert sum(1 for _, record in commits[0].changes if record is not None and record.inline) == 2000
        writes = [e for e in recorder.events if getattr(e, "kind", None) == "write"]
        assert writes and all(e.file.startswith("segment") for e in writes)  # only the large value's data
    async with TierStore([HostTier("64MiB"), disk(tmp_path / "d")]) as store:
        await check(store, expected)


async def test_small_values_evicted_from_memory_go_inline_and_come_back(tmp_path: Path) -> None:
    expected = {f"k{i}": torch.full((100,), float(i)) for i in range(300)}
    async with TierStore([HostTier("16KiB"), disk(tmp_path / "d", durable=False)]) as store:
        for key, value in expected.items():
            await store.put(key, value)
        assert store.stats()["tiers"]["disk"]["entries"] > 200  # demoted by eviction
        await check(store, expected)
    async with TierStore([HostTier("16KiB"), disk(tmp_path / "d")]) as store:
        await check(store, expected)


async def test_a_flipped_byte_of_an_inline_value_is_caught_and_the_rest_is_fine(tmp_path: Path) -> None:
    expected = {f"k{i}": torch.randint(0, 256, (300,), dtype=torch.uint8) for i in range(10)}
    async with TierStore([disk(tmp_path / "d")]) as store:
        for key, value in expected.items():
            await store.put(key, value)
    catalog = tmp_path / "d" / "catalog" / "data.mdb"
    raw = bytearray(catalog.read_bytes())
    needle = expected["k3"].numpy().tobytes()
    at = raw.find(needle)
    assert at >= 0
    while at >= 0:  # every copy (LMDB writes pages copy-on-write: older ones may linger, free)
        raw[at + 100] ^= 0x08
        at = raw.find(needle, at + 1)
    catalog.write_bytes(bytes(raw))
    async with TierStore([disk(tmp_path / "d")]) as store:
        with pytest.raises(ChecksumError, match="'k3'"):
            await store.get("k3")
        for key, value in expected.items():
            if key != "k3":
                assert torch.equal(await store.get(key), value)
        await store.put("k3", expected["k3"])  # the store stays usable
        assert torch.equal(await store.get("k3"), expected["k3"])


async def test_inline_values_count_against_the_capacity(tmp_path: Path) -> None:
    async with TierStore([DiskTier(tmp_path / "d", 4096, inline_max=1024)]) as store:
        for i in range(4):
            await store.put(f"k{i}", torch.zeros(256, dtype=torch.uint8) + i)
        assert store.tier("disk").used == 1024
        with pytest.raises(TierFullError):
            await store.put("k4", torch.zeros(1024 * 4 - 1024 + 1, dtype=torch.uint8))
        with pytest.raises(TierFullError):
            for i in range(4, 20):
                await store.put(f"k{i}", torch.zeros(1000, dtype=torch.uint8))
        await store.delete("k0")
        await store.put("again", torch.zeros(200, dtype=torch.uint8))


def test_inline_max_must_not_be_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="negative"):
        DiskTier(tmp_path / "d", "1MiB", inline_max=-1)


async def test_a_folder_of_format_version_2_opens_and_its_json_records_read_back(tmp_path: Path) -> None:
    expected = values(7)
    async with TierStore([disk(tmp_path / "d", inline_max=0)]) as store:  # every value in an extent
        for key, value in expected.items():
            await store.put(key, value)
        records = store.tier("disk").committed()  # type: ignore[attr-defined]
    env = lmdb.open(str(tmp_path / "d" / "catalog"), max_dbs=2)
    entries, meta = env.open_db(b"entries"), env.open_db(b"meta")
    with env.begin(write=True) as txn:  # what version 2 wrote: JSON records and format record
        for key, record in records.items():
            fields = {"key": key, **record.meta.to_json(), "nbytes": record.meta.nbytes, "segment": record.extent.segment,
                      "offset": record.extent.offset, "length": record.extent.length, "version": record.version,
                      "checksums": list(record.checksums)}
            txn.put(key_digest(key), json.dumps(fields).encode(), db=entries)
        layout = json.loads(bytes(txn.get(b"format", db=meta)))
        layout.update(format_version=2, version=2)
        txn.put(b"format", json.dumps(layout).encode(), db=meta)
    env.close()
    async with TierStore([disk(tmp_path / "d")]) as store:
        await check(store, expected)
        await store.put("k0", torch.tensor([1.0]))  # new writes are binary, inline records
        expected["k0"] = torch.tensor([1.0])
    async with TierStore([disk(tmp_path / "d")]) as store:
        await check(store, expected)


def test_binary_records_round_trip_and_refuse_damage() -> None:
    from tierstore.disk.extents import Extent
    from tierstore.tensors import TensorMeta

    inline = DiskRecord("a/b\u00e9", TensorMeta(torch.bfloat16, (2, 3)), None, 7, (123,), bytes(12), inline=True)
    extent = DiskRecord("k", TensorMeta(torch.float32, (5000,)), Extent(1, 8192, 20480), 9, (1, 2))
    for record in (inline, extent):
        assert DiskRecord.from_bytes(record.to_bytes()) == record
    assert DiskRecord.from_bytes(inline.to_bytes(), with_data=False).data is None
    for damaged in (inline.to_bytes()[:-1], extent.to_bytes()[:-3], extent.to_bytes() + b"x", b"\xb3\x09"):
        with pytest.raises(ValueError):
            DiskRecord.from_bytes(damaged)


async def test_power_cuts_keep_acknowledged_small_values(tmp_path: Path) -> None:
    report = await power_cuts(tmp_path, states=40, seed=3, operations=80)
    assert report.failures == 0, report.problems[:5]
    assert report.acknowledged > 0 and report.checked_keys > 0


async def test_an_inline_record_shorter_than_its_metadata_is_corruption_not_a_short_value(tmp_path: Path) -> None:
    # A damaged record whose bytes pass their own checksum but are fewer than its dtype and
    # shape need: refused (the catalog's scan at open says so), never a short value. Below the
    # store, ``from_bytes`` refuses such a buffer too (a 1-D value came back short: review).
    from tierstore.disk.catalog import inline_bytes
    from tierstore.disk.files import checksum_bytes
    from tierstore.errors import CorruptionError
    from tierstore.tensors import TensorMeta

    async with TierStore([disk(tmp_path / "d")]) as store:
        await store.put("short", torch.arange(8, dtype=torch.float32))
        await store.put("fine", torch.ones(3))
    env = lmdb.open(str(tmp_path / "d" / "catalog"), max_dbs=2)
    entries = env.open_db(b"entries")
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()  # 16 of the 32 bytes
    with env.begin(write=True) as txn:
        version = DiskRecord.from_bytes(bytes(txn.get(key_digest("short"), db=entries))).version
        record = inline_bytes("short", TensorMeta(torch.float32, (8,)), version, checksum_bytes(data), data)
        txn.put(key_digest("short"), record, db=entries)
    env.close()
    try:
        async with TierStore([disk(tmp_path / "d")]) as store:
            assert torch.equal(await store.get("fine"), torch.ones(3))
            with pytest.raises(CorruptionError):
                await store.get("short")
    except CorruptionError:
        pass  # (refused when the store opened: as good)
    from tierstore.tensors import from_bytes

    with pytest.raises(CorruptionError, match="needs 32 bytes"):
        from_bytes(torch.zeros(16, dtype=torch.uint8), TensorMeta(torch.float32, (8,)))
