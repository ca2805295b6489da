"""The drain and balance schedulers, and the scheduler status that says what they are doing.

Drain (every tick, within ``drainBatchSize`` and ``maxInFlightOperators``): every Replicating span on
a live capture with ``spec.draining: true`` gets a Move to the least-loaded schedulable capture. It
runs while other operators are in flight (an operator already on one of its spans is waited for).

Balance (every ``balanceIntervalSeconds``, TiCDC's 15 s): only when nothing is absent, no operator
is in flight, no repair was needed this tick, and no drain is under way or cooling down. It moves
spans from the fullest schedulable captures to the emptiest (those under the floor of the mean
first) until every capture holds the floor or the ceiling of the mean, at most ``balanceMaxMoves``
a round. A round is tried again on the next tick if it could not run; the
interval counts from the last round that ran (or from the start of the maintainer's term).

The status (``Changefeed.status.scheduler``) is the durable part: a drain that finished starts a
cool-down of ``drainCooldownSeconds`` whose end is written into the status, so a maintainer that
takes over mid-cool-down honours it.
"""

from __future__ import annotations

from controller.engine import controller
from controller.engine.scheduler import fresh_operator_name, movable, room, scheduler_operator
from controller.engine.world import Tick
from controller.model.ordering import in_order
from controller.model.records import Dispatcher, SchedulerStatus, Span
from controller.model.resources import format_time
from controller.model.states import OpType, SchedulerState, SpanState


def draining_captures(tick: Tick) -> list[str]:
    """Live captures marked draining that still hold a span or a dispatcher of this changefeed."""
    draining = {n for n in tick.alive if tick.world.captures[n].draining}
    if not draining:
        return []
    spans, dispatchers = _on(tick, draining)
    holding = {s.capture for s in spans if s.capture in draining and s.state is not SpanState.ABSENT}
    holding |= {d.capture for d in dispatchers if d.capture in draining}
    return sorted(holding)


def _on(tick: Tick, captures: set[str]) -> tuple[list[Span], list[Dispatcher]]:
    """Spans and dispatchers to look at for ``captures``: all of them in a full decision; in an incremental
    one, those the index has on these captures and those this decision changed."""
    if tick.index is None:
        return list(tick.spans.values()), list(tick.dispatchers.values())
    index = tick.index
    spans = tick.span_candidates(*(index.spans_by_capture.get(c, ()) for c in sorted(captures)))
    dispatchers = tick.dispatcher_candidates(*(index.disp_by_capture.get(c, ()) for c in sorted(captures)))
    return spans, dispatchers


def status(tick: Tick) -> SchedulerStatus:
    """What the automatic schedulers do in this decision (level-triggered from spec and the world).

    A cool-down survives a pause: the Paused status keeps ``balance_resumes_at`` (a drain that was
    under way when the changefeed was paused starts its cool-down then), and on resume the
    cool-down goes on until that time.
    """
    cf = tick.changefeed
    cfg = cf.scheduler
    prev = cf.scheduler_status
    cooling = cfg.drain_cooldown_seconds > 0 and cfg.balance_interval_seconds > 0
    resumes_at = prev.balance_resumes_at if prev.state in (SchedulerState.COOLING_DOWN, SchedulerState.PAUSED) else 0.0
    if prev.state is SchedulerState.DRAINING and cooling:
        resumes_at = tick.now + cfg.drain_cooldown_seconds  # the drain ends here (finished or paused)
    if tick.schedulers_stopped:
        why = "spec.paused is true: replication is paused" if cf.paused else "spec.scheduler.paused is true"
        return SchedulerStatus(
            state=SchedulerState.PAUSED,
            message=f"{why}: no automatic scheduling (basic, balance, split, merge, drain); "
            "operators in flight finish and user SpanOperators still run",
            balance_resumes_at=resumes_at if tick.now < resumes_at else 0.0,
        )
    draining = draining_captures(tick)
    if draining:
        where = "" if tick.schedulable_captures() else " (no schedulable capture to move them to)"
        return SchedulerStatus(
            state=SchedulerState.DRAINING,
            message=f"moving spans off draining capture(s) {', '.join(draining)}{where}; balancing waits",
        )
    if cooling and tick.now < resumes_at:
        if prev.state is SchedulerState.COOLING_DOWN and prev.balance_resumes_at == resumes_at:
            return prev
        return SchedulerStatus(
            state=SchedulerState.COOLING_DOWN,
            message=f"drain finished; balancing resumes at {format_time(resumes_at)}",
            balance_resumes_at=resumes_at,
        )
    if cfg.balance_interval_seconds <= 0:
        return SchedulerStatus(state=SchedulerState.ACTIVE, message="balancing is off (balanceIntervalSeconds: 0)")
    return SchedulerStatus(state=SchedulerState.ACTIVE, message=f"balancing every {cfg.balance_interval_seconds:g}s")


