"""The informer's cache: records per kind by name, each in the engine's ``Index`` of its changefeed, with what keeps
them in order (tombstones, buried uids, the objects that do not convert) whatever order the watch events, LIST pages
and the maintainer's own writes (write-through) arrive in.

An older watch event never overwrites a newer object, and a deleted object leaves a tombstone so a late event cannot
resurrect it; an incarnation our own Delete found gone is buried (``Store.dead``) until the watch's DELETED of it.
Records share what they repeat of each other (``Store._compact``). A sharded cache keeps the records of the
``SHARDED`` kinds only for the changefeeds it tracks. The Leases and the captures' records computed with them are
``controller.kube.liveness``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.engine.index import Index
from controller.kube.liveness import LEASE, LeaseLiveness
from controller.model import resources as conv
from controller.model.records import Capture, Dispatcher, Record, Span
from controller.model.states import API_VERSION, Kind

JSON = dict[str, Any]


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


def spec_changefeed(obj: JSON) -> str:
    """The ``spec.changefeed`` of ``obj`` ("" if none): immutable, the changefeed whose index is its record's home."""
    value = (obj.get("spec") or {}).get("changefeed")
    return value if isinstance(value, str) else ""


def label_of(obj: JSON) -> str:
    """The value of ``CHANGEFEED_LABEL`` on ``obj`` ("" if none)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    value = labels.get(conv.CHANGEFEED_LABEL) if isinstance(labels, dict) else None
    return value if isinstance(value, str) else ""


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
    objects (few), and a Capture's record is converted lazily with its Lease (``leases``).

    ``last_change`` says, after each ``put``/``remove``, which changefeeds the change concerns: a set of
    names (a record of theirs; a capture's Lease whose progress report changed for them, which may move
    their checkpoint), ``None`` for every changefeed (a Capture, a capture's Lease that may change its
    liveness or whether it is taken), or an empty set (nothing a decision depends on: a live capture's
    Lease renewal with the same report, a maintainer's Lease).
    """

    #: The raw objects of the kinds kept raw (Captures: few, and a Capture's record is converted with its Lease),
    #: by kind then name. The Leases are ``leases``'s.
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
    #: The Leases, their silence on our clock, and the captures' records computed with them.
    leases: LeaseLiveness = field(default_factory=LeaseLiveness)
    indexes: dict[str, Index] = field(default_factory=dict)
    last_change: set[str] | None = field(default_factory=set)
    #: The changefeeds whose records of the ``SHARDED`` kinds are kept (None: every changefeed's, a warm cache).
    #: A record of another changefeed (a late write-through after the changefeed was given up) is dropped.
    shards: set[str] | None = None
    #: Per kind: the changefeed of each tombstone (sharded: a shard's LIST or its end drops only its own).
    _tomb_cf: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Label and finalizer tuples shared by the records that carry equal ones (``_compact``).
    _tuples: dict[tuple[object, ...], tuple[object, ...]] = field(default_factory=dict)

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
        obj = self._raw(kind).get(name)
        return str((obj.get("metadata") or {}).get("uid") or "") if obj is not None else ""

    def _raw(self, kind: str) -> Mapping[str, JSON]:
        """The raw objects held of ``kind`` (a kind kept raw: Leases, Captures), by name."""
        return self.leases.objects if kind == LEASE else self.objects.setdefault(kind, {})

    def _current_rv(self, kind: str, name: str, hint: str = "") -> int | None:
        if kind in RECORD_ONLY:
            rec = self._rec(kind, name, hint)
            if rec is not None:
                return int(rec.resource_version or 0)
            bad = self.invalid.get(kind, {}).get(name)
            return bad[0] if bad is not None else None
        obj = self._raw(kind).get(name)
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
        current = self._current_rv(kind, name, spec_changefeed(obj))
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
            self.last_change = self.leases.put(obj)
            return True
        self.objects.setdefault(kind, {})[name] = obj
        self.invalid.get(kind, {}).pop(name, None)
        self.leases.capture_changed(name)
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
        old = self._rec(kind, name, spec_changefeed(obj))
        try:
            rec: Record | None = self._compact(conv.from_resource(obj))
        except conv.InvalidResource as exc:
            # The label first: a shard's LIST and watch select by it.
            self.invalid.setdefault(kind, {})[name] = (rv, str(exc), label_of(obj) or spec_changefeed(obj))
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

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None:
        """``name`` deleted, as ``obj`` (the object's last state: a watch's DELETED, a Delete's answer) says: at its
        resourceVersion and of its incarnation (None: at resourceVersion 0, of no known incarnation)."""
        self.remove(kind, name, _rv(obj) if obj else 0, _uid(obj))

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
            self.last_change = self.leases.remove(name)
        else:
            self.objects.get(kind, {}).pop(name, None)
            self.leases.capture_changed(name)
            self.last_change = None

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
            if kind == LEASE:
                self.leases.replace(items)
            else:
                self.objects[kind] = {o["metadata"]["name"]: o for o in items}
                self.leases.captures_changed()
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
        obj = self._raw(kind.value).get(name)
        if obj is None:
            return None
        try:
            return self.leases.capture(obj)
        except conv.InvalidResource as exc:
            self.invalid.setdefault(kind.value, {})[name] = (_rv(obj), str(exc), "")
            return None

    def captures(self) -> dict[str, Capture]:
        """Every Capture with its Lease, plus a record for each capture Lease whose Capture object is gone
        (marked deleting: never scheduled on, but its Lease still says whether its dispatchers may run)."""
        valid = {n: r for n, r in self.all(Kind.CAPTURE).items() if isinstance(r, Capture)}
        return self.leases.captures(valid, self._raw(Kind.CAPTURE.value).keys())

    def all(self, kind: Kind) -> Mapping[str, Record]:
        """Every record of ``kind`` (a live view for the record-only kinds: do not change it)."""
        if kind.value in RECORD_ONLY:
            return self.records[kind.value]
        out = {}
        for name in list(self._raw(kind.value)):
            rec = self.record(kind, name)
            if rec is not None:
                out[name] = rec
        return out

    def names(self, kind: Kind) -> list[str]:
        if kind.value in RECORD_ONLY:
            return list(self.records[kind.value])
        return list(self._raw(kind.value))

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
        self.store.forget(kind, name, obj)

    def gone(self, kind: str, name: str, uid: str = "") -> None:
        self.store.gone(kind, name, uid)

