"""Figures of tombstone collection: a table whose keys churn, replicated by the real runtime with collection on.
Prints figures; asserts nothing about speed.

    nice -n 10 .venv/bin/python bench/tombstones.py                    # 600 s at 1,000 changes/s over 10,000 keys
    .venv/bin/python bench/tombstones.py --duration 120 --gc-interval 20 --report-interval 10

A real etcd and a real PostgreSQL start on loopback (controller.demo.servers), both stopped at the end; one
process besides them (the runtime and the writer share its event loop).

The table holds ``--keys`` live keys at all times, and its key names churn: ``--rate`` changes a second, half of
them puts of new keys, half deletes of the oldest live ones (etcd transactions of 50 changes, 20 a second at the
default rate). Without collection every delete would stay as a tombstone: the ``deletes`` column is what the table
would hold of them. ``--dispatchers`` dispatchers of one capture (``DataplaneRuntime``, ``gc_interval``
``--gc-interval``) replicate it from an initial scan; every ``--publish-interval`` seconds the changefeed's checkpoint
(the lowest of theirs, as the maintainer publishes it) is handed to the runtime (``DataplaneRuntime.published``), as
the capture does when it reads the Changefeed again. Every ``--report-interval`` seconds: tombstones held and live
rows (counted in the sink), the table's size (``pg_total_relation_size``: heap, indexes, TOAST), the tombstones
collected in total and the horizon (``tombstone_stats``), the checkpoint's lag in revisions, and this process's CPU
over the interval. At the end, ``verify`` at the last published checkpoint (raised to the horizon if it passed it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import resource
import sys
import time
from pathlib import Path

import aetcd
import aetcd.rpc as rpc
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.capture.dataplane import DataplaneRuntime, Endpoints
from controller.dataplane import verify as check
from controller.demo.servers import EtcdServer, PostgresServer
from controller.model.keys import KeyRange, table_key
from controller.model.records import Dispatcher
from controller.model.states import Mode
from controller.sinks.postgres import PostgresSink
from controller.sinks.postgres import schema

OPTIONS = {"grpc.enable_http_proxy": 0}
CHANGEFEED = "bench-tombstones"
TABLE = 1
TXN = 50


def key(i: int) -> bytes:
    """The key of the i-th key ever written: spread over the table (a hash first), unique (i after it)."""
    return table_key(TABLE) + ((i * 2654435761) % 2**32).to_bytes(4, "big") + i.to_bytes(4, "big")


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def head(c: aetcd.Client) -> int:
    answer = await c.kvstub.Range(rpc.RangeRequest(key=b"\0", limit=1), timeout=10)
    return int(answer.header.revision)


class Churn:
    """The writer: ``keys`` live keys, ``rate`` changes a second, half puts of new keys and half deletes of the
    oldest."""

    def __init__(self, c: aetcd.Client, keys: int, rate: float) -> None:
        self.c, self.keys, self.rate = c, keys, rate
        self.live: collections.deque[int] = collections.deque()
        self.next = 0
        self.puts = self.deletes = 0
        self.last = 0

    async def txn(self, ops: list[rpc.RequestOp]) -> None:
        self.last = (await self.c.kvstub.Txn(rpc.TxnRequest(success=ops), timeout=10)).header.revision

    async def preload(self) -> None:
        while len(self.live) < self.keys:
            batch = range(self.next, self.next + min(100, self.keys - len(self.live)))
            await self.txn([rpc.RequestOp(request_put=rpc.PutRequest(key=key(i), value=b"v")) for i in batch])
            self.live.extend(batch)
            self.next = batch[-1] + 1

    async def run(self, until: float) -> None:
        period = TXN / self.rate
        due = time.monotonic()
        while time.monotonic() < until:
            puts = range(self.next, self.next + TXN // 2)
            gone = [self.live.popleft() for _ in range(TXN - len(puts))]
            ops = [rpc.RequestOp(request_put=rpc.PutRequest(key=key(i), value=b"value-%d" % i)) for i in puts]
            ops += [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key(i))) for i in gone]
            await self.txn(ops)
            self.live.extend(puts)
            self.next = puts[-1] + 1
            self.puts += len(puts)
            self.deletes += len(gone)
            due += period
            await asyncio.sleep(max(0.0, due - time.monotonic()))


async def caught_up(rt: DataplaneRuntime, names: list[str], revision: int) -> None:
    """Until every dispatcher's checkpoint is at ``revision`` or past it."""
    while min(rt.checkpoint(n) for n in names) < revision:  # noqa: ASYNC110 (a checkpoint is polled, not signalled)
        await asyncio.sleep(0.1)


async def figures(dsn: str) -> tuple[int, int, int]:
    """(tombstones, live rows, bytes) of the table, counted."""
    t = schema.qualified(CHANGEFEED, TABLE)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            f"SELECT count(*) FILTER (WHERE deleted), count(*) FILTER (WHERE NOT deleted), "
            f"pg_total_relation_size(%s::regclass) FROM {t}",
            (t,),
        )
        found = await cur.fetchone()
    assert found is not None
    return int(found[0]), int(found[1]), int(found[2])


