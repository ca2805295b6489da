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
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from controller.engine.index import Index
from controller.engine.liveness import Silence, ViewClock
from controller.kube.client import LEASES, LIST_PAGE, RESOURCES, ApiError, Client, Resource
from controller.model import resources as conv
from controller.model.progress import PROGRESS_ANNOTATION, ProgressEntry
from controller.model.records import Capture, Dispatcher, Record, Span
from controller.model.states import API_VERSION, Kind

log = logging.getLogger(__name__)
JSON = dict[str, Any]
LEASE = "Lease"
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


def _rv_of(rec: Record) -> int:
    try:
        return int(rec.resource_version or 0)
    except ValueError:
        return 0


#: Kinds kept as records only (their raw objects are dropped once converted): the many. Captures and
#: Leases (a few per capture and changefeed) keep their raw objects: a Capture's record is computed
#: from its object and its Lease together.
RECORD_ONLY = frozenset(
    {Kind.CHANGEFEED.value, Kind.TABLE.value, Kind.SPAN.value, Kind.DISPATCHER.value, Kind.OPERATOR.value}
)
SPAN, DISPATCHER = Kind.SPAN.value, Kind.DISPATCHER.value
#: Seconds a LIST waits for another kind's LIST to end before it goes ahead all the same.
LIST_PATIENCE = 5.0
#: At most this many distinct label and finalizer tuples are shared (``Store._compact``).
MAX_INTERNED = 10_000
#: Lease names that are captures' (``capture-<name>``); the maintainers' own are ``cfm-<changefeed>``.
CAPTURE_LEASE_PREFIX = conv.lease_name("")


def _report(lease: JSON | None) -> tuple[ProgressEntry, ...] | None:
    """The entries of the progress report a Lease carries (() if none; None if it does not parse). Only
    the entries matter to a decision, not when the report was made."""
    annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}
    text = annotations.get(PROGRESS_ANNOTATION) if isinstance(annotations, dict) else None
    if not text:
        return ()
    report = conv.progress_from_json(text)
    return None if report is None else report.entries


def _report_changefeeds(
    before: tuple[ProgressEntry, ...] | None, after: tuple[ProgressEntry, ...] | None
) -> set[str] | None:
    """The changefeeds whose entries differ between two reports (None, every changefeed, if one of them
    does not parse)."""
    if before is None or after is None:
        return None
    old = {(e.changefeed, e.mode): e for e in before}
    new = {(e.changefeed, e.mode): e for e in after}
    return {key[0] for key in old.keys() | new.keys() if old.get(key) != new.get(key)}


@dataclass
class Listing:
    """A LIST of one kind under way (``Store.begin_listing``)."""

    names: set[str] = field(default_factory=set)
    touched: set[str] = field(default_factory=set)
    #: The raw objects of a kind kept raw (Leases, Captures), replaced whole at the end.
    held: list[JSON] = field(default_factory=list)


