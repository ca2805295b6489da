"""Split: validation, the recorded shape, CreateSpans (children before the parent goes), AddSpans."""

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

S1 = span("s1", capture="c0", dispatcher="d1", checkpoint_ts=120)
D1 = dispatcher("d1", S1, "c0", checkpoint_ts=130)
CAPS = [capture("c0"), capture("c1")]
MID = trange(1).even_split_keys(2)[0]


def test_start_records_shape_before_closing_parent():
    op = operator("sp", OpType.SPLIT, ("s1",), split_into=3)
    dec = decide(world(table(1), *CAPS, S1, D1, op), memory())
    assert flat(dec) == [
        ("status", "SpanOperator", "sp"),
        ("status", "Span", "s1"),
        ("delete", "Dispatcher", "d1"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "sp")
    assert (rec.phase, rec.stage, rec.checkpoint_ts) == (OpPhase.RUNNING, Stage.REMOVE_ORIGIN, 120)
    assert tuple(t.key_range for t in rec.targets) == pieces(1, 3)
    assert len({t.span for t in rec.targets}) == 3
    assert last_status(dec, Kind.SPAN, "s1").state is SpanState.REMOVING


def test_start_with_explicit_keys():
    op = operator("sp", OpType.SPLIT, ("s1",), split_keys=(MID,))
    dec = decide(world(table(1), *CAPS, S1, D1, op), memory())
    rec = last_status(dec, Kind.OPERATOR, "sp")
    assert tuple(t.key_range for t in rec.targets) == (
        KeyRange(trange(1).start, MID),
        KeyRange(MID, trange(1).end),
    )


@pytest.mark.parametrize(
    ("spans", "kw", "tbl", "reason"),
    [
        (("nope",), {"split_into": 2}, table(1), "SpanNotFound"),
        (("s1", "s1"), {"split_into": 2}, table(1), "InvalidSpec"),
        (("s1",), {}, table(1), "InvalidSpec"),
        (("s1",), {"split_into": 1}, table(1), "InvalidSpec"),
        (("s1",), {"split_keys": (b"a",)}, table(1), "InvalidSplitKeys"),
        (("s1",), {"split_keys": (trange(1).end,)}, table(1), "InvalidSplitKeys"),
        (("s1",), {"split_keys": (MID, MID)}, table(1), "InvalidSplitKeys"),
        (("s1",), {"split_into": 2}, table(1, splittable=False), "NotSplittable"),
        (("s1",), {"split_into": 2, "target": "ghost"}, table(1), "CaptureNotFound"),
    ],
)
def test_validation(spans, kw, tbl, reason):
    op = operator("sp", OpType.SPLIT, spans, **kw)
    dec = decide(world(tbl, *CAPS, S1, D1, op), memory())
    assert flat(dec) == [("status", "SpanOperator", "sp"), ("event", "SpanOperator", "sp", "OperatorFailed")]
    assert last_status(dec, Kind.OPERATOR, "sp").status_reason == reason


CHILDREN = tuple(Target(span=f"child{i}", key_range=r) for i, r in enumerate(pieces(1, 2)))
ORIGIN = Origin(span="s1", dispatcher="d1", capture="c0", checkpoint_ts=130)


def at(stage, *recs, targets=CHILDREN, parent=True, cp=120):
    op = operator(
        "sp", OpType.SPLIT, ("s1",), OpPhase.RUNNING, stage, origins=(ORIGIN,), targets=targets, checkpoint_ts=cp
    )
    extra = [replace(S1, state=SpanState.REMOVING, operator="sp")] if parent else []
    return [table(1), *CAPS, *extra, op, *recs]


def test_remove_origin_waits():
    assert flat(decide(world(*at(Stage.REMOVE_ORIGIN, replace(D1, deleting=True))), memory())) == []


def test_origin_gone_creates_children_deletes_parent_and_places_them():
    dec = decide(world(*at(Stage.REMOVE_ORIGIN)), memory())
    got = flat(dec)
    ds = created(dec, Kind.DISPATCHER)
    assert got == [
        ("status", "SpanOperator", "sp"),
        ("create", "Span", "child0"),
        ("create", "Span", "child1"),
        ("delete", "Span", "s1"),
        ("status", "SpanOperator", "sp"),
        ("status", "Span", "child0"),
        ("status", "Span", "child1"),
        ("create", "Dispatcher", ds[0].name),
        ("create", "Dispatcher", ds[1].name),
    ]
    first, second = statuses(dec, Kind.OPERATOR, "sp")
    assert (first.stage, first.checkpoint_ts) == (Stage.CREATE_SPANS, 130)
    assert all(t.start_ts == 130 for t in first.targets)
    assert second.stage is Stage.ADD_SPANS
    assert sorted(t.capture for t in second.targets) == ["c0", "c1"]  # spread by load
    kids = created(dec, Kind.SPAN)
    assert [(k.key_range, k.start_ts) for k in kids] == [(r, 130) for r in pieces(1, 2)]
    assert [(d.span, d.start_ts) for d in ds] == [("child0", 130), ("child1", 130)]


def test_create_spans_restored_with_some_children_created():
    c0 = span("child0", key_range=CHILDREN[0].key_range, state=None, start_ts=130, checkpoint_ts=0)
    targets = tuple(replace(t, start_ts=130) for t in CHILDREN)
    dec = decide(world(*at(Stage.CREATE_SPANS, c0, targets=targets, cp=130)), memory())
    kids = created(dec, Kind.SPAN)
    assert [(k.name, k.key_range, k.start_ts) for k in kids] == [("child1", CHILDREN[1].key_range, 130)]
    assert ("delete", "Span", "s1") in flat(dec)
    assert sorted(d.span for d in created(dec, Kind.DISPATCHER)) == ["child0", "child1"]


def test_add_spans_all_working_succeeds():
    targets = (
        replace(CHILDREN[0], capture="c0", dispatcher="k0", start_ts=130),
        replace(CHILDREN[1], capture="c1", dispatcher="k1", start_ts=130),
    )
    kids = [
        span(f"child{i}", key_range=t.key_range, state=SpanState.SCHEDULING, operator="sp", capture=t.capture,
             dispatcher=t.dispatcher, checkpoint_ts=130)
        for i, t in enumerate(targets)
    ]
    ds = [dispatcher(t.dispatcher, k, t.capture, DispatcherState.WORKING, checkpoint_ts=140)
          for t, k in zip(targets, kids, strict=True)]
    recs = at(Stage.ADD_SPANS, *kids, ds[0], targets=targets, parent=False, cp=130)
    dec = decide(world(*recs), memory())
    # child0 settles first, then the progress is recorded, then child1's missing dispatcher is re-issued
    assert flat(dec) == [("status", "Span", "child0"), ("status", "SpanOperator", "sp"), ("create", "Dispatcher", "k1")]
    rec = last_status(dec, Kind.OPERATOR, "sp")
    assert (rec.phase, [t.done for t in rec.targets]) == (OpPhase.RUNNING, [True, False])
    dec = decide(world(*recs, ds[1]), memory())
    assert flat(dec) == [("status", "Span", "child0"), ("status", "Span", "child1"), ("status", "SpanOperator", "sp")]
    assert last_status(dec, Kind.OPERATOR, "sp").phase is OpPhase.SUCCEEDED


def test_add_spans_child_destination_lost_partially_placed():
    caps = [capture("c0"), capture("c1", alive=False)]
    targets = (
        replace(CHILDREN[0], capture="c0", dispatcher="k0", start_ts=130),
        replace(CHILDREN[1], capture="c1", dispatcher="k1", start_ts=130),
    )
    kids = [
        span(f"child{i}", key_range=t.key_range, state=SpanState.SCHEDULING, operator="sp", capture=t.capture,
             dispatcher=t.dispatcher, checkpoint_ts=130)
        for i, t in enumerate(targets)
    ]
    k0 = dispatcher("k0", kids[0], "c0", DispatcherState.WORKING, checkpoint_ts=140)
    k1 = dispatcher("k1", kids[1], "c1", DispatcherState.INITIALIZING, checkpoint_ts=130)
    op = operator("sp", OpType.SPLIT, ("s1",), OpPhase.RUNNING, Stage.ADD_SPANS, origins=(ORIGIN,), targets=targets,
                  checkpoint_ts=130)
    dec = decide(world(table(1), *caps, *kids, k0, k1, op), memory())
    assert flat(dec) == [
        ("status", "Span", "child0"),
        ("status", "SpanOperator", "sp"),
        ("delete", "Dispatcher", "k1"),
        ("unfinalize", "Dispatcher", "k1"),
    ]
    rec = last_status(dec, Kind.OPERATOR, "sp")
    dec = decide(world(table(1), *caps, *kids, k0, rec), memory())
    got = flat(dec)
    assert got[:2] == [("status", "Span", "child1"), ("status", "SpanOperator", "sp")]
    rec = last_status(dec, Kind.OPERATOR, "sp")
    assert (rec.phase, rec.status_reason) == (OpPhase.SUCCEEDED, "PartiallyPlaced")
    assert [(t.done, t.lost) for t in rec.targets] == [(True, False), (True, True)]
    assert statuses(dec, Kind.SPAN, "child1")[0].state is SpanState.ABSENT
