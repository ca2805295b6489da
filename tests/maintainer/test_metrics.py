"""The maintainer's Prometheus metrics (controller.maintainer.metrics) on a Maintainer whose informer cache is
filled by hand: no API server, no event loop except where the HTTP endpoint and the executor are exercised.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any, cast

import aiohttp
import pytest
import urllib3
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from controller.engine import intents as I
from controller.engine.maintainer import Decision, Memory
from controller.kube.client import ApiError, BadResponse, Client
from controller.kube.executor import failure_reason
from controller.maintainer import __main__ as cli
from controller.maintainer.metrics import PREFIX, MetricsServer
from controller.maintainer.runner import Maintainer, Settings
from controller.model import resources as conv
from controller.model.keys import KeyRange
from controller.model.progress import (
    SINK,
    SOURCE,
    Progress,
    ProgressEntry,
    SinkFigures,
    Trouble,
    checkpoint_lag,
    digest,
)
from controller.model.records import Capture, Changefeed, Dispatcher, Record, SchedulerStatus, Span, SpanOperator
from controller.model.states import DispatcherState, Kind, Mode, OpPhase, OpType, SchedulerState, SpanState, Stage
from controller.model.tso import tso
from controller.model.verification import LAST_VERIFY_ANNOTATION, Verification
from controller.sim.index_check import verify

CF = "cf"
OTHER = "other"  # a changefeed this process does not lead
NS = "ns"


class Harness:
    """A Maintainer (never started) whose informer cache the test writes, as the watch would."""

    def __init__(self, leading: tuple[str, ...] = (CF,)) -> None:
        self.m = Maintainer(cast(Client, object()), Settings(namespace=NS, identity="m1"))
        self.m.leading.update(leading)
        self.rv = 0
        self.uids = 0

    @property
    def registry(self) -> CollectorRegistry:
        return self.m.metrics.registry

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(PREFIX + name, labels)

    def offer(self, record: Record, kind: str | None = None) -> Record:
        """A watch event (or write-through) of ``record`` at the next resourceVersion."""
        self.rv += 1
        if not record.uid:
            self.uids += 1
            record = record.evolve(uid=f"uid-{self.uids}")
        record = record.evolve(resource_version=str(self.rv), namespace=NS)
        self.m.informer.offer(kind or record.KIND.value, conv.to_resource(record))
        return record

    def lease(self, capture: str, renewed: float, duration: int = 10) -> None:
        self.rv += 1
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": conv.lease_name(capture), "namespace": NS, "resourceVersion": str(self.rv)},
            "spec": {
                "holderIdentity": capture,
                "renewTime": conv.format_time(renewed, micro=True),
                "leaseDurationSeconds": duration,
            },
        }
        self.m.informer.offer("Lease", lease)

    def report(self, capture: str, entry: ProgressEntry, now: float, **more: Any) -> None:
        """The capture's Lease renewed at ``now``, carrying a progress report of one entry (and ``more``)."""
        self.rv += 1
        cap = Capture(name=capture, renew_time=now, lease_duration=10,
                      progress=Progress(incarnation="i", at=now, entries=(entry,), **more))  # fmt: skip
        lease = conv.lease_resource(cap)
        lease["metadata"]["resourceVersion"] = str(self.rv)
        self.m.informer.offer("Lease", lease)

    def delete(self, record: Record) -> None:
        """A watch DELETED event (carrying the object at its last resourceVersion)."""
        self.rv += 1
        obj = conv.to_resource(record.evolve(resource_version=str(self.rv)))
        self.m.informer.forget(record.KIND.value, record.name, obj)

    def relist(self, kind: Kind) -> None:
        store = self.m.informer.store
        store.replace_all(kind.value, [conv.to_resource(r) for r in store.all(kind).values()])
        self.m.informer._notify(kind.value, "")


def span(name: str, state: SpanState | None, capture: str = "", mode: Mode = Mode.DEFAULT, cf: str = CF) -> Span:
    return Span(
        name=name, changefeed=cf, table_id=1, mode=mode, key_range=KeyRange.of_table(1), state=state, capture=capture
    )


def operator(name: str, phase: OpPhase, stage: Stage = Stage.NONE, cf: str = CF, **kw: Any) -> SpanOperator:
    fields: dict[str, Any] = {"type": OpType.MOVE, "spans": ("s1",), "target": "c1", "created": 1000.0, **kw}
    return SpanOperator(name=name, changefeed=cf, phase=phase, stage=stage, **fields)


def histogram(h: Harness, suffix: str, type_: str, outcome: str) -> float | None:
    return h.value(f"operator_duration_seconds_{suffix}", type=type_, outcome=outcome)


# ------------------------------------------------------------------------------------------------------
# Gauges computed at scrape time


