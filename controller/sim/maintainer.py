"""The simulated maintainer process: LIST, take a new epoch, then tick ``decide`` on its own cache.

Why a process model around ``decide``: the engine is pure, so everything that can go wrong in
production lives in how it is driven: a cache that lags behind the API (watch delays, interleaved
kinds), a process killed between two writes of a chain, a restart with empty memory, a stale
process that keeps acting for a moment after a new one took over, and a process cut off from the API
(its writes fail, its watch delivers nothing; it decides on what it last saw). This module reproduces
exactly those, and calls the production ``decide`` (never a copy) with the production intents.

Captures' liveness is judged as the production informer judges it (``engine.liveness``): a capture's
silence is the time its Lease's renewTime stayed unchanged in this process's view, counted only while
that view was current (it could reach the API). The mutant ``outage-counts-as-silence`` counts all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from controller.engine import intents as I
from controller.engine.intents import Create, Delete, WriteStatus
from controller.engine.liveness import Silence, ViewClock
from controller.engine.maintainer import (
    CONFIGURATION_ERROR,
    FAILED_EVENT,
    PAUSED,
    REFUSED_EVENT,
    REPLICATION_FAILED,
    RETRYING,
    UNAVAILABLE,
    WRITES_REFUSED,
    Decision,
    Memory,
    Refusal,
    decide,
    observed,
)
from controller.engine.repair import OVERLAP_REASON
from controller.engine.world import Options, World, is_placement
from controller.model.records import Capture, Changefeed, Condition, Dispatcher, Span, SpanOperator
from controller.model.states import Kind, OpPhase, OpSource, OpType, SpanState
from controller.sim import executor, index_check
from controller.sim.api import KINDS, Watcher
from controller.sim.captures import LEASE
from controller.sim.context import Ctx
from controller.sim.executor import Cache

#: The view of Leases counts as current this long after the last step that reached the API.
VIEW_FRESH = 0.5
#: After its watches broke (cut off, an outage), each kind of records is listed again at its own moment within this
#: many seconds (production relists a broken record stream: ``Informer.in_doubt``; a real API server answers every
#: watch resumed after its restart with 410, and the kinds list one at a time). Until then that kind's view holds
#: what it held, deleted objects included, its events are lost (the LIST brings them), and it is in doubt
#: (``World.stale``). Captures are not: their liveness has a clock of its own (``view``).
RELIST_SPREAD = 4.0
#: ... or, as often (a server whose watch cache is warm answers the relists at once), all within this many seconds:
#: the maintainer decides again before the captures' next renewals show (``outage-counts-as-silence`` must not
#: take their Leases then).
RELIST_FAST = 0.2
#: Seconds between a new maintainer's LIST of Spans and its LIST of SpanOperators, at most (``SimMaintainer.listing``).
LIST_SKEW = 1.5
RECORD_KINDS: tuple[Kind, ...] = tuple(k for k in KINDS if k is not Kind.CAPTURE)


@dataclass
class Checks:
    """How often a maintainer's decision is checked beyond the invariants (``python -m controller.sim
    --agree-every N --verify-every N``; 0: never). The checks only read: a history is the same with any."""

    #: Every how many decisions the full decision is computed beside the incremental one and compared.
    agree_every: int = 3
    #: Every how many decisions the index is rebuilt from its records and compared (``index_check.verify``).
    verify_every: int = 10


CHECKS = Checks()


class SimMaintainer:
    def __init__(self, ctx: Ctx, changefeed: str, epoch: int, options: Options) -> None:
        self.ctx = ctx
        self.changefeed = changefeed
        self.options = options
        self.view = ViewClock(fresh=VIEW_FRESH, count_all="outage-counts-as-silence" in options.mutants)
        self.silence = Silence(self.view)
        self.identity = f"maintainer-{epoch}"
        self.memory = Memory(epoch=epoch, identity=self.identity)
        # Watch first, then LIST: nothing written in between can be missed.
        self.watcher: Watcher = ctx.api.watch(self.identity)
        # (Production decides only once every kind is listed: Informer.synced, per replica and changefeed.)
        early = "taker-decides-before-listed" in options.mutants
        self.cache = Cache.listed(ctx.api, changefeed, skip=(Kind.DISPATCHER,) if early else ())
        self.view.heard(ctx.now)
        self._observe_leases()
        #: Per kind in doubt: when it is listed again (``RELIST_SPREAD``).
        self.relist_at: dict[Kind, float] = {}
        #: Production lists one kind at a time, SpanOperators last (``Informer.kinds``), and decides only once all
        #: are listed: the kinds listed later show a later world than the Spans. Modelled: SpanOperators are listed
        #: again up to ``LIST_SKEW`` later, and nothing is decided before (events of theirs meanwhile are in that LIST).
        self.listing: dict[Kind, float] = {} if early else {Kind.OPERATOR: ctx.now + ctx.rng.uniform(0.0, LIST_SKEW)}
        self.cut = False
        self.alive = True
        self.zombie = False
        self.zombie_until = 0.0
        self.kill_after: int | None = None  # die after this many more writes
        self.events: list[str] = []
        self.decisions = 0
        #: A refusal the last apply found, which the next decision must report.
        self.unreported: Refusal | None = None
        ctx.trace.add(f"  {self.identity} started at epoch {epoch} (cache synced by LIST)")

    def break_watch(self, kind: Kind, seconds: float) -> None:
        """``kind``'s watch breaks: its view is in doubt, and holds what it holds, until its LIST ``seconds`` on."""
        self.relist_at[kind] = max(self.relist_at.get(kind, 0.0), self.ctx.now + seconds)
        self.ctx.bump("watch break")
        self.ctx.trace.add(f"  {self.identity}: {kind.value} watch broke; listed again in {seconds:.1f}s")

    def stop(self) -> None:
        self.alive = False
        self.ctx.api.unwatch(self.watcher)

    def sync(self) -> None:
        now = self.ctx.now
        if not self.ctx.api.reachable(self.identity):
            self.view.broken(now)  # its watch is broken: what it shows is stale, and nobody's silence
            self.cut = True
            return
        self.view.heard(now)
        if self.cut:
            self.cut = False
            spread = RELIST_FAST if self.ctx.rng.random() < 0.5 else RELIST_SPREAD
            for kind in RECORD_KINDS:
                self.break_watch(kind, self.ctx.rng.uniform(0.0, spread))
        for waiting in (self.listing, self.relist_at):
            for kind, at in sorted(waiting.items(), key=lambda x: x[1]):
                if now >= at:
                    self.cache.relist(self.ctx.api, kind)
                    del waiting[kind]
                    self.ctx.trace.add(f"  {self.identity}: {kind.value} listed")
        for ev in self.watcher.due(now):
            if ev.kind not in self.relist_at and ev.kind not in self.listing:  # else the LIST brings it
                self.cache.apply(ev)
        self._observe_leases()

    def _observe_leases(self) -> None:
        for name, c in self.cache.objects[Kind.CAPTURE].items():
            assert isinstance(c, Capture)
            self.silence.observe(name, c.renew_time, self.ctx.now)

    def world(self) -> World:
        objs = self.cache.objects
        cf = objs[Kind.CHANGEFEED][self.changefeed]
        assert isinstance(cf, Changefeed)
        now = self.ctx.now
        captures: dict[str, Capture] = {}
        for name, c in objs[Kind.CAPTURE].items():
            assert isinstance(c, Capture)
            silent = self.silence.of(name, now)
            renew = None if c.renew_time is None else now - (silent or 0.0)
            captures[name] = c.evolve(renew_time=renew, lease_duration=LEASE, lease_version=c.resource_version)
        index = self.cache.index
        assert index is not None
        # As production (controller.maintainer.runner.snapshot): the index's own maps, and the index.
        return World(
            now=self.ctx.now,
            changefeed=cf,
            tables=index.tables,
            spans=index.spans,
            dispatchers=index.dispatchers,
            operators=index.operators,
            captures=captures,
            index=index,
            stale=frozenset(self.relist_at),
        )

    def tick(self) -> None:
        """One decision, applied. May end with the process killed or, for a zombie, fenced."""
        ctx = self.ctx
        self.sync()
        if self.changefeed not in self.cache.objects[Kind.CHANGEFEED]:
            # As in production: the loop of a changefeed that is gone from the cache ends.
            ctx.trace.add(f"  {self.identity}: changefeed gone; its loop ends")
            self.stop()
            return
        if self.listing:
            return  # not every kind listed yet: nothing is decided (Informer.synced)
        world = self.world()
        decision = decide(world, self.memory, self.options)
        self._count_held(world, decision)
        self._check_agreement(world, decision)
        self._check_premises(world, decision)
        self._check_refusal_reported(world, decision)
        self._check_failures_reported(world, decision)
        self._check_troubles_reported(world, decision)
        self._check_paused(world, decision)
        self.memory = decision.memory
        who = f"{self.identity}{' (zombie)' if self.zombie else ''}"
        if decision.fenced:
            ctx.trace.add(f"  {who} fenced: a newer epoch is published; stops writing")
            self.stop()
            return
        kill: Callable[[], bool] = self._kill_check
        if decision.chains:
            ctx.trace.add(f"  {who} tick: {len(decision.chains)} chains")
        if self.zombie:  # it no longer holds the Lease: its successor may already have listed
            made = [w.obj for c in decision.chains for w in c.writes if isinstance(w, Create)]
            ctx.zombie_spans.update(o.name for o in made if isinstance(o, Span))
            ctx.zombie_made.update((o.kind, o.name) for o in made)
            ctx.zombie_deleted.update(
                w.name for c in decision.chains for w in c.writes if isinstance(w, Delete) and w.kind is Kind.SPAN
            )
            # A user's span the zombie accepts from its stale view may overlap spans its successor
            # created meanwhile (seed 1766): the successor's overlap repair resolves it.
            written = (w.obj for c in decision.chains for w in c.writes if isinstance(w, WriteStatus))
            ctx.zombie_spans.update(
                o.name
                for o in written
                if isinstance(o, Span) and o.state is not None and getattr(world.spans.get(o.name), "state", 0) is None
            )
            started = [w.obj for c in decision.chains for w in c.writes if isinstance(w, WriteStatus)]
            ctx.zombie_ops.update(o.name for o in started if isinstance(o, SpanOperator) and o.phase is OpPhase.RUNNING)
            ctx.zombie_written_ops.update(o.name for o in started if isinstance(o, SpanOperator))
            ctx.zombie_placed.update(o.name for o in started if isinstance(o, Span) and is_placement(o))
            ctx.zombie_span_writes.update(o.name for o in started if isinstance(o, Span))
            # A span created placed records its placement in the create, as a status write would have
            # (placement.create_placed; seed 29440: a zombie's created placements were counted in the bound).
            placed = [o.name for o in made if isinstance(o, Span) and is_placement(o)]
            ctx.zombie_placed.update(placed)
            ctx.zombie_span_writes.update(placed)
            ctx.bump("zombie created placed", len(placed))
        out = executor.apply(
            ctx.api, self.cache, decision, kill, self.events, ctx.trace.add, client=self.identity, guard=self._guard
        )
        ctx.bump("writes", out.writes)
        before = self.memory.refusal
        self.memory = observed(self.memory, out.created, tuple(out.refusals))  # as the runner does
        if out.refusals:
            ctx.bump("creates refused")
        if self.memory.refusal is not None and self.memory.refusal != before:
            self.unreported = self.memory.refusal
        if out.stale_views:
            ctx.bump("teardown stale view", out.stale_views)
        for read in out.stale_reads:
            ctx.bump(f"read stopped {read}")
        if out.killed:
            self.stop()
            ctx.trace.add(f"  {who} KILLED mid-decision")
            return
        self._check_recorded(decision)
        self._check_quiet(decision, out)

    def _count_held(self, world: World, decision: Decision) -> None:
        """Count the histories in which a rare mutant can do harm, which a long run lists (``--find``) for the
        mutation check's pinned seeds: a decision held for a view in doubt that would have created a dispatcher
        beside one the view lacks (``decide`` is pure: asked again with ``decides-on-stale-view``, the mutant), and a
        running Split or Merge of which the view shows no span."""
        for op in world.operators.values():
            # A running Split or Merge of which the view shows no span: where ``fills-a-hole-an-unseen-operator-plans``
            # can act (seed 867345).
            reshape = op.phase is OpPhase.RUNNING and op.type in (OpType.SPLIT, OpType.MERGE)
            if reshape and not any(n in world.spans for n in (*op.spans, *(t.span for t in op.targets))):
                self.ctx.bump("operator with no span in view")
                break
        if not world.stale or decision.chains or "decides-on-stale-view" in self.options.mutants:
            return
        options = replace(self.options, mutants=self.options.mutants | {"decides-on-stale-view"})
        would = decide(world, self.memory, options)
        truth = self.ctx.api.store[Kind.DISPATCHER]
        for c in would.chains:
            for w in c.writes:
                if not (isinstance(w, Create) and isinstance(w.obj, Dispatcher)):
                    continue
                d = w.obj
                beside = [
                    o
                    for o in truth.values()
                    if isinstance(o, Dispatcher)
                    and o.name != d.name
                    and o.name not in world.dispatchers
                    and (o.changefeed, o.table_id, o.mode) == (d.changefeed, d.table_id, d.mode)
                    and o.key_range.overlaps(d.key_range)
                ]
                if beside:  # the view in doubt lacks a dispatcher of these keys: the mutant would run them twice
                    self.ctx.bump("view in doubt held a second owner")
                    return

    def _check_premises(self, world: World, decision: Decision) -> None:
        """A rule that removes acts on a premise that holds in the API, not only in a view that lags: a span removed
        as an overlap no operator explains overlaps another span in the API at that moment. A view that still holds
        a deleted span (a Split's parent, its watch down) shows an overlap that is not there, and removing the
        newer span then undoes the Split (the mutant ``decides-on-stale-view``). A zombie's view is
        stale by nature (its successor resolves what it does)."""
        if self.zombie:
            return
        truth = self.ctx.api.store[Kind.SPAN]
        for chain in decision.chains:
            confirmed = [w for w in chain.writes if isinstance(w, I.ConfirmPresent) and w.kind is Kind.SPAN]
            if any(getattr(truth.get(w.name), "uid", None) != w.uid for w in confirmed):
                continue  # a consistent read of what it rests on stops the chain first
            for w in chain.writes:
                if not (isinstance(w, Create) and isinstance(w.obj, SpanOperator) and w.obj.reason == OVERLAP_REASON):
                    continue
                for name in w.obj.spans:
                    s, seen = truth.get(name), world.spans.get(name)
                    if not isinstance(s, Span) or seen is None or s.uid != seen.uid:
                        continue  # gone, or another incarnation, meanwhile
                    others = [
                        o.name
                        for o in truth.values()
                        if isinstance(o, Span)
                        and o.name != name
                        and (o.table_id, o.mode) == (s.table_id, s.mode)
                        and o.state not in (None, SpanState.INVALID)
                        and o.key_range.overlaps(s.key_range)
                    ]
                    if not others:
                        self.ctx.fail(
                            f"premise: {self.identity} removes span {name} as an overlap no operator explains, but "
                            f"nothing overlaps it in the API (its view of Spans is stale: {sorted(self.relist_at)})"
                        )

    def _check_recorded(self, decision: Decision) -> None:
        """Record before effect, on the ground truth: a dispatcher the leader's decision created is named by
        a record once the decision has landed, its span's (status, or the placement annotation of a span
        created placed) or an operator's target. Else the next process, reading only records, finds a
        running dispatcher nothing claims and closes it: a placement lost to a restart (the mutant
        ``placement-created-unrecorded`` was caught only by a fault of the gap check before this one).
        Exempt: a span gone or being deleted (a person deleted it while this view still had it), and a span
        a zombie wrote (its stale placement and the successor's race; the overlap repair resolves them)."""
        if self.zombie:
            return
        store = self.ctx.api.store
        targets = {
            t.dispatcher for o in store[Kind.OPERATOR].values() if isinstance(o, SpanOperator) for t in o.targets
        }
        for chain in decision.chains:
            for w in chain.writes:
                if not (isinstance(w, Create) and isinstance(w.obj, Dispatcher)):
                    continue
                d = store[Kind.DISPATCHER].get(w.obj.name)
                if not isinstance(d, Dispatcher) or d.uid == "" or d.name in targets:
                    continue
                span = store[Kind.SPAN].get(d.span)
                if not isinstance(span, Span) or span.deleting or span.name in self.ctx.zombie_span_writes:
                    continue
                if span.with_recorded_placement().dispatcher != d.name:
                    self.ctx.fail(
                        f"record before effect: {self.identity} created {d.name} ([{chain.why}]) but no record "
                        f"names it (span {span.name}: state {span.state}, dispatcher {span.dispatcher!r})"
                    )
                    return

    def _check_quiet(self, decision: Decision, out: executor.Outcome) -> None:
        """Production does not wake for the landing of chains that say ``wake=False`` (the runner sleeps until
        the next event or due time). When every chain of a decision says so and all of them landed, the same
        decision taken again at once on what they wrote must write nothing: else its landing called for a
        decision that production would leave for later."""
        if not decision.chains or any(c.wake for c in decision.chains) or out.failed_chains or out.stale_views:
            return
        again = decide(self.world(), self.memory, self.options)
        if again.chains and not again.fenced:
            self.ctx.fail(
                f"quiet: {self.identity}'s writes were declared to need no decision, but one taken on them "
                f"writes: {again.chains[0].describe()}"
            )
        self.ctx.bump("quiet checks")

    def _guard(self, w: I.Write) -> None:
        """The fencing rule, on the ground truth: a dispatcher's finalizer is released by a maintainer only
        once its capture's Lease no longer names the capture (else the capture could resume it).

        One case is not a breach: the Lease was taken, and a restarted process of the capture (a new
        incarnation, which takes its Lease over whoever holds it) took it back before the release landed.
        That process runs nothing of its predecessor's, so nothing can resume the dispatcher (seeds 1587, 1971:
        the maintainer decided from the snapshot showing its own take). What it could still do, start the
        dispatcher from a stale view of it, invariant 2 (single owner, on what captures really run) checks."""
        if not (isinstance(w, I.RemoveFinalizer) and w.kind is Kind.DISPATCHER):
            return
        d = self.ctx.api.get(Kind.DISPATCHER, w.name)
        if not isinstance(d, Dispatcher):
            return
        c = self.ctx.api.get(Kind.CAPTURE, d.capture)
        if isinstance(c, Capture) and not c.lease_taken and self.ctx.holds(d.capture, d.uid):
            self.ctx.fail(
                f"fencing: {self.identity} released the finalizer of {d.name} while {d.capture}'s Lease still "
                "names it (the capture could resume it)"
            )

    def _check_refusal_reported(self, world: World, decision: Decision) -> None:
        """A create the API refused shows in the next decision made on a current view: the Changefeed's
        WritesRefused condition True with the API's message (written by this decision, or already so), and an
        Event unless the condition already said exactly that."""
        if world.stale and not decision.chains:
            # Nothing is decided on a view in doubt (engine.maintainer.decide): the memory keeps the refusal and
            # the first decision on a current view reports it.
            return
        refusal, self.unreported = self.unreported, None
        cf = world.changefeed
        if (
            refusal is None
            or decision.fenced
            or cf.deleting
            or any(c.why.startswith("publish epoch") for c in decision.chains)
        ):
            return
        old, cond = _conditions(cf, decision, WRITES_REFUSED)
        if (
            cond is None
            or cond.status != "True"
            or refusal.write not in cond.message
            or refusal.message not in cond.message
        ):
            self.ctx.fail(
                f"refusal: {self.identity}'s next decision does not report that the API refused {refusal.write}"
            )
            return
        if not _told(decision, REFUSED_EVENT, old, cond):
            self.ctx.fail(f"refusal: no Event says that the API refused {refusal.write}")
        self.ctx.bump("refusals reported")

    def _check_failures_reported(self, world: World, decision: Decision) -> None:
        """A dispatcher its runtime stopped for good (``Dispatcher.failure``, in the view) shows in the decision: the
        Changefeed's ReplicationFailed condition True (written by it, or already so) naming how many, and an Event
        when that changed; with none left, the condition (if any) False."""
        cf = world.changefeed
        if decision.fenced or cf.deleting or any(c.why.startswith("publish epoch") for c in decision.chains):
            return
        if world.stale and not decision.chains:
            return  # nothing is decided on a view in doubt
        failed = sorted(n for n, d in world.dispatchers.items() if d.failure is not None and not d.deleting)
        old, cond = _conditions(cf, decision, REPLICATION_FAILED)
        if failed:
            if cond is None or cond.status != "True" or not cond.message.startswith(f"{len(failed)} dispatcher(s)"):
                self.ctx.fail(
                    f"failures: {self.identity}'s decision does not report {len(failed)} dispatcher(s) stopped "
                    f"for good ({failed[0]}): {cond}"
                )
                return
            if not _told(decision, FAILED_EVENT, old, cond):
                self.ctx.fail(f"failures: no Event says that {failed[0]} stopped for good")
            self.ctx.bump("failures reported")
        elif cond is not None and cond.status == "True":
            self.ctx.fail(f"failures: {self.identity} reports dispatchers stopped though none is: {cond.message}")

    def _check_troubles_reported(self, world: World, decision: Decision) -> None:
        """A live capture whose report names a trouble of the changefeed on a side (its source or its sink) shows in
        the decision: the Changefeed's SourceUnavailable or SinkUnavailable condition True naming how many such
        captures, with the reason ConfigurationError when one of them needs a person (else Retrying), and an Event
        when it turned True or its reason changed; with none left, the condition (if any) False. Computed here from
        the reports themselves, not with the engine's ``troubles``: the oracle stays independent of the rule it
        checks."""
        cf = world.changefeed
        if decision.fenced or cf.deleting or any(c.why.startswith("publish epoch") for c in decision.chains):
            return
        if world.stale and not decision.chains:
            return  # nothing is decided on a view in doubt
        for side, (kind, event) in UNAVAILABLE.items():
            reported = [
                t
                for _, cap in sorted(world.captures.items())
                if cap.alive(world.now) and cap.progress is not None
                for t in cap.progress.troubles
                if t.changefeed == cf.name and t.side == side
            ]
            old, cond = _conditions(cf, decision, kind)
            if reported:
                reason = CONFIGURATION_ERROR if any(not t.transient for t in reported) else RETRYING
                if (
                    cond is None
                    or (cond.status, cond.reason) != ("True", reason)
                    or not cond.message.startswith(f"{len(reported)} capture(s)")
                ):
                    self.ctx.fail(f"{side}: {self.identity}'s decision misses {len(reported)} trouble(s): {cond}")
                    return
                told = any(isinstance(w, I.Event) and w.reason == event for c in decision.chains for w in c.writes)
                if not told and (old is None or (old.status, old.reason) != ("True", reason)):
                    self.ctx.fail(f"{side}: no Event says that {len(reported)} capture(s) cannot use it ({reason})")
                self.ctx.bump(f"{side} troubles reported")
            elif cond is not None and cond.status == "True":
                self.ctx.fail(f"{side}: {self.identity} reports it unavailable though no live capture says so")

    def _check_paused(self, world: World, decision: Decision) -> None:
        """A changefeed whose replication is paused (``spec.paused``), or whose schedulers alone are
        (``spec.scheduler.paused``), is not scheduled: no decision starts a scheduler's operator nor places a span
        (operators in flight, a user's and the safety net's go on). And replication paused is said on it: its
        Paused condition True while spec.paused, False after (once it was)."""
        cf = world.changefeed
        if decision.fenced or cf.deleting or any(c.why.startswith("publish epoch") for c in decision.chains):
            return
        if cf.paused or cf.scheduler.paused:
            for c in decision.chains:
                for w in c.writes:
                    obj = w.obj if isinstance(w, Create | WriteStatus) else None
                    scheduler = isinstance(obj, SpanOperator) and obj.source is OpSource.SCHEDULER
                    before = world.spans.get(obj.name) if isinstance(obj, Span) else None
                    placed = isinstance(obj, Span) and is_placement(obj) and not is_placement(before)
                    started = scheduler and isinstance(w, Create)
                    if started or placed:
                        self.ctx.fail(f"pause: {self.identity} schedules a paused changefeed: {w.describe()} ({c.why})")
                        return
        if world.stale and not decision.chains:
            return
        _, cond = _conditions(cf, decision, PAUSED)
        if cf.paused and (cond is None or cond.status != "True"):
            self.ctx.fail(f"pause: {self.identity}'s decision does not say replication is paused: {cond}")
        elif not cf.paused and cond is not None and cond.status == "True":
            self.ctx.fail(f"pause: {self.identity} says replication is paused though spec.paused is false")
        elif cf.paused:
            self.ctx.bump("pause reported")

    def _check_agreement(self, world: World, decision: Decision) -> None:
        """The incremental decision (over the index's candidates) must be the full one (every rule over
        every record), and the index must be what a rebuild from its records gives."""
        ctx = self.ctx
        self.decisions += 1
        agree, verify = CHECKS.agree_every, CHECKS.verify_every
        if not decision.full and agree and self.decisions % agree == 0:
            full = decide(replace(world, index=None), self.memory, self.options)
            mine = (decision.chains, decision.repairs, decision.fenced, decision.next_due)
            theirs = (full.chains, full.repairs, full.fenced, full.next_due)
            if mine != theirs or replace(decision.memory, audited_at=0.0) != replace(full.memory, audited_at=0.0):
                ctx.fail(
                    f"agreement: the incremental decision differs from the full one: {_difference(decision, full)}"
                )
            ctx.bump("agreement checks")
        if verify and self.decisions % verify == 0:
            assert world.index is not None
            problems = index_check.verify(world.index)
            if problems:
                ctx.fail("index: " + "; ".join(problems[:3]))
            ctx.bump("index verifications")

    def _kill_check(self) -> bool:
        if self.kill_after is None:
            return False
        if self.kill_after <= 0:
            return True
        self.kill_after -= 1
        return False


