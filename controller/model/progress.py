"""Progress reports: how far a capture's dispatchers got, in one small record per capture.

Why not a status write per dispatcher: at rest the only thing that changes is every Working dispatcher's
checkpoint, every report interval. Written per dispatcher that is one API write per span per interval
(measured: 297 of 303 writes/s at 2,000 spans), which no API server keeps up with at 10,000 spans. TiCDC
keeps these heartbeats off its store; here a capture folds them into one report per (changefeed, mode)
and sends it with the renewal of its Lease, which it writes every renew interval anyway. Per-dispatcher
status is written only when the state changes (Initializing, Working, Stopped or Rejected with the final
checkpoint), which is what the operators need to hand a span over.

What a report says, per (changefeed, mode): "the ``dispatchers`` dispatchers whose uids hash to
``digest`` have each delivered everything up to ``checkpoint_ts``" (the lowest of their checkpoints,
held by ``slowest``). That is a statement about delivered data, so it stays true after the process that
made it dies: a checkpoint, once reached, is never un-reached. The maintainer may therefore use it as a
lower bound for exactly those dispatchers, and only for them. It knows which dispatchers it believes the
capture runs for that changefeed and mode (those it sees Working there); it recomputes the digest over
their uids, and uses the report only if both agree. Otherwise it falls back to what each dispatcher's
status persisted (an older, still safe bound) and the checkpoint waits: it stalls during churn, it
never passes what a span delivered.

Uids, not names: a name can come back on a re-created object, which starts again from its own start ts.
The incarnation (random per capture process) names the process that made a report; a restarted capture
runs none of its predecessor's dispatchers and reports only its own (see docs/architecture.md, "Progress
reports", for why a report of a previous incarnation is never unsafe in this design).

This module is pure: the capture agent and the simulator build reports with :func:`build`, the
maintainer checks them with :func:`digest`; ``controller.model.resources`` (de)serializes them.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from controller.model.ordering import in_order
from controller.model.states import GROUP, Mode
from controller.model.tso import physical_seconds

#: The annotation of a capture's Lease that carries its report (JSON, see ``resources.progress_to_json``).
PROGRESS_ANNOTATION = f"{GROUP}/progress"

#: How much of a trouble's message a report carries (its start: it rides on every Lease renewal).
TROUBLE_LIMIT = 300

class Side(enum.StrEnum):
    """The two sides of a changefeed's data path a :class:`Trouble` names."""

    SOURCE = "source"
    SINK = "sink"


SOURCE, SINK = Side.SOURCE, Side.SINK
SIDES = (SOURCE, SINK)

#: Traffic (write rate, region count) is written to a dispatcher's status only when it changes by at
#: least this fraction (or from or to zero): the split and merge schedulers judge within this much.
TRAFFIC_CHANGE = 0.1

#: Deliberate bugs for the simulator's mutation check (see controller.engine.world.MUTANTS).
MUTANT_WRONG_SET = "progress-min-over-wrong-set"  # the minimum skips dispatchers still at their start ts
MUTANT_PREVIOUS_INCARNATION = "progress-keeps-previous-incarnation"  # never below the previous process's report
MUTANTS = frozenset({MUTANT_WRONG_SET, MUTANT_PREVIOUS_INCARNATION})


@dataclass(frozen=True, kw_only=True)
class ProgressEntry:
    """One (changefeed, mode) of a capture's report."""

    changefeed: str
    mode: Mode
    #: The lowest checkpoint over the covered dispatchers: each has delivered at least this far.
    checkpoint_ts: int
    #: How many dispatchers it covers, and a digest of exactly which (their uids).
    dispatchers: int
    digest: str
    #: The dispatcher holding the minimum (for people: metrics and the kubectl plugin).
    slowest: str = ""
    #: For a changefeed counted in source revisions (not TSOs): the wall time (Unix seconds) that
    #: ``checkpoint_ts`` stands for, i.e. until when the source had nothing newer than it, as this capture saw
    #: the source's head (the report's own time when caught up). None for a TSO, whose physical part is its
    #: time. The checkpoint's lag in seconds is ``now - checkpoint_time``.
    checkpoint_time: float | None = None


