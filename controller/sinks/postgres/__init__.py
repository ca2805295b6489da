"""The PostgreSQL sink (``spec.sink.postgres``): one schema per changefeed, written with psycopg 3.

A batch is one transaction (:meth:`PostgresSession.write`): the fence (``horizon.fence``), the sweeps, then per
table a binary COPY of the batch's changes into a temporary table and one merge (``schema.stage``, ``schema.merge``:
only if newer than the row), and one statement saving every checkpoint over ``unnest`` arrays. COPY and one merge
cost the client least: measured against one ``INSERT ... SELECT FROM unnest(arrays)`` in bench/README.md. Requires
PostgreSQL 13 or later (``gen_random_uuid`` for the identity row).

The Secret: key ``dsn``, a libpq connection string or ``postgresql://`` URI (TLS with its ``sslmode``,
``sslrootcert``, ``sslcert``, ``sslkey``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import psycopg.conninfo

from controller.sinks.api import (
    Batch,
    Checkpoint,
    Collected,
    Figures,
    StoredRow,
    Superseded,
    Table,
    Unusable,
    Written,
    above,
)
from controller.sinks.postgres import errors, horizon, schema

KIND = "postgres"


def from_secret(changefeed: str, data: Mapping[str, str]) -> PostgresSink:
    dsn = data.get("dsn", "")
    if not dsn.strip():
        raise Unusable("no key dsn (a libpq connection string or postgresql:// URI)")
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:  # its words may quote the DSN: not repeated
        raise Unusable("dsn is not a libpq connection string (key=value ...) nor a URI") from None
    if "@" in str(params.get("host") or ""):  # the host quoted nowhere: it holds the rest of the password
        raise Unusable("dsn's host holds an @: percent-encode @, / and : in a URI's password")
    return PostgresSink(changefeed, dsn)


@dataclass(frozen=True)
class PostgresSink:
    changefeed: str
    dsn: str = field(repr=False)
    kind: str = KIND

    def __repr__(self) -> str:
        return f"PostgresSink({self.changefeed!r}, {self.describe()})"

    def describe(self) -> str:
        try:
            p = psycopg.conninfo.conninfo_to_dict(self.dsn)
        except psycopg.Error:
            return "postgres (an unparsable dsn)"
        return f"postgres host={p.get('host', '')} port={p.get('port', '')} dbname={p.get('dbname', '')}"

    def errors(self) -> tuple[type[BaseException], ...]:
        return (psycopg.Error, OSError)

    def trouble(self, exc: BaseException) -> tuple[bool, str]:
        return errors.sink_trouble(exc, self.dsn)

    async def connect(self) -> PostgresSession:
        conn = await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=5)
        return PostgresSession(self.changefeed, conn)

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[PostgresSnapshot]:
        conn = await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=10)
        try:
            await conn.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
            await conn.set_read_only(True)
            async with conn.transaction():
                yield PostgresSnapshot(self.changefeed, conn)
        finally:
            with contextlib.suppress(Exception):
                await conn.close()


class PostgresSession:
    def __init__(self, changefeed: str, conn: psycopg.AsyncConnection[Any]) -> None:
        self.changefeed = changefeed
        self.conn = conn

    @property
    def usable(self) -> bool:
        return not (self.conn.closed or self.conn.broken)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.conn.close()

    async def ensure(self, table: Table) -> str:
        table_id, mode = table
        conn = self.conn
        for attempt in range(3):
            try:
                async with conn.transaction():
                    for statement in schema.create_schema(self.changefeed).split(";\n"):
                        await conn.execute(statement)
                    await conn.execute(schema.create_table(self.changefeed, table_id, mode))
                    await horizon.ensure(conn, self.changefeed, table_id, mode)
                    row = await (await conn.execute(schema.read_identity(self.changefeed))).fetchone()
                break
            except psycopg.errors.UniqueViolation:  # another capture created it at the same moment
                if attempt == 2:
                    raise
        return str(row[0]) if row else ""

    async def identity(self) -> str:
        try:
            async with self.conn.transaction():
                row = await (await self.conn.execute(schema.read_identity(self.changefeed))).fetchone()
        except psycopg.errors.UndefinedTable:
            return ""
        return str(row[0]) if row else ""

    async def write(self, batch: Batch) -> Written:
        cf = self.changefeed
        applied = dropped = 0
        async with self.conn.transaction(), self.conn.cursor() as cur:
            # First the fence: the horizons of the tables written, share-locked. Changes at or below one are committed
            # already (or superseded), and one older than a tombstone collected would resurrect its key: dropped. A
            # scan at or below it has nothing left to sweep.
            tables = set(batch.rows) | {s.table for s in batch.sweeps}
            horizons = await horizon.fence(cur, cf, tables)
            for s in batch.sweeps:  # before the rows: what the scan found is not swept, whatever this batch holds of it
                if s.at > horizons[s.table]:
                    await cur.execute(
                        schema.sweep(cf, *s.table), {"lo": s.lo, "hi": s.hi, "at": s.at, "keys": list(s.keys)}
                    )
            for (table_id, mode), rows in batch.rows.items():
                fresh = above(rows.values(), horizons[(table_id, mode)])
                dropped += len(rows) - len(fresh)
                applied += len(fresh)
                if fresh:  # per table: a binary COPY into the staging table and one merge (keys distinct)
                    create, copy_in = schema.stage()
                    await cur.execute(create)
                    async with cur.copy(copy_in) as copy:
                        copy.set_types(list(schema.STAGED_TYPES))
                        for row in fresh:
                            await copy.write_row(row)
                    await cur.execute(schema.merge(cf, table_id, mode))
            if batch.checkpoints:
                await cur.execute(schema.save_checkpoints(cf), _columns(batch.checkpoints))
            # Last: a scan whose dispatcher closed while this transaction ran is not committed (the writer's
            # ``superseded``): its successor scans again, and this older scan landing after it would stay behind.
            if batch.superseded():
                raise Superseded()
        return Written(applied, dropped)

    async def save_checkpoints(self, checkpoints: Sequence[Checkpoint]) -> None:
        if checkpoints:
            async with self.conn.transaction(), self.conn.cursor() as cur:
                await cur.execute(schema.save_checkpoints(self.changefeed), _columns(checkpoints))

    async def checkpoint_spans(self, tables: Iterable[Table]) -> dict[Table, list[tuple[bytes, bytes, int]]]:
        return await horizon.checkpoint_spans(self.conn, self.changefeed, list(tables))

    async def collect(self, table: Table, target: int, *, batch: int, batches: int) -> Collected:
        return await horizon.collect(
            self.conn, self.changefeed, table[0], table[1], target, committed=target, batch=batch, batches=batches
        )

    async def figures(self, table: Table) -> Figures:
        return await horizon.figures(self.conn, self.changefeed, *table)


def _columns(checkpoints: Sequence[Checkpoint]) -> list[list[Any]]:
    return [
        [c.dispatcher for c in checkpoints],
        [c.table_id for c in checkpoints],
        [c.mode.value for c in checkpoints],
        [c.start for c in checkpoints],
        [c.end for c in checkpoints],
        [c.revision for c in checkpoints],
    ]


class PostgresSnapshot:
    """A REPEATABLE READ, read-only transaction: every read sees one snapshot."""

    def __init__(self, changefeed: str, conn: psycopg.AsyncConnection[Any]) -> None:
        self.changefeed = changefeed
        self.conn = conn

    async def horizons(self) -> dict[Table, int]:
        return await horizon.read(self.conn, self.changefeed)

    async def rows(self, table: Table, lo: bytes, hi: bytes) -> list[StoredRow] | None:
        name = schema.qualified(self.changefeed, *table)
        cur = await self.conn.execute("SELECT to_regclass(%s)", (name,))
        found = await cur.fetchone()
        if found is None or found[0] is None:
            return None
        cur = await self.conn.execute(schema.rows_in_range(self.changefeed, *table), (lo, hi))
        found = await cur.fetchall()
        return [StoredRow(bytes(k), None if v is None else bytes(v), int(r), bool(d)) for k, v, r, d in found]
