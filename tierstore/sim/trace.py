"""Traces for the simulator: the store's ``.npz`` access traces, CSV files and libCacheSim's
binary ``oracleGeneral`` traces.

A CSV trace has one access a line, by default ``key,size``, an optional header line and any
further columns ignored (libCacheSim's csv reader takes the same); ``columns`` picks other
columns, by 0-based index or by header name. Numeric keys are read columnar (numpy) and
interned to integers in one pass; other keys go through a plain parser. A key that is a whole
number is that number either way (``01`` and ``1`` are one key, whatever the other lines hold).
A UTF-8 byte-order mark before the header (a spreadsheet's export) is skipped. An ``oracleGeneral``
trace (``*.oracleGeneral*``, ``*.bin``: the format public cache traces are published in) is a
sequence of packed little-endian records ``uint32 time, uint64 id, uint32 size, int64 next
access``; requests of size 0 are skipped, as libCacheSim does. A store trace (``TierStore(trace=...)``,
format in ``tierstore.tracing``) keeps get, hold and put rows as accesses, deletes as removals,
and its step marks; its prefetch rows are dropped (the simulator decides prefetches itself), and
so are its evict rows (what the store evicted; ``load_evictions`` reads them for comparison) and
its writeback and update rows; a pop counts as an access.
"""

from __future__ import annotations

import codecs
import csv
import math
import re
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TraceError
from ..tracing import OPS

ACCESS, DELETE = 0, 1

#: One oracleGeneral record (24 bytes, packed, little-endian).
ORACLE_GENERAL = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


@dataclass
class Trace:
    """Accesses as parallel arrays; ``keys[ids[i]]`` is the key of access ``i``."""

    keys: list[str]
    ids: np.ndarray  # int64, one per access
    sizes: np.ndarray  # int64 bytes
    ops: np.ndarray  # uint8: ACCESS or DELETE
    steps: np.ndarray  # int64: step number of each access (mark_step count)
    times: np.ndarray | None = None  # float64 seconds, when known
    tiers: list[str] | None = None  # a store trace's tier names, fastest first (None: not known)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def working_set(self) -> int:
        """Bytes of all distinct keys (each at its largest size; summed as Python integers: each
        size fits an int64, their total need not)."""
        largest = np.zeros(len(self.keys), dtype=np.int64)
        np.maximum.at(largest, self.ids, self.sizes)
        return sum(largest.tolist())

    @property
    def deletes(self) -> int:
        """Rows that remove their key (the others are accesses)."""
        return int(np.count_nonzero(self.ops == DELETE))

    def check(self) -> None:
        """``TraceError`` unless the arrays describe a trace: one entry per access in each, key
        indexes within ``keys``, whole sizes of 0 or more, known operations."""
        for name, array in (("ids", self.ids), ("sizes", self.sizes), ("ops", self.ops), ("steps", self.steps)):
            if np.ndim(array) != 1:
                raise TraceError(f"the trace's {name} are an array of {np.ndim(array)} dimensions; give one value per access")
            if np.asarray(array).dtype.kind not in "iu":
                raise TraceError(f"the trace's {name} hold {np.asarray(array).dtype} values; give integers")
        n = len(self.ids)
        arrays = {"sizes": self.sizes, "ops": self.ops, "steps": self.steps} | ({"times": self.times} if self.times is not None else {})
        unequal = [f"{name} {len(array)}" for name, array in arrays.items() if len(array) != n]
        if unequal:
            raise TraceError(f"the trace's arrays differ in length: ids {n}, {', '.join(unequal)}")
        if n and int(self.sizes.max()) > 2**63 - 1:
            raise TraceError(f"the trace holds a size of {int(self.sizes.max())} bytes: at most 2**63 - 1")
        if n and (int(self.ids.min()) < 0 or int(self.ids.max()) >= len(self.keys)):
            raise TraceError(f"the trace's ids reach outside its table of {len(self.keys)} keys (0 to {len(self.keys) - 1})")
        if n and int(self.sizes.min()) < 0:
            raise TraceError(f"the trace holds a negative size ({int(self.sizes.min())} bytes)")
        if n and not np.isin(self.ops, (ACCESS, DELETE)).all():
            raise TraceError(f"the trace's ops hold codes other than {ACCESS} (access) and {DELETE} (delete)")

    @classmethod
    def from_accesses(cls, keys: list[str], sizes: list[int] | np.ndarray, steps: list[int] | np.ndarray | None = None) -> Trace:
        """A trace of plain accesses given as a key per access (and its size)."""
        table: dict[str, int] = {}
        ids = np.fromiter((table.setdefault(k, len(table)) for k in keys), dtype=np.int64, count=len(keys))
        n = len(ids)
        return cls(
            keys=list(table),
            ids=ids,
            sizes=np.asarray(sizes, dtype=np.int64),
            ops=np.zeros(n, dtype=np.uint8),
            steps=np.asarray(steps, dtype=np.int64) if steps is not None else np.zeros(n, dtype=np.int64),
        )


