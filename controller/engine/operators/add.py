"""Add: place an Absent span on a capture.

::

    Pending --validate--> AddDest --dest Working--> Succeeded
       |                     |
       | invalid             | dest capture lost: close the dispatcher, span Absent
       v                     v
     Failed                Failed (CaptureLost)

AddDest is recorded (with the destination capture, the dispatcher name and the start ts) before the
span is bound and the dispatcher created, so a restored Add re-creates exactly that dispatcher.
The start ts is the span's persisted checkpoint, never below the changefeed's (TiCDC #4548).
"""

from __future__ import annotations

from controller.engine.intents import Write
from controller.engine.operators.common import (
    Rejected,
    advance_targets,
    fail,
    least_loaded,
    new_dispatcher_name,
    record,
    require_capture,
    require_span,
    set_span,
    span_kind_check,
)
from controller.engine.world import Tick
from controller.model.records import SpanOperator, Target
from controller.model.states import OpPhase, SpanState, Stage


def start(tick: Tick, op: SpanOperator) -> list[Write]:
    try:
        span_kind_check(tick, op)
        if len(op.spans) != 1:
            raise Rejected("InvalidSpec", f"Add takes exactly one span, got {len(op.spans)}")
        span = require_span(tick, op.spans[0])
        if span.state is not SpanState.ABSENT:
            raise Rejected("SpanBusy", f"span {span.name!r} is {span.state}; only an Absent span can be added")
        capture = op.target or least_loaded(tick)
        if not capture:
            raise Rejected("NoCapture", "no live, non-draining capture to add the span to")
        require_capture(tick, capture)
    except Rejected as r:
        return fail(tick, op, r.reason, r.message)
    if tick.dispatchers_of_span(span.name):
        return []  # a leftover dispatcher is still closing (safety net): wait, stay Pending
    start_ts = max(span.known_checkpoint, tick.checkpoint_floor)
    target = Target(
        span=span.name,
        key_range=span.key_range,
        capture=capture,
        dispatcher=new_dispatcher_name(tick, span.name, op),
        start_ts=start_ts,
    )
    new, write = record(
        tick,
        op,
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        targets=(target,),
        checkpoint_ts=start_ts,
        started_at=tick.now,
    )
    bind = set_span(
        tick,
        span,
        state=SpanState.SCHEDULING,
        operator=op.name,
        capture=capture,
        dispatcher=target.dispatcher,
        checkpoint_ts=start_ts,
    )
    return [write, *bind, *advance_targets(tick, new, "CaptureLost")]


def advance(tick: Tick, op: SpanOperator) -> list[Write]:
    return advance_targets(tick, op, "CaptureLost")
