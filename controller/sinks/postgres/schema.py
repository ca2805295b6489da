"""The sink's layout in PostgreSQL: the contract between the dispatchers that write it and ``verify`` that reads it.

One PostgreSQL schema per changefeed (``cfm_<changefeed>``, ``-`` made ``_``) holds:

- per Table and mode, ``t<tableID>`` (default mode) and ``t<tableID>_redo`` (redo mode): one row per upstream key,
  ``key bytea PRIMARY KEY, value bytea, revision bigint NOT NULL, deleted boolean NOT NULL``. ``revision`` is the
  etcd ``mod_revision`` of the change the row holds; a delete keeps the row as a tombstone (``deleted``, value
  NULL) with the delete's revision (for a key an initial scan no longer finds, the scan's: ``sweep``), so that an
  older put replayed after a failover cannot resurrect the key; a partial index on ``revision WHERE deleted``
  finds the tombstones;
- ``checkpoints``: per dispatcher, the revision up to which every change of its span has been applied
  (``dispatcher text PRIMARY KEY, table_id bigint, mode text, span_start bytea, span_end bytea, revision bigint,
  updated_at timestamptz``), written in the same transaction as the rows it covers;
- ``horizons``: per table and mode, the tombstone collection horizon H (``table_id bigint, mode text, revision
  bigint``, primary key (table_id, mode)): every change of the table with revision <= H is committed in the sink,
  and the tombstones at or below H are collected (deleted). Every transaction that writes a table reads its
  horizon first (``FOR SHARE``) and drops the changes at or below it, so a put older than a collected tombstone
  is never applied: tombstones only outlive H until a collection (``controller.sinks.postgres.horizon``).

A change is applied only if it is newer than what the row holds (``APPLY``: ``ON CONFLICT ... WHERE
row.revision < new.revision``): replays are idempotent and never move a row backwards (TiCDC's safe mode,
made exact by the upstream revision).
"""

from __future__ import annotations

import re

from controller.model.states import Mode

#: Columns of a table's rows, in the order ``APPLY`` takes them.
ROW_COLUMNS = ("key", "value", "revision", "deleted")


def schema_name(changefeed: str) -> str:
    """The PostgreSQL schema of ``changefeed`` (a Kubernetes name: lowercase letters, digits, ``-`` and ``.``)."""
    return "cfm_" + re.sub(r"[^a-z0-9_]", "_", changefeed.lower())


