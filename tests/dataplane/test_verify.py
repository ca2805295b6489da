"""``verify`` against a real etcd and a real PostgreSQL (controller/dataplane/verify.py), and ``kubectl
changefeed verify`` end to end against the embedded Kubernetes API (controller/cli/verify.py).

The downstream rows are written here exactly as the dispatcher runtime writes them: every change through
``schema.apply`` with its etcd ``mod_revision``, a delete as a tombstone at the delete's revision. Then rows
are corrupted, deleted and added by hand, and each is reported.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import psycopg
import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.cli.__main__ import main
from controller.dataplane import verify as check
from controller.demo.servers import EtcdServer, PostgresServer
from controller.kube.client import RESOURCES, Client, Config
from controller.model import resources as conv
from controller.model.keys import KeyRange, table_key
from controller.model.records import Changefeed, Span
from controller.model.states import Kind, Mode, SpanState
from controller.model.verification import LAST_VERIFY_ANNOTATION, verification_from_json
from controller.sinks.postgres import PostgresSink, schema
from tests.kube.conftest import CRDS

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def client(server: EtcdServer) -> aetcd.Client:
    return aetcd.Client(host=server.host, port=server.port, timeout=5, options={"grpc.enable_http_proxy": 0})


def key(table: int, row: str) -> bytes:
    return table_key(table) + row.encode()


class Feed:
    """One changefeed's source writes mirrored into its sink, as a dispatcher would apply them."""

    def __init__(self, etcd: EtcdServer, postgres: PostgresServer, changefeed: str, table: int) -> None:
        self.etcd, self.postgres, self.changefeed, self.table = etcd, postgres, changefeed, table
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            conn.execute(schema.create_schema(changefeed))
            conn.execute(schema.create_table(changefeed, table))

    def write(self, *changes: tuple[str, bytes | None]) -> list[tuple[bytes, bytes | None, int, bool]]:
        """Put (value) or delete (None) each key in etcd; the changes with their revisions, not applied yet."""

        async def body() -> list[tuple[bytes, bytes | None, int, bool]]:
            out = []
            async with client(self.etcd) as c:
                for row, value in changes:
                    k = key(self.table, row)
                    if value is None:
                        rev = (await c.delete(k)).header.revision
                        out.append((k, None, rev, True))
                    else:
                        rev = (await c.put(k, value)).header.revision
                        out.append((k, value, rev, False))
            return out

        return run(body())

    def apply(self, changes: list[tuple[bytes, bytes | None, int, bool]]) -> None:
        with psycopg.connect(self.postgres.dsn) as conn, conn.transaction():
            for change in changes:
                conn.execute(schema.apply(self.changefeed, self.table), change)

    def sql(self, statement: str, params: tuple[Any, ...]) -> None:
        with psycopg.connect(self.postgres.dsn, autocommit=True) as conn:
            conn.execute(statement.replace("TABLE", schema.qualified(self.changefeed, self.table)), params)

    def verify(self, revision: int, spans: list[KeyRange] | None = None) -> list[check.TableResult]:
        targets = [check.SpanToVerify(self.table, Mode.DEFAULT, r) for r in spans or [KeyRange.of_table(self.table)]]

        async def body() -> list[check.TableResult]:
            async with check.EtcdReader([self.etcd.endpoint]) as reader:
                return await check.verify(reader, PostgresSink(self.changefeed, self.postgres.dsn), revision, targets)

        return run(body())


def kinds(results: list[check.TableResult]) -> list[tuple[str, bytes]]:
    return [(d.kind.value, d.key) for r in results for d in r.differences]


