"""The drain, balance, split and merge schedulers, the scheduler status, and the CaptureLost Event."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from controller.engine import balance
from controller.engine.intents import Event
from controller.engine.maintainer import PAUSED, Decision, Memory, decide
from controller.engine.traffic import Counters
from controller.engine.world import Options, Tick, World
from controller.model.records import Capture, Changefeed, SchedulerConfig, SchedulerStatus, Span, SpanOperator
from controller.model.states import SchedulerState
from tests.engine.fixtures import (
    NOW,
    Kind,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
    Stage,
    Store,
    capture,
    changefeed,
    created,
    dispatcher,
    last_status,
    memory,
    operator,
    pieces,
    span,
    statuses,
    table,
    trange,
    world,
    written_condition,
)


def cf_with(
    paused: bool = False, status: SchedulerStatus | None = None, paused_scheduler: bool = False, **knobs: object
) -> Changefeed:
    cfg = replace(SchedulerConfig(paused=paused_scheduler), **knobs)  # type: ignore[arg-type]
    return changefeed(paused=paused, scheduler=cfg, scheduler_status=status or SchedulerStatus())


def placed(table_id: int, n: int, captures: list[str], rate: float = 0.0, regions: int = 0, prefix: str = ""):
    """Table ``table_id`` cut into ``n`` Replicating spans on ``captures`` (round robin), with dispatchers."""
    out = []
    for i, rng in enumerate(pieces(table_id, n)):
        cap = captures[i % len(captures)]
        sp = span(
            f"{prefix}s{table_id}-{i}", table_id=table_id, key_range=rng, capture=cap, dispatcher=f"d{table_id}-{i}"
        )
        out += [sp, dispatcher(f"d{table_id}-{i}", sp, cap, write_rate=rate, region_count=regions)]
    return out


def at(recs, now: float) -> World:
    """``world(*recs)`` at ``now``, with the live captures' Leases renewed then."""
    renewed = [replace(r, renew_time=now) if isinstance(r, Capture) and r.renew_time == NOW else r for r in recs]
    return world(*renewed, now=now)


def moves(dec: Decision) -> list[SpanOperator]:
    return [o for o in created(dec, Kind.OPERATOR) if isinstance(o, SpanOperator) and o.type is OpType.MOVE]


def ops_of(dec: Decision, type_: OpType) -> list[SpanOperator]:
    return [o for o in created(dec, Kind.OPERATOR) if isinstance(o, SpanOperator) and o.type is type_]


def sched_status(dec: Decision) -> SchedulerStatus:
    cf = last_status(dec, Kind.CHANGEFEED, "cf")
    assert isinstance(cf, Changefeed)
    return cf.scheduler_status


CAPS = [capture("c0"), capture("c1"), capture("c2")]


# -- balance ---------------------------------------------------------------------------------------


def test_balance_moves_from_the_fullest_to_those_under_the_floor():
    dec = decide(world(table(1), *CAPS, *placed(1, 6, ["c0"]), cf=cf_with()), memory())
    ms = moves(dec)
    # 6 spans on 3 captures: floor 2; c0 keeps 2, c1 and c2 get 2 each.
    assert sorted(m.target for m in ms) == ["c1", "c1", "c2", "c2"]
    assert all(m.source is OpSource.SCHEDULER and "balance" in m.reason for m in ms)
    assert all(last_status(dec, Kind.OPERATOR, m.name).phase is OpPhase.RUNNING for m in ms)
    assert dec.memory.balanced_at == NOW


def test_balance_waits_for_its_interval():
    recs = [table(1), *CAPS, *placed(1, 6, ["c0"])]
    soon = replace(memory(), balanced_at=NOW - 14)
    assert moves(decide(world(*recs, cf=cf_with()), soon)) == []
    assert decide(world(*recs, cf=cf_with()), soon).memory.balanced_at == NOW - 14
    assert len(moves(decide(world(*recs, cf=cf_with()), replace(memory(), balanced_at=NOW - 15)))) == 4


