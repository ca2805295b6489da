"""The data plane on a cluster (issue 38): rows written to a real etcd arrive in a real PostgreSQL through the
chart's captures, through a maintainer pod deleted with a Move held in flight, and ``kubectl changefeed verify``
finds 0 differences while the writer still writes and after it stopped.

Opt in with ``--with-e2e`` and name the servers (none is started here: they must be reachable from the pods):

* ``CFM_E2E_ETCD``: the etcd endpoint the captures use (``http://host:port``, e.g. an etcd Service in the cluster);
  ``CFM_E2E_ETCD_LOCAL``: the one this machine uses for the writer and verify, if it differs (a port-forward);
* ``CFM_E2E_POSTGRES``: the DSN the captures use; ``CFM_E2E_POSTGRES_LOCAL``: this machine's, if it differs.

Unset: the test is skipped and says which. What it creates (the Secrets, the Changefeed, its Tables) it deletes,
whatever happens; the sink's schema of the changefeed stays (a unique name per run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any
from urllib.parse import urlsplit

import pytest

from controller.dataplane.writer import Writer
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


def _verify(kube: Kube, cf: str) -> subprocess.CompletedProcess[str]:
    """``kubectl changefeed verify`` as a person runs it, against this machine's view of the servers."""
    cmd = [sys.executable, "-m", "controller.cli", "--context", kube.context, "-n", kube.namespace, "verify",
           "-c", cf, "--etcd-endpoints", ETCD_LOCAL, "--dsn", POSTGRES_LOCAL]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)


def _checkpoint(kube: Kube, cf: str) -> int:
    obj = kube.get(f"changefeeds.{API.split('/')[0]}", cf) or {}
    return int((obj.get("status") or {}).get("checkpointTs") or 0)


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
    writer = Writer(local.hostname or "127.0.0.1", local.port or 2379, [table_id], rate=RATE, batch=20, keys=4_096)
    captures = [c["metadata"]["name"] for c in kube.items("captures")]
    try:
        kube.apply(*secrets, changefeed, table(cf, f"{cf}-t", table_id, 4))
        writer.start()

        def replicating() -> Any:
            spans = [s for s in kube.items("spans") if (s.get("spec") or {}).get("changefeed") == cf]
            ok = len(spans) == 4 and all((s.get("status") or {}).get("state") == "Replicating" for s in spans)
            return spans if ok else None

        spans = wait_for("4 spans Replicating", replicating, timeout=300, every=2.0)
        for c in captures:
            kube.annotate(f"captures.{API.split('/')[0]}", c, HOLD_CLOSE, "*")
        mover = spans[0]
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
