"""The maintainer's state metrics, computed when Prometheus scrapes (``StateCollector``); see docs/metrics.md.

Spans, operators in flight, checkpoint lag, leadership, captures, the last bootstrap... are computed from the
informer's cache for the changefeeds this process leads *now*, from the index's aggregates (span counts per state,
capture and mode; operators in flight; the progress reports) rather than by walking every record: a scrape costs
what the changefeeds and captures are, not what the spans are (tests/maintainer/test_metrics.py counts it). Nothing is
set and forgotten, so no series outlives what it describes (a changefeed led by another replica, a capture gone, a
state no span is in any more simply stops being reported), in the style of crate-operator's ``prometheus.py``.

The collector reads exactly what :class:`MaintainerView` holds, which the runner builds from its parts, and what
:class:`Observed` says of the process-lifetime metrics (``metrics.MaintainerMetrics``, which builds this collector):
this module imports neither the runner nor ``metrics.py``.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.engine import progress
from controller.engine.maintainer import Memory, sink_figures, troubles
from controller.engine.world import World
from controller.kube.informer import Informer
from controller.kube.liveness import LEASE
from controller.maintainer.stats import Stats
from controller.model.progress import SINK, SOURCE, entry_lag
from controller.model.records import Capture, Changefeed, SpanOperator
from controller.model.states import Kind, OpType, SchedulerState
from controller.model.tso import physical_ms
from controller.process.heap import HeapReserve
from controller.process.tenure import Tenure

PREFIX = "changefeed_maintainer_"
UNKNOWN_STATE = "Unknown"  # a Span whose status was never written
NO_CAPTURE = "none"  # a Span bound to no capture
NO_STAGE = "None"  # an operator not started yet (Pending) has no stage
NO_SPAN = "unknown"  # a reported slowest dispatcher the maintainer does not know (yet)
CAPTURE_STATES = ("alive", "draining", "lost")
#: The ``kind`` label values of the informer's counters: every kind it lists and watches.
INFORMER_KINDS = (LEASE, *(k.value for k in Kind))


#: Write-error reasons exported at 0 from the start, so that ``rate()`` and ``increase()`` see their first
#: occurrence (a series that appears at 1 has no earlier sample to increase from): the normal one (a stale
#: resourceVersion) and those the client itself reports when the API gave no usable answer.
INITIAL_WRITE_ERROR_REASONS = ("Conflict", "ClientTimeout", "ConnectionError")


class Observed(Protocol):
    """What the collector reads of the process-lifetime metrics (``metrics.MaintainerMetrics``)."""

    @property
    def failures(self) -> Tally[tuple[str, str]]: ...

    def head_time(self, changefeed: str, checkpoint: int) -> float | None: ...


@dataclass(frozen=True)
class MaintainerView:
    """What the metrics read of their maintainer process, and nothing more. The runner builds it from its parts
    when it builds the metrics (``controller.maintainer.runner.Maintainer``); the maps and sets are the parts' own,
    changed in place, so a scrape reads them as they are then."""

    #: The cache (records and the per-changefeed indexes), whether every kind is listed, relists, apply failures.
    informer: Informer
    #: The changefeeds this process leads now (``Terms.leading``).
    leading: Set[str]
    stats: Stats
    #: Each led changefeed's engine memory (``Changefeeds.memories``): its bootstrap's figures.
    memories: Mapping[str, Memory]
    #: Failed API writes by reason, one tally per executor (``Executor.errors``).
    write_errors: Sequence[Mapping[str, int]]
    #: Live member -> how many changefeeds it leads (``Membership.counts``).
    counts: Callable[[], dict[str, int]]
    #: A led changefeed's world (``Changefeeds.snapshot``: its index's maps and the captures, nothing copied).
    snapshot: Callable[[str], World | None]
    tenure: Tenure | None
    #: The heap reserve, once its thread runs (None: off, not started yet, or not glibc).
    heap: Callable[[], HeapReserve | None]


def operator_age(op: SpanOperator, now: float) -> float:
    """Seconds an in-flight operator has been at work: since ``status.startedAt``, else since its creation."""
    return max(0.0, now - (op.started_at or op.created))


def capture_state(capture: Capture, now: float) -> str:
    """One of :data:`CAPTURE_STATES`: lost (Lease lapsed or missing, or being deleted), draining, alive."""
    if not capture.alive(now):
        return "lost"
    return "draining" if capture.draining else "alive"


class StateCollector(Collector):
    """Every gauge computed from the informer's cache at scrape time, plus the runner's and executors' counters."""

    def __init__(self, view: MaintainerView, observed: Observed) -> None:
        self.view = view
        self.observed = observed

    def describe(self) -> Iterable[Metric]:
        return []  # the series are dynamic: nothing to check for duplicates at registration

    def _verifications(self, leading: list[str]) -> Iterable[Metric]:
        """The last ``kubectl changefeed verify`` of each led changefeed, from its annotation
        ``cdc.maintainer.dev/last-verify`` (``Changefeed.last_verify``); absent until one ran."""
        store = self.view.informer.store
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
        m = self.view
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
        heap = m.heap()
        if heap is not None:
            refills = CounterMetricFamily(
                PREFIX + "heap_reserve_refills",
                "Refills of the heap reserve (--heap-reserve): free memory paged in by a thread of its own.",
            )
            refills.add_metric([], float(heap.refills))
            yield refills
            top = GaugeMetricFamily(
                PREFIX + "heap_reserve_bytes",
                "Free memory at the top of the heap at the reserve's last check (what a growing table is carved from).",
            )
            top.add_metric([], float(heap.top))
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
                failed.add_metric([name, op_type.value], float(self.observed.failures[(name, op_type.value)]))
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
        source = GaugeMetricFamily(
            PREFIX + "source_unavailable_captures",
            "Live captures whose progress report says they cannot read the changefeed's source (its Secret missing "
            "or malformed, the source refusing connections, authentication or TLS failing): the checkpoint holds "
            "(condition SourceUnavailable, whose reason says whether a person must act).",
            labels=["changefeed"],
        )
        sink = GaugeMetricFamily(
            PREFIX + "sink_unavailable_captures",
            "Live captures whose progress report says they cannot write the changefeed's sink (its Secret missing "
            "or malformed, the sink down or refusing connections, authentication, TLS, grants or a statement "
            "failing): the checkpoint holds (condition SinkUnavailable, whose reason says whether a person must act).",
            labels=["changefeed"],
        )
        collected = CounterMetricFamily(
            PREFIX + "sink_tombstones_collected",
            "Tombstones (rows of deleted keys) a live capture collected from the changefeed's sink, in total since "
            "that capture process started (its progress report): they can no longer matter (below the collection "
            "horizon, docs/architecture.md).",
            labels=["changefeed", "capture"],
        )
        held = GaugeMetricFamily(
            PREFIX + "sink_tombstones",
            "Tombstones held in the changefeed's sink after a live capture's last collection, over the tables it holds "
            "spans of (a table whose spans are on several captures is counted by each).",
            labels=["changefeed", "capture"],
        )
        live = GaugeMetricFamily(
            PREFIX + "sink_live_rows",
            "Live rows (keys not deleted) in the changefeed's sink after a live capture's last collection, over the "
            "tables it holds spans of (exact under 16 MB a table, else PostgreSQL's estimate).",
            labels=["changefeed", "capture"],
        )
        for name in leading:
            idx = store.indexes.get(name)
            if idx is not None:
                stopped.add_metric([name], float(len(idx.failed_dispatchers)))
            world = self.view.snapshot(name)
            if world is not None:
                source.add_metric([name], float(len(troubles(world, now, SOURCE))))
                sink.add_metric([name], float(len(troubles(world, now, SINK))))
                for cap_name, figures in sink_figures(world, now):
                    collected.add_metric([name, cap_name], float(figures.collected))
                    held.add_metric([name, cap_name], float(figures.tombstones))
                    live.add_metric([name, cap_name], float(figures.live_rows))
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
        yield source
        yield sink
        yield collected
        yield held
        yield live
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
        write_errors = CounterMetricFamily(
            PREFIX + "api_write_errors",
            "API writes that failed, by reason (the API status reason or code, or ClientTimeout / ConnectionError"
            " / BadResponse; StaleView: a teardown's consistent read found something its view did not show).",
            labels=["reason"],
        )
        by_reason: Tally[str] = Tally(dict.fromkeys(INITIAL_WRITE_ERROR_REASONS, 0))
        for tally in m.write_errors:
            for reason, n in tally.items():
                by_reason[reason or "Unknown"] += n
        for reason, n in sorted(by_reason.items()):
            write_errors.add_metric([reason], float(n))
        yield write_errors

    def _checkpoint_time(self, cf: Changefeed) -> float | None:
        """The wall time the changefeed's checkpoint stands for: a TSO's physical part, or for a changefeed
        counted in source revisions what the captures' reports said of it (``MaintainerMetrics.head_time``)."""
        if cf.checkpoint_ts <= 0:
            return None
        if not cf.source_secret:
            return physical_ms(cf.checkpoint_ts) / 1000.0
        return self.observed.head_time(cf.name, cf.checkpoint_ts)

    def _informer(self) -> Iterable[Metric]:
        """The informer's relists and failures to apply, per kind (every kind from 0: ``increase()`` sees the first)."""
        informer = self.view.informer
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
            world = self.view.snapshot(name)
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
