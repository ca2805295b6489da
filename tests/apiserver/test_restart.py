"""The embedded API's watch cache window, and its restart in place (``ApiServerHandle.restart``).

A real kube-apiserver serves watches from its watch cache, which begins at the resourceVersion current when it
starts: a watch resumed from an older one gets HTTP 200, one ``ERROR`` event ``410 Expired`` with the message
``too old resource version: X (Y)`` (Y the cache's start, the real cache's ``oldest - 1``), and the end of the
stream (the recorded probes ``watch-too-old-rv*``). After a restart over the same etcd the objects and the
resourceVersions are the same, but the cache starts again, so every watch resumed from before the restart gets
that 410 and its client relists. LISTs are served from storage and see no difference.

Each test runs against a server of its own (a restart would disturb the shared one of ``conftest.py``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3

from controller.apiserver import ApiServerHandle, start_server
from controller.apiserver.store import RV_BASE

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
CM = "/api/v1/namespaces/default/configmaps"
SPANS = "/apis/cdc.maintainer.dev/v1alpha1/namespaces/default/spans"

Event = dict[str, Any]


@pytest.fixture
def server() -> Iterator[ApiServerHandle]:
    handle = start_server(CRD_DIR, bookmark_interval=3600)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def pool() -> Iterator[urllib3.PoolManager]:
    pool = urllib3.PoolManager(retries=False)
    try:
        yield pool
    finally:
        pool.clear()


def create(pool: urllib3.PoolManager, server: ApiServerHandle, name: str, path: str = CM) -> dict[str, Any]:
    if path == CM:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}
    else:
        spec = {"changefeed": "cf", "tableID": 1, "startKey": "00", "endKey": "ff"}
        body = {"apiVersion": "cdc.maintainer.dev/v1alpha1", "kind": "Span", "metadata": {"name": name}, "spec": spec}
    r = pool.request(
        "POST", server.url + path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    assert r.status == 201, r.data
    out: dict[str, Any] = json.loads(r.data)
    return out


def listing(pool: urllib3.PoolManager, server: ApiServerHandle, path: str = CM) -> dict[str, Any]:
    r = pool.request("GET", server.url + path)
    assert r.status == 200, r.data
    out: dict[str, Any] = json.loads(r.data)
    return out


def watch(
    server: ApiServerHandle, path: str, rv: str, *, until: int = 100, idle: float = 5.0
) -> tuple[int, list[Event], bool]:
    """(HTTP status, events, whether the server ended the stream) of a watch from ``rv``, read until ``until``
    events, the end of the stream, or ``idle`` seconds of silence."""
    pool = urllib3.PoolManager(retries=False)
    query = urlencode({"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true"})
    r = pool.request(
        "GET", f"{server.url}{path}?{query}", preload_content=False, timeout=urllib3.Timeout(connect=10, read=idle)
    )
    events: list[Event] = []
    closed = False
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
        else:
            closed = True
    except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError):
        pass
    finally:
        r.release_conn()
        pool.clear()
    return r.status, events, closed


def assert_expired(status: int, events: list[Event], closed: bool, since: int, start: int) -> None:
    """The recorded answer: 200, one ERROR 410 Expired event with the real message, the stream closed."""
    assert status == 200
    assert closed, "the server keeps the stream open after the ERROR event"
    assert [e["type"] for e in events] == ["ERROR"], events
    obj = events[0]["object"]
    assert obj["kind"] == "Status"
    assert obj["status"] == "Failure"
    assert obj["code"] == 410
    assert obj["reason"] == "Expired"
    assert obj["message"] == f"too old resource version: {since} ({start})"


def rv_of(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


# -- the window -----------------------------------------------------------------------------------------------


def test_a_watch_from_before_the_window_of_a_fresh_server_gets_410(server: ApiServerHandle) -> None:
    """A fresh server's cache starts at its first resourceVersion (as the probe ``watch-too-old-rv``: from 1)."""
    assert_expired(*watch(server, CM, "1"), since=1, start=RV_BASE)
    status, events, closed = watch(server, CM, str(RV_BASE), idle=1.0)
    assert status == 200
    assert not closed
    assert all(e["type"] != "ERROR" for e in events), events


def test_a_custom_resources_window_starts_when_its_crd_is_established(server: ApiServerHandle) -> None:
    """Each kind has its own watch cache; a CRD's starts when it is established (the recorded probes got
    different starts for widgets and dispatchers): watching Spans from before their CRD is a 410, watching
    ConfigMaps from the same resourceVersion is not."""
    start = server.call(lambda: server.store.kind_cache_start[("cdc.maintainer.dev", "spans")])
    assert start > RV_BASE
    assert_expired(*watch(server, SPANS, str(start - 1)), since=start - 1, start=start)
    status, events, closed = watch(server, CM, str(start - 1), idle=1.0)
    assert (status, closed) == (200, False)
    assert all(e["type"] != "ERROR" for e in events), events
    status, events, closed = watch(server, SPANS, str(start), idle=1.0)
    assert (status, closed) == (200, False)
    assert events == []


