"""Capture progress reports: building them, carrying them on the Lease, and when the maintainer may use one."""

from __future__ import annotations

from dataclasses import replace

from controller.engine import checkpoint
from controller.engine import progress as engine_progress
from controller.engine.index import Index
from controller.engine.intents import Chain
from controller.engine.maintainer import CHECKPOINT_INTERVAL, Decision, decide
from controller.engine.world import Options, Tick
from controller.model import progress
from controller.model.progress import (
    SINK,
    HeadCurve,
    Progress,
    ProgressEntry,
    Running,
    SinkFigures,
    Trouble,
    build,
    digest,
    traffic_changed,
)
from controller.model.resources import capture_from_resources, lease_resource, progress_from_json, progress_to_json
from controller.model.states import Mode
from controller.sim.index_check import verify
from tests.engine.fixtures import (
    EPOCH,
    NOW,
    DispatcherState,
    Kind,
    SpanState,
    capture,
    changefeed,
    dispatcher,
    last_status,
    memory,
    pieces,
    span,
    table,
    world,
)

P = pieces(1, 3)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=200)
B = span("b", key_range=P[1], capture="c0", dispatcher="db", checkpoint_ts=200)
C = span("c", key_range=P[2], capture="c1", dispatcher="dc", checkpoint_ts=200)
DA = dispatcher("da", A, "c0", checkpoint_ts=300)
DB = dispatcher("db", B, "c0", checkpoint_ts=260)
DC = dispatcher("dc", C, "c1", checkpoint_ts=280)


def report(cp: int, *ds: object, cf: str = "cf", mode: Mode = Mode.DEFAULT, incarnation: str = "i1") -> Progress:
    uids = [d.uid for d in ds]  # type: ignore[attr-defined]
    entry = ProgressEntry(changefeed=cf, mode=mode, checkpoint_ts=cp, dispatchers=len(uids), digest=digest(uids))
    return Progress(incarnation=incarnation, at=NOW, entries=(entry,))


def reporting(name: str, prog: Progress | None) -> object:
    return replace(capture(name), progress=prog)


def compute(*recs: object, options: Options | None = None) -> int:
    """The checkpoint as a full decision computes it, after checking that an incremental one (over an index
    of the same records, engine/index.py) computes the same."""
    w = world(*recs)  # type: ignore[arg-type]
    full = checkpoint.compute(Tick(w, EPOCH, options or Options()))
    index = Index.build(w.changefeed.name, [w.changefeed, *w.tables.values(), *w.spans.values(),
                                            *w.dispatchers.values(), *w.operators.values()])  # fmt: skip
    indexed = replace(w, tables=index.tables, spans=index.spans, dispatchers=index.dispatchers, index=index)
    incremental = checkpoint.compute(Tick(indexed, EPOCH, options or Options()))
    assert incremental == full, f"incremental {incremental} != full {full}"
    return full


# -- the report -------------------------------------------------------------------------------------------


def test_digest_is_order_independent_and_names_the_set() -> None:
    assert digest(["b", "a"]) == digest(["a", "b"])
    assert digest(["a", "b"]) != digest(["a", "c"])
    assert digest(["a"]) != digest(["a", "a2"])
    assert len(digest([])) == 17  # "+" (a set digest), then 64 bits in hex


def test_build_groups_per_changefeed_and_mode() -> None:
    runs = [
        Running("u1", "d1", "cf", Mode.DEFAULT, 10, 50),
        Running("u2", "d2", "cf", Mode.DEFAULT, 10, 40),
        Running("u3", "d3", "cf", Mode.REDO, 10, 45),
        Running("u4", "d4", "other", Mode.DEFAULT, 10, 5),
    ]
    p = build(runs, "inc", 12.5)
    assert p.incarnation == "inc"
    d = p.entry("cf", Mode.DEFAULT)
    assert d is not None
    assert (d.checkpoint_ts, d.dispatchers, d.digest, d.slowest) == (40, 2, digest(["u1", "u2"]), "d2")
    r = p.entry("cf", Mode.REDO)
    assert r is not None
    assert (r.checkpoint_ts, r.dispatchers) == (45, 1)
    assert p.entry("other", Mode.DEFAULT) is not None
    assert p.entry("other", Mode.REDO) is None


