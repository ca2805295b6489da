"""The real dispatcher runtime: a changefeed's key ranges read from its source (etcd: ``controller.sources.etcd``)
and written to its sink (any kind: ``controller.sinks``), with the dispatchers' bookkeeping between them.

Positions. A changefeed with a source counts in **etcd revisions**: its ts *is* the revision (one etcd cluster's
revision is global and totally ordered, so checkpoints taken on different captures compare exactly, and a
successor's startTs is exact). A dispatcher started at ``R > 0`` has had every change of its range up to ``R``
applied downstream and watches from ``R + 1``. ``R == 0`` means "now": an initial scan (``EtcdSource.scan``: one
range read at the store's current revision ``S``), committed in **one** transaction with checkpoint ``S`` (so a
dispatcher replaced before it committed leaves nothing half-scanned behind: its successor, also at 0, scans again),
then the watch from ``S + 1``. That transaction also makes a tombstone at ``S`` of every live row of the range older
than ``S`` that the scan did not find (``api.Sweep``): rows a predecessor committed before it died unreported, for
keys deleted since.

Checkpoint = the highest revision up to which every change of the span is *committed* in the sink. A watch response
with events carries whole revisions (etcd never splits one revision's events across responses), so after it
everything up to its last event's revision has been received; a periodic progress notification (no events, not
``created``) says everything up to its ``header.revision`` has been sent, which is how an idle span advances. The
answer to a manual ``WatchProgressRequest`` is never used (not ordered with events on etcd < 3.5.8:
docs/architecture.md).

The watches. Per changefeed, every dispatcher of this capture watches its range on the source's one watch stream
(``sources.etcd.watch.WatchStream``: one gRPC call, a watcher of its own per dispatcher, each with its own start
revision and progress notifications): a capture with 1,000 dispatchers holds one stream per changefeed, not 1,000. A
dispatcher whose rows pile up (``batcher.MAX_PENDING_ROWS``) or that is paused has its watcher cancelled, and created
again from its position when drained or resumed; a broken stream creates every watcher again from its position.

The sink (``batcher.Writer``). Per changefeed, one writer task on one sink session takes what every dispatcher of this
capture received since the last transaction and applies it in one transaction (group commit), with each included
dispatcher's resolved revision saved as its checkpoint in the same transaction. Only after the commit does the
dispatcher's in-memory checkpoint (``durable``) move. A failed transaction is rolled back, its rows put back, and
retried with back-off: the checkpoint stays where it was and nothing is lost. Changes are applied only if newer than
the row (deletes as tombstones), so replays after a failover or an in-flight transaction that commits after a close
are harmless.

So :meth:`DataplaneRuntime.checkpoint` only ever returns committed values, and :meth:`~DataplaneRuntime.flush` has
nothing to do: every checkpoint returned so far is already durable downstream.

Lag in seconds: the runtime remembers, per changefeed, when it first saw each new head revision (any response's
``header.revision``). A dispatcher's checkpoint stands for the wall time the head first passed it (now when caught
up): :meth:`DataplaneRuntime.checkpoint_time`, which the agent puts in its progress report
(``ProgressEntry.checkpoint_time``) for the maintainer's lag; :meth:`DataplaneRuntime.lag_seconds` is now minus it.

Compaction. A watch from a compacted revision is cancelled by etcd (``compact_revision`` set): the dispatcher stops,
its checkpoint does not move, and :meth:`~DataplaneRuntime.failed` says why. Nothing is skipped.

Credentials (:class:`Endpoints`) are never logged nor shown in a repr.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from controller.capture.batcher import MAX_PENDING_ROWS, Scan, Writer
from controller.capture.logs import fields
from controller.capture.troubles import CONNECTION, Troubles
from controller.model.progress import SINK, SOURCE, Side, SinkFigures
from controller.model.records import Dispatcher
from controller.sinks.api import Row, Session, Sink
from controller.sources.etcd import EtcdSource, same
from controller.sources.etcd.connection import Tls, describe
from controller.sources.etcd.watch import BACKOFF

log = logging.getLogger("controller.capture.dataplane")



@dataclass(frozen=True)
class Endpoints:
    """Where a changefeed reads and writes (from the Secrets it names). Never printed: see ``__repr__``."""

    etcd: tuple[str, ...]  # host:port or http://host:port
    #: Where it writes: a sink of one kind (``controller.sinks.api.Sink``), compared by value.
    sink: Sink
    username: str | None = None
    password: str | None = None
    #: TLS material for ``https://`` endpoints (``sources.etcd.connection``); None: the system's roots.
    tls: Tls | None = None

    def __repr__(self) -> str:
        return f"Endpoints(etcd={len(self.etcd)} endpoint(s), sink={self.sink.kind})"

    __str__ = __repr__


@dataclass
class _Disp:
    """A dispatcher of the data plane: its watcher (``sources.api.Watcher``) and what the sink holds of it
    (``sink.Pending``)."""

    dispatcher: Dispatcher
    feed: _Feed
    #: The last committed checkpoint (what the sink holds for this span).
    durable: int
    #: What ``checkpoint`` returns while paused (the value at pause), else None.
    paused_at: int | None = None
    #: Received, not yet committed: rows, and the revision up to which they cover the span.
    rows: list[Row] = field(default_factory=list)
    resolved: int = 0
    #: Why it stopped for good (the source compacted past its position...), None while it runs.
    failed: str | None = None
    #: Its initial scan (if it starts at 0) is done: it may watch.
    scanned: bool = False
    #: That scan, until the transaction holding its rows (and its sweep: ``sink.Scan``) committed.
    scan: Scan | None = None
    #: Its watcher is stopped while too many of its rows wait for the sink (back-pressure).
    held: bool = False
    task: asyncio.Task[None] | None = None
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    received_rows: int = 0
    created_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.resolved = self.durable
        self.resume.set()

    @property
    def name(self) -> str:
        return self.dispatcher.name

    @property
    def key(self) -> bytes:
        return self.dispatcher.key_range.start

    @property
    def range_end(self) -> bytes:
        return self.dispatcher.key_range.end

    def checkpoint(self) -> int:
        return self.paused_at if self.paused_at is not None else self.durable

    # -- sources.api.Watcher ------------------------------------------------------------------------------

    def position(self) -> int:
        return self.resolved

    def created(self, head: int) -> None:
        if head < self.resolved:
            self.fail(
                f"this dispatcher starts at revision {self.resolved}, past the source's revision {head} "
                "(a ts that is not an etcd revision of this cluster?)"
            )

    @property
    def own(self) -> str:
        """The origin of this dispatcher's own troubles (``Troubles``): its scan's, its watcher's."""
        return f"dispatcher {self.name}"

    def cancelled(self, reason: str) -> None:
        """The source cancelled its watcher for another reason than compaction (retried in a second): its trouble
        until its watcher answers again."""
        needs_a_person = "permission denied" in reason.lower()
        message = f"the source cancelled the watch of span {self.dispatcher.span}: {reason or 'no reason given'}"
        self.feed.runtime.troubles.set(self.feed.changefeed, SOURCE, self.own, not needs_a_person, message)

    def events(self, rows: list[Row], head: int) -> None:
        self.feed.runtime.troubles.clear(self.feed.changefeed, SOURCE, self.own)
        if self.rows:
            self.rows.extend(rows)
        else:
            self.rows = rows  # the source's list, handed over (a catch-up response: tens of thousands of rows)
        self.received_rows += len(rows)
        self.resolved = max(self.resolved, rows[-1][2])
        self.feed.sink.received(self, len(rows))
        if len(self.rows) >= MAX_PENDING_ROWS:
            self.held = True  # until the writer drained it (Sink.drained -> _Feed.drained)
            self.feed.stream.drop(self.name)
            self.feed.sink.full.set()

    def progress(self, head: int) -> None:
        self.feed.runtime.troubles.clear(self.feed.changefeed, SOURCE, self.own)
        self.resolved = max(self.resolved, head)
        self.feed.sink.received(self, 0)

    def compacted(self, compact_revision: int) -> None:
        self.fail(
            f"the source was compacted to revision {compact_revision}, past this dispatcher's position "
            f"{self.resolved}: its changes since cannot be read (not skipped)"
        )

    def fail(self, why: str) -> None:
        self.failed = why
        self.feed.stream.drop(self.name)
        self.feed.runtime.stopped(self.name)
        log.error("dispatcher failed", extra=fields(dispatcher=self.name, reason=why))

    def watching(self) -> bool:
        """Whether its watcher should run: scanned, not paused, not held back, not failed."""
        return self.scanned and self.paused_at is None and not self.held and self.failed is None


