"""A put copied over the buffer of the value it replaces, when its memory tier has no room.

A put allocates its new buffer beside the old value's and drops the old one once the new one is
installed, so the old value stays readable meanwhile and survives a put that fails. On a tier
without room for both, that made room by evicting, and the victim could be the very value being
replaced: written to the disk (a dirty value's only copy) to make room for its own successor,
or another value pushed out in its place. A put of a value that takes the old one's room on
that tier, with no one holding it, instead waits for the reads of it under way and writes
over it (what the simulator counts: a hit; the trace records a put row with ``hit`` 1).

While the copy runs the key is as under a write hold (``TierStore.hold(write=True)``): its
readers, puts and holds wait. The copy is never given up part-way: a cancelled caller waits for
it, and the put has then taken effect (as README's "Durability" allows: the new value once its
commit has begun). A copy that fails (it fails before it writes: a closed link, a pool that
stopped) leaves the old bytes in place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .entry import Copy, Entry
from .errors import TierFullError
from .tensors import TensorMeta
from .tiers.base import MemoryTier
from .units import format_bytes
from .workers import Priority, wait_uncancelled

if TYPE_CHECKING:
    from .engine import Engine


def overwritable(engine: Engine, entry: Entry, t: int, nbytes: int, read: bool = False) -> Copy | None:
    """The copy of ``entry``'s value on memory tier ``t`` that a put of ``nbytes`` may copy
    over: the tier has no room for a new buffer of that size now, the copy takes what the new
    value takes there, and no one else uses it (no hold, read, write-back, or other put of the
    key in flight; with ``read``, uses that are not holds are allowed: see ``after_reads``).
    None when the put should allocate as usual."""
    tier = engine.tiers[t]
    if not isinstance(tier, MemoryTier) or tier.free >= tier.allocation_size(nbytes):
        return None
    link = getattr(tier, "link", None)
    if engine.winding_down or engine.closing or engine.frozen:
        return None
    if engine.entries.get(entry.key) is not entry or entry.writer is not None or entry.pending_writes > 1:
        return None
    copy = entry.valid(t)
    if copy is None or not copy.in_memory or (copy.holds if read else copy.users) or copy.retired or copy.writing:
        return None
    last_use = copy.last_use
    if last_use is not None and not (link is not None and link.passed(last_use)):
        return None  # (a kernel may still read it)
    return copy if copy.nbytes == tier.value_size(nbytes) else None


@contextmanager
def refusal_explained(engine: Engine, entry: Entry, t: int, nbytes: int, fill: bool = False) -> Iterator[None]:
    """Around a put (``fill``: a fill) of ``nbytes`` onto tier ``t``: a ``TierFullError`` it
    raises says what the key's own value there has to do with it (``why_not``)."""
    try:
        yield
    except TierFullError as exc:
        if (why := why_not(engine, entry, t, nbytes, fill)) is None:
            raise
        raise TierFullError(f"{exc}; {why}") from None


def why_not(engine: Engine, entry: Entry, t: int, nbytes: int, fill: bool = False) -> str | None:
    """For a put (``fill``: a fill) of ``nbytes`` refused for room on tier ``t``: what the key's
    own value there has to do with it, when without it the new value would fit (None
    otherwise)."""
    tier = engine.tiers[t]
    copy = entry.valid(t) if engine.entries.get(entry.key) is entry else None
    if copy is None or not copy.in_memory or not isinstance(tier, MemoryTier):
        return None
    if tier.value_size(nbytes) > tier.capacity or tier.free + copy.nbytes < tier.value_size(nbytes):
        return None  # (deleting the key would not make room: say nothing of it)
    holding = f"{format_bytes(copy.nbytes)} of it hold the value {entry.key!r} has now"
    if copy.holds:
        return f"{holding}, held now: a put gets room beside a held value; release the hold first"
    if fill:
        return (f"{holding}: a fill gets room for its value beside the old one (its block may raise, which leaves the old "
                "value); delete the key first" + (", or write into its buffer under hold(key, write=True)" if copy.nbytes == tier.value_size(nbytes) else ""))
    if copy.nbytes == tier.value_size(nbytes):  # (one it could have copied over, but for a use that had not ended)
        return (f"{holding}: a put copies over a value of its size only when nothing else uses it (a read, a write-back, "
                "a kernel, another put of the key) and no freeze or close is under way")
    return f"{holding}: a value of another size gets room beside the old one; delete the key first"


async def after_reads(engine: Engine, entry: Entry, copy: Copy, t: int, nbytes: int) -> Copy | None:
    """``overwritable`` once the reads of ``copy`` under way have ended (gets, loads from it:
    they end by themselves), as a put that evicted it would have waited for them. Reads that
    would start meanwhile wait for the put instead, as for a write hold (let in, gets issued
    around the put kept the copy in use: the put then made room the usual way, writing the old
    value to the disk, or was refused where there is no disk; a loop of gets would have kept it
    waiting for ever). Other uses (a write-back): None, and the put goes the usual way."""
    reads = [done for done, read in engine.reads[t].items() if read is copy]
    if len(reads) < copy.users:
        return None
    if not reads:
        return overwritable(engine, entry, t, nbytes)
    entry.writer, entry.writer_token = copy, 0  # (no await from its end to ``overwrite``'s, which marks it again)
    try:
        await asyncio.wait(reads)
    except BaseException:  # (cancelled: the readers that waited go on)
        entry.writer, entry.writer_token = None, 0
        entry.wake()
        raise
    entry.writer, entry.writer_token = None, 0
    found = overwritable(engine, entry, t, nbytes)
    if found is None:
        entry.wake()  # (the readers that waited go on: the put goes the usual way)
    return found


async def overwrite(
    engine: Engine, entry: Entry, copy: Copy, fill: Callable[[torch.Tensor, Priority], Awaitable[None]], meta: TensorMeta,
    priority: Priority,
) -> bool:
    """Fill ``copy`` (from ``overwritable``) with a put's new value and make it ``entry``'s
    value, recording the put in the store's trace (a put row with ``hit`` 1). False when the
    key was deleted while the copy ran: nothing installed, the put should go the usual way. A
    cancelled caller gets its ``CancelledError`` once the copy has ended (the value then is the
    new one)."""
    engine.use(entry, copy)
    ended = asyncio.get_running_loop().create_future()
    engine.expect_room(copy.tier, ended)  # (a request for room meanwhile waits for the copy, not refuses)
    copy.writing = True
    entry.writer, entry.writer_token = copy, 0
    started = time.perf_counter()
    filling = engine._track(fill(copy.buffer, priority))  # type: ignore[arg-type]  # (a close waits for it)
    cancelled = False
    try:
        await asyncio.shield(filling)
    except asyncio.CancelledError:
        cancelled = True
        await wait_uncancelled(filling)  # (never stopped part-way)
    except Exception:
        pass  # (raised below: the copy failed before it wrote, the old value stands)
    installed = False
    try:
        copied = not filling.cancelled() and filling.exception() is None
        if copied and engine.entries.get(entry.key) is entry and entry.copy_on(copy.tier) is copy and not copy.retired:
            engine.overwritten(entry, copy, meta, time.perf_counter() - started)
            installed = True
    finally:
        copy.writing = False
        entry.writer, entry.writer_token = None, 0
        engine.unuse(entry, copy)  # (wakes those that waited for the copy)
        ended.set_result(None)
    if cancelled or filling.cancelled():
        raise asyncio.CancelledError()
    if (error := filling.exception()) is not None:
        raise error
    return installed