def test_the_window_of_a_compacted_history_starts_at_the_compaction() -> None:
    """With the history bounded, the oldest resourceVersion a watch resumes from is the last compacted one:
    from it, every event after it is replayed; from one before, 410 naming it."""
    handle = start_server(None, bookmark_interval=3600, history_size=5)
    pool = urllib3.PoolManager(retries=False)
    try:
        created = [create(pool, handle, f"c{i}") for i in range(8)]
        compacted = handle.call(lambda: handle.store.compacted_rv)
        assert compacted > RV_BASE
        assert_expired(*watch(handle, CM, str(compacted - 1)), since=compacted - 1, start=compacted)
        status, events, closed = watch(handle, CM, str(compacted), until=5, idle=2.0)
        assert (status, closed) == (200, False)
        assert [rv_of(e["object"]) for e in events] == [rv_of(c) for c in created if rv_of(c) > compacted]
    finally:
        pool.clear()
        handle.stop()


# -- restarts -------------------------------------------------------------------------------------------------


def test_a_watch_resumed_from_before_a_restart_gets_410_and_one_from_after_works(
    server: ApiServerHandle, pool: urllib3.PoolManager
) -> None:
    before = create(pool, server, "before")
    create(pool, server, "last")
    at_restart = server.call(lambda: server.store.rv)
    server.restart(0.5)
    # From the resourceVersion of "before": the events after it are not replayed, the watch is expired.
    assert_expired(*watch(server, CM, str(rv_of(before))), since=rv_of(before), start=at_restart)
    # From the cache's start (the last resourceVersion before the restart): served, and later events arrive.
    result: list[tuple[int, list[Event], bool]] = []
    thread = threading.Thread(target=lambda: result.append(watch(server, CM, str(at_restart), until=1)))
    thread.start()
    time.sleep(0.5)
    after = create(pool, server, "after")
    thread.join(timeout=15)
    status, events, _ = result[0]
    assert status == 200
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "after")]
    # From after the restart: replayed from the history as before.
    status, events, closed = watch(server, CM, str(at_restart), until=1, idle=2.0)
    assert (status, closed) == (200, False)
    assert [rv_of(e["object"]) for e in events] == [rv_of(after)]
    # From 0 (the current state): the objects as ADDED, no ERROR.
    status, events, _ = watch(server, CM, "0", until=3, idle=2.0)
    assert {e["object"]["metadata"]["name"] for e in events} == {"before", "last", "after"}


def test_a_list_after_a_restart_returns_the_same_objects(server: ApiServerHandle, pool: urllib3.PoolManager) -> None:
    create(pool, server, "a")
    create(pool, server, "b", SPANS)
    before = listing(pool, server)
    spans = listing(pool, server, SPANS)
    server.restart(0.2)
    after = listing(pool, server)
    assert after["items"] == before["items"]
    assert int(after["metadata"]["resourceVersion"]) >= int(before["metadata"]["resourceVersion"])
    assert listing(pool, server, SPANS)["items"] == spans["items"]
    # A consistent list at a resourceVersion from before the restart is still served (from storage).
    exact = {"resourceVersion": before["metadata"]["resourceVersion"], "resourceVersionMatch": "Exact"}
    r = pool.request("GET", server.url + CM + "?" + urlencode(exact))
    assert r.status == 200, r.data
    assert json.loads(r.data)["items"] == before["items"]
    # New writes continue the same resourceVersion sequence.
    assert rv_of(create(pool, server, "c")) == int(after["metadata"]["resourceVersion"]) + 1


def test_a_restart_drops_open_watches_and_refuses_connections_during_the_outage(
    server: ApiServerHandle, pool: urllib3.PoolManager
) -> None:
    result: list[tuple[int, list[Event], bool]] = []
    thread = threading.Thread(target=lambda: result.append(watch(server, CM, "0", idle=20)))
    thread.start()
    deadline = time.monotonic() + 10
    while server.call(lambda: sum(len(w) for w in server.store.watchers.values())) == 0:
        assert time.monotonic() < deadline, "the watch did not start"
        time.sleep(0.05)
    started = time.monotonic()
    future = server.restart(2.0, wait=False)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 5, "the open watch was not ended by the restart"
    with pytest.raises(urllib3.exceptions.HTTPError):
        pool.request("GET", server.url + "/version", timeout=2)
    future.result(timeout=15)
    assert pool.request("GET", server.url + "/version").status == 200
    assert time.monotonic() - started >= 2.0


def test_a_restart_through_the_admin_endpoint(server: ApiServerHandle, pool: urllib3.PoolManager) -> None:
    """``POST /_admin/restart`` (for a server run as a process: ``python -m controller.apiserver``)."""
    first = create(pool, server, "first")
    r = pool.request("POST", server.url + "/_admin/restart", body=b'{"outageSeconds": 0.3}')
    assert r.status == 200, r.data
    assert json.loads(r.data) == {"restarting": True, "outageSeconds": 0.3}
    deadline = time.monotonic() + 15
    while True:
        try:
            stats = json.loads(pool.request("GET", server.url + "/_admin/stats", timeout=2).data)
            if stats["restarts"] == 1:
                break
        except urllib3.exceptions.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come back"
        time.sleep(0.1)
    assert stats["watchCacheStart"] == stats["resourceVersion"] == rv_of(first)
    assert_expired(*watch(server, CM, str(rv_of(first) - 1)), since=rv_of(first) - 1, start=rv_of(first))
