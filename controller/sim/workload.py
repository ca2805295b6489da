"""Seeded random histories: what users, captures, the cluster and the network do to the maintainer.

Why random rather than scripted: the failures worth finding are interleavings nobody thought to
script (a kill between two writes of a Move while its destination is paused, a lease lapsing during
a Merge...). Each event is drawn from the history's one ``random.Random``, so a seed names a history.
Some events are deliberately invalid (a Move to a dead capture, a Merge of non-adjacent spans, a
pre-split Span overlapping others): the maintainer must refuse them without half-running them.

The simulator records what each user operator was asked to do (the expected split shape, the merge
union), so that its success can be checked against its intent.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from controller.model.keys import KeyError_, KeyRange
from controller.model.records import Capture, Changefeed, SchedulerConfig, Span, SpanOperator, Table
from controller.model.states import CHANGEFEED_FINALIZER, Kind, Mode, OpSource, OpType, SpanState
from controller.sim.captures import HOLD_CLOSE, LEASE, PAUSE_CREATE, Captures
from controller.sim.context import Ctx
from controller.sim.maintainer import RECORD_KINDS, RELIST_SPREAD, SimMaintainer

CF = "cf"
#: What users no longer do for a changefeed they deleted.
CHANGEFEED_EVENTS = ("table add", "user op", "user span", "pause", "refused table")
#: What still happens while the API is out: nothing that needs it (processes die, networks fail).
DURING_OUTAGE = ("capture crash", "lease fail", "maintainer kill", "watch burst", "write faults", "capture cut off")


@dataclass(frozen=True)
class Expect:
    """What a user operator must have done when it Succeeded."""

    type: OpType
    target: str = ""
    ranges: tuple[KeyRange, ...] = ()  # split: the children's ranges; merge: the one merged range
    sources: tuple[str, ...] = ()
    #: The uids of ``sources`` when the operator was asked for: a span of the same name made later (a hole
    #: filled from a stale view) is another span, not a source left behind.
    source_uids: tuple[str, ...] = ()


class Sim(Protocol):
    """What a workload drives of the simulation (``controller.sim.history.Sim``, which runs it): a Protocol, so that
    this module does not import the history (no import cycle)."""

    @property
    def ctx(self) -> Ctx: ...
    @property
    def captures(self) -> Captures: ...
    @property
    def maintainers(self) -> Sequence[SimMaintainer]: ...

    def schedule_kill(self, after_writes: int, delay: float = 0.0) -> None: ...

    def failover(self) -> None: ...

    def hand_over(self) -> None: ...

    def partition_maintainer(self, seconds: float) -> None: ...


class Workload:
    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.ctx = sim.ctx
        self.next_table = 1
        self.ops = 0
        self.user_spans = 0
        self.burst_until = 0.0
        self.faults_until = 0.0
        self.expect: dict[str, Expect] = {}
        self.join_at: float | None = None  # a capture joins then (after an outage)

    # -- setup -------------------------------------------------------------------------------------

    def initial(self) -> None:
        rng = self.ctx.rng
        redo = rng.random() < 0.3
        limit = rng.choice([2, 3, 5, 10000, 10000])
        # The automatic schedulers, on simulated-time scales (a history lasts a few minutes).
        sched = SchedulerConfig(
            max_in_flight_operators=limit,
            # Small batches: placements and new tables' spans spread over several decisions (repair.coverage).
            basic_batch_size=rng.choice([1, 3, 512, 512]),
            balance_interval_seconds=rng.choice([0.0, 3.0, 10.0, 10.0]),
            balance_max_moves=rng.choice([1, 4, 1024]),
            drain_batch_size=rng.choice([1, 3, 512]),
            drain_cooldown_seconds=rng.choice([0.0, 5.0, 20.0]),
            traffic_check_interval_seconds=rng.choice([1.0, 2.0, 4.0]),
            split_write_threshold=rng.choice([0.0, 100.0, 300.0]),
            split_region_threshold=rng.choice([0, 50, 10000]),
            split_checks=rng.choice([1, 3]),
            max_spans_per_table=rng.choice([4, 8, 16]),
            merge_write_threshold=rng.choice([0.0, 30.0, 60.0]),
            merge_checks=rng.choice([1, 5]),
            merge_max_per_round=rng.choice([1, 8]),
        )
        cf = Changefeed(name=CF, start_ts=self.ctx.base_ts, redo=redo, scheduler=sched)
        self.ctx.api.create(cf, faulty=False)
        self.ctx.trace.add(
            f"  changefeed redo={redo} maxInFlightOperators={limit} balance={sched.balance_interval_seconds:g}s "
            f"split>{sched.split_write_threshold:g}/s or >{sched.split_region_threshold} regions "
            f"merge<{sched.merge_write_threshold:g}/s cap={sched.max_spans_per_table}"
        )
        for _ in range(3):
            self.sim.captures.join()
        for _ in range(rng.randint(2, 4)):
            self.add_table(initial=True)

    # -- events ------------------------------------------------------------------------------------

    def event(self) -> None:
        ctx, rng = self.ctx, self.ctx.rng
        api = ctx.api
        if ctx.now >= self.burst_until:
            api.faults.watch_delay = 0.5
        if ctx.now >= self.faults_until:
            api.faults.p500 = api.faults.p409 = 0.0
        if self.join_at is not None and ctx.now >= self.join_at:
            self.join_at = None
            self.sim.captures.join()
            ctx.bump("capture join")
        r = rng.random()
        table: list[tuple[float, str]] = [
            (0.05, "table add"),
            (0.025, "table delete"),
            (0.16, "user op"),
            (0.02, "user span"),
            (0.008, "span delete"),
            (0.02, "capture crash"),
            (0.015, "capture restart"),
            (0.02, "capture join"),
            (0.01, "capture drain"),
            (0.01, "lease fail"),
            (0.05, "hook"),
            (0.04, "maintainer kill"),
            (0.015, "zombie failover"),
            (0.02, "watch burst"),
            (0.03, "write faults"),
            (0.02, "table traffic"),
            (0.006, "pause"),
            (0.003, "changefeed delete"),
            (0.012, "api outage"),
            (0.008, "capture cut off"),
            (0.005, "maintainer cut off"),
            (0.01, "refused table"),
            (0.015, "capture roll"),
            (0.015, "maintainer handoff"),
            (0.03, "watch break"),
        ]
        if ctx.cf_deleted_at is not None:
            # Deleted: users stop writing for it (creates naming it would be the user's own leftovers).
            table = [(p, w) for p, w in table if w not in CHANGEFEED_EVENTS]
        if api.outage():
            table = [(p, w) for p, w in table if w in DURING_OUTAGE]
        for p, what in table:
            if r < p:
                self.do(what)
                return
            r -= p

    def do(self, what: str) -> None:
        ctx, rng, api = self.ctx, self.ctx.rng, self.ctx.api
        caps = self.sim.captures
        if what == "table add":
            self.add_table(initial=False)
        elif what == "refused table":
            # A table whose spans the API refuses for a while (an admission policy): the maintainer retries and
            # must report it (WritesRefused, an Event) in its next decision.
            seconds = rng.uniform(1.0, 8.0)
            api.refusing[self.next_table] = ctx.now + seconds
            ctx.bump("refused table")
            ctx.trace.add(f"  the API refuses spans of table {self.next_table} for {seconds:.1f}s")
            self.add_table(initial=False)
        elif what == "table delete":
            live = self._tables()
            if live:
                t = rng.choice(live)
                api.delete(Kind.TABLE, t.name, faulty=False)
                ctx.bump("table delete")
                ctx.trace.add(f"  kubectl delete table {t.name} (id {t.table_id})")
        elif what == "user op":
            self.user_op()
        elif what == "user span":
            self.user_span(None)
        elif what == "span delete":
            # A person deletes a Span by hand: its dispatcher is left without a span (repair rule 3)
            # and the hole is re-covered (repair rule 4).
            spans = sorted(n for n, s in api.store[Kind.SPAN].items() if not s.deleting)
            if spans:
                name = rng.choice(spans)
                api.delete(Kind.SPAN, name, faulty=False)
                ctx.user_deleted.add(name)
                ctx.bump("span delete")
                ctx.trace.add(f"  kubectl delete span {name}")
        elif what == "capture crash":
            alive = caps.alive_names()
            if len(alive) > 1:
                name = rng.choice(alive)
                caps.crash(name)
                ctx.bump("capture crash")
                if rng.random() < 0.5:
                    # Its pod's container is restarted (same name), often after the maintainer took its Lease.
                    back = rng.uniform(1.0, 15.0)
                    caps.all[name].respawn_at = ctx.now + back
                    ctx.trace.add(f"  capture {name} comes back in {back:.1f}s")
        elif what == "capture restart":
            alive = caps.alive_names()
            if alive:
                caps.restart(rng.choice(alive))
                ctx.bump("capture restart")
        elif what == "capture join":
            caps.join()
            ctx.bump("capture join")
        elif what == "capture roll":
            # A rollout (or a scale-down, a node drain) stops one capture gracefully: SIGTERM with a drain
            # timeout; its pod comes back under the same name a little after it exits.
            alive = [n for n in caps.alive_names() if caps.all[n].stopping_until is None]
            if len(alive) > 1:
                caps.stop(rng.choice(alive), rng.choice([1.0, 5.0, 20.0]), rng.uniform(0.5, 3.0))
                ctx.bump("capture roll")
        elif what == "capture drain":
            alive = caps.alive_names()
            if len(alive) > 1:
                c = api.get(Kind.CAPTURE, rng.choice(alive))
                assert isinstance(c, Capture)
                api.update_spec(replace(c, draining=True))
                ctx.bump("capture drain")
                ctx.trace.add(f"  capture {c.name} draining")
        elif what == "lease fail":
            alive = caps.alive_names()
            if len(alive) > 1:
                name = rng.choice(alive)
                caps.all[name].renew_ok = False
                caps.all[name].own_fault = True
                ctx.bump("lease fail")
                ctx.trace.add(f"  capture {name}: Lease renewals start failing")
        elif what == "hook":
            self.hook()
        elif what == "maintainer kill":
            self.sim.schedule_kill(rng.randint(0, 6))
        elif what == "zombie failover":
            self.sim.failover()
        elif what == "maintainer handoff":
            self.sim.hand_over()
        elif what == "watch burst":
            api.faults.watch_delay = rng.uniform(1.0, 4.0)
            self.burst_until = ctx.now + rng.uniform(2.0, 8.0)
            ctx.bump("watch burst")
            ctx.trace.add(f"  watch delays up to {api.faults.watch_delay:.1f}s")
        elif what == "table traffic":
            live = self._tables()
            if live:
                t = rng.choice(live)
                rate, regions = self._traffic()
                api.update_spec(replace(t, write_rate=rate, region_count=regions))
                ctx.bump("table traffic")
                ctx.trace.add(f"  table {t.name}: writeRate={rate:g} regionCount={regions}")
        elif what == "changefeed delete":
            self.delete_changefeed()
        elif what == "api outage":
            # Every client cut off: seconds (nobody notices), past the captures' renew deadline (they pause),
            # or past their Lease and the maintainer's (nothing may be judged lost because of it).
            seconds = rng.choice([rng.uniform(1.0, 6.0), rng.uniform(6.0, 12.0), rng.uniform(12.0, 40.0)])
            api.outage_until = max(api.outage_until, ctx.now + seconds)
            ctx.bump("api outage")
            ctx.trace.add(f"  API OUTAGE: every client cut off for {seconds:.1f}s")
        elif what == "capture cut off":
            alive = caps.alive_names()
            if alive:
                name = rng.choice(alive)
                seconds = rng.uniform(2.0, 30.0)
                api.cut_until[name] = max(api.cut_until.get(name, 0.0), ctx.now + seconds)
                caps.all[name].own_fault = True
                ctx.bump("capture cut off")
                ctx.trace.add(f"  capture {name} cut off from the API for {seconds:.1f}s")
        elif what == "maintainer cut off":
            self.sim.partition_maintainer(rng.uniform(2.0, 30.0))
        elif what == "watch break":
            # One kind's watch of one maintainer breaks (a connection reset): that view stays as it was, in doubt,
            # until its LIST at its own moment; its deleted objects are still in it meanwhile.
            deciding = [m for m in self.sim.maintainers if m.alive]
            if deciding:
                # Mostly the newest (the leader); the view of a zombie is stale already.
                m = deciding[-1] if rng.random() < 0.7 else rng.choice(deciding)
                m.break_watch(rng.choice(RECORD_KINDS), rng.uniform(0.5, RELIST_SPREAD))
        elif what == "pause":
            cf = api.get(Kind.CHANGEFEED, CF)
            assert isinstance(cf, Changefeed)
            # Which flag, by a hash (not the seed's random stream: a history is as it was up to here).
            if zlib.crc32(f"{ctx.seed}/pause/{ctx.now}".encode()) % 2:  # replication paused (schedulers too), resumed
                api.update_spec(replace(cf, paused=not cf.paused))
                ctx.bump("pause" if not cf.paused else "resume")
                ctx.trace.add(f"  changefeed paused={not cf.paused}")
            else:  # the schedulers alone
                sched = replace(cf.scheduler, paused=not cf.scheduler.paused)
                api.update_spec(replace(cf, scheduler=sched))
                ctx.bump("schedulers paused" if sched.paused else "schedulers resumed")
                ctx.trace.add(f"  changefeed scheduler.paused={sched.paused}")
        elif what == "write faults":
            api.faults.p500 = rng.uniform(0.0, 0.15)
            api.faults.p409 = rng.uniform(0.0, 0.1)
            self.faults_until = ctx.now + rng.uniform(1.0, 6.0)
            ctx.bump("fault burst")
            ctx.trace.add(f"  write faults: 500 p={api.faults.p500:.2f}, 409 p={api.faults.p409:.2f}")

    def delete_changefeed(self) -> None:
        """``kubectl delete changefeed``: its teardown must stop replication and remove its objects."""
        ctx = self.ctx
        if ctx.cf_deleted_at is not None:
            return
        cf = ctx.api.get(Kind.CHANGEFEED, CF)
        ctx.cf_teardown = cf is not None and CHANGEFEED_FINALIZER in cf.finalizers
        ctx.api.delete(Kind.CHANGEFEED, CF, faulty=False)
        ctx.cf_deleted_at = ctx.now
        ctx.bump("changefeed delete")
        ctx.trace.add("  kubectl delete changefeed")

    # -- tables and spans ----------------------------------------------------------------------------

    def _tables(self) -> list[Table]:
        out = [t for t in self.ctx.api.store[Kind.TABLE].values() if isinstance(t, Table) and not t.deleting]
        return sorted(out, key=lambda t: t.name)

    def add_table(self, initial: bool) -> None:
        ctx, rng = self.ctx, self.ctx.rng
        tid = self.next_table
        self.next_table += 1
        pre = rng.choice([0, 0, 2, 3, 4])
        keys: tuple[bytes, ...] = ()
        if rng.random() < 0.15:
            rng_ = KeyRange.of_table(tid)
            keys = rng_.even_split_keys(rng.randint(2, 3))
            if rng.random() < 0.3:
                keys = (b"\x00",)  # invalid: outside the table; the maintainer ignores it with an Event
        start = 0 if initial or rng.random() < 0.5 else ctx.upstream()
        rate, regions = self._traffic()
        t = Table(
            name=f"t{tid}",
            changefeed=CF,
            table_id=tid,
            pre_split_spans=pre,
            pre_split_keys=keys,
            start_ts=start,
            write_rate=rate,
            region_count=regions,
        )
        ctx.api.create(t, faulty=False)
        ctx.table_start.setdefault(tid, start)
        ctx.bump("table add")
        ctx.trace.add(f"  kubectl apply table t{tid} preSplit={pre} keys={len(keys)} startTs={start}")
        if not initial and rng.random() < 0.3:
            self.user_span(tid)
        if rng.random() < 0.05 and not initial:
            # A second Table claiming the same ID: Invalid.
            dup = replace(t, name=f"t{tid}-dup")
            ctx.api.create(dup, faulty=False)
            ctx.trace.add(f"  kubectl apply table {dup.name} (duplicate id {tid})")

    def _traffic(self) -> tuple[float, int]:
        """A table's write rate and region count: mostly cold, sometimes hot enough to split."""
        rng = self.ctx.rng
        rate = rng.choice([0.0, 10.0, 50.0, 200.0, 1000.0])
        regions = rng.choice([0, 10, 40, 200])
        return rate, regions

    def user_span(self, table_id: int | None) -> None:
        ctx, rng = self.ctx, self.ctx.rng
        tables = self._tables()
        if table_id is None:
            if not tables:
                return
            table_id = rng.choice(tables).table_id
        whole = KeyRange.of_table(table_id)
        keys = whole.even_split_keys(4)
        i = rng.randint(0, len(keys) - 2)
        rng_ = KeyRange(keys[i], keys[i + 1])
        if rng.random() < 0.2:
            rng_ = KeyRange(keys[i], KeyRange.of_table(table_id + 1).end)  # invalid: crosses the table end
        mode = Mode.REDO if rng.random() < 0.2 else Mode.DEFAULT
        self.user_spans += 1
        s = Span(name=f"user-span-{self.user_spans}", changefeed=CF, table_id=table_id, mode=mode, key_range=rng_)
        ctx.api.create(s, faulty=False)
        ctx.bump("user span")
        ctx.trace.add(f"  kubectl apply span {s.name} table {table_id} {mode.value} {rng_}")

    def _accepted(self) -> list[Span]:
        live = {t.table_id for t in self._tables()}
        out = [
            s
            for s in self.ctx.api.store[Kind.SPAN].values()
            if isinstance(s, Span)
            and s.state not in (None, SpanState.INVALID)
            and not s.deleting
            and s.table_id in live
        ]
        return sorted(out, key=lambda s: (s.table_id, s.mode, s.key_range))

    # -- user operators ------------------------------------------------------------------------------

    def user_op(self) -> None:
        ctx, rng = self.ctx, self.ctx.rng
        spans = self._accepted()
        if not spans:
            return
        caps = self.sim.captures
        everyone = sorted(caps.all)
        alive = caps.alive_names()
        self.ops += 1
        name = f"user-op-{self.ops}"
        r = rng.random()
        span = rng.choice(spans)
        expect: Expect | None = None
        if r < 0.45:
            target = rng.choice(everyone if rng.random() < 0.15 else alive or everyone)
            op = SpanOperator(name=name, changefeed=CF, type=OpType.MOVE, spans=(span.name,), target=target)
            expect = Expect(OpType.MOVE, target=target)
            if rng.random() < 0.3:
                # Hold the Move in flight and kill the maintainer under it.
                if rng.random() < 0.5:
                    self.set_hook(target, PAUSE_CREATE, span.table_id)
                if span.capture and rng.random() < 0.5:
                    self.set_hook(span.capture, HOLD_CLOSE, span.table_id)
                self.sim.schedule_kill(rng.randint(0, 5), delay=rng.uniform(0.0, 2.5))
        elif r < 0.7:
            op, expect = self._split(name, span)
        elif r < 0.9:
            op, expect = self._merge(name, spans, span)
        elif r < 0.96:
            op = SpanOperator(name=name, changefeed=CF, type=OpType.REMOVE, spans=(span.name,))
        else:
            op = SpanOperator(name=name, changefeed=CF, type=OpType.MOVE, spans=("no-such-span",), target=everyone[0])
            expect = None
        op = replace(op, source=OpSource.USER)
        ctx.api.create(op, faulty=False)
        if expect is not None:
            self.expect[name] = expect
        ctx.bump("user op")
        ctx.trace.add(f"  kubectl apply {op.type.value} {name} spans={list(op.spans)} target={op.target!r}")
        if expect is not None and expect.type in (OpType.SPLIT, OpType.MERGE) and rng.random() < 0.08:
            self.outage(span)

    def outage(self, span: Span) -> None:
        """Every capture stops renewing its Lease under a Split or Merge: they fence themselves, and the
        new spans are made when no capture is live (the origin held closing, so it is still in RemoveOrigin
        then; a maintainer killed around then, half the time). A capture joins some time later."""
        ctx, rng, caps = self.ctx, self.ctx.rng, self.sim.captures
        if span.capture and rng.random() < 0.7:
            self.set_hook(span.capture, HOLD_CLOSE, span.table_id)
        for name in caps.alive_names():
            caps.all[name].renew_ok = False
            caps.all[name].own_fault = True  # their own silence, not the API's: their Leases may be taken
        self.join_at = ctx.now + rng.uniform(LEASE + 2.0, LEASE + 20.0)
        if rng.random() < 0.5:
            self.sim.schedule_kill(rng.randint(0, 6), delay=rng.uniform(LEASE - 3.0, LEASE + 3.0))
        ctx.bump("capture outage")
        ctx.trace.add(f"  every capture's Lease renewals start failing; one joins at t={self.join_at:.1f}")

    def _split(self, name: str, span: Span) -> tuple[SpanOperator, Expect | None]:
        rng = self.ctx.rng
        kr = span.key_range
        n = rng.randint(2, 4)
        try:
            even = kr.even_split_keys(n)
        except KeyError_:
            even = ()
        if rng.random() < 0.4 and even:
            keys = even[: rng.randint(1, len(even))]
            if rng.random() < 0.15:
                keys = (kr.end + b"\x01",)  # invalid: outside the span
                return SpanOperator(
                    name=name, changefeed=CF, type=OpType.SPLIT, spans=(span.name,), split_keys=keys
                ), None
            op = SpanOperator(name=name, changefeed=CF, type=OpType.SPLIT, spans=(span.name,), split_keys=keys)
            return op, Expect(OpType.SPLIT, ranges=kr.split_at(keys))
        op = SpanOperator(name=name, changefeed=CF, type=OpType.SPLIT, spans=(span.name,), split_into=n)
        return op, (Expect(OpType.SPLIT, ranges=kr.split_at(even)) if even else None)

    def _merge(self, name: str, spans: list[Span], span: Span) -> tuple[SpanOperator, Expect | None]:
        rng = self.ctx.rng
        same = [s for s in spans if s.table_id == span.table_id and s.mode == span.mode]
        i = same.index(span)
        k = rng.randint(2, 3)
        group = same[i : i + k]
        if rng.random() < 0.15 and len(same) >= 3:
            group = [same[0], same[-1]]  # usually not adjacent: must fail
        if len(group) < 2:
            group = [span, span] if rng.random() < 0.5 else [span]
        names = tuple(s.name for s in group)
        op = SpanOperator(name=name, changefeed=CF, type=OpType.MERGE, spans=names)
        ordered = sorted(group, key=lambda s: s.key_range)
        adjacent = len(set(names)) == len(names) >= 2 and all(
            a.key_range.end == b.key_range.start for a, b in itertools.pairwise(ordered)
        )
        if not adjacent:
            return op, None
        union = KeyRange(ordered[0].key_range.start, ordered[-1].key_range.end)
        return op, Expect(OpType.MERGE, ranges=(union,), sources=names, source_uids=tuple(s.uid for s in group))

    # -- hooks -------------------------------------------------------------------------------------

    def set_hook(self, capture: str, hook: str, table_id: int | None) -> None:
        cap = self.sim.captures.all.get(capture)
        if cap is None:
            return
        cap.hooks[hook] = () if table_id is None else (table_id,)
        self.ctx.bump("hook")
        self.ctx.trace.add(f"  hook {hook!r} on {capture} for {'all tables' if table_id is None else table_id}")

    def hook(self) -> None:
        rng = self.ctx.rng
        caps = self.sim.captures
        alive = caps.alive_names()
        if not alive:
            return
        cap = caps.all[rng.choice(alive)]
        if cap.hooks and rng.random() < 0.6:
            hook = sorted(cap.hooks)[0]
            del cap.hooks[hook]
            self.ctx.trace.add(f"  hook {hook!r} released on {cap.name}")
            return
        tables = self._tables()
        scope = rng.choice(tables).table_id if tables and rng.random() < 0.5 else None
        self.set_hook(cap.name, rng.choice([HOLD_CLOSE, PAUSE_CREATE]), scope)
