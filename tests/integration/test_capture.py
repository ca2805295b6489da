"""The capture agent as a real process against the embedded API server.

No maintainer exists here: each test plays the maintainer by writing Changefeed, Table and Dispatcher
objects directly and reads back what the agent wrote. Intervals are shortened through the CLI flags
(lease 3 s, renew (and report progress) every 0.3 s, fence after 1.5 s, re-send every 0.3 s, loop tick 0.1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import urllib3

from controller.apiserver import ApiServerHandle, start_server
from controller.capture.hooks import HOLD_CLOSE, PAUSE_CREATE, Scope, hooks_from_annotations, parse_scope
from controller.capture.ledger import Required, check, read
from controller.capture.runtime import LogicalClockRuntime
from controller.kube.client import JSON, RESOURCES, ApiError, Client, Resource
from controller.kube.objects import ObjectInformer
from controller.model.keys import KeyRange
from controller.model.progress import PROGRESS_ANNOTATION, digest
from controller.model.records import Dispatcher
from controller.model.resources import DRAIN_FOR_SHUTDOWN, DRAIN_REASON_ANNOTATION
from controller.model.states import Kind, Mode
from controller.model.tso import physical_ms
from tests.integration.chaos import Chaos

ROOT = Path(__file__).resolve().parents[2]
GROUP = "cdc.maintainer.dev/v1alpha1"
FINALIZER = "cdc.maintainer.dev/dispatcher-closed"
FAST = [
    "--lease-duration", "3",
    "--renew-interval", "0.3",
    "--renew-deadline", "1.5",
    "--report-interval", "0.3",
    "--init-delay", "0.6",
    "--tick", "0.1",
]  # fmt: skip
T = TypeVar("T")


class Api:
    """Plain HTTP to the embedded server, scoped to one namespace."""

    def __init__(self, handle: ApiServerHandle, namespace: str) -> None:
        self.handle = handle
        self.url = handle.url
        self.ns = namespace
        self.pool = urllib3.PoolManager()

    def req(self, method: str, path: str, body: Any = None, ct: str = "application/json") -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        r = self.pool.request(method, self.url + path, body=data, headers={"Content-Type": ct}, timeout=10)
        return r.status, json.loads(r.data) if r.data else None

    def path(self, plural: str, name: str = "") -> str:
        base = f"/apis/{GROUP}/namespaces/{self.ns}/{plural}"
        if plural == "leases":
            base = f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases"
        return f"{base}/{name}" if name else base

    def get(self, plural: str, name: str) -> Any:
        status, body = self.req("GET", self.path(plural, name))
        return body if status == 200 else None

    def create(self, plural: str, obj: dict[str, Any]) -> Any:
        status, body = self.req("POST", self.path(plural), obj)
        assert status == 201, body
        return body

    def patch(self, plural: str, name: str, patch: dict[str, Any], sub: str = "") -> Any:
        path = self.path(plural, name) + (f"/{sub}" if sub else "")
        status, body = self.req("PATCH", path, patch, "application/merge-patch+json")
        assert status == 200, body
        return body

    def delete(self, plural: str, name: str) -> None:
        status, body = self.req("DELETE", self.path(plural, name))
        assert status in (200, 202), body

    # -- the maintainer's part ---------------------------------------------------------------------

    def changefeed(self, name: str = "cf", epoch: int = 1) -> None:
        self.create("changefeeds", {"apiVersion": GROUP, "kind": "Changefeed", "metadata": {"name": name}, "spec": {}})
        self.patch("changefeeds", name, {"status": {"epoch": epoch}}, sub="status")

    def table(self, table_id: int, write_rate: float = 0.0, changefeed: str = "cf") -> None:
        spec = {"changefeed": changefeed, "tableID": table_id, "writeRate": write_rate}
        meta = {"name": f"t{table_id}"}
        self.create("tables", {"apiVersion": GROUP, "kind": "Table", "metadata": meta, "spec": spec})

    def dispatcher(
        self, name: str, capture: str, *, table_id: int = 1, epoch: int = 1, start_ts: int = 1000, extra: str = ""
    ) -> None:
        start, end = KeyRange.of_table(table_id).hex()
        finalizers = [FINALIZER, *([extra] if extra else [])]
        meta = {"name": name, "labels": {"cdc.maintainer.dev/capture": capture}, "finalizers": finalizers}
        spec = {
            "changefeed": "cf",
            "span": f"s-{name}",
            "tableID": table_id,
            "startKey": start,
            "endKey": end,
            "capture": capture,
            "startTs": start_ts,
            "epoch": epoch,
        }
        self.create("dispatchers", {"apiVersion": GROUP, "kind": "Dispatcher", "metadata": meta, "spec": spec})

    def state(self, name: str) -> str | None:
        obj = self.get("dispatchers", name)
        return None if obj is None else (obj.get("status") or {}).get("state", "")

    def annotate(self, capture: str, annotations: dict[str, str | None]) -> None:
        self.patch("captures", capture, {"metadata": {"annotations": annotations}})


class AgentProc:
    def __init__(
        self,
        api: Api,
        name: str,
        log_path: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        kubeconfig: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._resumes = 0
        args = [sys.executable, "-m", "controller.capture", "--name", name, "--namespace", api.ns]
        args += ["--kubeconfig", str(kubeconfig or api.handle.kubeconfig_path), *FAST, *extra]
        with log_path.open("ab") as err:
            self.proc = subprocess.Popen(args, cwd=ROOT, stderr=err, env={**os.environ, **(env or {})})

    def logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def said(self, msg: str) -> list[dict[str, Any]]:
        """Log lines whose message starts with ``msg``."""
        return [line for line in self.logs() if line["msg"].startswith(msg)]

    def running(self) -> bool:
        return self.proc.poll() is None

    def next_pause(self, timeout: float = 5.0) -> dict[str, Any]:
        """Wait for a pause logged after the ones already there (a loaded machine may have caused others)."""
        seen = len(self.said("paused"))
        self._resumes = len(self.said("resumed"))
        return wait_for(lambda: self.said("paused")[seen:], timeout, "paused")[0]

    def last_resume(self) -> dict[str, Any]:
        """The first resume after the pause ``next_pause`` returned."""
        return self.said("resumed")[self._resumes]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)


def wait_for(fn: Callable[[], T | None], timeout: float = 5.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {value!r})")
        time.sleep(0.05)


def stays(fn: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not fn():
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerHandle]:
    handle = start_server(ROOT / "crds", bookmark_interval=0.5)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def api(server: ApiServerHandle) -> Iterator[Api]:
    ns = f"cap-{uuid.uuid4().hex[:8]}"
    status, body = Api(server, ns).req(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    )
    assert status == 201, body
    api = Api(server, ns)
    yield api
    server.inject_failures("leases", 0)
    api.pool.clear()


@pytest.fixture
def agents(api: Api, tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    started: list[AgentProc] = []

    def start(name: str, *extra: str, env: dict[str, str] | None = None, kubeconfig: Path | None = None) -> AgentProc:
        proc = AgentProc(api, name, tmp_path / f"{name}-{len(started)}.log", *extra, env=env, kubeconfig=kubeconfig)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def chaos(server: ApiServerHandle, tmp_path: Path) -> Iterator[Chaos]:
    """Proxies between agents and the API server, to cut them off (tests/integration/chaos.py)."""
    c = Chaos(server.url, server.kubeconfig_path, tmp_path)
    yield c
    c.close()


def working(api: Api, name: str) -> Callable[[], bool]:
    return lambda: api.state(name) == "Working"


def checkpoint(api: Api, name: str) -> int:
    return int(api.get("dispatchers", name)["status"]["checkpointTs"])


def report(api: Api, capture: str) -> dict[str, Any] | None:
    """The progress report on the capture's Lease (annotation cdc.maintainer.dev/progress), decoded."""
    lease = api.get("leases", f"capture-{capture}")
    text = ((lease or {}).get("metadata", {}).get("annotations") or {}).get(PROGRESS_ANNOTATION)
    return json.loads(text) if text else None


