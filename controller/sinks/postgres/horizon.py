"""Tombstone collection in the sink: the horizon, the fence every writing transaction passes, and the collection.

The argument is in docs/architecture.md, "Tombstone collection"; in short:

- Each table and mode has a horizon H (``schema.horizons``): every change of it with revision <= H is committed in
  the sink. It only moves up. Tombstones at or below it may be deleted (:func:`collect`).
- Every transaction that writes a table first reads its horizon with ``FOR SHARE`` (:func:`fence`) and applies only
  the changes above it (:func:`above`); a scan's sweep at or below it is skipped. A put older than a collected
  tombstone is at or below H, so it is dropped, however late it comes and whoever sends it (a successor started
  below the tombstone, a transaction of a closed or fenced dispatcher, an initial scan replayed).
- The collection moves H with an ``UPDATE`` (the row's exclusive lock: it waits for every transaction holding
  the share lock, and those that come after read the new H), commits, and only then deletes the tombstones at or
  below the horizon it reads back.
- H = min(C, F): C the changefeed's published checkpoint (so verify, at a revision >= H <= C, stays exact), F the
  sink's committed frontier of the table from its ``checkpoints`` rows (:func:`frontier`; 0 while any part of the
  table's range is covered by none, e.g. a new table not scanned yet, whose scan's rows must not be dropped).

Every statement runs in READ COMMITTED (PostgreSQL's default): a ``FOR SHARE`` that waited for the collection's
``UPDATE`` returns the updated row. (Under REPEATABLE READ it fails with a serialization error instead, and the
writer retries the transaction: never a stale horizon.)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import psycopg

from controller.model.keys import KeyRange
from controller.model.states import Mode
from controller.sinks.api import DELETE_BATCH, DELETE_BATCHES, Collected, Figures, frontier
from controller.sinks.api import Table as Table
from controller.sinks.postgres import schema

#: How long a collection waits for a lock (the horizon row behind an open writing transaction, a tombstone a
#: writer is updating) before it gives up until its next turn: a capture stopped with a transaction open must not
#: hold the writer that collects.
LOCK_TIMEOUT = "2s"
#: The first key of the advisory lock a collection holds while it deletes a table's tombstones (the second: a hash
#: of the table's qualified name).
ADVISORY = 0x6366_6D74  # "cfmt"
#: Live rows are counted exactly below this table size (bytes); above it, estimated (:func:`figures`).
EXACT_COUNT_BYTES = 16 * 1024 * 1024


async def ensure(conn: psycopg.AsyncConnection[Any], changefeed: str, table_id: int, mode: Mode) -> None:
    """The table's tombstone index and its horizon row (at 0 if new), in the caller's transaction, after the table
    was created (``schema.create_schema`` creates the ``horizons`` table)."""
    await conn.execute(schema.create_tombstone_index(changefeed, table_id, mode))
    await conn.execute(schema.create_horizon(changefeed), (table_id, mode.value))


async def fence(cur: psycopg.AsyncCursor[Any], changefeed: str, tables: Collection[Table]) -> dict[Table, int]:
    """The horizons of ``tables``, share-locked until the caller's transaction ends: the first statement of every
    transaction that writes them. A table with no horizon row reads 0 (no collection can have deleted anything of
    it: a collection deletes only up to the horizon it reads back)."""
    out = dict.fromkeys(tables, 0)
    if not out:
        return out
    values = ", ".join(["(%s::bigint, %s::text)"] * len(out))
    await cur.execute(
        f"SELECT h.table_id, h.mode, h.revision FROM {schema.horizons(changefeed)} AS h "
        f"WHERE (h.table_id, h.mode) IN (VALUES {values}) ORDER BY h.table_id, h.mode FOR SHARE OF h",
        [v for table_id, mode in out for v in (table_id, mode.value)],
    )
    for table_id, mode, revision in await cur.fetchall():
        out[(int(table_id), Mode(mode))] = int(revision)
    return out


async def read(conn: psycopg.AsyncConnection[Any], changefeed: str) -> dict[Table, int]:
    """Every horizon of the changefeed's sink, in the caller's transaction (verify: its snapshot), no lock; empty if
    the sink has no ``horizons`` table (written by a version before tombstone collection)."""
    cur = await conn.execute("SELECT to_regclass(%s)", (schema.horizons(changefeed),))
    found = await cur.fetchone()
    if found is None or found[0] is None:
        return {}
    cur = await conn.execute(f"SELECT table_id, mode, revision FROM {schema.horizons(changefeed)}")
    return {(int(t), Mode(m)): int(r) for t, m, r in await cur.fetchall()}


async def checkpoint_spans(
    conn: psycopg.AsyncConnection[Any], changefeed: str, tables: Collection[Table]
) -> dict[Table, list[tuple[bytes, bytes, int]]]:
    """Every ``checkpoints`` row of ``tables`` (span start, span end, revision), read once for all of them (in a
    transaction of its own)."""
    wanted = {(t, m.value): (t, m) for t, m in tables}
    spans: dict[Table, list[tuple[bytes, bytes, int]]] = {t: [] for t in wanted.values()}
    if wanted:
        async with conn.transaction():
            cur = await conn.execute(
                f"SELECT table_id, mode, span_start, span_end, revision FROM {schema.checkpoints(changefeed)} "
                "WHERE table_id = ANY(%s)",
                (sorted({t for t, _ in wanted}),),
            )
            for table_id, mode, start, end, revision in await cur.fetchall():
                table = wanted.get((int(table_id), str(mode)))
                if table is not None:
                    spans[table].append((bytes(start), bytes(end), int(revision)))
    return spans


async def frontiers(conn: psycopg.AsyncConnection[Any], changefeed: str, tables: Collection[Table]) -> dict[Table, int]:
    """The committed :func:`~controller.sinks.api.frontier` of each of ``tables`` from the ``checkpoints`` rows. A row
    read early is no worse than one read late: what a row says stays true, and it only moves up."""
    spans = await checkpoint_spans(conn, changefeed, tables)
    return {table: frontier(KeyRange.of_table(table[0]), rows) for table, rows in spans.items()}


async def collect(
    conn: psycopg.AsyncConnection[Any],
    changefeed: str,
    table_id: int,
    mode: Mode,
    checkpoint: int,
    *,
    committed: int | None = None,
    batch: int = DELETE_BATCH,
    batches: int = DELETE_BATCHES,
) -> Collected:
    """Move the table's horizon up to min(``checkpoint``, its committed frontier) and delete the tombstones at or
    below it. ``checkpoint``: the changefeed's published checkpoint; ``committed``: the table's frontier if the
    caller read it (:func:`frontiers`), else it is read here. Transactions of its own on ``conn`` (which must have
    none open); a lock waited for past ``LOCK_TIMEOUT`` raises (``psycopg.errors.LockNotAvailable``)."""
    horizons = schema.horizons(changefeed)
    key = (table_id, mode.value)
    if committed is None:
        committed = (await frontiers(conn, changefeed, [(table_id, mode)]))[(table_id, mode)]
    target = min(checkpoint, committed)
    async with conn.transaction():
        await conn.execute("SELECT set_config('lock_timeout', %s, true)", (LOCK_TIMEOUT,))
        if target > 0:
            await conn.execute(
                f"UPDATE {horizons} SET revision = %s WHERE table_id = %s AND mode = %s AND revision < %s",
                (target, *key, target),
            )
    # Committed: every transaction that begins now reads it, and every one that read a lower horizon has ended (the
    # UPDATE waited for its share lock). So the tombstones at or below the horizon may go, in transactions of their
    # own: the horizon row is not held meanwhile. The horizon read back bounds them (another capture's may be higher;
    # no row: 0, nothing goes).
    async with conn.transaction():
        cur = await conn.execute(f"SELECT revision FROM {horizons} WHERE table_id = %s AND mode = %s", key)
        found = await cur.fetchone()
    horizon = int(found[0]) if found is not None else 0
    t = schema.qualified(changefeed, table_id, mode)
    deleted = 0
    more = False
    if horizon > 0:
        for n in range(batches):
            async with conn.transaction():
                await conn.execute("SELECT set_config('lock_timeout', %s, true)", (LOCK_TIMEOUT,))
                # One capture deletes a table's tombstones at a time: two deleting the same rows in different orders
                # could deadlock, and would do the work twice. The other leaves them to it (their horizon is the same
                # row: what one deletes is what the other would).
                cur = await conn.execute("SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))", (ADVISORY, t))
                got = await cur.fetchone()
                if got is None or not got[0]:
                    break
                # The condition again on the row itself: one a writer made newer meanwhile (a put after the delete)
                # is re-checked when its lock is granted, and stays.
                cur = await conn.execute(
                    f"DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE deleted AND revision <= %s LIMIT %s) "
                    "AND deleted AND revision <= %s",
                    (horizon, batch, horizon),
                )
                gone = max(cur.rowcount, 0)
            deleted += gone
            if gone < batch:
                break
            more = n == batches - 1
    return Collected(table_id, mode, horizon, deleted, more, target)


async def figures(conn: psycopg.AsyncConnection[Any], changefeed: str, table_id: int, mode: Mode) -> Figures:
    """:class:`Figures` of a table, in a transaction of its own (cheap: neither reads the live rows of a large
    table)."""
    t = schema.qualified(changefeed, table_id, mode)
    async with conn.transaction():
        cur = await conn.execute(
            f"SELECT (SELECT count(*) FROM {t} WHERE deleted), pg_relation_size(%s::regclass), "
            "(SELECT reltuples FROM pg_class WHERE oid = %s::regclass)",
            (t, t),
        )
        found = await cur.fetchone()
        assert found is not None
        tombstones, size, reltuples = int(found[0]), int(found[1]), float(found[2])
        if size < EXACT_COUNT_BYTES:
            cur = await conn.execute(f"SELECT count(*) FROM {t} WHERE NOT deleted")
            live = await cur.fetchone()
            return Figures(tombstones, int(live[0]) if live is not None else 0, True)
    return Figures(tombstones, max(int(reltuples) - tombstones, 0) if reltuples >= 0 else None, False)
