"""A small asyncio client for the Kubernetes API: exactly the verbs the maintainer and captures use.

Why not the generated ``kubernetes.aio`` client: we need precise control over patch content types,
delete preconditions and watch parameters (resourceVersion, bookmarks, timeouts), and the per-verb
request counts the benchmark reports. Configuration (URL, credentials, TLS) is still loaded by the
official ``kubernetes`` package from a kubeconfig or the in-cluster service account.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes import client as kclient
from kubernetes import config as kconfig

from controller.model.states import GROUP, VERSION, Kind

JSON = dict[str, Any]
#: A page of listed objects.
Page = list[JSON]

#: Objects per LIST page (client-go's pager asks for 500): a LIST of 50,000 objects is never one body of
#: hundreds of megabytes, and the caller can convert a page before the next arrives.
LIST_PAGE = 500


@dataclass(frozen=True)
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    status: bool = False

    def path(self, namespace: str, name: str = "", sub: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        out = f"{base}/namespaces/{namespace}/{self.plural}"
        if name:
            out += f"/{name}"
        if sub:
            out += f"/{sub}"
        return out


RESOURCES: dict[Kind, Resource] = {
    Kind.CHANGEFEED: Resource(GROUP, VERSION, "changefeeds", "Changefeed", True),
    Kind.TABLE: Resource(GROUP, VERSION, "tables", "Table", True),
    Kind.SPAN: Resource(GROUP, VERSION, "spans", "Span", True),
    Kind.DISPATCHER: Resource(GROUP, VERSION, "dispatchers", "Dispatcher", True),
    Kind.OPERATOR: Resource(GROUP, VERSION, "spanoperators", "SpanOperator", True),
    Kind.CAPTURE: Resource(GROUP, VERSION, "captures", "Capture", True),
}
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
EVENTS = Resource("", "v1", "events", "Event")
#: A changefeed's source and sink credentials (read by the capture that runs its dispatchers).
SECRETS = Resource("", "v1", "secrets", "Secret")


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, causes: tuple[str, ...] = ()) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        #: The ``reason`` of each of the Status's ``details.causes`` (e.g. ``NamespaceTerminating``).
        self.causes = causes

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409 and self.reason != "AlreadyExists"

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"


class BadResponse(ValueError):
    """A successful (2xx) response whose body is not JSON: not an API server (a proxy's page, say).

    A ValueError, like the JSON decoding error it replaces, so handlers of malformed input catch it."""


#: What a request or a watch raises when the API could not be reached or gave no usable answer: a connection
#: refused or reset, a timeout, a body that is not JSON. A caller retries these (with back-off) as an outage;
#: anything else raised on its side of a request is a bug of its own, not the network's. ``ApiError`` (an
#: answer, with a status) is apart: what it means depends on the status. ``ConnectionError`` is an ``OSError``,
#: ``asyncio.TimeoutError`` is ``TimeoutError``.
TRANSPORT_ERRORS = (aiohttp.ClientError, OSError, TimeoutError, BadResponse)


@dataclass(frozen=True)
class Config:
    url: str
    token: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    verify: bool = True

    @classmethod
    def load(cls, kubeconfig: str | None = None, context: str | None = None) -> Config:
        """From a kubeconfig (path, or $KUBECONFIG / ~/.kube/config), else the in-cluster account."""
        cfg = kclient.Configuration()
        try:
            kconfig.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)  # type: ignore[no-untyped-call]
        except kconfig.ConfigException:
            if kubeconfig:
                raise
            kconfig.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        token = cfg.api_key.get("authorization", "") or cfg.api_key.get("BearerToken", "")
        prefix = cfg.api_key_prefix.get("authorization", "")
        if token and prefix and not token.startswith(prefix):
            token = f"{prefix} {token}"
        return cls(
            url=cfg.host.rstrip("/"),
            token=token,
            ca_file=cfg.ssl_ca_cert or "",
            cert_file=cfg.cert_file or "",
            key_file=cfg.key_file or "",
            verify=bool(cfg.verify_ssl),
        )

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.url.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file or None)
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


class Client:
    """One HTTP session; every method raises :class:`ApiError` for an API error status.

    ``last_success`` is when (``time.monotonic()``) the API last answered a request of ours with success: a
    response below 400, a watch that connected, a line a watch delivered. It is the liveness probe's evidence of
    progress (``Informer.healthy``): a quiet watch is normal, a process that reaches the API no more is not. It
    starts at the client's creation, so a process that never reaches the API fails the probe too."""

    def __init__(self, config: Config, connections: int = 32) -> None:
        self.config = config
        self.requests: Counter[str] = Counter()
        self.last_success = time.monotonic()
        headers = {"Accept": "application/json"}
        if config.token:
            headers["Authorization"] = config.token if " " in config.token else f"Bearer {config.token}"
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=connections, ssl=config.ssl_context()),
        )
        # Watches hold their connection for as long as they run (HTTP/1.1: one stream per connection), and a
        # sharded cache runs four per changefeed it leads: they get connections of their own, not counted
        # against ``connections``, so that no number of them can starve the requests of a free connection.
        self._watch_session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0, ssl=config.ssl_context()),
        )

    async def close(self) -> None:
        await self._session.close()
        await self._watch_session.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(
        self,
        verb: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: object = None,
        content_type: str = "application/json",
        timeout: float = 30.0,  # noqa: ASYNC109 - a per-request budget handed to aiohttp
    ) -> JSON:
        self.requests[verb] += 1
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else None
        async with self._session.request(
            method,
            self.config.url + path,
            params=params,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            # Parsed from the bytes (no decoded copy of a LIST of 50,000 objects beside them).
            body = await resp.read()
            text = body.decode("utf-8", "replace") if resp.status >= 400 or not body else ""
            try:
                payload: JSON = json.loads(body) if body else {}
            except ValueError:
                text = body.decode("utf-8", "replace")
                if resp.status >= 400:  # e.g. a proxy's HTML error page: the status still says what happened
                    raise ApiError(resp.status, str(resp.status), text[:200]) from None
                problem = f"HTTP {resp.status} with a body that is not JSON: {text[:120]!r}"
                raise BadResponse(f"{method} {path}: {problem}") from None
            if not isinstance(payload, dict):
                raise BadResponse(f"{method} {path}: HTTP {resp.status} with JSON that is not an object")
            if resp.status >= 400:
                # The API's machine-readable reason (a Status object); the numeric code when there is none.
                reason = str(payload.get("reason") or resp.status)
                details = payload.get("details")
                found = details.get("causes") if isinstance(details, dict) else None
                causes = tuple(str(c.get("reason", "")) for c in found or () if isinstance(c, dict))
                raise ApiError(resp.status, reason, str(payload.get("message", text)), causes)
            self.last_success = time.monotonic()
            return payload

    # -- verbs ----------------------------------------------------------------------------------------

    async def get(self, res: Resource, namespace: str, name: str) -> JSON:
        return await self.request("get", "GET", res.path(namespace, name))

    async def list(
        self, res: Resource, namespace: str, label_selector: str = "", field_selector: str = ""
    ) -> tuple[list[JSON], str]:
        """The objects and the list's resourceVersion (current: the one to watch from, unlike an object's), in
        one response (a capture's resume check reads its Dispatchers against a deadline: one round trip)."""
        items: list[JSON] = []
        rv = ""
        async for page, page_rv in self.list_pages(res, namespace, label_selector, field_selector, limit=0):
            items.extend(page)
            rv = page_rv
        return items, rv

    async def list_pages(
        self,
        res: Resource,
        namespace: str,
        label_selector: str = "",
        field_selector: str = "",
        limit: int = LIST_PAGE,
    ) -> AsyncIterator[tuple[Page, str]]:
        """One LIST in pages of at most ``limit`` objects (``limit`` and ``continue``, as client-go's pager):
        each page's objects and the list's resourceVersion. The pages are one consistent snapshot; a
        continuation the server no longer has is ``410 Expired`` (list again). The first request counts as
        ``list``, the continuations as ``list/continue``.

        The next page is requested as soon as a page arrives, while the caller works on that one (client-go's
        pager buffers pages the same way): the server encodes a page while the caller converts the last one.
        One page ahead at most, so at most two pages are held at once."""
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        if limit > 0:
            params["limit"] = str(limit)

        async def page(cont: str) -> JSON:
            query = {**params, "continue": cont} if cont else params
            verb = "list/continue" if cont else "list"
            out: JSON = await self.request(verb, "GET", res.path(namespace), params=query or None, timeout=120.0)
            return out

        out = await page("")
        while True:
            meta = out.get("metadata") or {}
            cont = str(meta.get("continue") or "")
            ahead = asyncio.ensure_future(page(cont)) if cont else None
            try:
                yield list(out.get("items", [])), str(meta.get("resourceVersion", ""))
            except BaseException:
                # The caller stopped early (closed the iterator, was cancelled or failed): the page it will not
                # read is cancelled, or its outcome (an error too) taken, so that nothing is left behind.
                if ahead is not None:
                    if ahead.done():
                        if not ahead.cancelled():
                            ahead.exception()
                    else:
                        ahead.cancel()
                raise
            if ahead is None:
                return
            out = await ahead

    async def create(self, res: Resource, namespace: str, body: JSON) -> JSON:
        return await self.request("create", "POST", res.path(namespace), body=body)

    async def replace(self, res: Resource, namespace: str, name: str, body: JSON) -> JSON:
        return await self.request("update", "PUT", res.path(namespace, name), body=body)

    async def patch(self, res: Resource, namespace: str, name: str, patch: JSON, sub: str = "") -> JSON:
        """A JSON merge patch; put ``metadata.resourceVersion`` in it for a precondition."""
        return await self.request(
            "patch/status" if sub else "patch",
            "PATCH",
            res.path(namespace, name, sub),
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, res: Resource, namespace: str, name: str, uid: str = "") -> JSON:
        body: JSON = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        return await self.request("delete", "DELETE", res.path(namespace, name), body=body)

    async def watch(
        self,
        res: Resource,
        namespace: str,
        resource_version: str,
        *,
        label_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncGenerator[JSON, None]:
        """Watch events (dicts with ``type`` and ``object``), BOOKMARKs included, until the server ends it.

        ``timeout_seconds`` is asked of the server, which ends the stream cleanly then (a quiet stream included:
        a real server guarantees no BOOKMARKs, at any interval or at all). The socket read timeout, that plus
        30 s, is only a backstop for a connection that died silently; a caller may give up sooner."""
        self.requests["watch"] += 1
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_seconds + 30)
        url = self.config.url + res.path(namespace)
        async with self._watch_session.get(url, params=params, timeout=timeout) as resp:
            try:
                if resp.status >= 400:
                    text = await resp.text()
                    raise ApiError(resp.status, resp.reason or str(resp.status), text[:200])
                self.last_success = time.monotonic()  # connected: the API answered
                async for line in resp.content:
                    self.last_success = time.monotonic()
                    if line.strip():
                        try:
                            event = json.loads(line)
                        except ValueError:
                            raise BadResponse(f"watch {res.plural}: a line that is not JSON: {line[:120]!r}") from None
                        yield event
            finally:
                await end_stream(resp)


#: Seconds a watch left early waits for its connection's TLS shutdown before it aborts the connection.
STREAM_CLOSE_TIMEOUT = 2.0


async def end_stream(resp: aiohttp.ClientResponse) -> None:
    """Close the connection of a streamed response left before its end (a watch closed or cancelled by its
    reader) and wait until it is closed: it cannot be reused, and no session tracks it any more, so nobody
    else would wait for it. Over TLS a close is a shutdown exchange that takes a few turns of the event loop;
    a loop ended first (``asyncio.run`` returning) would leave the socket unclosed, a ResourceWarning.
    A peer that does not answer the shutdown within :data:`STREAM_CLOSE_TIMEOUT` has the connection aborted.
    A response read to its end has released its connection to the pool already: nothing to do."""
    connection = resp.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is None:
        resp.close()
        return
    transport = protocol.transport
    closed = protocol.closed
    resp.close()
    if closed is None:
        return
    if not closed.done():
        await asyncio.wait([closed], timeout=STREAM_CLOSE_TIMEOUT)
    if not closed.done() and transport is not None:
        transport.abort()
        await asyncio.wait([closed], timeout=STREAM_CLOSE_TIMEOUT)
    if closed.done() and not closed.cancelled():
        closed.exception()  # a connection that ended in error: taken, not logged as never retrieved


async def sleep_or(event: asyncio.Event, seconds: float) -> None:
    """Sleep up to ``seconds``, returning early if ``event`` is set (and clearing it).

    ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` swallows a cancellation that arrives as the
    event is set, and the caller's loop then never ends (a capture agent SIGTERMed just as a watch event woke its
    loop hung in its shutdown: tests/integration/test_capture.py, 2 runs in 12 under load)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    event.clear()


def without_finalizer(obj: Mapping[str, Any], finalizer: str) -> JSON | None:
    """A merge patch that removes ``finalizer`` from ``obj`` if the object is still as read (its resourceVersion
    as precondition), or None when ``obj`` does not carry it."""
    meta = obj.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    if finalizer not in finalizers:
        return None
    return {
        "metadata": {
            "finalizers": [f for f in finalizers if f != finalizer],
            "resourceVersion": meta.get("resourceVersion"),
        }
    }


async def remove_finalizer(
    client: Client, res: Resource, namespace: str, obj: Mapping[str, Any], finalizer: str, attempts: int = 5
) -> bool:
    """Remove ``finalizer`` from ``obj`` with a resourceVersion precondition, re-reading it on conflict. True once
    it is gone (or the object is); False if the object kept changing for ``attempts`` tries."""
    name = str((obj.get("metadata") or {})["name"])
    for _ in range(attempts):
        patch = without_finalizer(obj, finalizer)
        if patch is None:
            return True
        try:
            await client.patch(res, namespace, name, patch)
            return True
        except ApiError as exc:
            if exc.not_found:
                return True
            if not exc.conflict:
                raise
        try:
            obj = await client.get(res, namespace, name)
        except ApiError as exc:
            if exc.not_found:
                return True
            raise
    return False
