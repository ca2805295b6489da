"""Add: Pending validation, the AddDest chain (record before act), progress, lost target, stale epoch."""

from __future__ import annotations

import pytest

from controller.engine.intents import ConfirmPresent
from controller.engine.maintainer import decide
from tests.engine.fixtures import (
    EPOCH,
    DispatcherState,
    Kind,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
    Stage,
    Target,
    capture,
    changefeed,
    created,
    dispatcher,
    flat,
    last_status,
    memory,
    operator,
    pieces,
    span,
    table,
    trange,
    world,
)

ABSENT = span("s1", state=SpanState.ABSENT, checkpoint_ts=150)
BUSY = span("busy", table_id=2, capture="c0", dispatcher="x")


def base(*extra):
    return [table(1), capture("c0"), capture("c1"), ABSENT, *extra]


def test_start_records_stage_before_creating_dispatcher():
    op = operator("add", OpType.ADD, ("s1",), target="c1")
    dec = decide(world(*base(op)), memory())
    (d,) = created(dec, Kind.DISPATCHER)
    assert flat(dec) == [
        ("status", "SpanOperator", "add"),
        ("status", "Span", "s1"),
        ("create", "Dispatcher", d.name),
    ]
    rec = last_status(dec, Kind.OPERATOR, "add")
    assert (rec.phase, rec.stage, rec.epoch) == (OpPhase.RUNNING, Stage.ADD_DEST, EPOCH)
    want = Target(span="s1", key_range=ABSENT.key_range, capture="c1", dispatcher=d.name, start_ts=150)
    assert rec.targets == (want,)
    sp = last_status(dec, Kind.SPAN, "s1")
    assert (sp.state, sp.operator, sp.capture, sp.dispatcher) == (SpanState.SCHEDULING, "add", "c1", d.name)
    assert (d.capture, d.start_ts, d.epoch, d.span, d.operator) == ("c1", 150, EPOCH, "s1", "add")


def test_start_ts_never_below_changefeed_checkpoint():
    op = operator("add", OpType.ADD, ("s1",), target="c0")
    dec = decide(world(*base(op), cf=changefeed(checkpoint_ts=400)), memory())
    (d,) = created(dec, Kind.DISPATCHER)
    assert d.start_ts == 400


@pytest.mark.parametrize(
    ("spans", "target", "extra", "reason"),
    [
        (("nope",), "c0", [], "SpanNotFound"),
        (("s1", "s1"), "c0", [], "InvalidSpec"),
        (("s1",), "ghost", [], "CaptureNotFound"),
        (("s1",), "dead", [capture("dead", alive=False)], "CaptureNotAlive"),
        (("s1",), "dr", [capture("dr", draining=True)], "CaptureDraining"),
        (("busy",), "c0", [BUSY, dispatcher("x", BUSY, "c0"), table(2)], "SpanBusy"),
    ],
)
def test_validation_fails_with_reason_and_event_only(spans, target, extra, reason):
    op = operator("add", OpType.ADD, spans, target=target)
    dec = decide(world(*base(op, *extra)), memory())
    ops_writes = [w for w in flat(dec) if w[2] == "add"]
    assert ops_writes == [("status", "SpanOperator", "add"), ("event", "SpanOperator", "add", "OperatorFailed")]
    rec = last_status(dec, Kind.OPERATOR, "add")
    assert (rec.phase, rec.status_reason, rec.stage) == (OpPhase.FAILED, reason, Stage.NONE)
    assert rec.message
    assert [d for d in created(dec, Kind.DISPATCHER) if d.operator == "add"] == []


def test_scheduler_operator_failure_has_no_event():
    op = operator("add", OpType.ADD, ("nope",), target="c0", source=OpSource.SCHEDULER)
    dec = decide(world(*base(op)), memory())
    assert [w for w in flat(dec) if w[2] == "add"] == [("status", "SpanOperator", "add")]


def running_add(d_state=None, cap="c1", **d_kw):
    s = span("s1", state=SpanState.SCHEDULING, operator="add", capture=cap, dispatcher="dnew", checkpoint_ts=150)
    t = Target(span="s1", key_range=s.key_range, capture=cap, dispatcher="dnew", start_ts=150)
    op = operator("add", OpType.ADD, ("s1",), OpPhase.RUNNING, Stage.ADD_DEST, target=cap, targets=(t,))
    recs = [table(1), capture("c0"), capture("c1"), s, op]
    if d_state is not None:
        recs.append(dispatcher("dnew", s, cap, d_state, checkpoint_ts=150, start_ts=150, **d_kw))
    return recs


