"""The lag through failures (issue 38): a writer at a steady rate, the maintainer SIGKILLed with a Move, a Split and a
Merge in flight, then a capture SIGKILLed; the lag sampled throughout. Prints figures; asserts nothing.

    .venv/bin/python bench/dataplane_failover.py                     # 1,000 changes/s, Lease 15 s
    .venv/bin/python bench/dataplane_failover.py --rate 500 --lease 8 --capture-renew 1

A real etcd and a real PostgreSQL on loopback, the embedded Kubernetes API in this process, the maintainer and
three captures as processes (``controller.demo``'s ``System``), a changefeed of 4 tables pre-split into 4 spans each.
Two lags, both against the writer's own record of when it wrote each revision (``Writer.written_after``: ground
truth, not what the processes say of themselves), sampled every ``--every`` seconds:

* **checkpoint lag**: now minus when the writer first wrote above the Changefeed's ``status.checkpointTs`` (what
  ``kubectl changefeed status``, the metrics and the alert show). It moves when the maintainer writes a checkpoint
  from the captures' reports, which ride on their Lease renewals (``--capture-renew``, 2 s by default): at rest it
  sits around that interval.
* **sink lag**: the same, of the revision up to which the sink holds every span: for each Span the highest revision
  the sink's ``checkpoints`` table records for the ranges that cover it (each row says every change of its range up
  to its revision is committed, written in the transaction of those rows; a parent's row covers its children's
  ranges, its origins' rows a merged span's), the lowest over the Spans. What a reader of PostgreSQL sees.

Phases: steady state (``--steady`` s: p50 / p99 / max); the maintainer SIGKILLed with the three operators held in
RemoveOrigin, a new maintainer started and the hooks released at once (peak, and seconds from the kill until each lag
is back under its bound and stays there for 5 s: the sink lag under ``--under`` s, the checkpoint lag under the steady
state's p99 plus ``--under``, since at rest it is about a report interval); one capture SIGKILLed (the same figures;
its spans are placed again once its Lease ran out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.apiserver.server import start_server
from controller.demo.servers import EtcdServer, PostgresServer
from controller.demo.writer import Writer
from controller.demo.__main__ import HOLD_CLOSE, System, set_hook, snapshot
from controller.kube.client import RESOURCES, Client, Config
from controller.model.states import API_VERSION, Kind
from controller.sinks.postgres import schema

NS = "bench-lag"
CF = "lagbench"
TABLES = (301, 302, 303, 304)


class Lags:
    """The two lags, sampled."""

    def __init__(self, client: Client, dsn: str, writer: Writer) -> None:
        self.client, self.dsn, self.writer = client, dsn, writer
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, checkpoint lag, sink lag)

    def _lag(self, revision: int, now: float) -> float:
        first = self.writer.written_after(revision)
        return 0.0 if first is None else max(0.0, now - first)

    def _sink_ranges(self) -> list[tuple[bytes, bytes, int]]:
        with psycopg.connect(self.dsn, connect_timeout=5) as conn:
            try:
                rows = conn.execute(f"SELECT span_start, span_end, revision FROM {schema.checkpoints(CF)}").fetchall()
            except psycopg.errors.UndefinedTable:
                return []
        return [(bytes(a), bytes(b), int(r)) for a, b, r in rows]

    async def sample(self) -> tuple[float, float]:
        snap = await snapshot(self.client, NS)
        cfs = snap[Kind.CHANGEFEED]
        checkpoint = int((cfs[0].get("status") or {}).get("checkpointTs") or 0) if cfs else 0
        committed = await asyncio.to_thread(self._sink_ranges)
        per_span: list[int] = []
        for s in snap[Kind.SPAN]:
            if (s.get("metadata") or {}).get("deletionTimestamp"):
                continue
            lo, hi = bytes.fromhex(s["spec"]["startKey"]), bytes.fromhex(s["spec"]["endKey"])
            per_span.append(complete_up_to(lo, hi, committed))
        sink = min(per_span) if per_span else 0
        now = time.time()
        lags = (self._lag(checkpoint, now), self._lag(sink, now))
        self.samples.append((time.monotonic(), *lags))
        return lags

    async def run(self, seconds: float, every: float) -> list[tuple[float, float, float]]:
        began = len(self.samples)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await self.sample()
            await asyncio.sleep(every)
        return self.samples[began:]

    async def recovery(self, since: float, bounds: tuple[float, float], every: float, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """Sample until each lag has stayed under its bound (checkpoint, sink) for 5 s (or ``timeout``): the peak of
        each, and when each went back under its bound for good (seconds after ``since``)."""
        began = len(self.samples)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await self.sample()
            window = [s for s in self.samples[began:] if s[0] >= time.monotonic() - 5.0]
            if time.monotonic() - since > 5.0 and window and all(s[1] < bounds[0] and s[2] < bounds[1] for s in window):
                break
            await asyncio.sleep(every)
        got = self.samples[began:]
        out: dict[str, Any] = {}
        for i, name in ((1, "checkpoint"), (2, "sink")):
            bound = bounds[i - 1]
            over = [s[0] for s in got if s[i] >= bound]
            out[name] = {
                "bound_s": round(bound, 2),
                "peak_s": round(max((s[i] for s in got), default=0.0), 2),
                "back_under_after_s": round((over[-1] if over else since) - since, 2) if got else None,
                "recovered": bool(got) and got[-1][i] < bound,
            }
        return out


def complete_up_to(lo: bytes, hi: bytes, rows: list[tuple[bytes, bytes, int]]) -> int:
    """The revision up to which the sink holds every change of ``[lo, hi)``: each row says so of its own range, and a
    range covered by several (a merged span's, by its origins' rows) is complete up to the least of what covers each
    of its parts."""
    cuts = sorted({lo, hi, *(k for a, b, _ in rows for k in (a, b) if lo < k < hi)})
    return min(
        max((r for a, b, r in rows if a <= x and y <= b), default=0) for x, y in itertools.pairwise(cuts)
    )


def figures(samples: list[tuple[float, float, float]]) -> dict[str, Any]:
    out = {}
    for i, name in ((1, "checkpoint"), (2, "sink")):
        xs = sorted(s[i] for s in samples)
        if xs:
            out[name] = {
                "p50_s": round(statistics.median(xs), 3),
                "p99_s": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3),
                "max_s": round(xs[-1], 3),
            }
    return out


async def setup(client: Client, etcd: EtcdServer, pg: PostgresServer) -> None:
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    await client.request("create", "POST", "/api/v1/namespaces", body=ns)
    for name, data in (("src", {"endpoints": etcd.client_url}), ("dst", {"dsn": pg.dsn})):
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
        await client.request("create", "POST", f"/api/v1/namespaces/{NS}/secrets", body=body)
    cf = {
        "apiVersion": API_VERSION,
        "kind": "Changefeed",
        "metadata": {"name": CF},
        "spec": {
            "source": {"etcd": {"secretRef": {"name": "src"}}},
            "sink": {"postgres": {"secretRef": {"name": "dst"}}},
            "scheduler": {"balanceIntervalSeconds": 0},
        },
    }
    await client.create(RESOURCES[Kind.CHANGEFEED], NS, cf)
    for t in TABLES:
        spec = {"changefeed": CF, "tableID": t, "preSplit": {"spans": 4}}
        body = {"apiVersion": API_VERSION, "kind": "Table", "metadata": {"name": f"t{t}"}, "spec": spec}
        await client.create(RESOURCES[Kind.TABLE], NS, body)


async def wait(client: Client, what: str, cond: Any, timeout: float = 120.0) -> dict[Kind, list[dict[str, Any]]]:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while True:
        snap = await snapshot(client, NS)
        if cond(snap):
            return snap
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f} s")
        await asyncio.sleep(0.25)


def replicating(snap: dict[Kind, list[dict[str, Any]]]) -> bool:
    spans = snap[Kind.SPAN]
    return len(spans) >= 4 * len(TABLES) and all((s.get("status") or {}).get("state") == "Replicating" for s in spans)


async def operators_in_flight(client: Client, system: System) -> list[str]:
    """A Move, a Split and a Merge, held in RemoveOrigin by the capture hooks (hold-close)."""
    snap = await snapshot(client, NS)
    spans = sorted(snap[Kind.SPAN], key=lambda s: (s["spec"]["tableID"], s["spec"]["startKey"]))
    by_table: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        by_table.setdefault(s["spec"]["tableID"], []).append(s)
    a, b, c = (by_table[t] for t in TABLES[:3])
    target = next(x for x in system.capture_names if x != a[0]["status"]["capture"])
    ops = {
        "lag-move": {"type": "Move", "spans": [a[0]["metadata"]["name"]], "target": target},
        "lag-split": {"type": "Split", "spans": [b[0]["metadata"]["name"]], "splitInto": 2},
        "lag-merge": {"type": "Merge", "spans": [c[0]["metadata"]["name"], c[1]["metadata"]["name"]]},
    }
    for cap in system.capture_names:
        await set_hook(client, NS, cap, HOLD_CLOSE, "*")
    for name, spec in ops.items():
        meta, full = {"name": name}, {"changefeed": CF, **spec}
        body = {"apiVersion": API_VERSION, "kind": "SpanOperator", "metadata": meta, "spec": full}
        await client.create(RESOURCES[Kind.OPERATOR], NS, body)

    def held(snap: dict[Kind, list[dict[str, Any]]]) -> bool:
        stages = {o["metadata"]["name"]: (o.get("status") or {}).get("stage") for o in snap[Kind.OPERATOR]}
        return all(stages.get(n) == "RemoveOrigin" for n in ops)

    await wait(client, "the operators held in RemoveOrigin", held, 60)
    return list(ops)


async def main(a: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(EtcdServer(progress_notify_interval=a.progress_notify))
        pg = stack.enter_context(PostgresServer())
        handle = start_server(Path(__file__).resolve().parents[1] / "crds")
        stack.callback(handle.stop)
        log_dir = Path(tempfile.mkdtemp(prefix="cfm-lag-bench-"))
        system = System(str(handle.kubeconfig_path), NS, 3, log_dir)
        system.maintainer_args = ["--lease-duration", str(a.lease), "--renew-deadline", str(a.lease * 2 / 3)]
        stack.callback(system.stop)
        client = Client(Config.load(str(handle.kubeconfig_path)))
        try:
            await setup(client, etcd, pg)
            writer = Writer(etcd.host, etcd.port, TABLES, rate=a.rate, batch=50, keys=65_536, seed=3).start()
            stack.callback(writer.stop)
            maintainer = system.start_maintainer()
            system.start_captures(["--renew-interval", str(a.capture_renew)])
            await wait(client, "every span Replicating", replicating, 120)
            await asyncio.sleep(5.0)
            lags = Lags(client, pg.dsn, writer)
            print(f"etcd progress notifications every {a.progress_notify} s, writer {a.rate:.0f} changes/s, "
                  f"maintainer Lease {a.lease} s, captures renew every {a.capture_renew} s; logs in {log_dir}",
                  flush=True)  # fmt: skip
            steady = figures(await lags.run(a.steady, a.every))
            print(f"steady state, {a.steady:.0f} s: {steady}", flush=True)
            bounds = (steady["checkpoint"]["p99_s"] + a.under, a.under)

            await operators_in_flight(client, system)
            killed = time.monotonic()
            system.kill(maintainer)
            system.start_maintainer()
            for cap in system.capture_names:
                await set_hook(client, NS, cap, HOLD_CLOSE, None)
            rec = await lags.recovery(killed, bounds, a.every, a.timeout)
            snap = await snapshot(client, NS)
            phases = {o["metadata"]["name"]: (o.get("status") or {}).get("phase") for o in snap[Kind.OPERATOR]}
            print(f"maintainer SIGKILL with a Move, a Split and a Merge in flight (bound: Lease {a.lease} + 5 s = "
                  f"{a.lease + 5:.0f} s): {rec}; operators {phases}", flush=True)  # fmt: skip

            victim = system.capture_names[0]
            killed = time.monotonic()
            system.kill(victim)
            rec = await lags.recovery(killed, bounds, a.every, a.timeout)
            print(f"capture SIGKILL ({victim}; its Lease lasts 10 s): {rec}", flush=True)
            print(f"writer: {writer.changes} changes up to revision {writer.last}", flush=True)
        finally:
            await client.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1_000.0, help="the writer's changes a second")
    p.add_argument("--lease", type=float, default=15.0, help="the maintainer's Lease duration, s")
    p.add_argument("--capture-renew", type=float, default=2.0, help="the captures' renew interval (their reports), s")
    p.add_argument("--progress-notify", type=float, default=1.0, help="etcd's progress notification interval, s")
    p.add_argument("--steady", type=float, default=20.0, help="seconds of steady state measured")
    p.add_argument("--under", type=float, default=1.0, help="the lag a recovery is judged against, s")
    p.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=90.0, help="at most this long per recovery, s")
    asyncio.run(main(p.parse_args()))
