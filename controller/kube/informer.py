"""Informer: LIST then WATCH per stream, feeding an in-memory cache of model records. A stream is a whole kind in
the namespace or (sharded) a changefeed's shard of one, or the objects of a kind labelled with no live changefeed
(``Stream``); each lists again whenever its watch cannot simply resume (below).

Why our own and not Kopf's watchers: the maintainer must know when every kind has been listed
(bootstrap decides nothing before that), and the liveness probe must reflect the health of the
watch streams, not only that the process is up (Kopf's best-known production failure is a watch that
ends silently: nolar/kopf#1276, #996, #787). A stream the server ends resumes from the last resourceVersion it
saw (bookmarks, when the server sends any, keep it fresh); one that broke (an error, an API restart) relists if
it holds records, and its kind is in doubt until that LIST ends (``in_doubt``: the engine decides nothing on such
a view); 410 Gone relists. The resourceVersion a stream resumes from moves past an event only once
the event is applied: a LIST page or an event the cache fails to apply (an exception from the store, the index or
``on_change``: a bug, never taken for a transport error) is logged with its traceback, counted
(``apply_failures``), and the stream relists whatever its kind (a kind of records is in doubt until then): what
failed arrives with that LIST instead of being skipped in silence.

Watches are ended by the server, as client-go's are: each asks for a ``timeoutSeconds`` drawn between
``watch_timeout`` and twice that (5 to 10 minutes by default: the streams of a restarted API server do not all
end at once), and when the server ends a stream the informer resumes it from its last resourceVersion (a
resume, not a relist). A real kube-apiserver guarantees no BOOKMARKs, at any interval or at all (its watch
cache sends none for a kind it has seen no event for), so a quiet stream is normal: silence is never a reason
to restart a process (a probe that required events would restart an idle maintainer on a real cluster). The
client-side idle limit of a stream, the server's timeout plus ``IDLE_MARGIN``, only catches a connection that
died without an error.

Liveness (``healthy``) is progress: every watch task alive (retrying counts), and some request answered by
the API within ``progress_window`` (``Client.last_success``: a Lease renewal or bid, a LIST page, a watch that
connected or delivered). A working maintainer has one every few seconds (renewals every ``--retry-period``;
a quiet Lease stream is resumed every ``IDLE[LEASE]`` seconds, which connects again).

The cache also takes the maintainer's own writes (write-through): a successful write's response is
newer than anything the watch has delivered, so the next decision sees it at once. An older watch event
never overwrites a newer object, and a deleted object leaves a tombstone so a late event cannot
resurrect it.

Captures' liveness is judged on the Lease stream's health (``engine.liveness``): the time during which
that stream was broken, or silent for longer than ``lease_fresh``, does not count as the captures'
silence. An API outage is then nobody's silence, and when the API returns the captures are as alive as
they were. Reconnecting is quick on purpose (backoff at most ``MAX_BACKOFF``): after an outage the
streams resume from their resourceVersion (or relist on 410) within about a second. The Lease stream is
resumed after ``IDLE[LEASE]`` seconds of silence, far sooner than the others: while anything runs Leases
change every few seconds, so a silent Lease stream is most likely a dead one, and until it is resumed the
maintainer cannot see a capture stop renewing. When nothing renews (no capture, nothing led) it is merely
quiet: resuming it costs one request, is no failure and leaves the health as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.engine.index import Index
from controller.engine.liveness import Silence, ViewClock
from controller.engine.shards import Seen
from controller.kube.client import LEASES, LIST_PAGE, RESOURCES, Client, Resource
from controller.kube.reflector import WATCH_TIMEOUT, Reflector
from controller.model import resources as conv
from controller.model.progress import PROGRESS_ANNOTATION, ProgressEntry
from controller.model.records import Capture, Dispatcher, Record, Span
from controller.model.states import API_VERSION, Kind
from controller.process.pacing import Pacer

log = logging.getLogger(__name__)
JSON = dict[str, Any]
LEASE = "Lease"
#: Seconds a Lease stream may stay quiet and still count as current (the maintainer's own renewals and
#: the captures' keep it busy every ~2 s while it leads).
LEASE_FRESH = 5.0
#: Kinds whose stream is resumed sooner when silent: Leases change every few seconds while anything runs (the
#: maintainer's own renewals every ``--retry-period`` while it leads, the captures' every ~2 s), and a dead
#: Lease stream blinds the maintainer to captures that stop renewing. A quiet one is resumed at no other cost.
IDLE = {LEASE: 15.0}
#: The liveness probe fails when no request has been answered by the API for this long (``healthy``). A working
#: maintainer has one every few seconds (Lease renewals and bids every ``--retry-period``, 2 s by default; a
#: quiet Lease stream is resumed every ``IDLE[LEASE]`` s); 60 s is four times the longest of those gaps and six
#: periods of the chart's probe, whose three failures in a row then restart the container 80-90 s after the API
#: last answered. A quiet but connected watch is no failure.
PROGRESS_WINDOW = 60.0


def _rv(obj: JSON) -> int:
    try:
        return int(obj.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


def _uid(obj: JSON | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("uid") or "")


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
SPAN, DISPATCHER, CHANGEFEED = Kind.SPAN.value, Kind.DISPATCHER.value, Kind.CHANGEFEED.value
#: The map of an ``Index`` that is the home of each kind's records.
INDEX_MAPS = {Kind.TABLE.value: "tables", SPAN: "spans", DISPATCHER: "dispatchers", Kind.OPERATOR.value: "operators"}
#: The kinds a sharded cache holds per changefeed it leads (label-selected on ``CHANGEFEED_LABEL``); the
#: others (Changefeeds, Captures, Leases: a few per changefeed and capture) are cached whole by every replica.
SHARDED = (Kind.TABLE.value, SPAN, DISPATCHER, Kind.OPERATOR.value)
#: The kinds a sharded replica also watches when not labelled with a live changefeed, to label them (a user's
#: objects created without the label, or whose label was removed or changed by hand: Dispatchers too, which only
#: the maintainer creates) or detach them (the Tables of a changefeed that is gone).
UNASSIGNED = SHARDED
#: At most this many distinct label and finalizer tuples are shared (``Store._compact``).
MAX_INTERNED = 10_000
#: At most this many buried uids are kept per kind (``Store.dead``; normally a few: each goes with its DELETED).
MAX_DEAD = 100_000
#: Lease names that are captures' (``capture-<name>``); the maintainers' own are ``cfm-<changefeed>``.
CAPTURE_LEASE_PREFIX = conv.lease_name("")
#: The renewTime of the stand-in for a capture Lease never seen (``Store._missing_lease``): what counts is when it
#: was first missed, on our clock.
_EPOCH = "1970-01-01T00:00:00.000000Z"
_ABSENT = ("absent",)


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


class KindView(Mapping[str, Record]):
    """The records of one kind across the indexes (read-only): each record's home is its changefeed's index."""

    __slots__ = ("_attr", "_indexes")

    def __init__(self, indexes: dict[str, Index], attr: str) -> None:
        self._indexes = indexes
        self._attr = attr

    def _maps(self) -> list[Mapping[str, Record]]:
        return [getattr(idx, self._attr) for idx in self._indexes.values()]

    def __getitem__(self, name: str) -> Record:
        for m in self._maps():
            rec = m.get(name)
            if rec is not None:
                return rec
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(name in m for m in self._maps())

    def __iter__(self) -> Iterator[str]:
        for m in self._maps():
            yield from m

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps())


class Records:
    """Every record of a store by kind (``Store.records``): ``records[kind]`` or ``records.get(kind, default)``, a
    read-only mapping by name."""

    __slots__ = ("_changefeeds", "_indexes")

    def __init__(self, changefeeds: dict[str, Record], indexes: dict[str, Index]) -> None:
        self._changefeeds = changefeeds
        self._indexes = indexes

    def __getitem__(self, kind: str) -> Mapping[str, Record]:
        if kind == CHANGEFEED:
            return self._changefeeds
        if kind not in INDEX_MAPS:
            raise KeyError(kind)
        return KindView(self._indexes, INDEX_MAPS[kind])

    def get(self, kind: str, default: Mapping[str, Record] | None = None) -> Mapping[str, Record]:
        try:
            return self[kind]
        except KeyError:
            return default if default is not None else {}


@dataclass
class Listing:
    """A LIST of one kind under way (``Store.begin_listing``)."""

    names: set[str] = field(default_factory=set)
    touched: set[str] = field(default_factory=set)
    #: The changefeed whose shard is listed ("": the whole kind).
    changefeed: str = ""
    #: The raw objects of a kind kept raw (Leases, Captures), replaced whole at the end.
    held: list[JSON] = field(default_factory=list)
    #: The buried uids (``Store.dead``) when it began: a LIST begun after a delete cannot show what it deleted.
    dead: dict[str, tuple[str, str]] = field(default_factory=dict)


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
    #: Per kind: name -> (uid, changefeed) of an incarnation our own Delete found gone (``gone``) whose DELETED the
    #: watch has not brought yet. Nothing of that uid enters again: uids are never reused, so an event or a LIST page
    #: that still shows it is older than the delete, whatever its resourceVersion (a Delete's answer often carries
    #: none). Dropped by the watch's DELETED of that uid, or by a LIST begun after it was recorded.
    dead: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    #: The Changefeed records by name. The records of the other kinds live in their changefeed's ``Index`` only
    #: (``index.tables``, ``spans``, ``dispatchers``, ``operators``): one home each, not a second name-keyed table
    #: beside the index's growing in step with it. ``records`` reads them all by kind.
    _changefeeds: dict[str, Record] = field(default_factory=dict)
    #: name -> (resourceVersion, message, changefeed) of an object that could not be converted; the changefeed
    #: its label (what a shard selects by) or else its ``spec.changefeed`` names ("" if neither), so that a
    #: shard's are dropped with it.
    invalid: dict[str, dict[str, tuple[int, str, str]]] = field(default_factory=dict)
    #: The health of our view of Leases (driven by the informer's Lease stream), on the monotonic clock.
    lease_view: ViewClock = field(default_factory=lambda: ViewClock(fresh=LEASE_FRESH))
    #: Per Lease: when its renewTime last changed, on ``lease_view``.
    silence: Silence = field(init=False)
    indexes: dict[str, Index] = field(default_factory=dict)
    last_change: set[str] | None = field(default_factory=set)
    #: The changefeeds whose records of the ``SHARDED`` kinds are kept (None: every changefeed's, a warm cache).
    #: A record of another changefeed (a late write-through after the changefeed was given up) is dropped.
    shards: set[str] | None = None
    #: Per kind: the changefeed of each tombstone (sharded: a shard's LIST or its end drops only its own).
    _tomb_cf: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Capture records as converted with their Lease (memo; ``renew_time`` is put on our clock on reads).
    _captures: dict[str, Capture] = field(default_factory=dict)
    #: Per capture Lease that vanished while it named its capture (deleted by hand): the last object seen of
    #: it. Its silence is kept: the capture counts as holding it until a lease duration passes unrenewed
    #: (``_missing_lease``).
    _vanished: dict[str, JSON] = field(default_factory=dict)
    #: Capture Leases seen released (holder emptied) and then gone: nothing of their captures runs.
    _let_go: set[str] = field(default_factory=set)
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

    def _is_dead(self, kind: str, obj: JSON) -> bool:
        """``obj`` is an incarnation our own Delete found gone (``gone``)."""
        dead = self.dead.get(kind)
        if not dead:
            return False
        meta = obj.get("metadata") or {}
        entry = dead.get(meta.get("name", ""))
        return entry is not None and entry[0] == meta.get("uid")

    @property
    def records(self) -> Records:
        """Every record, by kind then name (read-only views: each record's home is its changefeed's index)."""
        return Records(self._changefeeds, self.indexes)

    def _rec(self, kind: str, name: str, hint: str = "") -> Record | None:
        """The record ``name`` of ``kind``, looked up in changefeed ``hint``'s index first (a record's changefeed is
        its ``spec.changefeed``, immutable: the one lookup nearly always), then in the others'."""
        if kind == CHANGEFEED:
            return self._changefeeds.get(name)
        attr = INDEX_MAPS.get(kind)
        if attr is None:
            return None
        idx = self.indexes.get(hint)
        if idx is not None:
            rec: Record | None = getattr(idx, attr).get(name)
            if rec is not None:
                return rec
        for cf, idx in self.indexes.items():
            if cf != hint:
                rec = getattr(idx, attr).get(name)
                if rec is not None:
                    return rec
        return None

    def _current_uid(self, kind: str, name: str) -> str:
        if kind in RECORD_ONLY:
            rec = self._rec(kind, name)
            return rec.uid if rec is not None else ""
        obj = self._bucket(kind).get(name)
        return str((obj.get("metadata") or {}).get("uid") or "") if obj is not None else ""

    def _bucket(self, kind: str) -> dict[str, JSON]:
        return self.objects.setdefault(kind, {})

    def _current_rv(self, kind: str, name: str, hint: str = "") -> int | None:
        if kind in RECORD_ONLY:
            rec = self._rec(kind, name, hint)
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
        current = self._current_rv(kind, name, _spec_changefeed(obj))
        self.last_change = set()
        if current is not None and current >= rv:
            return False
        if self.tombstones.get(kind, {}).get(name, -1) >= rv or self._is_dead(kind, obj):
            return False
        self.tombstones.get(kind, {}).pop(name, None)
        if kind in RECORD_ONLY:
            self._put_record(kind, name, rv, obj)
            return True
        if kind == LEASE:
            if self._vanished.pop(name, None) is not None:
                self.silence.forget(name)  # a new Lease (the capture's next process): seen for the first time
            self._let_go.discard(name)
            concerned = self._observe_lease(obj, time.monotonic())
            self._bucket(kind)[name] = obj
            capture = name[len(CAPTURE_LEASE_PREFIX) :] if name.startswith(CAPTURE_LEASE_PREFIX) else ""
            self._captures.pop(capture, None)
            self.last_change = concerned if capture else set()
            return True
        self._bucket(kind)[name] = obj
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
            span = self._rec(SPAN, rec.span, rec.changefeed)
            if isinstance(span, Span):
                changes["span"] = span.name
                if span.key_range == rec.key_range:
                    changes["key_range"] = span.key_range
        elif isinstance(rec, Span):
            d = self._rec(DISPATCHER, rec.dispatcher, rec.changefeed) if rec.dispatcher else None
            if d is not None:
                changes["dispatcher"] = d.name
            old = self._rec(SPAN, rec.name, rec.changefeed)
            if isinstance(old, Span) and old.key_range == rec.key_range:
                changes["key_range"] = old.key_range
        # ``rec`` is fresh from conversion and not shared yet: fill in the shared values in place rather than copy it
        # (records are frozen for their users; this is where they are made). Attribute by attribute, never through
        # ``__dict__``: reading an instance's ``__dict__`` turns its inline values into a dict object of its own
        # (64 bytes a record, for as long as it lives).
        for attr, value in changes.items():
            object.__setattr__(rec, attr, value)
        return rec

    def _put_record(self, kind: str, name: str, rv: int, obj: JSON) -> None:
        old = self._rec(kind, name, _spec_changefeed(obj))
        try:
            rec: Record | None = self._compact(conv.from_resource(obj))
        except conv.InvalidResource as exc:
            # The label first: a shard's LIST and watch select by it.
            self.invalid.setdefault(kind, {})[name] = (rv, str(exc), label_of(obj) or _spec_changefeed(obj))
            rec = None
        if rec is not None and self.shards is not None and kind in SHARDED:
            # Not a changefeed this replica leads (any more): not kept.
            rec = rec if self._changefeed_of(rec) in self.shards else None
        if rec is not None:
            self.invalid.get(kind, {}).pop(name, None)
        if kind == CHANGEFEED:
            if rec is None:
                self._changefeeds.pop(name, None)
            else:
                self._changefeeds[name] = rec
        self.last_change = self._route(old, rec)  # the index is the record's home: stored (or dropped) there

    def remove(self, kind: str, name: str, rv: int, uid: str = "") -> None:
        """``name`` was deleted at ``rv`` (a watch's DELETED, of incarnation ``uid`` if known): unless what is cached is
        newer."""
        self.last_change = set()
        dead = self.dead.get(kind, {})
        if uid and dead.get(name, ("",))[0] == uid:
            del dead[name]  # the watch has passed our delete of it
        current = self._current_rv(kind, name)
        if current is not None and current > rv:
            return
        self._drop(kind, name, rv)

    def gone(self, kind: str, name: str, uid: str = "") -> None:
        """Our own Delete of ``name`` (incarnation ``uid``; "" for whatever has the name) succeeded, or found it gone.
        The cached object goes now, unless it is another incarnation than the one deleted, and its uid is buried
        (``dead``): a watch event or a LIST page from before the delete never brings it back."""
        self.last_change = set()
        cached = self._current_uid(kind, name)
        if uid and cached and cached != uid:
            self._bury(kind, name, uid, "")  # a newer incarnation is cached: it stays
            return
        changefeed = self._changefeed_of(self._rec(kind, name)) or ""
        current = self._current_rv(kind, name)
        if uid or cached:
            self._bury(kind, name, uid or cached, changefeed)
        if current is not None:
            self._drop(kind, name, current)

    def _bury(self, kind: str, name: str, uid: str, changefeed: str) -> None:
        dead = self.dead.setdefault(kind, {})
        dead.pop(name, None)
        dead[name] = (uid, changefeed)
        while len(dead) > MAX_DEAD:  # the oldest first (insertion order)
            del dead[next(iter(dead))]

    def _drop(self, kind: str, name: str, rv: int) -> None:
        raw = self._bucket(kind).pop(name, None)
        old = self._rec(kind, name)
        if kind == CHANGEFEED:
            self._changefeeds.pop(name, None)
        self.invalid.get(kind, {}).pop(name, None)
        self.tombstones.setdefault(kind, {})[name] = rv
        if self.shards is not None and kind in SHARDED:
            owners = self._tomb_cf.setdefault(kind, {})
            # A second removal of the name (a write-through forget, then the watch's DELETED) keeps the first's owner.
            owners[name] = self._changefeed_of(old) or owners.get(name, "")
        if kind in RECORD_ONLY:
            self.last_change = self._route(old, None)
        elif kind == LEASE:
            self._lease_gone(name, raw)
            capture = name[len(CAPTURE_LEASE_PREFIX) :] if name.startswith(CAPTURE_LEASE_PREFIX) else ""
            self._captures.pop(capture, None)
            self.last_change = None if capture else set()
        else:
            self._captures.pop(name, None)
            self.last_change = None

    def _lease_gone(self, name: str, last: JSON | None) -> None:
        """Lease ``name`` is gone (deleted, or not named by a LIST). A capture's that still named its capture
        (deleted by hand while the capture runs) is remembered with its silence: that capture may deliver until
        its renew deadline, and its dispatchers may be released only once it could not have renewed for a lease
        duration, as for a Lease that lapsed. One it had released (its holder emptied at a graceful stop) is
        forgotten: that capture stopped everything first."""
        if last is None:
            return  # already gone (a second removal): as it was
        capture = name.removeprefix(CAPTURE_LEASE_PREFIX)
        if name.startswith(CAPTURE_LEASE_PREFIX) and capture:
            if (last.get("spec") or {}).get("holderIdentity") == capture:
                self._vanished[name] = last
                return
            self._let_go.add(name)
        self.silence.forget(name)

    def _missing_lease(self, capture: str) -> JSON | None:
        """What stands for capture ``capture``'s Lease when there is none: the last one seen if it vanished while
        it named the capture, else (a Lease never seen: a maintainer started after it was deleted) one renewed
        when the capture was first seen without it, of the default duration. None when the Lease was released."""
        name = conv.lease_name(capture)
        last = self._vanished.get(name)
        if last is not None:
            return last
        if name in self._let_go:
            return None  # seen released, then gone: nothing of it runs
        self.silence.observe(name, _ABSENT, time.monotonic())
        self._vanished[name] = last = {
            "metadata": {"name": name},
            "spec": {
                "holderIdentity": capture,
                "leaseDurationSeconds": int(Capture(name=capture).lease_duration),
                "renewTime": _EPOCH,
            },
        }
        return last

    def replace_all(self, kind: str, items: list[JSON]) -> None:
        """What a LIST says is all there is of ``kind`` (in one page; see ``begin_listing``)."""
        listing = self.begin_listing(kind)
        self.list_page(kind, items, listing)
        self.end_listing(kind, listing)

    def begin_listing(self, kind: str, changefeed: str = "") -> Listing:
        """A LIST of ``kind`` begins (of ``changefeed``'s shard of it, if given): its pages go to ``list_page``,
        then ``end_listing`` drops what it did not name. Records are converted page by page (the raw objects of
        50,000 spans are never all alive at once); between pages the cache holds some objects as listed and
        others as they were, as it would with a watch running late."""
        if not changefeed:
            self.tombstones[kind] = {}
            self._tomb_cf.pop(kind, None)
        else:
            self._drop_tombstones(kind, changefeed)
        return Listing(changefeed=changefeed, dead=dict(self.dead.get(kind, {})))

    def _end_burials(self, kind: str, listing: Listing) -> None:
        """The buried uids a LIST begun after them answers for (``Listing.dead``) are no longer needed."""
        dead = self.dead.get(kind, {})
        for name, entry in listing.dead.items():
            if dead.get(name) == entry and (not listing.changefeed or entry[1] in (listing.changefeed, "")):
                del dead[name]

    def _drop_tombstones(self, kind: str, changefeed: str) -> None:
        owners = self._tomb_cf.get(kind, {})
        tombs = self.tombstones.get(kind, {})
        for name in [n for n, cf in owners.items() if cf in (changefeed, "")]:
            del owners[name]
            tombs.pop(name, None)

    def _shard_names(self, kind: str, changefeed: str) -> list[str]:
        """The names of ``changefeed``'s records of ``kind`` (one of ``SHARDED``)."""
        idx = self.indexes.get(changefeed)
        if idx is None:
            return []
        by_kind: dict[str, Mapping[str, Any]] = {
            Kind.TABLE.value: idx.tables,
            SPAN: idx.spans,
            DISPATCHER: idx.dispatchers,
            Kind.OPERATOR.value: idx.operators,
        }
        return list(by_kind[kind])

    def track(self, changefeed: str) -> None:
        """Keep ``changefeed``'s records of the ``SHARDED`` kinds from now on (a sharded cache)."""
        if self.shards is not None:
            self.shards.add(changefeed)

    def untrack(self, changefeed: str) -> None:
        """Drop ``changefeed``'s records of the ``SHARDED`` kinds and keep no more of them (a sharded cache)."""
        if self.shards is None:
            return
        self.shards.discard(changefeed)
        for kind in SHARDED:
            for name in self._shard_names(kind, changefeed):
                old = self._rec(kind, name, changefeed)
                if old is not None:
                    self._route(old, None)
            self._drop_tombstones(kind, changefeed)
            self._drop_invalid(kind, changefeed)
        self.last_change = {changefeed}

    def _drop_invalid(self, kind: str, changefeed: str, keep: Collection[str] = ()) -> None:
        """Forget the objects of ``kind`` that could not be converted and name ``changefeed`` (all of them for
        ""), but those in ``keep``."""
        bad = self.invalid.get(kind, {})
        for name in [n for n, (_, _, cf) in bad.items() if (not changefeed or cf == changefeed) and n not in keep]:
            del bad[name]

    def list_page(self, kind: str, items: list[JSON], listing: Listing) -> None:
        """One page of a LIST. Items are dropped from ``items`` as they are converted (the caller's list)."""
        if kind not in RECORD_ONLY:
            listing.held.extend(items)  # Leases and Captures (a few): replaced whole at the end
            return
        for i, obj in enumerate(items):
            name = obj["metadata"]["name"]
            listing.names.add(name)
            rv, current = _rv(obj), self._current_rv(kind, name)
            if self._is_dead(kind, obj):
                listing.names.discard(name)  # a page older than our delete of it
            elif current is None or current <= rv:  # not over a newer write-through that landed between pages
                self._put_record(kind, name, rv, obj)
                listing.touched |= self.last_change or set()
            items[i] = {"metadata": {"name": name}}  # the raw object is no longer needed

    def end_listing(self, kind: str, listing: Listing, rv: int = 0) -> None:
        """The LIST (a snapshot at ``rv``) is read: what it did not name goes, except records newer than the
        snapshot (write-throughs that landed between its pages; 0: none are kept)."""
        if kind not in RECORD_ONLY:
            items = [o for o in listing.held if not self._is_dead(kind, o)]
            self._end_burials(kind, listing)
            before = self.objects.get(kind, {})
            self.objects[kind] = {o["metadata"]["name"]: o for o in items}
            if kind == LEASE:
                now = time.monotonic()
                for gone in set(self.silence.seen) - set(self.objects[kind]) - set(self._vanished):
                    self._lease_gone(gone, before.get(gone))
                for name in set(self._vanished) & set(self.objects[kind]):
                    del self._vanished[name]
                self._let_go -= set(self.objects[kind])
                for o in items:
                    self._observe_lease(o, now)
            self._captures.clear()
            self.last_change = None
            return
        touched = listing.touched
        # A shard's LIST names only its changefeed's records; the others' stay.
        candidates = self._shard_names(kind, listing.changefeed) if listing.changefeed else self.names(Kind(kind))
        for name in candidates:
            if name in listing.names:
                continue
            old = self._rec(kind, name, listing.changefeed)
            if old is None or 0 < rv < _rv_of(old):
                continue
            if kind == CHANGEFEED:
                self._changefeeds.pop(name, None)
            touched |= self._route(old, None)
        # A shard's LIST answers for the invalid objects that name its changefeed; a whole LIST for every one.
        self._drop_invalid(kind, listing.changefeed, keep=listing.names)
        self._end_burials(kind, listing)
        self.last_change = touched

    def record(self, kind: Kind, name: str) -> Record | None:
        if kind.value in RECORD_ONLY:
            return self._rec(kind.value, name)
        if kind is not Kind.CAPTURE:
            return None
        obj = self._bucket(kind.value).get(name)
        if obj is None:
            return None
        try:
            return self._capture_with_lease(obj)
        except conv.InvalidResource as exc:
            self.invalid.setdefault(kind.value, {})[name] = (_rv(obj), str(exc), "")
            return None

    def _capture_with_lease(self, obj: JSON) -> Capture:
        """The Capture ``obj`` with its Lease; without one, with what stands for it (``_missing_lease``), as a
        capture being deleted: never scheduled on, its dispatchers released only once that Lease ran out."""
        name = obj["metadata"]["name"]
        lease = self._bucket(LEASE).get(conv.lease_name(name))
        if lease is not None:
            return self._capture(obj, lease)
        stand_in = self._missing_lease(name)
        if stand_in is None:
            return self._capture(obj, None)
        return self._capture(obj, stand_in, memo=False).evolve(deleting=True)

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
        # A capture whose Capture object and Lease are both gone, the Lease while it named the capture (deleted by
        # hand in either order): its process may still run until its renew deadline, so what stood for its Lease
        # still says when its dispatchers may go. Forgotten ten lease durations after it ran out.
        for lease_name, last in list(self._vanished.items()):
            name = lease_name.removeprefix(CAPTURE_LEASE_PREFIX)
            if name in out or name in self._bucket(Kind.CAPTURE.value):
                continue
            try:
                rec = self._capture({"kind": "Capture", "metadata": {"name": name}}, last, memo=False)
            except conv.InvalidResource:
                continue
            if rec.renew_time is None or time.time() > rec.renew_time + 11 * rec.lease_duration:
                del self._vanished[lease_name]
                self.silence.forget(lease_name)
                continue
            out[name] = rec.evolve(deleting=True)
        return out

    def all(self, kind: Kind) -> Mapping[str, Record]:
        """Every record of ``kind`` (a live view for the record-only kinds: do not change it)."""
        if kind.value in RECORD_ONLY:
            return self.records[kind.value]
        out = {}
        for name in list(self._bucket(kind.value)):
            rec = self.record(kind, name)
            if rec is not None:
                out[name] = rec
        return out

    def names(self, kind: Kind) -> list[str]:
        if kind.value in RECORD_ONLY:
            return list(self.records[kind.value])
        return list(self._bucket(kind.value))

    # -- the Leases, typed ---------------------------------------------------------------------------

    def lease(self, name: str, now: float) -> Seen | None:
        """Lease ``name`` as our watch shows it (``shards.Seen``: holder, duration, how long it has been seen
        unchanged on our clock, transitions), or None if there is none. ``now`` is monotonic."""
        lease = self.objects.get(LEASE, {}).get(name)
        if lease is None:
            return None
        spec = lease.get("spec") or {}
        try:
            duration = float(spec.get("leaseDurationSeconds") or 0)
        except (TypeError, ValueError):
            duration = 0.0
        try:
            transitions = int(spec.get("leaseTransitions") or 0)
        except (TypeError, ValueError):
            transitions = 0
        return Seen(str(spec.get("holderIdentity") or ""), duration, self.silence.of(name, now), transitions)

    def lease_names(self, prefix: str) -> list[str]:
        """The names of the cached Leases that start with ``prefix``."""
        return [n for n in self.objects.get(LEASE, {}) if n.startswith(prefix)]

    def lease_uid(self, name: str) -> str:
        """The uid of Lease ``name`` as cached ("" if none)."""
        return _uid(self.objects.get(LEASE, {}).get(name))

    def unchanged_for(self, name: str, holder: str, renew: str, now: float) -> float:
        """How long our watch has seen Lease ``name`` unchanged with ``holder`` and ``renew`` (its renewTime as
        written): 0 if it shows another holder or renewal. Counted on our clock, only while our view of Leases was
        current (``silence``). ``now`` is monotonic."""
        spec = (self.objects.get(LEASE, {}).get(name) or {}).get("spec") or {}
        if str(spec.get("holderIdentity") or "") != holder or str(spec.get("renewTime") or "") != renew:
            return 0.0
        return self.silence.of(name, now) or 0.0

    def owner_reference(self, changefeed: str) -> JSON | None:
        """The ownerReference naming Changefeed ``changefeed`` as cached (None if unknown or without uid)."""
        cf = self._changefeeds.get(changefeed)
        if cf is None or not cf.uid:
            return None
        return {
            "apiVersion": API_VERSION,
            "kind": "Changefeed",
            "name": cf.name,
            "uid": cf.uid,
            "controller": True,
        }


