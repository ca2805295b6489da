"""Regressions the simulator found: each test is a small hand-built World and one decision.

Every test names the simulator seed that first showed the bug (``python -m controller.sim --seed S``).
"""

from __future__ import annotations

import dataclasses

from controller.engine import intents as I
from controller.engine.maintainer import Decision, decide
from controller.engine.world import DIRECT_MUTANTS, Options, World
from controller.model.records import Record, SchedulerConfig, SpanOperator
from controller.model.states import Kind
from tests.engine.fixtures import (
    NOW,
    DispatcherState,
    OpPhase,
    OpType,
    SpanState,
    Stage,
    Target,
    capture,
    changefeed,
    created,
    dispatcher,
    memory,
    operator,
    pieces,
    span,
    statuses,
    table,
    trange,
    world,
    writes,
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
    failed one, and skipped the span on every later decision. (The basic scheduler now places spans
    without an operator, placement.py; a finished Add of that name must still not hold the span back.)
    """
    from controller.engine import naming
    from tests.engine.fixtures import Kind, created, last_status

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
    placed = last_status(dec, Kind.SPAN, "s1")
    assert (placed.state, placed.capture, placed.operator) == (SpanState.SCHEDULING, "c0", "")
    assert [d.name for d in created(dec, Kind.DISPATCHER)] == [placed.dispatcher]


def test_a_split_whose_parent_was_deleted_by_hand_fails_instead_of_hanging():
    """Seed 2167 (and 4896, 5301 for Merge): a person deleted the span a Split was splitting.

    Once the origin's dispatcher was gone the Split moved to CreateSpans, found no span to copy the
    table and mode from, and waited forever. It now ends Failed (SpanNotFound); the safety net re-covers
    the range with an Absent span.
    """
    from controller.engine import intents as I
    from controller.model.records import Target as T
    from tests.engine.fixtures import Kind, Store, changefeed, created, describe, last_status, pieces, writes

    halves = pieces(1, 2)
    op = operator(
        "sp",
        OpType.SPLIT,
        ("gone",),
        phase=OpPhase.RUNNING,
        stage=Stage.REMOVE_ORIGIN,
        split_into=2,
        targets=tuple(T(span=f"child-{i}", key_range=r) for i, r in enumerate(halves)),
    )
    api = Store()
    api.add(changefeed(), table(1), capture("c0"), op)
    dec = decide(api.world(), memory())
    rec = last_status(dec, Kind.OPERATOR, "sp")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "SpanNotFound")
    # The spans it takes for deleted are read first (none of them is there), and its keys wait for that end to land.
    assert [describe(w) for w in writes(dec) if isinstance(w, I.ConfirmGone)] == [
        ("confirm-gone", "Span", n) for n in ("gone", "child-0", "child-1")
    ]
    assert created(dec, Kind.SPAN) == []
    api.apply(dec)
    assert api.aborted == 0
    api.apply(decide(api.world(), memory()))  # the table has no span left: it joins again first
    dec = decide(api.world(), memory())
    spans = created(dec, Kind.SPAN)
    assert [s.key_range for s in spans] == [trange(1)]  # the hole, re-covered as one span (placed at once)


def test_two_running_operators_on_one_span_keep_the_one_the_span_names():
    """Seeds 3128, 3768: a superseded maintainer started an Add on a span its successor also placed.

    Both Adds stayed Running and each closed the other's dispatcher before creating its own, forever.
    The operator the span's status names now survives; the other is Canceled (reason Conflict).
    """
    from controller.model.records import Target as T
    from tests.engine.fixtures import Kind, last_status

    s = span("s1", state=SpanState.SCHEDULING, capture="c1", dispatcher="d-new", operator="add-new")
    old = operator(
        "add-old",
        OpType.ADD,
        ("s1",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c0",
        targets=(T(span="s1", key_range=trange(1), capture="c0", dispatcher="d-old", start_ts=100),),
        created=10.0,
    )
    new = operator(
        "add-new",
        OpType.ADD,
        ("s1",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c1",
        targets=(T(span="s1", key_range=trange(1), capture="c1", dispatcher="d-new", start_ts=100),),
        created=20.0,
    )
    d_old = dispatcher("d-old", s, "c0", DispatcherState.WORKING)
    dec = decide(world(table(1), capture("c0"), capture("c1"), s, old, new, d_old), memory())
    assert last_status(dec, Kind.OPERATOR, "add-old").phase is OpPhase.CANCELED
    assert last_status(dec, Kind.OPERATOR, "add-old").status_reason == "Conflict"
    # The survivor carries on: the canceled Add's dispatcher goes before its own is created.
    from tests.engine.fixtures import flat, statuses

    assert statuses(dec, Kind.OPERATOR, "add-new") == []
    assert ("delete", "Dispatcher", "d-old") in flat(dec)
    assert ("create", "Dispatcher", "d-new") not in flat(dec)


def test_a_user_span_overlapping_a_span_an_operator_owns_before_its_status_is_written_is_invalid():
    """Seeds 6290, 9754, 15660 (50,000-history run): a person deleted a span while its Add was in flight;
    hole repair re-created it under the same name (same range) and was killed before writing its status.
    A user span applied inside that range was accepted, because the re-created span had no status yet;
    the Add then finished the re-created span: two accepted spans over the same keys. A span an operator
    owns now counts as taken even before its status is written.
    """
    from controller.model.keys import KeyRange
    from controller.model.records import Target as T
    from tests.engine.fixtures import Kind, last_status

    whole = span("x", state=None, capture="", dispatcher="")
    add = operator(
        "add-x",
        OpType.ADD,
        ("x",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c0",
        targets=(T(span="x", key_range=trange(1), capture="c0", dispatcher="dx", start_ts=100),),
    )
    inner = KeyRange(trange(1).start + b"\x40", trange(1).start + b"\x80")
    user = span("user", state=None, key_range=inner, capture="", dispatcher="", created=2000.0)
    dec = decide(world(table(1), capture("c0"), whole, add, user), memory())
    assert last_status(dec, Kind.SPAN, "user").state is SpanState.INVALID


def test_an_add_never_runs_keys_another_spans_dispatcher_runs():
    """Seed 863: a deposed maintainer's view lagged; it and its successor each covered a new table, with
    different cuts, so two accepted spans overlapped. Placing both would run the same keys twice. A
    dispatcher is now created only when no dispatcher of another span overlaps its keys; otherwise the
    placement is given up (span Absent) and the safety net removes the newer of the overlapping spans.
    """
    from controller.model.records import Target as T
    from tests.engine.fixtures import Kind, created, last_status, pieces

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
        targets=(T(span="whole", key_range=trange(1), capture="c1", dispatcher="dw", start_ts=100),),
    )
    dl = dispatcher("dl", left, "c0", DispatcherState.WORKING)
    dec = decide(world(table(1), capture("c0"), capture("c1"), left, whole, add, dl), memory())
    assert created(dec, Kind.DISPATCHER) == []
    assert last_status(dec, Kind.SPAN, "whole").state is SpanState.ABSENT
    rec = last_status(dec, Kind.OPERATOR, "add-w")
    assert (rec.phase, rec.status_reason) == (OpPhase.FAILED, "KeysBusy")


def test_a_hole_whose_name_an_invalid_span_holds_is_filled_and_holds_the_checkpoint():
    """Seed 34720 (long run): a hole-fill span was refused (Invalid) because a deposed maintainer's span
    overlapped it; that span was later removed, leaving the hole, but the hole's deterministic name was the
    Invalid span's, so the hole was never filled, and the changefeed checkpoint moved past keys nobody
    replicated. Now the refused span is accepted when it fits the hole exactly, and the checkpoint does
    not move while a live table has keys no span covers.
    """
    from controller.engine import naming
    from controller.model.keys import KeyRange
    from controller.model.states import Mode
    from tests.engine.fixtures import Kind, changefeed, last_status, pieces, statuses

    left, right = pieces(1, 2)
    hole_name = naming.span_name("cf", 1, Mode.DEFAULT, left)
    refused = span(hole_name, key_range=left, state=SpanState.INVALID, message="overlapped", capture="", dispatcher="")
    r = span("r", key_range=right, capture="c0", dispatcher="dr", checkpoint_ts=500)
    dr = dispatcher("dr", r, "c0", DispatcherState.WORKING, checkpoint_ts=900)
    cf = changefeed(checkpoint_ts=300)
    dec = decide(world(table(1), capture("c0"), refused, r, dr, cf=cf), memory())
    assert last_status(dec, Kind.SPAN, hole_name).state is SpanState.ABSENT
    # This decision still saw the hole: the checkpoint stays at 300 rather than following span r to 900.
    assert [c.checkpoint_ts for c in statuses(dec, Kind.CHANGEFEED, "cf")] in ([], [300])
    assert KeyRange(left.start, right.end) == trange(1)


def _split_done_world(parent_in_view: bool, stale: frozenset[Kind], dispatcher_in_view: bool = True) -> World:
    """Issue 36, as on the real cluster: a Split of ``p`` into ``c1``/``c2`` Succeeded at AddSpans; the parent (and
    its dispatcher) was deleted, but the Span view, its watch broken across an API restart and not relisted yet,
    still holds it."""
    halves = pieces(1, 2)
    c1 = span("c1", key_range=halves[0], capture="c0", dispatcher="d1", created=NOW - 10)
    c2 = span("c2", key_range=halves[1], capture="c1", dispatcher="d2", created=NOW - 10)
    parent = span("p", capture="c0", dispatcher="dp", created=NOW - 100)
    done = operator(
        "sp",
        OpType.SPLIT,
        ("p",),
        OpPhase.SUCCEEDED,
        Stage.ADD_SPANS,
        targets=(
            Target(span="c1", key_range=halves[0], capture="c0", dispatcher="d1", start_ts=100, done=True),
            Target(span="c2", key_range=halves[1], capture="c1", dispatcher="d2", start_ts=100, done=True),
        ),
        finished_at=NOW - 5,
    )
    records: list[Record] = [changefeed(), table(1), capture("c0"), capture("c1"), c1, c2, done]
    records += [dispatcher("d1", c1, "c0"), dispatcher("d2", c2, "c1")]
    if parent_in_view:
        records.append(parent)
        if dispatcher_in_view:
            records.append(dispatcher("dp", parent, "c0"))
    return dataclasses.replace(world(*records), stale=stale)


def _removals(dec: Decision) -> list[str]:
    removes = [o.name for o in created(dec, Kind.OPERATOR) if isinstance(o, SpanOperator) and o.type is OpType.REMOVE]
    deletes = [f"{w.kind.value}/{w.name}" for w in writes(dec) if isinstance(w, I.Delete)]
    return removes + deletes


def test_a_finished_split_is_not_undone_by_a_repair_on_a_span_view_still_showing_its_parent():
    """Issue 36 (a real cluster, an API restart with a Split in flight): decisions ran for 1.8 s on a Span view that
    still held the Split's deleted parent, and the rule "overlap no operator explains" removed the newer spans, the
    children; after the relist the hole got a new span under the parent's name. A view in doubt (``World.stale``)
    now removes nothing; once relisted (the parent gone from it), nothing is removed either."""
    lagging = decide(_split_done_world(parent_in_view=True, stale=frozenset({Kind.SPAN})), memory())
    assert _removals(lagging) == []
    assert created(lagging, Kind.SPAN) == []
    # The same view taken as current is what removed the children (the failure, and what the mutant
    # decides-on-stale-view brings back).
    trusted = decide(_split_done_world(parent_in_view=True, stale=frozenset()), memory())
    assert any(o.startswith("remove-") for o in _removals(trusted))
    # The mutant decides on the view in doubt as if it were current (killed here: engine.world.DIRECT_MUTANTS).
    assert "decides-on-stale-view" in DIRECT_MUTANTS
    mutant = Options(mutants=frozenset({"decides-on-stale-view"}))
    doubted = decide(_split_done_world(parent_in_view=True, stale=frozenset({Kind.SPAN})), memory(), mutant)
    assert any(o.startswith("remove-") for o in _removals(doubted))
    # The relist: the parent is gone from the view, which is current again.
    relisted = decide(_split_done_world(parent_in_view=False, stale=frozenset()), memory())
    assert _removals(relisted) == []
    assert created(relisted, Kind.SPAN) == []


def test_a_dispatcher_view_in_doubt_neither_closes_unclaimed_dispatchers_nor_forgets_missing_ones():
    """The orphan rule and "Replicating whose dispatcher is gone" wait for a current Dispatcher view too: the parent's
    dispatcher, still in a Dispatcher view in doubt after its span was deleted, is not closed; a child whose
    dispatcher the view lacks stays Replicating."""
    w = _split_done_world(parent_in_view=False, stale=frozenset({Kind.DISPATCHER, Kind.SPAN}))
    with_orphan = dataclasses.replace(
        w, dispatchers={**w.dispatchers, "dp": dispatcher("dp", span("p", capture="c0", dispatcher="dp"), "c0")}
    )
    assert _removals(decide(with_orphan, memory())) == []
    lacking = dataclasses.replace(w, dispatchers={n: d for n, d in w.dispatchers.items() if n != "d2"})
    dec = decide(lacking, memory())
    assert statuses(dec, Kind.SPAN, "c2") == []
    # Current again: the orphan is closed, the span without its dispatcher goes Absent.
    assert "Dispatcher/dp" in _removals(decide(dataclasses.replace(with_orphan, stale=frozenset()), memory()))
    after = statuses(decide(dataclasses.replace(lacking, stale=frozenset()), memory()), Kind.SPAN, "c2")
    assert after
    assert after[-1].state is SpanState.ABSENT


def test_an_overlap_removal_first_reads_again_the_span_it_keeps():
    """Simulator seed 300908 (the long run of issue 36): a person deleted a Merge's source while the Span watch ran
    3 s late, and the Merge's new span was removed as an overlap with that source, which was gone. The Remove's chain
    now starts with a consistent read of each span the overlap keeps (``ConfirmPresent``): gone, the chain stops."""
    halves = pieces(1, 2)
    old = span("old", key_range=halves[0], capture="c0", dispatcher="d-old", created=NOW - 100)
    new = span("new", capture="c1", dispatcher="d-new", created=NOW - 10)
    w = world(
        changefeed(),
        table(1),
        capture("c0"),
        capture("c1"),
        old,
        new,
        span("rest", key_range=halves[1], capture="c0", dispatcher="d-rest", created=NOW - 100),
        dispatcher("d-old", old, "c0"),
        dispatcher("d-new", new, "c1"),
    )
    dec = decide(w, memory())
    chains = [
        c for c in dec.chains if any(isinstance(x, I.Create) and isinstance(x.obj, SpanOperator) for x in c.writes)
    ]
    assert len(chains) == 1
    first, second = chains[0].writes[:2]
    # The pair that dooms "new" is the one it makes with "old" (the first, in name order): that is the one read.
    assert isinstance(first, I.ConfirmPresent)
    assert (first.kind, first.name, first.uid) == (Kind.SPAN, "old", "uid-old")
    assert isinstance(second, I.Create)
    assert isinstance(second.obj, SpanOperator)
    assert second.obj.spans == ("new",)