def test_balance_starts_counting_at_the_terms_first_decision():
    recs = [table(1), *CAPS, *placed(1, 6, ["c0"]), cf_with()]
    dec = decide(world(*recs), memory(bootstrapped=False))
    assert moves(dec) == []
    assert dec.memory.balanced_at == NOW


def test_balance_never_runs_while_an_operator_is_in_flight():
    other = span("x", table_id=2, capture="c1", dispatcher="dx")
    running = operator("mv", OpType.MOVE, ("x",), OpPhase.RUNNING, Stage.REMOVE_ORIGIN, target="c2")
    recs = [table(1), table(2), *CAPS, *placed(1, 6, ["c0"]), other, dispatcher("dx", other, "c1"), running]
    dec = decide(world(*recs, cf=cf_with()), memory())
    assert moves(dec) == []
    assert dec.memory.balanced_at == 0.0  # tried again on the next tick


def test_balance_never_runs_while_a_span_is_absent():
    absent = span("gap", table_id=2, state=SpanState.ABSENT)
    dec = decide(world(table(1), table(2), *CAPS, *placed(1, 6, ["c0"]), absent, cf=cf_with()), memory())
    assert moves(dec) == []
    assert last_status(dec, Kind.SPAN, "gap").state is SpanState.SCHEDULING  # the basic scheduler places it


def test_balance_respects_max_moves_and_the_off_switch():
    recs = [table(1), *CAPS, *placed(1, 6, ["c0"])]
    assert len(moves(decide(world(*recs, cf=cf_with(balance_max_moves=1)), memory()))) == 1
    assert moves(decide(world(*recs, cf=cf_with(balance_interval_seconds=0)), memory())) == []


def test_balance_leaves_a_balanced_changefeed_alone():
    dec = decide(world(table(1), *CAPS, *placed(1, 5, ["c0", "c1", "c2"]), cf=cf_with()), memory())
    assert moves(dec) == []
    assert dec.memory.balanced_at == NOW  # the round ran and found nothing to do


@pytest.mark.parametrize(
    ("cf", "why"),
    [
        (cf_with(paused=True), "spec.paused is true: replication is paused"),
        (cf_with(paused=False, paused_scheduler=True), "spec.scheduler.paused is true"),
    ],
    ids=["replication", "schedulers-only"],
)
def test_paused_changefeed_runs_no_scheduler_and_says_so(cf: Changefeed, why: str):
    absent = span("gap", table_id=2, state=SpanState.ABSENT)
    recs = [table(1), table(2), *CAPS, *placed(1, 6, ["c0"]), absent, capture("c3", draining=True)]
    dec = decide(world(*recs, cf=cf), memory())
    assert created(dec, Kind.OPERATOR) == []
    assert statuses(dec, Kind.SPAN, "gap") == []  # not placed either
    status = sched_status(dec)
    assert status.state is SchedulerState.PAUSED
    assert status.message.startswith(why)
    assert "user SpanOperators still run" in status.message
    # The mutant schedules a changefeed whose replication is paused (the simulator catches it too).
    mutated = decide(world(*recs, cf=cf), memory(), Options(mutants=frozenset({"pause-keeps-scheduling"})))
    if cf.paused:
        assert created(mutated, Kind.OPERATOR) or statuses(mutated, Kind.SPAN, "gap")


def test_replication_paused_is_said_on_the_changefeed_until_resumed():
    recs = [table(1), *CAPS, *placed(1, 2, ["c0"])]
    dec = decide(world(*recs, cf=cf_with(paused=True)), memory())
    cond = written_condition(dec, world(*recs).changefeed, PAUSED)
    assert cond is not None
    assert (cond.status, cond.reason) == ("True", "Paused")
    assert "resume continues from it" in cond.message
    resumed = decide(world(*recs, cf=replace(cf_with(paused=False), conditions=(cond,))), memory())
    after = written_condition(resumed, world(*recs).changefeed, PAUSED)
    assert after is not None
    assert (after.status, after.reason) == ("False", "Resumed")
    # The schedulers alone paused, or never paused: no such condition.
    assert written_condition(decide(world(*recs, cf=cf_with(paused_scheduler=True)), memory()), world(*recs).changefeed,
                             PAUSED) is None  # fmt: skip
    gone = decide(world(*recs, cf=cf_with(paused=True)), memory(), Options(mutants=frozenset({"pause-not-reported"})))
    assert written_condition(gone, world(*recs).changefeed, PAUSED) is None


