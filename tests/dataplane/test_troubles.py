"""A changefeed broken from its first second says why on the Changefeed, and replicates once fixed, without a restart.

One maintainer and one capture run as processes on the embedded API; a real etcd (the session's, and a TLS one) and
a real PostgreSQL whose roles log in with passwords. Each changefeed is broken in one way a person meets: a Secret
missing, a key missing, an endpoint malformed, the source or the sink refusing connections, a wrong password, TLS
verification failing, a grant missing, a sink table altered by hand. Within 30 s each shows it: the condition
SourceUnavailable or SinkUnavailable True with the reason (ConfigurationError: a person must act; Retrying: the
captures expect it to pass) and a message that says what and where, a warning Event, a line of ``kubectl changefeed
status``, and ``verify`` saying why there is no checkpoint. Then each is fixed the way a person would (the Secret
changed or created, the grant given, the table put back): the capture uses it within 30 s, the changefeed
replicates, verify finds 0 differences and the condition goes False. Rotations (a password, a client certificate)
are used within 30 s without a restart.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aetcd.rpc
import psycopg
import pytest

from controller.apiserver.tls import self_signed
from controller.cli.__main__ import main as kubectl_changefeed
from controller.demo.servers import EtcdServer, PostgresServer, free_port
from controller.engine.maintainer import (
    CONFIGURATION_ERROR,
    RETRYING,
    SINK_EVENT,
    SINK_UNAVAILABLE,
    SOURCE_EVENT,
    SOURCE_UNAVAILABLE,
)
from controller.model.keys import table_key
from controller.model.records import Condition
from controller.model.resources import changefeed_from_resource
from controller.sinks.postgres import schema
from controller.sources.etcd.connection import Connection, Tls
from tests.integration.harness import Api, System

#: How soon a trouble must show, and a fix be used.
WITHIN = 30.0
PASSWORD, ROTATED = "first-password", "second-password"


@pytest.fixture
def pg(start_postgres: Callable[..., PostgresServer]) -> PostgresServer:
    """A PostgreSQL whose role ``cdc`` logs in with :data:`PASSWORD` and may create the changefeeds' schemas; role
    ``nogrant`` may log in, nothing more."""
    server = start_postgres(passwords=True)
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE cdc LOGIN PASSWORD '{PASSWORD}'")
        admin.execute(f"GRANT CREATE ON DATABASE {server.database} TO cdc")
        admin.execute(f"CREATE ROLE nogrant LOGIN PASSWORD '{PASSWORD}'")
    return server


def dsn(pg: PostgresServer, user: str = "cdc", password: str = PASSWORD, port: int | None = None) -> str:
    return f"host={pg.host} port={port or pg.port} dbname={pg.database} user={user} password={password}"


def put_secret(api: Api, name: str, data: dict[str, str]) -> None:
    """Create or replace Secret ``name``."""
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
    path = f"/api/v1/namespaces/{api.namespace}/secrets"
    if api.req("GET", f"{path}/{name}")[0] == 404:
        api.ok("POST", path, body)
    else:
        api.ok("PUT", f"{path}/{name}", body)


def changefeed(api: Api, name: str, table_id: int) -> None:
    """Changefeed ``name`` from Secret ``<name>-source`` to ``<name>-sink``, one table pre-split into 2 spans."""
    api.create("changefeeds", "Changefeed", name, {
        "scheduler": {"balanceIntervalSeconds": 0},
        "source": {"etcd": {"secretRef": {"name": f"{name}-source"}}},
        "sink": {"postgres": {"secretRef": {"name": f"{name}-sink"}}},
    })  # fmt: skip
    api.create("tables", "Table", f"{name}-t", {"changefeed": name, "tableID": table_id, "preSplit": {"spans": 2}},
               labels={"cdc.maintainer.dev/changefeed": name})  # fmt: skip


def cli(api: Api, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = kubectl_changefeed(["--kubeconfig", str(api.kubeconfig), "-n", api.namespace, *args])
    out, err = capsys.readouterr()
    return rc, out + err


def condition(api: Api, name: str, kind: str) -> Condition | None:
    raw = api.get("changefeeds", name)
    return changefeed_from_resource(raw).condition(kind) if raw else None


def events(api: Api, name: str, reason: str) -> list[dict[str, Any]]:
    items = api.ok("GET", f"/api/v1/namespaces/{api.namespace}/events")["items"]
    return [e for e in items if e.get("reason") == reason and (e.get("involvedObject") or {}).get("name") == name]


def until(check: Callable[[], object], what: str, timeout: float = WITHIN) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = check()
        if last is True:
            return
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout:g} s: {what} (last: {last})")


async def _write(server: EtcdServer, table_id: int, tls: tuple[bytes, bytes, bytes] | None = None) -> int:
    """Puts, overwrites and a delete in the table; the last revision. ``tls``: CA, client certificate and key."""
    conn = await Connection.open(server.client_url, tls=Tls(*tls) if tls else None)
    try:
        last = 0
        for i in range(30):
            key = table_key(table_id) + bytes([i * 8]) + b"-k"
            put = aetcd.rpc.PutRequest(key=key, value=b"v%d" % i)
            last = (await conn.kvstub.Put(put, timeout=10)).header.revision
        gone = aetcd.rpc.DeleteRangeRequest(key=table_key(table_id) + bytes([8]) + b"-k")
        last = (await conn.kvstub.DeleteRange(gone, timeout=10)).header.revision
        return last
    finally:
        await conn.close()


def write(server: EtcdServer, table_id: int, tls: tuple[bytes, bytes, bytes] | None = None) -> int:
    return asyncio.run(_write(server, table_id, tls))


def checkpoint_past(api: Api, name: str, revision: int, timeout: float = 60) -> None:
    def passed() -> object:
        raw = api.get("changefeeds", name) or {}
        cp = (raw.get("status") or {}).get("checkpointTs") or 0
        return cp >= revision or f"checkpoint {cp} < {revision}"

    until(passed, f"{name}'s checkpoint to pass {revision}", timeout)


def verified(api: Api, capsys: pytest.CaptureFixture[str], name: str, table_id: int) -> None:
    rc, out = cli(api, capsys, "verify", "-c", name)
    assert rc == 0, out
    clean = rf"table {table_id} \(default\): [\d,]+ keys at revision \d+: 0 differences( \(.*\))?\n"
    assert re.fullmatch(clean, out), out


@dataclass
class Case:
    """One changefeed broken in one way: its Secrets' data (None: the Secret does not exist), what its condition
    must say, and how a person fixes it."""

    name: str
    side: str
    reason: str
    says: str
    source: dict[str, str] | None
    sink: dict[str, str] | None
    fix: Callable[[], None]


def test_every_broken_changefeed_says_why_within_30_s_and_replicates_once_fixed(
    api: Api,
    system: System,
    etcd: EtcdServer,
    pg: PostgresServer,
    start_etcd: Callable[..., EtcdServer],
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tls_etcd = start_etcd(tls=True)
    stranger = self_signed("127.0.0.1")  # a CA that did not sign the TLS etcd's certificate
    good_source = {"endpoints": etcd.client_url}
    good_tls_source = {"endpoints": tls_etcd.client_url, "ca.crt": tls_etcd.ca_pem.decode()}
    good_sink = {"dsn": dsn(pg)}
    nobody = f"http://127.0.0.1:{free_port()}"
    closed_port = free_port()

    def fix_secret(name: str, source: dict[str, str] | None = None, sink: dict[str, str] | None = None) -> Callable[
        [], None
    ]:
        def fix() -> None:
            if source is not None:
                put_secret(api, f"{name}-source", source)
            if sink is not None:
                put_secret(api, f"{name}-sink", sink)

        return fix

    def grant() -> None:
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute(f"GRANT CREATE ON DATABASE {pg.database} TO nogrant")

    def put_column_back() -> None:
        with psycopg.connect(dsn(pg), autocommit=True) as admin:
            admin.execute(f"ALTER TABLE {schema.qualified('altered', altered)} RENAME COLUMN rev TO revision")

    cases = [
        Case("no-sink-secret", "sink", CONFIGURATION_ERROR, "the sink Secret dp/no-sink-secret-sink does not exist",
             good_source, None, fix_secret("no-sink-secret", sink=good_sink)),
        Case("no-dsn", "sink", CONFIGURATION_ERROR, "the sink Secret dp/no-dsn-sink: no key dsn",
             good_source, {"url": dsn(pg)}, fix_secret("no-dsn", sink=good_sink)),
        Case("bad-dsn", "sink", CONFIGURATION_ERROR, "dsn is not a libpq connection string",
             good_source, {"dsn": "host=x password=hunter2 user"}, fix_secret("bad-dsn", sink=good_sink)),
        Case("sink-refuses", "sink", RETRYING, "Connection refused",
             good_source, {"dsn": dsn(pg, port=closed_port)}, fix_secret("sink-refuses", sink=good_sink)),
        Case("wrong-password", "sink", CONFIGURATION_ERROR, 'password authentication failed for user "cdc"',
             good_source, {"dsn": dsn(pg, password="hunter2")}, fix_secret("wrong-password", sink=good_sink)),
        Case("no-grant", "sink", CONFIGURATION_ERROR, "the sink's user lacks a grant (permission denied)",
             good_source, {"dsn": dsn(pg, user="nogrant")}, grant),
        Case("altered", "sink", CONFIGURATION_ERROR, "a statement of the sink failed (a sink table altered by hand?)",
             good_source, good_sink, put_column_back),
        Case("no-source-secret", "source", CONFIGURATION_ERROR,
             "the source Secret dp/no-source-secret-source does not exist",
             None, good_sink, fix_secret("no-source-secret", source=good_source)),
        Case("bad-endpoint", "source", CONFIGURATION_ERROR, "etcd endpoint 'etcd:port' is not host:port",
             {"endpoints": "etcd:port"}, good_sink, fix_secret("bad-endpoint", source=good_source)),
        Case("source-refuses", "source", RETRYING, "cannot reach the source",
             {"endpoints": nobody}, good_sink, fix_secret("source-refuses", source=good_source)),
        Case("untrusted", "source", CONFIGURATION_ERROR, "TLS with the source failed",
             {"endpoints": tls_etcd.client_url, "ca.crt": stranger.cert_pem.decode()}, good_sink,
             fix_secret("untrusted", source=good_tls_source)),
    ]  # fmt: skip
    ids = {c.name: table_id * 100 + i for i, c in enumerate(cases)}
    # A sink table altered by hand (by the sink's own user) before the changefeed writes it: a column renamed, so
    # that every statement on it fails.
    altered = ids["altered"]
    with psycopg.connect(dsn(pg), autocommit=True) as owner:
        for statement in schema.create_schema("altered").split(";\n"):
            owner.execute(statement)
        owner.execute(schema.create_table("altered", altered))
        owner.execute(f"ALTER TABLE {schema.qualified('altered', altered)} RENAME COLUMN revision TO rev")
    for c in cases:
        if c.source is not None:
            put_secret(api, f"{c.name}-source", c.source)
        if c.sink is not None:
            put_secret(api, f"{c.name}-sink", c.sink)
        changefeed(api, c.name, ids[c.name])
    system.maintainer("m0")
    system.capture("c0")
    kinds = {"source": (SOURCE_UNAVAILABLE, SOURCE_EVENT), "sink": (SINK_UNAVAILABLE, SINK_EVENT)}

    started = time.monotonic()
    for c in cases:
        kind, event = kinds[c.side]

        def shows(c: Case = c, kind: str = kind) -> object:
            cond = condition(api, c.name, kind)
            ok = cond is not None and cond.status == "True" and cond.reason == c.reason and c.says in cond.message
            return ok or f"{kind}: {cond}"

        until(shows, f"{c.name}: {kind} True ({c.reason}) saying {c.says!r}", WITHIN - (time.monotonic() - started))
        cond = condition(api, c.name, kind)
        assert cond is not None
        assert "hunter2" not in cond.message
        assert PASSWORD not in cond.message
        assert [e["type"] for e in events(api, c.name, event)] == ["Warning"], c.name
        rc, out = cli(api, capsys, "status", "-c", c.name)
        assert rc == 0, out
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{c.side.capitalize()}:"))
        assert "UNAVAILABLE" in line, line
        assert c.reason in line, line
        assert c.says in line, line
        rc, out = cli(api, capsys, "verify", "-c", c.name)
        assert rc != 0, out
        assert "has no checkpoint yet" in out, out
        assert c.says in out, out
    tables = {c.name: ids[c.name] for c in cases}
    assert all(condition(api, c.name, kinds["sink" if c.side == "source" else "source"][0]) is None for c in cases)

    # The fixes, as a person makes them: the capture uses each within 30 s, without a restart.
    pid = system.procs["c0"].popen.pid
    for c in cases:
        c.fix()
    fixed = time.monotonic()
    for c in cases:
        kind = kinds[c.side][0]

        def gone(c: Case = c, kind: str = kind) -> object:
            cond = condition(api, c.name, kind)
            return (cond is not None and cond.status == "False") or f"{kind}: {cond}"

        until(gone, f"{c.name}: {kind} False once fixed", WITHIN - (time.monotonic() - fixed))
    for c in cases:
        server = tls_etcd if c.name == "untrusted" else etcd
        last = write(server, tables[c.name], (tls_etcd.ca_pem, b"", b"") if c.name == "untrusted" else None)
        checkpoint_past(api, c.name, last)
        verified(api, capsys, c.name, tables[c.name])
    assert system.procs["c0"].popen.pid == pid  # no restart
    assert system.procs["c0"].alive()
    log = system.procs["c0"].log.read_text()
    assert "hunter2" not in log
    assert PASSWORD not in log
    assert '"dispatcher": "no-sink-secret"' not in log  # the changefeed is named as such


def test_a_rotated_password_is_used_within_30_s_without_a_restart(
    api: Api, system: System, etcd: EtcdServer, pg: PostgresServer, table_id: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sink's password changes (the role's, then the Secret's): within 30 s the capture writes with the new one.
    Shown by ending every connection of the role once the old password is gone: a capture still holding the old
    one could not connect again (SinkUnavailable, ConfigurationError), one that took the new one writes on."""
    put_secret(api, "rot-source", {"endpoints": etcd.client_url})
    put_secret(api, "rot-sink", {"dsn": dsn(pg)})
    changefeed(api, "rot", table_id)
    system.maintainer("m0")
    system.capture("c0")
    checkpoint_past(api, "rot", write(etcd, table_id))
    with psycopg.connect(pg.dsn, autocommit=True) as admin:
        admin.execute(f"ALTER ROLE cdc PASSWORD '{ROTATED}'")
    put_secret(api, "rot-sink", {"dsn": dsn(pg, password=ROTATED)})
    rotated = time.monotonic()
    until(lambda: system.procs["c0"].count("uses its Secrets' new values") > 0, "the new password in use")
    assert time.monotonic() - rotated < WITHIN
    with psycopg.connect(pg.dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'cdc'")
    checkpoint_past(api, "rot", write(etcd, table_id))
    cond = condition(api, "rot", SINK_UNAVAILABLE)
    assert cond is None or cond.reason != CONFIGURATION_ERROR, cond
    verified(api, capsys, "rot", table_id)


def client_certificate() -> tuple[bytes, bytes]:
    """A self-signed client certificate and its key (PEM), as an issuer would renew one."""
    cert = self_signed("127.0.0.1")
    return cert.cert_pem, cert.key_pem


def test_a_rotated_client_certificate_is_used_within_30_s_without_a_restart(
    api: Api,
    system: System,
    start_etcd: Callable[..., EtcdServer],
    postgres: PostgresServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The source's client certificate is renewed (a new certificate and key in the Secret, as cert-manager does):
    within 30 s the capture reads with the new one. Shown by etcd no longer trusting the old one and restarting: a
    capture still presenting it could not connect again (SourceUnavailable), one that took the new one reads on."""
    old, new = client_certificate(), client_certificate()
    server = start_etcd(trusted_clients=[old[0], new[0]])
    own = (server.ca_pem, server.client_cert_pem, server.client_key_pem)

    def source(cert: tuple[bytes, bytes]) -> dict[str, str]:
        return {"endpoints": server.client_url, "ca.crt": server.ca_pem.decode(), "tls.crt": cert[0].decode(),
                "tls.key": cert[1].decode()}  # fmt: skip

    put_secret(api, "cert-source", source(old))
    put_secret(api, "cert-sink", {"dsn": postgres.dsn})
    changefeed(api, "cert", table_id)
    system.maintainer("m0")
    system.capture("c0")
    checkpoint_past(api, "cert", write(server, table_id, own))
    put_secret(api, "cert-source", source(new))
    rotated = time.monotonic()
    until(lambda: system.procs["c0"].count("uses its Secrets' new values") > 0, "the new certificate in use")
    assert time.monotonic() - rotated < WITHIN
    server.trusted_clients.remove(old[0])
    server.restart(0.5)
    checkpoint_past(api, "cert", write(server, table_id, own))
    cond = condition(api, "cert", SOURCE_UNAVAILABLE)
    assert cond is None or cond.status == "False", cond
    verified(api, capsys, "cert", table_id)
