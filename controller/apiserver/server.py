"""HTTP front of the embedded API server: routing, content negotiation, discovery, lists, tables, watch streams,
and the thread runner.

The server runs an aiohttp application on its own event loop in a daemon thread (:func:`start_server`), so a
test, the demo or the CLI can use it while running Kopf, the capture agents or kubectl against it. Its answers
follow kube-apiserver v1.36's, as recorded in ``tests/apiserver/corpus`` (see ``docs/architecture.md``): paths it
does not serve get the plain-text ``404 page not found``, bodies are decoded with Go's number rules, warnings are
``Warning: 299 - "..."`` headers, and lists, watches and discovery have the real shapes.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import logging
import re
import shutil
import ssl
import tempfile
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from aiohttp import web

from controller.apiserver import builtins as B
from controller.apiserver import gojson, patches
from controller.apiserver.authz import Rbac, attributes
from controller.apiserver.controllers import NAMESPACE_DELAY, Controllers
from controller.apiserver.cost import Committer, CostModel
from controller.apiserver.errors import (
    ApiError,
    PageNotFound,
    bad_request,
    details,
    forbidden,
    internal,
    invalid_error,
    not_found,
    unsupported_media_type,
)
from controller.apiserver.resources import BUILTIN_GROUP_ORDER, CRD_KEY, JSON, NS_KEY, ResourceType
from controller.apiserver.selectors import (
    FieldGetter,
    SelectorError,
    combine,
    metadata_fields,
    parse_field_selector,
    parse_label_selector,
)
from controller.apiserver.store import BODY_TYPES, Store, TooLargeResourceVersion, WriteOptions

logger = logging.getLogger(__name__)
T = TypeVar("T")

KUBE_VERSION = {
    "major": "1",
    "minor": "36",
    "emulationMajor": "1",
    "emulationMinor": "36",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "35",
    "gitVersion": "v1.36.2-cfm.embedded",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "python",
    "compiler": "gc",
    "platform": "linux/amd64",
}
AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
LIST_WAIT = 3.0  # seconds a LIST at a future resourceVersion waits before 504, as the real server
PRE_TIMEOUT_BOOKMARK = 2.5  # seconds before a watch's timeout its last BOOKMARK is sent (as observed)
NAME_DESCRIPTION = (
    "Name must be unique within a namespace. Is required when creating resources, although some resources may "
    "allow a client to request the generation of an appropriate name automatically. Name is primarily intended "
    "for creation idempotence and configuration definition. Cannot be updated. More info: "
    "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names"
)
AGE_DESCRIPTION = (
    "CreationTimestamp is a timestamp representing the server time when this object was created. It is not "
    "guaranteed to be set in happens-before order across separate operations. Clients may not set this value. It "
    "is represented in RFC3339 form and is in UTC.\n\nPopulated by the system. Read-only. Null for lists. More "
    "info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#metadata"
)


def _json(
    body: Any,
    status: int = 200,
    warnings: list[str] | None = None,
    content_type: str = "application/json",
    encoded: bytes | None = None,
) -> web.Response:
    headers = [("Warning", f"299 - {gojson.quote(w)}") for w in warnings or []]
    resp = web.Response(body=encoded if encoded is not None else gojson.dumps(body), status=status, headers=headers)
    resp.headers["Content-Type"] = content_type
    return resp


def _text(text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> web.Response:
    resp = web.Response(body=text.encode(), status=status)
    resp.headers["Content-Type"] = content_type
    return resp


def _error(err: ApiError) -> web.Response:
    return _json(err.status(), status=err.code, warnings=err.warnings)


# -- printer columns (Table output) ----------------------------------------------------------------------

_JSONPATH_TOKEN = re.compile(r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_\-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")


def jsonpath(obj: Any, path: str) -> Any:
    """The subset of kubectl JSONPath used in printer columns: ``.a.b``, ``[0]``, ``[?(@.k=="v")]``."""
    value = obj
    for m in _JSONPATH_TOKEN.finditer(path.strip().strip("{}")):
        if value is None:
            return None
        if m.group(1) is not None:
            value = value.get(m.group(1)) if isinstance(value, dict) else None
        elif m.group(2) is not None:
            idx = int(m.group(2))
            value = value[idx] if isinstance(value, list) and idx < len(value) else None
        else:
            key, want = m.group(3), m.group(4)
            found = (
                [x for x in value if isinstance(x, dict) and str(x.get(key)) == want] if isinstance(value, list) else []
            )
            value = found[0] if found else None
    return value


def human_duration(since: str) -> str:
    try:
        then = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    secs = max(0, int((datetime.now(UTC) - then).total_seconds()))
    mins, hours, days = secs // 60, secs // 3600, secs // 86400
    if secs < 120:
        return f"{secs}s"
    if mins < 10:
        return f"{mins}m{secs % 60}s" if secs % 60 else f"{mins}m"
    if hours < 3:
        return f"{mins}m"
    if hours < 8:
        return f"{hours}h{mins % 60}m" if mins % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    return f"{days}d"


def _cell(col: JSON, value: Any) -> Any:
    kind = col.get("type", "string")
    if value is None:
        return None
    if kind == "date":
        return human_duration(value) if isinstance(value, str) else None
    if kind == "integer":
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    if kind == "number":
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def to_table(rt: ResourceType, items: list[JSON], rv: str, include: str) -> JSON:
    definitions = [{"name": "Name", "type": "string", "format": "name", "description": NAME_DESCRIPTION, "priority": 0}]
    if rt.printer_columns:
        cols = rt.printer_columns
        for col in cols:
            definitions.append(
                {
                    "name": col["name"],
                    "type": col.get("type", "string"),
                    "format": col.get("format", ""),
                    "description": col.get("description")
                    or f"Custom resource definition column (in JSONPath format): {col.get('jsonPath', '')}",
                    "priority": col.get("priority", 0),
                }
            )
    else:
        cols = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        definitions.append({"name": "Age", "type": "date", "format": "", "description": AGE_DESCRIPTION, "priority": 0})
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        cells += [_cell(col, jsonpath(obj, str(col.get("jsonPath", "")))) for col in cols]
        row: JSON = {"cells": cells}
        if include == "Object":
            row["object"] = obj
        elif include == "None":
            row["object"] = None
        else:
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": definitions,
        "rows": rows,
    }


# -- content negotiation ----------------------------------------------------------------------------------


def _accepts(request: web.Request) -> list[tuple[str, dict[str, str]]]:
    out = []
    for part in (request.headers.get("Accept") or "application/json").split(","):
        pieces = [p.strip() for p in part.split(";")]
        params = {}
        for p in pieces[1:]:
            if "=" in p:
                k, v = p.split("=", 1)
                params[k.strip()] = v.strip()
        out.append((pieces[0].lower(), params))
    return out


def _negotiate(request: web.Request, *, listing: bool = False, discovery: bool = False) -> str:
    """``json``, ``yaml``, ``table``, ``partial`` or ``aggregated``; 406 when nothing acceptable remains."""
    for media, params in _accepts(request):
        if media in ("application/json", "*/*", "application/*", ""):
            target = params.get("as")
            if target == "Table" and not discovery:
                return "table"
            if target in ("PartialObjectMetadataList", "PartialObjectMetadata") and not discovery:
                return "partial"
            if target == "APIGroupDiscoveryList" and discovery:
                return "aggregated"
            if target is None:
                return "json"
        elif media == "application/yaml" and not discovery:
            return "yaml"
    raise ApiError(
        406, "NotAcceptable", "only the following media types are accepted: application/json, application/yaml"
    )


def _render(
    request: web.Request,
    body: Any,
    status: int = 200,
    warnings: list[str] | None = None,
    encoded: Callable[[], bytes] | None = None,
) -> web.Response:
    """``body`` as the request accepts it; ``encoded`` gives its JSON when it is at hand already."""
    fmt = "json"
    try:
        fmt = _negotiate(request)
    except ApiError:
        fmt = "json"
    if fmt == "yaml":
        headers = [("Warning", f"299 - {gojson.quote(w)}") for w in warnings or []]
        resp = web.Response(body=yaml.safe_dump(body, sort_keys=False).encode(), status=status, headers=headers)
        resp.headers["Content-Type"] = "application/yaml"
        return resp
    return _json(body, status, warnings, encoded=encoded() if encoded is not None else None)


# -- the application ---------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    #: Seconds between the BOOKMARKs of an idle watch with ``allowWatchBookmarks`` (plus one shortly before its
    #: timeout, as observed). None: no BOOKMARK at all but the ``initial-events-end`` one that ``sendInitialEvents``
    #: requires, as a real watch cache for a kind it has seen no event for: clients must not count on them.
    bookmark_interval: float | None = 60.0
    history_size: int = 10_000
    #: The storage's cost model (controller/apiserver/cost.py); None: every write is answered at once.
    cost: CostModel | None = None


def _field_getters(rt: ResourceType) -> dict[str, FieldGetter]:
    fields = metadata_fields()
    if rt.key == NS_KEY:
        fields["status.phase"] = lambda o: str((o.get("status") or {}).get("phase", ""))
    if rt.is_event:
        labels = list(B.EVENT_CORE_FIELD_LABELS)
        for label in labels:
            fields[label] = (lambda lab: (lambda o: B.event_field(o, lab)))(label)
        if rt.group == "events.k8s.io":
            for v1_label, core_label in B.EVENT_FIELD_LABELS.items():
                fields[v1_label] = (lambda lab: (lambda o: B.event_field(o, lab)))(core_label)
    return fields


def _manager(request: web.Request) -> str:
    """The field manager of a write: ``fieldManager``, else (not for apply, which requires it) the
    User-Agent's first segment, as the real server derives it."""
    explicit = request.query.get("fieldManager")
    if explicit:
        return explicit[:128]
    if request.method == "PATCH" and request.content_type == patches.APPLY:
        return ""
    agent = request.headers.get("User-Agent", "")
    return agent.split("/")[0][:128]


