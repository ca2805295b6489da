"""Move: take a span from its capture to another, break before make.

::

    Pending --validate--> RemoveOrigin --origin gone--> AddDest --dest Working--> Succeeded
                              |                            |
                              | dest lost: keep closing    | dest lost: close it, span Absent
                              | the origin, then Absent    v
                              v                          Failed (DestinationLost)
                            Failed (DestinationLost)

    origin capture lost during RemoveOrigin: its finalizer is released, then straight to AddDest.

The destination (capture and dispatcher name) is recorded at the start and never re-chosen: a Move
restored in any stage still ends on the capture the user named. AddDest is recorded with the
origin's final checkpoint before the destination is created, which starts from it.
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine.intents import Write
from controller.engine.operators.common import (
    Rejected,
    advance_targets,
    capture_lost_message,
    fail,
    final_checkpoint,
    finish,
    give_up,
    least_loaded,
    new_dispatcher_name,
    origins_of,
    record,
    require_capture,
    require_placeable,
    require_span,
    set_span,
    span_kind_check,
    wait_origins,
)
from controller.engine.world import Tick
from controller.model.records import SpanOperator, Target
from controller.model.states import OpPhase, SpanState, Stage


def start(tick: Tick, op: SpanOperator) -> list[Write]:
    try:
        span_kind_check(tick, op)
        if len(op.spans) != 1:
            raise Rejected("InvalidSpec", f"Move takes exactly one span, got {len(op.spans)}")
        if not op.target:
            raise Rejected("InvalidSpec", "Move needs a target capture")
        span = require_span(tick, op.spans[0])
        require_placeable(tick, span)
        require_capture(tick, op.target)
    except Rejected as r:
        return fail(tick, op, r.reason, r.message)
    if span.state is SpanState.REPLICATING and span.capture == op.target:
        return finish(tick, op, OpPhase.SUCCEEDED, "AlreadyOnTarget", f"span is already on {op.target}")
    origins = tuple(origins_of(tick, span))
    target = Target(
        span=span.name,
        key_range=span.key_range,
        capture=op.target,
        dispatcher=new_dispatcher_name(tick, span.name, op),
    )
    new, write = record(
        tick,
        op,
        phase=OpPhase.RUNNING,
        stage=Stage.REMOVE_ORIGIN,
        origins=origins,
        targets=(target,),
        checkpoint_ts=span.known_checkpoint,
        started_at=tick.now,
    )
    bind = set_span(tick, span, state=SpanState.SCHEDULING, operator=op.name)
    return [write, *bind, *advance(tick, new)]


def advance(tick: Tick, op: SpanOperator) -> list[Write]:
    if op.stage is Stage.REMOVE_ORIGIN:
        return _remove_origin(tick, op)
    if tick.mutant("restore-forgets-move-destination") and tick.first_tick:
        # Deliberate bug for the mutation check: a restored Move re-plans its destination.
        other = least_loaded(tick, exclude=op.targets[0].capture)
        if other:
            op = replace(op, targets=(replace(op.targets[0], capture=other),))
    return advance_targets(tick, op, "DestinationLost")


def _remove_origin(tick: Tick, op: SpanOperator) -> list[Write]:
    (span_name,) = op.spans
    # The mutant is a deliberate bug for the simulator's mutation check: it adds before the origin stopped.
    waiting = wait_origins(tick, op, assume_gone=tick.mutant("move-adds-before-origin-stopped"))
    if waiting is not None:
        return waiting
    target = op.targets[0]
    cp = final_checkpoint(tick, op, span_name)
    span = tick.spans.get(span_name)
    if span is None:
        return finish(tick, op, OpPhase.FAILED, "SpanNotFound", f"span {span_name!r} disappeared")
    if not tick.capture_alive(target.capture):
        # Destination lost while the origin was closing: never two owners; leave the span Absent.
        settle = set_span(
            tick,
            span,
            state=SpanState.ABSENT,
            capture="",
            dispatcher="",
            operator="",
            checkpoint_ts=max(span.checkpoint_ts, cp),
        )
        lost = give_up(target, "DestinationLost", capture_lost_message(target.capture))
        message = f"{lost.lost_message}: {span_name}"
        return settle + finish(tick, op, OpPhase.FAILED, "DestinationLost", message, targets=(lost,))
    new, write = record(
        tick,
        op,
        stage=Stage.ADD_DEST,
        checkpoint_ts=cp,
        targets=(replace(target, start_ts=cp),),
    )
    bind = set_span(
        tick,
        span,
        capture=target.capture,
        dispatcher=target.dispatcher,
        checkpoint_ts=max(span.checkpoint_ts, cp),
    )
    return [write, *bind, *advance_targets(tick, new, "DestinationLost")]