async def main(args: argparse.Namespace) -> None:
    with EtcdServer(progress_notify_interval=args.progress_notify) as etcd, PostgresServer() as pg:
        rt = DataplaneRuntime(gc_interval=args.gc_interval)
        rt.configure(CHANGEFEED, Endpoints(etcd=(etcd.endpoint,), sink=PostgresSink(CHANGEFEED, pg.dsn)))
        whole = KeyRange.of_table(TABLE)
        ranges = whole.split_at(whole.even_split_keys(args.dispatchers)) if args.dispatchers > 1 else (whole,)
        names = [f"d{i}" for i in range(len(ranges))]
        async with aetcd.Client(host=etcd.host, port=etcd.port, timeout=10, options=OPTIONS) as c:
            churn = Churn(c, args.keys, args.rate)
            await churn.preload()
            for name, r in zip(names, ranges, strict=True):
                rt.start(Dispatcher(name=name, changefeed=CHANGEFEED, span=f"s-{name}", table_id=TABLE,
                                    mode=Mode.DEFAULT, key_range=r, capture="bench", start_ts=0, epoch=1))  # fmt: skip
            await caught_up(rt, names, churn.last)  # the initial scans
            print(
                f"{args.keys:,} keys preloaded and scanned; churning {args.rate:,.0f} changes/s for "
                f"{args.duration:.0f} s, {args.dispatchers} dispatchers, gc_interval {args.gc_interval:g} s, "
                f"the checkpoint published every {args.publish_interval:g} s",
                flush=True,
            )
            print(
                f"{'t (s)':>6} {'deletes':>9} {'tombstones':>10} {'live rows':>9} {'size (KiB)':>10} "
                f"{'collected':>9} {'horizon':>8} {'lag (rev)':>9} {'cpu %':>6}",
                flush=True,
            )
            began = time.monotonic()
            writer = asyncio.create_task(churn.run(began + args.duration))
            published = 0

            async def publish() -> None:
                nonlocal published
                while True:
                    await asyncio.sleep(args.publish_interval)
                    published = min(rt.checkpoint(n) for n in names)
                    rt.published(CHANGEFEED, published)

            publisher = asyncio.create_task(publish())
            cpu_at, wall_at = cpu(), time.monotonic()
            peak = 0
            try:
                while not writer.done():
                    await asyncio.wait({writer}, timeout=args.report_interval)
                    tombstones, live, size = await figures(pg.dsn)
                    peak = max(peak, tombstones)
                    stats = rt.tombstone_stats(CHANGEFEED)
                    table = next((t for t in stats["tables"] if t["table_id"] == TABLE), {"horizon": 0})
                    now_cpu, now = cpu(), time.monotonic()
                    share = 100 * (now_cpu - cpu_at) / max(now - wall_at, 1e-9)
                    cpu_at, wall_at = now_cpu, now
                    lag = churn.last - min(rt.checkpoint(n) for n in names)
                    print(
                        f"{now - began:6.0f} {churn.deletes:9,} {tombstones:10,} {live:9,} {size // 1024:10,} "
                        f"{stats['collected']:9,} {table['horizon']:8,} {lag:9,} {share:6.1f}",
                        flush=True,
                    )
                await writer
            finally:
                publisher.cancel()
            stats = rt.tombstone_stats(CHANGEFEED)
            print(
                f"changes written: {churn.puts + churn.deletes:,} ({churn.puts:,} puts, {churn.deletes:,} deletes); "
                f"tombstones collected: {stats['collected']:,} in {stats['collections']} collections; peak tombstones "
                f"held at a report: {peak:,}; changes dropped by the fence: {stats['dropped']:,}; last error: "
                f"{stats['error'] or '-'}",
                flush=True,
            )
            await caught_up(rt, names, churn.last)
            revision = min(rt.checkpoint(n) for n in names)
            rt.published(CHANGEFEED, revision)
            spans = [check.SpanToVerify(TABLE, Mode.DEFAULT, r) for r in ranges]
            async with check.EtcdReader([etcd.endpoint]) as reader:
                results = await check.verify(reader, PostgresSink(CHANGEFEED, pg.dsn), revision, spans, raise_to_horizon=True)
            diffs = sum(len(r.differences) for r in results)
            print(
                f"verify at revision {results[0].revision:,} (horizon {results[0].horizon:,}): {results[0].keys:,} "
                f"keys, {diffs} differences",
                flush=True,
            )
        await rt.aclose()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of churn (default 600)")
    p.add_argument("--rate", type=float, default=1_000.0, help="changes a second (default 1000)")
    p.add_argument("--keys", type=int, default=10_000, help="live keys at all times (default 10000)")
    p.add_argument("--dispatchers", type=int, default=4, help="dispatchers over the table (default 4)")
    p.add_argument("--gc-interval", type=float, default=60.0, help="seconds between collections (default 60)")
    p.add_argument("--publish-interval", type=float, default=15.0, help="seconds between checkpoints published")
    p.add_argument("--report-interval", type=float, default=30.0, help="seconds between reports (default 30)")
    p.add_argument("--progress-notify", type=float, default=1.0, help="etcd's progress-notify interval (s)")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
