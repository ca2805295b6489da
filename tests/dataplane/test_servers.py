"""The real servers of the data plane answer as the dispatcher runtime will need them to, through the chosen
clients (aetcd for etcd, psycopg 3 for PostgreSQL), and always stop (controller/demo/servers.py).

What these tests pin down about etcd, through aetcd (docs/architecture.md, "Data plane: the servers and
clients"): reads at a revision, a watch from a revision over ``[start, end)``, progress notifications (only
visible on the raw watch stream: aetcd's own watch iterator yields events only), a manual progress request,
and how a compaction surfaces.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import grpc
import psycopg
import pytest

from controller.demo import servers
from controller.demo.servers import EtcdServer, PostgresServer, ServerDied, ServerError
from controller.model.keys import table_key
from tests.dataplane.conftest import PROGRESS_INTERVAL

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 15.0) -> T:
    """Run one test's async part, bounded in time."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def client(server: EtcdServer) -> aetcd.Client:
    # Loopback, never through an http_proxy from the environment (gRPC honours it otherwise).
    return aetcd.Client(host=server.host, port=server.port, timeout=5, options={"grpc.enable_http_proxy": 0})


def row_key(table: int, row: bytes) -> bytes:
    return table_key(table) + row


class RawWatch:
    """etcd's bidirectional watch stream over aetcd's channel and its generated stubs (``aetcd.rpc``): every
    response as etcd sent it (header revision, progress notifications, compaction), and requests written at
    any time (a manual progress request). This is what the dispatcher runtime will read."""

    def __init__(self, c: aetcd.Client) -> None:
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self.call = aetcd.rpc.WatchStub(c.channel).Watch(self._iterate())

    async def _iterate(self) -> AsyncIterator[Any]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def create(self, key: bytes, range_end: bytes, start_revision: int, progress_notify: bool = False) -> None:
        await self._requests.put(aetcd.rpc.WatchRequest(create_request=aetcd.rpc.WatchCreateRequest(
            key=key, range_end=range_end, start_revision=start_revision, progress_notify=progress_notify)))  # fmt: skip

    async def request_progress(self) -> None:
        await self._requests.put(aetcd.rpc.WatchRequest(progress_request=aetcd.rpc.WatchProgressRequest()))

    async def next(self, within: float = 5.0) -> Any:
        return await asyncio.wait_for(self.call.read(), within)

    def close(self) -> None:
        self.call.cancel()
        self._requests.put_nowait(None)


async def with_raw_watch(c: aetcd.Client, body: Callable[[RawWatch], Awaitable[T]]) -> T:
    await c.connect()
    watch = RawWatch(c)
    try:
        return await body(watch)
    finally:
        watch.close()


# --- etcd through aetcd --------------------------------------------------------------------------------


def test_put_get_and_range_at_a_revision(etcd: EtcdServer, table_id: int) -> None:
    lo, hi = table_key(table_id), table_key(table_id + 1)

    async def body() -> None:
        async with client(etcd) as c:
            await c.put(table_key(table_id - 1) + b"\xff", b"left neighbour")  # outside [lo, hi)
            r1 = (await c.put(row_key(table_id, b"a"), b"1")).header.revision
            r2 = (await c.put(row_key(table_id, b"b"), b"2")).header.revision
            r3 = (await c.put(row_key(table_id, b"a"), b"1'")).header.revision
            await c.put(hi, b"right neighbour")  # the next table's first key: outside
            assert r1 < r2 < r3

            got = await c.get(row_key(table_id, b"a"))
            assert got is not None
            assert (got.value, got.mod_revision, got.create_revision, got.version) == (b"1'", r3, r1, 2)

            now = await c.get_range(lo, hi)
            assert [(kv.key, kv.value, kv.mod_revision) for kv in now] == [
                (row_key(table_id, b"a"), b"1'", r3),
                (row_key(table_id, b"b"), b"2", r2),
            ]
            assert now.header.revision >= r3 + 1

            # aetcd's get_range takes no revision: a read at a revision goes through its KV stub.
            at_r2 = await c.kvstub.Range(aetcd.rpc.RangeRequest(key=lo, range_end=hi, revision=r2), timeout=5)
            assert [(kv.key, kv.value) for kv in at_r2.kvs] == [(row_key(table_id, b"a"), b"1"),
                                                                 (row_key(table_id, b"b"), b"2")]  # fmt: skip
            assert at_r2.header.revision >= r3  # the header says the store's current revision, not r2

    run(body())


