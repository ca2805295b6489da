"""Indexes over one changefeed's records, kept current per event, so that a decision costs what changed.

Why: every rule of the engine is level-triggered ("a Replicating span whose dispatcher is gone goes
Absent"), and evaluated over the whole world it costs O(spans) per decision, about a second at 10,000
spans. But at rest almost every record satisfies every rule, and only a handful can need anything: the
spans that are not Replicating, the Replicating ones whose dispatcher is not Working, the dispatchers
no span claims, the tables whose spans do not partition their range... This module keeps those sets
(and the aggregates the decision reports: span counts, load per capture, the lowest checkpoint) as
*functions of the current records*, updated on every event in O(the records the event touches).

How it stays exact: for every span and dispatcher the index stores the facts it derived from the
record and the few records they depend on (a span's facts depend on the dispatcher its status names,
on its table and on the changefeed's modes and thresholds; a dispatcher's on its span and the spans
that name it). The facts carry their record, so each span and dispatcher is held once, in one table by name
(``spans`` and ``dispatchers`` read it), and a span and its own dispatcher find each other through their
records: no second table by name grows in step with it (tables of 100,000 names doubling together in one
write-through are the longest stalls of the event loop; the sets per rule, capture and table are split by
their key). An event retracts the facts of every record whose facts it can change and asserts
them afresh. Nothing here is an edge ("this changed, look at it once"): a set holds a span for as long
as the rule may apply to it, so a decision that fails to act leaves it there for the next one.

Who uses it: ``decide`` (``World.index``) iterates these candidate sets instead of every record, and
applies each rule's full predicate to the candidates, so a candidate too many costs a lookup and a
candidate missing would be a bug. Two backstops catch such a bug: the periodic full audit (``decide``
ignores the index every ``Options.audit_interval`` seconds and evaluates every rule over everything), and
in the simulator, a full decision beside every incremental one, which must be equal, and
``controller.sim.index_check.verify``, which rebuilds the index from its records and compares.

The index is maintained by the informer in production (``controller.kube.informer``) and by the
simulator's cache, from the same calls (``put`` and ``remove``): the simulator drives exactly this code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.engine import coverage
from controller.engine.containers import MinTracker, MultiMap, RecordView
from controller.engine.digests import ReportKey, WorkingSets
from controller.engine.operator_gc import GcQueue
from controller.model.keys import KeyRange
from controller.model.records import Changefeed, Dispatcher, Record, Span, SpanCounts, SpanOperator, Table
from controller.model.states import TABLE_FINALIZER, DispatcherState, Kind, Mode, OpPhase, SpanState

#: Span states kept as sets (Replicating and Invalid spans are the bulk at rest and need no pass).
TRACKED_STATES: tuple[SpanState | None, ...] = (None, SpanState.ABSENT, SpanState.SCHEDULING, SpanState.REMOVING)

TableKey = tuple[int, Mode]


def _add(index: dict[object, set[str]], key: object, name: str) -> None:
    index.setdefault(key, set()).add(name)


def _discard(index: dict[object, set[str]], key: object, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]


def is_placement(span: Span | None) -> bool:
    """``span`` is being placed without an operator (engine/placement.py); the same test as ``world``'s."""
    return span is not None and span.state is SpanState.SCHEDULING and not span.operator and bool(span.capture)


def span_counts(counts: Counter[SpanState | None]) -> SpanCounts:
    """Spans per state, as ``Changefeed.status.spans`` and ``Table.status.spans`` report them."""
    return SpanCounts(
        absent=counts[SpanState.ABSENT],
        scheduling=counts[SpanState.SCHEDULING],
        replicating=counts[SpanState.REPLICATING],
        removing=counts[SpanState.REMOVING],
        invalid=counts[SpanState.INVALID],
    )


