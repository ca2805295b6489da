"""The maintainer process: a few parts with one job each, wired here (the shape of controller-runtime's manager and
its runnables).

```
 Informer (controller/kube/informer.py)   LIST+WATCH of every kind into the cache and the engine's indexes
     | on_change(Change) -> route: the changefeeds concerned wake, a capture's report waits for the checkpoint
     v                     interval (Changefeeds.report), the metrics observe operators
 Changefeeds (changefeeds.py)   one loop per Changefeed: bid, lead (decide in a thread, apply through the Executor)
 Membership (membership.py)     the member Lease, and the balance policy (engine/balance_policy.step) applied
 Labeller (labels.py)           sharded: the unassigned objects' streams and their labels
 Janitor (janitor.py)           orphaned Tables, finalizers of a namespace being deleted
 Terms (terms.py)               what they share: what is led, each loop's wake-up, the handoffs asked
 MaintainerMetrics (metrics.py) /metrics: what a MaintainerView of these parts shows at scrape time
```

The supervisor turns on a change (``_kick``) or every ``SUPERVISE_IDLE``: it keeps one loop per Changefeed, looks at
the balance, the labels and (every ``JANITOR_INTERVAL``) the janitor. Several replicas of this process spread the
changefeeds among themselves evenly (``Settings.balance``, on by default; ``engine/shards.py``): each announces
itself with a member Lease ``cfmm-<identity>``, bids only while it leads less than its share (floor or ceil of
changefeeds over live replicas) and hands over what is above it; ``max_leases`` is a hard cap on what one replica
leads, not a way to spread them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from controller.engine import balance_policy
from controller.engine.maintainer import Memory
from controller.engine.world import AUDIT_INTERVAL, World
from controller.kube import namespace
from controller.kube.client import Client, sleep_or
from controller.kube.executor import Executor
from controller.kube.informer import PROGRESS_WINDOW, Change, Informer
from controller.kube.liveness import CAPTURE_LEASE_PREFIX, LEASE, LEASE_FRESH
from controller.kube.reflector import WATCH_TIMEOUT
from controller.kube.store import StoreCache
from controller.logs import fields
from controller.maintainer.changefeeds import Changefeeds, Timings
from controller.maintainer.janitor import JANITOR_INTERVAL, Janitor
from controller.maintainer.labels import Labeller
from controller.maintainer.membership import Membership
from controller.maintainer.metrics import MaintainerMetrics, MaintainerView
from controller.maintainer.stats import Stats
from controller.maintainer.terms import Terms
from controller.model.states import Kind
from controller.process import heap, tenure
from controller.process.pacing import Pacer

log = logging.getLogger("controller.maintainer")
#: At rest, the supervisor's longest sleep without a change (at most half the retry period): for what only
#: time brings (a replica's member Lease that lapses, the janitor). 0.25 s made 4 turns a second at rest.
SUPERVISE_IDLE = 1.0
#: Seconds that stopping may spend releasing finalizers in a namespace being deleted.
STOP_RELEASE_BUDGET = 10.0


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
    #: Seconds between tenure steps (controller.process.tenure: what survives is frozen out of the collector's
    #: full passes, so that they stay short however many records the replica holds); 0: off, the default of
    #: the class (a library user's process, a test's); the command line's default is tenure.PERIOD (0.5 s).
    gc_tenure: float = 0.0
    #: The heap reserve's ceiling, bytes (controller.process.heap: memory paged in ahead of time by a thread of its
    #: own, so that a table growing in the event loop does not take thousands of page faults); 0: off, the
    #: default of the class and of the command line (an opt-in: it rewires glibc's allocator in-process).
    heap_reserve: int = 0
    metrics_port: int = 0  # 0: no metrics endpoint (the CLI's default is 9090)
    #: The least ``timeoutSeconds`` a watch asks the server for (it asks between this and twice this, as
    #: client-go does); the server then ends the stream and the informer resumes it.
    watch_timeout: float = WATCH_TIMEOUT
    #: The liveness probe fails after this many seconds without a request answered by the API (``healthy``).
    liveness_window: float = PROGRESS_WINDOW
    metrics_address: str = "0.0.0.0"


class Maintainer:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        s = settings
        self.started = time.monotonic()
        self.stats = Stats()
        self.terms = Terms()
        self.tenure = tenure.Tenure(s.gc_tenure) if s.gc_tenure > 0 else None
        #: Set once its thread has started (None: off, or not glibc).
        self.heap: heap.HeapReserve | None = None
        #: Set on every informer notification but a capture's report, and when a changefeed's loop ends: the
        #: supervisor's next turn.
        self._kick = asyncio.Event()
        #: Set when every changefeed's loop must look (a Capture changed): the supervisor wakes them all.
        self.wakeup = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # What keeps the event loop's turns short, shared by the informer's streams and the executors' chains.
        pacer = Pacer()
        # The Lease stream counts as current while something arrives at least this often: our own Lease
        # renewals (every ``retry``) and the captures' keep it busy while we lead.
        self.informer = Informer(
            client,
            s.namespace,
            on_change=self._changed,  # it notifies nothing before ``start``, when every part below exists
            lease_fresh=max(LEASE_FRESH, 2.5 * s.retry),
            watch_timeout=s.watch_timeout,
            progress_window=s.liveness_window,
            sharded=s.cache == "sharded",
            # Each LIST page's records out of the collector's full passes at once, at a cold start.
            after_page=self.tenure.freeze_now if self.tenure is not None else None,
            pacer=pacer,
        )
        self.executor = Executor(client, self.informer, s.namespace, s.concurrency, pacer=pacer)
        #: The janitor's writes over the unassigned objects (sharded: the Tables of a changefeed that is gone).
        orphans = Executor(client, StoreCache(self.informer.unassigned), s.namespace, 4, pacer=pacer)
        policy = balance_policy.Config(
            identity=s.identity,
            started=self.started,
            lease_duration=s.lease_duration,
            retry=s.retry,
            balance=s.balance,
            max_leases=s.max_leases,
            expected_replicas=s.expected_replicas,
        )
        self.membership = Membership(
            client, s.namespace, self.informer.store, self.terms, policy, renew_deadline=s.renew_deadline
        )
        timings = Timings(
            namespace=s.namespace,
            identity=s.identity,
            tick=s.tick,
            audit_interval=s.audit_interval,
            lease_duration=s.lease_duration,
            renew_deadline=s.renew_deadline,
            retry=s.retry,
        )
        self.changefeeds = Changefeeds(
            client, timings, self.informer, self.executor, self.stats, self.terms, self.membership
        )
        self.labeller = Labeller(client, s.namespace, self.informer)
        self.janitor = Janitor(client, s.namespace, s.identity, self.informer, self.executor, orphans, self.stats)
        self.metrics = MaintainerMetrics(
            MaintainerView(
                informer=self.informer,
                leading=self.terms.leading,
                stats=self.stats,
                memories=self.changefeeds.memories,
                write_errors=(self.executor.errors, orphans.errors),
                counts=self.counts,
                snapshot=self.snapshot,
                tenure=self.tenure,
                heap=lambda: self.heap,
            )
        )

    # -- what the metrics and the tests read ---------------------------------------------------------------

    @property
    def leading(self) -> set[str]:
        return self.terms.leading

    @property
    def memories(self) -> dict[str, Memory]:
        return self.changefeeds.memories

    @property
    def loops(self) -> dict[str, asyncio.Task[None]]:
        return self.changefeeds.loops

    def counts(self) -> dict[str, int]:
        """Live member -> how many changefeeds it leads, as the Leases show (this replica: its own truth)."""
        return self.membership.counts()

    def snapshot(self, name: str) -> World | None:
        return self.changefeeds.snapshot(name)

    # -- lifecycle ---------------------------------------------------------------------------------------

    def _spawn(self, name: str, coro: object) -> None:
        self._tasks[name] = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]

    async def start(self) -> None:
        if self.settings.heap_reserve > 0:
            reserve = heap.HeapReserve(self.settings.heap_reserve)
            self.heap = reserve if reserve.start() else None
        if self.tenure is not None:
            self._spawn("tenure", self.tenure.run())
        await self.informer.start()
        self._spawn("membership", self.membership.run())
        self._spawn("supervisor", self._supervise())

    async def stop(self) -> None:
        ns = self.settings.namespace
        with contextlib.suppress(Exception):  # best effort within a bound: shutting down must not hang on it
            async with asyncio.timeout(STOP_RELEASE_BUDGET):
                if await namespace.terminating(self.client, ns):
                    await namespace.release_finalizers(self.client, ns, deleting_only=False)
        supervisor = self._tasks.pop("supervisor", None)
        if supervisor is not None:
            supervisor.cancel()
        await self.labeller.stop()
        await self.changefeeds.stop()
        membership = self._tasks.pop("membership", None)
        if membership is not None:
            membership.cancel()
            await asyncio.gather(membership, return_exceptions=True)
            with contextlib.suppress(Exception):  # best effort: the others' janitors delete it once it lapsed
                await self.membership.leave()
        await self.informer.stop()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self.heap is not None:
            self.heap.stop()

    # -- routing the informer's changes -----------------------------------------------------------------

    def _changed(self, change: Change) -> None:
        kind, name, concerned = change.kind, change.name, change.changefeeds
        report = kind == LEASE and name.startswith(CAPTURE_LEASE_PREFIX)
        if concerned is None or not report:
            # Not a capture's renewal or progress report (1.5 a second at rest with three captures): those wake
            # only the changefeeds they concern (below), and the supervisor has nothing to do for them.
            self._kick.set()
        if concerned is None:  # a capture: every changefeed's decisions look at the captures
            self.wakeup.set()
        else:
            for cf in concerned:
                if report:
                    self.changefeeds.report(cf)
                elif self.terms.has_loop(cf):
                    self.terms.wake(cf)
                elif kind == Kind.CHANGEFEED.value:
                    self.wakeup.set()  # a new changefeed: the supervisor starts its loop
        self.metrics.on_change(kind, name)

    # -- probes ------------------------------------------------------------------------------------------

    def healthy(self) -> tuple[bool, str]:
        """The liveness probe (Kopf's ``watches`` activity): the supervisor and every watch task alive, and a
        request answered by the API within ``liveness_window`` (``Informer.healthy``). A quiet watch is healthy."""
        supervisor = self._tasks.get("supervisor")
        if supervisor is not None and supervisor.done():
            return False, "supervisor ended"
        return self.informer.healthy()

    def ready(self) -> tuple[bool, str]:
        """Readiness: every kind listed, watches healthy, and a bid for the Lease of every Changefeed
        answered by the API (or held back on purpose by ``max_leases``)."""
        if "supervisor" not in self._tasks:
            return False, "starting"
        missing = self.informer.unlisted()
        if missing:
            return False, "not yet listed: " + ", ".join(missing)
        ok, why = self.healthy()
        if not ok:
            return False, why
        names = sorted(self.informer.store.all(Kind.CHANGEFEED))
        waiting = [n for n in names if n not in self.changefeeds.competing]
        if waiting:
            shown = ", ".join(waiting[:5]) + (f" and {len(waiting) - 5} more" if len(waiting) > 5 else "")
            return False, f"not yet competing for the Lease of {shown}"
        return True, f"{len(names)} changefeed(s), leading {len(self.leading & set(names))}"

    # -- supervision -----------------------------------------------------------------------------------

    async def _upkeep(self) -> None:
        """The janitor's pass, and the member Leases of replicas gone for good."""
        try:
            await self.janitor.sweep()
            await self.membership.forget_members(self.settings.lease_duration)
        except Exception:  # never let it end the supervisor: the loops live on
            log.exception("the janitor's pass failed; retrying", extra=fields(namespace=self.settings.namespace))

    async def _supervise(self) -> None:
        # Bidding needs only the Changefeeds and the Leases (listed first); decisions wait for every kind
        # (Changefeeds._lead), so a cold start lists Tables, Spans, Dispatchers and operators while it waits.
        await self.informer.wait_listed(LEASE, Kind.CHANGEFEED.value)
        janitor_at = 0.0
        while True:
            if self.informer.synced.is_set() and time.monotonic() >= janitor_at:
                janitor_at = time.monotonic() + JANITOR_INTERVAL
                await self._upkeep()
            # A Changefeed being deleted is still led: its teardown runs until the finalizer is released.
            names = set(self.informer.store.all(Kind.CHANGEFEED))
            self.changefeeds.sync(names, self._kick)
            if self.wakeup.is_set():
                self.terms.wake_all()
            self.wakeup.clear()
            self.membership.balance()
            self.labeller.upkeep(names, self.leading)
            self.stats.supervisor_turns += 1
            # At most 20 turns a second under load; at rest a turn on a change (a Changefeed, a Lease, a capture:
            # every informer notification but a report kicks it), when a loop ends, or every SUPERVISE_IDLE for what
            # only time brings (a Lease that lapses, the janitor), not 20 wake-ups a second for nothing.
            await asyncio.sleep(0.05)
            await sleep_or(self._kick, min(SUPERVISE_IDLE, self.settings.retry / 2))  # clears it
