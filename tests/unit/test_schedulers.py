"""The drain, balance, split and merge schedulers, the scheduler status, and the CaptureLost Event."""

from __future__ import annotations

from dataclasses import replace

from controller.engine.intents import Event
from controller.engine.maintainer import Decision, Memory, decide
from controller.engine.traffic import Counters
from controller.engine.world import World
from controller.model.records import Capture, Changefeed, SchedulerConfig, SchedulerStatus, SpanOperator
from controller.model.states import SchedulerState
from tests.unit.fixtures import (
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
    table,
    world,
)


def cf_with(paused: bool = False, status: SchedulerStatus | None = None, **knobs: object) -> Changefeed:
    cfg = replace(SchedulerConfig(), **knobs)  # type: ignore[arg-type]
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
    assert [o.type for o in created(dec, Kind.OPERATOR)] == [OpType.ADD]  # the basic scheduler places it


def test_balance_respects_max_moves_and_the_off_switch():
    recs = [table(1), *CAPS, *placed(1, 6, ["c0"])]
    assert len(moves(decide(world(*recs, cf=cf_with(balance_max_moves=1)), memory()))) == 1
    assert moves(decide(world(*recs, cf=cf_with(balance_interval_seconds=0)), memory())) == []


def test_balance_leaves_a_balanced_changefeed_alone():
    dec = decide(world(table(1), *CAPS, *placed(1, 5, ["c0", "c1", "c2"]), cf=cf_with()), memory())
    assert moves(dec) == []
    assert dec.memory.balanced_at == NOW  # the round ran and found nothing to do


def test_paused_changefeed_runs_no_scheduler_and_says_so():
    absent = span("gap", table_id=2, state=SpanState.ABSENT)
    recs = [table(1), table(2), *CAPS, *placed(1, 6, ["c0"]), absent, capture("c3", draining=True)]
    dec = decide(world(*recs, cf=cf_with(paused=True)), memory())
    assert created(dec, Kind.OPERATOR) == []
    status = sched_status(dec)
    assert status.state is SchedulerState.PAUSED
    assert "user SpanOperators still run" in status.message


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