def test_watch_from_a_revision_over_a_range(etcd: EtcdServer, table_id: int) -> None:
    lo, hi = table_key(table_id), table_key(table_id + 1)

    async def body() -> None:
        async with client(etcd) as c:
            r1 = (await c.put(row_key(table_id, b"a"), b"1")).header.revision
            await c.put(hi, b"outside")
            r2 = (await c.put(row_key(table_id, b"b"), b"2")).header.revision
            # From r1: the history first (r1, r2), then what happens while watching.
            watch = await c.watch(lo, range_end=hi, start_revision=r1)
            events = aiter(watch)
            seen = [await asyncio.wait_for(anext(events), 5) for _ in range(2)]
            r3 = (await c.delete(row_key(table_id, b"a"))).header.revision
            seen.append(await asyncio.wait_for(anext(events), 5))
            await watch.cancel()
            assert [(e.kind, e.kv.key, e.kv.value, e.kv.mod_revision) for e in seen] == [
                ("PUT", row_key(table_id, b"a"), b"1", r1),
                ("PUT", row_key(table_id, b"b"), b"2", r2),
                ("DELETE", row_key(table_id, b"a"), b"", r3),  # a delete's mod_revision is its own revision
            ]

    run(body())


def test_progress_notifications_and_a_progress_request(etcd: EtcdServer, table_id: int) -> None:
    """On the raw stream a watch created with progress_notify gets, once it has caught up and every
    ``--experimental-watch-progress-notify-interval`` while nothing happens in its range, a response with no
    events whose header revision is the store's revision: everything in range up to it has been sent. A
    WatchProgressRequest is answered at once with such a response for the whole stream (watch_id -1)."""
    lo, hi = table_key(table_id), table_key(table_id + 1)

    async def watching(watch: RawWatch, c: aetcd.Client, r1: int) -> None:
        await watch.create(lo, hi, r1, progress_notify=True)
        created = await watch.next()
        assert created.created
        assert not created.events
        assert created.compact_revision == 0
        first = await watch.next()
        assert [(e.kv.key, e.kv.mod_revision) for e in first.events] == [(row_key(table_id, b"a"), r1)]
        # Writes elsewhere move the store's revision but send this watch nothing...
        elsewhere = (await c.put(hi, b"elsewhere")).header.revision
        # ...until the periodic progress notification, which carries that revision.
        started = time.monotonic()
        progress = await watch.next(within=20 * PROGRESS_INTERVAL + 5)
        waited = time.monotonic() - started
        assert not progress.events
        assert not progress.created
        assert not progress.canceled
        assert progress.watch_id == created.watch_id
        assert progress.header.revision >= elsewhere
        assert waited < 20 * PROGRESS_INTERVAL
        # A manual progress request: answered for the whole stream, with watch_id -1 (etcd 3.5).
        await watch.request_progress()
        for _ in range(5):  # a periodic notification may come first
            answer = await watch.next()
            if answer.watch_id == -1:
                break
        assert answer.watch_id == -1
        assert not answer.events
        assert answer.header.revision >= elsewhere

    async def body() -> None:
        async with client(etcd) as c:
            r1 = (await c.put(row_key(table_id, b"a"), b"1")).header.revision
            await with_raw_watch(c, lambda w: watching(w, c, r1))

    run(body())


def test_compaction_fails_a_watch_from_an_older_revision(start_etcd: Callable[..., EtcdServer]) -> None:
    """After a compaction to revision C, a watch from an older revision is created, then cancelled with
    ``compact_revision == C``; aetcd's watch raises ``aetcd.exceptions.RevisionCompactedError`` (its
    ``compacted_revision`` is C, the oldest revision one can still watch from). A read at an older revision
    fails with gRPC status OUT_OF_RANGE, which aetcd raises as a plain ``ClientError``."""
    server = start_etcd()  # compaction is store-wide: not on the shared server
    lo, hi = table_key(7), table_key(8)

    async def raw(watch: RawWatch, old: int, compacted: int) -> None:
        await watch.create(lo, hi, old)
        created = await watch.next()
        assert created.created
        assert created.compact_revision == 0
        cancelled = await watch.next()
        assert cancelled.canceled
        assert cancelled.compact_revision == compacted
        assert not cancelled.events

    async def body() -> None:
        async with client(server) as c:
            old = (await c.put(row_key(7, b"a"), b"1")).header.revision
            compacted = (await c.put(row_key(7, b"a"), b"2")).header.revision
            await c.compact(compacted, physical=True)

            async def first_event(start_revision: int) -> Any:
                # Created then cancelled: aetcd raises from the iterator (or from watch() itself, should
                # etcd say both in one response).
                watch = await c.watch(lo, range_end=hi, start_revision=start_revision)
                try:
                    return await asyncio.wait_for(anext(aiter(watch)), 5)
                finally:
                    await watch.cancel()

            with pytest.raises(aetcd.exceptions.RevisionCompactedError) as raised:
                await first_event(old)
            assert raised.value.compacted_revision == compacted

            await with_raw_watch(c, lambda w: raw(w, old, compacted))

            with pytest.raises(grpc.aio.AioRpcError) as read:
                await c.kvstub.Range(aetcd.rpc.RangeRequest(key=lo, range_end=hi, revision=old), timeout=5)
            assert read.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert "required revision has been compacted" in (read.value.details() or "")
            with pytest.raises(aetcd.exceptions.ClientError, match="required revision has been compacted"):
                await c.compact(old)  # through aetcd's own API: the same status, as a ClientError

            # The compacted revision itself is still there to watch from.
            event = await first_event(compacted)
            assert (event.kv.value, event.kv.mod_revision) == (b"2", compacted)

    run(body())


