"""Simulated captures: the workers that run dispatchers, keep a Lease, and fence themselves.

Why they are modelled in this detail: the capture is the ground truth the invariants are checked
against. "Which dispatchers really run, from which ts, up to which checkpoint" is decided here, not
read from the API, so a maintainer bug that leaves two dispatchers running, or starts one above what
was delivered, shows up even if every resource looks fine.

A capture: renews its Lease every 1-2 s (duration ``LEASE``); watches its own Dispatchers (with watch
delays); Pending -> (after a delay, unless "pause create") strong-reads the Changefeed and either
refuses a stale epoch (Rejected) or starts (Initializing); Initializing -> Working after a delay
(epoch re-checked); Working advances its checkpoint towards the upstream clock; a deleting dispatcher
(unless "hold close") is stopped, reported Stopped with its final checkpoint, and then its finalizer
is released: two writes, with a chance to crash between them.

The Lease, as the capture's Lease keeper keeps it (controller/capture/lease_keeper.py). It is modelled on the
Capture record (``renew_time``, ``lease_taken``; its resourceVersion is the Lease's): a renewal is a
compare-and-swap on the version of the capture's previous renewal (now and then the answer is lost, and the
next renewal adopts the version it finds if the Lease is still its own); the maintainer takes a lapsed Lease
by the same kind of write. A capture that has not renewed for ``RENEW_DEADLINE`` (< ``LEASE``) *pauses*: its
dispatchers stop delivering but stay, with their positions. It keeps trying; when a renewal succeeds, it reads
(strongly) its Dispatchers and the published epoch, and when those reads are done (at once, or up to 25 s
later: renewals go on meanwhile) and it is still that pause and its last renewal is younger than
``RENEW_DEADLINE``, it resumes those whose Dispatcher still existed (same uid), was not being deleted, and
whose changefeed published no epoch it had not seen, and drops the others. A renewal that finds the Lease
taken makes it fence itself: it stops everything (a crash, for the simulation). While the API is unreachable
for it (an outage, or a cut of this capture alone) nothing of it gets through: no renewal, no watch event, no
write.

Ground truth checked here: a dispatcher resumed after a pause must not find that another dispatcher
delivered its keys meanwhile (that is two owners, one after the other, with no hand-over); a capture
resumes only while a renewal younger than the renew deadline vouches for it, and never after its Lease
was taken during that pause (the maintainer may have released its dispatchers).

Reporting is modelled as the agent does it (controller/capture/reconciler.py, reporter.py,
controller/model/progress.py): a dispatcher's status is written on a state change (Initializing, Working,
Stopped, Rejected) and when its traffic changes materially, never for a checkpoint alone; each Lease renewal
carries the report built by ``progress.build`` over the Working dispatchers whose Working status was written
(one write: if the renewal fails, so does the report). A capture process can also restart under the same name:
a new incarnation that runs none of its predecessor's dispatchers, takes its Lease over (a new
``acquireTime``: whatever the old process would still write is refused), and reports them Stopped, as the
agent does."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import replace

from controller.model import progress
from controller.model.keys import regions_touched
from controller.model.records import DISPATCHER_FAILED_PREFIX, Capture, Changefeed, Dispatcher, Table
from controller.model.states import CLOSED_DISPATCHER_STATES as CLOSED
from controller.model.states import DISPATCHER_FINALIZER, DispatcherState, Kind, Mode
from controller.sim.api import ApiError, WatchEvent
from controller.sim.context import Ctx, Frontier
from controller.sim.executor import Cache
from controller.sim.faults import TROUBLE_MESSAGES, fails, trouble
from controller.sim.state import ResumeCheck, Run, SimCapture

LEASE = 10.0
RENEW_DEADLINE = 7.0
#: Chance that a successful renewal's answer is lost (the next renewal then finds a newer version).
LOST_ANSWER = 0.03

LIVE = (DispatcherState.INITIALIZING, DispatcherState.WORKING)


def _dispatcher(obj: object) -> Dispatcher | None:
    return obj if isinstance(obj, Dispatcher) else None


def _hot_key(t: Table) -> bytes:
    """A skewed table's hot row: a third of the way into its key range."""
    rng = t.key_range
    return rng.split_at(rng.even_split_keys(3))[1].start


HOLD_CLOSE = "hold close"
PAUSE_CREATE = "pause create"


