"""Maintainer failover on a kind cluster (TiCDC's maintainer_failover_when_operator, on Kubernetes).

Three captures (StatefulSet pods), no balance scheduler (balancing is not built yet, so it is off). Hooks on
the Capture objects keep operators in flight: ``hold-close`` on the captures hosting the origins (a removed
dispatcher keeps running, so Move/Split/Merge/Remove stay in RemoveOrigin) and ``pause-create`` on all (new
dispatchers do not start, so the Adds of new tables stay in AddDest). Then the maintainer pod is deleted
(gracefully, or ``--force --grace-period=0``), a new pod takes the changefeed's Lease, the hooks are released,
and every operator must finish with its recorded intent; the deleted table must be gone and stay gone; the
invariants of controller.engine.invariants must hold on the records read back from the resources.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from controller.engine.invariants import settled, single_owner, unexplained_overlaps
from controller.engine.world import World
from controller.model.records import Capture, Changefeed, Dispatcher, Span, SpanOperator, Table
from controller.model.resources import capture_from_resources, from_resource, lease_name
from controller.model.states import DispatcherState
from tests.e2e.conftest import RELEASE
from tests.e2e.kube import Kube, wait_for

pytestmark = pytest.mark.e2e

API = "cdc.maintainer.dev/v1alpha1"
HOLD_CLOSE = "cdc.maintainer.dev/hold-close"
PAUSE_CREATE = "cdc.maintainer.dev/pause-create"
MAINTAINER = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=maintainer"
CAPTURE = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=capture"
IN_FLIGHT = ("Pending", "Running")


# -- reading the world back from the resources -------------------------------------------------------------


def mine(items: list[dict[str, Any]], cf: str) -> list[dict[str, Any]]:
    return [o for o in items if (o.get("spec") or {}).get("changefeed") == cf]


def world(k: Kube, cf: str) -> World:
    leases = {o["metadata"]["name"]: o for o in k.items("leases")}
    captures: dict[str, Capture] = {}
    for obj in k.items("captures"):
        c = capture_from_resources(obj, leases.get(lease_name(obj["metadata"]["name"])))
        captures[c.name] = c

    def records(kind: str, cls: type) -> dict[str, Any]:
        recs = (from_resource(o) for o in mine(k.items(kind), cf))
        return {r.name: r for r in recs if isinstance(r, cls)}

    changefeed = from_resource(k.get(f"changefeeds.{API.split('/')[0]}", cf) or {})
    assert isinstance(changefeed, Changefeed)
    return World(
        now=time.time(),
        changefeed=changefeed,
        tables=records("tables", Table),
        spans=records("spans", Span),
        dispatchers=records("dispatchers", Dispatcher),
        operators=records("spanoperators", SpanOperator),
        captures=captures,
    )


def live_dispatchers(w: World) -> list[Dispatcher]:
    alive = {n for n, c in w.captures.items() if c.alive(w.now)}
    live = (DispatcherState.INITIALIZING, DispatcherState.WORKING)
    return [d for d in w.dispatchers.values() if d.state in live and d.capture in alive]


def always(w: World) -> list[str]:
    """Invariants that hold at every instant (checked while operators are in flight, too)."""
    return single_owner(live_dispatchers(w)) + unexplained_overlaps(w)


def at_rest(k: Kube, cf: str) -> World | None:
    w = world(k, cf)
    assert always(w) == []
    return w if w.spans and not settled(w) else None


# -- building the scenario -----------------------------------------------------------------------------------


def changefeed(name: str, redo: bool) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "Changefeed", "metadata": {"name": name},
            "spec": {"paused": False, "redo": redo,
                     "scheduler": {"balanceIntervalSeconds": 0}}}  # balancing off, as in TiCDC's test  # fmt: skip


def table(cf: str, name: str, table_id: int, pre_split: int = 0) -> dict[str, Any]:
    spec: dict[str, Any] = {"changefeed": cf, "tableID": table_id}
    if pre_split:
        spec["preSplit"] = {"spans": pre_split}
    labels = {"cdc.maintainer.dev/changefeed": cf}
    return {"apiVersion": API, "kind": "Table", "metadata": {"name": name, "labels": labels}, "spec": spec}


def operator(cf: str, name: str, **spec: Any) -> dict[str, Any]:
    labels = {"cdc.maintainer.dev/changefeed": cf}
    return {"apiVersion": API, "kind": "SpanOperator", "metadata": {"name": name, "labels": labels},
            "spec": {"changefeed": cf, "reason": "e2e failover", **spec}}  # fmt: skip


def spans_of(w: World, table_id: int) -> list[Span]:
    return sorted((s for s in w.spans.values() if s.table_id == table_id and s.mode == "default"),
                  key=lambda s: s.key_range.start)  # fmt: skip


def lease_holder(k: Kube, cf: str) -> str:
    lease = k.get("leases", f"cfm-{cf}") or {}
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def pod_of(identity: str) -> str:
    """The maintainer's identity is ``<pod name>-<6 hex>`` (controller.maintainer.runner.default_identity)."""
    return identity.rsplit("-", 1)[0]


