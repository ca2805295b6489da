"""Tombstone collection against a real etcd and PostgreSQL (controller/sinks/postgres/horizon.py,
controller/capture/collector.py; the argument in docs/architecture.md, "Tombstone collection").

A collected tombstone never comes back as an older put: not from a successor started below it, nor from a
transaction of a closed dispatcher in flight, nor when an apply and a collection race (either first); a table whose
range is not all scanned keeps its horizon at 0 (its scan's rows are not dropped); and a churning table's tombstones
go while its live rows stay, with verify at 0 differences throughout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aetcd
import aetcd.rpc
import psycopg
import pytest

from controller.capture.batcher import Scan
from controller.capture.dataplane import DataplaneRuntime, Endpoints
from controller.dataplane import verify as check
from controller.demo.servers import EtcdServer, PostgresServer
from controller.model.keys import KeyRange, table_key
from controller.model.records import Dispatcher
from controller.model.states import Mode
from controller.sinks import api
from controller.sinks.api import Row
from controller.sinks.postgres import PostgresSink, horizon, schema

T = TypeVar("T")
CF = "cf-tombstones"
#: Seconds between collections in these tests (the default is 60).
GC = 0.2


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def client(server: EtcdServer) -> aetcd.Client:
    return aetcd.Client(host=server.host, port=server.port, timeout=5, options={"grpc.enable_http_proxy": 0})


def k(table_id: int, row: bytes) -> bytes:
    return table_key(table_id) + row


def dispatcher(table_id: int, name: str, start_ts: int, key_range: KeyRange | None = None,
               mode: Mode = Mode.DEFAULT) -> Dispatcher:  # fmt: skip
    return Dispatcher(
        name=name, changefeed=CF, span=f"span-{name}", table_id=table_id, mode=mode,
        key_range=key_range or KeyRange.of_table(table_id), capture="c0", start_ts=start_ts, epoch=1,
    )  # fmt: skip


def runtime(etcd: EtcdServer, postgres: PostgresServer, gc_interval: float = GC) -> DataplaneRuntime:
    rt = DataplaneRuntime(batch_interval=0.02, gc_interval=gc_interval)
    rt.configure(CF, Endpoints(etcd=(etcd.endpoint,), sink=PostgresSink(CF, postgres.dsn)))
    return rt


async def with_runtimes(etcd: EtcdServer, postgres: PostgresServer, n: int,
                        body: Callable[..., Awaitable[T]]) -> T:  # fmt: skip
    rts = [runtime(etcd, postgres) for _ in range(n)]
    try:
        return await body(*rts)
    finally:
        for rt in rts:
            await rt.aclose()


def rows(postgres: PostgresServer, table_id: int, mode: Mode = Mode.DEFAULT) -> dict[bytes, tuple[Any, ...]]:
    try:
        with psycopg.connect(postgres.dsn) as conn:
            got = conn.execute(
                schema.rows_in_range(CF, table_id, mode), (table_key(table_id), table_key(table_id + 1))
            ).fetchall()
    except psycopg.errors.UndefinedTable:
        return {}
    return {key: (v, rev, deleted) for key, v, rev, deleted in got}


def horizon_of(postgres: PostgresServer, table_id: int, mode: Mode = Mode.DEFAULT) -> int:
    with psycopg.connect(postgres.dsn) as conn:
        found = conn.execute(
            f"SELECT revision FROM {schema.horizons(CF)} WHERE table_id = %s AND mode = %s", (table_id, mode.value)
        ).fetchone()
    return int(found[0]) if found else 0


async def until(check_: Callable[[], bool], within: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not check_():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def verify(
    etcd: EtcdServer,
    postgres: PostgresServer,
    table_id: int,
    revision: int,
    modes: tuple[Mode, ...] = (Mode.DEFAULT,),
    raise_to_horizon: bool = False,
) -> list[check.TableResult]:
    spans = [check.SpanToVerify(table_id, m, KeyRange.of_table(table_id)) for m in modes]
    async with check.EtcdReader([etcd.endpoint]) as reader:
        sink = PostgresSink(CF, postgres.dsn)
        return await check.verify(reader, sink, revision, spans, raise_to_horizon=raise_to_horizon)


def differences(results: list[check.TableResult]) -> list[check.Difference]:
    return [d for r in results for d in r.differences]


async def head(c: aetcd.Client) -> int:
    answer = await c.kvstub.Range(aetcd.rpc.RangeRequest(key=b"\0", limit=1), timeout=5)
    return int(answer.header.revision)


@dataclass
class Late:
    """A dispatcher's batch as the sink holds it (``sink.Pending``), for a transaction driven by hand."""

    dispatcher: Dispatcher
    rows: list[Row] = field(default_factory=list)
    resolved: int = 0
    durable: int = 0
    paused_at: int | None = None
    scan: Scan | None = None

    @property
    def name(self) -> str:
        return self.dispatcher.name


