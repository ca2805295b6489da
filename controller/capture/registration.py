"""The capture's own ``Capture`` object: made if missing, marked draining for a shutdown and cleared again by the next
process, and given its status (a dispatcher count, for people: liveness is the Lease).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from controller.capture.logs import fields
from controller.kube.client import JSON, RESOURCES, ApiError, Client
from controller.model.resources import DRAIN_FOR_SHUTDOWN, DRAIN_REASON_ANNOTATION
from controller.model.states import Kind

log = logging.getLogger("controller.capture")
CAPTURES = RESOURCES[Kind.CAPTURE]
#: Seconds between rewrites of an unchanged Capture status.
CAPTURE_STATUS_REFRESH = 300.0


class CaptureObject:
    def __init__(self, client: Client, namespace: str, name: str, *, pod: str = "", address: str = "") -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.pod = pod
        self.address = address
        #: The status last written, and when (monotonic).
        self.status: dict[str, Any] = {}
        self.status_at = -1e9

    async def ensure(self) -> None:
        """Create it if it does not exist."""
        body: JSON = {
            "apiVersion": CAPTURES.group + "/" + CAPTURES.version,
            "kind": CAPTURES.kind,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {},
        }
        try:
            await self.client.create(CAPTURES, self.namespace, body)
            log.info("created Capture", extra=fields(capture=self.name))
        except ApiError as exc:
            if not exc.already_exists:
                raise

    async def _set_shutdown_drain(self, current: JSON, on: bool) -> None:
        """``spec.draining`` and the shutdown annotation together, on the Capture as read (its resourceVersion)."""
        patch = {
            "metadata": {
                "resourceVersion": current["metadata"]["resourceVersion"],
                "annotations": {DRAIN_REASON_ANNOTATION: DRAIN_FOR_SHUTDOWN if on else None},
            },
            "spec": {"draining": on},
        }
        await self.client.patch(CAPTURES, self.namespace, self.name, patch)

    async def mark_draining(self) -> None:
        """``spec.draining: true``, with the annotation that says the agent set it for its shutdown (so the next
        process of this capture clears it). A drain a person set already stays theirs."""
        current = await self.client.get(CAPTURES, self.namespace, self.name)
        if (current.get("spec") or {}).get("draining"):
            return
        await self._set_shutdown_drain(current, True)
        log.info("marked the Capture draining for shutdown", extra=fields(capture=self.name))

    async def end_shutdown_drain(self) -> None:
        """A previous process of this capture drained it for its shutdown: this one is new and empty, so the
        maintainer may place spans on it again (a person's drain, without the annotation, stays)."""
        current = await self.client.get(CAPTURES, self.namespace, self.name)
        annotations = (current.get("metadata") or {}).get("annotations") or {}
        if annotations.get(DRAIN_REASON_ANNOTATION) != DRAIN_FOR_SHUTDOWN:
            return
        await self._set_shutdown_drain(current, False)
        log.info("cleared the drain a previous process set for its shutdown", extra=fields(capture=self.name))

    async def report(self, dispatchers: int, interval: float) -> None:
        """The status, for people: when it changes, at most once per ``interval`` (a count that moves with every
        dispatcher placed is not worth a write each), or every ``CAPTURE_STATUS_REFRESH`` seconds (in case someone
        overwrote it; rarely: it is a write at rest). A change held back is written by a later call."""
        status = {"dispatchers": dispatchers, "pod": self.pod or None, "address": self.address or None}
        now = time.monotonic()
        since = now - self.status_at
        if status == self.status and since < CAPTURE_STATUS_REFRESH:
            return
        if self.status and since < interval:
            return
        try:
            await self.client.patch(CAPTURES, self.namespace, self.name, {"status": status}, sub="status")
        except ApiError as exc:
            if not exc.not_found:
                raise
            log.warning("Capture object is gone; registering again", extra=fields(capture=self.name))
            await self.ensure()
            return
        self.status, self.status_at = status, now
