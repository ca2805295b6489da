"""Conformance of the embedded API server with kube-apiserver, for everything this project relies on.

The same tests run against a real cluster when CFM_TEST_KUBECONFIG is set (see conftest.py); only the
fault-injection tests are skipped there.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3

from controller.apiserver import ApiServerHandle
from tests.apiserver.conftest import GROUP, HISTORY, ROOT, Kube

MERGE = "application/merge-patch+json"
CRD_BASE = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def _resources(kube: Kube, path: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in kube.ok("GET", path)["resources"]}


# -- discovery ---------------------------------------------------------------------------------------------


def test_discovery(kube: Kube) -> None:
    assert "v1" in kube.ok("GET", "/api")["versions"]
    groups = {g["name"] for g in kube.ok("GET", "/apis")["groups"]}
    assert {"cdc.maintainer.dev", "coordination.k8s.io", "events.k8s.io", "apiextensions.k8s.io"} <= groups
    core = _resources(kube, "/api/v1")
    assert core["namespaces"]["namespaced"] is False
    assert core["events"]["namespaced"] is True
    assert core["configmaps"]["kind"] == "ConfigMap"
    cdc = _resources(kube, f"/apis/{GROUP}")
    span = cdc["spans"]
    assert span["kind"] == "Span"
    assert span["singularName"] == "span"
    assert span["namespaced"] is True
    assert "cdcspan" in span["shortNames"]
    assert "cdc" in span["categories"]
    assert {"get", "list", "watch", "create", "update", "patch", "delete"} <= set(span["verbs"])
    assert "spans/status" in cdc
    assert "leases" in _resources(kube, "/apis/coordination.k8s.io/v1")
    assert "events" in _resources(kube, "/apis/events.k8s.io/v1")
    assert kube.req("GET", "/apis/nope.example.com/v1").status == 404


# -- create / get / metadata -------------------------------------------------------------------------------


def test_create_sets_server_metadata(kube: Kube, name: str) -> None:
    obj = kube.ok("POST", kube.path("spans"), kube.span(name))
    meta = obj["metadata"]
    assert meta["generation"] == 1
    assert meta["uid"]
    assert meta["namespace"] == kube.namespace
    assert int(meta["resourceVersion"]) > 0
    datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
    assert kube.ok("GET", kube.path("spans", name)) == obj


def test_generate_name(kube: Kube) -> None:
    body = kube.span("")
    body["metadata"] = {"generateName": "gen-"}
    obj = kube.ok("POST", kube.path("spans"), body)
    assert re.fullmatch(r"gen-[a-z0-9]{5}", obj["metadata"]["name"])


def test_already_exists_and_not_found(kube: Kube, name: str) -> None:
    kube.ok("POST", kube.path("spans"), kube.span(name))
    resp = kube.req("POST", kube.path("spans"), kube.span(name))
    assert resp.status == 409
    assert resp.body["reason"] == "AlreadyExists"
    assert resp.body["kind"] == "Status"
    assert resp.body["status"] == "Failure"
    assert resp.body["code"] == 409
    resp = kube.req("GET", kube.path("spans", name + "-missing"))
    assert resp.status == 404
    assert resp.body["reason"] == "NotFound"
    assert resp.body["details"]["name"] == name + "-missing"


def test_type_meta_is_required_for_custom_resources_only(kube: Kube, name: str) -> None:
    """A custom resource is decoded as unstructured: no kind, no create. A built-in kind's typed decoder takes
    apiVersion and kind from the URL (Kopf posts its Events that way)."""
    body = kube.span(name)
    del body["kind"], body["apiVersion"]
    resp = kube.req("POST", kube.path("spans"), body)
    assert resp.status == 400, resp.body
    assert resp.body["reason"] == "BadRequest"
    assert "Object 'Kind' is missing" in resp.body["message"]
    body = kube.span(name)
    body["apiVersion"] = f"{GROUP.split('/')[0]}/v9"
    assert kube.req("POST", kube.path("spans"), body).status == 400
    obj = kube.ok("POST", kube.path("configmaps", group="v1"), {"metadata": {"name": name}, "data": {"a": "1"}})
    assert (obj["apiVersion"], obj["kind"]) == ("v1", "ConfigMap")


def test_create_ignores_status_with_status_subresource(kube: Kube, name: str) -> None:
    body = kube.span(name)
    body["status"] = {"state": "Replicating"}
    assert "status" not in kube.ok("POST", kube.path("spans"), body)


# -- schema: pruning, defaults, validation, CEL ------------------------------------------------------------


def test_pruning_and_defaults(kube: Kube, name: str) -> None:
    body = kube.span(name, undeclared="x")
    obj = kube.ok("POST", kube.path("spans"), body)
    assert "undeclared" not in obj["spec"]
    assert obj["spec"]["mode"] == "default"
    obj = kube.ok(
        "PATCH", kube.path("spans", name) + "/status", {"status": {"state": "Scheduling", "progress": 3}}, ct=MERGE
    )
    assert obj["status"] == {"state": "Scheduling"}  # the undeclared status field vanished
    cap = kube.ok("POST", kube.path("captures"), kube.obj("Capture", {"name": name}))
    assert cap["spec"] == {}


def test_nested_defaults(kube: Kube, name: str) -> None:
    obj = kube.ok("POST", kube.path("changefeeds"), kube.obj("Changefeed", {"name": name}, spec={}))
    # Nested defaults: the scheduler object is defaulted, then its fields (a check on the text of the whole
    # object for "400" used to fail whenever a uid contained those digits).
    assert obj["spec"]["scheduler"]["maxInFlightOperators"] == 10000
    assert obj["spec"]["scheduler"]["balanceIntervalSeconds"] == 15


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"tableID": "one"}, "spec.tableID"),
        ({"tableID": -1}, "spec.tableID"),
        ({"mode": "sideways"}, "spec.mode"),
        ({"startKey": "zz"}, "spec.startKey"),
        ({"changefeed": "x" * 300}, "spec.changefeed"),
    ],
)
def test_schema_validation(kube: Kube, name: str, spec: dict[str, Any], field: str) -> None:
    resp = kube.req("POST", kube.path("spans"), kube.span(name, **spec))
    assert resp.status == 422, resp.body
    assert resp.body["reason"] == "Invalid"
    assert field in resp.body["message"]
    assert any(c.get("field") == field for c in resp.body["details"]["causes"])


def test_changefeed_name_longer_than_a_label_value_is_refused(kube: Kube, name: str) -> None:
    """The Changefeed CRD restricts metadata.name to 63 characters (its objects carry it in a label value): a
    real server validates metadata.name against a CRD's schema like any field, and so must the double."""
    long_name = (name + "-" + "x" * 64)[:64]
    body = kube.obj("Changefeed", {"name": long_name}, spec={})
    resp = kube.req("POST", kube.path("changefeeds"), body)
    assert resp.status == 422, resp.body
    assert resp.body["reason"] == "Invalid"
    assert {
        "field": "metadata.name",
        "reason": "FieldValueTooLong",
        "message": "Too long: may not be more than 63 bytes",
    } in (resp.body["details"]["causes"])
    ok = kube.ok("POST", kube.path("changefeeds"), kube.obj("Changefeed", {"name": long_name[:63]}, spec={}))
    assert ok["metadata"]["name"] == long_name[:63]
    # Other kinds keep the API's own limit (253): a Span may be named longer.
    assert kube.ok("POST", kube.path("spans"), kube.span(long_name))["metadata"]["name"] == long_name