def entry(api: Api, capture: str, changefeed: str = "cf", mode: str = "default") -> dict[str, Any] | None:
    found = report(api, capture)
    for e in (found or {}).get("changefeeds", []):
        if e["changefeed"] == changefeed and e["mode"] == mode:
            return dict(e)
    return None


def reported(api: Api, capture: str, dispatchers: int) -> int:
    """The checkpoint the capture's report (on its Lease) claims for changefeed cf, default mode, once it covers
    ``dispatchers`` dispatchers (0 before): checkpoints travel there, not in the dispatchers' status."""
    e = entry(api, capture)
    return int(e["checkpointTs"]) if e is not None and e["dispatchers"] == dispatchers else 0


# ------------------------------------------------------------------------------------------------------
# Pure parts


def test_hook_values_parse() -> None:
    assert parse_scope("*") == (Scope(every=True), [])
    assert parse_scope(" 7, 12 ,") == (Scope(tables=frozenset({7, 12})), [])
    assert parse_scope("7,x") == (Scope(tables=frozenset({7})), ["x"])
    assert parse_scope("") == (None, [])
    assert parse_scope("oops")[0] is None  # a typo never means "all tables"
    hooks, problems = hooks_from_annotations({HOLD_CLOSE: "3", PAUSE_CREATE: "*", "other": "x"})
    assert hooks.holds_close(3)
    assert not hooks.holds_close(4)
    assert hooks.pauses_create(99)
    assert not problems


def test_logical_clock_runtime() -> None:
    now = [1_700_000_000.0]
    mono = [0.0]
    rt = LogicalClockRuntime(lag_ms=500, init_delay=1.0, rate_of=lambda d: (42.0, 10), clock=lambda: now[0],
                             monotonic=lambda: mono[0])  # fmt: skip
    start_ts = (int(now[0] * 1000) - 10_000) << 18
    d = Dispatcher(name="d", changefeed="cf", span="s", table_id=1, key_range=KeyRange.of_table(1), capture="c",
                   start_ts=start_ts, epoch=1)  # fmt: skip
    rt.start(d)
    assert rt.checkpoint("d") == start_ts  # no progress before the init delay
    mono[0] = 1.0
    cp = rt.checkpoint("d")
    assert physical_ms(cp) == int(now[0] * 1000) - 500  # trails the upstream TSO by the lag
    now[0] -= 5  # the wall clock steps back: the checkpoint does not
    assert rt.checkpoint("d") >= cp
    assert (rt.write_rate("d"), rt.region_count("d")) == (42.0, 10)  # the whole table
    half = d.evolve(name="h", key_range=KeyRange.of_table(1).split_at(KeyRange.of_table(1).even_split_keys(2))[0])
    rt.start(half)
    assert (rt.write_rate("h"), rt.region_count("h")) == (21.0, 5)  # its share of the key space
    future = d.evolve(name="f", start_ts=(int(now[0] * 1000) + 60_000) << 18)
    rt.start(future)
    mono[0] = 5.0
    assert rt.checkpoint("f") == future.start_ts  # never below startTs
    paused = rt.pause("d")  # stops delivering: the checkpoint stays where it is
    now[0] += 30
    assert rt.checkpoint("d") == paused
    rt.resume("d")  # delivers again from there (the logical clock catches up with the upstream)
    assert physical_ms(rt.checkpoint("d")) == int(now[0] * 1000) - 500
    again = rt.pause("d")
    now[0] += 10
    assert rt.close("d") == again  # closed while paused: the final checkpoint is where it stopped
    # Past its delivery deadline (the Lease renewal deadline) nothing is delivered, paused or not.
    deadline = [mono[0] + 1.0]
    fenced = LogicalClockRuntime(init_delay=0.0, clock=lambda: now[0], monotonic=lambda: mono[0],
                                 deliver_until=lambda: deadline[0])  # fmt: skip
    fenced.start(d)
    before = fenced.checkpoint("d")
    mono[0] += 2.0
    now[0] += 2.0
    assert fenced.checkpoint("d") == before
    deadline[0] = mono[0] + 1.0  # renewed
    assert fenced.checkpoint("d") > before
    with pytest.raises(KeyError):
        rt.checkpoint("d")


