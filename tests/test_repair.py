"""``tierstore repair``: a folder a store refuses (a damaged record, a short or missing data file)
opens again with every intact entry as it was, and only the lost ones dropped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from catalog_records import flip_in_record, rewrite_record

from tierstore import DiskTier, TierStore
from tierstore.cli import main as cli_main
from tierstore.disk.repair import repair_folder
from tierstore.errors import CatalogError, ChecksumError, StoreLockedError
from tierstore.inspect import describe_folder

MiB = 1 << 20


def disk(root: Path) -> DiskTier:
    return DiskTier(root, "64MiB", chunk_size="256KiB")


async def fill(root: Path) -> dict[str, torch.Tensor]:
    """Eight 1 MiB values in the data file (in order) and four small ones inline in the catalog."""
    values = {f"big{i}": torch.full((256 * 1024,), float(i)) for i in range(8)}
    values |= {f"small{i}": torch.arange(10.0) + i for i in range(4)}
    async with TierStore([disk(root)]) as store:
        for key, value in values.items():
            await store.put(key, value)
    return values


async def refused(root: Path) -> str:
    with pytest.raises(CatalogError) as caught:
        async with TierStore([disk(root)]):
            pass
    return str(caught.value)


async def reads_back(root: Path, values: dict[str, torch.Tensor]) -> None:
    """The store opens, holds exactly ``values``, and takes and keeps a new value."""
    async with TierStore([disk(root)]) as store:
        assert sorted(store.keys()) == sorted(values)
        for key, value in values.items():
            assert torch.equal(await store.get(key), value), key
        await store.put("after", torch.full((512 * 1024,), 7.0))
    async with TierStore([disk(root)]) as store:
        assert torch.equal(await store.get("after"), torch.full((512 * 1024,), 7.0))
        for key, value in values.items():
            assert torch.equal(await store.get(key), value), key


def damage_record(root: Path, key: str) -> None:
    """Flip one bit of the seal of ``key``'s catalog record."""
    flip_in_record(root, key, -1)


