"""Deleting a Changefeed (engine/teardown.py): replication stops, its objects go, its Tables stay detached."""

from __future__ import annotations

from dataclasses import replace

from controller.engine import invariants
from controller.engine.maintainer import DELETING, Memory, decide
from controller.engine.teardown import DETACHED
from controller.model.records import Changefeed, Dispatcher, Span, SpanCounts, SpanOperator, Table
from controller.model.states import (
    CHANGEFEED_FINALIZER,
    TABLE_FINALIZER,
    DispatcherState,
    Kind,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
)
from tests.engine.fixtures import CF, Store, capture, changefeed, dispatcher, flat, memory, span, table, world

CAPS = (capture("c0"), capture("c1"), capture("c2"))


def settled() -> tuple[Store, Memory]:
    st = Store()
    st.add(
        Changefeed(name=CF, start_ts=100), *CAPS, table(1, pre_split_spans=3, finalizers=()), table(2, finalizers=())
    )
    mem = Memory(epoch=1, identity="m1")
    for _ in range(10):
        _, mem = st.step(mem)
    assert invariants.settled(st.world()) == []
    return st, mem


def delete_changefeed(st: Store) -> None:
    """What the API does on DELETE of a Changefeed carrying the teardown finalizer."""
    cf = st.changefeed
    assert CHANGEFEED_FINALIZER in cf.finalizers, "a live changefeed carries the teardown finalizer"
    st.put(replace(cf, deleting=True))


def gone(st: Store) -> bool:
    return (Kind.CHANGEFEED, CF) not in st.objects


def run_teardown(st: Store, mem: Memory, steps: int = 60, restart_every: int = 0, cut: int = 0) -> Memory:
    """Decide and apply until the Changefeed is gone. ``restart_every``: a new maintainer (empty memory, next
    epoch) every so many steps; ``cut``: apply only the first ``cut`` writes of every chain on those steps,
    as a maintainer killed mid-decision would."""
    for i in range(steps):
        killed = restart_every and i % restart_every == restart_every - 1
        dec = decide(st.world(), mem)
        if killed and cut:
            for chain in dec.chains:
                st.apply_chain(chain, limit=cut)
        else:
            st.apply(dec)
        mem = dec.memory
        if killed:
            mem = Memory(epoch=mem.epoch + 1, identity=f"m{mem.epoch + 1}")
        if gone(st):
            return mem
        assert invariants.single_owner(st.live_dispatchers()) == []
        st.captures_step()
        st.now += 0.5
    raise AssertionError(f"teardown did not finish: {sorted(st.objects)}")


def left(st: Store) -> dict[str, list[str]]:
    return {k.value: sorted(st.of(k)) for k in (Kind.SPAN, Kind.DISPATCHER, Kind.OPERATOR)}


def test_a_live_changefeed_gets_the_teardown_finalizer() -> None:
    dec = decide(world(cf=changefeed(finalizers=())), memory())
    assert ("finalize", "Changefeed", CF) in flat(dec, keep_bookkeeping=True)
    dec = decide(world(), memory())
    assert ("finalize", "Changefeed", CF) not in flat(dec, keep_bookkeeping=True)


def test_teardown_removes_everything_and_detaches_the_tables() -> None:
    st, mem = settled()
    assert len(st.of(Kind.SPAN)) == 4
    assert len(st.of(Kind.DISPATCHER)) == 4
    delete_changefeed(st)
    dec = decide(st.world(), mem)
    removes = [w for w in dec.chains for w in w.writes if hasattr(w, "obj") and isinstance(w.obj, SpanOperator)]
    assert {(o.obj.type, o.obj.source, o.obj.delete_spans) for o in removes} == {  # type: ignore[attr-defined]
        (OpType.REMOVE, OpSource.MAINTAINER, True)
    }
    run_teardown(st, mem)
    assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}
    tables = st.of(Kind.TABLE)
    assert sorted(tables) == ["t1", "t2"], "the Tables are the user's: they stay"
    for t in tables.values():
        assert isinstance(t, Table)
        assert TABLE_FINALIZER not in t.finalizers
        assert t.state == DETACHED
        assert t.span_counts == SpanCounts(), "no span of a detached table exists: its counts say so"
        assert t.message == f"changefeed {CF} was deleted; this table is replicated by no changefeed"


def test_the_status_says_what_is_left() -> None:
    st, mem = settled()
    delete_changefeed(st)
    dec = decide(st.world(), mem)
    st.apply(dec)
    cond = st.changefeed.condition(DELETING)
    assert cond is not None
    assert (cond.status, cond.reason) == ("True", "Teardown")
    # No operator: the spans were placed without one (placement.py)
    assert cond.message == "removing 4 span(s), 4 dispatcher(s) and 0 operator(s)"


