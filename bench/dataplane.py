"""Figures of the data plane: a capture's runtime against the best raw pipeline and the machine's limit, the lag at a
steady rate, an idle capture's CPU. Prints figures; asserts nothing about speed.

    .venv/bin/python bench/dataplane.py                      # 1, 100, 1000 dispatchers; lag at 1,000 writes/s
    .venv/bin/python bench/dataplane.py --sinks mysql --changes 20000 --dispatchers 1,100 --rounds 1 --lag-seconds 10

A real etcd and a real server of each sink kind (``--sinks``: PostgreSQL, MariaDB) start on loopback
(controller.demo.servers), all stopped at the end.

1. **Throughput, side by side, per sink.** Each round writes ``--changes`` changes to etcd first (transactions of 50
   keys over 65,536 keys of one table: puts, overwrites, deletes); then every consumer replays them from the revision
   before them, one after the other, timed until every change is committed downstream:
   - *read alone* (the source's ceiling): one watch over the table, every event decoded into a row;
   - *write alone* (the sink's ceiling), per statement form: the rows already read, cut into the runtime's
     transactions (at most 50,000 changes, the newest per key), one each with a checkpoint row and the sink's exact
     semantics: the form ``sink`` is the sink's own ``Session.write`` (PostgreSQL: a binary COPY into a temporary
     table and one merge; MySQL: one multi-row ``INSERT ... ON DUPLICATE KEY UPDATE``; both after the fence's read
     of the horizons), and for PostgreSQL the form ``unnest``, one ``INSERT ... SELECT FROM unnest(arrays) ON
     CONFLICT DO UPDATE WHERE newer``;
   - *raw pipeline*, per statement form: one watch into one connection, reading and writing overlapped, a
     transaction every 50 ms or 2,000 changes, whichever first, of whole watch responses, with whatever else is
     already read up to 50,000 changes (the runtime's group-commit rule); the faster is "the best raw pipeline";
   - *the runtime*: one capture's ``DataplaneRuntime`` with N dispatchers over N equal key ranges of the table.
   Each consumer's best of ``--rounds`` rounds is printed as changes/s, as ratios to the best raw pipeline and to
   the limit (the slower of reading alone and writing alone with the faster form), and with this process's CPU
   seconds (the client side: the servers are processes of their own) against the best raw pipeline's.
2. **Lag at a steady rate**, per sink. A writer at ``--rate`` changes/s over 100 dispatchers for ``--lag-seconds``; the
   lag of every dispatcher (``DataplaneRuntime.lag_seconds``: now minus when the head first passed its
   checkpoint) sampled every 50 ms; p50, p99 and max over all samples of the slowest dispatcher.
3. **Idle.** 1,000 dispatchers caught up, nothing written: the process's CPU (user + system) over
   ``--idle-seconds``, as a share of one core (the watches' progress notifications, one per watch every
   ``--progress-notify`` seconds, included).

The lag across a maintainer or a capture SIGKILL: ``bench/dataplane_failover.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aetcd
import aetcd.rpc as rpc
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.capture.batcher import MAX_TRANSACTION_ROWS
from controller.capture.dataplane import DataplaneRuntime, Endpoints
from controller.demo.mariadb import MariaDBServer
from controller.demo.servers import EtcdServer, PostgresServer
from controller.demo.writer import Writer, row_key
from controller.model.keys import KeyRange, table_key
from controller.model.records import Dispatcher
from controller.model.states import Mode
from controller.sinks import api, kinds
from controller.sinks.postgres import schema
from controller.sources.etcd.watch import rows_of

SinkServer = PostgresServer | MariaDBServer

OPTIONS = {"grpc.enable_http_proxy": 0}
BATCH_INTERVAL = 0.05
BATCH_ROWS = 2_000


def ranges(table_id: int, n: int) -> list[KeyRange]:
    inner = [row_key(table_id, i * 65_536 // n) for i in range(1, n)]
    return [KeyRange(a, b) for a, b in itertools.pairwise([table_key(table_id), *inner, table_key(table_id + 1)])]


def dispatchers(changefeed: str, table_id: int, n: int, start: int) -> list[Dispatcher]:
    return [
        Dispatcher(
            name=f"d{i}",
            changefeed=changefeed,
            span=f"s{i}",
            table_id=table_id,
            key_range=r,
            capture="bench",
            start_ts=start,
            epoch=1,
        )
        for i, r in enumerate(ranges(table_id, n))
    ]


async def head(c: aetcd.Client) -> int:
    """The store's current revision."""
    answer = await c.kvstub.Range(rpc.RangeRequest(key=b"\0", limit=1), timeout=10)
    return int(answer.header.revision)


