"""RBAC for the embedded API server: what the chart's Roles allow, enforced as kube-apiserver's RBAC does.

By default the server authorizes everything (its kubeconfig's token is an administrator). A test can
register bearer tokens as service accounts (:meth:`Rbac.add_service_account`) and load Roles,
ClusterRoles and their bindings (:meth:`Rbac.load`, e.g. from ``helm template`` of the chart); a request
bearing such a token is then allowed only if a bound rule covers it, otherwise it gets the real server's
403 ``Forbidden``. This is how the tests show that the maintainer and the captures need nothing the chart
does not grant: a process that lists namespaces cluster-wide (Kopf's scanning did) fails here as it
failed on a real cluster.

Request attributes follow ``k8s.io/apiserver``'s ``RequestInfoFactory``: the verb (``get``, ``list``,
``watch``, ``create``, ``update``, ``patch``, ``delete``, ``deletecollection``), the API group, the
resource and subresource (a rule names ``spans/status``), the namespace and the name. A rule matches when
its apiGroups, resources and verbs contain the request's (or ``*``) and, if it has resourceNames, the
name is among them (so resourceNames never grant ``list``, ``watch``, ``create`` or ``deletecollection``).
A RoleBinding grants its Role's (or a ClusterRole's) rules in its own namespace only; a
ClusterRoleBinding grants them everywhere. Non-resource requests (discovery, ``/version``, ``/openapi``,
health) are allowed, as ``system:discovery`` and ``system:public-info-viewer`` allow them to every
authenticated user.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.apiserver.errors import ApiError
from controller.apiserver.resources import JSON

NAMESPACE_SUBRESOURCES = ("status", "finalize")


@dataclass(frozen=True)
class Rule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    resource_names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, raw: JSON) -> Rule:
        return cls(
            frozenset(raw.get("apiGroups") or []),
            frozenset(raw.get("resources") or []),
            frozenset(raw.get("verbs") or []),
            frozenset(raw.get("resourceNames") or []),
        )

    def allows(self, attrs: Attributes) -> bool:
        def has(values: frozenset[str], value: str) -> bool:
            return "*" in values or value in values

        resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
        if not (has(self.api_groups, attrs.group) and has(self.verbs, attrs.verb)):
            return False
        if not (has(self.resources, resource) or (attrs.subresource and f"{attrs.resource}/*" in self.resources)):
            return False
        return not self.resource_names or attrs.name in self.resource_names


@dataclass(frozen=True)
class Attributes:
    """One resource request, as RBAC sees it."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str  # "" at the cluster scope
    name: str


@dataclass
class Rbac:
    #: bearer token -> user name (``system:serviceaccount:<namespace>:<name>``)
    users: dict[str, str] = field(default_factory=dict)
    #: user -> (namespace the grant holds in, "" = every namespace and the cluster scope; its rules)
    grants: dict[str, list[tuple[str, list[Rule]]]] = field(default_factory=dict)
    #: every request decided for a registered token: (user, attributes, allowed)
    decisions: list[tuple[str, Attributes, bool]] = field(default_factory=list)

    def add_service_account(self, token: str, namespace: str, name: str) -> str:
        user = f"system:serviceaccount:{namespace}:{name}"
        self.users[token] = user
        return user

    def load(self, docs: Iterable[Any]) -> None:
        """Roles, ClusterRoles, RoleBindings and ClusterRoleBindings (anything else is ignored)."""
        docs = [d for d in docs if isinstance(d, dict)]
        roles: dict[tuple[str, str, str], list[Rule]] = {}
        for d in docs:
            if d.get("kind") in ("Role", "ClusterRole"):
                meta = d.get("metadata") or {}
                ns = meta.get("namespace", "") if d["kind"] == "Role" else ""
                roles[(d["kind"], ns, meta["name"])] = [Rule.of(r) for r in d.get("rules") or []]
        for d in docs:
            if d.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            ns = (d.get("metadata") or {}).get("namespace", "") if d["kind"] == "RoleBinding" else ""
            ref = d.get("roleRef") or {}
            rules = roles.get((ref.get("kind", ""), ns if ref.get("kind") == "Role" else "", ref.get("name", "")))
            if rules is None:
                continue  # a binding to a role that does not exist grants nothing
            for subject in d.get("subjects") or []:
                if subject.get("kind") == "ServiceAccount":
                    user = f"system:serviceaccount:{subject.get('namespace', ns)}:{subject['name']}"
                elif subject.get("kind") == "User":
                    user = str(subject["name"])
                else:
                    continue
                self.grants.setdefault(user, []).append((ns, rules))

    def user_of(self, authorization: str) -> str | None:
        token = authorization.split(" ", 1)[1] if authorization.startswith("Bearer ") else ""
        return self.users.get(token)

    def authorize(self, user: str, attrs: Attributes) -> None:
        """Raise the real server's 403 unless a rule bound to ``user`` allows ``attrs``."""
        allowed = any(
            (not ns or ns == attrs.namespace) and any(rule.allows(attrs) for rule in rules)
            for ns, rules in self.grants.get(user, [])
        )
        self.decisions.append((user, attrs, allowed))
        if not allowed:
            raise forbidden(user, attrs)

    def authorize_create_on_update(self, user: str, attrs: Attributes) -> None:
        """A PUT that creates (Leases, Events) is authorized again as a ``create`` of that name, as the update
        handler's ``withAuthorization`` does: denied, it is ``NewForbidden`` with RBAC's reason (empty when no
        rule failed to evaluate), not the request-level message. A rule's resourceNames can grant this create."""
        create = Attributes("create", attrs.group, attrs.resource, attrs.subresource, attrs.namespace, attrs.name)
        allowed = any(
            (not ns or ns == create.namespace) and any(rule.allows(create) for rule in rules)
            for ns, rules in self.grants.get(user, [])
        )
        self.decisions.append((user, create, allowed))
        if not allowed:
            qualified = f"{create.resource}.{create.group}" if create.group else create.resource
            details: JSON = {"name": create.name, "kind": create.resource}
            if create.group:
                details["group"] = create.group
            raise ApiError(403, "Forbidden", f'{qualified} "{create.name}" is forbidden: ', details)

    def denied(self) -> list[tuple[str, Attributes]]:
        return [(user, attrs) for user, attrs, ok in self.decisions if not ok]


def forbidden(user: str, attrs: Attributes) -> ApiError:
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    qualified = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    subject = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    message = (
        f'{subject} is forbidden: User "{user}" cannot {attrs.verb} resource "{resource}" '
        f'in API group "{attrs.group}" {scope}'
    )
    details: JSON = {"kind": attrs.resource}
    if attrs.name:
        details["name"] = attrs.name
    if attrs.group:
        details["group"] = attrs.group
    return ApiError(403, "Forbidden", message, details)


def attributes(method: str, path: str, query: dict[str, str]) -> Attributes | None:
    """The RBAC attributes of a request, or None for a non-resource request (discovery, health...).

    Parsed from the path alone, as ``RequestInfoFactory`` does: ``/namespaces/<ns>/<resource>...`` is a
    namespaced request unless what follows the namespace is one of its own subresources."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        rest = parts[2:]
        group = ""
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        rest = parts[3:]
        group = parts[1]
    else:
        return None
    watch = query.get("watch", "") in ("true", "1")
    if rest[0] == "watch":
        watch, rest = True, rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]  # a Namespace itself is authorized in its own namespace
        if len(rest) > 2 and rest[2] not in NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    if not rest:
        return None
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, "")
    if method == "GET":
        verb = "watch" if watch else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    return Attributes(verb or method.lower(), group, resource, subresource, namespace, name)