def test_required_and_max_items(kube: Kube, name: str) -> None:
    body = kube.span(name)
    del body["spec"]["changefeed"]
    resp = kube.req("POST", kube.path("spans"), body)
    assert resp.status == 422
    assert "spec.changefeed: Required value" in resp.body["message"]
    assert {"field": "spec.changefeed", "reason": "FieldValueRequired", "message": "Required value"} in (
        resp.body["details"]["causes"]
    )
    # spec.spans holds Span names (strings, maxItems 128), as probe val-sop-max-items sends them. Items of
    # another type would be refused each on its own (so the maxItems cause would not be what fails the request),
    # and a real server prunes an object's keys under a string schema with one "unknown field" Warning header
    # per key: ~4 kB of them, over 100 headers, more than http.client reads.
    names = [f"s{i:03d}" for i in range(129)]

    def merge(spans: list[str], op_name: str) -> dict[str, Any]:
        return kube.obj("SpanOperator", {"name": op_name}, spec={"changefeed": "cf", "type": "Merge", "spans": spans})

    resp = kube.req("POST", kube.path("spanoperators"), merge(names, name))
    assert resp.status == 422, resp.body
    assert not [h for h in resp.headers if h.lower() == "warning"]  # the body is well-typed: nothing pruned
    causes = resp.body["details"]["causes"]
    assert causes[0] == {
        "field": "spec.spans",
        "reason": "FieldValueTooMany",
        "message": "Too many: 129: must have at most 128 items",
    }
    assert not [c for c in causes if c["field"].startswith("spec.spans[")]  # no item was refused on its own
    obj = kube.ok("POST", kube.path("spanoperators"), merge(names[:128], f"{name}-max"))  # maxItems itself is fine
    assert obj["spec"]["spans"] == names[:128]


def test_cel_rules(kube: Kube, name: str) -> None:
    resp = kube.req("POST", kube.path("spans"), kube.span(name, startKey="ff", endKey="00"))
    assert resp.status == 422
    assert "startKey must be below endKey" in resp.body["message"]
    kube.ok("POST", kube.path("spans"), kube.span(name))
    resp = kube.req("PATCH", kube.path("spans", name), {"spec": {"tableID": 2}}, ct=MERGE)
    assert resp.status == 422
    assert "tableID is immutable" in resp.body["message"]
    kube.ok("PATCH", kube.path("spans", name), {"spec": {"startTs": 7}}, ct=MERGE)  # a mutable field
    op = kube.obj("SpanOperator", {"name": name}, spec={"changefeed": "cf", "type": "Move", "spans": ["a"]})
    resp = kube.req("POST", kube.path("spanoperators"), op)
    assert resp.status == 422
    assert "Add and Move need a target capture" in resp.body["message"]


# -- updates, status subresource, generation, conflicts ----------------------------------------------------