class FakeClient:
    """list_pages/watch only: the first watch ends with a 410 ERROR event, the second one raises 410 Gone."""

    def __init__(self) -> None:
        self.lists = 0
        self.watches: list[str] = []

    async def list_pages(
        self, res: Resource, namespace: str, label_selector: str = "", limit: int = 0
    ) -> AsyncIterator[tuple[list[JSON], str]]:
        self.lists += 1
        yield [{"metadata": {"name": f"d{self.lists}", "resourceVersion": "5"}}], "10"

    async def watch(self, res: Resource, namespace: str, rv: str, **kw: Any) -> AsyncIterator[JSON]:
        self.watches.append(rv)
        if len(self.watches) == 1:
            yield {"type": "ADDED", "object": {"metadata": {"name": "x", "resourceVersion": "11"}}}
            yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}}
            return  # stream end: resume from 12
        if len(self.watches) == 2:
            yield {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
        if len(self.watches) == 3:
            raise ApiError(410, "Gone", "too old")
        await asyncio.sleep(3600)


def test_informer_resumes_and_relists_on_410() -> None:
    async def scenario() -> tuple[FakeClient, ObjectInformer]:
        fake = FakeClient()
        informer = ObjectInformer(cast(Client, fake), RESOURCES[Kind.DISPATCHER], "ns")
        task = asyncio.create_task(informer.run())
        for _ in range(200):
            if len(fake.watches) >= 4:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return fake, informer

    fake, informer = asyncio.run(scenario())
    assert fake.watches == ["10", "12", "10", "10"]  # resumed from the bookmark, relisted twice
    assert fake.lists == 3
    assert set(informer.objects) == {"d3"}  # a relist replaces the cache whole


# ------------------------------------------------------------------------------------------------------
# The agent process


def test_registers_renews_and_lease_lapses_after_sigkill(api: Api, agents: Callable[..., AgentProc]) -> None:
    agent = agents("c1", env={"POD_NAME": "pod-c1"})
    cap = wait_for(lambda: (api.get("captures", "c1") or {}).get("status"), what="Capture status")
    assert cap == {"dispatchers": 0, "pod": "pod-c1"}
    lease = wait_for(lambda: api.get("leases", "capture-c1"), what="Lease")
    assert lease["spec"]["holderIdentity"] == "c1"
    assert lease["spec"]["leaseDurationSeconds"] == 3
    first = lease["spec"]["renewTime"]
    wait_for(lambda: api.get("leases", "capture-c1")["spec"]["renewTime"] != first, 2.0, "a renewal")

    agent.stop(signal.SIGKILL)
    last = api.get("leases", "capture-c1")["spec"]["renewTime"]
    time.sleep(1.0)
    assert api.get("leases", "capture-c1")["spec"]["renewTime"] == last, "renewTime moved after SIGKILL"
    assert api.get("leases", "capture-c1")["spec"]["holderIdentity"] == "c1"  # not released: it lapses

    logs = agent.logs()  # JSON lines, every one
    assert {"ts", "level", "msg"} <= set(logs[0])
    assert any(line["msg"] == "registered" for line in logs)

    # A restarted agent reuses its Capture and takes its own Lease back.
    again = agents("c1")
    wait_for(lambda: api.get("leases", "capture-c1")["spec"]["renewTime"] != last, 15.0, "renewal after restart")
    assert not any(line["level"] == "error" for line in again.logs())


def test_dispatcher_lifecycle(api: Api, agents: Callable[..., AgentProc], server: ApiServerHandle) -> None:
    api.changefeed(epoch=2)
    api.table(1, write_rate=250.0)
    agents("c1")
    wait_for(lambda: api.get("leases", "capture-c1"), what="Lease")

    api.dispatcher("d-ok", "c1", epoch=2, extra="test/keep")
    init = wait_for(lambda: (api.get("dispatchers", "d-ok").get("status") or {}), what="a first status")
    assert init["state"] == "Initializing"
    assert init["checkpointTs"] == 1000
    assert init["heartbeat"]
    wait_for(working(api, "d-ok"), what="Working")
    cp1 = checkpoint(api, "d-ok")
    # The checkpoint advances in the report on the Lease (the dispatcher's status keeps the Working one).
    wait_for(lambda: (e := entry(api, "c1")) and e["checkpointTs"] > cp1 and e, 2.0, "an advancing checkpoint")
    # The table's write rate, reported for the split and merge schedulers (the span is the whole table).
    wait_for(lambda: api.get("dispatchers", "d-ok")["status"].get("writeRate") == 250.0, 10.0, "writeRate")
    assert wait_for(lambda: (api.get("captures", "c1").get("status") or {}).get("dispatchers") == 1)

    api.dispatcher("d-stale", "c1", epoch=1)
    wait_for(lambda: api.state("d-stale") == "Rejected", what="Rejected")
    assert "epoch 1 < changefeed epoch 2" in api.get("dispatchers", "d-stale")["status"]["message"]

    # Watch streams end (an API server restart): the agent reconnects and still sees new dispatchers.
    assert server.close_watches() >= 2
    api.dispatcher("d-after", "c1", table_id=2, epoch=2)
    wait_for(working(api, "d-after"), what="Working after a watch reconnect")

    # Delete: Stopped with the final checkpoint, our finalizer released (a second one keeps it visible).
    last = checkpoint(api, "d-ok")
    api.delete("dispatchers", "d-ok")
    obj = wait_for(
        lambda: (o := api.get("dispatchers", "d-ok")) and o["metadata"]["finalizers"] == ["test/keep"] and o,
        what="finalizer released",
    )
    assert obj["status"]["state"] == "Stopped"
    assert obj["status"]["checkpointTs"] >= last
    api.patch("dispatchers", "d-ok", {"metadata": {"finalizers": None}})
    wait_for(lambda: api.get("dispatchers", "d-ok") is None, what="d-ok gone")
    api.delete("dispatchers", "d-after")
    wait_for(lambda: api.get("dispatchers", "d-after") is None, what="d-after gone")
    wait_for(lambda: api.get("captures", "c1")["status"]["dispatchers"] == 0, what="count back to 0")


def test_progress_rides_on_the_lease_and_a_dispatcher_is_written_only_on_changes(
    api: Api, agents: Callable[..., AgentProc], tmp_path: Path
) -> None:
    """At rest: the Lease renewals carry how far the dispatchers got; their own status is not rewritten.
    The ledger has every checkpoint claimed (in the report or a status) before it is claimed."""
    ledger = tmp_path / "ledger"
    api.changefeed()
    api.table(1, write_rate=100.0)
    first = agents("c1", "--ledger-dir", str(ledger))
    for name, table_id in (("d1", 1), ("d2", 2)):
        api.dispatcher(name, "c1", table_id=table_id)
    wait_for(lambda: working(api, "d1")() and working(api, "d2")(), what="Working")
    uids = [api.get("dispatchers", n)["metadata"]["uid"] for n in ("d1", "d2")]
    e = wait_for(lambda: (e := entry(api, "c1")) and e["dispatchers"] == 2 and e, 3.0, "a report of both")
    assert e["digest"] == digest(uids)
    assert e["slowest"] in ("d1", "d2")
    incarnation = report(api, "c1")["incarnation"]  # type: ignore[index]
    # The traffic is written once (writeRate of table 1), then nothing while only checkpoints move.
    wait_for(lambda: api.get("dispatchers", "d1")["status"].get("writeRate") == 100.0, 5.0, "writeRate")
    rvs = {n: api.get("dispatchers", n)["metadata"]["resourceVersion"] for n in ("d1", "d2")}
    low = e["checkpointTs"]
    wait_for(lambda: (e := entry(api, "c1")) and e["checkpointTs"] > low, 3.0, "the report advancing")
    time.sleep(1.5)  # five report intervals
    assert {n: api.get("dispatchers", n)["metadata"]["resourceVersion"] for n in ("d1", "d2")} == rvs
    claimed = entry(api, "c1")["checkpointTs"]  # type: ignore[index]

    first.stop(signal.SIGKILL)  # whatever was claimed is in the ledger already
    delivered = read(ledger)
    assert {d.dispatcher for d in delivered} == {"d1", "d2"}
    for tid in (1, 2):
        assert check(delivered, [Required("cf", tid, Mode.DEFAULT, 1000, claimed)]) == []
    assert check(delivered, [Required("cf", 3, Mode.DEFAULT, 1000, claimed)])  # table 3: nothing delivered

    # A new process: another incarnation, which runs neither dispatcher and so reports neither.
    agents("c1", "--ledger-dir", str(ledger))
    wait_for(lambda: (r := report(api, "c1")) and r["incarnation"] != incarnation, 5.0, "a new incarnation")
    wait_for(lambda: api.state("d1") == "Stopped" and api.state("d2") == "Stopped", 5.0, "Stopped")
    assert entry(api, "c1") is None


def test_hooks_are_ignored_and_reported_unless_enabled(api: Api, agents: Callable[..., AgentProc]) -> None:
    """Production agents (no --test-hooks) do not honour the failpoints: a Capture annotated with them by
    anyone allowed to patch it cannot freeze closes or creates; the agent says it ignores them."""
    api.changefeed()
    agent = agents("c1")
    wait_for(lambda: api.get("captures", "c1"), what="Capture")
    api.annotate("c1", {HOLD_CLOSE: "*", PAUSE_CREATE: "*"})
    wait_for(lambda: agent.said("bad test hook annotation"), what="the ignored hooks reported")
    assert "test hooks are off" in agent.said("bad test hook annotation")[0]["problem"]
    api.dispatcher("a1", "c1", table_id=1)
    wait_for(working(api, "a1"), what="a1 Working although pause-create is set")
    api.delete("dispatchers", "a1")
    wait_for(lambda: api.get("dispatchers", "a1") is None, what="a1 closed although hold-close is set")
    assert not agent.said("test hooks changed")


def test_scoped_hooks_hold_close_and_pause_create(api: Api, agents: Callable[..., AgentProc]) -> None:
    api.changefeed()
    agents("c1", "--test-hooks")
    wait_for(lambda: api.get("captures", "c1"), what="Capture")
    api.annotate("c1", {HOLD_CLOSE: "2", PAUSE_CREATE: "4"})
    api.dispatcher("a1", "c1", table_id=1)
    api.dispatcher("a2", "c1", table_id=2)
    wait_for(lambda: working(api, "a1")() and working(api, "a2")(), what="a1, a2 Working")

    api.dispatcher("p3", "c1", table_id=3)
    api.dispatcher("p4", "c1", table_id=4)
    api.delete("dispatchers", "a1")
    api.delete("dispatchers", "a2")
    wait_for(working(api, "p3"), what="p3 (not paused) Working")
    wait_for(lambda: api.get("dispatchers", "a1") is None, what="a1 (not held) closed")
    assert stays(lambda: api.state("p4") == "" and api.state("a2") == "Working", 1.0), "hooks did not hold"
    assert api.get("dispatchers", "a2")["metadata"].get("deletionTimestamp")

    api.annotate("c1", {HOLD_CLOSE: None})
    wait_for(lambda: api.get("dispatchers", "a2") is None, 1.0, "a2 closed once hold-close is released")
    assert api.state("p4") == ""
    api.annotate("c1", {PAUSE_CREATE: None})
    wait_for(lambda: api.state("p4") in ("Initializing", "Working"), 1.0, "p4 started once released")

    # "*": every table.
    api.annotate("c1", {PAUSE_CREATE: "*", HOLD_CLOSE: "*"})
    time.sleep(0.3)
    api.dispatcher("p5", "c1", table_id=5)
    api.delete("dispatchers", "p3")
    assert stays(lambda: api.state("p5") == "" and api.state("p3") == "Working", 0.8)
    api.annotate("c1", {PAUSE_CREATE: None, HOLD_CLOSE: None})
    wait_for(lambda: api.state("p5") in ("Initializing", "Working") and api.get("dispatchers", "p3") is None, 1.0)


def test_restarted_agent_reports_dispatchers_it_does_not_run_stopped(
    api: Api, agents: Callable[..., AgentProc]
) -> None:
    api.changefeed()
    first = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    first.stop(signal.SIGKILL)
    cp = checkpoint(api, "d1")
    agents("c1")
    wait_for(lambda: api.state("d1") == "Stopped", 5.0, "Stopped after restart")
    status = api.get("dispatchers", "d1")["status"]
    assert status["checkpointTs"] == cp
    assert "not running" in status["message"]


#: Agent._shutdown bounds its own steps: the Stopped reports 3 s, the Lease release 2 s.
SHUTDOWN_DEADLINES = 3.0 + 2.0
#: How long a SIGTERMed agent may take to exit before a test calls it hung: its shutdown deadlines, plus
#: cancelling its tasks and leaving the interpreter, with room for a loaded machine. A hang guard only: how
#: fast it exits is not what the tests check.
EXIT_BOUND = 6 * SHUTDOWN_DEADLINES


def test_sigterm_stops_dispatchers_and_releases_lease(api: Api, agents: Callable[..., AgentProc]) -> None:
    """SIGTERM: the agent stops its dispatchers, reports them Stopped, then (last) releases its Lease, and
    exits 0."""
    api.changefeed()
    agent = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), 20.0, "Working")  # a hang guard, with room for a loaded machine
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(EXIT_BOUND) == 0
    assert [x["dispatchers"] for x in agent.said("stopping")] == [["d1"]]
    assert agent.said("released the Lease")
    assert not agent.said("could not release")
    d1 = api.get("dispatchers", "d1")
    assert d1["status"]["state"] == "Stopped"
    assert d1["status"]["message"] == "capture agent stopped"
    lease = api.get("leases", "capture-c1")
    assert lease["spec"].get("holderIdentity", "") == ""  # released, not left to expire
    assert lease["spec"]["leaseDurationSeconds"] == 1
    # The Lease was released after the Stopped report was written (the embedded server's resourceVersions are
    # one increasing sequence, as etcd's revisions are), so no one acted on the capture's absence before then.
    assert int(d1["metadata"]["resourceVersion"]) < int(lease["metadata"]["resourceVersion"])