class _Feed:
    """One changefeed on this capture: its source (``EtcdSource``: its connection and its one watch stream, every
    dispatcher's watcher on it), its writer (``batcher.Writer``), its dispatchers."""

    def __init__(self, runtime: DataplaneRuntime, changefeed: str, endpoints: Endpoints) -> None:
        self.runtime = runtime
        self.changefeed = changefeed
        self.endpoints = endpoints
        self.dispatchers: dict[str, _Disp] = {}
        #: The source: its connection, its one watch stream (every dispatcher's watcher on it), its scans.
        self.source = EtcdSource(endpoints, on_head=self.saw_head, on_error=self.source_failed)
        self.stream = self.source.stream
        self.sink = Writer(
            changefeed,
            endpoints.sink,
            self.dispatchers,
            batch_interval=runtime.batch_interval,
            batch_rows=runtime.batch_rows,
            drained=self.drained,
            troubles=runtime.troubles,
            gc_interval=runtime.gc_interval,
        )
        self.sink.tombstones.publish(runtime.published_checkpoint(changefeed))
        #: (head revision, wall time first seen), increasing in both.
        self.heads: list[tuple[int, float]] = []

    def source_failed(self, exc: BaseException, origin: str = CONNECTION) -> None:
        """A call to the source failed: the changefeed's source trouble while it is retried, under ``origin`` (the
        stream's: ``CONNECTION``, cleared by any response; a dispatcher's scan or watch: its own, cleared by its own
        success), so that one span's refusal is not cleared by another's answers. A connection closed under a call
        by another task's error is that task's to report."""
        said = self.source.trouble(exc)
        if said is not None:
            self.runtime.troubles.set(self.changefeed, SOURCE, origin, *said)

    # -- new values from the Secrets ------------------------------------------------------------------------

    async def reconfigure(self, new: Endpoints) -> dict[Side, str]:
        """Use ``new`` (a changed source or sink Secret) where it works: per side, the new values are tried first (a
        connection made, a read or a round trip answered); a side whose new values work uses them from now on (the
        source: its watch stream started again from each dispatcher's position; the sink: from its next
        transaction), a side whose new values do not keeps the connection it has, unless that one fails too. Returns,
        per side, why the new values were not taken (nothing lost either way)."""
        problems: dict[Side, str] = {}
        old = self.endpoints
        if not same(new, old):
            probe = min((d.key for d in self.dispatchers.values()), default=b"\x00")
            client, problem = await self.source.try_values(new, probe)
            failing = self.runtime.troubles.has(self.changefeed, SOURCE, CONNECTION)
            if client is not None or failing:
                await self.source.use(new, client)
                self.endpoints = replace(new, sink=self.endpoints.sink)
            if problem:
                problems[SOURCE] = f"the source Secret's new values do not work: {problem}" + (
                    "" if failing else "; still reading with the values read before"
                )
        if new.sink != old.sink:
            conn, problem = await self._try_sink(new.sink)
            failing = self.runtime.troubles.has(self.changefeed, SINK, CONNECTION)
            if conn is not None or failing:
                self.sink.use(new.sink, conn)
                self.endpoints = replace(self.endpoints, sink=new.sink)
                self.sink.wake.set()
            if problem:
                problems[SINK] = f"the sink Secret's new dsn does not work: {problem}" + (
                    "" if failing else "; still writing with the dsn read before"
                )
        if self.endpoints != old:
            log.info("changefeed uses its Secrets' new values", extra=fields(changefeed=self.changefeed))
        return problems

    async def _try_sink(self, sink: Sink) -> tuple[Session | None, str]:
        """A session of ``sink`` that answered a round trip and reaches the database this changefeed writes (its
        identity row, once the writer has read one), or why not."""
        conn = None
        try:
            conn = await sink.connect()
            found = await conn.identity()
            if self.sink.identity and found != self.sink.identity:
                await conn.close()
                return None, (
                    "it reaches another database than the one this changefeed writes (its identity row differs or is "
                    "missing), which does not hold the rows the checkpoint claims; a changefeed's sink cannot move: "
                    "point the Secret back, or create a new changefeed"
                )
            return conn, ""
        except sink.errors() as exc:
            if conn is not None:
                await conn.close()
            return None, sink.trouble(exc)[1]

    def saw_head(self, revision: int) -> None:
        """The source answered (any response carries its head revision): it works."""
        self.runtime.troubles.clear(self.changefeed, SOURCE, CONNECTION)
        if not self.heads or revision > self.heads[-1][0]:
            self.heads.append((revision, self.runtime.clock()))
            if len(self.heads) > 4096:  # keep it bounded: drop every other old entry (lag gets coarser, never lower)
                self.heads = self.heads[:2048:2] + self.heads[2048:]

    def checkpoint_time(self, checkpoint: int) -> float:
        """The wall time ``checkpoint`` stands for: when this capture first saw the source's head pass it (now
        if it has seen none above it: the span is caught up)."""
        for revision, at in self.heads:
            if revision > checkpoint:
                return at
        return self.runtime.clock()

    # -- a dispatcher's watch --------------------------------------------------------------------------

    def rewatch(self, d: _Disp) -> None:
        """Watch ``d`` again if it should (resumed, drained)."""
        if d.watching() and d.name in self.dispatchers:
            self.stream.want(d)

    def drained(self, d: _Disp) -> None:
        """The sink took ``d`` below ``MAX_PENDING_ROWS``: a watcher held back runs again from its position."""
        if d.held:
            d.held = False
            self.rewatch(d)

    async def begin(self, d: _Disp) -> None:
        """The initial scan if ``d`` starts at 0, then its watcher (retrying the scan while etcd is unreachable)."""
        backoff = BACKOFF[0]
        while d.failed is None:
            try:
                await d.resume.wait()
                if d.resolved == 0:
                    await self._scan(d)
                    self.runtime.troubles.clear(self.changefeed, SOURCE, d.own)
                d.scanned = True
                self.rewatch(d)
                return
            except self.source.errors() as exc:
                log.debug("etcd scan failed; retrying", extra=fields(dispatcher=d.name, error=describe(exc)))
                self.source_failed(exc, d.own)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])

    async def _scan(self, d: _Disp) -> None:
        """The initial scan: the range as of one revision, queued as one unit with that revision as resolved."""
        rows, at = await self.source.scan(d.dispatcher.key_range)
        # No await between these: the writer takes all of it, with ``at`` and the sweep, in one transaction.
        d.rows.extend(rows)
        d.scan = Scan(at, [row[0] for row in rows])
        d.resolved = at
        d.received_rows += len(rows)
        self.sink.received(d, len(rows))
        log.info("initial scan", extra=fields(dispatcher=d.name, revision=at, rows=len(rows)))

    async def aclose(self) -> None:
        for d in list(self.dispatchers.values()):
            if d.task is not None:
                d.task.cancel()
        await self.source.aclose()
        await self.sink.aclose()


