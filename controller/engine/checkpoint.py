"""The changefeed checkpoint: the ts up to which every span of every live table has been delivered.

It is the minimum, over the spans of live tables (and of tables not seen yet: a Span can be seen before its
Table), of what is known for each:

- a Replicating span: the best of its dispatcher's persisted checkpoint (written when it became
  Working), the span's persisted one, and the minimum its capture reported for a set of dispatchers
  that is exactly the set the maintainer believes it runs (``engine/progress.py``);
- any other span: its persisted checkpoint (the start ts it will be replicated from);
- a span some in-flight Add, Move, Split or Merge owns: also the operator's recorded checkpoint (the
  ts its new dispatchers start from), which holds the changefeed back while the span is in flight.
- a table joining (``Changefeed.status.joining``: its first spans are being created, perhaps by a deposed
  maintainer, unseen here): the join's start, until the table's spans cover it (engine/tables.py).

It never goes backwards: a lower minimum (cannot happen unless a span is created below the
checkpoint, which the engine never does) leaves the published value where it is.
"""

from __future__ import annotations

from collections import defaultdict

from controller.engine import coverage, progress
from controller.engine.world import Tick
from controller.model.keys import KeyRange
from controller.model.records import Join, Span, SpanOperator
from controller.model.states import DispatcherState, Mode, OpPhase, OpType, SpanState


def compute(tick: Tick) -> int:
    if tick.index is not None:
        return _incremental(tick)
    low: int | None = None

    def lower(value: int) -> None:
        nonlocal low
        low = value if low is None else min(low, value)

    reported = progress.covered(tick)
    for span in tick.spans.values():
        if span.state in (None, SpanState.INVALID) or not tick.table_holds_checkpoint(span.table_id):
            continue
        if not tick.mode_enabled(span.mode):
            continue
        d = tick.dispatchers.get(span.dispatcher) if span.dispatcher else None
        if span.state is SpanState.REPLICATING and d is not None and d.state is DispatcherState.WORKING:
            lower(max(d.known_checkpoint, span.known_checkpoint, reported.get(d.name, 0)))
        else:
            lower(span.known_checkpoint)
    for op in tick.operators.values():
        if op.phase is OpPhase.RUNNING and op.type is not OpType.REMOVE:
            if any(tick.table_holds_checkpoint(s.table_id) for s in (tick.spans.get(n) for n in op.spans) if s):
                lower(op.checkpoint_ts)
            for t in op.targets:
                if not t.done and t.start_ts:
                    lower(t.start_ts)
    for join in _joins(tick):
        lower(join.start_ts)
    previous = tick.checkpoint_floor
    if low is None or _has_hole(tick):
        return previous
    return max(previous, low)


def _joins(tick: Tick) -> list[Join]:
    """Tables whose first spans are being created (``Changefeed.status.joining``, and those this decision adds):
    their spans start no lower than the join says, and may not be in this view yet (a deposed maintainer's),
    so the join holds the checkpoint until the table's spans cover it."""
    return [*tick.changefeed.joining, *tick.joins_wanted.values()]


