"""A live store and the replay of its trace agree: the same misses, the same evictions, one by one.

Each shipped eviction policy runs a live ``TierStore`` (two memory tiers, with and without a disk
tier under them) through a few hundred random puts, gets and deletes of mixed sizes, awaited one
after another. The store records its trace, evictions included; ``replay_store_trace`` replays
the requests with the store's own rules and must choose exactly the victims the store chose.
Memory tiers round values up to pages and pack small ones in slabs: the replay allocates from
fresh tiers of the same classes and capacities, so it accounts (and tells the policies) what the
store does.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policies import ARC, FIFO, LFU, LRU, MIN, S3FIFO
from tierstore import DeviceTier, DiskTier, HostTier, TierStore
from tierstore.errors import TraceError, UnknownTierError
from tierstore.sim import NextUse, load_evictions, load_trace, replay_store_trace
from tierstore.tracing import TraceRecorder

KiB = 1024
MiB = 1 << 20
DEVICE = 64 * KiB
HOST_ABOVE_DISK = 128 * KiB
HOST_LAST = 4096 * KiB  # the last tier evicts nothing: it holds every key
#: Mixed sizes: small values and multiples of 4 KiB, and one larger than the device tier.
SIZES = [64, 520, 3000, 4 * KiB, 8 * KiB, 12 * KiB, 20 * KiB, 24 * KiB]
HUGE = 80 * KiB
KEYS = 24

Op = tuple[str, str, int, "int | None"]


def random_ops(seed: int, count: int, tiers: int) -> list[Op]:
    """``(op, key, nbytes, tier)``: every op succeeds on the store (gets and deletes of keys
    that exist), so each becomes exactly one trace row."""
    rng = random.Random(seed)
    live: dict[str, int] = {}
    ops: list[Op] = []
    while len(ops) < count:
        key = f"k{rng.randrange(KEYS)}"
        roll = rng.random()
        if key not in live or roll < 0.3:
            nbytes = HUGE if key in ("k0", "k1") else rng.choice(SIZES)
            tier = rng.choice([None, None, 0, 1] + ([2] if tiers == 3 else []))
            if nbytes > DEVICE and tier == 0:
                tier = None  # lands on the host tier (the device tier cannot take it)
            live[key] = nbytes
            ops.append(("put", key, nbytes, tier))
        elif roll < 0.9:
            tier = rng.choices(range(tiers), weights=[7, 2, 1][:tiers])[0]
            ops.append(("get", key, live[key], tier))
        else:
            del live[key]
            ops.append(("delete", key, 0, None))
    return ops


def make_tiers(tmp_path: Path, disk: bool) -> list[Any]:
    if disk:
        return [DeviceTier("cpu", DEVICE), HostTier(HOST_ABOVE_DISK), DiskTier(tmp_path / "disk", "64MiB", durable=False)]
    return [DeviceTier("cpu", DEVICE), HostTier(HOST_LAST)]


async def run_live(tmp_path: Path, ops: list[Op], eviction: Any, disk: bool, oracle: NextUse | None) -> tuple[Path, dict[str, Any]]:
    path = tmp_path / "trace.npz"
    tiers = make_tiers(tmp_path / "live", disk)
    values: dict[str, torch.Tensor] = {}
    async with TierStore(tiers, eviction=eviction, trace=path) as store:
        for position, (op, key, nbytes, tier) in enumerate(ops):
            if oracle is not None:
                oracle.now = position
            if op == "put":
                values[key] = torch.full((nbytes // 4,), float(position))
                await store.put(key, values[key], tier=tier)
            elif op == "prefetch":  # (awaited: a prefetch running beside later requests does not replay exactly)
                await (await store.prefetch([key], tier))
            elif op == "get":
                assert torch.equal((await store.get(key, tier=tier)).cpu(), values[key])
            else:
                await store.delete(key)
                del values[key]
        stats = store.stats()
    return path, stats


POLICIES = {"lru": LRU, "fifo": FIFO, "lfu": LFU, "arc": ARC, "s3fifo": S3FIFO, "min": "min"}


@pytest.mark.parametrize("disk", [False, True], ids=["device+host", "device+host+disk"])
@pytest.mark.parametrize("name, seed", [*((name, None) for name in POLICIES), ("min", 8), ("min", 9), ("min", 14)])
async def test_live_store_and_replay_agree(tmp_path: Path, name: str, seed: int | None, disk: bool) -> None:
    """(MIN at seeds 8, 9 and 14, three disk tiers: the review of MIN's parked keys found the
    replay, which told no ``on_release``, choosing other victims than the store.)"""
    tiers = 3 if disk else 2
    ops = random_ops(seed=sum(map(ord, name)) + disk if seed is None else seed, count=300, tiers=tiers)
    oracle = NextUse([key for _, key, _, _ in ops]) if name == "min" else None
    eviction = (lambda: MIN(oracle)) if oracle is not None else POLICIES[name]
    path, stats = await run_live(tmp_path, ops, eviction, disk, oracle)

    tier_objects = make_tiers(tmp_path / "replay", disk)
    memory = tier_objects[:2]
    result = replay_store_trace(
        path,
        {tier.name: tier.capacity for tier in memory},
        eviction="min" if name == "min" else POLICIES[name],
        accounting=memory,
    )
    with np.load(path) as data:
        ops_table = list(data["ops"])
        gets = data["op"] == ops_table.index("get")
        recorded_hits = (data["hit"][gets] == 1).tolist()
    assert len(recorded_hits) == len(result.hits) == sum(op == "get" for op, *_ in ops)
    assert result.hits == recorded_hits, f"first differing get: {_first_difference(result.hits, recorded_hits)}"
    for tier in tier_objects:
        assert result.misses[tier.name] == stats["tiers"][tier.name]["misses"], tier.name

    recorded = load_evictions(path)
    assert recorded, "the workload should evict"
    for t, tier in enumerate(memory):
        live = [key for key, u in recorded if u == t]
        replayed = result.evictions_on(t)
        assert replayed == live, f"tier {tier.name!r}, first differing eviction: {_first_difference(replayed, live)}"
    if disk:
        assert result.evictions_on(1), "the host tier should evict to the disk"
    assert result.evictions == recorded


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo"])
async def test_live_store_and_replay_agree_with_prefetches(tmp_path: Path, name: str) -> None:
    """Prefetch rows were skipped: a prefetch that evicted on the live store evicted nothing in
    the replay, and every eviction after it differed."""
    ops: list[Op] = []
    for index, op in enumerate(random_ops(seed=7, count=300, tiers=3)):
        ops.append(op)
        if index % 3 == 2 and op[0] == "get" and op[2] <= DEVICE:
            ops.append(("prefetch", op[1], op[2], 0))  # (up to the device tier)
    assert sum(op == "prefetch" for op, *_ in ops) >= 20
    path, stats = await run_live(tmp_path, ops, POLICIES[name], True, None)
    memory = make_tiers(tmp_path / "replay", True)[:2]
    result = replay_store_trace(path, {tier.name: tier.capacity for tier in memory}, eviction=POLICIES[name], accounting=memory)
    with np.load(path) as data:
        assert (data["op"] == list(data["ops"]).index("prefetch")).sum() >= 5  # (some found their value there already)
    recorded = load_evictions(path)
    assert result.evictions == recorded, _first_difference(result.evictions, recorded)
    for tier in memory:
        assert result.misses[tier.name] == stats["tiers"][tier.name]["misses"], tier.name


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"#{i}: replay {x!r}, store {y!r}"
    return f"lengths {len(a)} and {len(b)}"


# -- the replay's own rules, on hand-written traces --------------------------------------------------


def write_trace(path: Path, tiers: list[str], rows: list[tuple[Any, ...]]) -> Path:
    """Rows of (op, key, nbytes, tier), or (op, key, nbytes, tier, hit)."""
    recorder = TraceRecorder(path, tiers)
    for op, key, nbytes, tier, *hit in rows:
        if op == "evict":
            recorder.evicted(key, nbytes, tier)
        else:
            recorder.record(op, key, nbytes, tier, hit=hit[0] if hit else None)
    recorder.close()
    return path


def test_evict_rows_are_not_requests(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.npz", ["device"], [("put", "a", 10, 0), ("evict", "a", 10, 0), ("get", "a", 10, 0)])
    assert load_evictions(path) == [("a", 0)]
    trace = load_trace(path)
    assert len(trace) == 2 and trace.keys[trace.ids[1]] == "a"


def test_write_back_only_when_no_slower_tier_holds_the_value(tmp_path: Path) -> None:
    # a is put on the disk, read up to the device (its disk copy stays valid), then pushed out
    # twice: the first eviction just drops it; b, only in memory, is written back to host.
    rows = [
        ("put", "a", 10, 2),
        ("get", "a", 10, 0),
        ("put", "b", 10, 0),  # device full: a goes (valid on disk: dropped, not written back)
        ("put", "c", 10, 0),  # b goes, written back to host
        ("get", "b", 10, 1),
        ("get", "a", 10, 0),
    ]
    path = write_trace(tmp_path / "t.npz", ["device", "host", "disk"], rows)
    result = replay_store_trace(path, [10, 100], "lru")
    assert result.evictions == [("a", 0), ("b", 0), ("c", 0)]
    assert result.hits == [False, True, False]  # a from disk, b on host, a from disk again
    assert result.misses == {"device": 2, "host": 0, "disk": 0}


def test_a_put_drops_the_other_copies_and_a_promotion_source_is_not_evicted(tmp_path: Path) -> None:
    rows = [
        ("put", "a", 10, 1),
        ("put", "b", 10, 1),  # host full (20)
        ("put", "c", 10, 0),
        ("get", "a", 10, 0),  # c goes down to host; host evicts b, not a (in use as the source)
        ("put", "a", 10, 1),  # host evicts a's old copy (written back), the device copy is dropped
        ("get", "a", 10, 0),
    ]
    path = write_trace(tmp_path / "t.npz", ["device", "host", "disk"], rows)
    result = replay_store_trace(path, [10, 20], "fifo")  # FIFO would take a first, were it not in use
    assert result.evictions == [("c", 0), ("b", 1), ("a", 1)]
    assert result.hits == [False, False]


def test_a_put_copied_over_its_value_makes_no_room(tmp_path: Path) -> None:
    """The trace says so (``hit`` 1): the store copied the new value over the old one on a tier
    with no room for both (``tierstore.overwrite``), evicting nothing."""
    rows = [
        ("put", "a", 10, 1),
        ("put", "b", 10, 1),  # host full (20)
        ("put", "c", 10, 0),
        ("get", "a", 10, 0),  # c goes down to host; host evicts b
        ("put", "a", 10, 1, True),  # copied over a's copy on the host; the device copy is dropped
        ("get", "a", 10, 0),  # from the host
        ("get", "c", 10, 1),
    ]
    path = write_trace(tmp_path / "t.npz", ["device", "host", "disk"], rows)
    result = replay_store_trace(path, [10, 20], "fifo")
    assert result.evictions == [("c", 0), ("b", 1)]
    assert result.hits == [False, False, True]


def test_a_value_larger_than_the_tier_is_read_uncached(tmp_path: Path) -> None:
    rows = [("put", "a", 10, 0), ("put", "big", 50, 1), ("get", "big", 50, 0), ("get", "a", 10, 0)]
    path = write_trace(tmp_path / "t.npz", ["device", "host"], rows)
    result = replay_store_trace(path, {"device": 20, "host": 100})
    assert result.evictions == [] and result.hits == [False, True]


def test_room_is_accounted_as_the_tiers_account_it(tmp_path: Path) -> None:
    rows = [("put", "a", 4100, 0), ("put", "b", 4100, 0)]  # a page and a bit: two pages each
    path = write_trace(tmp_path / "t.npz", ["device", "host"], rows)
    assert replay_store_trace(path, [12 * KiB, 64 * KiB]).evictions == []
    tiers = [DeviceTier("cpu", 12 * KiB), HostTier(64 * KiB)]
    assert replay_store_trace(path, [12 * KiB, 64 * KiB], accounting=tiers).evictions == [("a", 0)]


def test_mismatched_tiers_and_unknown_rows_are_refused(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.npz", ["device", "host", "disk"], [("put", "a", 10, 0)])
    with pytest.raises(UnknownTierError):
        replay_store_trace(path, {"host": 10, "device": 10})
    with pytest.raises(UnknownTierError):
        replay_store_trace(path, [10])
    bad = tmp_path / "bad.npz"
    np.savez(bad, op=np.array([0], dtype=np.uint8), key=np.array([0]), nbytes=np.array([1]), tier=np.array([0], dtype=np.int8),
             keys=np.array(["a"]), ops=np.array(["teleport"]), tiers=np.array(["device"]))
    with pytest.raises(TraceError, match="teleport"):
        replay_store_trace(bad, [10])


def rich_ops(seed: int, count: int) -> list[Op]:
    """Like ``random_ops`` on three tiers, with write-through puts (``dput``), flushes, write
    holds (``whold``) and pops."""
    rng = random.Random(seed)
    live: dict[str, int] = {}
    ops: list[Op] = []
    while len(ops) < count:
        key = f"k{rng.randrange(KEYS)}"
        roll = rng.random()
        if rng.random() < 0.03:
            ops.append(("flush", "", 0, None))
        elif key not in live or roll < 0.3:
            nbytes = rng.choice(SIZES)
            tier = rng.choice([None, 0, 1])
            live[key] = nbytes
            ops.append(("dput" if rng.random() < 0.3 else "put", key, nbytes, tier))
        elif roll < 0.7:
            ops.append(("get", key, live[key], rng.choice([0, 0, 1])))
        elif roll < 0.8:
            ops.append(("whold", key, live[key], rng.choice([0, 1])))
        elif roll < 0.9:
            ops.append(("pop", key, live.pop(key), rng.choice([0, 1])))
        else:
            ops.append(("delete", key, live.pop(key), None))
    return ops


@pytest.mark.parametrize("name", ["lru", "lfu", "s3fifo"])
async def test_replay_agrees_with_write_through_flush_holds_and_pop(tmp_path: Path, name: str) -> None:
    """Write-through puts and flushes make disk copies current (a later eviction writes nothing
    back); a released write hold makes its copy the only current one; a pop reads without
    caching and removes. The replay follows them all."""
    ops = rich_ops(seed=sum(map(ord, name)), count=300)
    path = tmp_path / "trace.npz"
    async with TierStore(make_tiers(tmp_path / "live", disk=True), eviction=POLICIES[name], trace=path) as store:
        for position, (op, key, nbytes, tier) in enumerate(ops):
            data = torch.full((nbytes // 4,), float(position))
            if op in ("put", "dput"):
                await store.put(key, data, tier=tier, durable=op == "dput")
            elif op == "get":
                await store.get(key, tier=tier)
            elif op == "pop":
                await store.pop(key, tier=tier)
            elif op == "whold":
                async with store.hold(key, tier, write=True) as buffer:
                    buffer.fill_(position % 256)
            elif op == "delete":
                await store.delete(key)
            else:
                await store.flush()
        stats = store.stats()
    memory = make_tiers(tmp_path / "replay", disk=True)[:2]
    result = replay_store_trace(path, {t.name: t.capacity for t in memory}, eviction=POLICIES[name], accounting=memory)
    recorded = load_evictions(path)
    assert recorded and result.evictions_on(1), "the workload should evict from both memory tiers"
    assert result.evictions == recorded, f"first differing eviction: {_first_difference(result.evictions, recorded)}"
    for tier in memory:
        assert result.misses[tier.name] == stats["tiers"][tier.name]["misses"], tier.name


@pytest.mark.parametrize("eviction", ["fifo", "lru"])
async def test_a_flush_right_after_a_write_back_put_is_not_taken_for_a_write_through_put(tmp_path: Path, eviction: str) -> None:
    """A put's row followed by the key's writeback row read as a write-through put (which drops
    the key's memory copies before making room) also when a flush wrote the put's value back:
    the replay then evicted other keys than the store. A write-back put's row says how it
    landed (``hit`` 0 or 1), a write-through put's does not (-1)."""
    path = tmp_path / "t.npz"
    async with TierStore([HostTier("1MiB"), DiskTier(tmp_path / "d", "16MiB")], eviction=eviction, trace=path) as store:
        for key in "abcd":
            await store.put(key, torch.zeros(MiB // 16), "host")
        await store.put("a", torch.ones(MiB // 32), "host")  # another size: room made (a itself goes)
        await store.flush()  # rows: put a, writeback a
        await store.put("a", torch.ones(MiB // 16), "host")
        await store.flush()
        await store.put("a", torch.ones(MiB // 16), "host")  # copied over a's value
        await store.flush()  # rows: put a, writeback a
        await store.put("e", torch.ones(MiB // 16), "host")  # room made: a victim
        await store.flush()  # rows: put e, writeback e
        await store.put("b", torch.ones(MiB // 16), "host", durable=True)  # written through
        await store.put("f", torch.ones(MiB // 16), "host")
        await store.put("a", torch.full((MiB // 16,), 2.0), "host")
    live = load_evictions(path)
    assert live
    assert replay_store_trace(path, [MiB], eviction, accounting=[HostTier("1MiB")]).evictions == live
