"""Placement (engine/placement.py): the basic scheduler places an Absent span without an operator."""

from __future__ import annotations

from controller.engine import naming
from controller.engine.maintainer import decide
from tests.engine.fixtures import (
    Kind,
    OpPhase,
    OpType,
    SpanState,
    Stage,
    capture,
    created,
    last_status,
    memory,
    operator,
    span,
    table,
    world,
)


def test_an_absent_span_whose_add_failed_at_the_same_resource_version_is_placed_again():
    """A span stayed Absent forever at the end of a history (liveness).

    The basic scheduler's Add broke after recording Running but before binding the span (a 500); its
    capture was then lost, so the Add failed CaptureLost without writing the span, which was still Absent
    at the same resourceVersion. The scheduler named the next Add from that resourceVersion, found the
    failed one, and skipped the span on every later decision. (The basic scheduler now places spans
    without an operator, placement.py; a finished Add of that name must still not hold the span back.)
    """
    s1 = span("s1", table_id=1, state=SpanState.ABSENT, resource_version="5")
    failed = operator(
        naming.operator_name(OpType.ADD, ("s1",), ("5",)),
        OpType.ADD,
        ("s1",),
        phase=OpPhase.FAILED,
        stage=Stage.ADD_DEST,
        status_reason="CaptureLost",
        target="c9",
        finished_at=990.0,
    )
    dec = decide(world(table(1), capture("c0"), s1, failed), memory())
    placed = last_status(dec, Kind.SPAN, "s1")
    assert (placed.state, placed.capture, placed.operator) == (SpanState.SCHEDULING, "c0", "")
    assert [d.name for d in created(dec, Kind.DISPATCHER)] == [placed.dispatcher]
