"""Split: replace one span by several adjacent children covering exactly its range.

::

    Pending --validate, record the shape--> RemoveOrigin --origin gone--> CreateSpans
        --children created, parent deleted--> AddSpans --every child Working--> Succeeded
       |                                          |
       | invalid                                  | some or all children not placed
       v                                          v
     Failed                                     Succeeded ("PartiallyPlaced")

    origin capture lost in RemoveOrigin: its finalizer is released (it fenced itself), then CreateSpans.
    no live, non-draining capture at CreateSpans: the children are created all the same and left
    Absent, the captures named in the record ("NoCapture"); the basic scheduler places them later.
    a child's destination lost in AddSpans: that child is closed and left Absent ("DestinationLost").

Once the children exist and the parent is gone, the split has done what was asked (the new shape); it
succeeds whatever becomes of the children's placement, "PartiallyPlaced" naming each child it could
not place and why. It fails after validation only if a person deleted the spans mid-way (the parent
before any child existed: SpanNotFound; every child: SpanDeleted). No capture is needed to create
or delete spans, and no dispatcher is made without one: nothing is lost, nothing owned twice.

The children (names, ranges) are recorded at the start, so a restored split creates exactly the same
children; CreateSpans is recorded with the parent's final checkpoint before any child exists, and
every child starts from it. Children are created before the parent is deleted, so the table's range
is never left with a hole, and the overlap in between is explained by this operator's record. A child
given up is recorded with its reason and message in the same write, so a maintainer restarted at any
point finishes the split with the same outcome.
"""

from __future__ import annotations

from controller.engine import naming
from controller.engine.intents import Write
from controller.engine.operators import spans_common
from controller.engine.operators.common import (
    Rejected,
    fail,
    finish,
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
from controller.model.keys import KeyError_
from controller.model.records import SpanOperator, Target
from controller.model.states import OpPhase, SpanState, Stage

MAX_PIECES = 128


def start(tick: Tick, op: SpanOperator) -> list[Write]:
    try:
        span_kind_check(tick, op)
        if len(op.spans) != 1:
            raise Rejected("InvalidSpec", f"Split takes exactly one span, got {len(op.spans)}")
        span = require_span(tick, op.spans[0])
        require_placeable(tick, span)
        table = tick.table_of(span)
        if table is not None and not table.splittable:
            raise Rejected("NotSplittable", f"table {table.name!r} is not splittable")
        if op.target:
            require_capture(tick, op.target)
        if op.split_keys:
            keys = tuple(op.split_keys)
        elif 2 <= op.split_into <= MAX_PIECES:
            keys = span.key_range.even_split_keys(op.split_into)
        else:
            raise Rejected("InvalidSpec", f"Split needs splitKeys or splitInto between 2 and {MAX_PIECES}")
        try:
            ranges = span.key_range.split_at(keys)
        except KeyError_ as exc:
            raise Rejected("InvalidSplitKeys", str(exc)) from None
    except Rejected as r:
        return fail(tick, op, r.reason, r.message)
    targets = tuple(
        Target(
            span=naming.child_span_name(op.name, r, tick.changefeed.name, span.table_id, span.mode),
            key_range=r,
        )
        for r in ranges
    )
    new, write = record(
        tick,
        op,
        phase=OpPhase.RUNNING,
        stage=Stage.REMOVE_ORIGIN,
        origins=tuple(origins_of(tick, span)),
        targets=targets,
        checkpoint_ts=span.known_checkpoint,
        started_at=tick.now,
    )
    mark = set_span(tick, span, state=SpanState.REMOVING, operator=op.name)
    return [write, *mark, *advance(tick, new)]


def advance(tick: Tick, op: SpanOperator) -> list[Write]:
    if op.stage is Stage.REMOVE_ORIGIN:
        waiting = wait_origins(tick, op)
        if waiting is not None:
            return waiting
        if tick.mutant("split-skips-children"):
            # Deliberate bug for the mutation check: the parent goes, the children never come.
            return spans_common.delete_spans(tick, op.spans) + finish(tick, op, OpPhase.SUCCEEDED, "", "")
        return spans_common.create_spans(tick, op, op.spans[0])
    if op.stage is Stage.CREATE_SPANS:
        return spans_common.create_spans(tick, op, op.spans[0])
    return spans_common.add_spans(tick, op)
