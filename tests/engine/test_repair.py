"""The safety net: orphan and duplicate dispatchers, holes, overlaps, adoption, spans without an operator,
and validation of user-applied spans."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine import intents as I
from controller.engine import invariants, naming
from controller.engine.maintainer import Decision, Memory, decide
from controller.engine.world import DIRECT_MUTANTS, Options, World
from controller.model.keys import KeyRange
from controller.model.records import Changefeed, Record, SpanOperator
from tests.engine.fixtures import (
    NOW,
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
    Stage,
    Store,
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
    statuses,
    table,
    trange,
    world,
    writes,
)

P = pieces(1, 2)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=150)
B = span("b", key_range=P[1], capture="c1", dispatcher="db", checkpoint_ts=150)
DA = dispatcher("da", A, "c0", checkpoint_ts=150)
DB = dispatcher("db", B, "c1", checkpoint_ts=150)
CAPS = [capture("c0"), capture("c1")]
GOOD = [table(1), *CAPS, A, B, DA, DB]


def test_healthy_world_needs_no_writes():
    dec = decide(world(*GOOD), memory())
    assert flat(dec) == []
    assert dec.repairs == ()


@pytest.mark.parametrize(("alive", "expected"), [(True, ["delete"]), (False, ["delete", "fence", "unfinalize"])])
def test_dispatcher_without_span_deleted(alive, expected):
    ghost = replace(DA, name="ghost", span="nope", key_range=KeyRange(b"a", b"b"), table_id=99, capture="c2")
    dec = decide(world(*GOOD, ghost, capture("c2", alive=alive)), memory())
    assert [w[0] for w in flat(dec) if w[2] in ("ghost", "c2")] == expected
    assert [w for w in flat(dec) if w[2] not in ("ghost", "c2")] == []


def test_two_dispatchers_for_one_span_keep_the_named_one():
    extra = dispatcher("da2", A, "c1", created=NOW - 1)
    dec = decide(world(*GOOD, extra), memory())
    assert flat(dec) == [("delete", "Dispatcher", "da2")]


def test_hole_filled_with_a_span_for_exactly_the_hole_placed_at_once():
    dec = decide(world(table(1), *CAPS, A, DA), memory())
    (new,) = created(dec, Kind.SPAN)
    assert new.key_range == P[1]
    assert new.name == naming.span_name("cf", 1, Mode.DEFAULT, P[1])
    # Placed as it is created: the create records the destination (its annotation) before the dispatcher
    # exists, with no status write of its own; the API drops a created object's status, and what is left is
    # read as the same placement.
    assert statuses(dec, Kind.SPAN, new.name) == []
    stripped = replace(new, state=None, capture="", dispatcher="", checkpoint_ts=0, operator="", message="")
    st = stripped.with_recorded_placement()
    assert st == new
    assert (st.state, st.operator, st.checkpoint_ts) == (SpanState.SCHEDULING, "", new.start_ts)
    assert (new.created_capture, new.created_dispatcher) == (st.capture, st.dispatcher)
    (d,) = created(dec, Kind.DISPATCHER)
    assert (d.name, d.capture, d.span, d.start_ts, d.operator) == (
        st.dispatcher,
        st.capture,
        new.name,
        st.checkpoint_ts,
        "",
    )
    assert flat(dec)[:2] == [("create", "Span", new.name), ("create", "Dispatcher", d.name)]
    # The span's create is exclusive: one of that name already there is not this chain's, nor its record.
    (chain,) = [c for c in dec.chains if any(getattr(w, "obj", None) is new for w in c.writes)]
    first, second = chain.writes
    assert isinstance(first, I.Create)
    assert first.exclusive
    assert isinstance(second, I.Create)
    assert not second.exclusive


def test_hole_filled_with_absent_span_when_no_capture_can_take_it():
    dec = decide(world(table(1), capture("c0", alive=False), A, DA), memory())
    (new,) = created(dec, Kind.SPAN)
    assert last_status(dec, Kind.SPAN, new.name).state is SpanState.ABSENT
    assert created(dec, Kind.DISPATCHER) == []


def test_a_hole_whose_name_an_invalid_span_holds_is_filled_and_holds_the_checkpoint():
    """A hole-fill span was refused (Invalid) because a deposed maintainer's span overlapped it; that span was
    later removed, leaving the hole, but the hole's deterministic name was the Invalid span's, so the hole was
    never filled, and the changefeed checkpoint moved past keys nobody replicated. Now the refused span is
    accepted when it fits the hole exactly, and the checkpoint does not move while a live table has keys no span
    covers.
    """
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


def test_a_span_an_operator_owns_stands_for_its_keys_before_its_status_is_written():
    """A span with no status yet counts in the safety net's coverage (the rule with ``new``, engine/coverage.py):
    here one re-created under the name a Running Add targets, which validation leaves to the Add. Filled as a hole,
    its keys would get a second span."""
    b = replace(B, state=None, capture="", dispatcher="")
    target = Target(span="b", key_range=P[1], capture="c1", dispatcher="x", start_ts=150)
    add = operator("add", OpType.ADD, ("b",), OpPhase.RUNNING, Stage.ADD_DEST, targets=(target,))
    dec = decide(world(table(1), *CAPS, A, DA, b, add), memory())
    assert created(dec, Kind.SPAN) == []
    assert dec.repairs == ()


def test_unexplained_overlap_removes_newer_span():
    x = span("x", key_range=KeyRange(P[0].start, P[1].end), capture="c1", dispatcher="dx", created=NOW - 5)
    dx = dispatcher("dx", x, "c1")
    dec = decide(world(*GOOD, x, dx), memory())
    (rm,) = created(dec, Kind.OPERATOR)
    assert (rm.type, rm.spans, rm.delete_spans, rm.source) == (OpType.REMOVE, ("x",), True, OpSource.MAINTAINER)
    got = flat(dec)
    # First a consistent read of the span it keeps (it may be gone, still in a view that lags), then the Remove.
    assert got[:3] == [
        ("confirm", "Span", "a"),
        ("create", "SpanOperator", rm.name),
        ("status", "SpanOperator", rm.name),
    ]
    assert ("delete", "Dispatcher", "dx") in got
    assert not {("delete", "Dispatcher", "da"), ("delete", "Dispatcher", "db")} & set(got)


def test_an_overlap_removal_first_reads_again_the_span_it_keeps():
    """Found by the simulator: a person deleted a Merge's source while the Span watch ran 3 s late, and the Merge's
    new span was removed as an overlap with that source, which was gone. The Remove's chain now starts with a
    consistent read of each span the overlap keeps (``ConfirmPresent``): gone, the chain stops."""
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


def test_working_dispatcher_matching_absent_span_adopted():
    a = replace(A, state=SpanState.ABSENT, dispatcher="", capture="")
    dec = decide(world(table(1), *CAPS, a, B, DA, DB), memory())
    assert flat(dec) == [("status", "Span", "a")]
    st = last_status(dec, Kind.SPAN, "a")
    assert (st.state, st.dispatcher, st.capture) == (SpanState.REPLICATING, "da", "c0")
    assert not created(dec, Kind.OPERATOR)


def test_orphan_dispatcher_with_exact_range_adopted_by_absent_span():
    a = replace(A, state=SpanState.ABSENT, dispatcher="", capture="")
    orphan = replace(DA, name="orph", span="vanished")
    dec = decide(world(table(1), *CAPS, a, B, orphan, DB), memory())
    st = last_status(dec, Kind.SPAN, "a")
    assert (st.state, st.dispatcher) == (SpanState.REPLICATING, "orph")
    assert not created(dec, Kind.OPERATOR)
    assert ("delete", "Dispatcher", "orph") not in flat(dec)


def test_replicating_span_whose_dispatcher_is_gone_goes_absent():
    dec = decide(world(table(1), *CAPS, A, B, DB), memory())
    assert flat(dec) == [("status", "Span", "a")]
    st = last_status(dec, Kind.SPAN, "a")
    assert (st.state, st.dispatcher, st.checkpoint_ts) == (SpanState.ABSENT, "", 150)


def test_replicating_span_on_lost_capture_goes_absent_and_dispatcher_released():
    dec = decide(world(table(1), capture("c0", alive=False), capture("c1"), A, B, DA, DB), memory())
    got = flat(dec)
    assert got[0] == ("status", "Span", "a")
    assert last_status(dec, Kind.SPAN, "a").state is SpanState.ABSENT
    assert {("delete", "Dispatcher", "da"), ("unfinalize", "Dispatcher", "da")} <= set(got)


@pytest.mark.parametrize(
    ("state", "d_state", "expected"),
    [
        (SpanState.SCHEDULING, DispatcherState.WORKING, SpanState.REPLICATING),
        (SpanState.SCHEDULING, DispatcherState.INITIALIZING, SpanState.ABSENT),
        (SpanState.REMOVING, DispatcherState.WORKING, SpanState.ABSENT),
    ],
)
def test_span_in_flight_without_operator(state, d_state, expected):
    a = replace(A, state=state, operator="vanished-op")
    dec = decide(world(table(1), *CAPS, a, B, replace(DA, state=d_state), DB), memory())
    assert last_status(dec, Kind.SPAN, "a").state is expected


# -- user-applied spans ----------------------------------------------------------------------------------


def user_span(name, table_id=1, key_range=None, mode=Mode.DEFAULT):
    return span(name, table_id=table_id, key_range=key_range, state=None, checkpoint_ts=0, mode=mode, created=NOW - 1)


def test_user_span_accepted_and_rest_filled():
    dec = decide(world(table(1), *CAPS, user_span("u", key_range=P[0])), memory())
    st = last_status(dec, Kind.SPAN, "u")
    assert (st.state, st.message, st.checkpoint_ts) == (SpanState.ABSENT, "", 100)
    (filled,) = created(dec, Kind.SPAN)
    assert filled.key_range == P[1]


@pytest.mark.parametrize(
    ("u", "extra", "needle"),
    [
        (user_span("u", key_range=KeyRange(trange(1).start, trange(3).start)), [], "outside table"),
        (user_span("u", key_range=KeyRange(P[0].start, P[1].end)), [A, B, DA, DB], "overlaps span"),
        (user_span("u", table_id=42), [A, B, DA, DB], "is not a table of changefeed"),
        (user_span("u", key_range=P[0], mode=Mode.REDO), [A, B, DA, DB], "spec.redo is false"),
    ],
)
def test_user_span_invalid(u, extra, needle):
    dec = decide(world(table(1), *CAPS, u, *extra), memory())
    assert [w for w in flat(dec) if w[2] == "u"] == [("status", "Span", "u"), ("event", "Span", "u", "SpanRejected")]
    st = last_status(dec, Kind.SPAN, "u")
    assert st.state is SpanState.INVALID
    assert needle in st.message
    assert not [w for w in flat(dec) if w[0] in ("delete", "create") and w[2] in ("a", "b", "da", "db")]


def test_a_user_span_overlapping_a_span_an_operator_owns_before_its_status_is_written_is_invalid():
    """A person deleted a span while its Add was in flight; hole repair re-created it under the same name (same
    range) and was killed before writing its status. A user span applied inside that range was accepted, because
    the re-created span had no status yet; the Add then finished the re-created span: two accepted spans over the
    same keys. A span an operator owns now counts as taken even before its status is written.
    """
    whole = span("x", state=None, capture="", dispatcher="")
    add = operator(
        "add-x",
        OpType.ADD,
        ("x",),
        phase=OpPhase.RUNNING,
        stage=Stage.ADD_DEST,
        target="c0",
        targets=(Target(span="x", key_range=trange(1), capture="c0", dispatcher="dx", start_ts=100),),
    )
    inner = KeyRange(trange(1).start + b"\x40", trange(1).start + b"\x80")
    user = span("user", state=None, key_range=inner, capture="", dispatcher="", created=2000.0)
    dec = decide(world(table(1), capture("c0"), whole, add, user), memory())
    assert last_status(dec, Kind.SPAN, "user").state is SpanState.INVALID


def test_redo_span_accepted_on_redo_changefeed():
    cf = changefeed(redo=True)
    r = user_span("r", mode=Mode.REDO)
    dec = decide(world(table(1), *CAPS, A, B, DA, DB, r, cf=cf), memory())
    assert last_status(dec, Kind.SPAN, "r").state is SpanState.ABSENT


def test_redo_changefeed_gets_spans_per_mode():
    dec = decide(world(table(1), capture("c0"), cf=changefeed(redo=True)), memory())
    assert sorted((s.mode.value, s.key_range) for s in created(dec, Kind.SPAN)) == [
        ("default", trange(1)),
        ("redo", trange(1)),
    ]


def test_redo_spans_removed_when_redo_is_off():
    r = span("r", mode=Mode.REDO, capture="c0", dispatcher="dr")
    dec = decide(world(*GOOD, r, dispatcher("dr", r, "c0")), memory())
    (rm,) = created(dec, Kind.OPERATOR)
    assert (rm.type, rm.spans, rm.delete_spans) == (OpType.REMOVE, ("r",), True)
    assert flat(dec) == [
        ("create", "SpanOperator", rm.name),
        ("status", "SpanOperator", rm.name),
        ("status", "Span", "r"),
        ("delete", "Dispatcher", "dr"),
    ]


def test_adopted_orphan_dispatcher_stays_adopted():
    """Adoption of an orphan (its span no longer exists) that exactly matches an Absent span must stick: the next
    decision writes nothing (it used to un-adopt it and delete the dispatcher, then duplicate it)."""
    absent = replace(A, state=SpanState.ABSENT, dispatcher="", capture="")
    orphan = dispatcher("orph", replace(A, name="vanished"), "c0", created=NOW - 30)
    first = decide(world(table(1), *CAPS, absent, B, orphan, DB), memory())
    adopted = last_status(first, Kind.SPAN, "a")
    assert (adopted.state, adopted.dispatcher) == (SpanState.REPLICATING, "orph")
    second = decide(world(table(1), *CAPS, adopted, B, orphan, DB), memory())
    assert flat(second) == []


def test_adopted_orphan_dispatcher_satisfies_settled():
    """An orphan Working dispatcher adopted by an exactly matching Absent span: the engine then writes nothing
    more, and its own end-state check agrees (settled() used to report the adopted dispatcher as an orphan)."""
    st = Store()
    a = span("a", key_range=P[0], state=SpanState.ABSENT)
    b = span("b", key_range=P[1], capture="c1", dispatcher="db")
    orphan = dispatcher("orph", replace(a, name="vanished"), "c0", created=NOW - 30)
    st.add(
        Changefeed(name="cf", start_ts=100, epoch=1, holder="m1"),
        table(1),
        *CAPS,
        a,
        b,
        orphan,
        dispatcher("db", b, "c1"),
    )
    mem = Memory(epoch=1, identity="m1")
    for _ in range(10):
        _, mem = st.step(mem)
    dec = decide(st.world(), mem)
    assert [w for w in flat(dec) if w[1] != "Changefeed"] == []  # the engine is at rest
    assert st.get(Kind.SPAN, "a").dispatcher == "orph"  # type: ignore[union-attr]
    assert invariants.settled(st.world()) == []


# -- a view in doubt (``World.stale``: a kind whose watch broke, not relisted yet) ----------------------------


def _split_done_world(parent_in_view: bool, stale: frozenset[Kind], dispatcher_in_view: bool = True) -> World:
    """As on a real cluster: a Split of ``p`` into ``c1``/``c2`` Succeeded at AddSpans; the parent (and its
    dispatcher) was deleted, but the Span view, its watch broken across an API restart and not relisted yet, still
    holds it."""
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
    return replace(world(*records), stale=stale)


def _removals(dec: Decision) -> list[str]:
    removes = [o.name for o in created(dec, Kind.OPERATOR) if isinstance(o, SpanOperator) and o.type is OpType.REMOVE]
    deletes = [f"{w.kind.value}/{w.name}" for w in writes(dec) if isinstance(w, I.Delete)]
    return removes + deletes


def test_a_finished_split_is_not_undone_by_a_repair_on_a_span_view_still_showing_its_parent():
    """On a real cluster, an API restart with a Split in flight: decisions ran for 1.8 s on a Span view that still
    held the Split's deleted parent, and the rule "overlap no operator explains" removed the newer spans, the
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
    with_orphan = replace(
        w, dispatchers={**w.dispatchers, "dp": dispatcher("dp", span("p", capture="c0", dispatcher="dp"), "c0")}
    )
    assert _removals(decide(with_orphan, memory())) == []
    lacking = replace(w, dispatchers={n: d for n, d in w.dispatchers.items() if n != "d2"})
    dec = decide(lacking, memory())
    assert statuses(dec, Kind.SPAN, "c2") == []
    # Current again: the orphan is closed, the span without its dispatcher goes Absent.
    assert "Dispatcher/dp" in _removals(decide(replace(with_orphan, stale=frozenset()), memory()))
    after = statuses(decide(replace(lacking, stale=frozenset()), memory()), Kind.SPAN, "c2")
    assert after
    assert after[-1].state is SpanState.ABSENT