class ApiServer:
    """The aiohttp application over a :class:`Store`."""

    def __init__(self, store: Store, config: ServerConfig, rbac: Rbac | None = None) -> None:
        self.store = store
        self.config = config
        self.rbac = rbac  # None: every request is allowed (the kubeconfig's token is an administrator)
        self.address = "127.0.0.1:0"
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self.dispatch)
        self.stopping = asyncio.Event()
        self.committed = asyncio.Event()
        store.listeners.append(lambda _event: self.committed.set())
        self.commits = Committer(config.cost) if config.cost is not None else None
        self.serving: Serving | None = None  # set by start_server (restarts through /_admin/restart)

    async def _commit(self, opts: WriteOptions) -> None:
        """Wait for the storage's commit of this write (only with a cost model; a dry run commits nothing)."""
        if self.commits is not None and not opts.dry_run:
            await self.commits.turn()

    # discovery ----------------------------------------------------------------------------------------

    def _groups(self) -> list[tuple[str, list[str]]]:
        """Served groups (core excluded) in the real server's order: built-in ones, then CRD groups by
        APIService name (``<version>.<group>``)."""
        versions: dict[str, list[str]] = {}
        for group, version, _ in self.store.types:
            if group:
                versions.setdefault(group, [])
                if version not in versions[group]:
                    versions[group].append(version)
        builtin = [g for g in BUILTIN_GROUP_ORDER if g in versions]
        custom = sorted((g for g in versions if g not in BUILTIN_GROUP_ORDER), key=lambda g: f"{versions[g][0]}.{g}")
        return [(g, versions[g]) for g in builtin + custom]

    @staticmethod
    def _group_doc(name: str, versions: list[str]) -> JSON:
        entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
        return {"name": name, "versions": entries, "preferredVersion": entries[0]}

    def _types_of(self, group: str, version: str) -> list[ResourceType]:
        builtin = [
            rt for rt in self.store.types.values() if rt.group == group and rt.version == version and not rt.custom
        ]
        order = {gp: i for i, gp in enumerate(self.store.crd_order)}
        custom = sorted(
            (rt for rt in self.store.types.values() if rt.group == group and rt.version == version and rt.custom),
            key=lambda rt: order.get((rt.group, rt.plural), 0),
        )
        return sorted(builtin, key=lambda rt: rt.plural) + custom

    def _resource_list(self, group: str, version: str) -> JSON | None:
        types = self._types_of(group, version)
        if not types:
            return None
        resources: list[JSON] = []
        for rt in types:
            resources.extend(rt.discovery())
        doc: JSON = {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }
        if not group:
            del doc["apiVersion"]
        return doc

    def _aggregated(self, core: bool) -> JSON:
        groups = (
            [("", ["v1"])]
            if core
            else sorted(
                self._groups(),
                key=lambda g: (
                    g[0] not in BUILTIN_GROUP_ORDER,
                    BUILTIN_GROUP_ORDER.index(g[0]) if g[0] in BUILTIN_GROUP_ORDER else 0,
                    g[0],
                ),
            )
        )
        items = []
        for name, versions in groups:
            entries = []
            for v in versions:
                resources = sorted(
                    (rt.aggregated() for rt in self._types_of(name, v)), key=lambda r: str(r["resource"])
                )
                entries.append({"version": v, "resources": resources, "freshness": "Current"})
            items.append({"metadata": {"name": name} if name else {}, "versions": entries})
        return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items}

    def _openapi_v3(self, request: web.Request, gv_path: str) -> web.Response:
        """The OpenAPI v3 index, and per-group documents with one path per operation kind (collection, item,
        status, cluster-wide list) and a schema per kind: enough for kubectl's apply and explain."""
        gvs: dict[str, list[ResourceType]] = {}
        for rt in self.store.types.values():
            key = f"apis/{rt.group}/{rt.version}" if rt.group else f"api/{rt.version}"
            gvs.setdefault(key, []).append(rt)
        if not gv_path:
            paths = {k: {"serverRelativeURL": f"/openapi/v3/{k}?hash={self.store.rv:0128X}"} for k in sorted(gvs)}
            # The real index handler sets no Content-Type: Go's sniffing labels the JSON text/plain.
            return _text(json.dumps({"paths": paths}, separators=(",", ":")))
        if gv_path not in gvs:
            raise PageNotFound()
        doc_paths: JSON = {}
        schemas: JSON = {}
        for rt in gvs[gv_path]:
            prefix = f"/{gv_path}"
            collection = f"{prefix}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else f"{prefix}/{rt.plural}"
            gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
            param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
            op = {"responses": {"200": {"description": "OK"}}, "x-kubernetes-group-version-kind": gvk}
            doc_paths[collection] = {"get": dict(op, operationId=f"list{rt.kind}", **{"x-kubernetes-action": "list"})}
            doc_paths[collection + "/{name}"] = {
                "get": dict(op, operationId=f"read{rt.kind}", **{"x-kubernetes-action": "get"}),
                "patch": dict(
                    op, operationId=f"patch{rt.kind}", parameters=[param], **{"x-kubernetes-action": "patch"}
                ),
            }
            for sub in rt.subresources():
                doc_paths[collection + "/{name}/" + sub] = {"get": dict(op, operationId=f"read{rt.kind}{sub.title()}")}
            if rt.namespaced:
                doc_paths[f"{prefix}/{rt.plural}"] = {"get": dict(op, operationId=f"list{rt.kind}ForAllNamespaces")}
            name = (
                ".".join(reversed(rt.group.split("."))) + f".{rt.version}.{rt.kind}"
                if rt.group
                else f"io.k8s.api.core.v1.{rt.kind}"
            )
            schemas[name] = dict(rt.schema or {"type": "object"}, **{"x-kubernetes-group-version-kind": [gvk]})
        return _json(
            {
                "openapi": "3.0.0",
                "info": {"title": "Kubernetes", "version": "v1.36.2"},
                "paths": doc_paths,
                "components": {"schemas": schemas},
            }
        )

    def _openapi_v2(self) -> web.Response:
        paths: JSON = {}
        definitions: JSON = {}
        for rt in self.store.types.values():
            base = f"/apis/{rt.group}/{rt.version}" if rt.group else f"/api/{rt.version}"
            collection = f"{base}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else f"{base}/{rt.plural}"
            paths[collection] = {"get": {"operationId": f"list{rt.kind}"}}
            paths[collection + "/{name}"] = {"get": {"operationId": f"read{rt.kind}"}}
            definitions[f"{rt.group or 'core'}.{rt.version}.{rt.kind}"] = rt.schema or {"type": "object"}
        return _json(
            {
                "swagger": "2.0",
                "info": {"title": "Kubernetes", "version": "v1.36.2"},
                "paths": paths,
                "definitions": definitions,
                "parameters": {},
                "security": [{"BearerToken": []}],
                "securityDefinitions": {"BearerToken": {"type": "apiKey", "name": "authorization", "in": "header"}},
            }
        )

    # dispatch -----------------------------------------------------------------------------------------

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authorize(request)
            return await self._dispatch(request)
        except ApiError as err:
            return _error(err)
        except SelectorError as exc:
            return _error(bad_request(str(exc)))
        except PageNotFound:
            return _text("404 page not found\n", 404)

    def _authorize(self, request: web.Request) -> None:
        if self.rbac is None:
            return
        user = self.rbac.user_of(request.headers.get("Authorization", ""))
        if user is None:
            return
        attrs = attributes(request.method, request.path, dict(request.query))
        if attrs is not None:
            self.rbac.authorize(user, attrs)

    def _create_authorizer(self, request: web.Request) -> Callable[[], None] | None:
        """For a PUT: the check a create on update needs beside the ``update`` one (None: all allowed)."""
        if self.rbac is None:
            return None
        rbac, user = self.rbac, self.rbac.user_of(request.headers.get("Authorization", ""))
        attrs = attributes(request.method, request.path, dict(request.query))
        if user is None or attrs is None:
            return None
        return lambda: rbac.authorize_create_on_update(user, attrs)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if not parts:
            return _json(
                {
                    "paths": [
                        "/api",
                        "/api/v1",
                        "/apis",
                        "/healthz",
                        "/livez",
                        "/openapi/v2",
                        "/openapi/v3",
                        "/readyz",
                        "/version",
                    ]
                }
            )
        head = parts[0]
        if head == "version" and len(parts) == 1:
            return _json(KUBE_VERSION)
        if head in ("healthz", "livez", "readyz") and len(parts) == 1:
            return _text("ok")
        if head == "openapi" and parts[1:2] == ["v3"]:
            return self._openapi_v3(request, "/".join(parts[2:]))
        if head == "openapi" and parts[1:] == ["v2"]:
            return self._openapi_v2()
        if head == "_admin":
            return await self._admin(request, parts[1:])
        if head == "api":
            if len(parts) == 1:
                if _negotiate(request, discovery=True) == "aggregated":
                    return _json(self._aggregated(core=True), content_type=AGGREGATED)
                return _json(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.address}],
                    }
                )
            group, version, rest = "", parts[1], parts[2:]
        elif head == "apis":
            if len(parts) == 1:
                if _negotiate(request, discovery=True) == "aggregated":
                    return _json(self._aggregated(core=False), content_type=AGGREGATED)
                docs = [self._group_doc(g, vs) for g, vs in self._groups()]
                return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": docs})
            if len(parts) == 2:
                groups = dict(self._groups())
                if parts[1] not in groups:
                    raise PageNotFound()
                return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(parts[1], groups[parts[1]])})
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise PageNotFound()
        if not rest:
            doc = self._resource_list(group, version)
            if doc is None:
                raise PageNotFound()
            return _json(doc)
        return await self._resource(request, group, version, rest)

    async def _resource(self, request: web.Request, group: str, version: str, rest: list[str]) -> web.StreamResponse:
        query = request.query
        watch = query.get("watch", "") in ("true", "1")
        if rest[0] == "watch":
            watch, rest = True, rest[1:]
            if not rest:
                raise PageNotFound()
        ns: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            inner = self.store.find(group, version, rest[2])
            if inner is not None and inner.namespaced:
                ns, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise PageNotFound()
        rt = self.store.find(group, version, rest[0])
        if rt is None:
            raise PageNotFound()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (rt.namespaced and name is not None and ns is None) or (not rt.namespaced and ns is not None):
            raise PageNotFound()
        method = request.method
        obj_ns = ns or ""
        opts = WriteOptions(
            manager=_manager(request),
            dry_run=self._dry_run(query.getall("dryRun", [])),
            validation=query.get("fieldValidation", "Warn") or "Warn",
            force=query.get("force", "") in ("true", "1"),
        )
        if name is None:
            if method == "GET":
                predicate = combine(
                    parse_label_selector(query.get("labelSelector")),
                    parse_field_selector(query.get("fieldSelector"), _field_getters(rt)),
                )
                if watch:
                    return await self._watch(request, rt, ns, predicate)
                return await self._list(request, rt, ns, predicate)
            if method == "POST":
                if ns is None and rt.namespaced:
                    raise PageNotFound()
                body = await self._body(request, rt, opts)
                await self._commit(opts)
                out = self.store.create(rt, obj_ns, body, opts)
                return self._render_obj(request, rt, out.obj, 201, out.warnings)
            if method == "DELETE" and "deletecollection" in rt.verbs:
                return await self._delete_collection(request, rt, ns, opts)
            raise ApiError(
                405, "MethodNotAllowed", "the server does not allow this method on the requested resource", details()
            )
        if sub is not None and sub not in rt.subresources():
            raise not_found(rt.group, rt.plural, name)
        if watch:
            predicate = parse_field_selector(f"metadata.name={name}")
            return await self._watch(request, rt, ns, predicate)
        if method == "GET":
            obj = self.store.get(rt, obj_ns, name)
            fmt = _negotiate(request)
            if fmt == "table":
                return _json(to_table(rt, [obj], obj["metadata"]["resourceVersion"], query.get("includeObject", "")))
            if fmt == "partial":
                return _json(
                    {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
                )
            return self._render_obj(request, rt, obj)
        if method == "POST" and sub is None:  # the real server treats it as a create of the collection
            body = await self._body(request, rt, opts)
            await self._commit(opts)
            out = self.store.create(rt, obj_ns, body, opts)
            return self._render_obj(request, rt, out.obj, 201, out.warnings)
        if method == "PUT":
            body = await self._body(request, rt, opts)
            opts.authorize_create = self._create_authorizer(request)
            await self._commit(opts)
            out = self.store.replace(rt, obj_ns, name, body, opts, sub)
            return self._render_obj(request, rt, out.obj, 201 if out.created else 200, out.warnings)
        if method == "PATCH":
            content_type = request.content_type
            body = await self._patch_body(request, content_type)
            await self._commit(opts)
            out = self.store.patch(rt, obj_ns, name, content_type, body, opts, sub)
            return self._render_obj(request, rt, out.obj, 201 if out.created else 200, out.warnings)
        if method == "DELETE" and sub is None:
            options = await self._delete_body(request)
            if options.get("dryRun"):
                opts.dry_run = self._dry_run(options["dryRun"])
            await self._commit(opts)
            obj, gone = self.store.delete(rt, obj_ns, name, options, opts)
            if not gone:
                return self._render_obj(request, rt, obj)
            return _json(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": details(name, rt.group, rt.plural, uid=obj["metadata"]["uid"]),
                }
            )
        raise ApiError(
            405, "MethodNotAllowed", "the server does not allow this method on the requested resource", details()
        )

    def _render_obj(
        self, request: web.Request, rt: ResourceType, obj: JSON, status: int = 200, warnings: list[str] | None = None
    ) -> web.Response:
        """An object answered; a stored one is encoded once for its answer, its watch event and later reads."""
        stored = rt.group != "events.k8s.io" and self.store.is_stored(rt, obj)
        return _render(request, obj, status, warnings, (lambda: self.store.encoded(obj)) if stored else None)

    @staticmethod
    def _dry_run(values: Any) -> bool:
        values = list(values) if isinstance(values, list | tuple) else [values]
        values = [v for v in values if v]
        if not values:
            return False
        bad = [v for v in values if v != "All"]
        if bad:
            err = invalid_error(
                "meta.k8s.io", "CreateOptions", "", [forbidden("dryRun", f"unsupported value {bad[0]!r}")]
            )
            raise err
        return True

    # bodies ---------------------------------------------------------------------------------------------

    async def _body(self, request: web.Request, rt: ResourceType, opts: WriteOptions) -> Any:
        raw = await request.read()
        ctype = request.content_type or "application/json"
        if ctype == "application/vnd.kubernetes.protobuf":
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the embedded API server does not decode protobuf: send application/json or application/yaml "
                "(kubectl create <kind> sends protobuf; kubectl apply -f sends JSON)",
            )
        if ctype not in ("application/json", "application/yaml"):
            raise unsupported_media_type(BODY_TYPES)
        if ctype == "application/yaml":
            try:
                data = gojson.normalize_numbers(yaml.safe_load(raw)) if raw.strip() else None
            except yaml.YAMLError as exc:
                raise bad_request(f"the object provided is unrecognized (must be of type {rt.kind}): {exc}") from None
            opts.raw = gojson.dumps(data) if data is not None else b""
            if data is None:
                raise bad_request(
                    f"the object provided is unrecognized (must be of type {rt.kind}): couldn't get version/kind; "
                    "json parse error: unexpected end of JSON input (<empty>)"
                )
            return data
        opts.raw = raw
        try:
            return gojson.loads(raw)
        except gojson.JSONSyntaxError as exc:
            text = raw.decode("utf-8", errors="replace")
            if not text:
                summary = "<empty>"
            elif text.startswith("{"):
                summary = text if len(text) <= 30 else text[:30] + " ..."
            else:
                summary = raw[:30].hex() + (" ..." if len(raw) > 30 else "")
            raise bad_request(
                f"the object provided is unrecognized (must be of type {rt.kind}): couldn't get version/kind; "
                f"json parse error: {exc} ({summary})"
            ) from None

    @staticmethod
    async def _patch_body(request: web.Request, content_type: str) -> Any:
        raw = await request.read()
        if content_type == patches.APPLY:
            try:
                return gojson.normalize_numbers(yaml.safe_load(raw))
            except yaml.YAMLError as exc:
                raise bad_request(f"error decoding YAML: {exc}") from None
        if content_type not in (patches.MERGE, patches.JSON_PATCH, patches.STRATEGIC):
            return None  # the store answers 415
        try:
            return gojson.loads(raw)
        except gojson.JSONSyntaxError as exc:
            raise bad_request(f"error decoding patch: {exc}") from None

    async def _delete_body(self, request: web.Request) -> JSON:
        raw = await request.read()
        options: JSON = {}
        if raw.strip():
            try:
                loaded = gojson.loads(raw)
            except gojson.JSONSyntaxError as exc:
                raise bad_request(f"error decoding DeleteOptions: {exc}") from None
            if isinstance(loaded, dict):
                options = loaded
        query = request.query
        if "propagationPolicy" in query and "propagationPolicy" not in options:
            options["propagationPolicy"] = query["propagationPolicy"]
        if "orphanDependents" in query and "orphanDependents" not in options:
            options["orphanDependents"] = query["orphanDependents"] == "true"
        if "dryRun" in query and "dryRun" not in options:
            options["dryRun"] = query.getall("dryRun")
        pre = {k: query[k] for k in ("uid", "resourceVersion") if k in query}
        if pre and "preconditions" not in options:
            options["preconditions"] = pre
        return options

    # lists ----------------------------------------------------------------------------------------------

    def _list_doc(self, rt: ResourceType, items: list[JSON], rv: int, cont: str = "", remaining: int = 0) -> JSON:
        meta: JSON = {"resourceVersion": str(rv)}
        if rt.custom:
            meta = {"continue": cont, "resourceVersion": str(rv)}
        elif cont:
            meta["continue"] = cont
        if remaining:
            meta["remainingItemCount"] = remaining
        if rt.custom:
            shown = items
        else:
            shown = [
                {k: v for k, v in self.store.view(rt, o).items() if k not in ("apiVersion", "kind")} for o in items
            ]
        return {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta, "items": shown}

    def _encode_list(self, doc: JSON) -> bytes:
        """A list of stored objects, from their cached encodings."""
        head = gojson.dumps({k: v for k, v in doc.items() if k != "items"})
        items = b",".join(self.store.encoded(o) for o in doc["items"])
        return head[:-1] + b',"items":[' + items + b"]}"

    @staticmethod
    def _parse_rv(value: str, for_watch: bool = False) -> None:
        try:
            if int(value) < 0:
                raise ValueError
        except ValueError:
            quoted = gojson.quote(value)
            detail = f"resourceVersion: Invalid value: {quoted}: strconv.ParseUint: parsing {quoted}: invalid syntax"
            if for_watch:
                raise internal(detail) from None
            raise bad_request(f"invalid resource version: {detail}") from None

    async def _list(self, request: web.Request, rt: ResourceType, ns: str | None, predicate: Any) -> web.Response:
        query = request.query
        rv = query.get("resourceVersion")
        match = query.get("resourceVersionMatch") or None
        if match and not rv:
            err = forbidden(
                "resourceVersionMatch", "resourceVersionMatch is forbidden unless resourceVersion is provided"
            )
            raise invalid_error("meta.k8s.io", "ListOptions", "", [err])
        if match not in (None, "Exact", "NotOlderThan"):
            raise invalid_error(
                "meta.k8s.io", "ListOptions", "", [forbidden("resourceVersionMatch", f"unsupported value {match!r}")]
            )
        if rv:
            self._parse_rv(rv)
        try:
            limit = int(query.get("limit", "0") or 0)
        except ValueError:
            raise bad_request(f"limit: Invalid value: {query.get('limit')!r}") from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LIST_WAIT
        while True:
            try:
                result = self.store.list_page(
                    rt, ns, predicate, resource_version=rv, match=match, limit=limit, cont=query.get("continue")
                )
                break
            except TooLargeResourceVersion as exc:
                left = deadline - loop.time()
                if left <= 0:
                    raise ApiError(
                        504,
                        "Timeout",
                        f"Timeout: Too large resource version: {exc.wanted}, current: {exc.current}",
                        {
                            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                            "retryAfterSeconds": 1,
                        },
                    ) from None
                self.committed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.committed.wait(), timeout=min(left, 0.5))
        fmt = _negotiate(request, listing=True)
        items = [self.store.view(rt, o) for o in result.items] if rt.group == "events.k8s.io" else result.items
        if fmt == "table":
            return _json(to_table(rt, items, str(result.rv), query.get("includeObject", "")))
        if fmt == "partial":
            return _json(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": {"resourceVersion": str(result.rv)},
                    "items": [
                        {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}
                        for o in items
                    ],
                }
            )
        doc = self._list_doc(rt, result.items, result.rv, result.cont, result.remaining)
        if not rt.custom or not result.items:
            return _render(request, doc)
        at_rest = all(self.store.is_stored(rt, o) for o in result.items)
        return _render(request, doc, encoded=(lambda: self._encode_list(doc)) if at_rest else None)

    async def _delete_collection(
        self, request: web.Request, rt: ResourceType, ns: str | None, opts: WriteOptions
    ) -> web.Response:
        query = request.query
        predicate = combine(
            parse_label_selector(query.get("labelSelector")),
            parse_field_selector(query.get("fieldSelector"), _field_getters(rt)),
        )
        options = await self._delete_body(request)
        if options.get("dryRun"):
            opts.dry_run = self._dry_run(options["dryRun"])
        self.store.delete_options(options)
        await self._commit(opts)
        items = self.store.list_objects(rt, ns, predicate)
        rv = self.store.rv
        deleted = []
        for o in items:
            m = o["metadata"]
            try:
                obj, _ = self.store.delete(rt, m.get("namespace", ""), m["name"], options, opts)
            except ApiError as err:
                if err.code == 404:
                    continue
                raise
            deleted.append(o if rt.group != "events.k8s.io" else obj)
        return _render(request, self._list_doc(rt, deleted, rv))

    # watches --------------------------------------------------------------------------------------------

    async def _watch(
        self, request: web.Request, rt: ResourceType, ns: str | None, predicate: Any
    ) -> web.StreamResponse:
        query = request.query
        rv = query.get("resourceVersion")
        if rv not in (None, ""):
            self._parse_rv(str(rv), for_watch=True)
        timeout = float(query.get("timeoutSeconds", "0") or 0)
        bookmarks = query.get("allowWatchBookmarks", "") in ("true", "1")
        initial_events = query.get("sendInitialEvents", "") in ("true", "1")
        watcher, sent_initial = self.store.watch(rt, ns, predicate, rv, initial=True if initial_events else None)
        interval = self.config.bookmark_interval
        if bookmarks and sent_initial and (initial_events or (rv in (None, "") and interval is not None)):
            watcher.queue.put_nowait(self._bookmark(rt, {"k8s.io/initial-events-end": "true"}))
        response = web.StreamResponse(status=200)
        response.headers["Content-Type"] = "application/json"
        response.enable_chunked_encoding()
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout if timeout > 0 else None
        periodic = bookmarks and interval is not None
        next_mark = start + interval if periodic and interval is not None else None
        pre_timeout = deadline - min(PRE_TIMEOUT_BOOKMARK, timeout / 2) if periodic and deadline is not None else None
        try:
            await response.prepare(request)
            while not self.stopping.is_set():
                now = loop.time()
                if deadline is not None and now >= deadline:
                    break
                due = [t for t in (next_mark, pre_timeout, deadline) if t is not None]
                wait = max(0.0, min(due) - now) if due else None
                try:
                    # Queued events first: a BOOKMARK says "every event up to this resourceVersion has been
                    # sent", so one written while events wait in the queue would let a client that resumes
                    # from it skip them. (On Python 3.11, wait_for with a zero timeout times out even when
                    # the queue is not empty: this happened after a write to a slow client outlasted the
                    # pre-timeout mark, and a capture lost four Dispatcher creations.)
                    if not watcher.queue.empty():
                        item = watcher.queue.get_nowait()
                    else:
                        item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if not watcher.queue.empty():
                        continue  # an event arrived as the wait ended: it goes before any BOOKMARK
                    now = loop.time()
                    if pre_timeout is not None and now >= pre_timeout:
                        pre_timeout = None
                        await response.write(self._bookmark(rt))
                    elif next_mark is not None and interval is not None and now >= next_mark:
                        next_mark = now + interval
                        await response.write(self._bookmark(rt))
                    continue
                if item is None:
                    break
                chunk = [item]
                while not watcher.queue.empty() and len(chunk) < 256:
                    more = watcher.queue.get_nowait()
                    if more is None:
                        watcher.queue.put_nowait(None)
                        break
                    chunk.append(more)
                await response.write(b"".join(chunk))
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            self.store.unwatch(watcher)
        return response

    def _bookmark(self, rt: ResourceType, annotations: dict[str, str] | None = None) -> bytes:
        meta: JSON = {"resourceVersion": str(self.store.rv), "creationTimestamp": None}
        if annotations:
            meta["annotations"] = annotations
        return (
            gojson.dumps(
                {"type": "BOOKMARK", "object": {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta}}
            )
            + b"\n"
        )

    async def _admin(self, request: web.Request, rest: list[str]) -> web.Response:
        if rest == ["fail"] and request.method == "POST":
            body = json.loads(await request.read())
            self.store.inject_failures(str(body["resource"]), int(body.get("count", 1)), int(body.get("code", 500)))
            return _json({"ok": True})
        if rest == ["close-watches"] and request.method == "POST":
            return _json({"closed": self.store.close_watches()})
        if rest == ["restart"] and request.method == "POST" and self.serving is not None:
            raw = await request.read()
            body = json.loads(raw) if raw.strip() else {}
            outage = float(body.get("outageSeconds", 0))
            self.serving.restart_later(outage)
            return _json({"restarting": True, "outageSeconds": outage})
        if rest == ["stats"]:
            return _json(
                {
                    "resourceVersion": self.store.rv,
                    "history": len(self.store.history),
                    "watchers": sum(len(w) for w in self.store.watchers.values()),
                    "watchCacheStart": self.store.cache_start,
                    "restarts": self.serving.restarts if self.serving is not None else 0,
                }
            )
        raise PageNotFound()


