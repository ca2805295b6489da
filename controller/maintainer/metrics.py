"""Prometheus metrics of the maintainer process (``--metrics-port``, ``/metrics``); see docs/metrics.md.

Two sorts of metric live in one :class:`~prometheus_client.CollectorRegistry` per :class:`Maintainer`
(never the global registry: a test may build many maintainers in one process):

- **State at scrape time** (:class:`StateCollector`): spans, operators in flight, checkpoint lag,
  leadership, captures, the last bootstrap... are computed from the informer's cache when Prometheus
  scrapes, for the changefeeds this process leads *now*. Nothing is set and forgotten, so no series
  outlives what it describes (a changefeed led by another replica, a capture gone, a state no span is
  in any more simply stops being reported), in the style of crate-operator's ``prometheus.py``.
- **Process-lifetime counters and histograms**: decisions, writes, API write errors by reason, and the
  duration (and, for failures, the count by changefeed and type) of each operator this process saw finish
  (observed once per operator: see :meth:`MaintainerMetrics.on_change`). Counters whose label values are
  known in advance are exported from 0, so that ``increase()`` in an alert rule sees their first increment.

The chart's alert rules and dashboard (charts/changefeed-maintainer/monitoring/) use these names only;
tests/monitoring derives the names from this registry and fails on a query that names anything else.

The scrape runs in the event loop that mutates the cache (:class:`MetricsServer` is an aiohttp server
in the running loop, not prometheus_client's thread), so the collector reads a consistent cache
without locks.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Iterable
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.engine import progress
from controller.engine.maintainer import Memory, sink_errors
from controller.engine.world import World
from controller.kube.heap import HeapReserve
from controller.kube.informer import CAPTURE_LEASE_PREFIX, LEASE, Informer
from controller.kube.tenure import Tenure
from controller.maintainer.stats import Stats
from controller.model.progress import HeadCurve, entry_lag
from controller.model.records import Capture, Changefeed, SpanOperator
from controller.model.states import Kind, OpPhase, OpType, SchedulerState
from controller.model.tso import physical_ms

log = logging.getLogger(__name__)

PREFIX = "changefeed_maintainer_"
#: Operator durations: a Move of an idle span takes about a second, a held one or a large split minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
UNKNOWN_STATE = "Unknown"  # a Span whose status was never written
NO_CAPTURE = "none"  # a Span bound to no capture
NO_STAGE = "None"  # an operator not started yet (Pending) has no stage
NO_SPAN = "unknown"  # a reported slowest dispatcher the maintainer does not know (yet)
CAPTURE_STATES = ("alive", "draining", "lost")
#: Write-error reasons exported at 0 from the start, so that ``rate()`` and ``increase()`` see their first
#: occurrence (a series that appears at 1 has no earlier sample to increase from): the normal one (a stale
#: resourceVersion) and those the client itself reports when the API gave no usable answer.
INITIAL_WRITE_ERROR_REASONS = ("Conflict", "ClientTimeout", "ConnectionError")
#: The ``kind`` label values of the informer's counters: every kind it lists and watches.
INFORMER_KINDS = (LEASE, *(k.value for k in Kind))

__all__ = [
    "CAPTURE_STATES",
    "PREFIX",
    "MaintainerMetrics",
    "MetricsServer",
    "StateCollector",
    "operator_age",
]


class Maintainer(Protocol):
    """What the metrics read of a maintainer process (``controller.maintainer.runner.Maintainer``, which builds them):
    a Protocol, so that this module does not import the runner (no import cycle)."""

    @property
    def informer(self) -> Informer: ...
    @property
    def leading(self) -> set[str]: ...
    @property
    def stats(self) -> Stats: ...
    @property
    def memories(self) -> dict[str, Memory]: ...
    @property
    def metrics(self) -> MaintainerMetrics: ...
    @property
    def tenure(self) -> Tenure | None: ...
    @property
    def heap(self) -> HeapReserve | None: ...

    def counts(self) -> dict[str, int]: ...

    def snapshot(self, name: str) -> World | None: ...


def operator_age(op: SpanOperator, now: float) -> float:
    """Seconds an in-flight operator has been at work: since ``status.startedAt``, else since its creation."""
    return max(0.0, now - (op.started_at or op.created))


def capture_state(capture: Capture, now: float) -> str:
    """One of :data:`CAPTURE_STATES`: lost (Lease lapsed or missing, or being deleted), draining, alive."""
    if not capture.alive(now):
        return "lost"
    return "draining" if capture.draining else "alive"


class StateCollector(Collector):
    """Every gauge computed from the informer's cache at scrape time, plus the runner's counters."""

    def __init__(self, maintainer: Maintainer) -> None:
        self.maintainer = maintainer

    def describe(self) -> Iterable[Metric]:
        return []  # the series are dynamic: nothing to check for duplicates at registration

    def _verifications(self, leading: list[str]) -> Iterable[Metric]:
        """The last ``kubectl changefeed verify`` of each led changefeed, from its annotation
        ``cdc.maintainer.dev/last-verify`` (``Changefeed.last_verify``); absent until one ran."""
        store = self.maintainer.informer.store
        differences = GaugeMetricFamily(
            PREFIX + "verify_differences",
            "Differences (missing, extra, mismatched keys) the last kubectl changefeed verify found between the sink "
            "and etcd at its revision (absent until one ran).",
            labels=["changefeed"],
        )
        revision = GaugeMetricFamily(
            PREFIX + "verify_revision",
            "The etcd revision the last kubectl changefeed verify compared the sink at.",
            labels=["changefeed"],
        )
        stamp = GaugeMetricFamily(
            PREFIX + "verify_timestamp_seconds",
            "When the last kubectl changefeed verify ran (Unix seconds).",
            labels=["changefeed"],
        )
        for name in leading:
            cf = store.record(Kind.CHANGEFEED, name)
            if isinstance(cf, Changefeed) and cf.last_verify is not None:
                differences.add_metric([name], float(cf.last_verify.differences))
                revision.add_metric([name], float(cf.last_verify.revision))
                stamp.add_metric([name], cf.last_verify.at)
        yield differences
        yield revision
        yield stamp

    def collect(self) -> Iterable[Metric]:
        m = self.maintainer
        store = m.informer.store
        now = time.time()
        leading = sorted(m.leading)

        synced = GaugeMetricFamily(
            PREFIX + "informer_synced", "1 once every watched kind has been listed (decisions wait for it)."
        )
        synced.add_metric([], 1.0 if m.informer.synced.is_set() else 0.0)
        yield synced
        yield from self._informer()

        info = GaugeMetricFamily(
            PREFIX + "changefeed_info",
            "1 for each Changefeed in this process's cache (not being deleted), reported by every replica: "
            "the changefeeds some replica should lead.",
            labels=["changefeed"],
        )
        for name, rec in sorted(store.all(Kind.CHANGEFEED).items()):
            if isinstance(rec, Changefeed) and not rec.deleting:
                info.add_metric([name], 1.0)
        yield info

        members = GaugeMetricFamily(
            PREFIX + "members",
            "Maintainer replicas this process sees alive (member Leases cfmm-<identity>), itself included; the "
            "changefeeds are spread over them (each leads floor or ceil of changefeeds/members).",
        )
        members.add_metric([], float(len(m.counts())))
        yield members
        handoffs = CounterMetricFamily(
            PREFIX + "handoffs",
            "Changefeeds this process handed over to another replica to balance the replicas (a graceful end of "
            "its term: the taker bootstraps at a new epoch).",
        )
        handoffs.add_metric([], float(m.stats.handoffs))
        yield handoffs
        if m.tenure is not None:
            # Not the frozen objects' count: gc.get_freeze_count() walks them all (100 ms at a million).
            steps = CounterMetricFamily(PREFIX + "gc_tenure_steps", "Tenure steps made (--gc-tenure).")
            steps.add_metric([], float(m.tenure.steps))
            yield steps
            spent = CounterMetricFamily(
                PREFIX + "gc_tenure_seconds",
                "Seconds spent in tenure steps (a full pass over what is not frozen yet, then a freeze).",
            )
            spent.add_metric([], m.tenure.total_s)
            yield spent
            longest = GaugeMetricFamily(
                PREFIX + "gc_tenure_longest_seconds", "The longest tenure step so far (it holds the event loop)."
            )
            longest.add_metric([], m.tenure.longest_s)
            yield longest
        if m.heap is not None:
            refills = CounterMetricFamily(
                PREFIX + "heap_reserve_refills",
                "Refills of the heap reserve (--heap-reserve): free memory paged in by a thread of its own.",
            )
            refills.add_metric([], float(m.heap.refills))
            yield refills
            top = GaugeMetricFamily(
                PREFIX + "heap_reserve_bytes",
                "Free memory at the top of the heap at the reserve's last check (what a growing table is carved from).",
            )
            top.add_metric([], float(m.heap.top))
            yield top

        leader = GaugeMetricFamily(
            PREFIX + "leader",
            "1 for each changefeed this process leads (holds its Lease cfm-<changefeed>).",
            labels=["changefeed"],
        )
        epoch = GaugeMetricFamily(
            PREFIX + "epoch", "Epoch (leadership term) of each changefeed this process leads.", labels=["changefeed"]
        )
        for name in leading:
            leader.add_metric([name], 1.0)
            if name in m.stats.epochs:
                epoch.add_metric([name], float(m.stats.epochs[name]))
        yield leader
        yield epoch

        spans = GaugeMetricFamily(
            PREFIX + "spans",
            "Spans of each led changefeed by status state (Unknown: never validated), capture (none: unbound) "
            "and mode.",
            labels=["changefeed", "state", "capture", "mode"],
        )
        # From each led changefeed's index (kept per event): a scrape costs the distinct (state, capture, mode),
        # not a pass over every span (100,000 of them held the event loop for tens of milliseconds).
        span_counts: Tally[tuple[str, str, str, str]] = Tally()
        for name in leading:
            idx = store.indexes.get(name)
            for (span_state, capture, mode), n in idx.span_tally.items() if idx is not None else ():
                label = span_state.value if span_state is not None else UNKNOWN_STATE
                span_counts[(name, label, capture or NO_CAPTURE, mode.value)] += n
        for labels, n in sorted(span_counts.items()):
            spans.add_metric(list(labels), float(n))
        yield spans

        in_flight = GaugeMetricFamily(
            PREFIX + "operators_in_flight",
            "SpanOperators not finished (Pending or Running) of each led changefeed, by type, phase and stage "
            "(None: not started).",
            labels=["changefeed", "type", "phase", "stage"],
        )
        oldest = GaugeMetricFamily(
            PREFIX + "operator_oldest_in_flight_seconds",
            "Age of the oldest SpanOperator in flight of each led changefeed, by type and stage (None: not "
            "started): seconds since its status startedAt, else since its creation.",
            labels=["changefeed", "type", "stage"],
        )
        op_counts: Tally[tuple[str, str, str, str]] = Tally()
        op_ages: dict[tuple[str, str, str], float] = {}
        for name in leading:  # only the operators in flight (the index's set), not every retained one
            idx = store.indexes.get(name)
            for o in [idx.operators[n] for n in sorted(idx.in_flight)] if idx is not None else []:
                if o.in_flight:
                    stage = o.stage.value or NO_STAGE
                    op_counts[(o.changefeed, o.type.value, o.phase.value, stage)] += 1
                    key = (o.changefeed, o.type.value, stage)
                    op_ages[key] = max(op_ages.get(key, 0.0), operator_age(o, now))
        for labels, n in sorted(op_counts.items()):
            in_flight.add_metric(list(labels), float(n))
        for age_labels, age in sorted(op_ages.items()):
            oldest.add_metric(list(age_labels), age)
        yield in_flight
        yield oldest

        failed = CounterMetricFamily(
            PREFIX + "operators_failed",
            "SpanOperators this process saw fail while leading their changefeed, by changefeed and type (every "
            "led changefeed has all five types, from 0).",
            labels=["changefeed", "type"],
        )
        for name in leading:
            for op_type in OpType:
                failed.add_metric([name, op_type.value], float(m.metrics.failures[(name, op_type.value)]))
        yield failed

        lag = GaugeMetricFamily(
            PREFIX + "checkpoint_lag_seconds",
            "Now minus the wall time the changefeed's status.checkpointTs stands for (a TSO's physical time; for a "
            "changefeed with a source, when its captures saw the source's head pass it), absent while unknown.",
            labels=["changefeed"],
        )
        checkpoint = GaugeMetricFamily(
            PREFIX + "checkpoint_timestamp_seconds",
            "Wall time (Unix seconds) the changefeed's status.checkpointTs stands for (see checkpoint_lag_seconds).",
            labels=["changefeed"],
        )
        scheduler = GaugeMetricFamily(
            PREFIX + "scheduler_state",
            "1 for the state of the automatic schedulers in the changefeed's status.scheduler.state "
            "(Active, Paused, Draining, CoolingDown), 0 for the others.",
            labels=["changefeed", "state"],
        )
        stopped = GaugeMetricFamily(
            PREFIX + "dispatchers_failed",
            "Dispatchers of the changefeed that their runtime stopped for good (e.g. the source compacted past "
            "their position), not being deleted: the checkpoint is held at theirs (condition ReplicationFailed).",
            labels=["changefeed"],
        )
        sink = GaugeMetricFamily(
            PREFIX + "sink_unavailable_captures",
            "Live captures whose progress report says their sink transactions for the changefeed fail and are "
            "retried (the sink down or refusing writes): their checkpoints hold (condition SinkUnavailable).",
            labels=["changefeed"],
        )
        for name in leading:
            idx = store.indexes.get(name)
            if idx is not None:
                stopped.add_metric([name], float(len(idx.failed_dispatchers)))
            world = self.maintainer.snapshot(name)
            if world is not None:
                sink.add_metric([name], float(len(sink_errors(world, now))))
            cf = store.record(Kind.CHANGEFEED, name)
            if isinstance(cf, Changefeed):
                wall = self._checkpoint_time(cf)
                if wall is not None:
                    lag.add_metric([name], max(0.0, now - wall))
                    checkpoint.add_metric([name], wall)
                for sched in SchedulerState:
                    if sched.value:
                        scheduler.add_metric([name, sched.value], float(cf.scheduler_status.state is sched))
        yield lag
        yield checkpoint
        yield scheduler
        yield stopped
        yield sink
        yield from self._verifications(leading)
        yield from self._reports(leading, now)

        bootstrap = GaugeMetricFamily(
            PREFIX + "bootstrap_duration_seconds",
            "Seconds from taking the Lease to the first decision (the bootstrap) of the current term.",
            labels=["changefeed"],
        )
        restored = GaugeMetricFamily(
            PREFIX + "bootstrap_restored_operators",
            "In-flight operators the current term's bootstrap found and resumed.",
            labels=["changefeed"],
        )
        repairs = GaugeMetricFamily(
            PREFIX + "bootstrap_repairs", "Repairs made by the current term's bootstrap.", labels=["changefeed"]
        )
        for name in leading:
            memory = m.memories.get(name)
            if memory is None or not memory.bootstrapped:
                continue
            if name in m.stats.bootstrap_seconds:
                bootstrap.add_metric([name], m.stats.bootstrap_seconds[name])
            restored.add_metric([name], float(memory.restored))
            repairs.add_metric([name], float(memory.repaired))
        yield bootstrap
        yield restored
        yield repairs

        captures = GaugeMetricFamily(
            PREFIX + "captures",
            "Captures by liveness: alive (Lease current), draining (alive, spec.draining), lost (Lease lapsed).",
            labels=["state"],
        )
        cap_counts: Tally[str] = Tally({state: 0 for state in CAPTURE_STATES})
        for c in store.all(Kind.CAPTURE).values():
            if isinstance(c, Capture):
                cap_counts[capture_state(c, now)] += 1
        for state in CAPTURE_STATES:
            captures.add_metric([state], float(cap_counts[state]))
        yield captures

        yield CounterMetricFamily(
            PREFIX + "decisions", "Decisions (engine.decide calls) made by this process.", value=m.stats.decisions
        )
        yield CounterMetricFamily(PREFIX + "writes", "API writes applied by this process.", value=m.stats.writes)
        yield CounterMetricFamily(
            PREFIX + "loop_crashes",
            "Unexpected errors in a changefeed's maintainer loop (it gave up its Lease, backed off, competed again).",
            value=m.stats.loop_crashes,
        )
        yield CounterMetricFamily(
            PREFIX + "audits",
            "Full audits made (decisions over every record instead of the index's candidates).",
            value=m.stats.audits,
        )
        yield CounterMetricFamily(
            PREFIX + "audit_disagreements",
            "Full audits that decided otherwise than the incremental decision would have (an index bug).",
            value=m.stats.audit_disagreements,
        )
        yield CounterMetricFamily(
            PREFIX + "failed_chains",
            "Write chains abandoned at a failed write (retried from a fresh snapshot).",
            value=m.stats.failed_chains,
        )

    def _checkpoint_time(self, cf: Changefeed) -> float | None:
        """The wall time the changefeed's checkpoint stands for: a TSO's physical part, or for a changefeed
        counted in source revisions what the captures' reports said of it (``MaintainerMetrics.head_time``)."""
        if cf.checkpoint_ts <= 0:
            return None
        if not cf.source_secret:
            return physical_ms(cf.checkpoint_ts) / 1000.0
        return self.maintainer.metrics.head_time(cf.name, cf.checkpoint_ts)

    def _informer(self) -> Iterable[Metric]:
        """The informer's relists and failures to apply, per kind (every kind from 0: ``increase()`` sees the first)."""
        informer = self.maintainer.informer
        relists = CounterMetricFamily(
            PREFIX + "informer_relists",
            "LISTs the informer made again, by kind: a broken watch of records, 410 Gone, a failure to apply.",
            labels=["kind"],
        )
        failures = CounterMetricFamily(
            PREFIX + "informer_apply_failures",
            "LIST pages and watch events the informer failed to apply to its cache, by kind (a bug: logged with its "
            "traceback; the stream relisted). Never more than 0 in a healthy process.",
            labels=["kind"],
        )
        for kind in INFORMER_KINDS:
            relists.add_metric([kind], float(informer.relists[kind]))
            failures.add_metric([kind], float(informer.apply_failures[kind]))
        yield relists
        yield failures

    def _reports(self, leading: list[str], now: float) -> Iterable[Metric]:
        """The captures' progress reports (carried by their Leases), per led changefeed and mode."""
        labels = ["changefeed", "mode", "capture"]
        lag = GaugeMetricFamily(
            PREFIX + "capture_checkpoint_lag_seconds",
            "Now minus the wall time of the lowest checkpoint a capture reports for a changefeed and mode "
            "(its slowest dispatcher there).",
            labels=labels,
        )
        count = GaugeMetricFamily(
            PREFIX + "capture_reported_dispatchers",
            "Working dispatchers a capture's report covers, per changefeed and mode.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            PREFIX + "capture_report_covered",
            "1 when a capture's report covers exactly the dispatchers the maintainer sees Working there (it is "
            "used for the changefeed checkpoint), 0 when not (their persisted checkpoints hold it meanwhile).",
            labels=labels,
        )
        slowest = GaugeMetricFamily(
            PREFIX + "slowest_span_lag_seconds",
            "The same lag as capture_checkpoint_lag_seconds, labelled with the span of the slowest dispatcher.",
            labels=[*labels, "span"],
        )
        for name in leading:
            world = self.maintainer.snapshot(name)
            if world is None:
                continue
            for capture, entry, exact in progress.entries(world):
                key = [name, entry.mode.value, capture]
                count.add_metric(key, float(entry.dispatchers))
                used.add_metric(key, 1.0 if exact else 0.0)
                behind = entry_lag(entry, now)
                if behind is not None and entry.dispatchers:
                    lag.add_metric(key, behind)
                    d = world.dispatchers.get(entry.slowest)
                    slowest.add_metric([*key, d.span if d is not None else NO_SPAN], behind)
        yield lag
        yield count
        yield used
        yield slowest


