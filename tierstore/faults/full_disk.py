"""A put loop run into a full file system: ``python -m tierstore.faults.full_disk ROOT LIMIT``.

With LIMIT > 0 the process's files may not grow past LIMIT bytes (RLIMIT_FSIZE; SIGXFSZ ignored
so writes fail with EFBIG), which fills the disk tier's file system from the store's point of
view; with 0 the folder should be on a small file system. It puts 1 MiB values until three
puts fail with DiskFullError, checks every earlier value, deletes half, puts again into the
freed space, reopens and checks, and prints one JSON line:
``{"puts", "full", "error", "intact", "reused", "reopened"}``.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import sys

import torch

from ..errors import DiskFullError
from ..store import TierStore
from ..tiers import DiskTier


async def workload(root: str) -> dict[str, object]:
    report: dict[str, object] = {"puts": 0, "full": 0, "intact": True, "reused": False, "reopened": False}
    values: dict[str, torch.Tensor] = {}
    async with TierStore([DiskTier(root, "1GiB", overcommit=True)]) as store:
        for i in range(400):
            value = torch.full((256 * 1024,), float(i))
            try:
                await store.put(f"k{i}", value)
            except DiskFullError as exc:
                report["full"] = int(report["full"]) + 1  # type: ignore[call-overload]
                report["error"] = str(exc)
                if report["full"] == 3:
                    break
                continue
            values[f"k{i}"] = value
            report["puts"] = len(values)
        for key, value in values.items():
            report["intact"] = bool(report["intact"]) and bool(torch.equal(await store.get(key), value))
        gone = list(values)[: len(values) // 2]
        for key in gone:
            await store.delete(key)
            del values[key]
        for i in range(len(gone)):
            values[f"again{i}"] = torch.full((256 * 1024,), -1.0)
            await store.put(f"again{i}", values[f"again{i}"])
        report["reused"] = True
    async with TierStore([DiskTier(root, "1GiB", overcommit=True)]) as store:
        same = sorted(store.keys()) == sorted(values)
        for key, value in values.items():
            same = same and bool(torch.equal(await store.get(key), value))
        report["reopened"] = same
    return report


def main() -> None:
    root, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    print(json.dumps(asyncio.run(workload(root))))


if __name__ == "__main__":
    main()
