"""A changefeed's tombstone collection on a capture: when its sink writer collects, what, and the figures.

The writer (``batcher.Writer``) waits for work through :meth:`Collector.wait`, which runs a collection between its
transactions every ``interval`` seconds, on the writer's connection, once the changefeed's published checkpoint is
known (:meth:`Collector.publish`, from ``DataplaneRuntime.published``). A collection (``Session.collect``, the
argument in docs/architecture.md, "Tombstone collection") first saves this capture's dispatchers' committed
checkpoints (an idle span's moved with no transaction: the table's frontier follows it), then moves each table's
horizon to min(published checkpoint, the table's committed frontier: ``api.frontier``)
and deletes the tombstones below it, for every (table, mode) the writer has ensured and one of this
capture's dispatchers replicates (a table whose dispatchers all left is collected by the captures that hold them
now, not by every capture that ever wrote it). One that fails is logged and tried again at the next interval: it
never fails the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from controller.capture.logs import fields
from controller.model.keys import KeyRange
from controller.model.progress import SinkFigures
from controller.model.states import Mode
from controller.sinks.api import DELETE_BATCH, DELETE_BATCHES, Checkpoint, Session, frontier

log = logging.getLogger("controller.capture.dataplane")

class Writer(Protocol):
    """What the collector reads of the sink's writer (``batcher.Writer``)."""

    changefeed: str
    conn: Session | None
    ensured: set[tuple[int, Mode]]
    #: The feed's dispatchers by name (``sink.Pending``: ``dispatcher`` and ``durable`` are read).
    dispatchers: dict[str, Any]


@dataclass
class TableFigures:
    """A table's figures after its last collection on this capture."""

    table_id: int
    mode: str
    horizon: int = 0
    tombstones: int = 0
    live_rows: int | None = None
    live_rows_exact: bool = True
    #: Tombstones this capture collected from it, in total.
    collected: int = 0


class Collector:
    def __init__(self, writer: Writer, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.writer = writer
        self.interval = interval
        self.clock = clock
        #: The changefeed's published checkpoint (0: not known yet: nothing is collected).
        self.published = 0
        self.next_at = clock() + interval
        #: Tombstones collected by this capture, collections done, and changes the fence dropped at or below a
        #: horizon (counted in every transaction tried: one retried counts them again).
        self.collected = 0
        self.collections = 0
        self.dropped = 0
        #: The last collection's failure ("" once one succeeds).
        self.error = ""
        #: ``figures``' sums of the tables' figures, and the collection they were summed after.
        self._sums = (0, 0)
        self._figures_at = -1
        self.tables: dict[tuple[int, Mode], TableFigures] = {}

    def publish(self, checkpoint: int) -> None:
        self.published = max(self.published, checkpoint)

    def _due(self) -> bool:
        if self.clock() < self.next_at:
            return False
        if self.published <= 0:  # nothing may be collected before the checkpoint is known: look again later
            self.next_at = self.clock() + self.interval
            return False
        return True

    async def wait(self, wake: asyncio.Event) -> None:
        """Until ``wake`` is set (what the writer waited for before), running a collection whenever one is due."""
        while True:
            if self._due():
                await self.collect()
            if wake.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), max(self.next_at - self.clock(), 0.0))

    def tables_to_collect(self) -> list[tuple[int, Mode]]:
        held = {(d.dispatcher.table_id, d.dispatcher.mode) for d in self.writer.dispatchers.values()}
        return sorted(held & self.writer.ensured, key=lambda t: (t[0], t[1].value))

    async def collect(self) -> None:
        """One collection on the writer's connection (none open: nothing to collect until the writer connects)."""
        self.next_at = self.clock() + self.interval
        conn = self.writer.conn
        tables = self.tables_to_collect()
        if conn is None or not conn.usable or not tables or self.published <= 0:
            return
        cf = self.writer.changefeed
        try:
            await self._save_checkpoints(conn, set(tables))
            spans = await conn.checkpoint_spans(tables)
            more = False
            for table_id, mode in tables:
                # A row read early is no worse than one read late: what a row says stays true, and it only moves up.
                committed = frontier(KeyRange.of_table(table_id), spans.get((table_id, mode), []))
                done = await conn.collect(
                    (table_id, mode), min(self.published, committed), batch=DELETE_BATCH, batches=DELETE_BATCHES
                )
                seen = await conn.figures((table_id, mode))
                f = self.tables.setdefault((table_id, mode), TableFigures(table_id, mode.value))
                moved = done.horizon != f.horizon
                f.horizon, f.tombstones = done.horizon, seen.tombstones
                f.live_rows, f.live_rows_exact = seen.live_rows, seen.live_rows_exact
                f.collected += done.deleted
                self.collected += done.deleted
                more = more or done.more
                log.log(
                    logging.INFO if done.deleted or moved else logging.DEBUG,
                    "tombstones collected",
                    extra=fields(
                        changefeed=cf,
                        table=table_id,
                        mode=mode.value,
                        horizon=done.horizon,
                        deleted=done.deleted,
                        tombstones=seen.tombstones,
                    ),
                )
            self.collections += 1
            self.error = ""
            if more:  # more than a collection deletes at once: the rest at the next wake, between transactions
                self.next_at = self.clock()
        except Exception as exc:  # whatever it is, the writer goes on; the next interval tries again
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning(
                "tombstone collection failed; tried again at the next interval",
                extra=fields(changefeed=cf, error=self.error),
            )
            if not conn.usable:  # the writer connects again (``Writer._connection``: a closed session is replaced)
                await conn.close()

    async def _save_checkpoints(self, conn: Session, tables: set[tuple[int, Mode]]) -> None:
        """This capture's dispatchers' committed checkpoints (``durable``: every change of the span up to it is
        committed), saved as a transaction with rows saves them (never backwards). The writer is between
        transactions here: none of its own is in flight."""
        await conn.save_checkpoints(
            [
                Checkpoint(d.dispatcher.name, d.dispatcher.table_id, d.dispatcher.mode, d.dispatcher.key_range.start,
                           d.dispatcher.key_range.end, d.durable)
                for d in self.writer.dispatchers.values()
                if (d.dispatcher.table_id, d.dispatcher.mode) in tables and d.durable > 0
            ]
        )  # fmt: skip

    def figures(self) -> SinkFigures:
        """The progress report's figures: collected in total, tombstones held and live rows summed over the tables
        after their last collections (summed again only after a collection: a report costs nothing at rest)."""
        if self._figures_at != self.collections:
            self._figures_at = self.collections
            self._sums = (
                sum(f.tombstones for f in self.tables.values()),
                sum(f.live_rows or 0 for f in self.tables.values()),
            )
        tombstones, live_rows = self._sums
        return SinkFigures(
            changefeed=self.writer.changefeed, collected=self.collected, tombstones=tombstones, live_rows=live_rows
        )

    def stats(self) -> dict[str, Any]:
        """Tombstones collected by this capture in total, and each table's horizon, tombstones held and live rows
        after its last collection here (``api.Figures``: live rows exact for a small table, else estimated), with their
        sums."""
        tables = [asdict(f) for _, f in sorted(self.tables.items(), key=lambda kv: (kv[0][0], kv[0][1].value))]
        return {
            "checkpoint": self.published,
            "collections": self.collections,
            "collected": self.collected,
            "dropped": self.dropped,
            "tombstones": sum(f["tombstones"] for f in tables),
            "live_rows": sum(f["live_rows"] or 0 for f in tables),
            "error": self.error,
            "tables": tables,
        }
