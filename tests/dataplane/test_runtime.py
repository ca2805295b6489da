"""The real dispatcher runtime alone (controller/capture/dataplane.py) against a real etcd and PostgreSQL: no
Kubernetes. Rows and tombstones arrive with their revisions, the checkpoint moves only after the commit, an
idle span advances on progress notifications, a successor from the final checkpoint replays nothing wrong, a
sink that refuses writes holds the checkpoint and loses nothing, and a compaction past a paused dispatcher is
reported, not skipped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aetcd
import aetcd.rpc
import psycopg
import pytest

from controller.apiserver.tls import self_signed
from controller.capture.dataplane import DataplaneRuntime, Endpoints
from controller.demo.servers import EtcdServer, PostgresServer, free_port
from controller.model.keys import KeyRange, table_key
from controller.model.progress import SINK, SOURCE
from controller.model.records import Dispatcher
from controller.model.states import Mode
from controller.sinks.postgres import PostgresSink, schema
from controller.sources.etcd import EtcdSource
from controller.sources.etcd import connection as etcd
from controller.sources.etcd.watch import ChannelClosed, rpc

T = TypeVar("T")
CF = "cf-runtime"


def run(coro: Coroutine[Any, Any, T], timeout: float = 40.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def client(server: EtcdServer) -> aetcd.Client:
    return aetcd.Client(host=server.host, port=server.port, timeout=5, options={"grpc.enable_http_proxy": 0})


def endpoints(etcd: EtcdServer, postgres: PostgresServer) -> Endpoints:
    return Endpoints(etcd=(etcd.endpoint,), sink=PostgresSink(CF, postgres.dsn))


def dispatcher(table_id: int, name: str, start_ts: int, key_range: KeyRange | None = None,
               mode: Mode = Mode.DEFAULT) -> Dispatcher:  # fmt: skip
    return Dispatcher(
        name=name, changefeed=CF, span=f"span-{name}", table_id=table_id, mode=mode,
        key_range=key_range or KeyRange.of_table(table_id), capture="c0", start_ts=start_ts, epoch=1,
    )  # fmt: skip


def rows(postgres: PostgresServer, table_id: int, mode: Mode = Mode.DEFAULT) -> dict[bytes, tuple[Any, ...]]:
    try:
        with psycopg.connect(postgres.dsn) as conn:
            got = conn.execute(
                schema.rows_in_range(CF, table_id, mode), (table_key(table_id), table_key(table_id + 1))
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}
    return {k: (v, rev, deleted) for k, v, rev, deleted in got}


async def until(check: Callable[[], bool], within: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def with_runtime(
    e: Endpoints, body: Callable[[DataplaneRuntime], Awaitable[T]], clock: Callable[[], float] = time.time
) -> T:
    rt = DataplaneRuntime(batch_interval=0.02, clock=clock)
    rt.configure(CF, e)
    try:
        return await body(rt)
    finally:
        await rt.aclose()


def k(table_id: int, row: bytes) -> bytes:
    return table_key(table_id) + row


def test_rows_tombstones_checkpoint_and_a_successor(etcd: EtcdServer, postgres: PostgresServer, table_id: int) -> None:
    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            r0 = (await c.put(k(table_id, b"a"), b"before")).header.revision
            await c.put(table_key(table_id + 1), b"outside")  # the next table: never replicated here
            rt.start(dispatcher(table_id, "d1", 0))  # "now": the initial scan, then the watch
            assert rt.checkpoint("d1") == 0
            await until(lambda: rt.checkpoint("d1") > r0, what="the initial scan")
            assert rows(postgres, table_id) == {k(table_id, b"a"): (b"before", r0, False)}

            r1 = (await c.put(k(table_id, b"b"), b"1")).header.revision
            r2 = (await c.put(k(table_id, b"a"), b"2")).header.revision
            r3 = (await c.delete(k(table_id, b"b"))).header.revision
            await until(lambda: rt.checkpoint("d1") >= r3, what="the writes")
            got = rows(postgres, table_id)
            assert got == {k(table_id, b"a"): (b"2", r2, False), k(table_id, b"b"): (None, r3, True)}
            assert r1 < r2
            # The checkpoints table was written in the transaction of the rows: at least their revision.
            with psycopg.connect(postgres.dsn) as conn:
                (saved,) = conn.execute(
                    f"SELECT revision FROM {schema.checkpoints(CF)} WHERE dispatcher = 'd1'"
                ).fetchone() or (0,)
            assert saved >= r3

            # Idle: writes elsewhere move the store; progress notifications move the idle span's checkpoint,
            # with no transaction (nothing of its waits: every row up to it is committed).
            commits = rt.stats(CF)[0]
            elsewhere = (await c.put(table_key(table_id + 1), b"again")).header.revision
            await until(lambda: rt.checkpoint("d1") >= elsewhere, within=10, what="a progress notification")
            await asyncio.sleep(1.0)  # a few more notifications
            assert rt.stats(CF)[0] == commits
            assert rt.lag_seconds("d1") < 5

            final = rt.close("d1")
            assert final >= elsewhere
            with pytest.raises(KeyError):
                rt.checkpoint("d1")

            # A successor from the final checkpoint sees only what came after; an older put replayed by a
            # successor started too early (from r1) is refused by the rows' revisions: nothing moves back.
            r4 = (await c.put(k(table_id, b"c"), b"3")).header.revision
            rt.start(dispatcher(table_id, "d2", final))
            rt.start(dispatcher(table_id, "d-early", r1 - 1))
            await until(lambda: min(rt.checkpoint("d2"), rt.checkpoint("d-early")) >= r4, what="the successors")
            assert rows(postgres, table_id) == {
                k(table_id, b"a"): (b"2", r2, False),
                k(table_id, b"b"): (None, r3, True),
                k(table_id, b"c"): (b"3", r4, False),
            }
            rt.close("d2")
            rt.close("d-early")

    run(with_runtime(endpoints(etcd, postgres), body))


def test_a_successor_that_scans_again_turns_the_keys_deleted_since_into_tombstones(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """A successor at 0 (the maintainer never learned its predecessor's checkpoint: the capture died between its
    first commit and its first report) scans over a sink that holds its predecessor's rows. A key deleted in between
    is not in the scan: its row becomes a tombstone at the scan's revision, or it would stay live while the
    checkpoint says the delete was applied. Also when the scan finds nothing at all; rows outside the range stay."""
    half = KeyRange(table_key(table_id), k(table_id, b"m"))

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            r_a = (await c.put(k(table_id, b"a"), b"1")).header.revision
            await c.put(k(table_id, b"b"), b"2")
            r_z = (await c.put(k(table_id, b"z"), b"3")).header.revision  # outside ``half``
            rt.start(dispatcher(table_id, "d1", 0))
            await until(lambda: rt.checkpoint("d1") >= r_z, what="the first scan")
            rt.close("d1")  # died unreported: its successors start at 0 again
            r_b = (await c.delete(k(table_id, b"b"))).header.revision
            await c.delete(k(table_id, b"z"))  # outside ``half``: not the half's successors' to delete

            rt.start(dispatcher(table_id, "d2", 0, half))
            await until(lambda: rt.checkpoint("d2") >= r_b, what="the second scan")
            got = rows(postgres, table_id)
            assert got[k(table_id, b"a")] == (b"1", r_a, False)
            _, at, deleted = got[k(table_id, b"b")]
            assert deleted, got
            assert r_b <= at <= rt.checkpoint("d2"), got
            assert got[k(table_id, b"z")] == (b"3", r_z, False)
            rt.close("d2")

            r_a2 = (await c.delete(k(table_id, b"a"))).header.revision  # the half is empty now
            rt.start(dispatcher(table_id, "d3", 0, half))
            await until(lambda: rt.checkpoint("d3") >= r_a2, what="a scan that finds nothing")
            got = rows(postgres, table_id)
            _, at, deleted = got[k(table_id, b"a")]
            assert deleted, got
            assert r_a2 <= at <= rt.checkpoint("d3"), got
            assert got[k(table_id, b"z")] == (b"3", r_z, False)
            rt.close("d3")

    run(with_runtime(endpoints(etcd, postgres), body))


def test_a_scan_whose_dispatcher_closed_while_its_transaction_ran_is_not_committed(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """The scan's transaction waits (another session locks the table), its dispatcher is closed meanwhile (final
    checkpoint 0: its successor will scan again), then the lock goes: the old scan is rolled back, not committed
    behind a successor's scan. The writer goes on: a successor's scan commits."""
    table = schema.qualified(CF, table_id)

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            r_a = (await c.put(k(table_id, b"a"), b"1")).header.revision
        with psycopg.connect(postgres.dsn, autocommit=True) as setup:
            for statement in schema.create_schema(CF).split(";\n"):
                setup.execute(statement)
            setup.execute(schema.create_table(CF, table_id))
        with psycopg.connect(postgres.dsn) as locker:
            locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")

            def waiting() -> bool:
                with psycopg.connect(postgres.dsn, autocommit=True) as probe:
                    row = probe.execute(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass", (table,)
                    ).fetchone()
                return bool(row and row[0])

            rt.start(dispatcher(table_id, "d1", 0))
            await until(waiting, what="the scan's transaction waiting for the lock")
            assert rt.close("d1") == 0
            locker.rollback()  # the lock goes: the old scan's transaction runs on, and must roll back
            await asyncio.sleep(0.5)
        assert rows(postgres, table_id) == {}
        rt.start(dispatcher(table_id, "d2", 0))
        await until(lambda: rt.checkpoint("d2") >= r_a, what="the successor's scan")
        assert rows(postgres, table_id) == {k(table_id, b"a"): (b"1", r_a, False)}
        rt.close("d2")

    run(with_runtime(endpoints(etcd, postgres), body))


def test_split_ranges_and_redo_mode(etcd: EtcdServer, postgres: PostgresServer, table_id: int) -> None:
    """Two dispatchers of one capture on halves of a table share transactions; a redo span writes the redo table."""
    middle = k(table_id, b"m")
    left = KeyRange(table_key(table_id), middle)
    right = KeyRange(middle, table_key(table_id + 1))

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"0"), b"x")).header.revision
            rt.start(dispatcher(table_id, "left", start, left))
            rt.start(dispatcher(table_id, "right", start, right))
            rt.start(dispatcher(table_id, "redo", start, mode=Mode.REDO))
            last = 0
            for i in range(200):
                last = (await c.put(k(table_id, b"%c%03d" % (b"az"[i % 2], i)), b"v%d" % i)).header.revision
            await until(lambda: min(rt.checkpoint(n) for n in ("left", "right", "redo")) >= last, what="both halves")
            got = rows(postgres, table_id)
            assert len(got) == 200
            assert rows(postgres, table_id, Mode.REDO) == got
            commits, applied = rt.stats(CF)
            assert applied >= 400
            assert commits < 400  # batched: fewer transactions than changes

    run(with_runtime(endpoints(etcd, postgres), body))


def test_a_sink_that_refuses_writes_holds_the_checkpoint(
    etcd: EtcdServer, start_postgres: Callable[..., PostgresServer], table_id: int
) -> None:
    pg = start_postgres()

    def refuse(on: bool) -> None:
        with psycopg.connect(pg.conninfo("postgres"), autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {pg.database} ALLOW_CONNECTIONS {'false' if on else 'true'}")
            if on:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (pg.database,)
                )

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"a"), b"1")).header.revision
            rt.start(dispatcher(table_id, "d", start))
            r1 = (await c.put(k(table_id, b"b"), b"1")).header.revision
            await until(lambda: rt.checkpoint("d") >= r1, what="the first write")
            refuse(True)
            held = rt.checkpoint("d")
            last = 0
            for i in range(50):
                last = (await c.put(k(table_id, b"x%02d" % i), b"%d" % i)).header.revision
            await asyncio.sleep(1.0)
            assert rt.checkpoint("d") == held  # nothing committed: the checkpoint holds
            trouble = rt.troubles.get(CF, SINK)
            assert trouble is not None
            assert trouble.message.startswith("cannot write the sink: OperationalError:"), trouble
            assert trouble.transient  # the database refuses connections for now: retried
            refuse(False)
            await until(lambda: rt.checkpoint("d") >= last, within=20, what="the sink to come back")
            assert rt.troubles.report() == ()
            assert len(rows(pg, table_id)) == 51  # b and x00..x49: nothing lost

    run(with_runtime(Endpoints(etcd=(etcd.endpoint,), sink=PostgresSink(CF, pg.dsn)), body))


def test_compaction_past_a_paused_dispatcher_is_reported(
    start_etcd: Callable[..., EtcdServer], postgres: PostgresServer, table_id: int
) -> None:
    server = start_etcd()

    async def body(rt: DataplaneRuntime) -> None:
        async with client(server) as c:
            start = (await c.put(k(table_id, b"a"), b"1")).header.revision
            rt.start(dispatcher(table_id, "d", start))
            r1 = (await c.put(k(table_id, b"a"), b"2")).header.revision
            await until(lambda: rt.checkpoint("d") >= r1, what="the first write")
            held = rt.pause("d")
            rt.close("d")  # as the agent would after a pause that lost the span: restart it from `held`
            for i in range(5):
                last = (await c.put(k(table_id, b"a"), b"v%d" % i)).header.revision
            await c.compact(last, physical=True)
            rt.start(dispatcher(table_id, "d'", held))
            await until(lambda: rt.failed("d'") is not None, what="the compaction to be reported")
            assert "compacted" in (rt.failed("d'") or "")
            assert rt.checkpoint("d'") == held  # not skipped
            assert rows(postgres, table_id)[k(table_id, b"a")][1] == r1

    run(with_runtime(Endpoints(etcd=(server.endpoint,), sink=PostgresSink(CF, postgres.dsn)), body))


def test_pause_holds_and_resume_goes_on(etcd: EtcdServer, postgres: PostgresServer, table_id: int) -> None:
    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"a"), b"1")).header.revision
            rt.start(dispatcher(table_id, "d", start))
            held = rt.pause("d")
            last = 0
            for i in range(20):
                last = (await c.put(k(table_id, b"p%02d" % i), b"%d" % i)).header.revision
            await asyncio.sleep(0.5)
            assert rt.checkpoint("d") == held
            rt.resume("d")
            await until(lambda: rt.checkpoint("d") >= last, what="the resumed dispatcher")
            assert len(rows(postgres, table_id)) == 20

    run(with_runtime(endpoints(etcd, postgres), body))


def test_a_checkpoint_stands_for_the_wall_time_the_head_first_passed_it(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """The lag in seconds of a changefeed counted in revisions: a paused dispatcher's checkpoint stands for when
    this capture first saw the head pass it, a caught-up one's for now (a clock the test sets)."""
    wall = [1_000.0]
    lo, hi = KeyRange(table_key(table_id), k(table_id, b"m")), KeyRange(k(table_id, b"m"), table_key(table_id + 1))

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"a"), b"1")).header.revision
            rt.start(dispatcher(table_id, "lo", start, lo))
            rt.start(dispatcher(table_id, "hi", start, hi))
            assert rt.checkpoint_time("lo") == 1_000.0  # nothing above its checkpoint seen: caught up
            rt.pause("lo")
            wall[0] = 2_000.0
            later = (await c.put(k(table_id, b"x"), b"2")).header.revision  # hi's range
            await until(lambda: rt.checkpoint("hi") >= later, what="hi to commit the put")
            wall[0] = 2_005.0
            assert rt.checkpoint_time("lo") == 2_000.0  # the head passed it when hi's watch saw the put
            assert rt.lag_seconds("lo") == 5.0
            assert rt.checkpoint_time("hi") == 2_005.0
            assert rt.lag_seconds("hi") == 0.0
            rt.resume("lo")
            await until(lambda: rt.checkpoint("lo") >= later, what="lo to catch up")
            assert rt.lag_seconds("lo") == 0.0

    run(with_runtime(endpoints(etcd, postgres), body, clock=lambda: wall[0]))


