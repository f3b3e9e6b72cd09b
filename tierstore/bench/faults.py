"""Fault benchmark: the long variants of the reliability tests, with a table of what was tried.

Reproduce:  python benchmarks/bench_faults.py [--quick] [--kills N] [--corruptions N]
            [--full-disk-rounds N] [--examples N] [--power-cuts N] [--json FILE]

The full run (no options: 1,000 kill points, 1,000 power-cut states and the mutation, 100
corruptions, 10 fills, 10,000 state-machine examples) takes about 10-15 minutes on 2 cores and
prints one table, each phase with its "lost or wrong" count and seconds.

- kill points: a writer doing random durable puts, overwrites and deletes is SIGKILLed at random
  moments; after each kill every acknowledged operation is checked (tierstore.faults.crash);
- corruptions: one byte flipped inside a random stored value, then every value read back; a
  flipped value must raise ChecksumError, every other must read back exactly;
- full disk: the file system fills (RLIMIT_FSIZE) under a put loop; each DiskFullError must leave
  earlier values intact, and space freed by deletes must be reused;
- hypothesis: the state machine of tests/test_state_machine.py against a dict model on tiny
  tiers: puts (durable, cancelled, concurrent), gets to every tier, holds (read and write, open
  across steps while other tasks wait), flush, close and reopen; the examples counted include
  any a failure's shrinking ran;
- power cuts: a workload's data writes, syncs and catalog commits are recorded, and the states a
  power cut could leave (unsynced writes dropped, torn or reordered; commits under way in or
  out) are rebuilt, reopened and checked against the acknowledgement log
  (tierstore.faults.powercut); the same run with the fdatasync before each catalog commit
  removed (the mutation) must lose acknowledged puts, or the explorer would prove nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ..errors import ChecksumError
from ..faults.crash import kill_cycles
from ..faults.powercut import PowerCutReport, power_cuts
from ..store import TierStore
from ..tiers import DiskTier
from .common import environment, table, write_json


async def corruption_rounds(folder: Path, rounds: int) -> dict[str, Any]:
    """Flip one byte inside a random value per round; count catches and wrong reads."""
    rng = random.Random(0)
    root = folder / "corrupt"
    shutil.rmtree(root, ignore_errors=True)
    values = {f"k{i}": torch.randint(0, 256, (rng.randrange(1, 300_000),), dtype=torch.uint8) for i in range(32)}
    caught = wrong = 0
    async with TierStore([DiskTier(root, "256MiB", chunk_size="64KiB")]) as store:
        for key, value in values.items():
            await store.put(key, value)
    for _ in range(rounds):
        async with TierStore([DiskTier(root, "256MiB", chunk_size="64KiB")]) as store:
            victim = rng.choice(sorted(values))
            extent = store.tier("disk").committed()[victim].extent  # type: ignore[attr-defined]
            if extent is None:
                raise RuntimeError(f"{victim!r} has no extent on disk")
            where = extent.offset + rng.randrange(values[victim].numel())
            path = store.tiers[0].segment_path(extent.segment)  # type: ignore[attr-defined]
        with open(path, "r+b") as handle:
            handle.seek(where)
            byte = handle.read(1)[0]
            handle.seek(where)
            handle.write(bytes([byte ^ (1 << rng.randrange(8))]))
        async with TierStore([DiskTier(root, "256MiB", chunk_size="64KiB")]) as store:
            for key, value in values.items():
                try:
                    got = await store.get(key)
                except ChecksumError:
                    if key == victim:
                        caught += 1
                    else:
                        wrong += 1
                    continue
                if key == victim or not torch.equal(got, value):
                    wrong += 1
            await store.put(victim, values[victim])  # repair for the next round
    shutil.rmtree(root, ignore_errors=True)
    return {"injected": rounds, "caught": caught, "wrong": wrong}


def full_disk_rounds(folder: Path, rounds: int) -> dict[str, Any]:
    """Fill the file system (RLIMIT_FSIZE of 24 to 56 MiB) under ``tierstore.faults.full_disk``."""
    events = survived = 0
    wrong = 0
    for i in range(rounds):
        root = folder / f"full{i}"
        shutil.rmtree(root, ignore_errors=True)
        limit = (24 + 8 * (i % 5)) << 20
        result = subprocess.run([sys.executable, "-m", "tierstore.faults.full_disk", str(root), str(limit)],
                                capture_output=True, text=True, timeout=600)
        shutil.rmtree(root, ignore_errors=True)
        if result.returncode != 0:
            wrong += 1
            continue
        report = json.loads(result.stdout.strip().splitlines()[-1])
        events += report["full"]
        ok = report["intact"] and report["reused"] and report["reopened"]
        survived += report["full"] if ok else 0
        wrong += 0 if ok else 1
    return {"rounds": rounds, "events": events, "survived": survived, "wrong": wrong}


#: Seconds a kill-point writer runs before SIGKILL (uniform). Short: the writer reopens the
#: store the last one left, so early kills land in recovery and in the first puts as well.
KILL_DELAY = (0.005, 0.15)


def hypothesis_examples(examples: int) -> dict[str, Any]:
    """Run the state machine of tests/test_state_machine.py for ``examples`` examples (its
    ``STEPS`` steps each); count the examples and steps that ran."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "test_state_machine.py").exists():
        raise FileNotFoundError(f"{tests / 'test_state_machine.py'} not found: run the benchmark from a checkout")
    sys.path.insert(0, str(tests))
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test
    from test_state_machine import STEPS, StoreMachine

    ran = {"examples": 0, "steps": 0}

    class Counted(StoreMachine):
        def teardown(self) -> None:
            ran["examples"] += 1
            ran["steps"] += max(self.steps - 1, 0)  # the invariants also run once before any step
            super().teardown()

    failure = ""
    try:
        run_state_machine_as_test(
            Counted,
            settings=settings(
                max_examples=examples, stateful_step_count=STEPS, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            ),
        )
    except AssertionError as exc:  # the machine's report (failing steps) goes to the table's notes
        failure = str(exc)
        traceback.print_exc()
    return {**ran, "failures": 1 if failure else 0, "failure": failure[-4000:]}


