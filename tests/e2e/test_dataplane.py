"""The data plane on a cluster (issue 38): rows written to a real etcd arrive in a real PostgreSQL through the
chart's captures, across a Move held in flight while the maintainer's pods are deleted.

One Table, cut into four spans where the writer's rows are (``preSplit.splitKeys`` at rows 0x0400, 0x0800 and
0x0c00 of its 4,096, ``controller.demo.writer.row_key``: an even split of the table's whole key space would
put all of them in the first span). The writer puts and deletes those rows at 200 changes a second. Once the four
spans are Replicating and the sink holds live rows in each span's key range (so the span about to move holds
some), every capture holds its dispatchers' close (``hold-close``), a Move of one span to another capture is
created and held in RemoveOrigin, the maintainer's pods are deleted (forced, no grace period), the hold is
lifted, and the Move must succeed under their successor. Once the writer made 5,000 changes in all, ``kubectl
changefeed verify`` must find 0 differences while it still writes; then, the writer stopped and the changefeed's
checkpoint past its last revision, again.

Opt in with ``--with-e2e`` and name the servers (none is started here: they must be reachable from the pods):

* ``CFM_E2E_ETCD``: the etcd endpoint the captures use (``http://host:port``, e.g. an etcd Service in the cluster);
  ``CFM_E2E_ETCD_LOCAL``: the one this machine uses for the writer and verify, if it differs (a port-forward);
* ``CFM_E2E_POSTGRES``: the DSN the captures use; ``CFM_E2E_POSTGRES_LOCAL``: this machine's (the sink's
  rows per span are read there, and verify uses it), if it differs.

Unset: the test is skipped and says which. What it creates (the Secrets, the Changefeed, its Table) it deletes,
whatever happens; the sink's schema of the changefeed stays (a unique name per run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from controller.demo.writer import Writer, row_key
from controller.sinks.postgres import schema
from tests.e2e.conftest import ROOT
from tests.e2e.kube import Kube, wait_for
from tests.e2e.test_failover import API, HOLD_CLOSE, MAINTAINER, operator, table

pytestmark = pytest.mark.e2e

ETCD = os.environ.get("CFM_E2E_ETCD", "")
POSTGRES = os.environ.get("CFM_E2E_POSTGRES", "")
ETCD_LOCAL = os.environ.get("CFM_E2E_ETCD_LOCAL", ETCD)
POSTGRES_LOCAL = os.environ.get("CFM_E2E_POSTGRES_LOCAL", POSTGRES)
RATE = 200.0
CHANGES = 5_000
KEYS = 4_096  # the writer's rows of the table: row_key(table_id, 0 .. KEYS - 1)
SPANS = 4
#: The rows the table is cut at: SPANS spans with KEYS / SPANS of the writer's rows each.
SPLIT_ROWS = tuple(KEYS * i // SPANS for i in range(1, SPANS))


def _verify(kube: Kube, cf: str) -> subprocess.CompletedProcess[str]:
    """``kubectl changefeed verify`` as a person runs it, against this machine's view of the servers."""
    cmd = [sys.executable, "-m", "controller.cli", "--context", kube.context, "-n", kube.namespace, "verify",
           "-c", cf, "--etcd-endpoints", ETCD_LOCAL, "--dsn", POSTGRES_LOCAL]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)


def _checkpoint(kube: Kube, cf: str) -> int:
    obj = kube.get(f"changefeeds.{API.split('/')[0]}", cf) or {}
    return int((obj.get("status") or {}).get("checkpointTs") or 0)


def _table(cf: str, table_id: int) -> dict[str, Any]:
    """The Table, pre-split at ``SPLIT_ROWS``: every span gets its share of the writer's rows."""
    doc = table(cf, f"{cf}-t", table_id)
    doc["spec"]["preSplit"] = {"splitKeys": [row_key(table_id, row).hex() for row in SPLIT_ROWS]}
    return doc


def _live_rows(cf: str, table_id: int, spans: list[dict[str, Any]]) -> dict[str, int]:
    """The sink's live rows (tombstones aside) in each span's key range, by span name; {} before the table exists."""
    counts: dict[str, int] = {}
    try:
        with psycopg.connect(POSTGRES_LOCAL, autocommit=True) as conn:
            for span in spans:
                lo, hi = bytes.fromhex(span["spec"]["startKey"]), bytes.fromhex(span["spec"]["endKey"])
                rows = conn.execute(schema.rows_in_range(cf, table_id), (lo, hi)).fetchall()
                counts[span["metadata"]["name"]] = sum(1 for *_, deleted in rows if not deleted)
    except psycopg.errors.UndefinedTable:
        return {}
    return counts


