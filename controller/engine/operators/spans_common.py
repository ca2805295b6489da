"""The second half of split and merge: create the new spans, delete the replaced ones, place them."""

from __future__ import annotations

from dataclasses import replace

from controller.engine.intents import Delete, Write
from controller.engine.operators.common import (
    advance_targets,
    choose_targets,
    final_checkpoint,
    finish,
    record,
    set_span,
)
from controller.engine.world import Tick
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
        gone = ", ".join(replaced)
        return writes + finish(tick, op, OpPhase.FAILED, "SpanNotFound", f"span(s) {gone} were deleted mid-way")
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
                        labels=(("cdc.maintainer.dev/changefeed", tick.changefeed.name),),
                    )
                )
            )
    writes.extend(delete_spans(tick, replaced))
    targets = choose_targets(tick, op, op.targets, op.checkpoint_ts)
    op, write = record(tick, op, stage=Stage.ADD_SPANS, targets=targets)
    writes.append(write)
    for t in targets:
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
    return advance_targets(tick, op, "DestinationLost")
