"""Move: validation, RemoveOrigin recorded before the delete, AddDest from the origin's final checkpoint,
destination and origin loss."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine.maintainer import decide
from tests.engine.fixtures import (
    DispatcherState,
    Kind,
    OpPhase,
    OpType,
    Origin,
    SpanState,
    Stage,
    Target,
    capture,
    created,
    dispatcher,
    flat,
    last_status,
    memory,
    operator,
    span,
    statuses,
    table,
    world,
)

S1 = span("s1", capture="c0", dispatcher="d1", checkpoint_ts=120)
D1 = dispatcher("d1", S1, "c0", checkpoint_ts=130)
CAPS = [capture("c0"), capture("c1")]


def test_start_records_destination_before_closing_origin():
    op = operator("mv", OpType.MOVE, ("s1",), target="c1")
    dec = decide(world(table(1), *CAPS, S1, D1, op), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", "mv"),
        ("status", "Span", "s1"),
        ("delete", "Dispatcher", "d1"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.phase, rec.stage, rec.checkpoint_ts) == (OpPhase.RUNNING, Stage.REMOVE_ORIGIN, 120)
    assert rec.origins == (Origin(span="s1", dispatcher="d1", capture="c0", checkpoint_ts=130),)
    (t,) = rec.targets
    assert (t.span, t.capture, t.done) == ("s1", "c1", False)
    assert t.dispatcher not in ("", "d1")
    assert last_status(dec, Kind.SPAN, "s1").state is SpanState.SCHEDULING
    assert not created(dec, Kind.DISPATCHER)


@pytest.mark.parametrize(
    ("spans", "target", "extra", "reason"),
    [
        (("nope",), "c1", [], "SpanNotFound"),
        (("s1",), "", [], "InvalidSpec"),
        (("s1", "s1"), "c1", [], "InvalidSpec"),
        (("s1",), "ghost", [], "CaptureNotFound"),
        (("s1",), "dead", [capture("dead", alive=False)], "CaptureNotAlive"),
        (("s1",), "dr", [capture("dr", draining=True)], "CaptureDraining"),
    ],
)
def test_validation(spans, target, extra, reason):
    op = operator("mv", OpType.MOVE, spans, target=target)
    dec = decide(world(table(1), *CAPS, S1, D1, op, *extra), memory())
    assert flat(dec) == [("status", "SpanOperator", "mv"), ("event", "SpanOperator", "mv", "OperatorFailed")]
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, reason)


def test_already_on_target():
    op = operator("mv", OpType.MOVE, ("s1",), target="c0")
    dec = decide(world(table(1), *CAPS, S1, D1, op), memory())
    assert flat(dec) == [("status", "SpanOperator", "mv")]
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.phase, rec.status_reason) == (OpPhase.SUCCEEDED, "AlreadyOnTarget")


TARGET = Target(span="s1", key_range=S1.key_range, capture="c1", dispatcher="dnew")
ORIGIN = Origin(span="s1", dispatcher="d1", capture="c0", checkpoint_ts=130)


def at_remove_origin(*recs, caps=CAPS):
    op = operator(
        "mv",
        OpType.MOVE,
        ("s1",),
        OpPhase.RUNNING,
        Stage.REMOVE_ORIGIN,
        target="c1",
        origins=(ORIGIN,),
        targets=(TARGET,),
        checkpoint_ts=120,
    )
    return [table(1), *caps, replace(S1, state=SpanState.SCHEDULING, operator="mv"), op, *recs]


def test_remove_origin_waits_while_origin_closes():
    dec = decide(world(*at_remove_origin(replace(D1, deleting=True))), memory())
    assert flat(dec) == []


def test_remove_origin_done_records_add_dest_then_creates_destination():
    final = replace(D1, deleting=True, state=DispatcherState.STOPPED, checkpoint_ts=180)
    dec = decide(world(*at_remove_origin(final)), memory())
    # still there: waits, but records the higher final checkpoint
    assert flat(dec) == [("status", "SpanOperator", "mv")]
    op = last_status(dec, Kind.OPERATOR, "mv")
    assert op.origins[0].checkpoint_ts == 180
    recs = [r for r in at_remove_origin() if r.kind is not Kind.OPERATOR]
    dec = decide(world(*recs, op), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", "mv"),
        ("status", "Span", "s1"),
        ("create", "Dispatcher", "dnew"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.stage, rec.checkpoint_ts, rec.targets[0].start_ts) == (Stage.ADD_DEST, 180, 180)
    (d,) = created(dec, Kind.DISPATCHER)
    assert (d.name, d.capture, d.start_ts) == ("dnew", "c1", 180)


def test_destination_lost_keeps_closing_origin_never_creates():
    caps = [capture("c0"), capture("c1", alive=False)]
    dec = decide(world(*at_remove_origin(D1, caps=caps)), memory())
    assert flat(dec) == [("delete", "Dispatcher", "d1")]
    dec = decide(world(*at_remove_origin(caps=caps)), memory())
    assert not created(dec, Kind.DISPATCHER) or all(d.operator != "mv" for d in created(dec, Kind.DISPATCHER))
    got = [w for w in flat(dec) if w[2] in ("s1", "mv")]
    assert got[:3] == [
        ("status", "Span", "s1"),
        ("status", "SpanOperator", "mv"),
        ("event", "SpanOperator", "mv", "OperatorFailed"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "DestinationLost")
    first = statuses(dec, Kind.SPAN, "s1")[0]
    assert (first.state, first.checkpoint_ts, first.dispatcher) == (SpanState.ABSENT, 130, "")


def test_origin_capture_lost_released_then_advances():
    caps = [capture("c0", alive=False), capture("c1")]
    dec = decide(world(*at_remove_origin(D1, caps=caps)), memory())
    assert flat(dec) == [("delete", "Dispatcher", "d1"), ("fence", "Capture", "c0"), ("unfinalize", "Dispatcher", "d1")]
    dec = decide(world(*at_remove_origin(caps=caps)), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", "mv"),
        ("status", "Span", "s1"),
        ("create", "Dispatcher", "dnew"),
    ]


def at_add_dest(d_state=None, caps=CAPS):
    t = replace(TARGET, start_ts=130)
    op = operator(
        "mv",
        OpType.MOVE,
        ("s1",),
        OpPhase.RUNNING,
        Stage.ADD_DEST,
        target="c1",
        origins=(ORIGIN,),
        targets=(t,),
        checkpoint_ts=130,
    )
    s = replace(S1, state=SpanState.SCHEDULING, operator="mv", capture="c1", dispatcher="dnew", checkpoint_ts=130)
    recs = [table(1), *caps, s, op]
    if d_state is not None:
        recs.append(dispatcher("dnew", s, "c1", d_state, start_ts=130, checkpoint_ts=130))
    return recs


def test_add_dest_waits_then_succeeds():
    assert flat(decide(world(*at_add_dest(DispatcherState.INITIALIZING)), memory())) == []
    dec = decide(world(*at_add_dest(DispatcherState.WORKING)), memory())
    assert flat(dec) == [("status", "Span", "s1"), ("status", "SpanOperator", "mv")]
    assert last_status(dec, Kind.SPAN, "s1").state is SpanState.REPLICATING
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.phase, rec.targets[0].capture) == (OpPhase.SUCCEEDED, "c1")


def test_add_dest_destination_lost():
    caps = [capture("c0"), capture("c1", alive=False)]
    dec = decide(world(*at_add_dest(DispatcherState.INITIALIZING, caps=caps)), memory())
    assert flat(dec) == [
        ("delete", "Dispatcher", "dnew"),
        ("fence", "Capture", "c1"),
        ("unfinalize", "Dispatcher", "dnew"),
    ]
    dec = decide(world(*at_add_dest(caps=caps)), memory())
    rec = last_status(dec, Kind.OPERATOR, "mv")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "DestinationLost")
    assert statuses(dec, Kind.SPAN, "s1")[0].state is SpanState.ABSENT
