"""The engine's input: a snapshot of one changefeed's world, and the per-tick view built over it.

``World`` is what the caller gathers (from informer caches in production, from the simulated API in
the simulator): plain records, and optionally the ``Index`` the caller keeps over them per event
(``controller.engine.index``). ``Tick`` is the engine's scratch space for one decision: lookups over the
snapshot, an overlay of the records this decision has already changed (so that later phases see
earlier phases' effects), and the chains it has decided on.

A decision is *incremental* when the world comes with an index (``Tick.index`` set): each phase then
visits the index's candidates for its rule (plus whatever this decision changed) instead of every
record, and the aggregates (load, counts, checkpoint) come from the index adjusted by the overlay. A
*full* decision (no index: tests, the periodic audit, the simulator's agreement check) visits every
record, as the rules are written. Both must decide exactly the same; the simulator checks it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Generic, TypeVar

from controller.engine import coverage
from controller.engine.intents import Chain, Create, Delete, Event, FenceCapture, RemoveFinalizer, WriteStatus
from controller.model import progress
from controller.model.keys import KeyRange
from controller.model.ordering import in_order
from controller.model.records import Capture, Changefeed, Dispatcher, Join, Record, Span, SpanOperator, Table
from controller.model.states import DISPATCHER_FINALIZER, Kind, Mode, OpPhase, SpanState

if TYPE_CHECKING:
    from controller.engine.index import Index

V = TypeVar("V")


def is_placement(span: Span | None) -> bool:
    """``span`` is being placed without an operator: its status (or its create) records the destination
    (placement.py)."""
    return span is not None and span.state is SpanState.SCHEDULING and not span.operator and bool(span.capture)


def _load_of_span(span: Span | None) -> str:
    """The capture a span counts towards in ``Tick.load`` ("" for none)."""
    if span is None or not span.capture:
        return ""
    return span.capture if span.state is SpanState.REPLICATING or is_placement(span) else ""


def _load_of_operator(op: SpanOperator | None) -> list[str]:
    if op is None or not op.in_flight:
        return []
    return [t.capture for t in op.targets if t.capture and not t.done]


@dataclass(frozen=True)
class World:
    """Everything the maintainer knows about one changefeed at one instant."""

    now: float
    changefeed: Changefeed
    tables: Mapping[str, Table] = field(default_factory=dict)
    spans: Mapping[str, Span] = field(default_factory=dict)
    dispatchers: Mapping[str, Dispatcher] = field(default_factory=dict)
    operators: Mapping[str, SpanOperator] = field(default_factory=dict)
    captures: Mapping[str, Capture] = field(default_factory=dict)
    #: The caller's index over exactly these records (``tables`` .. ``operators`` are its own maps then);
    #: None: decide over everything (a full decision).
    index: Index | None = field(default=None, compare=False)
    #: The kinds whose view is in doubt: their watch broke and they have not been listed since, so they may still
    #: hold what is gone and lack what is new. Nothing is decided on such a view (``engine.maintainer.decide``).
    stale: frozenset[Kind] = frozenset()


class Overlay(Mapping[str, V], Generic[V]):
    """A mapping over ``base`` (never changed) with this decision's changes on top; O(1) to make.

    ``changed`` holds every name set or deleted here. Iterating visits the whole base: only a full
    decision does that."""

    __slots__ = ("base", "changed")

    def __init__(self, base: Mapping[str, V]) -> None:
        self.base = base
        self.changed: dict[str, V | None] = {}

    def __getitem__(self, name: str) -> V:
        if name in self.changed:
            value = self.changed[name]
            if value is None:
                raise KeyError(name)
            return value
        return self.base[name]

    def get(self, name: str, default: V | None = None) -> V | None:  # type: ignore[override]
        if name in self.changed:
            value = self.changed[name]
            return default if value is None else value
        return self.base.get(name, default)

    def __contains__(self, name: object) -> bool:
        if name in self.changed:
            return self.changed[name] is not None  # type: ignore[index]
        return name in self.base

    def __iter__(self) -> Iterator[str]:
        for name in self.base:
            if name not in self.changed or self.changed[name] is not None:
                yield name
        for name, value in self.changed.items():
            if value is not None and name not in self.base:
                yield name

    def __len__(self) -> int:
        # O(changes), not a pass over the base: ``list(overlay.values())`` asks it first (a length hint).
        base, changed = self.base, self.changed
        added = sum(1 for name, value in changed.items() if value is not None and name not in base)
        gone = sum(1 for name, value in changed.items() if value is None and name in base)
        return len(base) + added - gone

    def values(self) -> ValuesView[V]:
        """The values in ``__iter__``'s order, read from the base's items (a full decision's passes made a
        lookup per name through ``__getitem__``: 16 passes of 100,000 a full decision, a quarter of its time)."""
        return _OverlayValues(self)

    def __setitem__(self, name: str, value: V) -> None:
        self.changed[name] = value

    def pop(self, name: str, default: V | None = None) -> V | None:
        value = self.get(name, default)
        if name in self:
            self.changed[name] = None
        return value


class _OverlayValues(ValuesView[V], Generic[V]):
    """``Overlay.values()``: as ``ValuesView`` (changes made while iterating show as they would through
    ``__getitem__``), without a method call per name."""

    _mapping: Overlay[V]

    def __iter__(self) -> Iterator[V]:
        overlay = self._mapping
        base, changed = overlay.base, overlay.changed
        for name, value in base.items():
            if name in changed:
                over = changed[name]  # the overlay's, over the base's
                if over is not None:
                    yield over
            else:
                yield value
        for name, added in changed.items():
            if added is not None and name not in base:
                yield added


#: Switches for the simulator's mutation check: each names a deliberate bug. Production passes none.
MUTANTS = frozenset(
    {
        "restore-forgets-move-destination",  # a restored Move in AddDest re-plans its destination
        "split-skips-children",  # Split finishes without creating the children once the origin stopped
        "move-adds-before-origin-stopped",  # Move creates the destination while the origin still runs
        "bootstrap-skips-orphan-dispatchers",  # the safety net keeps dispatchers that have no span
        "remove-forgets-finalizer-of-lost-capture",  # dispatchers of a lost capture are never released
        "teardown-releases-early",  # a deleted Changefeed's finalizer goes while dispatchers still run
        "tables-never-detached",  # a deleted Changefeed's Tables keep the finalizer (teardown and janitor)
        "detached-table-keeps-counts",  # a detached Table's status still counts spans that no longer exist
        "refusals-not-reported",  # a create the API refuses is retried silently (no condition, no Event)
        "failures-not-reported",  # a dispatcher its runtime stopped for good holds the checkpoint silently
        "sink-errors-not-reported",  # a sink that refuses the captures' transactions holds the checkpoint silently
        "source-errors-not-reported",  # a source the captures cannot read holds the checkpoint silently
        "pause-keeps-scheduling",  # a changefeed whose replication is paused is still scheduled (spans moved, placed)
        "pause-not-reported",  # spec.paused is not said on the Changefeed (no Paused condition)
        "capture-exits-before-drained",  # a capture told to stop exits before its spans are moved off
        "taker-decides-before-listed",  # a replica taking a changefeed over decides before its Dispatchers are listed
        "reshape-fails-when-every-target-lost",  # Split/Merge Failed once its new spans exist (the cluster bug)
        "reshape-without-capture-skips-new-spans",  # no capture at CreateSpans: Succeeded, new spans never made
        "placement-waits-for-a-lost-capture",  # a placement whose destination is lost waits forever
        "placement-starts-ahead",  # a placement's dispatcher starts above the span's checkpoint (a gap)
        "placement-created-unrecorded",  # a span is created placed, but without the placement annotation
        "incremental-skips-suspect-spans",  # an incremental decision misses Replicating spans whose dispatcher died
        "incremental-skips-lost-captures",  # an incremental decision misses what is on a capture that was lost
        "incremental-ignores-progress-reports",  # an incremental checkpoint uses no capture's progress report
        "release-before-fence",  # finalizers of a lapsed capture released without taking its Lease first
        "release-under-an-old-take",  # released from a view showing the Lease taken, which may predate the dispatcher
        # Not the engine's: the simulator's capture model and the maintainer's liveness clock.
        "capture-resumes-after-takeover",  # a paused capture resumes though its Lease was taken meanwhile
        "capture-trusts-create-epoch",  # a dispatcher never reported Initializing goes Working unchecked
        "capture-resume-check-trusts-an-old-renewal",  # resumes on a slow check though no renewal vouches now
        "outage-counts-as-silence",  # the maintainer counts time its view of Leases was broken as silence
        "progress-used-beyond-coverage",  # a capture's minimum used for Working dispatchers it did not cover
        "quiet-chains-everywhere",  # every chain's landing is declared to need no decision of its own
        "decides-on-stale-view",  # a decision is made on a view in doubt (a kind's watch broke, not listed since)
        "creates-from-an-unconfirmed-record",  # a dispatcher made from a recorded target a zombie has rewritten since
        "gives-up-a-span-unseen",  # an operator's new span absent from the view is taken as deleted by hand, unread
        "fills-a-hole-an-unseen-operator-plans",  # a hole fill where a running Split/Merge's spans are all unseen
        "spans-before-the-join",  # a new table's first spans created without its join recorded on the Changefeed
        *progress.MUTANTS,  # the capture's report: minimum over the wrong set; kept from a previous process
    }
)
#: Mutants whose race the sweep's histories do not reach (searches of tens of thousands of histories with each found
#: none it fails), each killed instead by a test of the engine that drives the race directly; ``python -m
#: controller.sim --mutants`` skips them and says so. The tests:
#: ``release-under-an-old-take`` (a Lease watch lagging the Dispatcher watch across a zombie's take and the capture's
#: re-acquiring): tests/engine/test_fencing.py::test_the_old_rule_releases_from_a_view_older_than_the_dispatcher
#: (the mutant releases the finalizer that test_a_release_from_a_view_older_than_the_dispatcher_does_not_land shows
#: the rule keeping).
#: ``decides-on-stale-view``: tests/engine/test_repair.py::test_a_finished_split_is_not_undone_by_a_repair_on_a_
#: span_view_still_showing_its_parent (the mutant removes the children on the view in doubt).
#: ``creates-from-an-unconfirmed-record``: tests/engine/test_bootstrap.py::test_the_mutant_creates_from_a_record_
#: without_reading_it_again.
#: ``fills-a-hole-an-unseen-operator-plans``: tests/engine/test_split.py::test_each_half_of_the_unseen_children_fix_
#: is_needed.
#: ``spans-before-the-join``: tests/engine/test_joining.py::test_without_the_join_the_first_spans_are_created_at_
#: once (the mutant creates a new table's spans before any join) beside ..._joins_before_its_first_spans_... and
#: test_the_new_leader_counts_a_join_of_a_table_it_has_not_seen (the rule, and why it holds the checkpoint).
DIRECT_MUTANTS = frozenset(
    {
        "spans-before-the-join",
        "release-under-an-old-take",
        "decides-on-stale-view",
        "creates-from-an-unconfirmed-record",
        "fills-a-hole-an-unseen-operator-plans",
    }
)


#: Seconds between full audits (every rule over every record) by default: the backstop of incremental
#: decisions. A full decision at 50,000 spans takes seconds; this keeps its share of a core small.
AUDIT_INTERVAL = 300.0
#: Seconds after a dispatcher's creation before a capture absent from the view (no Capture, no Lease) counts as
#: fenced (``Tick.capture_fenced``): longer than any maintainer outlives its Lease with a stale view.
UNKNOWN_CAPTURE_GRACE = 60.0


@dataclass(frozen=True)
class Options:
    mutants: frozenset[str] = frozenset()
    #: Every this many seconds a decision ignores the world's index and evaluates every rule over
    #: everything (the full audit), so that a candidate the index failed to offer can delay a repair but
    #: never lose it. 0: every decision is full.
    audit_interval: float = AUDIT_INTERVAL

    def __post_init__(self) -> None:
        unknown = self.mutants - MUTANTS
        if unknown:
            raise ValueError(f"unknown mutants: {sorted(unknown)}")


class Tick:
    """One decision's working state. Only the engine creates and mutates it."""

    def __init__(self, world: World, epoch: int, options: Options, full: bool = False) -> None:
        self.world = world
        #: The world's index, unless this decision is full (then every phase visits every record).
        self.index: Index | None = None if full else world.index
        self.now = world.now
        self.epoch = epoch
        self.options = options
        self.changefeed = world.changefeed
        #: Nothing is ever started below this: the published checkpoint, or the changefeed's start ts.
        self.checkpoint_floor = max(world.changefeed.checkpoint_ts, world.changefeed.start_ts)
        self.chains: list[Chain] = []
        # Overlay: records as this decision leaves them.
        self.spans: Overlay[Span] = Overlay(world.spans)
        self.operators: Overlay[SpanOperator] = Overlay(world.operators)
        self.dispatchers: Overlay[Dispatcher] = Overlay(world.dispatchers)
        self.touched: set[tuple[Kind, str]] = set()
        self._by_span: defaultdict[str, list[Dispatcher]] | None = None
        #: Dispatchers this decision creates, by span (an incremental decision's ``dispatchers_of_span``).
        self._new_by_span: defaultdict[str, list[str]] = defaultdict(list)
        self._by_table: dict[tuple[int, Mode], tuple[list[bytes], list[bytes], list[str]]] = {}
        #: Dispatchers this decision creates, per table and mode, in key order: (start keys, end keys, names).
        #: They never overlap one another (each was created only when no dispatcher ran any of its keys), so
        #: a query bisects; if that ever failed to hold, ``_created_unsorted`` makes queries scan them.
        self._created: defaultdict[tuple[int, Mode], tuple[list[bytes], list[bytes], list[str]]] = defaultdict(
            lambda: ([], [], [])
        )
        self._created_unsorted: set[tuple[int, Mode]] = set()
        self.repairs: list[str] = []
        self.alive = {n for n, c in world.captures.items() if c.alive(world.now)}
        self._fencing: set[str] = set()  # captures whose Lease this decision takes (mutant release-under-an-old-take)
        self.first_tick = False  # set by the maintainer on the first decision of a term
        # Running operators and the spans they own, kept current as operators change in this tick.
        self.owner: dict[str, str] = {}
        self.running = 0
        for op in self._running_in_world():
            self._count(op, +1)
        #: Operators Running in the snapshot, and the ones this decision starts. Slots freed by an
        #: operator finishing in this decision are not reused before the next one: chains fail
        #: independently, so the finishing write may not land while a start in another chain does.
        self.snapshot_running = self.running
        #: Ownership as of the snapshot. A span an operator releases in this decision stays busy until
        #: the next one: the releasing write may fail while a new claim in another chain lands.
        self.snapshot_owner: dict[str, str] = dict(self.owner)
        self.started: set[str] = set()
        #: Placements in flight (spans Scheduling with no operator: placement.py); they take in-flight slots
        #: like Running operators. ``started_placements``: those this decision starts.
        if self.index is not None:
            self.placing = len(self.index.placing)
        else:
            self.placing = sum(1 for s in self.spans.values() if is_placement(s))
        self.snapshot_placing = self.placing
        self.started_placements: set[str] = set()
        self._load: dict[str, int] | None = None
        #: Coverage left some new tables' spans for the next decision (its batch was full): no balancing.
        self.coverage_deferred = False
        #: New tables this decision records as joining (``Changefeed.status.joining``) before their first spans.
        self.joins_wanted: dict[str, Join] = {}
        #: Span states per table, for the status phase of a full decision (built once, at that phase).
        self.per_table_states: dict[int, list[SpanState | None]] | None = None
        self.tables_by_id: dict[int, Table] = {}
        if self.index is not None:
            self.tables_by_id = self.index.tables_by_id
        else:
            for t in sorted(world.tables.values(), key=lambda t: (t.created, t.name)):
                self.tables_by_id.setdefault(t.table_id, t)

    def _running_in_world(self) -> list[SpanOperator]:
        """The snapshot's Running operators, oldest first."""
        if self.index is not None:
            ops = [self.world.operators[n] for n in self.index.running]
        else:
            ops = [op for op in self.world.operators.values() if op.phase is OpPhase.RUNNING]
        return sorted(ops, key=lambda o: (o.created, o.name))

    # -- candidates (an incremental decision visits these; a full one, everything) ----------------

    @property
    def incremental(self) -> bool:
        return self.index is not None

    def span_candidates(self, *names: Iterable[str]) -> list[Span]:
        """Spans (as this decision left them) to visit: in a full decision every span; in an incremental
        one the spans named (the index's candidates for the rule) and every span this decision changed.
        Unsorted: each rule sorts, and applies its full predicate."""
        if self.index is None:
            return list(self.spans.values())
        wanted: set[str] = set(self.spans.changed)
        for group in names:
            wanted.update(group)
        for d in self.dispatchers.changed:  # a span's rules look at its dispatcher
            wanted.update(self.index.spans_naming(d))
            x = self.dispatchers.get(d) or self.world.dispatchers.get(d)
            if x is not None:
                wanted.add(x.span)
        out = []
        for name in wanted:
            span = self.spans.get(name)
            if span is not None:
                out.append(span)
        return out

    def dispatcher_candidates(self, *names: Iterable[str]) -> list[Dispatcher]:
        """As ``span_candidates``, for dispatchers (also those of spans this decision changed)."""
        if self.index is None:
            return list(self.dispatchers.values())
        wanted: set[str] = set(self.dispatchers.changed)
        for group in names:
            wanted.update(group)
        for span in self.spans.changed:
            wanted.update(self.index.dispatchers_of(span))
            wanted.update(self._new_by_span.get(span, ()))
            for x in (self.world.spans.get(span), self.spans.get(span)):  # the dispatcher it names
                if x is not None and x.dispatcher:
                    wanted.add(x.dispatcher)
        out = []
        for name in wanted:
            d = self.dispatchers.get(name)
            if d is not None:
                out.append(d)
        return out

    def lost_holders(self) -> list[str]:
        """Capture names that spans or dispatchers of this changefeed refer to and that are not alive."""
        assert self.index is not None
        return sorted(c for c in {*self.index.spans_by_capture, *self.index.disp_by_capture} if c not in self.alive)

    def on_lost_captures(self) -> tuple[set[str], set[str]]:
        """Spans and dispatchers (of the snapshot) on captures that are not alive: the dynamic candidates of
        the repair rules (a capture's Lease lapses with time, not with an event)."""
        assert self.index is not None
        spans: set[str] = set()
        dispatchers: set[str] = set()
        if self.mutant("incremental-skips-lost-captures"):
            return spans, dispatchers  # deliberate bug for the mutation check (the agreement check sees it)
        for c in self.lost_holders():
            spans.update(self.index.spans_by_capture.get(c, ()))
            for d in self.index.disp_by_capture.get(c, ()):
                dispatchers.add(d)
                spans.update(self.index.spans_naming(d))
        return spans, dispatchers

    def coverage_changed(self) -> set[tuple[int, Mode]]:
        """Tables (and modes) whose coverage this decision changed: a span created, deleted, refused..."""
        keys: set[tuple[int, Mode]] = set()
        for name in self.spans.changed:
            old, new = self.world.spans.get(name), self.spans.get(name)
            if coverage.covers_differently(old, new):
                keys.update((s.table_id, s.mode) for s in (old, new) if s is not None)
        return keys

    def in_flight_names(self) -> set[str]:
        """Operators that may be in flight now: the snapshot's in flight and those this decision changed."""
        assert self.index is not None
        return self.index.in_flight | set(self.operators.changed)

    # -- switches -------------------------------------------------------------------------------

    def mutant(self, name: str) -> bool:
        return name in self.options.mutants

    @property
    def schedulers_stopped(self) -> bool:
        """No automatic scheduling this decision (``Changefeed.schedulers_stopped``: replication paused, or the
        schedulers alone)."""
        cf = self.changefeed
        if self.mutant("pause-keeps-scheduling"):
            return cf.scheduler.paused
        return cf.schedulers_stopped

    # -- lookups --------------------------------------------------------------------------------

    def busy(self, span: str) -> bool:
        """An operator owns ``span`` now, or did in the snapshot (its release may not land)."""
        return span in self.owner or span in self.snapshot_owner

    def capture_alive(self, name: str) -> bool:
        return name in self.alive

    def capture_fenced(self, name: str, assigned_at: float | None = None) -> bool:
        """Nothing the capture runs can resume: its Lease does not name it, or there is no Lease (nor Capture)
        at all and the dispatcher was assigned to it ``UNKNOWN_CAPTURE_GRACE`` ago. A capture missing from this
        view may simply be newer than the view (a deposed maintainer's stale cache, before it stops, sees a
        dispatcher its successor placed on a capture that joined since); a capture registers
        its Lease before anything is assigned to it, so one still unknown that long after does not exist."""
        capture = self.world.captures.get(name)
        if capture is None:
            return assigned_at is None or self.now - assigned_at >= UNKNOWN_CAPTURE_GRACE
        return capture.lease_taken

    def schedulable_captures(self) -> list[str]:
        caps = self.world.captures
        return sorted(n for n in self.alive if not caps[n].draining)

    def table_of(self, span: Span) -> Table | None:
        table = self.tables_by_id.get(span.table_id)
        return table if table is not None and table.changefeed == self.changefeed.name else None

    def table_live(self, table_id: int) -> bool:
        """The table exists and is not being deleted."""
        table = self.tables_by_id.get(table_id)
        return table is not None and not table.deleting

    def table_holds_checkpoint(self, table_id: int) -> bool:
        """Its spans hold the changefeed checkpoint back: the table is live, or this maintainer has not seen
        it (yet). Informers of different kinds are independent, so a Span can arrive before its Table: one
        a deposed maintainer made for a table whose creation this one's Table watch has not delivered. Only a
        table seen being deleted lets its spans go from the minimum; a span of a table that never shows up is
        removed by the safety net, and holds the checkpoint until then."""
        table = self.tables_by_id.get(table_id)
        return table is None or not table.deleting

    def mode_enabled(self, mode: Mode) -> bool:
        return mode in self.changefeed.modes

    def dispatchers_of_span(self, span: str) -> list[Dispatcher]:
        if self.index is not None:
            names = [*self.index.dispatchers_of(span), *self._new_by_span.get(span, ())]
            found = [self.dispatchers.get(n) for n in names]
        else:
            if self._by_span is None:
                self._by_span = defaultdict(list)
                for d in self.dispatchers.values():
                    self._by_span[d.span].append(d)
            found = [self.dispatchers.get(d.name) for d in self._by_span.get(span, ())]
        # A span may also claim, through status.dispatcher, a dispatcher it adopted whose spec names a
        # span that no longer exists (repair rule 2): it is that span's dispatcher all the same.
        owner = self.spans.get(span)
        if owner is not None and owner.dispatcher:
            adopted = self.dispatchers.get(owner.dispatcher)
            if adopted is not None and adopted.span != span and adopted.span not in self.spans:
                found.append(adopted)
        mine = {d.name: d for d in found if d is not None and (d.span == span or d.span not in self.spans)}
        return sorted(mine.values(), key=lambda d: (d.created, d.name))

    def overlapping_dispatchers(self, table_id: int, mode: Mode, rng: KeyRange) -> list[Dispatcher]:
        """Dispatchers (closing ones included) of ``table_id`` and ``mode`` whose keys overlap ``rng``.

        Called once per placement, so it must not scan the table: per table and mode, the snapshot's
        dispatchers are sorted by start key with a running maximum of end keys; a query bisects to
        the last start below ``rng.end`` and walks back only while an earlier range could still reach
        ``rng.start``. Dispatchers created in this decision (a new table's, thousands) are kept in key
        order as they are created, and bisected likewise.
        """
        key = (table_id, mode)
        if key not in self._by_table:
            # Per table and mode, built on the first query of the decision (from the index's dispatchers of
            # the table, or a scan of the snapshot in a full decision).
            groups: dict[tuple[int, Mode], list[Dispatcher]] = {key: []}
            if self.index is not None:
                groups[key] = [self.world.dispatchers[n] for n in self.index.disp_by_table.get(key, ())]
            else:
                for d in self.world.dispatchers.values():
                    groups.setdefault((d.table_id, d.mode), []).append(d)
            for k, ds in groups.items():
                ds[:] = in_order(ds, key=lambda d: (d.key_range.start, d.name))
                reach: list[bytes] = []
                for d in ds:
                    reach.append(max(reach[-1], d.key_range.end) if reach else d.key_range.end)
                self._by_table[k] = ([d.key_range.start for d in ds], reach, [d.name for d in ds])
        found: list[Dispatcher] = []
        starts, reach, names = self._by_table.get((table_id, mode), ([], [], []))
        j = bisect.bisect_left(starts, rng.end) - 1
        while j >= 0 and reach[j] > rng.start:
            hit = self.dispatchers.get(names[j])
            if hit is not None and hit.key_range.overlaps(rng):
                found.append(hit)
            j -= 1
        created = self._created.get((table_id, mode))
        if created is not None:
            c_starts, c_ends, c_names = created
            if (table_id, mode) in self._created_unsorted:
                hits = range(len(c_names))
            else:  # disjoint and sorted: the ends are sorted too; walk back from the last start below the end
                last = bisect.bisect_left(c_starts, rng.end) - 1
                first = last
                while first >= 0 and c_ends[first] > rng.start:
                    first -= 1
                hits = range(first + 1, last + 1)
            for i in hits:
                new = self.dispatchers.get(c_names[i])
                if new is not None and new.key_range.overlaps(rng):
                    found.append(new)
        return sorted(found, key=lambda d: d.name)

    def in_flight(self) -> list[SpanOperator]:
        if self.index is not None:
            found = (self.operators.get(n) for n in self.in_flight_names())
            ops = [o for o in found if o is not None and o.in_flight]
        else:
            ops = [o for o in self.operators.values() if o.in_flight]
        return sorted(ops, key=lambda o: (o.created, o.name))

    def load(self) -> dict[str, int]:
        """Spans per capture: replicating ones and placements in flight, plus in-flight operator targets.

        Computed once per decision, then kept current as the decision changes records (``note``); the
        caller gets a copy it may change."""
        if self._load is None:
            counts: dict[str, int] = defaultdict(int)
            if self.index is not None:
                counts.update(self.index.span_load)
                for name in self.spans.changed:
                    for c, sign in (
                        (_load_of_span(self.world.spans.get(name)), -1),
                        (_load_of_span(self.spans.get(name)), 1),
                    ):
                        if c:
                            counts[c] += sign
                ops: Iterable[SpanOperator] = self.in_flight()
            else:
                for s in self.spans.values():
                    c = _load_of_span(s)
                    if c:
                        counts[c] += 1
                ops = self.operators.values()
            for op in ops:
                for c in _load_of_operator(op):
                    counts[c] += 1
            self._load = counts
        return defaultdict(int, self._load)

    def _adjust_load(self, minus: list[str], plus: list[str]) -> None:
        if self._load is None:
            return
        for c in minus:
            if c:
                self._load[c] -= 1
        for c in plus:
            if c:
                self._load[c] = self._load.get(c, 0) + 1

    # -- recording decisions --------------------------------------------------------------------

    def emit(self, why: str, writes: Iterable[object], wake: bool = True) -> None:
        ws = tuple(writes)
        if ws:
            self.chains.append(Chain(ws, why, wake=wake and not self.mutant("quiet-chains-everywhere")))  # type: ignore[arg-type]

    def slots_used(self) -> int:
        """Operators that may be Running, and placements in flight, once this decision's chains land (in any
        subset): a slot freed in this decision is not reused before the next one."""
        now = self.running + self.placing
        snapshot = self.snapshot_running + self.snapshot_placing + len(self.started) + len(self.started_placements)
        return max(now, snapshot)

    def _count(self, op: SpanOperator, sign: int) -> None:
        if op.phase is not OpPhase.RUNNING:
            return
        self.running += sign
        for s in (*op.spans, *(t.span for t in op.targets)):
            if sign > 0:
                self.owner.setdefault(s, op.name)
            elif self.owner.get(s) == op.name:
                del self.owner[s]

    def note(self, obj: Record) -> None:
        """Record ``obj`` as this decision leaves it, so later phases of the tick see it."""
        self.touched.add((obj.kind, obj.name))
        if isinstance(obj, Span):
            old_span = self.spans.get(obj.name)
            self.spans[obj.name] = obj
            self.placing += is_placement(obj) - is_placement(old_span)
            if is_placement(obj) and not is_placement(self.world.spans.get(obj.name)):
                self.started_placements.add(obj.name)
            self._adjust_load([_load_of_span(old_span)], [_load_of_span(obj)])
        elif isinstance(obj, SpanOperator):
            old = self.operators.get(obj.name)
            if old is not None:
                self._count(old, -1)
            self._adjust_load(_load_of_operator(old), _load_of_operator(obj))
            self.operators[obj.name] = obj
            self._count(obj, +1)
            before = self.world.operators.get(obj.name)
            if obj.phase is OpPhase.RUNNING and (before is None or before.phase is not OpPhase.RUNNING):
                self.started.add(obj.name)
        elif isinstance(obj, Dispatcher):
            if obj.name not in self.dispatchers and self._by_span is not None:
                self._by_span[obj.span].append(obj)
            if obj.name not in self.world.dispatchers and obj.name not in self.dispatchers:
                key = (obj.table_id, obj.mode)
                starts, ends, names = self._created[key]
                i = bisect.bisect_left(starts, obj.key_range.start)
                if (i > 0 and ends[i - 1] > obj.key_range.start) or (i < len(starts) and starts[i] < obj.key_range.end):
                    self._created_unsorted.add(key)  # overlaps one created before: queries scan (never seen)
                starts.insert(i, obj.key_range.start)
                ends.insert(i, obj.key_range.end)
                names.insert(i, obj.name)
                if obj.name not in self._new_by_span[obj.span]:
                    self._new_by_span[obj.span].append(obj.name)
            self.dispatchers[obj.name] = obj

    def forget(self, kind: Kind, name: str) -> None:
        self.touched.add((kind, name))
        if kind is Kind.SPAN:
            old_span = self.spans.pop(name, None)
            self.placing -= is_placement(old_span)
            self._adjust_load([_load_of_span(old_span)], [])
        elif kind is Kind.DISPATCHER:
            self.dispatchers.pop(name, None)
        elif kind is Kind.OPERATOR:
            old = self.operators.pop(name, None)
            if old is not None:
                self._count(old, -1)
            self._adjust_load(_load_of_operator(old), [])

    def is_touched(self, obj: Record) -> bool:
        return (obj.kind, obj.name) in self.touched

    # -- write builders -------------------------------------------------------------------------

    def write_status(self, obj: Record) -> WriteStatus:
        self.note(obj)
        return WriteStatus(obj)

    def create(self, obj: Record, exclusive: bool = False) -> Create:
        self.note(obj)
        return Create(obj, exclusive)

    def close_dispatcher(self, d: Dispatcher) -> list[Delete | FenceCapture | RemoveFinalizer]:
        """Delete ``d``; if its capture is lost, also release its finalizer, right after a fence.

        A live capture closes the dispatcher, reports its final checkpoint and releases the finalizer
        itself; a lost one cannot, so the maintainer does, but only once no process of that capture can run
        the dispatcher. A capture whose Lease merely lapsed has stopped delivering, yet would resume its
        dispatchers in place if it reached the API again; and a view that shows its Lease taken may be older
        than the dispatcher (each kind has its own watch): a restarted process of the capture may hold the
        Lease again by now and run a dispatcher created since. So the release comes
        in the same chain as a ``FenceCapture``: a compare-and-swap on the Lease version of this view that
        takes the Lease (or, already taken, writes it again). If it lands, the Lease did not name the
        capture at a moment after this view was read, hence after ``d`` was created, and no process of the
        capture can run ``d``; if the capture renewed since, the chain stops before the release and the
        next decision judges again. The executor writes the Lease once per decision however many chains
        carry the same fence. A capture with no Lease at all (nor Capture) counts as fenced only
        ``UNKNOWN_CAPTURE_GRACE`` after the dispatcher was created (``capture_fenced``). A capture that is
        not alive for another reason (its Capture object deleted while its Lease is current) closes the
        dispatcher itself.
        """
        writes: list[Delete | FenceCapture | RemoveFinalizer] = []
        if not d.deleting:
            writes.append(Delete(Kind.DISPATCHER, d.name, d.uid))
        if (
            not self.capture_alive(d.capture)
            and DISPATCHER_FINALIZER in d.finalizers
            and not self.mutant("remove-forgets-finalizer-of-lost-capture")
        ):
            writes.extend(self._release_lost(d))
        if writes:
            self.touched.add((Kind.DISPATCHER, d.name))
            if not d.deleting:
                self.dispatchers[d.name] = replace(d, deleting=True)
        return writes

    def _release_lost(self, d: Dispatcher) -> list[FenceCapture | RemoveFinalizer]:
        """The writes that release the finalizer of ``d``, on a capture that is not alive (see
        :meth:`close_dispatcher`); none while no release is safe yet."""
        release = RemoveFinalizer(Kind.DISPATCHER, d.name, DISPATCHER_FINALIZER)
        capture = self.world.captures.get(d.capture)
        if self.mutant("release-before-fence"):
            return [release]
        if self.mutant("release-under-an-old-take"):
            # The old rule: take a lapsed Lease in a chain of its own, release from a view showing it taken.
            if capture is None or capture.lease_taken:
                return [release] if self.capture_fenced(d.capture, d.created) else []
            if capture.expired(self.now) and d.capture not in self._fencing:
                self._fencing.add(d.capture)
                take = FenceCapture(d.capture, capture.lease_version)
                self.emit(f"capture {d.capture} lost: take its Lease", [take])
            return []
        if capture is None:
            return [release] if self.capture_fenced(d.capture, d.created) else []
        if capture.lease_taken or capture.expired(self.now):
            return [FenceCapture(d.capture, capture.lease_version), release]
        return []

    def event(self, obj: Record, reason: str, message: str, warning: bool = False) -> Event:
        return Event(obj.kind, obj.name, reason, message, warning)
