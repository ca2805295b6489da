"""The per-changefeed loops: each competes for its changefeed's Lease, and while it leads, decides and writes.

Each changefeed has its own maintainer loop, as in TiCDC: it competes for the Lease ``cfm-<changefeed>`` (when the
balance lets it bid: ``Bidding``), takes the term's epoch from it, waits until every kind has been listed, and then
calls the pure engine when the informer reports a change to that changefeed's records (or to the captures), or
when the last decision said something becomes due (``Decision.next_due``: a balance round, a traffic check, a
garbage collection, a capture's Lease running out, the next full audit), and at least every ``tick`` seconds (a
backstop), applying the decision's writes. A decision costs what changed: the informer keeps the engine's
per-changefeed index current per event, and the snapshot handed to the engine is that index (O(1) to take). When the
Lease is lost the loop cancels whatever it is writing at once and goes back to competing; a handoff the balance
asked for ends the term at the next decision boundary (``Terms``). A loop never ends while its changefeed exists:
an error in a term is logged, counted, the Lease given up, and the loop competes again after a back-off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

from controller.engine import shards
from controller.engine.maintainer import CHECKPOINT_INTERVAL, Decision, Memory, decide, observed
from controller.engine.world import Options, World
from controller.kube.client import Client, sleep_or
from controller.kube.executor import Executor
from controller.kube.informer import Informer
from controller.kube.lease import LeaderElector
from controller.logs import fields
from controller.maintainer.stats import Stats
from controller.maintainer.terms import Terms
from controller.model.records import Changefeed
from controller.model.states import Kind

log = logging.getLogger("controller.maintainer")
#: At most one decision of a changefeed per this many seconds, however many events arrive.
MIN_INTERVAL = 0.05


class Bidding(Protocol):
    """What a changefeed's loop asks of the balance (``membership.Membership``)."""

    def may_bid(self, name: str) -> bool: ...

    def answered(self, name: str) -> None: ...

    def handed(self, name: str, epoch: int) -> None: ...

    def silent(self, lease: str, holder: str, renew: str) -> float: ...


@dataclass(frozen=True)
class Timings:
    """The loops' settings (the maintainer's ``Settings``)."""

    namespace: str
    identity: str
    tick: float
    audit_interval: float
    lease_duration: float
    renew_deadline: float
    retry: float


@dataclass(frozen=True)
class AuditCheck:
    """A full audit compared with the incremental decision of the same world."""

    agreed: bool
    #: The audit's chains the incremental decision lacked, described (at most 5; none: the same writes in
    #: another order).
    missed: tuple[str, ...] = ()


def decide_and_compare(world: World, memory: Memory, options: Options) -> tuple[Decision, AuditCheck | None]:
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


