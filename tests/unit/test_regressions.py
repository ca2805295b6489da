"""Regressions the simulator found: each test is a small hand-built World and one decision.

Every test names the simulator seed that first showed the bug (``python -m controller.sim --seed S``).
"""

from __future__ import annotations

from controller.engine.maintainer import decide
from controller.model.records import SchedulerConfig
from tests.unit.fixtures import (
    DispatcherState,
    OpPhase,
    OpType,
    SpanState,
    Stage,
    Target,
    capture,
    changefeed,
    dispatcher,
    memory,
    operator,
    span,
    table,
    trange,
    world,
)


def test_a_slot_freed_in_this_decision_is_not_reused_before_the_finish_lands():
    """Seed 32 (and 37, 63...): `bounded` broke with maxInFlightOperators=2.

    An Add finished in a decision and, in the same decision, a Pending operator was started in the slot
    it freed. Chains fail independently: the finishing status write failed (a 500) while the start landed,
    so three operators were Running with a limit of two. A freed slot is now reused by the next decision.
    """
    s1 = span("s1", table_id=1, state=SpanState.SCHEDULING, capture="c0", dispatcher="d1", operator="a1")
    s2 = span("s2", table_id=2, state=SpanState.SCHEDULING, capture="c1", dispatcher="d2", operator="a2")
    s3 = span("s3", table_id=3, capture="c0", dispatcher="d3")
    a1 = operator(
        "a1",
        OpType.ADD,
        ("s1",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c0",
        targets=(Target(span="s1", key_range=trange(1), capture="c0", dispatcher="d1", start_ts=100),),
    )
    a2 = operator(
        "a2",
        OpType.ADD,
        ("s2",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c1",
        targets=(Target(span="s2", key_range=trange(2), capture="c1", dispatcher="d2", start_ts=100),),
    )
    move = operator("mv", OpType.MOVE, ("s3",), target="c1")
    cf = changefeed(scheduler=SchedulerConfig(max_in_flight_operators=2))
    w = world(
        cf,
        table(1),
        table(2),
        table(3),
        capture("c0"),
        capture("c1"),
        s1,
        s2,
        s3,
        dispatcher("d1", s1, "c0", state=DispatcherState.WORKING),
        dispatcher("d2", s2, "c1", state=DispatcherState.PENDING),
        dispatcher("d3", s3, "c0"),
        a1,
        a2,
        move,
    )
    dec = decide(w, memory())
    statuses = [w_.obj for c in dec.chains for w_ in c.writes if type(w_).__name__ == "WriteStatus"]
    a1_after = [o for o in statuses if o.name == "a1"]
    assert a1_after  # a1 finishes in this decision...
    assert a1_after[-1].phase is OpPhase.SUCCEEDED
    assert not [o for o in statuses if o.name == "mv"]  # ...but the Move waits for the next one


def test_an_absent_span_whose_add_failed_at_the_same_resource_version_is_placed_again():
    """Seed 103: a span stayed Absent forever at the end of a history (liveness).

    The basic scheduler's Add broke after recording Running but before binding the span (a 500); its
    capture was then lost, so the Add failed CaptureLost without writing the span, which was still Absent
    at the same resourceVersion. The scheduler named the next Add from that resourceVersion, found the
    failed one, and skipped the span on every later decision.
    """
    from controller.engine import naming

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
    creates = [w_.obj for c in dec.chains for w_ in c.writes if type(w_).__name__ == "Create"]
    adds = [o for o in creates if getattr(o, "type", None) is OpType.ADD and o.spans == ("s1",)]
    assert adds
    assert adds[0].name != failed.name
    assert adds[0].target == "c0"