def test_verify_finds_each_corruption(etcd: EtcdServer, postgres: PostgresServer, table_id: int) -> None:
    feed = Feed(etcd, postgres, f"vf-{table_id}", table_id)
    changes = feed.write(("a", b"1"), ("b", b"2"), ("c", b"3"), ("a", b"1'"), ("b", None), ("d", b"4"))
    feed.apply(changes)
    r = changes[-1][2]
    halves = KeyRange.of_table(table_id).split_at([key(table_id, "c")])
    for spans in (None, list(halves)):
        results = feed.verify(r, spans)
        assert kinds(results) == []
        assert results[0].keys == 3  # a, c, d (b is a tombstone etcd has no key for)

    # Writes go on after R: the sink runs ahead; those rows are checked at their own revision.
    later = feed.write(("c", b"3'"), ("e", b"5"), ("d", None))
    feed.apply(later)
    results = feed.verify(r, list(halves))
    assert kinds(results) == []
    assert results[0].ahead == 3

    feed.sql("UPDATE TABLE SET value = %s WHERE key = %s", (b"corrupt", key(table_id, "a")))
    feed.sql("DELETE FROM TABLE WHERE key = %s", (key(table_id, "c"),))  # c: at R etcd held b"3"
    feed.sql("INSERT INTO TABLE VALUES (%s, %s, %s, false)", (key(table_id, "x"), b"extra", r - 1))
    feed.sql("UPDATE TABLE SET value = %s WHERE key = %s", (b"wrong", key(table_id, "e")))  # ahead of R
    feed.sql("UPDATE TABLE SET deleted = false, value = %s WHERE key = %s", (b"back", key(table_id, "b")))
    results = feed.verify(r)
    assert sorted(kinds(results)) == [
        ("extra", key(table_id, "b")),  # a live row etcd did not hold at R (a tombstone there is fine)
        ("extra", key(table_id, "x")),
        ("mismatch", key(table_id, "a")),
        ("mismatch", key(table_id, "e")),  # at its own revision
        ("missing", key(table_id, "c")),
    ]
    e = next(d for d in results[0].differences if d.key == key(table_id, "e"))
    assert e.at == later[1][2]


def test_rows_ahead_at_a_compacted_revision_are_unverifiable(
    start_etcd: Callable[..., EtcdServer], postgres: PostgresServer, table_id: int
) -> None:
    server = start_etcd()
    feed = Feed(server, postgres, f"vf-{table_id}", table_id)
    first = feed.write(("a", b"1"), ("b", b"2"))
    feed.apply(first)
    r = first[-1][2]
    ahead = feed.write(("a", b"2"), ("a", b"3"))
    feed.apply(ahead[:1])  # the sink holds a@(r+1), etcd has since rewritten a
    run(_compact(server, ahead[-1][2]))
    with pytest.raises(check.VerifyError, match="compacted") as refused:
        feed.verify(r)
    assert refused.value.refused
    # A verification that had chosen R before the compaction: its point read of a's row (ahead of R, at
    # r+1) now finds the revision compacted, which compare() counts as unverifiable.

    async def point() -> check.PointRead:
        async with check.EtcdReader([server.endpoint]) as reader:
            return await reader.point(key(table_id, "a"), ahead[0][2])

    assert run(point()) is check.COMPACTED
    # At the compaction point itself: readable, and the sink (once caught up) matches.
    feed.apply(ahead[1:])
    more = feed.write(("b", b"3"))
    feed.apply(more)
    results = feed.verify(ahead[-1][2])
    assert kinds(results) == []
    assert (results[0].ahead, results[0].unverifiable) == (1, 0)


async def _compact(server: EtcdServer, revision: int) -> None:
    async with client(server) as c:
        await c.compact(revision, physical=True)


def test_unreachable_servers_fail(postgres: PostgresServer, table_id: int) -> None:
    async def body() -> None:
        async with check.EtcdReader(["127.0.0.1:1"], timeout=2) as reader:
            await check.verify(reader, PostgresSink("none", postgres.dsn), 1, [])

    with pytest.raises(check.VerifyError, match="etcd") as failed:
        run(body())
    assert not failed.value.refused


# -- the command, end to end against the embedded API -------------------------------------------------


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServerHandle]:
    handle = start_server(CRDS)
    try:
        yield handle
    finally:
        handle.stop()


def _setup_api(api: ApiServerHandle, namespace: str, changefeed: str, table: int, checkpoint: int) -> None:
    async def body() -> None:
        async with Client(Config.load(str(api.kubeconfig_path))) as c:
            ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            await c.request("create", "POST", "/api/v1/namespaces", body=ns)
            feed = Changefeed(name=changefeed, namespace=namespace)
            await c.create(RESOURCES[Kind.CHANGEFEED], namespace, conv.to_resource(feed))
            status = {"status": {"checkpointTs": checkpoint}}
            await c.patch(RESOURCES[Kind.CHANGEFEED], namespace, changefeed, status, sub="status")
            whole = KeyRange.of_table(table)
            for i, rng in enumerate(whole.split_at([key(table, "c")])):
                s = Span(name=f"s{i}", namespace=namespace, changefeed=changefeed, table_id=table, key_range=rng,
                         state=SpanState.REPLICATING, checkpoint_ts=checkpoint)  # fmt: skip
                await c.create(RESOURCES[Kind.SPAN], namespace, conv.to_resource(s))

    run(body())