def test_a_source_is_checked_before_it_is_used() -> None:
    """``etcd.problem``: what the capture warns about (and waits), verify refuses, before any connection; its
    messages never quote credentials or PEM."""
    ca, client = self_signed("127.0.0.1"), self_signed("127.0.0.1")
    good = etcd.Tls(ca=ca.cert_pem, cert=client.cert_pem, key=client.key_pem)
    assert etcd.problem(["http://10.0.0.1:2379", "10.0.0.2:2379", "[::1]:2379", "etcd-0", "etcd-1/"]) is None
    assert etcd.problem(["https://etcd-0:2379", "HTTPS://etcd-1:2379"], good) is None
    assert etcd.problem(["https://etcd-0:2379"]) is None  # the system's roots
    assert etcd.problem([]) == "no etcd endpoint"
    mixed = etcd.problem(["http://10.0.0.1:2379", " HTTPS://etcd-1:2379"])
    assert "mix http:// and https://" in (mixed or "")
    half = etcd.problem(["https://etcd-0:2379"], etcd.Tls(cert=client.cert_pem))
    assert "needs its key" in (half or "")
    forgot = etcd.problem(["etcd-0:2379"], etcd.Tls(ca=ca.cert_pem))
    assert "use https://" in (forgot or "")
    bad_ca = etcd.problem(["https://etcd-0:2379"], etcd.Tls(ca=b"-----BEGIN CERTIFICATE-----\nnot one\n"))
    assert bad_ca == "ca.crt is not a PEM CA certificate (bundle)"
    other_key = etcd.problem(["https://etcd-0:2379"], etcd.Tls(cert=client.cert_pem, key=ca.key_pem))
    assert "tls.crt and tls.key are not a PEM certificate and its" in (other_key or "")
    for bad in ("etcd-0:port", "http://etcd-0:2379/v3", "etcd-0:70000", "unix://x", "http://https://etcd-0:2379",
                "fd00::1", "::1", "[fd00::1]x"):  # fmt: skip
        problem = etcd.problem([bad])
        assert "is not host:port" in (problem or ""), bad
    with_password = etcd.problem(["https://root:s3cret@etcd-0:2379"])
    assert "username and password keys" in (with_password or "")
    assert "s3cret" not in (with_password or "")
    assert etcd.host_port("https://[::1]:2380") == ("::1", 2380)
    assert etcd.host_port("etcd-0") == ("etcd-0", 2379)
    assert etcd.tls_of({"ca.crt": "CA", "tls.crt": " ", "endpoints": "x"}) == etcd.Tls(ca=b"CA")
    assert "CA" not in repr(etcd.Tls(ca=b"CA", cert=b"C", key=b"K"))
    assert etcd.describe(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert len(etcd.describe(OSError("x" * 500))) == 200


def test_a_tls_source_with_a_client_certificate_replicates(
    start_etcd: Callable[..., EtcdServer], postgres: PostgresServer, table_id: int, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``https://`` endpoint: the watch and the initial scan over TLS, the server checked against the Secret's
    ``ca.crt``, the capture known to etcd by its ``tls.crt``/``tls.key`` (``--client-cert-auth``). Without the
    client certificate etcd refuses the handshake: the dispatcher retries, its checkpoint does not move and
    nothing is written (nothing is ever spoken in plaintext)."""
    server = start_etcd(tls=True, client_cert_auth=True)
    full = etcd.Tls(ca=server.ca_pem, cert=server.client_cert_pem, key=server.client_key_pem)

    async def body() -> None:
        writer = await etcd.Connection.open(server.client_url, tls=full)
        try:
            put = aetcd.rpc.PutRequest(key=k(table_id, b"before"), value=b"scanned")
            await writer.kvstub.Put(put, timeout=5)

            async def refused(rt: DataplaneRuntime) -> None:
                rt.start(dispatcher(table_id, "d", 0))
                await asyncio.sleep(3)
                assert rt.checkpoint("d") == 0
                assert rows(postgres, table_id) == {}
                # Said, with why (gRPC's status and details), not only the exception's type: a trouble of the source
                # that a person must fix, and logged once with the changefeed.
                trouble = rt.troubles.get(CF, SOURCE)
                assert trouble is not None
                assert trouble.message.startswith("TLS with the source failed"), trouble
                assert "UNAVAILABLE: " in trouble.message, trouble
                assert not trouble.transient
                said = [getattr(r, "fields", {}) for r in caplog.records if r.msg == "source unavailable"]
                assert [f.get("changefeed") for f in said] == [CF], said

            no_cert = Endpoints(
                etcd=(server.client_url,), sink=PostgresSink(CF, postgres.dsn), tls=etcd.Tls(ca=server.ca_pem)
            )
            await with_runtime(no_cert, refused)

            async def replicate(rt: DataplaneRuntime) -> None:
                rt.start(dispatcher(table_id, "d", 0))  # 0: the initial scan first
                await until(lambda: rt.checkpoint("d") > 0, what="the initial scan")
                put = aetcd.rpc.PutRequest(key=k(table_id, b"after"), value=b"watched")
                last = (await writer.kvstub.Put(put, timeout=5)).header.revision
                await until(lambda: rt.checkpoint("d") >= last, what="the watch")
                got = rows(postgres, table_id)
                assert got[k(table_id, b"before")][0] == b"scanned"
                assert got[k(table_id, b"after")][0] == b"watched"

            await with_runtime(
                Endpoints(etcd=(server.client_url,), sink=PostgresSink(CF, postgres.dsn), tls=full), replicate
            )
        finally:
            await writer.close()

    run(body())


def test_endpoints_never_show_credentials() -> None:
    e = Endpoints(
        etcd=("http://10.0.0.1:2379",), sink=PostgresSink(CF, "postgresql://u:s3cret@h/db"), username="u", password="pw"
    )
    assert "s3cret" not in repr(e)
    assert "pw" not in str(e)


def test_the_dispatchers_of_a_changefeed_share_one_watch_stream(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """Issue 38: a capture watches every span of a changefeed on one etcd Watch stream (a watcher of its own per
    dispatcher), not one stream each; a paused dispatcher's watcher is cancelled and created again on resume."""

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"\x00"), b"x")).header.revision
            whole = KeyRange.of_table(table_id)
            parts = whole.split_at(whole.even_split_keys(8))
            for i, r in enumerate(parts):
                rt.start(dispatcher(table_id, f"d{i}", start, r))
            feed = rt._feeds[CF]
            await until(lambda: feed.stream.watching() == 8, what="eight watchers")
            last = 0
            for i in range(64):
                last = (await c.put(k(table_id, bytes([i * 4, 1])), b"%d" % i)).header.revision
            await until(lambda: all(rt.checkpoint(f"d{i}") >= last for i in range(8)), what="every dispatcher")
            assert feed.stream.streams == 1
            assert len(rows(postgres, table_id)) == 64

            rt.pause("d3")
            assert feed.stream.watching() == 7
            more = (await c.put(k(table_id, bytes([3 * 32 + 1, 2])), b"paused")).header.revision
            await asyncio.sleep(0.5)
            assert rt.checkpoint("d3") < more
            rt.resume("d3")
            await until(lambda: feed.stream.watching() == 8, what="the resumed watcher")
            await until(lambda: rt.checkpoint("d3") >= more, what="the resumed dispatcher")
            assert rows(postgres, table_id)[k(table_id, bytes([3 * 32 + 1, 2]))][0] == b"paused"
            assert feed.stream.streams == 1

    run(with_runtime(endpoints(etcd, postgres), body))


