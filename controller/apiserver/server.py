"""HTTP front of the embedded API server: routing, discovery, tables, watch streams, and the thread runner.

The server runs an aiohttp application on its own event loop in a daemon thread (:func:`start_server`), so a
test, the demo or the CLI can use it while running Kopf, the capture agents or kubectl against it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from aiohttp import web

from controller.apiserver import patches
from controller.apiserver.authz import Rbac, attributes
from controller.apiserver.resources import JSON, ResourceType
from controller.apiserver.selectors import SelectorError, combine, parse_field_selector, parse_label_selector
from controller.apiserver.store import CRD_KEY, ApiError, Store, bad_request

logger = logging.getLogger(__name__)
T = TypeVar("T")

KUBE_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-cfm-embedded",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_dumps(body), status=status, content_type="application/json", headers=headers)


def _error(err: ApiError) -> web.Response:
    return _json(err.status(), status=err.code)


def _not_found_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


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


def _columns(rt: ResourceType) -> list[JSON]:
    cols = rt.printer_columns or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    return cols


def to_table(rt: ResourceType, items: list[JSON], rv: str, include: str) -> JSON:
    cols = _columns(rt)
    definitions = [
        {"name": "Name", "type": "string", "format": "name", "description": "Name of the object", "priority": 0}
    ]
    for col in cols:
        definitions.append(
            {
                "name": col["name"],
                "type": col.get("type", "string"),
                "format": col.get("format", ""),
                "description": col.get("description", ""),
                "priority": col.get("priority", 0),
            }
        )
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for col in cols:
            value = jsonpath(obj, str(col.get("jsonPath", "")))
            if col.get("type") == "date" and isinstance(value, str):
                value = human_duration(value)
            elif isinstance(value, (dict, list)):
                value = json.dumps(value, separators=(",", ":"))
            cells.append(value)
        row: JSON = {"cells": cells}
        if include == "Object":
            row["object"] = obj
        elif include != "None":
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


def _wants_table(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    first = accept.split(",")[0]
    return "as=Table" in first


# -- the application ---------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    bookmark_interval: float = 5.0
    history_size: int = 10_000


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

    # discovery ----------------------------------------------------------------------------------------

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for group, version, _ in self.store.types:
            versions = groups.setdefault(group, [])
            if version not in versions:
                versions.append(version)
        return groups

    def _group_doc(self, name: str, versions: list[str]) -> JSON:
        entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
        return {"name": name, "versions": entries, "preferredVersion": entries[0]}

    def _resource_list(self, group: str, version: str) -> JSON | None:
        types = [rt for (g, v, _), rt in sorted(self.store.types.items()) if g == group and v == version]
        if not types:
            return None
        resources: list[JSON] = []
        for rt in types:
            resources.extend(rt.discovery())
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _openapi_v3(self, gv_path: str) -> web.Response:
        """Just enough OpenAPI v3 for kubectl: it looks for a ``fieldValidation`` parameter on each kind's
        PATCH operation and, finding it, leaves validation to the server (``kubectl apply --validate=strict``).
        No schemas are published: kubectl then computes apply patches from its compiled-in types."""
        gvs: dict[str, list[ResourceType]] = {}
        for rt in self.store.types.values():
            key = f"apis/{rt.group}/{rt.version}" if rt.group else f"api/{rt.version}"
            gvs.setdefault(key, []).append(rt)
        if not gv_path:
            paths = {k: {"serverRelativeURL": f"/openapi/v3/{k}?hash={self.store.rv}"} for k in sorted(gvs)}
            return _json({"paths": paths})
        if gv_path not in gvs:
            raise _not_found_path()
        doc_paths: JSON = {}
        for rt in gvs[gv_path]:
            base = f"/{gv_path}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced else f"/{gv_path}/{rt.plural}"
            gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
            param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
            doc_paths[base + "/{name}"] = {
                "patch": {
                    "operationId": f"patch{rt.kind}",
                    "parameters": [param],
                    "responses": {"200": {"description": "OK"}},
                    "x-kubernetes-action": "patch",
                    "x-kubernetes-group-version-kind": gvk,
                }
            }
        return _json(
            {
                "openapi": "3.0.0",
                "info": {"title": "Kubernetes", "version": "v1.32.0"},
                "paths": doc_paths,
                "components": {"schemas": {}},
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

    def _authorize(self, request: web.Request) -> None:
        if self.rbac is None:
            return
        user = self.rbac.user_of(request.headers.get("Authorization", ""))
        if user is None:
            return
        attrs = attributes(request.method, request.path, dict(request.query))
        if attrs is not None:
            self.rbac.authorize(user, attrs)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if not parts:
            return _json({"paths": ["/api", "/api/v1", "/apis", "/version", "/healthz"]})
        head = parts[0]
        if head == "version":
            return _json(KUBE_VERSION)
        if head in ("healthz", "livez", "readyz"):
            return web.Response(text="ok")
        if head == "openapi" and len(parts) >= 2 and parts[1] == "v3":
            return self._openapi_v3("/".join(parts[2:]))
        if head == "_admin":
            return await self._admin(request, parts[1:])
        if head == "api":
            if len(parts) == 1:
                return _json(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.address}],
                    }
                )
            group, version, rest = "", parts[1], parts[2:]
        elif head == "apis":
            groups = self._groups()
            if len(parts) == 1:
                docs = [self._group_doc(g, vs) for g, vs in groups.items() if g]
                return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": docs})
            if len(parts) == 2:
                if parts[1] not in groups:
                    raise _not_found_path()
                return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(parts[1], groups[parts[1]])})
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise _not_found_path()
        if not rest:
            doc = self._resource_list(group, version)
            if doc is None:
                raise _not_found_path()
            return _json(doc)
        return await self._resource(request, group, version, rest)

    async def _resource(self, request: web.Request, group: str, version: str, rest: list[str]) -> web.StreamResponse:
        query = request.query
        watch = query.get("watch", "") in ("true", "1")
        if rest[0] == "watch":
            watch, rest = True, rest[1:]
        ns: str | None = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            inner = self.store.find(group, version, rest[2])
            if inner is not None and inner.namespaced:
                ns, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise _not_found_path()
        rt = self.store.find(group, version, rest[0])
        if rt is None:
            raise _not_found_path()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if (rt.namespaced and name is not None and ns is None) or (not rt.namespaced and ns is not None):
            raise _not_found_path()
        if sub is not None and not (sub == "status" and rt.status_subresource):
            raise _not_found_path()
        if "dryRun" in query:
            raise bad_request("dryRun is not supported by the embedded API server")
        method = request.method
        obj_ns = ns or ""
        strict = query.get("fieldValidation", "") == "Strict"
        if name is None:
            if method == "GET":
                predicate = combine(
                    parse_label_selector(query.get("labelSelector")), parse_field_selector(query.get("fieldSelector"))
                )
                if watch:
                    return await self._watch(request, rt, ns, predicate)
                return self._list(request, rt, ns, predicate)
            if method == "POST":
                if ns is None and rt.namespaced:
                    raise _not_found_path()
                obj, pruned = self.store.create(rt, obj_ns, await self._body(request), strict)
                return _json(obj, 201, self._warnings(pruned))
            if method == "DELETE":
                predicate = combine(
                    parse_label_selector(query.get("labelSelector")), parse_field_selector(query.get("fieldSelector"))
                )
                options = await self._body(request, optional=True)
                items = self.store.list_objects(rt, ns, predicate)
                deleted = [
                    self.store.delete(rt, o["metadata"].get("namespace", ""), o["metadata"]["name"], options)
                    for o in items
                ]
                return _json(self._list_doc(rt, deleted))
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        if watch:
            predicate = combine(parse_field_selector(f"metadata.name={name}"))
            return await self._watch(request, rt, ns, predicate)
        if method == "GET":
            obj = self.store.get(rt, obj_ns, name)
            if _wants_table(request):
                return _json(to_table(rt, [obj], obj["metadata"]["resourceVersion"], query.get("includeObject", "")))
            return _json(obj)
        if method == "PUT":
            obj, pruned = self.store.replace(rt, obj_ns, name, await self._body(request), sub, strict)
            return _json(obj, headers=self._warnings(pruned))
        if method == "PATCH":
            obj, pruned = self.store.patch(
                rt, obj_ns, name, request.content_type, await self._body(request), sub, strict
            )
            return _json(obj, headers=self._warnings(pruned))
        if method == "DELETE" and sub is None:
            options = await self._body(request, optional=True)
            if isinstance(options, dict) and "preconditions" not in options:
                pre = {k: query[k] for k in ("uid", "resourceVersion") if k in query}
                if pre:
                    options["preconditions"] = pre
            obj = self.store.delete(rt, obj_ns, name, options)
            if rt.custom or obj["metadata"].get("deletionTimestamp"):
                return _json(obj)
            return _json(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {"name": name, "group": rt.group, "kind": rt.plural, "uid": obj["metadata"]["uid"]},
                }
            )
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    @staticmethod
    def _warnings(pruned: list[str]) -> dict[str, str] | None:
        if not pruned:
            return None
        return {"Warning": ", ".join(f'299 - "unknown field \\"{p}\\""' for p in pruned)}

    @staticmethod
    async def _body(request: web.Request, optional: bool = False) -> Any:
        raw = await request.read()
        if not raw.strip():
            if optional:
                return {}
            raise bad_request("the body of the request is empty")
        try:
            if request.content_type in ("application/yaml", patches.APPLY):
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise bad_request(f"the body of the request could not be decoded: {exc}") from exc

    def _list_doc(self, rt: ResourceType, items: list[JSON], cont: str | None = None, remaining: int = 0) -> JSON:
        meta: JSON = {"resourceVersion": str(self.store.rv)}
        if cont:
            meta["continue"] = cont
            meta["remainingItemCount"] = remaining
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": meta, "items": items}

    def _list(self, request: web.Request, rt: ResourceType, ns: str | None, predicate: Any) -> web.Response:
        items = self.store.list_objects(rt, ns, predicate)
        query = request.query
        token = query.get("continue")
        if token:
            try:
                after = tuple(json.loads(base64.urlsafe_b64decode(token.encode())))
            except (ValueError, TypeError) as exc:
                raise ApiError(410, "Expired", "the provided continue parameter is too old or invalid") from exc
            items = [o for o in items if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > after]
        cont: str | None = None
        remaining = 0
        limit = int(query.get("limit", "0") or 0)
        if 0 < limit < len(items):
            remaining = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]
            cont = base64.urlsafe_b64encode(_dumps([last.get("namespace", ""), last["name"]])).decode()
        if _wants_table(request):
            return _json(to_table(rt, items, str(self.store.rv), query.get("includeObject", "")))
        return _json(self._list_doc(rt, items, cont, remaining))

    async def _watch(
        self, request: web.Request, rt: ResourceType, ns: str | None, predicate: Any
    ) -> web.StreamResponse:
        query = request.query
        timeout = float(query.get("timeoutSeconds", "0") or 0)
        bookmarks = query.get("allowWatchBookmarks", "") in ("true", "1")
        watcher = self.store.watch(rt, ns, predicate, query.get("resourceVersion"))
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout > 0 else None
        try:
            await response.prepare(request)
            while not self.stopping.is_set():
                wait: float | None = self.config.bookmark_interval if bookmarks else None
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    wait = left if wait is None else min(wait, left)
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and (deadline is None or loop.time() < deadline):
                        mark = {
                            "kind": rt.kind,
                            "apiVersion": rt.api_version,
                            "metadata": {"resourceVersion": str(self.store.rv)},
                        }
                        await response.write(_dumps({"type": "BOOKMARK", "object": mark}) + b"\n")
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

    async def _admin(self, request: web.Request, rest: list[str]) -> web.Response:
        if rest == ["fail"] and request.method == "POST":
            body = await self._body(request)
            self.store.inject_failures(str(body["resource"]), int(body.get("count", 1)), int(body.get("code", 500)))
            return _json({"ok": True})
        if rest == ["close-watches"] and request.method == "POST":
            return _json({"closed": self.store.close_watches()})
        if rest == ["stats"]:
            return _json(
                {
                    "resourceVersion": self.store.rv,
                    "history": len(self.store.history),
                    "watchers": sum(len(w) for w in self.store.watchers.values()),
                }
            )
        raise _not_found_path()


def load_crds(store: Store, crd_dir: str | Path | None) -> int:
    """Create every CustomResourceDefinition found in ``crd_dir/*.yaml`` (sorted by file name)."""
    if crd_dir is None:
        return 0
    crd_type = store.types[CRD_KEY]
    count = 0
    for path in sorted(Path(crd_dir).glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                store.create(crd_type, "", doc)
                count += 1
    return count


def kubeconfig(url: str, namespace: str = "default") -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cfm-embedded", "cluster": {"server": url}}],
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
    _stopped: bool = field(default=False)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop (the store is not thread-safe) and return its result."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def inject_failures(self, plural: str, count: int, code: int = 500) -> None:
        self.call(lambda: self.store.inject_failures(plural, count, code))

    def close_watches(self) -> int:
        return self.call(self.store.close_watches)

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
    bookmark_interval: float = 5.0,
    history_size: int = 10_000,
    rbac: Rbac | None = None,
) -> ApiServerHandle:
    """Start the server in a daemon thread; returns once it accepts connections. With ``rbac``, requests
    bearing one of its service-account tokens are authorized by its rules (:mod:`controller.apiserver.authz`)."""
    result: dict[str, Any] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    config = ServerConfig(bookmark_interval=bookmark_interval, history_size=history_size)

    async def setup() -> None:
        store = Store(history_size=history_size)
        load_crds(store, crd_dir)
        server = ApiServer(store, config, rbac)
        # handler_cancellation: a watch whose client went away is cancelled at once, so its watcher is dropped.
        runner = web.AppRunner(
            server.app, access_log=None, handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        sockets = cast(asyncio.Server, site._server).sockets
        bound = sockets[0].getsockname()[1]
        server.address = f"{host}:{bound}"

        async def stop() -> None:
            server.stopping.set()
            store.close_watches()
            await runner.cleanup()

        result.update(store=store, port=bound, stop=stop)

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
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="cfm-apiserver", daemon=True)
    thread.start()
    started.wait(timeout=60)
    if "error" in result:
        raise RuntimeError(f"embedded API server failed to start: {result['error']}") from result["error"]
    url = f"http://{host}:{result['port']}"
    tmpdir: str | None = None
    if kubeconfig_path is None:
        tmpdir = tempfile.mkdtemp(prefix="cfm-apiserver-")
        kubeconfig_path = Path(tmpdir) / "kubeconfig"
    path = Path(kubeconfig_path)
    path.write_text(yaml.safe_dump(kubeconfig(url)))
    return ApiServerHandle(url, path, result["store"], loop, thread, result["stop"], tmpdir)
