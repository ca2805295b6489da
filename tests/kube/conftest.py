"""Fixtures shared by the tests of ``controller.kube`` against the embedded API server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.apiserver import ApiServerHandle, start_server

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="module")
def api_server() -> Iterator[ApiServerHandle]:
    """An embedded API server with the project's CRDs, one per test module."""
    handle = start_server(CRDS)
    try:
        yield handle
    finally:
        handle.stop()
