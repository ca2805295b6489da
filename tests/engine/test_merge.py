"""Merge: validation (adjacency), sources closed before the merged span exists, min checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from controller.engine.maintainer import Memory, decide
from controller.model.keys import KeyRange
from tests.engine.fixtures import (
    EPOCH,
    DispatcherState,
    Kind,
    OpPhase,
    OpType,
    Origin,
    SpanState,
    Stage,
    Store,
    Target,
    capture,
    changefeed,
    created,
    describe,
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


def test_merge_never_starts_below_the_checkpoint_when_a_source_span_vanished():
    """Tick.checkpoint_floor: "Nothing is ever started below this: the published checkpoint, or the changefeed's
    start ts". A Merge in RemoveOrigin whose source ``b`` had no dispatcher (it was Absent, so no origin was
    recorded) and whose Span object was then deleted by hand: ``final_checkpoint`` finds neither an origin nor
    the span and returns 0.

    Expected: the merged span and its dispatcher start at or above the changefeed checkpoint (100 here).
    Actual: CreateSpans records checkpointTs 0, the merged Span is created with startTs 0 and its Dispatcher
    with startTs 0 -- below the changefeed's startTs, i.e. replicating from the beginning of time. Found by the
    property test (redo changefeed, limit 1: merge, then delete a source span).
    """
    halves = pieces(1, 2)
    a = span("a", key_range=halves[0], state=SpanState.REMOVING, operator="mg", checkpoint_ts=150)
    merged = Target(span="merged", key_range=KeyRange(halves[0].start, halves[1].end))
    op = operator(
        "mg",
        OpType.MERGE,
        ("a", "b"),
        OpPhase.RUNNING,
        Stage.REMOVE_ORIGIN,
        targets=(merged,),
        origins=(Origin(span="a", dispatcher="da", capture="c0", checkpoint_ts=150),),
        checkpoint_ts=100,
    )
    dec = decide(world(table(1), *CAPS, a, op), memory())
    spans = created(dec, Kind.SPAN)
    (m,) = [s for s in spans if s.name == "merged"]
    assert m.start_ts >= 100
    assert [d.start_ts for d in created(dec, Kind.DISPATCHER) if d.start_ts < 100] == []


def test_add_spans_merged_working_succeeds():
    t = replace(MERGED, capture="c1", dispatcher="dm", start_ts=125)
    m = span(
        "merged",
        key_range=t.key_range,
        state=SpanState.SCHEDULING,
        operator="mg",
        capture="c1",
        dispatcher="dm",
        checkpoint_ts=125,
    )
    op = operator(
        "mg",
        OpType.MERGE,
        ("a", "b"),
        OpPhase.RUNNING,
        Stage.ADD_SPANS,
        origins=ORIGINS,
        targets=(t,),
        checkpoint_ts=125,
    )
    dm = dispatcher("dm", m, "c1", DispatcherState.WORKING, checkpoint_ts=130)
    dec = decide(world(table(1), *CAPS, C, DC, m, dm, op), memory())
    assert flat(dec) == [("status", "Span", "merged"), ("status", "SpanOperator", "mg")]
    assert last_status(dec, Kind.OPERATOR, "mg").phase is OpPhase.SUCCEEDED
    assert last_status(dec, Kind.SPAN, "merged").state is SpanState.REPLICATING
    assert trange(1).contains_range(m.key_range)


def test_add_spans_merged_destination_lost_succeeds_partially_placed_and_leaves_absent():
    """Found on a real cluster (with Split): the sources gone, the merged span created, its destination lost.
    Was: Failed (DestinationLost) with a warning Event, though the merge had done what was asked."""
    t = replace(MERGED, capture="c1", dispatcher="dm", start_ts=125)
    m = span(
        "merged",
        key_range=t.key_range,
        state=SpanState.SCHEDULING,
        operator="mg",
        capture="c1",
        dispatcher="dm",
        checkpoint_ts=125,
    )
    op = operator(
        "mg",
        OpType.MERGE,
        ("a", "b"),
        OpPhase.RUNNING,
        Stage.ADD_SPANS,
        origins=ORIGINS,
        targets=(t,),
        checkpoint_ts=125,
    )
    dec = decide(world(table(1), capture("c0"), capture("c1", alive=False), C, DC, m, op), memory())
    assert flat(dec)[:2] == [("status", "Span", "merged"), ("status", "SpanOperator", "mg")]
    assert ("event", "SpanOperator", "mg", "OperatorFailed") not in flat(dec)
    rec = last_status(dec, Kind.OPERATOR, "mg")
    assert (rec.phase, rec.status_reason) == (OpPhase.SUCCEEDED, "PartiallyPlaced")
    assert rec.message == (
        "1 of 1 new spans not placed (the Merge itself is done): merged: "
        "destination capture c1 lost; left Absent for the basic scheduler"
    )
    assert [(t.lost, t.lost_reason) for t in rec.targets] == [(True, "DestinationLost")]
    first = statuses(dec, Kind.SPAN, "merged")[0]
    assert (first.state, first.checkpoint_ts) == (SpanState.ABSENT, 125)


def _every_capture_lost() -> Store:
    """Sources a (c0) and b (c1) still have their dispatchers; c0 and c1 are both lost; RemoveOrigin."""
    st = Store()
    st.add(changefeed(), table(1), capture("c0", alive=False), capture("c1", alive=False))
    st.lost = {"c0", "c1"}
    st.add(*at(Stage.REMOVE_ORIGIN, DA, DB)[1 + len(CAPS) :])
    return st


def _run(st: Store, mem: Memory, until: Callable[[], bool], limit: int = 40) -> Memory:
    for _ in range(limit):
        if until():
            return mem
        _, mem = st.step(mem)
    raise AssertionError(f"not reached in {limit} steps: {sorted(st.objects)}")


def test_every_capture_lost_before_the_merged_span_exists_creates_it_absent_and_succeeds():
    """Was: the merged span got no destination and the merge Failed with "destination capture (none) lost"."""
    st = _every_capture_lost()
    mem = _run(st, memory(), lambda: st.get(Kind.OPERATOR, "mg").phase.terminal)  # type: ignore[union-attr]
    op = st.get(Kind.OPERATOR, "mg")
    assert (op.phase, op.status_reason) == (OpPhase.SUCCEEDED, "PartiallyPlaced")
    assert op.message == (
        "1 of 1 new spans not placed (the Merge itself is done): merged: no live, non-draining capture "
        "(c0, c1 lost); left Absent for the basic scheduler, which places Absent spans as soon as a capture is live"
    )
    assert st.get(Kind.SPAN, "a") is None
    assert st.get(Kind.SPAN, "b") is None
    merged = st.get(Kind.SPAN, "merged")
    assert (merged.key_range, merged.state, merged.checkpoint_ts) == (MERGED.key_range, SpanState.ABSENT, 125)
    assert not [d for d in st.of(Kind.DISPATCHER).values() if d.span == "merged"]  # type: ignore[attr-defined]
    st.add(capture("c2"))
    _run(st, mem, lambda: st.get(Kind.SPAN, "merged").state is SpanState.REPLICATING)  # type: ignore[union-attr]
    assert st.get(Kind.SPAN, "merged").capture == "c2"


def test_every_capture_lost_maintainer_killed_at_any_write_finishes_with_the_same_outcome():
    def origins_gone(st: Store) -> bool:
        return not ({"da", "db"} & {n for n in st.of(Kind.DISPATCHER)})

    st = _every_capture_lost()
    mem = _run(st, memory(), lambda: origins_gone(st))
    dec = decide(st.world(), mem)
    (chain,) = [c for c in dec.chains if any(describe(w)[1:3] == ("SpanOperator", "mg") for w in c.writes)]
    outcomes = set()
    for cut in range(len(chain.writes) + 1):
        st = _every_capture_lost()
        mem = _run(st, memory(), lambda st=st: origins_gone(st))
        st.apply_chain(chain, cut)
        _run(st, Memory(epoch=EPOCH + 1, identity="m2"), lambda st=st: st.get(Kind.OPERATOR, "mg").phase.terminal)
        op = st.get(Kind.OPERATOR, "mg")
        m = st.get(Kind.SPAN, "merged")
        outcomes.add((op.phase, op.status_reason, op.message, m.key_range, m.state, st.get(Kind.SPAN, "a") is None))
    assert len(outcomes) == 1
    ((phase, reason, _, rng, state, sources_gone),) = outcomes
    assert (phase, reason, rng, state, sources_gone) == (
        OpPhase.SUCCEEDED,
        "PartiallyPlaced",
        MERGED.key_range,
        SpanState.ABSENT,
        True,
    )