async def preload(etcd: EtcdServer, table_id: int, changes: int) -> tuple[int, int, dict[bytes, int]]:
    """Write ``changes`` changes at once (as fast as etcd takes them); (revision before, last revision, each
    key's last revision)."""
    writer = Writer(etcd.host, etcd.port, [table_id], rate=1e9, batch=50, keys=65_536, seed=table_id)
    async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
        before = await head(c)
        last = before
        done = 0
        keys: dict[bytes, int] = {}
        while done < changes:
            ops = writer.next_ops()  # the writer's own mix, written from here at full speed
            answer = await c.kvstub.Txn(rpc.TxnRequest(success=ops), timeout=10)
            last = answer.header.revision
            done += len(ops)
            for op, result in zip(ops, answer.responses, strict=True):
                if op.HasField("request_put") or result.response_delete_range.deleted:  # not a delete of nothing
                    keys[op.request_put.key or op.request_delete_range.key] = last
    return before, last, keys


Row = tuple[bytes, bytes | None, int, bool]


def _watch_requests(table_id: int, start: int) -> Any:
    async def requests() -> Any:
        yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=table_key(table_id), range_end=table_key(table_id + 1), start_revision=start + 1))  # fmt: skip
        await asyncio.Event().wait()

    return requests()


def _rows(events: Any) -> list[Row]:
    """A response's events as rows: the source's own decoding (``watch.rows_of``), the fastest here."""
    return rows_of(events)


async def read_alone(etcd: EtcdServer, table_id: int, start: int, last: int) -> list[list[Row]]:
    """The source's ceiling: one watch over the table from ``start + 1`` until ``last``, every event decoded into a
    row (what any consumer must do). Returns the responses' rows, for ``write_alone``."""
    out: list[list[Row]] = []
    async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
        call = rpc.WatchStub(c.channel).Watch(_watch_requests(table_id, start))
        try:
            async for answer in call:
                if answer.events:
                    out.append(_rows(answer.events))
                    if answer.events[-1].kv.mod_revision >= last:
                        break
        finally:
            call.cancel()
    return out


def batches(responses: list[list[Row]]) -> list[list[Row]]:
    """The responses' rows cut into transactions as the runtime's writer cuts a backlog: at most
    ``MAX_TRANSACTION_ROWS`` changes each, the newest change per key kept in each."""
    out: list[list[Row]] = []
    rows: dict[bytes, Row] = {}
    size = 0
    for response in responses:
        for row in response:
            old = rows.get(row[0])
            if old is None or old[2] < row[2]:
                rows[row[0]] = row
            size += 1
            if size >= MAX_TRANSACTION_ROWS:
                out.append(list(rows.values()))
                rows, size = {}, 0
    if rows:
        out.append(list(rows.values()))
    return out


async def _prepare(conn: psycopg.AsyncConnection[Any], changefeed: str, table_id: int) -> None:
    for statement in schema.create_schema(changefeed).split(";\n"):
        await conn.execute(statement)
    await conn.execute(schema.create_table(changefeed, table_id))
    await conn.commit()


async def _apply_unnest(cur: psycopg.AsyncCursor[Any], changefeed: str, table_id: int, rows: list[Row]) -> None:
    """One ``INSERT ... SELECT FROM unnest(arrays)`` with the only-if-newer upsert."""
    t = schema.qualified(changefeed, table_id)
    await cur.execute(
        f"INSERT INTO {t} AS row (key, value, revision, deleted) "
        "SELECT * FROM unnest(%s::bytea[], %s::bytea[], %s::bigint[], %s::boolean[]) "
        "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, revision = EXCLUDED.revision, "
        "deleted = EXCLUDED.deleted WHERE row.revision < EXCLUDED.revision",
        [list(c) for c in zip(*rows, strict=True)],
    )


class Form:
    """A statement form of a sink: a connection that commits one batch at a time with the sink's semantics."""

    async def open(self, sink: api.Sink, table_id: int) -> None: ...

    async def commit(self, table_id: int, rows: list[Row]) -> None: ...

    async def close(self) -> None: ...


