"""Prometheus metrics of the maintainer process (``--metrics-port``, ``/metrics``); see docs/metrics.md.

Two sorts of metric live in one :class:`~prometheus_client.CollectorRegistry` per :class:`MaintainerMetrics`
(never the global registry: a test may build many maintainers in one process):

- **State at scrape time** (:class:`StateCollector`, ``collector.py``): spans, operators in flight, checkpoint lag,
  leadership, captures, the last bootstrap, the runner's and the executors' counters... are read when Prometheus
  scrapes, from what the runner hands the metrics (:class:`MaintainerView`), for the changefeeds this process leads
  *now*. Nothing is set and forgotten, so no series outlives what it describes (a changefeed led by another replica,
  a capture gone, a state no span is in any more simply stops being reported), in the style of crate-operator's
  ``prometheus.py``. A scrape reads the indexes' aggregates, never every record: its work does not grow with the
  spans (tests/maintainer/test_metrics.py counts it at 100 and 10,000 spans).
- **Process-lifetime** figures only an observer can make: the duration (and, for failures, the count by changefeed
  and type) of each operator this process saw finish (observed once per operator: see
  :meth:`MaintainerMetrics.on_change`), and each changefeed's head curve from the captures' reports.

The chart's alert rules and dashboard (charts/changefeed-maintainer/monitoring/) use these names only;
tests/monitoring derives the names from this registry and fails on a query that names anything else.

The endpoint (:class:`MetricsServer`) is served the conventional way, as controller-runtime's and CloudNativePG's
metrics servers are: an HTTP server of the process (aiohttp, as the readiness endpoint) that collects the registry
when Prometheus asks. It answers in the maintainer's event loop, the one that updates the informer's cache, so the
collector reads a consistent cache without locks (prometheus_client's own server would collect in a thread of its
own while the loop changes the maps it reads). A scrape therefore waits for the loop's current turn; Prometheus
waits 10 s by default, and bench/run.py reports how long scrapes take.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from controller.kube.liveness import CAPTURE_LEASE_PREFIX, LEASE
from controller.maintainer.collector import (
    CAPTURE_STATES,
    INITIAL_WRITE_ERROR_REASONS,
    PREFIX,
    MaintainerView,
    StateCollector,
)
from controller.model.progress import HeadCurve
from controller.model.records import Capture, SpanOperator
from controller.model.states import Kind, OpPhase

log = logging.getLogger(__name__)

#: Operator durations: a Move of an idle span takes about a second, a held one or a large split minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

__all__ = [
    "CAPTURE_STATES",
    "INITIAL_WRITE_ERROR_REASONS",
    "PREFIX",
    "MaintainerMetrics",
    "MaintainerView",
    "MetricsServer",
    "StateCollector",
]


class MaintainerMetrics:
    """The registry of one Maintainer: its state at scrape time (read from ``view``), its process-lifetime metrics
    and the hook that feeds them (:meth:`on_change`, the runner's informer callback), and prometheus_client's
    standard ``process_*`` and ``python_*`` series."""

    def __init__(self, view: MaintainerView) -> None:
        self.view = view
        self.registry = CollectorRegistry()
        self.operator_duration = Histogram(
            PREFIX + "operator_duration_seconds",
            "Duration of SpanOperators this process saw finish while leading their changefeed "
            "(status startedAt, else creation, to finishedAt), by type and outcome.",
            ["type", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        #: (changefeed, type) -> SpanOperators this process saw fail while leading (``operators_failed_total``).
        self.failures: Tally[tuple[str, str]] = Tally()
        self.registry.register(StateCollector(view, self))
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
        for c in self.view.informer.store.all(Kind.CAPTURE).values():
            self._see_report(c)
        curve = self.heads.setdefault(changefeed, HeadCurve())
        curve.forget_below(checkpoint)
        return curve.time_of(checkpoint)

    def _heard(self, lease: str) -> None:
        """A capture's Lease changed: what its report says of the source's head."""
        self._see_report(self.view.informer.store.record(Kind.CAPTURE, lease.removeprefix(CAPTURE_LEASE_PREFIX)))

    def _see_report(self, capture: object) -> None:
        """A capture's report into each changefeed's curve (entries carrying no time are skipped there)."""
        if isinstance(capture, Capture) and capture.progress is not None:
            for e in capture.progress.entries:
                if e.checkpoint_time is not None:
                    self.heads.setdefault(e.changefeed, HeadCurve()).see_entries((e,))

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
            store = self.view.informer.store
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
        if not terminal or before != (rec.uid, False) or rec.changefeed not in self.view.leading:
            return
        if rec.phase is OpPhase.FAILED:
            self.failures[(rec.changefeed, rec.type.value)] += 1
        began = rec.started_at or rec.created
        if began <= 0:
            return
        ended = rec.finished_at or time.time()
        self.operator_duration.labels(rec.type.value, rec.phase.value).observe(max(0.0, ended - began))


class MetricsServer:
    """``GET /metrics`` on its own address and port, answered in the running event loop with a collection of
    ``registry`` made then: text format 0.0.4, or OpenMetrics if the scraper's ``Accept`` asks for it; ``name[]``
    query parameters restrict the answer to those series. Anything but ``/metrics`` is a 404, a collection that
    raises a 500 with its error. ``start`` raises OSError where the address cannot be bound (a port taken)."""

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
        names = set(request.query.getall("name[]", []))
        try:
            body = encoder(Only(self.registry, names) if names else self.registry)  # type: ignore[arg-type]
        except Exception as exc:
            log.exception("metrics: the collection failed")
            return web.Response(status=500, text=f"the collection failed: {exc!r}\n")
        return web.Response(body=body, headers={"Content-Type": content_type})


class Only:
    """A registry's collection restricted to the series named (``name[]``), as the encoders take a registry (they
    call ``collect``). Not ``CollectorRegistry.restricted_registry``: it finds a collector by the names the collector
    describes, and the state collector's series are not known before a scrape."""

    def __init__(self, registry: CollectorRegistry, names: set[str]) -> None:
        self.registry = registry
        self.names = names

    def collect(self) -> Iterable[Metric]:
        for metric in self.registry.collect():
            samples = [s for s in metric.samples if s.name in self.names]
            if samples:
                only = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                only.samples = samples
                yield only
