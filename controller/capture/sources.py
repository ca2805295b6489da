"""Where a changefeed's data comes from and goes to, read from its Changefeed and the Secrets it names.

Before the first dispatcher of a changefeed starts in this process, its Changefeed is read (strongly) and, if it
names a source and a sink, their Secrets too, and the data plane is configured with them
(``RoutedRuntime.configure``: its dispatchers then replicate etcd into PostgreSQL; the others run the logical
clock). What cannot be used (a Secret missing or unreadable, a key missing, an endpoint or a DSN malformed) is a
trouble of that side (``troubles.Troubles``, origin ``SECRETS``: the Changefeed's SourceUnavailable or
SinkUnavailable, reason ConfigurationError), and the dispatcher waits: the next look comes within ``RETRY``.

Secrets are read again. Every ``RELOAD`` seconds, for each changefeed configured here, the Changefeed and its
Secrets are read again (``get`` by name: the captures may not list or watch Secrets). New values are handed to the
data plane (``DataplaneRuntime.reconfigure``), which tries them before it uses them: what works replaces the old
connections (positions kept: nothing lost, nothing skipped); what does not is a trouble, and the connections made
with the old values are kept. A Secret that disappeared or became malformed is a trouble too, and the old values
stay in use. So a rotated password or client certificate is in use within ``RELOAD`` plus one connection, without
a restart. Each look also hands the data plane the Changefeed's published checkpoint (``published``).

Credentials and the DSN are never logged nor put in a message: only the Secrets' names.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from controller.capture.dataplane import Endpoints
from controller.capture.logs import fields
from controller.capture.routed import RoutedRuntime
from controller.capture.troubles import SECRETS, Troubles
from controller.kube.client import JSON, RESOURCES, ApiError, Client
from controller.kube.client import SECRETS as SECRET_RESOURCE
from controller.model.progress import SINK, SOURCE, Side
from controller.model.resources import InvalidResource, changefeed_from_resource
from controller.model.states import Kind
from controller.sinks import api as sinks
from controller.sinks import kinds
from controller.sources.etcd import connection as etcd

log = logging.getLogger("controller.capture")
CHANGEFEEDS = RESOURCES[Kind.CHANGEFEED]
#: Seconds before a source that could not be used is looked at again: first, then doubling up to the cap.
RETRY = (2.0, 15.0)
#: Seconds between two reads of a configured changefeed's Changefeed and Secrets (a rotation is used within this
#: plus one connection).
RELOAD = 10.0


def secret_data(secret: JSON) -> dict[str, str]:
    """A Secret's ``data``, decoded (base64 -> text). Never logged."""
    out = {}
    for key, value in (secret.get("data") or {}).items():
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            out[str(key)] = base64.b64decode(str(value)).decode()
    return out


@dataclass(frozen=True)
class _Problem:
    """Why a changefeed's Secrets cannot be used as they are: the side and what to say."""

    side: Side
    message: str


#: A changefeed that names no source and no sink: it runs the logical clock.
_NO_DATAPLANE = object()


