"""Crash consistency: a writer process killed with SIGKILL at random moments, and a checker.

The writer (a process forked by ``kill_cycles``) runs random puts,
overwrites and deletes on a durable ``DiskTier``, several at once (never two on one key), and
appends to LOG, with one ``os.write`` per line, ``I`` (intent) before each operation and ``A``
(acknowledged) after it returns. Values are derived from (key, version), so the checker can
regenerate the bytes. After a kill, ``check`` reopens the folder and demands, per key:

- an acknowledged put reads back with exactly its bytes, an acknowledged delete stays deleted;
- an operation in flight at the kill is either fully there or not at all (never torn);
- keys never written are absent; the space accounting matches the catalog (no leaked extents);
- and the store keeps working (a put, get and delete after recovery).

What an in-flight operation turned out to be is appended to LOG (``R`` lines), so cycles chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..store import TierStore
from ..tiers import DiskTier

KEYS = 40
CAPACITY = "256MiB"


def value_for(key: str, version: int) -> torch.Tensor:
    """The value written as ``version`` of ``key``: random bytes of a random size and dtype."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{version}".encode(), digest_size=8).digest(), "little")
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.uint8, torch.bfloat16, torch.int64])
    numel = rng.choice([0, 1, rng.randrange(2, 4096), rng.randrange(4096, 1 << 18)])
    generator = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype) if numel else torch.empty(0, dtype=dtype)


def open_tier(root: Path) -> DiskTier:
    return DiskTier(root, CAPACITY, durable=True, chunk_size="64KiB")


# -- the writer (a child process) ------------------------------------------------------------------


async def _write_forever(root: Path, log: Path, seed: int, ready: Any = None) -> None:
    rng = random.Random(seed)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    async with TierStore([open_tier(root)]) as store:
        if ready is not None:  # the parent starts its kill timer now, not during start-up
            ready.set()
        busy: set[str] = set()
        present = set(store.keys())

        async def one() -> None:
            key = f"k{rng.randrange(KEYS)}"
            if key in busy:
                return
            busy.add(key)
            try:
                if key in present and rng.random() < 0.3:
                    note(f"I del {key}")
                    await store.delete(key)
                    present.discard(key)
                    note(f"A del {key}")
                else:
                    version = rng.getrandbits(48)
                    note(f"I put {key} {version}")
                    await store.put(key, value_for(key, version))
                    present.add(key)
                    note(f"A put {key} {version}")
            finally:
                busy.discard(key)

        while True:
            await asyncio.gather(*(one() for _ in range(6)))


# -- the checker ---------------------------------------------------------------------------------------


@dataclass
class Expectation:
    """What a key may hold: the acknowledged state, and what an in-flight op may have left."""

    acked: int | None = None  # a version, or None for absent
    pending: list[int | None] = field(default_factory=list)  # in-flight outcomes (None: deleted)

    def allowed(self) -> list[int | None]:
        return [self.acked, *self.pending]


def drop_cut_line(log: Path) -> None:
    """Truncate ``log`` after its last newline.

    SIGKILL can stop a ``write`` to a regular file part-way (the kernel checks for a fatal signal
    between pages), so a line that straddles a page boundary can end the log cut short. The writer
    dies inside that write: a cut ``I`` line is an operation never started, a cut ``A`` line leaves
    its ``I`` line pending, which allows the outcome it names. Dropping the fragment keeps both
    true and keeps the checker's ``R`` lines from being glued onto it."""
    data = log.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole != len(data):
        os.truncate(log, whole)


def expectations(log: Path) -> dict[str, Expectation]:
    """Replay the log: per key, the acknowledged state and any trailing intent.

    Only whole lines count (see ``drop_cut_line``)."""
    keys: dict[str, Expectation] = {}
    text = log.read_text()
    for line in text[: text.rfind("\n") + 1].splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        kind, op, key = parts[0], parts[1], parts[2]
        version = int(parts[3]) if op == "put" and len(parts) > 3 else None
        expect = keys.setdefault(key, Expectation())
        if kind == "I":
            expect.pending = [version]
        elif kind in ("A", "R"):
            expect.acked = version
            expect.pending = []
    return keys