class SessionForm(Form):
    """The sink's own statements: ``Session.write`` of a batch with its checkpoint (the fence included)."""

    async def open(self, sink: api.Sink, table_id: int) -> None:
        self.session = await sink.connect()
        await self.session.ensure((table_id, Mode.DEFAULT))

    async def commit(self, table_id: int, rows: list[Row]) -> None:
        r = KeyRange.of_table(table_id)
        cp = api.Checkpoint("raw", table_id, Mode.DEFAULT, r.start, r.end, max(row[2] for row in rows))
        rows_by_key = {row[0]: row for row in rows}
        await self.session.write(api.Batch({(table_id, Mode.DEFAULT): rows_by_key}, [], [cp], lambda: False))

    async def close(self) -> None:
        await self.session.close()


class UnnestForm(Form):
    """PostgreSQL only: one ``INSERT ... SELECT FROM unnest(arrays)`` and a checkpoint row per transaction."""

    async def open(self, sink: api.Sink, table_id: int) -> None:
        self.changefeed = sink.changefeed
        self.conn = await psycopg.AsyncConnection.connect(sink.dsn)  # type: ignore[attr-defined]
        await _prepare(self.conn, sink.changefeed, table_id)

    async def commit(self, table_id: int, rows: list[Row]) -> None:
        async with self.conn.transaction(), self.conn.cursor() as cur:
            await _apply_unnest(cur, self.changefeed, table_id, rows)
            await cur.execute(schema.save_checkpoints(self.changefeed), [["raw"], [table_id], ["default"], [b""],
                                                                          [b""], [max(r[2] for r in rows)]])  # fmt: skip

    async def close(self) -> None:
        await self.conn.close()


def forms(kind: str) -> dict[str, type[Form]]:
    return {"sink": SessionForm, "unnest": UnnestForm} if kind == "postgres" else {"sink": SessionForm}


async def write_alone(sink: api.Sink, form: type[Form], table_id: int, cut: list[list[Row]]) -> None:
    """The sink's ceiling with a statement form: the batches, already read and decoded, one transaction each, on one
    connection."""
    f = form()
    await f.open(sink, table_id)
    try:
        for rows in cut:
            await f.commit(table_id, rows)
    finally:
        await f.close()


async def raw_pipeline(etcd: EtcdServer, sink: api.Sink, form: type[Form], table_id: int, start: int,
                       last: int) -> None:  # fmt: skip
    """The best raw pipeline: one watch into one connection, reading and writing overlapped (the reader decodes
    into a queue while the writer commits), batched as the runtime batches, with a statement form."""
    f = form()
    await f.open(sink, table_id)
    try:
        async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
            queue: asyncio.Queue[list[Row]] = asyncio.Queue()
            call = rpc.WatchStub(c.channel).Watch(_watch_requests(table_id, start))

            async def read() -> None:
                async for answer in call:
                    if answer.events:
                        await queue.put(_rows(answer.events))

            reader = asyncio.create_task(read())
            applied = start
            try:
                while applied < last:
                    if reader.done():
                        raise RuntimeError(f"the raw watch ended: {reader.exception()!r}")
                    rows: dict[bytes, Row] = {}
                    size = 0
                    deadline = time.monotonic() + BATCH_INTERVAL
                    while size < BATCH_ROWS or (not queue.empty() and size < MAX_TRANSACTION_ROWS):
                        # Until 2,000 changes or 50 ms, then whatever else is already read, up to a transaction's
                        # rows (the runtime's rule: a backlog goes in large transactions).
                        try:
                            got = queue.get_nowait() if not queue.empty() else await asyncio.wait_for(
                                queue.get(), max(0.0, deadline - time.monotonic()))  # fmt: skip
                        except TimeoutError:
                            break
                        for row in got:
                            old = rows.get(row[0])
                            if old is None or old[2] < row[2]:
                                rows[row[0]] = row
                        size += len(got)
                    if rows:
                        await f.commit(table_id, list(rows.values()))
                        applied = max(applied, max(r[2] for r in rows.values()))
            finally:
                reader.cancel()
                call.cancel()
                with contextlib.suppress(BaseException):
                    await reader
    finally:
        await f.close()


Figure = tuple[float, float]  # seconds, CPU seconds of this process


async def timed(work: Any) -> tuple[Any, Figure]:
    """``work`` awaited: its result, and its wall and CPU seconds (this process: the client's side)."""
    cpu, wall = time.process_time(), time.monotonic()
    result = await work
    return result, (time.monotonic() - wall, time.process_time() - cpu)


