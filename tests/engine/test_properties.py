"""Property tests: random histories driven through ``decide`` with the in-memory applier of fixtures.Store.

Events: tables added and deleted, user move/split/merge/remove, spans applied by hand, dispatchers
failing, captures lost and joining, the maintainer restarting with its memory dropped (sometimes mid-decision),
decisions applied from a lagging snapshot, dispatchers progressing.
After every step:

- invariant 1: no overlap that an in-flight operator does not explain (and coverage once at rest);
- invariant 2: at most one Initializing/Working dispatcher per key on live captures;
- invariant 5: every new dispatcher starts at or below the highest checkpoint already reached on each of its
  keys; the changefeed checkpoint never decreases;
- invariant 7: Running operators stay within maxInFlightOperators.

Status writes carry resourceVersion preconditions (a 409 aborts the rest of the chain).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.engine import invariants
from controller.engine.maintainer import Memory, decide
from controller.model.keys import KeyRange
from controller.model.records import Capture, Changefeed, Dispatcher, SchedulerConfig, Span, SpanOperator
from controller.model.states import LIVE_DISPATCHER_STATES, DispatcherState, Kind, OpPhase, OpType, SpanState
from tests.engine.fixtures import Store, table

CAPTURES = ("c0", "c1", "c2")

event = st.one_of(
    st.tuples(st.just("add_table"), st.integers(1, 3)),
    st.tuples(st.just("delete_table"), st.integers(0, 5)),
    st.tuples(st.just("move"), st.integers(0, 20), st.sampled_from(CAPTURES)),
    st.tuples(st.just("split"), st.integers(0, 20), st.integers(2, 3)),
    st.tuples(st.just("merge"), st.integers(0, 20)),
    st.tuples(st.just("remove"), st.integers(0, 20)),
    st.tuples(st.just("lose"), st.sampled_from(CAPTURES)),
    st.tuples(st.just("join"), st.sampled_from(CAPTURES)),
    st.tuples(st.just("restart"), st.sampled_from([None, 0, 1, 2, 3, 5])),
    st.tuples(st.just("steps"), st.integers(1, 4)),
    st.tuples(st.just("lagging"), st.integers(1, 3)),
    st.tuples(st.just("delete_span"), st.integers(0, 20)),  # kubectl delete span
    st.tuples(st.just("user_span"), st.integers(0, 5), st.integers(1, 4), st.integers(0, 3)),
    st.tuples(st.just("dispatcher_fails"), st.integers(0, 20)),
    # ("zombie", n) is handled but not generated: a deposed leader's late writes can exceed the in-flight bound,
    # a documented limitation (docs/architecture.md, Fencing); the simulator covers zombies with that allowance.
)


class Harness:
    def __init__(self, limit: int, redo: bool = False) -> None:
        self.st = Store(strict=True)
        cfg = SchedulerConfig(max_in_flight_operators=limit)
        self.st.add(Changefeed(name="cf", start_ts=100, redo=redo, scheduler=cfg))
        for c in CAPTURES:
            self.st.add(Capture(name=c, renew_time=self.st.now, lease_duration=15.0))
        self.mem = Memory(epoch=1, identity="m1")
        self.table_ids = itertools.count(1)
        self.op_ids = itertools.count(1)
        self.reached: dict[str, tuple[KeyRange, str, int]] = {}  # dispatcher -> (range, mode, max checkpoint)
        self.cf_checkpoint = 0

    # -- events ----------------------------------------------------------------------------------------

    def spans(self) -> list[Span]:
        out = [s for s in self.st.of(Kind.SPAN).values() if isinstance(s, Span)]
        return sorted(out, key=lambda s: (s.table_id, s.mode, s.key_range))

    def user_op(self, type_: OpType, spans: tuple[str, ...], **kw: object) -> None:
        name = f"user-{next(self.op_ids)}"
        self.st.add(SpanOperator(name=name, changefeed="cf", type=type_, spans=spans, created=self.st.now, **kw))

    def handle(self, ev: tuple) -> None:
        kind = ev[0]
        spans = self.spans()
        if kind == "add_table":
            tid = next(self.table_ids)  # never re-use an ID: a re-created table starts afresh
            self.st.add(table(tid, finalizers=(), state="", pre_split_spans=ev[1], created=self.st.now))
        elif kind == "delete_table":
            tables = sorted(self.st.of(Kind.TABLE).values(), key=lambda t: t.name)
            if tables:
                t = tables[ev[1] % len(tables)]
                if t.finalizers:
                    self.st.put(replace(t, deleting=True))
                else:
                    del self.st.objects[(Kind.TABLE, t.name)]
        elif kind in ("move", "split", "remove") and spans:
            s = spans[ev[1] % len(spans)]
            if kind == "move":
                self.user_op(OpType.MOVE, (s.name,), target=ev[2])
            elif kind == "split":
                self.user_op(OpType.SPLIT, (s.name,), split_into=ev[2])
            else:
                self.user_op(OpType.REMOVE, (s.name,))
        elif kind == "merge" and len(spans) > 1:
            i = ev[1] % (len(spans) - 1)
            self.user_op(OpType.MERGE, (spans[i].name, spans[i + 1].name))
        elif kind == "delete_span" and spans:  # kubectl delete span
            del self.st.objects[(Kind.SPAN, spans[ev[1] % len(spans)].name)]
        elif kind == "user_span":  # kubectl apply of a span: piece ev[3] of the table cut in ev[2]
            tables = sorted(self.st.of(Kind.TABLE).values(), key=lambda t: t.name)
            if tables:
                t = tables[ev[1] % len(tables)]
                rngs = t.key_range.split_at(t.key_range.even_split_keys(ev[2])) if ev[2] > 1 else (t.key_range,)
                rng = rngs[ev[3] % len(rngs)]
                name = f"user-span-{next(self.op_ids)}"
                self.st.add(Span(name=name, changefeed="cf", table_id=t.table_id, key_range=rng, created=self.st.now))
        elif kind == "dispatcher_fails":  # a dispatcher stops on its own (error); its checkpoint is final
            ds = sorted(self.st.of(Kind.DISPATCHER).values(), key=lambda d: d.name)
            if ds:
                d = ds[ev[1] % len(ds)]
                self.st.put(replace(d, state=DispatcherState.STOPPED))
        elif kind == "lose":
            c = self.st.get(Kind.CAPTURE, ev[1])
            self.st.lost.add(ev[1])
            self.st.put(replace(c, renew_time=self.st.now - 100.0))  # type: ignore[type-var]
        elif kind == "join":
            self.st.lost.discard(ev[1])
            c = self.st.get(Kind.CAPTURE, ev[1])
            # A new incarnation of the capture takes its Lease back (a taken one included).
            self.st.put(replace(c, renew_time=self.st.now, lease_taken=False))  # type: ignore[type-var]
        elif kind == "restart":
            if ev[1] is not None:  # killed in the middle of applying a decision
                dec = decide(self.st.world(), self.mem)
                for chain in dec.chains:
                    self.check_new(self.st.apply_chain(chain, ev[1]))
            self.mem = Memory(epoch=self.mem.epoch + 1, identity=f"m{self.mem.epoch + 1}")
        elif kind == "zombie":  # a deposed leader's decision lands after the new leader made ev[1] decisions
            old = decide(self.st.world(), self.mem)
            self.mem = Memory(epoch=self.mem.epoch + 1, identity=f"m{self.mem.epoch + 1}")
            for _ in range(ev[1]):
                self.step()
            for chain in old.chains:
                self.check_new(self.st.apply_chain(chain))
            self.check_world()
        elif kind == "steps":
            for _ in range(ev[1]):
                self.step()
        elif kind == "lagging":  # decisions made from a snapshot the captures moved on from before it is applied
            for _ in range(ev[1]):
                self.step(lagging=True)
        self.step()

    # -- one step and the checks -----------------------------------------------------------------------

    def step(self, lagging: bool = False) -> None:
        dec = decide(self.st.world(), self.mem)
        self.mem = dec.memory
        if lagging:
            self.st.captures_step()
            self.record_reached()
        for chain in dec.chains:
            self.check_new(self.st.apply_chain(chain))
        self.check_world()
        self.st.captures_step()
        self.st.now += 0.5
        self.record_reached()
        self.check_world()

    def record_reached(self) -> None:
        for d in self.st.of(Kind.DISPATCHER).values():
            assert isinstance(d, Dispatcher)
            if d.state in LIVE_DISPATCHER_STATES or d.name in self.reached:
                prev = self.reached.get(d.name, (d.key_range, d.mode, 0))[2]
                self.reached[d.name] = (d.key_range, d.mode, max(prev, d.known_checkpoint))

    def check_new(self, made: list[Dispatcher]) -> None:
        """Invariant 5: on every key of a new dispatcher, some predecessor reached at least its start ts."""
        for d in made:
            preds = [(r, cp) for n, (r, m, cp) in self.reached.items() if m == d.mode and r.overlaps(d.key_range)]
            if not preds:
                continue
            bounds = sorted(
                {d.key_range.start, d.key_range.end}
                | {k for r, _ in preds for k in (r.start, r.end) if d.key_range.start < k < d.key_range.end}
            )
            for lo, hi in itertools.pairwise(bounds):
                seg = KeyRange(lo, hi)
                cps = [cp for r, cp in preds if r.contains_range(seg)]
                assert not cps or d.start_ts <= max(cps), (
                    f"gap: dispatcher {d.name} starts at {d.start_ts} but keys {seg} reached only {max(cps)}"
                )

    def check_world(self) -> None:
        w = self.st.world()
        assert invariants.unexplained_overlaps(w) == []
        assert invariants.single_owner(self.st.live_dispatchers()) == []
        assert invariants.bounded(w) == []
        cp = w.changefeed.checkpoint_ts
        assert cp >= self.cf_checkpoint, f"changefeed checkpoint went back from {self.cf_checkpoint} to {cp}"
        self.cf_checkpoint = cp
        # ... and never passes what any span of a live table is known to have reached
        live = {t.table_id for t in w.tables.values() if not t.deleting and t.state != "Invalid"}
        for s in w.spans.values():
            if s.state in (None, SpanState.INVALID) or s.deleting or s.table_id not in live:
                continue
            if s.mode not in w.changefeed.modes:
                continue
            d = w.dispatchers.get(s.dispatcher)
            reached = max(s.known_checkpoint, d.known_checkpoint if d is not None else 0)
            recorded = [
                o.checkpoint_ts for op in w.operators.values() if op.in_flight for o in op.origins if o.span == s.name
            ]
            reached = max(reached, min(recorded, default=0))  # a closed origin's final checkpoint, as recorded
            assert cp <= reached, f"changefeed checkpoint {cp} passed span {s.name} ({s.state}) at {reached}"

    def settle(self) -> list[str]:
        """Faults stop; lost captures stay lost (the maintainer must release their dispatchers) unless none is
        left, in which case c0 comes back."""
        if all(c in self.st.lost for c in CAPTURES):
            self.handle(("join", "c0"))
        for _ in range(300):  # with maxInFlightOperators=1 every span is placed one at a time
            self.step()
            w = self.st.world()
            if not any(op.phase in (OpPhase.PENDING, OpPhase.RUNNING) for op in w.operators.values()) and (
                invariants.settled(w) == []
            ):
                break
        return invariants.settled(self.st.world())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(event, min_size=1, max_size=30), limit=st.sampled_from([1, 2, 100]), redo=st.booleans())
def test_random_histories_keep_invariants(events, limit, redo):
    h = Harness(limit, redo)
    h.handle(("add_table", 2))
    h.handle(("steps", 4))
    for ev in events:
        h.handle(ev)
    assert h.settle() == []
    # at rest: coverage holds for every live table
    assert invariants.coverage(h.st.world()) == []
    assert all(s.state is SpanState.REPLICATING for s in h.spans() if s.state is not SpanState.INVALID)


def test_random_history_with_span_deleted_by_hand_settles():
    """A falsifying example hypothesis once found: split a span, let the children start, delete one child by
    hand (its dispatcher was adopted by the hole span and settled() disagreed)."""
    h = Harness(limit=1)
    h.handle(("add_table", 2))
    h.handle(("steps", 4))
    h.handle(("split", 0, 2))
    h.handle(("steps", 3))
    first = h.spans()[0]
    del h.st.objects[(Kind.SPAN, first.name)]
    h.step()
    assert h.settle() == []