def test_report_round_trips_through_the_lease_annotation() -> None:
    p = build([Running("u1", "d1", "cf", Mode.DEFAULT, 10, 50)], "inc", 12.5)
    cap = replace(capture("c0"), progress=p)
    lease = lease_resource(cap)
    obj = {"apiVersion": "cdc.maintainer.dev/v1alpha1", "kind": "Capture", "metadata": {"name": "c0"}, "spec": {}}
    assert capture_from_resources(obj, lease).progress == p
    assert progress_from_json(progress_to_json(p)) == p
    timed = replace(p, entries=tuple(replace(e, checkpoint_time=1_765_000_000.125) for e in p.entries))
    assert '"checkpointTime":1765000000.125' in progress_to_json(timed)
    assert progress_from_json(progress_to_json(timed)) == timed
    assert "checkpointTime" not in progress_to_json(p)  # a TSO's time is its own
    failing = replace(p, troubles=(Trouble(changefeed="cf", side=SINK, transient=True, message="refused"),))
    assert '"troubles":[{"changefeed":"cf","side":"sink","transient":true,"message":"refused"}]' in (
        progress_to_json(failing)
    )
    assert progress_from_json(progress_to_json(failing)) == failing
    figures = replace(p, sinks=(SinkFigures(changefeed="cf", collected=3, tombstones=2, live_rows=1),))
    assert '"sinks":[{"changefeed":"cf","collected":3,"tombstones":2,"liveRows":1}]' in progress_to_json(figures)
    assert progress_from_json(progress_to_json(figures)) == figures
    assert "troubles" not in progress_to_json(p)
    # A side this version does not know (a newer capture's) is left out; the rest of the report stands.
    newer = progress_to_json(failing).replace('"side":"sink"', '"side":"schema"')
    assert progress_from_json(newer) == p


def test_a_report_that_does_not_parse_is_ignored_and_the_capture_stays_valid() -> None:
    cap = replace(capture("c0"), progress=None)
    obj = {"apiVersion": "cdc.maintainer.dev/v1alpha1", "kind": "Capture", "metadata": {"name": "c0"}, "spec": {}}
    for bad in ("{", "[]", '{"incarnation": 1}', '{"incarnation":"x","at":"now","changefeeds":[]}',
                '{"incarnation":"x","at":"2024-01-01T00:00:00Z","changefeeds":[{"changefeed":"cf","mode":"nope",'
                '"checkpointTs":1,"dispatchers":1,"digest":"d"}]}',
                '{"incarnation":"x","at":"2024-01-01T00:00:00Z","changefeeds":[{"changefeed":"cf","mode":"default",'
                '"checkpointTs":-1,"dispatchers":1,"digest":"d"}]}',
                *('{"incarnation":"x","at":"2024-01-01T00:00:00Z","changefeeds":[{"changefeed":"cf","mode":"default",'
                  f'"checkpointTs":1,"dispatchers":1,"digest":"d","checkpointTime":{t}}}]}}'
                  for t in ("-1", '"soon"', "true", "NaN", "Infinity")),
                '{"incarnation":"x","at":"2024-01-01T00:00:00Z","changefeeds":[{"changefeed":"cf","mode":"default",'
                '"checkpointTs":1,"dispatchers":1,"digest":"d"}],"troubles":[{"changefeed":"cf","side":"sink",'
                '"transient":true,"message":7}]}',
                '{"incarnation":"x","at":"2024-01-01T00:00:00Z","changefeeds":[],"troubles":[{"changefeed":"cf",'
                '"side":"sink","transient":"yes","message":"m"}]}',
                '{"incarnation":"x","at":"2024-01-01T00:00:00Z","changefeeds":[],"sinks":[{"changefeed":"cf",'
                '"collected":-1,"tombstones":0,"liveRows":0}]}'):  # fmt: skip
        lease = lease_resource(cap)
        lease["metadata"]["annotations"] = {progress.PROGRESS_ANNOTATION: bad}
        got = capture_from_resources(obj, lease)
        assert got.progress is None, bad
        assert got.renew_time == cap.renew_time


