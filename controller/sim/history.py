"""One simulated history: the step loop, the maintainer's lifecycle, and the checks after every step.

Why the checks live next to the loop: they are only meaningful at step boundaries of this loop
(after watch delivery, captures and maintainers have all acted), and several of them need ground
truth only the simulator has: which dispatchers really run, what was really delivered per key.

A history: setup (changefeed, tables, three captures, a maintainer), ``steps`` random steps of
``DT`` seconds, then the quiet phase (faults stop, hooks released, a capture alive, one maintainer; an
API outage under way runs to its end) until the world is settled or ``QUIET_STEPS`` pass; then
``invariants.settled`` must hold.

Besides the safety checks, one availability check: a capture whose only silence came from API outages
(no crash, no cut of its own, no failing renewals) must never have its Lease taken. That is what "an
outage of the API costs no restart" means here: the maintainer does not count time it could not see
as the captures' silence, and the captures resume what they paused.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field, replace

from controller.engine import invariants, teardown
from controller.engine.maintainer import Decision, Memory
from controller.engine.teardown import DETACHED
from controller.engine.world import Options, World
from controller.model.keys import KeyRange
from controller.model.records import Capture, Changefeed, Dispatcher, Record, Span, SpanCounts, SpanOperator, Table
from controller.model.states import TABLE_FINALIZER, Kind, OpPhase, OpSource, OpType, SpanState, Stage
from controller.sim import executor
from controller.sim.api import Api
from controller.sim.captures import LEASE, Captures
from controller.sim.context import Ctx, Frontier, Trace, Violation
from controller.sim.executor import Cache
from controller.sim.maintainer import RELIST_SPREAD, SimMaintainer
from controller.sim.workload import CF, Workload

DT = 0.5
# A cap: a settled history stops early. Redo with maxInFlightOperators=2 needs >240 (seeds 28426, 35063); seed 854535
# (traffic checks every 4 s, the traffic scheduler's 27 Splits then 21 Merges one check apart, each table's after
# the last one's ended) settles after 652 quiet steps, past the old cap of 600.
QUIET_STEPS = 1200
DEFAULT_STEPS = 60
MAINTAINER_RENEW_DEADLINE = 10.0
MAINTAINER_LEASE = 15.0
#: Share of histories whose Changefeed is deleted as the quiet phase begins (besides the workload's
#: "changefeed delete" events): the teardown must then finish on its own.
QUIET_DELETE = 0.05
#: Why an operator may give a target up (Target.lost_reason): its capture lost (an Add's CaptureLost,
#: the others' DestinationLost), no live capture to choose, keys another span runs, span deleted by hand.
LOST_REASONS = frozenset({"CaptureLost", "DestinationLost", "NoCapture", "KeysBusy", "SpanDeleted"})


@dataclass
class Result:
    seed: int
    ok: bool
    steps: int
    violation: str = ""
    trace: str = ""
    digest: int = 0
    counts: dict[str, int] = field(default_factory=dict)


class Sim:
    def __init__(self, seed: int, options: Options, verbose: bool = False) -> None:
        rng = random.Random(seed)
        holder: list[Ctx] = []
        api = Api(rng, lambda: holder[0].now)
        self.ctx = Ctx(seed=seed, rng=rng, api=api, trace=Trace(verbose=verbose))
        holder.append(self.ctx)
        self.options = options
        self.captures = Captures(self.ctx, CF, options.mutants)
        self.maintainers: list[SimMaintainer] = []
        self.current: SimMaintainer | None = None
        self.epochs = 0
        self.restart_at: float | None = None
        self.kill_at: tuple[float, int] | None = None
        #: A maintainer cut off alone for longer than its Lease: (it, when it stops at its renew deadline,
        #: when another replica takes the Lease over).
        self.partitioned: tuple[SimMaintainer, float, float] | None = None
        #: The maintainer handing the changefeed over after its next decision (scale-out's balance).
        self.handing_over: SimMaintainer | None = None
        self.workload = Workload(self)
        self.prev_checkpoint = 0
        self.step_no = 0
        #: What of the Changefeed the API held at the instant it vanished (kind, name).
        self.left_at_release: list[tuple[Kind, str]] = []
        api.observers.append(self._observe)

    # -- maintainer lifecycle ----------------------------------------------------------------------

    def start_maintainer(self) -> None:
        cf = self.ctx.api.get(Kind.CHANGEFEED, CF)
        if not isinstance(cf, Changefeed):
            self.restart_at = None  # the changefeed is gone: nothing to maintain
            return
        if self.ctx.api.outage():
            self.restart_at = self.ctx.now + DT  # it cannot list, nor win the Lease, before the API returns
            return
        self.epochs = max(self.epochs, cf.epoch) + 1
        m = SimMaintainer(self.ctx, CF, self.epochs, self.options)
        self.maintainers.append(m)
        self.current = m
        self.restart_at = None

    def schedule_kill(self, after_writes: int, delay: float = 0.0) -> None:
        if self.ctx.quiet:
            return
        self.kill_at = (self.ctx.now + delay, after_writes)

    def failover(self) -> None:
        """A new maintainer takes over while the old one keeps acting on its stale cache."""
        if self.current is None or not self.current.alive or self.ctx.quiet or self.ctx.api.outage():
            return
        self.current.zombie = True
        # Its Lease is lost: it stops writing at its renew deadline at the latest (client-go's 10 s),
        # earlier if decide reports it fenced. Until then it acts on its stale cache.
        self.current.zombie_until = self.ctx.now + self.ctx.rng.uniform(1.0, MAINTAINER_RENEW_DEADLINE)
        self.ctx.bump("zombie failover")
        self.ctx.trace.add(f"  failover: {self.current.identity} keeps running as a zombie")
        self.start_maintainer()
        if self.current is not None and self.ctx.rng.random() < 0.7:
            # The successor started across a control plane restart: its record kinds relist one by one, while the
            # zombie, its view current, finishes what it had in flight (as a real cluster undid a finished Split).
            # Dispatchers listed last: its Span view shows the zombie's placements before it sees their dispatchers.
            self.current.break_watch(Kind.DISPATCHER, self.ctx.rng.uniform(1.0, RELIST_SPREAD))
            for kind in (Kind.SPAN, Kind.OPERATOR):
                if self.ctx.rng.random() < 0.5:
                    self.current.break_watch(kind, self.ctx.rng.uniform(0.5, RELIST_SPREAD))

    def hand_over(self) -> None:
        """Scale-out's graceful handoff (runner ``_balance``): the current maintainer finishes the decision in
        hand, stops writing and releases its Lease; another replica, whose caches are listed, takes it at once
        at a new epoch and bootstraps as after any failover."""
        m = self.current
        if m is None or not m.alive or m.zombie or self.ctx.quiet or self.ctx.api.outage():
            return
        if not self.ctx.api.reachable(m.identity):
            return  # cut off: it cannot release; that is the partition path
        self.handing_over = m

    def partition_maintainer(self, seconds: float) -> None:
        """The current maintainer alone is cut off from the API for ``seconds``. Past its renew deadline it
        stops leading; past the Lease duration another replica takes over (a new epoch). Shorter, it goes on
        with its epoch when it gets through again."""
        m = self.current
        if m is None or not m.alive or self.ctx.quiet:
            return
        self.ctx.api.cut_until[m.identity] = self.ctx.now + seconds
        self.ctx.bump("maintainer cut off")
        self.ctx.trace.add(f"  {m.identity} cut off from the API for {seconds:.1f}s")
        if seconds > MAINTAINER_LEASE:
            now = self.ctx.now
            self.partitioned = (m, now + MAINTAINER_RENEW_DEADLINE, now + MAINTAINER_LEASE)

    def _maintainers_step(self) -> None:
        ctx = self.ctx
        if self.partitioned is not None and ctx.now >= self.partitioned[1]:
            m, _, takeover = self.partitioned
            self.partitioned = None
            if m.alive:
                m.stop()  # still cut off, it never writes again
                ctx.trace.add(f"  {m.identity} reached its renew deadline cut off: stops; another replica takes over")
                if m is self.current:
                    self.current = None
                    self.restart_at = takeover
        if self.kill_at is not None and ctx.now >= self.kill_at[0] and self.current is not None:
            if self.current.kill_after is None:
                self.current.kill_after = self.kill_at[1]
            self.kill_at = None
        for m in list(self.maintainers):
            if m.zombie and m.alive and ctx.now >= m.zombie_until:
                m.stop()
                ctx.trace.add(f"  {m.identity} (zombie) reached its Lease renew deadline; stops writing")
            if m.alive:
                m.tick()
            if m is self.current and m.alive and m.kill_after is not None and m.kill_after <= 0:
                m.stop()  # the kill landed between two decisions
                ctx.trace.add(f"  {m.identity} KILLED between decisions")
            if m is self.handing_over:
                self.handing_over = None
                if m.alive and m is self.current and ctx.api.reachable(m.identity):
                    m.stop()  # between decisions: its last one's writes are all applied
                    ctx.bump("maintainer handoff")
                    ctx.trace.add(f"  {m.identity} hands the changefeed over (Lease released)")
                    self.current = None
                    self.start_maintainer()  # a standby replica takes the released Lease at once
        self.maintainers = [m for m in self.maintainers if m.alive]
        if self.current is not None and not self.current.alive:
            ctx.bump("maintainer kill")
            self.current = None
            self.restart_at = ctx.now + ctx.rng.uniform(0.5, 6.0)
        if self.current is None and self.restart_at is not None and ctx.now >= self.restart_at:
            self.start_maintainer()

    # -- the loop ----------------------------------------------------------------------------------

    def step(self) -> None:
        ctx = self.ctx
        self.step_no += 1
        ctx.now += DT
        ctx.trace.begin(f"step {self.step_no} t={ctx.now:.1f} upstream={ctx.upstream()}")
        if not ctx.quiet:
            self.workload.event()
        self.collect_garbage()
        self.janitor()
        self.captures.step()
        self._maintainers_step()
        self.check()

    def quiesce(self) -> None:
        ctx = self.ctx
        ctx.quiet = True
        ctx.trace.add("  -- quiet phase: faults stop, hooks released --")
        api = ctx.api
        api.faults.p500 = api.faults.p409 = 0.0
        api.faults.watch_delay = 0.5
        api.cut_until.clear()  # partitions heal; an outage of the whole API runs to its end
        api.refusing.clear()
        self.kill_at = None
        for cap in self.captures.all.values():  # also those between two processes (a roll): hooks are on the object
            cap.hooks.clear()
            cap.renew_ok = True
        if ctx.rng.random() < QUIET_DELETE:
            self.workload.delete_changefeed()
        cf = api.get(Kind.CHANGEFEED, CF)
        # A paused changefeed places nothing: resume it (a deleted one's teardown runs paused or not).
        if isinstance(cf, Changefeed) and cf.schedulers_stopped and not cf.deleting:
            api.update_spec(replace(cf, paused=False, scheduler=replace(cf.scheduler, paused=False)))
            ctx.trace.add("  changefeed resumed for the quiet phase")
        schedulable = [
            n
            for n in self.captures.alive_names()
            if not getattr(api.get(Kind.CAPTURE, n), "draining", False)
            and ctx.now - self.captures.all[n].last_renew < 2.0
        ]
        if not schedulable:
            self.captures.join()
        if self.current is not None:
            self.current.kill_after = None
        elif self.restart_at is None:
            self.restart_at = ctx.now

    def run(self, steps: int) -> Result:
        ctx = self.ctx
        try:
            self.workload.initial()
            self.start_maintainer()
            for _ in range(steps):
                self.step()
            self.quiesce()
            quiet_ok = 0
            for i in range(QUIET_STEPS):
                self.step()
                if i % 4 == 3:  # settled() is costly: look every 2 s of simulated time
                    quiet_ok = quiet_ok + 1 if not self.settled() else 0
                    if quiet_ok >= 2:
                        break
            problems = self.settled()
            if problems:
                raise Violation("not settled at the end (3, 4): " + "; ".join(problems[:6]))
        except Violation as v:
            return Result(
                ctx.seed, False, self.step_no, str(v), ctx.trace.render(), ctx.trace.digest, dict(self.counts())
            )
        except Exception as exc:  # an engine or simulator crash is a failed history too, with its seed
            tb = traceback.format_exc(limit=8)
            ctx.trace.add(tb)
            return Result(
                ctx.seed,
                False,
                self.step_no,
                f"exception: {type(exc).__name__}: {exc}",
                ctx.trace.render(),
                ctx.trace.digest,
                dict(self.counts()),
            )
        return Result(ctx.seed, True, self.step_no, digest=ctx.trace.digest, counts=self.counts())

    def counts(self) -> dict[str, int]:
        out = dict(self.ctx.counts)
        for k, v in self.ctx.api.faults.counts.items():
            out[f"inject {k}"] = v
        out["steps"] = self.step_no
        return out

    # -- checks ------------------------------------------------------------------------------------

    def settled(self) -> list[str]:
        if self.ctx.cf_deleted_at is not None:
            return self.torn_down()
        return invariants.settled(self.api_world())

    def torn_down(self) -> list[str]:
        """The end of a history whose Changefeed was deleted: its teardown finished, nothing of it left.

        Tolerated: a dispatcher the teardown never saw (a zombie's late create, or any dispatcher of a
        changefeed deleted before it carried the finalizer) still held by its finalizer on a capture that
        is gone. Nothing can close it: no capture runs it, and no maintainer runs for a changefeed that
        no longer exists (docs/architecture.md, Deleting a changefeed). Everything else is removed by the
        garbage collector."""
        st = self.ctx.api.store
        if CF in st[Kind.CHANGEFEED]:
            cf = st[Kind.CHANGEFEED][CF]
            return [f"teardown: the deleted changefeed is still there ({getattr(cf, 'conditions', ())})"]
        alive = set(self.captures.alive_names())
        problems = [f"teardown: {k.value} {n} remains" for k in (Kind.SPAN, Kind.OPERATOR) for n in sorted(st[k])]
        for n, d in sorted(st[Kind.DISPATCHER].items()):
            assert isinstance(d, Dispatcher)
            unclosable = d.capture not in alive and d.deleting
            if not (unclosable and (not self.ctx.cf_teardown or (Kind.DISPATCHER, n) in self.ctx.zombie_made)):
                problems.append(f"teardown: dispatcher {n} on {d.capture} remains")
        problems += [
            f"teardown: table {n} keeps its finalizer"
            for n, t in sorted(st[Kind.TABLE].items())
            if isinstance(t, Table) and t.changefeed == CF and TABLE_FINALIZER in t.finalizers
        ]
        problems += [
            f"teardown: detached table {n} still counts spans ({t.span_counts})"
            for n, t in sorted(st[Kind.TABLE].items())
            if isinstance(t, Table) and t.changefeed == CF and t.state == DETACHED and t.span_counts != SpanCounts()
        ]
        return problems

    def janitor(self) -> None:
        """The maintainer process's rule over Tables whose changefeed is gone (``teardown.detach_orphans``),
        from a fresh listing (the process's informer), with the API's faults."""
        api = self.ctx.api
        if CF in api.store[Kind.CHANGEFEED] or api.outage():
            return
        cache = Cache.listed(api)
        tables = [t for t in cache.objects[Kind.TABLE].values() if isinstance(t, Table)]
        chains = teardown.detach_orphans(tables, set(cache.objects[Kind.CHANGEFEED]), self.options)
        if chains:
            decision = Decision(tuple(chains), Memory(epoch=0, identity="janitor"))
            executor.apply(api, cache, decision, lambda: False, None, self.ctx.trace.add)

    def collect_garbage(self) -> None:
        """Kubernetes' garbage collector: once the Changefeed is gone, what it owned (ownerReferences set
        by the executor) is deleted. Only a zombie's late creates are left for it after a teardown."""
        api = self.ctx.api
        if CF in api.store[Kind.CHANGEFEED] or api.outage():
            return
        for kind in (Kind.SPAN, Kind.OPERATOR, Kind.DISPATCHER):
            for name, obj in sorted(api.store[kind].items()):
                if getattr(obj, "changefeed", None) == CF and not obj.deleting:
                    api.delete(kind, name, faulty=False)
                    self.ctx.bump("garbage collected")
                    self.ctx.trace.add(f"  garbage collector: deleted {kind.value} {name}")

    def api_world(self) -> World:
        st = self.ctx.api.store
        cf = st[Kind.CHANGEFEED][CF]
        assert isinstance(cf, Changefeed)
        captures = {}
        for n, c in st[Kind.CAPTURE].items():
            assert isinstance(c, Capture)
            captures[n] = c.evolve(lease_duration=LEASE, lease_version=c.resource_version)
        return World(
            now=self.ctx.now,
            changefeed=cf,
            tables=dict(st[Kind.TABLE]),  # type: ignore[arg-type]
            spans=dict(st[Kind.SPAN]),  # type: ignore[arg-type]
            dispatchers=dict(st[Kind.DISPATCHER]),  # type: ignore[arg-type]
            operators=dict(st[Kind.OPERATOR]),  # type: ignore[arg-type]
            captures=captures,
        )

    def check(self) -> None:
        ctx = self.ctx
        if CF not in ctx.api.store[Kind.CHANGEFEED]:
            self._check_gone()
            return
        world = self.api_world()
        problems = invariants.unexplained_overlaps(world, ignore=self._zombie_tainted(world))
        problems += invariants.single_owner(self.captures.running())
        problems += invariants.bounded(world, ignore=ctx.zombie_ops, ignore_spans=ctx.zombie_placed)
        if problems:
            ctx.fail("; ".join(problems[:4]))
        cp = world.changefeed.checkpoint_ts
        if cp < self.prev_checkpoint:
            ctx.fail(f"no gap (5): changefeed checkpoint went back from {self.prev_checkpoint} to {cp}")
        self.prev_checkpoint = cp
        live = _live_table_ids(world)
        for (tid, mode), uid in sorted(ctx.frontier_table.items()):
            if tid in live and live[tid] != uid:
                # The table ID now belongs to another Table object (the first one was deleted and a
                # queued duplicate took over): a new incarnation, replicated from its own start.
                del ctx.frontier[(tid, mode)], ctx.frontier_table[(tid, mode)]
        for (tid, mode), fr in sorted(ctx.frontier.items()):
            if tid in live and mode in world.changefeed.modes and cp > fr.low():
                ctx.fail(
                    f"no gap (5): changefeed checkpoint {cp} passes table {tid} ({mode}), "
                    f"delivered only up to {fr.low()} on some keys"
                )

    def _check_gone(self) -> None:
        """After its teardown, nothing of the changefeed runs; when it vanished, nothing it had was left but
        what a zombie created after the teardown's last look."""
        ctx = self.ctx
        if not ctx.cf_teardown:
            return  # deleted before it carried the finalizer: gone at once, the garbage collector cleans up
        running = [d.name for d in self.captures.running() if d.changefeed == CF]
        if running:
            ctx.fail(f"teardown: changefeed gone but captures still run {sorted(running)[:4]}")
        if ctx.cf_gone_at is not None:
            return
        ctx.cf_gone_at = ctx.now
        # Judged as the API held it when the Changefeed vanished, not at the end of the step: a maintainer
        # whose view still shows the Changefeed may create an object of it after that, in the same step
        # (seed 86327: a zombie released the Changefeed, then the new leader, its view lagging, created a
        # Remove of the teardown). Nothing fences a create; it carries an ownerReference to the vanished
        # Changefeed and the garbage collector deletes it (``collect_garbage``).
        left = [f"{k.value} {n}" for k, n in self.left_at_release if (k, n) not in ctx.zombie_made]
        if left:
            ctx.fail(f"teardown: changefeed released while {left[:4]} remained")
        ctx.trace.add("  changefeed gone: teardown finished")

    def _zombie_tainted(self, world: World) -> set[str]:
        """Spans a zombie created, and spans made from them by operators (a split child of a zombie's
        span inherits its overlap): the engine must never run both sides (single owner is checked) and
        must repair the overlap by the end (coverage is checked), but it may exist meanwhile."""
        tainted = set(self.ctx.zombie_spans)
        grew = True
        while grew:
            grew = False
            for op in world.operators.values():
                if tainted.intersection(op.spans):
                    new = {t.span for t in op.targets} - tainted
                    if new:
                        tainted |= new
                        grew = True
        return tainted

    def _observe(self, old: Record | None, new: Record | None) -> None:
        if isinstance(old, Changefeed) and old.name == CF and new is None:
            st = self.ctx.api.store
            self.left_at_release = [
                (k, n)
                for k in (Kind.SPAN, Kind.DISPATCHER, Kind.OPERATOR)
                for n, o in sorted(st[k].items())
                if getattr(o, "changefeed", None) == CF
            ]
        if isinstance(new, Capture) and new.lease_taken and isinstance(old, Capture) and not old.lease_taken:
            cap = self.captures.all.get(new.name)
            if cap is not None and cap.alive and not cap.own_fault:
                self.ctx.fail(
                    f"availability: the Lease of {new.name} was taken though only API outages silenced it "
                    "(an outage must cost no capture its dispatchers)"
                )
            self.ctx.bump("capture lease taken")
        if isinstance(new, Span) and new.state not in (None, SpanState.INVALID):
            self._init_frontier(new)
        was_done = isinstance(old, SpanOperator) and old.phase is OpPhase.SUCCEEDED
        if isinstance(new, SpanOperator) and new.phase is OpPhase.SUCCEEDED and not was_done:
            self._check_intent(new)
        if isinstance(new, SpanOperator):
            self._check_given_up(old, new)
        was_over = isinstance(old, SpanOperator) and old.phase.terminal
        if isinstance(new, SpanOperator) and new.phase.terminal and not was_over:
            self._check_outcome(new)
        if old is None and isinstance(new, SpanOperator) and new.source is OpSource.SCHEDULER:
            # What the automatic schedulers did (the basic scheduler's Adds are counted as "writes").
            if new.type is OpType.MOVE:
                self.ctx.bump("scheduler drain move" if "draining" in new.reason else "scheduler balance move")
            elif new.type is not OpType.ADD:
                self.ctx.bump(f"scheduler {new.type.value.lower()}")

    def _init_frontier(self, span: Span) -> None:
        """A table's frontier starts when the maintainer first accepts one of its spans.

        It starts at max(table startTs, the published changefeed checkpoint, the changefeed startTs):
        by design a table is replicated from no lower than the checkpoint at the time the maintainer
        takes it on ("never below the changefeed's checkpoint"); a table it has not seen yet does not
        hold the checkpoint back, so its data before that point is out of scope, not a gap.
        """
        key = (span.table_id, span.mode)
        if key in self.ctx.frontier:
            return
        st = self.ctx.api.store
        cf = st[Kind.CHANGEFEED].get(CF)
        if not isinstance(cf, Changefeed):
            return  # a zombie's status write after the teardown: nothing to replicate any more
        # The workload's record, not the store: the table may already be deleted (a maintainer with
        # a stale cache still places its spans), and its startTs still bounds what is in scope.
        start = self.ctx.table_start.get(span.table_id, 0)
        tables = self.ctx.api.store[Kind.TABLE].values()
        owners = sorted(
            (t for t in tables if isinstance(t, Table) and t.table_id == span.table_id),
            key=lambda t: (t.created, t.name),
        )
        self.ctx.frontier_table[key] = owners[0].uid if owners else ""
        fr = Frontier.of(KeyRange.of_table(span.table_id), max(start, cf.checkpoint_ts, cf.start_ts))
        self.ctx.frontier[key] = fr
        self.captures.bind_frontier(span.table_id, span.mode, fr)

    def _check_given_up(self, old: Record | None, op: SpanOperator) -> None:
        """A target recorded as given up because its span was deleted by hand: no span of that name exists as the
        record lands. A view that had not yet seen the span (another maintainer created it) is not proof of its
        deletion (seed 867345; the mutant ``gives-up-a-span-unseen``)."""
        before = {t.span for t in old.targets if t.lost} if isinstance(old, SpanOperator) else set()
        spans = self.ctx.api.store[Kind.SPAN]
        for t in op.targets:
            if t.lost and t.lost_reason == "SpanDeleted" and t.span not in before and t.span in spans:
                self.ctx.fail(f"outcome: {op.type} {op.name} recorded {t.span} as deleted by hand, but it exists")

    def _check_outcome(self, op: SpanOperator) -> None:
        """The phase and reason an operator ended with are the right ones for what it did.

        A Split or Merge that got past validation has done what was asked once its new spans exist
        and the old ones are gone, so it must succeed whatever became of the new spans' placement:
        it may fail only if a person deleted its spans (or a table deletion or a conflict cancels it,
        which is not Failed). "PartiallyPlaced" exactly when some new span was given up, and then the
        message names each one; every span given up records why; no message is "(none)"-vague.
        """
        ctx = self.ctx
        lost = [t for t in op.targets if t.lost]
        for t in lost:
            if t.lost_reason not in LOST_REASONS or not t.lost_message or "(none)" in t.lost_message:
                ctx.fail(f"outcome: {op.type} {op.name} gave {t.span} up with {t.lost_reason!r}: {t.lost_message!r}")
        if "(none)" in op.message:
            ctx.fail(f"outcome: {op.type} {op.name} {op.phase}: {op.message!r} names no capture")
        reshape = op.type in (OpType.SPLIT, OpType.MERGE)
        touched = ctx.user_deleted & {*op.spans, *(t.span for t in op.targets)}
        # An operator the successor admitted on a span a zombie had just deleted for another operator (seed
        # 117032: the zombie's CreateSpans of one Split replaced the span; the successor, its Span watch behind,
        # admitted a second Split of it, which then fails SpanNotFound: the right outcome for it). Two maintainers
        # acting at once do not excuse a Split or Merge Failed as SpanDeleted: the one that finishes it may see
        # its record before its Span watch shows the new spans, but it reads them before it takes them for deleted
        # by hand (``ConfirmGone``).
        exempt = (
            touched
            or op.name in ctx.zombie_ops
            or op.name in ctx.zombie_written_ops
            or bool(ctx.zombie_deleted & set(op.spans))
        )
        if (
            reshape
            and op.phase is OpPhase.FAILED
            and op.stage is not Stage.NONE
            and not (touched or bool(ctx.zombie_deleted & set(op.spans)))
        ):
            ctx.fail(
                f"outcome: {op.type} {op.name} Failed in {op.stage} ({op.status_reason}: {op.message}) though "
                "nobody deleted its spans: once its new spans exist it must succeed (PartiallyPlaced)"
            )
        if op.phase is not OpPhase.SUCCEEDED or op.status_reason == "AlreadyOnTarget":
            return
        if (op.status_reason == "PartiallyPlaced") != bool(lost):
            ctx.fail(
                f"outcome: {op.type} {op.name} Succeeded ({op.status_reason or 'no reason'}) with "
                f"{len(lost)} of {len(op.targets)} targets given up"
            )
        missing = [t.span for t in lost if t.span not in op.message]
        if missing:
            ctx.fail(f"outcome: {op.type} {op.name} PartiallyPlaced: {op.message!r} does not name {missing}")
        for t in lost:
            span = ctx.api.store[Kind.SPAN].get(t.span)
            if t.lost_reason != "SpanDeleted" and not exempt and getattr(span, "state", None) is not SpanState.ABSENT:
                ctx.fail(
                    f"outcome: {op.type} {op.name} Succeeded saying {t.span} was left Absent ({t.lost_reason}), "
                    f"but it is {getattr(span, 'state', 'gone')}"
                )
        if reshape:
            self.ctx.bump(f"{op.type.value.lower()} PartiallyPlaced" if lost else f"{op.type.value.lower()} placed")
            for reason in sorted({t.lost_reason for t in lost}):
                self.ctx.bump(f"{op.type.value.lower()} new span given up {reason}")

    def _check_intent(self, op: SpanOperator) -> None:
        ctx = self.ctx
        st = ctx.api.store
        if ctx.user_deleted & {*op.spans, *(t.span for t in op.targets)}:
            return  # a person deleted one of its spans: the operator did what was left to do
        if op.type in (OpType.MOVE, OpType.ADD) and op.target:
            span = st[Kind.SPAN].get(op.spans[0])
            if not isinstance(span, Span):
                raise Violation(f"intent: {op.type} {op.name} Succeeded but span {op.spans[0]} is gone")
            on = span.capture
            d = st[Kind.DISPATCHER].get(span.dispatcher)
            if isinstance(d, Dispatcher):
                on = d.capture
            # "Already on the target" judged from a deposed maintainer's stale view: it wrote the span's status, or
            # the operator's (seed 7645: its successor had made the span Absent meanwhile, as its capture's restart
            # left it; only the reported outcome is wrong, see docs/architecture.md, Fencing).
            zombie = span.name in ctx.zombie_span_writes or op.name in ctx.zombie_written_ops
            stale = op.status_reason == "AlreadyOnTarget" and zombie
            if on != op.target and not stale:
                ctx.fail(f"intent: {op.type} {op.name} Succeeded with span {span.name} on {on!r}, not {op.target!r}")
        expect = self.workload.expect.get(op.name)
        if expect is None:
            return
        if expect.type is OpType.SPLIT:
            got = tuple(t.key_range for t in op.targets)
            if got != expect.ranges:
                ctx.fail(
                    f"intent: split {op.name} recorded {[str(r) for r in got]}, asked {[str(r) for r in expect.ranges]}"
                )
            for t in op.targets:
                s = st[Kind.SPAN].get(t.span)
                if not isinstance(s, Span) or s.key_range != t.key_range:
                    ctx.fail(f"intent: split {op.name} Succeeded but child {t.span} {t.key_range} does not exist")
            if op.spans[0] in st[Kind.SPAN]:
                ctx.fail(f"intent: split {op.name} Succeeded but parent {op.spans[0]} remains")
        elif expect.type is OpType.MERGE:
            (want,) = expect.ranges
            if len(op.targets) != 1 or op.targets[0].key_range != want:
                ctx.fail(f"intent: merge {op.name} recorded {[str(t.key_range) for t in op.targets]}, asked {want}")
            s = st[Kind.SPAN].get(op.targets[0].span)
            if not isinstance(s, Span) or s.key_range != want:
                ctx.fail(f"intent: merge {op.name} Succeeded but merged span {want} does not exist")
            left = [
                n
                for n, uid in zip(expect.sources, expect.source_uids, strict=True)
                if getattr(st[Kind.SPAN].get(n), "uid", None) == uid
            ]
            if left:
                ctx.fail(f"intent: merge {op.name} Succeeded but sources remain: {left}")


def _live_table_ids(world: World) -> dict[int, str]:
    """Live table IDs, with the uid of the Table object that owns each (the first one created)."""
    first: dict[int, Table] = {}
    for t in sorted(world.tables.values(), key=lambda t: (t.created, t.name)):
        first.setdefault(t.table_id, t)
    return {tid: t.uid for tid, t in first.items() if not t.deleting}


def run_history(
    seed: int, mutants: frozenset[str] = frozenset(), steps: int = DEFAULT_STEPS, verbose: bool = False
) -> Result:
    return Sim(seed, Options(mutants=mutants), verbose=verbose).run(steps)