async def runtime_catch_up(endpoints: Endpoints, changefeed: str, table_id: int, n: int, start: int,
                           keys: dict[bytes, int]) -> Figure:  # fmt: skip
    """Seconds until every dispatcher's checkpoint reached the last change of its own range (committed with it;
    reaching the store's revision beyond that would wait for a progress notification, not for the sink)."""
    rt = DataplaneRuntime(batch_interval=BATCH_INTERVAL, batch_rows=BATCH_ROWS)
    rt.configure(changefeed, endpoints)
    try:
        ds = dispatchers(changefeed, table_id, n, start)
        # Each dispatcher's last change, computed before the clock starts (it used to be inside the timed part: over
        # every key for every dispatcher, a second of the 100-dispatcher run and more at 1,000).
        starts = [d.key_range.start for d in ds]
        due = dict.fromkeys((d.name for d in ds), 0)
        for k, r in keys.items():
            i = bisect.bisect_right(starts, k) - 1
            if i >= 0 and k < ds[i].key_range.end:
                due[ds[i].name] = max(due[ds[i].name], r)
        began, cpu = time.monotonic(), time.process_time()
        for d in ds:
            rt.start(d)
        # Waiting costs the harness little (its CPU is counted as the runtime's): only the dispatchers still behind
        # are looked at, and failures once every 50 polls.
        behind = [d.name for d in ds]
        polls = 0
        while behind:
            behind = [name for name in behind if rt.checkpoint(name) < due[name]]
            polls += 1
            if time.monotonic() - began > 120:
                raise RuntimeError(f"{len(behind)} dispatchers not caught up after 120 s, e.g. {behind[:3]}")
            if polls % 50 == 0 and any(rt.failed(name) for name in behind):
                raise RuntimeError(next(rt.failed(name) for name in behind if rt.failed(name)))
            await asyncio.sleep(0.01)
        took = (time.monotonic() - began, time.process_time() - cpu)
        commits, rows = rt.stats(changefeed)
        print(f"  runtime, {n} dispatchers: {commits} transactions, {rows} rows applied (the newest per key)")
        return took
    finally:
        await rt.aclose()


async def lag_at_rate(
    etcd: EtcdServer, endpoints: Endpoints, table_id: int, rate: float, seconds: float
) -> list[float]:
    rt = DataplaneRuntime(batch_interval=BATCH_INTERVAL, batch_rows=BATCH_ROWS)
    rt.configure("bench-lag", endpoints)
    async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
        start = await head(c)
    ds = dispatchers("bench-lag", table_id, 100, start)
    samples: list[float] = []
    try:
        for d in ds:
            rt.start(d)
        await asyncio.sleep(2.0)  # every watch created and caught up
        writer = Writer(etcd.host, etcd.port, [table_id], rate=rate, batch=50, keys=65_536, seed=7).start()
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                samples.append(max(rt.lag_seconds(d.name) for d in ds))
                await asyncio.sleep(0.05)
        finally:
            writer.stop()
    finally:
        await rt.aclose()
    return samples


async def idle_cpu(etcd: EtcdServer, endpoints: Endpoints, table_id: int, seconds: float) -> float:
    rt = DataplaneRuntime(batch_interval=BATCH_INTERVAL, batch_rows=BATCH_ROWS)
    rt.configure("bench-idle", endpoints)
    async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
        start = await head(c)
    ds = dispatchers("bench-idle", table_id, 1_000, start)
    try:
        for d in ds:
            rt.start(d)
        await asyncio.sleep(5.0)  # every watch created
        before = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.monotonic()
        await asyncio.sleep(seconds)
        after = resource.getrusage(resource.RUSAGE_SELF)
        used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return used / (time.monotonic() - wall)
    finally:
        await rt.aclose()


def pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sink_of(server: SinkServer, changefeed: str) -> api.Sink:
    return kinds.from_secret(server.sink_kind, changefeed, {"dsn": server.dsn})


def endpoints_of(etcd: EtcdServer, server: SinkServer, changefeed: str) -> Endpoints:
    return Endpoints(etcd=(etcd.endpoint,), sink=sink_of(server, changefeed))