def test_the_head_curve_gives_the_earliest_time_known_at_or_above_a_revision() -> None:
    curve = HeadCurve()
    assert curve.time_of(10) is None
    curve.see(20, 100.0)
    curve.see(30, 105.0)
    curve.see(25, 104.0)
    assert curve.time_of(10) == 100.0  # by 100 the source held 20 >= 10
    assert curve.time_of(21) == 104.0
    assert curve.time_of(31) is None  # nothing known that far: no time claimed
    curve.see(40, 101.0)  # a later revision known earlier (another capture's report): the pairs below are useless
    assert curve.points == [(20, 100.0), (40, 101.0)]
    curve.see(15, 120.0)  # known later than something above it: tells nothing
    assert curve.points == [(20, 100.0), (40, 101.0)]
    curve.forget_below(21)
    assert curve.points == [(40, 101.0)]
    small = HeadCurve(limit=8)
    for i in range(100):
        small.see(i, float(i))
        assert len(small.points) <= 8
        assert small.time_of(i) == float(i)  # the newest is always kept
    for r in range(100):  # older ones coarser: a time at or after the true one, a lag never over-stated
        when = small.time_of(r)
        assert when is not None
        assert when >= r


def test_traffic_is_rewritten_only_when_it_changes_materially() -> None:
    assert not traffic_changed((100.0, 10), (100.0, 10))
    assert not traffic_changed((100.0, 10), (105.0, 10))
    assert traffic_changed((100.0, 10), (112.0, 10))
    assert traffic_changed((100.0, 10), (100.0, 12))
    assert traffic_changed((0.0, 0), (0.5, 0))
    assert traffic_changed((3.0, 0), (0.0, 0))


# -- the maintainer's use of it ------------------------------------------------------------------------


def test_a_report_covering_exactly_the_believed_set_advances_the_checkpoint() -> None:
    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    assert compute(table(1), *caps, A, B, C, DA, DB, DC) == 450


def test_without_reports_the_persisted_checkpoints_hold_it() -> None:
    assert compute(table(1), capture("c0"), capture("c1"), A, B, C, DA, DB, DC) == 260


def test_a_report_missing_a_working_dispatcher_is_not_used() -> None:
    # c0 reports only da: db (Working as the maintainer sees it) is not covered, so c0's report is not used.
    caps = (reporting("c0", report(500, DA)), reporting("c1", report(450, DC)))
    assert compute(table(1), *caps, A, B, C, DA, DB, DC) == 260


def test_a_report_covering_more_than_the_believed_set_is_not_used() -> None:
    # db just stopped as far as the maintainer knows; the report (made before) still counts it.
    stopped = replace(DB, state=DispatcherState.STOPPED)
    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    b = replace(B, state=SpanState.ABSENT, dispatcher="", capture="")
    assert compute(table(1), *caps, A, b, C, DA, stopped, DC) == 200


def test_a_recreated_dispatcher_of_the_same_name_is_not_covered() -> None:
    # The report names db's previous object (same name, another uid): not the dispatcher running now.
    old_db = replace(DB, uid="uid-db-previous")
    caps = (reporting("c0", report(500, DA, old_db)), reporting("c1", report(450, DC)))
    assert compute(table(1), *caps, A, B, C, DA, DB, DC) == 260


def test_mutant_uses_a_report_beyond_what_it_covers() -> None:
    caps = (reporting("c0", report(500, DA)), reporting("c1", report(450, DC)))
    mutant = Options(mutants=frozenset({engine_progress.MUTANT_BEYOND_COVERAGE}))
    assert compute(table(1), *caps, A, B, C, DA, DB, DC, options=mutant) == 450


