"""``kubectl changefeed pause`` pauses replication (TiCDC's meaning): no dispatcher reads the source or writes the
sink, the captures close their connections, the checkpoint holds; ``resume`` continues from the checkpoint and
nothing is lost. A changefeed paused longer than the source keeps its history fails with ReplicationFailed on
resume, never a silent skip. Pausing the schedulers alone (``--schedulers-only``) leaves replication running.

The maintainer and two captures run as processes on the embedded API; a real etcd and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import psycopg
import pytest

from controller.demo.servers import EtcdServer, PostgresServer
from controller.engine.maintainer import PAUSED
from controller.model.records import Condition
from tests.dataplane.test_failures import (
    checkpoint_past,
    compact,
    failed_at_compaction,
    settled_on,
    start_feed,
    verified,
    verify,
    writer,
)
from tests.dataplane.test_troubles import cli
from tests.integration.harness import CHANGEFEED, Api, Snap, System

#: How long the writer writes through the pause.
PAUSE = 25.0
#: What a pause may take to reach the captures (their reads of the Changefeed, every 5 s) and close what they hold.
SETTLE = 12.0


def sink_connections(pg: PostgresServer) -> int:
    """Client connections to the sink's database other than this one."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'",
            (pg.database,),
        ).fetchone()
    return int(row[0]) if row else 0


def sink_rows(pg: PostgresServer, table_id: int) -> int:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*), max(revision) FROM cfm_{CHANGEFEED}."t{table_id}"').fetchone()
    return int(row[0]) * 10**12 + int(row[1] or 0) if row else 0  # rows and the newest revision, as one number


def condition(s: Snap, kind: str) -> Condition | None:
    return s.changefeed.condition(kind) if s.changefeed is not None else None


def test_a_pause_stops_replication_and_resume_goes_on_from_the_checkpoint(
    api: Api,
    system: System,
    etcd: EtcdServer,
    start_postgres: Callable[..., PostgresServer],
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pg = start_postgres()  # its own: the captures' connections to it are counted
    watch = start_feed(api, system, etcd, pg, table_id)
    with writer(etcd, table_id) as w:
        watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id), "4 spans Working", 60)
        checkpoint_past(watch, w.last, "the checkpoint to pass the first writes")
        assert sink_connections(pg) >= 1

        # The schedulers alone: replication goes on.
        rc, out = cli(api, capsys, "pause", "--schedulers-only", "-c", CHANGEFEED)
        assert rc == 0, out
        checkpoint_past(watch, w.last, "the checkpoint to move with the schedulers paused", 30)
        rc, out = cli(api, capsys, "resume", "--schedulers-only", "-c", CHANGEFEED)
        assert rc == 0, out

        rc, out = cli(api, capsys, "pause", "-c", CHANGEFEED)
        assert rc == 0, out
        assert "paused" in out
        paused = watch.until(
            lambda s: ((c := condition(s, PAUSED)) is not None and c.status == "True") or f"Paused: {c}",
            "the Changefeed to say replication is paused",
            10,
        )
        time.sleep(SETTLE)  # the captures read the pause, hold their dispatchers, close their connections
        held = watch.poll().changefeed
        assert held is not None
        rows = sink_rows(pg, table_id)
        assert sink_connections(pg) == 0  # the sink's connections are closed
        during = w.changes
        time.sleep(PAUSE - SETTLE)
        assert w.changes > during + 1000  # the writer wrote all along
        now = watch.poll().changefeed
        assert now is not None
        assert now.checkpoint_ts == held.checkpoint_ts  # the checkpoint holds
        assert sink_rows(pg, table_id) == rows  # nothing written to the sink
        assert sink_connections(pg) == 0
        rc, out = cli(api, capsys, "status", "-c", CHANGEFEED)
        assert "Paused:       replication (spec.paused)" in out, out
        assert paused.changefeed is not None

        rc, out = cli(api, capsys, "resume", "-c", CHANGEFEED)
        assert rc == 0, out
        checkpoint_past(watch, w.last, "the checkpoint to pass what was written during the pause", 60)
        snap = watch.poll()
        cond = condition(snap, PAUSED)
        assert cond is not None
        assert cond.status == "False"
        verified(api, capsys, pg, table_id)
    checkpoint_past(watch, w.last, "the checkpoint to pass the writer's last revision", 60)
    verified(api, capsys, pg, table_id)


def test_a_changefeed_paused_past_the_sources_history_fails_clearly_on_resume(
    api: Api,
    system: System,
    start_etcd: Callable[..., EtcdServer],
    postgres: PostgresServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Paused, the source compacted past the checkpoint meanwhile (its history gone): on resume the dispatchers
    cannot watch from the checkpoint and stop for good, the Changefeed says so (ReplicationFailed, naming the
    compaction), its checkpoint does not move, and nothing after it is claimed delivered."""
    etcd = start_etcd()
    watch = start_feed(api, system, etcd, postgres, table_id)
    with writer(etcd, table_id) as w:
        watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id), "4 spans Working", 60)
        checkpoint_past(watch, w.last, "the checkpoint to pass the first writes")
        rc, out = cli(api, capsys, "pause", "-c", CHANGEFEED)
        assert rc == 0, out
        time.sleep(SETTLE)
        w.wait_for(w.changes + 2_000)
    held = watch.poll().changefeed
    assert held is not None
    compacted = w.last
    asyncio.run(compact(etcd, compacted))
    rc, out = cli(api, capsys, "resume", "-c", CHANGEFEED)
    assert rc == 0, out
    failed_at_compaction(watch, compacted)
    rc, out = verify(api, capsys, postgres)
    assert rc != 0, out

