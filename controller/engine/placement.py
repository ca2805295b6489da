"""Placement: how an Absent span gets a dispatcher, recorded in the Span's own status (no SpanOperator).

The basic scheduler (and the safety net, for a span it creates) places a span by recording the
placement in the span's status *before* anything is created, exactly what an Add operator used to
record in its own status:

    state Scheduling, status.operator "" (no operator: the span's status is the record),
    status.capture (the destination), status.dispatcher (the name of the dispatcher to create),
    status.checkpointTs (the ts it starts from: the span's persisted checkpoint, never below the
    changefeed's)

::

    Absent --record the placement--> Scheduling --create the Dispatcher--> ... --Working--> Replicating
                                          |
                                          | destination lost: close the dispatcher; once gone, Absent
                                          | dispatcher refused (stale epoch) or stopped: close it,
                                          |   record a new dispatcher name, create that one once gone
                                          | another span's dispatcher runs some of its keys: Absent
                                          v
                                        Absent (the basic scheduler places it again)

A span the safety net creates (a new table's, a hole's) is created placed (:func:`create_placed`): the
create carries the same record in the annotation ``cdc.maintainer.dev/placement``, which the API keeps
where it drops a created object's status, and a span whose status was never written is read as
Scheduling there (``Span.with_recorded_placement``). The record still exists before the dispatcher does.

A restarted maintainer finds the record and re-derives the progress from the observed dispatcher, like
any operator's: the dispatcher is created if it is missing (under the recorded name, so a re-issued
create is AlreadyExists), and the span settles when it is Working. Break before make holds as for the
operators: the dispatcher is created only when no other dispatcher of the span exists and no other
span's dispatcher runs any of its keys. Placements in flight count towards ``maxInFlightOperators``
(with the Running SpanOperators), and at most ``basicBatchSize`` start per decision.

Why not an Add SpanOperator for every placement: a fresh span's first placement then cost 3 creates
(Span, SpanOperator, Dispatcher), 5 status writes and a delete when the operator was garbage-collected;
now it costs 3 writes (create Span recording the placement, create Dispatcher, the span's status
Replicating), and nothing a person or a restart needs is lost: the Span's status says where it is
being placed and why it is not yet replicating. SpanOperators remain for what carries intent beyond
"place this span somewhere": user operators (an Add to a named capture included), Move, Split, Merge,
Remove.
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine import naming
from controller.engine.intents import Create, Write, record_unchanged
from controller.engine.operators.common import creates_from_record, new_dispatcher
from controller.engine.world import Tick, is_placement
from controller.model.records import Dispatcher, Span
from controller.model.states import CLOSED_DISPATCHER_STATES, DispatcherState, SpanState

__all__ = ["advance", "bind", "cancel", "create_placed", "destination", "is_placement", "room"]


def room(tick: Tick, batch: bool = True) -> int:
    """How many more placements this decision may start: within the in-flight limit, and (``batch``) within
    ``basicBatchSize`` placements a decision."""
    cfg = tick.changefeed.scheduler
    left = cfg.max_in_flight_operators - tick.slots_used()
    return min(cfg.basic_batch_size - len(tick.started_placements), left) if batch else left


def destination(tick: Tick) -> str:
    """The least-loaded live, non-draining capture (ties by name), "" if none; as the basic scheduler picks."""
    captures = tick.schedulable_captures()
    if not captures:
        return ""
    load = tick.load()
    return min(captures, key=lambda c: (load.get(c, 0), c))


def dispatcher_name(tick: Tick, span: Span, avoid: str = "") -> str:
    """A name for the next dispatcher of ``span``, from the span's resourceVersion (a new placement, a new
    name), this term's epoch and an attempt number; never one that exists in the snapshot."""
    attempt = 0
    while True:
        name = naming.dispatcher_name(span.name, f"place@{span.resource_version}", tick.epoch, attempt)
        if name != avoid and name not in tick.dispatchers:
            return name
        attempt += 1


def keys_busy(tick: Tick, span: Span) -> bool:
    """Another span's dispatcher (a closing one included) runs some of ``span``'s keys."""
    return any(x.span != span.name for x in tick.overlapping_dispatchers(span.table_id, span.mode, span.key_range))


def _bound(tick: Tick, span: Span, capture: str, dispatcher: str) -> Span | None:
    """``span`` recorded as placed on ``capture``; None when it must wait: a dispatcher of it is still
    closing, or another span's dispatcher runs some of its keys (only a deposed maintainer's writes leave
    two accepted spans overlapping; the safety net removes the newer one)."""
    if tick.dispatchers_of_span(span.name) or keys_busy(tick, span):
        return None
    return replace(
        span,
        state=SpanState.SCHEDULING,
        capture=capture,
        dispatcher=dispatcher,
        operator="",
        checkpoint_ts=max(span.known_checkpoint, tick.checkpoint_floor),
        message="",
    )