def test_status_subresource_and_generation(kube: Kube, name: str) -> None:
    kube.ok("POST", kube.path("spans"), kube.span(name))
    obj = kube.ok(
        "PATCH",
        kube.path("spans", name) + "/status",
        {"status": {"state": "Replicating"}, "spec": {"startTs": 9}, "metadata": {"labels": {"a": "b"}}},
        ct=MERGE,
    )
    assert obj["status"]["state"] == "Replicating"
    assert "startTs" not in obj["spec"]
    assert obj["metadata"]["generation"] == 1
    assert "labels" not in obj["metadata"]
    obj = kube.ok("PATCH", kube.path("spans", name), {"spec": {"startTs": 9}, "status": {"state": "Absent"}}, ct=MERGE)
    assert obj["spec"]["startTs"] == 9
    assert obj["status"]["state"] == "Replicating"
    assert obj["metadata"]["generation"] == 2
    obj = kube.ok("PATCH", kube.path("spans", name), {"metadata": {"labels": {"a": "b"}}}, ct=MERGE)
    assert obj["metadata"]["generation"] == 2
    obj["status"] = {"state": "Removing"}
    obj = kube.ok("PUT", kube.path("spans", name) + "/status", obj)
    assert obj["status"]["state"] == "Removing"
    assert obj["metadata"]["generation"] == 2
    assert kube.ok("GET", kube.path("spans", name) + "/status")["status"]["state"] == "Removing"


def test_stale_resource_version_conflicts(kube: Kube, name: str) -> None:
    obj = kube.ok("POST", kube.path("spans"), kube.span(name))
    stale = obj["metadata"]["resourceVersion"]
    obj["spec"]["startTs"] = 1
    obj = kube.ok("PUT", kube.path("spans", name), obj)
    assert int(obj["metadata"]["resourceVersion"]) > int(stale)
    obj["metadata"]["resourceVersion"] = stale
    resp = kube.req("PUT", kube.path("spans", name), obj)
    assert resp.status == 409
    assert resp.body["reason"] == "Conflict"
    assert "the object has been modified" in resp.body["message"]
    resp = kube.req("PATCH", kube.path("spans", name), {"metadata": {"resourceVersion": stale}}, ct=MERGE)
    assert resp.status == 409
    resp = kube.req(
        "PATCH",
        kube.path("spans", name) + "/status",
        {"metadata": {"resourceVersion": stale}, "status": {"state": "Absent"}},
        ct=MERGE,
    )
    assert resp.status == 409
    # A custom resource (unlike a ConfigMap) has no unconditional update: a PUT must carry a resourceVersion.
    del obj["metadata"]["resourceVersion"]
    obj["spec"]["startTs"] = 2
    resp = kube.req("PUT", kube.path("spans", name), obj)
    assert resp.status == 422, resp.body
    assert resp.body["details"]["causes"][0]["field"] == "metadata.resourceVersion"
    assert "must be specified for an update" in resp.body["message"]
    cm = kube.ok(
        "POST", kube.path("configmaps", group="v1"), kube.obj("ConfigMap", {"name": name}, "v1", data={"a": "1"})
    )
    del cm["metadata"]["resourceVersion"]
    cm["data"] = {"a": "2"}
    assert kube.ok("PUT", kube.path("configmaps", name, group="v1"), cm)["data"] == {"a": "2"}


def test_json_patch_and_strategic_merge(kube: Kube, name: str) -> None:
    kube.ok("POST", kube.path("spans"), kube.span(name))
    ops = [{"op": "add", "path": "/spec/startTs", "value": 5}, {"op": "add", "path": "/metadata/labels", "value": {}}]
    obj = kube.ok("PATCH", kube.path("spans", name), ops, ct="application/json-patch+json")
    assert obj["spec"]["startTs"] == 5
    bad = [{"op": "test", "path": "/spec/startTs", "value": 6}]
    assert kube.req("PATCH", kube.path("spans", name), bad, ct="application/json-patch+json").status == 422
    cm = kube.obj("ConfigMap", {"name": name}, "v1", data={"a": "1", "b": "2"})
    kube.ok("POST", kube.path("configmaps", group="v1"), cm)
    smp = {"data": {"b": None, "c": "3"}}
    obj = kube.ok("PATCH", kube.path("configmaps", name, group="v1"), smp, ct="application/strategic-merge-patch+json")
    assert obj["data"] == {"a": "1", "c": "3"}


def test_noop_update_keeps_resource_version(kube: Kube, name: str) -> None:
    obj = kube.ok("POST", kube.path("spans"), kube.span(name))
    again = kube.ok("PATCH", kube.path("spans", name), {"spec": {"tableID": 1}}, ct=MERGE)
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


# -- lists and selectors ------------------------------------------------------------------------------------


def test_selectors(kube: Kube) -> None:
    run = uuid.uuid4().hex[:8]
    labels = {"a": {"run": run, "tier": "x"}, "b": {"run": run, "tier": "y"}, "c": {"run": run}}
    for suffix, lab in labels.items():
        body = kube.obj("ConfigMap", {"name": f"sel-{run}-{suffix}", "labels": lab}, "v1", data={})
        kube.ok("POST", kube.path("configmaps", group="v1"), body)

    def names(selector: str, **kw: Any) -> set[str]:
        items = kube.ok("GET", kube.path("configmaps", group="v1"), labelSelector=f"run={run},{selector}", **kw)
        return {i["metadata"]["name"].rsplit("-", 1)[1] for i in items["items"]}

    assert names("tier=x") == {"a"}
    assert names("tier==y") == {"b"}
    assert names("tier!=x") == {"b", "c"}
    assert names("tier in (x,y)") == {"a", "b"}
    assert names("tier notin (x)") == {"b", "c"}
    assert names("tier") == {"a", "b"}
    assert names("!tier") == {"c"}
    assert names("tier", fieldSelector=f"metadata.name=sel-{run}-a") == {"a"}
    assert names("tier", fieldSelector=f"metadata.name!=sel-{run}-a") == {"b"}
    assert names("tier", fieldSelector=f"metadata.namespace={kube.namespace}") == {"a", "b"}


