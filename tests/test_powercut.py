"""Power loss: the disk tier's write order, and states a power cut can leave (ALICE-style)."""

from __future__ import annotations

from pathlib import Path

import torch

from tierstore import TierStore
from tierstore.disk.files import segment_name
from tierstore.faults.powercut import (
    SECTOR,
    CommitBegin,
    CommitEnd,
    FileOp,
    Note,
    Recorder,
    explore,
    open_tier,
    plan_cuts,
    power_cuts,
    record_workload,
    value_for,
)


async def test_each_commit_follows_a_sync_of_the_data_it_names(tmp_path: Path) -> None:
    recorder = Recorder()
    async with TierStore([open_tier(tmp_path / "d", recorder)]) as store:
        for i in range(6):
            await store.put(f"k{i}", value_for(f"k{i}", i))
        await store.put("k0", value_for("k0", 99))
        await store.delete("k1")
    events = recorder.events
    commits = [i for i, e in enumerate(events) if isinstance(e, CommitBegin) and any(r is not None for _, r in e.changes)]
    assert len(commits) >= 7
    for at in commits:
        begin = events[at]
        assert isinstance(begin, CommitBegin)
        for key, record in begin.changes:
            if record is None or record.meta.nbytes == 0 or record.extent is None:  # empty or inline: no data write
                continue
            name = segment_name(record.extent.segment)
            inside = [
                i for i, e in enumerate(events[:at])
                if isinstance(e, FileOp) and e.kind == "write" and e.file == name
                and record.extent.offset <= e.offset < record.extent.end
            ]
            assert inside, f"no write of {key!r} before its commit"
            synced = [i for i, e in enumerate(events[:at]) if isinstance(e, FileOp) and e.kind == "datasync" and e.file == name]
            assert synced and synced[-1] > inside[-1], f"{key!r} was committed before its data was synced"
    assert any(isinstance(e, CommitEnd) for e in events)


def test_the_model_keeps_synced_writes_and_may_drop_tear_or_reorder_the_rest() -> None:
    data = bytes(range(256)) * 16  # 4096 bytes: 8 sectors
    events = [
        FileOp("create", "segment-000000.bin"),
        FileOp("dirsync", "data"),
        FileOp("write", "segment-000000.bin", 0, data),  # 2: synced by 3
        FileOp("datasync", "segment-000000.bin"),
        CommitBegin(1, (), None),  # 4: ends at 5
        CommitEnd(1),
        FileOp("write", "segment-000000.bin", 4096, data),  # 6: never synced
        FileOp("write", "segment-000000.bin", 8192, data),  # 7: never synced
        CommitBegin(2, (), None),  # 8: under way at the end
        Note("intent", "put", "k", 1),
    ]
    cuts = [cut for cut in plan_cuts(events, states=1000, seed=3) if cut.at == len(events) - 1]
    by_variant = {cut.variant: cut for cut in cuts}
    assert set(by_variant) == {"none", "all", "subset", "torn", "reorder"}
    for cut in cuts:
        assert 0 not in cut.landed and 2 not in cut.landed  # on disk for sure, not a choice
    assert by_variant["none"].landed == () and by_variant["none"].committed == ()
    assert sorted(by_variant["all"].landed) == [6, 7] and by_variant["all"].committed == (8,)
    torn = by_variant["torn"].torn
    assert torn is not None and torn[0] in (6, 7) and set(torn[1]) <= set(range(len(data) // SECTOR))
    points = {cut.at for cut in plan_cuts(events, states=1000, seed=3)}
    assert points == {i + 1 for i, e in enumerate(events) if not isinstance(e, Note)}


async def test_power_cuts_keep_every_acknowledged_put(tmp_path: Path) -> None:
    report = await power_cuts(tmp_path, states=100, seed=5, operations=60)
    assert report.states >= 100 and report.acknowledged >= 60
    assert report.lost == report.wrong == report.refused == 0, report.problems[:5]


async def test_a_flush_under_way_is_all_old_or_all_new(tmp_path: Path) -> None:
    report = await power_cuts(tmp_path, states=100, seed=6, operations=60)
    assert report.flushes_under_way > 0
    assert report.torn_flushes == 0, report.problems[:5]


async def test_without_the_fdatasync_before_the_commit_puts_are_lost(tmp_path: Path) -> None:
    report = await power_cuts(tmp_path, states=50, seed=5, operations=40, drop_fdatasync=True)
    assert report.lost > 0
    assert report.wrong == 0  # the checksums still refuse the bytes that did not land


async def test_the_recorded_writes_rebuild_the_value(tmp_path: Path) -> None:
    recorder = Recorder()
    value = value_for("x", 5)
    raw = value.view(torch.uint8).numpy().tobytes()
    assert len(raw) > 16 << 10  # several chunks, written by several threads
    async with TierStore([open_tier(tmp_path / "d", recorder)]) as store:
        await store.put("x", value)
    image = bytearray()
    for event in recorder.events:
        if isinstance(event, FileOp) and event.kind == "write":
            image.extend(bytes(max(0, event.offset + len(event.data) - len(image))))
            image[event.offset : event.offset + len(event.data)] = event.data
    (record,) = [r for e in recorder.events if isinstance(e, CommitBegin) for _, r in e.changes if r is not None]
    assert bytes(image[record.extent.offset : record.extent.offset + len(raw)]) == raw


async def test_a_flush_split_over_two_commits_is_caught_torn(tmp_path: Path) -> None:
    recorder = Recorder()
    await record_workload(tmp_path / "recorded", recorder, seed=6, operations=60)
    events = list(recorder.events)
    at = next(i for i, e in enumerate(events) if isinstance(e, CommitBegin) and len(e.changes) >= 4)
    flush = events[at]
    assert isinstance(flush, CommitBegin)
    half = len(flush.changes) // 2
    # What a flush committing entry by entry would have logged: two transactions in a row.
    events[at : at + 1] = [
        CommitBegin(10**6, flush.changes[:half], None),
        CommitEnd(10**6),
        CommitBegin(flush.commit, flush.changes[half:], None),
    ]
    report = await explore(events, tmp_path / "state", states=5, points=[at + 2])
    assert report.flushes_under_way == 5
    assert report.torn_flushes > 0, report.problems
    untouched = await explore(recorder.events, tmp_path / "state", states=5, points=[at + 1])
    assert untouched.flushes_under_way == 5 and untouched.torn_flushes == 0