def _difference(a: Decision, b: Decision) -> str:
    """The first difference between two decisions, for a person."""
    for i, (x, y) in enumerate(zip(a.chains, b.chains, strict=False)):
        if x != y:
            return f"chain {i}: incremental [{x.describe()}] vs full [{y.describe()}]"
    if len(a.chains) != len(b.chains):
        extra = a.chains[len(b.chains) :] or b.chains[len(a.chains) :]
        who = "incremental" if len(a.chains) > len(b.chains) else "full"
        return f"{who} has {len(extra)} more chain(s), first: [{extra[0].describe()}]"
    if a.repairs != b.repairs:
        return f"repairs {a.repairs} vs {b.repairs}"
    if a.next_due != b.next_due:
        return f"next due {a.next_due} vs {b.next_due}"
    return f"memory {a.memory} vs {b.memory}"


def _conditions(cf: Changefeed, decision: Decision, kind: str) -> tuple[Condition | None, Condition | None]:
    """The changefeed's condition ``kind`` in the view, and as the decision leaves it (its last status write of
    the Changefeed, else the view's)."""
    written = [
        w.obj
        for c in decision.chains
        for w in c.writes
        if isinstance(w, WriteStatus) and isinstance(w.obj, Changefeed) and w.obj.name == cf.name
    ]
    old = cf.condition(kind)
    return old, (written[-1].condition(kind) if written else old)


def _told(decision: Decision, reason: str, old: Condition | None, cond: Condition) -> bool:
    """The decision writes an Event of ``reason``, or needs none: the condition already said exactly this."""
    told = any(isinstance(w, I.Event) and w.reason == reason for c in decision.chains for w in c.writes)
    return told or (old is not None and (old.status, old.message) == (cond.status, cond.message))
