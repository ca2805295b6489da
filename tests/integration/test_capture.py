"""The capture agent as a real process against the embedded API server.

No maintainer exists here: each test plays the maintainer by writing Changefeed, Table and Dispatcher
objects directly and reads back what the agent wrote. Intervals are shortened through the CLI flags
(lease 3 s, renew (and report progress) every 0.3 s, fence after 1.5 s, re-send every 0.3 s, loop tick 0.1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from controller.capture.informer import Informer
from controller.capture.ledger import Required, check, read
from controller.capture.runtime import LogicalClockRuntime, physical_ms
from controller.kube.client import JSON, RESOURCES, ApiError, Client, Resource
from controller.model.keys import KeyRange
from controller.model.progress import PROGRESS_ANNOTATION, digest
from controller.model.records import Dispatcher
from controller.model.states import Kind, Mode

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
    def __init__(self, api: Api, name: str, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        args = [sys.executable, "-m", "controller.capture", "--name", name, "--namespace", api.ns]
        args += ["--kubeconfig", str(api.handle.kubeconfig_path), *FAST, *extra]
        with log_path.open("ab") as err:
            self.proc = subprocess.Popen(args, cwd=ROOT, stderr=err, env={**os.environ, **(env or {})})

    def logs(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

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
    status, body = Api(server, ns).req("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    assert status == 201, body
    api = Api(server, ns)
    yield api
    server.inject_failures("leases", 0)
    api.pool.clear()


@pytest.fixture
def agents(api: Api, tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    started: list[AgentProc] = []

    def start(name: str, *extra: str, env: dict[str, str] | None = None) -> AgentProc:
        proc = AgentProc(api, name, tmp_path / f"{name}-{len(started)}.log", *extra, env=env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


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
    assert rt.close("d") >= cp
    with pytest.raises(KeyError):
        rt.checkpoint("d")


class FakeClient:
    """list/watch only: the first watch ends with a 410 ERROR event, the second one raises 410 Gone."""

    def __init__(self) -> None:
        self.lists = 0
        self.watches: list[str] = []

    async def list(self, res: Resource, namespace: str, label_selector: str = "") -> tuple[list[JSON], str]:
        self.lists += 1
        return [{"metadata": {"name": f"d{self.lists}", "resourceVersion": "5"}}], "10"

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
    async def scenario() -> tuple[FakeClient, Informer]:
        fake = FakeClient()
        informer = Informer(cast(Client, fake), RESOURCES[Kind.DISPATCHER], "ns", backoff=0.01)
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
    wait_for(lambda: api.get("leases", "capture-c1")["spec"]["renewTime"] != last, 3.0, "renewal after restart")
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


def test_scoped_hooks_hold_close_and_pause_create(api: Api, agents: Callable[..., AgentProc]) -> None:
    api.changefeed()
    agents("c1")
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


def test_sigterm_stops_dispatchers_and_releases_lease(api: Api, agents: Callable[..., AgentProc]) -> None:
    api.changefeed()
    agent = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait(5) == 0
    assert api.state("d1") == "Stopped"
    spec = api.get("leases", "capture-c1")["spec"]
    assert spec.get("holderIdentity", "") == ""  # released, not left to expire
    assert spec["leaseDurationSeconds"] == 1


def test_fences_itself_when_the_lease_cannot_be_renewed(
    api: Api, agents: Callable[..., AgentProc], server: ApiServerHandle
) -> None:
    api.changefeed()
    agent = agents("c1")
    api.dispatcher("d1", "c1")
    wait_for(working(api, "d1"), what="Working")
    server.inject_failures("leases", 10_000)
    started = time.monotonic()
    assert agent.wait(5) == 3
    assert time.monotonic() - started < 3.0  # well inside the 3 s lease
    fenced = [line for line in agent.logs() if line["msg"].startswith("fenced itself")]
    assert fenced
    assert "could not renew" in fenced[0]["reason"]
    assert "d1" in fenced[0]["stopped"]


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


def test_fences_itself_when_the_api_server_is_gone(tmp_path: Path) -> None:
    """Connection refused (not an API error status) counts as a failed renewal too."""
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
        assert agent.wait(5) == 3
    finally:
        agent.stop()
    fenced = [line for line in agent.logs() if line["msg"].startswith("fenced itself")]
    assert fenced
    assert "d1" in fenced[0]["stopped"]
