"""State shared by every simulated actor of one history: clock, randomness, API, trace, ground truth.

Why one object: determinism. There is exactly one ``random.Random`` per history and one logical clock;
every actor draws from them in a fixed order, so a seed replays exactly. The ground truth the checks
need (what was delivered for which keys) lives here too, next to the violations it produces.
"""

from __future__ import annotations

import bisect
import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.model.keys import KeyRange
from controller.model.states import Kind, Mode
from controller.sim.api import Api


class Violation(Exception):
    """An invariant failed; the history stops here."""


@dataclass
class Frontier:
    """Per (table, mode): the highest checkpoint any dispatcher reached, piecewise over the key space.

    Stored as sorted segment bounds and one value per segment, split lazily at dispatcher bounds.
    """

    bounds: list[bytes]
    values: list[int]

    @classmethod
    def of(cls, rng: KeyRange, ts: int) -> Frontier:
        return cls([rng.start, rng.end], [ts])

    def _cut(self, key: bytes) -> None:
        i = bisect.bisect_left(self.bounds, key)
        if i < len(self.bounds) and self.bounds[i] == key:
            return
        if i == 0 or i == len(self.bounds):
            return  # outside the table: nothing to cut
        self.bounds.insert(i, key)
        self.values.insert(i, self.values[i - 1])

    def _indices(self, rng: KeyRange) -> range:
        self._cut(rng.start)
        self._cut(rng.end)
        lo = bisect.bisect_left(self.bounds, rng.start)
        hi = bisect.bisect_left(self.bounds, rng.end)
        return range(lo, min(hi, len(self.values)))

    def raise_to(self, rng: KeyRange, ts: int) -> None:
        for i in self._indices(rng):
            if self.values[i] < ts:
                self.values[i] = ts

    def high(self, rng: KeyRange) -> int:
        """The highest checkpoint any dispatcher reached on some key of ``rng``."""
        return max((self.values[i] for i in self._indices(rng)), default=0)

    def low(self, rng: KeyRange | None = None) -> int:
        idx = self._indices(rng) if rng is not None else range(len(self.values))
        return min((self.values[i] for i in idx), default=0)


@dataclass
class Trace:
    """The last steps of a history, for the failure report; everything, when verbose."""

    verbose: bool = False
    keep: int = 40
    steps: deque[list[str]] = field(default_factory=lambda: deque(maxlen=40))
    digest: int = 0  # running CRC-32 fingerprint of the whole trace (for determinism tests)

    def begin(self, header: str) -> None:
        self.steps.append([header])
        self._emit(header)

    def add(self, line: str) -> None:
        if not self.steps:
            self.steps.append([])
        self.steps[-1].append(line)
        self._emit(line)

    def _emit(self, line: str) -> None:
        self.digest = zlib.crc32(line.encode(), self.digest)
        if self.verbose:
            print(line)

    def render(self) -> str:
        return "\n".join(line for step in self.steps for line in step)


@dataclass
class Ctx:
    seed: int
    rng: random.Random
    api: Api
    trace: Trace
    now: float = 0.0
    base_ts: int = 1000
    counts: dict[str, int] = field(default_factory=dict)
    frontier: dict[tuple[int, Mode], Frontier] = field(default_factory=dict)
    #: uid of the Table object each frontier belongs to (a table ID can be taken over by a duplicate).
    frontier_table: dict[tuple[int, Mode], str] = field(default_factory=dict)
    #: startTs of every Table the workload applied, by table ID (kept after the table is deleted).
    table_start: dict[int, int] = field(default_factory=dict)
    #: Spans a superseded maintainer (a zombie: it lost the Lease, its successor has started) created.
    #: Nothing fences a Span create, so such a span can overlap what the new maintainer made from
    #: its own view; the engine must then never run both (checked: single owner) and the safety net
    #: must remove the overlap before the history ends (checked: coverage at the end). The per-step
    #: overlap check skips pairs involving these spans.
    zombie_spans: set[str] = field(default_factory=set)
    #: Operators a superseded maintainer started. Admission is decided from each maintainer's own
    #: view, and nothing fences a zombie's status writes to other operators, so during a failover the
    #: zombie's admissions come on top of the new maintainer's: the bound is checked without them.
    zombie_ops: set[str] = field(default_factory=set)
    #: Spans whose placement (placement.py) a superseded maintainer recorded: left out of the bound likewise.
    zombie_placed: set[str] = field(default_factory=set)
    #: Every object a zombie created (kind, name): after a Changefeed's teardown, only these may outlive it
    #: (nothing fences a create; the garbage collector removes them, see Sim.collect_garbage).
    zombie_made: set[tuple[Kind, str]] = field(default_factory=set)
    #: Spans a zombie deleted (a Split's or Merge's origins it replaced from its stale view, a Remove's): its
    #: successor, whose Span watch may not show that yet, can admit another operator on such a span.
    zombie_deleted: set[str] = field(default_factory=set)
    #: When the Changefeed was deleted (kubectl delete), if it was; and when it vanished from the API.
    cf_deleted_at: float | None = None
    cf_gone_at: float | None = None
    #: Whether it carried the teardown finalizer when deleted. If not (deleted before the maintainer's
    #: first decisions added it), it vanished at once and only the garbage collector cleans up.
    cf_teardown: bool = False
    #: Operators whose status a superseded maintainer wrote, in any phase (it may finish one from its
    #: stale view, in which a Span watch lags the SpanOperator watch: the outcome check exempts them).
    zombie_written_ops: set[str] = field(default_factory=set)
    #: Spans whose status a superseded maintainer wrote. Its successor may judge one from a view the
    #: zombie's write has just made stale (the zombie took a lost capture's span off it as the successor,
    #: whose clock had not yet called that capture lost, finished a Move to it as AlreadyOnTarget): such a Move's
    #: intent is not judged.
    zombie_span_writes: set[str] = field(default_factory=set)
    #: Spans a person deleted by hand: an operator that owned one cannot keep its intent for it.
    user_deleted: set[str] = field(default_factory=set)
    quiet: bool = False  # the end phase: no faults, no hooks
    #: Ground truth for the fencing check: (capture name, dispatcher uid) pairs the capture's current process
    #: holds (running or paused), i.e. could deliver for again if its Lease still named it. Kept by Captures.
    holds: Callable[[str, str], bool] = field(default=lambda capture, uid: False)

    def upstream(self) -> int:
        """The upstream's logical clock: the highest ts with data; grows with simulated time."""
        return self.base_ts + int(self.now * 100)

    def bump(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def fail(self, message: str) -> None:
        raise Violation(message)