@dataclass(frozen=True, kw_only=True)
class Trouble:
    """What keeps a changefeed's data from flowing on this capture, on one side (:data:`SOURCE` or :data:`SINK`):
    a Secret missing or malformed, a server refusing connections, an authentication or TLS failure, a statement
    the sink refuses. Reported per changefeed, not per dispatcher: a dispatcher whose first scan never committed,
    or one that could not start at all, has no progress entry, but its changefeed's trouble is reported all the
    same. The maintainer's conditions SourceUnavailable and SinkUnavailable."""

    changefeed: str
    side: Side
    #: True: retried, and expected to pass by itself (the server down or restarting, a connection refused or
    #: reset). False: retrying cannot help until a person changes something (a Secret, a password, a
    #: certificate, the sink's grants or tables).
    transient: bool
    #: What and where, never a credential. At most :data:`TROUBLE_LIMIT` characters.
    message: str


@dataclass(frozen=True, kw_only=True)
class SinkFigures:
    """A changefeed's sink as this capture last saw it, over the tables it holds spans of (a table whose spans are
    on several captures is counted by each): tombstones it collected in total (this process), tombstones held and
    live rows after its last collection. The maintainer's metrics ``sink_tombstones*`` and ``sink_live_rows``."""

    changefeed: str
    collected: int
    tombstones: int
    live_rows: int


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A capture's report: its process incarnation, when it was made, its entries, its troubles, and its sinks'
    figures."""

    incarnation: str
    at: float
    entries: tuple[ProgressEntry, ...] = ()
    troubles: tuple[Trouble, ...] = ()
    sinks: tuple[SinkFigures, ...] = ()

    def entry(self, changefeed: str, mode: Mode) -> ProgressEntry | None:
        for e in self.entries:
            if e.changefeed == changefeed and e.mode is mode:
                return e
        return None


@dataclass(frozen=True, slots=True)
class Running:
    """A dispatcher a capture counts in its report: Working, and reported Working to the API."""

    uid: str
    name: str
    changefeed: str
    mode: Mode
    start_ts: int
    checkpoint_ts: int


#: What a set digest (``digest``) begins with; a report's digest without it is a legacy one (``legacy_digest``).
SET_DIGEST = "+"
_MASK = (1 << 64) - 1


def uid_hash(uid: str) -> int:
    """A uid's 64-bit BLAKE2b, as a number (what ``digest`` sums)."""
    return int.from_bytes(hashlib.blake2b(uid.encode(), digest_size=8).digest(), "big")


def sum_digest(total: int) -> str:
    """The digest of a set whose members' ``uid_hash``es sum to ``total``."""
    return f"{SET_DIGEST}{total & _MASK:016x}"


def digest(uids: Iterable[str]) -> str:
    """A short, order-independent digest of a set of uids: the sum, modulo 2^64, of each uid's 64-bit BLAKE2b. A sum
    can be kept current as members come and go, one addition each (engine/digests.py), so a dispatcher starting or
    stopping costs O(1) rather than a hash over every Working dispatcher of its capture (at 100,000 spans, hashing
    them all in the event loop took up to 140 ms while spans were placed)."""
    return sum_digest(sum(uid_hash(u) for u in uids))


def legacy_digest(uids: Iterable[str]) -> str:
    """The legacy digest, which captures of an older version send (64 bits of BLAKE2b over the sorted uids): still
    judged, so that a rolling upgrade keeps using their reports."""
    h = hashlib.blake2b(digest_size=8)
    for uid in in_order(uids, key=None):
        h.update(uid.encode())
        h.update(b"\n")
    return h.hexdigest()


def digest_matches(reported: str, uids: Iterable[str]) -> bool:
    """Whether a report's ``reported`` digest (a set digest, or a legacy one) is the digest of ``uids``."""
    if reported.startswith(SET_DIGEST):
        return reported == digest(uids)
    return reported == legacy_digest(uids)


def build(
    running: Iterable[Running],
    incarnation: str,
    at: float,
    *,
    previous: Progress | None = None,
    mutants: frozenset[str] = frozenset(),
) -> Progress:
    """The report over ``running``: per (changefeed, mode), the minimum, the count and the digest.

    ``previous`` (the report this capture's Lease carried when the process started) and ``mutants`` are
    for the simulator's mutation check only: a correct capture reports only what it runs itself.
    """
    groups: defaultdict[tuple[str, Mode], list[Running]] = defaultdict(list)
    for r in running:
        groups[(r.changefeed, r.mode)].append(r)
    entries = []
    for (cf, mode), rs in sorted(groups.items()):
        counted = rs
        if MUTANT_WRONG_SET in mutants:
            counted = [r for r in rs if r.checkpoint_ts > r.start_ts] or rs
        slowest = min(counted, key=lambda r: (r.checkpoint_ts, r.name))
        low = slowest.checkpoint_ts
        if MUTANT_PREVIOUS_INCARNATION in mutants and previous is not None and previous.incarnation != incarnation:
            before = previous.entry(cf, mode)
            if before is not None:
                low = max(low, before.checkpoint_ts)
        entries.append(
            ProgressEntry(
                changefeed=cf,
                mode=mode,
                checkpoint_ts=low,
                dispatchers=len(rs),
                digest=digest(r.uid for r in rs),
                slowest=slowest.name,
            )
        )
    return Progress(incarnation=incarnation, at=at, entries=tuple(entries))