def test_paused_changefeed_still_runs_user_operators():
    recs = [table(1), *CAPS, *placed(1, 2, ["c0"])]
    user = operator("u", OpType.MOVE, ("s1-0",), target="c1")
    dec = decide(world(*recs, user, cf=cf_with(paused=True)), memory())
    assert last_status(dec, Kind.OPERATOR, "u").phase is OpPhase.RUNNING


# -- drain -----------------------------------------------------------------------------------------


def test_drain_moves_every_span_off_the_draining_capture_spread_by_load():
    caps = [capture("c0", draining=True), capture("c1"), capture("c2")]
    dec = decide(world(table(1), *caps, *placed(1, 4, ["c0"]), cf=cf_with()), memory())
    ms = moves(dec)
    assert sorted(m.target for m in ms) == ["c1", "c1", "c2", "c2"]
    assert all("draining" in m.reason for m in ms)
    status = sched_status(dec)
    assert status.state is SchedulerState.DRAINING
    assert "c0" in status.message


def test_drain_runs_while_other_operators_are_in_flight_and_skips_busy_spans():
    caps = [capture("c0", draining=True), capture("c1"), capture("c2")]
    recs = placed(1, 3, ["c0"])
    busy = operator("mv", OpType.MOVE, ("s1-0",), OpPhase.RUNNING, Stage.REMOVE_ORIGIN, target="c1")
    dec = decide(world(table(1), *caps, *recs, busy, cf=cf_with()), memory())
    assert sorted(m.spans[0] for m in moves(dec)) == ["s1-1", "s1-2"]


def test_drain_batch_size_and_in_flight_limit():
    caps = [capture("c0", draining=True), capture("c1")]
    recs = [table(1), *caps, *placed(1, 4, ["c0"])]
    assert len(moves(decide(world(*recs, cf=cf_with(drain_batch_size=1)), memory()))) == 1
    assert len(moves(decide(world(*recs, cf=cf_with(max_in_flight_operators=3)), memory()))) == 3


def test_drain_with_nowhere_to_go_waits_and_says_why():
    caps = [capture("c0", draining=True), capture("c1", draining=True)]
    dec = decide(world(table(1), *caps, *placed(1, 2, ["c0"]), cf=cf_with()), memory())
    assert moves(dec) == []
    assert "no schedulable capture" in sched_status(dec).message


def test_finished_drain_cools_down_then_balancing_resumes():
    caps = [capture("c0", draining=True), capture("c1"), capture("c2")]
    recs = [table(1), *caps, *placed(1, 6, ["c1"])]  # c0 is empty now; c1 holds everything
    draining = SchedulerStatus(state=SchedulerState.DRAINING, message="x")
    dec = decide(world(*recs, cf=cf_with(status=draining)), memory())
    status = sched_status(dec)
    assert status.state is SchedulerState.COOLING_DOWN
    assert status.balance_resumes_at == NOW + 120
    assert moves(dec) == []
    # A new maintainer (empty memory) honours the cool-down recorded in status...
    cooling = cf_with(status=status)
    assert moves(decide(at([*recs, cooling], NOW + 60), memory())) == []
    # ... and balances once it is over.
    later = decide(at([*recs, cooling], NOW + 121), memory())
    assert sched_status(later).state is SchedulerState.ACTIVE
    assert sorted(m.target for m in moves(later)) == ["c2", "c2", "c2"]


def test_no_cool_down_when_balancing_is_off():
    caps = [capture("c0", draining=True), capture("c1")]
    draining = SchedulerStatus(state=SchedulerState.DRAINING, message="x")
    dec = decide(
        world(table(1), *caps, *placed(1, 2, ["c1"]), cf=cf_with(status=draining, balance_interval_seconds=0)), memory()
    )
    assert sched_status(dec).state is SchedulerState.ACTIVE
    assert "balancing is off" in sched_status(dec).message


# -- split -----------------------------------------------------------------------------------------


