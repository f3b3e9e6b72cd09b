"""Shared pieces of the benchmarks: timing, medians, tables, JSON and the environment."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import psutil
import torch
from tqdm import tqdm

T = TypeVar("T")


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "", **options: Any) -> tqdm[T]:
    """A tqdm progress bar drawn only on a terminal.

    Written to a file or a pipe (a CI log, ``| tee``) a bar adds a line per refresh, hundreds
    in a long run, so there it is disabled (tqdm's ``disable=None``); callers that want a record
    in logs check ``bar.disable`` and print a few summary lines themselves.

    Parameters
    ----------
    iterable:
        What to iterate over, if the bar wraps an iterable.
    total:
        The number of steps, if not ``len(iterable)``.
    desc:
        The label in front of the bar.
    **options:
        Further ``tqdm`` options (``unit``, ``leave`` ...).
    """
    return tqdm(iterable, total=total, desc=desc, disable=None, **options)


def milestones(total: int, lines: int = 10) -> set[int]:
    """The steps (1-based, the last included) after which a log without a progress bar gets a
    summary line: about ``lines`` of them, evenly spaced."""
    every = max(1, -(-total // lines))
    return {n for n in range(every, total + 1, every)} | ({total} if total > 0 else set())


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def settle_store(store: Any) -> None:
    """Wait, from outside its loop, until nothing is in flight in ``store`` (its write-backs and
    prefetches, ``tierstore.testing.settle``): a benchmark taking turns between stores counts
    each one's background work in its own time, not in the next one's."""
    from ..sync import run
    from ..testing import settle

    run(settle(store, timeout=600))


def environment(folder: Path | None = None) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if folder is not None:
        best = None
        for part in psutil.disk_partitions(all=True):
            if str(folder.resolve()).startswith(part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
                best = part
        info["filesystem"] = {"folder": str(folder), "type": best.fstype if best else None, "device": best.device if best else None}
    return info


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a fixed-width table; ``columns`` are (key, heading, format)."""
    cells = [[heading for _, heading, _ in columns]]
    for row in rows:
        cells.append([("" if row.get(key) is None else format(row[key], fmt)) for key, _, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as strict JSON: a NaN or infinite figure (none measured) is written as null,
    which every parser reads (Python's json would write ``NaN``, which strict ones refuse)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, default=str, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