def bind(tick: Tick, span: Span, capture: str) -> list[Write]:
    """Place ``span`` (Absent) on ``capture``: record it in the span's status, then create the dispatcher.
    Returns nothing when the span must wait (see ``_bound``)."""
    bound = _bound(tick, span, capture, dispatcher_name(tick, span))
    if bound is None:
        return []
    return [tick.write_status(bound), tick.create(_dispatcher(tick, bound))]


def create_placed(tick: Tick, span: Span, capture: str) -> list[Write]:
    """Create ``span`` (not yet created, ``start_ts`` at or above the checkpoint floor) already placed on
    ``capture``, then its dispatcher: the create itself records the placement (the annotation
    ``cdc.maintainer.dev/placement``, which the API keeps where it drops a created object's status), so a
    fresh span's first placement needs no status write of its own. The create is exclusive: a span of
    that name already there is not the one this chain made, and its own record is what counts (its
    dispatcher may be running elsewhere). Returns nothing when the span must wait (see ``_bound``)."""
    # A name no earlier incarnation of this span name had in this term: the span has no resourceVersion yet.
    name = dispatcher_name(tick, replace(span, resource_version=f"new@{tick.now!r}"))
    bound = _bound(tick, span, capture, name)
    if bound is None:
        return []
    assert bound.checkpoint_ts == span.start_ts, "a span is created from a start at or above the floor"
    created = replace(bound, created_capture=capture, created_dispatcher=name)
    if tick.mutant("placement-created-unrecorded"):
        # The mutant: the span is created without the annotation (its status dropped: no record at all).
        made = replace(created, created_capture="", created_dispatcher="")
        tick.note(created)
        return [Create(made, exclusive=True), tick.create(_dispatcher(tick, created))]
    return [tick.create(created, exclusive=True), tick.create(_dispatcher(tick, created))]


def _dispatcher(tick: Tick, span: Span) -> Dispatcher:
    # The mutant is a deliberate bug for the simulator's mutation check: data below the start is skipped.
    ahead = 50 if tick.mutant("placement-starts-ahead") else 0
    return new_dispatcher(
        tick,
        span,
        name=span.dispatcher,
        span_name=span.name,
        key_range=span.key_range,
        capture=span.capture,
        start_ts=span.known_checkpoint + ahead,
    )


def _absent(tick: Tick, span: Span, why: str) -> list[Write]:
    message = f"placement on {span.capture} given up: {why}; the basic scheduler places it again"
    new = replace(span, state=SpanState.ABSENT, capture="", dispatcher="", operator="", message=message)
    return [tick.write_status(new)]


def cancel(tick: Tick, span: Span) -> list[Write]:
    """Give a placement up because its table is being deleted (or its mode disabled): Absent at once, so its
    in-flight slot is free for the Remove that takes the span; that Remove closes any dispatcher made."""
    new = replace(span, state=SpanState.ABSENT, capture="", dispatcher="", operator="", message="")
    return [tick.write_status(new)]


def advance(tick: Tick, span: Span) -> list[Write]:
    """Drive a placement in flight (``is_placement(span)``) one step, from the observed dispatchers."""
    d = tick.dispatchers.get(span.dispatcher) if span.dispatcher else None
    others = [x for x in tick.dispatchers_of_span(span.name) if x.name != span.dispatcher]
    if not tick.capture_alive(span.capture) and not tick.mutant("placement-waits-for-a-lost-capture"):
        # Destination lost: close what was made there; once nothing is left, the span goes Absent.
        made = ([d] if d else []) + others
        if not made:
            return _absent(tick, span, f"capture {span.capture} lost")
        return [w for x in made for w in tick.close_dispatcher(x)]
    if others:
        # Break before make: a stray dispatcher of this span must be gone before ours is created.
        return [w for x in others for w in tick.close_dispatcher(x)]
    if d is None:
        if keys_busy(tick, span):
            return _absent(tick, span, "another span's dispatcher runs some of its keys")
        create = tick.create(_dispatcher(tick, span))
        if creates_from_record(tick, span, [create]):
            # From the name as recorded before: only if the record still names it (``record_unchanged``).
            return [record_unchanged(span), create]
        return [create]
    if d.deleting or d.state in CLOSED_DISPATCHER_STATES:
        # Refused (stale epoch) or failed: record a new name first, then close; created once it is gone.
        renamed = replace(span, dispatcher=dispatcher_name(tick, span, avoid=d.name))
        return [tick.write_status(renamed), *tick.close_dispatcher(d)]
    if d.state is DispatcherState.WORKING:
        done = replace(
            span,
            state=SpanState.REPLICATING,
            capture=d.capture,
            operator="",
            checkpoint_ts=max(d.known_checkpoint, span.checkpoint_ts),
        )
        return [tick.write_status(done)]
    return []  # Pending or Initializing: wait