class HeadCurve:
    """When the source's head passed each revision, as far as the captures' reports tell: the pairs
    (``checkpoint_ts`` c, ``checkpoint_time`` t) of their entries, each saying "by t the source held every change
    up to c" (the head had just passed c, or stood at it). So a revision C <= c stood for a time at or before t,
    and the time of a changefeed's checkpoint C is at most the least t over the pairs with c >= C: what
    :meth:`time_of` gives (a lag never over-stated by the curve; as fine as the reports are frequent).

    Kept as the pairs no other pair makes useless (c and t both increasing), ``limit`` of them at most (every
    other one of the older half dropped past it: coarser, still never over-stated), and those below a
    checkpoint that has passed them dropped (:meth:`forget_below`)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.points: list[tuple[int, float]] = []

    def see(self, revision: int, at: float) -> None:
        points = self.points
        i = bisect.bisect_left(points, (revision, -math.inf))
        if i < len(points) and points[i][1] <= at:
            return  # a pair at or above this revision is already as early
        end = i + 1 if i < len(points) and points[i][0] == revision else i
        start = i
        while start > 0 and points[start - 1][1] >= at:
            start -= 1  # lower revisions said no earlier than this one: useless now
        points[start:end] = [(revision, at)]
        if len(points) > self.limit:
            half = len(points) // 2
            points[:half] = points[1:half:2]

    def see_entries(self, entries: Iterable[ProgressEntry]) -> None:
        for e in entries:
            if e.dispatchers and e.checkpoint_time is not None:
                self.see(e.checkpoint_ts, e.checkpoint_time)

    def time_of(self, checkpoint: int) -> float | None:
        """The wall time ``checkpoint`` stands for, at most; None if no report reached it."""
        i = bisect.bisect_left(self.points, (checkpoint, -math.inf))
        return self.points[i][1] if i < len(self.points) else None

    def forget_below(self, checkpoint: int) -> None:
        """Drop what a checkpoint that only grows no longer needs (the pairs below it)."""
        i = bisect.bisect_left(self.points, (checkpoint, -math.inf))
        del self.points[:i]


def source_checkpoint_time(checkpoint: int, entries: Iterable[ProgressEntry]) -> float | None:
    """The wall time a changefeed's ``checkpoint`` stands for, from its captures' current entries alone (see
    :class:`HeadCurve`); None when none carries a time at or above it (a TSO changefeed, or no report yet)."""
    curve = HeadCurve()
    curve.see_entries(entries)
    return curve.time_of(checkpoint)


def entry_lag(entry: ProgressEntry, now: float) -> float | None:
    """Seconds an entry's checkpoint is behind ``now``: from the wall time it carries (a source's revision),
    else from its TSO's physical part; None for a TSO of 0 (unknown)."""
    if entry.checkpoint_time is not None:
        return max(0.0, now - entry.checkpoint_time)
    return checkpoint_lag(entry.checkpoint_ts, now)


def checkpoint_lag(ts: int, now: float) -> float | None:
    """Seconds between ``now`` and the physical time of a TiDB TSO (physical ms << 18); None for 0 (unknown)."""
    return None if ts <= 0 else max(0.0, now - physical_seconds(ts))


def traffic_changed(written: tuple[float, int], now: tuple[float, int]) -> bool:
    """Whether a dispatcher's traffic (write rate, region count) moved enough to be written again."""
    return any(_changed(float(a), float(b)) for a, b in zip(written, now, strict=True))


def _changed(old: float, new: float) -> bool:
    if old == new:
        return False
    if old == 0.0 or new == 0.0:
        return True
    return abs(new - old) >= TRAFFIC_CHANGE * max(abs(old), abs(new))