async def commit_by_hand(rt: DataplaneRuntime, late: Late) -> None:
    """One transaction of the sink's writer (``Sink._commit``: the fence, the rows, the checkpoint) with ``late``'s
    rows, as a writer that took them before its dispatcher closed would commit them."""
    sink = rt._feeds[CF].sink
    await sink._commit([late], {late.name: (list(late.rows), late.resolved)}, {})


# -- the committed frontier (pure) -----------------------------------------------------------------------------


def test_the_frontier_of_a_table_is_the_lowest_of_the_highest_checkpoints_covering_each_point() -> None:
    t = KeyRange.of_table(7)
    a, m, z = k(7, b"a"), k(7, b"m"), k(7, b"z")
    assert api.frontier(t, []) == 0  # a new table: nothing committed
    assert api.frontier(t, [(t.start, t.end, 50)]) == 50
    assert api.frontier(t, [(t.start, m, 50)]) == 0  # the right half not covered yet: 0
    assert api.frontier(t, [(t.start, m, 50), (m, t.end, 30)]) == 30
    # A successor's row over a part covered by an older row: the higher counts there (both claims are true).
    assert api.frontier(t, [(t.start, t.end, 20), (t.start, m, 50), (m, t.end, 40)]) == 40
    assert api.frontier(t, [(t.start, t.end, 20), (a, m, 90)]) == 20
    # Rows outside the table (another table's) count for nothing; rows beyond it are clipped.
    assert api.frontier(t, [(table_key(8), table_key(9), 99)]) == 0
    assert api.frontier(t, [(table_key(6), z, 70), (z, table_key(9), 60)]) == 60
    # A hole in the middle.
    assert api.frontier(t, [(t.start, a, 10), (m, t.end, 10)]) == 0
    assert api.above([(a, b"v", 5, False), (m, None, 6, True)], 5) == [(m, None, 6, True)]


# -- no resurrection ----------------------------------------------------------------------------------------


