"""I/O settings of a disk tier folder: the defaults, the tuning file ``tierstore bench --tune``
writes beside the store, and which of them is in force.

The file is a small JSON document, ``<root>/.tierstore-tuning.json``; a ``DiskTier`` opened on
that folder uses its settings unless the constructor names them. A file that cannot be read, or
is not ours, or holds settings out of range is reported with a ``TuningFileWarning`` and
ignored: a tuning file never stops a store from opening.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..tensors import ALIGNMENT
from ..units import format_bytes, parse_bytes
from ..warn import warn

#: The tuning file's name inside a disk tier folder.
TUNING_FILE = ".tierstore-tuning.json"
_FORMAT = "tierstore-tuning"
_VERSION = 1
#: Bounds a tuning file's settings must lie in (beyond them it is taken as damaged).
MAX_CHUNK = 1 << 30
MAX_THREADS = 256
MAX_QUEUE_DEPTH = 1024


class TuningFileWarning(UserWarning):
    """A tuning file was there but could not be used; the defaults are in force instead."""


@dataclass(frozen=True)
class IOSettings:
    """How a disk tier moves large values: ``chunk_size`` bytes per request and per checksum,
    ``io_threads`` worker threads (the requests in flight for the whole tier), and
    ``queue_depth`` requests of one value in flight at a time."""

    chunk_size: int
    io_threads: int
    queue_depth: int

    def __post_init__(self) -> None:
        check_settings(self.chunk_size, self.io_threads, self.queue_depth)

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return f"chunk {format_bytes(self.chunk_size)}, {self.io_threads} threads, queue depth {self.queue_depth}"


def check_settings(chunk_size: int, io_threads: int, queue_depth: int) -> None:
    """Raise ``ValueError`` unless the three settings are usable."""
    for name, value, top in (("chunk_size", chunk_size, MAX_CHUNK), ("io_threads", io_threads, MAX_THREADS),
                             ("queue_depth", queue_depth, MAX_QUEUE_DEPTH)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ValueError(f"{name} must be an integer from 1 to {top}, not {value!r}")
    if chunk_size % ALIGNMENT:
        raise ValueError(f"chunk_size must be a multiple of {ALIGNMENT} bytes, not {chunk_size}")


DEFAULTS = IOSettings(chunk_size=4 << 20, io_threads=4, queue_depth=4)


@dataclass(frozen=True)
class Resolved:
    """The settings in force and where each came from (``"argument"``, ``"tuning file"`` or
    ``"default"``)."""

    settings: IOSettings
    sources: dict[str, str]
    tuning_path: Path | None

    def describe(self) -> str:
        s = self.settings
        parts = [f"chunk_size={format_bytes(s.chunk_size)} ({self.sources['chunk_size']})",
                 f"io_threads={s.io_threads} ({self.sources['io_threads']})",
                 f"queue_depth={s.queue_depth} ({self.sources['queue_depth']})"]
        return ", ".join(parts)


def tuning_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / TUNING_FILE


def load_tuning(root: str | os.PathLike[str]) -> IOSettings | None:
    """The settings saved in ``root``'s tuning file, or None if there is none. A file that is
    unreadable, foreign or out of range gives a ``TuningFileWarning`` and None."""
    path = tuning_path(root)
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no file (a root that is no folder is refused on open)
        return None
    except (OSError, UnicodeDecodeError) as exc:
        _warn(path, f"cannot be read ({exc})")
        return None
    try:
        document = json.loads(text)
    except ValueError as exc:
        _warn(path, f"is not valid JSON ({exc})")
        return None
    except RecursionError:  # (arrays nested deeper than Python's parser goes)
        _warn(path, "is not a tuning file (JSON nested too deeply to read)")
        return None
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        _warn(path, f"is not a tierstore tuning file (no \"format\": \"{_FORMAT}\")")
        return None
    if document.get("version") != _VERSION:
        _warn(path, f"has version {document.get('version')!r}; this tierstore reads version {_VERSION}")
        return None
    settings = document.get("settings")
    if not isinstance(settings, dict):
        _warn(path, "has no \"settings\" object")
        return None
    try:
        return IOSettings(settings.get("chunk_size"), settings.get("io_threads"), settings.get("queue_depth"))  # type: ignore[arg-type]
    except ValueError as exc:
        _warn(path, f"holds unusable settings: {exc}")
        return None


def save_tuning(root: str | os.PathLike[str], settings: IOSettings, details: dict[str, Any] | None = None) -> Path:
    """Write ``settings`` (and ``details``: what was measured) to ``root``'s tuning file,
    atomically (a reader sees the old file or the new one)."""
    path = tuning_path(root)
    document = {"format": _FORMAT, "version": _VERSION, "settings": settings.to_json(), **(details or {})}
    temporary = path.with_name(path.name + ".tmp")
    # 0600, as the store's other files: opened with the mode (no moment readable by others)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
    os.chmod(temporary, 0o600)  # an old temporary file keeps its mode through O_CREAT
    os.replace(temporary, path)
    return path


def resolve(
    root: str | os.PathLike[str],
    chunk_size: int | str | None = None,
    io_threads: int | None = None,
    queue_depth: int | None = None,
) -> Resolved:
    """The settings a disk tier at ``root`` uses: each argument given wins, then the tuning
    file's value, then the default. Bad arguments raise ``ValueError``."""
    saved = load_tuning(root) if chunk_size is None or io_threads is None or queue_depth is None else None
    base = saved or DEFAULTS
    origin = "tuning file" if saved is not None else "default"
    given = {
        "chunk_size": parse_bytes(chunk_size) if chunk_size is not None else None,
        "io_threads": io_threads,
        "queue_depth": queue_depth,
    }
    values = {name: value if value is not None else getattr(base, name) for name, value in given.items()}
    sources = {name: "argument" if value is not None else origin for name, value in given.items()}
    if queue_depth is None and saved is None:  # by default every thread can serve one value
        values["queue_depth"] = values["io_threads"]
        sources["queue_depth"] = "default: io_threads"
    elif queue_depth is None and values["queue_depth"] > values["io_threads"]:
        # a saved depth beyond fewer threads given as an argument: no more requests than threads
        # serve them can be in flight (the --tune sweep never saves more either)
        values["queue_depth"] = values["io_threads"]
        sources["queue_depth"] = f"{origin}, capped at io_threads"
    if given["chunk_size"] is not None and given["chunk_size"] % ALIGNMENT:
        values["chunk_size"] = -(-given["chunk_size"] // ALIGNMENT) * ALIGNMENT  # as before: rounded up to a block
    settings = IOSettings(**values)
    return Resolved(settings, sources, tuning_path(root) if saved is not None else None)


#: The least gain (5%) a setting must show over the default, in most repetitions and in the
#: median, before ``tierstore bench --tune`` prefers it.
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Choice:
    """What ``choose_setting`` picked: ``index`` into the candidates, whether it is the
    default (``kept_default``), its median gain over the default (0 when kept), and ``reason``,
    one line saying why."""

    index: int
    kept_default: bool
    gain: float
    reason: str


def choose_setting(
    scores: Sequence[Sequence[float]], default: int | None, labels: Sequence[str] | None = None, min_gain: float = MIN_GAIN
) -> Choice:
    """Pick one of several measured settings, keeping the default unless another is clearly faster.

    ``scores[i][r]`` is candidate ``i``'s throughput (higher is better) in repetition ``r``; the
    candidates of one repetition are measured together (taking turns), so each challenger is
    compared with the default repetition by repetition, as ratios. A challenger qualifies only
    if it is faster than the default by more than ``min_gain`` in most repetitions (a strict
    majority) and its median ratio exceeds ``1 + max(min_gain, spread)``, where ``spread`` is
    half the range of its ratios (how far the comparison itself swung between repetitions).
    Of those that qualify, the one with the highest median ratio is chosen; if none does, the
    default is kept. ``default`` None (the default was not among the candidates) picks the
    highest median score. ``labels`` name the candidates in ``reason``.
    """
    if not scores or any(len(row) != len(scores[0]) for row in scores) or not scores[0]:
        raise ValueError("scores must give every candidate the same, non-zero number of repetitions")
    if any(not value > 0 for row in scores for value in row):
        raise ValueError("scores must be positive")
    names = list(labels) if labels is not None else [f"candidate {i}" for i in range(len(scores))]
    reps = len(scores[0])
    if default is None:
        best = max(range(len(scores)), key=lambda i: statistics.median(scores[i]))
        return Choice(best, False, 0.0, f"{names[best]}: the fastest measured (median of {reps}); the default was not among them")
    majority = reps // 2 + 1
    qualified: list[tuple[float, int, int, float]] = []  # (median ratio, index, wins, spread)
    closest: tuple[float, int, int, float] | None = None
    for i, row in enumerate(scores):
        if i == default:
            continue
        ratios = [mine / theirs for mine, theirs in zip(row, scores[default], strict=True)]
        ratio = statistics.median(ratios)
        wins = sum(r > 1 + min_gain for r in ratios)
        spread = (max(ratios) - min(ratios)) / 2
        entry = (ratio, i, wins, spread)
        if wins >= majority and ratio > 1 + max(min_gain, spread):
            qualified.append(entry)
        elif closest is None or ratio > closest[0]:
            closest = entry
    if qualified:
        ratio, i, wins, spread = max(qualified)
        return Choice(i, False, ratio - 1, f"{names[i]}: {_percent(ratio - 1)} faster than the default {names[default]} "
                      f"(the median of its {reps} repetitions' ratios to the default's, each measured beside it, so not the ratio of the medians; faster by more than {_percent(min_gain)} in {wins} of {reps}, "
                      f"spread ±{_percent(spread)})")
    reason = (f"default kept ({names[default]}): no setting beat it by more than {_percent(min_gain)} in most of {reps} "
              f"repetitions and by more than the spread between them")
    if closest is not None:
        ratio, i, wins, spread = closest
        reason += f" (closest: {names[i]}, {_signed_percent(ratio - 1)} as the median of its per-repetition ratios, faster by more than {_percent(min_gain)} in {wins} of {reps}, spread ±{_percent(spread)})"
    return Choice(default, True, 0.0, reason)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _signed_percent(fraction: float) -> str:
    return f"{round(fraction * 100):+d}%"  # (no "-0%")


def _warn(path: Path, problem: str) -> None:
    warn(
        f"tuning file {path} {problem}; it is ignored: the I/O settings not given as arguments are the defaults "
        f"({DEFAULTS.describe()})",
        TuningFileWarning,
    )