@dataclass(frozen=True, slots=True)
class SpanFacts:
    """What the index derived from one span (and the records it depends on) the last time it looked, and the span
    itself: the index's one home for it (``Index.spans`` reads it from here; not part of what the facts say)."""

    record: Span = field(compare=False, repr=False)
    state: SpanState | None
    capture: str
    table: TableKey
    covered: bool  # counts in its table's coverage, new or not (``coverage.counts``)
    key_range: KeyRange  # the spec cannot change, but a new incarnation (relisted) may replace the span
    dispatcher: str
    load: str  # the capture the span counts towards in the load ("" none): Replicating or a placement
    placing: bool
    holding: bool  # on a capture and not Absent: a capture lost while holding it is reported
    suspect: bool  # Replicating, but its dispatcher is not a Working dispatcher of it
    stray: bool  # of a table that is not the changefeed's, or of a disabled mode
    hot: bool
    cold: bool
    checkpoint: int | None  # what it contributes to the changefeed checkpoint (None: nothing)
    #: The (capture, mode) whose progress report may raise ``checkpoint`` (its Working dispatcher's): the
    #: span's value is then max(checkpoint, that report's minimum) when the report covers exactly the
    #: capture's Working dispatchers (engine/progress.py). None: nothing raises it.
    reporter: ReportKey | None = None
    #: The dispatcher its status names exists and is of this span (``Dispatcher.span``): then ``spans_naming``
    #: finds the span through it, and it is not in ``foreign_naming``.
    own: bool = False


@dataclass(frozen=True, slots=True)
class DispatcherFacts:
    """What the index derived from one dispatcher (and the spans it depends on), and the dispatcher itself (as
    ``SpanFacts.record``)."""

    record: Dispatcher = field(compare=False, repr=False)
    span: str
    capture: str
    table: TableKey
    deleting: bool
    orphan: bool  # its span does not exist
    unclaimed: bool  # no span claims it (repair rule 3 looks at it)
    uid: str = ""
    working: bool = False  # Working (deleting or not): in the set its capture's report must cover
    failed: bool = False  # its runtime stopped it for good (Dispatcher.failure), and it is not being deleted
    #: Its span exists and its status names it (then ``Index.dispatchers_of`` finds it through the span, and it is
    #: not in ``loose_by_span``).
    named: bool = False