def drain(tick: Tick) -> None:
    draining = set(draining_captures(tick))
    if not draining:
        return
    left = room(tick, tick.changefeed.scheduler.drain_batch_size)
    targets = tick.schedulable_captures()
    if left <= 0 or not targets:
        return
    load = tick.load()
    pending = {name for op in tick.in_flight() for name in op.spans}
    on_draining, _ = _on(tick, draining)
    for span in in_order(
        (s for s in on_draining if s.capture in draining and movable(tick, s) and s.name not in pending),
        key=lambda s: (s.capture, s.table_id, s.mode, s.key_range),
    ):
        if left <= 0:
            break
        dest = min(targets, key=lambda c: (load.get(c, 0), c))
        if _move(tick, span, dest, f"capture {span.capture} is draining"):
            load[dest] = load.get(dest, 0) + 1
            left -= 1


def balance_due(tick: Tick, last: float, state: SchedulerStatus) -> bool:
    """A balance round may run now (TiCDC's conditions: nothing absent, no operator in flight)."""
    cfg = tick.changefeed.scheduler
    if cfg.balance_interval_seconds <= 0 or tick.now - last < cfg.balance_interval_seconds:
        return False
    if state.state is not SchedulerState.ACTIVE or tick.repairs or tick.coverage_deferred:
        return False
    if tick.index is not None:
        if tick.in_flight():
            return False
        by_state = tick.index.by_state
        pool = tick.span_candidates(*(by_state[s] for s in by_state))  # every span that is not Replicating
    else:
        if any(op.in_flight for op in tick.operators.values()):
            return False
        pool = list(tick.spans.values())
    for s in pool:
        if (
            s.deleting
            or s.state is SpanState.INVALID
            or not tick.table_live(s.table_id)
            or not tick.mode_enabled(s.mode)
        ):
            continue
        if s.state is not SpanState.REPLICATING:
            return False  # absent, being validated, or not yet settled
    return True


def balance(tick: Tick) -> int:
    """One balance round; returns how many Moves it started.

    The least-loaded schedulable capture receives from the most-loaded one that has a movable span,
    until every capture holds the floor or the ceiling of the mean (max - min <= 1), a state that is
    stable (no ping-pong). Load counts every Replicating span; only movable ones are taken.
    """
    cfg = tick.changefeed.scheduler
    captures = tick.schedulable_captures()
    if len(captures) < 2:
        return 0
    load = dict.fromkeys(captures, 0)
    takeable: dict[str, list[Span]] = {c: [] for c in captures}
    if tick.index is not None:
        # Balanced already (max - min <= 1: no capture gives to another)? Then nothing to look at.
        counts = {c: tick.index.replicating_by_capture.get(c, 0) for c in captures}
        for name in tick.spans.changed:
            for span, sign in ((tick.world.spans.get(name), -1), (tick.spans.get(name), 1)):
                if span is not None and span.capture in counts and span.state is SpanState.REPLICATING:
                    counts[span.capture] += sign
        if max(counts.values()) - min(counts.values()) <= 1:
            return 0
        pool, _ = _on(tick, set(captures))
    else:
        pool = list(tick.spans.values())
    for s in pool:
        if s.capture in load and s.state is SpanState.REPLICATING:
            load[s.capture] += 1
            if movable(tick, s):
                takeable[s.capture].append(s)
    for capture, spans in takeable.items():
        takeable[capture] = in_order(spans, key=lambda s: (s.table_id, s.mode, s.key_range), reverse=True)
    floor = sum(load.values()) // len(captures)
    left = room(tick, cfg.balance_max_moves)
    moved = 0
    while left > 0:
        dst = min(captures, key=lambda c: (load[c], c))
        sources = [c for c in captures if takeable[c]]
        if not sources:
            break
        src = max(sources, key=lambda c: (load[c], c))
        if load[src] - load[dst] <= 1:
            break
        span = takeable[src].pop(0)
        reason = f"balance: {src} held {load[src]} spans, {dst} {load[dst]} (floor of the mean: {floor})"
        load[src] -= 1
        load[dst] += 1
        if _move(tick, span, dst, reason):
            moved += 1
            left -= 1
    return moved


def _move(tick: Tick, span: Span, dest: str, reason: str) -> bool:
    name = fresh_operator_name(tick, OpType.MOVE, (span.name,), (span.resource_version, dest))
    if not name:
        return False
    op = scheduler_operator(tick, name, OpType.MOVE, (span.name,), target=dest, reason=reason)
    controller.admit(tick, op, create=True)
    return True
