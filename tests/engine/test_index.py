"""The engine's index (engine/index.py): kept per event, it must always be what a rebuild from its records
gives, and a decision over it must be the decision over everything (the simulator checks both over whole
histories; these are the direct cases)."""

from __future__ import annotations

import random
import sys
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from controller.engine.containers import MinTracker, MultiMap
from controller.engine.index import Index
from controller.engine.maintainer import decide
from controller.engine.world import World
from controller.model.keys import KeyRange
from controller.model.records import Changefeed, Dispatcher, SchedulerConfig, Span, SpanOperator, Table
from controller.model.states import (
    TABLE_FINALIZER,
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
)
from controller.sim.index_check import verify
from tests.engine.fixtures import EPOCH, IDENTITY, capture, memory

CF = "cf"


class Tracked:
    """A MinTracker with the map of what each entry was (what the index keeps in its facts)."""

    def __init__(self) -> None:
        self.m = MinTracker()
        self.was: dict[str, int] = {}

    def set(self, name: str, value: int | None) -> None:
        self.m.set(name, value, self.was.get(name))
        if value is None:
            self.was.pop(name, None)
        else:
            self.was[name] = value


def test_min_tracker_follows_updates_and_exclusions() -> None:
    t = Tracked()
    m = t.m
    for name, value in (("a", 5), ("b", 3), ("c", 9)):
        t.set(name, value)
    assert m.min_excluding() == 3
    assert m.min_excluding({"b"}) == 5
    t.set("b", 10)  # raised: its old entry is stale
    assert m.min_excluding() == 5
    t.set("a", None)
    assert m.min_excluding() == 9
    assert m.min_excluding({"b", "c"}) is None
    assert m.min_excluding({"c"}) == 10  # what was excluded is put back
    for i in range(500):  # many updates: the minimum stays right
        t.set("c", 1000 - i)
    assert m.min_excluding() == 10
    t.set("b", None)
    assert m.min_excluding() == 501
    assert m.values == {"c": 501}
    assert len(m) == 1


@given(
    ops=st.lists(st.tuples(st.sampled_from("abcdef"), st.one_of(st.none(), st.integers(0, 20))), max_size=60),
    exclude=st.sets(st.sampled_from("abcdef")),
)
def test_min_tracker_is_the_minimum_of_its_values(ops: list[tuple[str, int | None]], exclude: set[str]) -> None:
    t, model = Tracked(), {}
    m = t.m
    for name, value in ops:
        t.set(name, value)
        if value is None:
            model.pop(name, None)
        else:
            model[name] = value
        assert m.values == model
        assert m.min_excluding() == min(model.values(), default=None)
        assert m.min_excluding(exclude) == min((v for n, v in model.items() if n not in exclude), default=None)


class _Counted(int):
    """An int whose comparisons are counted (a tuple compares its elements with these)."""

    compared = 0

    def __lt__(self, other: object) -> bool:
        _Counted.compared += 1
        return int(self) < int(other)  # type: ignore[call-overload]

    def __eq__(self, other: object) -> bool:
        _Counted.compared += 1
        return isinstance(other, int) and int(self) == int(other)

    __hash__ = int.__hash__


def test_no_min_tracker_update_passes_over_every_entry() -> None:
    """At 100,000 spans the heap it used to keep was rebuilt whole every so many updates: one C call over every
    entry, up to 73 ms of a held event loop during a placement. No single update may compare more than a few
    dozen entries now (5,000 entries here; a rebuild compared thousands)."""
    rng = random.Random(7)
    t = Tracked()
    names = [f"s{i}" for i in range(5000)]
    for n in names:
        t.set(n, _Counted(rng.randrange(10**6)))
    worst = 0
    for _ in range(20_000):
        name = rng.choice(names)
        value = _Counted(rng.randrange(10**6))
        _Counted.compared = 0
        t.m.set(name, value, t.was.get(name))
        t.was[name] = value
        worst = max(worst, _Counted.compared)
    assert worst <= 200, worst
    assert t.m.min_excluding() == min(t.was.values())
    assert t.m.values == t.was


def test_multimap_keeps_a_lone_name_without_a_set() -> None:
    m = MultiMap()
    m.add("k", "a")
    assert list(m.get("k")) == ["a"]
    m.add("k", "b")
    assert set(m.get("k")) == {"a", "b"}
    m.discard("k", "a")
    assert list(m.get("k")) == ["b"]
    m.discard("k", "b")
    assert "k" not in m
    assert list(m.get("k")) == []


