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

Captures' liveness is judged on the Lease stream's health (``engine.liveness``): the time during which
that stream was broken, or silent for longer than ``lease_fresh``, does not count as the captures'
silence. An API outage is then nobody's silence, and when the API returns the captures are as alive as
they were. Reconnecting is quick on purpose (backoff at most ``MAX_BACKOFF``): after an outage the
streams resume from their resourceVersion (or relist on 410) within about a second. A stream that
delivers nothing for ``idle`` seconds (a connection that died without an error) is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from controller.engine.liveness import Silence, ViewClock
from controller.kube.client import LEASES, RESOURCES, ApiError, Client, Resource
from controller.model import resources as conv
from controller.model.records import Capture, Record
from controller.model.states import Kind

log = logging.getLogger(__name__)
JSON = dict[str, Any]
LEASE = "Lease"
CAPTURE_LEASE_PREFIX = conv.lease_name("")
#: Reconnect backoff: doubling from ``MIN_BACKOFF`` up to this (a returning API is used within ~1 s).
MIN_BACKOFF = 0.25
MAX_BACKOFF = 1.0
#: Seconds a Lease stream may stay quiet and still count as current (the maintainer's own renewals and
#: the captures' keep it busy every ~2 s while it leads).
LEASE_FRESH = 5.0
#: A stream silent this long is restarted: Leases change every few seconds; the other kinds get
#: bookmarks (a real API server sends them about once a minute).
IDLE = {LEASE: 15.0}
IDLE_DEFAULT = 90.0


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
    #: The health of our view of Leases (driven by the informer's Lease stream), on the monotonic clock.
    lease_view: ViewClock = field(default_factory=lambda: ViewClock(fresh=LEASE_FRESH))
    #: Per Lease: when its renewTime last changed, on ``lease_view``.
    silence: Silence = field(init=False)

    def __post_init__(self) -> None:
        self.silence = Silence(self.lease_view)

    def _observe_lease(self, obj: JSON, now: float) -> None:
        """Liveness is judged on *our* clock, as client-go does: a capture is alive while the renewTime
        of its Lease keeps changing, whatever its clock says, and only time during which our view of the
        Leases was current counts (``engine.liveness``). Skew can then delay the verdict "lost" (after a
        restart, by one lease duration) but never make a live capture look lost."""
        renew = str(obj.get("spec", {}).get("renewTime") or "")
        self.silence.observe(obj["metadata"]["name"], renew, now)

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
            self._observe_lease(obj, time.monotonic())
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
        if kind == LEASE:
            self.silence.forget(name)

    def replace_all(self, kind: str, items: Iterable[JSON]) -> None:
        self.objects[kind] = {o["metadata"]["name"]: o for o in items}
        if kind == LEASE:
            now = time.monotonic()
            for gone in set(self.silence.seen) - set(self.objects[kind]):
                self.silence.forget(gone)
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
                rec: Record = self._capture(obj, self._bucket(LEASE).get(conv.lease_name(name)))
            else:
                rec = conv.from_resource(obj)
        except conv.InvalidResource as exc:
            self.invalid.setdefault(kind.value, {})[name] = str(exc)
            return None
        if kind is not Kind.CAPTURE:  # a Capture's record also depends on its Lease
            memo[name] = rec
        return rec

    def _capture(self, obj: JSON, lease: JSON | None) -> Capture:
        """The Capture with its Lease, ``renew_time`` on our clock: now minus its silence as we count it."""
        rec = conv.capture_from_resources(obj, lease)
        silent = self.silence.of(conv.lease_name(rec.name), time.monotonic()) if lease is not None else None
        if silent is not None and rec.renew_time is not None:
            rec = rec.evolve(renew_time=time.time() - silent)
        return rec

    def captures(self) -> dict[str, Capture]:
        """Every Capture with its Lease, plus a record for each capture Lease whose Capture object is gone
        (marked deleting: never scheduled on, but its Lease still says whether its dispatchers may run)."""
        out = {n: r for n, r in self.all(Kind.CAPTURE).items() if isinstance(r, Capture)}
        for lease_name, lease in self._bucket(LEASE).items():
            name = lease_name.removeprefix(CAPTURE_LEASE_PREFIX)
            if not lease_name.startswith(CAPTURE_LEASE_PREFIX) or not name or name in out:
                continue
            if name in self._bucket(Kind.CAPTURE.value):
                continue  # an invalid Capture object: ignored like any invalid object
            meta = {"name": name}
            if lease["metadata"].get("namespace"):
                meta["namespace"] = lease["metadata"]["namespace"]
            stub = {"kind": "Capture", "metadata": meta}
            try:
                out[name] = self._capture(stub, lease).evolve(deleting=True)
            except conv.InvalidResource:
                continue
        return out

    def all(self, kind: Kind) -> dict[str, Record]:
        out = {}
        for name in list(self._bucket(kind.value)):
            rec = self.record(kind, name)
            if rec is not None:
                out[name] = rec
        return out