def load_trace(path: str | Path, columns: Mapping[str, int | str] | None = None, delimiter: str = ",") -> Trace:
    """Read a store ``.npz`` trace, an ``oracleGeneral`` binary trace or a CSV (``columns``, for
    a CSV only: ``{"key": 0, "size": 1}`` by default; indexes from 0, or header names)."""
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path} is a folder; give a trace file (.npz, a key,size CSV or an oracleGeneral .bin)")
    binary = "a store trace (.npz)" if path.suffix == ".npz" else "an oracleGeneral trace" if _is_oracle_general(path) else None
    if columns and binary:
        raise TraceError(f"columns (--columns) pick a CSV trace's columns, and {path} is {binary}, whose columns are fixed; leave them out")
    if path.suffix == ".npz":
        return _load_npz(path)
    if _is_oracle_general(path):
        if path.suffix in (".zst", ".gz", ".xz"):
            raise TraceError(f"{path}: compressed oracleGeneral traces are not read; decompress it first")
        return load_oracle_general(path)
    try:
        return _load_csv(path, columns or {}, delimiter)
    except UnicodeDecodeError:
        offset, byte = _first_bad_byte(path)
        raise TraceError(f"{path} is not UTF-8 text (byte {byte:#04x} at offset {offset:,}); "
                         "give a key,size CSV, a store .npz or an oracleGeneral .bin") from None


def _is_oracle_general(path: Path) -> bool:
    return path.suffix == ".bin" or "oracleGeneral" in path.name


def _first_bad_byte(path: Path) -> tuple[int, int]:
    """Offset in the file and value of the first byte that is not UTF-8 there."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as error:
                return offset - pending + error.start, error.object[error.start]
            offset += len(block)
    pending = decoder.getstate()[0]  # (a sequence cut off by the end of the file)
    return offset - len(pending), pending[0] if pending else 0


def load_oracle_general(path: str | Path) -> Trace:
    """Read libCacheSim's ``oracleGeneral`` binary trace (see the module docstring)."""
    path = Path(path)
    nbytes = path.stat().st_size
    if nbytes % ORACLE_GENERAL.itemsize:
        raise TraceError(f"{path}: {nbytes} bytes is not a whole number of {ORACLE_GENERAL.itemsize}-byte oracleGeneral records")
    records = np.fromfile(path, dtype=ORACLE_GENERAL)
    records = records[records["size"] > 0]
    if not len(records):
        raise TraceError(f"{path} holds no accesses")
    keys, ids = _intern(records["id"])
    return Trace(
        keys=[str(k) for k in keys.tolist()],
        ids=ids,
        sizes=records["size"].astype(np.int64),
        ops=np.zeros(len(ids), dtype=np.uint8),
        steps=np.zeros(len(ids), dtype=np.int64),
        times=records["time"].astype(np.float64),
    )