def test_sigterm_with_a_drain_timeout_drains_first_and_its_next_process_clears_the_drain(
    api: Api, agents: Callable[..., AgentProc]
) -> None:
    """--drain-timeout: SIGTERM marks the Capture draining (annotation drain-reason: shutdown) and waits for the
    maintainer to move its dispatchers off. With no maintainer here nothing moves: the timeout runs out, and the
    agent stops what is left as without a drain (Stopped reports, Lease released, exit 0). Its next process
    clears that drain; a drain a person set (no annotation) stays."""
    api.changefeed()
    agent = agents("c1", "--drain-timeout", "1.5")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), 20.0, "Working")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(EXIT_BOUND + 1.5) == 0
    assert agent.said("marked the Capture draining for shutdown")
    assert [x["dispatchers"] for x in agent.said("drain timed out; stopping the dispatchers still here")] == [1]
    assert not agent.said("drained: every dispatcher moved off")
    assert api.get("dispatchers", "d1")["status"]["state"] == "Stopped"
    assert api.get("leases", "capture-c1")["spec"].get("holderIdentity", "") == ""
    cap = api.get("captures", "c1")
    assert cap["spec"]["draining"] is True
    assert cap["metadata"]["annotations"][DRAIN_REASON_ANNOTATION] == DRAIN_FOR_SHUTDOWN

    again = agents("c1", "--drain-timeout", "1.5")
    wait_for(lambda: again.said("cleared the drain a previous process set for its shutdown"), 20.0, "drain cleared")
    cap = api.get("captures", "c1")
    assert cap["spec"]["draining"] is False
    assert DRAIN_REASON_ANNOTATION not in (cap["metadata"].get("annotations") or {})

    # A person's drain is theirs: a SIGTERM keeps it as it is and a new process does not clear it.
    api.patch("captures", "c1", {"spec": {"draining": True}})
    again.proc.send_signal(signal.SIGTERM)
    assert again.wait(EXIT_BOUND + 1.5) == 0
    third = agents("c1", "--drain-timeout", "1.5")
    wait_for(lambda: third.said("registered"), 20.0, "registered")
    cap = api.get("captures", "c1")
    assert cap["spec"]["draining"] is True
    assert DRAIN_REASON_ANNOTATION not in (cap["metadata"].get("annotations") or {})
    assert not third.said("cleared the drain")