class Index:
    """The records of one changefeed and the indexes over them. See the module docstring."""

    def __init__(self, changefeed: str) -> None:
        self.name = changefeed
        self.changefeed: Changefeed | None = None
        self.tables: dict[str, Table] = {}
        #: name -> facts, each with its record: the one home of the changefeed's spans and dispatchers, which
        #: ``spans`` and ``dispatchers`` read.
        self.span_facts: dict[str, SpanFacts] = {}
        self.dispatcher_facts: dict[str, DispatcherFacts] = {}
        self.spans: RecordView[Span] = RecordView(self.span_facts)
        self.dispatchers: RecordView[Dispatcher] = RecordView(self.dispatcher_facts)
        self.operators: dict[str, SpanOperator] = {}
        # -- spans
        self.by_state: dict[SpanState | None, set[str]] = {s: set() for s in TRACKED_STATES}
        self.placing: set[str] = set()
        self.suspect: set[str] = set()
        self.stray: set[str] = set()
        self.hot: set[str] = set()
        self.cold: set[str] = set()
        self.spans_by_capture: dict[str, set[str]] = {}
        self.holding: Counter[str] = Counter()
        self.spans_by_table: dict[TableKey, set[str]] = {}
        #: dispatcher -> the spans whose status names it though it is not theirs (``Dispatcher.span`` is another
        #: span's, or it does not exist): a span naming its own dispatcher is found through the dispatcher
        #: (``spans_naming``), so this holds only the few adopting or naming a dispatcher not made yet.
        self.foreign_naming = MultiMap()
        self.state_counts: Counter[SpanState | None] = Counter()
        #: Spans per (state, capture as recorded, mode): what the metrics export (a scrape reads this, not the spans).
        self.span_tally: Counter[tuple[SpanState | None, str, Mode]] = Counter()
        self.table_counts: dict[int, Counter[SpanState | None]] = {}
        self.span_load: Counter[str] = Counter()
        #: Replicating spans per capture (what the balance scheduler weighs).
        self.replicating_by_capture: Counter[str] = Counter()
        #: What spans contribute to the checkpoint: those no report can raise, and per (capture, mode) those
        #: whose Working dispatcher that capture's report may cover (engine/checkpoint.py takes, per group,
        #: max(lowest, the report's minimum): the minimum over max(value, report) is max(minimum, report)).
        self.checkpoints = MinTracker()
        self.reported_checkpoints: dict[ReportKey, MinTracker] = {}
        # -- dispatchers
        #: span -> the dispatchers of that span (``Dispatcher.span``) it does not name: a span's own dispatcher is
        #: found through the span (``dispatchers_of``), so this holds only the few left over, created but not
        #: named yet, replaced or orphaned (a third map of every dispatcher was one more table of 100,000 names).
        self.loose_by_span = MultiMap()
        self.disp_by_capture: dict[str, set[str]] = {}
        self.disp_by_table: dict[TableKey, set[str]] = {}
        self.unclaimed: set[str] = set()
        self.orphans: set[str] = set()
        self.deleting_dispatchers: set[str] = set()
        #: Dispatchers their runtime stopped for good, not being deleted (the ReplicationFailed condition).
        self.failed_dispatchers: set[str] = set()
        #: Per (capture, mode): the Working dispatchers the maintainer believes that capture runs for this
        #: changefeed, and the digest of their uids (engine/digests.py).
        self.working = WorkingSets()
        # -- operators
        self.in_flight: set[str] = set()
        self.running: set[str] = set()
        #: Finished operators in order of when their retention ends (engine/operator_gc.py).
        self.gc = GcQueue(self.operators)
        # -- tables
        self.tables_by_id: dict[int, Table] = {}
        self.table_names: dict[int, set[str]] = {}
        self.table_attention: set[str] = set()
        self._table_stale: set[str] = set()
        #: Table IDs whose tables' status may have become stale (span counts changed): recomputed lazily.
        self._stale_dirty: set[int] = set()
        # -- coverage: (table, mode) whose spans may not partition the table's range; recomputed lazily
        self._coverage_dirty: set[TableKey] = set()
        self._coverage_problems: set[TableKey] = set()
        #: The table and report keys the facts share (``_pair``).
        self._pairs: dict[tuple[object, Mode], tuple[object, Mode]] = {}

    def _pair(self, a: object, b: Mode) -> Any:
        """``(a, b)``, one tuple shared by every fact that names it (a table key, a report key): there are few of
        them and a fact per span; each fact's own tuple was 56 bytes, twice per span."""
        key = (a, b)
        return self._pairs.setdefault(key, key)

    # -- what the changefeed says ------------------------------------------------------------------

    def modes(self) -> tuple[Mode, ...]:
        return self.changefeed.modes if self.changefeed is not None else (Mode.DEFAULT,)

    def table_live(self, table_id: int) -> bool:
        table = self.tables_by_id.get(table_id)
        return table is not None and not table.deleting

    def table_holds_checkpoint(self, table_id: int) -> bool:
        """As ``Tick.table_holds_checkpoint``: live, or not seen yet."""
        table = self.tables_by_id.get(table_id)
        return table is None or not table.deleting

    def _thresholds(self) -> tuple[float, int, float]:
        if self.changefeed is None:
            return (0.0, 0, 0.0)
        cfg = self.changefeed.scheduler
        return (cfg.split_write_threshold, cfg.split_region_threshold, cfg.merge_write_threshold)

    # -- events ------------------------------------------------------------------------------------

    def put(self, record: Record) -> None:
        if isinstance(record, Span):
            self._put_span(record)
        elif isinstance(record, Dispatcher):
            self._put_dispatcher(record)
        elif isinstance(record, SpanOperator):
            self._put_operator(record)
        elif isinstance(record, Table):
            self._put_table(record)
        elif isinstance(record, Changefeed):
            self._put_changefeed(record)

    def remove(self, kind: Kind, name: str) -> None:
        if kind is Kind.SPAN:
            self._put_span(None, name)
        elif kind is Kind.DISPATCHER:
            self._put_dispatcher(None, name)
        elif kind is Kind.OPERATOR:
            self._put_operator(None, name)
        elif kind is Kind.TABLE:
            self._put_table(None, name)
        elif kind is Kind.CHANGEFEED:
            self._put_changefeed(None)

    def empty(self) -> bool:
        return self.changefeed is None and not (self.tables or self.spans or self.dispatchers or self.operators)

    @classmethod
    def build(cls, name: str, records: Iterable[Record]) -> Index:
        """An index of ``records`` (those of changefeed ``name``), as a LIST followed by no event leaves it."""
        index = cls(name)
        for record in records:
            index.put(record)
        return index

    # -- changefeed ----------------------------------------------------------------------------------

    def _put_changefeed(self, cf: Changefeed | None) -> None:
        before = (self.modes(), self._thresholds())
        self.changefeed = cf
        if (self.modes(), self._thresholds()) != before:
            # Every span's facts depend on the modes (stray, checkpoint) and thresholds (hot, cold).
            for name in list(self.span_facts):
                self._refresh_span(name)
            self._coverage_dirty.update((tid, m) for tid in self.tables_by_id for m in Mode)

    # -- tables --------------------------------------------------------------------------------------

    def _put_table(self, table: Table | None, name: str = "") -> None:
        name = table.name if table is not None else name
        old = self.tables.get(name)
        if old is not None:
            _discard(self.table_names, old.table_id, name)  # type: ignore[arg-type]
        if table is None:
            self.tables.pop(name, None)
        else:
            self.tables[name] = table
            _add(self.table_names, table.table_id, name)  # type: ignore[arg-type]
        for tid in sorted({t.table_id for t in (old, table) if t is not None}):
            self._refresh_table_id(tid)
        self._refresh_table(name)

    def _refresh_table_id(self, tid: int) -> None:
        """The table ID's canonical Table (the first created) and everything that depends on it."""
        names = self.table_names.get(tid, set())
        before = self.tables_by_id.get(tid)
        first = min((self.tables[n] for n in names), key=lambda t: (t.created, t.name), default=None)
        if first is None:
            self.tables_by_id.pop(tid, None)
        else:
            self.tables_by_id[tid] = first
        if (before is not None, before is not None and before.deleting) != (
            first is not None,
            first is not None and first.deleting,
        ):
            # Whether the table exists and is live: stray and checkpoint facts of its spans.
            for mode in Mode:
                for span in list(self.spans_by_table.get((tid, mode), ())):
                    self._refresh_span(span)
        for mode in Mode:
            self._coverage_dirty.add((tid, mode))
        for n in sorted(names):
            self._refresh_table(n)
        if before is not None and before.name not in names:
            self._refresh_table(before.name)

    def _refresh_table(self, name: str) -> None:
        table = self.tables.get(name)
        self.table_attention.discard(name)
        self._table_stale.discard(name)
        if table is None:
            return
        canonical = self.tables_by_id.get(table.table_id) is table
        if not canonical or table.deleting or TABLE_FINALIZER not in table.finalizers:
            self.table_attention.add(name)
        self._stale_dirty.add(table.table_id)

    def table_stale(self) -> set[str]:
        """Tables (the canonical one per ID) whose status differs from what it should say (their span
        counts, state, generation). Recomputed for the IDs events touched since the last call."""
        for tid in self._stale_dirty:
            for name in self.table_names.get(tid, ()):
                self._table_stale.discard(name)
            table = self.tables_by_id.get(tid)
            if table is not None and self._table_status_differs(table):
                self._table_stale.add(table.name)
        self._stale_dirty.clear()
        return self._table_stale

    def _table_status_differs(self, table: Table) -> bool:
        counts = span_counts(self.table_counts.get(table.table_id, Counter()))
        state = "Removing" if table.deleting else "Active"
        return (table.state, table.message, table.span_counts, table.observed_generation) != (
            state,
            "",
            counts,
            table.generation,
        )

    # -- spans ---------------------------------------------------------------------------------------

    def _put_span(self, span: Span | None, name: str = "") -> None:
        name = span.name if span is not None else name
        had = self.span_facts.get(name)
        old = had.record if had is not None else None
        # Its dispatchers (``Dispatcher.span``), as they are before this change: the loose ones, and the one its
        # status names (before or after) if that dispatcher's spec names this span (``DispatcherFacts.named``).
        mine = set(self.loose_by_span.get(name, ()))
        for x in (old, span):
            df = self.dispatcher_facts.get(x.dispatcher) if x is not None and x.dispatcher else None
            if df is not None and df.span == name:
                mine.add(df.record.name)
        self._derive_span(name, span)
        # Dispatchers whose facts depend on this span: those of it (orphan, claimed, named), those it names (the
        # claim of an orphan by a span naming it).
        for d in sorted(mine | {x.dispatcher for x in (old, span) if x is not None and x.dispatcher}):
            if d in self.dispatcher_facts:
                self._refresh_dispatcher(d)
        if (old is None) != (span is None):
            # A span created or deleted: a span that adopted a dispatcher of this name's spec is suspect now
            # (or no longer).
            for d in sorted(mine):
                for s in list(self.foreign_naming.get(d, ())):  # a span naming one of this span's is foreign
                    if s != name:
                        self._refresh_span(s)

    def _span_facts(self, s: Span) -> SpanFacts:
        df = self.dispatcher_facts.get(s.dispatcher) if s.dispatcher else None
        d = df.record if df is not None else None
        working = d is not None and not d.deleting and d.state is DispatcherState.WORKING
        belongs = d is not None and (
            d.span == s.name
            or (
                d.span not in self.span_facts and (d.table_id, d.mode, d.key_range) == (s.table_id, s.mode, s.key_range)
            )
        )
        enabled = s.mode in self.modes()
        ours = s.table_id in self.tables_by_id
        validated = s.state not in (None, SpanState.INVALID)  # deleting or not (not ``Span.accepted``)
        measured = s.state is SpanState.REPLICATING and not s.deleting and working and d is not None
        split_rate, split_regions, merge_rate = self._thresholds()
        hot = (
            measured
            and d is not None
            and (
                (split_rate > 0 and d.write_rate > split_rate) or (split_regions > 0 and d.region_count > split_regions)
            )
        )
        cold = measured and d is not None and merge_rate > 0 and d.write_rate < merge_rate
        checkpoint: int | None = None
        reporter: ReportKey | None = None
        if validated and enabled and self.table_holds_checkpoint(s.table_id):
            if s.state is SpanState.REPLICATING and d is not None and d.state is DispatcherState.WORKING:
                checkpoint = max(d.known_checkpoint, s.known_checkpoint)
                reporter = self._pair(d.capture, d.mode)
            else:
                checkpoint = s.known_checkpoint
        placing = is_placement(s)
        return SpanFacts(
            record=s,
            state=s.state,
            capture=s.capture,
            table=self._pair(s.table_id, s.mode),
            covered=coverage.counts(s, new=True),
            key_range=s.key_range,
            dispatcher=s.dispatcher,
            load=s.capture if s.capture and (s.state is SpanState.REPLICATING or placing) else "",
            placing=placing,
            holding=bool(s.capture) and s.state is not SpanState.ABSENT,
            suspect=s.state is SpanState.REPLICATING and not (working and belongs),
            stray=not s.deleting and validated and (not ours or not enabled),
            hot=hot,
            cold=cold,
            checkpoint=checkpoint,
            reporter=reporter,
            own=d is not None and d.span == s.name,
        )

    def _refresh_span(self, name: str) -> None:
        """Derive span ``name``'s facts afresh from the record it has (records it depends on changed)."""
        facts = self.span_facts.get(name)
        if facts is not None:
            self._derive_span(name, facts.record)

    def _derive_span(self, name: str, span: Span | None) -> None:
        """Span ``name``'s record is ``span`` (None: deleted): its facts derived from it, and the indexes updated."""
        # Only what changed is touched: an entry taken out of a map keyed by name and put back is a deletion and
        # an insertion, and a dict or set of 100,000 names that churns so grows a fresh table now and then
        # (about 10 MB, first touched there) though its size never changes: 40-80 ms in one write-through at
        # 100,000 spans, several such maps resizing in the same refresh.
        old = self.span_facts.get(name)
        new = self._span_facts(span) if span is not None else None
        if old == new:  # the same facts (compared without the record)
            if new is not None:
                self.span_facts[name] = new  # its record may be new: replaced in place (no resize)
            return
        if old is not None:
            self._span_out(name, old, new)
        if new is not None:
            self.span_facts[name] = new
            self._span_in(name, new, old)
        else:
            del self.span_facts[name]
        # Its entry in ``foreign_naming`` (the dispatcher it names, while that is not its own).
        was = old.dispatcher if old is not None and not old.own else ""
        now = new.dispatcher if new is not None and not new.own else ""
        if was != now:
            if was:
                self.foreign_naming.discard(was, name)
            if now:
                self.foreign_naming.add(now, name)
        if (old and (old.table, old.covered, old.key_range)) != (new and (new.table, new.covered, new.key_range)):
            self._coverage_dirty.update(f.table for f in (old, new) if f is not None)
        if (old and (old.table, old.state)) != (new and (new.table, new.state)):
            self._stale_dirty.update(f.table[0] for f in (old, new) if f is not None)

    def _span_out(self, name: str, f: SpanFacts, keep: SpanFacts | None) -> None:
        """Take span ``name``'s facts ``f`` out of the indexes, but where ``keep`` (its next facts, put in right
        after by ``_span_in``) has the same membership."""
        if f.state in self.by_state and (keep is None or keep.state is not f.state):
            self.by_state[f.state].discard(name)
        if f.placing and not (keep is not None and keep.placing):
            self.placing.discard(name)
        if f.suspect and not (keep is not None and keep.suspect):
            self.suspect.discard(name)
        if f.stray and not (keep is not None and keep.stray):
            self.stray.discard(name)
        if f.hot and not (keep is not None and keep.hot):
            self.hot.discard(name)
        if f.cold and not (keep is not None and keep.cold):
            self.cold.discard(name)
        if f.capture and (keep is None or keep.capture != f.capture):
            _discard(self.spans_by_capture, f.capture, name)  # type: ignore[arg-type]
        if f.holding:
            self.holding[f.capture] -= 1
            if not self.holding[f.capture]:
                del self.holding[f.capture]
        if keep is None or keep.table != f.table:
            _discard(self.spans_by_table, f.table, name)  # type: ignore[arg-type]
        self.state_counts[f.state] -= 1
        tally = (f.state, f.capture, f.table[1])
        self.span_tally[tally] -= 1
        if not self.span_tally[tally]:
            del self.span_tally[tally]
        counts = self.table_counts[f.table[0]]
        counts[f.state] -= 1
        if not counts[f.state]:
            del counts[f.state]
            if not counts:
                del self.table_counts[f.table[0]]
        if f.load:
            self.span_load[f.load] -= 1
            if not self.span_load[f.load]:
                del self.span_load[f.load]
        if f.capture and f.state is SpanState.REPLICATING:
            self.replicating_by_capture[f.capture] -= 1
            if not self.replicating_by_capture[f.capture]:
                del self.replicating_by_capture[f.capture]
        if keep is not None and keep.reporter == f.reporter:
            pass  # the same tracker: ``_span_in`` sets the new value over the old one
        elif f.reporter is None:
            self.checkpoints.set(name, None, f.checkpoint)
        else:
            tracker = self.reported_checkpoints[f.reporter]
            tracker.set(name, None, f.checkpoint)
            if not tracker:
                del self.reported_checkpoints[f.reporter]

    def _span_in(self, name: str, f: SpanFacts, had: SpanFacts | None) -> None:
        """Put span ``name``'s facts ``f`` into the indexes, but where ``had`` (its facts before, taken out by
        ``_span_out`` with ``keep=f``) had the same membership."""
        if f.state in self.by_state and (had is None or had.state is not f.state):
            self.by_state[f.state].add(name)
        if f.placing and not (had is not None and had.placing):
            self.placing.add(name)
        if f.suspect and not (had is not None and had.suspect):
            self.suspect.add(name)
        if f.stray and not (had is not None and had.stray):
            self.stray.add(name)
        if f.hot and not (had is not None and had.hot):
            self.hot.add(name)
        if f.cold and not (had is not None and had.cold):
            self.cold.add(name)
        if f.capture and (had is None or had.capture != f.capture):
            _add(self.spans_by_capture, f.capture, name)  # type: ignore[arg-type]
        if f.holding:
            self.holding[f.capture] += 1
        if had is None or had.table != f.table:
            _add(self.spans_by_table, f.table, name)  # type: ignore[arg-type]
        self.state_counts[f.state] += 1
        self.span_tally[(f.state, f.capture, f.table[1])] += 1
        self.table_counts.setdefault(f.table[0], Counter())[f.state] += 1
        if f.load:
            self.span_load[f.load] += 1
        if f.capture and f.state is SpanState.REPLICATING:
            self.replicating_by_capture[f.capture] += 1
        # What the span's entry was in this tracker: its old value if ``_span_out`` kept it (the same tracker).
        was = had.checkpoint if had is not None and had.reporter == f.reporter else None
        if f.reporter is None:
            self.checkpoints.set(name, f.checkpoint, was)
        else:
            self.reported_checkpoints.setdefault(f.reporter, MinTracker()).set(name, f.checkpoint, was)

    # -- dispatchers ---------------------------------------------------------------------------------

    def _put_dispatcher(self, d: Dispatcher | None, name: str = "") -> None:
        name = d.name if d is not None else name
        # The spans naming it (their facts look at it), as their facts say before this change: the foreign ones,
        # and its own span (of its record before or after) if that names it.
        naming = set(self.foreign_naming.get(name, ()))
        old = self.dispatcher_facts.get(name)
        for span in (old.span if old is not None else "", d.span if d is not None else ""):
            sf = self.span_facts.get(span) if span else None
            if sf is not None and sf.dispatcher == name:
                naming.add(span)
        self._derive_dispatcher(name, d)
        for s in sorted(naming):
            self._refresh_span(s)

    def _dispatcher_facts(self, d: Dispatcher) -> DispatcherFacts:
        sf = self.span_facts.get(d.span)
        span = sf.record if sf is not None else None
        if span is None:
            claimed = any(
                self.span_facts[s].record.state is SpanState.REPLICATING
                for s in self.spans_naming(d.name)
                if s in self.span_facts
            )
        else:
            claimed = (
                (span.state is SpanState.REPLICATING or is_placement(span))
                and span.dispatcher == d.name
                and not span.deleting
            )
        return DispatcherFacts(
            record=d,
            span=d.span,
            capture=d.capture,
            table=self._pair(d.table_id, d.mode),
            deleting=d.deleting,
            orphan=span is None,
            unclaimed=not claimed,
            uid=d.uid,
            working=d.state is DispatcherState.WORKING,
            failed=d.failure is not None and not d.deleting,
            named=span is not None and span.dispatcher == d.name,
        )

    def _refresh_dispatcher(self, name: str) -> None:
        """Derive dispatcher ``name``'s facts afresh from the record it has (a span it depends on changed)."""
        facts = self.dispatcher_facts.get(name)
        if facts is not None:
            self._derive_dispatcher(name, facts.record)

    def _derive_dispatcher(self, name: str, d: Dispatcher | None) -> None:
        """Dispatcher ``name``'s record is ``d`` (None: deleted): its facts, and the indexes updated. Only what
        changed is touched (see ``_derive_span``)."""
        old = self.dispatcher_facts.get(name)
        f = self._dispatcher_facts(d) if d is not None else None
        if old == f:  # the same facts (compared without the record)
            if f is not None:
                self.dispatcher_facts[name] = f  # its record may be new: replaced in place
            return
        # Its entry in ``loose_by_span`` (the span it is of, while that span does not name it).
        was = old.span if old is not None and not old.named else None
        now = f.span if f is not None and not f.named else None
        if was != now:
            if was is not None:
                self.loose_by_span.discard(was, name)
            if now is not None:
                self.loose_by_span.add(now, name)
        if old is not None:
            if f is None or f.capture != old.capture:
                _discard(self.disp_by_capture, old.capture, name)  # type: ignore[arg-type]
            if f is None or f.table != old.table:
                _discard(self.disp_by_table, old.table, name)  # type: ignore[arg-type]
            if old.unclaimed and not (f is not None and f.unclaimed):
                self.unclaimed.discard(name)
            if old.orphan and not (f is not None and f.orphan):
                self.orphans.discard(name)
            if old.deleting and not (f is not None and f.deleting):
                self.deleting_dispatchers.discard(name)
            if old.failed and not (f is not None and f.failed):
                self.failed_dispatchers.discard(name)
        self._working_change(name, old, f)
        if f is None:
            self.dispatcher_facts.pop(name, None)
            return
        self.dispatcher_facts[name] = f
        if old is None or f.capture != old.capture:
            _add(self.disp_by_capture, f.capture, name)  # type: ignore[arg-type]
        if old is None or f.table != old.table:
            _add(self.disp_by_table, f.table, name)  # type: ignore[arg-type]
        if f.unclaimed:
            self.unclaimed.add(name)
        if f.orphan:
            self.orphans.add(name)
        if f.deleting:
            self.deleting_dispatchers.add(name)
        if f.failed:
            self.failed_dispatchers.add(name)

    def spans_naming(self, dispatcher: str) -> list[str]:
        """The spans whose status names ``dispatcher``: its own span, if that names it, and the foreign ones."""
        out = list(self.foreign_naming.get(dispatcher, ()))
        df = self.dispatcher_facts.get(dispatcher)
        sf = self.span_facts.get(df.span) if df is not None else None
        if sf is not None and sf.own and sf.dispatcher == dispatcher:
            out.append(df.span)  # type: ignore[union-attr]
        return out

    def dispatchers_of(self, span: str) -> list[str]:
        """The dispatchers of ``span`` (``Dispatcher.span``): the one its status names, if it is one, and the loose
        ones."""
        out = list(self.loose_by_span.get(span, ()))
        sf = self.span_facts.get(span)
        named = sf.record.dispatcher if sf is not None else ""
        df = self.dispatcher_facts.get(named) if named else None
        if df is not None and df.named and df.span == span:
            out.append(named)
        return out

    def _working_change(self, name: str, old: DispatcherFacts | None, new: DispatcherFacts | None) -> None:
        """Keep ``working`` current as dispatcher ``name`` goes from ``old`` to ``new``."""
        before = (old.capture, old.table[1], old.uid) if old is not None and old.working else None
        after = (new.capture, new.table[1], new.uid) if new is not None and new.working else None
        self.working.change(name, before, after)

    def lowest_reported(self, key: ReportKey, exclude: Collection[str] = ()) -> int | None:
        """The lowest value of the spans whose report group is ``key`` (not in ``exclude``)."""
        tracker = self.reported_checkpoints.get(key)
        return tracker.min_excluding(exclude) if tracker is not None else None

    # -- operators -----------------------------------------------------------------------------------

    def _put_operator(self, op: SpanOperator | None, name: str = "") -> None:
        name = op.name if op is not None else name
        if op is None:
            self.operators.pop(name, None)
        else:
            self.operators[name] = op
        self.in_flight.discard(name)
        self.running.discard(name)
        if op is None:
            return
        if op.in_flight:
            self.in_flight.add(name)
        if op.phase is OpPhase.RUNNING:
            self.running.add(name)
        self.gc.put(op)

    # -- coverage ------------------------------------------------------------------------------------

    def coverage_problems(self) -> set[TableKey]:
        """(table, mode) of live tables and enabled modes whose spans (new ones too: the coverage rule with
        ``new``, engine/coverage.py) do not partition the table's range exactly (a hole, an overlap, no span at
        all): the tables ``repair.coverage`` and the checkpoint's hole test look at. Recomputed for the tables
        events touched."""
        modes = self.modes()
        for key in self._coverage_dirty:
            tid, mode = key
            self._coverage_problems.discard(key)
            if not self.table_live(tid) or mode not in modes:
                continue
            spans = (self.span_facts[n].record for n in self.spans_by_table.get(key, ()))
            if not coverage.exact(KeyRange.of_table(tid), spans, new=True):
                self._coverage_problems.add(key)
        self._coverage_dirty.clear()
        return self._coverage_problems