def test_cluster_wide_list(kube: Kube, name: str) -> None:
    kube.ok("POST", kube.path("spans"), kube.span(name))
    listing = kube.ok("GET", kube.path("spans", ns=None))
    assert int(listing["metadata"]["resourceVersion"]) > 0
    found = [i for i in listing["items"] if i["metadata"]["name"] == name]
    assert found
    assert found[0]["metadata"]["namespace"] == kube.namespace


def test_list_in_pages(kube: Kube, name: str) -> None:
    """limit/continue as client-go's pager uses it: pages in name order from one snapshot (the same
    resourceVersion on every page), remainingItemCount without a selector; with a label selector the pages
    hold only matching objects and remainingItemCount is not set (the server cannot know it)."""
    for i in range(6):
        labels = {"page": name} if i % 2 == 0 else None
        kube.ok("POST", kube.path("spans"), kube.span(f"{name}-{i}", labels))

    def pages(**params: str) -> tuple[list[list[str]], list[dict[str, Any]]]:
        names: list[list[str]] = []
        metas: list[dict[str, Any]] = []
        cont = ""
        while True:
            query = {"limit": "2", **params, **({"continue": cont} if cont else {})}
            doc = kube.ok("GET", kube.path("spans") + "?" + urlencode(query))
            names.append([o["metadata"]["name"] for o in doc["items"]])
            metas.append(doc["metadata"])
            cont = doc["metadata"].get("continue") or ""
            if not cont:
                return names, metas

    every, metas = pages()
    listed = [n for page in every for n in page]
    assert listed == sorted(listed)
    assert [n for n in listed if n.startswith(f"{name}-")] == [f"{name}-{i}" for i in range(6)]
    assert all(len(page) == 2 for page in every[:-1])
    assert metas[0]["remainingItemCount"] == len(listed) - 2
    assert len({m["resourceVersion"] for m in metas}) == 1
    matching, metas = pages(labelSelector=f"page={name}")
    assert [n for page in matching for n in page] == [f"{name}-0", f"{name}-2", f"{name}-4"]
    assert all("remainingItemCount" not in m for m in metas)


# -- deletion and finalizers --------------------------------------------------------------------------------


def test_finalizers_and_deletion(kube: Kube, name: str) -> None:
    body = kube.span(name)
    body["metadata"]["finalizers"] = ["cfm.test/hold"]
    kube.ok("POST", kube.path("spans"), body)
    resp = kube.req("DELETE", kube.path("spans", name))
    assert resp.status == 200
    meta = resp.body["metadata"]
    assert meta["deletionTimestamp"]
    assert meta["deletionGracePeriodSeconds"] == 0
    obj = kube.ok("GET", kube.path("spans", name))
    assert obj["metadata"]["deletionTimestamp"]
    resp = kube.req(
        "PATCH", kube.path("spans", name), {"metadata": {"finalizers": ["cfm.test/hold", "cfm.test/new"]}}, ct=MERGE
    )
    assert resp.status == 422
    assert "no new finalizers can be added" in resp.body["message"]
    kube.ok("PATCH", kube.path("spans", name), {"metadata": {"finalizers": None}}, ct=MERGE)
    assert kube.req("GET", kube.path("spans", name)).status == 404


def test_delete_without_finalizers_and_preconditions(kube: Kube, name: str) -> None:
    obj = kube.ok("POST", kube.path("spans"), kube.span(name))
    uid, rv = obj["metadata"]["uid"], obj["metadata"]["resourceVersion"]
    resp = kube.req("DELETE", kube.path("spans", name), {"preconditions": {"uid": "not-" + uid}})
    assert resp.status == 409
    assert resp.body["reason"] == "Conflict"
    resp = kube.req("DELETE", kube.path("spans", name), {"preconditions": {"resourceVersion": str(int(rv) - 1)}})
    assert resp.status == 409
    body = {"preconditions": {"uid": uid, "resourceVersion": rv}, "propagationPolicy": "Background"}
    assert kube.req("DELETE", kube.path("spans", name), body).status == 200
    assert kube.req("GET", kube.path("spans", name)).status == 404
    assert kube.req("DELETE", kube.path("spans", name)).status == 404


# -- watches -------------------------------------------------------------------------------------------------


def test_watch_from_resource_version(kube: Kube, name: str) -> None:
    rv = kube.ok("GET", kube.path("spans"))["metadata"]["resourceVersion"]
    kube.ok("POST", kube.path("spans"), kube.span(name))
    kube.ok("PATCH", kube.path("spans", name) + "/status", {"status": {"state": "Scheduling"}}, ct=MERGE)
    kube.ok("DELETE", kube.path("spans", name))
    events = kube.watch(kube.path("spans"), resourceVersion=rv, until=3, fieldSelector=f"metadata.name={name}")
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert rvs == sorted(rvs)
    assert len(set(rvs)) == 3
    assert events[2]["object"]["status"]["state"] == "Scheduling"  # DELETED carries the last state


