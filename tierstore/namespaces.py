"""Key namespaces: who owns which keys of a store.

A *namespace* is a key prefix ending in ``"/"`` (``"optim/0/"``, ``"swap/act/1/"``). Whoever
claims one owns every key under it; nothing deletes keys it does not own (DESIGN invariant 11).

- ``await store.claim(name, owner=...)`` records the claim in the store and makes it *live* in
  this process. A second live claim of the same name, or of one nested inside or around it,
  raises ``NamespaceClaimedError`` naming the holder. Reading needs no claim (``tierstore
  info``, snapshots, ``store.read``).
- The record outlives the process: after a restart the same owner claiming the same name
  adopts it (its keys are its own, e.g. optimizer state to continue from). Another owner, a
  namespace overlapping a recorded one, or keys under the name that no record covers (put there
  by hand) are refused unless ``overwrite=True``, which deletes what is in the way (or, for the
  keys no namespace owns, ``adopt=True``, which keeps them as the claimed namespace's).
- ``await store.claim_unique("optim/", owner=...)`` picks ``optim/0/``, ``optim/1/`` ...: the
  first with no live claim, no record and no keys. Adapters use it when not given a name, so
  two of them on one store never share keys. Such namespaces are marked *auto*.
- ``Namespace.release()`` (or leaving ``async with``) ends the live claim and keeps the record
  and the keys; ``Namespace.drop()`` deletes the keys and the record.
- A recorded namespace without a live claim is an orphan candidate: ``store.namespaces()`` lists
  every namespace with its keys and bytes, ``store.gc()`` removes the orphaned auto ones (named
  ones only when named), ``tierstore gc ROOT`` does it from the command line.

The records are one small JSON document (never pickle) stored as a uint8 entry under the
reserved key ``INDEX_KEY`` on the store's slowest tier, so it takes the same durable path as
any value and comes back when a disk tier is reopened. Claims are recorded before their keys
are written and records removed after their keys are deleted, so a crash at any point leaves
no key of a claimed namespace without its record.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from .errors import (
    CatalogError,
    InvalidKeyError,
    KeyNotFoundError,
    NamespaceClaimedError,
    StoreClosedError,
)
from .flags import require_flag
from .keys import RESERVED_PREFIX, check_key, is_reserved, reserved_keys

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .store import TierStore

__all__ = ["INDEX_KEY", "Namespace", "NamespaceInfo", "NamespaceRegistry", "namespace_name"]

#: The reserved key holding every namespace record of a store.
INDEX_KEY = f"{RESERVED_PREFIX}namespaces"
#: Version of the JSON document under ``INDEX_KEY``.
INDEX_FORMAT = 1


def namespace_name(name: object) -> str:
    """``name`` as a namespace: a usable key prefix, given a trailing ``"/"`` if it has none.

    Raises
    ------
    InvalidKeyError
        ``name`` is not a str, is empty or ``"/"``, or is under the store's reserved prefix.
    """
    if not isinstance(name, str) or name.strip("/") == "":
        raise InvalidKeyError(f"a namespace is a non-empty str key prefix, not {name!r:.80}")
    if is_reserved(name) or RESERVED_PREFIX.startswith(name if name.endswith("/") else name + "/"):
        raise InvalidKeyError(f"namespace {name!r:.80} overlaps the store's reserved keys ({RESERVED_PREFIX!r})")
    name = check_key(name if name.endswith("/") else name + "/")
    return name


def _overlaps(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


@dataclass(frozen=True)
class _Record:
    owner: str
    auto: bool
    created: float
    pid: int


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace of a store, as ``store.namespaces()`` and ``store.gc()`` report it.

    Attributes
    ----------
    name:
        The key prefix (ends in ``"/"``).
    owner:
        Who claimed it (e.g. ``"TieredAdamW"``).
    auto:
        Chosen by ``claim_unique`` (a default), not named by the user.
    live:
        Claimed in this process right now; otherwise left by an earlier run (an orphan
        candidate) or released.
    keys, nbytes:
        Keys under the prefix and the bytes of their values.
    created, pid:
        When and by which process it was last claimed.
    """

    name: str
    owner: str
    auto: bool
    live: bool
    keys: int
    nbytes: int
    created: float
    pid: int

    def to_json(self) -> dict[str, Any]:
        """Plain (JSON-ready) data."""
        return asdict(self)