def run_checks(recs, cf: Changefeed, checks: int, mem: Memory | None = None) -> list[Decision]:
    """``checks`` decisions, one traffic-check interval apart, threading the memory."""
    mem = mem or memory()
    out = []
    for i in range(checks):
        dec = decide(at([*recs, cf], NOW + i * cf.scheduler.traffic_check_interval_seconds), mem)
        out.append(dec)
        mem = dec.memory
    return out


def test_split_a_span_hot_for_three_checks_into_enough_pieces():
    cf = cf_with(split_write_threshold=1000.0, balance_interval_seconds=0)
    recs = [table(1), *CAPS, *placed(1, 1, ["c0"], rate=4500.0)]
    decs = run_checks(recs, cf, 3)
    assert [len(ops_of(d, OpType.SPLIT)) for d in decs] == [0, 0, 1]
    split = ops_of(decs[2], OpType.SPLIT)[0]
    assert split.split_into == 5  # ceil(4500 / 1000), above the 3 live captures
    assert split.source is OpSource.SCHEDULER
    assert "hot for 3 checks" in split.reason
    assert decs[2].memory.counters.hot == {}  # counting starts again


def test_split_needs_consecutive_hot_checks():
    cf = cf_with(split_write_threshold=1000.0, balance_interval_seconds=0)
    hot = [table(1), *CAPS, *placed(1, 1, ["c0"], rate=4500.0)]
    cool = [table(1), *CAPS, *placed(1, 1, ["c0"], rate=10.0)]
    decs = run_checks(hot, cf, 2)
    mem = decs[-1].memory
    assert mem.counters.hot == {"s1-0": 2}
    dec = decide(at([*cool, cf], NOW + 30), mem)
    assert dec.memory.counters.hot == {}
    again = decide(at([*hot, cf], NOW + 45), dec.memory)
    assert again.memory.counters.hot == {"s1-0": 1}  # counting starts afresh
    assert ops_of(again, OpType.SPLIT) == []


def test_split_by_region_count_into_at_least_as_many_pieces_as_captures():
    cf = cf_with(split_region_threshold=100, split_checks=1, balance_interval_seconds=0)
    dec = decide(world(table(1), *CAPS, *placed(1, 1, ["c0"], regions=150), cf=cf), memory())
    assert [o.split_into for o in ops_of(dec, OpType.SPLIT)] == [3]


def test_split_respects_the_per_table_cap_and_splittable():
    cf = cf_with(split_write_threshold=1000.0, split_checks=1, max_spans_per_table=4, balance_interval_seconds=0)
    recs = [*CAPS, *placed(1, 3, ["c0", "c1", "c2"], rate=9000.0)]
    dec = decide(world(table(1), *recs, cf=cf), memory())
    assert [o.split_into for o in ops_of(dec, OpType.SPLIT)] == [2]  # 3 spans + 1 more = the cap of 4
    assert ops_of(decide(world(table(1, splittable=False), *recs, cf=cf), memory()), OpType.SPLIT) == []
    full = [*CAPS, *placed(1, 4, ["c0"], rate=9000.0)]
    assert ops_of(decide(world(table(1), *full, cf=cf), memory()), OpType.SPLIT) == []


def test_split_never_runs_on_a_table_with_an_operator_in_flight():
    cf = cf_with(split_write_threshold=1000.0, split_checks=1, balance_interval_seconds=0)
    recs = placed(1, 2, ["c0"], rate=5000.0)
    running = operator("mv", OpType.MOVE, ("s1-1",), OpPhase.RUNNING, Stage.REMOVE_ORIGIN, target="c1")
    dec = decide(world(table(1), *CAPS, *recs, running, cf=cf), memory())
    assert ops_of(dec, OpType.SPLIT) == []


def test_split_off_by_default():
    dec = decide(world(table(1), *CAPS, *placed(1, 1, ["c0"], rate=1e9)), memory())
    assert ops_of(dec, OpType.SPLIT) == []


# -- merge -----------------------------------------------------------------------------------------


