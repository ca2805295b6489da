"""The plugin's I/O: configuration, reading a snapshot, writes, following an operator.

Built on the project's own client (``controller.kube.client``). Every API failure is turned into a
:class:`~controller.cli.errors.CliError` with a one-line message: 404 into ``NotFound`` (exit 2),
anything else (connection refused, 401/403, 5xx, timeouts) into ``Failed`` (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import config as kconfig

from controller.cli import render
from controller.cli.errors import CliError, Failed, NotFound, Usage
from controller.cli.snapshot import Snapshot, snapshot_from
from controller.kube.client import LEASES, RESOURCES, ApiError, Client, Config, Resource
from controller.model import resources as conv
from controller.model.records import SpanOperator
from controller.model.states import Kind

JSON = dict[str, Any]
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
PLURALS: dict[str, Resource] = {res.plural: res for res in RESOURCES.values()}
OPERATORS = RESOURCES[Kind.OPERATOR]


def load_config(kubeconfig: str | None, context: str | None) -> tuple[Config, str]:
    """The client configuration and the default namespace: the context's, else the service account's
    (in a pod), else ``default``."""
    try:
        config = Config.load(kubeconfig, context)
    except (kconfig.ConfigException, OSError, ValueError, TypeError) as exc:
        where = kubeconfig or "$KUBECONFIG / ~/.kube/config / in-cluster"
        raise Usage(f"cannot load a kubeconfig from {where}: {_one_line(exc)}") from None
    return config, _default_namespace(kubeconfig, context)


def _default_namespace(kubeconfig: str | None, context: str | None) -> str:
    try:
        contexts, active = kconfig.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except Exception:  # no kubeconfig: in-cluster
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
        except OSError:
            return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else "default"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


@contextlib.contextmanager
def api_errors(what: str, url: str) -> Iterator[None]:
    """Translate client exceptions raised while doing ``what`` into CliErrors."""
    try:
        yield
    except ApiError as exc:
        detail = _one_line(Exception(exc.message)) if exc.message else exc.reason
        if exc.status == 404:
            raise NotFound(f"{what}: not found ({detail})") from None
        if exc.status in (401, 403):
            raise Failed(f"{what}: {exc.status} {exc.reason}: {detail}") from None
        raise Failed(f"{what}: API error {exc.status} {exc.reason}: {detail}") from None
    except aiohttp.ClientConnectionError as exc:
        raise Failed(f"{what}: cannot reach the API server at {url}: {_one_line(exc)}") from None
    except aiohttp.ClientError as exc:
        raise Failed(f"{what}: request to {url} failed: {_one_line(exc)}") from None
    except TimeoutError:
        raise Failed(f"{what}: the API server at {url} did not answer in time") from None


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

    async def create(self, res: Resource, body: JSON) -> JSON:
        name = body.get("metadata", {}).get("name", "")
        with self.errors(f"creating {res.kind} {name}"):
            return await self.client.create(res, self.namespace, body)

    async def patch_spec(self, kind: Kind, name: str, spec: JSON) -> JSON:
        with self.errors(f"{kind.value} {name!r} in namespace {self.namespace!r}"):
            return await self.client.patch(RESOURCES[kind], self.namespace, name, {"spec": spec})

    async def get_operator(self, name: str) -> JSON:
        with self.errors(f"SpanOperator {name!r} in namespace {self.namespace!r}"):
            return await self.client.get(OPERATORS, self.namespace, name)

    async def operator_updates(self, name: str, obj: JSON, label_selector: str) -> AsyncGenerator[JSON, None]:
        """Every version of SpanOperator ``name`` after ``obj`` (its create or last read), from a watch;
        a watch that ends or expires (410) is resumed from a fresh read, which is yielded too."""
        rv = str(obj.get("metadata", {}).get("resourceVersion", ""))
        while True:
            with self.errors(f"watching SpanOperator {name!r}"):
                try:
                    async for ev in self.client.watch(
                        OPERATORS, self.namespace, rv, label_selector=label_selector, timeout_seconds=60
                    ):
                        typ, item = ev.get("type"), ev.get("object") or {}
                        if typ == "ERROR":  # e.g. 410 Gone: resume from a fresh read
                            break
                        rv = str(item.get("metadata", {}).get("resourceVersion", rv))
                        if typ == "BOOKMARK" or item.get("metadata", {}).get("name") != name:
                            continue
                        if typ == "DELETED":
                            raise Failed(f"SpanOperator {name!r} was deleted")
                        yield item
                except ApiError as exc:
                    if exc.status != 410:
                        raise
            fresh = await self.get_operator(name)
            rv = str(fresh.get("metadata", {}).get("resourceVersion", ""))
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
            f"timed out after {budget:g}s waiting for SpanOperator {op.name!r} (last seen {render.op_state(op)})"
        ) from None
    raise CliError(f"the watch of SpanOperator {op.name!r} ended")  # pragma: no cover - the loop never ends
