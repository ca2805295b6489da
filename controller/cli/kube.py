"""The plugin's I/O: configuration, reading a snapshot, writes, following an operator.

Built on the project's own client (``controller.kube.client``). Every API failure is turned into a
:class:`~controller.cli.errors.CliError` with a one-line message: 404 into ``NotFound`` and 422 (the API
refused the object, nothing written) into ``Refused`` (exit 2), anything else (connection refused,
401/403, 409, 5xx, timeouts, a body that is not JSON) into ``Failed`` (exit 1). A kubeconfig that cannot
be loaded or used (bad YAML, unknown context, a CA or client certificate that does not load, a server
URL without ``https://``) is a ``Usage`` error (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml
from kubernetes import config as kconfig

from controller.cli import render
from controller.cli.errors import CliError, Failed, NotFound, Refused, Usage
from controller.cli.snapshot import Snapshot, snapshot_from
from controller.kube.client import LEASES, RESOURCES, ApiError, BadResponse, Client, Config, Resource
from controller.model import resources as conv
from controller.model.records import SpanOperator
from controller.model.states import Kind

JSON = dict[str, Any]
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
PLURALS: dict[str, Resource] = {res.plural: res for res in RESOURCES.values()}
OPERATORS = RESOURCES[Kind.OPERATOR]


#: Errors of reading a kubeconfig or building a client from it: all a Usage error (exit 2).
CONFIG_ERRORS = (kconfig.ConfigException, yaml.YAMLError, ssl.SSLError, OSError, ValueError, TypeError)
#: Seconds before re-watching after a watch ERROR event other than 410 Gone: the first, doubling up to
#: the second.
WATCH_BACKOFF = (1.0, 10.0)


def kubeconfig_path(explicit: str | None) -> str | None:
    """The kubeconfig to load, as kubectl picks it: ``--kubeconfig``; else ``$KUBECONFIG`` (files separated
    by ``os.pathsep``, merged) when it is set and one of its files exists; else ``~/.kube/config`` when
    ``$KUBECONFIG`` is not set and that file exists. None when there is no kubeconfig file: the only case
    that falls back to the in-cluster service account, so that a broken kubeconfig is reported as such."""
    if explicit:
        return explicit
    env = os.environ.get("KUBECONFIG", "")
    if env:
        return env if any(p and Path(p).expanduser().exists() for p in env.split(os.pathsep)) else None
    home = Path("~/.kube/config").expanduser()
    return str(home) if home.exists() else None


def load_config(kubeconfig: str | None, context: str | None) -> tuple[Config, str]:
    """The client configuration and the default namespace: the context's, else the service account's
    (in a pod), else ``default``. The configuration is checked (server URL, TLS files) so that a broken
    kubeconfig is one Usage error here rather than a traceback when the client is built."""
    path = kubeconfig_path(kubeconfig)
    try:
        config = Config.load(path, context)
    except CONFIG_ERRORS as exc:
        if path is not None:
            where = f"kubeconfig {path}"
        elif os.environ.get("KUBECONFIG"):
            where = f"a kubeconfig: no file of $KUBECONFIG ({os.environ['KUBECONFIG']}) exists, and not in a pod"
        else:
            where = "a kubeconfig: no $KUBECONFIG, no ~/.kube/config, and not in a pod"
        raise Usage(f"cannot load {where}: {one_line(exc)}") from None
    check_config(config, f"kubeconfig {path}" if path is not None else "in-cluster configuration")
    return config, _default_namespace(path, context)


def check_config(config: Config, where: str) -> None:
    """The server URL is an absolute http(s) URL and the TLS files (CA, client certificate and key) load."""
    url = urlsplit(config.url)
    if url.scheme not in ("http", "https") or not url.netloc:
        hint = "" if "://" in config.url else f" (e.g. https://{config.url})"
        raise Usage(f"{where}: server {config.url!r} is not an http(s) URL{hint}")
    try:
        config.ssl_context()
    except CONFIG_ERRORS as exc:
        raise Usage(f"{where}: cannot load its TLS settings (CA or client certificate): {one_line(exc)}") from None


def connect(config: Config) -> Client:
    """The client (to be closed by the caller); a configuration it cannot use is a Usage error.
    Call with the event loop running (the HTTP session binds to it)."""
    try:
        return Client(config)
    except CONFIG_ERRORS as exc:
        raise Usage(f"cannot use the API server {config.url!r}: {one_line(exc)}") from None


def _default_namespace(kubeconfig: str | None, context: str | None) -> str:
    if kubeconfig is not None:
        try:
            contexts, active = kconfig.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        except Exception:  # loaded once already; a kubeconfig without contexts (e.g. only a cluster)
            contexts, active = [], None
        chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
        namespace = ((chosen or {}).get("context") or {}).get("namespace")
        return str(namespace) if namespace else "default"
    try:  # in a pod: the service account's namespace
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


@contextlib.contextmanager
def api_errors(what: str, url: str) -> Iterator[None]:
    """Translate client exceptions raised while doing ``what`` into CliErrors."""
    try:
        yield
    except ApiError as exc:
        detail = one_line(Exception(exc.message)) if exc.message else exc.reason
        if exc.status == 404:
            raise NotFound(f"{what}: not found ({detail})") from None
        if exc.status == 422:  # Invalid: the API refused the object (schema, CEL rules); nothing was written
            raise Refused(f"{what}: refused by the API ({exc.reason}): {detail}") from None
        if exc.status in (401, 403):
            raise Failed(f"{what}: {exc.status} {exc.reason}: {detail}") from None
        raise Failed(f"{what}: API error {exc.status} {exc.reason}: {detail}") from None
    except BadResponse as exc:
        raise Failed(f"{what}: {url} did not answer like a Kubernetes API server: {one_line(exc)}") from None
    except aiohttp.ClientConnectionError as exc:
        raise Failed(f"{what}: cannot reach the API server at {url}: {one_line(exc)}") from None
    except aiohttp.ClientError as exc:
        raise Failed(f"{what}: request to {url} failed: {one_line(exc)}") from None
    except TimeoutError:
        raise Failed(f"{what}: the API server at {url} did not answer in time") from None


class NameTaken(Failed):
    """A create refused with 409 AlreadyExists: the name is taken (exit 1 if not handled)."""


async def pause(seconds: float) -> None:
    """``asyncio.sleep``, under a name tests can replace."""
    await asyncio.sleep(seconds)


class Session:
    """A client bound to one namespace."""

    def __init__(self, client: Client, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self.url = client.config.url

    def errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return api_errors(what, self.url)

    async def list(self, res: Resource) -> list[JSON]:
        with self.errors(f"listing {res.plural} in namespace {self.namespace!r}"):
            try:
                items, _ = await self.client.list(res, self.namespace)
            except ApiError as exc:
                if exc.status == 404 and res.group != LEASES.group:
                    raise NotFound(
                        f"the API has no {res.plural}.{res.group} (are the CRDs installed? kubectl apply -f crds/)"
                    ) from None
                raise
        return items

    async def snapshot(self, kinds: tuple[Resource, ...] = (*RESOURCES.values(), LEASES)) -> Snapshot:
        """Everything, listed concurrently (dispatchers are not needed and are skipped)."""
        wanted = [r for r in kinds if r.plural != "dispatchers"]
        results = await asyncio.gather(*(self.list(r) for r in wanted), return_exceptions=True)
        listings: list[list[JSON]] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            listings.append(result)
        return snapshot_from(
            self.namespace, time.time(), {r.plural: items for r, items in zip(wanted, listings, strict=True)}
        )

    async def read_namespace(self) -> JSON | None:
        """The Namespace, or None when it cannot be read: gone (404), or not allowed (403: ``get`` on
        ``namespaces`` is granted per namespace, by a Role there; without it the caller knows no better)."""
        with self.errors(f"reading namespace {self.namespace!r}"):
            try:
                return await self.client.request("get", "GET", f"/api/v1/namespaces/{self.namespace}")
            except ApiError as exc:
                if exc.status in (403, 404):
                    return None
                raise

    async def create(self, res: Resource, body: JSON) -> JSON:
        """Create ``body``; :class:`NameTaken` if an object of that name exists (409 AlreadyExists)."""
        name = body.get("metadata", {}).get("name", "")
        with self.errors(f"creating {res.kind} {name}"):
            try:
                return await self.client.create(res, self.namespace, body)
            except ApiError as exc:
                if exc.already_exists:
                    raise NameTaken(f"creating {res.kind} {name}: {name!r} already exists") from None
                raise

    async def patch_spec(self, kind: Kind, name: str, spec: JSON) -> JSON:
        with self.errors(f"{kind.value} {name!r} in namespace {self.namespace!r}"):
            return await self.client.patch(RESOURCES[kind], self.namespace, name, {"spec": spec})

    async def read_operator(self, name: str) -> tuple[JSON, str]:
        """The operator and a resourceVersion to watch it from: the list's, which the server has, not the
        operator's own, which is as old as its last change and may be compacted away (410 again)."""
        what = f"SpanOperator {name!r} in namespace {self.namespace!r}"
        with self.errors(what):
            items, rv = await self.client.list(OPERATORS, self.namespace, field_selector=f"metadata.name={name}")
        if not items:
            raise NotFound(f"{what}: not found")
        return items[0], rv

    async def operator_updates(self, name: str, obj: JSON, label_selector: str) -> AsyncGenerator[JSON, None]:
        """Every version of SpanOperator ``name`` after ``obj`` (its create or last read), from a watch;
        a watch that ends or expires (410) is resumed from a fresh read, which is yielded too."""
        rv = str(obj.get("metadata", {}).get("resourceVersion", ""))
        first, most = WATCH_BACKOFF
        delay = 0.0
        while True:
            error: JSON | None = None
            with self.errors(f"watching SpanOperator {name!r}"):
                # Closed with this generator (not left to the collector: its connection must be closed while
                # the event loop still runs).
                events = self.client.watch(
                    OPERATORS, self.namespace, rv, label_selector=label_selector, timeout_seconds=60
                )
                try:
                    async with contextlib.aclosing(events):
                        async for ev in events:
                            typ, item = ev.get("type"), ev.get("object") or {}
                            if typ == "ERROR":  # a Status: 410 Gone (expired), or a failure of the server
                                error = item
                                break
                            delay = 0.0
                            rv = str(item.get("metadata", {}).get("resourceVersion", rv))
                            if typ == "BOOKMARK" or item.get("metadata", {}).get("name") != name:
                                continue
                            if typ == "DELETED":
                                raise Failed(f"SpanOperator {name!r} was deleted")
                            yield item
                except ApiError as exc:
                    if exc.status != 410:
                        raise
            if error is not None and error.get("code") != 410:
                # Not an expiry: the server is in trouble; do not hammer it with re-watches.
                delay = min(most, delay * 2 if delay else first)
                await pause(delay)
            fresh, rv = await self.read_operator(name)
            yield fresh