class Captures:
    def __init__(self, ctx: Ctx, changefeed: str, mutants: frozenset[str] = frozenset()) -> None:
        self.ctx = ctx
        self.changefeed = changefeed
        self.mutants = mutants
        self.all: dict[str, SimCapture] = {}
        self.joined = 0
        #: Mutant: a paused capture that resumes everything, even after its Lease was taken (it re-takes it).
        self.resumes_blindly = "capture-resumes-after-takeover" in mutants
        self.defers_epoch_check = "capture-trusts-create-epoch" in mutants
        #: Mutant: a slow resume check's result is used however old the last renewal is by then.
        self.trusts_old_renewal = "capture-resume-check-trusts-an-old-renewal" in mutants
        ctx.holds = self.holds
        #: Mutant: a capture told to stop exits at once, before the maintainer moved its spans off.
        self.exits_before_drained = "capture-exits-before-drained" in mutants
        #: Captures whose ``spec.draining`` their own agent set for a shutdown (the annotation
        #: cdc.maintainer.dev/drain-reason: shutdown): the next process of that name clears it.
        self.shutdown_drains: set[str] = set()
        #: Per capture, when the maintainer last took its Lease (ground truth, from the API's changes).
        self.taken_at: dict[str, float] = {}
        ctx.api.observers.append(self._observe_take)

    def _observe_take(self, old: object, new: object) -> None:
        if isinstance(new, Capture) and new.lease_taken and not (isinstance(old, Capture) and old.lease_taken):
            self.taken_at[new.name] = self.ctx.now

    def holds(self, capture: str, uid: str) -> bool:
        """Whether the capture's current process holds (runs, or keeps paused) the dispatcher object ``uid``."""
        cap = self.all.get(capture)
        return cap is not None and cap.alive and any(r.d.uid == uid for r in cap.runs.values())

    # -- membership --------------------------------------------------------------------------------

    def join(self) -> str:
        ctx = self.ctx
        self.joined += 1
        name = f"cap-{self.joined}"
        watcher = ctx.api.watch(name, _mine(name))
        cap = SimCapture(name=name, watcher=watcher, last_renew=ctx.now, next_renew=ctx.now + 1.0)
        cap.cache = Cache()
        cap.incarnation = f"{name}.0"
        self.all[name] = cap
        made = ctx.api.create_with_status(Capture(name=name, renew_time=ctx.now, lease_duration=LEASE))
        cap.lease_rv = made.resource_version
        cf = self._published()
        cap.epoch_seen = cf.epoch if cf is not None else 0
        ctx.trace.add(f"  capture {name} joined")
        return name

    def crash(self, name: str, why: str = "crashed") -> None:
        cap = self.all[name]
        if not cap.alive:
            return
        cap.alive = False
        cap.own_fault = True
        cap.stopping_until = cap.respawn_at = None  # a crash ends a graceful stop too (the workload may restart it)
        cap.runs.clear()
        cap.check = None
        self.ctx.api.unwatch(cap.watcher)
        self.ctx.trace.add(f"  capture {name} {why}")

    def stop(self, name: str, grace: float, respawn_after: float) -> None:
        """SIGTERM to a capture run with a drain timeout of ``grace`` (a rollout, a scale-down, a node drain):
        it marks its Capture draining (registration.py ``mark_draining``), goes on as before while the maintainer
        moves its spans off, and exits gracefully once it holds nothing or ``grace`` ran out (``_step_one``).
        Its next process starts ``respawn_after`` seconds after it exits."""
        ctx, api = self.ctx, self.ctx.api
        cap = self.all[name]
        if not cap.alive or cap.stopping_until is not None:
            return
        cap.respawn_delay = respawn_after
        cap.stopping_until = ctx.now + grace
        ctx.trace.add(f"  capture {name}: SIGTERM, drains for up to {grace:.1f}s")
        if self.exits_before_drained:
            self._exit(cap)
            return
        cur = api.get(Kind.CAPTURE, name)
        if not api.reachable(name) or cap.acquiring or not isinstance(cur, Capture):
            cap.stopping_until = ctx.now  # cannot mark itself draining: stops at once, as before
            return
        if not cur.draining:
            api.update_spec(replace(cur, draining=True))
            self.shutdown_drains.add(name)

    def _holding(self, cap: SimCapture) -> list[str]:
        """What it still holds, by its own view (drainer.py ``holding``): what it runs, its dispatchers being deleted
        (until their close releases the finalizer) and those not closed."""
        held = set(cap.runs)
        for n, obj in cap.cache.objects[Kind.DISPATCHER].items():
            if isinstance(obj, Dispatcher) and (obj.deleting or obj.state not in CLOSED):
                held.add(n)
        return sorted(held)

    def _assigned(self, cap: SimCapture) -> list[str]:
        """The agent's consistent read before it exits drained (drainer.py ``assigned``): the Dispatchers the API
        assigns to it that are being deleted or not closed; unreachable: assume some are."""
        api = self.ctx.api
        if not api.reachable(cap.name):
            return ["(unreadable)"]
        return sorted(
            n
            for n, d in api.list(Kind.DISPATCHER).items()
            if isinstance(d, Dispatcher) and d.capture == cap.name and (d.deleting or d.state not in CLOSED)
        )

    def _exit(self, cap: SimCapture) -> None:
        """The graceful end of a process (agent.py ``_shutdown``): what still runs is stopped and reported
        Stopped, then the Lease is released (lease_taken: nothing of this process can resume)."""
        ctx, api = self.ctx, self.ctx.api
        assert cap.stopping_until is not None
        left = sorted(cap.runs)
        if left and ctx.now < cap.stopping_until:
            ctx.fail(
                f"drain: capture {cap.name} exited running {len(left)} dispatcher(s) ({', '.join(left[:3])}) before "
                "its drain timeout ran out (they were to be moved off first)"
            )
        ctx.bump("capture graceful exit" if not left else "capture drain timed out")
        mine = cap.cache.objects[Kind.DISPATCHER]
        for n in left:
            run = cap.runs.pop(n)
            obj = mine.get(n)
            if isinstance(obj, Dispatcher) and api.reachable(cap.name):
                self._status(cap, obj, DispatcherState.STOPPED, run.cp, "capture agent stopped")
        cap.runs.clear()
        cap.alive = False  # the process ends with the release below (nothing of it runs any more)
        if api.reachable(cap.name) and not cap.acquiring:
            released = Capture(name=cap.name, renew_time=ctx.now, lease_duration=1.0, lease_taken=True)
            with contextlib.suppress(ApiError):  # taken or changed meanwhile: it lapses
                api.write_status(released, cap.lease_rv, faulty=False)
        cap.check = None
        api.unwatch(cap.watcher)
        cap.respawn_at = ctx.now + cap.respawn_delay
        cap.stopping_until = None
        ctx.trace.add(f"  capture {cap.name} exited (left {len(left)})")

    def _end_shutdown_drain(self, cap: SimCapture) -> None:
        """A new process of a capture whose previous one drained it for its shutdown clears that drain as it
        registers (retried until the API answers, as registration is)."""
        cur = self.ctx.api.get(Kind.CAPTURE, cap.name)
        if cap.name in self.shutdown_drains and isinstance(cur, Capture) and self.ctx.api.reachable(cap.name):
            self.ctx.api.update_spec(replace(cur, draining=False))
            self.shutdown_drains.discard(cap.name)
            self.ctx.trace.add(f"  capture {cap.name}: its new process clears the shutdown drain")

    def _respawn(self, cap: SimCapture) -> None:
        """Its next process (the pod recreated under the same name): registers, and clears a drain the previous
        process set for its shutdown (registration.py ``end_shutdown_drain``)."""
        ctx = self.ctx
        cap.respawn_at = None
        cap.alive = True
        cap.watcher = ctx.api.watch(cap.name, _mine(cap.name))
        self.restart(cap.name)

    def restart(self, name: str) -> None:
        """The capture process dies and its supervisor starts it again at once (same name, same Lease):
        the new incarnation runs nothing, lists its dispatchers afresh, and reports live ones Stopped."""
        ctx = self.ctx
        cap = self.all[name]
        if not cap.alive:
            return
        cap.stopping_until = cap.respawn_at = None
        cap.foreign = False
        cap.inherited = set()
        self._end_shutdown_drain(cap)
        cap.runs.clear()
        cap.pending_since.clear()
        cap.closing.clear()
        cap.closing_uid.clear()
        cap.rejected.clear()
        ctx.api.unwatch(cap.watcher)
        cap.watcher = ctx.api.watch(name, _mine(name))
        cap.cache = Cache()
        for n, d in sorted(ctx.api.list(Kind.DISPATCHER).items()):
            if _capture_of(d) == name:
                cap.cache.objects[Kind.DISPATCHER][n] = d
        cap.restarts += 1
        cap.incarnation = f"{name}.{cap.restarts}"
        before = ctx.api.get(Kind.CAPTURE, name)
        cap.previous = before.progress if isinstance(before, Capture) else None
        cap.paused_at = None
        cap.check = None
        cap.acquiring = True
        cap.next_renew = ctx.now  # it takes its Lease again at once
        ctx.trace.add(f"  capture {name} restarted (incarnation {cap.incarnation})")

    def alive_names(self) -> list[str]:
        return sorted(n for n, c in self.all.items() if c.alive)

    def running(self) -> list[Dispatcher]:
        """Ground truth for the single-owner check: what the captures really run (deliver: not paused)."""
        return [r.d for n in sorted(self.all) for _, r in sorted(self.all[n].runs.items()) if not r.paused]

    # -- the Lease ---------------------------------------------------------------------------------

    def _renew(self, cap: SimCapture) -> None:
        """One renewal attempt (a compare-and-swap on ``cap.lease_rv``); may pause-resume or fence."""
        ctx, api = self.ctx, self.ctx.api
        cap.next_renew = ctx.now + ctx.rng.uniform(1.0, 2.0)
        if not cap.renew_ok or not api.reachable(cap.name):
            if cap.paused_at is not None:
                cap.next_renew = ctx.now + ctx.rng.uniform(0.5, 2.0)  # retrying
            return
        if cap.acquiring:  # a new process: takes its Lease over, whoever holds it now (as _acquire_lease)
            cur = api.get(Kind.CAPTURE, cap.name)
            if not isinstance(cur, Capture):
                return
            cap.foreign = cap.foreign or cur.lease_taken
            cap.lease_rv = cur.resource_version  # still acquiring until that write is known to have landed
        report = self._report(cap)
        renewal = Capture(name=cap.name, renew_time=ctx.now, lease_duration=LEASE, progress=report)
        new = None
        for _ in range(2):
            try:
                new = api.write_status(renewal, cap.lease_rv, faulty=False)
                break
            except ApiError as e:
                if e.code != 409:
                    raise
            cur = api.get(Kind.CAPTURE, cap.name)
            if not isinstance(cur, Capture) or cur.lease_taken:
                if self.resumes_blindly and isinstance(cur, Capture):
                    cap.lease_rv = cur.resource_version  # the mutant: takes its Lease back and carries on
                    continue
                self.crash(cap.name, "fenced itself: its Lease was taken (it stops everything)")
                ctx.bump("capture fenced")
                return
            cap.lease_rv = cur.resource_version  # our own renewal whose answer was lost, or a spec change
        if new is None:
            return
        if ctx.rng.random() < LOST_ANSWER:
            return  # the renewal landed but its answer was lost: the capture does not know it renewed
        cap.lease_rv = new.resource_version
        cap.last_renew = ctx.now
        if cap.acquiring and cap.foreign:
            # The agent lists its Dispatchers after its acquisition: what is assigned to it then.
            cap.inherited = {n for n, d in api.list(Kind.DISPATCHER).items() if _capture_of(d) == cap.name}
        cap.acquiring = False
        if cap.paused_at is not None and cap.check is None:
            self._start_check(cap)

    def _pause(self, cap: SimCapture) -> None:
        ctx = self.ctx
        cap.paused_at = ctx.now
        for run in cap.runs.values():
            run.paused = True
            fr = self.run_frontier(run)
            run.frontier_at_pause = fr.high(run.d.key_range) if fr is not None else 0
        ctx.bump("capture paused")
        ctx.trace.add(
            f"  {cap.name}: paused (no Lease renewal for {ctx.now - cap.last_renew:.1f}s), keeps {sorted(cap.runs)}"
        )

    def _start_check(self, cap: SimCapture) -> None:
        """A renewal succeeded while paused: read (strongly) what it holds, now; judge it when the reads are
        done, at once half of the time, else after a while (a slow LIST), sometimes longer than the renew
        deadline or even the Lease."""
        ctx, api = self.ctx, self.ctx.api
        assert cap.paused_at is not None
        reads = {name: _dispatcher(api.get(Kind.DISPATCHER, name)) for name in sorted(cap.runs)}
        slow = ctx.rng.random() < 0.5
        delay = ctx.rng.choice([ctx.rng.uniform(0.2, 4.0), ctx.rng.uniform(4.0, 25.0)]) if slow else 0.0
        cap.check = ResumeCheck(cap.paused_at, reads, self._published(), ctx.now + delay)
        if not slow:
            self._finish_check(cap)
            return
        ctx.bump("capture slow resume check")
        ctx.trace.add(f"  {cap.name}: reads what to resume, for {delay:.1f}s")
        if cap.runs and not ctx.quiet and ctx.rng.random() < 0.25:
            # Its renewals fail again while it reads (the rest of the API works), and the reads take about
            # a Lease: when they are done, no renewal vouches for what they said, and the Lease may be taken.
            cap.renew_ok = False
            cap.own_fault = True
            cap.check.ready_at = ctx.now + ctx.rng.uniform(LEASE, LEASE + 4.0)
            ctx.bump("lease fail")
            ctx.trace.add(f"  capture {cap.name}: Lease renewals start failing while it reads")

    def _finish_check(self, cap: SimCapture) -> None:
        ctx = self.ctx
        check, cap.check = cap.check, None
        assert check is not None
        if not self.trusts_old_renewal:
            if cap.paused_at != check.pause:
                return  # resumed, or paused again, meanwhile: the next renewal checks afresh
            if ctx.now - cap.last_renew >= RENEW_DEADLINE:
                ctx.trace.add(f"  {cap.name}: no renewal vouches for what it read; stays paused")
                return
        if cap.paused_at is not None:
            self._resume(cap, check)

    def _resume(self, cap: SimCapture, check: ResumeCheck) -> None:
        """After a renewal that succeeded while paused: resume what is still ours, drop the rest (as read)."""
        ctx = self.ctx
        cf = check.cf
        if cap.runs and ctx.now - cap.last_renew >= RENEW_DEADLINE:
            # What a capture promises the maintainer: it delivers only while a renewal younger than the
            # renew deadline vouches for it (so that nothing runs by the time its Lease can lapse).
            ctx.fail(
                f"fencing: {cap.name} resumed {sorted(cap.runs)[:3]} {ctx.now - cap.last_renew:.1f}s after its "
                f"last renewal (renew deadline {RENEW_DEADLINE}s)"
            )
        taken = self.taken_at.get(cap.name)
        if cap.runs and taken is not None and cap.paused_at is not None and taken >= cap.paused_at:
            # The fencing argument's ground: once the maintainer took the Lease it may release the capture's
            # dispatchers and place their spans elsewhere; nothing this process paused may deliver again.
            ctx.fail(f"fencing: {cap.name} resumed {sorted(cap.runs)[:3]} though its Lease was taken at {taken:.1f}")
        resumed, dropped = [], []
        for name in sorted(cap.runs):
            run = cap.runs[name]
            d = check.reads.get(name)
            if not self.resumes_blindly:
                if d is None or d.uid != run.d.uid:
                    del cap.runs[name]
                    dropped.append(name)
                    continue
                if d.deleting:
                    continue  # stays paused: the close path closes it where it stopped
                if cf is None or cf.epoch > cap.epoch_seen:
                    del cap.runs[name]
                    dropped.append(name)
                    self._status(cap, d, DispatcherState.STOPPED, run.cp, "not resumed: a new epoch")
                    continue
            fr = self.run_frontier(run)
            if fr is not None and fr.high(run.d.key_range) > max(run.cp, run.frontier_at_pause):
                ctx.fail(
                    f"single owner (2): {cap.name} resumed {name} at {run.cp} but its keys {run.d.key_range} were "
                    f"delivered up to {fr.high(run.d.key_range)} by another dispatcher while it was paused"
                )
            run.paused = False
            run.next_at = ctx.now + ctx.rng.uniform(0.2, 1.5)
            resumed.append(name)
        if cf is not None:
            cap.epoch_seen = max(cap.epoch_seen, cf.epoch)
        ctx.trace.add(
            f"  {cap.name}: resumed {resumed} after {ctx.now - (cap.paused_at or ctx.now):.1f}s, dropped {dropped}"
        )
        ctx.bump("capture resumed")
        cap.paused_at = None

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> None:
        for name in sorted(self.all):
            cap = self.all[name]
            if cap.alive:
                self._step_one(cap)
                if (
                    cap.alive
                    and cap.stopping_until is not None
                    and ((not self._holding(cap) and not self._assigned(cap)) or self.ctx.now >= cap.stopping_until)
                ):
                    self._exit(cap)
            elif cap.respawn_at is not None and self.ctx.now >= cap.respawn_at:
                self._respawn(cap)

    def _step_one(self, cap: SimCapture) -> None:
        ctx = self.ctx
        if cap.check is not None and ctx.now >= cap.check.ready_at and ctx.api.reachable(cap.name):
            # The reads' last answer (before the renewal that may be due now: they run side by side).
            self._finish_check(cap)
        if ctx.now >= cap.next_renew:
            self._renew(cap)
            if not cap.alive:
                return
        if cap.stopping_until is None and cap.name in self.shutdown_drains:
            self._end_shutdown_drain(cap)  # registration retried
        if cap.acquiring:
            # A restarted process registers first, as the agent's _register: until it holds its Lease it
            # runs nothing (seed 5859: one that could not renew started dispatchers, paused, and resumed
            # them after the maintainer had taken the Lease, by taking it over as a new process would).
            cap.next_renew = min(cap.next_renew, ctx.now + 0.5)
            return
        if cap.paused_at is None and ctx.now - cap.last_renew > RENEW_DEADLINE:
            self._pause(cap)
        if not ctx.api.reachable(cap.name):
            return  # nothing gets through: no watch events, no writes
        if cap.paused_at is None:
            cf = self._published()  # the agent re-reads the epochs of its changefeeds every few seconds
            if cf is not None:
                cap.epoch_seen = max(cap.epoch_seen, cf.epoch)
        for ev in cap.watcher.due(ctx.now):
            cap.cache.apply(ev)
        mine = cap.cache.objects[Kind.DISPATCHER]
        for name in sorted(cap.runs):
            if name not in mine:
                # Deleted outright (finalizer released by someone else): stop at once.
                del cap.runs[name]
                ctx.trace.add(f"  {cap.name}: {name} vanished; stopped")
        for name in sorted(cap.closing):
            # Gone, or re-created under the same name (the watch coalesced the deletion away): a new
            # incarnation is not the one being closed (seed 35063: a re-created dispatcher never started).
            current = mine.get(name)
            if current is None or current.uid != cap.closing_uid.get(name):
                del cap.closing[name]
                cap.closing_uid.pop(name, None)
        cap.rejected &= set(mine)
        for name in sorted(mine):
            obj = mine[name]
            assert isinstance(obj, Dispatcher)
            if obj.deleting:
                self._close(cap, obj)
            elif cap.paused_at is not None:
                continue  # paused: nothing starts, advances or is reported
            elif name in cap.runs:
                self._advance(cap, cap.runs[name], obj)
            elif obj.state is DispatcherState.PENDING and name not in cap.closing and name in cap.inherited:
                # Assigned before this process took over a Lease that did not name it: the maintainer may be
                # releasing it on the strength of that Lease. Not started; reported Stopped.
                self._status(cap, obj, DispatcherState.STOPPED, obj.checkpoint_ts, "assigned before the takeover")
            elif obj.state is DispatcherState.PENDING and name not in cap.closing:
                self._create(cap, obj)
            elif obj.state in (DispatcherState.INITIALIZING, DispatcherState.WORKING):
                # Reported live but not run here (refused at Working, and that report did not land):
                # level-triggered, the capture re-reports what it knows until the API agrees.
                state = DispatcherState.REJECTED if name in cap.rejected else DispatcherState.STOPPED
                self._status(cap, obj, state, obj.checkpoint_ts, "not running on this capture")

    def _report(self, cap: SimCapture) -> progress.Progress:
        """The progress report the next Lease renewal carries (checked against the ground truth)."""
        ctx = self.ctx
        running = [
            progress.Running(r.d.uid, n, r.d.changefeed, r.d.mode, r.d.start_ts, r.cp)
            for n, r in sorted(cap.runs.items())
            if r.state is DispatcherState.WORKING and r.written is DispatcherState.WORKING
        ]
        report = progress.build(running, cap.incarnation, ctx.now, previous=cap.previous, mutants=self.mutants)
        self._check_report(cap, report, running)
        changefeeds = sorted({r.d.changefeed for r in cap.runs.values()})
        troubles = []
        for side in progress.SIDES if changefeeds and not ctx.quiet else ():
            transient = trouble(ctx.seed, cap.name, side, ctx.now)
            if transient is not None:
                ctx.bump(f"{side} troubles reported by captures")
                troubles += [
                    progress.Trouble(changefeed=cf, side=side, transient=transient, message=TROUBLE_MESSAGES[side])
                    for cf in changefeeds
                ]
        return replace(report, troubles=tuple(troubles)) if troubles else report

    def _check_report(self, cap: SimCapture, report: progress.Progress, running: list[progress.Running]) -> None:
        """Ground truth: a report claims no more than was delivered, for every key of every dispatcher it covers."""
        for r in running:
            entry = report.entry(r.changefeed, r.mode)
            run = cap.runs[r.name]
            fr = self.run_frontier(run)
            if entry is None or fr is None:
                continue
            if fr is not self.frontier(run.d.table_id, run.d.mode):
                # Its table was deleted and another incarnation took the ID (simulator seed 89912 judged
                # such a report against the new incarnation's frontier): counted, so tests can find it.
                self.ctx.bump("report of a replaced table incarnation")
            low = fr.low(run.d.key_range)
            if entry.checkpoint_ts > low:
                self.ctx.fail(
                    f"no gap (5): {cap.name} ({cap.incarnation}) reports {entry.checkpoint_ts} for "
                    f"{r.changefeed}/{r.mode.value} covering {r.name}, whose keys {run.d.key_range} were "
                    f"delivered only up to {low}"
                )

    def _traffic(self, d: Dispatcher) -> tuple[float, int]:
        """The span's share of its table's write rate and regions (what a real capture measures).

        Every third table is skewed: 80% of its writes hit one key (a hot row), so splitting the span
        that holds it never cools it, which the split scheduler's hot-spot rule must notice.
        """
        for t in self.ctx.api.store[Kind.TABLE].values():
            if isinstance(t, Table) and t.table_id == d.table_id and t.changefeed == d.changefeed:
                share = d.key_range.share_of(t.key_range)
                regions = regions_touched(t.region_count, d.key_range, t.key_range)
                if t.table_id % 3:
                    return round(t.write_rate * share, 3), regions
                hot = 0.8 if d.key_range.contains_key(_hot_key(t)) else 0.0
                return round(t.write_rate * (0.2 * share + hot), 3), regions
        return 0.0, 0

    def _status(self, cap: SimCapture, d: Dispatcher, state: DispatcherState, cp: int, message: str = "") -> bool:
        rate, regions = self._traffic(d) if state in LIVE else (0.0, 0)
        new = d.evolve(
            state=state,
            checkpoint_ts=cp,
            heartbeat=self.ctx.now,
            message=message,
            write_rate=rate,
            region_count=regions,
        )
        try:
            cap.cache.offer(self.ctx.api.write_status(new, ""))
        except ApiError as e:
            self.ctx.trace.add(f"  {cap.name}: status {d.name} {state.value or 'Pending'} failed: {e.code}")
            return False
        return True

    def _published(self) -> Changefeed | None:
        """The changefeed by a strong read; None once it is gone (deleted)."""
        cf = self.ctx.api.get(Kind.CHANGEFEED, self.changefeed)
        return cf if isinstance(cf, Changefeed) else None

    def _create(self, cap: SimCapture, d: Dispatcher) -> None:
        ctx = self.ctx
        ready = cap.pending_since.setdefault(d.name, ctx.now + ctx.rng.uniform(0.2, 2.0))
        if ctx.now < ready or cap.hooked(PAUSE_CREATE, d.table_id):
            return
        cf = self._published()
        if cf is None:
            return  # as the agent: a dispatcher of a changefeed that does not exist is not started
        if d.epoch < cf.epoch:
            if self._status(cap, d, DispatcherState.REJECTED, d.start_ts, f"epoch {d.epoch} < {cf.epoch}"):
                cap.pending_since.pop(d.name, None)
                ctx.trace.add(f"  {cap.name}: rejected {d.name} (epoch {d.epoch} < {cf.epoch})")
            return
        self._check_gap(d)
        run = Run(d, DispatcherState.INITIALIZING, d.start_ts, ctx.now + ctx.rng.uniform(0.2, 1.5))
        run.fr = self.frontier(d.table_id, d.mode)
        cap.runs[d.name] = run
        cap.pending_since.pop(d.name, None)
        ctx.trace.add(
            f"  {cap.name}: started {d.name} {d.mode.value} {d.key_range} from {d.start_ts} (epoch {d.epoch})"
        )
        # The agent defers the Initializing write by up to its report interval (most dispatchers are Working
        # by then, and one write says so): the maintainer may see a dispatcher go Pending -> Working.
        # Half of them, chosen by uid (not by the history's random stream, which the other faults draw from).
        if zlib.crc32(d.uid.encode()) & 1:
            self._write_run(cap, run, d)
        else:
            ctx.trace.add(f"  {cap.name}: {d.name} Initializing not written (deferred)")

    def _check_gap(self, d: Dispatcher) -> None:
        fr = self.frontier(d.table_id, d.mode)
        if fr is None:
            return
        low = fr.low(d.key_range)
        if d.start_ts > low:
            self.ctx.fail(
                f"no gap (5): dispatcher {d.name} on {d.capture} starts at {d.start_ts} but keys of "
                f"{d.key_range} ({d.mode}) were delivered only up to {low}"
            )

    def run_frontier(self, run: Run) -> Frontier | None:
        """The frontier of the table incarnation ``run`` delivers for (bound when it started, or when first
        found: a dispatcher started before its table had one)."""
        if run.fr is None:
            fr = self.frontier(run.d.table_id, run.d.mode)
            if fr is not None:
                self._bind(run, fr)
        return run.fr

    def bind_frontier(self, table_id: int, mode: Mode, fr: Frontier) -> None:
        """A frontier was just created for ``(table_id, mode)``: every run of it that started without one is
        bound to it now, before a check compares the changefeed's checkpoint with it."""
        for name in sorted(self.all):
            for _, run in sorted(self.all[name].runs.items()):
                if run.fr is None and run.d.table_id == table_id and run.d.mode is mode:
                    self._bind(run, fr)

    def _bind(self, run: Run, fr: Frontier) -> None:
        """Bind ``run``, which started while its table had no frontier, to ``fr``: it has delivered its keys
        from its start up to its checkpoint meanwhile, and that counts when it began no later than ``fr``
        on those keys (seed 2129177: a dispatcher of a deleted table advanced unbound to 1253, was adopted by
        the duplicate that took the ID, and its report was judged against the new frontier, still at 1000)."""
        run.fr = fr
        self.ctx.bump("run bound late")
        if run.d.start_ts <= fr.low(run.d.key_range):
            fr.raise_to(run.d.key_range, run.cp)

    def frontier(self, table_id: int, mode: Mode) -> Frontier | None:
        return self.ctx.frontier.get((table_id, mode))

    def _advance(self, cap: SimCapture, run: Run, d: Dispatcher) -> None:
        ctx = self.ctx
        if ctx.now < run.next_at or run.paused:
            return
        if run.state is DispatcherState.INITIALIZING:
            cf = self._published()
            # The mutant: a dispatcher whose Initializing was never written (deferred) is taken to be as
            # fresh as the epoch read at its start, and goes Working without the second read.
            trusted = self.defers_epoch_check and run.written is None
            if cf is not None and d.epoch < cf.epoch and not trusted:
                del cap.runs[d.name]
                ctx.trace.add(f"  {cap.name}: rejected {d.name} at Working (epoch {d.epoch} < {cf.epoch})")
                cap.rejected.add(d.name)
                self._status(cap, d, DispatcherState.REJECTED, run.cp, f"epoch {d.epoch} < {cf.epoch}")
                return
            if cf is not None and d.epoch < cf.epoch:  # invariant 6, on the ground truth (the capture's re-check)
                ctx.fail(f"fencing (6): {d.name} reached Working with epoch {d.epoch} < published {cf.epoch}")
            run.state = DispatcherState.WORKING
            ctx.trace.add(f"  {cap.name}: {d.name} Working")
        else:
            if not run.failure and not ctx.quiet and fails(ctx.seed, d.name, run.cp):
                run.failure = "the source was compacted past this dispatcher's position (injected)"
                run.written = None  # said in its next status write
                ctx.bump("dispatcher failed")
                ctx.trace.add(f"  {cap.name}: {d.name} stopped for good at {run.cp}")
            elif run.failure and ctx.quiet:
                run.failure, run.written = "", None  # a person repaired the source: it delivers again
                ctx.bump("dispatcher failure cleared")
            if not run.failure:
                run.cp = max(run.cp, min(ctx.upstream(), run.cp + ctx.rng.randint(0, 200)))
        fr = self.run_frontier(run)
        if fr is not None:
            fr.raise_to(d.key_range, run.cp)
        run.next_at = ctx.now + ctx.rng.uniform(1.0, 2.5)
        # A status write on a state change (or one that failed before), or when the traffic moved
        # materially; the checkpoint alone travels in the Lease renewal's report.
        if run.written is not run.state or progress.traffic_changed(run.traffic, self._traffic(d)):
            self._write_run(cap, run, d)

    def _write_run(self, cap: SimCapture, run: Run, d: Dispatcher) -> None:
        traffic = self._traffic(d)
        message = f"{DISPATCHER_FAILED_PREFIX}{run.failure}" if run.failure else ""
        if self._status(cap, d, run.state, run.cp, message):
            run.written, run.traffic = run.state, traffic

    def _close(self, cap: SimCapture, d: Dispatcher) -> None:
        ctx = self.ctx
        if cap.hooked(HOLD_CLOSE, d.table_id) and d.name in cap.runs:
            return
        if d.name not in cap.closing:
            run = cap.runs.pop(d.name, None)
            if run is not None:
                final = run.cp
                ctx.trace.add(f"  {cap.name}: closed {d.name} at {final}")
            else:
                final = d.known_checkpoint
            cap.pending_since.pop(d.name, None)
            already = d.state in (DispatcherState.STOPPED, DispatcherState.REJECTED, DispatcherState.REMOVED)
            cap.closing[d.name] = (final, already and run is None)
            cap.closing_uid[d.name] = d.uid
        final, written = cap.closing[d.name]
        if not written:
            if not self._status(cap, d, DispatcherState.STOPPED, final):
                return
            cap.closing[d.name] = (final, True)
            if ctx.rng.random() < 0.5:
                return  # the finalizer goes in a later step: a window to crash in between
        try:
            ctx.api.remove_finalizer(Kind.DISPATCHER, d.name, DISPATCHER_FINALIZER)
        except ApiError as e:
            if e.code != 404:
                ctx.trace.add(f"  {cap.name}: release {d.name} failed: {e.code}")
                return
        cap.closing.pop(d.name, None)
        cap.closing_uid.pop(d.name, None)


def _capture_of(obj: object) -> str:
    return obj.capture if isinstance(obj, Dispatcher) else ""


def _mine(name: str) -> Callable[[WatchEvent], bool]:
    def mine(e: WatchEvent) -> bool:
        return e.kind is Kind.DISPATCHER and (e.obj is None or _capture_of(e.obj) == name)

    return mine
