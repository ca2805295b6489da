"""The API under test: the embedded server by default, a real cluster when CFM_TEST_KUBECONFIG is set.

Either way the tests get a :class:`Kube` bound to a fresh namespace, with the CRDs of crds/ installed, and
talk plain HTTP through urllib3 (with the kubeconfig's TLS and credentials on a real cluster).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3
import yaml

from controller.apiserver import ApiServerHandle, start_server

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
GROUP = "cdc.maintainer.dev/v1alpha1"
HISTORY = 1000  # the embedded server's watch window, small so the 410 test is quick


@dataclass
class Resp:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Kube:
    host: str
    headers: dict[str, str]
    pool: urllib3.PoolManager
    namespace: str
    kubeconfig_path: Path
    embedded: ApiServerHandle | None = None

    def path(self, plural: str, name: str = "", *, group: str = GROUP, ns: str | None = "") -> str:
        prefix = f"/apis/{group}" if "/" in group else f"/api/{group}"
        namespace = self.namespace if ns == "" else ns
        base = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        return f"{base}/{name}" if name else base

    def req(self, method: str, path: str, body: Any = None, *, ct: str = "application/json", **params: Any) -> Resp:
        headers = dict(self.headers)
        data = None
        if body is not None:
            headers["Content-Type"] = ct
            data = json.dumps(body).encode()
        headers.setdefault("Accept", "application/json")
        query = {k: str(v) for k, v in params.items()}
        url = self.host + path + ("?" + urlencode(query) if query else "")
        r = self.pool.request(method, url, body=data, headers=headers, timeout=urllib3.Timeout(10, 30))
        text = r.data.decode()
        try:
            payload = json.loads(text) if text else None
        except ValueError:
            payload = text
        return Resp(r.status, payload, dict(r.headers))

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        resp = self.req(method, path, body, **kw)
        assert resp.status < 300, (resp.status, resp.body)
        return resp.body

    def watch(self, path: str, *, until: int = 1000, idle: float = 3.0, **params: Any) -> list[dict[str, Any]]:
        """Read watch events until ``until`` events arrived, the stream ended, or ``idle`` seconds of silence."""
        query = {"watch": "true", **{k: str(v) for k, v in params.items()}}
        r = self.pool.request(
            "GET",
            self.host + path + "?" + urlencode(query),
            headers=self.headers,
            preload_content=False,
            timeout=urllib3.Timeout(10, idle),
        )
        events: list[dict[str, Any]] = []
        buf = b""
        try:
            for chunk in r.stream(4096):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        events.append(json.loads(line))
                if len(events) >= until:
                    break
        except urllib3.exceptions.ReadTimeoutError:
            pass
        except urllib3.exceptions.ProtocolError:
            pass
        finally:
            r.close()  # drop the connection: a watch cannot be reused
            r.release_conn()
        return events

    def span(self, name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
        body = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff", **spec}
        meta: dict[str, Any] = {"name": name, "labels": labels} if labels else {"name": name}
        return {"apiVersion": GROUP, "kind": "Span", "metadata": meta, "spec": body}

    @staticmethod
    def obj(kind: str, metadata: dict[str, Any], api_version: str = GROUP, **fields: Any) -> dict[str, Any]:
        """A request body as a real client sends it: ``apiVersion`` and ``kind`` included (a real server refuses
        a create or update without them: ``Object 'Kind' is missing``)."""
        return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}


def _apply_crds(kube: Kube) -> None:
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        resp = kube.req("POST", base, crd)
        if resp.status == 409:
            current = kube.ok("GET", f"{base}/{crd['metadata']['name']}")
            crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            kube.ok("PUT", f"{base}/{crd['metadata']['name']}", crd)
        else:
            assert resp.status == 201, resp.body
    deadline = time.monotonic() + 60
    for path in sorted(CRD_DIR.glob("*.yaml")):
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        while True:
            crd = kube.ok("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conditions = (crd.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                break
            assert time.monotonic() < deadline, f"CRD {name} not established"
            time.sleep(0.2)


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    real = os.environ.get("CFM_TEST_KUBECONFIG")
    handle: ApiServerHandle | None = None
    if real:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=real, client_configuration=cfg)
        pool = urllib3.PoolManager(
            cert_reqs="CERT_REQUIRED" if cfg.verify_ssl else "CERT_NONE",
            ca_certs=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
        )
        headers = {}
        auth = cfg.get_api_key_with_prefix("authorization")
        if auth:
            headers["Authorization"] = auth
        host, kubeconfig_path = cfg.host, Path(real)
    else:
        handle = start_server(CRD_DIR, bookmark_interval=0.3, history_size=HISTORY)
        pool = urllib3.PoolManager()
        headers, host, kubeconfig_path = {}, handle.url, handle.kubeconfig_path
    namespace = f"cfm-test-{uuid.uuid4().hex[:8]}"
    kube = Kube(host, headers, pool, namespace, kubeconfig_path, handle)
    _apply_crds(kube)
    kube.ok("POST", "/api/v1/namespaces", Kube.obj("Namespace", {"name": namespace}, "v1"))
    try:
        yield kube
    finally:
        if handle is not None:
            handle.stop()
        else:
            kube.req("DELETE", f"/api/v1/namespaces/{namespace}")
            _release_finalizers(kube)
        pool.clear()


MERGE = "application/merge-patch+json"


def _release_finalizers(kube: Kube) -> None:
    """A real cluster's namespace waits for every finalizer; a test's (``cfm.test/hold``) or one that a process
    it killed left (Kopf's, the maintainer's) would hold it Terminating for ever. Nothing of the project runs in
    a test's namespace once its test ended, so the finalizers are taken off here."""
    for plural in ("changefeeds", "tables", "spans", "dispatchers", "spanoperators", "captures"):
        resp = kube.req("GET", kube.path(plural))
        for obj in (resp.body or {}).get("items") or [] if resp.status == 200 else []:
            if obj["metadata"].get("finalizers"):
                patch = {"metadata": {"finalizers": None}}
                kube.req("PATCH", kube.path(plural, obj["metadata"]["name"]), patch, ct=MERGE)


@pytest.fixture
def embedded(kube: Kube) -> ApiServerHandle:
    """The embedded server's handle; skips the test on a real cluster (fault injection has no equivalent)."""
    if kube.embedded is None:
        pytest.skip("fault injection exists only on the embedded server")
    return kube.embedded


@pytest.fixture
def name() -> str:
    return f"o-{uuid.uuid4().hex[:10]}"
