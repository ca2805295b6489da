"""Fixtures shared by the tests of ``controller.kube`` against the embedded API server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controller.apiserver import ApiServerHandle, start_server
from controller.kube.client import Client

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="module")
def api_server() -> Iterator[ApiServerHandle]:
    """An embedded API server with the project's CRDs, one per test module."""
    handle = start_server(CRDS)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServerHandle]:
    """An embedded API server with the project's CRDs that sends a bookmark every half second, one per test module
    (a module that needs other settings defines its own ``server``)."""
    handle = start_server(CRDS, bookmark_interval=0.5)
    try:
        yield handle
    finally:
        handle.stop()


async def until(cond: Callable[[], object], what: str, timeout: float = 30.0, every: float = 0.05) -> None:  # noqa: ASYNC109
    """Poll ``cond`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)


async def namespace(client: Client, prefix: str = "t") -> str:
    """A fresh namespace on the shared server (the tests' objects in it, apart from every other test's)."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    await client.request("create", "POST", "/api/v1/namespaces", body=body)
    return ns
