"""The embedded API can send no BOOKMARK at all (``bookmark_interval=None``, ``--no-bookmarks``).

A real kube-apiserver promises none: clients must not assume them at any interval, or at all, and its watch
cache sends none for a kind it has seen no event for (issue 36). The recorded server's BOOKMARK before a
timeout (``watch-bookmark-before-timeout``) and its initial-events-end one for a watch without a
resourceVersion are what it did, not what it must do; with ``sendInitialEvents=true`` the initial-events-end
BOOKMARK is part of the protocol and stays.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3

from controller.apiserver import ApiServerHandle, start_server

ROOT = Path(__file__).resolve().parents[2]
LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


@pytest.fixture(scope="module")
def quiet() -> Iterator[ApiServerHandle]:
    handle = start_server(ROOT / "crds", bookmark_interval=None)
    try:
        yield handle
    finally:
        handle.stop()


def watch(url: str, **params: str) -> list[dict[str, Any]]:
    """Every event of a watch the server ends (its ``timeoutSeconds``)."""
    query = urlencode({"watch": "true", "allowWatchBookmarks": "true", **params})
    r = urllib3.PoolManager().request("GET", f"{url}{LEASES}?{query}", preload_content=True, timeout=30)
    assert r.status == 200, r.data
    return [json.loads(line) for line in r.data.splitlines() if line.strip()]


def rv(url: str) -> str:
    r = urllib3.PoolManager().request("GET", f"{url}{LEASES}")
    return str(json.loads(r.data)["metadata"]["resourceVersion"])


def test_no_bookmark_before_the_timeout_nor_for_a_watch_without_a_resource_version(quiet: ApiServerHandle) -> None:
    assert watch(quiet.url, resourceVersion=rv(quiet.url), timeoutSeconds="3") == []  # closed by the server
    assert watch(quiet.url, timeoutSeconds="1") == []


def test_the_initial_events_end_bookmark_that_send_initial_events_requires_stays(quiet: ApiServerHandle) -> None:
    events = watch(quiet.url, sendInitialEvents="true", resourceVersionMatch="NotOlderThan", timeoutSeconds="3")
    assert [e["type"] for e in events] == ["BOOKMARK"]
    assert events[0]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_the_default_still_sends_them() -> None:
    handle = start_server(ROOT / "crds", bookmark_interval=0.3)
    try:
        events = watch(handle.url, resourceVersion=rv(handle.url), timeoutSeconds="2")
        assert events
        assert {e["type"] for e in events} == {"BOOKMARK"}
    finally:
        handle.stop()


def test_the_command_line_sends_none_with_no_bookmarks(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.apiserver", "--port", "0", "--no-bookmarks", "--bookmark-interval", "0.2",
         "--kubeconfig", str(tmp_path / "kubeconfig")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), url
        assert watch(url, resourceVersion=rv(url), timeoutSeconds="2") == []
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
