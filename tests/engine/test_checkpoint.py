"""The changefeed checkpoint: the minimum over spans and in-flight operators, never going backwards."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine import checkpoint
from controller.engine.maintainer import decide
from controller.engine.world import Options, Tick
from tests.engine.fixtures import (
    EPOCH,
    DispatcherState,
    Kind,
    OpPhase,
    OpType,
    SpanState,
    Stage,
    Target,
    capture,
    changefeed,
    dispatcher,
    indexed_world,
    last_status,
    memory,
    operator,
    pieces,
    span,
    table,
    world,
)

P = pieces(1, 3)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=200)
B = span("b", key_range=P[1], capture="c0", dispatcher="db", checkpoint_ts=200)
C = span("c", key_range=P[2], capture="c0", dispatcher="dc", checkpoint_ts=200)
DA = dispatcher("da", A, "c0", checkpoint_ts=300)
DB = dispatcher("db", B, "c0", checkpoint_ts=260)
DC = dispatcher("dc", C, "c0", checkpoint_ts=280)


def compute(*recs, cf=None):
    return checkpoint.compute(Tick(world(*recs, cf=cf), EPOCH, Options()))


def test_minimum_of_working_dispatchers():
    assert compute(table(1), capture("c0"), A, B, C, DA, DB, DC) == 260


def test_written_to_changefeed_status():
    dec = decide(world(table(1), capture("c0"), A, B, C, DA, DB, DC), memory())
    assert last_status(dec, Kind.CHANGEFEED, "cf").checkpoint_ts == 260


def test_non_working_dispatcher_uses_persisted_checkpoint():
    assert compute(table(1), capture("c0"), A, B, C, DA, replace(DB, state=DispatcherState.INITIALIZING), DC) == 200


def test_absent_span_holds_it_back():
    b = replace(B, state=SpanState.ABSENT, dispatcher="", capture="", checkpoint_ts=150)
    assert compute(table(1), capture("c0"), A, b, C, DA, DC) == 150


def test_in_flight_operator_holds_it_back():
    op = operator(
        "mv",
        OpType.MOVE,
        ("a",),
        OpPhase.RUNNING,
        Stage.ADD_DEST,
        checkpoint_ts=170,
        targets=(Target(span="a", key_range=P[0], capture="c1", dispatcher="x", start_ts=170),),
    )
    assert compute(table(1), capture("c0"), A, B, C, DA, DB, DC, op) == 170


def test_undone_target_start_ts_holds_it_back():
    op = operator(
        "sp",
        OpType.SPLIT,
        ("gone",),
        OpPhase.RUNNING,
        Stage.ADD_SPANS,
        checkpoint_ts=0,
        targets=(Target(span="kid", key_range=P[0], capture="c1", dispatcher="x", start_ts=120),),
    )
    assert compute(table(1), capture("c0"), A, B, C, DA, DB, DC, op) == 120


def test_invalid_spans_and_deleted_tables_ignored():
    bad = span("bad", table_id=1, state=SpanState.INVALID, checkpoint_ts=0, start_ts=0)
    other = span("o", table_id=2, checkpoint_ts=110, state=SpanState.ABSENT)
    assert compute(table(1), table(2, deleting=True), capture("c0"), A, B, C, DA, DB, DC, bad, other) == 260


@pytest.mark.parametrize("published", [260, 500])
def test_never_backwards(published):
    cf = changefeed(checkpoint_ts=published)
    assert compute(table(1), capture("c0"), A, B, C, DA, DB, DC, cf=cf) == max(published, 260)


def test_nothing_known_keeps_previous():
    assert compute(cf=changefeed(checkpoint_ts=321)) == 321


def test_a_span_of_a_table_not_seen_yet_holds_it_back():
    """Simulator seed 3023: a deposed maintainer accepted a new Table and made its span (start 150); its
    successor's Span watch delivered the span before its Table watch delivered the Table. A span of a table
    the maintainer has not seen must hold the checkpoint (only a table seen being deleted lets go), or the
    published checkpoint passes keys delivered only up to the span's start."""
    unseen = span("new", table_id=4, state=SpanState.SCHEDULING, capture="c0", dispatcher="dn", checkpoint_ts=150)
    assert compute(table(1), capture("c0"), A, B, C, DA, DB, DC, unseen) == 150
    # The same through the index (an incremental decision) as through the full one.
    cf = changefeed()
    w = indexed_world(cf, [table(1), A, B, C, DA, DB, DC, unseen], [capture("c0")], now=1000.0)
    assert checkpoint.compute(Tick(w, EPOCH, Options())) == 150
    # Once the table is seen being deleted, its span no longer counts.
    assert compute(table(1), table(4, deleting=True), capture("c0"), A, B, C, DA, DB, DC, unseen) == 260


def test_keys_no_validated_span_covers_hold_it_where_it_is():
    """A hole (keys no span stands for) holds the checkpoint where it is, and so do keys whose only span has no status
    yet: it is not validated, its data is replicated from nothing known (the coverage rule without ``new``,
    engine/coverage.py)."""
    assert compute(table(1), capture("c0"), A, C, DA, DC) == 100
    unvalidated = replace(B, state=None, capture="", dispatcher="")
    assert compute(table(1), capture("c0"), A, unvalidated, C, DA, DC) == 100


def test_a_split_plans_its_childrens_keys_before_their_status_is_written():
    """A Running Split whose children exist without a status yet (created, the status write not landed) and whose
    parent is gone: the children's keys are planned by the operator, no hole, so the operator's checkpoint counts."""
    kids = [
        span(f"kid{i}", key_range=r, state=None, checkpoint_ts=0, start_ts=130, operator="sp")
        for i, r in enumerate(pieces(1, 2))
    ]
    targets = tuple(Target(span=k.name, key_range=k.key_range, capture="c0", start_ts=130) for k in kids)
    op = operator("sp", OpType.SPLIT, ("gone",), OpPhase.RUNNING, Stage.ADD_SPANS, checkpoint_ts=130, targets=targets)
    assert compute(table(1), capture("c0"), *kids, op) == 130
