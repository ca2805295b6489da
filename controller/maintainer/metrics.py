"""Prometheus metrics of the maintainer process (``--metrics-port``, ``/metrics``); see docs/metrics.md.

Two sorts of metric live in one :class:`~prometheus_client.CollectorRegistry` per :class:`Maintainer`
(never the global registry: a test may build many maintainers in one process):

- **State at scrape time** (:class:`StateCollector`, ``collector.py``): spans, operators in flight, checkpoint lag,
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

The collection runs in the event loop that mutates the cache, so the collector reads a consistent cache without
locks; everything else of a scrape runs in a process of its own, the relay (:class:`MetricsServer`,
``metrics_relay.py``): the HTTP exchange and the encoding of what the loop collected, which the loop sends it
pickled. No scrape takes this process's GIL. While scrapes come, the relay has the loop collect every ``REFRESH``
seconds (1 s) and answers each scrape at once with the latest collection; one older than twice that (the first
scrape, the first after a pause of 10 minutes, a loop that was late) is asked for and waited for at most
``FRESH_WITHIN`` (15 ms), else answered with anyway (``metrics_stale_scrapes_total`` counts those). The loop makes
no system call for a scrape but its channel's: the standard ``process_*`` series are read from ``/proc`` by a
thread once a second and served from that reading (:class:`ProcessReadings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import sys
import time
from collections import Counter as Tally
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from controller.kube.liveness import CAPTURE_LEASE_PREFIX, LEASE
from controller.maintainer import metrics_relay
from controller.maintainer.collector import CAPTURE_STATES, PREFIX, Maintainer, StateCollector
from controller.model.progress import HeadCurve
from controller.model.records import Capture, SpanOperator
from controller.model.states import Kind, OpPhase

log = logging.getLogger(__name__)

#: Operator durations: a Move of an idle span takes about a second, a held one or a large split minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Write-error reasons exported at 0 from the start, so that ``rate()`` and ``increase()`` see their first
#: occurrence (a series that appears at 1 has no earlier sample to increase from): the normal one (a stale
#: resourceVersion) and those the client itself reports when the API gave no usable answer.
INITIAL_WRITE_ERROR_REASONS = ("Conflict", "ClientTimeout", "ConnectionError")
#: How long a scrape the relay has no recent collection for waits for the event loop to collect before it is
#: answered with the latest. The loop's longest turns at 100,000 spans are 50-60 ms; a scrape that waited for them
#: took as long.
FRESH_WITHIN = 0.015
#: While scrapes come, the relay asks for a collection this often (seconds), and answers a scrape at once with the
#: latest if it is at most twice as old: at 100,000 spans a collection costs the loop at most about 3 ms of CPU (p99).
REFRESH = 1.0
#: How long ``MetricsServer.start`` waits for the relay to serve (an interpreter and prometheus_client to import).
RELAY_START = 30.0

__all__ = [
    "CAPTURE_STATES",
    "PREFIX",
    "MaintainerMetrics",
    "MetricsServer",
    "ProcessReadings",
    "StateCollector",
]


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
        self.stale_scrapes = Counter(
            PREFIX + "metrics_stale_scrapes",
            "Scrapes answered with a collection of these metrics older than the relay answers at once with (2 s),"
            " because the event loop did not collect within the relay's wait (15 ms): it was late (longer turns).",
            registry=self.registry,
        )
        #: (changefeed, type) -> SpanOperators this process saw fail while leading (``operators_failed_total``).
        self.failures: Tally[tuple[str, str]] = Tally()
        self.collector = StateCollector(maintainer)
        self.registry.register(self.collector)
        #: The standard process_* series, read off the event loop (None: not exported).
        self.process: ProcessReadings | None = None
        if process:  # the standard process_* and python_* series, in this registry
            self.process = ProcessReadings()
            self.registry.register(self.process)
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


class ProcessReadings(Collector):
    """prometheus_client's ``process_*`` series (CPU, memory, file descriptors, start time), served from the last
    reading of ``/proc``, which :meth:`refresh` makes (the server calls it from a thread once a second).

    Why not read ``/proc`` at scrape time, in the event loop: a reading is a dozen system calls (open, read, close
    of ``stat`` and ``limits``, a listing of ``fd``), and each lets the GIL go. While the decision's thread runs,
    the loop's thread then waits up to a switch interval (5 ms) to get it back, after every one of them:
    0.13 ms of work took 10.7 ms (median) and up to 37 ms beside a busy thread, and at 100,000 spans the whole
    scrape 35-53 ms in the loop (bench/README.md). A reading older than ``max_age`` (no server, or its
    thread late) is replaced at scrape time, so the series are never staler than that."""

    def __init__(self, max_age: float = 5.0) -> None:
        self.max_age = max_age
        self._source = ProcessCollector(registry=None)
        self._reading: tuple[float, list[Metric]] | None = None

    def refresh(self) -> list[Metric]:
        """Read ``/proc`` now (from any thread: the reading is replaced by one assignment); the series read."""
        series = list(self._source.collect())
        self._reading = (time.monotonic(), series)
        return series

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        reading = self._reading
        if reading is None or time.monotonic() - reading[0] > self.max_age:
            return self.refresh()
        return reading[1]


class RelayFailed(RuntimeError):
    """The metrics relay did not start (it exited, or did not say it serves within ``RELAY_START`` seconds)."""


class Relay:
    """A running relay: its process, and the maintainer's end of the channel to it."""

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.proc = proc
        self.reader = reader
        self.writer = writer

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def stop(self) -> None:
        """Close the channel (the relay exits on its end), and wait for the process (killed after 10 s)."""
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class MetricsServer:
    """``GET /metrics`` on its own address and port, answered by a process of its own (the relay,
    :mod:`controller.maintainer.metrics_relay`) from collections of ``registry`` that the running (the maintainer's)
    event loop makes when the relay asks for one.

    ``start`` binds the port here (an address that cannot be bound raises OSError there) and hands the listening
    socket to the relay, which it starts and waits for (:class:`RelayFailed` if it does not start). A relay that
    exits while serving is started again, on the same socket, after a pause that doubles up to a minute. While
    scrapes come the relay asks for a collection every ``refresh`` seconds and answers with the latest at once if
    it is at most twice that old; otherwise it asks, waits at most ``fresh_within`` seconds, and answers with the
    latest and says so; ``stale`` counts those (``MaintainerMetrics.stale_scrapes``). With
    ``process``, a task has the reading of ``/proc`` refreshed by a thread every ``period`` seconds."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        port: int,
        process: ProcessReadings | None = None,
        period: float = 1.0,
        fresh_within: float = FRESH_WITHIN,
        stale: Counter | None = None,
        refresh: float = REFRESH,
    ) -> None:
        self.registry = registry
        self.address = address
        self.port = port
        self.process = process
        self.period = period
        self.fresh_within = fresh_within
        self.stale = stale
        self.refresh = refresh
        #: Collections made for the relay so far (tests wait on it).
        self.collections = 0
        #: The relay serving now, if any.
        self.relay: Relay | None = None
        self._listener: socket.socket | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve, from now on; an address that cannot be bound raises (OSError) here, a relay that cannot start
        :class:`RelayFailed`."""
        family = (await asyncio.get_running_loop().getaddrinfo(self.address, self.port, flags=socket.AI_PASSIVE))[0][0]
        listener = socket.create_server((self.address, self.port), family=family)
        try:
            self.relay = await self._spawn(listener)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        if not self.port:  # an ephemeral port (tests): report the one the OS chose
            self.port = int(listener.getsockname()[1])
        self._keeper = asyncio.create_task(self._keep(listener), name="metrics-relay")
        if self.process is not None:
            self._refresher = asyncio.create_task(self._refresh(self.process), name="metrics-process-readings")
        log.info("metrics served on http://%s:%d/metrics (relay pid %d)", self.address, self.port, self.relay.pid)

    async def _spawn(self, listener: socket.socket) -> Relay:
        """Start a relay on ``listener`` and wait until it serves."""
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                metrics_relay.__name__,
                "--listen-fd",
                str(listener.fileno()),
                "--channel-fd",
                str(theirs.fileno()),
                "--fresh-within",
                repr(self.fresh_within),
                "--refresh",
                repr(self.refresh),
                pass_fds=(listener.fileno(), theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        relay = Relay(proc, reader, writer)
        try:
            await asyncio.wait_for(reader.readexactly(len(metrics_relay.READY)), RELAY_START)
        except (asyncio.IncompleteReadError, TimeoutError) as exc:
            await relay.stop()
            raise RelayFailed(f"the metrics relay did not start (exit status {proc.returncode})") from exc
        except BaseException:  # cancelled: no relay is left behind
            await relay.stop()
            raise
        return relay

    async def _keep(self, listener: socket.socket) -> None:
        """Answer the relay's asks; start another when it exits."""
        pause = 1.0
        while True:
            relay = self.relay
            if relay is not None:
                began = time.monotonic()
                await self._answer(relay)
                await relay.stop()
                if time.monotonic() - began > 60:
                    pause = 1.0
                log.error(
                    "metrics: the relay (pid %d) exited with status %s; another starts in %.0f s",
                    relay.pid,
                    relay.proc.returncode,
                    pause,
                )
                self.relay = None
                await asyncio.sleep(pause)
                pause = min(60.0, pause * 2)
            try:
                self.relay = await self._spawn(listener)
            except (OSError, RelayFailed) as exc:
                log.error("metrics: could not start the relay: %s; trying again in %.0f s", exc, pause)
                await asyncio.sleep(pause)
                pause = min(60.0, pause * 2)

    async def _answer(self, relay: Relay) -> None:
        """Until the relay's channel closes: answer each ask with a collection, and count its stale answers."""
        reported = 0
        try:
            while True:
                message = await relay.reader.readexactly(metrics_relay.MESSAGE.size)
                kind, stale = metrics_relay.MESSAGE.unpack(message)
                if self.stale is not None and stale > reported:
                    self.stale.inc(stale - reported)
                reported = max(reported, stale)
                if kind == metrics_relay.ASK:
                    relay.writer.write(self._collection())
                    await relay.writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    def _collection(self) -> bytes:
        """In the loop: collect the registry (the only part of a scrape that reads the cache), as a frame."""
        self.collections += 1
        try:
            kind, payload = metrics_relay.COLLECTED, pickle.dumps(list(self.registry.collect()), protocol=5)
        except Exception as exc:
            log.exception("metrics: the collection failed")
            kind, payload = metrics_relay.FAILED, repr(exc).encode()
        return metrics_relay.FRAME.pack(kind, len(payload)) + payload

    async def stop(self) -> None:
        for task in (self._refresher, self._keeper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._refresher = self._keeper = None
        relay, self.relay = self.relay, None
        if relay is not None:
            await relay.stop()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    async def _refresh(self, process: ProcessReadings) -> None:
        while True:
            try:
                await asyncio.to_thread(process.refresh)
            except Exception:  # never seen: /proc unreadable is handled by the reading itself
                log.exception("metrics: could not read the process's /proc")
            await asyncio.sleep(self.period)
