"""End to end with the embedded Kubernetes API: a Changefeed with a source (etcd) and a sink (PostgreSQL) named
through Secrets, one pre-split Table placed by a maintainer on two captures (processes); a writer puts,
overwrites and deletes keys across the table's range; once the changefeed's checkpoint passes the writer's
last revision, etcd at that revision and the PostgreSQL rows agree row by row. Then a user Move of one span,
more writes, the same comparison."""

from __future__ import annotations

import asyncio
import base64
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aetcd
import aetcd.rpc
import psycopg
import pytest

from controller.cli.__main__ import main as kubectl_changefeed
from controller.demo.servers import EtcdServer, PostgresServer
from controller.model.keys import table_key
from controller.model.states import OpPhase
from controller.sinks.postgres import schema
from tests.dataplane.conftest import SinkServer
from tests.integration.harness import CHANGEFEED, Api, System, Watch

TABLE = 4242
TLS_TABLE = 4343


def secret(api: Api, name: str, data: dict[str, str]) -> None:
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
    api.ok("POST", f"/api/v1/namespaces/{api.namespace}/secrets", body)
    stored = api.ok("GET", f"/api/v1/namespaces/{api.namespace}/secrets/{name}")
    assert {k: base64.b64decode(v).decode() for k, v in stored["data"].items()} == data
    assert stored["type"] == "Opaque"


def create_changefeed(api: Api, etcd: EtcdServer, sink: SinkServer, *, redo: bool = False) -> None:
    """Changefeed ``cf`` from ``etcd`` to ``sink`` (a server of either sink kind), their endpoints in the Secrets it
    names."""
    secret(api, "source", {"endpoints": etcd.client_url})
    secret(api, "sink", {"dsn": sink.dsn})
    api.create("changefeeds", "Changefeed", CHANGEFEED, {
        "redo": redo,
        "scheduler": {"balanceIntervalSeconds": 0},
        "source": {"etcd": {"secretRef": {"name": "source"}}},
        "sink": {sink.sink_kind: {"secretRef": {"name": "sink"}}},
    })  # fmt: skip


async def write(server: EtcdServer, count: int, seed: int) -> int:
    """``count`` random puts, overwrites and deletes over the table's keys; the last revision."""
    rng = random.Random(seed)
    last = 0
    async with aetcd.Client(host=server.host, port=server.port, timeout=5, options={"grpc.enable_http_proxy": 0}) as c:
        for _ in range(count):
            key = table_key(TABLE) + bytes([rng.randrange(256)]) + b"-%d" % rng.randrange(4)
            if rng.random() < 0.2:
                answer = await c.delete(key)
                last = max(last, answer.header.revision) if answer is not None else last
            else:
                last = (await c.put(key, b"v%d" % rng.randrange(10**6))).header.revision
        last = max(last, (await c.get_range(table_key(TABLE), table_key(TABLE + 1))).header.revision)
    return last


async def upstream_at(server: EtcdServer, revision: int) -> dict[bytes, tuple[bytes, int]]:
    async with aetcd.Client(host=server.host, port=server.port, timeout=5, options={"grpc.enable_http_proxy": 0}) as c:
        request = aetcd.rpc.RangeRequest(key=table_key(TABLE), range_end=table_key(TABLE + 1), revision=revision)
        answer = await c.kvstub.Range(request, timeout=10)
    return {kv.key: (kv.value, kv.mod_revision) for kv in answer.kvs}


def downstream(postgres: PostgresServer, table: int = TABLE) -> dict[bytes, tuple[bytes, int]]:
    with psycopg.connect(postgres.dsn) as conn:
        rows = conn.execute(
            schema.rows_in_range(CHANGEFEED, table), (table_key(table), table_key(table + 1))
        ).fetchall()
    return {k: (bytes(v), rev) for k, v, rev, deleted in rows if not deleted}


def compare(etcd: EtcdServer, postgres: PostgresServer, watch: Watch, last: int) -> None:
    started = time.monotonic()
    watch.until(
        lambda s: (s.changefeed is not None and s.changefeed.checkpoint_ts >= last) or
        f"checkpoint {s.changefeed and s.changefeed.checkpoint_ts} < {last}",
        "the changefeed checkpoint to pass the writer's last revision",
        timeout=40,
    )  # fmt: skip
    print(f"checkpoint passed revision {last} {time.monotonic() - started:.1f}s after the last write")
    expected = asyncio.run(upstream_at(etcd, last))
    got = downstream(postgres)
    missing = sorted(set(expected) - set(got))[:5]
    extra = sorted(set(got) - set(expected))[:5]
    wrong = [k for k in expected if k in got and got[k] != expected[k]][:5]
    assert (missing, extra, wrong) == ([], [], []), "downstream differs from etcd at the checkpoint"
    assert expected, "the writer wrote nothing?"