def test_spans_by_state_capture_and_mode_of_led_changefeeds_only() -> None:
    h = Harness()
    h.offer(span("a", SpanState.REPLICATING, "c1"))
    h.offer(span("b", SpanState.REPLICATING, "c1"))
    h.offer(span("c", SpanState.REPLICATING, "c2", Mode.REDO))
    h.offer(span("d", SpanState.ABSENT))
    h.offer(span("e", None))
    h.offer(span("x", SpanState.REPLICATING, "c1", cf=OTHER))
    assert h.value("spans", changefeed=CF, state="Replicating", capture="c1", mode="default") == 2
    assert h.value("spans", changefeed=CF, state="Replicating", capture="c2", mode="redo") == 1
    assert h.value("spans", changefeed=CF, state="Absent", capture="none", mode="default") == 1
    assert h.value("spans", changefeed=CF, state="Unknown", capture="none", mode="default") == 1
    assert h.value("spans", changefeed=OTHER, state="Replicating", capture="c1", mode="default") is None

    # Built at scrape time: a span that moves leaves no stale series behind.
    h.offer(span("c", SpanState.ABSENT, "", Mode.REDO).evolve(uid="uid-3"))
    assert h.value("spans", changefeed=CF, state="Replicating", capture="c2", mode="redo") is None
    assert h.value("spans", changefeed=CF, state="Absent", capture="none", mode="redo") == 1

    # Leadership lost: nothing about that changefeed is reported any more.
    h.m.leading.clear()
    assert h.value("spans", changefeed=CF, state="Replicating", capture="c1", mode="default") is None
    assert h.value("leader", changefeed=CF) is None


def test_a_scrape_reads_the_index_aggregates_not_every_span_or_operator() -> None:
    """Issue 37: a scrape walked every Span and SpanOperator on the event loop (tens of milliseconds at 100,000
    spans). The span counts come from the index's ``span_tally`` and the operators from its in-flight set: a scrape
    never lists the records of those kinds."""
    h = Harness()
    for i in range(50):
        h.offer(span(f"s{i}", SpanState.REPLICATING, f"c{i % 3}"))
    for i in range(20):
        h.offer(operator(f"done{i}", OpPhase.SUCCEEDED, Stage.ADD_DEST))
    h.offer(operator("r1", OpPhase.RUNNING, Stage.REMOVE_ORIGIN))
    store = h.m.informer.store
    real = store.all

    def all_but_the_many(kind: Kind) -> Any:
        assert kind not in (Kind.SPAN, Kind.OPERATOR), f"a scrape listed every {kind.value}"
        return real(kind)

    store.all = all_but_the_many  # type: ignore[method-assign]
    assert h.value("spans", changefeed=CF, state="Replicating", capture="c0", mode="default") == 17
    assert h.value("operators_in_flight", changefeed=CF, type="Move", phase="Running", stage="RemoveOrigin") == 1
    assert verify(store.indexes[CF]) == []