@dataclass
class Store:
    """Records per kind by name, with tombstones, and the engine's per-changefeed ``Index`` over them.

    Spans, Dispatchers, SpanOperators, Tables and Changefeeds are converted to records as they arrive and
    their raw objects dropped (at 50,000 spans the raw JSON would be most of the process's memory);
    each record is also routed to the ``Index`` of its changefeed, which keeps the candidate sets and
    aggregates a decision needs (``controller.engine.index``). Captures and Leases keep their raw
    objects (few), and a Capture's record is converted lazily with its Lease.

    ``last_change`` says, after each ``put``/``remove``, which changefeeds the change concerns: a set of
    names (a record of theirs; a capture's Lease whose progress report changed for them, which may move
    their checkpoint), ``None`` for every changefeed (a Capture, a capture's Lease that may change its
    liveness or whether it is taken), or an empty set (nothing a decision depends on: a live capture's
    Lease renewal with the same report, a maintainer's Lease).
    """

    objects: dict[str, dict[str, JSON]] = field(default_factory=dict)
    tombstones: dict[str, dict[str, int]] = field(default_factory=dict)
    records: dict[str, dict[str, Record]] = field(default_factory=dict)
    #: name -> (resourceVersion, message) of an object that could not be converted.
    invalid: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    #: The health of our view of Leases (driven by the informer's Lease stream), on the monotonic clock.
    lease_view: ViewClock = field(default_factory=lambda: ViewClock(fresh=LEASE_FRESH))
    #: Per Lease: when its renewTime last changed, on ``lease_view``.
    silence: Silence = field(init=False)
    indexes: dict[str, Index] = field(default_factory=dict)
    last_change: set[str] | None = field(default_factory=set)
    #: Capture records as converted with their Lease (memo; ``renew_time`` is put on our clock on reads).
    _captures: dict[str, Capture] = field(default_factory=dict)
    #: Label and finalizer tuples shared by the records that carry equal ones (``_compact``).
    _tuples: dict[tuple[object, ...], tuple[object, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.silence = Silence(self.lease_view)

    def _observe_lease(self, obj: JSON, now: float) -> set[str] | None:
        """Liveness is judged on *our* clock, as client-go does: a capture is alive while the renewTime
        of its Lease keeps changing, whatever its clock says, and only time during which our view of the
        Leases was current counts (``engine.liveness``). Skew can then delay the verdict "lost" (after a
        restart, by one lease duration) but never make a live capture look lost.

        Returns which changefeeds' decisions could see a difference (``last_change``'s convention): every
        one (None) for a new Lease, a new holder (a Lease taken or released: ``Capture.lease_taken``), a
        new duration, or a renewal of a Lease that had run out on our clock; the changefeeds named in the
        old or new progress report when the report changed (the checkpoint may move); none for a live
        capture's plain renewal (it only moves the time its Lease would run out, which
        ``Decision.next_due`` follows). ``now`` is monotonic."""
        name = obj["metadata"]["name"]
        spec = obj.get("spec") or {}
        renew = str(spec.get("renewTime") or "")
        old = self.objects.get(LEASE, {}).get(name)
        old_spec = (old or {}).get("spec") or {}
        silent = self.silence.of(name, now)
        concerned: set[str] | None = set()
        if (
            silent is None
            or old is None
            or old_spec.get("holderIdentity") != spec.get("holderIdentity")
            or old_spec.get("leaseDurationSeconds") != spec.get("leaseDurationSeconds")
        ):
            concerned = None
        elif str(old_spec.get("renewTime") or "") != renew:
            try:
                duration = float(spec.get("leaseDurationSeconds") or 0)
            except (TypeError, ValueError):
                duration = 0.0
            if silent >= duration:
                concerned = None  # it had run out on our clock: alive again
        if concerned is not None:
            before, after = _report(old), _report(obj)
            if before != after:
                concerned = _report_changefeeds(before, after)
        self.silence.observe(name, renew, now)
        return concerned

    def _bucket(self, kind: str) -> dict[str, JSON]:
        return self.objects.setdefault(kind, {})

    def _current_rv(self, kind: str, name: str) -> int | None:
        if kind in RECORD_ONLY:
            rec = self.records.get(kind, {}).get(name)
            if rec is not None:
                return int(rec.resource_version or 0)
            bad = self.invalid.get(kind, {}).get(name)
            return bad[0] if bad is not None else None
        obj = self._bucket(kind).get(name)
        return _rv(obj) if obj is not None else None

    # -- routing to the indexes ------------------------------------------------------------------

    def index(self, changefeed: str) -> Index:
        """The index of ``changefeed``'s records (made empty on first use)."""
        idx = self.indexes.get(changefeed)
        if idx is None:
            idx = self.indexes[changefeed] = Index(changefeed)
        return idx

    @staticmethod
    def _changefeed_of(rec: Record | None) -> str | None:
        if rec is None:
            return None
        if rec.kind is Kind.CHANGEFEED:
            return rec.name
        return getattr(rec, "changefeed", None)

    def _route(self, old: Record | None, new: Record | None) -> set[str]:
        """Keep the indexes current with ``old`` replaced by ``new``; the changefeeds concerned."""
        before, after = self._changefeed_of(old), self._changefeed_of(new)
        touched: set[str] = set()
        if old is not None and before is not None and before != after:
            self.index(before).remove(old.kind, old.name)
            touched.add(before)
        if new is not None and after is not None:
            self.index(after).put(new)
            touched.add(after)
        if old is not None and new is None and before is not None:
            touched.add(before)
        for cf in touched:
            idx = self.indexes.get(cf)
            if idx is not None and idx.empty():
                del self.indexes[cf]
        return touched

    # -- events ------------------------------------------------------------------------------------

    def put(self, kind: str, obj: JSON) -> bool:
        name = obj["metadata"]["name"]
        rv = _rv(obj)
        current = self._current_rv(kind, name)
        self.last_change = set()
        if current is not None and current >= rv:
            return False
        if self.tombstones.get(kind, {}).get(name, -1) >= rv:
            return False
        self.tombstones.get(kind, {}).pop(name, None)
        if kind in RECORD_ONLY:
            self._put_record(kind, name, rv, obj)
            return True
        if kind == LEASE:
            concerned = self._observe_lease(obj, time.monotonic())
            self._bucket(kind)[name] = obj
            capture = name[len(CAPTURE_LEASE_PREFIX) :] if name.startswith(CAPTURE_LEASE_PREFIX) else ""
            self._captures.pop(capture, None)
            self.last_change = concerned if capture else set()
            return True
        self._bucket(kind)[name] = obj
        self.records.get(kind, {}).pop(name, None)
        self.invalid.get(kind, {}).pop(name, None)
        self._captures.pop(name, None)
        self.last_change = None  # a Capture: every changefeed's decisions look at the captures
        return True

    def _compact(self, rec: Record) -> Record:
        """``rec`` sharing what it repeats of other records: label and finalizer tuples, the changefeed,
        capture and namespace strings, and a Dispatcher its Span's key range and name (a few hundred bytes
        a span at 50,000 spans). Equal values, fewer objects."""
        changes: dict[str, object] = {}
        for attr, table in (("labels", self._tuples), ("finalizers", self._tuples)):
            value = getattr(rec, attr)
            if len(table) < MAX_INTERNED:
                shared = table.setdefault(value, value)
                if shared is not value:
                    changes[attr] = shared
        for attr in ("namespace", "changefeed", "capture"):
            value = getattr(rec, attr, None)
            if isinstance(value, str) and value:
                interned = sys.intern(value)
                if interned is not value:
                    changes[attr] = interned
        if isinstance(rec, Dispatcher):
            span = self.records.get(SPAN, {}).get(rec.span)
            if isinstance(span, Span):
                changes["span"] = span.name
                if span.key_range == rec.key_range:
                    changes["key_range"] = span.key_range
        elif isinstance(rec, Span):
            d = self.records.get(DISPATCHER, {}).get(rec.dispatcher) if rec.dispatcher else None
            if d is not None:
                changes["dispatcher"] = d.name
            old = self.records.get(SPAN, {}).get(rec.name)
            if isinstance(old, Span) and old.key_range == rec.key_range:
                changes["key_range"] = old.key_range
        if changes:
            # ``rec`` is fresh from conversion and not shared yet: fill in the shared values in place rather
            # than copy it (records are frozen for their users; this is where they are made).
            rec.__dict__.update(changes)
        return rec

    def _put_record(self, kind: str, name: str, rv: int, obj: JSON) -> None:
        old = self.records.get(kind, {}).get(name)
        try:
            rec: Record | None = self._compact(conv.from_resource(obj))
        except conv.InvalidResource as exc:
            self.invalid.setdefault(kind, {})[name] = (rv, str(exc))
            rec = None
        if rec is None:
            self.records.get(kind, {}).pop(name, None)
        else:
            self.invalid.get(kind, {}).pop(name, None)
            self.records.setdefault(kind, {})[name] = rec
        self.last_change = self._route(old, rec)

    def remove(self, kind: str, name: str, rv: int) -> None:
        self.last_change = set()
        current = self._current_rv(kind, name)
        if current is not None and current > rv:
            return
        self._bucket(kind).pop(name, None)
        old = self.records.get(kind, {}).pop(name, None)
        self.invalid.get(kind, {}).pop(name, None)
        self.tombstones.setdefault(kind, {})[name] = rv
        if kind in RECORD_ONLY:
            self.last_change = self._route(old, None)
        elif kind == LEASE:
            self.silence.forget(name)
            capture = name[len(CAPTURE_LEASE_PREFIX) :] if name.startswith(CAPTURE_LEASE_PREFIX) else ""
            self._captures.pop(capture, None)
            self.last_change = None if capture else set()
        else:
            self._captures.pop(name, None)
            self.last_change = None

    def replace_all(self, kind: str, items: list[JSON]) -> None:
        """What a LIST says is all there is of ``kind`` (in one page; see ``begin_listing``)."""
        listing = self.begin_listing(kind)
        self.list_page(kind, items, listing)
        self.end_listing(kind, listing)

    def begin_listing(self, kind: str) -> Listing:
        """A LIST of ``kind`` begins: its pages go to ``list_page``, then ``end_listing`` drops what it did
        not name. Records are converted page by page (the raw objects of 50,000 spans are never all alive
        at once); between pages the cache holds some objects as listed and others as they were, as it would
        with a watch running late."""
        self.tombstones[kind] = {}
        return Listing()

    def list_page(self, kind: str, items: list[JSON], listing: Listing) -> None:
        """One page of a LIST. Items are dropped from ``items`` as they are converted (the caller's list)."""
        if kind not in RECORD_ONLY:
            listing.held.extend(items)  # Leases and Captures (a few): replaced whole at the end
            return
        for i, obj in enumerate(items):
            name = obj["metadata"]["name"]
            listing.names.add(name)
            rv, current = _rv(obj), self._current_rv(kind, name)
            if current is None or current <= rv:  # not over a newer write-through that landed between pages
                self._put_record(kind, name, rv, obj)
                listing.touched |= self.last_change or set()
            items[i] = {"metadata": {"name": name}}  # the raw object is no longer needed

    def end_listing(self, kind: str, listing: Listing, rv: int = 0) -> None:
        """The LIST (a snapshot at ``rv``) is read: what it did not name goes, except records newer than the
        snapshot (write-throughs that landed between its pages; 0: none are kept)."""
        if kind not in RECORD_ONLY:
            items = listing.held
            self.objects[kind] = {o["metadata"]["name"]: o for o in items}
            if kind == LEASE:
                now = time.monotonic()
                for gone in set(self.silence.seen) - set(self.objects[kind]):
                    self.silence.forget(gone)
                for o in items:
                    self._observe_lease(o, now)
            self._captures.clear()
            self.last_change = None
            return
        touched = listing.touched
        records = self.records.get(kind, {})
        for name in [n for n, r in records.items() if n not in listing.names and not 0 < rv < _rv_of(r)]:
            old = self.records[kind].pop(name)
            touched |= self._route(old, None)
        for name in [n for n in self.invalid.get(kind, {}) if n not in listing.names]:
            del self.invalid[kind][name]
        self.last_change = touched

    def record(self, kind: Kind, name: str) -> Record | None:
        if kind.value in RECORD_ONLY:
            return self.records.get(kind.value, {}).get(name)
        if kind is not Kind.CAPTURE:
            return None
        obj = self._bucket(kind.value).get(name)
        if obj is None:
            return None
        try:
            return self._capture(obj, self._bucket(LEASE).get(conv.lease_name(name)))
        except conv.InvalidResource as exc:
            self.invalid.setdefault(kind.value, {})[name] = (_rv(obj), str(exc))
            return None

    def _capture(self, obj: JSON, lease: JSON | None, memo: bool = True) -> Capture:
        """The Capture with its Lease, ``renew_time`` on our clock: now minus its silence as we count it.
        The conversion is kept (``memo``) until the Capture or its Lease changes; the clock is read on every
        call, since silence grows with time."""
        name = obj["metadata"]["name"]
        rec = self._captures.get(name) if memo else None
        if rec is None:
            rec = conv.capture_from_resources(obj, lease)
            if memo:
                self._captures[name] = rec
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
                out[name] = self._capture(stub, lease, memo=False).evolve(deleting=True)
            except conv.InvalidResource:
                continue
        return out

    def all(self, kind: Kind) -> dict[str, Record]:
        """Every record of ``kind`` (a live view for the record-only kinds: do not change it)."""
        if kind.value in RECORD_ONLY:
            return self.records.setdefault(kind.value, {})
        out = {}
        for name in list(self._bucket(kind.value)):
            rec = self.record(kind, name)
            if rec is not None:
                out[name] = rec
        return out

    def names(self, kind: Kind) -> list[str]:
        if kind.value in RECORD_ONLY:
            return list(self.records.get(kind.value, {}))
        return list(self._bucket(kind.value))

    def owner_reference(self, changefeed: str) -> JSON | None:
        """The ownerReference naming Changefeed ``changefeed`` as cached (None if unknown or without uid)."""
        cf = self.records.get(Kind.CHANGEFEED.value, {}).get(changefeed)
        if cf is None or not cf.uid:
            return None
        return {
            "apiVersion": API_VERSION,
            "kind": "Changefeed",
            "name": cf.name,
            "uid": cf.uid,
            "controller": True,
        }


#: Objects (of a LIST page, a watch burst, a thaw's backlog) handled between two yields to the event loop.
CHUNK = 100


class Informer:
    """List+watch of the six kinds (and Leases) in one namespace."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        on_change: Callable[[str, str], None] | None = None,
        *,
        lease_fresh: float = LEASE_FRESH,
        page_size: int = LIST_PAGE,
    ) -> None:
        self.client = client
        self.namespace = namespace
        #: Objects per LIST page (0: one page).
        self.page_size = page_size
        self.store = Store(lease_view=ViewClock(fresh=lease_fresh))
        self.on_change = on_change
        self.synced = asyncio.Event()
        self._listed: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._list_gate = asyncio.Lock()
        # The small kinds first (one LIST at a time, in this order: the gate is FIFO): the maintainer bids for
        # Leases once Changefeeds and Leases are listed, while the big kinds still list (a cold start).
        first = (LEASE, Kind.CHANGEFEED.value, Kind.CAPTURE.value)
        every: dict[str, Resource] = {k.value: r for k, r in RESOURCES.items()}
        every[LEASE] = LEASES
        self.kinds: dict[str, Resource] = {k: every[k] for k in (*first, *sorted(set(every) - set(first)))}
        self._listed_events: dict[str, asyncio.Event] = {k: asyncio.Event() for k in self.kinds}
        # ``frozen``: while a decision runs in a thread over the store, nothing changes it; watch events and
        # LIST pages wait (``_thawed``), and writes offered through are applied at the thaw, in order.
        self._frozen = 0
        self._thawing = False
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._backlog: list[Callable[[], None]] = []

    async def start(self) -> None:
        for kind, res in self.kinds.items():
            self._tasks.append(asyncio.create_task(self._run(kind, res), name=f"informer-{kind}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_listed(self, *kinds: str) -> None:
        """Until each of ``kinds`` has been listed once (``synced`` waits for all of them)."""
        for kind in kinds:
            await self._listed_events[kind].wait()

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

    # -- freezing ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[None]:
        """Nothing changes the store while inside (a decision reads it from another thread): the watches stop
        reading (their streams wait), and what is offered or forgotten meanwhile is applied on the way out.
        Freezes nest."""
        self._frozen += 1
        self._thawed.clear()
        try:
            yield
        finally:
            self._frozen -= 1
            if not self._frozen:
                await self._thaw()

    async def _thaw(self) -> None:
        """Apply the backlog in order, yielding to the loop every ``CHUNK`` (a decision placing thousands of
        spans offers thousands of objects); what is offered meanwhile joins its end. Stops, leaving the rest,
        if another freeze began."""
        self._thawing = True
        try:
            while self._backlog and not self._frozen:
                chunk, self._backlog = self._backlog[:CHUNK], self._backlog[CHUNK:]
                for apply in chunk:
                    apply()
                if self._backlog:
                    await asyncio.sleep(0)
        finally:
            self._thawing = False
            if not self._frozen:
                if self._backlog:  # cancelled midway: nothing may be lost or reordered
                    backlog, self._backlog = self._backlog, []
                    for apply in backlog:
                        apply()
                self._thawed.set()

    async def _unfrozen(self) -> None:
        if not self._thawed.is_set():
            await self._thawed.wait()

    # -- write-through ---------------------------------------------------------------------------

    def offer(self, kind: str, obj: JSON) -> None:
        if self._frozen or self._thawing:
            self._backlog.append(lambda: self._offer(kind, obj))
        else:
            self._offer(kind, obj)

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None:
        if self._frozen or self._thawing:
            self._backlog.append(lambda: self._forget(kind, name, obj))
        else:
            self._forget(kind, name, obj)

    def _offer(self, kind: str, obj: JSON) -> None:
        if self.store.put(kind, obj):
            self._notify(kind, obj["metadata"]["name"])

    def _forget(self, kind: str, name: str, obj: JSON | None) -> None:
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

    async def _gate(self) -> bool:
        try:
            await asyncio.wait_for(self._list_gate.acquire(), LIST_PATIENCE)
        except TimeoutError:
            return False
        return True

    async def _run(self, kind: str, res: Resource) -> None:
        rv = ""
        backoff = MIN_BACKOFF
        failures = 0
        while True:
            try:
                if not rv:
                    # One kind's LIST at a time: at 50,000 spans a LIST's raw objects are a few hundred MB
                    # until converted, and two at once would double the process's peak memory. A LIST that
                    # hangs holds the others back for LIST_PATIENCE seconds at most.
                    held = await self._gate()
                    try:
                        await self._unfrozen()
                        listing = self.store.begin_listing(kind)
                        listed_rv = ""
                        pages = self.client.list_pages(res, self.namespace, limit=self.page_size)
                        async for items, page_rv in pages:
                            for i in range(0, len(items), CHUNK):
                                # A page converted a chunk at a time: 500 objects hold the loop up to 100 ms.
                                await self._unfrozen()
                                chunk = items[i : i + CHUNK]
                                items[i : i + CHUNK] = [{}] * len(chunk)  # the raw objects go as converted
                                self.store.list_page(kind, chunk, listing)
                                del chunk
                                await asyncio.sleep(0)
                            listed_rv = page_rv
                            del items
                        await self._unfrozen()
                        self.store.end_listing(kind, listing, int(listed_rv or 0))
                        rv = listed_rv  # only a LIST read to its end is watched from
                    finally:
                        if held:
                            self._list_gate.release()
                    self._listed.add(kind)
                    self._listed_events[kind].set()
                    self._heard(kind)
                    if failures:
                        log.info("watch %s back (relisted) after %d failed attempts", kind, failures)
                        failures = 0
                    self._notify(kind, "")
                    if self._listed >= set(self.kinds):
                        self.synced.set()
                burst = 0
                async for ev in self._events(kind, res, rv):
                    burst += 1
                    if burst % CHUNK == 0:
                        # Events already buffered come without a pause: a burst (thousands, after a freeze or a
                        # decision's writes) would hold the loop for as long as it takes.
                        await asyncio.sleep(0)
                    await self._unfrozen()
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

