"""The MySQL sink's layout and statements: the contract between the writers and verify, as
``controller.sinks.postgres.schema`` is for PostgreSQL, in the dialect MySQL 8.0, MariaDB 10.11+ and TiDB share.

One database per changefeed (``cfm_<changefeed>``: ``api.namespace_of``) holds:

- per Table and mode, ``t<tableID>`` / ``t<tableID>_redo``: ``key_hash BINARY(32) PRIMARY KEY`` (SHA-256 of the key),
  ``k LONGBLOB`` (the key), ``v LONGBLOB`` (the value, NULL in a tombstone), ``revision BIGINT``, ``deleted BOOL``.
  InnoDB indexes at most 3,072 bytes of a key and etcd keys may be far longer (up to its request limit, 1.5 MiB
  by default): the primary key is the key's SHA-256, so any key works, and the key's first 3,072 bytes are indexed
  (``key_order``) for the range reads (verify, the sweep), which compare the whole key. ``(deleted, revision)`` is
  indexed for the tombstone collection;
- ``checkpoints``, ``horizons``, ``identity``: as in PostgreSQL.

Dialect features relied on, all three servers have them: ``INSERT ... ON DUPLICATE KEY UPDATE`` with ``VALUES()``
(deprecated but kept by MySQL 8.0; MariaDB's own; TiDB's), hex literals ``X'..'`` for every value sent (no string
escaping, no character set conversion), ``LOCK IN SHARE MODE``, multi-table ``UPDATE``, ``DELETE ... LIMIT``,
temporary tables, ``GET_LOCK``, ``START TRANSACTION WITH CONSISTENT SNAPSHOT``.

``ON DUPLICATE KEY UPDATE`` assigns left to right, each assignment seeing the columns already assigned: every
column is assigned ``IF(revision < VALUES(revision), new, old)`` and ``revision`` itself last, so every condition
reads the row's revision from before the statement (:func:`merge`; tests/dataplane/test_mysql_sink.py proves it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from controller.model.states import Mode
from controller.sinks.api import Checkpoint, namespace_of, table_name

#: InnoDB's largest index key prefix (ROW_FORMAT DYNAMIC or COMPRESSED), in bytes.
KEY_PREFIX = 3072


def q(ident: str) -> str:
    """``ident`` quoted as a MySQL identifier (the names here never hold a backquote; this keeps it so)."""
    if "`" in ident or "\x00" in ident:
        raise ValueError(f"not an identifier: {ident!r}")
    return f"`{ident}`"


def database(changefeed: str) -> str:
    return q(namespace_of(changefeed))


def qualified(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    return f"{database(changefeed)}.{q(table_name(table_id, mode))}"


def checkpoints(changefeed: str) -> str:
    return f"{database(changefeed)}.`checkpoints`"


def horizons(changefeed: str) -> str:
    return f"{database(changefeed)}.`horizons`"


def identity(changefeed: str) -> str:
    return f"{database(changefeed)}.`identity`"


def lit(value: bytes | str | int | bool | None) -> str:
    """A literal: bytes and text as hex (``X'..'``: nothing to escape, no character set conversion), integers as
    digits, booleans as 1 or 0, None as NULL."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        value = value.encode()
    return f"X'{value.hex()}'"


def create_layout(changefeed: str) -> list[str]:
    """The database and its three shared tables (idempotent; DDL commits implicitly in MySQL)."""
    return [
        f"CREATE DATABASE IF NOT EXISTS {database(changefeed)}",
        f"CREATE TABLE IF NOT EXISTS {checkpoints(changefeed)} ("
        "dispatcher VARCHAR(253) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, "
        "table_id BIGINT NOT NULL, mode VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
        "span_start LONGBLOB NOT NULL, span_end LONGBLOB NOT NULL, revision BIGINT NOT NULL, "
        "updated_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), KEY by_table (table_id)) ENGINE=InnoDB",
        f"CREATE TABLE IF NOT EXISTS {horizons(changefeed)} (table_id BIGINT NOT NULL, "
        "mode VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, revision BIGINT NOT NULL DEFAULT 0, "
        "PRIMARY KEY (table_id, mode)) ENGINE=InnoDB",
        f"CREATE TABLE IF NOT EXISTS {identity(changefeed)} ("
        "id VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY) ENGINE=InnoDB",
        # Two captures racing here may both insert: the identity is the smallest id (``read_identity``), the same
        # for every reader.
        f"INSERT INTO {identity(changefeed)} (id) SELECT UUID() FROM DUAL "
        f"WHERE NOT EXISTS (SELECT 1 FROM {identity(changefeed)})",
    ]


def read_identity(changefeed: str) -> str:
    return f"SELECT id FROM {identity(changefeed)} ORDER BY id LIMIT 1"


