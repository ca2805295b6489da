"""The maintainer and the captures started as the chart's pods start them, under the chart's RBAC.

What broke on a real cluster, reproduced without one:

- the image's user (uid 65532: no passwd entry, no USER) crashed Kopf's identity detection at startup
  (``as_image_user.py`` makes the same facts true in the process);
- Kopf listed namespaces and watched CRDs cluster-wide, 403 forever under the chart's namespaced Roles
  (the embedded API enforces the Roles rendered by ``helm template`` for the service-account tokens);
- nothing told Kubernetes when a maintainer was ready, so ``helm install --wait`` meant nothing.

The container arguments come from the rendered Deployment and StatefulSet (only ports are changed, so
that several processes share this host), and ``examples/`` is applied as a user would.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml

from controller.apiserver import ApiServerHandle, start_server
from controller.apiserver.authz import Rbac
from tests.integration.harness import CRD_DIR, ROOT, Api, Proc, embedded_api

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("CFM_TEST_KUBECONFIG")), reason="embedded API only: it enforces the chart's RBAC itself"
)

RELEASE = "cfm"
CAPTURES = 2
LAUNCHER = str(ROOT / "tests" / "integration" / "as_image_user.py")


def helm() -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "fetch-helm.py")], check=True, capture_output=True, text=True
    )
    return out.stdout.strip().splitlines()[-1]


def render(namespace: str, *sets: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [
            helm(),
            "template",
            RELEASE,
            str(ROOT / "charts" / "changefeed-maintainer"),
            "--namespace",
            namespace,
            "--set",
            f"capture.replicas={CAPTURES}",
            *(arg for value in sets for arg in ("--set", value)),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if isinstance(d, dict)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def pod_args(doc: dict[str, Any], pod: str, namespace: str) -> tuple[list[str], dict[str, int]]:
    """The container's command line for one pod (downward-API variables filled in, every endpoint moved to a
    free port on loopback), and the ports chosen by flag name."""
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["python", "-m"], container["command"]
    args: list[str] = [container["command"][2]]
    ports: dict[str, int] = {}
    for arg in container["args"]:
        arg = arg.replace("$(POD_NAMESPACE)", namespace).replace("$(POD_NAME)", pod)
        flag, _, value = arg.partition("=")
        if flag in ("--liveness", "--readiness"):
            ports[flag] = free_port()
            path = value.split("/", 3)[3]
            arg = f"{flag}=http://127.0.0.1:{ports[flag]}/{path}"
        elif flag == "--metrics-port":
            ports[flag] = free_port()
            arg = f"{flag}={ports[flag]}"
        args.append(arg)
    return args, ports


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServerHandle, Api, Rbac, list[dict[str, Any]]]]:
    namespace = f"cfm-pods-{uuid.uuid4().hex[:6]}"
    # Two maintainer replicas, as the test starts: the chart gives them the sharded cache.
    docs = render(namespace, "maintainer.replicas=2")
    rbac = Rbac()
    rbac.load(docs)
    for doc in docs:
        if doc["kind"] == "ServiceAccount":
            name = doc["metadata"]["name"]
            rbac.add_service_account(f"token-{name}", namespace, name)
    handle = start_server(CRD_DIR, bookmark_interval=0.5, rbac=rbac)
    try:
        api = embedded_api(handle.url, handle.kubeconfig_path, namespace)
        api.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        yield handle, api, rbac, docs
    finally:
        handle.stop()


def kubeconfig_for(handle: ApiServerHandle, token: str, path: Path) -> Path:
    config = yaml.safe_load(handle.kubeconfig_path.read_text())
    config["users"][0]["user"]["token"] = token
    path.write_text(yaml.safe_dump(config))
    return path


def start(name: str, args: list[str], kubeconfig: Path, pod: str, logs: Path) -> Proc:
    env = {**os.environ, "POD_NAME": pod, "POD_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    log = logs / f"{name}.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [sys.executable, LAUNCHER, *args, "--kubeconfig", str(kubeconfig)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
    return Proc(name, popen, log)


def probe(port: int) -> tuple[int, str]:
    try:
        r = urllib3.request("GET", f"http://127.0.0.1:{port}/readyz", timeout=2.0, retries=False)
    except urllib3.exceptions.HTTPError as exc:
        return 0, repr(exc)
    return r.status, r.data.decode()


def wait_for(what: str, cond: Any, procs: list[Proc], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if result:
            return result
        dead = [f"{p.name} exited {p.popen.returncode}:\n{p.tail()}" for p in procs if not p.alive()]
        assert not dead, "\n".join(dead)
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.2)


def kill_all(procs: list[Proc]) -> None:
    """SIGKILL every process group started and reap them (whatever the test did)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, 9)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10)


