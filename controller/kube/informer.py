"""Informer: one LIST and then one WATCH per kind, feeding an in-memory cache of model records.

Why our own and not Kopf's watchers: the maintainer must know when every kind has been listed
(bootstrap decides nothing before that), and the liveness probe must reflect the health of the
watch streams, not only that the process is up (Kopf's best-known production failure is a watch that
ends silently: nolar/kopf#1276, #996, #787). Each stream resumes from the last resourceVersion it saw
(bookmarks keep it fresh) and relists on 410 Gone.

The cache also takes the maintainer's own writes (write-through): a successful write's response is
newer than anything the watch has delivered, so the next decision sees it at once. An older watch event
never overwrites a newer object, and a deleted object leaves a tombstone so a late event cannot
resurrect it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.kube.client import LEASES, RESOURCES, ApiError, Client, Resource
from controller.model import resources as conv
from controller.model.records import Record
from controller.model.states import Kind

log = logging.getLogger(__name__)
JSON = dict[str, Any]
LEASE = "Lease"


def _rv(obj: JSON) -> int:
    try:
        return int(obj.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


@dataclass
class Store:
    """Raw objects per kind by name, with tombstones; records are converted lazily and memoised."""

    objects: dict[str, dict[str, JSON]] = field(default_factory=dict)
    tombstones: dict[str, dict[str, int]] = field(default_factory=dict)
    records: dict[str, dict[str, Record]] = field(default_factory=dict)
    invalid: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Lease name -> (renewTime as written by its holder, our wall time when we saw it change).
    lease_seen: dict[str, tuple[str, float]] = field(default_factory=dict)

    def _observe_lease(self, obj: JSON, now: float) -> None:
        """Liveness is judged on *our* clock, as client-go does: a capture is alive while the renewTime
        of its Lease keeps changing, whatever its clock says. Skew can then delay the verdict "lost"
        (after a restart, by one lease duration) but never make a live capture look lost, which would
        let the maintainer release the finalizers of dispatchers that still run."""
        name = obj["metadata"]["name"]
        renew = str(obj.get("spec", {}).get("renewTime") or "")
        seen = self.lease_seen.get(name)
        if seen is None or seen[0] != renew:
            self.lease_seen[name] = (renew, now)

    def _bucket(self, kind: str) -> dict[str, JSON]:
        return self.objects.setdefault(kind, {})

    def put(self, kind: str, obj: JSON) -> bool:
        name = obj["metadata"]["name"]
        rv = _rv(obj)
        current = self._bucket(kind).get(name)
        if current is not None and _rv(current) >= rv:
            return False
        if self.tombstones.get(kind, {}).get(name, -1) >= rv:
            return False
        self._bucket(kind)[name] = obj
        if kind == LEASE:
            self._observe_lease(obj, time.time())
        self.tombstones.get(kind, {}).pop(name, None)
        self.records.get(kind, {}).pop(name, None)
        return True

    def remove(self, kind: str, name: str, rv: int) -> None:
        current = self._bucket(kind).get(name)
        if current is not None and _rv(current) > rv:
            return
        self._bucket(kind).pop(name, None)
        self.records.get(kind, {}).pop(name, None)
        self.invalid.get(kind, {}).pop(name, None)
        self.tombstones.setdefault(kind, {})[name] = rv

    def replace_all(self, kind: str, items: Iterable[JSON]) -> None:
        self.objects[kind] = {o["metadata"]["name"]: o for o in items}
        if kind == LEASE:
            now = time.time()
            for o in items:
                self._observe_lease(o, now)
        self.records[kind] = {}
        self.invalid[kind] = {}
        self.tombstones[kind] = {}

    def record(self, kind: Kind, name: str) -> Record | None:
        memo = self.records.setdefault(kind.value, {})
        if name in memo:
            return memo[name]
        obj = self._bucket(kind.value).get(name)
        if obj is None:
            return None
        try:
            if kind is Kind.CAPTURE:
                lease = self._bucket(LEASE).get(conv.lease_name(name))
                if lease is not None and lease["metadata"]["name"] in self.lease_seen:
                    observed = self.lease_seen[lease["metadata"]["name"]][1]
                    spec = {**lease.get("spec", {}), "renewTime": conv.format_time(observed, micro=True)}
                    lease = {**lease, "spec": spec}
                rec: Record = conv.capture_from_resources(obj, lease)
            else:
                rec = conv.from_resource(obj)
        except conv.InvalidResource as exc:
            self.invalid.setdefault(kind.value, {})[name] = str(exc)
            return None
        if kind is not Kind.CAPTURE:  # a Capture's record also depends on its Lease
            memo[name] = rec
        return rec

    def all(self, kind: Kind) -> dict[str, Record]:
        out = {}
        for name in list(self._bucket(kind.value)):
            rec = self.record(kind, name)
            if rec is not None:
                out[name] = rec
        return out


class Informer:
    """List+watch of the six kinds (and Leases) in one namespace."""

    def __init__(self, client: Client, namespace: str, on_change: Callable[[str, str], None] | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self.store = Store()
        self.on_change = on_change
        self.synced = asyncio.Event()
        self._listed: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.kinds: dict[str, Resource] = {k.value: r for k, r in RESOURCES.items()}
        self.kinds[LEASE] = LEASES

    async def start(self) -> None:
        for kind, res in self.kinds.items():
            self._tasks.append(asyncio.create_task(self._run(kind, res), name=f"informer-{kind}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def unlisted(self) -> list[str]:
        """The kinds not listed yet (sorted): the maintainer decides nothing before they all are."""
        return sorted(set(self.kinds) - self._listed)

    def healthy(self, stale_after: float = 120.0) -> tuple[bool, str]:
        """Every watch task alive and heard from recently (events or bookmarks)."""
        now = time.monotonic()
        for t in self._tasks:
            if t.done():
                return False, f"watch task {t.get_name()} ended"
        for kind, seen in self.last_seen.items():
            if now - seen > stale_after:
                return False, f"no event or bookmark for {kind} in {now - seen:.0f}s"
        return True, "ok"

    # -- write-through ---------------------------------------------------------------------------

    def offer(self, kind: str, obj: JSON) -> None:
        if self.store.put(kind, obj):
            self._notify(kind, obj["metadata"]["name"])

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None:
        self.store.remove(kind, name, _rv(obj) if obj else 0)
        self._notify(kind, name)

    def _notify(self, kind: str, name: str) -> None:
        if self.on_change is not None:
            self.on_change(kind, name)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self, kind: str, res: Resource) -> None:
        rv = ""
        backoff = 0.5
        while True:
            try:
                if not rv:
                    items, rv = await self.client.list(res, self.namespace)
                    self.store.replace_all(kind, items)
                    self._listed.add(kind)
                    self.last_seen[kind] = time.monotonic()
                    self._notify(kind, "")
                    if self._listed >= set(self.kinds):
                        self.synced.set()
                async for ev in self.client.watch(res, self.namespace, rv, timeout_seconds=240):
                    self.last_seen[kind] = time.monotonic()
                    typ = ev.get("type")
                    obj = ev.get("object") or {}
                    if typ == "ERROR":
                        code = obj.get("code")
                        log.info("watch %s ended with %s; relisting", kind, code)
                        rv = "" if code == 410 else rv
                        if code != 410:
                            await asyncio.sleep(backoff)
                        break
                    new_rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if typ == "BOOKMARK":
                        rv = new_rv
                        continue
                    rv = new_rv
                    name = obj["metadata"]["name"]
                    if typ == "DELETED":
                        self.forget(kind, name, obj)
                    elif self.store.put(kind, obj):
                        self._notify(kind, name)
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:
                    rv = ""
                    continue
                log.warning("watch %s failed: %s; retrying in %.1fs", kind, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception as exc:  # connection reset, server restart: resume from rv
                log.warning("watch %s broke: %s; retrying in %.1fs", kind, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

