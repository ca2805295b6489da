"""Fixtures shared by the tests of ``controller.kube`` against the embedded API server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
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
