"""Deleting a Changefeed: replication stops, and everything the changefeed was made of goes with it.

A live Changefeed carries the finalizer ``cdc.maintainer.dev/teardown``, so that deleting it waits for
this teardown (level-triggered, like everything else: a maintainer killed half-way resumes it)::

    deleting --every in-flight operator Canceled (ChangefeedDeleted); per table one Remove with
             | deleteSpans (the Remove of a deleted Table, the same code): dispatchers closed by
             | their captures (released by the maintainer on a lost capture), then spans deleted
             v
    no span and no dispatcher left --every SpanOperator deleted; every Table of the changefeed
             | detached (status Detached, its finalizer released: it stays, it is the user's)
             v
    no operator left, no Table finalizer --the changefeed's finalizer released--> gone

Nothing new starts while it runs: no scheduler, no coverage (a hole is not refilled), no user
operator admitted. What stays: the Tables (they are what the user declared; a Changefeed re-created
under the same name picks them up again, from its own ``startTs``) and the Events. The Lease
``cfm-<changefeed>`` and the objects the maintainer created carry an ownerReference to the Changefeed
(``controller.kube.executor``), so Kubernetes' garbage collector removes what is left if the finalizer
is taken off by hand while no maintainer runs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from controller.engine import controller, tables
from controller.engine.intents import (
    AddFinalizer,
    Chain,
    ConfirmNoneLeft,
    Delete,
    RemoveFinalizer,
    Write,
    WriteStatus,
)
from controller.engine.operators.common import cancel
from controller.engine.world import Options, Tick
from controller.model.ordering import in_order
from controller.model.records import Dispatcher, Record, Span, SpanCounts, SpanOperator, Table
from controller.model.states import CHANGEFEED_FINALIZER, TABLE_FINALIZER, Kind, OpSource, OpType

#: Table.status.state of a Table whose changefeed was deleted.
DETACHED = "Detached"


def ensure_finalizer(tick: Tick) -> None:
    cf = tick.changefeed
    if not cf.deleting and CHANGEFEED_FINALIZER not in cf.finalizers:
        tick.emit("changefeed finalizer", [AddFinalizer(Kind.CHANGEFEED, cf.name, CHANGEFEED_FINALIZER)])


def _ours(op: SpanOperator) -> bool:
    return op.type is OpType.REMOVE and op.delete_spans and op.source is OpSource.MAINTAINER


def run(tick: Tick) -> str:
    """One teardown step (the caller has advanced the Running operators already); returns what is left,
    for the ``Deleting`` condition."""
    cf = tick.changefeed
    world = tick.world
    message = f"changefeed {cf.name} was deleted; replication stops"
    for op in tick.in_flight():
        if not _ours(op):
            tick.emit(f"cancel {op.name}", [cancel(tick, op, "ChangefeedDeleted", message)])
    by_table: dict[int, list[str]] = {}
    for s in tick.spans.values():
        if not s.deleting:
            by_table.setdefault(s.table_id, []).append(s.name)
    for table_id, names in sorted(by_table.items()):
        tables.remove_spans(
            tick,
            in_order(names, key=None),
            basis=f"{cf.uid}/{table_id}",
            why=f"changefeed {cf.name} deleted",
            cancel=("ChangefeedDeleted", message),
        )
    controller.admit_pending(tick)
    spans, dispatchers = len(world.spans), len(world.dispatchers)
    operators = [op for op in world.operators.values() if not op.deleting]
    detach = [t for t in world.tables.values() if t.changefeed == cf.name and TABLE_FINALIZER in t.finalizers]
    if tick.mutant("tables-never-detached"):
        detach = []
    if tick.mutant("teardown-releases-early") and CHANGEFEED_FINALIZER in cf.finalizers:
        tick.emit("changefeed released", [RemoveFinalizer(Kind.CHANGEFEED, cf.name, CHANGEFEED_FINALIZER)])
    if not spans and not dispatchers:
        for op in sorted(operators, key=lambda o: o.name):
            if not tick.is_touched(op):
                tick.emit(f"delete {op.name}", [Delete(Kind.OPERATOR, op.name, op.uid)])
        for table in sorted(detach, key=lambda t: t.name):
            tick.chains.append(_detach(table, tick.options))
        if not operators and not detach and CHANGEFEED_FINALIZER in cf.finalizers:
            # Released only after a consistent read confirms what this view says (ConfirmNoneLeft).
            release = RemoveFinalizer(Kind.CHANGEFEED, cf.name, CHANGEFEED_FINALIZER)
            tick.emit("changefeed released", [ConfirmNoneLeft(cf.name), release])
    return f"removing {spans} span(s), {dispatchers} dispatcher(s) and {len(operators)} operator(s)"


def left_behind(records: Iterable[Record], changefeed: str) -> list[Record]:
    """What of ``changefeed`` its teardown must remove before it releases the Changefeed: every Span and
    Dispatcher (deleting or not), every SpanOperator not being deleted, every Table still holding the
    maintainer's finalizer. The same rule as ``run``'s, over what a consistent read of the API returned
    (``ConfirmNoneLeft``, applied by the executors)."""
    left: list[Record] = []
    for r in records:
        if getattr(r, "changefeed", None) != changefeed:
            continue
        if isinstance(r, Span | Dispatcher) or (
            (isinstance(r, SpanOperator) and not r.deleting)
            or (isinstance(r, Table) and TABLE_FINALIZER in r.finalizers)
        ):
            left.append(r)
    return left


#: The kinds ``left_behind`` looks at, in the order an executor reads them.
LEFT_BEHIND_KINDS = (Kind.SPAN, Kind.DISPATCHER, Kind.OPERATOR, Kind.TABLE)


def detached(table: Table) -> Table:
    """``table`` as its changefeed's teardown leaves it: Detached, and counting no span (none of them
    exists any more). The forced teardown of ``kubectl changefeed teardown`` writes the same status."""
    text = f"changefeed {table.changefeed} was deleted; this table is replicated by no changefeed"
    return table.evolve(state=DETACHED, message=text, span_counts=SpanCounts())


def _detach(table: Table, options: Options | None = None) -> Chain:
    writes: list[Write] = []
    target = detached(table)
    if options is not None and "detached-table-keeps-counts" in options.mutants:
        target = target.evolve(span_counts=table.span_counts)
    if not table.deleting and (table.state, table.message, table.span_counts) != (
        target.state,
        target.message,
        target.span_counts,
    ):
        writes.append(WriteStatus(target))
    writes.append(RemoveFinalizer(Kind.TABLE, table.name, TABLE_FINALIZER))
    return Chain(tuple(writes), f"table {table.name} detached")


def detach_orphans(
    tables: Iterable[Table], changefeeds: Collection[str], options: Options | None = None
) -> list[Chain]:
    """Tables still holding the maintainer's finalizer although their changefeed does not exist.

    The teardown detaches the Tables of a changefeed it removes. But a Changefeed deleted before its
    first decisions added its own finalizer vanishes at once, with no teardown, possibly after its Tables
    got theirs: they would then wait forever for a maintainer that no longer runs for them. The
    maintainer process (not a changefeed's loop) runs this rule over every Table it sees."""
    if options is not None and "tables-never-detached" in options.mutants:
        return []
    return [
        _detach(t, options)
        for t in sorted(tables, key=lambda t: t.name)
        if TABLE_FINALIZER in t.finalizers and t.changefeed not in changefeeds
    ]
