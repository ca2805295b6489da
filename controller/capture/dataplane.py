"""The real dispatcher runtime: an etcd v3 key range replicated into PostgreSQL (issue 38).

Positions. A changefeed with a source (``spec.source.etcd``) counts in **etcd revisions**: its ts *is* the
revision (one etcd cluster's revision is global and totally ordered, so checkpoints taken on different
captures compare exactly, and a successor's startTs is exact). A dispatcher started at ``R > 0`` has had
every change of its range up to ``R`` applied downstream and watches from ``R + 1``. ``R == 0`` means "now":
an initial scan (one range read at the store's current revision ``S``), committed in **one** transaction
with checkpoint ``S`` (so a dispatcher replaced before it committed leaves nothing half-scanned behind:
its successor, also at 0, scans again), then the watch from ``S + 1``.

Checkpoint = the highest revision up to which every change of the span is *committed* in the sink. A
watch response with events carries whole revisions (etcd never splits one revision's events across
responses), so after it everything up to its last event's ``mod_revision`` has been received; a periodic
progress notification (``progress_notify``: no events, not ``created``) says everything up to its
``header.revision`` has been sent, which is how an idle span advances. The answer to a manual
``WatchProgressRequest`` is never used (not ordered with events on etcd < 3.5.8: docs/architecture.md).

The sink. Per changefeed, one writer task on one psycopg connection takes what every dispatcher of this
capture received since the last transaction and applies it in one transaction (group commit: at most
``batch_interval`` seconds apart, sooner once ``batch_rows`` rows wait), with each included dispatcher's
resolved revision saved to the ``checkpoints`` table in the same transaction (``controller.dataplane.schema``).
Only after the commit does the dispatcher's in-memory checkpoint move. A failed transaction (the sink down,
a refused write) is rolled back, its rows put back in front of what arrived meanwhile, and retried with
back-off: the checkpoint stays where it was and nothing is lost. Changes are applied with ``schema.apply``
(only if newer than the row; deletes as tombstones), so replays after a failover or an in-flight transaction
that commits after a close are harmless.

So :meth:`DataplaneRuntime.checkpoint` only ever returns committed values, and :meth:`~DataplaneRuntime.flush`
has nothing to do: every checkpoint returned so far is already durable downstream.

Lag in seconds: the runtime remembers, per changefeed, when it first saw each new head revision (any watch
response's ``header.revision``). A dispatcher's checkpoint stands for the wall time the head first passed it
(now when caught up): :meth:`DataplaneRuntime.checkpoint_time`, which the agent puts in its progress report
(``ProgressEntry.checkpoint_time``) for the maintainer's lag; :meth:`DataplaneRuntime.lag_seconds` is now
minus it.

Compaction. A watch from a compacted revision is cancelled by etcd (``compact_revision`` set): the
dispatcher stops, its checkpoint does not move, and :meth:`~DataplaneRuntime.failed` says why. Nothing is
skipped.

Credentials (:class:`Endpoints`) are never logged nor shown in a repr.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aetcd
import aetcd.rpc
import grpc
import psycopg

from controller.capture.logs import fields
from controller.capture.runtime import DispatcherRuntime
from controller.dataplane import schema
from controller.model.records import Dispatcher
from controller.model.states import Mode

log = logging.getLogger("controller.capture.dataplane")

#: One row as ``schema.apply`` takes it: key, value, revision, deleted.
Row = tuple[bytes, bytes | None, int, bool]

#: Back-off of a failed watch or transaction: first wait, cap (seconds).
BACKOFF = (0.1, 5.0)
#: A dispatcher stops reading its watch while this many rows wait for the sink (back-pressure).
MAX_PENDING_ROWS = 20_000
#: Rows per page of the initial scan.
SCAN_PAGE = 2_000


@dataclass(frozen=True)
class Endpoints:
    """Where a changefeed reads and writes (from the Secrets it names). Never printed: see ``__repr__``."""

    etcd: tuple[str, ...]  # host:port or http://host:port
    dsn: str
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        return f"Endpoints(etcd={len(self.etcd)} endpoint(s), dsn=<hidden>)"

    __str__ = __repr__


def unsupported_endpoint(endpoints: Sequence[str]) -> str | None:
    """Why these etcd endpoints cannot be used, or None. TLS to etcd (``https://``) is not supported yet: the
    client would speak plaintext to a TLS port and retry for ever, so such a source is refused up front."""
    for e in endpoints:
        if e.strip().lower().startswith("https://"):
            return f"TLS to etcd is not supported yet (endpoint {e.strip()!r}): use http:// on a trusted network"
    return None


def _host_port(endpoint: str) -> tuple[str, int]:
    text = endpoint.strip().removeprefix("http://")
    text = text.rstrip("/")
    host, _, port = text.rpartition(":")
    if not host:
        return text, 2379
    return host.strip("[]"), int(port)


@dataclass
class _Disp:
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
    task: asyncio.Task[None] | None = None
    resume: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    received_rows: int = 0
    created_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.resolved = self.durable
        self.resume.set()
        self.drained.set()

    @property
    def name(self) -> str:
        return self.dispatcher.name

    def checkpoint(self) -> int:
        return self.paused_at if self.paused_at is not None else self.durable


class _Feed:
    """One changefeed on this capture: its etcd client, its sink connection and writer task, its dispatchers."""

    def __init__(self, runtime: DataplaneRuntime, changefeed: str, endpoints: Endpoints) -> None:
        self.runtime = runtime
        self.changefeed = changefeed
        self.endpoints = endpoints
        self.dispatchers: dict[str, _Disp] = {}
        #: Rows waiting in every dispatcher's ``rows`` (the writer's "enough for a transaction" test), and the
        #: dispatchers whose resolved revision moved since the writer last looked: neither costs a walk over
        #: every dispatcher per watch response or per batch.
        self.pending_rows = 0
        self.dirty: set[str] = set()
        self.wake = asyncio.Event()
        self.client: aetcd.Client | None = None
        self._client_lock = asyncio.Lock()
        self._endpoint_index = 0
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.ensured: set[tuple[int, Mode]] = set()
        self.writer: asyncio.Task[None] | None = None
        #: (head revision, wall time first seen), increasing in both.
        self.heads: list[tuple[int, float]] = []
        self.sink_error: str = ""
        self.commits = 0
        self.committed_rows = 0

    # -- etcd --------------------------------------------------------------------------------------------

    async def etcd(self) -> aetcd.Client:
        async with self._client_lock:
            if self.client is None:
                host, port = _host_port(self.endpoints.etcd[self._endpoint_index % len(self.endpoints.etcd)])
                client = aetcd.Client(
                    host=host,
                    port=port,
                    username=self.endpoints.username,
                    password=self.endpoints.password,
                    timeout=10,
                    options={"grpc.enable_http_proxy": 0},
                )
                await client.connect()
                self.client = client
            return self.client

    async def reset_etcd(self) -> None:
        """Drop the client after a transport error: the next call connects again (to the next endpoint)."""
        async with self._client_lock:
            client, self.client = self.client, None
            self._endpoint_index += 1
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    def saw_head(self, revision: int) -> None:
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

    # -- the sink ------------------------------------------------------------------------------------------

    def ensure_writer(self) -> None:
        if self.writer is None or self.writer.done():
            self.writer = asyncio.create_task(self._write_loop(), name=f"sink-{self.changefeed}")

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self.conn is None or self.conn.closed:
            self.conn = await psycopg.AsyncConnection.connect(self.endpoints.dsn, connect_timeout=5)
            self.ensured.clear()
        return self.conn

    async def _write_loop(self) -> None:
        backoff = BACKOFF[0]
        rt = self.runtime
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), rt.batch_interval)
            self.wake.clear()
            batch = self._take_dirty()
            if not batch:
                continue
            if self._advance_without_rows(batch):
                continue
            taken = {d.name: (d.rows, d.resolved) for d in batch}
            for d in batch:
                self.pending_rows -= len(d.rows)
                d.rows = []
            try:
                await self._commit(batch, taken)
            except (psycopg.Error, OSError) as exc:
                for d in batch:  # put them back in front of what came meanwhile: nothing lost, nothing reordered
                    d.rows = taken[d.name][0] + d.rows
                    self.pending_rows += len(taken[d.name][0])
                    self.dirty.add(d.name)
                self.sink_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.warning(
                    "sink transaction failed; retrying", extra=fields(changefeed=self.changefeed, error=self.sink_error)
                )
                if self.conn is not None and (self.conn.closed or self.conn.broken):
                    with contextlib.suppress(Exception):
                        await self.conn.close()
                    self.conn = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])
                self.wake.set()
                continue
            backoff = BACKOFF[0]
            self.sink_error = ""
            for d in batch:
                d.durable = max(d.durable, taken[d.name][1])
                if len(d.rows) < MAX_PENDING_ROWS:
                    d.drained.set()
            if any(d.rows for d in batch):
                self.wake.set()

    def _take_dirty(self) -> list[_Disp]:
        """The dispatchers with something to commit (resolved past durable), not paused (those stay dirty)."""
        names, self.dirty = self.dirty, set()
        batch = []
        for name in sorted(names):
            d = self.dispatchers.get(name)
            if d is None:
                continue  # closed
            if d.paused_at is not None:
                self.dirty.add(name)
            elif d.resolved > d.durable:
                batch.append(d)
        return batch

    def _advance_without_rows(self, batch: list[_Disp]) -> bool:
        """Checkpoints that only moved (progress notifications of idle spans): when no dispatcher of the batch
        has a row waiting, every row each received up to its resolved revision is already committed (rows leave
        ``d.rows`` only into a transaction, and come back if it fails), so its checkpoint may move with no
        transaction at all. An idle capture then writes nothing to the sink; the ``checkpoints`` table is
        brought up to date by the next transaction with rows. Not before its table exists (the first
        transaction creates it), so that verify finds every span's table."""
        if any(d.rows for d in batch) or any(
            (d.dispatcher.table_id, d.dispatcher.mode) not in self.ensured for d in batch
        ):
            return False
        for d in batch:
            d.durable = max(d.durable, d.resolved)
        return True

    async def _commit(self, batch: list[_Disp], taken: dict[str, tuple[list[Row], int]]) -> None:
        conn = await self._connection()
        cf = self.changefeed
        for d in batch:
            key = (d.dispatcher.table_id, d.dispatcher.mode)
            if key not in self.ensured:
                await self._ensure(conn, *key)
        per_table: dict[tuple[int, Mode], dict[bytes, Row]] = {}
        for d in batch:
            latest = per_table.setdefault((d.dispatcher.table_id, d.dispatcher.mode), {})
            for row in taken[d.name][0]:
                old = latest.get(row[0])
                if old is None or old[2] < row[2]:
                    latest[row[0]] = row
        async with conn.transaction(), conn.cursor() as cur:
            for (table_id, mode), rows in per_table.items():
                if rows:
                    await cur.executemany(schema.apply(cf, table_id, mode), list(rows.values()))
            await cur.executemany(
                schema.save_checkpoint(cf),
                [
                    (
                        d.name,
                        d.dispatcher.table_id,
                        d.dispatcher.mode.value,
                        d.dispatcher.key_range.start,
                        d.dispatcher.key_range.end,
                        taken[d.name][1],
                    )
                    for d in batch
                ],
            )
        self.commits += 1
        self.committed_rows += sum(len(r) for r in per_table.values())

    async def _ensure(self, conn: psycopg.AsyncConnection[Any], table_id: int, mode: Mode) -> None:
        for attempt in range(3):
            try:
                async with conn.transaction():
                    for statement in schema.create_schema(self.changefeed).split(";\n"):
                        await conn.execute(statement)
                    await conn.execute(schema.create_table(self.changefeed, table_id, mode))
                break
            except psycopg.errors.UniqueViolation:  # another capture created it at the same moment
                if attempt == 2:
                    raise
        self.ensured.add((table_id, mode))

    # -- a dispatcher's watch --------------------------------------------------------------------------

    async def follow(self, d: _Disp) -> None:
        backoff = BACKOFF[0]
        while d.failed is None:
            try:
                await d.resume.wait()
                if d.resolved == 0:
                    await self._scan(d)
                await self._watch(d)
                return
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, aetcd.exceptions.ClientError, OSError, TimeoutError) as exc:
                log.warning(
                    "etcd watch failed; retrying",
                    extra=fields(dispatcher=d.name, error=type(exc).__name__, resolved=d.resolved),
                )
                await self.reset_etcd()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])

    async def _scan(self, d: _Disp) -> None:
        """The initial scan: the range as of one revision, queued as one unit with that revision as resolved."""
        client = await self.etcd()
        lo, hi = d.dispatcher.key_range.start, d.dispatcher.key_range.end
        rows: list[Row] = []
        at = 0
        key = lo
        while True:
            answer = await client.kvstub.Range(
                aetcd.rpc.RangeRequest(key=key, range_end=hi, revision=at, limit=SCAN_PAGE), timeout=30
            )
            if at == 0:
                at = answer.header.revision
                self.saw_head(at)
            rows.extend((kv.key, kv.value, kv.mod_revision, False) for kv in answer.kvs)
            if not answer.more or not answer.kvs:
                break
            key = answer.kvs[-1].key + b"\x00"
        # No await between these two: the writer takes all of it, with ``at``, in one transaction.
        d.rows.extend(rows)
        d.resolved = at
        d.received_rows += len(rows)
        self.pending_rows += len(rows)
        self.dirty.add(d.name)
        log.info("initial scan", extra=fields(dispatcher=d.name, revision=at, rows=len(rows)))
        self.wake.set()

    async def _watch(self, d: _Disp) -> None:
        client = await self.etcd()
        lo, hi = d.dispatcher.key_range.start, d.dispatcher.key_range.end
        requests: asyncio.Queue[Any] = asyncio.Queue()

        async def iterate() -> Any:
            while (request := await requests.get()) is not None:
                yield request

        start = d.resolved + 1
        create = aetcd.rpc.WatchCreateRequest(key=lo, range_end=hi, start_revision=start, progress_notify=True)
        await requests.put(aetcd.rpc.WatchRequest(create_request=create))
        call = aetcd.rpc.WatchStub(client.channel).Watch(iterate())
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise OSError("the etcd watch stream ended")
                head = response.header.revision
                self.saw_head(head)
                if response.canceled:
                    if response.compact_revision:
                        d.failed = (
                            f"the source was compacted to revision {response.compact_revision}, past this "
                            f"dispatcher's position {d.resolved}: its changes since cannot be read (not skipped)"
                        )
                        log.error("dispatcher failed", extra=fields(dispatcher=d.name, reason=d.failed))
                        return
                    raise OSError(f"etcd cancelled the watch: {response.cancel_reason}")
                if response.created:
                    if head < d.resolved:
                        d.failed = (
                            f"this dispatcher starts at revision {d.resolved}, past the source's revision {head} "
                            "(a ts that is not an etcd revision of this cluster?)"
                        )
                        log.error("dispatcher failed", extra=fields(dispatcher=d.name, reason=d.failed))
                        return
                    continue
                if response.events:
                    for e in response.events:
                        deleted = e.type == aetcd.rpc.Event.DELETE
                        d.rows.append((e.kv.key, None if deleted else e.kv.value, e.kv.mod_revision, deleted))
                    d.received_rows += len(response.events)
                    self.pending_rows += len(response.events)
                    d.resolved = max(d.resolved, response.events[-1].kv.mod_revision)
                else:  # a progress notification: everything in range up to the header's revision was sent
                    d.resolved = max(d.resolved, head)
                self.dirty.add(d.name)
                if self.pending_rows >= self.runtime.batch_rows or not response.events:
                    self.wake.set()
                if len(d.rows) >= MAX_PENDING_ROWS:
                    d.drained.clear()
                    self.wake.set()
                    await d.drained.wait()
                if not d.resume.is_set():
                    await d.resume.wait()
        finally:
            call.cancel()
            requests.put_nowait(None)

    async def aclose(self) -> None:
        for d in list(self.dispatchers.values()):
            if d.task is not None:
                d.task.cancel()
        if self.writer is not None:
            self.writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.writer
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()