def test_merge_adjacent_cold_spans_after_enough_checks():
    cf = cf_with(merge_write_threshold=100.0, balance_interval_seconds=0)
    recs = [table(1), *CAPS, *placed(1, 4, ["c0", "c1"], rate=5.0)]
    decs = run_checks(recs, cf, 5)
    assert [len(ops_of(d, OpType.MERGE)) for d in decs] == [0, 0, 0, 0, 1]
    merge = ops_of(decs[4], OpType.MERGE)[0]
    assert merge.spans == ("s1-0", "s1-1", "s1-2", "s1-3")
    assert merge.source is OpSource.SCHEDULER


def test_merged_span_would_stay_cold_and_not_be_hot():
    cf = cf_with(merge_write_threshold=100.0, merge_checks=1, balance_interval_seconds=0)
    dec = decide(world(table(1), *CAPS, *placed(1, 4, ["c0"], rate=40.0), cf=cf), memory())
    # 40 + 40 < 100, but a third would make 120: two merges of two.
    assert [m.spans for m in ops_of(dec, OpType.MERGE)] == [("s1-0", "s1-1"), ("s1-2", "s1-3")]
    capped = cf_with(merge_write_threshold=100.0, merge_checks=1, merge_max_per_round=1, balance_interval_seconds=0)
    assert (
        len(ops_of(decide(world(table(1), *CAPS, *placed(1, 4, ["c0"], rate=40.0), cf=capped), memory()), OpType.MERGE))
        == 1
    )


def test_merge_keeps_the_pre_split_the_user_asked_for():
    cf = cf_with(merge_write_threshold=100.0, merge_checks=1, balance_interval_seconds=0)
    recs = [*CAPS, *placed(1, 4, ["c0"], rate=1.0)]
    assert ops_of(decide(world(table(1, pre_split_spans=4), *recs, cf=cf), memory()), OpType.MERGE) == []
    merges = ops_of(decide(world(table(1, pre_split_spans=2), *recs, cf=cf), memory()), OpType.MERGE)
    assert [m.spans for m in merges] == [("s1-0", "s1-1", "s1-2")]


def test_merge_never_runs_on_a_table_with_an_operator_in_flight_nor_by_default():
    cf = cf_with(merge_write_threshold=100.0, merge_checks=1, balance_interval_seconds=0)
    recs = [table(1), *CAPS, *placed(1, 4, ["c0"], rate=1.0)]
    running = operator("mv", OpType.MOVE, ("s1-3",), OpPhase.RUNNING, Stage.REMOVE_ORIGIN, target="c1")
    assert ops_of(decide(world(*recs, running, cf=cf), memory()), OpType.MERGE) == []
    assert ops_of(decide(world(*recs), memory()), OpType.MERGE) == []


def test_traffic_counters_are_kept_between_checks_only():
    cf = cf_with(merge_write_threshold=100.0, traffic_check_interval_seconds=10.0, balance_interval_seconds=0)
    recs = [table(1), *CAPS, *placed(1, 2, ["c0"], rate=1.0)]
    mem = replace(memory(), counters=Counters(checked_at=NOW - 5, cold={"s1-0": 2}))
    dec = decide(world(*recs, cf=cf), mem)
    assert dec.memory.counters == mem.counters  # not due yet: nothing counted


# -- events ----------------------------------------------------------------------------------------


def test_capture_lost_event_once_per_term():
    lost = capture("c1", alive=False)
    sp = span("s", capture="c1", dispatcher="d")
    recs = [table(1), capture("c0"), lost, sp, dispatcher("d", sp, "c1")]
    dec = decide(world(*recs), memory())
    events = [w for c in dec.chains for w in c.writes if isinstance(w, Event) and w.reason == "CaptureLost"]
    assert [(e.kind, e.name, e.warning) for e in events] == [(Kind.CAPTURE, "c1", True)]
    assert "holding 1 span(s)" in events[0].message
    again = decide(world(*recs), dec.memory)
    assert not [w for c in again.chains for w in c.writes if isinstance(w, Event)]


# -- end to end on the fixture store -----------------------------------------------------------------