def test_operators_in_flight_are_canceled_and_nothing_new_starts() -> None:
    st, mem = settled()
    s = min(st.of(Kind.SPAN).values(), key=lambda x: x.key_range)
    assert isinstance(s, Span)
    target = next(c for c in ("c0", "c1", "c2") if c != s.capture)
    st.add(SpanOperator(name="mv", changefeed=CF, type=OpType.MOVE, spans=(s.name,), target=target, created=st.now))
    _, mem = st.step(mem)
    assert st.get(Kind.OPERATOR, "mv").phase is OpPhase.RUNNING  # type: ignore[union-attr]
    # A new table and a user operator arrive as the changefeed is deleted.
    st.add(table(3, finalizers=()))
    other = next(x for x in st.of(Kind.SPAN).values() if x.name != s.name)
    st.add(SpanOperator(name="sp", changefeed=CF, type=OpType.SPLIT, spans=(other.name,), split_into=2, created=st.now))
    delete_changefeed(st)
    dec = decide(st.world(), mem)
    st.apply(dec)
    for name in ("mv", "sp"):
        op = st.get(Kind.OPERATOR, name)
        assert isinstance(op, SpanOperator)
        assert (op.phase, op.status_reason) == (OpPhase.CANCELED, "ChangefeedDeleted"), name
    made = [w for c in dec.chains for w in c.writes if type(w).__name__ == "Create"]
    assert all(isinstance(w.obj, SpanOperator) for w in made), "no Span, no Dispatcher is created"  # type: ignore[attr-defined]
    run_teardown(st, dec.memory)
    assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}
    assert st.get(Kind.TABLE, "t3") is not None


def test_a_lost_captures_dispatchers_are_released_by_the_maintainer() -> None:
    st, mem = settled()
    victim = next(d for d in st.of(Kind.DISPATCHER).values() if isinstance(d, Dispatcher))
    st.lost.add(victim.capture)
    st.now += 30  # its Lease lapses
    delete_changefeed(st)
    run_teardown(st, mem)
    assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}


def test_teardown_survives_maintainer_kills_between_writes() -> None:
    # A new maintainer every third decision (a successor's first decision only takes over: killed every
    # second one, it would never get to a two-write release chain whole).
    for cut in (1, 2):
        st, mem = settled()
        delete_changefeed(st)
        run_teardown(st, mem, restart_every=3, cut=cut)
        assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}
        assert all(TABLE_FINALIZER not in t.finalizers for t in st.of(Kind.TABLE).values())


def test_the_finalizer_is_released_only_when_nothing_is_left() -> None:
    """Until every span and dispatcher is gone, the Changefeed stays (a capture holding a close keeps it)."""
    st, mem = settled()
    held = next(d for d in st.of(Kind.DISPATCHER).values() if isinstance(d, Dispatcher))
    delete_changefeed(st)
    for _ in range(20):
        dec = decide(st.world(), mem)
        mem = dec.memory
        assert ("unfinalize", "Changefeed", CF) not in flat(dec, keep_bookkeeping=True)
        st.apply(dec)
        st.captures_step()
        # The capture holding `held` never closes it (a hook, or a capture slow to close).
        d = st.get(Kind.DISPATCHER, held.name)
        if d is None:
            st.put(replace(held, deleting=True, state=DispatcherState.WORKING))
        st.now += 0.5
    assert not gone(st)
    assert st.get(Kind.DISPATCHER, held.name) is not None


def test_a_span_of_an_unknown_table_and_an_absent_span_go_too() -> None:
    st = Store()
    cf = changefeed(deleting=True)
    st.add(cf, *CAPS, table(1), span("orphan", table_id=9, state=SpanState.ABSENT), span("a", state=SpanState.ABSENT))
    run_teardown(st, Memory(epoch=cf.epoch, identity=cf.holder))
    assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}