def test_a_collected_tombstone_never_comes_back_from_an_older_put(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """The resurrection test. A key put then deleted, replicated, and its tombstone collected; then the old put comes
    again, late, two ways: a successor on another capture started below the delete (from a checkpoint the maintainer
    recorded before it), and a transaction of a closed dispatcher still in flight (its batch, taken before the close,
    committed through the writer's own path after the collection). Both pass the fence: the key stays absent, and
    verify finds 0 differences. Without the fence the put lands as a live row: the key is back."""
    gone, other = k(table_id, b"gone"), k(table_id, b"other")

    async def body(rt: DataplaneRuntime, second: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            r0 = (await c.put(other, b"x")).header.revision
            rt.start(dispatcher(table_id, "d1", r0))
            r_put = (await c.put(gone, b"old")).header.revision
            r_del = (await c.delete(gone)).header.revision
            r_last = (await c.put(other, b"y")).header.revision
            await until(lambda: rt.checkpoint("d1") >= r_last, what="the put and the delete")
            assert rows(postgres, table_id)[gone] == (None, r_del, True)

            rt.published(CF, r_last)  # the changefeed's checkpoint passed the delete
            await until(lambda: rt.tombstone_stats(CF)["collected"] >= 1, what="the tombstone collected")
            assert gone not in rows(postgres, table_id)
            stats = rt.tombstone_stats(CF)
            assert stats["checkpoint"] == r_last
            h = horizon_of(postgres, table_id)
            assert r_del <= h <= r_last

            # A batch of a closed dispatcher (one started below the delete, whose watch had delivered the put and not
            # yet the delete), taken before its close, committed after the collection.
            rt.close("d1")
            late = Late(dispatcher(table_id, "d-closed", r0), rows=[(gone, b"old", r_put, False)], resolved=r_put)
            await commit_by_hand(rt, late)
            assert gone not in rows(postgres, table_id)
            # A successor on another capture started below the put: it replays the put and the delete.
            second.start(dispatcher(table_id, "d-early", r_put - 1))
            await until(lambda: second.checkpoint("d-early") >= r_last, what="the early successor's replay")
            assert gone not in rows(postgres, table_id)
            assert rows(postgres, table_id)[other] == (b"y", r_last, False)
            assert rt.tombstone_stats(CF)["dropped"] >= 1
            assert second.tombstone_stats(CF)["dropped"] >= 2  # the put and the delete, replayed
            second.close("d-early")

            results = await verify(etcd, postgres, table_id, r_last)
            assert differences(results) == [], differences(results)
            assert results[0].horizon == h

            # Below the horizon verify cannot be exact (the delete's tombstone is gone): refused, or, for a
            # default revision, raised to it.
            with pytest.raises(check.VerifyError, match="below the tombstone horizon") as refused:
                await verify(etcd, postgres, table_id, r_put)
            assert refused.value.refused
            raised = await verify(etcd, postgres, table_id, r_put, raise_to_horizon=True)
            assert raised[0].revision == h
            assert differences(raised) == []

    run(with_runtimes(etcd, postgres, 2, body))


def test_an_apply_and_a_collection_racing_either_first_resurrect_nothing(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two connections. (1) The apply first: its transaction holds the horizon's share lock (the writer's real
    path, held open on a row another session locks) while a collection starts: the collection waits; the apply's old
    put meets the tombstone still there and is refused; then the collection deletes the tombstone. (2) The
    collection first: its UPDATE of the horizon holds the row while an apply begins: the apply waits, then reads the
    new horizon and drops its old put (a newer put of the same batch lands). Either way the key is not resurrected."""
    a, b = k(table_id, b"a"), k(table_id, b"b")
    table = schema.qualified(CF, table_id)
    monkeypatch.setattr(horizon, "LOCK_TIMEOUT", "30s")  # the collection waits here as long as the test holds it

    def waiting_on(relation: str) -> bool:
        with psycopg.connect(postgres.dsn, autocommit=True) as probe:
            found = probe.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid) "
                "WHERE NOT l.granted AND s.wait_event_type = 'Lock' AND s.query ILIKE %s",
                (f"%{relation}%",),
            ).fetchone()
        return bool(found and found[0])

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            r0 = (await c.put(b, b"x")).header.revision
            r_put_a = (await c.put(a, b"old")).header.revision
            r_del_a = (await c.delete(a)).header.revision
            r_put_b = (await c.put(b, b"old")).header.revision
            r_del_b = (await c.delete(b)).header.revision
            r_last = (await c.put(b, b"new")).header.revision
        whole = dispatcher(table_id, "d", r0)
        # The sink as the writer left it: both tombstones, the span's checkpoint past them.
        await commit_by_hand(rt, Late(whole, rows=[(a, None, r_del_a, True), (b, None, r_del_b, True)],
                                      resolved=r_del_b))  # fmt: skip
        conn = await psycopg.AsyncConnection.connect(postgres.dsn, autocommit=False)
        try:
            # (1) The apply first: held open on ``a``'s row (locked by another session) after its fence.
            async with await psycopg.AsyncConnection.connect(postgres.dsn) as locker:
                await locker.execute(f"SELECT 1 FROM {table} WHERE key = %s FOR UPDATE", (a,))
                apply = asyncio.create_task(commit_by_hand(rt, Late(whole, rows=[(a, b"old", r_put_a, False)],
                                                                    resolved=r_del_b)))  # fmt: skip
                await until(lambda: waiting_on(table), what="the apply holding its fence, waiting on the row")
                collect = asyncio.create_task(horizon.collect(conn, CF, table_id, Mode.DEFAULT, r_del_a))
                await until(lambda: waiting_on(schema.horizons(CF)), what="the collection waiting for the apply")
                assert not collect.done()
                await locker.rollback()
                await apply
            done = await collect
            assert (done.horizon, done.deleted) == (r_del_a, 1)
            assert a not in rows(postgres, table_id)  # the old put was refused by the tombstone, then it went

            # (2) The collection first: its UPDATE of the horizon holds the row (uncommitted) while an apply begins.
            await conn.execute(
                f"UPDATE {schema.horizons(CF)} SET revision = %s WHERE table_id = %s AND mode = %s",
                (r_del_b, table_id, Mode.DEFAULT.value),
            )
            both_old = Late(whole, rows=[(b, b"old", r_put_b, False), (a, b"old", r_put_a, False)], resolved=r_del_b)
            apply = asyncio.create_task(commit_by_hand(rt, both_old))
            await until(lambda: waiting_on(schema.horizons(CF)), what="the apply's fence waiting for the collection")
            assert not apply.done()
            await conn.commit()
            await apply  # read the new horizon: both old puts dropped
            done = await horizon.collect(conn, CF, table_id, Mode.DEFAULT, r_del_b)
            assert (done.horizon, done.deleted) == (r_del_b, 1)
            assert rows(postgres, table_id) == {}
            # A newer put passes the fence.
            await commit_by_hand(rt, Late(whole, rows=[(b, b"new", r_last, False), (a, b"old", r_put_a, False)],
                                          resolved=r_last))  # fmt: skip
            assert rows(postgres, table_id) == {b: (b"new", r_last, False)}
        finally:
            await conn.close()
        results = await verify(etcd, postgres, table_id, r_last)
        assert differences(results) == [], differences(results)

    run(with_runtimes(etcd, postgres, 1, body))


# -- the horizon of a table not all scanned ---------------------------------------------------------------------


def test_a_table_not_yet_scanned_everywhere_keeps_its_horizon_at_zero(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """A table's left half is scanned and written (a put and a delete in it: a tombstone), its right half's first
    dispatcher has not scanned yet (held before its scan). A checkpoint is published past everything: the horizon
    stays 0 (no checkpoint covers the right half), so the tombstone stays and the right half's scan, whose rows carry
    their old revisions, is applied in full. Once it is, the horizon moves and the tombstone goes."""
    middle = k(table_id, b"m")
    left, right = KeyRange(table_key(table_id), middle), KeyRange(middle, table_key(table_id + 1))
    a, x, z = k(table_id, b"a"), k(table_id, b"c"), k(table_id, b"z")  # x in the left half, z in the right

    async def body(rt: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            r_a = (await c.put(a, b"1")).header.revision
            r_z = (await c.put(z, b"2")).header.revision  # the right half's: found by its scan only
            rt.start(dispatcher(table_id, "left", 0, left))
            rt.start(dispatcher(table_id, "right", 0, right))
            rt.pause("right")  # before its scan
            await until(lambda: rt.checkpoint("left") >= r_z, what="the left half's scan")
            await c.put(x, b"3")
            r_del = (await c.delete(x)).header.revision
            await until(lambda: rt.checkpoint("left") >= r_del, what="the left half's put and delete")
            assert rows(postgres, table_id)[x] == (None, r_del, True)

            rt.published(CF, await head(c))
            await until(lambda: rt.tombstone_stats(CF)["collections"] >= 3, what="three collections")
            assert horizon_of(postgres, table_id) == 0
            assert rows(postgres, table_id)[x] == (None, r_del, True)
            assert z not in rows(postgres, table_id)

            rt.resume("right")
            await until(lambda: rt.checkpoint("right") >= r_del, what="the right half's scan")
            assert rows(postgres, table_id)[z] == (b"2", r_z, False)  # below every checkpoint published: kept
            assert rows(postgres, table_id)[a] == (b"1", r_a, False)
            assert rt.tombstone_stats(CF)["dropped"] == 0
            rt.published(CF, await head(c))
            await until(lambda: x not in rows(postgres, table_id), what="the tombstone collected")
            assert horizon_of(postgres, table_id) >= r_del
            results = await verify(etcd, postgres, table_id, horizon_of(postgres, table_id))
            assert differences(results) == [], differences(results)

    run(with_runtimes(etcd, postgres, 1, body))


# -- collection through the runtime -------------------------------------------------------------------------------


def test_churned_keys_tombstones_are_collected_while_live_rows_stay(
    etcd: EtcdServer, postgres: PostgresServer, table_id: int
) -> None:
    """Two captures, each with half of a table, and the table's redo span on the first: keys are put and deleted in
    waves (each wave new keys), the changefeed's checkpoint published as a maintainer would (the lowest
    checkpoint). Both captures collect the same table (their collections serialise on its horizon row), each mode
    under its own horizon: the tombstones drop to 0 while the live rows stay, and verify finds 0 differences in both
    modes."""
    middle = k(table_id, b"\x80")
    left, right = KeyRange(table_key(table_id), middle), KeyRange(middle, table_key(table_id + 1))

    def key(i: int) -> bytes:
        return k(table_id, bytes([(i * 37) % 256, i // 256, i % 256]))

    async def body(one: DataplaneRuntime, two: DataplaneRuntime) -> None:
        async with client(etcd) as c:
            start = await head(c)
            one.start(dispatcher(table_id, "left", start, left))
            two.start(dispatcher(table_id, "right", start, right))
            one.start(dispatcher(table_id, "redo", start, mode=Mode.REDO))
            names = {"left": one, "right": two, "redo": one}

            def lowest() -> int:  # the changefeed's checkpoint, as the maintainer computes it
                return min(rt.checkpoint(n) for n, rt in names.items())

            live: set[int] = set()
            last = start
            for wave in range(6):  # 100 new keys a wave; the previous wave's deleted but 20
                new = range(wave * 100, wave * 100 + 100)
                old = sorted(live)[20:] if wave else []
                puts = [aetcd.rpc.RequestOp(request_put=aetcd.rpc.PutRequest(key=key(i), value=b"w%d" % wave))
                        for i in new]  # fmt: skip
                deletes = [aetcd.rpc.RequestOp(request_delete_range=aetcd.rpc.DeleteRangeRequest(key=key(i)))
                           for i in old]  # fmt: skip
                for ops in (puts, deletes):  # etcd takes at most 128 operations a transaction
                    if ops:
                        last = (await c.kvstub.Txn(aetcd.rpc.TxnRequest(success=ops), timeout=5)).header.revision
                live = (live - set(old)) | set(new)
                await until(lambda end=last: lowest() >= end, what="the wave")  # type: ignore[misc]
                checkpoint = lowest()
                one.published(CF, checkpoint)
                two.published(CF, checkpoint)
            held = len(live)

            def tombstones(mode: Mode) -> int:
                return sum(1 for _, _, deleted in rows(postgres, table_id, mode).values() if deleted)

            await until(lambda: tombstones(Mode.DEFAULT) == 0 and tombstones(Mode.REDO) == 0, within=30,
                        what="every tombstone collected")  # fmt: skip
            for mode in Mode:
                got = rows(postgres, table_id, mode)
                assert len(got) == held
                assert all(not deleted for _, _, deleted in got.values())
                assert horizon_of(postgres, table_id, mode) >= last
            await until(lambda: any(t["tombstones"] == 0 and t["live_rows"] == held
                                    for t in one.tombstone_stats(CF)["tables"] if t["mode"] == "redo"),
                        what="the figures after a collection")  # fmt: skip
            # 80 deletes in the second wave, 100 in each of the next four, in each mode; each collected once, by
            # whichever capture came first (a collection in flight counts its deletes once it has its figures).
            await until(lambda: sum(rt.tombstone_stats(CF)["collected"] for rt in (one, two)) == 2 * (80 + 4 * 100),
                        what="every delete counted once")  # fmt: skip
            assert two.tombstone_stats(CF)["collections"] > 0  # the second capture collected the same table too
            assert not one.tombstone_stats(CF)["error"]
            assert not two.tombstone_stats(CF)["error"]
            results = await verify(etcd, postgres, table_id, last, modes=(Mode.DEFAULT, Mode.REDO))
            assert differences(results) == [], differences(results)
            assert [r.keys for r in results] == [held, held]

    run(with_runtimes(etcd, postgres, 2, body))
