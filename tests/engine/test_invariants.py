"""The invariant functions: each reports a violation for a bad world and nothing for a good one."""

from __future__ import annotations

from dataclasses import replace

from controller.engine import invariants
from controller.model.keys import KeyRange
from tests.engine.fixtures import (
    DispatcherState,
    Mode,
    OpPhase,
    OpType,
    SchedulerConfig,
    SpanState,
    Stage,
    Target,
    capture,
    changefeed,
    dispatcher,
    operator,
    pieces,
    span,
    table,
    world,
)

P = pieces(1, 2)
A = span("a", key_range=P[0], capture="c0", dispatcher="da")
B = span("b", key_range=P[1], capture="c1", dispatcher="db")
DA = dispatcher("da", A, "c0")
DB = dispatcher("db", B, "c1")
GOOD = [table(1), capture("c0"), capture("c1"), A, B, DA, DB]
WIDE = span("w", key_range=KeyRange(P[0].start, P[1].end), state=SpanState.ABSENT)


def test_good_world_has_no_violations():
    w = world(*GOOD)
    assert invariants.coverage(w) == []
    assert invariants.unexplained_overlaps(w) == []
    assert invariants.single_owner([DA, DB]) == []
    assert invariants.bounded(w) == []
    assert invariants.settled(w) == []


def test_coverage_hole_and_overlap():
    assert invariants.coverage(world(table(1), A)) == [
        f"coverage: table t1 (default) has a hole {P[1]}",
    ]
    assert invariants.coverage(world(*GOOD, WIDE)) == [
        "coverage: table t1 (default) spans a and w overlap",
        "coverage: table t1 (default) spans w and b overlap",
    ]


def test_coverage_ignores_invalid_and_deleted_tables():
    bad = replace(WIDE, state=SpanState.INVALID)
    assert invariants.coverage(world(*GOOD, bad)) == []
    assert invariants.coverage(world(table(1, deleting=True))) == []


def test_coverage_redo_mode_checked_separately():
    w = world(*GOOD, cf=changefeed(redo=True))
    assert invariants.coverage(w) == [f"coverage: table t1 (redo) has a hole {KeyRange.of_table(1)}"]


def test_unexplained_overlap_and_explained_by_one_operator():
    problems = invariants.unexplained_overlaps(world(*GOOD, WIDE))
    assert [p.split(" of table")[0] for p in problems] == ["overlap: spans a and w", "overlap: spans w and b"]
    merge = operator(
        "mg",
        OpType.MERGE,
        ("a", "b"),
        OpPhase.RUNNING,
        Stage.CREATE_SPANS,
        targets=(Target(span="w", key_range=WIDE.key_range),),
    )
    assert invariants.unexplained_overlaps(world(*GOOD, WIDE, merge)) == []


def test_single_owner():
    dup = dispatcher("dup", A, "c1")
    (problem,) = invariants.single_owner([DA, DB, dup])
    assert problem.startswith("single owner: dispatchers da (on c0) and dup (on c1) both run keys")
    redo = dispatcher("redo", replace(A, mode=Mode.REDO), "c1")
    assert invariants.single_owner([DA, redo]) == []  # modes are independent


def test_bounded():
    cf = changefeed(scheduler=SchedulerConfig(max_in_flight_operators=1))
    ops = [operator(f"o{i}", OpType.ADD, (f"s{i}",), OpPhase.RUNNING, Stage.ADD_DEST) for i in range(2)]
    assert invariants.bounded(world(*GOOD, ops[0], cf=cf)) == []
    assert invariants.bounded(world(*GOOD, *ops, cf=cf)) == [
        "bounded: 2 operators Running and 0 placements in flight, limit 1"
    ]
    # A placement in flight (placement.py) takes a slot too.
    placing = replace(A, state=SpanState.SCHEDULING, operator="")
    assert invariants.bounded(world(*GOOD[:3], placing, B, DB, ops[0], cf=cf)) == [
        "bounded: 1 operators Running and 1 placements in flight, limit 1"
    ]
    assert invariants.bounded(world(*GOOD[:3], placing, B, DB, ops[0], cf=cf), ignore_spans={"a"}) == []


def test_settled_reports_each_problem():
    op = operator("o", OpType.ADD, ("a",), OpPhase.RUNNING, Stage.ADD_DEST)
    assert invariants.settled(world(*GOOD, op)) == ["lost operator: o (Add) still Running in AddDest"]
    absent = replace(A, state=SpanState.ABSENT)
    assert invariants.settled(world(*GOOD[:3], absent, B, DB)) == ["liveness: span a is Absent, not Replicating"]
    orphan = dispatcher("orph", span("gone", table_id=1), "c0")
    assert "orphan: dispatcher orph has no span (gone)" in invariants.settled(world(*GOOD, orphan))
    assert invariants.settled(
        world(*GOOD[:3], replace(A, capture="c0"), B, replace(DA, capture="c2"), DB, capture("c2", alive=False))
    ) == ["liveness: span a runs on lost capture c2"]
    stopped = replace(DA, state=DispatcherState.STOPPED)
    assert len(invariants.settled(world(*GOOD[:5], stopped, DB))) == 1
    gone_table = world(table(1, deleting=True), A, B)
    assert sorted(invariants.settled(gone_table)) == [
        "deleted table: span a of table 1 remains",
        "deleted table: span b of table 1 remains",
    ]
