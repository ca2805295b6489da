"""The maintainer process: informer -> one loop per changefeed (led through its Lease) -> executor.

Each changefeed has its own maintainer loop, as in TiCDC: it competes for the Lease
``cfm-<changefeed>``, takes the term's epoch from it, waits until every kind has been listed, and
then calls the pure engine when the informer reports a change to that changefeed's records (or to the
captures), or when the last decision said something becomes due (``Decision.next_due``: a balance
round, a traffic check, a garbage collection, a capture's Lease running out, the next full audit), and
at least every ``tick`` seconds (a backstop), applying the decision's writes. A decision costs what
changed: the informer keeps the engine's per-changefeed index current per event, and the snapshot
handed to the engine is that index (O(1) to take). When the Lease is lost the loop cancels whatever it is writing at
once and goes back to competing. Several replicas of this process spread the changefeeds among
themselves evenly (``Settings.balance``, on by default; ``controller.engine.shards``): each announces itself with
a member Lease ``cfmm-<identity>``, bids only while it leads less than its share (floor or ceil of changefeeds over
live replicas) and hands over what is above it. ``max_leases`` is only a hard cap on what one replica leads (with
``balance`` off, the first replica to bid leads, up to that cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field, replace

from controller.engine import balance_policy, shards, teardown
from controller.engine.maintainer import CHECKPOINT_INTERVAL, Decision, Memory, decide, observed
from controller.engine.world import AUDIT_INTERVAL, Options, World
from controller.kube import heap, namespace, tenure
from controller.kube.client import LEASES, RESOURCES, ApiError, Client, sleep_or
from controller.kube.executor import Executor
from controller.kube.informer import (
    CAPTURE_LEASE_PREFIX,
    LEASE,
    LEASE_FRESH,
    PROGRESS_WINDOW,
    UNASSIGNED,
    WATCH_TIMEOUT,
    Informer,
    StoreCache,
    label_of,
)
from controller.kube.lease import LeaderElector
from controller.logs import fields
from controller.maintainer.metrics import MaintainerMetrics
from controller.maintainer.stats import Stats
from controller.model import resources as conv
from controller.model.records import Changefeed, Table
from controller.model.states import Kind

log = logging.getLogger("controller.maintainer")
MIN_INTERVAL = 0.05
#: Seconds between passes over Tables whose changefeed is gone (teardown.detach_orphans).
JANITOR_INTERVAL = 2.0
#: At rest, the supervisor's longest sleep without a change (at most half the retry period): for what only
#: time brings (a replica's member Lease that lapses, the janitor). 0.25 s made 4 turns a second at rest.
SUPERVISE_IDLE = 1.0
#: A member Lease silent for this many lease durations is deleted (its replica is gone for good).
MEMBER_GC = 10
#: Seconds that stopping may spend releasing finalizers in a namespace being deleted.
STOP_RELEASE_BUDGET = 10.0
#: Sharded cache: at least this many seconds between two restarts of the unassigned objects' streams (their
#: selector names every live changefeed: creating 30 changefeeds at once restarts them about once, not 30 times).
UNASSIGNED_DEBOUNCE = 1.0
#: Labels written at once (the objects a user created without ``cdc.maintainer.dev/changefeed``).
LABEL_CONCURRENCY = 8


def default_identity() -> str:
    pod = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{pod}-{uuid.uuid4().hex[:6]}"


@dataclass
class Settings:
    namespace: str
    identity: str = field(default_factory=default_identity)
    #: At most this many seconds between decisions of a changefeed when nothing happens (a backstop:
    #: decisions come on events and when something is due).
    tick: float = 30.0
    #: Seconds between full audits (every rule over everything), the backstop of incremental decisions.
    audit_interval: float = AUDIT_INTERVAL
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry: float = 2.0
    max_leases: int = 0  # 0: no cap
    #: Spread the changefeeds evenly over the live replicas (engine/balance_policy.py): bid only below the share, hand
    #: over above it. Off: every replica bids for everything (the first to bid leads; ``max_leases`` caps it).
    balance: bool = True
    #: How many replicas the Deployment runs (the chart's ``maintainer.replicas``): for its first lease duration a
    #: replica takes its share as if that many were up, since the others announce themselves seconds apart.
    expected_replicas: int = 1
    concurrency: int = 16
    #: What each replica caches: "warm" (every object of the namespace: a standby takes a changefeed over
    #: and decides at once) or "sharded" (Tables, Spans, Dispatchers and SpanOperators only of the
    #: changefeeds it leads: memory and watch traffic follow its share; taking one over lists it first).
    cache: str = "warm"
    #: Seconds between tenure steps (controller.kube.tenure: what survives is frozen out of the collector's
    #: full passes, so that they stay short however many records the replica holds); 0: off, the default of
    #: the class (a library user's process, a test's); the command line's default is tenure.PERIOD (0.5 s).
    gc_tenure: float = 0.0
    #: The heap reserve's ceiling, bytes (controller.kube.heap: memory paged in ahead of time by a thread of its
    #: own, so that a table growing in the event loop does not take thousands of page faults); 0: off, the
    #: default of the class; the command line's default is heap.CEILING (32 MiB).
    heap_reserve: int = 0
    metrics_port: int = 0  # 0: no metrics endpoint (the CLI's default is 9090)
    #: The least ``timeoutSeconds`` a watch asks the server for (it asks between this and twice this, as
    #: client-go does); the server then ends the stream and the informer resumes it.
    watch_timeout: float = WATCH_TIMEOUT
    #: The liveness probe fails after this many seconds without a request answered by the API (``healthy``).
    liveness_window: float = PROGRESS_WINDOW
    metrics_address: str = "0.0.0.0"


@dataclass(frozen=True)
class AuditCheck:
    """A full audit compared with the incremental decision of the same world."""

    agreed: bool
    #: The audit's chains the incremental decision lacked, described (at most 5; none: the same writes in
    #: another order).
    missed: tuple[str, ...] = ()


def _decide_and_compare(world: World, memory: Memory, options: Options) -> tuple[Decision, AuditCheck | None]:
    """``decide``; for a full audit (an index, bootstrapped), also the incremental decision of the same world,
    compared here, in the decision's thread: comparing the chains of a placement of 1,000 spans (every record
    of every write) is milliseconds of the loop's time, and describing a disagreement is quadratic."""
    decision = decide(world, memory, options)
    if not (decision.full and world.index is not None and memory.bootstrapped):
        return decision, None
    incremental = decide(world, memory, replace(options, audit_interval=float("inf")))
    if incremental.chains == decision.chains:
        return decision, AuditCheck(agreed=True)
    missed = [c.describe() for c in decision.chains if c not in incremental.chains]
    return decision, AuditCheck(agreed=False, missed=tuple(missed[:5]))


