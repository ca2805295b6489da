"""Scale-out on a cluster (issue 23): three maintainer replicas with the sharded cache, six changefeeds.

The chart's Deployment is scaled to three and its maintainer container given ``--cache=sharded
--expected-replicas=3`` (what ``maintainer.replicas: 3`` renders), by a JSON patch that the test undoes. Six
changefeeds, each with one Table applied *without* the changefeed label (the leader labels it): they spread two
per replica. One maintainer pod is deleted (``--force --grace-period=0``): its changefeeds are led again by the
others within the lease duration + 5 s (plus the seconds the API takes to show it), and the pod the Deployment
starts in its place gets its share back. Every span ends Replicating with no Failed operator, the engine's
invariants hold on every changefeed's records read back, and every Table carries its changefeed's label.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from controller.engine.world import World
from tests.e2e.kube import Kube, wait_for
from tests.e2e.test_failover import MAINTAINER, always, at_rest, changefeed, lease_holder, maintainer_pods, pod_of

pytestmark = pytest.mark.e2e

API = "cdc.maintainer.dev/v1alpha1"
LABEL = "cdc.maintainer.dev/changefeed"
CHANGEFEEDS = 6
LEASE = 15.0  # the chart's maintainer.leaderElection.leaseDuration


def plain_table(cf: str, table_id: int) -> dict[str, Any]:
    spec = {"changefeed": cf, "tableID": table_id, "preSplit": {"spans": 2}}
    return {"apiVersion": API, "kind": "Table", "metadata": {"name": f"{cf}-t"}, "spec": spec}


def counts(k: Kube, cfs: list[str]) -> dict[str, int]:
    """Maintainer pod -> how many of ``cfs`` it leads (Leases as the API shows them)."""
    out = dict.fromkeys(maintainer_pods(k), 0)
    for cf in cfs:
        pod = pod_of(lease_holder(k, cf))
        if pod in out:
            out[pod] += 1
    return out


@pytest.fixture
def sharded(kube: Kube) -> Any:
    deploy = kube.items("deployments", MAINTAINER)[0]
    name = deploy["metadata"]["name"]
    args = deploy["spec"]["template"]["spec"]["containers"][0].get("args") or []
    kept = [a for a in args if not a.startswith(("--cache=", "--expected-replicas="))]
    patch = [
        {
            "op": "replace",
            "path": "/spec/template/spec/containers/0/args",
            "value": [*kept, "--cache=sharded", "--expected-replicas=3"],
        },
        {"op": "replace", "path": "/spec/replicas", "value": 3},
    ]
    kube.run("patch", "deployment", name, "--type=json", "-p", json.dumps(patch))
    kube.run("rollout", "status", "deployment", name, "--timeout=240s", timeout=260)
    try:
        yield name
    finally:
        undo = [
            {"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": args},
            {"op": "replace", "path": "/spec/replicas", "value": deploy["spec"].get("replicas", 1)},
        ]
        kube.run("patch", "deployment", name, "--type=json", "-p", json.dumps(undo), check=False)
        kube.run("rollout", "status", "deployment", name, "--timeout=240s", timeout=260, check=False)


def test_three_sharded_replicas_spread_the_changefeeds_and_survive_a_pod_deletion(kube: Kube, sharded: str) -> None:
    run = uuid.uuid4().hex[:6]
    base = 5000 + int(uuid.uuid4().int % 400) * 10
    cfs = [f"e2e-so-{run}-{i}" for i in range(CHANGEFEEDS)]
    try:
        kube.apply(*(changefeed(cf, False) for cf in cfs))
        kube.apply(*(plain_table(cf, base + i) for i, cf in enumerate(cfs)))
        for cf in cfs:

            def placed(cf: str = cf) -> World | None:
                return at_rest(kube, cf)

            wait_for(f"{cf}: every span Replicating", placed, timeout=240)

        def spread() -> dict[str, int] | None:
            got = counts(kube, cfs)
            return got if len(got) == 3 and sorted(got.values()) == [2, 2, 2] else None

        wait_for("two changefeeds per replica", spread, timeout=120)
        for cf in cfs:
            table = kube.get("tables.cdc.maintainer.dev", f"{cf}-t") or {}
            assert (table["metadata"].get("labels") or {}).get(LABEL) == cf, f"{cf}-t not labelled by its leader"

        victim = sorted(counts(kube, cfs))[0]
        theirs = [cf for cf in cfs if pod_of(lease_holder(kube, cf)) == victim]
        assert len(theirs) == 2
        kube.run("delete", "pod", victim, "--force", "--grace-period=0", "--wait=false")
        killed = time.monotonic()

        def led_again() -> bool | None:
            pods = set(maintainer_pods(kube)) - {victim}
            return all(pod_of(lease_holder(kube, cf)) in pods for cf in theirs) or None

        wait_for(f"{victim}'s changefeeds led again", led_again, timeout=LEASE + 60)
        took = time.monotonic() - killed
        print(f"led again {took:.1f}s after the pod was deleted (Lease {LEASE:.0f}s)")
        assert took <= LEASE + 5 + 10, f"led again only after {took:.1f}s"  # + the poll and the API's view

        kube.run("rollout", "status", "deployment", sharded, "--timeout=240s", timeout=260)
        began = time.monotonic()
        wait_for("two per replica again", spread, timeout=90)
        print(f"balanced again {time.monotonic() - began:.1f}s after the new pod was up")
        for cf in cfs:

            def settled_again(cf: str = cf) -> World | None:
                return at_rest(kube, cf)

            w = wait_for(f"{cf}: every span Replicating", settled_again, timeout=240)
            assert always(w) == []
            failed = [n for n, o in w.operators.items() if o.phase == "Failed"]
            assert failed == [], f"{cf}: Failed operators {failed}"
    finally:
        for cf in cfs:
            kube.run("delete", "changefeeds.cdc.maintainer.dev", cf, "--wait=false", check=False)
        for cf in cfs:
            kube.run("delete", "tables.cdc.maintainer.dev", f"{cf}-t", "--wait=false", check=False)
