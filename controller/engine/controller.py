"""The operator controller: which operators run, in what order, and who owns which span.

Rules (TiCDC's, kept):

- One operator per span and mode. A Pending operator naming a span another in-flight operator owns
  fails with ``SpanBusy``, except that a table's deletion cancels the span's other operators and
  replaces them with a Remove (see ``tables``).
- At most ``maxInFlightOperators`` are Running; the rest wait in Pending, oldest first.
- Running operators advance every tick from the observed world; a restored operator (after a restart
  or failover) is just a Running operator seen for the first time by this process.
- Finished operators are garbage-collected after a retention period (longer for user operators).
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.engine import operator_gc
from controller.engine.intents import Delete, Write
from controller.engine.operators import ADVANCE, START
from controller.engine.operators.common import cancel, fail
from controller.engine.world import Tick
from controller.model.records import SpanOperator
from controller.model.states import Kind, OpPhase, OpSource


def resolve_conflicts(tick: Tick) -> None:
    """Two Running operators on one span: keep one, cancel the others.

    One maintainer never starts a second operator on a busy span, but a superseded one (alive for a
    moment during a failover, before it notices) decides from its own view, and nothing fences a
    status write to an operator. The survivor is the operator the span's status names, else the
    oldest; the others are Canceled. Break-before-make still holds: the survivor closes any
    dispatcher of the span that is not its own before it creates one.
    """
    claims: dict[str, list[SpanOperator]] = {}
    for op in tick.in_flight():
        if op.phase is OpPhase.RUNNING:
            for name in {*op.spans, *(t.span for t in op.targets)}:
                claims.setdefault(name, []).append(op)
    canceled: set[str] = set()
    for name in sorted(claims):
        ops = [o for o in claims[name] if o.name not in canceled]
        if len(ops) < 2:
            continue
        span = tick.spans.get(name)
        named = [o for o in ops if span is not None and o.name == span.operator]
        survivor = named[0] if named else ops[0]
        for op in ops:
            if op is survivor:
                continue
            canceled.add(op.name)
            message = f"span {name!r} is also owned by operator {survivor.name!r}; only one may run"
            tick.emit(f"cancel {op.name}", [cancel(tick, op, "Conflict", message)])
        for s in {*survivor.spans, *(t.span for t in survivor.targets)}:
            tick.owner[s] = survivor.name


def advance_running(tick: Tick) -> None:
    resolve_conflicts(tick)
    for op in tick.in_flight():
        if op.phase is OpPhase.RUNNING and not tick.is_touched(op):
            tick.emit(f"{op.type} {op.name} {op.stage}", ADVANCE[op.type](tick, op))


def admit(tick: Tick, op: SpanOperator, create: bool = False, confirm: Sequence[Write] = ()) -> bool:
    """Start a Pending operator if it may run now; False if it must wait for the in-flight limit.

    With ``create``, ``op`` is new: its Create leads the chain that starts it, so the record exists
    before anything it does (and if it must wait, it is created Pending). ``confirm``: consistent reads that
    come first (``ConfirmPresent``: what the operator's reason rests on is still there).
    """
    prefix: list[Write] = [*confirm, tick.create(op)] if create else [*confirm]
    busy = [s for s in op.spans if tick.owner.get(s, op.name) != op.name]
    if busy and op.source is not OpSource.MAINTAINER:
        reason = f"span {busy[0]!r} is owned by operator {tick.owner[busy[0]]!r}"
        tick.emit(f"{op.type} {op.name} refused", [*prefix, *fail(tick, op, "SpanBusy", reason)])
        return True
    if busy or any(tick.snapshot_owner.get(s, op.name) != op.name for s in op.spans):
        # Released in this decision (or, for the maintainer's own Removes, being canceled): the
        # release may not land, so the claim waits for the next decision.
        tick.emit(f"{op.type} {op.name} waits for its spans", prefix)
        return False
    if tick.slots_used() >= tick.changefeed.scheduler.max_in_flight_operators:
        tick.emit(f"{op.type} {op.name} queued", prefix)
        return False
    tick.emit(f"{op.type} {op.name} start", [*prefix, *START[op.type](tick, op)])
    return True


def admit_pending(tick: Tick) -> None:
    for op in tick.in_flight():
        if op.phase is OpPhase.PENDING and not tick.is_touched(op):
            if tick.slots_used() >= tick.changefeed.scheduler.max_in_flight_operators:
                break
            admit(tick, op)


def garbage_collect(tick: Tick) -> None:
    """Delete the finished operators whose retention has ended (engine/operator_gc.py)."""
    cfg = tick.changefeed.scheduler
    keep_user, keep_other = cfg.user_operator_retention_seconds, cfg.operator_retention_seconds
    if tick.index is None:
        ops = list(tick.operators.values())
    else:  # the finished operators whose retention has ended (one just finished here is never due)
        due = tick.index.gc.due(tick.now, keep_user, keep_other)
        ops = [op for op in (tick.operators.get(n) for n in due) if op is not None]
    for op in sorted(ops, key=lambda o: o.name):
        if not operator_gc.retained(op) or tick.is_touched(op):
            continue
        if tick.now - operator_gc.since(op) >= operator_gc.keep(op, keep_user, keep_other):
            tick.emit(f"gc {op.name}", [Delete(Kind.OPERATOR, op.name, op.uid)])
            tick.forget(Kind.OPERATOR, op.name)
