"""Where a changefeed's data comes from and goes to: before the first dispatcher of a changefeed starts in this
process, its Changefeed is read (strongly) and, if it names a source and a sink, their Secrets too, and the data
plane is configured with them (``RoutedRuntime.configure``: its dispatchers then replicate etcd into PostgreSQL;
the others run the logical clock). A Secret missing or incomplete is a warning, and the dispatcher waits (a later
pass tries again). Credentials and the DSN are never logged: only the Secrets' names."""

from __future__ import annotations

import base64
import contextlib
import logging

from controller.capture.dataplane import Endpoints, unsupported_endpoint
from controller.capture.logs import Notes, fields
from controller.capture.routed import RoutedRuntime
from controller.kube.client import JSON, RESOURCES, SECRETS, ApiError, Client
from controller.model.resources import InvalidResource, changefeed_from_resource
from controller.model.states import Kind

log = logging.getLogger("controller.capture")
CHANGEFEEDS = RESOURCES[Kind.CHANGEFEED]


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

    async def ready(self, changefeed: str) -> bool:
        """Whether ``changefeed``'s dispatchers may start: its source looked up (and the data plane configured if it
        names one). False: try again at a later pass."""
        if changefeed in self.read:
            return True
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
            problem = unsupported_endpoint(endpoints)
            if problem:
                note(changefeed, "unsupported-source", logging.WARNING, f"{problem}; waiting", source=cf.source_secret)
                return False
            self.routed.configure(
                changefeed,
                Endpoints(endpoints, sink["dsn"], source.get("username") or None, source.get("password") or None),
            )
            log.info("changefeed replicates etcd to PostgreSQL",
                     extra=fields(changefeed=changefeed, source=cf.source_secret, sink=cf.sink_secret))  # fmt: skip
        self.read.add(changefeed)
        return True