# --- PostgreSQL through psycopg ------------------------------------------------------------------------


def test_postgres_transactions(postgres: PostgresServer, table_id: int) -> None:
    table = f"rows_{table_id}"
    with psycopg.connect(postgres.dsn) as conn:
        assert conn.execute("SELECT current_database(), current_user").fetchone() == (postgres.database, "postgres")
        conn.execute(f"CREATE TABLE {table} (k bytea PRIMARY KEY, v bytea NOT NULL, rev bigint NOT NULL)")
        conn.commit()
        with conn.transaction():
            conn.execute(f"INSERT INTO {table} VALUES (%s, %s, %s)", (row_key(table_id, b"a"), b"1", 5))
            conn.execute(f"INSERT INTO {table} VALUES (%s, %s, %s)", (row_key(table_id, b"b"), b"2", 6))

        def failing_transaction() -> None:
            with conn.transaction():
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s, %s)", (row_key(table_id, b"c"), b"3", 7))
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s, %s)", (row_key(table_id, b"a"), b"again", 7))

        with pytest.raises(psycopg.errors.UniqueViolation):
            failing_transaction()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    async def other_connection() -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(postgres.dsn) as aconn:
            cursor = await aconn.execute(f"SELECT k, v, rev FROM {table} ORDER BY k")
            return await cursor.fetchall()

    # Committed rows only (the failed transaction left nothing), seen from another (async) connection.
    assert run(other_connection()) == [(row_key(table_id, b"a"), b"1", 5), (row_key(table_id, b"b"), b"2", 6)]


# --- the servers' own lifecycle ------------------------------------------------------------------------


def test_a_killed_etcd_is_noticed(start_etcd: Callable[..., EtcdServer]) -> None:
    server = start_etcd()
    directory = server.directory
    server.check()
    os.kill(server.pid, signal.SIGKILL)
    assert server.wait(5) == -signal.SIGKILL
    assert not server.is_running
    with pytest.raises(ServerDied, match="exited with signal SIGKILL") as died:
        server.check()
    assert died.value.returncode == -signal.SIGKILL
    assert "--- last lines of" in str(died.value)
    assert died.value.log_tail

    async def put() -> None:
        async with client(server) as c:
            await c.put(b"k", b"v")

    with pytest.raises(aetcd.exceptions.ConnectionFailedError):
        run(put())
    server.stop()
    assert not directory.exists()


def test_a_killed_postgres_is_noticed(start_postgres: Callable[..., PostgresServer]) -> None:
    server = start_postgres()

    def keep_querying(conn: psycopg.Connection[Any]) -> None:
        for _ in range(50):
            conn.execute("SELECT 1")
            time.sleep(0.1)

    with psycopg.connect(server.dsn) as conn:
        os.kill(server.pid, signal.SIGKILL)
        assert server.wait(5) == -signal.SIGKILL
        with pytest.raises(ServerDied, match="exited with signal SIGKILL"):
            server.check()
        # The backend of an open connection notices its postmaster is gone and ends the session too.
        with pytest.raises(psycopg.OperationalError):
            keep_querying(conn)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(server.dsn, connect_timeout=2).close()