def lag_shown(api: Api, capsys: pytest.CaptureFixture[str]) -> float:
    """The checkpoint lag ``kubectl changefeed status`` prints for the changefeed (a revision, with seconds)."""
    capsys.readouterr()
    assert (
        kubectl_changefeed(["--kubeconfig", str(api.kubeconfig), "-n", api.namespace, "status", "-c", CHANGEFEED]) == 0
    )
    out = capsys.readouterr().out
    found = re.search(r"Checkpoint:\s+\d+ \(revision, lag (\d+\.\d)s\)", out)
    assert found, out
    return float(found.group(1))


def test_etcd_to_postgres_through_the_maintainer(
    api: Api, tmp_path: Path, etcd: EtcdServer, postgres: PostgresServer, capsys: pytest.CaptureFixture[str]
) -> None:
    create_changefeed(api, etcd, postgres)
    before = asyncio.run(write(etcd, 100, seed=1))  # rows that exist before: copied by the initial scan
    system = System(api, tmp_path)
    try:
        system.capture("c0")
        system.capture("c1")
        system.maintainer("m0")
        spec: dict[str, Any] = {"changefeed": CHANGEFEED, "tableID": TABLE, "preSplit": {"spans": 4}}
        api.create("tables", "Table", f"t{TABLE}", spec, labels={"cdc.maintainer.dev/changefeed": CHANGEFEED})
        watch = Watch(api, system)
        snap = watch.until(
            lambda s: len({d.capture for d in s.live_dispatchers()}) == 2 and
            all(d.checkpoint_ts > 0 for d in s.live_dispatchers()) and len(s.live_dispatchers()) == 4,
            "4 spans Working on 2 captures",
        )  # fmt: skip
        assert all(d.checkpoint_ts >= before for d in snap.live_dispatchers())  # ts = etcd revisions
        started = time.monotonic()
        last = asyncio.run(write(etcd, 400, seed=2))
        took = time.monotonic() - started
        print(f"writer: 400 changes in {took:.2f}s ({400 / took:.0f}/s)")
        compare(etcd, postgres, watch, last)
        # The lag is in wall-clock seconds (the captures' reports carry the time a revision stands for), not
        # the revision read as a TSO (which would be 1970): small once caught up.
        lag = lag_shown(api, capsys)
        assert lag < 30, lag

        # A user Move of one span to the other capture; more writes; the same comparison.
        snap = watch.poll()
        mover = snap.live_dispatchers()[0]
        target = "c1" if mover.capture == "c0" else "c0"
        api.operator("op-move", "Move", [mover.span], target=target)
        last = asyncio.run(write(etcd, 300, seed=3))
        watch.until(
            lambda s: ((o := s.operators.get("op-move")) is not None and o.phase is OpPhase.SUCCEEDED) or
            f"move: {o and (o.phase, o.message)}",
            "the Move to succeed",
        )  # fmt: skip
        assert any(d.span == mover.span and d.capture == target for d in watch.poll().live_dispatchers())
        compare(etcd, postgres, watch, last)
        for proc in system.procs.values():
            text = proc.log.read_text(errors="replace")
            assert postgres.dsn not in text, f"{proc.name} logged the DSN"
            if proc.name != "m0":
                assert "initial scan" in text  # the real runtime ran here, not the logical clock
    except BaseException:
        print(system.tails())
        raise
    finally:
        system.stop_all()


