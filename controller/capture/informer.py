"""List+watch of one resource kind into a local cache: the agent's view of the world.

Why hand-rolled: the agent needs exactly one behaviour, the client-go reflector's. List, then watch
from the list's resourceVersion; follow BOOKMARKs; when the stream ends (server timeout, API restart)
watch again from the last resourceVersion seen; on ``410 Gone`` (as an HTTP status or an ``ERROR``
event) or any other ``ERROR`` event, list again and replace the cache whole. Transport errors
(``TRANSPORT_ERRORS``) and error statuses back off and retry. The resourceVersion moves past an event
only once it is applied; anything else raised while listing or applying (a bug, e.g. in ``keep``) is
logged with its traceback, counted (``apply_failures``), and the informer lists again after the
back-off: no event is skipped in silence, and the watch never resumes past one the cache did not take
(issue 37). ``changed`` is set on every change so the agent's loop wakes up at once, and ``dirty``
collects the names of the objects that changed (or vanished) since the agent last took them, so that its
pass visits what changed rather than everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from controller.capture.logs import fields
from controller.kube.client import JSON, TRANSPORT_ERRORS, ApiError, Client, Resource

log = logging.getLogger("controller.capture.informer")

#: What the agent retries as an outage: the client's transport errors (a ``ValueError`` of our own is a bug).
NETWORK_ERRORS = TRANSPORT_ERRORS


class Relist(Exception):
    """The watch cannot resume from the last resourceVersion."""


class Informer:
    def __init__(
        self,
        client: Client,
        resource: Resource,
        namespace: str,
        *,
        label_selector: str = "",
        keep: Callable[[JSON], bool] | None = None,
        changed: asyncio.Event | None = None,
        watch_timeout: int = 60,
        backoff: float = 0.5,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.keep = keep
        self.changed = changed if changed is not None else asyncio.Event()
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.objects: dict[str, JSON] = {}
        #: Names changed, added or removed since the last ``take_dirty`` (a relist marks every name).
        self.dirty: set[str] = set()
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.relists = 0
        self.failures = 0  # consecutive failed attempts (logged sparingly)
        #: Lists and events it failed to apply (a bug: each logged with its traceback, then a relist).
        self.apply_failures = 0

    def take_dirty(self) -> set[str]:
        """The names that changed since the last call (and forget them)."""
        dirty, self.dirty = self.dirty, set()
        return dirty

    def _wanted(self, obj: JSON) -> bool:
        return self.keep is None or self.keep(obj)

    async def run(self) -> None:
        """Forever (until cancelled)."""
        need_list = True
        self.failures = 0
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                await self._watch()
            except Relist as exc:
                log.info("relisting %s", self.resource.plural, extra=fields(reason=str(exc)))
                need_list = True
            except ApiError as exc:
                if exc.status == 410:
                    need_list = True
                else:
                    self._failed(str(exc))
                    await asyncio.sleep(self.backoff)
            except NETWORK_ERRORS as exc:
                self._failed(repr(exc))
                await asyncio.sleep(self.backoff)
            except Exception:  # not the network's: never resumed past in silence
                self.apply_failures += 1
                log.exception(
                    "could not apply what the watch of %s delivered; relisting",
                    self.resource.plural,
                    extra=fields(apply_failures=self.apply_failures),
                )
                need_list = True
                await asyncio.sleep(self.backoff)

    def _failed(self, error: str) -> None:
        """Log the first failure of a run of them, then one in 20 (an outage retries twice a second)."""
        self.failures += 1
        if self.failures == 1 or self.failures % 20 == 0:
            log.warning("watch of %s failed", self.resource.plural, extra=fields(error=error, attempts=self.failures))

    def _recovered(self) -> None:
        if self.failures:
            log.info("watch of %s back", self.resource.plural, extra=fields(failed_attempts=self.failures))
            self.failures = 0

    async def _list(self) -> None:
        items, rv = await self.client.list(self.resource, self.namespace, self.label_selector)
        self._recovered()
        objects = {o["metadata"]["name"]: o for o in items if self._wanted(o)}
        self.dirty |= set(self.objects) | set(objects)
        self.objects = objects
        self.resource_version = rv
        self.relists += 1
        self.synced.set()
        self.changed.set()

    async def _watch(self) -> None:
        stream = self.client.watch(
            self.resource,
            self.namespace,
            self.resource_version,
            label_selector=self.label_selector,
            timeout_seconds=self.watch_timeout,
        )
        async with contextlib.aclosing(stream):  # a Relist (or a cancel) closes its connection now, not the collector
            async for event in stream:
                self._recovered()
                self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            raise Relist(f"{obj.get('code', '?')} {obj.get('reason', '')}: {obj.get('message', '')}")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        name = meta.get("name")
        if kind != "BOOKMARK" and isinstance(name, str):
            if kind == "DELETED" or not self._wanted(obj):
                # Not wanted any more (e.g. the label was changed away from this capture): forget it.
                if self.objects.pop(name, None) is not None:
                    self.dirty.add(name)
                    self.changed.set()
            else:
                self.objects[name] = obj
                self.dirty.add(name)
                self.changed.set()
        if rv:  # only once applied: a watch resumed after a failure starts at this event, not past it
            self.resource_version = str(rv)
