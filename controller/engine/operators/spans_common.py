"""The second half of split and merge: create the new spans, delete the replaced ones, place them.

Once the new spans exist and the replaced ones are deleted, the operator's intent (the new shape) is
achieved: a new span that cannot be placed (its destination lost, or no capture live at all) is left
Absent for the basic scheduler and the operator still succeeds ("PartiallyPlaced"). Nothing here waits
for a capture: creating spans and deleting spans needs none, and no dispatcher is made without one.
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine.intents import ConfirmGone, Delete, Write
from controller.engine.operators.common import (
    NO_CAPTURE,
    PARTIALLY_PLACED,
    advance_targets,
    choose_targets,
    final_checkpoint,
    finish,
    give_up,
    no_capture_message,
    record,
    set_span,
)
from controller.engine.world import Tick
from controller.model import resources as conv
from controller.model.records import Span, SpanOperator
from controller.model.states import Kind, OpPhase, SpanState, Stage


def delete_spans(tick: Tick, names: tuple[str, ...]) -> list[Write]:
    writes: list[Write] = []
    for name in names:
        span = tick.spans.get(name)
        if span is not None and not span.deleting:
            writes.append(Delete(Kind.SPAN, name, span.uid))
            tick.forget(Kind.SPAN, name)
    return writes


def _template(tick: Tick, op: SpanOperator, replaced: tuple[str, ...]) -> Span | None:
    """A span to copy table, mode and namespace from: a replaced span, or an already created new one."""
    for name in (*replaced, *(t.span for t in op.targets)):
        span = tick.spans.get(name) or tick.world.spans.get(name)
        if span is not None:
            return span
    return None


def create_spans(tick: Tick, op: SpanOperator, *replaced: str) -> list[Write]:
    writes: list[Write] = []
    if op.stage is not Stage.CREATE_SPANS:
        cp = min(final_checkpoint(tick, op, s) for s in replaced)
        op, write = record(
            tick,
            op,
            stage=Stage.CREATE_SPANS,
            checkpoint_ts=cp,
            targets=tuple(replace(t, start_ts=cp) for t in op.targets),
        )
        writes.append(write)
    template = _template(tick, op, replaced)
    if template is None:
        # Every replaced span was deleted by hand and none of the new ones exists yet: there is nothing
        # to take the table and mode from. The safety net re-covers the range; this operator ends.
        # Absent from the view is not deleted (another maintainer may have made the new spans, unseen yet): a
        # consistent read confirms each is gone first.
        gone = ", ".join(replaced)
        message = f"span(s) {gone} deleted by hand before the new spans existed; the safety net re-covers the keys"
        reads: list[Write] = []
        if not tick.mutant("gives-up-a-span-unseen"):
            reads = [ConfirmGone(Kind.SPAN, n) for n in (*replaced, *(t.span for t in op.targets))]
        return writes + reads + finish(tick, op, OpPhase.FAILED, "SpanNotFound", message)
    if tick.mutant("reshape-without-capture-skips-new-spans") and not tick.schedulable_captures():
        # Deliberate bug for the mutation check: with no capture to place them on, the new spans are
        # given up before they exist (the old spans go, nothing replaces them).
        gone_targets = tuple(give_up(t, NO_CAPTURE, no_capture_message(tick)) for t in op.targets)
        return [
            *writes,
            *delete_spans(tick, replaced),
            *finish(tick, op, OpPhase.SUCCEEDED, PARTIALLY_PLACED, "", targets=gone_targets),
        ]
    for t in op.targets:
        if t.span not in tick.spans:
            writes.append(
                tick.create(
                    Span(
                        name=t.span,
                        namespace=template.namespace,
                        changefeed=tick.changefeed.name,
                        table_id=template.table_id,
                        mode=template.mode,
                        key_range=t.key_range,
                        start_ts=op.checkpoint_ts,
                        created=tick.now,
                        labels=conv.span_labels(tick.changefeed.name, template.table_id),
                    )
                )
            )
    writes.extend(delete_spans(tick, replaced))
    targets = choose_targets(tick, op, op.targets, op.checkpoint_ts)
    if not all(t.capture for t in targets):
        # No live, non-draining capture to place them on: the new spans exist all the same (the shape is
        # what was asked, and it needs no capture). Those without a destination are given up in the
        # record of AddSpans, with the captures named, and left Absent (before that record: a done
        # target is never settled again) for the basic scheduler.
        why = no_capture_message(tick)
        targets = tuple(t if t.capture else give_up(t, NO_CAPTURE, why) for t in targets)
        for t in targets:
            if t.lost:
                writes.extend(
                    set_span(
                        tick,
                        tick.spans[t.span],
                        state=SpanState.ABSENT,
                        capture="",
                        dispatcher="",
                        operator="",
                        checkpoint_ts=op.checkpoint_ts,
                    )
                )
    op, write = record(tick, op, stage=Stage.ADD_SPANS, targets=targets)
    writes.append(write)
    for t in targets:
        if t.lost:
            continue
        span = tick.spans[t.span]
        writes.extend(
            set_span(
                tick,
                span,
                state=SpanState.SCHEDULING,
                operator=op.name,
                capture=t.capture,
                dispatcher=t.dispatcher,
                checkpoint_ts=op.checkpoint_ts,
            )
        )
    return writes + add_spans(tick, op)


def add_spans(tick: Tick, op: SpanOperator) -> list[Write]:
    return advance_targets(tick, op, "DestinationLost", reshape=True)