def test_the_incremental_checkpoint_raises_each_group_by_its_own_report() -> None:
    # Per (capture, mode) the lowest span value is raised to the report's minimum, never another group's.
    low_a, low_c = replace(DA, checkpoint_ts=100), replace(DC, checkpoint_ts=150)  # below the spans' 200
    caps = (reporting("c0", report(500, low_a, DB)), reporting("c1", report(250, low_c)))
    assert compute(table(1), *caps, A, B, C, low_a, DB, low_c) == 250
    caps = (reporting("c0", report(500, low_a)), reporting("c1", report(450, low_c)))  # db not covered: c0 unused
    assert compute(table(1), *caps, A, B, C, low_a, DB, low_c) == 200


def test_mutant_incremental_ignores_reports_differs_from_the_full_checkpoint() -> None:
    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    mutant = Options(mutants=frozenset({engine_progress.MUTANT_INCREMENTAL_IGNORES}))
    w = world(table(1), *caps, A, B, C, DA, DB, DC)
    index = Index.build("cf", [w.changefeed, *w.tables.values(), *w.spans.values(), *w.dispatchers.values()])
    indexed = replace(w, tables=index.tables, spans=index.spans, dispatchers=index.dispatchers, index=index)
    assert checkpoint.compute(Tick(w, EPOCH, mutant)) == 450
    assert checkpoint.compute(Tick(indexed, EPOCH, mutant)) == 260


def test_reports_are_per_mode() -> None:
    ar = span("ar", mode=Mode.REDO, capture="c0", dispatcher="dr", checkpoint_ts=200)  # the whole table
    redo = dispatcher("dr", ar, "c0", checkpoint_ts=300)
    # c0 reports its default dispatchers only: its redo dispatcher keeps its persisted checkpoint.
    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    w = world(table(1), *caps, A, B, C, ar, DA, DB, DC, redo, cf=changefeed(redo=True))  # type: ignore[arg-type]
    assert checkpoint.compute(Tick(w, EPOCH, Options())) == 300


def test_another_changefeeds_entry_is_not_used() -> None:
    caps = (reporting("c0", report(500, DA, DB, cf="other")), reporting("c1", report(450, DC)))
    assert compute(table(1), *caps, A, B, C, DA, DB, DC) == 260


# -- how often the checkpoint is written -------------------------------------------------------------------


def test_a_checkpoint_only_change_is_written_at_most_once_per_interval() -> None:
    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    w = world(table(1), *caps, A, B, C, DA, DB, DC)
    first = decide(w, memory())
    cf = last_status(first, Kind.CHANGEFEED, "cf")
    assert cf.checkpoint_ts == 450
    assert first.memory.checkpoint_at == NOW
    caps2 = (reporting("c0", report(520, DA, DB)), reporting("c1", report(470, DC)))
    soon = world(table(1), *caps2, A, B, C, DA, DB, DC, cf=cf, now=NOW + CHECKPOINT_INTERVAL / 2)
    held = decide(soon, first.memory)
    assert not [w for c in held.chains for w in c.writes if getattr(w, "obj", None) is not None
                and w.obj.kind is Kind.CHANGEFEED]  # fmt: skip
    # Nothing else would wake the maintainer: the decision is due again when the wait ends.
    assert held.next_due == NOW + CHECKPOINT_INTERVAL
    later = world(table(1), *caps2, A, B, C, DA, DB, DC, cf=cf, now=NOW + CHECKPOINT_INTERVAL)
    assert last_status(decide(later, first.memory), Kind.CHANGEFEED, "cf").checkpoint_ts == 470


def test_another_status_change_carries_the_new_checkpoint_at_once() -> None:
    caps = (reporting("c0", report(520, DA, DB)), reporting("c1", report(470, DC)))
    cf = changefeed(checkpoint_ts=450, operators_in_flight=3)  # stale count: the write goes out anyway
    w = world(table(1), *caps, A, B, C, DA, DB, DC, cf=cf, now=NOW)
    mem = replace(memory(), checkpoint_at=NOW - 0.1)
    assert last_status(decide(w, mem), Kind.CHANGEFEED, "cf").checkpoint_ts == 470