class Changefeeds:
    def __init__(
        self,
        client: Client,
        timings: Timings,
        informer: Informer,
        executor: Executor,
        stats: Stats,
        terms: Terms,
        bidding: Bidding,
    ) -> None:
        self.client = client
        self.timings = timings
        self.informer = informer
        self.executor = executor
        self.stats = stats
        self.terms = terms
        self.bidding = bidding
        self.loops: dict[str, asyncio.Task[None]] = {}
        #: The memory of the last decision of each changefeed's current term (read by the metrics).
        self.memories: dict[str, Memory] = {}
        #: Changefeeds whose loop has had an answer from the API to a bid for its Lease (won or not), or waits on
        #: purpose (its share full): what readiness calls "competing".
        self.competing: set[str] = set()
        #: Per changefeed: the wake-up a capture's progress report waits for (``report``).
        self._progress_timers: dict[str, asyncio.TimerHandle] = {}

    # -- the set of loops ---------------------------------------------------------------------------

    def sync(self, names: set[str], ended: asyncio.Event) -> None:
        """One loop per changefeed of ``names`` (those that exist): loops that ended while their changefeed exists
        are counted and started again, loops of changefeeds gone are cancelled. ``ended`` is set when a loop ends."""
        for name in sorted(n for n, t in self.loops.items() if t.done() and n in names):
            task = self.loops.pop(name)  # a loop that ended while its changefeed still exists (see _changefeed)
            if not task.cancelled() and task.exception() is not None:
                self.stats.loop_crashes += 1
                log.error(
                    "changefeed %s: loop ended: %r; restarting it",
                    name,
                    task.exception(),
                    extra=fields(changefeed=name),
                )
        for name in sorted(names - set(self.loops)):
            self.terms.wakeup(name)
            self.loops[name] = asyncio.create_task(self._changefeed(name), name=f"changefeed-{name}")
            self.loops[name].add_done_callback(lambda _: ended.set())
        for name in sorted(set(self.loops) - names):
            self.loops.pop(name).cancel()
            self.terms.forget(name)
            self.memories.pop(name, None)

    async def stop(self) -> None:
        for t in self.loops.values():
            t.cancel()
        for timer in self._progress_timers.values():
            timer.cancel()
        self._progress_timers.clear()
        await asyncio.gather(*self.loops.values(), return_exceptions=True)

    def report(self, cf: str) -> None:
        """A capture's progress report changed for ``cf`` (not its liveness, nor a Lease taken). Reports feed nothing
        but the checkpoint (engine/progress.py), and a new checkpoint is written at most once per
        ``CHECKPOINT_INTERVAL``: until then a decision would hold it back and write nothing for it. So the changefeed
        wakes once that interval since its last checkpoint write is over, for every report that came meanwhile
        (three captures report 1.5 times a second at rest: a decision each, most of them writing nothing), at once
        if it is over already."""
        if not self.terms.has_loop(cf):
            return
        memory = self.memories.get(cf)
        delay = memory.checkpoint_at + CHECKPOINT_INTERVAL - time.time() if memory is not None else 0.0
        if not 0 < delay <= CHECKPOINT_INTERVAL:  # over, or the wall clock stepped back: the engine writes then
            self.terms.wake(cf)
        elif cf not in self._progress_timers:
            self._progress_timers[cf] = asyncio.get_running_loop().call_later(delay, self._progress_due, cf)

    def _progress_due(self, cf: str) -> None:
        self._progress_timers.pop(cf, None)
        self.terms.wake(cf)

    def snapshot(self, name: str) -> World | None:
        """The changefeed's world: its index's own maps (kept current per event by the informer) and the index
        itself, and the captures. O(captures): nothing is copied."""
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

    # -- one changefeed ---------------------------------------------------------------------------------

    async def _changefeed(self, name: str) -> None:
        t = self.timings
        lease = shards.changefeed_lease(name)
        elector = LeaderElector(
            self.client,
            t.namespace,
            lease,
            t.identity,
            duration=t.lease_duration,
            renew_deadline=t.renew_deadline,
            retry=t.retry,
            owner=lambda: self.informer.store.owner_reference(name),
            silent=lambda holder, renew: self.bidding.silent(lease, holder, renew),
            on_answer=lambda: self.competing.add(name),
        )
        backoff = t.retry
        try:
            while True:
                try:
                    if not await self._term(name, elector):
                        return  # the changefeed is gone
                    backoff = t.retry
                except Exception:
                    # Never let one error end the changefeed's loop for good (it would stay unmaintained while the
                    # process looks healthy): report, give the Lease up, back off, compete again.
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
        bidding = self.bidding
        epoch = await elector.acquire(floor, may=lambda: bidding.may_bid(name), answered=lambda: bidding.answered(name))
        handover = self.terms.begin(name)
        self.stats.epochs[name] = epoch
        lost = asyncio.Event()
        holder = asyncio.create_task(elector.hold(lost), name=f"lease-{name}")
        try:
            await self._lead(name, epoch, lost, handover)
        finally:
            handed = self.terms.end(name)
            self.informer.untrack(name)  # sharded: its watches stop and its records go
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
        if handed and not lost.is_set():
            # The decision in hand is finished and nothing more is written: the Lease goes, and another replica
            # takes it at a new epoch (bootstrapping as after any failover).
            await elector.release()
            self.stats.handoffs += 1
            bidding.handed(name, epoch)
            log.info(
                "changefeed %s: handed over at epoch %d to balance the replicas (leading %d)",
                name,
                epoch,
                len(self.terms.leading),
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

        Every decision runs in a thread while it holds the informer's decision lock, so that it sees one snapshot
        and the event loop keeps renewing Leases, reading watches (they wait, not the loop) and deciding for other
        changefeeds meanwhile. In the loop, a heavy one (the audit, a bootstrap: every record visited, seconds at
        100,000 spans) would hold it for 1.5 to 2.7 s at 50,000 spans, and one that places a 1,000-span Table for
        90 ms; at rest a decision is under a millisecond, and the thread costs about 0.1 ms more."""
        async with self.informer.lock.hold():
            decision, check = await asyncio.to_thread(decide_and_compare, world, memory, options)
        if check is not None:
            self._audited(world.changefeed.name, memory, check)
        return decision

    def _audited(self, name: str, memory: Memory, check: AuditCheck) -> None:
        """A full audit ran: what would the incremental decision have done from the same snapshot? The same, unless
        the index failed to offer a candidate (then the audit has just made up for it)."""
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

    def _memory(self, name: str, epoch: int) -> Memory:
        memory = self.memories.get(name)
        if memory is None or memory.epoch != epoch or memory.identity != self.timings.identity:
            return Memory(epoch=epoch, identity=self.timings.identity)
        # The same term resumed (the Lease was still ours after we could not renew it for a while, an API outage):
        # nothing happened under another epoch, so what this term learnt still holds.
        log.info(
            "changefeed %s: leadership resumed at epoch %d", name, epoch, extra=fields(changefeed=name, epoch=epoch)
        )
        return memory

    async def _lead(self, name: str, epoch: int, lost: asyncio.Event, handover: asyncio.Event) -> None:
        # Every kind listed (sharded: this changefeed's objects listed, its watches started) before deciding.
        await self.informer.track(name)
        memory = self.memories[name] = self._memory(name, epoch)
        began = time.monotonic()
        wakeup = self.terms.wakeup(name)
        options = Options(audit_interval=self.timings.audit_interval)
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
            memory = self.memories[name] = decision.memory
            self.stats.decisions += 1
            if decision.chains:
                applied = await self._apply(decision, lost)
                if applied is None:
                    return  # leadership lost mid-decision: stopped writing at once
                before, memory = memory.refusal, applied
                self.memories[name] = memory
                if memory.refusal != before:
                    wakeup.set()  # the next decision says so (WritesRefused, an Event) at once, not at the next tick
            # Batch: at most one decision per MIN_INTERVAL, however many events arrive. Then sleep until an event of
            # this changefeed (our own writes included, so an operator advances as fast as its steps land), until
            # something is due, or at the latest for a tick.
            await asyncio.sleep(MIN_INTERVAL)
            delay = self.timings.tick
            if decision.next_due is not None:
                delay = min(delay, max(0.0, decision.next_due - time.time()))
            await sleep_or(wakeup, delay)

    async def _apply(self, decision: Decision, lost: asyncio.Event) -> Memory | None:
        """The decision's writes, cancelled at once if the Lease is lost meanwhile (None then); else the memory with
        what the writes learnt (``observed``: what was created, what the API refused)."""
        apply = asyncio.create_task(self.executor.apply(decision))
        stop = asyncio.create_task(lost.wait())
        done, _ = await asyncio.wait({apply, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if apply not in done:
            apply.cancel()
            await asyncio.gather(apply, return_exceptions=True)
            return None
        out = apply.result()
        self.stats.writes += out.writes
        self.stats.failed_chains += out.failed
        return observed(decision.memory, out.created, tuple(out.refusals))