def test_store_balances_and_drains_to_a_fixed_point():
    st = Store()
    st.add(cf_with(balance_interval_seconds=1.0, drain_cooldown_seconds=2.0), table(1, pre_split_spans=6))
    st.add(capture("c0"))
    mem = memory(bootstrapped=False)
    for _ in range(30):
        _, mem = st.step(mem)
    assert {s.capture for s in st.of(Kind.SPAN).values()} == {"c0"}
    st.add(capture("c1"), capture("c2"))
    for _ in range(40):
        _, mem = st.step(mem)
    per = {c: sum(1 for s in st.of(Kind.SPAN).values() if s.capture == c) for c in ("c0", "c1", "c2")}
    assert per == {"c0": 2, "c1": 2, "c2": 2}
    st.put(replace(st.get(Kind.CAPTURE, "c2"), draining=True))
    states = []
    for _ in range(40):
        _, mem = st.step(mem)
        states.append(st.changefeed.scheduler_status.state)
    per = {c: sum(1 for s in st.of(Kind.SPAN).values() if s.capture == c) for c in ("c0", "c1", "c2")}
    assert per == {"c0": 3, "c1": 3, "c2": 0}
    assert SchedulerState.DRAINING in states
    assert SchedulerState.COOLING_DOWN in states
    assert states[-1] is SchedulerState.ACTIVE
    assert all(o.phase is OpPhase.SUCCEEDED for o in st.of(Kind.OPERATOR).values())  # type: ignore[attr-defined]


# -- review findings: convergence, guards, pause, hot spots ---------------------------------------------


def final_counts(recs, dec: Decision) -> dict[str, int]:
    """Spans per capture once the decision's Moves land."""
    where = {r.name: r.capture for r in recs if isinstance(r, Span)}
    for m in moves(dec):
        where[m.spans[0]] = m.target
    return dict(Counter(where.values()))


def test_balance_converges_to_floor_or_ceiling_of_the_mean():
    caps = [capture(f"c{i}") for i in range(10)]
    recs = [table(1), *caps, *placed(1, 19, ["c0"])]
    counts = final_counts(recs, decide(world(*recs, cf=cf_with()), memory()))
    assert sorted(counts.values()) == [1, *[2] * 9]  # 19 spans on 10 captures
    recs = [
        table(1),
        *CAPS,
        *placed(1, 4, ["c0"]),
        *placed(2, 2, ["c1"], prefix="b"),
        *placed(3, 2, ["c2"], prefix="c"),
    ]
    recs.insert(0, table(2))
    recs.insert(0, table(3))
    dec = decide(world(*recs, cf=cf_with()), memory())
    assert [m.target for m in moves(dec)] == ["c1"]  # [4, 2, 2] -> [3, 3, 2]


def test_balance_skips_a_source_with_nothing_movable():
    recs = [table(1), *CAPS, *placed(1, 6, ["c0"]), *placed(2, 4, ["c1"]), table(2)]
    tick = Tick(world(*recs, cf=cf_with()), 1, Options())
    for s in recs:
        if isinstance(s, Span) and s.capture == "c0":
            tick.touched.add((Kind.SPAN, s.name))  # already changed in this decision: not movable
    assert balance.balance(tick) == 2
    ops = [o for o in tick.operators.values() if o.type is OpType.MOVE]
    # c0 is fuller but gives nothing: c1 gives two (4, 0 -> 2, 2).
    assert [(tick.world.spans[o.spans[0]].capture, o.target) for o in ops] == [("c1", "c2"), ("c1", "c2")]


def test_balance_due_needs_a_quiet_world():
    recs = [table(1), *CAPS, *placed(1, 6, ["c0"])]
    active = SchedulerStatus(state=SchedulerState.ACTIVE)
    assert balance.balance_due(Tick(world(*recs, cf=cf_with()), 1, Options()), 0.0, active)
    repaired = Tick(world(*recs, cf=cf_with()), 1, Options())
    repaired.repairs.append("something was repaired")
    assert not balance.balance_due(repaired, 0.0, active)
    new = span("new", table_id=1, key_range=trange(1), state=None)
    assert not balance.balance_due(Tick(world(*recs, new, cf=cf_with()), 1, Options()), 0.0, active)
    absent = span("gap", table_id=1, state=SpanState.ABSENT)
    assert not balance.balance_due(Tick(world(*recs, absent, cf=cf_with()), 1, Options()), 0.0, active)
    cooling = SchedulerStatus(state=SchedulerState.COOLING_DOWN)
    assert not balance.balance_due(Tick(world(*recs, cf=cf_with()), 1, Options()), 0.0, cooling)