class DataplaneRuntime:
    """Dispatchers of changefeeds with a source and a sink: etcd key ranges applied to PostgreSQL.

    :meth:`configure` (the agent, before it starts a dispatcher of such a changefeed, with what it read from
    the changefeed's Secrets) says where a changefeed reads and writes. Must be created and used inside the
    agent's running event loop (each dispatcher's watch and each changefeed's writer are tasks of it).
    ``batch_interval``: seconds between group commits at most; ``batch_rows``: commit sooner once this many
    rows wait. ``clock``: wall time (lag)."""

    def __init__(
        self, *, batch_interval: float = 0.05, batch_rows: int = 2_000, clock: Callable[[], float] = time.time
    ) -> None:
        self.batch_interval = batch_interval
        self.batch_rows = batch_rows
        self.clock = clock
        self._feeds: dict[str, _Feed] = {}
        self._runs: dict[str, _Disp] = {}

    def configure(self, changefeed: str, endpoints: Endpoints) -> None:
        """Where ``changefeed`` reads and writes from now on (its running dispatchers keep their connections
        until they close; a changed value takes effect for dispatchers started after every one closed)."""
        feed = self._feeds.get(changefeed)
        if feed is not None and (feed.endpoints == endpoints or feed.dispatchers):
            return
        if feed is not None:
            asyncio.get_running_loop().create_task(feed.aclose())
        self._feeds[changefeed] = _Feed(self, changefeed, endpoints)

    def configured(self, changefeed: str) -> bool:
        return changefeed in self._feeds

    def runs(self, name: str) -> bool:
        return name in self._runs

    def start(self, dispatcher: Dispatcher) -> None:
        if dispatcher.name in self._runs:
            return
        feed = self._feeds[dispatcher.changefeed]  # KeyError: not configured
        d = _Disp(dispatcher, feed, durable=dispatcher.start_ts)
        feed.dispatchers[d.name] = d
        self._runs[d.name] = d
        feed.ensure_writer()
        d.task = asyncio.get_running_loop().create_task(feed.follow(d), name=f"watch-{d.name}")

    def checkpoint(self, name: str) -> int:
        """The last committed checkpoint (never one whose rows are not committed)."""
        return self._runs[name].checkpoint()

    def failed(self, name: str) -> str | None:
        """Why the dispatcher stopped for good (its source compacted past its position...), None if it did not."""
        return self._runs[name].failed

    def sink_error(self, name: str) -> str:
        """The last error of the sink of this dispatcher's changefeed while it retries ("" when it writes)."""
        return self._runs[name].feed.sink_error

    def checkpoint_time(self, name: str) -> float:
        """The wall time this dispatcher's checkpoint stands for (``_Feed.checkpoint_time``): its lag in seconds
        is now minus it, 0 when caught up."""
        d = self._runs[name]
        return d.feed.checkpoint_time(d.checkpoint())

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
        if d.task is not None:
            d.task.cancel()
        final = d.checkpoint()
        d.feed.pending_rows -= len(d.rows)
        d.rows = []
        return final

    def pause(self, name: str) -> int:
        d = self._runs[name]
        if d.paused_at is None:
            d.paused_at = d.durable
            d.resume.clear()
        return d.paused_at

    def resume(self, name: str) -> None:
        d = self._runs[name]
        if d.paused_at is not None:
            d.durable = max(d.durable, d.paused_at)
            d.paused_at = None
            d.resume.set()
            d.feed.dirty.add(name)
            d.feed.wake.set()

    def flush(self) -> None:
        """Nothing to do: ``checkpoint`` only returns checkpoints committed with the rows they cover."""

    def running(self) -> list[str]:
        return sorted(self._runs)

    def stats(self, changefeed: str) -> tuple[int, int]:
        """(transactions committed, rows applied) by this capture for ``changefeed``."""
        feed = self._feeds.get(changefeed)
        return (feed.commits, feed.committed_rows) if feed is not None else (0, 0)

    async def aclose(self) -> None:
        """Stop every watch and writer and close the connections (the agent, when it exits)."""
        feeds, self._feeds = list(self._feeds.values()), {}
        self._runs.clear()
        for feed in feeds:
            await feed.aclose()


