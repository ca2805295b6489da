"""A graceful stop that moves the work off first (SIGTERM with ``--drain-timeout``): the capture marks its Capture
``spec.draining: true`` with the annotation ``cdc.maintainer.dev/drain-reason: shutdown`` (a drain a person set stays
as it is), goes on replicating while the maintainer's drain scheduler moves each of its spans off with a Move (the
destination runs before the origin closes: no span goes Absent), and stops once it holds nothing (nothing it runs, no
close unfinished, no unclosed Dispatcher assigned to it), or when the timeout runs out: then it stops what is left as
without a drain, and the maintainer places those spans again from their checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from controller.capture.lease_keeper import API_ERRORS
from controller.capture.logs import fields
from controller.capture.registration import CaptureObject
from controller.capture.runs import Runs
from controller.kube.client import JSON, RESOURCES, Client
from controller.kube.objects import ObjectInformer
from controller.model.resources import CAPTURE_LABEL
from controller.model.states import CLOSED_DISPATCHER_STATES, Kind

log = logging.getLogger("controller.capture")
DISPATCHERS = RESOURCES[Kind.DISPATCHER]
_CLOSED = frozenset(st.value for st in CLOSED_DISPATCHER_STATES)


def unfinished(obj: JSON) -> bool:
    """A Dispatcher its capture still has to run or close: being deleted (its finalizer still on), or not closed (a
    closed one not being deleted is the maintainer's to delete)."""
    deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
    return deleting or (obj.get("status") or {}).get("state") not in _CLOSED


class Drainer:
    def __init__(
        self,
        client: Client,
        capture: CaptureObject,
        runs: Runs,
        dispatchers: ObjectInformer,
        stop: asyncio.Event,
        timeout: float,
    ) -> None:
        self.client = client
        self.capture = capture
        self.runs = runs
        self.dispatchers = dispatchers
        #: Set when the drain is over (drained, timed out, or it could not begin): the agent stops.
        self.stop = stop
        self.timeout = timeout

    def holding(self) -> list[str]:
        """What this capture still holds: what it runs, what is being deleted whose close has not finished, and what
        is assigned to it and not closed (a Pending one created before the maintainer saw the drain)."""
        return sorted(set(self.runs) | {n for n, o in self.dispatchers.objects.items() if unfinished(o)})

    async def assigned(self) -> list[str]:
        """A consistent read (LIST without resourceVersion) of the Dispatchers assigned to this capture that it would
        still have to run or close: what its watch may not show yet. Unreadable: assume some are."""
        name, ns = self.capture.name, self.capture.namespace
        try:
            items, _ = await self.client.list(DISPATCHERS, ns, label_selector=f"{CAPTURE_LABEL}={name}")
        except API_ERRORS:
            return ["(unreadable)"]
        return [o["metadata"]["name"] for o in items if (o.get("spec") or {}).get("capture") == name and unfinished(o)]

    async def drain_then_stop(self) -> None:
        began = time.monotonic()
        try:
            try:
                await self.capture.mark_draining()
            except API_ERRORS as exc:
                log.warning("could not mark the Capture draining; stopping now", extra=fields(error=repr(exc)))
                return
            log.info(
                "draining before exit: waiting for the maintainer to move the dispatchers off",
                extra=fields(capture=self.capture.name, dispatchers=len(self.holding()), timeout=self.timeout),
            )
            while time.monotonic() - began < self.timeout and not self.stop.is_set():
                if not self.holding() and not await self.assigned():
                    log.info(
                        "drained: every dispatcher moved off",
                        extra=fields(capture=self.capture.name, seconds=round(time.monotonic() - began, 3)),
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await self.stop.wait()
            left = self.holding()
            if left:
                log.warning(
                    "drain timed out; stopping the dispatchers still here (their spans are placed again)",
                    extra=fields(capture=self.capture.name, dispatchers=len(left), timeout=self.timeout),
                )
        finally:
            self.stop.set()