def test_no_balance_in_the_decision_that_creates_a_new_tables_spans():
    recs = [table(1), table(2), *CAPS, *placed(1, 6, ["c0"])]
    dec = decide(world(*recs, cf=cf_with()), memory())
    assert [s.table_id for s in created(dec, Kind.SPAN)] == [2]
    assert moves(dec) == []


def test_paused_changefeed_neither_drains_nor_counts_traffic():
    caps = [capture("c0", draining=True), capture("c1")]
    cf = cf_with(paused=True, split_write_threshold=100.0, split_checks=1)
    mem = replace(memory(), counters=Counters(checked_at=NOW - 100, hot={"s1-0": 5}))
    dec = decide(world(table(1), *caps, *placed(1, 2, ["c0"], rate=1000.0), cf=cf), mem)
    assert created(dec, Kind.OPERATOR) == []
    assert dec.memory.counters == Counters(checked_at=NOW)  # "in a row" starts again on resume


def test_drain_skips_a_span_a_user_operator_claims():
    caps = [capture("c0", draining=True), capture("c1")]
    pending = operator("u", OpType.SPLIT, ("s1-0",), split_into=2, created=NOW + 1)
    recs = [table(1), *caps, *placed(1, 2, ["c0"]), pending]
    dec = decide(world(*recs, cf=cf_with(max_in_flight_operators=3)), memory())
    assert [m.spans for m in moves(dec)] == [("s1-1",)]


def test_pause_keeps_the_drain_cool_down():
    caps = [capture("c0", draining=True), capture("c1"), capture("c2")]
    recs = [table(1), *caps, *placed(1, 6, ["c1"])]
    draining = SchedulerStatus(state=SchedulerState.DRAINING, message="x")
    paused = sched_status(decide(world(*recs, cf=cf_with(paused=True, status=draining)), memory()))
    assert paused.state is SchedulerState.PAUSED
    assert paused.balance_resumes_at == NOW + 120
    resumed = decide(at([*recs, cf_with(status=paused)], NOW + 60), memory())
    assert sched_status(resumed).state is SchedulerState.COOLING_DOWN
    assert sched_status(resumed).balance_resumes_at == NOW + 120
    assert moves(resumed) == []


def merge_cf(**knobs: object) -> Changefeed:
    return cf_with(merge_write_threshold=100.0, merge_checks=1, balance_interval_seconds=0, **knobs)


def merges(dec: Decision) -> list[tuple[str, ...]]:
    return [m.spans for m in ops_of(dec, OpType.MERGE)]


def test_merge_never_makes_a_span_that_would_be_split_again():
    by_rate = merge_cf(split_write_threshold=50.0)
    assert merges(decide(world(table(1), *CAPS, *placed(1, 2, ["c0"], rate=30.0), cf=by_rate), memory())) == []
    by_regions = merge_cf(split_region_threshold=100)
    recs = placed(1, 2, ["c0"], rate=1.0, regions=60)
    assert merges(decide(world(table(1), *CAPS, *recs, cf=by_regions), memory())) == []


def test_merge_only_adjacent_spans():
    recs = placed(1, 4, ["c0"], rate=1.0)
    del recs[4:6]  # s1-2 is gone: a hole between s1-1 and s1-3
    dec = decide(world(table(1), *CAPS, *recs, cf=merge_cf()), memory())
    assert merges(dec) == [("s1-0", "s1-1")]


def test_no_merge_on_a_table_split_in_the_same_check():
    cf = merge_cf(split_write_threshold=1000.0, split_checks=1)
    recs = placed(1, 4, ["c0"], rate=1.0)
    hot = [r.evolve(write_rate=5000.0) if r.name == "d1-3" else r for r in recs]
    dec = decide(world(table(1), *CAPS, *hot, cf=cf), memory())
    assert [o.spans for o in ops_of(dec, OpType.SPLIT)] == [("s1-3",)]
    assert merges(dec) == []


