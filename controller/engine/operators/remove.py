"""Remove: stop replicating spans; delete them (table dropped, overlap repair) or leave them Absent.

::

    Pending --validate--> RemoveOrigin --all dispatchers gone--> Succeeded
                             (spans deleted, or Absent at their final checkpoint)

Every dispatcher of the spans is closed, not only the ones recorded at the start: a Remove is also
what a table's deletion turns the spans' other operators into, and it must leave nothing behind.
A dispatcher on a lost capture has its finalizer released by the maintainer (the capture fenced
itself when it could not renew its Lease).
"""

from __future__ import annotations

from controller.engine.intents import Delete, Write
from controller.engine.operators.common import (
    Rejected,
    fail,
    final_checkpoint,
    finish,
    origins_of,
    record,
    set_span,
    span_kind_check,
    wait_origins,
)
from controller.engine.world import Tick
from controller.model.records import SpanOperator
from controller.model.states import Kind, OpPhase, OpSource, SpanState, Stage


def start(tick: Tick, op: SpanOperator) -> list[Write]:
    try:
        span_kind_check(tick, op)
        if not op.spans:
            raise Rejected("InvalidSpec", "Remove needs at least one span")
        missing = [s for s in op.spans if s not in tick.spans]
        if missing and op.source is OpSource.USER:
            raise Rejected("SpanNotFound", f"span(s) do not exist: {', '.join(missing)}")
    except Rejected as r:
        return fail(tick, op, r.reason, r.message)
    spans = [tick.spans[s] for s in op.spans if s in tick.spans]
    origins = tuple(o for s in spans for o in origins_of(tick, s))
    new, write = record(
        tick, op, phase=OpPhase.RUNNING, stage=Stage.REMOVE_ORIGIN, origins=origins, started_at=tick.now
    )
    # A new or Invalid span replicates nothing: it is not marked, only deleted (or left) at the end.
    marks = [w for s in spans if s.accepted for w in set_span(tick, s, state=SpanState.REMOVING, operator=op.name)]
    return [write, *marks, *advance(tick, new)]


def advance(tick: Tick, op: SpanOperator) -> list[Write]:
    waiting = wait_origins(tick, op)
    if waiting is not None:
        return waiting
    settle: list[Write] = []
    for name in op.spans:
        span = tick.spans.get(name)
        if span is None:
            continue
        if op.delete_spans or not tick.table_live(span.table_id) or not tick.mode_enabled(span.mode):
            if not span.deleting:
                settle.append(Delete(Kind.SPAN, span.name, span.uid))
                tick.forget(Kind.SPAN, span.name)
        elif span.state not in (None, SpanState.INVALID):
            settle.extend(
                set_span(
                    tick,
                    span,
                    state=SpanState.ABSENT,
                    capture="",
                    dispatcher="",
                    operator="",
                    checkpoint_ts=max(span.checkpoint_ts, final_checkpoint(tick, op, name)),
                )
            )
    return settle + finish(tick, op, OpPhase.SUCCEEDED, "", "")