class Maintainer:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.wakeup = asyncio.Event()
        self.leading: set[str] = set()
        self.stats = Stats()
        #: The memory of the last decision of each changefeed's current term (read by the metrics).
        self.memories: dict[str, Memory] = {}
        self.metrics = MaintainerMetrics(self)
        # The Lease stream counts as current while something arrives at least this often: our own Lease
        # renewals (every ``retry``) and the captures' keep it busy while we lead.
        lease_fresh = max(LEASE_FRESH, 2.5 * settings.retry)
        self.informer = Informer(
            client,
            settings.namespace,
            on_change=self._changed,
            lease_fresh=lease_fresh,
            sharded=settings.cache == "sharded",
            freeze=settings.gc_tenure > 0,
        )
        self.informer.watch_timeout = settings.watch_timeout
        self.informer.progress_window = settings.liveness_window
        self.executor = Executor(
            client,
            self.informer,
            settings.namespace,
            settings.concurrency,
            on_error=self.metrics.write_error,
            pacer=self.informer.pacer,
        )
        #: The janitor's writes over the unassigned objects (sharded: the Tables of a changefeed that is gone).
        self.orphans = Executor(
            client,
            StoreCache(self.informer.unassigned),
            settings.namespace,
            4,
            on_error=self.metrics.write_error,
            pacer=self.informer.pacer,
        )
        self.loops: dict[str, asyncio.Task[None]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        #: Per changefeed: the wake-up a capture's progress report waits for (``_progress_wake``).
        self._progress_timers: dict[str, asyncio.TimerHandle] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self.started = time.monotonic()
        #: Changefeeds whose loop has had an answer from the API to a bid for its Lease (won or not),
        #: or waits on purpose (``max_leases`` reached): what readiness calls "competing".
        self.competing: set[str] = set()
        #: This replica's member Lease (engine/shards.py), renewed while the process runs.
        self.member = LeaderElector(
            client,
            settings.namespace,
            shards.member_lease(settings.identity),
            settings.identity,
            duration=settings.lease_duration,
            renew_deadline=settings.renew_deadline,
            retry=settings.retry,
        )
        self._membership: asyncio.Task[None] | None = None
        #: Per changefeed: a handoff this replica decided (its loop ends the term at the next decision boundary).
        self._hand_over: dict[str, asyncio.Event] = {}
        #: The balance policy (engine/balance_policy.py): its settings, and its memory between steps (what was
        #: handed over and is held back, when the last round was, when the next look is due).
        self.policy = balance_policy.Config(
            identity=settings.identity,
            started=self.started,
            lease_duration=settings.lease_duration,
            retry=settings.retry,
            balance=settings.balance,
            max_leases=settings.max_leases,
            expected_replicas=settings.expected_replicas,
        )
        self.balance_memory = balance_policy.Memory()
        #: Changefeeds whose Lease this replica is bidding for right now (``may_bid``).
        self._bids: set[str] = set()
        #: Sharded cache: when the unassigned objects' streams were last restarted for a new set of changefeeds.
        self._unassigned_at = -math.inf
        self._labelling: asyncio.Task[None] | None = None
        self._labels_seen: frozenset[str] | None = None
        #: Labels the API refused (logged once each).
        self._label_refused: set[tuple[str, str, str]] = set()
        self._label_at = -math.inf
        self.tenure = tenure.Tenure(settings.gc_tenure) if settings.gc_tenure > 0 else None
        #: Set once its thread has started (None: off, or not glibc).
        self.heap: heap.HeapReserve | None = None
        #: Set on every informer notification and when a changefeed's loop ends: the supervisor's next turn.
        self._kick = asyncio.Event()
        self._tenure: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.settings.heap_reserve > 0:
            reserve = heap.HeapReserve(self.settings.heap_reserve)
            self.heap = reserve if reserve.start() else None
        if self.tenure is not None:
            self._tenure = asyncio.create_task(self.tenure.run(), name="tenure")
        await self.informer.start()
        self._membership = asyncio.create_task(self._member(), name="membership")
        self._supervisor = asyncio.create_task(self._supervise(), name="supervisor")

    # -- scale-out: membership and balance (engine/shards.py, engine/balance_policy.py) ---------------------

    async def _member(self) -> None:
        """Keep this replica's member Lease: acquire, renew; acquire again if it was lost."""
        while True:
            await self.member.acquire()
            lost = asyncio.Event()
            await self.member.hold(lost)

    def _seen(self, name: str, now: float) -> shards.Seen | None:
        """The Lease ``name`` as our watch shows it (``shards.Seen``), or None if there is none."""
        store = self.informer.store
        lease = store.objects.get(LEASE, {}).get(name)
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
        return shards.Seen(str(spec.get("holderIdentity") or ""), duration, store.silence.of(name, now), transitions)

    def _view(self, now: float, asking: frozenset[str] = frozenset()) -> balance_policy.View:
        """This replica's ``balance_policy.View``: its member and changefeed Leases as its watch shows them, what it
        leads, bids for and hands over, and the policy's memory."""
        store = self.informer.store
        leases = store.objects.get(LEASE, {})
        members = {n: seen for n in leases if n.startswith(shards.MEMBER_PREFIX) and (seen := self._seen(n, now))}
        cfs = store.all(Kind.CHANGEFEED)
        return balance_policy.View(
            config=self.policy,
            members=members,
            changefeeds={cf: self._seen(shards.changefeed_lease(cf), now) for cf in cfs},
            leading=frozenset(self.leading),
            bids=frozenset(self._bids),
            asking=asking,
            handing=frozenset(n for n, e in self._hand_over.items() if e.is_set()),
            deleting=frozenset(n for n, cf in cfs.items() if isinstance(cf, Changefeed) and cf.deleting),
            memory=self.balance_memory,
        )

    def counts(self) -> dict[str, int]:
        """Live member -> how many changefeeds it leads, as the Leases show (this replica: its own truth). A
        member whose Lease has run out on our clock (``Store.silence``) is not counted, nor are its Leases."""
        return balance_policy.counts(self._view(time.monotonic()))

    def _step(self, asking: frozenset[str] = frozenset()) -> balance_policy.Decision:
        """One step of the balance policy (``balance_policy.step``), applied: the bids it lets through hold their
        place in the count of what this replica leads until answered (``_answered``), the changefeeds it hands
        over end their terms at the next decision boundary (``_term``), and its memory is kept for the next."""
        now = time.monotonic()
        decision = balance_policy.step(self._view(now, asking), now)
        self.balance_memory = decision.memory
        self._bids.update(decision.bids)
        for name in decision.hand_over:
            self._hand_over.setdefault(name, asyncio.Event()).set()
            ev = self._wakeups.get(name)
            if ev is not None:
                ev.set()
        return decision

    async def _forget_members(self) -> None:
        """Delete the member Leases of replicas gone for good (SIGKILLed: a graceful stop deletes its own): silent
        on our clock for ``MEMBER_GC`` lease durations. The uid precondition spares a Lease created anew."""
        store = self.informer.store
        now = time.monotonic()
        for name, lease in list(store.objects.get(LEASE, {}).items()):
            if not name.startswith(shards.MEMBER_PREFIX) or name == self.member.name:
                continue
            seen = self._seen(name, now)
            silent = seen.silent if seen is not None else None
            duration = (seen.duration if seen is not None else 0.0) or self.settings.lease_duration
            if silent is None or silent < MEMBER_GC * duration:
                continue
            uid = str((lease.get("metadata") or {}).get("uid") or "")
            try:
                await self.client.delete(LEASES, self.settings.namespace, name, uid)
                log.info("deleted the member Lease %s of a replica gone for %.0fs", name, silent)
            except ApiError as exc:
                if not (exc.not_found or exc.status == 409):
                    raise

    def may_bid(self, name: str) -> bool:
        """Whether this replica bids for ``name``'s Lease now (``balance_policy.step``, asked by ``name``'s loop). A
        bid let through holds its place in the count of what this replica leads until it is answered (``_answered``):
        the loops of many changefeeds ask at once, and without that all of them would bid before any had won, past
        the share and past ``maxLeases``."""
        return name in self._step(frozenset({name})).bids

    def _answered(self, name: str) -> None:
        self._bids.discard(name)

    def _silent(self, lease_name: str, holder: str, renew: str) -> float:
        """How long our watch has seen ``lease_name`` unchanged with ``holder`` and ``renew`` (0 if it shows another
        holder or renewal): counted on our clock, and only while our view of Leases was current (``Silence``)."""
        store = self.informer.store
        spec = (store.objects.get(LEASE, {}).get(lease_name) or {}).get("spec") or {}
        if str(spec.get("holderIdentity") or "") != holder or str(spec.get("renewTime") or "") != renew:
            return 0.0
        return store.silence.of(lease_name, time.monotonic()) or 0.0

    def _balance(self) -> None:
        """A look at the balance, from the supervisor's turn (``balance_policy.step`` decides when one is due: once
        per ``retry``, one round of handoffs per two lease durations, none in the first lease duration): a step
        before the last one's ``next_due`` would decide no handoff, and the supervisor turns up to 20 times a second."""
        if time.monotonic() >= self.balance_memory.next_look:
            self._step()

    # -- sharded cache: the unassigned objects, and their labels --------------------------------------------

    def _shard_upkeep(self, changefeeds: set[str]) -> None:
        """Sharded: keep the unassigned objects' streams selecting against the live changefeeds, and label what a
        user created without ``cdc.maintainer.dev/changefeed`` (or labelled with another changefeed than its
        ``spec.changefeed``) when this replica leads its changefeed: only then does its shard watch see it."""
        inf = self.informer
        if not inf.sharded:
            return
        now = time.monotonic()
        if now - self._unassigned_at >= UNASSIGNED_DEBOUNCE and inf.watch_unassigned(changefeeds):
            self._unassigned_at = now
        if self._labelling is not None and not self._labelling.done():
            return
        leading = frozenset(self.leading)
        if now < self._label_at or not (inf.relabel or inf.unassigned_changed or leading != self._labels_seen):
            return
        todo, inf.relabel = inf.relabel, {}
        if inf.unassigned_changed or leading != self._labels_seen:
            inf.unassigned_changed, self._labels_seen = False, leading
            for kind in UNASSIGNED:
                for name, rec in inf.unassigned.all(Kind(kind)).items():
                    cf = str(getattr(rec, "changefeed", ""))
                    if cf in leading and dict(rec.labels).get(conv.CHANGEFEED_LABEL) != cf:
                        todo[(kind, name)] = cf
        if todo:
            self._labelling = asyncio.create_task(self._label(todo), name="labels")

    async def _label(self, todo: dict[tuple[str, str], str]) -> None:
        """Write ``cdc.maintainer.dev/changefeed`` on each object of ``todo``. What fails for a reason that may pass
        (the API down, a timeout) is tried again a second later; a refusal is logged, once per object."""
        sem = asyncio.Semaphore(LABEL_CONCURRENCY)

        async def one(kind: str, name: str, changefeed: str) -> None:
            patch = {"metadata": {"labels": {conv.CHANGEFEED_LABEL: changefeed}}}
            async with sem:
                try:
                    obj = await self.client.patch(RESOURCES[Kind(kind)], self.settings.namespace, name, patch)
                except ApiError as exc:
                    if exc.not_found:
                        return
                    if exc.status >= 500 or exc.status == 429:
                        self.informer.relabel.setdefault((kind, name), changefeed)
                        self._label_at = time.monotonic() + 1.0
                        return
                    if (kind, name, changefeed) in self._label_refused:
                        return
                    self._label_refused.add((kind, name, changefeed))
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
                    self.informer.relabel.setdefault((kind, name), changefeed)
                    self._label_at = time.monotonic() + 1.0
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

    async def stop(self) -> None:
        with contextlib.suppress(Exception):  # best effort within a bound: shutting down must not hang on it
            async with asyncio.timeout(STOP_RELEASE_BUDGET):
                if await namespace.terminating(self.client, self.settings.namespace):
                    await namespace.release_finalizers(self.client, self.settings.namespace, deleting_only=False)
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._labelling is not None:
            self._labelling.cancel()
        for t in self.loops.values():
            t.cancel()
        for timer in self._progress_timers.values():
            timer.cancel()
        self._progress_timers.clear()
        await asyncio.gather(*self.loops.values(), return_exceptions=True)
        if self._membership is not None:
            self._membership.cancel()
            await asyncio.gather(self._membership, return_exceptions=True)
            with contextlib.suppress(Exception):  # best effort: the others' janitors delete it once it lapsed
                async with asyncio.timeout(5.0):
                    await self.client.delete(LEASES, self.settings.namespace, self.member.name)
        await self.informer.stop()
        if self._tenure is not None:
            self._tenure.cancel()
            await asyncio.gather(self._tenure, return_exceptions=True)
        if self.heap is not None:
            self.heap.stop()

    def _changed(self, kind: str, name: str) -> None:
        concerned = self.informer.store.last_change
        if concerned is None or kind != LEASE or not name.startswith(CAPTURE_LEASE_PREFIX):
            # Not a capture's renewal or progress report (1.5 a second at rest with three captures): those wake
            # only the changefeeds they concern (below), and the supervisor has nothing to do for them.
            self._kick.set()
        if concerned is None:  # a capture: every changefeed's decisions look at the captures
            self.wakeup.set()
        else:
            report = kind == LEASE and name.startswith(CAPTURE_LEASE_PREFIX)
            for cf in concerned:
                ev = self._wakeups.get(cf)
                if ev is not None and report:
                    self._progress_wake(cf, ev)
                elif ev is not None:
                    ev.set()
                elif kind == Kind.CHANGEFEED.value:
                    self.wakeup.set()  # a new changefeed: the supervisor starts its loop
        self.metrics.on_change(kind, name)

    def _progress_wake(self, cf: str, ev: asyncio.Event) -> None:
        """A capture's progress report changed for ``cf`` (a capture's liveness or a Lease taken is not this:
        ``last_change`` is None then). Reports feed nothing but the checkpoint (engine/progress.py), and a new
        checkpoint is written at most once per ``CHECKPOINT_INTERVAL``: until then a decision would hold it
        back and write nothing for it. So the changefeed wakes once that interval since its last checkpoint
        write is over, for every report that came meanwhile (three captures report 1.5 times a second at rest:
        a decision each, most of them writing nothing), at once if it is over already."""
        memory = self.memories.get(cf)
        delay = memory.checkpoint_at + CHECKPOINT_INTERVAL - time.time() if memory is not None else 0.0
        if not 0 < delay <= CHECKPOINT_INTERVAL:  # over, or the wall clock stepped back: the engine writes then
            ev.set()
        elif cf not in self._progress_timers:
            self._progress_timers[cf] = asyncio.get_running_loop().call_later(delay, self._progress_due, cf)

    def _progress_due(self, cf: str) -> None:
        self._progress_timers.pop(cf, None)
        ev = self._wakeups.get(cf)
        if ev is not None:
            ev.set()

    def healthy(self) -> tuple[bool, str]:
        """The liveness probe (Kopf's ``watches`` activity): the supervisor and every watch task alive, and a
        request answered by the API within ``liveness_window`` (``Informer.healthy``). A quiet watch is healthy."""
        if self._supervisor is not None and self._supervisor.done():
            return False, "supervisor ended"
        return self.informer.healthy()

    def ready(self) -> tuple[bool, str]:
        """Readiness: every kind listed, watches healthy, and a bid for the Lease of every Changefeed
        answered by the API (or held back on purpose by ``max_leases``)."""
        if self._supervisor is None:
            return False, "starting"
        missing = self.informer.unlisted()
        if missing:
            return False, "not yet listed: " + ", ".join(missing)
        ok, why = self.healthy()
        if not ok:
            return False, why
        names = sorted(self.informer.store.all(Kind.CHANGEFEED))
        waiting = [n for n in names if n not in self.competing]
        if waiting:
            shown = ", ".join(waiting[:5]) + (f" and {len(waiting) - 5} more" if len(waiting) > 5 else "")
            return False, f"not yet competing for the Lease of {shown}"
        return True, f"{len(names)} changefeed(s), leading {len(self.leading & set(names))}"

    # -- supervision -------------------------------------------------------------------------------

    async def _janitor(self) -> None:
        """Tables whose changefeed is gone but which still hold our finalizer (teardown.detach_orphans); while
        a Changefeed is being deleted, whether that is because its namespace is (``controller.kube.namespace``)."""
        store = self.informer.store
        if any(cf.deleting for cf in store.all(Kind.CHANGEFEED).values()) and await namespace.terminating(
            self.client, self.settings.namespace
        ):
            await namespace.release_finalizers(self.client, self.settings.namespace, deleting_only=True)
        await self._forget_members()
        # Sharded, the Tables of a changefeed that is gone are among the unassigned (labelled with no live one).
        source = self.informer.unassigned if self.informer.sharded else store
        tables = [t for t in source.all(Kind.TABLE).values() if isinstance(t, Table)]
        chains = teardown.detach_orphans(tables, set(store.all(Kind.CHANGEFEED)))
        if chains:
            executor = self.orphans if self.informer.sharded else self.executor
            out = await executor.apply(Decision(tuple(chains), Memory(epoch=0, identity=self.settings.identity)))
            self.stats.writes += out.writes
            self.stats.failed_chains += out.failed

    async def _supervise(self) -> None:
        # Bidding needs only the Changefeeds and the Leases (listed first); decisions wait for every kind
        # (_lead), so a cold start lists Tables, Spans, Dispatchers and operators while it waits for a Lease.
        await self.informer.wait_listed(LEASE, Kind.CHANGEFEED.value)
        janitor_at = 0.0
        while True:
            if self.informer.synced.is_set() and time.monotonic() >= janitor_at:
                janitor_at = time.monotonic() + JANITOR_INTERVAL
                try:
                    await self._janitor()
                except Exception:  # never let it end the supervisor: the loops live on
                    log.exception("detaching the Tables of deleted changefeeds failed; retrying")
            # A Changefeed being deleted is still led: its teardown runs until the finalizer is released.
            names = set(self.informer.store.all(Kind.CHANGEFEED))
            for name in sorted(n for n, t in self.loops.items() if t.done() and n in names):
                # A loop that ended while its changefeed still exists (it should not: see _changefeed).
                task = self.loops.pop(name)
                if not task.cancelled() and task.exception() is not None:
                    self.stats.loop_crashes += 1
                    log.error(
                        "changefeed %s: loop ended: %r; restarting it",
                        name,
                        task.exception(),
                        extra=fields(changefeed=name),
                    )
            for name in sorted(names - set(self.loops)):
                self._wakeups[name] = asyncio.Event()
                self.loops[name] = asyncio.create_task(self._changefeed(name), name=f"changefeed-{name}")
                self.loops[name].add_done_callback(lambda _: self._kick.set())
            for name in sorted(set(self.loops) - names):
                self.loops.pop(name).cancel()
                self._wakeups.pop(name, None)
                self.memories.pop(name, None)
            for ev in self._wakeups.values():
                if self.wakeup.is_set():
                    ev.set()
            self.wakeup.clear()
            self._balance()
            self._shard_upkeep(names)
            self.stats.supervisor_turns += 1
            # At most 20 turns a second under load; at rest a turn on a change (a Changefeed, a Lease, a capture:
            # every informer notification kicks it), when a loop ends, or every SUPERVISE_IDLE for what only time
            # brings (a Lease that lapses, the janitor), not 20 wake-ups a second for nothing.
            await asyncio.sleep(0.05)
            await sleep_or(self._kick, min(SUPERVISE_IDLE, self.settings.retry / 2))  # clears it

    def snapshot(self, name: str) -> World | None:
        """The changefeed's world: its index's own maps (kept current per event by the informer) and the
        index itself, and the captures. O(captures): nothing is copied."""
        store = self.informer.store
        cf = store.record(Kind.CHANGEFEED, name)
        index = store.indexes.get(name)
        if not isinstance(cf, Changefeed) or index is None:
            return None
        return World(
            now=time.time(),
            changefeed=cf,
            tables=index.tables,
            spans=index.spans,
            dispatchers=index.dispatchers,
            operators=index.operators,
            captures=store.captures(),
            index=index,
            stale=self.informer.in_doubt(name),
        )

    async def _changefeed(self, name: str) -> None:
        s = self.settings
        elector = LeaderElector(
            self.client,
            s.namespace,
            shards.changefeed_lease(name),
            s.identity,
            duration=s.lease_duration,
            renew_deadline=s.renew_deadline,
            retry=s.retry,
            owner=lambda: self.informer.store.owner_reference(name),
            silent=lambda holder, renew: self._silent(shards.changefeed_lease(name), holder, renew),
        )
        elector.on_answer = lambda: self.competing.add(name)
        backoff = s.retry
        try:
            while True:
                try:
                    if not await self._term(name, elector):
                        return  # the changefeed is gone
                    backoff = s.retry
                except Exception:
                    # Never let one error end the changefeed's loop for good (it would stay unmaintained
                    # while the process looks healthy): report, give the Lease up, back off, compete again.
                    self.stats.loop_crashes += 1
                    log.exception(
                        "changefeed %s: the maintainer loop failed; retrying in %.1fs",
                        name,
                        backoff,
                        extra=fields(changefeed=name),
                    )
                    await elector.release()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 60.0)
        except asyncio.CancelledError:
            self.competing.discard(name)
            await elector.release()
            raise

    async def _term(self, name: str, elector: LeaderElector) -> bool:
        """One leadership term: acquire, lead until the Lease is lost. False when the changefeed is gone."""
        cf = self.informer.store.record(Kind.CHANGEFEED, name)
        floor = cf.epoch if isinstance(cf, Changefeed) else 0
        # Held back while this replica's share is full (another replica may take it; engine/shards.py).
        epoch = await elector.acquire(floor, may=lambda: self.may_bid(name), answered=lambda: self._answered(name))
        self.leading.add(name)
        self._hand_over[name] = asyncio.Event()  # a handoff decided for an earlier term is not this one's
        self.stats.epochs[name] = epoch
        lost = asyncio.Event()
        holder = asyncio.create_task(elector.hold(lost), name=f"lease-{name}")
        try:
            await self._lead(name, epoch, lost)
        finally:
            self.leading.discard(name)
            self.informer.untrack(name)  # sharded: its watches stop and its records go
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
        handover = self._hand_over.pop(name, None)
        if handover is not None and handover.is_set() and not lost.is_set():
            # The decision in hand is finished and nothing more is written: the Lease goes, and another replica
            # takes it at a new epoch (bootstrapping as after any failover).
            await elector.release()
            self.stats.handoffs += 1
            self.balance_memory = balance_policy.handed(self.balance_memory, name, epoch, time.monotonic(), self.policy)
            log.info(
                "changefeed %s: handed over at epoch %d to balance the replicas (leading %d)",
                name,
                epoch,
                len(self.leading),
                extra=fields(changefeed=name, epoch=epoch),
            )
            return True
        if not lost.is_set():
            return False
        log.warning(
            "changefeed %s: leadership lost at epoch %d; stopped writing",
            name,
            epoch,
            extra=fields(changefeed=name, epoch=epoch),
        )
        return True

    async def _decide(self, world: World, memory: Memory, options: Options) -> Decision:
        """``decide``, and for a full audit also the incremental decision from the same snapshot (``_audited``).

        Every decision runs in a thread while the informer is frozen, so that it sees one snapshot and the
        event loop keeps renewing Leases, reading watches (they wait, not the loop) and deciding for other
        changefeeds meanwhile. A heavy one (the audit, a bootstrap: every record visited, seconds at 100,000
        spans) held the loop for 1.5 to 2.7 s at 50,000 spans (issue 25), and one
        that places a 1,000-span Table for 90 ms; at rest a decision is under a millisecond, and the thread
        costs about 0.1 ms more."""
        async with self.informer.frozen():
            decision, check = await asyncio.to_thread(_decide_and_compare, world, memory, options)
        if check is not None:
            self._audited(world.changefeed.name, memory, check)
        return decision

    def _audited(self, name: str, memory: Memory, check: AuditCheck) -> None:
        """A full audit ran: what would the incremental decision have done from the same snapshot? The
        same, unless the index failed to offer a candidate (then the audit has just made up for it)."""
        self.stats.audits += 1
        if not check.agreed:
            self.stats.audit_disagreements += 1
            log.error(
                "changefeed %s: the full audit decided otherwise than the incremental decision would have "
                "(an index bug; the audit acts on it): %s",
                name,
                "; ".join(check.missed) or "(same writes in another order)",
                extra=fields(changefeed=name, epoch=memory.epoch),
            )

    async def _lead(self, name: str, epoch: int, lost: asyncio.Event) -> None:
        # Every kind listed (sharded: this changefeed's objects listed, its watches started) before deciding.
        await self.informer.track(name)
        memory = self.memories.get(name)
        if memory is None or memory.epoch != epoch or memory.identity != self.settings.identity:
            memory = Memory(epoch=epoch, identity=self.settings.identity)
        else:
            # The same term resumed (the Lease was still ours after we could not renew it for a while, an
            # API outage): nothing happened under another epoch, so what this term learnt still holds.
            log.info(
                "changefeed %s: leadership resumed at epoch %d", name, epoch, extra=fields(changefeed=name, epoch=epoch)
            )
        self.memories[name] = memory
        began = time.monotonic()
        wakeup = self._wakeups.setdefault(name, asyncio.Event())
        options = Options(audit_interval=self.settings.audit_interval)
        handover = self._hand_over.setdefault(name, asyncio.Event())
        while not lost.is_set():
            if handover.is_set():
                return  # a handoff: between decisions, never in the middle of one's writes
            world = self.snapshot(name)
            if world is None:
                return
            decision = await self._decide(world, memory, options)
            if lost.is_set():
                return  # the Lease was lost while the decision ran: nothing of it is written
            if decision.fenced:
                log.warning(
                    "changefeed %s: a newer epoch is published; this maintainer is fenced",
                    name,
                    extra=fields(changefeed=name, epoch=epoch),
                )
                lost.set()
                return
            if memory.bootstrapped is False and decision.memory.bootstrapped:
                self.stats.bootstrap_seconds[name] = time.monotonic() - began
                log.info(
                    "changefeed %s bootstrapped at epoch %d: %s",
                    name,
                    epoch,
                    decision.memory.report,
                    extra=fields(changefeed=name, epoch=epoch),
                )
            memory = decision.memory
            self.memories[name] = memory
            self.stats.decisions += 1
            if decision.chains:
                apply = asyncio.create_task(self.executor.apply(decision))
                stop = asyncio.create_task(lost.wait())
                done, _ = await asyncio.wait({apply, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if apply not in done:
                    apply.cancel()  # leadership lost mid-decision: stop writing at once
                    await asyncio.gather(apply, return_exceptions=True)
                    return
                out = apply.result()
                self.stats.writes += out.writes
                self.stats.failed_chains += out.failed
                before, memory = memory.refusal, observed(memory, out.created, tuple(out.refusals))
                self.memories[name] = memory
                if memory.refusal != before:
                    wakeup.set()  # the next decision says so (WritesRefused, an Event) at once, not at the next tick
            # Batch: at most one decision per MIN_INTERVAL, however many events arrive. Then sleep until an
            # event of this changefeed (our own writes included, so an operator advances as fast as its
            # steps land), until something is due, or at the latest for a tick.
            await asyncio.sleep(MIN_INTERVAL)
            delay = self.settings.tick
            if decision.next_due is not None:
                delay = min(delay, max(0.0, decision.next_due - time.time()))
            await sleep_or(wakeup, delay)
