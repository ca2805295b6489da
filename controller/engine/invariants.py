"""The invariants of docs/architecture.md as functions that return violations (empty: all hold).

They read plain records, so the unit tests, the simulator, the integration tests and the e2e suite
all check the same thing, each from its own source of truth.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable

from controller.engine.world import World, is_placement
from controller.model.keys import gaps, overlapping_pairs
from controller.model.records import Dispatcher, Span
from controller.model.states import DispatcherState, Mode, OpPhase, SpanState


def _accepted(world: World) -> dict[tuple[int, Mode], list[Span]]:
    out: dict[tuple[int, Mode], list[Span]] = defaultdict(list)
    for s in world.spans.values():
        if s.accepted:
            out[(s.table_id, s.mode)].append(s)
    return out


def _live_tables(world: World) -> list[tuple[int, str]]:
    """(table ID, Table name) of the live tables: the first Table object per ID, if not deleting."""
    first: dict[int, tuple[float, str, bool]] = {}
    for t in world.tables.values():
        if t.changefeed != world.changefeed.name:
            continue
        if t.table_id not in first or (t.created, t.name) < first[t.table_id][:2]:
            first[t.table_id] = (t.created, t.name, t.deleting)
    return sorted((tid, name) for tid, (_, name, deleting) in first.items() if not deleting)


def coverage(world: World) -> list[str]:
    """Invariant 1 (at rest): each live table's spans partition its key range, per enabled mode.

    This is the simulator's oracle, written apart from the engine's rule on purpose: it must not call
    engine/coverage.py, or a bug there would be in both the decision and its check and go unseen."""
    problems = []
    accepted = _accepted(world)
    for table_id, name in _live_tables(world):
        table = world.tables[name]
        for mode in world.changefeed.modes:
            spans = accepted.get((table_id, mode), [])
            for hole in gaps(table.key_range, [s.key_range for s in spans]):
                problems.append(f"coverage: table {name} ({mode}) has a hole {hole}")
            for a, b in overlapping_pairs([(s.name, s.key_range) for s in spans]):
                problems.append(f"coverage: table {name} ({mode}) spans {a} and {b} overlap")
    return problems


def unexplained_overlaps(world: World, ignore: Collection[str] = ()) -> list[str]:
    """Invariant 1 (always): overlapping accepted spans are all owned by one in-flight operator."""
    owner: dict[str, set[str]] = defaultdict(set)
    for op in world.operators.values():
        if op.in_flight:
            for s in (*op.spans, *(t.span for t in op.targets)):
                owner[s].add(op.name)
    problems = []
    for (table_id, mode), spans in _accepted(world).items():
        for a, b in overlapping_pairs([(s.name, s.key_range) for s in spans]):
            if not owner[a] & owner[b] and a not in ignore and b not in ignore:
                problems.append(f"overlap: spans {a} and {b} of table {table_id} ({mode}) overlap with no operator")
    return problems


def single_owner(live: Iterable[Dispatcher]) -> list[str]:
    """Invariant 2: at most one live (Initializing or Working) dispatcher per key per mode.

    ``live`` is whatever the caller knows to be running: the simulator passes the dispatchers its
    captures actually run; tests reading resources pass the ones reported Initializing or Working
    on a live capture.
    """
    by_mode: dict[Mode, list[tuple[str, Dispatcher]]] = defaultdict(list)
    for d in live:
        by_mode[d.mode].append((d.name, d))
    problems = []
    for mode, ds in by_mode.items():
        ranges = {name: d for name, d in ds}
        for a, b in overlapping_pairs([(n, d.key_range) for n, d in ds]):
            problems.append(
                f"single owner: dispatchers {a} (on {ranges[a].capture}) and {b} (on {ranges[b].capture}) "
                f"both run keys of {ranges[a].key_range} ∩ {ranges[b].key_range} ({mode})"
            )
    return problems


def bounded(world: World, ignore: Collection[str] = (), ignore_spans: Collection[str] = ()) -> list[str]:
    """Invariant 7: Running operators and placements in flight (placement.py) never exceed
    ``maxInFlightOperators``.

    ``ignore``: operators to leave out of the count, ``ignore_spans``: placements (by span) to leave out
    (the simulator passes the ones a superseded maintainer started during a failover; see
    docs/architecture.md, Fencing).
    """
    running = sum(1 for op in world.operators.values() if op.phase is OpPhase.RUNNING and op.name not in ignore)
    placing = sum(1 for s in world.spans.values() if is_placement(s) and s.name not in ignore_spans)
    limit = world.changefeed.scheduler.max_in_flight_operators
    if running + placing > limit:
        return [f"bounded: {running} operators Running and {placing} placements in flight, limit {limit}"]
    return []


def settled(world: World) -> list[str]:
    """Invariants 3 and 4 at the end of a history (faults stopped, time advanced, a capture alive).

    Every operator terminal; every span of a live table Replicating on exactly one Working dispatcher
    of a live capture; coverage exact; deleted tables without spans or dispatchers; no dispatcher
    without a span.
    """
    problems = [
        f"lost operator: {op.name} ({op.type}) still {op.phase} in {op.stage}"
        for op in world.operators.values()
        if op.in_flight
    ]
    live_ids = {tid for tid, _ in _live_tables(world)}
    # A span may claim, through status.dispatcher, an orphan it adopted (its spec names a gone span).
    adopted = {
        s.dispatcher: s.name
        for s in world.spans.values()
        if s.dispatcher in world.dispatchers and world.dispatchers[s.dispatcher].span not in world.spans
    }
    by_span: dict[str, list[Dispatcher]] = defaultdict(list)
    for d in world.dispatchers.values():
        owner = d.span if d.span in world.spans else adopted.get(d.name)
        if owner is None:
            problems.append(f"orphan: dispatcher {d.name} has no span ({d.span})")
        else:
            by_span[owner].append(d)
        if d.table_id not in live_ids:
            problems.append(f"deleted table: dispatcher {d.name} of table {d.table_id} remains")
    for s in world.spans.values():
        if s.state is SpanState.INVALID:
            continue
        if s.table_id not in live_ids:
            problems.append(f"deleted table: span {s.name} of table {s.table_id} remains")
            continue
        if s.state is not SpanState.REPLICATING:
            problems.append(f"liveness: span {s.name} is {s.state}, not Replicating")
            continue
        ds = by_span.get(s.name, [])
        working = [d for d in ds if d.state is DispatcherState.WORKING and not d.deleting]
        if len(ds) != 1 or len(working) != 1 or working[0].name != s.dispatcher:
            problems.append(
                f"liveness: span {s.name} names {s.dispatcher!r} but has dispatchers "
                f"{sorted((d.name, d.state.value) for d in ds)}"
            )
        elif not world.captures.get(working[0].capture) or not world.captures[working[0].capture].alive(world.now):
            problems.append(f"liveness: span {s.name} runs on lost capture {working[0].capture}")
    return problems + coverage(world) + bounded(world)
