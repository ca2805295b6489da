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

The cache (``controller.kube.store``) also takes the maintainer's own writes (write-through): a successful write's
response is newer than anything the watch has delivered, so the next decision sees it at once. An older watch event
never overwrites a newer object, and a deleted object leaves a tombstone so a late event cannot resurrect it. While a
decision reads the store from another thread, the streams wait and the writes offered meanwhile wait in a backlog
(``controller.kube.decision_lock``).

Captures' liveness is judged on the Lease stream's health (``controller.kube.liveness``, ``engine.liveness``): the
time during which
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
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

from controller.kube.client import LEASES, LIST_PAGE, RESOURCES, Client, Resource
from controller.kube.decision_lock import DecisionLock
from controller.kube.liveness import LEASE, LEASE_FRESH, LeaseLiveness
from controller.kube.reflector import WATCH_TIMEOUT, Reflector
from controller.kube.store import JSON, RECORD_ONLY, SHARDED, UNASSIGNED, Listing, Store, spec_changefeed
from controller.model import resources as conv
from controller.model.states import Kind
from controller.process.pacing import Pacer

log = logging.getLogger(__name__)
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


@dataclass(frozen=True)
class Change:
    """What the informer tells its process after each change to its cache (``Informer.on_change``)."""

    kind: str
    #: The object's name ("" for a whole LIST of the kind).
    name: str
    #: The changefeeds whose decisions can see the change (``Store.last_change``): their names, or None for every
    #: changefeed (a Capture, a capture's Lease whose liveness or holder changed).
    changefeeds: frozenset[str] | None


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
        self.store = Store(leases=LeaseLiveness(fresh=lease_fresh), shards=set() if sharded else None)
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
        #: Held while a decision reads the store from another thread: nothing changes the store meanwhile.
        self.lock = DecisionLock(self.pacer)

    def _start(self, stream: Stream) -> None:
        self._tasks[stream.key] = asyncio.create_task(self.reflector(stream).run(), name=f"informer-{stream.key}")

    def reflector(self, stream: Stream) -> Reflector:
        """The LIST+WATCH of ``stream`` into this informer's stores."""
        return Reflector(
            self.client,
            stream.res,
            self.namespace,
            Feed(self, stream),
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
        # After an untrack of the same changefeed still waiting in the backlog, not before it (the term ended and a
        # new one began while another changefeed's decision ran): the LIST below waits for the lock's release.
        self.lock.apply(lambda: self.store.track(changefeed))
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
        self.lock.apply(lambda: self._untrack(changefeed))

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

    # -- write-through ---------------------------------------------------------------------------

    def offer(self, kind: str, obj: JSON, notify: bool = True) -> None:
        """``obj`` as a write returned it, into the store at once (or once the decision lock is released).
        ``notify`` False: no ``on_change`` for it (a write whose landing needs no decision: ``Chain.wake``)."""
        self.lock.apply(lambda: self._offer(kind, obj, notify))

    def forget(self, kind: str, name: str, obj: JSON | None = None) -> None:
        """``name`` deleted, as the watch (or a write's answer ``obj``, the object's last state) says."""
        self.lock.apply(lambda: self._forget(kind, name, obj))

    def gone(self, kind: str, name: str, uid: str = "") -> None:
        """Our own Delete of ``name`` (incarnation ``uid``) succeeded or found it gone: out of the view at once
        (``Store.gone``)."""
        self.lock.apply(lambda: self._gone(kind, name, uid))

    def _gone(self, kind: str, name: str, uid: str) -> None:
        self.store.gone(kind, name, uid)
        self._notify(kind, name)

    def _offer(self, kind: str, obj: JSON, notify: bool = True) -> None:
        if self.store.put(kind, obj) and notify:
            self._notify(kind, obj["metadata"]["name"])

    def _forget(self, kind: str, name: str, obj: JSON | None) -> None:
        self.store.forget(kind, name, obj)
        self._notify(kind, name)

    def _notify(self, kind: str, name: str) -> None:
        if self.on_change is not None:
            concerned = self.store.last_change
            self.on_change(Change(kind, name, None if concerned is None else frozenset(concerned)))

    # -- what each stream's feed tells (``Feed``) -----------------------------------------------------

    def heard(self, stream: Stream) -> None:
        """``stream`` delivered something (an event, a bookmark, a LIST)."""
        now = time.monotonic()
        self.last_seen[stream.key] = now
        if stream.kind == LEASE:
            self.store.leases.view.heard(now)

    def interrupted(self, stream: Stream) -> None:
        """``stream`` ended or broke: until it delivers again, our view of its kind is not current."""
        if stream.kind == LEASE:
            self.store.leases.view.broken(time.monotonic())

    def broke(self, stream: Stream) -> bool:
        """``stream``'s watch broke: a stream of records relists (``in_doubt``); Leases and Captures resume."""
        if stream.kind not in RECORD_ONLY:
            return False
        self._doubt.add(stream.key)
        return True

    def admit(self, stream: Stream, obj: JSON) -> bool:
        """Whether ``obj`` from ``stream`` may enter the store. A shard's stream admits only the objects whose
        ``spec.changefeed`` (immutable) is its changefeed: one labelled with another (by hand) is to be relabelled
        (``relabel``), and until then no stream of ours has it. So each object has one stream that may put or
        delete it, and an object relabelled from one shard of ours into another is not deleted by the first
        stream's DELETED (a watch says DELETED, with the object as it was, when an object stops matching)."""
        if not stream.changefeed:
            return True
        wanted = spec_changefeed(obj)
        if wanted == stream.changefeed:
            return True
        if wanted:
            self._relabel[(stream.kind, obj["metadata"]["name"])] = wanted
        return False

    def received(self, stream: Stream, obj: JSON) -> None:
        """``stream``'s watch brought ``obj`` (added or modified)."""
        if stream.assigned is not None:
            if self.unassigned.put(stream.kind, obj):
                self._unassigned_dirty = True
        elif self.admit(stream, obj) and self.store.put(stream.kind, obj):
            self._notify(stream.kind, obj["metadata"]["name"])

    def deleted(self, stream: Stream, obj: JSON) -> None:
        """``stream``'s watch said ``obj`` was deleted (or no longer matches its selector)."""
        name = obj["metadata"]["name"]
        if stream.assigned is not None:
            self.unassigned.forget(stream.kind, name, obj)
            self._unassigned_dirty = True
        elif not stream.changefeed or spec_changefeed(obj) == stream.changefeed:
            self.forget(stream.kind, name, obj)  # deleted, or no longer labelled with its changefeed

    def listed(self, stream: Stream, again: bool) -> None:
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
            self._unassigned_dirty = True
        if self._listed >= self._expected:
            self.synced.set()


class Feed:
    """The ``reflector.Target`` of one stream: the informer's store (the unassigned store for an unassigned stream),
    paced and held while a decision holds the lock."""

    def __init__(self, informer: Informer, stream: Stream) -> None:
        self.informer = informer
        self.stream = stream
        self.store = informer.unassigned if stream.assigned is not None else informer.store

    async def ready(self) -> None:
        await self.informer.pacer.pace()
        await self.informer.lock.released()

    def begin_listing(self) -> Listing:
        return self.store.begin_listing(self.stream.kind, self.stream.changefeed)

    def list_chunk(self, listing: Listing, items: list[JSON]) -> None:
        if self.stream.changefeed:
            items = [obj for obj in items if self.informer.admit(self.stream, obj)]
        self.store.list_page(self.stream.kind, items, listing)

    def page_read(self, listing: Listing) -> None:
        if self.stream.kind in RECORD_ONLY and self.informer.after_page is not None:
            self.informer.after_page()

    def end_listing(self, listing: Listing, rv: str) -> None:
        self.store.end_listing(self.stream.kind, listing, int(rv or 0))

    def listed(self, again: bool) -> None:
        self.informer.listed(self.stream, again)

    def put(self, obj: JSON) -> None:
        self.informer.received(self.stream, obj)

    def delete(self, obj: JSON) -> None:
        self.informer.deleted(self.stream, obj)

    def heard(self) -> None:
        self.informer.heard(self.stream)

    def interrupted(self) -> None:
        self.informer.interrupted(self.stream)

    def broke(self) -> bool:
        return self.informer.broke(self.stream)

    def failed_to_apply(self) -> None:
        self.informer.apply_failures[self.stream.kind] += 1