def test_a_taken_port_is_retried(start_etcd: Callable[..., EtcdServer], monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind((servers.LOOPBACK, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real = servers._free_ports
        picks = iter([[busy, real(1)[0]]])
        monkeypatch.setattr(servers, "_free_ports", lambda n: next(picks, None) or real(n))
        server = start_etcd()
        assert server.port != busy
        server.check()
        log = server.log_path.read_text()
        assert "--- attempt 2:" in log
        assert "address already in use" in log


def test_a_failed_start_reports_the_log_and_leaves_nothing(tmp_path: Path) -> None:
    before = set(Path(servers.tempfile.gettempdir()).glob("cfm-etcd-*"))
    with pytest.raises(ServerError, match="exited at start") as failed:
        EtcdServer(extra_args=["--no-such-flag"], attempts=1).start()
    assert "no-such-flag" in str(failed.value)  # the tail of etcd's own complaint
    assert set(Path(servers.tempfile.gettempdir()).glob("cfm-etcd-*")) == before


def test_servers_start_without_fork_handlers_and_as_their_account(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server (and initdb) is spawned with neither ``preexec_fn`` nor ``user=``, so ``Popen`` uses ``vfork``
    and no ``pthread_atfork`` handler runs: a plain ``fork()`` while gRPC's threads were busy crashed the
    child of a PostgreSQL restart (SIGSEGV, CI). ``setpriv`` switches the account and arms the parent-death
    signal instead (the test above shows the signal still works); run by root, the postmaster is ``nobody``."""
    # Not a skip: without setpriv the servers fall back to the fork that crashed (install util-linux).
    assert shutil.which("setpriv") is not None, "no setpriv: servers fall back to preexec_fn and user= (a fork)"
    spawned: list[tuple[list[str], dict[str, Any]]] = []
    real = subprocess.Popen

    def spy(argv: list[str], *args: Any, **kwargs: Any) -> Any:
        spawned.append((list(argv), kwargs))
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)  # servers.py calls subprocess.Popen
    with PostgresServer() as pg:
        uid = next(int(line.split()[1]) for line in Path(f"/proc/{pg.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))  # fmt: skip
        if os.geteuid() == 0:
            assert uid == pwd.getpwnam("nobody").pw_uid
        else:
            assert uid == os.geteuid()
    assert any("initdb" in " ".join(argv) for argv, _ in spawned), spawned
    assert any(Path(a).name == "postgres" for argv, _ in spawned for a in argv), spawned
    for argv, kwargs in spawned:
        assert not {"preexec_fn", "user", "group", "extra_groups"} & kwargs.keys(), (argv, kwargs)
        assert Path(argv[0]).name == "setpriv", argv


def test_servers_die_with_the_process_that_started_them() -> None:
    """SIGKILL the process that started an etcd and a PostgreSQL: the kernel's parent-death signal takes
    both servers down (the postmaster with its backends), though nothing ran their stop()."""
    script = textwrap.dedent("""
        import sys, time
        from controller.demo.servers import EtcdServer, PostgresServer
        e = EtcdServer().start()
        p = PostgresServer().start()
        print(e.pid, p.pid, e.directory, p.directory, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    line: list[str] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline().split()
        assert len(line) == 4, f"the starter failed (exit {parent.poll()})"
        etcd_pid, pg_pid = int(line[0]), int(line[1])
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 15
        while (alive(etcd_pid) or alive(pg_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(etcd_pid), "etcd outlived its parent"
        assert not alive(pg_pid), "the postmaster or a backend outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        for leftover in line[2:]:  # nothing ran stop(): the directories stay (servers.py says so)
            shutil.rmtree(leftover, ignore_errors=True)


def alive(group: int) -> list[int]:
    """The live (not zombie) processes of process group ``group``, read from /proc (a zombie whose new parent
    does not reap it would still take signals)."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(stat_file.parent.name))
    return found


def test_a_stopped_server_starts_again_afresh(start_etcd: Callable[..., EtcdServer]) -> None:
    server = start_etcd()
    first_dir, first_pid = server.directory, server.pid
    server.stop()
    server.stop()  # idempotent
    assert not server.is_running
    assert not first_dir.exists()
    with pytest.raises(ServerDied):
        server.check()  # stopped: reported as exited
    server.start()
    assert server.pid != first_pid
    assert server.directory != first_dir
    server.check()


@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "crashed"])
def test_a_restarted_postgres_keeps_its_data_and_port(
    start_postgres: Callable[..., PostgresServer], crash: bool
) -> None:
    """A crash keeps what was committed only on a durable server (``fsync=True``: with fsync and synchronous
    commit off, the throwaway default, the last commits die with the WAL buffers; seen here)."""
    server = start_postgres(fsync=crash)
    directory, port, pid = server.directory, server.port, server.pid
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (k int PRIMARY KEY)")
        conn.execute("INSERT INTO kept VALUES (1), (2)")
        server.restart(0.2, crash=crash)
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")  # the connection of before is gone
    assert (server.directory, server.port) == (directory, port)
    assert server.pid != pid
    server.check()
    with psycopg.connect(server.dsn) as conn:
        assert conn.execute("SELECT k FROM kept ORDER BY k").fetchall() == [(1,), (2,)]
    server.stop()
    with pytest.raises(ServerError, match="not running"):
        server.restart()
