"""``python -m controller.demo``: run the maintainer and three captures, apply the examples, show progress.

With no kubeconfig or context it serves an embedded Kubernetes API in this process (kubectl works
against it: the kubeconfig path is printed); with ``--kubeconfig``/``--context`` it uses that cluster
(the CRDs are created if missing). The maintainer and every capture run as real subprocesses, the way
they run in pods.

By default (``--source etcd``) the changefeed replicates real data: a real etcd and a real PostgreSQL start
on loopback from the pinned wheels (``controller.demo.servers``; stopped and removed at the end,
whatever happens), the Changefeed names them through two Secrets, and a writer puts, overwrites and deletes
rows of the three example tables at ``--rate`` changes a second throughout. Each progress line shows the
rows downstream, the source's head and the checkpoint revision, and the lag in seconds. ``--source none``
runs the logical-clock runtime instead (it replicates nothing).

``--scenario failover`` then holds a Move, a Split and a Merge in flight with the capture hooks, SIGKILLs the
maintainer, starts a new one, releases the hooks and shows every operator finish with its original intent.
With a source, the writer is then stopped, the checkpoint awaited past its last revision, and
``kubectl changefeed verify`` compares etcd with PostgreSQL row by row: the demo's exit code is verify's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from controller import logs
from controller.kube.client import RESOURCES, ApiError, Client, Config, Resource
from controller.model.progress import PROGRESS_ANNOTATION, HeadCurve, ProgressEntry
from controller.model.resources import progress_from_json
from controller.model.states import Kind

ROOT = Path(__file__).resolve().parents[2]
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition")
HOLD_CLOSE = "cdc.maintainer.dev/hold-close"
PAUSE_CREATE = "cdc.maintainer.dev/pause-create"


class System:
    """The processes of one run, and the client to look at them."""

    def __init__(self, kubeconfig: str, namespace: str, captures: int, log_dir: Path, log_format: str = "json") -> None:
        self.kubeconfig = kubeconfig
        #: ``--log-format`` of every process it starts.
        self.log_format = log_format
        self.namespace = namespace
        self.capture_names = [f"capture-{i}" for i in range(captures)]
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.maintainers = 0
        #: More flags for every maintainer it starts (a benchmark's Lease duration, say).
        self.maintainer_args: list[str] = []

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )

    def start_maintainer(self) -> str:
        self.maintainers += 1
        name = f"maintainer-{self.maintainers}"
        self._spawn(
            name,
            ["-m", "controller.maintainer", "--namespace", self.namespace, "--kubeconfig", self.kubeconfig,
             "--identity", name, "--metrics-port", "0", "--log-format", self.log_format, *self.maintainer_args],
        )  # fmt: skip
        return name

    def start_captures(self, extra: list[str] | None = None) -> None:
        for c in self.capture_names:
            self._spawn(
                c,
                ["-m", "controller.capture", "--name", c, "--namespace", self.namespace,
                 "--kubeconfig", self.kubeconfig, "--log-format", self.log_format, "--test-hooks", *(extra or [])],
            )  # fmt: skip

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)


async def apply_file(client: Client, namespace: str, path: Path) -> list[dict[str, Any]]:
    return await apply_docs(client, namespace, [doc for doc in yaml.safe_load_all(path.read_text()) if doc])


async def apply_docs(client: Client, namespace: str, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    applied = []
    for doc in docs:
        kind = Kind(doc["kind"])
        doc.setdefault("metadata", {})["namespace"] = namespace
        try:
            applied.append(await client.create(RESOURCES[kind], namespace, doc))
        except ApiError as exc:
            if not exc.already_exists:
                raise
    return applied


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


async def ensure_crds(client: Client, timeout: float = 60.0) -> None:  # noqa: ASYNC109 - a budget for the wait
    """Create the CRDs that are missing, then wait until every one is Established: an API server serves a
    CRD's resources only from then on (404 before), a moment after the create."""
    names = []
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        names.append(body["metadata"]["name"])
        try:
            await client.request("create", "POST", CRD_PATH, body=body)
        except ApiError as exc:
            if not exc.already_exists:
                raise
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            crd = await client.request("get", "GET", f"{CRD_PATH}/{name}")
            conditions = (crd.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established after {timeout:.0f}s")
            await asyncio.sleep(0.2)


async def snapshot(client: Client, ns: str) -> dict[Kind, list[dict[str, Any]]]:
    kinds = (Kind.CHANGEFEED, Kind.SPAN, Kind.DISPATCHER, Kind.OPERATOR)
    lists = await asyncio.gather(*(client.list(RESOURCES[k], ns) for k in kinds))
    return {k: items for k, (items, _) in zip(kinds, lists, strict=True)}


async def leases(client: Client, ns: str) -> list[dict[str, Any]]:
    answer = await client.request("list", "GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases")
    items: list[dict[str, Any]] = answer.get("items") or []
    return items


class DataPlane:
    """The demo's real source and sink (the servers, the writer) and how to look at them."""

    TABLES = (101, 102, 103)  # examples/tables.yaml

    def __init__(self, rate: float, stack: contextlib.ExitStack, sink: str = "postgres") -> None:
        from controller.demo.mariadb import MariaDBServer
        from controller.demo.servers import EtcdServer, PostgresServer
        from controller.demo.writer import Writer

        server = "MariaDB (Debian's mariadb-server)" if sink == "mysql" else "PostgreSQL (from the pinned wheel)"
        print(f"starting etcd and {server} on loopback", flush=True)
        self.etcd = stack.enter_context(EtcdServer(progress_notify_interval=0.5))
        self.sink: PostgresServer | MariaDBServer = MariaDBServer() if sink == "mysql" else PostgresServer()
        stack.enter_context(self.sink)
        print(f"  etcd {self.etcd.client_url}, {self.sink.sink_kind} sink on 127.0.0.1:{self.sink.port}", flush=True)
        self.writer = Writer(self.etcd.host, self.etcd.port, self.TABLES, rate=rate, batch=20, keys=2_000)
        stack.callback(self.stop_writer)
        #: What the captures' reports said of the source's head so far (the lag of the changefeed's checkpoint).
        self.heads = HeadCurve()

    def stop_writer(self) -> int:
        if self.writer.running:
            self.writer.stop()
        return self.writer.last

    async def secrets(self, client: Client, ns: str) -> None:
        for name, data in (
            ("demo-source", {"endpoints": self.etcd.client_url}),
            ("demo-sink", {"dsn": self.sink.dsn}),
        ):
            body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
            try:
                await client.request("create", "POST", f"/api/v1/namespaces/{ns}/secrets", body=body)
            except ApiError as exc:
                if not exc.already_exists:
                    raise
                await client.request("replace", "PUT", f"/api/v1/namespaces/{ns}/secrets/{name}", body=body)

    async def downstream_rows(self) -> int:
        """Live rows in the sink's tables of changefeed demo (0 before the first commit)."""
        from controller.model.states import Mode
        from controller.sinks import kinds

        sink = kinds.from_secret(self.sink.sink_kind, "demo", {"dsn": self.sink.dsn})
        total = 0
        session = await sink.connect()
        try:
            for table_id in self.TABLES:
                try:
                    total += (await session.figures((table_id, Mode.DEFAULT))).live_rows or 0
                except sink.errors():
                    continue  # not created yet
        finally:
            await session.close()
        return total

    async def line(self, checkpoint: int, leases: list[dict[str, Any]]) -> str:
        """Rows written and downstream, the source's head, the lag (from the captures' progress reports)."""
        rows = await self.downstream_rows()
        entries: list[ProgressEntry] = []
        for lease in leases:
            report = progress_from_json(
                ((lease.get("metadata") or {}).get("annotations") or {}).get(PROGRESS_ANNOTATION)
            )
            if report is not None:
                entries.extend(e for e in report.entries if e.changefeed == "demo")
        self.heads.see_entries(entries)
        self.heads.forget_below(checkpoint)
        wall = self.heads.time_of(checkpoint)
        lag = "-" if wall is None else f"{max(0.0, time.time() - wall):.1f}s"
        return f"  data: written={self.writer.changes} head={self.writer.last} rows downstream={rows} lag={lag}"


def progress_line(snap: dict[Kind, list[dict[str, Any]]]) -> str:
    spans = Counter(s.get("status", {}).get("state", "New") for s in snap[Kind.SPAN])
    per_capture = Counter(
        d["spec"]["capture"] for d in snap[Kind.DISPATCHER] if d.get("status", {}).get("state") == "Working"
    )
    in_flight = [
        f"{o['spec']['type']}:{o.get('status', {}).get('stage') or 'Pending'}"
        for o in snap[Kind.OPERATOR]
        if o.get("status", {}).get("phase", "Pending") in ("Pending", "Running")
    ]
    cf = snap[Kind.CHANGEFEED][0].get("status", {}) if snap[Kind.CHANGEFEED] else {}
    return (
        f"epoch={cf.get('epoch', 0)} checkpoint={cf.get('checkpointTs', 0)} "
        f"spans={dict(sorted(spans.items()))} working/capture={dict(sorted(per_capture.items()))} "
        f"in-flight={sorted(Counter(in_flight).items())}"
    )


class Monitor:
    """Prints a progress line every ``every`` seconds (and the data plane's, when there is one) until done."""

    def __init__(self, client: Client, ns: str, data: DataPlane | None) -> None:
        self.client, self.ns, self.data = client, ns, data

    async def until(self, done: Any, within: float, every: float = 1.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            snap = await snapshot(self.client, self.ns)
            print(time.strftime("%H:%M:%S"), progress_line(snap), flush=True)
            if self.data is not None:
                cfs = snap[Kind.CHANGEFEED]
                checkpoint = int((cfs[0].get("status") or {}).get("checkpointTs") or 0) if cfs else 0
                print(await self.data.line(checkpoint, await leases(self.client, self.ns)), flush=True)
            if done(snap):
                return True
            await asyncio.sleep(every)
        return False


def all_replicating(snap: dict[Kind, list[dict[str, Any]]]) -> bool:
    spans = snap[Kind.SPAN]
    return bool(spans) and all(s.get("status", {}).get("state") == "Replicating" for s in spans)


def settled(snap: dict[Kind, list[dict[str, Any]]]) -> bool:
    ops = snap[Kind.OPERATOR]
    finished = all(o.get("status", {}).get("phase") not in (None, "Pending", "Running") for o in ops)
    return all_replicating(snap) and finished


async def set_hook(client: Client, ns: str, capture: str, hook: str, value: str | None) -> None:
    await client.patch(RESOURCES[Kind.CAPTURE], ns, capture, {"metadata": {"annotations": {hook: value}}})


async def failover(client: Client, system: System, ns: str, maintainer: str, monitor: Monitor) -> str:
    snap = await snapshot(client, ns)
    spans = sorted(
        (s for s in snap[Kind.SPAN] if s.get("status", {}).get("state") == "Replicating"),
        key=lambda s: (s["spec"]["tableID"], s["spec"]["startKey"]),
    )
    by_table: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        by_table.setdefault(s["spec"]["tableID"], []).append(s)
    multi = next(v for v in by_table.values() if len(v) >= 2)
    single = next(v[0] for v in by_table.values() if len(v) == 1)
    mover = multi[-1] if len(multi) > 2 else next(v[0] for v in by_table.values() if v[0] is not single)
    target = next(c for c in system.capture_names if c != mover["status"]["capture"])
    ops: list[tuple[str, dict[str, Any]]] = [
        ("demo-move", {"type": "Move", "spans": [mover["metadata"]["name"]], "target": target}),
        ("demo-split", {"type": "Split", "spans": [single["metadata"]["name"]], "splitInto": 3}),
        ("demo-merge", {"type": "Merge", "spans": [multi[0]["metadata"]["name"], multi[1]["metadata"]["name"]]}),
    ]
    print("holding closes on every capture, then applying a Move, a Split and a Merge", flush=True)
    for c in system.capture_names:
        await set_hook(client, ns, c, HOLD_CLOSE, "*")
    for name, spec in ops:
        body = {
            "apiVersion": "cdc.maintainer.dev/v1alpha1",
            "kind": "SpanOperator",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"changefeed": "demo", **spec},
        }
        await client.create(RESOURCES[Kind.OPERATOR], ns, body)

    def held(snap: dict[Kind, list[dict[str, Any]]]) -> bool:
        phases = {o["metadata"]["name"]: o.get("status", {}).get("stage") for o in snap[Kind.OPERATOR]}
        return all(phases.get(n) == "RemoveOrigin" for n, _ in ops)

    await monitor.until(held, 30)
    print(f"SIGKILL {maintainer} with three operators in flight", flush=True)
    system.kill(maintainer)
    new = system.start_maintainer()
    print(f"started {new}; releasing the hooks", flush=True)
    await asyncio.sleep(3)
    for c in system.capture_names:
        await set_hook(client, ns, c, HOLD_CLOSE, None)
    ok = await monitor.until(settled, 90)
    snap = await snapshot(client, ns)
    for o in snap[Kind.OPERATOR]:
        if o["metadata"]["name"] in dict(ops):
            st = o.get("status", {})
            print(f"  {o['metadata']['name']}: {st.get('phase')} {st.get('reason', '')} targets="
                  f"{[(t.get('span'), t.get('capture')) for t in st.get('targets', [])]}", flush=True)  # fmt: skip
    print("recovered: every operator finished" if ok else "NOT settled in time", flush=True)
    return new


async def run(a: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:  # the servers, whatever happens
        data = DataPlane(a.rate, stack, a.sink) if a.source == "etcd" else None
        return await run_system(a, data)


async def run_system(a: argparse.Namespace, data: DataPlane | None) -> int:
    handle = None
    kubeconfig = a.kubeconfig
    if not kubeconfig and not a.context:
        from controller.apiserver.server import start_server

        handle = start_server(ROOT / "crds", port=a.port)
        kubeconfig = str(handle.kubeconfig_path)
        print(f"embedded Kubernetes API at {handle.url}", flush=True)
        print(f"  kubectl --kubeconfig {kubeconfig} get cdc", flush=True)
    elif a.context and not kubeconfig:
        kubeconfig = os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config"))
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    client = Client(Config.load(kubeconfig, a.context))
    system = System(kubeconfig, a.namespace, a.captures, log_dir, a.log_format)
    monitor = Monitor(client, a.namespace, data)
    try:
        if handle is None:
            await ensure_crds(client)
        maintainer = system.start_maintainer()
        system.start_captures()
        print(f"maintainer and {a.captures} captures started; logs in {log_dir}/", flush=True)
        changefeed = yaml.safe_load((ROOT / "examples" / "changefeed.yaml").read_text())
        if data is not None:
            await data.secrets(client, a.namespace)
            changefeed["spec"]["source"] = {"etcd": {"secretRef": {"name": "demo-source"}}}
            changefeed["spec"]["sink"] = {data.sink.sink_kind: {"secretRef": {"name": "demo-sink"}}}
            data.writer.start()
            print(f"writer: {a.rate:.0f} puts, overwrites and deletes a second over tables {data.TABLES}", flush=True)
        await apply_docs(client, a.namespace, [changefeed])
        await apply_file(client, a.namespace, ROOT / "examples" / "tables.yaml")
        ok = await monitor.until(all_replicating, a.timeout)
        print("all spans Replicating" if ok else "spans not all Replicating in time", flush=True)
        if ok and a.scenario == "failover":
            maintainer = await failover(client, system, a.namespace, maintainer, monitor)
        if a.duration:
            await monitor.until(lambda _: False, a.duration, every=2.0)
        if ok and data is not None:
            ok = await verify(client, a.namespace, kubeconfig, data, monitor)
        return 0 if ok else 1
    finally:
        await client.close()
        system.stop()
        if handle is not None:
            handle.stop()


async def verify(client: Client, ns: str, kubeconfig: str, data: DataPlane, monitor: Monitor) -> bool:
    """Stop the writer, wait for the checkpoint to pass its last revision, and run ``kubectl changefeed
    verify`` (the plugin, as a person would): True when it found no difference."""
    last = data.stop_writer()
    print(f"writer stopped at revision {last} after {data.writer.changes} changes; waiting for the checkpoint",
          flush=True)  # fmt: skip

    def past(snap: dict[Kind, list[dict[str, Any]]]) -> bool:
        cfs = snap[Kind.CHANGEFEED]
        return bool(cfs) and int((cfs[0].get("status") or {}).get("checkpointTs") or 0) >= last

    if not await monitor.until(past, 60):
        print("the checkpoint did not pass the writer's last revision in time", flush=True)
        return False
    cmd = [sys.executable, "-m", "controller.cli", "--kubeconfig", kubeconfig, "-n", ns, "verify", "-c", "demo"]
    print("$ kubectl changefeed verify -c demo", flush=True)
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT)
    rc = await proc.wait()
    print("verify: 0 differences" if rc == 0 else f"verify failed (exit {rc})", flush=True)
    return rc == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="changefeed-demo", description=__doc__)
    p.add_argument("--kubeconfig", help="use this cluster instead of the embedded API")
    p.add_argument("--context", help="use this kubeconfig context instead of the embedded API")
    p.add_argument("--namespace", default="default")
    p.add_argument("--captures", type=int, default=3)
    p.add_argument("--scenario", choices=["none", "failover"], default="none")
    p.add_argument("--source", choices=["etcd", "none"], default="etcd",
                   help="etcd: replicate a real etcd into a real PostgreSQL (started on loopback); none: the logical "
                   "clock, which replicates nothing")  # fmt: skip
    p.add_argument("--sink", choices=["postgres", "mysql"], default="postgres",
                   help="with --source etcd: the sink, PostgreSQL (from the pinned wheel) or MariaDB (Debian's "
                   "mariadb-server), started on loopback")  # fmt: skip
    p.add_argument("--rate", type=float, default=200.0, help="the writer's changes a second (with --source etcd)")
    p.add_argument("--duration", type=float, default=0.0, help="keep running and printing this many seconds")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--port", type=int, default=0, help="port of the embedded API (0: any)")
    p.add_argument("--log-dir", default=".demo-logs", help="where the logs of the maintainer and captures go")
    logs.add_arguments(p)  # this process's own log (stderr), and --log-format of the processes it starts
    a = p.parse_args(argv)
    logs.setup(a.log_level, a.log_format)
    # The embedded API's celpy logs every CEL rule it transpiles at info (the generated Python): not for people.
    logging.getLogger("celpy").setLevel(logging.WARNING)
    try:
        return asyncio.run(run(a))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
