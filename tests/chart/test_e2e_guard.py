"""The e2e context guard (tests/e2e/guard.py), without a cluster: only kind contexts or $CFM_E2E_CONTEXT.

It lives here, not in tests/e2e, because tests/conftest.py skips everything under tests/e2e without --with-e2e.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.guard import ContextRefused, check_context, current_context

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters:
- name: prod
  cluster: {server: "https://prod.example.invalid:6443"}
users:
- name: admin
  user: {token: not-a-real-token}
contexts:
- name: prod-eu-1
  context: {cluster: prod, user: admin}
- name: kind-cfm
  context: {cluster: prod, user: admin}
current-context: prod-eu-1
"""


def test_kind_context_is_accepted() -> None:
    assert check_context("kind-cfm", allowed="") == "kind-cfm"


@pytest.mark.parametrize("context", ["prod-eu-1", "gke_project_zone_cluster", "minikube", "kind", "my-kind-cfm"])
def test_other_contexts_are_refused(context: str) -> None:
    with pytest.raises(ContextRefused, match=rf"refusing to run the e2e suite against kube context '{context}'"):
        check_context(context, allowed="")


def test_explicit_opt_in_names_exactly_one_context() -> None:
    assert check_context("staging-throwaway", allowed="staging-throwaway") == "staging-throwaway"
    with pytest.raises(ContextRefused, match="CFM_E2E_CONTEXT=staging"):
        check_context("staging", allowed="staging-throwaway")


def test_opt_in_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFM_E2E_CONTEXT", "ci-cluster")
    assert check_context("ci-cluster") == "ci-cluster"
    monkeypatch.delenv("CFM_E2E_CONTEXT")
    with pytest.raises(ContextRefused):
        check_context("ci-cluster")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_current_context_of_a_non_kind_kubeconfig_is_refused(tmp_path: Path) -> None:
    """End to end through kubectl: a kubeconfig whose current context is not kind's is refused."""
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    context = current_context(str(path))
    assert context == "prod-eu-1"
    with pytest.raises(ContextRefused, match="prod-eu-1"):
        check_context(context, allowed="")