class Serving:
    """The listening side of a running :class:`ApiServer`: its aiohttp runner and site, on a fixed host and port.

    :meth:`restart` is a restart of kube-apiserver that keeps etcd: the server stops serving (every watch ends,
    every connection is dropped, new ones are refused), stays down ``outage`` seconds, then serves again on the
    same host and port with the same objects and resourceVersion counter, its watch cache starting again at the
    current resourceVersion (:meth:`Store.restart_watch_cache`), so a watch resumed from before gets 410."""

    def __init__(self, server: ApiServer, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.ssl_context = ssl_context
        self.restarts = 0
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        # handler_cancellation: a watch whose client went away is cancelled at once, so its watcher is dropped.
        runner = web.AppRunner(
            self.server.app, access_log=None, handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True, ssl_context=self.ssl_context)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        sockets = cast(asyncio.Server, site._server).sockets
        self.port = sockets[0].getsockname()[1]  # the port bound the first time is kept for every restart
        self.server.address = f"{self.host}:{self.port}"
        self.server.stopping.clear()
        self._runner = runner

    async def _close(self) -> None:
        self.server.stopping.set()
        self.server.store.close_watches()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def stop(self) -> None:
        for task in list(self._pending):
            task.cancel()
        async with self._lock:
            await self._close()

    async def restart(self, outage: float = 0.0) -> None:
        async with self._lock:
            await self._close()
            await asyncio.sleep(max(0.0, outage))
            self.server.store.restart_watch_cache()
            await self.open()
            self.restarts += 1
        logger.info("embedded API server restarted after %.1fs, watch cache from %s", outage, self.server.store.rv)

    def restart_later(self, outage: float) -> None:
        """A restart in a moment (asked for by a request, whose answer goes out first)."""

        async def later() -> None:
            await asyncio.sleep(0.05)
            await self.restart(outage)

        task = asyncio.get_running_loop().create_task(later())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


def load_crds(store: Store, crd_dir: str | Path | None) -> int:
    """Create and establish every CustomResourceDefinition found in ``crd_dir/*.yaml`` (sorted by file name),
    as if they had been installed before the server started."""
    if crd_dir is None:
        return 0
    from controller.apiserver.crd import established_status
    from controller.apiserver.store import now

    crd_type = store.types[CRD_KEY]
    count = 0
    for path in sorted(Path(crd_dir).glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                created = store.create(crd_type, "", gojson.normalize_numbers(doc), WriteOptions("kube-apiserver")).obj
                store.controller_update(
                    crd_type,
                    created,
                    dict(created, status=established_status(created, now())),
                    "status",
                    "kube-apiserver",
                )
                count += 1
    return count


def kubeconfig(url: str, namespace: str = "default", ca_pem: bytes | None = None) -> JSON:
    """A kubeconfig for the server at ``url``; ``ca_pem``: the certificate an https server is verified with."""
    cluster: JSON = {"server": url}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cfm-embedded", "cluster": cluster}],
        "users": [{"name": "cfm-embedded", "user": {"token": "cfm-embedded"}}],
        "contexts": [
            {
                "name": "cfm-embedded",
                "context": {"cluster": "cfm-embedded", "user": "cfm-embedded", "namespace": namespace},
            }
        ],
        "current-context": "cfm-embedded",
        "preferences": {},
    }


@dataclass
class ApiServerHandle:
    """A running embedded API server (in its own thread and event loop)."""

    url: str
    kubeconfig_path: Path
    store: Store
    _loop: asyncio.AbstractEventLoop
    _thread: threading.Thread
    _stop: Callable[[], Coroutine[Any, Any, None]]
    _tmpdir: str | None = None
    _restart: Callable[[float], Coroutine[Any, Any, None]] | None = None
    _stopped: bool = field(default=False)
    #: The storage's commits (None without a cost model): how many ran, for how many writes.
    commits: Committer | None = None
    #: With TLS: the server's self-signed certificate (PEM), which is its own CA.
    ca_pem: bytes | None = None

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop (the store is not thread-safe) and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def inject_failures(self, plural: str, count: int, code: int = 500) -> None:
        self.call(lambda: self.store.inject_failures(plural, count, code))

    def close_watches(self) -> int:
        return self.call(self.store.close_watches)

    def restart(self, outage_seconds: float = 0.0, *, wait: bool = True) -> concurrent.futures.Future[None]:
        """Restart the server in place, as kube-apiserver restarts over the same etcd (:meth:`Serving.restart`):
        every connection and watch is dropped, nothing is served for ``outage_seconds``, then the same URL serves
        the same objects and resourceVersions, and a watch resumed from a resourceVersion older than the restart
        gets ``ERROR 410 Expired``. Blocks until it serves again unless ``wait`` is false; the returned future
        is done then (``await asyncio.wrap_future(handle.restart(2, wait=False))`` from a coroutine)."""
        if self._restart is None or self._stopped:
            raise RuntimeError("the embedded API server is not running")
        future = asyncio.run_coroutine_threadsafe(self._restart(outage_seconds), self._loop)
        if wait:
            future.result(timeout=outage_seconds + 30)
        return future

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> ApiServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    crd_dir: str | Path | None = None,
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    kubeconfig_path: str | Path | None = None,
    bookmark_interval: float | None = 60.0,
    history_size: int = 10_000,
    rbac: Rbac | None = None,
    cost: CostModel | None = None,
    namespace_delay: float = NAMESPACE_DELAY,
    tls: bool = False,
) -> ApiServerHandle:
    """Start the server in a daemon thread; returns once it accepts connections. With ``rbac``, requests
    bearing one of its service-account tokens are authorized by its rules (:mod:`controller.apiserver.authz`).

    ``bookmark_interval`` is how often an idle watch with ``allowWatchBookmarks`` gets a BOOKMARK (the real server:
    about a minute, but it promises none; None: none at all, not even before the timeout); ``history_size`` is
    the window of events watches can resume from; ``cost``: the storage's cost model
    (:mod:`controller.apiserver.cost`), None for none; ``namespace_delay``: seconds from a namespace's deletion to
    the namespace controller's first pass over it (:data:`controllers.NAMESPACE_DELAY`, as a real cluster takes);
    ``tls``: serve HTTPS with a self-signed certificate made now (:mod:`controller.apiserver.tls`), which the
    kubeconfig carries as its CA."""
    if namespace_delay < 0:
        raise ValueError(f"namespace_delay must not be negative, got {namespace_delay}")
    result: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    config = ServerConfig(bookmark_interval=bookmark_interval, history_size=history_size, cost=cost)
    tmpdir: str | None = None
    if kubeconfig_path is None or tls:
        tmpdir = tempfile.mkdtemp(prefix="cfm-apiserver-")
    ca_pem: bytes | None = None
    ssl_context = None
    if tls:
        from controller.apiserver import tls as tlsmod

        assert tmpdir is not None
        cert = tlsmod.self_signed(host)
        ca_pem = cert.cert_pem
        ssl_context = tlsmod.server_context(cert, Path(tmpdir))

    async def setup() -> None:
        store = Store(history_size=history_size)
        load_crds(store, crd_dir)
        Controllers(store, asyncio.get_running_loop(), namespace_delay=namespace_delay)
        server = ApiServer(store, config, rbac)
        serving = server.serving = Serving(server, host, port, ssl_context)
        await serving.open()
        result.update(
            store=store, port=serving.port, stop=serving.stop, restart=serving.restart, commits=server.commits
        )

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(setup())
        except BaseException as exc:
            result["error"] = exc
            started.set()
            loop.close()
            return
        started.set()
        try:
            loop.run_forever()
        finally:
            # A connection the shutdown left open, or closed with data still to send to a client that no longer
            # reads (a watch's: close() waits for the buffer to drain, for ever), is aborted here, not left to
            # the collector: its ResourceWarning surfaced in whichever test ran next.
            for transport in list(getattr(loop, "_transports", {}).values()):
                if transport is not None:
                    transport.abort()
            for _ in range(3):
                loop.run_until_complete(asyncio.sleep(0))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="cfm-apiserver", daemon=True)
    thread.start()
    started.wait(timeout=60)
    if "error" in result:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
        raise RuntimeError(f"embedded API server failed to start: {result['error']}") from result["error"]
    url = f"{'https' if tls else 'http'}://{host}:{result['port']}"
    if kubeconfig_path is None:
        assert tmpdir is not None
        kubeconfig_path = Path(tmpdir) / "kubeconfig"
    path = Path(kubeconfig_path)
    path.write_text(yaml.safe_dump(kubeconfig(url, ca_pem=ca_pem)))
    return ApiServerHandle(
        url,
        path,
        result["store"],
        loop,
        thread,
        result["stop"],
        tmpdir,
        result["restart"],
        commits=result["commits"],
        ca_pem=ca_pem,
    )