def test_watch_initial_state_and_live_events(kube: Kube, name: str) -> None:
    labels = {"w": name}
    kube.ok("POST", kube.path("spans"), kube.span(name, labels))
    late = name + "-late"
    timer = threading.Timer(0.5, lambda: kube.ok("POST", kube.path("spans"), kube.span(late, labels)))
    timer.start()
    try:
        events = kube.watch(kube.path("spans"), until=2, labelSelector=f"w={name}", fieldSelector="metadata.name!=zz")
    finally:
        timer.join()
    names = [(e["type"], e["object"]["metadata"]["name"]) for e in events]
    assert names == [("ADDED", name), ("ADDED", late)]  # the synthetic initial ADDED, then the live one
    events = kube.watch(kube.path("spans"), resourceVersion="0", fieldSelector=f"metadata.name={late}", until=1)
    assert [e["type"] for e in events] == ["ADDED"]


def test_watch_label_selector_transitions(kube: Kube, name: str) -> None:
    rv = kube.ok("GET", kube.path("configmaps", group="v1"))["metadata"]["resourceVersion"]
    kube.ok(
        "POST", kube.path("configmaps", group="v1"), kube.obj("ConfigMap", {"name": name, "labels": {"w": name}}, "v1")
    )
    kube.ok("PATCH", kube.path("configmaps", name, group="v1"), {"data": {"k": "v"}}, ct=MERGE)
    kube.ok("PATCH", kube.path("configmaps", name, group="v1"), {"metadata": {"labels": None}}, ct=MERGE)
    events = kube.watch(kube.path("configmaps", group="v1"), resourceVersion=rv, labelSelector=f"w={name}", until=3)
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]


def test_watch_timeout_and_bookmarks(kube: Kube) -> None:
    start = time.monotonic()
    events = kube.watch(kube.path("leases", group="coordination.k8s.io/v1"), timeoutSeconds=1, idle=10)
    assert time.monotonic() - start < 8  # the server closed the stream
    if kube.embedded is None:
        return  # a real server sends bookmarks about once a minute: too slow to wait for here
    rv = kube.ok("GET", kube.path("leases", group="coordination.k8s.io/v1"))["metadata"]["resourceVersion"]
    events = kube.watch(
        kube.path("leases", group="coordination.k8s.io/v1"),
        resourceVersion=rv,
        allowWatchBookmarks="true",
        timeoutSeconds=2,
        idle=10,
    )
    marks = [e for e in events if e["type"] == "BOOKMARK"]
    assert marks
    assert int(marks[-1]["object"]["metadata"]["resourceVersion"]) >= int(rv)


def test_watch_sends_no_bookmark_ahead_of_queued_events(kube: Kube, name: str) -> None:
    """Found at 10,000 spans: a BOOKMARK written while events still waited in the watch's queue (a write to a
    slow client outlasted the pre-timeout mark) carried a resourceVersion ahead of them, and a client that
    resumed from it never saw them (a capture lost four Dispatcher creations). A real API server's stream is
    ordered: no event after a BOOKMARK has a lower resourceVersion. Here a slow reader: the replayed events
    fill the socket, the reader sleeps past the pre-timeout mark, then reads to the end."""
    if kube.embedded is None:
        pytest.skip("needs the embedded server's short watch timeout and a reader it cannot outrun")
    cms = kube.path("configmaps", group="v1")
    rv = kube.ok("GET", cms)["metadata"]["resourceVersion"]
    blob = "x" * 20_000
    names = [f"{name}-{i:03d}" for i in range(400)]  # more than the server writes at once (256)
    for n in names:
        kube.ok("POST", cms, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, "labels": {"w": name}},
                              "data": {"blob": blob}})  # fmt: skip
    url = urllib3.util.parse_url(kube.host)
    query = urlencode({"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true", "timeoutSeconds": "3",
                       "labelSelector": f"w={name}"})  # fmt: skip
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.host, url.port))
    try:
        sock.sendall(f"GET {cms}?{query} HTTP/1.1\r\nHost: {url.host}\r\nConnection: close\r\n\r\n".encode())
        time.sleep(2.0)  # past the pre-timeout BOOKMARK mark (timeout 3 s: 1.5 s), before the timeout
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    head, body = data.split(b"\r\n\r\n", 1)
    assert b"chunked" in head.lower(), head
    stream = b""
    while body:  # de-chunk: "<hex size>\r\n<data>\r\n", ended by a zero-size chunk
        size_line, body = body.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        stream, body = stream + body[:size], body[size + 2 :]
    events = [json.loads(line) for line in stream.split(b"\n") if line.strip()]
    rvs = [(e["type"], int(e["object"]["metadata"]["resourceVersion"])) for e in events]
    assert [e["object"]["metadata"]["name"] for e in events if e["type"] == "ADDED"] == names
    # (Without the fix a BOOKMARK came out as the first write unblocked, ahead of the 144 events still queued.)
    for (kind_a, a), (kind_b, b) in itertools.pairwise(rvs):
        assert b >= a, f"{kind_b} at {b} after {kind_a} at {a}"


def test_watch_too_old_resource_version_is_gone(kube: Kube, name: str) -> None:
    if kube.embedded is not None:  # push the first resourceVersions out of the (small) history window
        cm = kube.path("configmaps", name, group="v1")
        kube.ok("POST", kube.path("configmaps", group="v1"), kube.obj("ConfigMap", {"name": name}, "v1"))
        current = int(kube.ok("GET", cm)["metadata"]["resourceVersion"])
        for i in range(max(0, HISTORY + 10 - current)):
            kube.ok("PATCH", cm, {"data": {"i": str(i)}}, ct=MERGE)
    events = kube.watch(kube.path("spans"), resourceVersion="1", until=1)
    assert events
    assert events[0]["type"] == "ERROR"
    status = events[0]["object"]
    assert status["kind"] == "Status"
    assert status["code"] == 410
    assert status["reason"] in ("Expired", "Gone")


