"""Figures of the data plane (issue 38): a capture's runtime against the raw pipeline, the lag at a steady rate,
an idle capture's CPU. Prints figures; asserts nothing about speed.

    .venv/bin/python bench/dataplane.py                      # 1, 100, 1000 dispatchers; lag at 1,000 writes/s
    .venv/bin/python bench/dataplane.py --changes 20000 --dispatchers 1,100 --lag-seconds 10 --idle-seconds 5

A real etcd and a real PostgreSQL start on loopback (controller.dataplane.servers), both stopped at the end.

1. **Throughput, side by side.** ``--changes`` changes (transactions of 50 keys over 65,536 keys of one table)
   are written to etcd first; then, from the revision before them, (a) the raw pipeline: one watch over the
   whole table into one psycopg connection, batched as the runtime batches (a transaction every 50 ms or
   2,000 rows, ``schema.apply`` with executemany), and (b) one capture's ``DataplaneRuntime`` with N
   dispatchers over N equal key ranges of the table, each from the same revision. Each is timed until every
   change is committed downstream (the raw one: its last revision applied; the runtime: every dispatcher's
   checkpoint at the last revision). Rows/s = changes / seconds; the ratio is the runtime's to the raw one's.
2. **Lag at a steady rate.** A writer at ``--rate`` changes/s over 100 dispatchers for ``--lag-seconds``; the
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
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aetcd
import aetcd.rpc as rpc
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.capture.dataplane import DataplaneRuntime, Endpoints
from controller.dataplane import schema
from controller.dataplane.servers import EtcdServer, PostgresServer
from controller.dataplane.writer import Writer, row_key
from controller.model.keys import KeyRange, table_key
from controller.model.records import Dispatcher

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


async def raw_pipeline(etcd: EtcdServer, dsn: str, changefeed: str, table_id: int, start: int, last: int) -> float:
    """One watch over the table from ``start + 1`` into one connection, batched like the runtime; seconds."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(schema.create_schema(changefeed))
        await conn.execute(schema.create_table(changefeed, table_id))
        await conn.commit()
        apply = schema.apply(changefeed, table_id)
        async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
            began = time.monotonic()
            queue: asyncio.Queue[list[Any]] = asyncio.Queue()
            stub = rpc.WatchStub(c.channel)

            async def requests() -> Any:
                yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=table_key(table_id), range_end=table_key(table_id + 1), start_revision=start + 1))  # fmt: skip
                await asyncio.Event().wait()

            async def read() -> None:
                async for answer in stub.Watch(requests()):
                    if answer.events:
                        await queue.put(list(answer.events))

            reader = asyncio.create_task(read())
            applied = start
            try:
                while applied < last:
                    if reader.done():
                        raise RuntimeError(f"the raw watch ended: {reader.exception()!r}")
                    rows: dict[bytes, tuple[bytes, bytes | None, int, bool]] = {}
                    deadline = time.monotonic() + BATCH_INTERVAL
                    while len(rows) < BATCH_ROWS:
                        with contextlib.suppress(TimeoutError):
                            events = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                            for e in events:
                                deleted = e.type == rpc.Event.DELETE
                                rows[e.kv.key] = (e.kv.key, None if deleted else e.kv.value, e.kv.mod_revision, deleted)
                            continue
                        break
                    if not rows:
                        continue
                    async with conn.cursor() as cur:
                        await cur.executemany(apply, list(rows.values()))
                    await conn.commit()
                    applied = max(applied, max(r[2] for r in rows.values()))
            finally:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            return time.monotonic() - began


async def runtime_catch_up(endpoints: Endpoints, changefeed: str, table_id: int, n: int, start: int,
                           keys: dict[bytes, int]) -> float:  # fmt: skip
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
        began = time.monotonic()
        for d in ds:
            rt.start(d)
        while any(rt.checkpoint(d.name) < due[d.name] for d in ds):
            if time.monotonic() - began > 120:
                behind = [(d.name, rt.checkpoint(d.name), due[d.name]) for d in ds
                          if rt.checkpoint(d.name) < due[d.name]]  # fmt: skip
                raise RuntimeError(f"{len(behind)} dispatchers not caught up after 120 s, e.g. {behind[:3]}")
            if any(rt.failed(d.name) for d in ds):
                raise RuntimeError(next(rt.failed(d.name) for d in ds if rt.failed(d.name)))
            await asyncio.sleep(0.01)
        took = time.monotonic() - began
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


async def main(a: argparse.Namespace) -> None:
    with EtcdServer(progress_notify_interval=a.progress_notify) as etcd, PostgresServer() as pg:
        endpoints = Endpoints(etcd=(etcd.endpoint,), dsn=pg.dsn)
        print(f"etcd {etcd.endpoint} (progress notifications every {a.progress_notify} s), PostgreSQL "
              f"127.0.0.1:{pg.port}; {a.changes} changes per throughput run")  # fmt: skip
        for i, n in enumerate(int(x) for x in a.dispatchers.split(",") if x):
            table = 1_000 + i
            start, last, keys = await preload(etcd, table, a.changes)
            raw = await raw_pipeline(etcd, pg.dsn, f"raw-{i}", table, start, last)
            ours = await runtime_catch_up(endpoints, f"rt-{i}", table, n, start, keys)
            print(f"throughput, {n:>5} dispatchers: raw {a.changes / raw:8.0f} rows/s ({raw:.2f} s), runtime "
                  f"{a.changes / ours:8.0f} rows/s ({ours:.2f} s): ratio {raw / ours:.2f}")  # fmt: skip
        if a.lag_seconds > 0:
            samples = await lag_at_rate(etcd, endpoints, 2_000, a.rate, a.lag_seconds)
            print(f"lag at {a.rate:.0f} changes/s over 100 dispatchers, {len(samples)} samples of the slowest: "
                  f"p50 {statistics.median(samples):.3f} s, p99 {pct(samples, 0.99):.3f} s, "
                  f"max {max(samples):.3f} s")  # fmt: skip
        if a.idle_seconds > 0:
            share = await idle_cpu(etcd, endpoints, 2_001, a.idle_seconds)
            print(f"idle, 1,000 dispatchers (watches) caught up: {100 * share:.2f} % of a core over "
                  f"{a.idle_seconds:.0f} s")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--changes", type=int, default=50_000)
    p.add_argument("--dispatchers", default="1,100,1000")
    p.add_argument("--rate", type=float, default=1_000.0)
    p.add_argument("--lag-seconds", type=float, default=20.0)
    p.add_argument("--idle-seconds", type=float, default=20.0)
    p.add_argument("--progress-notify", type=float, default=1.0, help="etcd's progress notification interval, s")
    asyncio.run(main(p.parse_args()))