class RoutedRuntime:
    """What the agent drives: each dispatcher runs in the :class:`DataplaneRuntime` when its changefeed was
    configured with a source and a sink (:meth:`configure`), else in ``default`` (the logical clock: a
    changefeed that names no source replicates nothing, for benchmarks of the control plane)."""

    def __init__(self, default: DispatcherRuntime, data: DataplaneRuntime | None = None) -> None:
        self.default = default
        self.data = data if data is not None else DataplaneRuntime()
        self._real: set[str] = set()

    def configure(self, changefeed: str, endpoints: Endpoints) -> None:
        self.data.configure(changefeed, endpoints)

    def configured(self, changefeed: str) -> bool:
        return self.data.configured(changefeed)

    def _rt(self, name: str) -> DispatcherRuntime:
        return self.data if name in self._real else self.default

    def start(self, dispatcher: Dispatcher) -> None:
        if dispatcher.name in self._real:
            return
        if self.data.configured(dispatcher.changefeed):
            self.data.start(dispatcher)
            self._real.add(dispatcher.name)
        else:
            self.default.start(dispatcher)

    def checkpoint(self, name: str) -> int:
        return self._rt(name).checkpoint(name)

    def write_rate(self, name: str) -> float:
        return self._rt(name).write_rate(name)

    def region_count(self, name: str) -> int:
        return self._rt(name).region_count(name)

    def close(self, name: str) -> int:
        rt = self._rt(name)
        final = rt.close(name)
        self._real.discard(name)
        return final

    def pause(self, name: str) -> int:
        return self._rt(name).pause(name)

    def resume(self, name: str) -> None:
        self._rt(name).resume(name)

    def flush(self) -> None:
        self.default.flush()
        self.data.flush()

    def checkpoint_time(self, name: str) -> float | None:
        """The wall time a real dispatcher's checkpoint stands for; None for the logical clock (a TSO)."""
        return self.data.checkpoint_time(name) if name in self._real else None

    def sink_error(self, name: str) -> str:
        """The sink's last error while a real dispatcher's transactions are retried ("" while it writes)."""
        return self.data.sink_error(name) if name in self._real else ""

    def failed(self, name: str) -> str | None:
        """Why a real dispatcher stopped for good (None: it did not, or it is not a real one)."""
        return self.data.failed(name) if name in self._real else None

    def low_watermark(self, names: Sequence[str]) -> tuple[int, str] | None:
        """The default runtime's shortcut, for groups with no real dispatcher (else None: ask each)."""
        fast = getattr(self.default, "low_watermark", None)
        if fast is None or any(n in self._real for n in names):
            return None
        low: tuple[int, str] | None = fast(names)
        return low

    async def aclose(self) -> None:
        self._real.clear()
        await self.data.aclose()


def _check(rt: DataplaneRuntime, routed: RoutedRuntime) -> tuple[DispatcherRuntime, DispatcherRuntime]:
    return rt, routed  # both implement the agent's interface (checked by mypy)
