"""The basic scheduler: every Absent span goes to the least-loaded live, non-draining capture.

Each is placed without an operator: the placement is recorded in the span's own status before its
dispatcher is created (``placement.py``), so it survives a crash; within ``maxInFlightOperators`` (Running
operators and placements in flight together) and ``basicBatchSize`` placements per decision. Also the
helpers every automatic scheduler shares (operator names, what may be moved, how many may start).
"""

from __future__ import annotations

from controller.engine import naming, placement
from controller.engine.world import Tick
from controller.model import resources as conv
from controller.model.ordering import in_order
from controller.model.records import Span, SpanOperator
from controller.model.states import OpSource, OpType, SpanState


def basic(tick: Tick) -> None:
    left = placement.room(tick)
    if left <= 0:
        return
    captures = tick.schedulable_captures()
    if not captures:
        return
    load = tick.load()
    pool = (
        tick.span_candidates(tick.index.by_state[SpanState.ABSENT]) if tick.index is not None else tick.spans.values()
    )
    absent = in_order(
        (
            s
            for s in pool
            if s.state is SpanState.ABSENT
            and not s.deleting
            and not tick.busy(s.name)
            and not tick.is_touched(s)
            and tick.table_live(s.table_id)
            and tick.mode_enabled(s.mode)
            and not tick.dispatchers_of_span(s.name)
        ),
        key=lambda s: (s.table_id, s.mode, s.key_range),
    )
    pending = {name for op in tick.in_flight() for name in op.spans}
    for span in absent:
        if left <= 0:
            break
        if span.name in pending:
            continue  # a queued operator already names it
        capture = min(captures, key=lambda c: (load.get(c, 0), c))
        writes = placement.bind(tick, span, capture)
        if not writes:
            continue  # another span's dispatcher still runs some of its keys: it waits
        load[capture] = load.get(capture, 0) + 1
        tick.emit(f"place {span.name} on {capture}", writes)
        left -= 1


def fresh_operator_name(tick: Tick, type_: OpType, spans: tuple[str, ...], basis: tuple[object, ...]) -> str:
    """A scheduler operator's name from what caused it; "" if that very operator is still in flight.

    The same snapshot names the same operator (a retried create is AlreadyExists). A finished operator
    of that name does not block a new one: the retry gets an attempt number, and the first attempt
    keeps the plain name.
    """
    attempt = 0
    while True:
        name = naming.operator_name(type_, spans, basis if attempt == 0 else (*basis, attempt))
        existing = tick.operators.get(name)
        if existing is None:
            return name
        if existing.in_flight:
            return ""
        attempt += 1


def scheduler_operator(tick: Tick, name: str, type_: OpType, spans: tuple[str, ...], **spec: object) -> SpanOperator:
    """A SpanOperator the maintainer's schedulers create (source ``scheduler``)."""
    first = tick.spans[spans[0]]
    return SpanOperator(
        name=name,
        namespace=first.namespace,
        changefeed=tick.changefeed.name,
        type=type_,
        spans=spans,
        source=OpSource.SCHEDULER,
        created=tick.now,
        labels=conv.changefeed_labels(tick.changefeed.name),
        **spec,  # type: ignore[arg-type]
    )


def movable(tick: Tick, span: Span) -> bool:
    """A Replicating span of a live table that no operator owns and nothing changed in this decision:
    what the drain, balance, split and merge schedulers may take."""
    return (
        span.state is SpanState.REPLICATING
        and not span.deleting
        and not tick.busy(span.name)
        and not tick.is_touched(span)
        and tick.table_live(span.table_id)
        and tick.mode_enabled(span.mode)
    )


def room(tick: Tick, batch: int) -> int:
    """How many more operators this tick may start: within ``batch`` and ``maxInFlightOperators``."""
    return min(batch, tick.changefeed.scheduler.max_in_flight_operators - tick.slots_used())