def test_sigterm_with_a_drain_timeout_exits_once_nothing_is_held(api: Api, agents: Callable[..., AgentProc]) -> None:
    """Holding nothing (its dispatcher moved off: deleted, its finalizer released by the agent's close), a draining
    agent exits at once, long before its drain timeout."""
    api.changefeed()
    agent = agents("c1", "--drain-timeout", "60")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), 20.0, "Working")
    agent.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: agent.said("marked the Capture draining for shutdown"), 20.0, "draining")
    api.delete("dispatchers", "d1")  # as a Move's RemoveOrigin does
    assert agent.wait(EXIT_BOUND) == 0  # well inside the 60 s timeout
    assert agent.said("drained: every dispatcher moved off")
    assert api.get("dispatchers", "d1") is None  # closed and released before the exit


def test_pauses_when_its_lease_cannot_be_renewed_and_resumes_in_place(
    api: Api, agents: Callable[..., AgentProc], server: ApiServerHandle
) -> None:
    """Renewals fail (the rest of the API works): it stops delivering within the renew deadline, keeps its
    dispatchers, and once a renewal gets through (nobody took the Lease) goes on from where it stopped."""
    api.changefeed()
    agent = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    server.inject_failures("leases", 10_000)
    started = time.monotonic()
    paused = agent.next_pause()
    assert time.monotonic() - started < 3.0  # well inside the 3 s lease
    assert "could not renew" in paused["reason"]
    at = paused["dispatchers"]["d1"]
    time.sleep(1.0)
    assert agent.running()
    assert checkpoint(api, "d1") <= at  # nothing reported past where it paused
    assert reported(api, "c1", 1) <= at
    server.inject_failures("leases", 0)
    wait_for(lambda: reported(api, "c1", 1) > at, 5.0, "d1 delivering again")
    assert agent.running()
    assert agent.last_resume()["resumed"] == ["d1"]
    assert len([x for x in agent.said("started dispatcher") if x["dispatcher"] == "d1"]) == 1