class Namespace:
    """A claimed key namespace (get one from ``store.claim`` or ``store.claim_unique``).

    Use ``ns.key("3/exp_avg")`` for the keys of the owner; ``async with`` releases the claim.
    """

    def __init__(self, registry: NamespaceRegistry, name: str, owner: str, auto: bool) -> None:
        self._registry = registry
        self.name = name
        self.owner = owner
        self.auto = auto

    @property
    def live(self) -> bool:
        """Whether this object still holds the claim."""
        return self._registry.holder(self.name) is self

    def key(self, suffix: str) -> str:
        """The store key ``suffix`` inside this namespace."""
        return self.name + suffix

    def keys(self) -> list[str]:
        """The keys under this namespace now."""
        return self._registry.keys_under(self.name)

    async def clear(self) -> int:
        """Delete every key of the namespace (keeping the claim); returns how many.

        Raises
        ------
        NamespaceClaimedError
            This object no longer holds the claim.
        """
        self._require_live("clear")
        return await self._registry.delete_keys(self.keys())

    async def release(self) -> None:
        """End the live claim; the record and the keys stay (a later claim by the same owner
        adopts them). Releasing twice does nothing."""
        self._registry.forget(self)

    async def drop(self) -> None:
        """Delete every key of the namespace and its record, and end the claim.

        Raises
        ------
        NamespaceClaimedError
            This object no longer holds the claim.
        """
        self._require_live("drop")
        await self._registry.drop(self)

    def _require_live(self, verb: str) -> None:
        if not self.live:
            raise NamespaceClaimedError(f"cannot {verb} namespace {self.name!r}: this claim was released; claim it again first")

    async def __aenter__(self) -> Namespace:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()

    def __repr__(self) -> str:
        state = "live" if self.live else "released"
        return f"Namespace({self.name!r}, owner={self.owner!r}, {'auto, ' if self.auto else ''}{state})"


