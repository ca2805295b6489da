"""A new table's join (``Changefeed.status.joining``): recorded before its first spans, counted in the checkpoint
until the table's spans cover it, dropped then (or once a read finds the table gone).

Simulator seed 805239: a Table applied as the leadership changed hands; the deposed maintainer, not yet fenced,
created its spans from its floor (1000) while the new leader's Table and Span views had not seen it, and the new
leader published 1015: a checkpoint past rows of the new table not yet in the sink. The Changefeed is the one object
every leader writes with a compare-and-swap, so the join is written there, before any span."""

from __future__ import annotations

from dataclasses import replace

from controller.engine import checkpoint
from controller.engine import intents as I
from controller.engine.maintainer import decide
from controller.engine.world import Options, Tick
from controller.model.records import Changefeed, Join
from tests.engine.fixtures import (
    CF,
    EPOCH,
    Kind,
    SpanState,
    Store,
    capture,
    changefeed,
    created,
    describe,
    dispatcher,
    indexed_world,
    memory,
    pieces,
    span,
    table,
    world,
    writes,
)

P = pieces(1, 2)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=200)
B = span("b", key_range=P[1], capture="c0", dispatcher="db", checkpoint_ts=200)
DA = dispatcher("da", A, "c0", checkpoint_ts=300)
DB = dispatcher("db", B, "c0", checkpoint_ts=300)
LIVE = [table(1), capture("c0"), A, B, DA, DB]


def written_changefeed(dec: object) -> Changefeed:
    found = [w.obj for w in writes(dec) if isinstance(w, I.WriteStatus) and w.obj.kind is Kind.CHANGEFEED]  # type: ignore[arg-type]
    assert found, "no Changefeed status write"
    cf = found[-1]
    assert isinstance(cf, Changefeed)
    return cf


def test_a_new_table_joins_before_its_first_spans_and_they_follow_once_the_view_shows_it():
    api = Store()
    api.add(changefeed(checkpoint_ts=250), *LIVE, table(2, pre_split_spans=2))
    dec = decide(api.world(), memory())
    assert created(dec, Kind.SPAN) == []  # no span of table 2 before its join
    assert written_changefeed(dec).joining == (Join(table="t2", uid="uid-t2", start_ts=250),)
    api.apply(dec)
    dec = decide(api.world(), memory())
    made = created(dec, Kind.SPAN)
    assert [(s.table_id, s.start_ts) for s in made] == [(2, 250), (2, 250)]  # from the join's start, or above


def test_a_join_holds_the_checkpoint_until_the_tables_spans_cover_it_then_it_is_dropped():
    joined = changefeed(checkpoint_ts=250, joining=(Join(table="t2", uid="uid-t2", start_ts=250),))
    # Table 2 has no span in this view: the join holds the checkpoint where it is (the other spans are at 300).
    assert checkpoint.compute(Tick(world(*LIVE, table(2), cf=joined), EPOCH, Options())) == 250
    new = [
        span(f"n{i}", table_id=2, key_range=r, state=SpanState.ABSENT, checkpoint_ts=250)
        for i, r in enumerate(pieces(2, 2))
    ]
    dec = decide(world(*LIVE, table(2), *new, cf=joined), memory())
    cf = written_changefeed(dec)
    assert cf.joining == ()  # covered: its spans hold the checkpoint from now on
    assert cf.checkpoint_ts == 250
    assert not [w for w in writes(dec) if isinstance(w, I.ConfirmGone)]  # the table is in the view: no read
    # Half covered: kept.
    dec = decide(world(*LIVE, table(2), new[0], cf=joined), memory())
    assert [j.table for j in written_changefeed(dec).joining] == ["t2"]
    # Covered by spans not validated yet (no status; the coverage rule without ``new``, engine/coverage.py): kept.
    unvalidated = [replace(s, state=None) for s in new]
    dec = decide(world(*LIVE, table(2), *unvalidated, cf=joined), memory())
    assert [j.table for j in written_changefeed(dec).joining] == ["t2"]


def test_the_new_leader_counts_a_join_of_a_table_it_has_not_seen():
    """Seed 805239 from the new leader's side: its Table and Span views lack table 5, which the deposed maintainer
    joined before the leader's epoch (so the leader's Changefeed view carries it); the checkpoint stays at the join's
    start, not at the minimum of the spans it sees (300)."""
    cf = changefeed(checkpoint_ts=250, joining=(Join(table="t5", uid="uid-t5", start_ts=250),))
    assert checkpoint.compute(Tick(world(*LIVE, cf=cf), EPOCH, Options())) == 250
    w = indexed_world(cf, [r for r in LIVE if r.kind is not Kind.CAPTURE], [capture("c0")])
    assert checkpoint.compute(Tick(w, EPOCH, Options())) == 250  # the incremental decision counts it too
    # Without the join (the old rule), the leader publishes the minimum of what it sees: 300.
    assert checkpoint.compute(Tick(world(*LIVE, cf=replace(cf, joining=())), EPOCH, Options())) == 300


def test_a_join_of_a_table_the_view_lacks_is_dropped_only_after_a_read_finds_it_gone():
    api = Store()
    api.add(changefeed(checkpoint_ts=250), *LIVE, table(5))
    t5 = api.get(Kind.TABLE, "t5")
    assert t5 is not None
    cf = replace(api.changefeed, joining=(Join(table="t5", uid=t5.uid, start_ts=250),))
    api.put(cf)
    view = world(*LIVE, cf=api.changefeed, joined=False)  # the Table watch has not delivered t5
    dec = decide(view, memory())
    (chain,) = [
        c for c in dec.chains if any(describe(w)[1] == "Changefeed" for w in c.writes if describe(w)[0] == "status")
    ]
    assert [describe(w) for w in chain.writes][:2] == [("confirm-gone", "Table", "t5"), ("status", "Changefeed", CF)]
    api.apply(dec)
    assert [j.table for j in api.changefeed.joining] == ["t5"]  # found: nothing dropped, nothing published
    assert api.changefeed.checkpoint_ts == 250
    # Gone (or re-created as another incarnation): dropped.
    del api.objects[(Kind.TABLE, "t5")]
    api.apply(decide(world(*LIVE, cf=api.changefeed, joined=False), memory()))
    assert api.changefeed.joining == ()


def test_without_the_join_the_first_spans_are_created_at_once():
    """The mutant ``spans-before-the-join`` (the old rule, which seed 805239's history once failed): killed here
    (``engine.world.DIRECT_MUTANTS``)."""
    api = Store()
    api.add(changefeed(checkpoint_ts=250), *LIVE, table(2))
    dec = decide(api.world(), memory(), Options(mutants=frozenset({"spans-before-the-join"})))
    assert [s.table_id for s in created(dec, Kind.SPAN)] == [2]