# -- built-in kinds --------------------------------------------------------------------------------------------


def test_leases_configmaps_events(kube: Kube, name: str) -> None:
    leases = kube.path("leases", group="coordination.k8s.io/v1")
    lease = kube.ok(
        "POST", leases, kube.obj("Lease", {"name": name}, "coordination.k8s.io/v1", spec={"holderIdentity": "a"})
    )
    stale = dict(lease, spec={"holderIdentity": "b"})
    lease["spec"]["holderIdentity"] = "c"
    kube.ok("PUT", f"{leases}/{name}", lease)
    assert kube.req("PUT", f"{leases}/{name}", stale).status == 409
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "ev-"},
        "involvedObject": {"kind": "Span", "name": name, "namespace": kube.namespace},
        "reason": "Test",
        "message": "hello",
        "type": "Normal",
    }
    assert kube.ok("POST", kube.path("events", group="v1"), event)["metadata"]["name"].startswith("ev-")
    ev2 = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name},
        "eventTime": "2025-01-01T00:00:00.000000Z",
        "reportingController": "cfm.test/x",
        "reportingInstance": "x",
        "action": "Test",
        "reason": "Test",
        "type": "Normal",
        "regarding": {"kind": "Span", "name": name, "namespace": kube.namespace},
    }
    kube.ok("POST", kube.path("events", group="events.k8s.io/v1"), ev2)
    kube.ok("POST", kube.path("configmaps", group="v1"), kube.obj("ConfigMap", {"name": name}, "v1", data={"x": "1"}))
    assert kube.ok("GET", kube.path("configmaps", name, group="v1"))["data"] == {"x": "1"}
    assert (
        kube.req(
            "POST", kube.path("configmaps", group="v1", ns="no-such-ns"), kube.obj("ConfigMap", {"name": name}, "v1")
        ).status
        == 404
    )


LEASES_V1 = "coordination.k8s.io/v1"


def _lease(name: str, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": LEASES_V1,
        "kind": "Lease",
        "metadata": {"name": name, **meta},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "2020-01-02T03:04:05.000000Z"},
    }


def _uid_precondition_failed(kube: Kube, resource: str, name: str, given: str, stored: str) -> str:
    """The 409 message of a PUT whose metadata.uid is not the stored object's (storage.Preconditions.Check; the
    key is etcd's: ``/registry/leases/...`` for a built-in kind). A missing object's uid is empty."""
    return (
        f'Operation cannot be fulfilled on {resource}.coordination.k8s.io "{name}": StorageError: invalid object, '
        f"Code: 4, Key: /registry/{resource}/{kube.namespace}/{name}, ResourceVersion: 0, AdditionalErrorMsg: "
        f"Precondition failed: UID in precondition: {given}, UID in object meta: {stored}"
    )


def test_put_creates_a_missing_lease(kube: Kube, name: str) -> None:
    """A Lease's strategy allows create on update: a PUT to a missing Lease creates it (201, a fresh uid and
    creationTimestamp, a resourceVersion of its own: the body's is ignored). So a renewal of a Lease deleted a
    moment before re-creates it unless it carries the uid, whose precondition fails against the missing object."""
    leases = kube.path("leases", group=LEASES_V1)
    resp = kube.req("PUT", f"{leases}/{name}", _lease(name, resourceVersion="12345"))
    assert resp.status == 201, resp.body
    meta = resp.body["metadata"]
    assert meta["uid"]
    assert meta["resourceVersion"] != "12345"
    datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
    assert resp.body["spec"]["holderIdentity"] == "a"
    assert kube.ok("GET", f"{leases}/{name}") == resp.body
    # Deleted, then renewed with the answer's resourceVersion: without the uid it is created again ...
    first = resp.body
    kube.ok("DELETE", f"{leases}/{name}")
    renewal = {k: v for k, v in first.items() if k != "metadata"}
    renewal["metadata"] = {"name": name, "resourceVersion": first["metadata"]["resourceVersion"]}
    again = kube.req("PUT", f"{leases}/{name}", renewal)
    assert again.status == 201, again.body
    assert again.body["metadata"]["uid"] != first["metadata"]["uid"]
    # ... with it, the precondition fails (409 Conflict) and nothing is created.
    kube.ok("DELETE", f"{leases}/{name}")
    renewal["metadata"]["uid"] = uid = again.body["metadata"]["uid"]
    resp = kube.req("PUT", f"{leases}/{name}", renewal)
    assert resp.status == 409, resp.body
    assert resp.body["reason"] == "Conflict"
    assert resp.body["details"] == {"name": name, "group": "coordination.k8s.io", "kind": "leases"}
    assert resp.body["message"] == _uid_precondition_failed(kube, "leases", name, uid, "")
    assert kube.req("GET", f"{leases}/{name}").status == 404
    # A Lease of that name created since (another uid): the same 409, naming the stored uid.
    other = kube.ok("POST", leases, _lease(name))
    renewal["metadata"]["resourceVersion"] = other["metadata"]["resourceVersion"]
    resp = kube.req("PUT", f"{leases}/{name}", renewal)
    assert resp.status == 409, resp.body
    assert resp.body["message"] == _uid_precondition_failed(kube, "leases", name, uid, other["metadata"]["uid"])
    assert kube.ok("GET", f"{leases}/{name}") == other
    # Create on update is a create: validated as one, and not in a namespace that does not exist.
    bad = _lease(name + "-bad")
    bad["spec"]["leaseDurationSeconds"] = 0
    resp = kube.req("PUT", f"{leases}/{name}-bad", bad)
    assert resp.status == 422, resp.body
    assert kube.req("GET", f"{leases}/{name}-bad").status == 404
    missing_ns = kube.path("leases", name, group=LEASES_V1, ns=f"no-such-{name}")
    resp = kube.req("PUT", missing_ns, _lease(name))
    assert resp.status == 404, resp.body
    assert resp.body["details"]["kind"] == "namespaces"