def test_tables_of_a_changefeed_that_vanished_without_teardown_are_detached() -> None:
    """Deleted before its finalizer was added, a Changefeed goes at once: the process detaches its Tables."""
    from controller.engine.intents import RemoveFinalizer, WriteStatus
    from controller.engine.teardown import detach_orphans

    held = table(1)  # our finalizer, changefeed "cf" gone
    deleting = table(2, deleting=True)
    other = table(3, changefeed="other")  # its changefeed exists
    never = table(4, finalizers=())  # never seen by a maintainer
    chains = detach_orphans([held, deleting, other, never], {"other"})
    writes = [
        (type(w).__name__, getattr(w, "name", getattr(getattr(w, "obj", None), "name", "")))
        for c in chains
        for w in c.writes
    ]
    assert writes == [("WriteStatus", "t1"), ("RemoveFinalizer", "t1"), ("RemoveFinalizer", "t2")]
    status = chains[0].writes[0]
    assert isinstance(status, WriteStatus)
    assert isinstance(chains[0].writes[1], RemoveFinalizer)
    assert (status.obj.state, status.obj.message) == (
        DETACHED,
        f"changefeed {CF} was deleted; this table is replicated by no changefeed",
    )  # type: ignore[attr-defined]
    assert detach_orphans([held], {CF}) == []


def test_new_spans_are_not_accepted_while_the_changefeed_is_torn_down() -> None:
    """Simulator seed 1067 (found by the deferred-Initializing change's sweep): the changefeed deleted while a
    Split had made its children; the teardown canceled the Split, and the next decision accepted the children
    beside their origin, which a failed delete kept: overlapping accepted spans no operator explained. Being
    torn down, the changefeed accepts no new span; the teardown's Removes take them as they are."""
    from tests.engine.fixtures import OpSource, OpType, operator, pieces

    whole, halves = pieces(1, 1)[0], pieces(1, 2)
    st = Store()
    cf = changefeed(deleting=True)
    origin = span("origin", key_range=whole, state=SpanState.ABSENT)
    children = [span(f"child{i}", key_range=r, state=None) for i, r in enumerate(halves)]
    # The teardown's Remove of the table, made by an earlier decision, waits for the origin, which a user
    # Move still holds (this decision cancels it): the children are no operator's in flight.
    move = operator("mv", OpType.MOVE, ("origin",), OpPhase.RUNNING, target="c1")
    remove = operator(
        "rm", OpType.REMOVE, ("child0", "child1", "origin"), source=OpSource.MAINTAINER, delete_spans=True
    )
    st.add(cf, *CAPS, table(1), origin, *children, move, remove)
    dec = decide(st.world(), Memory(epoch=cf.epoch, identity=cf.holder))
    accepted = [w for w in flat(dec) if w[0] == "status" and w[2].startswith("child")]
    assert accepted == []
    st.apply(dec)
    assert invariants.unexplained_overlaps(st.world()) == []
    run_teardown(st, Memory(epoch=cf.epoch, identity=cf.holder))
    assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}


def test_the_release_waits_for_a_consistent_read_to_confirm_the_view() -> None:
    """The maintainer's view is one watch per kind, and one kind's watch can lag (simulator seed 27541: a
    person's Span created as the Changefeed was deleted, not yet seen; seed 36446: an operator another
    maintainer created from its own stale view). The release of the Changefeed's finalizer follows, in the
    same chain, a consistent read that fails the chain when anything of the changefeed is left."""
    from controller.engine.intents import ConfirmNoneLeft, RemoveFinalizer

    st, mem = settled()
    delete_changefeed(st)
    for _ in range(60):
        dec = decide(st.world(), mem)
        mem = dec.memory
        release = [
            c for c in dec.chains if any(isinstance(w, RemoveFinalizer) and w.kind is Kind.CHANGEFEED for w in c.writes)
        ]
        if release:
            break
        st.apply(dec)
        st.captures_step()
        st.now += 0.5
    else:
        raise AssertionError("the teardown never released the changefeed")
    assert release[0].writes == (ConfirmNoneLeft(CF), RemoveFinalizer(Kind.CHANGEFEED, CF, CHANGEFEED_FINALIZER))
    st.add(span("late", state=None, capture=""))  # in the API, not in the view that decided
    st.apply(dec)
    assert not gone(st), "released while a Span of the changefeed was left"
    run_teardown(st, mem)  # the next decisions see the Span and remove it first
    assert left(st) == {"Span": [], "Dispatcher": [], "SpanOperator": []}


def test_left_behind_is_what_the_teardown_still_has_to_remove() -> None:
    from controller.engine.teardown import left_behind

    op = SpanOperator(name="op", changefeed=CF, type=OpType.MOVE, spans=("s",), target="c1")
    kept = [
        span("s"),
        span("gone", deleting=True, finalizers=("x",)),
        dispatcher("d", span("s"), "c0"),
        op,
        table(1),
    ]
    ignored = [
        replace(op, name="op-deleting", deleting=True),
        table(2, finalizers=()),
        span("other", changefeed="other"),
        table(3, changefeed="other"),
        changefeed(),
    ]
    assert [r.name for r in left_behind([*kept, *ignored], CF)] == [r.name for r in kept]
