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
from typing import cast

from controller.engine import intents as I
from controller.engine.intents import Create, WriteStatus
from controller.engine.liveness import Silence, ViewClock
from controller.engine.maintainer import Memory, decide
from controller.engine.world import Options, World
from controller.model.records import Capture, Changefeed, Dispatcher, Span, SpanOperator, Table
from controller.model.states import Kind, OpPhase
from controller.sim import executor
from controller.sim.api import Watcher
from controller.sim.captures import LEASE
from controller.sim.context import Ctx
from controller.sim.executor import Cache

#: The view of Leases counts as current this long after the last step that reached the API.
VIEW_FRESH = 0.5


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
        self.cache = Cache.listed(ctx.api)
        self.view.heard(ctx.now)
        self._observe_leases()
        self.alive = True
        self.zombie = False
        self.zombie_until = 0.0
        self.kill_after: int | None = None  # die after this many more writes
        self.events: list[str] = []
        ctx.trace.add(f"  {self.identity} started at epoch {epoch} (cache synced by LIST)")

    def stop(self) -> None:
        self.alive = False
        self.ctx.api.unwatch(self.watcher)

    def sync(self) -> None:
        now = self.ctx.now
        if not self.ctx.api.reachable(self.identity):
            self.view.broken(now)  # its watch is broken: what it shows is stale, and nobody's silence
            return
        self.view.heard(now)
        for ev in self.watcher.due(now):
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
        return World(
            now=self.ctx.now,
            changefeed=cf,
            tables=cast("dict[str, Table]", dict(objs[Kind.TABLE])),
            spans=cast("dict[str, Span]", dict(objs[Kind.SPAN])),
            dispatchers=cast("dict[str, Dispatcher]", dict(objs[Kind.DISPATCHER])),
            operators=cast("dict[str, SpanOperator]", dict(objs[Kind.OPERATOR])),
            captures=captures,
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
        world = self.world()
        decision = decide(world, self.memory, self.options)
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
            # A user's span the zombie accepts from its stale view may overlap spans its successor
            # created meanwhile (seed 1766): the successor's overlap repair resolves it.
            written = (w.obj for c in decision.chains for w in c.writes if isinstance(w, WriteStatus))
            ctx.zombie_spans.update(
                o.name
                for o in written
                if isinstance(o, Span) and o.state is not None and getattr(world.spans.get(o.name), "state", 0) is None
            )
            started = [w.obj for c in decision.chains for w in c.writes if isinstance(w, WriteStatus)]
            ctx.zombie_ops.update(
                o.name for o in started if isinstance(o, SpanOperator) and o.phase is OpPhase.RUNNING
            )
            ctx.zombie_written_ops.update(o.name for o in started if isinstance(o, SpanOperator))
        out = executor.apply(
            ctx.api, self.cache, decision, kill, self.events, ctx.trace.add, client=self.identity, guard=self._guard
        )
        ctx.bump("writes", out.writes)
        if out.killed:
            self.stop()
            ctx.trace.add(f"  {who} KILLED mid-decision")

    def _guard(self, w: I.Write) -> None:
        """The fencing rule, on the ground truth: a dispatcher's finalizer is released by a maintainer only
        once its capture's Lease no longer names the capture (else the capture could resume it)."""
        if not (isinstance(w, I.RemoveFinalizer) and w.kind is Kind.DISPATCHER):
            return
        d = self.ctx.api.get(Kind.DISPATCHER, w.name)
        if not isinstance(d, Dispatcher):
            return
        c = self.ctx.api.get(Kind.CAPTURE, d.capture)
        # A process of that capture that holds the dispatcher (running or paused) and whose Lease still names
        # the capture could resume it. (A restarted process that re-took the Lease after the maintainer took
        # it holds none of its predecessor's dispatchers: seed 1971.)
        if isinstance(c, Capture) and not c.lease_taken and self.ctx.holds(d.capture, d.uid):
            self.ctx.fail(
                f"fencing: {self.identity} released the finalizer of {d.name} while {d.capture}'s Lease still "
                "names it (the capture could resume it)"
            )

    def _kill_check(self) -> bool:
        if self.kill_after is None:
            return False
        if self.kill_after <= 0:
            return True
        self.kill_after -= 1
        return False