def save_oracle_general(trace: Trace, path: str | Path) -> Path:
    """Write ``trace``'s accesses as an ``oracleGeneral`` file (ids are the trace's interned
    integers; next-access positions computed, -1 for none), for libCacheSim to read. Deletes
    are left out: the format has no operation field, so a delete would read as an access."""
    path = Path(path)
    accesses = trace.ops == ACCESS
    ids, sizes = trace.ids[accesses], trace.sizes[accesses]
    if len(sizes) and int(sizes.max()) > np.iinfo(np.uint32).max:
        raise TraceError(f"{path}: an access of {int(sizes.max())} bytes does not fit oracleGeneral's 32-bit size field")
    records = np.zeros(len(ids), dtype=ORACLE_GENERAL)
    records["id"] = ids
    records["size"] = sizes
    if trace.times is not None:
        times = trace.times[accesses]
        records["time"] = (times - times.min()).astype(np.uint32) if len(times) else 0
    records["next"] = next_access(ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    records.tofile(path)
    return path


def next_access(ids: np.ndarray) -> np.ndarray:
    """For each position, the position of the next access to the same id (-1 if none)."""
    order = np.argsort(ids, kind="stable")
    following = np.full(len(ids), -1, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    following[order[:-1][same]] = order[1:][same]
    return following


def _intern(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values in order of first appearance, and each access's index among them."""
    unique, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return unique[order], rank[inverse.reshape(-1)]


@contextmanager
def store_npz(path: str | Path) -> Iterator[Any]:
    """``numpy.load`` of a store's ``.npz`` trace (no pickles), with ``TraceError`` for a file
    that is not one (not an archive, or one without the trace's arrays)."""
    try:
        data = np.load(Path(path), allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise TraceError(f"{path} is not a store trace (the .npz TierStore(trace=...) writes): not a numpy archive") from None
    if not hasattr(data, "files"):
        raise TraceError(f"{path} is not a store trace (the .npz TierStore(trace=...) writes): it holds one array, not an archive")
    with data:
        try:
            yield data
        except KeyError:
            raise TraceError(f"{path} is not a store trace (the .npz TierStore(trace=...) writes): it lacks the trace's "
                             f"arrays (it holds {sorted(data.files)})") from None


def _load_npz(path: Path) -> Trace:
    """A store's trace as the simulator reads it: puts, gets and reads are accesses, a delete
    removes its key, and a pop is both (an access, then the key gone)."""
    with store_npz(path) as data:
        ops_table, codes, keys, key_ids, sizes, times, steps = store_rows(data, path)
        op_names = np.asarray(ops_table)[codes]
        keep = ~np.isin(op_names, ("prefetch", "evict", "writeback", "update"))
        kept = op_names[keep]
        if not (kept != "delete").any():  # (as an empty CSV is: no miss ratio to give)
            raise TraceError(f"{path} holds no accesses")
        repeats = np.where(kept == "pop", 2, 1)
        ops = np.repeat(np.where(kept == "delete", DELETE, ACCESS).astype(np.uint8), repeats)
        ops[np.cumsum(repeats)[kept == "pop"] - 1] = DELETE  # (a pop's second row: the key goes)
        return Trace(
            keys=keys,
            ids=np.repeat(key_ids[keep], repeats),
            sizes=np.repeat(sizes[keep], repeats),
            ops=ops,
            steps=np.repeat(steps[keep].astype(np.int64), repeats),
            times=np.repeat(times[keep], repeats),
            tiers=store_tiers(data, path),
        )


def store_rows(
    data: Any, path: str | Path, timed: bool = True
) -> tuple[list[str], np.ndarray, list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The columns of a store's ``.npz`` trace (``store_npz``), checked as every reader of one
    checks them (``TraceError`` for rows no store writes): the ops table, op codes, the keys
    table, key indexes, sizes, times and steps (``timed``; else zeros, for a reader that needs
    neither)."""
    ops_table = [str(op) for op in _npz_array(data, "ops", "U", path)]
    codes, key_ids = _npz_array(data, "op", "iu", path).astype(np.int64), _npz_array(data, "key", "iu", path).astype(np.int64)
    sizes = _npz_array(data, "nbytes", "iu", path).astype(np.int64)
    times = _npz_array(data, "time", "iuf", path).astype(np.float64) if timed else np.zeros(len(codes))
    keys = [str(k) for k in _npz_array(data, "keys", "U", path)]
    steps = _npz_array(data, "step", "iu", path) if timed else np.zeros(len(codes), dtype=np.int64)
    _check_npz_rows(path, len(ops_table), codes, len(keys), key_ids, sizes, times, steps)
    _check_names(path, "keys", keys)
    _check_tier_columns(data, path, len(codes))
    unknown = sorted({ops_table[code] for code in np.unique(codes).tolist()} - set(OPS))
    if unknown:  # (counted as accesses by the simulator, refused by the replay: refused by both)
        raise TraceError(f"{path} is not a trace a store wrote: it has rows of unknown operations {unknown} (a store writes {list(OPS)})")
    return ops_table, codes, keys, key_ids, sizes, times, steps


_KINDS = {"U": "text", "iu": "integers", "iuf": "numbers"}


def _npz_array(data: Any, name: str, kinds: str, path: str | Path) -> np.ndarray:
    """``data[name]``, with ``TraceError`` unless its values are of one of ``kinds`` (numpy
    dtype kinds: a float key index would be truncated, numeric strings parsed as sizes)."""
    try:
        array = data[name]
    except ValueError:  # (an object array: reading it needs pickle, which a trace never holds)
        raise TraceError(f"{path} is not a store trace: its {name!r} array holds Python objects (a store writes "
                         f"{_KINDS[kinds]}, no pickles)") from None
    if array.dtype.kind not in kinds:
        raise TraceError(f"{path} is not a store trace: its {name!r} array holds {array.dtype} values, not {_KINDS[kinds]}")
    return array


def _check_npz_rows(path: str | Path, n_ops: int, codes: np.ndarray, n_keys: int, key_ids: np.ndarray, sizes: np.ndarray,
                    times: np.ndarray, steps: np.ndarray) -> None:
    """``TraceError`` for rows no store writes (a file edited by hand, or damaged)."""
    problems = []
    if len(codes) and (codes.min() < 0 or codes.max() >= n_ops):
        problems.append(f"operation codes outside its table of {n_ops}")
    if len(key_ids) and (key_ids.min() < 0 or key_ids.max() >= n_keys):
        problems.append(f"key indexes outside its table of {n_keys} keys")
    if len(sizes) and sizes.min() < 0:
        problems.append("negative sizes")
    if not np.isfinite(times).all():
        problems.append("times that are not finite")
    elif len(times) > 1 and (np.diff(times) < 0).any():
        problems.append("times that go backwards")
    if len({len(codes), len(key_ids), len(sizes), len(times), len(steps)}) != 1:
        problems.append("columns of different lengths")
    if problems:
        raise TraceError(f"{path} is not a trace a store wrote: it has {', '.join(problems)}")


def store_tiers(data: Any, path: str | Path) -> list[str] | None:
    """The tier names of a store's ``.npz`` trace (``store_npz``), fastest first; None when it
    has no ``tiers`` table."""
    if "tiers" not in data.files:
        return None
    tiers = [str(name) for name in _npz_array(data, "tiers", "U", path)]
    _check_names(path, "tiers", tiers)
    return tiers


def _check_names(path: str | Path, table: str, names: list[str]) -> None:
    """``TraceError`` for a name twice in a trace's ``keys`` or ``tiers`` table: rows pointing
    at either copy would be counted as two keys (tiers) where the store had one."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise TraceError(f"{path} is not a trace a store wrote: its {table} table names {name!r} twice")
        seen.add(name)


def _check_tier_columns(data: Any, path: str | Path, rows: int) -> None:
    """``TraceError`` for a ``tier`` or ``before`` column whose indexes reach outside the
    trace's ``tiers`` table (-1 is none) or that is not one value per row."""
    tiers = store_tiers(data, path)
    for column in ("tier", "before"):
        if column not in data.files:
            continue
        indexes = _npz_array(data, column, "iu", path).astype(np.int64)
        if len(indexes) != rows:
            raise TraceError(f"{path} is not a trace a store wrote: it has columns of different lengths ({column} {len(indexes)}, op {rows})")
        if tiers is not None and len(indexes) and (indexes.min() < -1 or indexes.max() >= len(tiers)):
            bad = int(indexes[(indexes < -1) | (indexes >= len(tiers))][0])
            raise TraceError(f"{path} is not a trace a store wrote: its {column!r} column holds tier index {bad}, outside its "
                             f"table of {len(tiers)} tiers ({', '.join(tiers)}; -1 for none)")


def load_evictions(path: str | Path) -> list[tuple[str, int]]:
    """The evictions a store recorded in its ``.npz`` trace, in order: ``(key, tier index)``
    (``tiers[index]`` of the file names the tier). Empty for traces made before the store
    recorded evictions."""
    with store_npz(path) as data:
        ops_table, codes, keys, key_ids, _, _, _ = store_rows(data, path, timed=False)
        if "evict" not in ops_table:
            return []
        rows = np.flatnonzero(codes == ops_table.index("evict"))
        tiers = _npz_array(data, "tier", "iu", path)[rows].tolist()
        return [(keys[k], int(t)) for k, t in zip(key_ids[rows].tolist(), tiers, strict=True)]


_KEY_NAMES = ("key", "obj_id", "object_id", "id", "obj", "object")
_SIZE_NAMES = ("size", "obj_size", "object_size", "bytes", "nbytes", "req_size")


def _named_columns(names: list[str], path: Path) -> dict[str, int | str]:
    """Key and size columns from a header's names when none were given: the usual names
    (``key``/``obj_id``..., ``size``/``obj_size``...); with no header, or a header of two
    columns, the first two. A wider header without those names is ambiguous: refused."""
    if not names or all(_is_number(name) for name in names):
        return {}
    lowered = [name.strip().lower() for name in names]
    key = next((lowered.index(n) for n in _KEY_NAMES if n in lowered), None)
    size = next((lowered.index(n) for n in _SIZE_NAMES if n in lowered), None)
    if key is not None and size is not None:
        return {"key": key, "size": size}
    if len(names) > 1 and _is_number(names[1]):
        return {}  # (no header: a first line whose size column, the second, is a number is an access)
    if len(names) > 2:
        raise TraceError(
            f"{path} has a header of {len(names)} columns {names} without a key and a size column by their usual names; "
            "say which with columns={'key': NAME, 'size': NAME} (CLI: --columns key=NAME,size=NAME)"
        )
    return {}


def _load_csv(path: Path, columns: Mapping[str, int | str], delimiter: str) -> Trace:
    unknown = set(columns) - {"key", "size"}
    if unknown:
        raise TraceError(f"unknown CSV column role(s) {sorted(unknown)}; give 'key' and 'size'")
    with open(path, newline="", encoding="utf-8-sig") as handle:
        first = handle.readline()
    if not first.strip() and path.stat().st_size <= len(first.encode()):
        raise TraceError(f"{path} holds no accesses")
    if first.startswith("#"):
        first = ""  # a comment first: no header names
    names = next(csv.reader([first], delimiter=delimiter), []) if first.strip() else []
    columns = columns or _named_columns(names, path)
    key_col = _column(columns.get("key", 0), names, path)
    size_col = _column(columns.get("size", 1), names, path)
    header = len(names) > size_col and not _is_number(names[size_col])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (numpy's "input contained no data": said below)
            table = np.loadtxt(path, delimiter=delimiter, usecols=(key_col, size_col), dtype=np.int64,
                               skiprows=int(header), comments="#", ndmin=2)
    except ValueError:
        return _load_csv_plain(path, key_col, size_col, delimiter)
    if not len(table):
        taken = f" (its first line, {first.strip()!r}, was taken as a header: its size column is not a number)" if header else ""
        raise TraceError(f"{path} holds no accesses{taken}")
    if (table[:, 1] < 0).any():
        row = int(np.flatnonzero(table[:, 1] < 0)[0])
        raise TraceError(f"{path}: negative size {table[row, 1]} (access {row + 1})")
    keys, ids = _intern(table[:, 0])
    n = len(ids)
    return Trace([str(k) for k in keys.tolist()], ids, np.ascontiguousarray(table[:, 1]), np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.int64))


def _column(spec: int | str, names: list[str], path: Path) -> int:
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        return int(spec)
    if spec not in names:
        raise TraceError(f"{path}: no column {spec!r} in the header {names}")
    return names.index(spec)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_MAX_SIZE = 2**63 - 1
#: A key numpy's columnar reader may take as an int64 (leading zeros, a sign, blanks around it).
_WHOLE_NUMBER = re.compile(r"\s*[+-]?[0-9]+\s*")


def _as_read(key: str) -> str:
    """``key`` as the columnar path reads it: a whole number that fits an int64 as that number."""
    if _WHOLE_NUMBER.fullmatch(key):
        text = key.strip()
        sign, digits = ("-", text[1:]) if text[0] == "-" else ("", text.lstrip("+"))
        digits = digits.lstrip("0") or "0"
        if len(digits) > 19:  # (int() refuses 4,300 digits)
            return key
        number = int(sign + digits)
        if -(2**63) <= number < 2**63:
            return str(number)
    return key


def _whole_bytes(text: str) -> int | float | None:
    """``text`` as a number of bytes: an int when whole (exact: a float rounds those above
    2**53; ``1e3`` and ``12.0`` count), else the float it reads as (not whole, or infinite),
    or None for text that is no number."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        exact = float(text)
    except ValueError:
        return None
    return int(exact) if exact.is_integer() else exact


def _uncommented(handle: Iterable[str], lines: list[int]) -> Iterator[str]:
    """The lines of ``handle`` but its comments (a line whose first character is ``#``, outside
    a quoted field: a key quoted ``"#a"`` is a key, its line starts with the quote, and so is a
    quoted key's next line that starts with ``#``), counting every line read in ``lines[0]``."""
    quoted = False  # (inside a quoted field that goes on past the line: an odd count of quotes so far)
    for line in handle:
        lines[0] += 1
        if quoted or not line.startswith("#"):
            yield line
            quoted ^= line.count('"') % 2 == 1


def _load_csv_plain(path: Path, key_col: int, size_col: int, delimiter: str) -> Trace:
    keys: list[str] = []
    sizes: list[int] = []
    width = max(key_col, size_col) + 1
    lines = [0]  # (lines read so far, comments too: for the line number in errors)
    with open(path, newline="", encoding="utf-8-sig") as handle:
        for number, row in enumerate(csv.reader(_uncommented(handle, lines), delimiter=delimiter)):
            if not row:
                continue
            if len(row) < width:
                raise TraceError(f"{path}:{lines[0]}: expected at least {width} columns (key in {key_col}, size in {size_col}), got {row!r}")
            size = _whole_bytes(row[size_col])
            if size is None:
                if number == 0:
                    continue  # a header line
                raise TraceError(f"{path}:{lines[0]}: size {row[size_col]!r} is not a number")
            if isinstance(size, float):
                what = "more bytes than a trace holds (at most 2**63 - 1)" if size == math.inf else "not a whole number of bytes"
                raise TraceError(f"{path}:{lines[0]}: size {row[size_col]!r} is {what}")
            if size < 0:
                raise TraceError(f"{path}:{lines[0]}: negative size {size}")
            if size > _MAX_SIZE:
                raise TraceError(f"{path}:{lines[0]}: size {row[size_col]!r} is more bytes than a trace holds (at most 2**63 - 1)")
            key = row[key_col]
            keys.append(_as_read(key))
            sizes.append(size)
    if not keys:
        raise TraceError(f"{path} holds no accesses")
    return Trace.from_accesses(keys, sizes)
