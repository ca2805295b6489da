"""Repair: the rules that explain every object no operator explains. Run at bootstrap and every tick.

A restored maintainer and a running one are the same code: there is no separate "recovery mode",
only these level-triggered rules, applied to whatever no in-flight operator owns.

1. New spans (no status yet and no placement recorded at their create: user-applied, or left by a crash
   between create and status write) are validated: inside their table's range, of an enabled mode,
   overlapping no accepted span. They become Absent, or Invalid with a reason; an invalid span touches
   nothing else.
2. Spans: Replicating whose dispatcher is missing, closed, deleting or on a lost capture -> Absent;
   a placement in flight (Scheduling, no operator, its destination recorded: placement.py) is driven
   one step; Scheduling/Removing whose operator is gone -> Replicating if their dispatcher is Working,
   else Absent; Absent with a Working dispatcher that matches exactly -> adopted (Replicating), not
   duplicated.
3. Dispatchers no span claims (no span, a deleted span, a duplicate for a span that names another)
   are deleted; on a lost capture their finalizer is released too, once its Lease was taken (it cannot resume).
4. Coverage: a live table with no spans gets its initial spans (pre-split policy), placed at once
   when a capture can take them (whole tables, up to ``basicBatchSize`` new spans a decision, at
   least one table); a hole in a table's coverage (engine/coverage.py: new spans and the ranges of in-flight
   Splits and Merges count as covering) gets a span; an overlap no operator explains is
   resolved by removing the newer span; spans of a disabled mode or an unknown table are removed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from controller.engine import controller, naming, placement
from controller.engine import coverage as coverage_rule
from controller.engine.intents import ConfirmPresent, Write
from controller.engine.operators.common import set_span
from controller.engine.tables import join_of, joined
from controller.engine.world import Tick, is_placement
from controller.model import resources as conv
from controller.model.keys import KeyError_, KeyRange, overlapping_pairs, table_id_of
from controller.model.ordering import in_order
from controller.model.records import Dispatcher, Span, SpanOperator, Table
from controller.model.states import (
    DISPATCHER_FINALIZER,
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
)

#: The Table CRD's maximum for spec.preSplit.spans (crds/tables.yaml); the engine never cuts finer.
MAX_PRE_SPLIT = 1024
#: The reason of the Remove that resolves an overlap no operator explains (the simulator checks its premise).
OVERLAP_REASON = "overlap no operator explains"


def run(tick: Tick) -> None:
    validate_new_spans(tick)
    repair_spans(tick)
    repair_dispatchers(tick)


def _owned_dispatchers(tick: Tick) -> set[str]:
    names: set[str] = set()
    if tick.index is None:
        ops = [*tick.world.operators.values(), *tick.operators.values()]
    else:  # only Running operators count: those of the snapshot, and those this decision changed
        ops = [tick.world.operators[n] for n in tick.index.running]
        ops += [o for o in (tick.operators.get(n) for n in tick.operators.changed) if o is not None]
    for op in ops:
        if op.phase is OpPhase.RUNNING:
            names.update(o.dispatcher for o in op.origins)
            names.update(t.dispatcher for t in op.targets if t.dispatcher)
    return names


def _planned_ranges(tick: Tick) -> tuple[dict[tuple[int, Mode], list[KeyRange]], set[int]]:
    """Ranges that in-flight operators will create (split children, merged spans), per table and mode; and the
    tables of in-flight operators of which the view shows no span at all (neither an old one nor a new one).

    Such an operator's table and mode are known only from its spans, and the view showing none of them does not
    mean they are gone: its own deletes took the old ones out of the view at once, while the new ones another
    maintainer created (a deposed one driving the same operator) may not have arrived yet. Its keys are then
    neither covered nor planned in this view, and a hole fill there would create the old span's range again under
    its old name. Those tables wait (their table is read from the targets' keys)."""
    planned: dict[tuple[int, Mode], list[KeyRange]] = defaultdict(list)
    unseen: set[int] = set()
    if tick.index is not None:
        names = tick.in_flight_names()
    else:
        names = set(tick.operators) | set(tick.world.operators)
    for name in in_order(names, key=str):
        # As this decision leaves it, or as the snapshot had it: an operator this decision ends (its new spans
        # given up as deleted by hand) still plans its keys until that end, and the read it rests on, land.
        op = tick.operators.get(name)
        if op is None or op.phase is not OpPhase.RUNNING:
            op = tick.world.operators.get(name)
        if op is None or op.phase is not OpPhase.RUNNING or op.type not in (OpType.SPLIT, OpType.MERGE):
            continue
        template = next((tick.world.spans[s] for s in op.spans if s in tick.world.spans), None)
        if template is None:
            template = next((tick.world.spans[t.span] for t in op.targets if t.span in tick.world.spans), None)
        if template is not None:
            planned[(template.table_id, template.mode)].extend(t.key_range for t in op.targets)
        elif not tick.mutant("fills-a-hole-an-unseen-operator-plans"):
            unseen.update(tid for tid in (table_id_of(t.key_range) for t in op.targets) if tid is not None)
    for ranges in planned.values():
        ranges.sort()
    return planned, unseen


# -- 1. new spans --------------------------------------------------------------------------------


def validate_new_spans(tick: Tick) -> None:
    if tick.changefeed.deleting:
        return  # torn down: a new span is accepted by no one, and the teardown's Removes take it as it is
    pool = tick.span_candidates(tick.index.by_state[None]) if tick.index is not None else tick.spans.values()
    new = in_order(
        (s for s in pool if s.state is None and not s.deleting and not tick.busy(s.name)),
        key=lambda s: (s.created, s.name),
    )
    if not new:
        return
    # The ranges a new span may not overlap: spans validated or owned by an operator, and planned ones.
    claimed: dict[tuple[int, Mode], list[tuple[str, KeyRange]]] = defaultdict(list)
    if tick.index is None:
        others: list[Span] = list(tick.spans.values())
    else:  # only the tables (and modes) of the new spans are asked about
        keys = {(s.table_id, s.mode) for s in new}
        others = tick.span_candidates(*(tick.index.spans_by_table.get(k, ()) for k in keys))
    for s in in_order(others, key=lambda s: s.name):
        # A span an operator owns is taken even before its status is written (a split child, or a
        # span re-created under the name an in-flight Add still targets).
        taken = s.state is not None or tick.busy(s.name)
        if taken and s.state is not SpanState.INVALID and not s.deleting:
            claimed[(s.table_id, s.mode)].append((s.name, s.key_range))
    for key, ranges in _planned_ranges(tick)[0].items():
        claimed[key].extend(("(planned)", r) for r in ranges)
    for span in new:
        table = tick.tables_by_id.get(span.table_id)
        if table is not None and table.deleting:
            continue  # the table's Remove takes it
        problem = _span_problem(tick, span, table, claimed[(span.table_id, span.mode)])
        if problem:
            new_span = replace(span, state=SpanState.INVALID, message=problem)
            tick.emit(
                f"span {span.name} invalid",
                [tick.write_status(new_span), tick.event(new_span, "SpanRejected", problem, warning=True)],
            )
            continue
        claimed[(span.table_id, span.mode)].append((span.name, span.key_range))
        cp = max(span.start_ts, tick.checkpoint_floor, table.start_ts if table else 0)
        tick.emit(f"span {span.name} accepted", set_span(tick, span, state=SpanState.ABSENT, checkpoint_ts=cp))


def _span_problem(tick: Tick, span: Span, table: Table | None, claimed: list[tuple[str, KeyRange]]) -> str:
    if table is None or table.changefeed != tick.changefeed.name:
        return f"table ID {span.table_id} is not a table of changefeed {tick.changefeed.name!r}"
    if not tick.mode_enabled(span.mode):
        return f"mode {span.mode} is not enabled for changefeed {tick.changefeed.name!r} (spec.redo is false)"
    if not table.key_range.contains_range(span.key_range):
        return f"range {span.key_range} is outside table {table.name!r} range {table.key_range}"
    for name, rng in claimed:
        if rng.overlaps(span.key_range):
            return f"range {span.key_range} overlaps span {name!r} {rng}"
    return ""


# -- 2. spans ------------------------------------------------------------------------------------


def _usable(tick: Tick, d: Dispatcher | None) -> bool:
    return d is not None and not d.deleting and d.state is DispatcherState.WORKING and tick.capture_alive(d.capture)


def repair_spans(tick: Tick) -> None:
    orphans: dict[tuple[int, Mode, KeyRange], list[Dispatcher]] = defaultdict(list)
    owned_d = _owned_dispatchers(tick)
    if tick.index is None:
        pool: list[Span] = list(tick.spans.values())
        disp_pool: list[Dispatcher] = list(tick.dispatchers.values())
    else:
        # Candidates: every span not Replicating, the Replicating ones whose dispatcher is not a Working
        # one of theirs, and those on (or naming a dispatcher on) a capture that is not alive.
        lost_spans, _ = tick.on_lost_captures()
        by_state = tick.index.by_state
        pool = tick.span_candidates(
            by_state[SpanState.ABSENT],
            by_state[SpanState.SCHEDULING],
            by_state[SpanState.REMOVING],
            () if tick.mutant("incremental-skips-suspect-spans") else tick.index.suspect,
            lost_spans,
        )
        disp_pool = tick.dispatcher_candidates(tick.index.orphans)
    for x in in_order(disp_pool, key=lambda d: (d.created, d.name)):
        if x.name not in owned_d and x.span not in tick.spans and _usable(tick, x):
            orphans[(x.table_id, x.mode, x.key_range)].append(x)
    for span in in_order(pool, key=lambda s: s.name):
        if tick.busy(span.name) or span.deleting or tick.is_touched(span) or span.state is None:
            continue
        d = tick.dispatchers.get(span.dispatcher) if span.dispatcher else None
        if span.state is SpanState.REPLICATING:
            if _usable(tick, d) and d is not None and _belongs(tick, d, span):
                continue
            why = "its dispatcher is gone" if d is None else f"its dispatcher {d.name} is {d.state or 'lost'}"
            _absent(tick, span, d, f"span {span.name} was Replicating but {why}")
        elif is_placement(span):
            if tick.table_live(span.table_id) and tick.mode_enabled(span.mode):
                tick.emit(f"place {span.name}", placement.advance(tick, span))
            else:
                # Table deleted (or mode disabled) mid-placement: given up, as an Add is canceled, so that its
                # in-flight slot goes to the Remove that takes the span (and closes what was made for it).
                tick.emit(f"place {span.name} canceled", placement.cancel(tick, span))
        elif span.state in (SpanState.SCHEDULING, SpanState.REMOVING):
            if (
                span.state is SpanState.SCHEDULING
                and _usable(tick, d)
                and d is not None
                and _belongs(tick, d, span)
                and tick.table_live(span.table_id)
            ):
                tick.repairs.append(f"span {span.name}: operator gone, dispatcher {d.name} Working -> Replicating")
                tick.emit(
                    f"span {span.name} settle",
                    set_span(tick, span, state=SpanState.REPLICATING, operator="", capture=d.capture),
                )
            elif tick.table_live(span.table_id):
                _absent(tick, span, d, f"span {span.name} was {span.state} with no operator")
        elif span.state is SpanState.ABSENT and tick.table_live(span.table_id):
            mine = [x for x in tick.dispatchers_of_span(span.name) if _usable(tick, x)]
            candidates = mine or orphans.get((span.table_id, span.mode, span.key_range), [])
            if candidates:
                chosen = candidates[0]
                if chosen in orphans.get((span.table_id, span.mode, span.key_range), []):
                    orphans[(span.table_id, span.mode, span.key_range)].remove(chosen)
                tick.repairs.append(f"span {span.name}: adopted Working dispatcher {chosen.name}")
                tick.emit(
                    f"span {span.name} adopt",
                    set_span(
                        tick,
                        span,
                        state=SpanState.REPLICATING,
                        capture=chosen.capture,
                        dispatcher=chosen.name,
                        checkpoint_ts=max(span.checkpoint_ts, chosen.known_checkpoint),
                    ),
                )


def _belongs(tick: Tick, d: Dispatcher, span: Span) -> bool:
    """``d`` replicates ``span``: it names it, or it is an orphan adopted for exactly its keys."""
    if d.span == span.name:
        return True
    return d.span not in tick.spans and (d.table_id, d.mode, d.key_range) == (span.table_id, span.mode, span.key_range)


def _absent(tick: Tick, span: Span, d: Dispatcher | None, why: str) -> None:
    tick.repairs.append(why)
    cp = max(span.checkpoint_ts, d.known_checkpoint if d is not None and _belongs(tick, d, span) else 0)
    writes: list[Write] = list(
        set_span(tick, span, state=SpanState.ABSENT, capture="", dispatcher="", operator="", checkpoint_ts=cp)
    )
    tick.emit(f"span {span.name} absent", writes)


# -- 3. dispatchers ------------------------------------------------------------------------------


def repair_dispatchers(tick: Tick) -> None:
    owned_d = _owned_dispatchers(tick)
    if tick.index is None:
        pool = list(tick.dispatchers.values())
    else:  # those no span claims, those being deleted, those on a capture that is not alive
        _, lost = tick.on_lost_captures()
        pool = tick.dispatcher_candidates(tick.index.unclaimed, tick.index.deleting_dispatchers, lost)
    for d in in_order(pool, key=lambda d: d.name):
        if d.name in owned_d or tick.busy(d.span) or tick.is_touched(d):
            continue
        if d.deleting:
            if not tick.capture_alive(d.capture) and DISPATCHER_FINALIZER in d.finalizers:
                tick.emit(f"release {d.name}", tick.close_dispatcher(d))
            continue
        span = tick.spans.get(d.span)
        if span is None:
            # Claimed by exact match through adoption (span named differently)?
            claimer = _claimer(tick, d)
            if claimer is None:
                if tick.mutant("bootstrap-skips-orphan-dispatchers"):
                    continue
                tick.repairs.append(f"dispatcher {d.name}: its span {d.span} does not exist")
                tick.emit(f"orphan {d.name}", tick.close_dispatcher(d))
            continue
        claimed = (
            (span.state is SpanState.REPLICATING or is_placement(span))
            and span.dispatcher == d.name
            and not span.deleting
        )
        if claimed and _usable(tick, d):
            continue
        if claimed:
            continue  # a Replicating span still names it: repair_spans decides about that span first
        tick.repairs.append(f"dispatcher {d.name}: span {span.name} does not claim it")
        tick.emit(f"unclaimed {d.name}", tick.close_dispatcher(d))


def _claimer(tick: Tick, d: Dispatcher) -> Span | None:
    if tick.index is None:
        pool: list[Span] = list(tick.spans.values())
    else:
        pool = tick.span_candidates(tick.index.spans_naming(d.name))
    for s in in_order(pool, key=lambda s: s.name):
        if s.dispatcher == d.name and s.state is SpanState.REPLICATING:
            return s
    return None


# -- 4. coverage ---------------------------------------------------------------------------------


def coverage(tick: Tick) -> None:
    by_table: dict[tuple[int, Mode], list[Span]] = defaultdict(list)
    stray: list[Span] = []
    wanted: set[tuple[int, Mode]] | None = None  # the (table, mode) to look at; None: all of them
    if tick.index is None:
        pool: list[Span] = list(tick.spans.values())
    else:
        # Tables (and modes) whose spans may not partition their range, and those whose spans changed now.
        wanted = set(tick.index.coverage_problems()) | tick.coverage_changed()
        pool = tick.span_candidates(tick.index.stray, *(tick.index.spans_by_table.get(k, ()) for k in wanted))
    for s in in_order(pool, key=lambda s: s.name):
        if not coverage_rule.counts(s, new=True):
            continue
        table = tick.tables_by_id.get(s.table_id)
        if table is None or table.changefeed != tick.changefeed.name or not tick.mode_enabled(s.mode):
            if s.state is not None and not tick.busy(s.name):
                stray.append(s)
            continue
        if not table.deleting:
            by_table[(s.table_id, s.mode)].append(s)
    planned, unseen = _planned_ranges(tick)
    # New tables' spans, whole tables at a time, up to basicBatchSize a decision (at least one table): they
    # are placed as they are created, and a decision's writes must stay a batch, not the whole changefeed.
    initial_left = tick.changefeed.scheduler.basic_batch_size
    if wanted is None:
        tables = list(tick.tables_by_id.values())
    else:
        tables = [t for t in (tick.tables_by_id.get(tid) for tid in {k[0] for k in wanted}) if t is not None]
    for table in sorted(tables, key=lambda t: t.table_id):
        if table.deleting or table.changefeed != tick.changefeed.name:
            continue
        for mode in tick.changefeed.modes:
            if wanted is not None and (table.table_id, mode) not in wanted:
                continue
            if table.table_id in unseen:
                tick.coverage_deferred = True  # an operator the view cannot place plans some of these keys
                continue
            spans = by_table.get((table.table_id, mode), [])
            plans = planned.get((table.table_id, mode), [])
            if not spans and not plans:
                if initial_left <= 0:
                    tick.coverage_deferred = True  # next decision (which this decision's writes wake)
                    continue
                if not joined(tick, table) and not tick.mutant("spans-before-the-join"):
                    # First the join, on the Changefeed (engine/tables.py): the spans come once the view shows it.
                    tick.joins_wanted.setdefault(table.name, join_of(tick, table))
                    tick.coverage_deferred = True
                    initial_left -= len(_initial_ranges(table)[0])
                    continue
                initial_left -= _initial_spans(tick, table, mode)
                continue
            for hole in coverage_rule.holes(table.key_range, spans, plans, new=True):
                # Cut as the pre-split would have: a term that ended while it created a table's first spans
                # leaves one hole where the pre-split asked for many spans.
                cut = _pre_split_cut(table, hole)
                tick.repairs.append(f"table {table.name} ({mode}): hole {hole} filled with {len(cut)} Absent span(s)")
                for piece in cut:
                    _new_span(tick, table, mode, piece)
            _resolve_overlaps(tick, spans)
    if stray:
        _remove_spans(tick, stray, "span of an unknown table or a disabled mode")


def _pre_split_keys(table: Table) -> tuple[bytes, ...]:
    """The keys ``table``'s preSplit cuts its range at (none without one); KeyError_ for keys that cannot."""
    rng = table.key_range
    if table.pre_split_keys:
        rng.split_at(table.pre_split_keys)  # raises for keys not strictly increasing inside the table
        return tuple(table.pre_split_keys)
    if table.pre_split_spans > 1:
        return rng.even_split_keys(min(table.pre_split_spans, MAX_PRE_SPLIT))
    return ()


def _pre_split_cut(table: Table, hole: KeyRange) -> tuple[KeyRange, ...]:
    """``hole`` (part of ``table``'s range) cut at the preSplit keys inside it; whole if the preSplit is bad."""
    try:
        return hole.split_at([k for k in _pre_split_keys(table) if hole.start < k < hole.end])
    except KeyError_:
        return (hole,)


def _initial_ranges(table: Table) -> tuple[tuple[KeyRange, ...], str]:
    """``table``'s first spans' ranges (its pre-split), and why its preSplit was ignored ("" if it was not)."""
    rng = table.key_range
    try:
        return rng.split_at(_pre_split_keys(table)), ""
    except KeyError_ as exc:
        return (rng,), str(exc)


def _initial_spans(tick: Tick, table: Table, mode: Mode) -> int:
    """Create ``table``'s first spans in ``mode`` (its pre-split); returns how many."""
    ranges, ignored = _initial_ranges(table)
    if ignored:
        tick.emit(
            f"table {table.name} presplit",
            [tick.event(table, "PreSplitIgnored", f"spec.preSplit ignored: {ignored}", warning=True)],
        )
    for r in ranges:
        _new_span(tick, table, mode, r)
    return len(ranges)


def _new_span(tick: Tick, table: Table, mode: Mode, rng: KeyRange) -> None:
    """Create a span for ``rng`` (initial spans, a hole), placed at once if a capture can take it: create it
    with the placement recorded, create the dispatcher (``placement.create_placed``); else created Absent."""
    start = max(tick.checkpoint_floor, table.start_ts)
    span = Span(
        name=naming.span_name(tick.changefeed.name, table.table_id, mode, rng),
        namespace=table.namespace,
        changefeed=tick.changefeed.name,
        table_id=table.table_id,
        mode=mode,
        key_range=rng,
        start_ts=start,
        created=tick.now,
        labels=conv.span_labels(tick.changefeed.name, table.table_id),
    )
    existing = tick.spans.get(span.name)
    if existing is not None:
        # The hole's deterministic name is taken by a span refused earlier (it overlapped something
        # that is gone now, e.g. a deposed maintainer's span): it fits exactly, so accept it. Otherwise
        # the hole could never be filled.
        if existing.state is SpanState.INVALID and existing.key_range == rng and not existing.deleting:
            tick.emit(
                f"span {existing.name} re-accepted",
                set_span(tick, existing, state=SpanState.ABSENT, message="", checkpoint_ts=start),
            )
        return
    # Within the in-flight limit only: the batch is counted in spans created (whole tables, coverage above),
    # and a span created now and placed later would cost a write more.
    room = placement.room(tick, batch=False)
    capture = placement.destination(tick) if not tick.schedulers_stopped and room > 0 else ""
    placed = placement.create_placed(tick, span, capture) if capture else []
    if placed:
        tick.emit(f"span {span.name} new", placed)
        return
    accepted = replace(span, state=SpanState.ABSENT, checkpoint_ts=start)
    tick.emit(f"span {span.name} new", [tick.create(span), tick.write_status(accepted)])


def _resolve_overlaps(tick: Tick, spans: list[Span]) -> None:
    free = [s for s in spans if not tick.busy(s.name) and s.state is not None]
    if len(free) < 2:
        return
    pairs = overlapping_pairs([(s.name, s.key_range) for s in free])
    if not pairs:
        return
    by_name = {s.name: s for s in free}
    doomed: set[str] = set()
    kept: set[str] = set()
    for a, b in pairs:
        if a in doomed or b in doomed:
            continue
        sa, sb = by_name[a], by_name[b]
        newer = max(sa, sb, key=lambda s: (s.created, s.name))
        doomed.add(newer.name)
        kept.add(a if newer is sb else b)
    victims = [by_name[n] for n in sorted(doomed)]
    tick.repairs.append(f"overlapping spans removed: {', '.join(s.name for s in victims)}")
    # Each span kept is read again first: one deleted since (by a person, by another maintainer) may still be in a
    # view whose watch delivers late, and the overlap it makes is not there.
    confirm = [ConfirmPresent(Kind.SPAN, n, by_name[n].uid) for n in sorted(kept - doomed)]
    _remove_spans(tick, victims, OVERLAP_REASON, confirm)


def _remove_spans(tick: Tick, spans: list[Span], reason: str, confirm: Sequence[Write] = ()) -> None:
    names = tuple(sorted(s.name for s in spans if not tick.busy(s.name)))
    if not names:
        return
    basis = tuple(tick.spans[n].resource_version for n in names)
    op = SpanOperator(
        name=naming.operator_name(OpType.REMOVE, names, basis),
        namespace=spans[0].namespace,
        changefeed=tick.changefeed.name,
        type=OpType.REMOVE,
        spans=names,
        delete_spans=True,
        source=OpSource.MAINTAINER,
        reason=reason,
        created=tick.now,
        labels=conv.changefeed_labels(tick.changefeed.name),
    )
    if op.name in tick.operators:
        return
    controller.admit(tick, op, create=True, confirm=confirm)
