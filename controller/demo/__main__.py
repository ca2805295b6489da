"""``python -m controller.demo``: run the maintainer and three captures, apply the examples, show progress.

With no kubeconfig or context it serves an embedded Kubernetes API in this process (kubectl works
against it: the kubeconfig path is printed); with ``--kubeconfig``/``--context`` it uses that cluster
(the CRDs are created if missing). The maintainer and every capture run as real subprocesses, the way
they run in pods. ``--scenario failover`` then holds a Move, a Split and a Merge in flight with the
capture hooks, SIGKILLs the maintainer, starts a new one, releases the hooks and shows every operator
finish with its original intent.
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
             "--identity", name, "--metrics-port", "0", "--log-format", self.log_format],
        )  # fmt: skip
        return name

    def start_captures(self) -> None:
        for c in self.capture_names:
            self._spawn(
                c,
                ["-m", "controller.capture", "--name", c, "--namespace", self.namespace,
                 "--kubeconfig", self.kubeconfig, "--log-format", self.log_format, "--test-hooks"],
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
    applied = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
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


async def watch_until(client: Client, ns: str, done: Any, within: float, every: float = 1.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        snap = await snapshot(client, ns)
        print(time.strftime("%H:%M:%S"), progress_line(snap), flush=True)
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


async def failover(client: Client, system: System, ns: str, maintainer: str) -> str:
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

    await watch_until(client, ns, held, 30)
    print(f"SIGKILL {maintainer} with three operators in flight", flush=True)
    system.kill(maintainer)
    new = system.start_maintainer()
    print(f"started {new}; releasing the hooks", flush=True)
    await asyncio.sleep(3)
    for c in system.capture_names:
        await set_hook(client, ns, c, HOLD_CLOSE, None)
    ok = await watch_until(client, ns, settled, 90)
    snap = await snapshot(client, ns)
    for o in snap[Kind.OPERATOR]:
        if o["metadata"]["name"] in dict(ops):
            st = o.get("status", {})
            print(f"  {o['metadata']['name']}: {st.get('phase')} {st.get('reason', '')} targets="
                  f"{[(t.get('span'), t.get('capture')) for t in st.get('targets', [])]}", flush=True)  # fmt: skip
    print("recovered: every operator finished" if ok else "NOT settled in time", flush=True)
    return new


async def run(a: argparse.Namespace) -> int:
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
    try:
        if handle is None:
            await ensure_crds(client)
        maintainer = system.start_maintainer()
        system.start_captures()
        print(f"maintainer and {a.captures} captures started; logs in {log_dir}/", flush=True)
        await apply_file(client, a.namespace, ROOT / "examples" / "changefeed.yaml")
        await apply_file(client, a.namespace, ROOT / "examples" / "tables.yaml")
        ok = await watch_until(client, a.namespace, all_replicating, a.timeout)
        print("all spans Replicating" if ok else "spans not all Replicating in time", flush=True)
        if ok and a.scenario == "failover":
            maintainer = await failover(client, system, a.namespace, maintainer)
        if a.duration:
            await watch_until(client, a.namespace, lambda _: False, a.duration, every=2.0)
        return 0 if ok else 1
    finally:
        await client.close()
        system.stop()
        if handle is not None:
            handle.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="changefeed-demo", description=__doc__)
    p.add_argument("--kubeconfig", help="use this cluster instead of the embedded API")
    p.add_argument("--context", help="use this kubeconfig context instead of the embedded API")
    p.add_argument("--namespace", default="default")
    p.add_argument("--captures", type=int, default=3)
    p.add_argument("--scenario", choices=["none", "failover"], default="none")
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