def apply_examples(api: Api) -> None:
    for file in ("changefeed.yaml", "tables.yaml"):
        for doc in yaml.safe_load_all((ROOT / "examples" / file).read_text()):
            plural = {"Changefeed": "changefeeds", "Table": "tables"}[doc["kind"]]
            doc["metadata"].pop("namespace", None)
            api.ok("POST", api.path(plural), doc)


def test_pods_start_ready_and_need_no_more_than_the_chart_grants(
    cluster: tuple[ApiServerHandle, Api, Rbac, list[dict[str, Any]]], tmp_path: Path
) -> None:
    handle, api, rbac, docs = cluster
    deployment, statefulset = workload(docs, "Deployment"), workload(docs, "StatefulSet")
    tokens = {doc["spec"]["template"]["spec"]["serviceAccountName"] for doc in (deployment, statefulset)}
    assert len(tokens) == 2, "the maintainer and the captures run under service accounts of their own"
    procs: list[Proc] = []
    ready_ports: dict[str, int] = {}
    try:
        # Two maintainer replicas (one leads the changefeed, the other stands by) and the capture pods.
        for i in range(2):
            pod = f"{RELEASE}-maintainer-{i}"
            args, ports = pod_args(deployment, pod, api.namespace)
            sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            kc = kubeconfig_for(handle, f"token-{sa}", tmp_path / f"maintainer-{i}.kubeconfig")
            procs.append(start(pod, args, kc, pod, tmp_path))
            ready_ports[pod] = ports["--readiness"]
        sts = statefulset["metadata"]["name"]
        for i in range(CAPTURES):
            pod = f"{sts}-{i}"
            args, ports = pod_args(statefulset, pod, api.namespace)
            sa = statefulset["spec"]["template"]["spec"]["serviceAccountName"]
            kc = kubeconfig_for(handle, f"token-{sa}", tmp_path / f"{pod}.kubeconfig")
            procs.append(start(pod, args, kc, pod, tmp_path))
            ready_ports[pod] = ports["--readiness"]

        def all_ready() -> bool:
            return all(probe(port)[0] == 200 for port in ready_ports.values())

        assert "--cache=sharded" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        wait_for("every pod ready with no changefeed yet", all_ready, procs)
        apply_examples(api)
        # A Table applied without the changefeed label: its leader labels it (under the chart's Role).
        plain = {"apiVersion": "cdc.maintainer.dev/v1alpha1", "kind": "Table", "metadata": {"name": "plain"}}
        api.ok("POST", api.path("tables"), {**plain, "spec": {"changefeed": "demo", "tableID": 120}})

        def replicating() -> bool:
            spans = api.list("spans")
            states = [(s.get("status") or {}).get("state") for s in spans]
            tables = api.list("tables")
            return len(tables) == 4 and len(spans) >= 4 and all(state == "Replicating" for state in states)

        wait_for("every span of examples/ and of the plain Table Replicating", replicating, procs, timeout=90)
        labels = (api.get("tables", "plain") or {}).get("metadata", {}).get("labels") or {}
        assert labels.get("cdc.maintainer.dev/changefeed") == "demo"
        wait_for("every pod ready again", all_ready, procs)
        answers = {pod: probe(port)[1] for pod, port in ready_ports.items()}
        maintainers = [a for pod, a in answers.items() if pod.startswith(f"{RELEASE}-maintainer-")]
        assert sorted(m.split(", ")[-1].strip() for m in maintainers) == ["leading 0", "leading 1"], answers

        assert rbac.denied() == [], "requests the chart's Roles do not allow"
        assert {user for user, _, _ in rbac.decisions} == {
            f"system:serviceaccount:{api.namespace}:{sa}" for sa in tokens
        }
        for proc in procs:
            text = proc.log.read_text(errors="replace")
            for needle in ("Forbidden", " 403", "Traceback", "KeyError"):
                assert needle not in text, f"{proc.name} logged {needle!r}:\n{proc.tail(60)}"
    finally:
        kill_all(procs)


