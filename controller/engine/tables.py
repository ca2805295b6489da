"""Table lifecycle: the finalizer, a deleted table's spans, and a table's initial spans.

- A live Table gets the maintainer's finalizer, so that deleting it waits for its spans.
- A deleted table (deletionTimestamp set): every in-flight operator on its spans is Canceled (its
  record says why) and the spans go to one Remove operator that deletes their dispatchers and then
  the spans. When no span and no dispatcher of the table is left, the finalizer is released.
- A second Table object naming a table ID already taken is Invalid; it gets no spans.
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine import controller, naming
from controller.engine.intents import AddFinalizer, RemoveFinalizer, WriteStatus
from controller.engine.operators.common import owned_spans, record
from controller.engine.world import Tick
from controller.model import resources as conv
from controller.model.ordering import in_order
from controller.model.records import SpanOperator, Table
from controller.model.states import TABLE_FINALIZER, Kind, Mode, OpPhase, OpSource, OpType


def lifecycle(tick: Tick) -> None:
    if tick.index is None:
        tables = list(tick.world.tables.values())
    else:  # only the tables that may need something: duplicates, deleted ones, those without the finalizer
        tables = [tick.world.tables[n] for n in tick.index.table_attention]
    for table in sorted(tables, key=lambda t: (t.created, t.name)):
        if table.changefeed != tick.changefeed.name:
            continue
        if tick.tables_by_id.get(table.table_id) is not table:
            _invalid(tick, table)
        elif table.deleting:
            _removing(tick, table)
        elif TABLE_FINALIZER not in table.finalizers:
            tick.emit(f"table {table.name} finalizer", [AddFinalizer(Kind.TABLE, table.name, TABLE_FINALIZER)])


def _invalid(tick: Tick, table: Table) -> None:
    if table.deleting and TABLE_FINALIZER in table.finalizers:
        tick.emit(f"table {table.name} release", [RemoveFinalizer(Kind.TABLE, table.name, TABLE_FINALIZER)])
        return
    owner = tick.tables_by_id[table.table_id]
    message = f"table ID {table.table_id} is already defined by Table {owner.name!r}"
    if table.state != "Invalid" or table.message != message:
        new = replace(table, state="Invalid", message=message)
        tick.emit(
            f"table {table.name} invalid",
            [WriteStatus(new), tick.event(new, "TableRejected", message, warning=True)],
        )


def _removing(tick: Tick, table: Table) -> None:
    if tick.index is None:
        span_pool, disp_pool = list(tick.spans.values()), list(tick.dispatchers.values())
    else:
        keys = [(table.table_id, m) for m in Mode]
        span_pool = tick.span_candidates(*(tick.index.spans_by_table.get(k, ()) for k in keys))
        disp_pool = tick.dispatcher_candidates(*(tick.index.disp_by_table.get(k, ()) for k in keys))
    spans = in_order((s.name for s in span_pool if s.table_id == table.table_id and not s.deleting), key=None)
    leftover = [d for d in disp_pool if d.table_id == table.table_id]
    if not spans and not leftover:
        if TABLE_FINALIZER in table.finalizers:
            tick.emit(f"table {table.name} released", [RemoveFinalizer(Kind.TABLE, table.name, TABLE_FINALIZER)])
        return
    remove_spans(
        tick,
        spans,
        basis=table.uid,
        why=f"table {table.name} deleted",
        cancel=("TableDeleted", f"table {table.name} was deleted; its spans are being removed"),
    )


def remove_spans(tick: Tick, spans: list[str], basis: str, why: str, cancel: tuple[str, str]) -> None:
    """Remove ``spans`` (and their dispatchers) for good: one Remove operator with ``deleteSpans``.

    Every other in-flight operator owning one of them yields: it is Canceled (``cancel`` = reason,
    message) and its spans join the Remove. ``basis`` (with the spans' resourceVersions) names the
    Remove deterministically, so a restarted maintainer finds the one it already made.
    """
    wanted = set(spans)
    covered: set[str] = set()
    for op in tick.in_flight():
        mine = owned_spans(op) & wanted
        if not mine:
            continue
        if op.type is OpType.REMOVE and op.phase is OpPhase.RUNNING:
            covered.update(op.spans)
            continue
        if op.type is OpType.REMOVE and op.phase is OpPhase.PENDING and op.source is OpSource.MAINTAINER:
            covered.update(op.spans)
            continue
        # Any other operator yields: it is canceled and its spans join the Remove.
        _, write = record(
            tick, op, phase=OpPhase.CANCELED, status_reason=cancel[0], message=cancel[1], finished_at=tick.now
        )
        tick.emit(f"cancel {op.name}", [write])
    todo = tuple(s for s in spans if s not in covered)
    if not todo:
        return
    rvs = tuple(tick.spans[s].resource_version for s in todo)
    op = SpanOperator(
        name=naming.operator_name(OpType.REMOVE, todo, (basis, *rvs)),
        namespace=tick.changefeed.namespace,
        changefeed=tick.changefeed.name,
        type=OpType.REMOVE,
        spans=todo,
        delete_spans=True,
        source=OpSource.MAINTAINER,
        reason=why,
        created=tick.now,
        labels=conv.changefeed_labels(tick.changefeed.name),
    )
    if op.name in tick.operators:
        return  # created already (not yet started: the in-flight limit)
    controller.admit(tick, op, create=True)
