"""An informer of raw objects: one stream (``controller.kube.reflector``) into a dict by name.

The capture's view of its Dispatchers and of its Capture. It is the same reflector as the maintainer's informer
(the same LIST, resume, 410 and apply-failure rules); only the cache differs: the maintainer converts what it reads
into records and indexes, this one keeps the objects as they are, with the names that changed since its owner last
looked (``take_dirty``), so that the capture's reconcile pass visits what changed rather than everything. A watch
that breaks is resumed from its resourceVersion (the server replays what was missed); 410 and a failure to apply
list again. ``changed`` is set on every change, so the owner's loop wakes at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from controller.kube.client import Client, Resource
from controller.kube.reflector import Reflector

log = logging.getLogger("controller.kube.objects")
JSON = dict[str, Any]


class ObjectInformer:
    def __init__(
        self,
        client: Client,
        resource: Resource,
        namespace: str,
        *,
        label_selector: str = "",
        keep: Callable[[JSON], bool] | None = None,
        changed: asyncio.Event | None = None,
        logger: logging.Logger = log,
    ) -> None:
        self.keep = keep
        self.changed = changed if changed is not None else asyncio.Event()
        self.objects: dict[str, JSON] = {}
        #: Names changed, added or removed since the last ``take_dirty`` (a LIST marks every name).
        self.dirty: set[str] = set()
        self.synced = asyncio.Event()
        #: LISTs made (the first one included).
        self.relists = 0
        #: Lists and events it failed to apply (a bug: each logged with its traceback, then a LIST).
        self.apply_failures = 0
        self.reflector = Reflector(
            client, resource, namespace, self, name=resource.plural, selector=label_selector, logger=logger
        )

    async def run(self) -> None:
        """Forever (until cancelled)."""
        await self.reflector.run()

    def take_dirty(self) -> set[str]:
        """The names that changed since the last call (and forget them)."""
        dirty, self.dirty = self.dirty, set()
        return dirty

    def _wanted(self, obj: JSON) -> bool:
        return self.keep is None or self.keep(obj)

    # -- reflector.Target -------------------------------------------------------------------------------

    async def ready(self) -> None:
        return None

    def begin_listing(self) -> dict[str, JSON]:
        return {}

    def list_chunk(self, listing: dict[str, JSON], items: list[JSON]) -> None:
        for obj in items:
            if self._wanted(obj):
                listing[obj["metadata"]["name"]] = obj

    def page_read(self, listing: dict[str, JSON]) -> None:
        return None

    def end_listing(self, listing: dict[str, JSON], rv: str) -> None:
        self.dirty |= set(self.objects) | set(listing)
        self.objects = listing

    def listed(self, again: bool) -> None:
        self.relists += 1
        self.synced.set()
        self.changed.set()

    def put(self, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        if not self._wanted(obj):
            # Not wanted any more (e.g. the label was changed away from this capture): forget it.
            self.delete(obj)
            return
        self.objects[name] = obj
        self.dirty.add(name)
        self.changed.set()

    def delete(self, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        if self.objects.pop(name, None) is not None:
            self.dirty.add(name)
            self.changed.set()

    def heard(self) -> None:
        return None

    def interrupted(self) -> None:
        return None

    def broke(self) -> bool:
        return False  # resumed: the server replays what the stream missed (410 lists again)

    def failed_to_apply(self) -> None:
        self.apply_failures += 1