def test_a_tls_source_named_by_its_secret_replicates_and_verifies(
    api: Api,
    tmp_path: Path,
    start_etcd: Callable[..., EtcdServer],
    postgres: PostgresServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TLS to etcd through the source Secret's keys (``ca.crt``, ``tls.crt``, ``tls.key``, as a
    ``kubernetes.io/tls`` Secret names them) against an etcd that asks for a client certificate. First the Secret's
    endpoints mix http:// and https://: the capture refuses it with a warning that says so and reads nothing. The
    Secret fixed, the capture replicates (initial scan and watch) over TLS, and ``kubectl changefeed verify`` reads
    the same Secret and finds 0 differences. No PEM and no DSN in any output."""
    server = start_etcd(tls=True, client_cert_auth=True)  # its own etcd; its own table in the shared PostgreSQL

    pem = tmp_path / "pem"
    pem.mkdir()
    for name, blob in (("ca", server.ca_pem), ("cert", server.client_cert_pem), ("key", server.client_key_pem)):
        (pem / name).write_bytes(blob)

    def put(key: bytes, value: bytes) -> int:
        """In a process of its own: gRPC over TLS in the test process left it busy, and a later test's fork of a
        PostgreSQL restart then crashed the child (CI, SIGSEGV before its exec)."""
        script = (
            "import asyncio, sys, aetcd.rpc\n"
            "from pathlib import Path\n"
            "from controller.sources.etcd import connection as etcd\n"
            "p = Path(sys.argv[2])\n"
            "tls = etcd.Tls(ca=(p / 'ca').read_bytes(), cert=(p / 'cert').read_bytes(), key=(p / 'key').read_bytes())\n"
            "async def main():\n"
            "    c = await etcd.Connection.open(sys.argv[1], tls=tls)\n"
            "    put = aetcd.rpc.PutRequest(key=bytes.fromhex(sys.argv[3]), value=bytes.fromhex(sys.argv[4]))\n"
            "    a = await c.kvstub.Put(put, timeout=5)\n"
            "    await c.close()\n"
            "    print(a.header.revision)\n"
            "asyncio.run(main())\n"
        )
        out = subprocess.run([sys.executable, "-c", script, server.client_url, str(pem), key.hex(), value.hex()],
                             check=True, capture_output=True, text=True, timeout=60)  # fmt: skip
        return int(out.stdout.split()[-1])

    first = put(table_key(TLS_TABLE) + b"before", b"scanned")
    data = {"ca.crt": server.ca_pem.decode(), "tls.crt": server.client_cert_pem.decode(),
            "tls.key": server.client_key_pem.decode()}  # fmt: skip
    secret(api, "source", {"endpoints": f"{server.client_url},http://{server.endpoint}", **data})
    secret(api, "sink", {"dsn": postgres.dsn})
    api.create("changefeeds", "Changefeed", CHANGEFEED, {
        "source": {"etcd": {"secretRef": {"name": "source"}}},
        "sink": {"postgres": {"secretRef": {"name": "sink"}}},
    })  # fmt: skip
    system = System(api, tmp_path)
    try:
        system.capture("c0")
        system.maintainer("m0")
        spec: dict[str, Any] = {"changefeed": CHANGEFEED, "tableID": TLS_TABLE}
        api.create("tables", "Table", f"t{TLS_TABLE}", spec, labels={"cdc.maintainer.dev/changefeed": CHANGEFEED})
        deadline = time.monotonic() + 30
        while system.procs["c0"].count("the etcd endpoints mix http:// and https://") == 0:
            assert time.monotonic() < deadline, system.tails()
            time.sleep(0.2)
        assert system.procs["c0"].count("initial scan") == 0  # nothing read from the source

        fixed = {"endpoints": server.client_url, **data}
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "source"}, "stringData": fixed}
        api.ok("PUT", f"/api/v1/namespaces/{api.namespace}/secrets/source", body)
        watch = Watch(api, system)
        watch.until(lambda s: any(d.checkpoint_ts > 0 for d in s.live_dispatchers()), "the initial scan over TLS")
        last = put(table_key(TLS_TABLE) + b"after", b"watched")
        watch.until(
            lambda s: (s.changefeed is not None and s.changefeed.checkpoint_ts >= last) or "behind",
            "the checkpoint to pass the write over TLS",
            timeout=40,
        )
        assert downstream(postgres, TLS_TABLE) == {
            table_key(TLS_TABLE) + b"before": (b"scanned", first),
            table_key(TLS_TABLE) + b"after": (b"watched", last),
        }
        base = ["--kubeconfig", str(api.kubeconfig), "-n", api.namespace]
        done = subprocess.run(
            [sys.executable, "-m", "controller.cli", *base, "verify", "-c", CHANGEFEED],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip (its own process, as above)
        rc, out, err = done.returncode, done.stdout, done.stderr
        assert rc == 0, (out, err)
        assert f"table {TLS_TABLE} (default): 2 keys at revision" in out
        assert "0 differences" in out
        for text in (out, err, *(p.log.read_text(errors="replace") for p in system.procs.values())):
            assert "BEGIN" not in text  # no PEM
            assert postgres.dsn not in text
    except BaseException:
        print(system.tails())
        raise
    finally:
        system.stop_all()
