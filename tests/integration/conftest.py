"""Fixtures of the process-level tests: the API (embedded, or a real cluster), a namespace, the processes.

By default one embedded API server (``controller.apiserver.start_server``) serves a test module. When
``CFM_TEST_KUBECONFIG`` names a kubeconfig, the same tests run against that cluster instead: the CRDs of
crds/ are applied (or updated) once per module, and every test gets a fresh namespace, deleted afterwards
(then the plugin's forced teardown releases what the killed processes left, and the finalizers of the
test's own objects are stripped).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.cli.__main__ import main as cli_main
from tests.integration.harness import CRD_DIR, Api, System, apply_crds, cluster_api, embedded_api, release_everything


@dataclass
class Target:
    """Where the API is: an embedded server (``handle``) or a cluster (``kubeconfig``)."""

    handle: ApiServerHandle | None
    kubeconfig: Path

    def api(self, namespace: str) -> Api:
        if self.handle is not None:
            return embedded_api(self.handle.url, self.handle.kubeconfig_path, namespace, self.handle.ca_pem)
        return cluster_api(self.kubeconfig, namespace)


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """A module with ``EMBEDDED_TLS = True`` gets the embedded server over HTTPS, as a real cluster serves (a
    client's TLS connections close differently: issue 36). The embedded namespace controller takes its realistic
    moment (``NAMESPACE_DELAY``) everywhere."""
    real = os.environ.get("CFM_TEST_KUBECONFIG")
    if real:
        t = Target(None, Path(real))
        api = t.api("default")
        apply_crds(api)
        api.pool.clear()
        yield t
        return
    handle = start_server(CRD_DIR, bookmark_interval=0.5, tls=bool(getattr(request.module, "EMBEDDED_TLS", False)))
    try:
        yield Target(handle, handle.kubeconfig_path)
    finally:
        handle.stop()


@pytest.fixture
def api(target: Target) -> Iterator[Api]:
    namespace = f"cfm-it-{uuid.uuid4().hex[:8]}"
    api = target.api(namespace)
    api.ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    try:
        yield api
    finally:
        if target.handle is None:
            # The processes were SIGKILLed (the system fixture ends first): nobody honours a finalizer now. The
            # namespace goes, then the plugin's forced teardown releases what they left, as a person would
            # (docs/operations.md, "Deleting a namespace"); release_everything is the backstop for what no
            # Changefeed owns (a test's own objects).
            api.req("DELETE", f"/api/v1/namespaces/{namespace}")
            with contextlib.suppress(Exception):
                cli_main(
                    ["--kubeconfig", str(api.kubeconfig), "-n", namespace, "teardown", "--wait", "--timeout", "60"]
                )
            release_everything(api)
        api.pool.clear()


@pytest.fixture
def system(api: Api, tmp_path: Path) -> Iterator[System]:
    system = System(api, tmp_path)
    try:
        yield system
    finally:
        system.stop_all()