def set_hooks(k: Kube, captures: list[str], key: str, value: str | None) -> None:
    for c in captures:
        k.annotate("captures.cdc.maintainer.dev", c, key, value)


class Scenario:
    """One changefeed with tables, the user operators held in flight, and the checks at the end."""

    def __init__(self, k: Kube, redo: bool) -> None:
        self.k = k
        self.cf = f"e2e-{uuid.uuid4().hex[:6]}"
        self.base = 1000 + int(uuid.uuid4().int % 900) * 10  # table IDs of this run: base+1 .. base+5
        self.redo = redo
        self.ops: dict[str, dict[str, Any]] = {}
        self.hooked: list[str] = []

    def start(self) -> World:
        k, cf, b = self.k, self.cf, self.base
        k.apply(changefeed(cf, self.redo), table(cf, f"{cf}-split", b + 1), table(cf, f"{cf}-multi", b + 2, 4),
                table(cf, f"{cf}-gone", b + 3))  # fmt: skip
        return wait_for(f"{cf}: every span Replicating", lambda: at_rest(k, cf))

    def hold(self, w: World) -> None:
        """Pause creates everywhere, hold closes on the origins' captures, then start every operator."""
        k, cf, b = self.k, self.cf, self.base
        captures = sorted(w.captures)
        assert len(captures) >= 3, f"need three captures, have {captures}"
        single = spans_of(w, b + 1)[0]
        multi = spans_of(w, b + 2)
        mover, merged = multi[-1], multi[:2]
        target = next(c for c in captures if c != mover.capture)
        origins = {single.capture, mover.capture, *(s.capture for s in merged)}
        origins |= {s.capture for s in spans_of(w, b + 3)}
        self.hooked = captures
        set_hooks(k, captures, PAUSE_CREATE, "*")
        set_hooks(k, sorted(origins), HOLD_CLOSE, "*")
        self.ops = {
            f"{cf}-move": {"type": "Move", "spans": [mover.name], "target": target},
            f"{cf}-split": {"type": "Split", "spans": [single.name], "splitInto": 3},
            f"{cf}-merge": {"type": "Merge", "spans": [s.name for s in merged]},
        }
        k.apply(*(operator(cf, name, **spec) for name, spec in self.ops.items()))
        k.apply(table(cf, f"{cf}-new1", b + 4), table(cf, f"{cf}-new2", b + 5, 2))  # adds
        k.run("delete", "tables.cdc.maintainer.dev", f"{cf}-gone", "--wait=false")  # a remove

        def held() -> World | None:
            w = world(k, cf)
            assert always(w) == []
            stages = {n: (o.phase, o.stage) for n, o in w.operators.items()}
            users_held = all(stages.get(n) == ("Running", "RemoveOrigin") for n in self.ops)
            # New tables' spans are placed without an operator: Scheduling, their destination in the Span status.
            adds = [s for s in w.spans.values() if s.state == "Scheduling" and not s.operator and s.capture]
            removes = [o for o in w.operators.values() if o.type == "Remove" and o.phase in IN_FLIGHT]
            return w if users_held and adds and removes else None

        wait_for(f"{cf}: Move, Split, Merge held in RemoveOrigin, placements and a Remove in flight", held, timeout=120)

    def release(self) -> None:
        set_hooks(self.k, self.hooked, HOLD_CLOSE, None)
        set_hooks(self.k, self.hooked, PAUSE_CREATE, None)

    def check(self) -> None:
        k, cf, b = self.k, self.cf, self.base
        w = wait_for(f"{cf}: settled after the failover", lambda: at_rest(k, cf), timeout=240)
        for name, spec in self.ops.items():
            op = w.operators.get(name)
            assert op is not None, f"{name} is gone"
            assert op.phase == "Succeeded", f"{name}: {op}"
            if spec["type"] == "Move":
                assert [t.capture for t in op.targets] == [spec["target"]], f"{name} changed its destination"
            if spec["type"] == "Split":
                assert len(op.targets) == 3, op
                assert all(t.span in w.spans for t in op.targets), op
            if spec["type"] == "Merge":
                assert len(op.targets) == 1, op
                assert op.targets[0].span in w.spans, op
        assert {s.table_id for s in w.spans.values()} >= {b + 1, b + 2, b + 4, b + 5}
        time.sleep(10)  # a few maintainer ticks: the deleted table must not come back
        w = world(k, cf)
        assert f"{cf}-gone" not in w.tables
        assert not [s.name for s in w.spans.values() if s.table_id == b + 3], "deleted table resurrected (spans)"
        assert not [d.name for d in w.dispatchers.values() if d.table_id == b + 3], "deleted table (dispatchers)"
        assert settled(w) == []
        assert always(w) == []

    def cleanup(self) -> None:
        self.release()
        self.k.run("delete", "tables.cdc.maintainer.dev", "-l", f"cdc.maintainer.dev/changefeed={self.cf}",
                   "--wait=true", "--timeout=120s", check=False)  # fmt: skip
        self.k.run("delete", "spanoperators.cdc.maintainer.dev", "-l", f"cdc.maintainer.dev/changefeed={self.cf}",
                   "--wait=false", check=False)  # fmt: skip
        self.k.run("delete", "changefeeds.cdc.maintainer.dev", self.cf, "--wait=false", check=False)


