"""Fixtures of the data-plane tests: a real etcd and a real PostgreSQL on loopback (controller/demo/servers.py).

``etcd`` and ``postgres`` are shared by the session (start once: etcd ~0.2 s, PostgreSQL ~2 s with initdb):
a test uses keys and tables of its own (``table_id``) and never compacts the shared etcd. A test that
compacts, kills or otherwise spoils a server starts its own with ``start_etcd`` / ``start_postgres``,
stopped at the end of the test. Every server stops when its fixture ends, whether the tests passed or not,
and is killed by the kernel if the test process itself dies (servers.py, the parent-death signal).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.demo.mariadb import MariaDBServer
from controller.demo.servers import EtcdServer, PostgresServer
from controller.sinks import api as sinks
from controller.sinks import kinds
from tests.integration.harness import CRD_DIR, Api, System, embedded_api

#: etcd's progress-notification interval on the test servers (its default is 10 minutes).
PROGRESS_INTERVAL = 0.3

_table_ids = itertools.count(1000)


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer(progress_notify_interval=PROGRESS_INTERVAL) as server:
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def mariadb() -> Iterator[MariaDBServer]:
    with MariaDBServer() as server:
        yield server


#: The sink servers every sink-generic test runs against: the fixture's name, and its sink kind.
SINK_SERVERS = ("postgres", "mariadb")
SinkServer = PostgresServer | MariaDBServer


@pytest.fixture(params=SINK_SERVERS)
def sink_server(request: pytest.FixtureRequest) -> SinkServer:
    """Each sink's shared server in turn (a test taking it runs once per sink kind)."""
    server: SinkServer = request.getfixturevalue(request.param)
    return server


def sink_of(server: SinkServer, changefeed: str) -> sinks.Sink:
    """The sink ``changefeed`` writes on ``server``, as a capture makes it from its Secret."""
    return kinds.from_secret(server.sink_kind, changefeed, {"dsn": server.dsn})


@pytest.fixture
def start_sink(request: pytest.FixtureRequest) -> Iterator[Callable[..., SinkServer]]:
    """Start a private server of a sink kind (``start("mysql", **kwargs)``), stopped when the test ends."""
    servers: list[SinkServer] = []

    def start(kind: str, **kwargs: Any) -> SinkServer:
        server: SinkServer = MariaDBServer(**kwargs) if kind == "mysql" else PostgresServer(**kwargs)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def table_id() -> int:
    """A table ID no other test in this session uses (its key range ``[t<id>, t<id+1>)`` is the test's own)."""
    return next(_table_ids)


@pytest.fixture
def start_etcd() -> Iterator[Callable[..., EtcdServer]]:
    """Start a private etcd (keyword arguments as EtcdServer's); stopped when the test ends."""
    servers: list[EtcdServer] = []

    def start(**kwargs: Any) -> EtcdServer:
        kwargs.setdefault("progress_notify_interval", PROGRESS_INTERVAL)
        server = EtcdServer(**kwargs)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_postgres() -> Iterator[Callable[..., PostgresServer]]:
    """Start a private PostgreSQL (keyword arguments as PostgresServer's); stopped when the test ends."""
    servers: list[PostgresServer] = []

    def start(**kwargs: Any) -> PostgresServer:
        server = PostgresServer(**kwargs)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def kube() -> Iterator[ApiServerHandle]:
    """The embedded Kubernetes API server with the CRDs (its handle: ``restart(outage)``), stopped when the test
    ends."""
    handle = start_server(CRD_DIR, bookmark_interval=0.5)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def api(kube: ApiServerHandle) -> Iterator[Api]:
    """A client of :func:`kube` in namespace ``dp`` (tests whose maintainer and captures run as processes:
    harness.System)."""
    api = embedded_api(kube.url, kube.kubeconfig_path, "dp", kube.ca_pem)
    api.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "dp"}})
    yield api
    api.pool.clear()


@pytest.fixture
def system(api: Api, tmp_path: Path) -> Iterator[System]:
    """The maintainers and captures of a test, as processes (harness.System): their logs' tails printed when the
    test fails, every one stopped when it ends."""
    system = System(api, tmp_path)
    try:
        yield system
    except BaseException:
        print(system.tails())
        raise
    finally:
        system.stop_all()
