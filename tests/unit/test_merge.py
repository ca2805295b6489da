"""Merge: validation (adjacency), sources closed before the merged span exists, min checkpoint."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine.maintainer import decide
from controller.model.keys import KeyRange
from tests.unit.fixtures import (
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
    pieces,
    span,
    statuses,
    table,
    trange,
    world,
)

P = pieces(1, 3)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=150)
B = span("b", key_range=P[1], capture="c1", dispatcher="db", checkpoint_ts=120)
C = span("c", key_range=P[2], capture="c0", dispatcher="dc", checkpoint_ts=170)
DA = dispatcher("da", A, "c0", checkpoint_ts=150)
DB = dispatcher("db", B, "c1", checkpoint_ts=125)
DC = dispatcher("dc", C, "c0", checkpoint_ts=170)
CAPS = [capture("c0"), capture("c1")]
ALL = [table(1), *CAPS, A, B, C, DA, DB, DC]


def test_start_records_merged_span_before_closing_sources():
    op = operator("mg", OpType.MERGE, ("b", "a"))
    dec = decide(world(*ALL, op), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", "mg"),
        ("status", "Span", "a"),
        ("status", "Span", "b"),
        ("delete", "Dispatcher", "da"),
        ("delete", "Dispatcher", "db"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "mg")
    assert (rec.stage, rec.checkpoint_ts) == (Stage.REMOVE_ORIGIN, 120)
    (t,) = rec.targets
    assert t.key_range == KeyRange(P[0].start, P[1].end)
    assert {o.dispatcher for o in rec.origins} == {"da", "db"}


@pytest.mark.parametrize(
    ("spans", "extra", "reason"),
    [
        (("a",), [], "InvalidSpec"),
        (("a", "a"), [], "InvalidSpec"),
        (("a", "c"), [], "NotAdjacent"),
        (("a", "x"), [table(2), span("x", table_id=2, state=SpanState.ABSENT)], "NotAdjacent"),
        (("a", "nope"), [], "SpanNotFound"),
    ],
)
def test_validation(spans, extra, reason):
    op = operator("mg", OpType.MERGE, spans)
    dec = decide(world(*ALL, *extra, op), memory())
    assert [w for w in flat(dec) if w[2] == "mg"] == [
        ("status", "SpanOperator", "mg"),
        ("event", "SpanOperator", "mg", "OperatorFailed"),
    ]
    assert not [w for w in flat(dec) if w[0] == "delete"]
    assert last_status(dec, Kind.OPERATOR, "mg").status_reason == reason


MERGED = Target(span="merged", key_range=KeyRange(P[0].start, P[1].end))
ORIGINS = (
    Origin(span="a", dispatcher="da", capture="c0", checkpoint_ts=150),
    Origin(span="b", dispatcher="db", capture="c1", checkpoint_ts=125),
)


def at(stage, *recs):
    op = operator(
        "mg", OpType.MERGE, ("a", "b"), OpPhase.RUNNING, stage, origins=ORIGINS, targets=(MERGED,), checkpoint_ts=120
    )
    srcs = [replace(s, state=SpanState.REMOVING, operator="mg") for s in (A, B)]
    return [table(1), *CAPS, *srcs, C, DC, op, *recs]


def test_one_source_gone_other_still_closing():
    dec = decide(world(*at(Stage.REMOVE_ORIGIN, DB)), memory())
    assert flat(dec) == [("delete", "Dispatcher", "db")]
    dec = decide(world(*at(Stage.REMOVE_ORIGIN, replace(DB, deleting=True, state=DispatcherState.STOPPED))), memory())
    assert flat(dec) == []


def test_all_sources_gone_creates_merged_from_min_checkpoint():
    dec = decide(world(*at(Stage.REMOVE_ORIGIN)), memory())
    got = flat(dec)
    (d,) = created(dec, Kind.DISPATCHER)
    assert got == [
        ("status", "SpanOperator", "mg"),
        ("create", "Span", "merged"),
        ("delete", "Span", "a"),
        ("delete", "Span", "b"),
        ("status", "SpanOperator", "mg"),
        ("status", "Span", "merged"),
        ("create", "Dispatcher", d.name),
    ]
    first = statuses(dec, Kind.OPERATOR, "mg")[0]
    assert (first.stage, first.checkpoint_ts) == (Stage.CREATE_SPANS, 125)
    (m,) = created(dec, Kind.SPAN)
    assert (m.key_range, m.start_ts) == (MERGED.key_range, 125)
    assert d.start_ts == 125


def test_add_spans_merged_working_succeeds():
    t = replace(MERGED, capture="c1", dispatcher="dm", start_ts=125)
    m = span("merged", key_range=t.key_range, state=SpanState.SCHEDULING, operator="mg", capture="c1",
             dispatcher="dm", checkpoint_ts=125)
    op = operator("mg", OpType.MERGE, ("a", "b"), OpPhase.RUNNING, Stage.ADD_SPANS, origins=ORIGINS, targets=(t,),
                  checkpoint_ts=125)
    dm = dispatcher("dm", m, "c1", DispatcherState.WORKING, checkpoint_ts=130)
    dec = decide(world(table(1), *CAPS, C, DC, m, dm, op), memory())
    assert flat(dec) == [("status", "Span", "merged"), ("status", "SpanOperator", "mg")]
    assert last_status(dec, Kind.OPERATOR, "mg").phase is OpPhase.SUCCEEDED
    assert last_status(dec, Kind.SPAN, "merged").state is SpanState.REPLICATING
    assert trange(1).contains_range(m.key_range)


def test_add_spans_merged_destination_lost_fails_and_leaves_absent():
    t = replace(MERGED, capture="c1", dispatcher="dm", start_ts=125)
    m = span("merged", key_range=t.key_range, state=SpanState.SCHEDULING, operator="mg", capture="c1",
             dispatcher="dm", checkpoint_ts=125)
    op = operator("mg", OpType.MERGE, ("a", "b"), OpPhase.RUNNING, Stage.ADD_SPANS, origins=ORIGINS, targets=(t,),
                  checkpoint_ts=125)
    dec = decide(world(table(1), capture("c0"), capture("c1", alive=False), C, DC, m, op), memory())
    got = flat(dec)
    assert got[:3] == [
        ("status", "Span", "merged"),
        ("status", "SpanOperator", "mg"),
        ("event", "SpanOperator", "mg", "OperatorFailed"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "mg")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "DestinationLost")
    first = statuses(dec, Kind.SPAN, "merged")[0]
    assert (first.state, first.checkpoint_ts) == (SpanState.ABSENT, 125)