def led_changefeed(spans: int) -> Harness:
    """A maintainer leading CF with ``spans`` spans spread over the same states and three live captures, a Working
    dispatcher per span, each capture's report covering its dispatchers, three operators in flight and a tenth as
    many finished ones retained: everything a scrape reports but the number of records."""
    h = Harness()
    now = time.time()
    h.offer(Changefeed(name=CF, checkpoint_ts=tso(int((now - 2) * 1000))))
    h.m.stats.epochs[CF] = 1
    h.m.stats.bootstrap_seconds[CF] = 0.5
    h.m.memories[CF] = Memory(epoch=1, identity="m1", bootstrapped=True)
    captures = ("c1", "c2", "c3")
    rng = KeyRange.of_table(1)
    working: dict[str, list[Record]] = {c: [] for c in captures}
    for i in range(spans):
        capture = captures[i % 3]
        h.offer(span(f"s{i}", SpanState.REPLICATING if i % 5 else SpanState.ABSENT, capture if i % 5 else ""))
        d = h.offer(Dispatcher(name=f"d{i}", changefeed=CF, span=f"s{i}", table_id=1, key_range=rng, capture=capture,
                               start_ts=1, epoch=1, state=DispatcherState.WORKING))  # fmt: skip
        working[capture].append(d)
    for i in range(spans // 10):
        h.offer(operator(f"done{i}", OpPhase.SUCCEEDED, Stage.ADD_DEST))
    for i, stage in enumerate((Stage.NONE, Stage.ADD_DEST, Stage.REMOVE_ORIGIN)):
        h.offer(operator(f"run{i}", OpPhase.PENDING if stage is Stage.NONE else OpPhase.RUNNING, stage))
    for capture, ds in working.items():
        entry = ProgressEntry(changefeed=CF, mode=Mode.DEFAULT, checkpoint_ts=tso(int((now - 1) * 1000)),
                              dispatchers=len(ds), digest=digest(d.uid for d in ds), slowest=ds[-1].name)  # fmt: skip
        h.report(capture, entry, now)
        h.offer(Capture(name=capture))
    return h


def scrape_work(registry: CollectorRegistry) -> tuple[int, int]:
    """The work of one scrape (a collection of ``registry`` and its text encoding, what the endpoint does), counted:
    the lines of Python it runs, in every module (a loop or comprehension over records runs lines per record, in our
    code or a library's; a walk made wholly in C, ``Counter(map(...))``, would not be seen), and the samples it
    produces."""
    lines = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    before, collecting = sys.gettrace(), gc.isenabled()
    gc.disable()  # no collection's callbacks or finalizers in the count
    sys.settrace(trace)
    try:
        text = generate_latest(registry).decode()
    finally:
        sys.settrace(before)
        if collecting:
            gc.enable()
    return lines, sum(len(f.samples) for f in text_string_to_metric_families(text))


def test_a_scrapes_work_does_not_grow_with_the_spans() -> None:
    """A scrape reads the indexes' aggregates (span counts by state, capture and mode; the operators in flight; the
    Working sets' digests), never every record: at 10,000 spans it runs exactly the lines, and produces exactly the
    samples, it does at 100. A walk over the spans, dispatchers or operators anywhere in it, put back, fails here."""
    small, large = led_changefeed(100), led_changefeed(10_000)
    assert small.value("spans", changefeed=CF, state="Replicating", capture="c1", mode="default") == 27
    assert large.value("spans", changefeed=CF, state="Replicating", capture="c1", mode="default") == 2667
    assert large.value("capture_report_covered", changefeed=CF, mode="default", capture="c1") == 1
    assert large.value("operators_in_flight", changefeed=CF, type="Move", phase="Running", stage="AddDest") == 1
    scrape_work(small.registry), scrape_work(large.registry)  # the first scrape of each warms what is cached once
    assert scrape_work(large.registry) == scrape_work(small.registry)


class Unwalked(dict):  # type: ignore[type-arg]
    """A map a scrape may look up in but never walk."""

    def __iter__(self) -> Any:
        raise AssertionError("a scrape walked every dispatcher")

    def values(self) -> Any:
        raise AssertionError("a scrape walked every dispatcher")

    def items(self) -> Any:
        raise AssertionError("a scrape walked every dispatcher")


def test_the_capture_reports_are_judged_from_the_index_not_by_walking_the_dispatchers() -> None:
    """Issue 37, found by the bench scraping /metrics every second: the reports' coverage was judged by walking every
    dispatcher of the changefeed (``progress.entries``), 250-300 ms of the event loop per scrape at 100,000 spans.
    It reads the index's Working sets and their digests now: the same answer, and no walk."""
    h = Harness()
    now = time.time()
    h.offer(Changefeed(name=CF))
    rng = KeyRange.of_table(1)
    ds = [
        h.offer(Dispatcher(name=f"d{i}", changefeed=CF, span=f"s{i}", table_id=1, key_range=rng, capture="c1",
                           start_ts=1, epoch=1, state=DispatcherState.WORKING))
        for i in range(40)
    ]  # fmt: skip
    entry = ProgressEntry(changefeed=CF, mode=Mode.DEFAULT, checkpoint_ts=tso(int((now - 1) * 1000)),
                          dispatchers=len(ds), digest=digest(d.uid for d in ds), slowest="d7")  # fmt: skip
    h.report("c1", entry, now)
    h.offer(Capture(name="c1"))
    index = h.m.informer.store.indexes[CF]
    index.dispatchers = Unwalked(index.dispatchers)
    key = {"changefeed": CF, "mode": "default", "capture": "c1"}
    assert h.value("capture_report_covered", **key) == 1
    assert h.value("capture_reported_dispatchers", **key) == 40
    assert h.value("slowest_span_lag_seconds", span="s7", **key) is not None


def test_operators_in_flight_by_type_phase_and_stage() -> None:
    h = Harness()
    h.offer(operator("p1", OpPhase.PENDING))
    h.offer(operator("r1", OpPhase.RUNNING, Stage.REMOVE_ORIGIN))
    h.offer(operator("r2", OpPhase.RUNNING, Stage.REMOVE_ORIGIN))
    h.offer(operator("a1", OpPhase.RUNNING, Stage.ADD_DEST, type=OpType.ADD))
    h.offer(operator("done", OpPhase.SUCCEEDED, Stage.ADD_DEST))
    h.offer(operator("o1", OpPhase.RUNNING, Stage.ADD_DEST, cf=OTHER))
    assert h.value("operators_in_flight", changefeed=CF, type="Move", phase="Pending", stage="None") == 1
    assert h.value("operators_in_flight", changefeed=CF, type="Move", phase="Running", stage="RemoveOrigin") == 2
    assert h.value("operators_in_flight", changefeed=CF, type="Add", phase="Running", stage="AddDest") == 1
    assert h.value("operators_in_flight", changefeed=CF, type="Move", phase="Running", stage="AddDest") is None
    assert h.value("operators_in_flight", changefeed=OTHER, type="Move", phase="Running", stage="AddDest") is None


def test_oldest_operator_in_flight_by_type_and_stage() -> None:
    h = Harness()
    now = time.time()
    h.offer(operator("old", OpPhase.RUNNING, Stage.REMOVE_ORIGIN, created=now - 900, started_at=now - 600))
    h.offer(operator("new", OpPhase.RUNNING, Stage.REMOVE_ORIGIN, created=now - 30, started_at=now - 20))
    h.offer(operator("queued", OpPhase.PENDING, created=now - 120))  # not started: from its creation
    h.offer(operator("done", OpPhase.FAILED, Stage.ADD_DEST, created=now - 5000, started_at=now - 5000))
    h.offer(operator("theirs", OpPhase.RUNNING, Stage.ADD_DEST, cf=OTHER, started_at=now - 5000))
    age = h.value("operator_oldest_in_flight_seconds", changefeed=CF, type="Move", stage="RemoveOrigin")
    assert age is not None
    assert 600 <= age < 660
    pending = h.value("operator_oldest_in_flight_seconds", changefeed=CF, type="Move", stage="None")
    assert pending is not None
    assert 120 <= pending < 180
    assert h.value("operator_oldest_in_flight_seconds", changefeed=CF, type="Move", stage="AddDest") is None
    assert h.value("operator_oldest_in_flight_seconds", changefeed=OTHER, type="Move", stage="AddDest") is None


def test_changefeed_info_from_every_replica_leader_or_not() -> None:
    h = Harness(leading=())
    h.offer(Changefeed(name=CF))
    h.offer(Changefeed(name=OTHER, deleting=True))
    assert h.value("changefeed_info", changefeed=CF) == 1
    assert h.value("changefeed_info", changefeed=OTHER) is None  # being deleted: nobody needs to lead it
    assert h.value("leader", changefeed=CF) is None


def test_checkpoint_lag_from_the_tso_and_absent_while_unknown() -> None:
    assert checkpoint_lag(0, 100.0) is None
    assert checkpoint_lag(tso(90_000, 7), 100.0) == pytest.approx(10.0)

    h = Harness(leading=(CF, OTHER))
    h.offer(Changefeed(name=CF, checkpoint_ts=tso(int((time.time() - 5) * 1000))))
    h.offer(Changefeed(name=OTHER))
    lag = h.value("checkpoint_lag_seconds", changefeed=CF)
    assert lag is not None
    assert 4.5 < lag < 60
    stamp = h.value("checkpoint_timestamp_seconds", changefeed=CF)
    assert stamp is not None
    assert abs(stamp - (time.time() - 5)) < 60
    assert h.value("checkpoint_lag_seconds", changefeed=OTHER) is None


def test_capture_reports_lag_coverage_and_slowest_span() -> None:
    h = Harness()
    now = time.time()
    h.offer(Changefeed(name=CF))
    rng = KeyRange.of_table(1)
    ds = [
        h.offer(Dispatcher(name=f"d{i}", changefeed=CF, span=f"s{i}", table_id=1, key_range=rng, capture=c,
                           start_ts=1, epoch=1, state=DispatcherState.WORKING))
        for i, c in ((1, "c1"), (2, "c1"), (3, "c2"))
    ]  # fmt: skip

    def report(capture: str, lag: float, covered: list[Record], slowest: str) -> None:
        entry = ProgressEntry(
            changefeed=CF,
            mode=Mode.DEFAULT,
            checkpoint_ts=tso(int((now - lag) * 1000)),
            dispatchers=len(covered),
            digest=digest(d.uid for d in covered),
            slowest=slowest,
        )
        h.report(capture, entry, now)
        h.offer(Capture(name=capture))

    report("c1", 3.0, ds[:2], "d2")
    report("c2", 1.0, ds[:1], "d3")  # covers d1 (of c1), not d3: the maintainer cannot use it
    key = {"changefeed": CF, "mode": "default"}
    assert 2.5 < (h.value("capture_checkpoint_lag_seconds", capture="c1", **key) or 0) < 30
    assert h.value("capture_reported_dispatchers", capture="c1", **key) == 2
    assert h.value("capture_report_covered", capture="c1", **key) == 1
    assert h.value("capture_report_covered", capture="c2", **key) == 0
    assert h.value("slowest_span_lag_seconds", capture="c1", span="s2", **key) is not None


def test_a_changefeed_counted_in_source_revisions_lags_by_the_wall_time_its_reports_carry() -> None:
    """Its checkpointTs is an etcd revision (read as a TSO it would be 1970). Each report entry says "by t the
    source held everything up to c": the checkpoint's time is the earliest t over the pairs with c at or above
    it, from every report this process saw (the reports are replaced; what they told is kept)."""
    h = Harness()
    now = time.time()
    h.offer(Changefeed(name=CF, source_secret="src", sink_secret="dst", checkpoint_ts=1234))
    rng = KeyRange.of_table(1)
    ds = {
        c: h.offer(Dispatcher(name=f"d-{c}", changefeed=CF, span=f"s-{c}", table_id=1, key_range=rng, capture=c,
                              start_ts=1, epoch=1, state=DispatcherState.WORKING))
        for c in ("c1", "c2")
    }  # fmt: skip
    for c in ds:
        h.offer(Capture(name=c))

    def report(capture: str, revision: int, behind: float) -> None:
        entry = ProgressEntry(
            changefeed=CF, mode=Mode.DEFAULT, checkpoint_ts=revision, dispatchers=1,
            digest=digest([ds[capture].uid]), slowest=f"d-{capture}", checkpoint_time=now - behind,
        )  # fmt: skip
        h.report(capture, entry, now)

    def lag() -> float:
        value = h.value("checkpoint_lag_seconds", changefeed=CF)
        assert value is not None
        return value

    report("c1", 1240, 1.0)
    report("c2", 1236, 4.0)
    assert 3.9 < lag() < 30  # c2's pair: by now - 4 the source held 1236 >= 1234
    stamp = h.value("checkpoint_timestamp_seconds", changefeed=CF)
    assert stamp is not None
    assert abs(stamp - (now - 4.0)) < 0.01
    key = {"changefeed": CF, "mode": "default"}
    assert 0.9 < (h.value("capture_checkpoint_lag_seconds", capture="c1", **key) or 0) < 30

    # The checkpoint passes 1236: only c1's pair is at or above it. c1's next report (a later time for a later
    # revision) does not make the checkpoint younger: the earlier report said more about 1237.
    h.offer(Changefeed(name=CF, source_secret="src", sink_secret="dst", checkpoint_ts=1237))
    report("c1", 1245, 0.5)
    assert 0.9 < lag() < 3.9


def test_leader_epoch_bootstrap_and_runner_counters() -> None:
    h = Harness(leading=(CF, OTHER))
    h.m.stats.epochs.update({CF: 4, OTHER: 2})
    h.m.stats.bootstrap_seconds[CF] = 0.75
    h.m.stats.decisions, h.m.stats.writes, h.m.stats.failed_chains = 12, 40, 1
    h.m.memories[CF] = Memory(epoch=4, identity="m1", bootstrapped=True, restored=3, repaired=2)
    h.m.memories[OTHER] = Memory(epoch=2, identity="m1")  # this term has not bootstrapped yet
    assert h.value("leader", changefeed=CF) == 1
    assert h.value("epoch", changefeed=CF) == 4
    assert h.value("bootstrap_duration_seconds", changefeed=CF) == 0.75
    assert h.value("bootstrap_restored_operators", changefeed=CF) == 3
    assert h.value("bootstrap_repairs", changefeed=CF) == 2
    assert h.value("bootstrap_repairs", changefeed=OTHER) is None
    assert h.value("decisions_total") == 12
    assert h.value("writes_total") == 40
    assert h.value("failed_chains_total") == 1
    assert h.value("informer_synced") == 0


def test_informer_relists_and_apply_failures_by_kind_from_zero() -> None:
    h = Harness()
    for kind in ("Lease", *(k.value for k in Kind)):
        assert h.value("informer_relists_total", kind=kind) == 0
        assert h.value("informer_apply_failures_total", kind=kind) == 0
    h.m.informer.relists["Span"] += 2
    h.m.informer.apply_failures["Capture"] += 1
    assert h.value("informer_relists_total", kind="Span") == 2
    assert h.value("informer_apply_failures_total", kind="Capture") == 1
    assert h.value("informer_apply_failures_total", kind="Span") == 0


def test_captures_by_liveness() -> None:
    h = Harness(leading=())
    now = time.time()
    for name, draining in (("c1", False), ("c2", False), ("c3", True), ("c4", False)):
        h.lease(name, now)
        h.offer(Capture(name=name, draining=draining))
    # Liveness is judged on our clock: c4's renewTime last changed, as we saw it, ten minutes ago.
    store = h.m.informer.store
    renew, _ = store.leases.silence.seen[conv.lease_name("c4")]
    store.leases.silence.seen[conv.lease_name("c4")] = (renew, store.leases.view.reading(time.monotonic()) - 600)
    h.offer(Capture(name="c5"))  # never took its Lease
    assert h.value("captures", state="alive") == 2
    assert h.value("captures", state="draining") == 1
    assert h.value("captures", state="lost") == 2


# ------------------------------------------------------------------------------------------------------
# Operator durations: once per operator, on the transition this process saw, while leading


def test_operator_duration_observed_once_when_seen_finishing() -> None:
    h = Harness()
    running = h.offer(operator("mv", OpPhase.RUNNING, Stage.REMOVE_ORIGIN, started_at=1000.0))
    done = h.offer(running.evolve(phase=OpPhase.SUCCEEDED, stage=Stage.ADD_DEST, finished_at=1002.5))
    assert histogram(h, "count", "Move", "Succeeded") == 1
    assert histogram(h, "sum", "Move", "Succeeded") == pytest.approx(2.5)
    # A later event of the same finished operator, and a relist, change nothing.
    h.offer(done.evolve(message="kept for retention"))
    h.relist(Kind.OPERATOR)
    h.relist(Kind.OPERATOR)
    assert histogram(h, "count", "Move", "Succeeded") == 1


def test_operator_duration_outcomes_and_start_fallback() -> None:
    h = Harness()
    add = h.offer(operator("add", OpPhase.PENDING, type=OpType.ADD, created=2000.0))
    h.offer(add.evolve(phase=OpPhase.FAILED, finished_at=2003.0))  # never started: from creation
    split = h.offer(operator("split", OpPhase.RUNNING, Stage.CREATE_SPANS, type=OpType.SPLIT, started_at=3000.0))
    h.offer(split.evolve(phase=OpPhase.CANCELED, finished_at=3010.0))
    assert histogram(h, "count", "Add", "Failed") == 1
    assert histogram(h, "sum", "Add", "Failed") == pytest.approx(3.0)
    assert histogram(h, "count", "Split", "Canceled") == 1
    assert histogram(h, "sum", "Split", "Canceled") == pytest.approx(10.0)
    assert (
        h.registry.get_sample_value(
            PREFIX + "operator_duration_seconds_bucket", {"type": "Split", "outcome": "Canceled", "le": "10.0"}
        )
        == 1
    )


def test_operator_duration_not_observed_without_a_transition_or_leadership() -> None:
    h = Harness()
    # Finished before this process saw it (a predecessor's operator, listed at start): not ours to count.
    h.offer(operator("old", OpPhase.SUCCEEDED, started_at=1.0, finished_at=2.0))
    # Finishing in a changefeed another replica leads.
    other = h.offer(operator("elsewhere", OpPhase.RUNNING, Stage.ADD_DEST, cf=OTHER, started_at=1.0))
    h.offer(other.evolve(phase=OpPhase.SUCCEEDED, finished_at=2.0))
    assert histogram(h, "count", "Move", "Succeeded") is None


def test_failed_operators_counted_once_per_led_changefeed_and_type_from_zero() -> None:
    h = Harness(leading=(CF,))
    for op_type in OpType:  # every type of a led changefeed is exported from 0
        assert h.value("operators_failed_total", changefeed=CF, type=op_type.value) == 0
    assert h.value("operators_failed_total", changefeed=OTHER, type="Move") is None
    mv = h.offer(operator("mv", OpPhase.RUNNING, Stage.ADD_DEST, started_at=10.0))
    failed = h.offer(mv.evolve(phase=OpPhase.FAILED, status_reason="CaptureLost", finished_at=12.0))
    h.offer(failed.evolve(message="again"))
    h.relist(Kind.OPERATOR)
    # Failed before this process saw it, or in a changefeed led elsewhere: not counted.
    h.offer(operator("old", OpPhase.FAILED, type=OpType.ADD))
    theirs = h.offer(operator("theirs", OpPhase.RUNNING, Stage.ADD_DEST, cf=OTHER))
    h.offer(theirs.evolve(phase=OpPhase.FAILED))
    # Pending operators that fail never started: counted too (no duration needed).
    sp = h.offer(operator("sp", OpPhase.PENDING, type=OpType.SPLIT, created=0.0))
    h.offer(sp.evolve(phase=OpPhase.FAILED))
    assert h.value("operators_failed_total", changefeed=CF, type="Move") == 1
    assert h.value("operators_failed_total", changefeed=CF, type="Split") == 1
    assert h.value("operators_failed_total", changefeed=CF, type="Add") == 0
    h.m.leading.add(OTHER)
    assert h.value("operators_failed_total", changefeed=OTHER, type="Move") == 0


def test_operator_duration_per_uid_and_after_a_relist() -> None:
    h = Harness()
    first = h.offer(operator("mv", OpPhase.RUNNING, Stage.ADD_DEST, started_at=10.0))
    # The watch missed the end; a relist (410 Gone) shows it finished: observed once, from the relist.
    store = h.m.informer.store
    h.rv += 1
    finished = first.evolve(phase=OpPhase.SUCCEEDED, finished_at=11.0, resource_version=str(h.rv))
    store.replace_all(Kind.OPERATOR.value, [conv.to_resource(finished)])
    h.m.informer._notify(Kind.OPERATOR.value, "")
    assert histogram(h, "count", "Move", "Succeeded") == 1
    # Deleted (retention), then a new operator of the same name: a new uid, counted on its own.
    h.delete(finished)
    again = h.offer(operator("mv", OpPhase.RUNNING, Stage.ADD_DEST, started_at=20.0))
    h.offer(again.evolve(phase=OpPhase.SUCCEEDED, finished_at=24.0))
    assert histogram(h, "count", "Move", "Succeeded") == 2
    assert histogram(h, "sum", "Move", "Succeeded") == pytest.approx(5.0)
    assert h.m.metrics._seen == {"mv": (again.uid, True)}
    h.delete(again)
    assert h.m.metrics._seen == {}  # nothing kept for deleted operators


# ------------------------------------------------------------------------------------------------------
# API write errors: each executor counts its failures by reason (Executor.errors), which a scrape reads


class FailingClient:
    """Every status write of span ``name`` fails with ``errors[name]``; every Event post with ``errors["event"]``."""

    def __init__(self, errors: dict[str, BaseException]) -> None:
        self.errors = errors

    async def patch(self, res: Any, namespace: str, name: str, *args: Any, **kw: Any) -> Any:
        raise self.errors[name]

    async def create(self, res: Any, namespace: str, body: Any) -> Any:
        raise self.errors["event"]


def test_failure_reasons() -> None:
    assert failure_reason(ApiError(409, "Conflict", "")) == "Conflict"
    assert failure_reason(ApiError(503, "", "")) == "503"
    assert failure_reason(ApiError(504, "Timeout", "")) == "Timeout"  # the API's own reason
    assert failure_reason(TimeoutError()) == "ClientTimeout"  # no answer at all
    assert failure_reason(aiohttp.ServerTimeoutError()) == "ClientTimeout"
    assert failure_reason(aiohttp.ClientConnectionError()) == "ConnectionError"
    assert failure_reason(BadResponse("<html>")) == "BadResponse"
    assert failure_reason(ValueError()) is None


def test_executor_reports_write_errors_by_reason() -> None:
    h = Harness()
    errors: dict[str, BaseException] = {
        "conflict": ApiError(409, "Conflict", "stale resourceVersion"),
        "notfound": ApiError(404, "NotFound", "gone"),
        "internal": ApiError(500, "InternalError", "boom"),
        "timeout": TimeoutError(),
        "reset": aiohttp.ClientConnectionError("connection reset"),
        "proxy": BadResponse("a proxy's HTML page"),
        "event": ApiError(403, "Forbidden", "no events for you"),
    }
    executor = h.m.executor
    executor.client = cast(Client, FailingClient(errors))

    def write(name: str) -> I.WriteStatus:
        return I.WriteStatus(span(name, SpanState.ABSENT).evolve(resource_version="1"))

    # Each chain stops at its first failed write (the second write of each is never tried).
    chains = [I.Chain((write(name), write(name))) for name in errors if name != "event"]
    # An Event is best effort: its failure is counted, and its chain goes on (to a conflict).
    chains.append(I.Chain((I.Event(Kind.SPAN, "x", "Test", "message"), write("conflict"))))
    out = asyncio.run(executor.apply(Decision(tuple(chains), Memory(epoch=1, identity="m1"))))
    assert (out.chains, out.failed, out.writes) == (7, 7, 1)  # the Event counts as written (best effort)
    assert h.value("api_write_errors_total", reason="Conflict") == 2
    for reason in ("NotFound", "InternalError", "ClientTimeout", "ConnectionError", "BadResponse", "Forbidden"):
        assert h.value("api_write_errors_total", reason=reason) == 1, reason
    assert sum(executor.errors.values()) == 8


# ------------------------------------------------------------------------------------------------------
# Exposition, registries, the endpoint and the command line


def test_scheduler_state_is_one_hot_per_led_changefeed() -> None:
    h = Harness(leading=(CF,))
    draining = SchedulerStatus(state=SchedulerState.DRAINING, message="moving spans off c1")
    h.offer(Changefeed(name=CF, scheduler_status=draining))
    values = {s.value: h.value("scheduler_state", changefeed=CF, state=s.value) for s in SchedulerState if s.value}
    assert values == {"Active": 0.0, "Paused": 0.0, "Draining": 1.0, "CoolingDown": 0.0}
    h.offer(Changefeed(name=OTHER, scheduler_status=draining))
    assert h.value("scheduler_state", changefeed=OTHER, state="Draining") is None  # not led here


def test_text_exposition_parses_and_registries_are_per_maintainer() -> None:
    a, b = Harness(), Harness()
    a.offer(span("a", SpanState.REPLICATING, "c1"))
    b.m.executor.errors.update(["Conflict", "Forbidden"])
    assert a.value("api_write_errors_total", reason="Forbidden") is None  # nothing shared
    assert a.value("api_write_errors_total", reason="Conflict") == 0  # exported from 0
    assert b.value("api_write_errors_total", reason="Conflict") == 1
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(a.registry).decode())}
    ours = {n for n in families if n.startswith(PREFIX)}
    for name in (
        "spans",
        "operators_in_flight",
        "operator_duration_seconds",
        "checkpoint_lag_seconds",
        "bootstrap_duration_seconds",
        "captures",
        "leader",
        "decisions",
        "writes",
        "api_write_errors",
        "changefeed_info",
        "operator_oldest_in_flight_seconds",
        "operators_failed",
    ):
        assert PREFIX + name in ours, name
    assert families[PREFIX + "decisions"].type == "counter"
    assert families[PREFIX + "operator_duration_seconds"].type == "histogram"
    assert families[PREFIX + "spans"].type == "gauge"
    assert any(n.startswith("process_") for n in families)