def _records(rng: random.Random, now: float) -> list[object]:
    """A random world: two tables (one split in two spans), dispatchers in every state, operators."""
    out: list[object] = [Changefeed(name=CF, redo=rng.random() < 0.5)]
    for tid in (1, 2, 3):
        out.append(
            Table(
                name=f"t{tid}",
                changefeed=CF,
                table_id=tid,
                deleting=rng.random() < 0.2,
                finalizers=(TABLE_FINALIZER,) if rng.random() < 0.7 else (),
                created=float(tid),
            )
        )
    for tid in (1, 2, 4):
        rng_t = KeyRange.of_table(tid)
        parts = rng_t.split_at(rng_t.even_split_keys(2)) if rng.random() < 0.5 else (rng_t,)
        for i, part in enumerate(parts):
            state = rng.choice([None, *SpanState])
            name = f"s{tid}-{i}"
            d = f"d{tid}-{i}"
            out.append(
                Span(
                    name=name,
                    changefeed=CF,
                    table_id=tid,
                    mode=rng.choice(list(Mode)),
                    key_range=part,
                    state=state,
                    capture=rng.choice(["", "c0", "c1"]),
                    # Its own dispatcher, mostly; or the other half's (adopted, or named before it is re-made).
                    dispatcher=rng.choice([d, d, d, f"d{tid}-{1 - i}"]) if rng.random() < 0.8 else "",
                    checkpoint_ts=rng.randint(100, 200),
                    operator=rng.choice(["", "op"]),
                    deleting=rng.random() < 0.1,
                )
            )
            if rng.random() < 0.8:
                out.append(
                    Dispatcher(
                        name=d,
                        changefeed=CF,
                        span=name if rng.random() < 0.9 else "gone",
                        table_id=tid,
                        key_range=part,
                        capture=rng.choice(["c0", "c1", "c9"]),
                        start_ts=100,
                        epoch=1,
                        state=rng.choice(list(DispatcherState)),
                        checkpoint_ts=rng.randint(100, 300),
                        write_rate=rng.choice([0.0, 50.0, 500.0]),
                        deleting=rng.random() < 0.1,
                    )
                )
    for i in range(3):
        out.append(
            SpanOperator(
                name=f"op{i}",
                changefeed=CF,
                type=rng.choice([OpType.MOVE, OpType.REMOVE]),
                spans=("s1-0",),
                target="c1",
                phase=rng.choice(list(OpPhase)),
                source=rng.choice(list(OpSource)),
                finished_at=now - rng.choice([0, 400, 4000]),
            )
        )
    return out


def test_an_index_kept_per_event_is_a_rebuilt_one() -> None:
    """Random puts and removes, in random order: after each, the index equals a rebuild from its records."""
    for seed in range(30):
        rng = random.Random(seed)
        index = Index(CF)
        for _ in range(6):
            records = _records(rng, 1000.0)
            rng.shuffle(records)
            for rec in records:
                if rng.random() < 0.15:
                    index.remove(rec.kind, rec.name)  # type: ignore[attr-defined]
                else:
                    index.put(rec)  # type: ignore[arg-type]
                assert verify(index) == [], f"seed {seed}"


def test_a_decision_over_the_index_is_the_decision_over_everything() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        records = _records(rng, 1000.0)
        cf = next(r for r in records if isinstance(r, Changefeed))
        cf = replace(cf, epoch=EPOCH, holder=IDENTITY, scheduler=SchedulerConfig(split_write_threshold=100.0))
        records = [cf if isinstance(r, Changefeed) else r for r in records]
        index = Index.build(CF, records)  # type: ignore[arg-type]
        world = World(
            now=1000.0,
            changefeed=cf,
            tables=index.tables,
            spans=index.spans,
            dispatchers=index.dispatchers,
            operators=index.operators,
            captures={c.name: c for c in (capture("c0"), capture("c1", alive=rng.random() < 0.5))},
            index=index,
        )
        mem = replace(memory(), audited_at=1000.0)  # audited just now: no audit due
        incremental = decide(world, mem)
        full = decide(replace(world, index=None), mem)
        assert not incremental.full
        assert full.full
        assert incremental.chains == full.chains, f"seed {seed}"
        assert incremental.repairs == full.repairs
        assert replace(incremental.memory, audited_at=0.0) == replace(full.memory, audited_at=0.0)


def test_the_audit_is_full_every_interval() -> None:
    cf = Changefeed(name=CF, epoch=EPOCH, holder=IDENTITY)
    index = Index.build(CF, [cf])
    world = World(now=1000.0, changefeed=cf, index=index)
    first = decide(world, memory(bootstrapped=False))
    assert not first.full  # the term's first decision counts as the last audit
    assert first.memory.audited_at == 1000.0
    assert first.next_due is not None
    assert first.next_due <= 1300.0
    later = decide(replace(world, now=1299.0), first.memory)
    assert not later.full
    due = decide(replace(world, now=1300.0), first.memory)
    assert due.full
    assert due.memory.audited_at == 1300.0