def test_merge_floor_counts_pre_split_keys():
    keys = (pieces(1, 3)[1].start, pieces(1, 3)[2].start)
    recs = placed(1, 3, ["c0"], rate=1.0)
    assert merges(decide(world(table(1, pre_split_keys=keys), *CAPS, *recs, cf=merge_cf()), memory())) == []
    one_key = table(1, pre_split_keys=keys[:1])
    assert merges(decide(world(one_key, *CAPS, *recs, cf=merge_cf()), memory())) == [("s1-0", "s1-1")]


def test_split_pieces_capped_by_max_pieces_and_by_regions():
    cf = cf_with(split_write_threshold=1.0, split_checks=1, max_spans_per_table=1000, balance_interval_seconds=0)
    dec = decide(world(table(1), *CAPS, *placed(1, 1, ["c0"], rate=1e6), cf=cf), memory())
    assert [o.split_into for o in ops_of(dec, OpType.SPLIT)] == [128]
    dec = decide(world(table(1), *CAPS, *placed(1, 1, ["c0"], rate=1e6, regions=2), cf=cf), memory())
    assert [o.split_into for o in ops_of(dec, OpType.SPLIT)] == [2]
    dec = decide(world(table(1), *CAPS, *placed(1, 1, ["c0"], rate=1e6, regions=1), cf=cf), memory())
    assert ops_of(dec, OpType.SPLIT) == []  # one region: nothing to cut


def test_a_hot_spot_left_by_a_split_is_not_split_again():
    cf = cf_with(split_write_threshold=1000.0, split_checks=1, balance_interval_seconds=0)
    recs = [table(1), *CAPS, *placed(1, 1, ["c0"], rate=4000.0)]
    mem = replace(memory(), counters=Counters(children={"s1-0": 5000.0}))
    assert ops_of(decide(world(*recs, cf=cf), mem), OpType.SPLIT) == []  # 4000 > 5000 / 2
    spread = [table(1), *CAPS, *placed(1, 1, ["c0"], rate=2000.0)]
    assert len(ops_of(decide(world(*spread, cf=cf), mem), OpType.SPLIT)) == 1


def test_capture_lost_event_goes_on_the_changefeed_when_the_capture_is_gone_and_in_its_own_chain():
    sp = span("s", capture="gone", dispatcher="d")
    dec = decide(world(table(1), capture("c0"), sp, dispatcher("d", sp, "gone")), memory())
    (chain,) = [c for c in dec.chains if any(isinstance(w, Event) for w in c.writes)]
    assert [(w.kind, w.name, w.reason) for w in chain.writes] == [(Kind.CHANGEFEED, "cf", "CaptureLost")]


def test_skewed_traffic_does_not_churn():
    """One hot key range: the first split leaves a hot child; it is not split again, keys stay short."""
    st = Store()
    cf = cf_with(
        split_write_threshold=1000.0,
        split_checks=1,
        merge_write_threshold=100.0,
        merge_checks=1,
        traffic_check_interval_seconds=1.0,
        balance_interval_seconds=0,
    )
    st.add(cf, table(1), capture("c0"), capture("c1"), capture("c2"))
    hot_key = trange(1).start + b"\x00\x00\x00\x00\x00\x00\x00\x07"
    mem = memory(bootstrapped=False)
    for _ in range(400):
        for d in list(st.of(Kind.DISPATCHER).values()):
            rate = 5000.0 if d.key_range.contains_key(hot_key) else 10.0
            if d.write_rate != rate:
                st.objects[(Kind.DISPATCHER, d.name)] = d.evolve(write_rate=rate)
        _, mem = st.step(mem)
    ops = [o for o in st.of(Kind.OPERATOR).values() if isinstance(o, SpanOperator)]
    splits = [o for o in ops if o.type is OpType.SPLIT]
    assert len(splits) == 1
    assert all(o.phase is OpPhase.SUCCEEDED for o in ops)
    assert max(len(s.key_range.start) for s in st.of(Kind.SPAN).values()) <= 9 + 4