def _has_hole(tick: Tick, keys: set[tuple[int, Mode]] | None = None) -> bool:
    """Keys of a live table that no accepted span (nor an operator's planned span) covers.

    Their data is replicated by nobody, so nothing bounds how far they are delivered: the checkpoint
    must not move until the safety net has covered them again. ``keys``: only these tables (and modes) can
    have one (an incremental decision); None: look at all. The coverage rule
    (engine/coverage.py) with the planned ranges of the operators as this decision leaves them, and without
    new spans (their data is replicated from nothing known yet).
    """
    spans: dict[tuple[int, Mode], list[Span]] = defaultdict(list)
    planned: dict[tuple[int, Mode], list[KeyRange]] = defaultdict(list)
    if keys is None or tick.index is None:
        pool: list[Span] = list(tick.spans.values())
        ops: list[SpanOperator] = list(tick.operators.values())
    else:
        pool = tick.span_candidates(*(tick.index.spans_by_table.get(k, ()) for k in keys))
        ops = tick.in_flight()
    for span in pool:
        spans[(span.table_id, span.mode)].append(span)
    for op in ops:
        if op.phase is OpPhase.RUNNING and op.type in (OpType.SPLIT, OpType.MERGE):
            for t in op.targets:
                s = tick.spans.get(t.span) or tick.world.spans.get(op.spans[0]) if op.spans else None
                if s is not None:
                    planned[(s.table_id, s.mode)].append(t.key_range)
    if keys is None:
        tables = list(tick.tables_by_id.values())
    else:
        tables = [t for t in (tick.tables_by_id.get(tid) for tid in {k[0] for k in keys}) if t is not None]
    for table in tables:
        if table.deleting or table.changefeed != tick.changefeed.name:
            continue
        for mode in tick.changefeed.modes:
            key = (table.table_id, mode)
            if keys is not None and key not in keys:
                continue
            if coverage.holes(table.key_range, spans.get(key, ()), planned.get(key, ())):
                return True
    return False


def _span_value(tick: Tick, span: Span, reports: dict[tuple[str, Mode], int]) -> int | None:
    """What one span contributes to the minimum (None: nothing), as ``compute`` counts it; ``reports``:
    ``progress.group_reports``."""
    if span.state in (None, SpanState.INVALID) or not tick.table_holds_checkpoint(span.table_id):
        return None
    if not tick.mode_enabled(span.mode):
        return None
    d = tick.dispatchers.get(span.dispatcher) if span.dispatcher else None
    if span.state is SpanState.REPLICATING and d is not None and d.state is DispatcherState.WORKING:
        # A report is about the dispatchers of the snapshot: it covers ``d`` if the snapshot's ``d`` is one of
        # the Working dispatchers of its capture the report covers exactly.
        seen = tick.world.dispatchers.get(d.name)
        reported = 0
        if seen is not None and seen.state is DispatcherState.WORKING and seen.changefeed == tick.changefeed.name:
            reported = reports.get((seen.capture, seen.mode), 0)
        return max(d.known_checkpoint, span.known_checkpoint, reported)
    return span.known_checkpoint


def _incremental(tick: Tick) -> int:
    """``compute`` from the index: the lowest span value it keeps (engine/index.py), per group of spans a
    capture's progress report may raise (max(lowest, the report's minimum) for a report that covers its
    capture's Working dispatchers exactly), with the spans this decision changed (or whose dispatcher it
    changed) taken as they are now; in-flight operators as ``compute``; and holes only where the index or
    this decision says a table may have one."""
    index = tick.index
    assert index is not None
    changed = set(tick.spans.changed)
    for d in tick.dispatchers.changed:
        changed.update(index.spans_naming(d))
    reports = progress.group_reports(tick)
    values = [index.checkpoints.min_excluding(changed)]
    for key in index.reported_checkpoints:
        low = index.lowest_reported(key, changed)
        if low is not None:
            values.append(max(low, reports[key]) if key in reports else low)
    values += [_span_value(tick, s, reports) for s in (tick.spans.get(n) for n in changed) if s is not None]
    for op in tick.in_flight():
        if op.phase is OpPhase.RUNNING and op.type is not OpType.REMOVE:
            if any(tick.table_holds_checkpoint(s.table_id) for s in (tick.spans.get(n) for n in op.spans) if s):
                values.append(op.checkpoint_ts)
            for t in op.targets:
                if not t.done and t.start_ts:
                    values.append(t.start_ts)
    values += [join.start_ts for join in _joins(tick)]
    known = [v for v in values if v is not None]
    previous = tick.checkpoint_floor
    if not known:
        return previous
    # Holes: tables whose spans may not partition their range, those with unvalidated spans (not counted
    # as covering), those whose spans changed now.
    keys = set(index.coverage_problems()) | tick.coverage_changed()
    keys.update((s.table_id, s.mode) for s in (tick.world.spans[n] for n in index.by_state[None]))
    if _has_hole(tick, keys):
        return previous
    return max(previous, min(known))
