"""The operator controller: one operator per span, the in-flight limit, garbage collection; table deletion."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine.maintainer import decide
from tests.engine.fixtures import (
    NOW,
    DispatcherState,
    Kind,
    OpPhase,
    OpSource,
    OpType,
    Origin,
    SchedulerConfig,
    SpanState,
    Stage,
    Target,
    capture,
    changefeed,
    created,
    dispatcher,
    flat,
    indexed_world,
    last_status,
    memory,
    operator,
    pieces,
    span,
    statuses,
    table,
    trange,
    world,
)

P = pieces(1, 2)
A = span("a", key_range=P[0], capture="c0", dispatcher="da")
B = span("b", key_range=P[1], capture="c0", dispatcher="db")
DA = dispatcher("da", A, "c0")
DB = dispatcher("db", B, "c0")
BASE = [table(1), capture("c0"), capture("c1"), A, B, DA, DB]
MOVE_A = operator(
    "mv1",
    OpType.MOVE,
    ("a",),
    OpPhase.RUNNING,
    Stage.REMOVE_ORIGIN,
    target="c1",
    origins=(Origin(span="a", dispatcher="da", capture="c0"),),
    targets=(Target(span="a", key_range=P[0], capture="c1", dispatcher="na"),),
    created=NOW - 20,
)


def test_second_operator_on_owned_span_fails_span_busy():
    running = [
        table(1),
        capture("c0"),
        capture("c1"),
        replace(A, state=SpanState.SCHEDULING, operator="mv1"),
        B,
        replace(DA, deleting=True),
        DB,
        MOVE_A,
    ]
    op = operator("mv2", OpType.MOVE, ("a",), target="c0")
    dec = decide(world(*running, op), memory())
    assert [w for w in flat(dec) if w[2] == "mv2"] == [
        ("status", "SpanOperator", "mv2"),
        ("event", "SpanOperator", "mv2", "OperatorFailed"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "mv2")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "SpanBusy")
    assert "mv1" in rec.message


def test_two_running_operators_on_one_span_keep_the_one_the_span_names():
    """A superseded maintainer started an Add on a span its successor also placed.

    Both Adds stayed Running and each closed the other's dispatcher before creating its own, forever.
    The operator the span's status names now survives; the other is Canceled (reason Conflict).
    """
    s = span("s1", state=SpanState.SCHEDULING, capture="c1", dispatcher="d-new", operator="add-new")
    old = operator(
        "add-old",
        OpType.ADD,
        ("s1",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c0",
        targets=(Target(span="s1", key_range=trange(1), capture="c0", dispatcher="d-old", start_ts=100),),
        created=10.0,
    )
    new = operator(
        "add-new",
        OpType.ADD,
        ("s1",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c1",
        targets=(Target(span="s1", key_range=trange(1), capture="c1", dispatcher="d-new", start_ts=100),),
        created=20.0,
    )
    d_old = dispatcher("d-old", s, "c0", DispatcherState.WORKING)
    dec = decide(world(table(1), capture("c0"), capture("c1"), s, old, new, d_old), memory())
    assert last_status(dec, Kind.OPERATOR, "add-old").phase is OpPhase.CANCELED
    assert last_status(dec, Kind.OPERATOR, "add-old").status_reason == "Conflict"
    # The survivor carries on: the canceled Add's dispatcher goes before its own is created.
    assert statuses(dec, Kind.OPERATOR, "add-new") == []
    assert ("delete", "Dispatcher", "d-old") in flat(dec)
    assert ("create", "Dispatcher", "d-new") not in flat(dec)


def test_in_flight_limit_keeps_pending_waiting():
    cf = changefeed(scheduler=SchedulerConfig(max_in_flight_operators=1))
    running = [
        table(1),
        capture("c0"),
        capture("c1"),
        replace(A, state=SpanState.SCHEDULING, operator="mv1"),
        B,
        replace(DA, deleting=True),
        DB,
        MOVE_A,
    ]
    op = operator("mv2", OpType.MOVE, ("b",), target="c1")
    dec = decide(world(*running, op, cf=cf), memory())
    assert [w for w in flat(dec) if w[2] == "mv2"] == []


def test_in_flight_limit_admits_oldest_first():
    cf = changefeed(scheduler=SchedulerConfig(max_in_flight_operators=1))
    young = operator("young", OpType.MOVE, ("a",), target="c1", created=NOW - 1)
    old = operator("zold", OpType.MOVE, ("b",), target="c1", created=NOW - 5)
    dec = decide(world(*BASE, young, old, cf=cf), memory())
    assert last_status(dec, Kind.OPERATOR, "zold").phase is OpPhase.RUNNING
    assert statuses(dec, Kind.OPERATOR, "young") == []


def test_a_slot_freed_in_this_decision_is_not_reused_before_the_finish_lands():
    """The invariant `bounded` broke with maxInFlightOperators=2.

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


# A deposed maintainer whose writes land after its successor took over can still start operators beyond
# maxInFlightOperators: nothing fences a SpanOperator status write (a documented limitation, no test;
# docs/architecture.md, Fencing).


def finished(name, source, age):
    return operator(
        name, OpType.MOVE, ("a",), OpPhase.SUCCEEDED, source=source, created=NOW - 5000, finished_at=NOW - age
    )


@pytest.mark.parametrize(
    ("source", "age", "collected"),
    [
        (OpSource.SCHEDULER, 299, False),
        (OpSource.SCHEDULER, 300, True),
        (OpSource.MAINTAINER, 301, True),
        (OpSource.USER, 301, False),
        (OpSource.USER, 3600, True),
    ],
)
def test_garbage_collection_after_retention(source, age, collected):
    dec = decide(world(*BASE, finished("old", source, age)), memory())
    assert (("delete", "SpanOperator", "old") in flat(dec)) is collected


