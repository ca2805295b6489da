"""RBAC of the embedded API (controller.apiserver.authz): rule matching as kube-apiserver's RBAC does it."""

from __future__ import annotations

import json

import pytest
import urllib3

from controller.apiserver import start_server
from controller.apiserver.authz import Attributes, Rbac, attributes
from controller.apiserver.store import ApiError


def rbac(*rules: dict[str, object], kind: str = "Role", binding: str = "RoleBinding") -> Rbac:
    r = Rbac()
    r.add_service_account("t", "ns", "sa")
    role = {"kind": kind, "metadata": {"name": "r", "namespace": "ns"}, "rules": list(rules)}
    bind = {
        "kind": binding,
        "metadata": {"name": "b", "namespace": "ns"},
        "roleRef": {"kind": kind, "name": "r", "apiGroup": "rbac.authorization.k8s.io"},
        "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": "ns"}],
    }
    r.load([role, bind])
    return r


USER = "system:serviceaccount:ns:sa"


def allowed(r: Rbac, method: str, path: str, **query: str) -> bool:
    attrs = attributes(method, path, query)
    assert attrs is not None
    try:
        r.authorize(USER, attrs)
    except ApiError as exc:
        if exc.code != 403:
            raise
        return False
    return True


@pytest.mark.parametrize(
    ("method", "path", "query", "want"),
    [
        ("GET", "/api/v1/namespaces/ns/configmaps", {}, Attributes("list", "", "configmaps", "", "ns", "")),
        (
            "GET",
            "/api/v1/namespaces/ns/configmaps",
            {"watch": "1"},
            Attributes("watch", "", "configmaps", "", "ns", ""),
        ),
        ("GET", "/api/v1/watch/namespaces/ns/configmaps", {}, Attributes("watch", "", "configmaps", "", "ns", "")),
        (
            "PATCH",
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases/x",
            {},
            Attributes("patch", "coordination.k8s.io", "leases", "", "ns", "x"),
        ),
        ("PUT", "/apis/g/v1/namespaces/ns/spans/s/status", {}, Attributes("update", "g", "spans", "status", "ns", "s")),
        (
            "DELETE",
            "/api/v1/namespaces/ns/configmaps",
            {},
            Attributes("deletecollection", "", "configmaps", "", "ns", ""),
        ),
        ("GET", "/api/v1/namespaces", {}, Attributes("list", "", "namespaces", "", "", "")),
        ("GET", "/api/v1/namespaces/ns", {}, Attributes("get", "", "namespaces", "", "ns", "ns")),
    ],
)
def test_request_attributes(method: str, path: str, query: dict[str, str], want: Attributes) -> None:
    assert attributes(method, path, query) == want


@pytest.mark.parametrize("path", ["/api", "/apis", "/apis/g", "/api/v1", "/apis/g/v1", "/version", "/openapi/v3"])
def test_non_resource_requests_are_not_resource_requests(path: str) -> None:
    assert attributes("GET", path, {}) is None


def test_verbs_groups_and_subresources() -> None:
    r = rbac({"apiGroups": ["g"], "resources": ["spans", "spans/status"], "verbs": ["get", "patch"]})
    assert allowed(r, "GET", "/apis/g/v1/namespaces/ns/spans/s")
    assert allowed(r, "PATCH", "/apis/g/v1/namespaces/ns/spans/s/status")
    assert not allowed(r, "PUT", "/apis/g/v1/namespaces/ns/spans/s/status")  # update is not patch
    assert not allowed(r, "GET", "/apis/g/v1/namespaces/ns/spans")  # list is not get
    assert not allowed(r, "GET", "/apis/other/v1/namespaces/ns/spans/s")
    assert not allowed(r, "PATCH", "/apis/g/v1/namespaces/ns/tables/t/status")


def test_resource_names_never_grant_collections() -> None:
    r = rbac(
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "create"], "resourceNames": ["a"]}
    )
    assert allowed(r, "GET", "/api/v1/namespaces/ns/configmaps/a")
    assert not allowed(r, "GET", "/api/v1/namespaces/ns/configmaps/b")
    assert not allowed(r, "GET", "/api/v1/namespaces/ns/configmaps")
    assert not allowed(r, "POST", "/api/v1/namespaces/ns/configmaps")


def test_a_role_binding_grants_in_its_namespace_only() -> None:
    r = rbac({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]})
    assert allowed(r, "GET", "/api/v1/namespaces/ns/configmaps")
    assert not allowed(r, "GET", "/api/v1/namespaces/other/configmaps")
    assert not allowed(r, "GET", "/api/v1/configmaps")  # across namespaces is the cluster scope
    cluster = rbac(
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, kind="ClusterRole", binding="ClusterRoleBinding"
    )
    assert allowed(cluster, "GET", "/api/v1/namespaces/other/configmaps")
    assert allowed(cluster, "GET", "/api/v1/namespaces")


def test_forbidden_reads_like_the_real_server() -> None:
    r = rbac()
    attrs = attributes("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/x", {})
    assert attrs is not None
    with pytest.raises(ApiError) as err:
        r.authorize(USER, attrs)
    assert err.value.code == 403
    assert err.value.reason == "Forbidden"
    assert err.value.message == (
        f'leases.coordination.k8s.io "x" is forbidden: User "{USER}" cannot get resource "leases" '
        'in API group "coordination.k8s.io" in the namespace "ns"'
    )


def test_unknown_tokens_are_not_checked() -> None:
    r = rbac()
    assert r.user_of("Bearer t") == USER
    assert r.user_of("Bearer admin") is None
    assert r.user_of("t") is None


def test_a_put_that_creates_is_authorized_as_a_create_too() -> None:
    """A PUT to a missing Lease creates it: the update handler also authorizes a ``create`` of that name (where a
    rule's resourceNames can grant it), and denied, answers NewForbidden with RBAC's (empty) reason."""
    r = rbac(
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"], "resourceNames": ["b"]},
        kind="ClusterRole",
        binding="ClusterRoleBinding",
    )
    handle = start_server(rbac=r)
    pool = urllib3.PoolManager()
    try:
        base = f"{handle.url}/apis/coordination.k8s.io/v1/namespaces/ns/leases"

        def put(name: str) -> urllib3.BaseHTTPResponse:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name}, "spec": {}}
            headers = {"Authorization": "Bearer t", "Content-Type": "application/json"}
            return pool.request("PUT", f"{base}/{name}", body=json.dumps(body).encode(), headers=headers)

        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}
        created = pool.request(
            "POST",
            f"{handle.url}/api/v1/namespaces",
            body=json.dumps(ns).encode(),
            headers={"Authorization": "Bearer t", "Content-Type": "application/json"},
        )
        assert created.status == 201, created.data
        denied = put("a")
        assert denied.status == 403, denied.data
        status = json.loads(denied.data)
        assert status["reason"] == "Forbidden"
        assert status["message"] == 'leases.coordination.k8s.io "a" is forbidden: '
        assert status["details"] == {"name": "a", "group": "coordination.k8s.io", "kind": "leases"}
        assert put("b").status == 201  # create granted by name
    finally:
        handle.stop()