def test_put_creates_a_missing_event_of_either_api(kube: Kube, name: str) -> None:
    """Events (one storage for core/v1 and events.k8s.io/v1) allow create on update too."""
    core = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name},
        "involvedObject": {"kind": "Span", "name": name, "namespace": kube.namespace},
        "reason": "Test",
        "message": "hello",
        "type": "Normal",
    }
    resp = kube.req("PUT", kube.path("events", name, group="v1"), core)
    assert resp.status == 201, resp.body
    assert resp.body["metadata"]["uid"]
    v1 = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name + "-v1"},
        "eventTime": "2025-01-01T00:00:00.000000Z",
        "reportingController": "cfm.test/x",
        "reportingInstance": "x",
        "action": "Test",
        "reason": "Test",
        "type": "Normal",
        "regarding": {"kind": "Span", "name": name, "namespace": kube.namespace},
    }
    resp = kube.req("PUT", kube.path("events", name + "-v1", group="events.k8s.io/v1"), v1)
    assert resp.status == 201, resp.body
    assert (
        kube.ok("GET", kube.path("events", name + "-v1", group="v1"))["metadata"]["uid"] == resp.body["metadata"]["uid"]
    )


def test_put_to_a_missing_configmap_namespace_or_custom_resource_is_not_found(kube: Kube, name: str) -> None:
    """Their strategies do not allow create on update: 404, and nothing is created."""
    cm = kube.obj("ConfigMap", {"name": name}, "v1", data={"a": "1"})
    for path, body in (
        (kube.path("configmaps", name, group="v1"), cm),
        (kube.path("spans", name), kube.span(name)),
        (
            kube.path("namespaces", f"no-such-{name}", group="v1", ns=None),
            kube.obj("Namespace", {"name": f"no-such-{name}"}, "v1"),
        ),
    ):
        resp = kube.req("PUT", path, body)
        assert resp.status == 404, (path, resp.body)
        assert resp.body["reason"] == "NotFound"
        assert kube.req("GET", path).status == 404


def test_put_with_another_uid_conflicts(kube: Kube, name: str) -> None:
    """A PUT whose metadata.uid is another incarnation's: 409, whatever its resourceVersion (custom resource)."""
    obj = kube.ok("POST", kube.path("spans"), kube.span(name))
    stored = obj["metadata"]["uid"]
    given = str(uuid.uuid4())
    obj["metadata"]["uid"] = given
    resp = kube.req("PUT", kube.path("spans", name), obj)
    assert resp.status == 409, resp.body
    assert resp.body["reason"] == "Conflict"
    assert resp.body["message"] == (
        f'Operation cannot be fulfilled on spans.{GROUP.split("/")[0]} "{name}": StorageError: invalid object, '
        f"Code: 4, Key: /registry/{GROUP.split('/')[0]}/spans/{kube.namespace}/{name}, ResourceVersion: 0, "
        f"AdditionalErrorMsg: Precondition failed: UID in precondition: {given}, UID in object meta: {stored}"
    )


def test_post_crd(kube: Kube) -> None:
    group = f"t{uuid.uuid4().hex[:6]}.cfm.test"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }
    kube.ok("POST", CRD_BASE, crd)
    try:
        path = kube.path("widgets", group=f"{group}/v1")
        deadline = time.monotonic() + 30
        while kube.req("GET", path).status != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        obj = kube.ok("POST", path, kube.obj("Widget", {"name": "w"}, f"{group}/v1", spec={"anything": [1]}))
        assert obj["spec"] == {"anything": [1]}
        assert obj["metadata"]["generation"] == 1
        assert "widgets" in _resources(kube, f"/apis/{group}/v1")
    finally:
        kube.req("DELETE", f"{CRD_BASE}/widgets.{group}")


def test_crd_deletion_waits_for_its_resources(kube: Kube) -> None:
    """A deleted CRD first deletes its custom resources; one held by a finalizer holds the CRD too."""
    group = f"t{uuid.uuid4().hex[:6]}.cfm.test"
    schema = {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"gizmos.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "gizmos", "kind": "Gizmo"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": schema}],
        },
    }
    kube.ok("POST", CRD_BASE, crd)
    path = kube.path("gizmos", group=f"{group}/v1")
    deadline = time.monotonic() + 30
    while kube.req("GET", path).status != 200:
        assert time.monotonic() < deadline, "the CRD was not served"
        time.sleep(0.2)
    kube.ok("POST", path, kube.obj("Gizmo", {"name": "g", "finalizers": ["cfm.test/hold"]}, f"{group}/v1"))
    deleting = kube.ok("DELETE", f"{CRD_BASE}/gizmos.{group}")
    assert deleting["metadata"]["deletionTimestamp"]
    deadline = time.monotonic() + 30
    while not kube.ok("GET", f"{path}/g")["metadata"].get("deletionTimestamp"):
        assert time.monotonic() < deadline, "the custom resource was not deleted"
        time.sleep(0.2)
    assert kube.req("GET", f"{CRD_BASE}/gizmos.{group}").status == 200  # held by the resource's finalizer
    kube.ok("PATCH", f"{path}/g", {"metadata": {"finalizers": None}}, ct=MERGE)
    deadline = time.monotonic() + 60
    while kube.req("GET", f"{CRD_BASE}/gizmos.{group}").status != 404:
        assert time.monotonic() < deadline, "the CRD was not removed"
        time.sleep(0.2)


