"""Where a changefeed's data comes from and goes to: before the first dispatcher of a changefeed starts in this
process, its Changefeed is read (strongly) and, if it names a source and a sink, their Secrets too, and the data
plane is configured with them (``RoutedRuntime.configure``: its dispatchers then replicate etcd into PostgreSQL;
the others run the logical clock). A Secret missing or incomplete is a warning, and the dispatcher waits (a later
pass tries again). Credentials and the DSN are never logged: only the Secrets' names."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time

from controller.capture.dataplane import Endpoints
from controller.capture.logs import Notes, fields
from controller.capture.routed import RoutedRuntime
from controller.dataplane import etcd
from controller.kube.client import JSON, RESOURCES, SECRETS, ApiError, Client
from controller.model.resources import InvalidResource, changefeed_from_resource
from controller.model.states import Kind

log = logging.getLogger("controller.capture")
CHANGEFEEDS = RESOURCES[Kind.CHANGEFEED]
#: Seconds before a source that could not be used is looked at again: first, then doubling up to the cap.
RETRY = (2.0, 30.0)


def secret_data(secret: JSON) -> dict[str, str]:
    """A Secret's ``data``, decoded (base64 -> text). Never logged."""
    out = {}
    for key, value in (secret.get("data") or {}).items():
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            out[str(key)] = base64.b64decode(str(value)).decode()
    return out


class Sources:
    def __init__(self, client: Client, namespace: str, routed: RoutedRuntime, notes: Notes) -> None:
        self.client = client
        self.namespace = namespace
        self.routed = routed
        self.notes = notes
        #: Changefeeds whose source was looked up (its Secrets read, or found to have none).
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

    async def _ready(self, changefeed: str) -> bool:
        if changefeed in self.read:
            return True
        waiting = self.waiting.get(changefeed)
        if waiting is not None and time.monotonic() < waiting[0]:
            return False
        if await self._look(changefeed):
            self.waiting.pop(changefeed, None)
            self.read.add(changefeed)
            return True
        delay = min(waiting[1] * 2, RETRY[1]) if waiting else RETRY[0]
        self.waiting[changefeed] = (time.monotonic() + delay, delay)
        return False

    async def _look(self, changefeed: str) -> bool:
        note = self.notes.say
        try:
            cf = changefeed_from_resource(await self.client.get(CHANGEFEEDS, self.namespace, changefeed))
        except InvalidResource as exc:
            note(changefeed, "bad-changefeed", logging.WARNING, "unreadable changefeed", error=str(exc))
            return False
        if bool(cf.source_secret) != bool(cf.sink_secret):
            note(changefeed, "half-dataplane", logging.WARNING,
                 "the changefeed names a source without a sink or a sink without a source; waiting")  # fmt: skip
            return False
        if cf.source_secret:
            try:
                source = secret_data(await self.client.get(SECRETS, self.namespace, cf.source_secret))
                sink = secret_data(await self.client.get(SECRETS, self.namespace, cf.sink_secret))
            except ApiError as exc:
                if exc.status not in (403, 404):
                    raise
                note(changefeed, "no-secret", logging.WARNING, "cannot read the changefeed's Secrets; waiting",
                     source=cf.source_secret, sink=cf.sink_secret, status=exc.status)  # fmt: skip
                return False
            endpoints = tuple(e.strip() for e in source.get("endpoints", "").split(",") if e.strip())
            if not endpoints or not sink.get("dsn"):
                note(changefeed, "bad-secret", logging.WARNING,
                     "the source Secret needs endpoints and the sink Secret dsn; waiting",
                     source=cf.source_secret, sink=cf.sink_secret)  # fmt: skip
                return False
            tls = etcd.tls_of(source)
            problem = etcd.problem(endpoints, tls)
            if problem:
                note(changefeed, "unsupported-source", logging.WARNING, f"{problem}; waiting", source=cf.source_secret)
                return False
            username, password = source.get("username") or None, source.get("password") or None
            self.routed.configure(changefeed, Endpoints(endpoints, sink["dsn"], username, password, tls))
            log.info("changefeed replicates etcd to PostgreSQL",
                     extra=fields(changefeed=changefeed, source=cf.source_secret, sink=cf.sink_secret))  # fmt: skip
        return True