def create_table(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> list[str]:
    """The table of a Table and mode, and its horizon row at 0 if it has none."""
    return [
        f"CREATE TABLE IF NOT EXISTS {qualified(changefeed, table_id, mode)} ("
        "key_hash BINARY(32) NOT NULL PRIMARY KEY, k LONGBLOB NOT NULL, v LONGBLOB NULL, revision BIGINT NOT NULL, "
        f"deleted BOOL NOT NULL DEFAULT 0, KEY key_order (k({KEY_PREFIX})), KEY tombstones (deleted, revision)) "
        "ENGINE=InnoDB ROW_FORMAT=DYNAMIC",
        f"INSERT IGNORE INTO {horizons(changefeed)} (table_id, mode, revision) "
        f"VALUES ({table_id}, {lit(mode.value)}, 0)",
    ]


def fence(changefeed: str, tables: Sequence[tuple[int, Mode]]) -> str:
    """The horizons of ``tables``, share-locked until the transaction ends (a locking read: the newest committed
    row, whatever the isolation level)."""
    pairs = ", ".join(f"({t}, {lit(m.value)})" for t, m in tables)
    return (
        f"SELECT table_id, mode, revision FROM {horizons(changefeed)} WHERE (table_id, mode) IN ({pairs}) "
        "ORDER BY table_id, mode LOCK IN SHARE MODE"
    )


def merge_head(changefeed: str, table_id: int, mode: Mode = Mode.DEFAULT) -> str:
    return f"INSERT INTO {qualified(changefeed, table_id, mode)} (key_hash, k, v, revision, deleted) VALUES "


#: Each column only if the change is newer than the row; ``revision`` assigned last (MySQL assigns left to right).
MERGE_TAIL = (
    " ON DUPLICATE KEY UPDATE v = IF(revision < VALUES(revision), VALUES(v), v), "
    "deleted = IF(revision < VALUES(revision), VALUES(deleted), deleted), "
    "revision = IF(revision < VALUES(revision), VALUES(revision), revision)"
)


def merge_values(rows: Iterable[tuple[bytes, bytes, bytes | None, int, bool]]) -> Iterable[str]:
    """Each change (key hash, key, value, revision, deleted) as one ``(...)`` of a multi-row ``INSERT``."""
    for h, k, v, r, d in rows:
        value = "NULL" if v is None else "X'" + v.hex() + "'"
        yield f"(X'{h.hex()}',X'{k.hex()}',{value},{r},{1 if d else 0})"


def scanned(changefeed: str) -> str:
    """The per-connection temporary table a sweep's found keys go into (in the changefeed's database)."""
    return f"{database(changefeed)}.`cfm_scanned`"


def scanned_table(changefeed: str) -> list[str]:
    """``scanned``, made once per connection and emptied before each use."""
    return [
        f"CREATE TEMPORARY TABLE IF NOT EXISTS {scanned(changefeed)} (key_hash BINARY(32) NOT NULL PRIMARY KEY)",
        f"DELETE FROM {scanned(changefeed)}",
    ]


def scanned_head(changefeed: str) -> str:
    return f"INSERT IGNORE INTO {scanned(changefeed)} (key_hash) VALUES "


def sweep(changefeed: str, table_id: int, mode: Mode, lo: bytes, hi: bytes, at: int) -> str:
    """Every live row of ``[lo, hi)`` older than ``at`` whose key the scan did not find (not in ``cfm_scanned``)
    becomes a tombstone at ``at`` (``api.Sweep``)."""
    t = qualified(changefeed, table_id, mode)
    return (
        f"UPDATE {t} AS r LEFT JOIN {scanned(changefeed)} AS s ON s.key_hash = r.key_hash "
        f"SET r.v = NULL, r.deleted = 1, r.revision = {at} "
        f"WHERE r.k >= {lit(lo)} AND r.k < {lit(hi)} AND r.revision < {at} AND r.deleted = 0 AND s.key_hash IS NULL"
    )


def save_checkpoints(changefeed: str, rows: Sequence[Checkpoint]) -> str:
    """Checkpoints, never backwards (``revision`` assigned last), their span moving with their revision."""
    values = ", ".join(
        f"({lit(c.dispatcher)}, {c.table_id}, {lit(c.mode.value)}, {lit(c.start)}, {lit(c.end)}, {c.revision})"
        for c in rows
    )
    newer = "revision < VALUES(revision)"
    return (
        f"INSERT INTO {checkpoints(changefeed)} (dispatcher, table_id, mode, span_start, span_end, revision) "
        f"VALUES {values} ON DUPLICATE KEY UPDATE table_id = IF({newer}, VALUES(table_id), table_id), "
        f"mode = IF({newer}, VALUES(mode), mode), span_start = IF({newer}, VALUES(span_start), span_start), "
        f"span_end = IF({newer}, VALUES(span_end), span_end), "
        f"updated_at = IF({newer}, CURRENT_TIMESTAMP(6), updated_at), "
        f"revision = IF({newer}, VALUES(revision), revision)"
    )


def checkpoint_spans(changefeed: str, table_ids: Iterable[int]) -> str:
    ids = ", ".join(str(t) for t in sorted(set(table_ids)))
    return (
        f"SELECT table_id, mode, span_start, span_end, revision FROM {checkpoints(changefeed)} "
        f"WHERE table_id IN ({ids})"
    )


def rows_in_range(changefeed: str, table_id: int, mode: Mode, lo: bytes, hi: bytes) -> str:
    """Every row (tombstones included) with ``lo <= key < hi``, in key order (bytewise: LONGBLOB compares bytes)."""
    return (
        f"SELECT k, v, revision, deleted FROM {qualified(changefeed, table_id, mode)} "
        f"WHERE k >= {lit(lo)} AND k < {lit(hi)} ORDER BY k"
    )