@dataclass(frozen=True)
class Change:
    """What the informer tells its process after each change to its cache (``Informer.on_change``)."""

    kind: str
    #: The object's name ("" for a whole LIST of the kind).
    name: str
    #: The changefeeds whose decisions can see the change (``Store.last_change``): their names, or None for every
    #: changefeed (a Capture, a capture's Lease whose liveness or holder changed).
    changefeeds: frozenset[str] | None


class Cache(Protocol):
    """What writes go through (the executor's view): a store, and how a written object enters it."""

    store: Store

    def offer(self, kind: str, obj: JSON, notify: bool = True) -> None: ...

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None: ...

    def gone(self, kind: str, name: str, uid: str = "") -> None: ...


@dataclass
class StoreCache:
    """A ``Cache`` over a plain store (the informer's unassigned objects): writes enter it at once."""

    store: Store

    def offer(self, kind: str, obj: JSON, notify: bool = True) -> None:
        self.store.put(kind, obj)

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None:
        self.store.remove(kind, name, _rv(obj) if obj else 0, _uid(obj))

    def gone(self, kind: str, name: str, uid: str = "") -> None:
        self.store.gone(kind, name, uid)


@dataclass(frozen=True)
class Stream:
    """One LIST+WATCH: a whole kind in the namespace, a changefeed's shard of it (``changefeed``: the objects
    labelled with it), or its objects not labelled with any of ``assigned`` (``unassigned`` streams: those a
    user created without the label, or of a changefeed that is gone)."""

    kind: str
    res: Resource
    changefeed: str = ""
    assigned: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        if self.changefeed:
            return f"{self.kind}/{self.changefeed}"
        if self.assigned is not None:
            return f"{self.kind} (unassigned)"
        return self.kind

    @property
    def selector(self) -> str:
        if self.changefeed:
            return f"{conv.CHANGEFEED_LABEL}={self.changefeed}"
        if self.assigned:
            # ``notin`` also selects the objects without the label.
            return f"{conv.CHANGEFEED_LABEL} notin ({','.join(sorted(self.assigned))})"
        return ""


