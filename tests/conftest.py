"""Test-suite wiring: opt-in markers for the layers that need a cluster.

- ``e2e``: runs only with ``--with-e2e`` (a kind cluster; see tests/e2e).
- ``cluster``: runs only when ``CFM_TEST_KUBECONFIG`` names a kubeconfig.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# No timing in tests: Hypothesis's deadline and its "input generation is slow" health check measure
# wall time, which a loaded 2-core CI machine makes meaningless. Examples stay deterministic per run.
settings.register_profile("cfm", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cfm")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--with-e2e", action="store_true", default=False, help="run the e2e tests (kind cluster)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    with_e2e = config.getoption("--with-e2e")
    with_cluster = bool(os.environ.get("CFM_TEST_KUBECONFIG"))
    for item in items:
        if "e2e" in item.keywords and not with_e2e:
            item.add_marker(pytest.mark.skip(reason="e2e: opt in with --with-e2e"))
        if "cluster" in item.keywords and not with_cluster:
            item.add_marker(pytest.mark.skip(reason="cluster: set CFM_TEST_KUBECONFIG"))