def maintainer_pods(k: Kube) -> list[str]:
    pods = k.items("pods", MAINTAINER)
    return sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp"))


def delete_pod(k: Kube, pod: str, force: bool) -> None:
    args = ["delete", "pod", pod, "--wait=false"]
    k.run(*args, *(["--force", "--grace-period=0"] if force else []))


def taken_over(k: Kube, cf: str, old_pods: set[str], old_epoch: int) -> bool:
    holder = lease_holder(k, cf)
    cfo = k.get("changefeeds.cdc.maintainer.dev", cf) or {}
    epoch = int((cfo.get("status") or {}).get("epoch") or 0)
    return bool(holder) and pod_of(holder) not in old_pods and epoch > old_epoch


def epoch_of(k: Kube, cf: str) -> int:
    return int(((k.get("changefeeds.cdc.maintainer.dev", cf) or {}).get("status") or {}).get("epoch") or 0)


@pytest.fixture
def scenario(kube: Kube, request: pytest.FixtureRequest) -> Any:
    made: list[Scenario] = []

    def make(redo: bool) -> Scenario:
        s = Scenario(kube, redo)
        made.append(s)
        return s

    yield make
    for s in made:
        s.cleanup()


# -- the runs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("redo", [False, True], ids=["default", "redo"])
@pytest.mark.parametrize("force", [False, True], ids=["graceful", "force"])
def test_maintainer_failover_when_operator(kube: Kube, scenario: Any, redo: bool, force: bool) -> None:
    s: Scenario = scenario(redo)
    s.hold(s.start())
    old = set(maintainer_pods(kube))
    assert pod_of(lease_holder(kube, s.cf)) in old
    epoch = epoch_of(kube, s.cf)
    for pod in old:
        delete_pod(kube, pod, force)
    wait_for("a new maintainer pod leads the changefeed", lambda: taken_over(kube, s.cf, old, epoch), timeout=180)
    s.release()
    s.check()


def test_maintainer_and_capture_deleted_together(kube: Kube, scenario: Any) -> None:
    s: Scenario = scenario(False)
    s.hold(s.start())
    old = set(maintainer_pods(kube))
    epoch = epoch_of(kube, s.cf)
    capture_pod = sorted(p["metadata"]["name"] for p in kube.items("pods", CAPTURE))[0]
    for pod in old:
        delete_pod(kube, pod, force=True)
    delete_pod(kube, capture_pod, force=True)
    wait_for("a new maintainer pod leads the changefeed", lambda: taken_over(kube, s.cf, old, epoch), timeout=180)
    s.release()
    s.check()


def test_two_maintainer_replicas_leader_deleted(kube: Kube, scenario: Any) -> None:
    deploy = kube.items("deployments", MAINTAINER)[0]["metadata"]["name"]
    kube.run("scale", "deployment", deploy, "--replicas=2")
    kube.run("rollout", "status", "deployment", deploy, "--timeout=180s", timeout=200)
    try:
        s: Scenario = scenario(False)
        s.hold(s.start())
        pods = set(maintainer_pods(kube))
        assert len(pods) == 2, pods
        leader = pod_of(lease_holder(kube, s.cf))
        assert leader in pods
        epoch = epoch_of(kube, s.cf)
        delete_pod(kube, leader, force=True)
        standby = pods - {leader}

        # the standby (already running) takes over; the leader's replacement may not be up yet
        def standby_leads() -> bool:
            return pod_of(lease_holder(kube, s.cf)) in standby and epoch_of(kube, s.cf) > epoch

        wait_for("the standby replica leads the changefeed", standby_leads, timeout=120)
        s.release()
        s.check()
    finally:
        kube.run("scale", "deployment", deploy, "--replicas=1")
