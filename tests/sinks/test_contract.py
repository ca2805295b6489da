"""What every sink must do (controller/sinks/api.py, ``Session``), proven against each real server: PostgreSQL and
MariaDB (the MySQL-compatible sink). Each test runs once per sink kind (``sink_server``)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from controller.model.keys import KeyRange
from controller.model.states import Mode
from controller.sinks import api, kinds
from controller.sinks.api import Batch, Checkpoint, Row, Session, StoredRow, Superseded, Sweep
from tests.dataplane.conftest import SinkServer, sink_of

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def k(table_id: int, suffix: bytes) -> bytes:
    return KeyRange.of_table(table_id).start + suffix


def batch(
    table_id: int,
    rows: list[Row],
    *,
    sweeps: list[Sweep] | None = None,
    checkpoints: list[Checkpoint] | None = None,
    superseded: Callable[[], bool] = lambda: False,
    mode: Mode = Mode.DEFAULT,
) -> Batch:
    latest: dict[bytes, Row] = {}
    for row in rows:
        if row[0] not in latest or latest[row[0]][2] < row[2]:
            latest[row[0]] = row
    return Batch({(table_id, mode): latest}, sweeps or [], checkpoints or [], superseded)


async def session_of(server: SinkServer, cf: str, table_id: int) -> tuple[api.Sink, Session]:
    sink = sink_of(server, cf)
    s = await sink.connect()
    await s.ensure((table_id, Mode.DEFAULT))
    return sink, s


async def rows_of(sink: api.Sink, table_id: int, mode: Mode = Mode.DEFAULT) -> list[StoredRow] | None:
    r = KeyRange.of_table(table_id)
    async with sink.snapshot() as snap:
        return await snap.rows((table_id, mode), r.start, r.end)


def test_rows_move_only_forward_by_revision(sink_server: SinkServer, table_id: int) -> None:
    """A change applies only if newer than the row: value, deleted and revision together. (MySQL assigns ``ON
    DUPLICATE KEY UPDATE`` left to right: a condition reading ``revision`` after it was assigned would take the new
    value and keep the old one, or the reverse.)"""

    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-forward", table_id)
        a, b = k(table_id, b"a"), k(table_id, b"b")
        await s.write(batch(table_id, [(a, b"v5", 5, False), (b, b"b5", 5, False)]))
        await s.write(batch(table_id, [(a, b"v3", 3, False), (b, None, 4, True)]))  # both older: nothing moves
        assert await rows_of(sink, table_id) == [StoredRow(a, b"v5", 5, False), StoredRow(b, b"b5", 5, False)]
        await s.write(batch(table_id, [(a, b"v7", 7, False), (b, None, 6, True)]))  # newer: every column moves
        assert await rows_of(sink, table_id) == [StoredRow(a, b"v7", 7, False), StoredRow(b, None, 6, True)]
        await s.write(batch(table_id, [(b, b"again", 9, False)]))  # a put after the delete revives the key
        await s.write(batch(table_id, [(a, b"v7", 7, False), (b, b"again", 9, False)]))  # a replay: nothing changes
        assert await rows_of(sink, table_id) == [StoredRow(a, b"v7", 7, False), StoredRow(b, b"again", 9, False)]
        await s.close()

    run(body())


def test_checkpoints_never_move_back_and_commit_with_rows(sink_server: SinkServer, table_id: int) -> None:
    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-checkpoints", table_id)
        r = KeyRange.of_table(table_id)
        table = (table_id, Mode.DEFAULT)
        cp = Checkpoint("d-1", table_id, Mode.DEFAULT, r.start, r.end, 10)
        await s.write(batch(table_id, [(k(table_id, b"x"), b"1", 10, False)], checkpoints=[cp]))
        await s.save_checkpoints([Checkpoint("d-1", table_id, Mode.DEFAULT, r.start, r.end, 4)])  # older: kept 10
        spans = await s.checkpoint_spans([(table_id, Mode.DEFAULT)])
        assert spans[(table_id, Mode.DEFAULT)] == [(r.start, r.end, 10)]
        # A batch that fails commits neither its rows nor its checkpoint.
        later = Checkpoint("d-1", table_id, Mode.DEFAULT, r.start, r.end, 20)
        with pytest.raises(Superseded):
            await s.write(batch(table_id, [(k(table_id, b"y"), b"2", 20, False)], checkpoints=[later],
                                superseded=lambda: True))  # fmt: skip
        assert [row.key for row in await rows_of(sink, table_id) or []] == [k(table_id, b"x")]
        assert (await s.checkpoint_spans([table]))[table] == [(r.start, r.end, 10)]
        # The session is usable after the rollback.
        await s.write(batch(table_id, [(k(table_id, b"y"), b"2", 20, False)], checkpoints=[later]))
        assert (await s.checkpoint_spans([table]))[table] == [(r.start, r.end, 20)]
        await s.close()

    run(body())


def test_a_scan_sweeps_what_it_did_not_find(sink_server: SinkServer, table_id: int) -> None:
    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-sweep", table_id)
        r = KeyRange.of_table(table_id)
        old, kept, newer = k(table_id, b"old"), k(table_id, b"kept"), k(table_id, b"newer")
        await s.write(batch(table_id, [(old, b"o", 3, False), (kept, b"k", 3, False), (newer, b"n", 30, False)]))
        # A scan at 20 found only ``kept``: ``old`` (older than 20, not found) becomes a tombstone at 20; ``newer``
        # (written after the scan's revision) stays.
        sweep = Sweep((table_id, Mode.DEFAULT), r.start, r.end, 20, [kept])
        await s.write(batch(table_id, [(kept, b"k", 3, False)], sweeps=[sweep]))
        assert await rows_of(sink, table_id) == [
            StoredRow(kept, b"k", 3, False),
            StoredRow(newer, b"n", 30, False),
            StoredRow(old, None, 20, True),
        ]
        await s.close()

    run(body())


def test_the_fence_drops_changes_at_or_below_the_horizon_and_collects(sink_server: SinkServer, table_id: int) -> None:
    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-fence", table_id)
        a, b, c = k(table_id, b"a"), k(table_id, b"b"), k(table_id, b"c")
        await s.write(batch(table_id, [(a, None, 5, True), (b, None, 8, True), (c, b"c", 9, False)]))
        done = await s.collect((table_id, Mode.DEFAULT), 6, batch=1, batches=10)
        assert (done.horizon, done.deleted) == (6, 1)  # the tombstone at 5 is gone; the one at 8 stays
        figures = await s.figures((table_id, Mode.DEFAULT))
        assert (figures.tombstones, figures.live_rows, figures.live_rows_exact) == (1, 1, True)
        # A put older than the collected tombstone (a replay from before it) is dropped by the fence: the key
        # stays deleted; a newer one lands.
        written = await s.write(batch(table_id, [(a, b"stale", 4, False)]))
        assert (written.applied, written.dropped) == (0, 1)
        assert [row.key for row in await rows_of(sink, table_id) or []] == [b, c]
        await s.write(batch(table_id, [(a, b"new", 7, False)]))
        assert [row.key for row in await rows_of(sink, table_id) or []] == [a, b, c]
        # The horizon never moves back.
        assert (await s.collect((table_id, Mode.DEFAULT), 2, batch=10, batches=1)).horizon == 6
        async with sink.snapshot() as snap:
            assert (await snap.horizons())[(table_id, Mode.DEFAULT)] == 6
        await s.close()

    run(body())


def test_long_keys_and_large_values(sink_server: SinkServer, table_id: int) -> None:
    """Long binary keys and values up to etcd's request limit, kept exactly and read back in bytewise key order. The
    MySQL sink takes any key, far longer than InnoDB indexes (3,072 bytes): two keys equal over their indexed prefix
    are told apart. PostgreSQL indexes a key up to about 2,700 bytes (``test_a_key_postgresql_cannot_index``)."""

    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-wide", table_id)
        base = k(table_id, b"")
        tie = 3072 if sink.kind == "mysql" else 2000
        long_a = base + b"\xff" * tie + b"\x00"  # equal to long_b over the first ``tie`` bytes
        long_b = base + b"\xff" * tie + b"\x01" + (os.urandom(10_000) if sink.kind == "mysql" else b"")
        small = base + b"\x00\x01"
        big = os.urandom(1_500_000)
        await s.write(batch(table_id, [(long_b, b"b", 2, False), (long_a, big, 3, False), (small, b"", 4, False)]))
        got = await rows_of(sink, table_id) or []
        assert [row.key for row in got] == [small, long_a, long_b]
        assert got[1].value == big
        assert got[0].value == b""
        r = KeyRange(long_a, long_b)  # a range that starts and ends inside the indexed prefix's ties
        async with sink.snapshot() as snap:
            assert [row.key for row in await snap.rows((table_id, Mode.DEFAULT), r.start, r.end) or []] == [long_a]
        await s.close()

    run(body())


def test_a_key_postgresql_cannot_index(postgres: Any, table_id: int) -> None:
    """A key longer than PostgreSQL's index limit fails the transaction with an error a person must act on, which
    says so (it is never retried as if it could pass)."""

    async def body() -> tuple[bool, str]:
        sink, s = await session_of(postgres, "cf-too-long", table_id)
        try:
            await s.write(batch(table_id, [(k(table_id, os.urandom(10_000)), b"v", 2, False)]))
        except sink.errors() as exc:
            return sink.trouble(exc)
        finally:
            await s.close()
        raise AssertionError("PostgreSQL indexed a 10,000-byte incompressible key")

    transient, message = run(body())
    assert not transient, message
    assert "longer than PostgreSQL can index" in message, message


def test_a_batch_larger_than_one_statement(sink_server: SinkServer, table_id: int) -> None:
    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-many", table_id)
        rows: list[Row] = [(k(table_id, b"%06d" % i), os.urandom(200), 10 + i, False) for i in range(60_000)]
        written = await s.write(batch(table_id, rows))
        assert written.applied == 60_000
        got = await rows_of(sink, table_id) or []
        assert [(row.key, row.value, row.revision) for row in got] == [(r[0], r[1], r[2]) for r in rows]
        await s.close()

    run(body())


def test_identity_and_a_table_that_does_not_exist(sink_server: SinkServer, table_id: int) -> None:
    async def body() -> None:
        sink = sink_of(sink_server, f"cf-identity-{table_id}")
        s = await sink.connect()
        assert await s.identity() == ""  # nothing made yet
        async with sink.snapshot() as snap:
            assert await snap.rows((table_id, Mode.DEFAULT), b"", b"\xff") is None
            assert await snap.horizons() == {}
        first = await s.ensure((table_id, Mode.DEFAULT))
        assert first
        assert await s.ensure((table_id, Mode.REDO)) == first == await s.identity()
        other = await sink.connect()
        assert await other.identity() == first
        await s.close()
        await other.close()

    run(body())


def test_the_snapshot_is_one_point_in_time(sink_server: SinkServer, table_id: int) -> None:
    async def body() -> None:
        sink, s = await session_of(sink_server, "cf-snapshot", table_id)
        a = k(table_id, b"a")
        await s.write(batch(table_id, [(a, b"1", 1, False)]))
        r = KeyRange.of_table(table_id)
        async with sink.snapshot() as snap:
            before = await snap.rows((table_id, Mode.DEFAULT), r.start, r.end)
            await s.write(batch(table_id, [(a, b"2", 2, False), (k(table_id, b"b"), b"x", 2, False)]))
            assert await snap.rows((table_id, Mode.DEFAULT), r.start, r.end) == before
        assert [row.value for row in await rows_of(sink, table_id) or []] == [b"2", b"x"]
        await s.close()

    run(body())


def test_a_wrong_mysql_password_needs_a_person_and_is_never_quoted(mariadb: Any) -> None:
    """(PostgreSQL's: tests/dataplane/test_troubles.py, on a server with passwords.)"""

    async def body() -> tuple[bool, str]:
        await asyncio.to_thread(mariadb.sql, "CREATE USER IF NOT EXISTS 'cfmuser'@'%' IDENTIFIED BY 'right-one'")
        sink = kinds.from_secret("mysql", "cf-auth", {"dsn": mariadb.url("cfmuser", "Wr0ng-hunter2")})
        try:
            await sink.connect()
        except sink.errors() as exc:
            return sink.trouble(exc)
        raise AssertionError("connected with a wrong password")

    transient, message = run(body())
    assert not transient, message
    assert "Wr0ng-hunter2" not in message, message
    assert "credentials" in message, message


def test_strict_sql_and_read_committed_on_every_mysql_session(mariadb: Any, table_id: int) -> None:
    async def body() -> tuple[Any, ...]:
        _, s = await session_of(mariadb, "cf-strict", table_id)
        async with s.conn.cursor() as cur:  # type: ignore[attr-defined]
            await cur.execute("SELECT @@SESSION.sql_mode, @@SESSION.tx_isolation")
            row = await cur.fetchone()
        await s.close()
        return tuple(row)

    sql_mode, isolation = run(body())
    assert "STRICT_ALL_TABLES" in sql_mode
    assert isolation == "READ-COMMITTED"


@pytest.mark.parametrize(
    ("dsn", "data", "problem"),
    [
        ("", {}, "no key dsn"),
        ("postgresql://x@h/", {}, "not a mysql:// URL"),
        ("mysql://u:p@h:notaport/", {}, "port"),
        ("mysql://u:p@/", {}, "names no host"),
        ("mysql://u:p@h/?sslmode=require", {}, "unknown parameter 'sslmode'"),
        ("mysql://u:p@h/?ssl-mode=MAYBE", {}, "ssl-mode must be one of"),
        ("mysql://u:p@h/", {"tls.crt": "x"}, "needs both tls.crt and tls.key"),
        ("mysql://u:p@h/?ssl-mode=DISABLED", {"ca.crt": "x"}, "with ssl-mode=DISABLED"),
        ("mysql://u:p@h/", {"ca.crt": "not a pem"}, "TLS material cannot be used"),
    ],
)
def test_a_mysql_secret_that_cannot_be_used_says_why(dsn: str, data: dict[str, str], problem: str) -> None:
    with pytest.raises(api.Unusable, match=problem) as refused:
        kinds.from_secret("mysql", "cf", {"dsn": dsn, **data})
    assert "p@" not in str(refused.value)


def test_mysql_sinks_compare_by_value_and_never_show_the_password() -> None:
    one = kinds.from_secret("mysql", "cf", {"dsn": "mysql://u:s3cret@db:3307/"})
    assert one == kinds.from_secret("mysql", "cf", {"dsn": "mysql://u:s3cret@db:3307/"})
    assert one != kinds.from_secret("mysql", "cf", {"dsn": "mysql://u:other@db:3307/"})
    assert "s3cret" not in repr(one)
    assert "s3cret" not in one.describe()
    assert (one.host, one.port, one.user) == ("db", 3307, "u")  # type: ignore[attr-defined]
    # The userinfo ends at the last @: an unencoded @ in the password is still the password's.
    odd = kinds.from_secret("mysql", "cf", {"dsn": "mysql://u:pa@ss%2Fw@db/"})
    assert (odd.host, odd.password) == ("db", "pa@ss/w")  # type: ignore[attr-defined]