def test_removal_of_an_unknown_name_changes_nothing() -> None:
    index = Index(CF)
    for kind in (Kind.SPAN, Kind.DISPATCHER, Kind.OPERATOR, Kind.TABLE):
        index.remove(kind, "nothing")
    assert verify(index) == []
    assert index.empty()


def test_an_update_touches_only_the_maps_whose_membership_changed() -> None:
    """A refresh used to take a record's entries out of every map keyed by name and put them back. A dict or
    set of 100,000 names that churns so grows a fresh table now and then though its size never changes (about
    10 MB, first touched then): 40-80 ms in one write-through at 100,000 spans (issue 25). Here 1,000
    Replicating spans on one capture, their checkpoints and their dispatchers' Working state moved 20,000
    times: no name-keyed table is ever rebuilt."""
    from tests.engine import fixtures as F

    idx = Index("cf")
    idx.put(F.table(1))
    spans, disps = [], []
    for i, kr in enumerate(F.pieces(1, 1000)):
        sp = F.span(f"s-{i}", table_id=1, key_range=kr, capture="c0", dispatcher=f"d-{i}")
        d = F.dispatcher(f"d-{i}", sp, "c0")
        idx.put(sp)
        idx.put(d)
        spans.append(sp)
        disps.append(d)

    def tables() -> dict[str, int]:
        maps = {
            "span_facts": idx.span_facts,
            "dispatcher_facts": idx.dispatcher_facts,
            "foreign_naming": idx.foreign_naming._d,
            "loose_by_span": idx.loose_by_span._d,
            "spans on c0": idx.spans_by_capture["c0"],
            "dispatchers on c0": idx.disp_by_capture["c0"],
        }
        return {k: sys.getsizeof(v) for k, v in maps.items()}

    before = tables()
    rng = random.Random(3)
    for _ in range(20_000):
        k = rng.randrange(len(spans))
        spans[k] = spans[k].evolve(checkpoint_ts=spans[k].checkpoint_ts + 1)
        state = DispatcherState.INITIALIZING if disps[k].state is DispatcherState.WORKING else DispatcherState.WORKING
        disps[k] = disps[k].evolve(state=state)
        idx.put(spans[k])
        idx.put(disps[k])
    assert tables() == before
    fresh = Index("cf")
    for rec in (F.table(1), *spans, *disps):
        fresh.put(rec)  # type: ignore[arg-type]
    assert idx.span_facts == fresh.span_facts
    assert idx.dispatcher_facts == fresh.dispatcher_facts


def test_each_span_and_dispatcher_is_held_once() -> None:
    """Issue 37: the records live in the maps of their facts (``spans`` and ``dispatchers`` read them there), a
    span's own dispatcher is found through the span and the span through it, so the only maps of the index with an
    entry per span or per dispatcher are those of the facts. Before, the records and the dispatchers by span were
    more: at 100,000 dispatchers, three tables doubled in one write-through (2,817 page faults in one callback),
    and a span created placed doubled its facts' and the spans by dispatcher (1,879)."""
    from tests.engine import fixtures as F

    n = 1200
    idx = Index(F.CF)
    idx.put(F.changefeed())
    captures = ("c0", "c1", "c2", "c3")
    for t in range(1, 5):
        idx.put(F.table(t))
        for i, kr in enumerate(F.pieces(t, n // 4)):
            sp = F.span(f"s-{t}-{i}", table_id=t, key_range=kr, capture=captures[i % 4], dispatcher=f"d-{t}-{i}")
            idx.put(F.dispatcher(f"d-{t}-{i}", sp, captures[i % 4]))
            idx.put(sp)

    def full_size(obj: object, path: str, out: set[str]) -> None:
        for attr in getattr(type(obj), "__slots__", ()) or vars(obj):
            value = getattr(obj, attr)
            if isinstance(value, (dict, set)) and len(value) >= n:
                out.add(path + attr)
            if isinstance(value, dict) and len(value) < n:
                for key, inner in value.items():
                    if isinstance(inner, (dict, set)) and len(inner) >= n:
                        out.add(f"{path}{attr}[{key}]")
            if isinstance(value, MultiMap):
                full_size(value, path + attr + ".", out)

    found: set[str] = set()
    full_size(idx, "", found)
    assert found == {"span_facts", "dispatcher_facts"}
    assert len(idx.spans) == len(idx.dispatchers) == n
    assert idx.dispatchers_of("s-1-0") == ["d-1-0"]
    assert idx.spans_naming("d-1-0") == ["s-1-0"]
    assert not idx.loose_by_span
    assert not idx.foreign_naming
    assert verify(idx) == []