def test_the_chart_rbac_is_enforced(cluster: tuple[ApiServerHandle, Api, Rbac, list[dict[str, Any]]]) -> None:
    """The control: what the Roles do not grant is refused, with the real server's 403."""
    handle, api, rbac, docs = cluster
    sa = workload(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    token = {"Authorization": f"Bearer token-{sa}"}
    pool = urllib3.PoolManager()
    r = pool.request("GET", f"{handle.url}/api/v1/namespaces", headers=token)
    assert r.status == 403
    body = json.loads(r.data)
    user = f"system:serviceaccount:{api.namespace}:{sa}"
    assert body["reason"] == "Forbidden"
    assert body["message"] == (
        f'namespaces is forbidden: User "{user}" cannot list resource "namespaces" in API group "" at the cluster scope'
    )
    # The maintainer may create Spans but not write Dispatcher status (the captures' job) ...
    r = pool.request("GET", f"{handle.url}{api.path('spans')}", headers=token)
    assert r.status == 200
    r = pool.request(
        "PATCH",
        f"{handle.url}{api.path('dispatchers', 'd', 'status')}",
        body=b"{}",
        headers={**token, "Content-Type": "application/merge-patch+json"},
    )
    assert r.status == 403
    assert json.loads(r.data)["message"].startswith(f'dispatchers.cdc.maintainer.dev "d" is forbidden: User "{user}"')
    # ... and discovery is open to every authenticated user.
    assert pool.request("GET", f"{handle.url}/apis", headers=token).status == 200
    assert rbac.denied()


def test_test_hooks_are_off_unless_the_chart_turns_them_on() -> None:
    """The failpoint annotations freeze dispatcher closes: production captures do not honour them."""

    def capture_args(*sets: str) -> list[str]:
        sts = next(d for d in render("ns", *sets) if d["kind"] == "StatefulSet")
        return list(sts["spec"]["template"]["spec"]["containers"][0]["args"])

    assert "--test-hooks" not in capture_args()
    assert "--test-hooks" in capture_args("capture.testHooks=true")


def test_kubectl_scale_of_the_captures_works_up_to_max_replicas(tmp_path: Path) -> None:
    """Issue 24, item 2: `kubectl scale statefulset` to one more capture (within capture.maxReplicas): the new pod
    may renew its Lease under the chart's Role, joins and gets spans. One more than maxReplicas: refused before it
    registers, exit 1, with a message that says what to change; the Role grants it nothing else."""
    namespace = f"cfm-scale-{uuid.uuid4().hex[:6]}"
    docs = render(namespace, f"capture.maxReplicas={CAPTURES + 1}")
    rbac = Rbac()
    rbac.load(docs)
    for doc in docs:
        if doc["kind"] == "ServiceAccount":
            rbac.add_service_account(f"token-{doc['metadata']['name']}", namespace, doc["metadata"]["name"])
    handle = start_server(CRD_DIR, bookmark_interval=0.5, rbac=rbac)
    procs: list[Proc] = []
    try:
        api = embedded_api(handle.url, handle.kubeconfig_path, namespace)
        api.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        deployment, statefulset = workload(docs, "Deployment"), workload(docs, "StatefulSet")
        sts = statefulset["metadata"]["name"]

        def pod(kind_doc: dict[str, Any], name: str) -> Proc:
            args, _ = pod_args(kind_doc, name, namespace)
            sa = kind_doc["spec"]["template"]["spec"]["serviceAccountName"]
            kc = kubeconfig_for(handle, f"token-{sa}", tmp_path / f"{name}.kubeconfig")
            return start(name, args, kc, name, tmp_path)

        procs.append(pod(deployment, f"{RELEASE}-maintainer-0"))
        procs += [pod(statefulset, f"{sts}-{i}") for i in range(CAPTURES)]
        apply_examples(api)

        def replicating_on(capture: str | None = None) -> bool:
            spans = api.list("spans")
            states = [(s.get("status") or {}) for s in spans]
            if not spans or any(s.get("state") != "Replicating" for s in states):
                return False
            return capture is None or any(s.get("capture") == capture for s in states)

        wait_for("examples/ Replicating", replicating_on, procs, timeout=90)

        # kubectl scale statefulset ... --replicas=3: pod -2 starts under the same Role.
        third = f"{sts}-{CAPTURES}"
        procs.append(pod(statefulset, third))
        wait_for(
            "the new capture's Lease renewed",
            lambda: any((lease.get("spec") or {}).get("holderIdentity") == third for lease in api.list("leases")),
            procs,
        )
        table = {"apiVersion": "cdc.maintainer.dev/v1alpha1", "kind": "Table", "metadata": {"name": "scaled"}}
        api.ok("POST", api.path("tables"), {**table, "spec": {"changefeed": "demo", "tableID": 900}})
        wait_for(f"a span Replicating on {third}", lambda: replicating_on(third), procs, timeout=60)
        assert rbac.denied() == [], "the scaled-out capture needed more than the chart grants"

        # One beyond capture.maxReplicas: refused, exit 1, and it says how to fix it.
        beyond = pod(statefulset, f"{sts}-{CAPTURES + 1}")
        deadline = time.monotonic() + 30
        while beyond.popen.poll() is None:
            assert time.monotonic() < deadline, f"the capture beyond maxReplicas still runs:\n{beyond.tail()}"
            time.sleep(0.2)
        assert beyond.popen.returncode == 1, beyond.tail()
        assert "capture.maxReplicas" in beyond.log.read_text(), beyond.tail()
        denied = rbac.denied()
        assert denied
        assert all(f"capture-{sts}-{CAPTURES + 1}" in str(d) for d in denied), denied
        assert not [c for c in api.list("captures") if c["metadata"]["name"] == f"{sts}-{CAPTURES + 1}"]
    finally:
        kill_all(procs)
        handle.stop()
