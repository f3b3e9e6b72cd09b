"""ScheduleLearned: record one repeated phase (a training step), then prefetch along it.

Between two ``store.mark_step()`` calls the policy records the order of demand accesses, with
each key's size and tier. From the next phase on, it follows that schedule: each access moves
its position (re-synchronising within a window if a few accesses differ) and it suggests the
keys coming next, up to ``ahead`` bytes (default: a quarter of the target tier), for the tier
each was accessed on. Every phase's order
replaces the last one, so a changed order is learned one phase later; ``changes`` counts phases
whose order differed from the schedule followed.

Orders that alternate between two phases (an optimizer updating in one order, then the reverse,
so the state updated last is updated first) are learned too: when a phase resembles the one
two phases back, or the one just before reversed, more than the one just before, the schedule
followed next is the phase before it, and the one after that
this phase (``period`` is 2). A phase whose first access is where the one schedule known ends
(the first reversal) is followed reversed from there on, not learned a phase later, unless the
accesses after it say otherwise: a phase rotated to start near the end runs forward from there,
and the two are told apart by the accesses each would not have expected (``_Undecided``).

``next_use(key)`` says when a key is needed next (an access count from where the phase began,
so those asked at different times compare; ``inf`` if not in the schedule or the phase after
it), so ``MIN(schedule)`` evicts exactly what the schedule needs last. Between the first two
phases, before the second's first access, nothing is foretold (no suggestions, every next use
``inf``): the second may run either way. ``revision`` moves when
the predictions change as a whole, and ``MIN`` then asks every key's next use again.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from tierstore.units import parse_bytes

#: A reversal taken at a phase's first access is kept, or dropped for the schedule as it was,
#: once one way missed this many accesses more than the other (``ScheduleLearned._judge``)...
DECIDED_BY = 2
#: ...or after this many accesses, the way that missed fewer. An access counts as a miss
#: either way when its key is not within ``NEAR`` keys ahead (keys a little out of order, one
#: tensor's chunks finishing in another order, are not).
JUDGED_OVER = 8
NEAR = 1
#: A phase is foreseen when at least this share of its keys was in the schedule it followed.
#: After this many phases in a row that were not, nothing is foretold until one is
#: (``_predicting_off``).
FORESEEN_SHARE = 0.5
UNFORESEEN_PHASES = 2


class ScheduleLearned:
    """Prefetch along the order recorded in the previous phase."""

    name = "schedule"

    def __init__(self, ahead: int | str | None = None, max_keys: int = 64, window: int = 32, share: float = 0.25) -> None:
        self.ahead = parse_bytes(ahead) if ahead is not None else None
        self.max_keys = max_keys
        self.window = window
        self.share = share
        self._capacities: dict[str, int] = {}
        self.reset()

    def set_capacities(self, capacities: dict[str, int]) -> None:
        """Tier sizes (the store and the simulator call this): without an explicit ``ahead``,
        the policy looks ``share`` of the target tier's capacity ahead (64 MiB if unknown)."""
        self._capacities = dict(capacities)

    def _budget(self, tier: str) -> int:
        if self.ahead is not None:
            return self.ahead
        capacity = self._capacities.get(tier)
        return int(self.share * capacity) if capacity else 64 << 20

    def reset(self) -> None:
        self._recording: list[tuple[str, int, str]] = []
        self._schedule: list[tuple[str, int, str]] = []
        self._positions: dict[str, list[int]] = {}
        #: The phase expected after the one followed (the same one unless ``period`` is 2).
        self._after: list[tuple[str, int, str]] = []
        self._after_positions: dict[str, list[int]] = {}
        #: The last two phases recorded, latest first.
        self._recent: list[list[tuple[str, int, str]]] = []
        #: The key sets of the last four phases recorded, latest first (``_alternates``).
        self._recent_sets: list[frozenset[str]] = []
        self.period = 1
        self._pos = 0  # index in the schedule of the next expected access
        #: A reversal taken at a phase's first access, until the accesses after it confirm it or
        #: say the phase runs forward (``_reverse_from``); else None.
        self._undecided: _Undecided | None = None
        self._clock = 0  # demand accesses seen so far
        #: The access count at which the phase followed began, as ``next_use`` counts (each
        #: phase after it begins the schedule's length later, as does a wrap round it). Moved
        #: to where the accesses are (``_clock - _pos``) only when the predictions change as a
        #: whole (``revision``). Counted from each access instead, a key a little out of order
        #: (which leaves the position where it is while the count moves on) made every next
        #: use asked after it one later than those asked before it, and ``MIN`` compares next
        #: uses asked at different times.
        self._origin = 0
        #: The access count at which the phase followed began (its first access is the next one
        #: after it), to tell a phase gone on past its end from a key out of order (``_wraps``).
        self._began = 0
        #: The keys accessed since then: one of them again begins the schedule again.
        self._phase_seen: set[str] = set()
        self._misaligned = 0
        #: Phases in a row that the schedule they followed did not foresee (``FORESEEN_SHARE``).
        self._unforeseen_phases = 0
        #: What the caller said the phase underway will access, and will not (``expect``), and
        #: whether that changed a next use.
        self._used: frozenset[str] | None = None
        self._unused: frozenset[str] = frozenset()
        self._advised = False
        self.changes = 0
        #: Moved when the predictions change as a whole (a new order learned, a reversal taken
        #: or undone): ``MIN`` asks every key's next use anew then, not only at its next hit.
        #: (Never back: a ``MIN`` that saw it before a reset must see it move.)
        self.revision = getattr(self, "revision", -1) + 1
        self.phases = 0

    @property
    def schedule(self) -> list[str]:
        """The keys of the schedule being followed, in order."""
        return [key for key, _, _ in self._schedule]

    def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
        revision = self.revision
        self._follow_access(key, nbytes, tier)
        if self.revision != revision:
            self._origin = self._clock - self._pos

    def _follow_access(self, key: str, nbytes: int, tier: str) -> None:
        if self._unsure():
            self.revision += 1  # (the phase's first access: the way it runs is known from here)
        self._clock += 1
        self._recording.append((key, nbytes, tier))
        if not self._schedule:
            return
        if self._pos >= len(self._schedule) and self._after is not self._schedule:
            # The phase followed is done and no ``on_step`` came: the next one is ``_after``
            # (alternating: then the one just followed again).
            self._origin += len(self._schedule)
            self._phase_began(self._clock - 1)
            self._schedule, self._after = self._after, self._schedule
            self._positions, self._after_positions = self._after_positions, self._positions
            self._pos = 0
        if self._undecided is not None:
            self._judge(key)
            self._phase_seen.add(key)
            return
        # (the reversal first: a schedule no longer than ``window`` finds any key ahead, wrapping)
        if self._pos == 0 and self.period == 1 and self._reverse_from(key):
            self._phase_seen.add(key)
            return
        followed = self._follow(key)
        self._phase_seen.add(key)
        if followed:
            return
        self._misaligned += 1  # not in the schedule nearby: stay put

    def _judge(self, key: str) -> None:
        """After a reversal taken at a phase's first access: follow ``key`` both ways (the
        schedule reversed, and as it was), and keep the reversal or go back to the schedule as
        it was once one way missed ``DECIDED_BY`` accesses more than the other, or after
        ``JUDGED_OVER`` accesses, the one that missed fewer (the reversal on a tie). Keys a
        little out of order (a tensor's chunks finishing in another order) miss once or so
        either way; a phase run the other way misses at almost every access."""
        undecided = self._undecided
        assert undecided is not None
        located = self._locate(self._schedule, self._pos, key)
        if located is None or not located[1]:
            undecided.reversed_misses += 1
        if located is not None:
            self._pos = located[0]
        located = self._locate(undecided.forward[0], undecided.pos, key)
        if located is None or not located[1]:
            undecided.forward_misses += 1
        if located is not None:
            undecided.pos = located[0]
        undecided.seen += 1
        lead = undecided.forward_misses - undecided.reversed_misses
        if abs(lead) < DECIDED_BY and undecided.seen < JUDGED_OVER:
            return
        self._undecided = None
        if lead >= 0:
            self._misaligned += 1 + undecided.reversed_misses  # (the reversal: a change of order)
            return
        self._schedule, self._after, self._positions, self._after_positions, self.period = undecided.forward
        self._pos = undecided.pos
        self.revision += 1
        self._misaligned += 1 + undecided.forward_misses  # (the first access was not where expected)

    def _follow(self, key: str) -> bool:
        """Move the position past ``key`` if it is within ``window`` ahead in the schedule (or
        leave it, ``key`` just behind it)."""
        # ``_pos`` runs up to ``length`` (the phase done: what comes next is ``_after``), and
        # only wraps round when a phase goes on past its end (no ``on_step`` between phases).
        located = self._locate(self._schedule, self._pos, key)
        if located is None:
            return False
        if located[0] < self._pos:  # (found by wrapping round)
            if not self._wraps(key, located[0] - 1):  # a key from earlier in the phase, late: stay put
                self._misaligned += 1
                return True
            self._origin += len(self._schedule)  # (the same keys one phase on)
            self._phase_began(self._clock - located[0])
        self._pos, near = located
        if not near:
            self._misaligned += 1
        return True

    def _phase_began(self, clock: int) -> None:
        """A phase is followed from the access count ``clock`` on (its first access the next)."""
        self._began = clock
        self._phase_seen = set()

    def _wraps(self, key: str, index: int) -> bool:
        """Whether ``key``, found behind the position by wrapping round (at ``index`` of the
        schedule), begins the schedule again: a key this phase has accessed already, found at
        the schedule's start (the next phase has begun, however many of the last keys this one
        skipped; found further on, it is a key the phase accesses twice), or the position at the
        schedule's end, or more accesses since the phase began than the schedule has. Otherwise
        it is a key of this phase come late (a tensor entered after those behind it: its hold
        waited), and taken for the next phase begun it moved every next use asked after it one
        phase later: ``MIN`` then evicted what was needed soonest."""
        length = len(self._schedule)
        return (key in self._phase_seen and index <= NEAR) or self._pos >= length or self._clock - self._began > length

    def _locate(self, schedule: list[tuple[str, int, str]], pos: int, key: str) -> tuple[int, bool] | None:
        """Where following ``schedule`` from ``pos`` goes on ``key``, and whether ``key`` was
        where expected (at most ``NEAR`` keys ahead); None if it is not nearby. A key one or two
        behind (a little out of order: two neighbours swapped) leaves the position where it is:
        in a schedule no longer than ``window`` it is found ahead too, wrapping round, and
        going there went back to a key just used."""
        found = self._ahead(schedule, pos, key)
        if found is not None and found[1] <= NEAR:
            return found[0] + 1, True
        if any(0 <= pos - back < len(schedule) and schedule[pos - back][0] == key for back in (1, 2)):
            return pos, False
        return None if found is None else (found[0] + 1, False)

    def _ahead(self, schedule: list[tuple[str, int, str]], start: int, key: str) -> tuple[int, int] | None:
        """``(index, offset)`` of ``key`` within ``window`` accesses of ``schedule`` from
        ``start`` on (wrapping round), or None."""
        length = len(schedule)
        for offset in range(min(self.window, length)):
            index = (start + offset) % length
            if schedule[index][0] == key:
                return index, offset
        return None

    def _reverse_from(self, key: str) -> bool:
        """At a phase's first access, not where the one schedule known starts: if it is where
        that schedule ends, follow the schedule reversed from here and expect it as it was next
        (an order reversed each phase, seen once: known at the phase's first access, not a
        phase later); not if it is as near where the schedule starts. Undecided until the
        accesses after it tell (``_judge``)."""
        length = len(self._schedule)
        for offset in range(min(self.window, length)):
            if self._schedule[length - 1 - offset][0] == key:
                if self._positions[key][0] <= offset:  # (nearer where the schedule starts)
                    return False
                forward = self._schedule
                self._undecided = _Undecided((forward, self._after, self._positions, self._after_positions, self.period), length - offset)
                self._schedule, self._after = forward[::-1], forward
                self._positions, self._after_positions = _positions(self._schedule), self._positions
                self.period = 2
                self._pos = offset + 1
                self.revision += 1
                return True
        return False

    def expect(self, used: Iterable[str], unused: Iterable[str] = ()) -> None:
        """What the phase beginning now will access, where the caller knows it (an optimizer
        knows which states its step updates: those of the parameters with a gradient): the
        keys of ``used`` it will, those of ``unused`` it will not; of other keys nothing is
        said. Until the phase ends (``on_step``; a second ``expect`` replaces the first), a key
        of ``unused`` is not suggested for it, and where the schedule followed expected it in
        the phase, its next use is ``inf`` (``MIN`` evicts it first; a use the schedule
        foretold only in a later phase, where the phases alternate, stands); a key of ``used``
        the phase has not accessed yet is foretold a use in it: where the schedule has it, else
        at the phase's end (before any use in the next), also where nothing else is foretold
        (the keys of the phases change: ``_predicting_off``). A part of the parameters with a
        gradient each step (the experts of a mixture beside its trunk) is then told apart from
        the rest."""
        self._used, self._unused = frozenset(used), frozenset(unused)
        same = not self._unused and not self._unsure() and not self._predicting_off() and self._used <= self._positions.keys()
        if not same or self._advised:
            # (``MIN`` asks every next use anew; not where it would get the answers it has)
            self.revision += 1
        self._advised = not same

    def on_step(self) -> None:
        self._used, self._unused = None, frozenset()
        if self._advised:  # (the next uses ``MIN`` has were the advice's: asked anew)
            self.revision += 1
            self._advised = False
        if not self._recording:
            return
        recorded = [key for key, _, _ in self._recording]
        if self._schedule and (recorded != self.schedule or self._misaligned or self._undecided is not None):
            self.changes += 1
        # (a new order, not a few keys out of order: those are not worth asking every next use
        # again, with thousands of keys)
        revised = len(recorded) != len(self._schedule) or self._misaligned * 8 > len(recorded)
        period = self.period
        followed = len(self._schedule)
        recording, self._recording = self._recording, []
        recent = self._recent
        # Alternating: this phase is nearer the one two back, or the one before it reversed (an
        # order reversed each phase), than the one before it.
        keys = frozenset(recorded)
        was_off = self._predicting_off()
        if self._schedule:
            expected = self._positions
            foreseen = sum(key in expected for key in keys)
            self._unforeseen_phases = 0 if foreseen >= FORESEEN_SHARE * len(keys) else self._unforeseen_phases + 1
        sets = [keys, *self._recent_sets[:3]]
        self._recent_sets = sets
        if recent:
            # (the keys a phase lacks count only where the key sets alternate over two periods:
            # a step that gains a few keys now and then is not an alternation)
            differ = _differences if _alternates(sets) else _misses
            same = differ(recent[0], recording, self.window)
            two_back = len(recent) == 2 and differ(recent[1], recording, self.window) < same
            # (a reversal after two equal phases is a change of order, not an alternation yet)
            changing = len(recent) == 1 or _misses(recent[1], recent[0], self.window) > 0
            reversed_ = changing and differ(recent[0][::-1], recording, self.window) < same
            self.period = 2 if two_back or reversed_ else 1
        self._schedule = recent[0] if self.period == 2 else recording
        self._after = recording
        self._recent = [recording, *recent[:1]]
        self._positions = _positions(self._schedule)
        self._after_positions = self._positions if self._after is self._schedule else _positions(self._after)
        self._pos = 0
        if revised or self.period != period or was_off != self._predicting_off():
            self.revision += 1
            self._origin = self._clock
        else:
            self._origin += followed
        self._phase_began(self._clock)
        self._misaligned = 0
        self._undecided = None
        self.phases += 1

    def _predicting_off(self) -> bool:
        """The last ``UNFORESEEN_PHASES`` phases each had keys the schedule they followed
        mostly did not (a random part of the keys each step: the experts of a mixture, an
        embedding's rows): nothing is foretold (no suggestions; every next use ``inf``, so
        ``MIN`` evicts the least recently used), as prefetches of keys the phase then does not
        read, and victims ranked by a wrong next use, would move more than the phase needs.
        Judged at each phase's end; a phase foreseen turns it back on."""
        return self._unforeseen_phases >= UNFORESEEN_PHASES

    def _unsure(self) -> bool:
        """One phase known and the next not begun: it may run the same way or the other (an
        optimizer's steps alternate), so nothing is foretold until its first access."""
        return not self._recording and self.period == 1 and len(self._recent) < 2 and bool(self._schedule)

    def suggest(self) -> Iterable[tuple[str, str | None]]:
        if not self._schedule or self._unsure() or self._predicting_off():
            return []
        length = len(self._schedule)
        budget = self._budget((self._schedule[self._pos] if self._pos < length else self._after[0])[2])
        seen: set[str] = set()
        out: list[tuple[str, str | None]] = []
        # the rest of this phase, then the next one's start (as much as a whole phase)
        rest = (self._schedule[i] for i in range(self._pos, length))
        coming = itertools.islice(itertools.chain(rest, self._after), length)
        for key, nbytes, tier in coming:
            # (a key said unused is not read ahead while the phase runs, not even for the next
            # phase's start: a guess for the next step's part of the parameters that, read now,
            # took room the phase needed; a mixture's step moved 1.19x its need emulated, 1.08x
            # without. The next phase's start is suggested once the phase ends.)
            if key in seen or key in self._unused:
                continue
            if nbytes > budget or len(out) >= self.max_keys:
                break
            seen.add(key)
            budget -= nbytes
            out.append((key, tier))
        return out

    def next_use(self, key: str) -> float:
        if self._used is not None and (key in self._unused or key in self._used and key not in self._phase_seen):
            return self._expected_use(key)
        return self._foretold(key)

    def _expected_use(self, key: str) -> float:
        """The next use of a key the caller said the phase will access, or will not (``expect``)."""
        end = self._origin + len(self._schedule)
        foretold = self._foretold(key)
        if key in self._unused:  # (one the schedule followed lacks is foretold as before: the phases alternate)
            return math.inf if key in self._positions else foretold
        return foretold if foretold < end else end - 0.5

    def _foretold(self, key: str) -> float:
        """The next use the schedule foretells (``next_use`` without ``expect``)."""
        if self._unsure() or self._predicting_off():
            return math.inf  # (``MIN`` then evicts the least recently used first)
        positions = self._positions.get(key)
        after = self._after_positions.get(key)
        if not positions and not after:
            return math.inf
        length = len(self._schedule)
        i = bisect.bisect_left(positions, self._pos) if positions else 0
        if positions and i < len(positions):
            at = positions[i]
        elif after:
            at = length + after[0]
        else:  # in this phase only, behind: two phases on
            at = length + len(self._after) + positions[0]  # type: ignore[index]
        return self._origin + at