def test_a_dispatcher_held_back_for_its_rows_watches_again_from_its_position(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-pressure on a shared stream: a dispatcher whose rows pile up has its watcher cancelled (the others go on)
    and created again from its position once the sink drained it. Nothing is lost or skipped."""
    from controller.capture import batcher, dataplane

    monkeypatch.setattr(dataplane, "MAX_PENDING_ROWS", 5)
    monkeypatch.setattr(batcher, "MAX_PENDING_ROWS", 5)

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"\x00"), b"x")).header.revision
            rt.start(dispatcher(table_id, "d", start))
            feed = rt._feeds[CF]
            await until(lambda: feed.stream.watching() == 1, what="the watcher")
            last = 0
            for burst in range(5):  # transactions of 20 keys: one response of 20 events each, over the limit
                keys = [k(table_id, b"b%d-%02d" % (burst, i)) for i in range(20)]
                ops = [aetcd.rpc.RequestOp(request_put=aetcd.rpc.PutRequest(key=key, value=b"v")) for key in keys]
                last = (await c.kvstub.Txn(aetcd.rpc.TxnRequest(success=ops), timeout=5)).header.revision
            await until(lambda: rt.checkpoint("d") >= last, what="every burst")
            assert len(rows(postgres, table_id)) == 100
            # The last burst may have held the watcher back too: it is created again once the sink drained it (a
            # round trip to etcd after the checkpoint moved, so waited for: asserting it at once failed under load).
            await until(lambda: feed.stream.watching() == 1, what="the watcher created again")
            after = (await c.put(k(table_id, b"after"), b"v")).header.revision
            await until(lambda: rt.checkpoint("d") >= after, what="a write after the bursts")
            assert len(rows(postgres, table_id)) == 101

    run(with_runtime(endpoints(etcd, postgres), body))


def test_a_source_with_a_username_and_password_replicates(
    start_etcd: Callable[..., EtcdServer], postgres: PostgresServer, table_id: int
) -> None:
    """etcd with authentication: the Secret's username and password are used for the watch and the initial scan too
    (their gRPC calls carry the client's auth token; without it etcd refuses them and the dispatcher retried for
    ever)."""
    server = start_etcd()

    async def body() -> None:
        async with client(server) as c:
            auth = aetcd.rpc.AuthStub(c.channel)
            await auth.UserAdd(aetcd.rpc.AuthUserAddRequest(name="root", password="secret"))
            await auth.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user="root", role="root"))
            await auth.AuthEnable(aetcd.rpc.AuthEnableRequest())
        options = {"grpc.enable_http_proxy": 0}
        authed = aetcd.Client(host=server.host, port=server.port, username="root", password="secret", timeout=5,
                              options=options)  # fmt: skip
        async with authed as c:
            await c.put(k(table_id, b"before"), b"scanned")
            e = Endpoints(
                etcd=(server.endpoint,), sink=PostgresSink(CF, postgres.dsn), username="root", password="secret"
            )

            async def replicate(rt: DataplaneRuntime) -> None:
                rt.start(dispatcher(table_id, "d", 0))  # 0: the initial scan first
                await until(lambda: rt.checkpoint("d") > 0, what="the initial scan")
                last = (await c.put(k(table_id, b"after"), b"watched")).header.revision
                await until(lambda: rt.checkpoint("d") >= last, what="the watch")
                assert rt.failed("d") is None
                got = rows(postgres, table_id)
                assert got[k(table_id, b"before")][0] == b"scanned"
                assert got[k(table_id, b"after")][0] == b"watched"

            await with_runtime(e, replicate)

    run(body())


def test_a_call_on_a_connection_closed_under_it_is_a_transport_error_and_a_stale_reset_keeps_the_new_one(
    request: pytest.FixtureRequest,
) -> None:
    """Every dispatcher of a changefeed shares one connection. One task's transport error drops it; gRPC then
    cancels the calls other tasks have on it, which reached them as ``CancelledError`` and ended their scan (or the
    watch stream) for good, with nothing said. Now such a call is ``ChannelClosed``, a transport error the caller
    retries, while the task's own cancellation still propagates; and a reset for a connection already replaced
    leaves the new one alone. (The pending call is a watch stream's read: a call to a server that never answers
    would leave gRPC connecting in its threads, and the next fork of a test server abort.)"""
    endpoint = request.getfixturevalue("etcd").endpoint  # the shared server (``etcd`` here is the module)

    async def pending_read(conn: etcd.Connection) -> asyncio.Task[Any]:
        requests: asyncio.Queue[Any] = asyncio.Queue()
        create = aetcd.rpc.WatchCreateRequest(key=b"\xff\xfe-nothing", start_revision=0)
        requests.put_nowait(aetcd.rpc.WatchRequest(create_request=create))

        async def iterate() -> Any:
            while (request := await requests.get()) is not None:
                yield request

        call = aetcd.rpc.WatchStub(conn.channel).Watch(iterate())
        assert (await call.read()).created
        return asyncio.create_task(rpc(call.read()))  # nothing will come: pending until closed or cancelled

    async def body() -> None:
        conn = await etcd.Connection.open(endpoint)
        read = await pending_read(conn)
        await asyncio.sleep(0.2)
        await conn.close()
        with pytest.raises(ChannelClosed):
            await read
        conn = await etcd.Connection.open(endpoint)
        read = await pending_read(conn)
        await asyncio.sleep(0.2)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        await conn.close()

        source = EtcdSource(Endpoints(etcd=(endpoint,), sink=PostgresSink(CF, "host=unused")),
                            on_head=lambda _: None, on_error=lambda _: None)  # fmt: skip
        first = await source.connection()
        await source.reset(first)
        second = await source.connection()
        assert second is not first
        await source.reset(first)  # a late reset from a task that used the first
        assert await source.connection() is second
        await source.reset(second)
        assert source.client is None

    run(body())


def test_new_values_that_do_not_work_leave_the_working_connection_in_use(
    etcd: EtcdServer, postgres: PostgresServer, start_etcd: Callable[..., EtcdServer], table_id: int
) -> None:
    """A changed Secret whose new values fail (a sink DSN to a port nobody listens on, an etcd endpoint nobody
    answers) is refused per side with why, and the connections made with the old values stay in use: the
    dispatcher keeps replicating. New values that work are used at once, positions kept, nothing lost. New values
    that work but reach another sink database or another etcd cluster are refused too: the positions are revisions
    of this cluster, and the checkpoint claims rows that only the first database holds."""
    good = endpoints(etcd, postgres)
    elsewhere = start_etcd()
    with psycopg.connect(postgres.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE other{table_id}")

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"a"), b"1")).header.revision
            rt.start(dispatcher(table_id, "d", start))
            r1 = (await c.put(k(table_id, b"b"), b"1")).header.revision
            await until(lambda: rt.checkpoint("d") >= r1, what="the first write")
            nobody = f"127.0.0.1:{free_port()}"
            broken = Endpoints(
                etcd=(nobody,), sink=PostgresSink(CF, f"host=127.0.0.1 port={free_port()} dbname=x user=y")
            )
            problems = await rt.reconfigure(CF, broken)
            assert set(problems) == {SOURCE, SINK}, problems
            refused = "the sink Secret's new dsn does not work: cannot write the sink: "
            assert problems[SINK].startswith(refused), problems
            assert problems[SINK].endswith("; still writing with the dsn read before"), problems
            assert problems[SOURCE].startswith("the source Secret's new values do not work: cannot reach the source"), (
                problems
            )
            r2 = (await c.put(k(table_id, b"c"), b"1")).header.revision
            await until(lambda: rt.checkpoint("d") >= r2, what="a write after the refused values")
            assert rt.troubles.report() == ()
            # Values that work (the same servers, named another way) are taken: the stream starts again on them.
            other = Endpoints(
                etcd=(f"http://{etcd.endpoint}",), sink=PostgresSink(CF, postgres.dsn + " application_name=rotated")
            )
            assert await rt.reconfigure(CF, other) == {}
            r3 = (await c.put(k(table_id, b"d"), b"1")).header.revision
            await until(lambda: rt.checkpoint("d") >= r3, what="a write after the new values")
            with psycopg.connect(postgres.dsn) as conn:
                names = [r[0] for r in conn.execute("SELECT application_name FROM pg_stat_activity").fetchall()]
            assert "rotated" in names
            assert set(rows(postgres, table_id)) == {k(table_id, x) for x in (b"b", b"c", b"d")}
            moved = Endpoints(etcd=(elsewhere.endpoint,), sink=PostgresSink(CF, postgres.conninfo(f"other{table_id}")))
            problems = await rt.reconfigure(CF, moved)
            assert "reaches another database than the one this changefeed writes" in problems[SINK], problems
            assert "belongs to another etcd cluster" in problems[SOURCE], problems
            r4 = (await c.put(k(table_id, b"e"), b"1")).header.revision
            await until(lambda: rt.checkpoint("d") >= r4, what="a write after the refused move")
            assert k(table_id, b"e") in rows(postgres, table_id)

    run(with_runtime(good, body))


def test_a_batch_is_one_statement_applying_each_change_only_if_newer(postgres: PostgresServer, table_id: int) -> None:
    """``schema.stage`` and ``schema.merge``: a batch copied into the staging table and merged in one statement; each
    change lands only if newer than its row (a replay or an older change is a no-op), a delete as a tombstone; a
    batch of deletes only (every value NULL) too; the staging is empty after each merge. ``schema.save_checkpoints``
    likewise in one statement, never backwards."""
    cf = "cf-batch"
    t = (table_key(table_id), table_key(table_id + 1))

    def apply(*rows: tuple[bytes, bytes | None, int, bool]) -> None:
        create, copy_in = schema.stage()
        with psycopg.connect(postgres.dsn) as conn, conn.transaction(), conn.cursor() as cur:
            cur.execute(create)
            with cur.copy(copy_in) as copy:
                copy.set_types(list(schema.STAGED_TYPES))
                for row in rows:
                    copy.write_row(row)
            cur.execute(schema.merge(cf, table_id))
            assert cur.execute(f"SELECT count(*) FROM {schema.STAGED}").fetchone() == (0,)

    def got() -> dict[bytes, tuple[Any, ...]]:
        with psycopg.connect(postgres.dsn) as conn:
            return {k: (v, rev, dead) for k, v, rev, dead in conn.execute(schema.rows_in_range(cf, table_id), t)}

    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        for statement in schema.create_schema(cf).split(";\n"):
            conn.execute(statement)
        conn.execute(schema.create_table(cf, table_id))
    a, b, c = k(table_id, b"a"), k(table_id, b"b"), k(table_id, b"c")
    apply((a, b"1", 5, False), (b, b"2", 6, False))
    apply((a, None, 4, True), (b, None, 7, True), (c, None, 8, True))  # deletes only: a's is older than its row
    assert got() == {a: (b"1", 5, False), b: (None, 7, True), c: (None, 8, True)}
    apply((a, b"1", 5, False), (b, b"2", 6, False))  # a replay changes nothing
    assert got() == {a: (b"1", 5, False), b: (None, 7, True), c: (None, 8, True)}
    with psycopg.connect(postgres.dsn) as conn, conn.transaction():
        rows = [["d1", "d2"], [table_id, table_id], ["default", "default"], [a, b], [b, c], [9, 3]]
        conn.execute(schema.save_checkpoints(cf), rows)
        conn.execute(schema.save_checkpoints(cf), [["d1"], [table_id], ["default"], [a], [b], [8]])  # backwards
        saved = dict(conn.execute(f"SELECT dispatcher, revision FROM {schema.checkpoints(cf)}").fetchall())
    assert saved == {"d1": 9, "d2": 3}


def test_a_backlog_is_committed_in_pieces_of_whole_revisions(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog larger than a transaction's rows (``MAX_TRANSACTION_ROWS``) goes in several transactions, each cut
    at a revision boundary: its checkpoint is the last revision it holds, and no revision is split between two (the
    rows of one etcd transaction share a revision: a checkpoint between them would claim half of it)."""
    from controller.capture import batcher
    from controller.sinks import postgres as sink

    monkeypatch.setattr(batcher, "MAX_TRANSACTION_ROWS", 7)
    seen: list[tuple[list[int], list[int]]] = []
    write = sink.PostgresSession.write

    async def recorded(self: Any, b: Any) -> Any:
        seen.append(([r[2] for rows in b.rows.values() for r in rows.values()], [c.revision for c in b.checkpoints]))
        return await write(self, b)

    monkeypatch.setattr(sink.PostgresSession, "write", recorded)

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = (await c.put(k(table_id, b"\x00"), b"x")).header.revision
            last = start
            for burst in range(6):  # etcd transactions of 3 keys: 3 rows of one revision each
                ops = [aetcd.rpc.RequestOp(request_put=aetcd.rpc.PutRequest(key=k(table_id, b"%d-%d" % (burst, i)),
                                                                            value=b"v")) for i in range(3)]  # fmt: skip
                last = (await c.kvstub.Txn(aetcd.rpc.TxnRequest(success=ops), timeout=5)).header.revision
            rt.start(dispatcher(table_id, "d", start))  # the whole backlog arrives in one catch-up response
            await until(lambda: rt.checkpoint("d") >= last, what="the backlog")
        assert len(rows(postgres, table_id)) == 18
        pieces = [(revs, cps) for revs, cps in seen if revs]
        assert len(pieces) >= 2, seen  # 18 rows, at most 7 (plus the rest of a revision) a transaction
        committed: set[int] = set()
        for revs, (checkpoint,) in pieces:
            assert max(revs) == checkpoint, pieces  # the checkpoint claims exactly what the piece holds
            assert not committed & set(revs), pieces  # no revision in two pieces
            assert all(revs.count(r) == 3 for r in set(revs)), pieces  # each revision whole
            committed |= set(revs)

    run(with_runtime(endpoints(etcd, postgres), body))
