"""e2e fixtures: a kind cluster with the image loaded and the chart installed (``make e2e-kind`` does it all).

* Refuses any kube context that is not a kind one (``kind-*``) or ``$CFM_E2E_CONTEXT`` (tests/e2e/guard.py).
* ``CFM_E2E_INSTALL=1``: install the chart first (``helm upgrade --install --wait``; ``$HELM``,
  ``$CFM_E2E_IMAGE`` repository:tag). Otherwise the chart must already be installed in ``$CFM_E2E_NAMESPACE``
  (default ``cfm-e2e``) as release ``$CFM_E2E_RELEASE`` (default ``cfm``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.guard import ContextRefused, check_context, current_context
from tests.e2e.kube import Kube

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = os.environ.get("CFM_E2E_NAMESPACE", "cfm-e2e")
RELEASE = os.environ.get("CFM_E2E_RELEASE", "cfm")
IMAGE = os.environ.get("CFM_E2E_IMAGE", "changefeed-maintainer:e2e")


@pytest.fixture(scope="session")
def kube(pytestconfig: pytest.Config) -> Kube:
    if not pytestconfig.getoption("--with-e2e"):
        pytest.skip("e2e: opt in with --with-e2e")
    try:
        context = check_context(current_context())
    except ContextRefused as exc:
        pytest.exit(str(exc), returncode=2)  # refuse the whole run, before any request
    if os.environ.get("CFM_E2E_INSTALL") == "1":
        repo, _, tag = IMAGE.rpartition(":")
        helm = os.environ.get("HELM", str(ROOT / ".cache" / "bin" / "helm"))
        subprocess.run(
            [helm, "upgrade", "--install", RELEASE, str(ROOT / "charts" / "changefeed-maintainer"),
             "--kube-context", context, "--namespace", NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
             "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
             "--set", "capture.testHooks=true"],
            check=True,
        )  # fmt: skip
    k = Kube(context, NAMESPACE)
    if not k.items("deployments", f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=maintainer"):
        pytest.exit(f"no maintainer Deployment of release {RELEASE} in {NAMESPACE}: run `make install` "
                    "or set CFM_E2E_INSTALL=1", returncode=2)  # fmt: skip
    return k
