"""Sharded cache: the unassigned objects' streams, and the labels that bring a user's objects into their shard.

A sharded replica watches Tables, Spans, Dispatchers and SpanOperators per changefeed it leads, selected by the
label ``cdc.maintainer.dev/changefeed``. What a user creates without it (or labelled with another changefeed
than its ``spec.changefeed``) reaches no shard until it is labelled; the leader of its changefeed writes the
label (one metadata patch each). The informer says what it saw (``Informer.take_relabel``, the unassigned store
and ``take_unassigned_changed``); this part keeps the unassigned streams selecting against the live changefeeds
and writes the labels, retrying what failed for a reason that may pass.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection

from controller.kube.client import RESOURCES, ApiError, Client
from controller.kube.informer import Informer
from controller.kube.store import UNASSIGNED, label_of
from controller.logs import fields
from controller.model import resources as conv
from controller.model.states import Kind

log = logging.getLogger("controller.maintainer")
#: At least this many seconds between two restarts of the unassigned objects' streams (their selector names every
#: live changefeed: creating 30 changefeeds at once restarts them about once, not 30 times).
UNASSIGNED_DEBOUNCE = 1.0
#: Labels written at once.
LABEL_CONCURRENCY = 8
#: Seconds before a label that failed for a reason that may pass (the API down, a timeout) is tried again.
RETRY = 1.0


class Labeller:
    def __init__(self, client: Client, namespace: str, informer: Informer) -> None:
        self.client = client
        self.namespace = namespace
        self.informer = informer
        self._unassigned_at = -math.inf
        self._task: asyncio.Task[None] | None = None
        #: The led changefeeds when the unassigned objects were last looked at.
        self._seen: frozenset[str] | None = None
        #: Labels to try again (kind, name) -> changefeed, and not before when.
        self._retry: dict[tuple[str, str], str] = {}
        self._retry_at = -math.inf
        #: Labels the API refused (logged once each).
        self._refused: set[tuple[str, str, str]] = set()

    def upkeep(self, changefeeds: Collection[str], leading: Collection[str]) -> None:
        """From the supervisor's turn: keep the unassigned objects' streams selecting against the live
        ``changefeeds``, and label what must be for the changefeeds this replica is ``leading``."""
        inf = self.informer
        if not inf.sharded:
            return
        now = time.monotonic()
        if now - self._unassigned_at >= UNASSIGNED_DEBOUNCE and inf.watch_unassigned(changefeeds):
            self._unassigned_at = now
        if self._task is not None and not self._task.done():
            return
        led = frozenset(leading)
        todo = inf.take_relabel()
        if now >= self._retry_at:
            todo = {**self._retry, **todo}
            self._retry = {}
        if inf.take_unassigned_changed() or led != self._seen:
            self._seen = led
            for kind in UNASSIGNED:
                for name, rec in inf.unassigned.all(Kind(kind)).items():
                    cf = str(getattr(rec, "changefeed", ""))
                    if cf in led and dict(rec.labels).get(conv.CHANGEFEED_LABEL) != cf:
                        todo[(kind, name)] = cf
        if todo:
            self._task = asyncio.create_task(self._label(todo), name="labels")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _later(self, kind: str, name: str, changefeed: str) -> None:
        self._retry.setdefault((kind, name), changefeed)
        self._retry_at = time.monotonic() + RETRY

    async def _label(self, todo: dict[tuple[str, str], str]) -> None:
        """Write ``cdc.maintainer.dev/changefeed`` on each object of ``todo``. What fails for a reason that may pass
        is tried again a second later; a refusal is logged, once per object."""
        sem = asyncio.Semaphore(LABEL_CONCURRENCY)

        async def one(kind: str, name: str, changefeed: str) -> None:
            patch = {"metadata": {"labels": {conv.CHANGEFEED_LABEL: changefeed}}}
            async with sem:
                try:
                    obj = await self.client.patch(RESOURCES[Kind(kind)], self.namespace, name, patch)
                except ApiError as exc:
                    if exc.not_found:
                        return
                    if exc.status >= 500 or exc.status == 429:
                        self._later(kind, name, changefeed)
                        return
                    if (kind, name, changefeed) in self._refused:
                        return
                    self._refused.add((kind, name, changefeed))
                    log.error(
                        "changefeed %s: could not label %s %s with %s=%s (its shard watch cannot see it): %s",
                        changefeed,
                        kind,
                        name,
                        conv.CHANGEFEED_LABEL,
                        changefeed,
                        exc,
                        extra=fields(changefeed=changefeed),
                    )
                    return
                except Exception as exc:  # connection refused or reset, a timeout: again in a second
                    log.debug("labelling %s %s failed: %r; retrying", kind, name, exc)
                    self._later(kind, name, changefeed)
                    return
            if label_of(obj) == changefeed:
                self.informer.offer(kind, obj)
            log.info(
                "changefeed %s: labelled %s %s with %s=%s",
                changefeed,
                kind,
                name,
                conv.CHANGEFEED_LABEL,
                changefeed,
                extra=fields(changefeed=changefeed),
            )

        await asyncio.gather(*(one(k, n, cf) for (k, n), cf in todo.items()))