def _spec_changefeed(obj: JSON) -> str:
    value = (obj.get("spec") or {}).get("changefeed")
    return value if isinstance(value, str) else ""


def label_of(obj: JSON) -> str:
    """The value of ``CHANGEFEED_LABEL`` on ``obj`` ("" if none)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    value = labels.get(conv.CHANGEFEED_LABEL) if isinstance(labels, dict) else None
    return value if isinstance(value, str) else ""


class Informer:
    """List+watch of the six kinds (and Leases) in one namespace.

    ``sharded``: Tables, Spans, Dispatchers and SpanOperators are listed and watched only for the changefeeds
    this replica leads (``track``/``untrack``: one LIST and one WATCH per kind and changefeed, label-selected),
    plus, in a small store of their own (``unassigned``), the Tables, Spans and SpanOperators not labelled with
    a live changefeed (``watch_unassigned``): those a user created without the label (the leader labels them:
    ``relabel``) and those of a changefeed that is gone (detached by the janitor). Changefeeds, Captures and
    Leases are cached whole either way. Warm (the default): every kind is cached whole, and a standby that
    takes a changefeed over decides at once."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        on_change: Callable[[Change], None] | None = None,
        *,
        lease_fresh: float = LEASE_FRESH,
        page_size: int = LIST_PAGE,
        watch_timeout: float = WATCH_TIMEOUT,
        progress_window: float = PROGRESS_WINDOW,
        sharded: bool = False,
        after_page: Callable[[], None] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.client = client
        #: What keeps the loop's turns short (shared with the executor's chains: ``controller.process.pacing``).
        self.pacer = pacer or Pacer()
        self.namespace = namespace
        #: Objects per LIST page (0: one page).
        self.page_size = page_size
        #: The least ``timeoutSeconds`` a watch asks for (it asks between this and twice this); the maintainer's
        #: ``--watch-timeout``.
        self.watch_timeout = watch_timeout
        #: Seconds without an answer from the API after which ``healthy`` fails; the maintainer's
        #: ``--liveness-window``.
        self.progress_window = progress_window
        self.sharded = sharded
        #: Called after each LIST page of records has been converted (its raw objects dropped): the process may act
        #: on what it made (the maintainer's runner freezes them out of the collector's full passes).
        self.after_page = after_page
        self.store = Store(lease_view=ViewClock(fresh=lease_fresh), shards=set() if sharded else None)
        #: Sharded: the Tables, Spans and SpanOperators not labelled with a live changefeed.
        self.unassigned = Store()
        #: Whether ``unassigned`` changed since the last ``take_unassigned_changed``.
        self._unassigned_dirty = False
        #: (kind, name) -> the changefeed an object should be labelled with (its ``spec.changefeed``): seen in
        #: another changefeed's shard (a label set by hand), since the last ``take_relabel``.
        self._relabel: dict[tuple[str, str], str] = {}
        self.on_change = on_change
        self.synced = asyncio.Event()
        self._listed: set[str] = set()
        #: The streams of record kinds whose watch broke since their last LIST (``in_doubt``): they relist.
        self._doubt: set[str] = set()
        #: Per kind: LISTs made again by a stream that had listed (a broken watch of records, 410 Gone, a failure
        #: to apply). The maintainer's ``informer_relists_total``.
        self.relists: Counter[str] = Counter()
        #: Per kind: LIST pages and watch events the cache failed to apply (a bug, logged with its traceback; the
        #: stream relisted). The maintainer's ``informer_apply_failures_total``; 0 in a healthy process.
        self.apply_failures: Counter[str] = Counter()
        self.last_seen: dict[str, float] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._list_gate = asyncio.Lock()
        # The small kinds first (one LIST at a time, in this order: the gate is FIFO): the maintainer bids for
        # Leases once Changefeeds and Leases are listed, while the big kinds still list (a cold start). Tables
        # before Spans: a Table that arrives after its spans re-derives every one of them in one step of the
        # index (listed last, 50 Tables over 20,000 spans held the loop 313 ms in one LIST chunk).
        first: tuple[str, ...] = (LEASE, Kind.CHANGEFEED.value, Kind.CAPTURE.value, Kind.TABLE.value)
        every: dict[str, Resource] = {k.value: r for k, r in RESOURCES.items()}
        every[LEASE] = LEASES
        if sharded:
            every = {k: r for k, r in every.items() if k not in SHARDED}
        first = tuple(k for k in first if k in every)  # sharded: Tables list per changefeed (SHARDED: first too)
        self.kinds: dict[str, Resource] = {k: every[k] for k in (*first, *sorted(set(every) - set(first)))}
        #: The streams that must have listed before ``synced``: the namespace-wide kinds, and (sharded) the
        #: unassigned objects.
        self._expected = set(self.kinds)
        if sharded:
            self._expected |= {Stream(k, RESOURCES[Kind(k)], assigned=()).key for k in UNASSIGNED}
        self._listed_events: dict[str, asyncio.Event] = {k: asyncio.Event() for k in self._expected}
        self._assigned: tuple[str, ...] | None = None
        # ``frozen``: while a decision runs in a thread over the store, nothing changes it; watch events and
        # LIST pages wait (``_thawed``), and writes offered through are applied at the thaw, in order.
        self._frozen = 0
        self._thawing = False
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._backlog: deque[Callable[[], None]] = deque()

    def _start(self, stream: Stream) -> None:
        self._tasks[stream.key] = asyncio.create_task(self.reflector(stream).run(), name=f"informer-{stream.key}")

    def reflector(self, stream: Stream) -> Reflector:
        """The LIST+WATCH of ``stream`` into this informer's stores."""
        return Reflector(
            self.client,
            stream.res,
            self.namespace,
            _Feed(self, stream),
            name=stream.key,
            selector=stream.selector,
            watch_timeout=self.watch_timeout,
            idle=IDLE.get(stream.kind, math.inf),
            idle_quietly=stream.kind in IDLE,
            page_size=self.page_size,
            # One LIST at a time: at 50,000 spans a LIST's raw objects are a few hundred MB until converted, and
            # two at once would double the process's peak memory.
            list_gate=self._list_gate,
            logger=log,
        )

    # -- what the labels need (sharded) ---------------------------------------------------------------

    def take_relabel(self) -> dict[tuple[str, str], str]:
        """The objects seen in another changefeed's shard since the last call, (kind, name) -> the changefeed
        their ``spec.changefeed`` names (they should be labelled with it); forgotten here."""
        todo, self._relabel = self._relabel, {}
        return todo

    def take_unassigned_changed(self) -> bool:
        """Whether the unassigned objects changed since the last call."""
        changed, self._unassigned_dirty = self._unassigned_dirty, False
        return changed

    def _relabel_later(self, key: tuple[str, str], changefeed: str) -> None:
        self._relabel[key] = changefeed

    def _unassigned_changed(self) -> None:
        self._unassigned_dirty = True

    def _cancel(self, key: str) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
        self._listed.discard(key)
        self._doubt.discard(key)
        self.last_seen.pop(key, None)

    async def start(self) -> None:
        for kind, res in self.kinds.items():
            self._start(Stream(kind, res))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait_listed(self, *kinds: str) -> None:
        """Until each of ``kinds`` has been listed once (``synced`` waits for all of them)."""
        for kind in kinds:
            await self._listed_events[kind].wait()

    def in_doubt(self, changefeed: str) -> frozenset[Kind]:
        """The kinds of ``changefeed``'s records whose view is in doubt (``World.stale``): their stream has not been
        listed yet, or its watch broke and it has not been listed again. A watch resumed after a break replays
        what it missed, but nothing says when it has caught up; a real API server answers a watch resumed after its
        restart with 410, and each kind relists on its own schedule. Until then the view may still hold what was
        deleted meanwhile (by another maintainer term, by hand) and lack what was made: the engine decides nothing
        on it."""
        doubt: set[Kind] = set()
        for value in RECORD_ONLY:
            key = f"{value}/{changefeed}" if self.sharded and value in SHARDED else value
            if key in self._doubt or key not in self._listed:
                doubt.add(Kind(value))
        return frozenset(doubt)

    def _in_doubt(self, stream: Stream) -> bool:
        """``stream``'s watch broke: a stream of records relists (``in_doubt``); Leases and Captures resume."""
        if stream.kind not in RECORD_ONLY:
            return False
        self._doubt.add(stream.key)
        return True

    def unlisted(self) -> list[str]:
        """The streams not listed yet (sorted): the maintainer decides nothing before they all are."""
        return sorted(self._expected - self._listed)

    # -- sharding -----------------------------------------------------------------------------------

    def watch_unassigned(self, changefeeds: Collection[str]) -> bool:
        """Sharded: (re)start the streams of the objects not labelled with one of ``changefeeds`` (the live
        ones) if that set changed; True if it did. The store keeps what it had until the new LIST ends."""
        assigned = tuple(sorted(changefeeds))
        if not self.sharded or assigned == self._assigned:
            return False
        self._assigned = assigned
        for kind in UNASSIGNED:
            stream = Stream(kind, RESOURCES[Kind(kind)], assigned=assigned)
            task = self._tasks.pop(stream.key, None)
            if task is not None:
                task.cancel()
            self._start(stream)
        return True

    def tracked(self) -> set[str]:
        return set(self.store.shards or ())

    async def track(self, changefeed: str) -> None:
        """Until ``changefeed``'s records are listed (warm: until every kind is). Sharded: starts its streams
        (one LIST and one WATCH per kind, label-selected) unless they run, and waits for their LISTs."""
        await self.synced.wait()
        if not self.sharded:
            return
        if self._frozen or self._thawing:
            # After an untrack of the same changefeed still waiting in the backlog, not before it (the term ended
            # and a new one began while another changefeed's decision ran): the LIST below waits for the thaw.
            self._backlog.append(lambda: self.store.track(changefeed))
        else:
            self.store.track(changefeed)
        streams = [Stream(k, RESOURCES[Kind(k)], changefeed=changefeed) for k in SHARDED]
        for stream in streams:
            if stream.key not in self._tasks:
                self._listed_events[stream.key] = asyncio.Event()
                self._start(stream)
        for stream in streams:
            await self._listed_events[stream.key].wait()

    def untrack(self, changefeed: str) -> None:
        """Sharded: stop ``changefeed``'s streams and drop its records (after a decision in a thread, if one
        runs). A write of ours that lands later is not kept (``Store.shards``)."""
        if not self.sharded:
            return
        for kind in SHARDED:
            key = Stream(kind, RESOURCES[Kind(kind)], changefeed=changefeed).key
            self._cancel(key)
            self._listed_events.pop(key, None)
        if self._frozen or self._thawing:
            self._backlog.append(lambda: self._untrack(changefeed))
        else:
            self._untrack(changefeed)

    def _untrack(self, changefeed: str) -> None:
        self.store.untrack(changefeed)
        self._notify(Kind.CHANGEFEED.value, changefeed)

    def healthy(self, window: float | None = None) -> tuple[bool, str]:
        """The liveness probe's verdict: this process still reaches the API and makes progress.

        Unhealthy when a watch task ended (a stream that fails retries inside its task for ever, so an ended task
        is the zombie of nolar/kopf#1276), or when the API has answered no request of ours for ``window`` seconds
        (``progress_window`` by default; ``Client.last_success``). Never because a watch is quiet: a real server
        may send no event and no BOOKMARK for as long as nothing changes, and the server's own timeout ends and
        renews the stream."""
        for t in self._tasks.values():
            if t.done():
                return False, f"watch task {t.get_name()} ended"
        window = self.progress_window if window is None else window
        since = time.monotonic() - self.client.last_success
        if since > window:
            return False, f"no request answered by the API in {since:.0f}s"
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
        """Apply the backlog in order, paced (a decision placing thousands of spans offers thousands of
        objects); what is offered meanwhile joins its end. Stops, leaving the rest, if another freeze began."""
        self._thawing = True
        try:
            while self._backlog and not self._frozen:
                await self.pacer.pace()
                if self._frozen:
                    break
                self._backlog.popleft()()
        finally:
            self._thawing = False
            if not self._frozen:
                if self._backlog:  # cancelled midway: nothing may be lost or reordered
                    backlog, self._backlog = self._backlog, deque()
                    for apply in backlog:
                        apply()
                self._thawed.set()

    async def _unfrozen(self) -> None:
        if not self._thawed.is_set():
            await self._thawed.wait()

    # -- write-through ---------------------------------------------------------------------------

    def offer(self, kind: str, obj: JSON, notify: bool = True) -> None:
        """``obj`` as a write returned it, into the store at once (or after the freeze). ``notify`` False: no
        ``on_change`` for it (a write whose landing needs no decision: ``Chain.wake``)."""
        if self._frozen or self._thawing:
            self._backlog.append(lambda: self._offer(kind, obj, notify))
        else:
            self._offer(kind, obj, notify)

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None:
        """``name`` deleted, as the watch (or a write's answer ``obj``, the object's last state) says."""
        if self._frozen or self._thawing:
            self._backlog.append(lambda: self._forget(kind, name, obj))
        else:
            self._forget(kind, name, obj)

    def gone(self, kind: str, name: str, uid: str = "") -> None:
        """Our own Delete of ``name`` (incarnation ``uid``) succeeded or found it gone: out of the view at once
        (``Store.gone``)."""
        if self._frozen or self._thawing:
            self._backlog.append(lambda: self._gone(kind, name, uid))
        else:
            self._gone(kind, name, uid)

    def _gone(self, kind: str, name: str, uid: str) -> None:
        self.store.gone(kind, name, uid)
        self._notify(kind, name)

    def _offer(self, kind: str, obj: JSON, notify: bool = True) -> None:
        if self.store.put(kind, obj) and notify:
            self._notify(kind, obj["metadata"]["name"])

    def _forget(self, kind: str, name: str, obj: JSON | None) -> None:
        self.store.remove(kind, name, _rv(obj) if obj else 0, _uid(obj))
        self._notify(kind, name)

    def _notify(self, kind: str, name: str) -> None:
        if self.on_change is not None:
            concerned = self.store.last_change
            self.on_change(Change(kind, name, None if concerned is None else frozenset(concerned)))

    # -- the streams ---------------------------------------------------------------------------------

    def _heard(self, stream: Stream) -> None:
        now = time.monotonic()
        self.last_seen[stream.key] = now
        if stream.kind == LEASE:
            self.store.lease_view.heard(now)

    def _broken(self, stream: Stream) -> None:
        if stream.kind == LEASE:
            self.store.lease_view.broken(time.monotonic())

    def _admit(self, stream: Stream, obj: JSON) -> bool:
        """Whether ``obj`` from ``stream`` may enter the store. A shard's stream admits only the objects whose
        ``spec.changefeed`` (immutable) is its changefeed: one labelled with another (by hand) is to be relabelled
        (``relabel``), and until then no stream of ours has it. So each object has one stream that may put or
        delete it, and an object relabelled from one shard of ours into another is not deleted by the first
        stream's DELETED (a watch says DELETED, with the object as it was, when an object stops matching)."""
        if not stream.changefeed:
            return True
        wanted = _spec_changefeed(obj)
        if wanted == stream.changefeed:
            return True
        if wanted:
            self._relabel_later((stream.kind, obj["metadata"]["name"]), wanted)
        return False

    def _deleted(self, stream: Stream, obj: JSON) -> None:
        name = obj["metadata"]["name"]
        if stream.assigned is not None:
            self.unassigned.remove(stream.kind, name, _rv(obj), _uid(obj))
            self._unassigned_changed()
        elif not stream.changefeed or _spec_changefeed(obj) == stream.changefeed:
            self.forget(stream.kind, name, obj)  # deleted, or no longer labelled with its changefeed

    def _put(self, stream: Stream, obj: JSON) -> None:
        if stream.assigned is not None:
            if self.unassigned.put(stream.kind, obj):
                self._unassigned_changed()
        elif self._admit(stream, obj) and self.store.put(stream.kind, obj):
            self._notify(stream.kind, obj["metadata"]["name"])

    def _listed_stream(self, stream: Stream, again: bool) -> None:
        """``stream``'s LIST has been applied: it is listed, no longer in doubt, and the maintainer is told."""
        if again:
            self.relists[stream.kind] += 1
        self._listed.add(stream.key)
        self._doubt.discard(stream.key)
        listed = self._listed_events.get(stream.key)
        if listed is not None:
            listed.set()
        if stream.assigned is None:
            self._notify(stream.kind, "")
        else:
            self._unassigned_changed()
        if self._listed >= self._expected:
            self.synced.set()