def files_state(root: Path) -> dict[str, bytes]:
    """Every file's bytes but the locks' (LMDB's reader table changes on any open)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name not in ("lock", "lock.mdb")}


@pytest.mark.parametrize("victim", ["big3", "small1"])
async def test_a_damaged_record_is_dropped_and_every_other_entry_opens(tmp_path: Path, victim: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, one damaged record refused the whole folder, and nothing could drop it: every
    other entry was out of reach."""
    root = tmp_path / "d"
    values = await fill(root)
    damage_record(root, victim)
    assert "tierstore repair" in await refused(root)
    before = files_state(root)
    assert cli_main(["repair", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would drop 1 entry" in out and repr(victim) not in out and victim in out and "damaged" in out
    assert files_state(root) == before  # (a dry run changes nothing)
    await refused(root)
    assert cli_main(["repair", str(root)]) == 0
    assert "dropped 1 entry" in capsys.readouterr().out
    del values[victim]
    await reads_back(root, values)
    assert describe_folder(root)["healthy"]
    assert not repair_folder(root).changed  # (a second repair finds nothing)


async def test_a_truncated_data_file_drops_only_the_values_past_its_end(tmp_path: Path) -> None:
    root = tmp_path / "d"
    values = await fill(root)
    segment = root / "data" / "segment-000000.bin"
    os.truncate(segment, 5 * MiB + 12345)  # big0..big4 whole, big5 cut, big6 and big7 gone
    message = await refused(root)
    assert "truncated" in message and "tierstore repair" in message
    assert "3 of the 8 entries in it lie past its end ('big5', 'big6', 'big7')" in message  # (it said "8 entries live in it")
    report = repair_folder(root)
    assert sorted(name for name, _ in report.dropped) == ["big5", "big6", "big7"]
    assert report.restored_files == ["segment-000000.bin"] and report.kept == 9
    for key in ("big5", "big6", "big7"):
        del values[key]
    await reads_back(root, values)


async def test_a_missing_data_file_keeps_the_values_inline_in_the_catalog(tmp_path: Path) -> None:
    root = tmp_path / "d"
    values = await fill(root)
    (root / "data" / "segment-000000.bin").unlink()
    assert "tierstore repair" in await refused(root)
    report = repair_folder(root)
    assert sorted(name for name, _ in report.dropped) == [f"big{i}" for i in range(8)]
    await reads_back(root, {key: value for key, value in values.items() if key.startswith("small")})


async def test_repair_refuses_a_folder_a_store_has_open(tmp_path: Path) -> None:
    root = tmp_path / "d"
    values = await fill(root)
    async with TierStore([disk(root)]) as store:
        with pytest.raises(StoreLockedError):
            repair_folder(root)
        assert torch.equal(await store.get("big2"), values["big2"])
    assert not repair_folder(root).changed


def test_repair_refuses_a_folder_that_is_no_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    assert cli_main(["repair", str(tmp_path / "x")]) == 1
    assert "not a tierstore disk folder" in capsys.readouterr().err
    assert (tmp_path / "x" / "notes.txt").read_text() == "mine" and sorted(os.listdir(tmp_path / "x")) == ["notes.txt"]


@pytest.mark.parametrize("how", ["past its segment", "misaligned"])
async def test_a_record_whose_extent_is_impossible_is_dropped_alone(tmp_path: Path, how: str) -> None:
    """(From review.) A sound record whose extent lies outside its segment or off the block
    alignment loses only its own value; repair refused the whole folder, as if extents overlapped."""
    from dataclasses import replace

    from tierstore.disk.catalog import DiskRecord
    from tierstore.disk.extents import Extent

    def moved(raw: bytes) -> bytes:
        record = DiskRecord.from_bytes(raw)
        e = record.extent
        assert e is not None
        bad = Extent(e.segment, e.offset + (64 << 20), e.length) if how == "past its segment" else Extent(e.segment, e.offset + 512, e.length)
        return replace(record, extent=bad).to_bytes()

    root = tmp_path / "d"
    values = await fill(root)
    rewrite_record(root, "big7", moved)
    assert "tierstore repair" in await refused(root)
    report = repair_folder(root)
    assert [name for name, _ in report.dropped] == ["big7"] and report.restored_files == []
    del values["big7"]
    await reads_back(root, values)


async def test_repair_of_a_folder_whose_catalog_is_lost_changes_nothing(tmp_path: Path) -> None:
    """(From review.) Opening the catalog for writing made an empty one before refusing."""
    root = tmp_path / "d"
    await fill(root)
    for name in ("data.mdb", "lock.mdb"):
        (root / "catalog" / name).unlink()
    before = files_state(root)
    for dry_run in (True, False):
        with pytest.raises(CatalogError, match="holds no tierstore catalog"):
            repair_folder(root, dry_run=dry_run)
    assert files_state(root) == before and sorted(os.listdir(root / "catalog")) == []


async def test_a_dry_run_reads_a_folder_in_use_and_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "d"
    values = await fill(root)
    async with TierStore([disk(root)]) as store:  # (in another process: LMDB opens a folder once per process)
        lock_before = (root / "lock").read_bytes()
        shown = subprocess.run([sys.executable, "-m", "tierstore", "repair", str(root), "--dry-run"],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and "nothing to repair" in shown.stdout and f"{len(values)} entries kept" in shown.stdout, shown
        assert (root / "lock").read_bytes() == lock_before
        assert torch.equal(await store.get("big1"), values["big1"])


def damage_value(root: Path, key: str) -> None:
    """Flip one byte of ``key``'s value in its data file (its record stays sound)."""
    segment, offset = extent_of(root, key)
    with open(root / "data" / f"segment-{segment:06d}.bin", "r+b") as f:
        f.seek(offset + 1000)
        byte = f.read(1)
        f.seek(offset + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))


def extent_of(root: Path, key: str) -> tuple[int, int]:
    from tierstore.disk.catalog import DiskRecord

    env = lmdb.open(str(root / "catalog"), max_dbs=2, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"entries", create=False)) as txn:
            for _, raw in txn.cursor():
                record = DiskRecord.from_bytes(bytes(raw))
                if record.key == key:
                    assert record.extent is not None
                    return record.extent.segment, record.extent.offset
    finally:
        env.close()
    raise AssertionError(key)


async def test_verify_drops_a_value_whose_bytes_fail_their_checksums(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(Tryout.) A value whose bytes are damaged raised ``ChecksumError`` at every read (an
    optimizer's ``step()`` failed at every retry) and ``repair`` said "nothing to repair":
    only a ``store.delete`` by hand got out. The error now says what to do, and ``--verify``
    drops every such value."""
    root = tmp_path / "d"
    values = await fill(root)
    damage_value(root, "big2")
    async with TierStore([disk(root)]) as store:
        with pytest.raises(ChecksumError, match="tierstore repair .* --verify"):
            await store.get("big2")
    assert not repair_folder(root).changed  # (the records are sound: without --verify nothing is read)
    assert cli_main(["repair", str(root), "--verify", "--dry-run"]) == 0
    assert "big2: its bytes fail their checksums" in capsys.readouterr().out
    report = repair_folder(root, verify=True)
    assert report.dropped == [("big2", "its bytes fail their checksums")] and report.kept == len(values) - 1
    del values["big2"]
    await reads_back(root, values)


async def test_info_counts_a_damaged_record_whose_key_cannot_be_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(Tryout.) ``tierstore info`` said "UNHEALTHY (0 entries damaged)" beside the damaged records."""
    root = tmp_path / "d"
    values = await fill(root)
    rewrite_record(root, "big4", lambda raw: raw.replace(b"big4", b"big5", 1))  # (a bit of the key itself: it no longer hashes to its address)
    assert cli_main(["info", str(root)]) == 1
    assert "UNHEALTHY (0 entries damaged, and 1 damaged record whose key cannot be read)" in capsys.readouterr().out
    report = repair_folder(root)
    assert len(report.dropped) == 1 and report.dropped[0][0].startswith("<address ")
    del values["big4"]
    await reads_back(root, values)


def test_after_a_lost_namespace_index_adopt_lets_the_optimizer_continue(tmp_path: Path) -> None:
    """(From review.) Repair's advice for a dropped namespace index was ``overwrite=True``,
    which deletes the keys: the saved optimizer state could never be resumed. ``adopt=True``
    makes them the namespace's again, and the optimizer continues from them exactly."""
    from tierstore import HostTier, SyncTierStore
    from tierstore.namespaces import INDEX_KEY
    from tierstore.optim import TieredAdamW

    root = tmp_path / "d"
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    reference = torch.nn.Linear(32, 32)
    reference.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    batches = [torch.randn(4, 32) for _ in range(4)]

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()

    with SyncTierStore([HostTier("1MiB"), DiskTier(root, "64MiB")]) as store:
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="run1")
        for x in batches[:2]:
            step(model, opt, x)
        opt.close()
    damage_record(root, INDEX_KEY)
    report = repair_folder(root)
    assert [name for name, _ in report.dropped] == [INDEX_KEY] and "adopt=True" in report.dropped[0][1]
    with SyncTierStore([HostTier("1MiB"), DiskTier(root, "64MiB")]) as store:
        store.claim("run1", owner="TieredAdamW", adopt=True).release()
        opt = TieredAdamW(model.parameters(), lr=1e-2, store=store, namespace="run1")
        assert {int(s["step"]) for s in opt.state_dict()["state"].values()} == {2}
        for x in batches[:2]:
            step(reference, torch_opt, x)
        for x in batches[2:]:
            step(model, opt, x)
            step(reference, torch_opt, x)
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours, theirs)
        opt.close()


def test_a_resume_that_fails_part_way_keeps_the_saved_state_for_the_next_try(tmp_path: Path) -> None:
    """(From review.) The step counts were deleted before the saved state was rebuilt: a value
    failing its checksums while a new ``chunk_bytes`` re-chunked it failed the constructor and
    left state without counts, so the next try, after ``repair --verify`` as the error advised,
    took it for a crashed run and deleted the intact state of every other parameter too."""
    import warnings

    from tierstore import HostTier, SyncTierStore
    from tierstore.optim import TieredAdamW

    root = tmp_path / "d"
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(65536)), torch.nn.Parameter(torch.randn(65536))

    def store() -> SyncTierStore:
        return SyncTierStore([HostTier("4MiB"), DiskTier(root, "64MiB", chunk_size="64KiB")]).open()

    def step(opt: TieredAdamW) -> None:
        opt.zero_grad()
        (a.square().sum() + b.square().sum()).backward()
        opt.step()

    with store() as st:
        opt = TieredAdamW([a, b], lr=1e-2, store=st, namespace="n", min_offload_numel=1, chunk_bytes=None)
        step(opt)
        step(opt)
        opt.close()
    damage_value(root, "n/0")
    with store() as st:
        with pytest.raises(ChecksumError):
            TieredAdamW([a, b], lr=1e-2, store=st, namespace="n", min_offload_numel=1, chunk_bytes="64KiB")
        assert {"n/0", "n/1", "n/steps"} <= set(st.keys())
    assert [name for name, _ in repair_folder(root, verify=True).dropped] == ["n/0"]
    with store() as st, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = TieredAdamW([a, b], lr=1e-2, store=st, namespace="n", min_offload_numel=1, chunk_bytes="64KiB")
        assert [str(w.message) for w in caught if "is not in the store" in str(w.message)] and len(caught) == 1
        assert {index: int(state["step"]) for index, state in opt.state_dict()["state"].items()} == {1: 2}
        opt.close()