class DataplaneRuntime:
    """Dispatchers of changefeeds with a source and a sink: etcd key ranges applied to PostgreSQL.

    :meth:`configure` (the agent, before it starts a dispatcher of such a changefeed, with what it read from
    the changefeed's Secrets) says where a changefeed reads and writes. Must be created and used inside the
    agent's running event loop (each dispatcher's watch and each changefeed's writer are tasks of it).
    ``batch_interval``: seconds between group commits at most; ``batch_rows``: commit sooner once this many
    rows wait. ``clock``: wall time (lag). ``gc_interval``: seconds between tombstone collections of a changefeed's
    sink (``collector.Collector``; none before :meth:`published` gave its checkpoint)."""

    def __init__(
        self,
        *,
        batch_interval: float = 0.05,
        batch_rows: int = 2_000,
        clock: Callable[[], float] = time.time,
        troubles: Troubles | None = None,
        gc_interval: float = 60.0,
        wake: asyncio.Event | None = None,
    ) -> None:
        #: What keeps each changefeed's data from flowing, as its sources and sinks tell (the progress report's).
        self.troubles = troubles if troubles is not None else Troubles()
        #: Set when a dispatcher stops for good (``take_failed`` names it): the agent's reconcile loop wakes and
        #: writes why, whatever the dispatcher's state (a settled one is not visited otherwise).
        self.wake = wake
        self._failed_since: set[str] = set()
        self.batch_interval = batch_interval
        self.batch_rows = batch_rows
        self.clock = clock
        self.gc_interval = gc_interval
        #: Each changefeed's published checkpoint, the highest seen (``published``).
        self._published: dict[str, int] = {}
        self._feeds: dict[str, _Feed] = {}
        self._runs: dict[str, _Disp] = {}

    def configure(self, changefeed: str, endpoints: Endpoints) -> None:
        """Where ``changefeed`` reads and writes from now on, if none of its dispatchers runs here (else nothing
        changes: ``reconfigure`` tries new values before it uses them)."""
        feed = self._feeds.get(changefeed)
        if feed is not None and (feed.endpoints == endpoints or feed.dispatchers):
            return
        if feed is not None:
            asyncio.get_running_loop().create_task(feed.aclose())
        self._feeds[changefeed] = _Feed(self, changefeed, endpoints)

    def configured(self, changefeed: str) -> bool:
        return changefeed in self._feeds

    async def reconfigure(self, changefeed: str, endpoints: Endpoints) -> dict[Side, str]:
        """New values for a configured changefeed, used where they work (``_Feed.reconfigure``): per side, why they
        were not."""
        feed = self._feeds.get(changefeed)
        if feed is None:
            return {}
        if not feed.dispatchers:
            self.configure(changefeed, endpoints)
            return {}
        return await feed.reconfigure(endpoints)

    def runs(self, name: str) -> bool:
        return name in self._runs

    def start(self, dispatcher: Dispatcher) -> None:
        if dispatcher.name in self._runs:
            return
        feed = self._feeds[dispatcher.changefeed]  # KeyError: not configured
        d = _Disp(dispatcher, feed, durable=dispatcher.start_ts)
        feed.dispatchers[d.name] = d
        self._runs[d.name] = d
        feed.sink.start()
        d.task = asyncio.get_running_loop().create_task(feed.begin(d), name=f"begin-{d.name}")

    def checkpoint(self, name: str) -> int:
        """The last committed checkpoint (never one whose rows are not committed)."""
        return self._runs[name].checkpoint()

    def failed(self, name: str) -> str | None:
        """Why the dispatcher stopped for good (its source compacted past its position...), None if it did not."""
        return self._runs[name].failed

    def stopped(self, name: str) -> None:
        """Dispatcher ``name`` stopped for good: named by the next ``take_failed``, and the agent woken."""
        self._failed_since.add(name)
        if self.wake is not None:
            self.wake.set()

    def take_failed(self) -> set[str]:
        """The dispatchers that stopped for good since the last call."""
        names, self._failed_since = self._failed_since, set()
        return names

    def checkpoint_time(self, name: str) -> float:
        """The wall time this dispatcher's checkpoint stands for (``_Feed.checkpoint_time``): its lag in seconds
        is now minus it, 0 when caught up."""
        d = self._runs[name]
        return d.feed.checkpoint_time(d.checkpoint())

    def low_watermark(self, names: Sequence[str]) -> None:
        """None: each dispatcher's checkpoint is its own (ask each: ``checkpoint``)."""
        return None

    def lag_seconds(self, name: str) -> float:
        """Wall-clock seconds between now and when the source's head first passed this dispatcher's checkpoint."""
        return max(0.0, self.clock() - self.checkpoint_time(name))

    def write_rate(self, name: str) -> float:
        d = self._runs[name]
        elapsed = time.monotonic() - d.created_at
        return round(d.received_rows / elapsed, 3) if elapsed > 1.0 else 0.0

    def region_count(self, name: str) -> int:
        self._runs[name]
        return 0

    def close(self, name: str) -> int:
        d = self._runs.pop(name)
        d.feed.dispatchers.pop(name, None)
        d.feed.stream.drop(name)
        if d.task is not None:
            d.task.cancel()
        final = d.checkpoint()
        d.feed.sink.forget(d)
        self.troubles.clear(d.feed.changefeed, SOURCE, d.own)
        return final

    def pause(self, name: str) -> int:
        d = self._runs[name]
        if d.paused_at is None:
            d.paused_at = d.durable
            d.resume.clear()
            d.feed.stream.drop(name)  # nothing more is received; what was stays for after the resume
        return d.paused_at

    def resume(self, name: str) -> None:
        d = self._runs[name]
        if d.paused_at is not None:
            d.durable = max(d.durable, d.paused_at)
            d.paused_at = None
            d.resume.set()
            d.feed.sink.received(d, 0)
            d.feed.rewatch(d)

    def flush(self) -> None:
        """Nothing to do: ``checkpoint`` only returns checkpoints committed with the rows they cover."""

    def release(self, changefeed: str) -> None:
        """Every dispatcher of ``changefeed`` here is paused (its replication is): its etcd connection is closed (the
        watch stream, every watcher dropped already, ends with it) and its sink's between two transactions. Rows
        received and not committed stay with their dispatchers; a resume connects again and goes on from each
        dispatcher's position. Nothing if one of them still runs."""
        feed = self._feeds.get(changefeed)
        if feed is None or any(d.paused_at is None for d in feed.dispatchers.values()):
            return
        feed.sink.release()
        feed.source.release()

    def running(self) -> list[str]:
        return sorted(self._runs)

    def stats(self, changefeed: str) -> tuple[int, int]:
        """(transactions committed, rows applied) by this capture for ``changefeed``."""
        feed = self._feeds.get(changefeed)
        return (feed.sink.commits, feed.sink.committed_rows) if feed is not None else (0, 0)

    def published(self, changefeed: str, checkpoint_ts: int) -> None:
        """The changefeed's published checkpoint (its ``status.checkpointTs``: every span's capture reported it
        committed), as the capture last read it: the bound of its tombstone collection (docs/architecture.md,
        "Tombstone collection"). Only ever raised: a lower value (an older read) changes nothing."""
        value = max(self._published.get(changefeed, 0), checkpoint_ts)
        self._published[changefeed] = value
        feed = self._feeds.get(changefeed)
        if feed is not None:
            feed.sink.tombstones.publish(value)

    def published_checkpoint(self, changefeed: str) -> int:
        return self._published.get(changefeed, 0)

    def tombstone_stats(self, changefeed: str) -> dict[str, Any]:
        """The tombstone collection of ``changefeed`` on this capture (``collector.Collector.stats``): tombstones
        collected in total, and each table's horizon, tombstones held and live rows after its last collection."""
        feed = self._feeds.get(changefeed)
        if feed is None:
            return {"checkpoint": self._published.get(changefeed, 0), "collections": 0, "collected": 0,
                    "dropped": 0, "tombstones": 0, "live_rows": 0, "error": "", "tables": []}  # fmt: skip
        return feed.sink.tombstones.stats()

    def sink_figures(self) -> tuple[SinkFigures, ...]:
        """Per changefeed replicated here, its sink's figures (``tombstone_stats``) for the progress report."""
        return tuple(feed.sink.tombstones.figures() for _, feed in sorted(self._feeds.items()) if feed.dispatchers)

    async def aclose(self) -> None:
        """Stop every watch and writer and close the connections (the agent, when it exits)."""
        feeds, self._feeds = list(self._feeds.values()), {}
        self._runs.clear()
        for feed in feeds:
            await feed.aclose()