def test_cut_off_it_keeps_its_dispatchers_and_resumes_them(
    api: Api, agents: Callable[..., AgentProc], chaos: Chaos
) -> None:
    """The API unreachable for longer than the lease: no exit, no restart of anything; then it resumes."""
    api.changefeed()
    _, kubeconfig = chaos.proxy("c1")
    agent = agents("c1", kubeconfig=kubeconfig)
    api.dispatcher("d1", "c1")
    api.dispatcher("d2", "c1", table_id=2)
    wait_for(lambda: working(api, "d1")() and working(api, "d2")(), what="Working")
    chaos.cut(["c1"])
    at = agent.next_pause()["dispatchers"]
    time.sleep(4.0)  # past the 3 s lease: an agent that fenced itself would have exited by now
    assert agent.running()
    chaos.restore(["c1"])
    wait_for(lambda: reported(api, "c1", 2) > max(at["d1"], at["d2"]), 5.0, "delivering again")
    assert agent.running()
    assert sorted(agent.last_resume()["resumed"]) == ["d1", "d2"]
    assert len(agent.said("started dispatcher")) == 2
    assert agent.said("registered")[0] == agent.said("registered")[-1]


def test_resumes_only_what_was_not_taken(api: Api, agents: Callable[..., AgentProc], chaos: Chaos) -> None:
    """While it is cut off, one dispatcher is removed outright and one is deleted: on its return it resumes the
    third, drops the first, and closes the second reporting where it stopped."""
    api.changefeed()
    _, kubeconfig = chaos.proxy("c1")
    agent = agents("c1", kubeconfig=kubeconfig)
    api.dispatcher("keep", "c1")
    api.dispatcher("gone", "c1", table_id=2)
    api.dispatcher("closing", "c1", table_id=3, extra="test/keep")
    wait_for(lambda: all(working(api, d)() for d in ("keep", "gone", "closing")), what="Working")
    chaos.cut(["c1"])
    at = agent.next_pause()["dispatchers"]
    api.delete("dispatchers", "gone")
    api.patch("dispatchers", "gone", {"metadata": {"finalizers": None}})
    api.delete("dispatchers", "closing")
    chaos.restore(["c1"])
    closed = wait_for(
        lambda: (o := api.get("dispatchers", "closing")) and o["metadata"]["finalizers"] == ["test/keep"] and o,
        5.0,
        "closing closed",
    )
    assert closed["status"]["state"] == "Stopped"
    assert closed["status"]["checkpointTs"] == at["closing"]  # it delivered nothing after it paused
    wait_for(lambda: reported(api, "c1", 1) > at["keep"], 5.0, "keep delivering again")
    resumed = agent.last_resume()
    assert resumed["resumed"] == ["keep"]
    # Dropped by the resume check, or already when its watch reconnected and showed it gone.
    assert "gone" in resumed["dropped"] or [x for x in agent.said("dispatcher vanished") if x["dispatcher"] == "gone"]
    api.patch("dispatchers", "closing", {"metadata": {"finalizers": None}})


def test_a_new_maintainer_term_while_paused_starts_its_dispatchers_afresh(
    api: Api, agents: Callable[..., AgentProc], chaos: Chaos
) -> None:
    """A newer epoch was published while it could not see: it does not resume; it reports them Stopped (the
    maintainer places them again from their checkpoints)."""
    api.changefeed(epoch=1)
    _, kubeconfig = chaos.proxy("c1")
    agent = agents("c1", kubeconfig=kubeconfig)
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    chaos.cut(["c1"])
    at = agent.next_pause()["dispatchers"]
    api.patch("changefeeds", "cf", {"status": {"epoch": 2}}, sub="status")
    chaos.restore(["c1"])
    wait_for(lambda: api.state("d1") == "Stopped", 5.0, "d1 Stopped")
    status = api.get("dispatchers", "d1")["status"]
    assert status["checkpointTs"] == at["d1"]
    assert "epoch" in status["message"]
    assert agent.running()
    assert agent.last_resume()["resumed"] == []


def test_a_paused_capture_whose_lease_was_taken_fences_itself(
    api: Api, agents: Callable[..., AgentProc], chaos: Chaos
) -> None:
    """The maintainer took its lapsed Lease (as it does before re-placing a lost capture's spans): on its
    return the renewal fails, and it stops everything and exits without resuming anything."""
    api.changefeed()
    _, kubeconfig = chaos.proxy("c1")
    agent = agents("c1", kubeconfig=kubeconfig)
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    chaos.cut(["c1"])
    agent.next_pause()
    resumes = len(agent.said("resumed"))
    lease = api.get("leases", "capture-c1")
    lease["spec"]["holderIdentity"] = ""
    status, body = api.req("PUT", api.path("leases", "capture-c1"), lease)
    assert status == 200, body
    before = api.get("dispatchers", "d1")["status"]
    chaos.restore(["c1"])
    assert agent.wait(5) == 3
    assert len(agent.said("resumed")) == resumes
    assert "Lease" in agent.said("fenced itself")[0]["reason"]
    assert api.get("dispatchers", "d1")["status"] == before  # nothing written after the pause


def test_keeps_trying_when_the_api_server_is_gone(tmp_path: Path) -> None:
    """Connection refused (not an API error status) pauses it too; it does not exit."""
    handle = start_server(ROOT / "crds", bookmark_interval=0.5)
    try:
        api = Api(handle, "default")
        api.changefeed()
        agent = AgentProc(api, "c1", tmp_path / "c1.log")
        try:
            api.dispatcher("d1", "c1")
            wait_for(working(api, "d1"), what="Working")
        except BaseException:
            agent.stop()
            raise
    finally:
        handle.stop()
    try:
        paused = wait_for(lambda: agent.said("paused"), 5.0, "paused")
        assert "d1" in paused[-1]["dispatchers"]
        time.sleep(3.0)  # the whole lease: still there, still trying
        assert agent.running()
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait(10) == 0
    finally:
        agent.stop()


def test_a_second_process_of_the_same_name_takes_over_and_the_first_fences(
    api: Api, agents: Callable[..., AgentProc]
) -> None:
    """The Lease's acquireTime is the process's incarnation: the first process must not mistake the second's
    renewals for its own lost answers (before, it adopted them and both ran, one capture name, two owners)."""
    api.changefeed()
    first = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    acquired = api.get("leases", "capture-c1")["spec"]["acquireTime"]
    second = agents("c1")
    wait_for(lambda: api.get("leases", "capture-c1")["spec"]["acquireTime"] != acquired, 15.0, "the takeover")
    assert first.wait(10) == 3
    assert "another process" in first.said("fenced itself")[0]["reason"]
    assert second.running()