def _get(port: int, path: str = "/metrics", host: str = "127.0.0.1", **headers: str) -> tuple[int, str]:
    """A GET from this (non-loop) thread, as Prometheus would make it."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
    r = urllib3.request("GET", url, headers=headers, timeout=urllib3.Timeout(5, 10), retries=False)
    return r.status, r.data.decode()


def serve(registry: CollectorRegistry, *paths: str, host: str = "127.0.0.1", **headers: str) -> list[tuple[int, str]]:
    """Start a MetricsServer on an ephemeral port, GET each path (from a thread, the loop serving), and stop it."""

    async def scrape() -> list[tuple[int, str]]:
        server = MetricsServer(registry, host, 0)
        await server.start()
        try:
            return [await asyncio.to_thread(_get, server.port, p, host, **headers) for p in paths]
        finally:
            await server.stop()
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:  # stopped: the port is closed
                assert s.connect_ex((host, server.port)) != 0

    return asyncio.run(scrape())


def test_endpoint_serves_the_registry() -> None:
    h = Harness()
    h.offer(span("a", SpanState.REPLICATING, "c1"))

    async def scrape() -> tuple[int, str, str]:
        server = MetricsServer(h.registry, "127.0.0.1", 0)
        await server.start()
        url = f"http://127.0.0.1:{server.port}/metrics"
        try:
            async with aiohttp.ClientSession() as session, session.get(url) as resp:
                return resp.status, resp.headers["Content-Type"], await resp.text()
        finally:
            await server.stop()

    status, content_type, text = asyncio.run(scrape())
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    assert 'changefeed_maintainer_spans{capture="c1",changefeed="cf",mode="default",state="Replicating"} 1.0' in text
    assert "process_cpu_seconds_total" in text


def test_the_endpoint_serves_metrics_only_at_its_path_by_name_and_in_openmetrics_if_asked() -> None:
    h = Harness()
    h.offer(span("a", SpanState.REPLICATING, "c1"))
    by_name = f"/metrics?name[]={PREFIX}spans&name[]={PREFIX}writes_total"
    root, below, named = serve(h.registry, "/", "/metrics/x", by_name)
    assert root[0] == 404
    assert below[0] == 404
    assert named[0] == 200
    assert {f.name for f in text_string_to_metric_families(named[1])} == {PREFIX + "spans", PREFIX + "writes"}
    [(status, text)] = serve(h.registry, "/metrics", Accept="application/openmetrics-text; version=1.0.0")
    assert status == 200
    assert text.endswith("# EOF\n")


class Flaky(Collector):
    """A collector that raises while ``broken``."""

    def __init__(self) -> None:
        self.broken = True

    def collect(self) -> Iterable[Metric]:
        if self.broken:
            raise ValueError("the cache is not readable")
        return []


def test_a_failed_collection_is_a_500_with_its_reason_and_the_next_scrape_is_served() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc()
    flaky = Flaky()
    registry.register(flaky)

    async def scrape() -> tuple[tuple[int, str], tuple[int, str]]:
        server = MetricsServer(registry, "127.0.0.1", 0)
        await server.start()
        try:
            failed = await asyncio.to_thread(_get, server.port)
            flaky.broken = False
            return failed, await asyncio.to_thread(_get, server.port)
        finally:
            await server.stop()

    (status, text), (status2, text2) = asyncio.run(scrape())
    assert status == 500
    assert "the cache is not readable" in text
    assert status2 == 200
    assert "things_total 1.0" in text2


def test_a_port_already_taken_fails_the_start() -> None:
    """operator.startup turns this OSError into ``cannot serve metrics on ADDRESS:PORT: ...`` and exit status 1
    (tests/integration/test_metrics.py, test_a_busy_metrics_port_stops_the_maintainer)."""

    async def start(port: int) -> None:
        server = MetricsServer(CollectorRegistry(), "127.0.0.1", port)
        try:
            await server.start()
        finally:
            await server.stop()

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError, match="address already in use"):
            asyncio.run(start(busy.getsockname()[1]))


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_the_endpoint_listens_on_an_ipv6_address() -> None:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError:
        pytest.skip("no IPv6 loopback here")
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc()
    [(status, text)] = serve(registry, "/metrics", host="::1")
    assert status == 200
    assert "things_total 1.0" in text


def test_command_line() -> None:
    a = cli.parse(["--namespace", "x"])
    assert (a.metrics_port, a.metrics_address) == (9090, "0.0.0.0")
    assert cli.parse(["--metrics-port", "0", "--liveness", "http://0.0.0.0:9090/healthz"]).metrics_port == 0
    with pytest.raises(SystemExit):
        cli.parse(["--metrics-port", "8080", "--liveness", "http://0.0.0.0:8080/healthz"])
    with pytest.raises(SystemExit):
        cli.parse(["--metrics-port", "70000"])
    assert cli.liveness_port("http://0.0.0.0/healthz") == 80
    assert a.gc_tenure == 0.5
    assert cli.parse(["--gc-tenure", "0"]).gc_tenure == 0
    with pytest.raises(SystemExit):
        cli.parse(["--gc-tenure", "-1"])


def test_last_verification_from_the_changefeeds_annotation() -> None:
    h = Harness(leading=(CF, OTHER))
    h.offer(Changefeed(name=CF))
    assert h.value("verify_differences", changefeed=CF) is None  # never verified
    done = Verification(revision=1234, differences=3, keys=1000, at=1_700_000_000.5)
    h.offer(Changefeed(name=CF, last_verify=done))
    assert h.value("verify_differences", changefeed=CF) == 3.0
    assert h.value("verify_revision", changefeed=CF) == 1234.0
    assert h.value("verify_timestamp_seconds", changefeed=CF) == pytest.approx(1_700_000_000.5)
    # As the command writes it, and leniently read: an annotation that does not parse is no verification.
    obj = conv.to_resource(Changefeed(name=OTHER, namespace=NS, uid="u-other", resource_version="99"))
    obj["metadata"]["annotations"] = {LAST_VERIFY_ANNOTATION: "{not json"}
    h.m.informer.offer("Changefeed", obj)
    assert h.value("verify_differences", changefeed=OTHER) is None
    obj["metadata"]["annotations"] = {LAST_VERIFY_ANNOTATION: done.to_json()}
    obj["metadata"]["resourceVersion"] = "100"
    h.m.informer.offer("Changefeed", obj)
    assert h.value("verify_differences", changefeed=OTHER) == 3.0


def test_the_sinks_figures_and_troubles_from_the_live_captures_reports() -> None:
    """Each live capture's report names its sink's figures (tombstones collected and held, live rows) and its
    troubles: per capture for the figures, counted per side for the troubles (a lost capture's say nothing about
    now: the engine's rule, tests/engine/test_data_path_conditions.py)."""
    h = Harness()
    now = time.time()
    h.offer(Changefeed(name=CF, source_secret="src", sink_secret="dst", checkpoint_ts=1234))
    entry = ProgressEntry(changefeed=CF, mode=Mode.DEFAULT, checkpoint_ts=1234, dispatchers=0, digest=digest([]))
    for c in ("c1", "c2", "c3"):
        h.offer(Capture(name=c))
    h.report("c1", entry, now, sinks=(SinkFigures(changefeed=CF, collected=70, tombstones=5, live_rows=900),),
             troubles=(Trouble(changefeed=CF, side=SINK, transient=True, message="refused"),))  # fmt: skip
    h.report("c2", entry, now, sinks=(SinkFigures(changefeed=CF, collected=3, tombstones=1, live_rows=100),),
             troubles=(Trouble(changefeed=CF, side=SOURCE, transient=False, message="no Secret"),
                       Trouble(changefeed="other", side=SINK, transient=True, message="not this one's")))  # fmt: skip
    h.report("c3", entry, now, sinks=(SinkFigures(changefeed="other", collected=9, tombstones=9, live_rows=9),))
    assert h.value("sink_tombstones_collected_total", changefeed=CF, capture="c1") == 70
    assert h.value("sink_tombstones", changefeed=CF, capture="c2") == 1
    assert h.value("sink_live_rows", changefeed=CF, capture="c1") == 900
    assert h.value("sink_tombstones", changefeed=CF, capture="c3") is None  # another changefeed's figures
    assert h.value("sink_unavailable_captures", changefeed=CF) == 1
    assert h.value("source_unavailable_captures", changefeed=CF) == 1