# -- fault injection (embedded only) ------------------------------------------------------------------------------


def test_injected_failures(kube: Kube, embedded: ApiServerHandle, name: str) -> None:
    embedded.inject_failures("dispatchers", 2, 500)
    spec = {"changefeed": "cf", "capture": "c", "span": "s", "tableID": 1, "startKey": "00", "endKey": "ff"}
    body = kube.obj("Dispatcher", {"name": name}, spec={**spec, "startTs": 0, "epoch": 1})
    assert kube.req("POST", kube.path("dispatchers"), body).status == 500
    assert kube.req("POST", kube.path("dispatchers"), body).status == 500
    resp = kube.req("POST", kube.path("dispatchers"), body)
    assert resp.status in (201, 422), resp.body  # the third write goes through (422 only if the body is invalid)
    embedded.inject_failures("dispatchers", 1, 409)
    assert kube.req("PATCH", kube.path("dispatchers", name), {"metadata": {"labels": {"a": "b"}}}, ct=MERGE).status in (
        409,
        404,
    )


def test_close_watches(kube: Kube, embedded: ApiServerHandle) -> None:
    def watchers() -> int:
        return embedded.call(lambda: sum(len(w) for w in embedded.store.watchers.values()))

    baseline = watchers()
    result: list[list[dict[str, Any]]] = []
    thread = threading.Thread(
        target=lambda: result.append(kube.watch(kube.path("spans"), resourceVersion="0", idle=20))
    )
    start = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 10
    while watchers() <= baseline:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert embedded.close_watches() >= 1
    thread.join(timeout=15)
    assert not thread.is_alive()
    assert time.monotonic() - start < 10


# -- clients: kubectl and Kopf -------------------------------------------------------------------------------------


def _kubectl(kube: Kube, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig_path), "HOME": str(tmp_path)}
    cmd = ["kubectl", "--cache-dir", str(tmp_path / "cache"), "-n", kube.namespace, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl(kube: Kube, name: str, tmp_path: Path) -> None:
    kube.ok("POST", kube.path("spans"), kube.span(name))
    out = _kubectl(kube, tmp_path, "apply", "-f", str(ROOT / "crds"))
    assert out.returncode == 0, out.stderr
    out = _kubectl(kube, tmp_path, "get", "cdc")
    assert out.returncode == 0, out.stderr
    assert name in out.stdout
    assert "TABLE" in out.stdout
    assert "CHECKPOINT" in out.stdout
    out = _kubectl(kube, tmp_path, "get", "spans", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert name in out.stdout
    assert '"kind": "Span"' in out.stdout
    out = _kubectl(kube, tmp_path, "get", "cdcspan", name, "-o", "wide")
    assert out.returncode == 0, out.stderr
    assert "CHANGEFEED" in out.stdout


KOPF_OPERATOR = textwrap.dedent(
    """
    import sys, kopf

    LOG = sys.argv[1]

    def log(line):
        with open(LOG, "a") as f:
            f.write(line + "\\n")

    @kopf.on.startup()
    def configure(settings, **_):
        settings.watching.server_timeout = 30
        settings.posting.level = 0

    @kopf.on.create("cdc.maintainer.dev", "v1alpha1", "spans")
    def created(name, patch, **_):
        patch.metadata.annotations["cfm.test/created"] = "yes"
        log("create " + name)

    @kopf.on.delete("cdc.maintainer.dev", "v1alpha1", "spans")
    def deleted(name, **_):
        log("delete " + name)

    kopf.run(standalone=True, namespaces=[sys.argv[2]])
    """
)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_kopf_runs_handlers_with_finalizers(kube: Kube, name: str, tmp_path: Path) -> None:
    script, log = tmp_path / "operator.py", tmp_path / "handlers.log"
    script.write_text(KOPF_OPERATOR)
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig_path)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log), kube.namespace],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        kube.ok("POST", kube.path("spans"), kube.span(name))
        _wait(lambda: log.exists() and f"create {name}" in log.read_text(), 20, "the create handler")

        def annotated() -> bool:
            meta = kube.ok("GET", kube.path("spans", name))["metadata"]
            return bool((meta.get("annotations") or {}).get("cfm.test/created") == "yes")

        _wait(annotated, 20, "the handler's patch")  # Kopf applies the handler's patch after it returns
        obj = kube.ok("GET", kube.path("spans", name))
        assert obj["metadata"].get("finalizers")  # Kopf's finalizer (the delete handler is not optional)
        kube.ok("DELETE", kube.path("spans", name))
        _wait(lambda: f"delete {name}" in log.read_text(), 20, "the delete handler")
        _wait(lambda: kube.req("GET", kube.path("spans", name)).status == 404, 20, "the object to disappear")
    finally:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert "Traceback" not in output, output[-3000:]