def test_fences_itself_when_another_holder_takes_the_lease(api: Api, agents: Callable[..., AgentProc]) -> None:
    agent = agents("c1")
    lease = wait_for(lambda: api.get("leases", "capture-c1"), what="Lease")
    lease["spec"]["holderIdentity"] = "intruder"
    status, body = api.req("PUT", api.path("leases", "capture-c1"), lease)
    if status == 409:  # raced a renewal: take the fresh one
        lease = api.get("leases", "capture-c1")
        lease["spec"]["holderIdentity"] = "intruder"
        status, body = api.req("PUT", api.path("leases", "capture-c1"), lease)
    assert status == 200, body
    assert agent.wait(3) == 3
    fenced = [line for line in agent.logs() if line["msg"].startswith("fenced itself")]
    assert fenced
    assert "intruder" in fenced[0]["reason"]


def test_fences_itself_when_its_lease_is_deleted_and_does_not_create_it_again(
    api: Api, agents: Callable[..., AgentProc]
) -> None:
    """``kubectl delete lease capture-c1``: a Lease PUT to a missing name creates it, so a renewal without the
    uid would bring the Lease back under the same holder. The renewal carries the uid: 409, the Lease is gone
    (404), the capture fences itself (exit 3) and the Lease stays deleted."""
    api.changefeed()
    agent = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    status, body = api.req("DELETE", api.path("leases", "capture-c1"))
    assert status == 200, body
    assert agent.wait(5) == 3
    fenced = [line for line in agent.logs() if line["msg"].startswith("fenced itself")]
    assert fenced
    assert "deleted" in fenced[0]["reason"]
    status, body = api.req("GET", api.path("leases", "capture-c1"))
    assert status == 404, f"the Lease was created again: {body}"


def _states_written(server: ApiServerHandle, namespace: str, name: str) -> list[str | None]:
    """Every state the API stored for a Dispatcher, in order (from the server's event history)."""

    def read() -> list[str | None]:
        return [
            (e.obj.get("status") or {}).get("state")
            for e in server.store.history
            if e.obj.get("kind") == "Dispatcher"
            and e.obj["metadata"]["namespace"] == namespace
            and e.obj["metadata"]["name"] == name
        ]

    return server.call(read)


def test_a_dispatcher_working_within_the_report_interval_is_written_once(
    api: Api, agents: Callable[..., AgentProc], server: ApiServerHandle
) -> None:
    """Most dispatchers are Working within init_delay: the capture defers the Initializing write by up to
    report_interval, so their first placement costs it one status write, Pending -> Working. (One still
    Initializing after report_interval is reported as such: test_dispatcher_lifecycle.)"""
    api.changefeed()
    agents("c1", "--report-interval", "3", "--init-delay", "0.2")
    wait_for(lambda: api.get("leases", "capture-c1"), what="Lease")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    time.sleep(0.5)
    assert _states_written(server, api.ns, "d1") == [None, "Working"]


def test_a_pass_visits_what_changed_and_a_full_pass_everything(api: Api, server: ApiServerHandle) -> None:
    """The agent in-process, its loop driven by hand: once its dispatchers are settled (Working, written), a
    pass between full passes steps no dispatcher and looks at none but those whose objects changed; a full
    pass (every report_interval) looks at all of them again."""
    from controller.capture.agent import Agent, Settings
    from controller.kube.client import Config

    api.changefeed()
    names = [f"d{i}" for i in range(20)]
    for i, name in enumerate(names):
        api.dispatcher(name, "c1", table_id=i + 1)

    async def scenario() -> None:
        settings = Settings(name="c1", namespace=api.ns, report_interval=600.0, init_delay=0.0)
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            agent = Agent(client, settings)
            rec = agent.reconciler
            looked: list[str] = []
            stepped: list[str] = []
            quiet, step = rec._quiet, rec._step

            def counting_quiet(run: Any, raw: JSON, now: float) -> bool:
                looked.append(raw["metadata"]["name"])
                return quiet(run, raw, now)

            async def counting_step(d: Dispatcher, raw: JSON, epochs: Any) -> None:
                stepped.append(d.name)
                await step(d, raw, epochs)

            rec._quiet = counting_quiet  # type: ignore[method-assign]
            rec._step = counting_step  # type: ignore[method-assign]
            assert await agent._register()
            tasks = [asyncio.create_task(agent.dispatchers.run()), asyncio.create_task(agent.captures.run())]
            try:
                await agent.dispatchers.synced.wait()
                await agent.captures.synced.wait()
                for _ in range(100):
                    await rec.reconcile()
                    if all(r.settled for r in agent.runs.values()) and len(agent.runs) == len(names):
                        break
                    await asyncio.sleep(0.05)
                assert len(agent.runs) == len(names)
                await asyncio.sleep(0.3)  # the watch delivers the Working writes (they mark their names dirty)
                await rec.reconcile()
                looked.clear()
                stepped.clear()
                await rec.reconcile()
                assert (looked, stepped) == ([], [])  # settled: nothing to look at

                api.patch("dispatchers", "d7", {"metadata": {"annotations": {"touched": "yes"}}})
                for _ in range(100):
                    if agent.dispatchers.dirty:
                        break
                    await asyncio.sleep(0.02)
                await rec.reconcile()
                assert (looked, stepped) == (["d7"], [])  # looked at, found quiet

                rec.full_at = -1e9  # the full pass is due
                looked.clear()
                await rec.reconcile()
                assert sorted(looked) == sorted(names)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_resume_check_slower_than_the_renew_deadline_still_resumes(api: Api, server: ApiServerHandle) -> None:
    """Found at 16,000 dispatchers on an overloaded machine: the LIST of a paused capture's Dispatchers took
    longer than the renew deadline, the check was cut short every time, and the capture stayed paused for
    good. The check now reads beside the renewals; a renewal that lands meanwhile vouches for the result.
    (The agent in-process, its Dispatcher LIST made slower than the renew deadline while it is paused.)"""
    from controller.capture.agent import Agent, Settings
    from controller.capture.reconciler import DISPATCHERS
    from controller.kube.client import Config

    api.changefeed()
    api.dispatcher("d1", "c1")
    settings = Settings(
        name="c1",
        namespace=api.ns,
        lease_duration=3,
        renew_interval=0.3,
        renew_deadline=1.5,
        report_interval=0.3,
        init_delay=0.0,
        tick=0.1,
    )

    async def scenario() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            agent = Agent(client, settings)
            slow_lists: list[float] = []
            plain_list = client.list

            async def list_slowly(res: Any, namespace: str, *args: Any, **kw: Any) -> Any:
                if res is DISPATCHERS and agent.keeper.paused_at is not None:
                    started = time.monotonic()
                    await asyncio.sleep(2.5)  # beyond the 1.5 s renew deadline
                    out = await plain_list(res, namespace, *args, **kw)
                    slow_lists.append(time.monotonic() - started)
                    return out
                return await plain_list(res, namespace, *args, **kw)

            client.list = list_slowly  # type: ignore[method-assign]
            running = asyncio.create_task(agent.run())
            try:
                for _ in range(200):
                    if api.state("d1") == "Working":
                        break
                    await asyncio.sleep(0.05)
                assert api.state("d1") == "Working"
                server.inject_failures("leases", 10_000)
                for _ in range(100):
                    if agent.keeper.paused_at is not None:
                        break
                    await asyncio.sleep(0.05)
                assert agent.keeper.paused_at is not None, "did not pause"
                server.inject_failures("leases", 0)
                for _ in range(200):
                    if agent.keeper.paused_at is None:
                        break
                    await asyncio.sleep(0.05)
                still = f"still paused after the renewals came back (slow lists {slow_lists})"
                assert agent.keeper.paused_at is None, still
                assert slow_lists, "the resume check did not read the Dispatchers"
                assert min(slow_lists) > settings.renew_deadline
                assert "d1" in agent.runs
                assert not agent.keeper.fence_reason
            finally:
                agent.stop.set()
                await asyncio.wait_for(running, 10)

    asyncio.run(scenario())


