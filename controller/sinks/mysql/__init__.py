"""The MySQL-compatible sink (``spec.sink.mysql``): MySQL 8.0, MariaDB 10.11 or later, TiDB, written with asyncmy.

A batch is one transaction (:meth:`MysqlSession.write`), in READ COMMITTED: the fence (the horizons read ``LOCK IN
SHARE MODE``), the sweeps (the scan's keys into a temporary table, one multi-table ``UPDATE`` each), then per table one
multi-row ``INSERT ... ON DUPLICATE KEY UPDATE`` of the batch's changes (only if newer than the row:
``schema.MERGE_TAIL``), split only where a statement would pass ``max_allowed_packet``, and one statement saving every
checkpoint. Rows are sent in key-hash order, so two captures writing the same table (a span moving) lock rows in
the same order; a deadlock or a lock wait timeout all the same is retried like any failed transaction.

Sessions run with strict SQL mode (``STRICT_ALL_TABLES``: a value that does not fit fails the transaction rather
than being cut). Verify reads a REPEATABLE READ snapshot (``START TRANSACTION WITH CONSISTENT SNAPSHOT``).

The client is asyncmy (docs/architecture.md, "Sinks: the seam", says why). The Secret: key ``dsn``,
``mysql://user:password@host:port/`` (user and password percent-encoded; the path, a database, is not used: the
changefeed's tables live in the database ``cfm_<changefeed>``), optionally ``?ssl-mode=`` DISABLED, REQUIRED,
VERIFY_CA or VERIFY_IDENTITY (MySQL's names); ``ca.crt`` (PEM) checks the server, ``tls.crt`` and ``tls.key`` are a
client certificate. Without ``ssl-mode``: VERIFY_IDENTITY when ``ca.crt`` is given, else DISABLED.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncmy
import asyncmy.errors

from controller.model.states import Mode
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
    namespace_of,
    table_name,
)
from controller.sinks.mysql import errors, schema

KIND = "mysql"
SSL_MODES = ("DISABLED", "REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY")
#: A statement's largest size, whatever the server's ``max_allowed_packet`` (a batch is split above it).
MAX_STATEMENT = 8 * 1024 * 1024
#: Live rows are counted exactly below this table size (bytes); above it, the server's estimate.
EXACT_COUNT_BYTES = 16 * 1024 * 1024
#: Seconds a tombstone collection waits for a lock before it gives up until its next turn.
LOCK_WAIT = 2
SESSION_SETUP = (
    "SET SESSION sql_mode = 'STRICT_ALL_TABLES,NO_ENGINE_SUBSTITUTION'",
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
)


def from_secret(changefeed: str, data: Mapping[str, str]) -> MysqlSink:
    dsn = data.get("dsn", "").strip()
    if not dsn:
        raise Unusable("no key dsn (mysql://user:password@host:port/)")
    try:
        url = urllib.parse.urlsplit(dsn)
        port = url.port or 3306
    except ValueError:
        raise Unusable("dsn is not a mysql:// URL (its port is not a number?)") from None
    if url.scheme != "mysql":
        raise Unusable("dsn is not a mysql:// URL")
    if not url.hostname:
        raise Unusable("dsn names no host (mysql://user:password@host:port/)")
    query = urllib.parse.parse_qs(url.query)
    unknown = sorted(set(query) - {"ssl-mode"})
    if unknown:
        raise Unusable(f"dsn has an unknown parameter {unknown[0]!r} (known: ssl-mode)")
    ca, cert, key = data.get("ca.crt", ""), data.get("tls.crt", ""), data.get("tls.key", "")
    mode = (query.get("ssl-mode", [""])[0] or ("VERIFY_IDENTITY" if ca else "DISABLED")).upper()
    if mode not in SSL_MODES:
        raise Unusable(f"dsn's ssl-mode must be one of {', '.join(SSL_MODES)}")
    if bool(cert) != bool(key):
        raise Unusable("a client certificate needs both tls.crt and tls.key")
    if mode == "DISABLED" and (ca or cert):
        raise Unusable("ca.crt or tls.crt given with ssl-mode=DISABLED: set ssl-mode (REQUIRED, VERIFY_CA, ...)")
    try:
        context = _context(mode, ca, cert, key)
    except (ssl.SSLError, ValueError) as exc:
        raise Unusable(
            f"its TLS material cannot be used ({type(exc).__name__}: check ca.crt, tls.crt, tls.key)"
        ) from None
    return MysqlSink(
        changefeed,
        host=url.hostname,
        port=port,
        user=urllib.parse.unquote(url.username or ""),
        password=urllib.parse.unquote(url.password or ""),
        ssl_mode=mode,
        tls=(ca, cert, key),
        context=context,
    )


def _context(mode: str, ca: str, cert: str, key: str) -> ssl.SSLContext | None:
    if mode == "DISABLED":
        return None
    context = ssl.create_default_context()
    if ca:
        context = ssl.create_default_context(cadata=ca)
    if mode in ("REQUIRED", "VERIFY_CA"):
        context.check_hostname = False
    if mode == "REQUIRED":
        context.verify_mode = ssl.CERT_NONE
    if cert:
        # The standard library loads a client certificate from files only: written for the moment it is read.
        with tempfile.TemporaryDirectory(prefix="cfm-mysql-tls-") as d:
            path = os.path.join(d, "client.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(cert.rstrip() + "\n" + key.rstrip() + "\n")
            context.load_cert_chain(path)
    return context


@dataclass(frozen=True)
class MysqlSink:
    changefeed: str
    host: str
    port: int
    user: str
    password: str = field(repr=False)
    ssl_mode: str = "DISABLED"
    tls: tuple[str, str, str] = field(default=("", "", ""), repr=False)
    context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    kind: str = KIND

    def __repr__(self) -> str:
        return f"MysqlSink({self.changefeed!r}, {self.describe()})"

    def describe(self) -> str:
        return f"mysql host={self.host} port={self.port} user={self.user}"

    def errors(self) -> tuple[type[BaseException], ...]:
        return (asyncmy.errors.Error, OSError, TimeoutError)

    def trouble(self, exc: BaseException) -> tuple[bool, str]:
        return errors.sink_trouble(exc, self.password)

    async def _connect(self, wait: float) -> tuple[Any, int]:
        """A connection set up (``SESSION_SETUP``), and the largest statement it may send."""
        conn = await asyncmy.connect(
            host=self.host, port=self.port, user=self.user, password=self.password, ssl=self.context,
            connect_timeout=wait, autocommit=False, max_allowed_packet=64 * 1024 * 1024,
        )  # fmt: skip
        try:
            async with conn.cursor() as cur:
                for statement in SESSION_SETUP:
                    await cur.execute(statement)
                await cur.execute("SELECT @@max_allowed_packet")
                (packet,) = await cur.fetchone()
            await conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn, max(64 * 1024, min(int(packet) - 64 * 1024, MAX_STATEMENT))

    async def connect(self) -> MysqlSession:
        return MysqlSession(self.changefeed, *await self._connect(5))

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[MysqlSnapshot]:
        conn, _ = await self._connect(10)
        try:
            async with conn.cursor() as cur:
                await cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
            yield MysqlSnapshot(self.changefeed, conn)
        finally:
            with contextlib.suppress(Exception):
                await conn.rollback()
            conn.close()


def _hash(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class MysqlSession:
    def __init__(self, changefeed: str, conn: Any, limit: int) -> None:
        self.changefeed = changefeed
        self.conn = conn
        #: The largest statement sent (a batch is split above it).
        self.limit = limit

    @property
    def usable(self) -> bool:
        return bool(self.conn.connected)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()

    async def _run(self, *statements: str) -> int:
        """Statements in the open transaction; returns the last one's affected rows."""
        affected = 0
        async with self.conn.cursor() as cur:
            for statement in statements:
                affected = await cur.execute(statement)
        return int(affected or 0)

    async def _many(self, head: str, values: Iterable[str], tail: str = "") -> None:
        """``head`` + values joined + ``tail``, in as few statements as fit ``limit`` bytes."""
        chunk: list[str] = []
        size = len(head) + len(tail)
        async with self.conn.cursor() as cur:
            for value in values:
                if chunk and size + len(value) + 1 > self.limit:
                    await cur.execute(head + ",".join(chunk) + tail)
                    chunk, size = [], len(head) + len(tail)
                chunk.append(value)
                size += len(value) + 1
            if chunk:
                await cur.execute(head + ",".join(chunk) + tail)

    async def ensure(self, table: Table) -> str:
        await self._run(*schema.create_layout(self.changefeed), *schema.create_table(self.changefeed, *table))
        await self.conn.commit()
        return await self.identity()

    async def identity(self) -> str:
        try:
            async with self.conn.cursor() as cur:
                await cur.execute(schema.read_identity(self.changefeed))
                row = await cur.fetchone()
            await self.conn.commit()
        except asyncmy.errors.ProgrammingError as exc:
            if errors.code(exc) in (errors.NO_SUCH_TABLE, errors.BAD_DB):
                await self.conn.rollback()
                return ""
            raise
        return str(row[0]) if row else ""

    async def write(self, batch: Batch) -> Written:
        cf = self.changefeed
        applied = dropped = 0
        try:
            await self.conn.begin()
            tables = sorted(set(batch.rows) | {s.table for s in batch.sweeps}, key=lambda t: (t[0], t[1].value))
            horizons = dict.fromkeys(tables, 0)
            if tables:
                async with self.conn.cursor() as cur:
                    await cur.execute(schema.fence(cf, tables))
                    for table_id, mode, revision in await cur.fetchall():
                        horizons[(int(table_id), Mode(str(mode)))] = int(revision)
            for s in batch.sweeps:  # before the rows: what the scan found is not swept, whatever this batch holds of it
                if s.at > horizons[s.table]:
                    await self._run(*schema.scanned_table(cf))
                    await self._many(schema.scanned_head(cf), (f"(X'{_hash(k).hex()}')" for k in s.keys))
                    await self._run(schema.sweep(cf, s.table[0], s.table[1], s.lo, s.hi, s.at))
            for (table_id, mode), rows in batch.rows.items():
                fresh = above(rows.values(), horizons[(table_id, mode)])
                dropped += len(rows) - len(fresh)
                applied += len(fresh)
                if fresh:
                    hashed = sorted((_hash(k), k, v, r, d) for k, v, r, d in fresh)
                    await self._many(
                        schema.merge_head(cf, table_id, mode), schema.merge_values(hashed), schema.MERGE_TAIL
                    )
            if batch.checkpoints:
                await self._run(schema.save_checkpoints(cf, batch.checkpoints))
            if batch.superseded():
                raise Superseded()
            await self.conn.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.conn.rollback()
            raise
        return Written(applied, dropped)

    async def save_checkpoints(self, checkpoints: Sequence[Checkpoint]) -> None:
        if checkpoints:
            try:
                await self._run(schema.save_checkpoints(self.changefeed, checkpoints))
                await self.conn.commit()
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.conn.rollback()
                raise

    async def checkpoint_spans(self, tables: Iterable[Table]) -> dict[Table, list[tuple[bytes, bytes, int]]]:
        wanted = {(t, m.value): (t, m) for t, m in tables}
        spans: dict[Table, list[tuple[bytes, bytes, int]]] = {t: [] for t in wanted.values()}
        if wanted:
            async with self.conn.cursor() as cur:
                await cur.execute(schema.checkpoint_spans(self.changefeed, (t for t, _ in wanted)))
                for table_id, mode, start, end, revision in await cur.fetchall():
                    table = wanted.get((int(table_id), str(mode)))
                    if table is not None:
                        spans[table].append((bytes(start), bytes(end), int(revision)))
            await self.conn.commit()
        return spans

    async def collect(self, table: Table, target: int, *, batch: int, batches: int) -> Collected:
        table_id, mode = table
        where = f"table_id = {table_id} AND mode = {schema.lit(mode.value)}"
        h = schema.horizons(self.changefeed)
        t = schema.qualified(self.changefeed, table_id, mode)
        lock = "cfmt:" + hashlib.sha1(t.encode()).hexdigest()
        deleted, more = 0, False
        await self._run(f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT}")
        try:
            if target > 0:  # committed before any tombstone goes: every writer after it reads it, none before holds it
                await self._run(f"UPDATE {h} SET revision = {target} WHERE {where} AND revision < {target}")
                await self.conn.commit()
            async with self.conn.cursor() as cur:
                await cur.execute(f"SELECT revision FROM {h} WHERE {where}")
                found = await cur.fetchone()
            await self.conn.commit()
            horizon = int(found[0]) if found else 0
            if horizon > 0:
                # One capture deletes a table's tombstones at a time (a session lock, released below).
                async with self.conn.cursor() as cur:
                    await cur.execute(f"SELECT GET_LOCK({schema.lit(lock)}, 0)")
                    got = await cur.fetchone()
                if got and got[0] == 1:
                    try:
                        for n in range(batches):
                            # The condition is checked on each row as it is locked: one a writer made newer stays.
                            gone = await self._run(
                                f"DELETE FROM {t} WHERE deleted = 1 AND revision <= {horizon} ORDER BY revision "
                                f"LIMIT {batch}"
                            )
                            await self.conn.commit()
                            deleted += gone
                            if gone < batch:
                                break
                            more = n == batches - 1
                    finally:
                        await self._run(f"DO RELEASE_LOCK({schema.lit(lock)})")
        except BaseException:
            with contextlib.suppress(Exception):
                await self.conn.rollback()
            raise
        finally:
            with contextlib.suppress(Exception):
                await self._run("SET SESSION innodb_lock_wait_timeout = DEFAULT")
        return Collected(table_id, mode, horizon, deleted, more, target)

    async def figures(self, table: Table) -> Figures:
        t = schema.qualified(self.changefeed, *table)
        async with self.conn.cursor() as cur:
            await cur.execute(f"SELECT COUNT(*) FROM {t} WHERE deleted = 1")
            (tombstones,) = await cur.fetchone()
            await cur.execute(
                "SELECT data_length, table_rows FROM information_schema.TABLES WHERE table_schema = "
                f"{schema.lit(namespace_of(self.changefeed))} AND table_name = {schema.lit(table_name(*table))}"
            )
            size, estimate = await cur.fetchone() or (0, None)
            exact = int(size or 0) < EXACT_COUNT_BYTES
            if exact:
                await cur.execute(f"SELECT COUNT(*) FROM {t} WHERE deleted = 0")
                (live,) = await cur.fetchone()
        await self.conn.commit()
        if exact:
            return Figures(int(tombstones), int(live), True)
        return Figures(int(tombstones), None if estimate is None else max(int(estimate) - int(tombstones), 0), False)