@dataclass
class CheckResult:
    keys_checked: int = 0
    acknowledged_ops: int = 0
    in_flight_resolved: int = 0
    errors: list[str] = field(default_factory=list)


async def check(root: Path, log: Path) -> CheckResult:
    """Reopen ``root`` and check it against ``log`` (see the module docstring)."""
    result = CheckResult()
    if not log.exists():
        log.touch()
    drop_cut_line(log)
    expected = expectations(log)
    text = log.read_text()
    result.acknowledged_ops = sum(1 for line in text.splitlines() if line.startswith("A "))
    resolutions = []
    disk = open_tier(root)
    async with TierStore([disk]) as store:
        present = set(store.keys())
        for key in sorted(present - set(expected)):
            result.errors.append(f"{key!r} is in the store but was never written")
        for key, expect in expected.items():
            result.keys_checked += 1
            actual: int | None = None
            if key in present:
                value = await store.get(key)
                matches = [v for v in expect.allowed() if v is not None and _same(value, value_for(key, v))]
                if not matches:
                    result.errors.append(f"{key!r} holds bytes that match no value written (allowed {expect.allowed()})")
                    continue
                actual = matches[0]
            if actual not in expect.allowed():
                result.errors.append(f"{key!r}: found {'absent' if actual is None else actual}, allowed {expect.allowed()}")
                continue
            if expect.pending:
                result.in_flight_resolved += 1
                resolutions.append(f"R {'put' if actual is not None else 'del'} {key}" + (f" {actual}" if actual is not None else ""))
        committed = disk.committed().values()
        live = sum(record.extent.length if record.extent is not None else record.meta.nbytes for record in committed)
        if disk.used != live:
            result.errors.append(f"space accounting: {disk.used} bytes used, live extents and inline values hold {live}")
        if disk.used - disk.inline_bytes + disk._allocator.free_bytes != disk.reserved:
            result.errors.append("space accounting: used + free != reserved")
        probe = torch.arange(10.0)  # the store keeps working
        await store.put("probe-after-crash", probe)
        if not torch.equal(await store.get("probe-after-crash"), probe):
            result.errors.append("a put after recovery did not read back")
        await store.delete("probe-after-crash")
    with open(log, "a") as handle:
        handle.writelines(line + "\n" for line in resolutions)
    return result


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    from ..tensors import as_bytes

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(as_bytes(a), as_bytes(b)))


# -- kill cycles -----------------------------------------------------------------------------------------


@dataclass
class KillReport:
    kills: int = 0
    acknowledged_ops: int = 0
    in_flight_resolved: int = 0
    keys_checked: int = 0
    errors: list[str] = field(default_factory=list)


def _writer_process(root: str, log: str, seed: int, ready: Any) -> None:
    asyncio.run(_write_forever(Path(root), Path(log), seed, ready))


def kill_cycles(root: Path, cycles: int, seed: int = 0, min_delay: float = 0.02, max_delay: float = 0.5) -> KillReport:
    """Start the writer, SIGKILL it after a random delay, check, repeat ``cycles`` times.

    Writers are forked from a ``forkserver`` that has imported torch once, so a cycle costs the
    delay and the check, not an interpreter start."""
    rng = random.Random(seed)
    log = root.parent / f"{root.name}.log"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tierstore.faults.crash"])
    report = KillReport()
    for cycle in range(cycles):
        ready = context.Event()
        child = context.Process(target=_writer_process, args=(str(root), str(log), rng.getrandbits(32), ready), daemon=True)
        child.start()
        if not ready.wait(timeout=60):
            child.kill()
            report.errors.append(f"cycle {cycle}: the writer did not start (exit code {child.exitcode})")
            break
        time.sleep(rng.uniform(min_delay, max_delay))
        if not child.is_alive():
            report.errors.append(f"cycle {cycle}: the writer exited early (exit code {child.exitcode})")
            break
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join()
        report.kills += 1
        result = asyncio.run(check(root, log))
        report.in_flight_resolved += result.in_flight_resolved
        report.keys_checked += result.keys_checked
        report.acknowledged_ops = result.acknowledged_ops
        report.errors += [f"cycle {cycle}: {error}" for error in result.errors]
        if report.errors:
            break
    return report