def test_the_next_decision_is_due_when_a_finished_operators_retention_ends():
    """The earliest end of a retention (a user's operator kept 3600 s, the scheduler's 300 s) is when the decision is
    due again, and a decision over the index (its queue of finished operators, engine/operator_gc.py) says the same
    as the full one; with none finished, something else is due later (a balance round, the Leases' end)."""
    user, other = finished("u", OpSource.USER, 3592), finished("s", OpSource.SCHEDULER, 295)
    cf, mem = changefeed(), replace(memory(), audited_at=NOW)
    records = [r for r in BASE if r.kind is not Kind.CAPTURE]
    captures = [r for r in BASE if r.kind is Kind.CAPTURE]
    for ops, due in (([user, other], NOW + 5), ([user], NOW + 8), ([], NOW + 15)):
        full = decide(world(*BASE, *ops, cf=cf), mem)
        incremental = decide(indexed_world(cf, [*records, *ops], captures), mem)
        assert (full.full, incremental.full) == (True, False)
        assert full.next_due == incremental.next_due == due


def test_table_deleted_mid_move_cancels_and_removes():
    """The Move is canceled first; the table's Remove is created Pending in the same decision and claims the
    spans only in the next one (the cancel might not land), then closes every dispatcher of the table."""
    tbl = table(1, deleting=True)
    recs = [
        tbl,
        capture("c0"),
        capture("c1"),
        replace(A, state=SpanState.SCHEDULING, operator="mv1"),
        B,
        replace(DA, deleting=True),
        DB,
        MOVE_A,
    ]
    dec = decide(world(*recs), memory())
    got = flat(dec)
    (rm,) = created(dec, Kind.OPERATOR)
    assert got == [("status", "SpanOperator", "mv1"), ("create", "SpanOperator", rm.name)]
    cancel = last_status(dec, Kind.OPERATOR, "mv1")
    assert (cancel.phase, cancel.status_reason) == (OpPhase.CANCELED, "TableDeleted")
    assert (rm.type, rm.spans, rm.delete_spans, rm.source) == (OpType.REMOVE, ("a", "b"), True, OpSource.MAINTAINER)
    assert rm.phase is OpPhase.PENDING
    # next decision: the Move is Canceled in the world; the Remove starts, recording before it deletes
    recs[-1] = cancel
    dec = decide(world(*recs, replace(rm, uid="uid-rm", resource_version="1")), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", rm.name),
        ("status", "Span", "a"),
        ("status", "Span", "b"),
        ("delete", "Dispatcher", "db"),
    ]
    assert not created(dec, Kind.DISPATCHER)
    started = last_status(dec, Kind.OPERATOR, rm.name)
    assert (started.phase, started.stage) == (OpPhase.RUNNING, Stage.REMOVE_ORIGIN)
    assert ("unfinalize", "Table", "t1") not in flat(dec)


def test_table_deleted_remove_finishes_then_finalizer_released():
    rm = operator(
        "rm",
        OpType.REMOVE,
        ("a", "b"),
        OpPhase.RUNNING,
        Stage.REMOVE_ORIGIN,
        delete_spans=True,
        source=OpSource.MAINTAINER,
    )
    tbl = table(1, deleting=True)
    a = replace(A, state=SpanState.REMOVING, operator="rm")
    b = replace(B, state=SpanState.REMOVING, operator="rm")
    dec = decide(world(tbl, capture("c0"), a, b, rm), memory())
    assert flat(dec) == [("delete", "Span", "a"), ("delete", "Span", "b"), ("status", "SpanOperator", "rm")]
    dec = decide(world(tbl, capture("c0"), replace(rm, phase=OpPhase.SUCCEEDED)), memory())
    assert flat(dec) == [("unfinalize", "Table", "t1")]


def test_table_finalizer_waits_for_leftover_dispatcher():
    tbl = table(1, deleting=True)
    d = replace(DA, deleting=True, state=DispatcherState.STOPPED)
    dec = decide(world(tbl, capture("c0"), d), memory())
    assert ("unfinalize", "Table", "t1") not in flat(dec)


def test_new_table_gets_finalizer_and_spans():
    dec = decide(world(table(7, finalizers=(), pre_split_spans=3), capture("c0")), memory())
    got = flat(dec)
    assert got[0] == ("finalize", "Table", "t7")
    spans = created(dec, Kind.SPAN)
    assert [s.key_range for s in spans] == list(pieces(7, 3))


def test_second_table_with_same_id_is_invalid_and_gets_no_spans():
    dup = table(1, name="again", created=NOW - 1)
    dec = decide(world(table(1, created=NOW - 50), dup, capture("c0"), A, B, DA, DB), memory())
    assert [w for w in flat(dec, keep_bookkeeping=True) if w[2] == "again"] == [
        ("status", "Table", "again"),
        ("event", "Table", "again", "TableRejected"),
    ]
    st = last_status(dec, Kind.TABLE, "again")
    assert (st.state, st.message) == ("Invalid", "table ID 1 is already defined by Table 't1'")
    assert created(dec, Kind.SPAN) == []


def test_table_status_counts_spans():
    a = replace(A, state=SpanState.ABSENT, dispatcher="", capture="")
    dec = decide(world(table(1, state=""), capture("c0"), capture("c1"), a, B, DB), memory())
    st = last_status(dec, Kind.TABLE, "t1")
    assert st.state == "Active"
    assert (st.span_counts.absent + st.span_counts.scheduling, st.span_counts.replicating) == (1, 1)