def test_rows_replicated_through_a_maintainer_pod_deleted_with_a_move_in_flight(kube: Kube) -> None:
    if not (ETCD and POSTGRES):
        pytest.skip("name the servers the captures reach: CFM_E2E_ETCD (http://host:port) and CFM_E2E_POSTGRES (DSN)")
    cf = f"dp-{uuid.uuid4().hex[:6]}"
    table_id = 8_000_000 + int(uuid.uuid4().int % 1_000_000)
    secrets = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{cf}-src"}, "stringData": {"endpoints": ETCD}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{cf}-dst"}, "stringData": {"dsn": POSTGRES}},
    ]
    changefeed: dict[str, Any] = {
        "apiVersion": API,
        "kind": "Changefeed",
        "metadata": {"name": cf},
        "spec": {
            "source": {"etcd": {"secretRef": {"name": f"{cf}-src"}}},
            "sink": {"postgres": {"secretRef": {"name": f"{cf}-dst"}}},
            "scheduler": {"balanceIntervalSeconds": 0},
        },
    }
    local = urlsplit(ETCD_LOCAL if "://" in ETCD_LOCAL else f"http://{ETCD_LOCAL}")
    writer = Writer(local.hostname or "127.0.0.1", local.port or 2379, [table_id], rate=RATE, batch=20, keys=KEYS)
    captures = [c["metadata"]["name"] for c in kube.items("captures")]
    try:
        kube.apply(*secrets, changefeed, _table(cf, table_id))
        writer.start()

        def replicating() -> Any:
            spans = [s for s in kube.items("spans") if (s.get("spec") or {}).get("changefeed") == cf]
            ok = len(spans) == SPANS and all((s.get("status") or {}).get("state") == "Replicating" for s in spans)
            return spans if ok else None

        spans = wait_for(f"{SPANS} spans Replicating", replicating, timeout=300, every=2.0)
        ranges = sorted((s["spec"]["startKey"], s["spec"]["endKey"]) for s in spans)
        cuts = [row_key(table_id, row).hex() for row in SPLIT_ROWS]
        assert [end for _, end in ranges[:-1]] == cuts, f"the spans are not cut at the writer's rows: {ranges}"

        def filled() -> dict[str, int] | None:
            counts = _live_rows(cf, table_id, spans)
            return counts if len(counts) == len(spans) and all(counts.values()) else None

        rows = wait_for("live rows in the sink in every span's range", filled, timeout=120, every=2.0)
        mover = spans[0]
        assert rows[mover["metadata"]["name"]] > 0, f"the span to move holds no rows: {rows}"
        for c in captures:
            kube.annotate(f"captures.{API.split('/')[0]}", c, HOLD_CLOSE, "*")
        target = next(c for c in captures if c != mover["status"]["capture"])
        kube.apply(operator(cf, f"{cf}-move", type="Move", spans=[mover["metadata"]["name"]], target=target))

        def held() -> bool:
            op = kube.get(f"spanoperators.{API.split('/')[0]}", f"{cf}-move") or {}
            return (op.get("status") or {}).get("stage") == "RemoveOrigin"

        wait_for("the Move held in RemoveOrigin", held, timeout=120)
        pods = [p["metadata"]["name"] for p in kube.items("pods", MAINTAINER)]
        kube.run("delete", "pod", *pods, "--force", "--grace-period=0", "--wait=false")
        for c in captures:
            kube.annotate(f"captures.{API.split('/')[0]}", c, HOLD_CLOSE, None)

        def finished() -> bool:
            op = kube.get(f"spanoperators.{API.split('/')[0]}", f"{cf}-move") or {}
            return (op.get("status") or {}).get("phase") == "Succeeded"

        wait_for("the Move Succeeded after the failover", finished, timeout=300, every=2.0)
        writer.wait_for(CHANGES, timeout=600)
        live = _verify(kube, cf)
        assert live.returncode == 0, live.stdout + live.stderr
        assert "0 differences" in live.stdout, live.stdout
        last = writer.stop()
        wait_for("the checkpoint past the writer's last revision", lambda: _checkpoint(kube, cf) >= last, timeout=120)
        after = _verify(kube, cf)
        assert after.returncode == 0, after.stdout + after.stderr
        assert "0 differences" in after.stdout, after.stdout
    finally:
        if writer.running:
            writer.stop()
        for c in captures:
            kube.annotate(f"captures.{API.split('/')[0]}", c, HOLD_CLOSE, None)
        kube.run("delete", "changefeeds.cdc.maintainer.dev", cf, "--wait=false", check=False)
        kube.run("delete", "tables.cdc.maintainer.dev", "-l", f"cdc.maintainer.dev/changefeed={cf}",
                 "--wait=false", check=False)  # fmt: skip
        kube.run("delete", "secret", f"{cf}-src", f"{cf}-dst", "--ignore-not-found", check=False)