def power_cut_rounds(folder: Path, states: int) -> tuple[PowerCutReport, PowerCutReport]:
    """``states`` power-cut states of the workload, then a fifth as many of the mutation."""
    operations = max(60, states // 5)
    real = asyncio.run(power_cuts(folder / "powercut", states=states, seed=13, operations=operations))
    mutation = asyncio.run(
        power_cuts(folder / "powercut-mutation", states=max(50, states // 5), seed=13, operations=operations, drop_fdatasync=True)
    )
    return real, mutation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kills", type=int)
    parser.add_argument("--corruptions", type=int)
    parser.add_argument("--full-disk-rounds", type=int)
    parser.add_argument("--examples", type=int)
    parser.add_argument("--power-cuts", type=int, help="power-cut states to explore (default 1000; --quick 150)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_faults.json"))
    args = parser.parse_args(argv)
    kills = args.kills or (30 if args.quick else 1000)
    corruptions = args.corruptions or (10 if args.quick else 100)
    full_rounds = args.full_disk_rounds or (3 if args.quick else 10)
    examples = args.examples or (100 if args.quick else 10_000)
    cut_states = args.power_cuts or (150 if args.quick else 1000)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="tierstore-faults-"))
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def phase(name: str, what: str) -> None:
        seconds[name] = time.perf_counter()
        print(f"{what} ...", flush=True)

    def done(name: str) -> None:
        seconds[name] = time.perf_counter() - seconds[name]

    try:
        phase("kills", f"kill points: {kills}")
        crash = kill_cycles(folder / "crash", kills, seed=11, min_delay=KILL_DELAY[0], max_delay=KILL_DELAY[1])
        done("kills")
        phase("power", f"power-cut states: {cut_states} (and the mutation)")
        cuts, mutation = power_cut_rounds(folder, cut_states)
        done("power")
        phase("corrupt", f"corruptions: {corruptions}")
        corrupt = asyncio.run(corruption_rounds(folder, corruptions))
        done("corrupt")
        phase("full", f"full disk rounds: {full_rounds}")
        full = full_disk_rounds(folder, full_rounds)
        done("full")
        phase("machine", f"hypothesis examples: {examples}")
        machine = hypothesis_examples(examples)
        done("machine")
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    detected = mutation.lost > 0
    rows = [
        {"fault": "SIGKILL at random moments", "tried": f"{crash.kills} kill points",
         "checked": f"{crash.acknowledged_ops} acknowledged ops, {crash.in_flight_resolved} in flight", "lost_or_wrong": len(crash.errors),
         "seconds": seconds["kills"]},
        {"fault": "power cut (ALICE-style states)", "tried": f"{cuts.states} states at {cuts.cut_points} cut points",
         "checked": f"{cuts.acknowledged} acknowledged ops, {cuts.flushes_under_way} in a flush; mutation (no fdatasync): "
                    f"{mutation.lost} lost in {mutation.states} states, {'detected' if detected else 'NOT DETECTED'}",
         "lost_or_wrong": cuts.failures, "seconds": seconds["power"]},
        {"fault": "flipped byte in a data file", "tried": f"{corrupt['injected']} corruptions", "checked": f"{corrupt['caught']} caught by checksum",
         "lost_or_wrong": corrupt["wrong"] + corrupt["injected"] - corrupt["caught"], "seconds": seconds["corrupt"]},
        {"fault": "file system full (ENOSPC/EFBIG)", "tried": f"{full['rounds']} fills", "checked": f"{full['survived']} of {full['events']} events survived",
         "lost_or_wrong": full["wrong"], "seconds": seconds["full"]},
        {"fault": "interleaved ops, holds, cancellations", "tried": f"{machine['examples']} hypothesis examples",
         "checked": f"{machine['steps']} steps against a dict model", "lost_or_wrong": machine["failures"], "seconds": seconds["machine"]},
    ]
    print()
    print(table(rows, [("fault", "fault", "s"), ("tried", "tried", "s"), ("checked", "checked", "s"),
                       ("lost_or_wrong", "lost or wrong", "d"), ("seconds", "s", ".0f")]))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    for error in crash.errors[:5]:
        print("  crash:", error)
    for problem in cuts.problems[:5]:
        print("  power cut:", problem)
    if machine["failure"]:
        print("  state machine:", machine["failure"].splitlines()[0])
    power = {
        "states": cuts.states, "cut_points": cuts.cut_points, "events": cuts.events, "failures": cuts.failures,
        "lost": cuts.lost, "wrong": cuts.wrong, "torn_flushes": cuts.torn_flushes, "refused": cuts.refused,
        "caught": cuts.caught, "problems": cuts.problems[:50],
        "mutation": {"drop": "fdatasync before the catalog commit", "states": mutation.states, "lost": mutation.lost, "detected": detected},
    }
    write_json(args.json, {"benchmark": "bench_faults", "environment": environment(), "rows": rows, "crash_errors": crash.errors,
                           "power_cuts": power, "state_machine": machine})
    print(f"JSON: {args.json}")
    return 0 if detected and all(row["lost_or_wrong"] == 0 for row in rows) else 1