@dataclass
class _Undecided:
    """A reversal taken at a phase's first access, not yet confirmed: the schedule as it was
    (with what came after it, the positions and the period), the position following it, and how
    many accesses since missed each way."""

    forward: tuple[list[tuple[str, int, str]], list[tuple[str, int, str]], dict[str, list[int]], dict[str, list[int]], int]
    pos: int
    forward_misses: int = 0
    reversed_misses: int = 0
    seen: int = 0


def _positions(schedule: list[tuple[str, int, str]]) -> dict[str, list[int]]:
    positions: dict[str, list[int]] = {}
    for index, (key, _, _) in enumerate(schedule):
        positions.setdefault(key, []).append(index)
    return positions


def _alternates(sets: list[frozenset[str]]) -> bool:
    """Whether the key sets of the last four phases (latest first) alternate: this phase's
    the one two back's, the one before it the one three back's, and the two unlike."""
    return len(sets) == 4 and sets[0] == sets[2] and sets[1] == sets[3] and sets[0] != sets[1]


def _differences(predicted: list[tuple[str, int, str]], actual: list[tuple[str, int, str]], window: int) -> int:
    """How far ``actual`` is from ``predicted``: its accesses ``predicted`` would not find where
    it expects them (``_misses``), and the keys ``predicted`` has that ``actual`` never accessed.
    Misses alone called a phase of a few keys the same as a longer one that has them all (an
    embedding updated every other step beside an MLP: the MLP's steps were taken for repeats
    of the one before, the period stayed 1, and the embedding's chunks, missing from the
    schedule followed, had no next use: ``MIN`` took them in any order, and its steps read and
    wrote all of its state, 2.5x their need with 70% of it on the host)."""
    extra = {key for key, _, _ in predicted}.difference(key for key, _, _ in actual)
    return _misses(predicted, actual, window) + len(extra)


def _misses(predicted: list[tuple[str, int, str]], actual: list[tuple[str, int, str]], window: int) -> int:
    """How many of ``actual``'s accesses following ``predicted`` would not find where it expects
    them (within ``window`` ahead), as ``on_access`` follows a schedule."""
    length = len(predicted)
    if not length:
        return len(actual)
    pos = misses = 0
    for key, _, _ in actual:
        for offset in range(min(window, length)):
            if predicted[(pos + offset) % length][0] == key:
                pos = (pos + offset + 1) % length
                misses += offset > 0
                break
        else:
            misses += 1
    return misses