class _Feed:
    """The ``reflector.Target`` of one stream: the informer's store (the unassigned store for an unassigned stream),
    paced and held while a decision has the store frozen."""

    def __init__(self, informer: Informer, stream: Stream) -> None:
        self.informer = informer
        self.stream = stream
        self.store = informer.unassigned if stream.assigned is not None else informer.store

    async def ready(self) -> None:
        await self.informer.pacer.pace()
        await self.informer._unfrozen()

    def begin_listing(self) -> Listing:
        return self.store.begin_listing(self.stream.kind, self.stream.changefeed)

    def list_chunk(self, listing: Listing, items: list[JSON]) -> None:
        if self.stream.changefeed:
            items = [obj for obj in items if self.informer._admit(self.stream, obj)]
        self.store.list_page(self.stream.kind, items, listing)

    def page_read(self, listing: Listing) -> None:
        if self.stream.kind in RECORD_ONLY and self.informer.after_page is not None:
            self.informer.after_page()

    def end_listing(self, listing: Listing, rv: str) -> None:
        self.store.end_listing(self.stream.kind, listing, int(rv or 0))

    def listed(self, again: bool) -> None:
        self.informer._listed_stream(self.stream, again)

    def put(self, obj: JSON) -> None:
        self.informer._put(self.stream, obj)

    def delete(self, obj: JSON) -> None:
        self.informer._deleted(self.stream, obj)

    def heard(self) -> None:
        self.informer._heard(self.stream)

    def interrupted(self) -> None:
        self.informer._broken(self.stream)

    def broke(self) -> bool:
        return self.informer._in_doubt(self.stream)

    def failed_to_apply(self) -> None:
        self.informer.apply_failures[self.stream.kind] += 1