class Informer:
    """List+watch of the six kinds (and Leases) in one namespace."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        on_change: Callable[[str, str], None] | None = None,
        *,
        lease_fresh: float = LEASE_FRESH,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.store = Store(lease_view=ViewClock(fresh=lease_fresh))
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

    def _heard(self, kind: str) -> None:
        now = time.monotonic()
        self.last_seen[kind] = now
        if kind == LEASE:
            self.store.lease_view.heard(now)

    def _broken(self, kind: str) -> None:
        if kind == LEASE:
            self.store.lease_view.broken(time.monotonic())

    async def _events(self, kind: str, res: Resource, rv: str) -> AsyncIterator[JSON]:
        """The watch stream's events; ends (TimeoutError) when it delivers nothing for the kind's idle time."""
        stream = self.client.watch(res, self.namespace, rv, timeout_seconds=240)
        idle = IDLE.get(kind, IDLE_DEFAULT)
        try:
            while True:
                try:
                    async with asyncio.timeout(idle):
                        ev = await anext(stream)
                except StopAsyncIteration:
                    return
                yield ev
        finally:
            close = getattr(stream, "aclose", None)  # an async generator: release its connection now
            if close is not None:
                await close()

    def _failed(self, kind: str, failures: int, error: object, backoff: float) -> None:
        """The first failure of a run of them, then one in 20: an outage retries every second."""
        if failures == 1 or failures % 20 == 0:
            log.warning("watch %s broke (%d attempts): %r; retrying in %.2fs", kind, failures, error, backoff)

    async def _run(self, kind: str, res: Resource) -> None:
        rv = ""
        backoff = MIN_BACKOFF
        failures = 0
        while True:
            try:
                if not rv:
                    items, rv = await self.client.list(res, self.namespace)
                    self.store.replace_all(kind, items)
                    self._listed.add(kind)
                    self._heard(kind)
                    if failures:
                        log.info("watch %s back (relisted) after %d failed attempts", kind, failures)
                        failures = 0
                    self._notify(kind, "")
                    if self._listed >= set(self.kinds):
                        self.synced.set()
                async for ev in self._events(kind, res, rv):
                    self._heard(kind)
                    if failures:
                        log.info("watch %s back after %d failed attempts", kind, failures)
                        failures = 0
                    typ = ev.get("type")
                    obj = ev.get("object") or {}
                    if typ == "ERROR":
                        code = obj.get("code")
                        log.info("watch %s ended with %s; relisting", kind, code)
                        self._broken(kind)
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
                else:
                    self._broken(kind)  # the server ended the stream (its timeout): resume from rv at once
                backoff = MIN_BACKOFF
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                self._broken(kind)
                if exc.status == 410:
                    rv = ""
                    continue
                failures += 1
                self._failed(kind, failures, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            except Exception as exc:  # connection reset, server restart, an idle stream: resume from rv
                self._broken(kind)
                failures += 1
                self._failed(kind, failures, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