def _annotation(api: ApiServerHandle, namespace: str, changefeed: str) -> Any:
    async def body() -> Any:
        async with Client(Config.load(str(api.kubeconfig_path))) as c:
            obj = await c.get(RESOURCES[Kind.CHANGEFEED], namespace, changefeed)
            return (obj.get("metadata", {}).get("annotations") or {}).get(LAST_VERIFY_ANNOTATION)

    return run(body())


def test_the_command(
    api: ApiServerHandle,
    etcd: EtcdServer,
    postgres: PostgresServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    cf, ns = f"vf-{table_id}", f"vf-{table_id}"
    feed = Feed(etcd, postgres, cf, table_id)
    changes = feed.write(("a", b"1"), ("b", b"2"), ("d", b"4"), ("b", None))
    feed.apply(changes)
    r = changes[-1][2]
    _setup_api(api, ns, cf, table_id, r)
    base = ["--kubeconfig", str(api.kubeconfig_path), "-n", ns, "verify", "-c", cf]
    flags = ["--etcd-endpoints", etcd.endpoint, "--dsn", postgres.dsn]

    def cli(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main([*base, *args])
        out, err = capsys.readouterr()
        assert postgres.dsn not in out + err
        return rc, out, err

    rc, out, err = cli(*flags)
    assert (rc, err) == (0, "")
    assert out.splitlines() == [f"table {table_id} (default): 2 keys at revision {r}: 0 differences"]
    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    recorded = verification_from_json(_annotation(api, ns, cf))
    assert recorded is not None
    assert (recorded.revision, recorded.differences, recorded.keys) == (r, 0, 2)

    feed.write(("a", b"later"))  # not applied: etcd moves on, the sink lags, both are fine at R
    feed.sql("UPDATE TABLE SET value = %s WHERE key = %s", (b"corrupt", key(table_id, "d")))
    feed.sql("INSERT INTO TABLE VALUES (%s, %s, %s, false)", (key(table_id, "z"), b"extra", r))
    rc, out, err = cli(*flags, "--limit", "1")
    assert rc == 1
    lines = out.splitlines()
    assert lines[0] == f"table {table_id} (default): 3 keys at revision {r}: 2 differences"
    assert lines[2].split()[:5] == ["KIND", "TABLE", "MODE", "KEY", "AT"]
    assert lines[3].split()[:5] == ["mismatch", str(table_id), "default", key(table_id, "d").hex(), str(r)]
    assert lines[4] == "... and 1 more (--limit)"
    assert json.loads(_annotation(api, ns, cf))["differences"] == 2

    # Refusals: exit 2, one error line.
    for args, message in [
        ((*flags, "--revision", str(r + 1)), "above the changefeed's checkpoint"),
        (("--dsn", postgres.dsn), "names no etcd source"),
        (("--etcd-endpoints", etcd.endpoint), "names no sink"),
        ((*flags[:1], f"https://{etcd.endpoint},{etcd.endpoint}", *flags[2:]), "mix http:// and https://"),
        ((*flags, "--etcd-cert", str(pem)), "needs its key"),
        ((*flags, "--etcd-cacert", str(pem)), "use https:// endpoints for TLS"),
        ((*flags, "--etcd-cacert", str(pem.parent / "nope.pem")), "--etcd-cacert: cannot read"),
    ]:
        rc, out, err = cli(*args)
        assert rc == 2, err
        assert err.startswith("error: ")
        assert message in err
        assert len(err.splitlines()) == 1
    capsys.readouterr()
    assert main([*base[:-1], "no-such", *flags]) == 2
    # TLS spoken to a plaintext etcd: the handshake fails, exit 1, with the endpoint.
    rc, out, err = cli("--etcd-endpoints", f"https://{etcd.endpoint}", "--dsn", postgres.dsn)
    assert rc == 1
    assert err.startswith(f"error: cannot reach etcd at https://{etcd.endpoint}")
    # An unreachable sink: exit 1, without the DSN.
    rc, out, err = cli("--etcd-endpoints", etcd.endpoint, "--dsn", "host=127.0.0.1 port=1 user=secret-user")
    assert rc == 1
    assert err.startswith("error: cannot read the sink (postgres host=127.0.0.1 port=1 dbname=): "), err
    assert "secret-user" not in err
