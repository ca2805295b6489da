"""Remove: validation, record before delete, progress, lost origin capture, settle (Absent or deleted)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine.maintainer import decide
from controller.model.records import Changefeed
from tests.engine.fixtures import (
    CF,
    NOW,
    Kind,
    OpPhase,
    OpSource,
    OpType,
    Origin,
    SpanState,
    Stage,
    capture,
    dispatcher,
    flat,
    last_status,
    memory,
    operator,
    pieces,
    span,
    statuses,
    table,
    world,
)

S1 = span("s1", capture="c0", dispatcher="d1", checkpoint_ts=120)
D1 = dispatcher("d1", S1, "c0", checkpoint_ts=130)


def test_start_records_origins_then_marks_span_then_deletes():
    op = operator("rm", OpType.REMOVE, ("s1",))
    dec = decide(world(table(1), capture("c0"), S1, D1, op), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", "rm"),
        ("status", "Span", "s1"),
        ("delete", "Dispatcher", "d1"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "rm")
    assert (rec.phase, rec.stage) == (OpPhase.RUNNING, Stage.REMOVE_ORIGIN)
    assert rec.origins == (Origin(span="s1", dispatcher="d1", capture="c0", checkpoint_ts=130),)
    sp = last_status(dec, Kind.SPAN, "s1")
    assert (sp.state, sp.operator) == (SpanState.REMOVING, "rm")


@pytest.mark.parametrize(("spans", "reason"), [((), "InvalidSpec"), (("s1", "nope"), "SpanNotFound")])
def test_validation(spans, reason):
    op = operator("rm", OpType.REMOVE, spans)
    dec = decide(world(table(1), capture("c0"), S1, D1, op), memory())
    assert flat(dec) == [("status", "SpanOperator", "rm"), ("event", "SpanOperator", "rm", "OperatorFailed")]
    assert last_status(dec, Kind.OPERATOR, "rm").status_reason == reason


def running(d=None, **op_kw):
    op = operator(
        "rm",
        OpType.REMOVE,
        ("s1",),
        OpPhase.RUNNING,
        Stage.REMOVE_ORIGIN,
        origins=(Origin(span="s1", dispatcher="d1", capture="c0", checkpoint_ts=130),),
        **op_kw,
    )
    s = replace(S1, state=SpanState.REMOVING, operator="rm")
    return [table(1), s, op, *([d] if d else [])]


def test_waits_while_live_capture_closes():
    dec = decide(world(capture("c0"), *running(replace(D1, deleting=True))), memory())
    assert flat(dec) == []


def test_refreshes_origin_checkpoint_while_closing():
    d = replace(D1, deleting=True, checkpoint_ts=170)
    dec = decide(world(capture("c0"), *running(d)), memory())
    assert flat(dec) == [("status", "SpanOperator", "rm")]
    assert last_status(dec, Kind.OPERATOR, "rm").origins[0].checkpoint_ts == 170


def test_lost_origin_capture_finalizer_released_by_maintainer():
    dec = decide(world(capture("c0", alive=False), *running(replace(D1, deleting=True))), memory())
    assert flat(dec) == [("fence", "Capture", "c0"), ("unfinalize", "Dispatcher", "d1")]


def test_lost_origin_capture_not_yet_deleted():
    dec = decide(world(capture("c0", alive=False), *running(D1)), memory())
    assert flat(dec) == [("delete", "Dispatcher", "d1"), ("fence", "Capture", "c0"), ("unfinalize", "Dispatcher", "d1")]


def test_gone_leaves_span_absent_at_final_checkpoint():
    dec = decide(world(capture("c0"), *running()), memory())
    got = flat(dec)
    assert got[:2] == [("status", "Span", "s1"), ("status", "SpanOperator", "rm")]
    sp = next(w.obj for c in dec.chains for w in c.writes if getattr(w, "obj", None) and w.obj.name == "s1")
    assert (sp.state, sp.checkpoint_ts, sp.dispatcher, sp.capture, sp.operator) == (SpanState.ABSENT, 130, "", "", "")
    rec = last_status(dec, Kind.OPERATOR, "rm")
    assert (rec.phase, rec.finished_at) == (OpPhase.SUCCEEDED, 1000.0)


def test_gone_with_delete_spans_deletes_span():
    dec = decide(world(capture("c0"), *running(delete_spans=True, source=OpSource.MAINTAINER)), memory())
    assert flat(dec)[:2] == [("delete", "Span", "s1"), ("status", "SpanOperator", "rm")]
    assert last_status(dec, Kind.OPERATOR, "rm").phase is OpPhase.SUCCEEDED
    # the table is live and now has no span: it joins again (on the Changefeed, engine/tables.py), and once the view
    # shows that, coverage repair refills the range with a fresh span in its own chain, placed at once (create the
    # span with its placement recorded, create its dispatcher: placement.py)
    assert flat(dec)[2:] == []
    cf = last_status(dec, Kind.CHANGEFEED, CF)
    assert isinstance(cf, Changefeed)
    assert [j.table for j in cf.joining] == ["t1"]
    done = last_status(dec, Kind.OPERATOR, "rm")
    dec = decide(world(capture("c0"), table(1), done, cf=cf), memory())
    assert [w[:2] for w in flat(dec) if w[0] == "create"] == [("create", "Span"), ("create", "Dispatcher")]


# -- Invalid spans (regressions found by the property test) ----------------------------------------------

P = pieces(1, 2)
CAPS = [capture("c0"), capture("c1")]


def test_user_remove_of_an_invalid_span_does_not_accept_it():
    """A user Remove naming a span the maintainer refused (Invalid) must never make it an accepted span (it used
    to go Invalid -> Removing -> Absent in one decision and overlap the table's spans)."""
    a = span("a", key_range=P[0], capture="c0", dispatcher="da")
    b = span("b", key_range=P[1], capture="c1", dispatcher="db")
    u = span("u", state=SpanState.INVALID, message="overlaps span 'a'", created=NOW - 1)
    rm = operator("rm", OpType.REMOVE, ("u",))
    recs = [table(1), *CAPS, a, b, dispatcher("da", a, "c0"), dispatcher("db", b, "c1"), u, rm]
    dec = decide(world(*recs), memory())
    states = [s.state for s in statuses(dec, Kind.SPAN, "u")]
    assert SpanState.ABSENT not in states, f"Invalid span u was written {states}"


def test_table_remove_does_not_turn_an_invalid_span_into_an_accepted_one():
    """A deleted table's Remove must not write its Invalid span in an accepted state (it used to mark it
    Removing, overlapping a span another operator owns)."""
    from controller.engine import invariants
    from controller.model.records import Changefeed
    from tests.engine.fixtures import Store

    a = span("a", key_range=P[0], state=SpanState.REMOVING, operator="user-rm", capture="c0", dispatcher="da")
    b = span("b", key_range=P[1], capture="c1", dispatcher="db")
    u = span("u", state=SpanState.INVALID, message="overlaps span 'a'", created=NOW - 1)
    rm = operator(
        "user-rm",
        OpType.REMOVE,
        ("a",),
        OpPhase.RUNNING,
        Stage.REMOVE_ORIGIN,
        origins=(Origin(span="a", dispatcher="da", capture="c0"),),
    )
    st = Store()
    st.add(
        Changefeed(name="cf", start_ts=100, epoch=3, holder="m1"),
        table(1, deleting=True),
        *CAPS,
        a,
        b,
        u,
        rm,
        replace(dispatcher("da", a, "c0"), deleting=True),
        dispatcher("db", b, "c1"),
    )
    st.apply(decide(st.world(), memory()))
    assert invariants.unexplained_overlaps(st.world()) == []