class MysqlSnapshot:
    """A REPEATABLE READ transaction started WITH CONSISTENT SNAPSHOT: every read sees one committed state."""

    def __init__(self, changefeed: str, conn: Any) -> None:
        self.changefeed = changefeed
        self.conn = conn

    async def _exists(self, name: str) -> bool:
        async with self.conn.cursor() as cur:
            await cur.execute(
                "SELECT COUNT(*) FROM information_schema.TABLES WHERE table_schema = "
                f"{schema.lit(namespace_of(self.changefeed))} AND table_name = {schema.lit(name)}"
            )
            (n,) = await cur.fetchone()
        return int(n) > 0

    async def horizons(self) -> dict[Table, int]:
        if not await self._exists("horizons"):
            return {}
        async with self.conn.cursor() as cur:
            await cur.execute(f"SELECT table_id, mode, revision FROM {schema.horizons(self.changefeed)}")
            return {(int(t), Mode(str(m))): int(r) for t, m, r in await cur.fetchall()}

    async def rows(self, table: Table, lo: bytes, hi: bytes) -> list[StoredRow] | None:
        if not await self._exists(table_name(*table)):
            return None
        async with self.conn.cursor() as cur:
            await cur.execute(schema.rows_in_range(self.changefeed, table[0], table[1], lo, hi))
            found = await cur.fetchall()
        return [StoredRow(bytes(k), None if v is None else bytes(v), int(r), bool(d)) for k, v, r, d in found]