def test_missing_dispatcher_is_recreated_with_recorded_name():
    dec = decide(world(*running_add()), memory())
    # After a consistent read confirming the operator still records it (simulator seed 738533: a zombie had
    # rewritten the target meanwhile, and the dispatcher made from the old one was claimed by nothing).
    assert flat(dec) == [("confirm", "SpanOperator", "add"), ("create", "Dispatcher", "dnew")]
    (confirm,) = [w for c in dec.chains for w in c.writes if isinstance(w, ConfirmPresent)]
    op = next(r for r in running_add() if r.kind is Kind.OPERATOR)
    assert (confirm.uid, confirm.resource_version) == (op.uid, op.resource_version)
    (d,) = created(dec, Kind.DISPATCHER)
    assert (d.capture, d.start_ts) == ("c1", 150)


@pytest.mark.parametrize("state", [DispatcherState.PENDING, DispatcherState.INITIALIZING])
def test_waits_while_dispatcher_starts(state):
    assert flat(decide(world(*running_add(state)), memory())) == []


def test_working_settles_span_then_succeeds():
    dec = decide(world(*running_add(DispatcherState.WORKING)), memory())
    assert flat(dec) == [("status", "Span", "s1"), ("status", "SpanOperator", "add")]
    sp = last_status(dec, Kind.SPAN, "s1")
    assert (sp.state, sp.capture, sp.dispatcher, sp.operator) == (SpanState.REPLICATING, "c1", "dnew", "")
    rec = last_status(dec, Kind.OPERATOR, "add")
    assert (rec.phase, rec.targets[0].done, rec.targets[0].lost) == (OpPhase.SUCCEEDED, True, False)


def test_target_lost_closes_dispatcher_then_span_absent():
    recs = running_add(DispatcherState.INITIALIZING)
    recs[2] = capture("c1", alive=False)
    dec = decide(world(*recs), memory())
    assert flat(dec) == [
        ("delete", "Dispatcher", "dnew"),
        ("fence", "Capture", "c1"),
        ("unfinalize", "Dispatcher", "dnew"),
    ]
    gone = [r for r in recs if r.name != "dnew"]
    dec = decide(world(*gone), memory())
    got = flat(dec)
    assert got[:3] == [
        ("status", "Span", "s1"),
        ("status", "SpanOperator", "add"),
        ("event", "SpanOperator", "add", "OperatorFailed"),
    ]
    sp = last_status(dec, Kind.SPAN, "s1")
    assert (sp.state, sp.capture, sp.dispatcher, sp.operator, sp.checkpoint_ts) == (SpanState.ABSENT, "", "", "", 150)
    rec = last_status(dec, Kind.OPERATOR, "add")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "CaptureLost")
    assert rec.targets[0].lost


def test_an_add_never_runs_keys_another_spans_dispatcher_runs():
    """A deposed maintainer's view lagged; it and its successor each covered a new table, with different cuts, so
    two accepted spans overlapped. Placing both would run the same keys twice. A dispatcher is now created only
    when no dispatcher of another span overlaps its keys; otherwise the placement is given up (span Absent) and
    the safety net removes the newer of the overlapping spans.
    """
    halves = pieces(1, 2)
    left = span("left", key_range=halves[0], capture="c0", dispatcher="dl")
    whole = span("whole", state=SpanState.SCHEDULING, operator="add-w", capture="c1", dispatcher="dw", created=2000.0)
    add = operator(
        "add-w",
        OpType.ADD,
        ("whole",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c1",
        targets=(Target(span="whole", key_range=trange(1), capture="c1", dispatcher="dw", start_ts=100),),
    )
    dl = dispatcher("dl", left, "c0", DispatcherState.WORKING)
    dec = decide(world(table(1), capture("c0"), capture("c1"), left, whole, add, dl), memory())
    assert created(dec, Kind.DISPATCHER) == []
    assert last_status(dec, Kind.SPAN, "whole").state is SpanState.ABSENT
    rec = last_status(dec, Kind.OPERATOR, "add-w")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "KeysBusy")


def test_rejected_dispatcher_replaced_under_new_name_only_after_gone():
    recs = running_add(DispatcherState.REJECTED, epoch=EPOCH - 1)
    dec = decide(world(*recs), memory())
    got = flat(dec)
    assert got == [("status", "SpanOperator", "add"), ("delete", "Dispatcher", "dnew")]
    new_name = last_status(dec, Kind.OPERATOR, "add").targets[0].dispatcher
    assert new_name != "dnew"
    assert not created(dec, Kind.DISPATCHER)
    # still there (deleting, finalizer not yet released): nothing new is created
    op2 = last_status(dec, Kind.OPERATOR, "add")
    still = [r for r in recs if r.kind is not Kind.OPERATOR and r.name != "dnew"]
    d_old = next(r for r in recs if r.name == "dnew")
    from dataclasses import replace

    dec = decide(world(*still, op2, replace(d_old, deleting=True)), memory())
    assert not created(dec, Kind.DISPATCHER)
    # gone: the replacement is created under the new name
    dec = decide(world(*still, op2), memory())
    (d,) = created(dec, Kind.DISPATCHER)
    assert (d.name, d.epoch, d.capture, d.start_ts) == (new_name, EPOCH, "c1", 150)