class NamespaceRegistry:
    """The namespaces of one store: live claims of this process and the records in the store.

    The store creates one and delegates ``claim``, ``claim_unique``, ``namespaces`` and ``gc``
    to it; it works through the store's public verbs only.
    """

    def __init__(self, store: TierStore) -> None:
        self._store = store
        self._live: dict[str, Namespace] = {}
        # Claims read the index, check it and write it back across awaits: one at a time.
        self._lock = asyncio.Lock()

    # -- claims -----------------------------------------------------------------------------------

    async def claim(self, name: str, *, owner: str = "user", overwrite: bool = False, adopt: bool = False) -> Namespace:
        """Claim ``name`` for ``owner`` (see the module docstring)."""
        require_flag("overwrite", overwrite)
        require_flag("adopt", adopt)
        name = namespace_name(name)
        owner = _owner(owner)
        async with self._lock:
            records = await self._read_index()
            self._check_live(name)
            in_the_way = [n for n, r in records.items() if _overlaps(n, name) and not (n == name and r.owner == owner)]
            stray = [] if adopt else self._stray_keys(name, records)
            if (in_the_way or stray) and not overwrite:
                raise NamespaceClaimedError(self._refusal(name, owner, records, in_the_way, stray))
            for other in in_the_way:  # overwrite: take over what an earlier run left there
                await self.delete_keys(self.keys_under(other))
            await self.delete_keys(stray)
            for other in in_the_way:
                del records[other]
            records[name] = _Record(owner, False, time.time(), os.getpid())
            await self._write_index(records)
            namespace = self._live[name] = Namespace(self, name, owner, auto=False)
            return namespace

    async def claim_unique(self, base: str, *, owner: str = "user") -> Namespace:
        """Claim the first free ``{base}{n}/`` (n = 0, 1, ...) for ``owner``, marked auto."""
        base = namespace_name(base)
        owner = _owner(owner)
        async with self._lock:
            records = await self._read_index()
            for outer in [*self._live, *records]:
                if base.startswith(outer):  # every name under base would be inside it
                    raise NamespaceClaimedError(f"cannot pick a namespace under {base!r}: {self._describe(outer, records)} covers it")
            taken = {n.split("/", base.count("/") + 1)[base.count("/")] for n in [*self._live, *records, *self._store.keys()] if n.startswith(base)}
            name = next(f"{base}{i}/" for i in itertools.count() if str(i) not in taken)
            records[name] = _Record(owner, True, time.time(), os.getpid())
            await self._write_index(records)
            namespace = self._live[name] = Namespace(self, name, owner, auto=True)
            return namespace

    def holder(self, name: str) -> Namespace | None:
        """The live claim of exactly ``name``, if any."""
        return self._live.get(name)

    def forget(self, namespace: Namespace) -> None:
        """End ``namespace``'s live claim (its record stays)."""
        if self._live.get(namespace.name) is namespace:
            del self._live[namespace.name]

    async def drop(self, namespace: Namespace) -> None:
        """Delete the keys and the record of ``namespace`` (a live claim) and end the claim."""
        async with self._lock:
            await self.delete_keys(self.keys_under(namespace.name))
            records = await self._read_index()
            records.pop(namespace.name, None)
            await self._write_index(records)
            self.forget(namespace)

    # -- listing and collecting ---------------------------------------------------------------------

    async def namespaces(self) -> list[NamespaceInfo]:
        """Every recorded namespace, with its keys and bytes, sorted by name."""
        records = await self._read_index()
        return [self._info(name, record) for name, record in sorted(records.items())]

    async def gc(self, *, names: Iterable[str] | None = None, dry_run: bool = True) -> list[NamespaceInfo]:
        """Remove orphaned namespaces (recorded, not live): every auto one, or exactly ``names``.

        Returns what was (or, with ``dry_run``, would be) removed, as it was before.

        Raises
        ------
        NamespaceClaimedError
            A namespace in ``names`` is claimed live in this process.
        KeyNotFoundError
            A namespace in ``names`` is not recorded.
        """
        wanted = None if names is None else [namespace_name(n) for n in names]
        async with self._lock:
            records = await self._read_index()
            if wanted is None:
                chosen = [n for n, r in sorted(records.items()) if r.auto and n not in self._live]
            else:
                for name in wanted:
                    if name in self._live:
                        raise NamespaceClaimedError(f"namespace {name!r} is {self._describe(name, records)}; it is no orphan")
                    if name not in records:
                        raise KeyNotFoundError(f"no namespace {name!r} is recorded in the store (recorded: {sorted(records)})")
                chosen = list(dict.fromkeys(wanted))
            removed = [self._info(name, records[name]) for name in chosen]
            if not dry_run and chosen:
                for name in chosen:
                    await self.delete_keys(self.keys_under(name))
                    del records[name]
                await self._write_index(records)
            return removed

    # -- helpers ---------------------------------------------------------------------------------------

    def keys_under(self, name: str) -> list[str]:
        return [key for key in self._store.keys() if key.startswith(name) and not is_reserved(key)]

    async def delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys``; one deleted meanwhile by its owner (a swap freeing what backward
        used, say) is gone as asked. Returns how many this call deleted."""
        deleted = 0
        for key in keys:
            try:
                await self._store.delete(key)
            except KeyNotFoundError:
                continue
            deleted += 1
        return deleted

    def _info(self, name: str, record: _Record) -> NamespaceInfo:
        keys = self.keys_under(name)
        nbytes = sum(int(self._store.info(key)["nbytes"]) for key in keys)
        return NamespaceInfo(name, record.owner, record.auto, name in self._live, len(keys), nbytes, record.created, record.pid)

    def _check_live(self, name: str) -> None:
        for held, namespace in self._live.items():
            if _overlaps(held, name):
                what = "is" if held == name else f"overlaps {held!r}, which is"
                raise NamespaceClaimedError(f"namespace {name!r} {what} claimed by {namespace.owner!r} in this process (live); release it first")

    def _stray_keys(self, name: str, records: dict[str, _Record]) -> list[str]:
        """Keys under ``name`` that no recorded namespace covers."""
        return [key for key in self.keys_under(name) if not any(key.startswith(n) for n in records)]

    def _describe(self, name: str, records: dict[str, _Record]) -> str:
        if name in self._live:
            return f"claimed by {self._live[name].owner!r} in this process (live)"
        record = records[name]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        return f"recorded for {record.owner!r} by process {record.pid} at {when}"

    def _refusal(self, name: str, owner: str, records: dict[str, _Record], in_the_way: list[str], stray: list[str]) -> str:
        parts = [f"{other!r} is {self._describe(other, records)}" for other in in_the_way]
        if stray:
            parts.append(f"{len(stray)} key(s) under it belong to no namespace (e.g. {stray[0]!r}: their record was lost, "
                         "or they were imported; store.claim(..., adopt=True) keeps them as the namespace's)")
        return f"cannot claim {name!r} for {owner!r}: " + "; ".join(parts) + "; pass overwrite=True to delete them and take it over"

    async def _read_index(self) -> dict[str, _Record]:
        if not self._store.is_open:
            raise StoreClosedError("the store is not open")
        try:
            with reserved_keys():
                raw = await self._store.read(INDEX_KEY)
        except KeyNotFoundError:
            return {}
        try:
            document = json.loads(raw.numpy().tobytes().decode("utf-8"))
            if document.get("format") != INDEX_FORMAT:
                raise CatalogError(f"the namespace index has format {document.get('format')!r}; this version reads {INDEX_FORMAT}")
            return {name: _Record(str(r["owner"]), bool(r["auto"]), float(r["created"]), int(r["pid"])) for name, r in document["namespaces"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CatalogError(f"the namespace index ({INDEX_KEY!r}) is unreadable: {exc}") from exc

    async def _write_index(self, records: dict[str, _Record]) -> None:
        with reserved_keys():
            if not records:
                with contextlib.suppress(KeyNotFoundError):  # nothing was recorded: nothing to remove
                    await self._store.delete(INDEX_KEY)
                return
            document = {"format": INDEX_FORMAT, "namespaces": {name: asdict(r) for name, r in sorted(records.items())}}
            data = bytearray(json.dumps(document, ensure_ascii=False).encode("utf-8"))
            # The slowest tier: on a disk tier the record is as durable as the tier makes puts.
            await self._store.put(INDEX_KEY, torch.frombuffer(data, dtype=torch.uint8), tier=self._store.tiers[-1].name)


def _owner(owner: object) -> str:
    if not isinstance(owner, str) or not owner:
        raise TypeError(f"owner must be a non-empty str, not {owner!r:.80}")
    return owner