async def throughput(a: argparse.Namespace, etcd: EtcdServer, server: SinkServer, tables: Any) -> None:
    """Every consumer of the same changes, side by side, best of ``--rounds`` each (figures: changes/s)."""
    runs = [int(x) for x in a.dispatchers.split(",") if x]
    kind = server.sink_kind
    best: dict[str, Figure] = {}

    def keep(name: str, figure: Figure) -> None:
        if name not in best or figure[0] < best[name][0]:
            best[name] = figure

    for round_ in range(a.rounds):
        table = next(tables)
        start, last, keys = await preload(etcd, table, a.changes)
        responses, figure = await timed(read_alone(etcd, table, start, last))
        keep("read alone", figure)
        cut = batches(responses)
        for how, form in forms(kind).items():
            _, figure = await timed(write_alone(sink_of(server, f"w{how}-{round_}"), form, table, cut))
            keep(f"write alone ({how})", figure)
        for how, form in forms(kind).items():
            _, figure = await timed(raw_pipeline(etcd, sink_of(server, f"p{how}-{round_}"), form, table, start, last))
            keep(f"raw pipeline ({how})", figure)
        for n in runs:
            cf = f"rt{n}-{round_}"
            figure = await runtime_catch_up(endpoints_of(etcd, server, cf), cf, table, n, start, keys)
            keep(f"runtime, {n} dispatchers", figure)
    read = best["read alone"][0]
    fastest_write = min(forms(kind), key=lambda how: best[f"write alone ({how})"][0])
    fastest_raw = min(forms(kind), key=lambda how: best[f"raw pipeline ({how})"][0])
    limit = max(read, best[f"write alone ({fastest_write})"][0])  # the slower ceiling
    raw, raw_cpu = best[f"raw pipeline ({fastest_raw})"]
    print(f"{kind}: throughput, {a.changes:,} changes, best of {a.rounds} rounds "
          f"(machine load {os.getloadavg()[0]:.2f}):")  # fmt: skip
    print(f"  {'consumer':<34} {'changes/s':>10} {'/ raw':>6} {'/ limit':>8} {'CPU s':>7} {'CPU / raw':>9}")
    for name, (wall, cpu) in best.items():
        mark = " (best raw)" if name == f"raw pipeline ({fastest_raw})" else ""
        print(f"  {name + mark:<34} {a.changes / wall:>10,.0f} {raw / wall:>6.2f} {limit / wall:>8.2f} "
              f"{cpu:>7.2f} {cpu / raw_cpu:>9.2f}")  # fmt: skip
    print(f"  limit: the slower of reading alone and writing alone ({fastest_write}): {a.changes / limit:,.0f} "
          "changes/s")


async def main(a: argparse.Namespace) -> None:
    tables = itertools.count(1_000)
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdServer(progress_notify_interval=a.progress_notify))
        servers: list[SinkServer] = []
        for kind in a.sinks.split(","):
            server: SinkServer = MariaDBServer() if kind == "mysql" else PostgresServer()
            stack.enter_context(server)
            servers.append(server)
        where = ", ".join(f"{s.sink_kind} 127.0.0.1:{s.port}" for s in servers)
        print(f"etcd {etcd.endpoint} (progress notifications every {a.progress_notify} s), {where}; "
              f"commit {_commit_id()}")  # fmt: skip
        for server in servers:
            if a.changes > 0:
                await throughput(a, etcd, server, tables)
            if a.lag_seconds > 0:
                samples = await lag_at_rate(etcd, endpoints_of(etcd, server, "bench-lag"), next(tables), a.rate,
                                            a.lag_seconds)  # fmt: skip
                print(f"{server.sink_kind}: lag at {a.rate:.0f} changes/s over 100 dispatchers, {len(samples)} "
                      f"samples of the slowest: p50 {statistics.median(samples):.3f} s, p99 {pct(samples, 0.99):.3f} "
                      f"s, max {max(samples):.3f} s")  # fmt: skip
        if a.idle_seconds > 0:
            share = await idle_cpu(etcd, endpoints_of(etcd, servers[0], "bench-idle"), next(tables), a.idle_seconds)
            print(f"idle, 1,000 dispatchers (watches) caught up: {100 * share:.2f} % of a core over "
                  f"{a.idle_seconds:.0f} s")  # fmt: skip


def _commit_id() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    return "?"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sinks", default="postgres,mysql", help="the sink kinds measured, in this order")
    p.add_argument("--changes", type=int, default=50_000)
    p.add_argument("--dispatchers", default="1,100,1000")
    p.add_argument("--rounds", type=int, default=3, help="each consumer's best of this many rounds")
    p.add_argument("--rate", type=float, default=1_000.0)
    p.add_argument("--lag-seconds", type=float, default=20.0)
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--progress-notify", type=float, default=0.8,
                   help="etcd's progress notification interval, s (docs/operations.md recommends 800 ms)")  # fmt: skip
    asyncio.run(main(p.parse_args()))