def test_a_wall_clock_stepping_back_does_not_stall_the_checkpoint() -> None:
    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    first = decide(world(table(1), *caps, A, B, C, DA, DB, DC), memory())
    cf = last_status(first, Kind.CHANGEFEED, "cf")
    # The last write was stamped an hour "later" than now (NTP stepped the clock back): write anyway.
    caps2 = (reporting("c0", report(520, DA, DB)), reporting("c1", report(470, DC)))
    back = replace(first.memory, checkpoint_at=NOW + 3600)
    decision = decide(world(table(1), *caps2, A, B, C, DA, DB, DC, cf=cf, now=NOW + 1), back)
    assert last_status(decision, Kind.CHANGEFEED, "cf").checkpoint_ts == 470
    assert decision.memory.checkpoint_at == NOW + 1


def test_a_progress_only_status_write_does_not_wake_the_next_decision() -> None:
    """At rest the Changefeed's checkpoint moves once a second; that write's landing needs no decision of its
    own (``Chain.wake``). The first decision of a term, and any other status change, still wakes one."""

    def status_chain(d: Decision) -> Chain:
        return next(c for c in d.chains if c.why == "changefeed status")

    caps = (reporting("c0", report(500, DA, DB)), reporting("c1", report(450, DC)))
    first = decide(world(table(1), *caps, A, B, C, DA, DB, DC), memory(bootstrapped=False))
    assert status_chain(first).wake  # the Bootstrapped condition: the term's first status
    cf = last_status(first, Kind.CHANGEFEED, "cf")
    caps2 = (reporting("c0", report(520, DA, DB)), reporting("c1", report(470, DC)))
    later = decide(world(table(1), *caps2, A, B, C, DA, DB, DC, cf=cf, now=NOW + 2), first.memory)
    assert last_status(later, Kind.CHANGEFEED, "cf").checkpoint_ts == 470
    assert not status_chain(later).wake
    # The scheduler's status changed too (a paused changefeed's): that wakes the next decision.
    paused = replace(cf, paused=True)
    moved = decide(world(table(1), *caps2, A, B, C, DA, DB, DC, cf=paused, now=NOW + 2), first.memory)
    assert status_chain(moved).wake


def test_a_set_digest_is_a_sum_kept_current_per_change_and_a_legacy_one_is_still_judged() -> None:
    """Issue 37: the maintainer hashed every Working dispatcher of a capture whenever one started or stopped (the digest
    was over the sorted uids), in the event loop when a metrics scrape asked. The digest is now a sum of per-uid
    hashes, which the index keeps current one addition per change; a report from a capture of before (a legacy
    digest, no "+") is still recognised, so a rolling upgrade keeps using its reports."""
    from controller.engine import digests as digests_module
    from controller.engine.index import Index
    from controller.model.keys import KeyRange
    from controller.model.progress import legacy_digest
    from controller.model.records import Dispatcher
    from controller.model.states import DispatcherState

    idx = Index("cf")
    ds = [
        Dispatcher(name=f"d{i}", uid=f"u{i}", changefeed="cf", span=f"s{i}", table_id=1, key_range=KeyRange.of_table(1),
                   capture="c0", start_ts=1, epoch=1, state=DispatcherState.WORKING)
        for i in range(50)
    ]  # fmt: skip
    for d in ds:
        idx.put(d)
    key = ("c0", Mode.DEFAULT)
    assert idx.working.digest(key) == digest(d.uid for d in ds)
    idx.remove(ds[7].KIND, "d7")
    idx.put(ds[3].evolve(state=DispatcherState.STOPPED))
    left = [d.uid for d in ds if d.name not in ("d3", "d7")]
    hashed: list[str] = []
    real = digests_module.uid_hash

    def counting(uid: str) -> int:
        hashed.append(uid)
        return real(uid)

    digests_module.uid_hash = counting  # type: ignore[assignment]
    try:
        assert idx.working.digest(key) == digest(left)
        assert idx.working.covers(key, digest(left))
        assert hashed == []  # no uid hashed to answer: the sum was kept per change
        assert idx.working.covers(key, legacy_digest(left))  # a capture of before issue 37
        assert not idx.working.covers(key, legacy_digest(left[:-1]))
        assert not idx.working.covers(key, digest(left[:-1]))
    finally:
        digests_module.uid_hash = real  # type: ignore[assignment]
    assert verify(idx) == []
