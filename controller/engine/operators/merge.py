"""Merge: replace adjacent spans of one table and mode by one span covering them all.

::

    Pending --validate, record the merged span--> RemoveOrigin --every source gone--> CreateSpans
        --merged span created, sources deleted--> AddSpans --merged Working--> Succeeded
       |                                              |
       | invalid                                      | merged span not placed
       v                                              v
     Failed                                         Succeeded ("PartiallyPlaced")

    a source's capture lost in RemoveOrigin: its finalizer is released, then CreateSpans.
    no live, non-draining capture at CreateSpans: the merged span is created all the same and left
    Absent ("NoCapture", the captures named); its destination lost in AddSpans: left Absent
    ("DestinationLost"). Either way the basic scheduler places it later.

Once the merged span exists and the sources are gone, the merge has done what was asked; placing
the merged span is the basic scheduler's job if the merge cannot. It fails after validation only if
a person deleted the spans mid-way (SpanNotFound, SpanDeleted).

Unlike TiCDC, sources need not share a capture: every source dispatcher is closed before the merged
one is created (break before make), and the merged span starts from the lowest final checkpoint of
the sources. CreateSpans is recorded with that checkpoint before the merged span exists.
"""

from __future__ import annotations

import itertools

from controller.engine import naming
from controller.engine.intents import Write
from controller.engine.operators import spans_common
from controller.engine.operators.common import (
    Rejected,
    fail,
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
from controller.model.keys import KeyRange
from controller.model.records import SpanOperator, Target
from controller.model.states import OpPhase, SpanState, Stage


def start(tick: Tick, op: SpanOperator) -> list[Write]:
    try:
        span_kind_check(tick, op)
        if len(op.spans) < 2:
            raise Rejected("InvalidSpec", "Merge needs at least two spans")
        if len(set(op.spans)) != len(op.spans):
            raise Rejected("InvalidSpec", "Merge names a span twice")
        spans = sorted((require_span(tick, s) for s in op.spans), key=lambda s: s.key_range)
        for s in spans:
            require_placeable(tick, s)
        first = spans[0]
        if any(s.table_id != first.table_id or s.mode != first.mode for s in spans):
            raise Rejected("NotAdjacent", "Merge spans must belong to one table and one mode")
        for a, b in itertools.pairwise(spans):
            if a.key_range.end != b.key_range.start:
                raise Rejected("NotAdjacent", f"spans {a.name!r} and {b.name!r} are not adjacent")
        if op.target:
            require_capture(tick, op.target)
    except Rejected as r:
        return fail(tick, op, r.reason, r.message)
    merged = KeyRange(spans[0].key_range.start, spans[-1].key_range.end)
    target = Target(
        span=naming.child_span_name(op.name, merged, tick.changefeed.name, first.table_id, first.mode),
        key_range=merged,
    )
    new, write = record(
        tick,
        op,
        phase=OpPhase.RUNNING,
        stage=Stage.REMOVE_ORIGIN,
        origins=tuple(o for s in spans for o in origins_of(tick, s)),
        targets=(target,),
        checkpoint_ts=min(s.known_checkpoint for s in spans),
        started_at=tick.now,
    )
    marks = [w for s in spans for w in set_span(tick, s, state=SpanState.REMOVING, operator=op.name)]
    return [write, *marks, *advance(tick, new)]


def advance(tick: Tick, op: SpanOperator) -> list[Write]:
    if op.stage is Stage.REMOVE_ORIGIN:
        waiting = wait_origins(tick, op)
        if waiting is not None:
            return waiting
        return spans_common.create_spans(tick, op, *op.spans)
    if op.stage is Stage.CREATE_SPANS:
        return spans_common.create_spans(tick, op, *op.spans)
    return spans_common.add_spans(tick, op)