async def follow_operator(session: Session, created: JSON, budget: float, emit: Callable[[str], None]) -> SpanOperator:
    """Print each phase/stage the operator goes through until it ends; raise Failed on timeout."""
    start = time.monotonic()
    op = conv.operator_from_resource(created)
    last = (op.phase, op.stage)
    emit(render.progress(op, 0.0))
    selector = f"{conv.CHANGEFEED_LABEL}={op.changefeed}"
    try:
        async with asyncio.timeout(budget):
            updates = session.operator_updates(op.name, created, selector)
            async with contextlib.aclosing(updates):
                async for obj in updates:
                    try:
                        op = conv.operator_from_resource(obj)
                    except conv.InvalidResource as exc:
                        raise Failed(str(exc)) from None
                    if (op.phase, op.stage) != last:
                        last = (op.phase, op.stage)
                        emit(render.progress(op, time.monotonic() - start))
                    if op.phase.terminal:
                        return op
    except TimeoutError:
        raise Failed(
            f"timed out after {budget:g}s waiting for SpanOperator {op.name!r} (last seen {render.op_state(op)}); "
            + render.still_running(op.name, op.namespace)
        ) from None
    raise CliError(f"the watch of SpanOperator {op.name!r} ended")  # pragma: no cover - the loop never ends
