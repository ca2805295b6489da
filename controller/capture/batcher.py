"""One changefeed's writer on a capture: group commit into its sink, whichever kind (``controller.sinks.api``).

One writer task on one sink session takes what every dispatcher of this capture received since the last
transaction (at most ``batch_interval`` apart, sooner once ``batch_rows`` rows wait), keeps the newest change per
key, and hands the sink one :class:`~controller.sinks.api.Batch`: the changes per table, the initial scans' sweeps,
and the included dispatchers' resolved revisions as checkpoints, written in one transaction
(``Session.write``). Only after the commit does a
dispatcher's checkpoint (``durable``) move: a checkpoint is never claimed before the rows it covers are committed.
A failed transaction is rolled back, its rows go back in front of what arrived meanwhile, and it is retried with
back-off (``error`` says why meanwhile, and the capture's ``troubles`` report it: ``Sink.trouble``): the
checkpoint stays where it was and nothing is lost. A changed DSN (``use``) is taken between two transactions.
When no dispatcher of a batch has a row waiting (idle spans whose checkpoints only moved with progress
notifications), there is no transaction at all: every row each received up to its resolved revision is already
committed.

Tombstone collection (``collector.Collector``, each sink's ``Session.collect``): every transaction first reads the
horizons of the tables it writes (``FOR SHARE``) and applies only the changes above them, so a put older than a
collected tombstone never lands; and between its transactions the writer collects the tombstones below them.

A dispatcher is held back (its watcher stopped) while ``MAX_PENDING_ROWS`` of its rows wait: above what one catch-up
response of etcd 3.5 carries for a wide range (about 47,000 events measured), so a span catching up is not held back
after every response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from controller.capture.collector import Collector
from controller.capture.logs import fields
from controller.capture.troubles import CONNECTION, Troubles
from controller.model.progress import SINK
from controller.model.records import Dispatcher
from controller.model.states import Mode
from controller.sinks.api import Batch, Checkpoint, Row, Session, Sink, Superseded, Sweep

log = logging.getLogger("controller.capture.dataplane")


@dataclass(frozen=True)
class Scan:
    """An initial scan waiting to be committed with its rows: its revision and every key it found. Its transaction
    also turns the live rows of the range that the scan did not find into tombstones (``api.Sweep``)."""

    at: int
    keys: list[bytes]


#: Back-off of a failed transaction: first wait, cap (seconds).
BACKOFF = (0.1, 5.0)
#: Rows of one transaction, about (``Writer._take``): what one catch-up response of etcd carries for a wide range is
#: committed at once (a transaction costs a few round trips whatever its size: measured, 2,000-row transactions wrote
#: 44k rows/s where 30,000-row ones wrote 75k), and a long catch-up in pieces that overlap with its reading.
MAX_TRANSACTION_ROWS = 50_000
#: A dispatcher stops receiving while this many of its rows wait for the sink (back-pressure).
MAX_PENDING_ROWS = 100_000


class Pending(Protocol):
    """A dispatcher as the sink sees it: what it received and not committed, and what is committed."""

    @property
    def name(self) -> str: ...

    dispatcher: Dispatcher
    rows: list[Row]
    #: The revision up to which ``rows`` (with what is committed) cover its range.
    resolved: int
    #: The last committed checkpoint.
    durable: int
    #: Set while paused (its rows stay where they are).
    paused_at: int | None
    #: An initial scan among ``rows``, to be committed with them (None once it is).
    scan: Scan | None


class Writer:
    def __init__(
        self,
        changefeed: str,
        sink: Sink,
        dispatchers: dict[str, Any],
        *,
        batch_interval: float,
        batch_rows: int,
        drained: Callable[[Any], None],
        troubles: Troubles,
        gc_interval: float = 60.0,
    ) -> None:
        self.changefeed = changefeed
        #: Where a failing transaction says why (``Sink.trouble``), cleared by the next commit.
        self.troubles = troubles
        #: Where it writes (``use`` changes it, between two transactions).
        self.sink = sink
        #: The feed's dispatchers by name (the sink reads it; the feed adds and removes).
        self.dispatchers = dispatchers
        self.batch_interval = batch_interval
        self.batch_rows = batch_rows
        #: Called with a dispatcher held back for its pending rows once they fell below ``MAX_PENDING_ROWS``.
        self.drained = drained
        #: Rows waiting in every dispatcher's ``rows``, and the dispatchers whose resolved revision moved since the
        #: writer last looked: neither costs a walk over every dispatcher per response or per batch.
        self.pending_rows = 0
        self.dirty: set[str] = set()
        #: Something waits (the writer gathers a group for ``batch_interval``), and a full batch waits (it goes now).
        self.wake = asyncio.Event()
        self.full = asyncio.Event()
        self.conn: Session | None = None
        #: A changed sink (``use``): the session to take at the next transaction, and whether to.
        self._replacement: Session | None = None
        self._reconnect = False
        #: ``release`` asked to close the connection (every dispatcher paused).
        self._release = False
        #: The sink's identity (``Session.ensure``), read once the layout was ensured ("" until then): a changed DSN
        #: must reach the database holding it.
        self.identity = ""
        self.ensured: set[tuple[int, Mode]] = set()
        self.task: asyncio.Task[None] | None = None
        #: The last failure while transactions are retried ("" while they commit).
        self.error = ""
        self.commits = 0
        self.committed_rows = 0
        #: The tombstone collection, every ``gc_interval`` seconds between transactions (and the fence's horizons).
        self.tombstones = Collector(self, gc_interval)

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._write_loop(), name=f"sink-{self.changefeed}")

    def received(self, d: Pending, rows: int) -> None:
        """``d`` received ``rows`` more rows, or (0) its resolved revision moved: the writer takes it with the group
        gathered over the next ``batch_interval`` (at once if a full batch waits). An idle changefeed wakes the
        writer at most once per interval, whatever the number of its dispatchers' progress notifications."""
        self.pending_rows += rows
        self.dirty.add(d.name)
        self.wake.set()
        if self.pending_rows >= self.batch_rows:
            self.full.set()

    def forget(self, d: Pending) -> None:
        """``d`` closed: its rows not committed are dropped (its successor replays them)."""
        self.pending_rows -= len(d.rows)
        d.rows = []

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()

    def use(self, sink: Sink, conn: Session | None) -> None:
        """Write to ``sink`` from the next transaction on (a changed sink Secret), on ``conn`` (already made with
        it and found working) or on a new session: the one in use is closed between two transactions, never
        under one."""
        self.sink = sink
        previous, self._replacement = self._replacement, conn
        self._reconnect = True
        if previous is not None and previous is not conn:
            asyncio.get_running_loop().create_task(previous.close())

    def release(self) -> None:
        """Close the connection between two transactions, once every dispatcher is paused (a paused changefeed's
        sink holds no connection); the next transaction, after a resume, connects again."""
        self._release = True
        self.wake.set()

    async def _released(self) -> None:
        """What ``release`` asked for, if every dispatcher is still paused."""
        self._release = False
        if self.conn is not None and all(d.paused_at is not None for d in self.dispatchers.values()):
            conn, self.conn = self.conn, None
            if self._replacement is not None:  # a changed DSN tried meanwhile: the next connection is made anew
                self._reconnect = False
                conn2, self._replacement = self._replacement, None
                with contextlib.suppress(Exception):
                    await conn2.close()
            with contextlib.suppress(Exception):
                await conn.close()
            log.info("sink connection closed: the changefeed is paused", extra=fields(changefeed=self.changefeed))

    async def _connection(self) -> Session:
        if self._reconnect:
            self._reconnect = False
            old, self.conn, self._replacement = self.conn, self._replacement, None
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()
            self.ensured.clear()  # the new DSN may name another database
        if self.conn is None or not self.conn.usable:
            if self.conn is not None:
                await self.conn.close()
            self.conn = await self.sink.connect()
            self.ensured.clear()
        return self.conn

    async def _write_loop(self) -> None:
        backoff = BACKOFF[0]
        while True:
            if self._release:  # asked while a batch was gathered or committed
                await self._released()
            await self.tombstones.wait(self.wake)  # and a tombstone collection when one is due
            if self._release:  # asked while idle
                await self._released()
            if self.pending_rows < self.batch_rows:  # gather a group, unless a full batch waits
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.full.wait(), self.batch_interval)
            self.wake.clear()
            self.full.clear()
            batch = self._take_dirty()
            if not batch or self._advance_without_rows(batch):
                continue
            batch, taken = self._take(batch)
            scans = {d.name: d.scan for d in batch if d.scan is not None}
            for d in batch:
                self.pending_rows -= len(taken[d.name][0])
                d.scan = None
            try:
                await self._commit(batch, taken, scans)
            except Superseded:
                self._put_back(batch, taken, scans)  # the others' rows go in the next transaction, at once
                self.wake.set()
                continue
            except self.sink.errors() as exc:
                self._put_back(batch, taken, scans)
                transient, self.error = self.sink.trouble(exc)
                self.troubles.set(self.changefeed, SINK, CONNECTION, transient, self.error)
                log.debug(
                    "sink transaction failed; retrying", extra=fields(changefeed=self.changefeed, error=self.error)
                )
                if self.conn is not None and not self.conn.usable:
                    await self.conn.close()
                    self.conn = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF[1])
                self.wake.set()
                continue
            backoff = BACKOFF[0]
            self.error = ""
            self.troubles.clear(self.changefeed, SINK, CONNECTION)
            for d in batch:
                d.durable = max(d.durable, taken[d.name][1])
                if len(d.rows) < MAX_PENDING_ROWS:
                    self.drained(d)
            if self.pending_rows > 0 and self._rows_wait():
                self.wake.set()

    def _put_back(self, batch: list[Any], taken: dict[str, tuple[list[Row], int]], scans: dict[str, Scan]) -> None:
        """A transaction that did not commit: its rows (and scans) go back in front of what came meanwhile, nothing
        lost, nothing reordered; those of a dispatcher closed meanwhile are dropped (its successor replays them)."""
        for d in batch:
            if self.dispatchers.get(d.name) is not d:
                continue
            d.rows = taken[d.name][0] + d.rows
            d.scan = scans.get(d.name, d.scan)
            self.pending_rows += len(taken[d.name][0])
            self.dirty.add(d.name)

    def _take(self, batch: list[Any]) -> tuple[list[Any], dict[str, tuple[list[Row], int]]]:
        """What of ``batch`` goes into one transaction: at most about ``MAX_TRANSACTION_ROWS`` rows, so that a long
        catch-up is committed in pieces while the rest is still being read. A dispatcher's rows are taken up to a
        revision boundary (its checkpoint is then the last revision taken: its rows come in revision order, and every
        change of that revision is among them); an initial scan goes whole (its sweep with it). What is left stays
        with its dispatcher, which stays dirty. Every dispatcher without rows (only its resolved revision moved) goes
        along: it costs nothing."""
        budget = MAX_TRANSACTION_ROWS
        chosen: list[Any] = []
        taken: dict[str, tuple[list[Row], int]] = {}
        for d in batch:
            rows = d.rows
            if rows and budget <= 0:
                self.dirty.add(d.name)
                continue
            cut = len(rows)
            if d.scan is None and cut > budget:
                cut = budget
                while cut < len(rows) and rows[cut][2] == rows[cut - 1][2]:
                    cut += 1
            if cut < len(rows):
                taken[d.name] = (rows[:cut], rows[cut - 1][2])
                d.rows = rows[cut:]
                self.dirty.add(d.name)
            else:
                taken[d.name] = (rows, d.resolved)
                d.rows = []
            budget -= cut
            chosen.append(d)
        return chosen, taken

    def _rows_wait(self) -> bool:
        """Whether a dispatcher that is not paused has rows waiting (left by ``_take``, or received meanwhile)."""
        for name in self.dirty:
            d = self.dispatchers.get(name)
            if d is not None and d.rows and d.paused_at is None:
                return True
        return False

    def _take_dirty(self) -> list[Any]:
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

    def _advance_without_rows(self, batch: list[Any]) -> bool:
        """Checkpoints that only moved (progress notifications of idle spans): when no dispatcher of the batch has a
        row (or a scan, even one that found nothing: its sweep) waiting, every row each received up to its resolved
        revision is already committed (rows leave ``rows`` only into a transaction, and come back if it fails), so its
        checkpoint may move with no transaction at all. The ``checkpoints`` table is brought up to date by the next
        transaction with rows. Not before its table exists (the first transaction creates it), so that verify finds
        every span's table."""
        if (
            self.error
            or any(d.rows or d.scan is not None for d in batch)
            or any((d.dispatcher.table_id, d.dispatcher.mode) not in self.ensured for d in batch)
        ):
            return False
        for d in batch:
            d.durable = max(d.durable, d.resolved)
        return True

    async def _commit(self, batch: list[Any], taken: dict[str, tuple[list[Row], int]], scans: dict[str, Scan]) -> None:
        session = await self._connection()
        for d in batch:
            key = (d.dispatcher.table_id, d.dispatcher.mode)
            if key not in self.ensured:
                self.identity = await session.ensure(key) or self.identity
                self.ensured.add(key)
        per_table: dict[tuple[int, Mode], dict[bytes, Row]] = {}
        for d in batch:
            table = (d.dispatcher.table_id, d.dispatcher.mode)
            # A dispatcher's rows come in revision order (a scan's, all at or below its revision, before its watch's):
            # the last of a key is its newest. Two dispatchers of one table (a span moving between them here) may
            # share keys: those are compared.
            newest = {row[0]: row for row in taken[d.name][0]}
            latest = per_table.get(table)
            if latest is None:
                per_table[table] = newest
                continue
            for k, row in newest.items():
                old = latest.get(k)
                if old is None or old[2] < row[2]:
                    latest[k] = row
        sweeps = [
            Sweep((d.dispatcher.table_id, d.dispatcher.mode), d.dispatcher.key_range.start, d.dispatcher.key_range.end,
                  scans[d.name].at, scans[d.name].keys)
            for d in batch if d.name in scans
        ]  # fmt: skip
        checkpoints = [
            Checkpoint(d.name, d.dispatcher.table_id, d.dispatcher.mode, d.dispatcher.key_range.start,
                       d.dispatcher.key_range.end, taken[d.name][1])
            for d in batch
        ]  # fmt: skip

        def superseded() -> bool:
            # A scan whose dispatcher closed while this transaction ran is not committed. Its close reported a final
            # checkpoint of 0 (nothing committed yet), so its successor starts at 0 and scans again; rows of this older
            # scan landing after that successor's (for keys etcd deleted in between, which its sweep cannot see yet)
            # would stay live behind its checkpoint. What is left is the COMMIT's own round trip: a close then reports
            # 0 while this commits, milliseconds before any successor could have scanned.
            return any(d.name in scans and self.dispatchers.get(d.name) is not d for d in batch)

        written = await session.write(Batch(per_table, sweeps, checkpoints, superseded))
        self.tombstones.dropped += written.dropped
        self.commits += 1
        self.committed_rows += sum(len(r) for r in per_table.values())