class Sources:
    def __init__(self, client: Client, namespace: str, routed: RoutedRuntime, troubles: Troubles) -> None:
        self.client = client
        self.namespace = namespace
        self.routed = routed
        self.troubles = troubles
        #: Changefeeds whose source was looked up (configured, or found to name none).
        self.read: set[str] = set()
        #: Changefeeds whose source could not be used: name -> (monotonic time of the next look, back-off). A fixed
        #: Secret is picked up within the back-off (``RETRY``), not at the next full pass; a broken one costs its
        #: reads once per back-off, however many dispatchers wait on it.
        self.waiting: dict[str, tuple[float, float]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def retry_at(self, changefeed: str) -> float | None:
        """When a dispatcher of ``changefeed`` that waits on its source should be visited again (monotonic)."""
        waiting = self.waiting.get(changefeed)
        return waiting[0] if waiting else None

    async def ready(self, changefeed: str) -> bool:
        """Whether ``changefeed``'s dispatchers may start: its source looked up (and the data plane configured if it
        names one). False: try again at a later pass."""
        if changefeed in self.read:
            return True
        # One look at a time per changefeed: its dispatchers step concurrently, and the first look decides for all.
        async with self._locks.setdefault(changefeed, asyncio.Lock()):
            return await self._ready(changefeed)

    def keep(self, changefeeds: Collection[str]) -> None:
        """Forget what was read of changefeeds this capture holds no dispatcher of any more (their troubles too)."""
        for cf in (self.read | set(self.waiting)) - set(changefeeds):
            self.read.discard(cf)
            self.waiting.pop(cf, None)
            self._locks.pop(cf, None)
            self.troubles.forget(cf)

    async def run(self, stop: asyncio.Event) -> None:
        """Read the configured changefeeds' Changefeeds and Secrets again every ``RELOAD`` seconds, until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RELOAD)
            for cf in sorted(self.read):
                if stop.is_set() or not self.routed.configured(cf):
                    continue
                try:
                    async with self._locks.setdefault(cf, asyncio.Lock()):
                        await self._reload(cf)
                except ApiError as exc:  # the API unreachable or refusing: the values in use stay; next time
                    log.debug("cannot read the changefeed again", extra=fields(changefeed=cf, error=str(exc)))
                except Exception:  # never the end of the task: the values in use stay; next time
                    log.exception("reading the changefeed's Secrets again failed", extra=fields(changefeed=cf))

    # -- looks ----------------------------------------------------------------------------------------------

    async def _ready(self, changefeed: str) -> bool:
        if changefeed in self.read:
            return True
        waiting = self.waiting.get(changefeed)
        if waiting is not None and time.monotonic() < waiting[0]:
            return False
        found = await self._look(changefeed)
        if isinstance(found, _Problem):
            self._said(changefeed, {found.side: found.message})
        elif found is not None:
            self._said(changefeed, {})
        if isinstance(found, Endpoints):
            self.routed.configure(changefeed, found)
            log.info("changefeed replicates etcd", extra=fields(changefeed=changefeed, sink=found.sink.kind))
        if isinstance(found, Endpoints) or found is _NO_DATAPLANE:
            self.waiting.pop(changefeed, None)
            self.read.add(changefeed)
            return True
        delay = min(waiting[1] * 2, RETRY[1]) if waiting else RETRY[0]
        self.waiting[changefeed] = (time.monotonic() + delay, delay)
        return False

    async def _reload(self, changefeed: str) -> None:
        """The Secrets read again: new values handed to the data plane, which tries them; the troubles of both sides
        set or cleared once, after (not cleared while new values are being tried: a report in between would say
        all is well)."""
        found = await self._look(changefeed)
        problems: dict[Side, str] = {}
        if isinstance(found, _Problem):
            problems[found.side] = found.message + "; still using the values read before"
        elif isinstance(found, Endpoints):
            problems = await self.routed.reconfigure(changefeed, found)
        elif found is None:
            return  # an unreadable Changefeed: what was said stays
        self._said(changefeed, problems)

    def _said(self, changefeed: str, problems: dict[Side, str]) -> None:
        for side in (SOURCE, SINK):
            if side in problems:
                self.troubles.set(changefeed, side, SECRETS, False, problems[side])
            else:
                self.troubles.clear(changefeed, side, SECRETS)

    async def _look(self, changefeed: str) -> Endpoints | _Problem | object | None:
        """The changefeed's Endpoints, ``_NO_DATAPLANE`` if it names no source and no sink, a ``_Problem`` if what
        it names cannot be used, None if the Changefeed cannot be read."""
        try:
            raw = await self.client.get(CHANGEFEEDS, self.namespace, changefeed)
            cf = changefeed_from_resource(raw)
        except InvalidResource as exc:
            log.warning("unreadable changefeed", extra=fields(changefeed=changefeed, error=str(exc)))
            return None
        if cf.checkpoint_ts:
            self.routed.published(changefeed, cf.checkpoint_ts)
        return await self._endpoints(changefeed, cf.source_secret, cf.sink_kind, cf.sink_secret)

    async def _endpoints(
        self, changefeed: str, source_secret: str, sink_kind: str, sink_secret: str
    ) -> Endpoints | _Problem | object:
        if not source_secret and not sink_secret:
            return _NO_DATAPLANE
        if not sink_secret:
            return _Problem(SINK, "the changefeed names a source but no sink (spec.sink.postgres or spec.sink.mysql)")
        if not source_secret:
            return _Problem(SOURCE, "the changefeed names a sink but no source (spec.source.etcd.secretRef)")
        source = await self._secret(SOURCE, source_secret)
        if isinstance(source, _Problem):
            return source
        sink = await self._secret(SINK, sink_secret)
        if isinstance(sink, _Problem):
            return sink
        where = f"the source Secret {self.namespace}/{source_secret}"
        endpoints = tuple(e.strip() for e in source.get("endpoints", "").split(",") if e.strip())
        if not endpoints:
            return _Problem(SOURCE, f"{where} has no key endpoints (comma-separated etcd endpoints)")
        tls = etcd.tls_of(source)
        problem = etcd.problem(endpoints, tls)
        if problem:
            return _Problem(SOURCE, f"{where}: {problem}")
        try:
            target = kinds.from_secret(sink_kind, changefeed, sink)
        except sinks.Unusable as exc:
            return _Problem(SINK, f"the sink Secret {self.namespace}/{sink_secret}: {exc}")
        username, password = source.get("username") or None, source.get("password") or None
        return Endpoints(endpoints, target, username, password, tls)

    async def _secret(self, side: Side, name: str) -> dict[str, str] | _Problem:
        try:
            return secret_data(await self.client.get(SECRET_RESOURCE, self.namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return _Problem(side, f"the {side} Secret {self.namespace}/{name} does not exist")
            if exc.status == 403:
                return _Problem(
                    side,
                    f"this capture may not read the {side} Secret {self.namespace}/{name} ({exc.message}): its Role "
                    "needs get on Secrets",
                )
            raise