def test_a_resume_check_that_fails_for_a_bug_fences_the_capture(api: Api, server: ApiServerHandle) -> None:
    """The resume check runs in a task of its own; a bug in it must not leave the capture paused and silent
    (a background task that ends fences the agent, and so does this one)."""
    from controller.capture.agent import Agent, Settings
    from controller.kube.client import Config

    async def scenario() -> None:
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            agent = Agent(client, Settings(name="c1", namespace=api.ns))  # never started: only the check runs

            async def broken(pause: float) -> None:
                raise KeyError("d1")

            agent.reconciler.resume_plan = broken  # type: ignore[assignment,method-assign]
            await agent.keeper._check_resume(1.0)
            assert agent.keeper.fence_reason == "internal error: the resume check failed (KeyError('d1'))"
            assert agent.stop.is_set()

    asyncio.run(scenario())


def _capture_status_writes(server: ApiServerHandle, namespace: str, name: str) -> int:
    """How many times the API stored a Capture whose status differs from the one before (registration aside)."""

    def read() -> int:
        seen = [
            e.obj.get("status")
            for e in server.store.history
            if e.obj.get("kind") == "Capture"
            and e.obj["metadata"]["namespace"] == namespace
            and e.obj["metadata"]["name"] == name
        ]
        return sum(1 for a, b in itertools.pairwise(seen) if a != b and b)

    return int(server.call(read))


def test_the_capture_status_is_written_at_most_once_a_report_interval_while_its_count_moves(
    api: Api, agents: Callable[..., AgentProc], server: ApiServerHandle
) -> None:
    """Measured at 10,000 spans: the Capture status (a dispatcher count, for humans) was written on nearly every
    pass while dispatchers were placed, a quarter of an API request per placement. Dispatchers arriving one
    by one now move it at most once per report interval, and the last count is written all the same."""
    api.changefeed()
    agents("c1", "--report-interval", "1.5", "--init-delay", "0")
    wait_for(lambda: ((api.get("captures", "c1") or {}).get("status") or {}).get("dispatchers") == 0, what="registered")
    began = time.monotonic()
    for i in range(24):
        api.dispatcher(f"d{i}", "c1", table_id=i + 1)
        time.sleep(0.15)
    wait_for(lambda: api.get("captures", "c1")["status"]["dispatchers"] == 24, what="the final count")
    elapsed = time.monotonic() - began
    writes = _capture_status_writes(server, api.ns, "c1")
    assert 1 <= writes <= 2 + elapsed / 1.5, (writes, elapsed)


def test_a_burst_of_events_is_taken_by_one_pass_not_a_pass_each(api: Api, server: ApiServerHandle) -> None:
    """Measured at 10,000 spans: each capture ran about 30 passes a second while dispatchers were placed, each
    with its own strong read of the changefeed's epoch (a quarter of an API request per placement). The loop
    now starts a pass at most every PASS_MIN_INTERVAL, however often events wake it. (The agent in-process,
    its pass replaced by a counter, woken every few milliseconds.)"""
    from controller.capture.agent import Agent, Settings
    from controller.capture.reconciler import PASS_MIN_INTERVAL
    from controller.kube.client import Config

    async def scenario() -> None:
        settings = Settings(name="c1", namespace=api.ns, tick=1.0)
        async with Client(Config.load(str(server.kubeconfig_path))) as client:
            agent = Agent(client, settings)
            passes: list[float] = []

            async def counting_pass() -> None:
                passes.append(time.monotonic())

            agent.reconciler.reconcile = counting_pass  # type: ignore[method-assign]
            agent.dispatchers.synced.set()
            agent.captures.synced.set()

            async def events() -> None:
                while True:
                    agent.wake.set()
                    await asyncio.sleep(0.003)

            waker = asyncio.create_task(events())
            loop = asyncio.create_task(agent.reconciler.run(agent.wake, took_over_foreign=False))
            began = time.monotonic()
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - began
            for task in (waker, loop):
                task.cancel()
            await asyncio.gather(waker, loop, return_exceptions=True)
            assert len(passes) >= 2  # it did run, woken by the events
            assert len(passes) <= 2 + elapsed / PASS_MIN_INTERVAL, len(passes)
            gaps = [b - a for a, b in itertools.pairwise(passes)]
            assert min(gaps) >= PASS_MIN_INTERVAL * 0.9

    asyncio.run(scenario())
