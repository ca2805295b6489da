"""Table lifecycle: the finalizer, a deleted table's spans, and a table's initial spans.

- A live Table gets the maintainer's finalizer, so that deleting it waits for its spans.
- A deleted table (deletionTimestamp set): every in-flight operator on its spans is Canceled (its
  record says why) and the spans go to one Remove operator that deletes their dispatchers and then
  the spans. When no span and no dispatcher of the table is left, the finalizer is released.
- A second Table object naming a table ID already taken is Invalid; it gets no spans.
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine import controller, coverage, naming
from controller.engine.intents import AddFinalizer, ConfirmGone, RemoveFinalizer, Write, WriteStatus
from controller.engine.operators.common import cancel as cancel_operator
from controller.engine.operators.common import owned_spans
from controller.engine.world import Tick
from controller.model import resources as conv
from controller.model.ordering import in_order
from controller.model.records import Join, SpanOperator, Table
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
        tick.emit(f"cancel {op.name}", [cancel_operator(tick, op, *cancel)])
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


# -- joining: a new table's record on the Changefeed before its first spans -------------------------------------


def join_of(tick: Tick, table: Table) -> Join:
    """The join ``table``'s first spans wait for: they start from the checkpoint floor (or the table's startTs)."""
    return Join(table=table.name, uid=table.uid, start_ts=max(tick.checkpoint_floor, table.start_ts))


def joined(tick: Tick, table: Table) -> bool:
    """The view's Changefeed records ``table`` (this incarnation) as joining: its first spans may be created."""
    return any(j.table == table.name and j.uid == table.uid for j in tick.changefeed.joining)


def joining(tick: Tick) -> tuple[tuple[Join, ...], list[Write]]:
    """What ``Changefeed.status.joining`` becomes, and the reads its write must follow.

    A join stays until the view shows the table's spans covering its range in every mode (their checkpoints hold
    the changefeed back from then on), or the table deleted. A join whose table the view does not show (gone, or
    not seen yet: a Table watch lagging behind another maintainer's join) is dropped only after a GET finds no such
    Table (``ConfirmGone`` with its uid): found, the chain stops and the Table enters the view. The joins this
    decision wants (``Tick.joins_wanted``) are added."""
    keep: list[Join] = []
    reads: list[Write] = []
    for j in tick.changefeed.joining:
        table = tick.world.tables.get(j.table)
        if table is None or table.uid != j.uid:
            reads.append(ConfirmGone(Kind.TABLE, j.table, j.uid))
        elif not table.deleting and not _covered(tick, table):
            keep.append(j)
    names = {j.table for j in keep}
    keep += [j for name, j in sorted(tick.joins_wanted.items()) if name not in names]
    return tuple(keep), reads


def _covered(tick: Tick, table: Table) -> bool:
    """The view's accepted spans of ``table`` cover its range in every mode of the changefeed (as the view shows
    them: a span this decision creates counts once it has landed; the coverage rule without new or planned
    spans, engine/coverage.py)."""
    for mode in tick.changefeed.modes:
        if tick.index is not None:
            found = (tick.world.spans.get(n) for n in tick.index.spans_by_table.get((table.table_id, mode), ()))
            pool = [s for s in found if s is not None]
        else:
            pool = list(tick.world.spans.values())
        spans = [s for s in pool if (s.table_id, s.mode) == (table.table_id, mode)]
        if coverage.holes(table.key_range, spans):
            return False
    return True