class MaintainerMetrics:
    """The registry of one Maintainer, its process-lifetime metrics and the hooks that feed them."""

    def __init__(self, maintainer: Maintainer, *, process: bool = True) -> None:
        self.maintainer = maintainer
        self.registry = CollectorRegistry()
        self.operator_duration = Histogram(
            PREFIX + "operator_duration_seconds",
            "Duration of SpanOperators this process saw finish while leading their changefeed "
            "(status startedAt, else creation, to finishedAt), by type and outcome.",
            ["type", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.write_errors = Counter(
            PREFIX + "api_write_errors",
            "API writes that failed, by reason (the API status reason or code, or ClientTimeout / ConnectionError"
            " / BadResponse; StaleView: a teardown's consistent read found something its view did not show).",
            ["reason"],
            registry=self.registry,
        )
        for reason in INITIAL_WRITE_ERROR_REASONS:
            self.write_errors.labels(reason)
        #: (changefeed, type) -> SpanOperators this process saw fail while leading (``operators_failed_total``).
        self.failures: Tally[tuple[str, str]] = Tally()
        self.collector = StateCollector(maintainer)
        self.registry.register(self.collector)
        if process:  # the standard process_* and python_* series, in this registry
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        #: SpanOperator name -> (uid, terminal) as last seen, to observe each operator's end exactly once.
        self._seen: dict[str, tuple[str, bool]] = {}
        #: Changefeed -> when its source's head passed each revision, from every report this process saw.
        self.heads: dict[str, HeadCurve] = {}

    def head_time(self, changefeed: str, checkpoint: int) -> float | None:
        """The wall time a changefeed's ``checkpoint`` (a source revision) stands for (``HeadCurve.time_of``),
        from every report seen so far and the current ones."""
        for c in self.maintainer.informer.store.all(Kind.CAPTURE).values():
            self._see_report(c)
        curve = self.heads.setdefault(changefeed, HeadCurve())
        curve.forget_below(checkpoint)
        return curve.time_of(checkpoint)

    def _heard(self, lease: str) -> None:
        """A capture's Lease changed: what its report says of the source's head."""
        self._see_report(self.maintainer.informer.store.record(Kind.CAPTURE, lease.removeprefix(CAPTURE_LEASE_PREFIX)))

    def _see_report(self, capture: object) -> None:
        """A capture's report into each changefeed's curve (entries carrying no time are skipped there)."""
        if isinstance(capture, Capture) and capture.progress is not None:
            for e in capture.progress.entries:
                if e.checkpoint_time is not None:
                    self.heads.setdefault(e.changefeed, HeadCurve()).see_entries((e,))

    def write_error(self, reason: str) -> None:
        """The executor's ``on_error`` callback."""
        self.write_errors.labels(reason or "Unknown").inc()

    def on_change(self, kind: str, name: str) -> None:
        """The informer's change callback (watch events, our own writes, and ``name == ""`` after a LIST).

        An operator's duration is observed when this process sees it go from in flight to finished (a
        transition, so a maintainer that starts and lists operators finished by its predecessor counts
        none of them), once per uid (a relist or a late event of the same object changes nothing), and
        only while this process leads its changefeed. A failed one is also counted by changefeed and type.
        """
        if kind == LEASE and name.startswith(CAPTURE_LEASE_PREFIX):
            try:
                self._heard(name)
            except Exception:  # metrics must never break the informer
                log.exception("metrics: could not read the report of Lease %r", name)
            return
        if kind != Kind.OPERATOR.value:
            return
        try:
            store = self.maintainer.informer.store
            if name:
                self._see(name, store.record(Kind.OPERATOR, name))
                return
            current = store.all(Kind.OPERATOR)
            for n, rec in current.items():
                self._see(n, rec)
            for gone in set(self._seen) - set(current):
                del self._seen[gone]
        except Exception:  # metrics must never break the informer
            log.exception("metrics: could not observe SpanOperator %r", name)

    def _see(self, name: str, rec: object) -> None:
        if not isinstance(rec, SpanOperator):
            self._seen.pop(name, None)  # deleted (or unreadable)
            return
        terminal = rec.phase.terminal
        before = self._seen.get(name)
        self._seen[name] = (rec.uid, terminal)
        if not terminal or before != (rec.uid, False) or rec.changefeed not in self.maintainer.leading:
            return
        if rec.phase is OpPhase.FAILED:
            self.failures[(rec.changefeed, rec.type.value)] += 1
        began = rec.started_at or rec.created
        if began <= 0:
            return
        ended = rec.finished_at or time.time()
        self.operator_duration.labels(rec.type.value, rec.phase.value).observe(max(0.0, ended - began))


class MetricsServer:
    """``GET /metrics`` in the running event loop (aiohttp), on its own address and port."""

    def __init__(self, registry: CollectorRegistry, address: str, port: int) -> None:
        self.registry = registry
        self.address = address
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.address, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if not self.port:  # an ephemeral port (tests): report the one the OS chose
            self.port = int(runner.addresses[0][1])
        log.info("metrics served on http://%s:%d/metrics", self.address, self.port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.registry), headers={"Content-Type": content_type})