def table_name(table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    return f"t{table_id}" if mode is Mode.DEFAULT else f"t{table_id}_redo"


def _q(ident: str) -> str:
    """``ident`` quoted as a PostgreSQL identifier (the names above never hold a quote; this keeps it so)."""
    if '"' in ident or "\x00" in ident:
        raise ValueError(f"not an identifier: {ident!r}")
    return f'"{ident}"'


def qualified(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    return f"{_q(schema_name(changefeed))}.{_q(table_name(table_id, mode))}"


def checkpoints(changefeed: str) -> str:
    return f"{_q(schema_name(changefeed))}.{_q('checkpoints')}"


def horizons(changefeed: str) -> str:
    return f"{_q(schema_name(changefeed))}.{_q('horizons')}"


def create_schema(changefeed: str) -> str:
    return (
        f"CREATE SCHEMA IF NOT EXISTS {_q(schema_name(changefeed))};\n"
        f"CREATE TABLE IF NOT EXISTS {checkpoints(changefeed)} ("
        "dispatcher text PRIMARY KEY, table_id bigint NOT NULL, mode text NOT NULL, span_start bytea NOT NULL, "
        "span_end bytea NOT NULL, revision bigint NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());\n"
        f"CREATE TABLE IF NOT EXISTS {horizons(changefeed)} ("
        "table_id bigint NOT NULL, mode text NOT NULL, revision bigint NOT NULL DEFAULT 0, "
        "PRIMARY KEY (table_id, mode));\n"
        f"CREATE TABLE IF NOT EXISTS {identity(changefeed)} (id text PRIMARY KEY);\n"
        f"INSERT INTO {identity(changefeed)} SELECT gen_random_uuid()::text "
        f"WHERE NOT EXISTS (SELECT 1 FROM {identity(changefeed)})"
    )


def identity(changefeed: str) -> str:
    """A table of one row, made with the schema: a random id naming this sink, so that a changed DSN that reaches
    another database (which does not hold the rows the checkpoints claim) is told apart from one that reaches the
    same database another way (a moved host, a failed-over primary, new credentials)."""
    return f"{_q(schema_name(changefeed))}.{_q('identity')}"


def read_identity(changefeed: str) -> str:
    return f"SELECT id FROM {identity(changefeed)} ORDER BY id LIMIT 1"


def create_table(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {qualified(changefeed, table_id, mode)} "
        "(key bytea PRIMARY KEY, value bytea, revision bigint NOT NULL, deleted boolean NOT NULL DEFAULT false)"
    )


def create_tombstone_index(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    """The partial index through which tombstones are counted and collected without reading live rows."""
    index = _q(f"{table_name(table_id, mode)}_tombstones")
    return f"CREATE INDEX IF NOT EXISTS {index} ON {qualified(changefeed, table_id, mode)} (revision) WHERE deleted"


def create_horizon(changefeed: str) -> str:
    """A table's horizon row at 0, if it has none (placeholders: table_id, mode)."""
    return (
        f"INSERT INTO {horizons(changefeed)} (table_id, mode, revision) VALUES (%s, %s, 0) "
        "ON CONFLICT (table_id, mode) DO NOTHING"
    )


def apply(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    """One change (key, value, revision, deleted) applied if newer than the row (``%s`` placeholders)."""
    t = qualified(changefeed, table_id, mode)
    return (
        f"INSERT INTO {t} AS row (key, value, revision, deleted) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, revision = EXCLUDED.revision, "
        "deleted = EXCLUDED.deleted WHERE row.revision < EXCLUDED.revision"
    )


#: The per-connection temporary table a batch is copied into before its merge (``stage`` then ``merge``).
STAGED = "cfm_staged"


def stage() -> tuple[str, str]:
    """The staging of a batch: the temporary table (made once per connection, emptied at each commit) and the
    binary COPY into it of the batch's changes (key, value, revision, deleted). COPY then one merge (``merge``)
    writes a batch with one round trip of data and one statement, and costs the client least: measured against one
    ``INSERT ... SELECT FROM unnest(arrays)`` (bench/README.md), whose arrays the client builds row by row."""
    return (
        f"CREATE TEMPORARY TABLE IF NOT EXISTS {STAGED} (key bytea NOT NULL, value bytea, revision bigint NOT NULL, "
        "deleted boolean NOT NULL) ON COMMIT DELETE ROWS",
        f"COPY {STAGED} (key, value, revision, deleted) FROM STDIN (FORMAT BINARY)",
    )


#: The column types of ``stage``'s COPY, in its order.
STAGED_TYPES = ("bytea", "bytea", "int8", "bool")


def merge(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    """The staged batch merged into a table, each change only if newer than its row (``apply``'s rule), and the
    staging emptied for the next table of the same transaction. The keys must be distinct (``ON CONFLICT DO
    UPDATE`` touches a row at most once per statement): the writer keeps the newest change per key of a batch."""
    t = qualified(changefeed, table_id, mode)
    return (
        f"WITH batch AS (DELETE FROM {STAGED} RETURNING key, value, revision, deleted) "
        f"INSERT INTO {t} AS row (key, value, revision, deleted) SELECT key, value, revision, deleted FROM batch "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, revision = EXCLUDED.revision, "
        "deleted = EXCLUDED.deleted WHERE row.revision < EXCLUDED.revision"
    )


def sweep(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    """An initial scan's deletes (named placeholders ``lo``, ``hi``, ``at``, ``keys``): every live row of
    ``lo <= key < hi`` older than the scan's revision ``at`` whose key the scan did not find (``keys``) becomes a
    tombstone at ``at``. A scan reads only what is there, so without this a key that a predecessor wrote downstream
    and that etcd deleted before the scan would stay live while the checkpoint says its delete was applied (a
    successor starts at 0 when the maintainer never learned its predecessor's checkpoint: the capture died between
    its first commit and its first report). Rows at or after ``at`` are newer than what the scan saw: untouched."""
    t = qualified(changefeed, table_id, mode)
    return (
        f"UPDATE {t} AS row SET value = NULL, revision = %(at)s, deleted = true "
        "WHERE row.key >= %(lo)s AND row.key < %(hi)s AND row.revision < %(at)s AND NOT row.deleted "
        "AND NOT EXISTS (SELECT 1 FROM unnest(%(keys)s::bytea[]) AS scanned(key) WHERE scanned.key = row.key)"
    )


def save_checkpoint(changefeed: str) -> str:
    """A dispatcher's checkpoint (dispatcher, table_id, mode, span_start, span_end, revision); never backwards.
    The row's span moves with its revision, so that the row always says what it covers (a tombstone collection
    reads the rows as "every change of the span up to the revision is committed": ``horizon.frontier``)."""
    c = checkpoints(changefeed)
    return (
        f"INSERT INTO {c} AS cp (dispatcher, table_id, mode, span_start, span_end, revision) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (dispatcher) DO UPDATE SET revision = EXCLUDED.revision, "
        "table_id = EXCLUDED.table_id, mode = EXCLUDED.mode, span_start = EXCLUDED.span_start, "
        "span_end = EXCLUDED.span_end, updated_at = now() WHERE cp.revision < EXCLUDED.revision"
    )


def save_checkpoints(changefeed: str) -> str:
    """``save_checkpoint`` for many dispatchers (distinct) in one statement: six arrays (dispatchers, table ids,
    modes, span starts, span ends, revisions)."""
    c = checkpoints(changefeed)
    return (
        f"INSERT INTO {c} AS cp (dispatcher, table_id, mode, span_start, span_end, revision) "
        "SELECT * FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::bytea[], %s::bytea[], %s::bigint[]) "
        "ON CONFLICT (dispatcher) DO UPDATE SET revision = EXCLUDED.revision, "
        "table_id = EXCLUDED.table_id, mode = EXCLUDED.mode, span_start = EXCLUDED.span_start, "
        "span_end = EXCLUDED.span_end, updated_at = now() WHERE cp.revision < EXCLUDED.revision"
    )


def rows_in_range(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    """Every row (tombstones included) with ``%s <= key < %s``, in key order."""
    return (
        f"SELECT key, value, revision, deleted FROM {qualified(changefeed, table_id, mode)} "
        "WHERE key >= %s AND key < %s ORDER BY key"
    )
