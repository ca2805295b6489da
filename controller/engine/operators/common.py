"""Steps shared by the operators: recording a stage, closing origins, placing targets, finishing.

The two halves of every placement change live here, so that all five operators obey the same
break-before-make rule:

- :func:`close_origins` deletes the origin dispatchers and reports them gone only once no object is
  left (a live capture releases the finalizer after closing; for a lost capture, whose Lease lapsed and
  which has therefore fenced itself, the maintainer releases it);
- :func:`place_targets` creates a target's dispatcher only when no other dispatcher of that span
  exists, so at most one dispatcher per key can ever be Initializing or Working.
"""

from __future__ import annotations

from dataclasses import replace

from controller.engine import naming
from controller.engine.intents import Write
from controller.engine.world import Tick
from controller.model.records import Dispatcher, Origin, Span, SpanOperator, Target
from controller.model.states import (
    CLOSED_DISPATCHER_STATES,
    DISPATCHER_FINALIZER,
    DispatcherState,
    Kind,
    OpPhase,
    OpSource,
    SpanState,
    Stage,
)


class Rejected(Exception):
    """An operator that cannot run: it fails with this reason and message, having done nothing."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def record(tick: Tick, op: SpanOperator, **changes: object) -> tuple[SpanOperator, Write]:
    """The operator with new status fields, stamped with this term's epoch, and the write recording it."""
    new = replace(op, epoch=tick.epoch, **changes)  # type: ignore[arg-type]
    return new, tick.write_status(new)


def fail(tick: Tick, op: SpanOperator, reason: str, message: str) -> list[Write]:
    """Fail a Pending operator before it acted (validation). Emits an Event for user operators."""
    new, write = record(
        tick,
        op,
        phase=OpPhase.FAILED,
        stage=Stage.NONE,
        status_reason=reason,
        message=message,
        finished_at=tick.now,
    )
    writes: list[Write] = [write]
    if op.source is OpSource.USER:
        writes.append(tick.event(new, "OperatorFailed", f"{op.type} {op.name} failed: {message}", warning=True))
    return writes


def finish(tick: Tick, op: SpanOperator, phase: OpPhase, reason: str, message: str, **changes: object) -> list[Write]:
    new, write = record(tick, op, phase=phase, status_reason=reason, message=message, finished_at=tick.now, **changes)
    writes: list[Write] = [write]
    if phase is OpPhase.FAILED:
        writes.append(tick.event(new, "OperatorFailed", f"{op.type} {op.name} failed: {message}", warning=True))
    return writes


# -- validation helpers ----------------------------------------------------------------------------


def require_span(tick: Tick, name: str) -> Span:
    span = tick.spans.get(name)
    if span is None:
        raise Rejected("SpanNotFound", f"span {name!r} does not exist")
    if span.deleting:
        raise Rejected("SpanDeleting", f"span {name!r} is being deleted")
    if span.state is None:
        raise Rejected("SpanNotReady", f"span {name!r} has not been accepted by the maintainer yet")
    if span.state is SpanState.INVALID:
        raise Rejected("SpanInvalid", f"span {name!r} is invalid: {span.message}")
    if not tick.table_live(span.table_id):
        raise Rejected("TableDeleted", f"table {span.table_id} of span {name!r} does not exist or is being deleted")
    return span


def require_placeable(tick: Tick, span: Span) -> None:
    """A span an operator may take over: Replicating or Absent (Scheduling/Removing belong to others)."""
    if span.state not in (SpanState.REPLICATING, SpanState.ABSENT):
        raise Rejected("SpanBusy", f"span {span.name!r} is {span.state}, not Replicating or Absent")


def require_capture(tick: Tick, name: str) -> None:
    capture = tick.world.captures.get(name)
    if capture is None:
        raise Rejected("CaptureNotFound", f"capture {name!r} does not exist")
    if not capture.alive(tick.now):
        raise Rejected("CaptureNotAlive", f"capture {name!r} is not alive (its Lease is not renewed)")
    if capture.draining:
        raise Rejected("CaptureDraining", f"capture {name!r} is draining")


def least_loaded(tick: Tick, exclude: str = "") -> str:
    """The schedulable capture with the fewest spans (ties by name); "" if there is none."""
    load = tick.load()
    candidates = [c for c in tick.schedulable_captures() if c != exclude]
    if not candidates:
        return ""
    return min(candidates, key=lambda c: (load.get(c, 0), c))


# -- origins ---------------------------------------------------------------------------------------


def origins_of(tick: Tick, span: Span) -> list[Origin]:
    return [
        Origin(
            span=span.name,
            dispatcher=d.name,
            capture=d.capture,
            checkpoint_ts=max(d.known_checkpoint, span.known_checkpoint),
        )
        for d in tick.dispatchers_of_span(span.name)
    ]


def close_origins(tick: Tick, op: SpanOperator, spans: tuple[str, ...]) -> tuple[bool, list[Write]]:
    """Close every recorded origin and any other dispatcher of ``spans``; True once none is left."""
    names = {o.dispatcher for o in op.origins}
    names.update(d.name for s in spans for d in tick.dispatchers_of_span(s))
    writes: list[Write] = []
    left = False
    for name in sorted(names):
        d = tick.dispatchers.get(name)
        if d is None:
            continue
        left = True
        writes.extend(tick.close_dispatcher(d))
    return not left, writes


def wait_origins(tick: Tick, op: SpanOperator, assume_gone: bool = False) -> list[Write] | None:
    """The writes that keep closing ``op``'s origins, or None once every one is gone.

    While waiting, the origins' recorded checkpoints are raised to what their dispatchers last
    reported, so a crash loses as little progress as possible.
    """
    gone, closing = close_origins(tick, op, op.spans)
    if gone or assume_gone:
        return None
    origins = refresh_origins(tick, op)
    if origins != op.origins:
        _, write = record(tick, op, origins=origins)
        return [write, *closing]
    return closing


def final_checkpoint(tick: Tick, op: SpanOperator, span: str) -> int:
    """Best known final checkpoint of ``span``'s origins: the start ts of whatever replaces them.

    For each origin: the higher of what was recorded and what its dispatcher last reported (both are
    lower bounds of what it delivered). Over several origins of one span, the lowest (conservative).
    With no origin, the span's own persisted checkpoint.
    """
    cps = []
    for o in op.origins:
        if o.span != span:
            continue
        d = tick.world.dispatchers.get(o.dispatcher)
        cps.append(max(o.checkpoint_ts, d.known_checkpoint if d is not None else 0))
    if cps:
        return max(min(cps), tick.checkpoint_floor)
    s = tick.spans.get(span) or tick.world.spans.get(span)
    # Never below the changefeed's checkpoint (which no span's delivered data is below), even when
    # nothing is known of the span any more (deleted by hand): TiCDC #4548.
    return max(s.known_checkpoint if s is not None else 0, tick.checkpoint_floor)


def refresh_origins(tick: Tick, op: SpanOperator) -> tuple[Origin, ...]:
    """Origins with checkpoints raised to what their dispatchers last reported."""
    out = []
    for o in op.origins:
        d = tick.world.dispatchers.get(o.dispatcher)
        cp = max(o.checkpoint_ts, d.known_checkpoint if d is not None else 0)
        out.append(replace(o, checkpoint_ts=cp))
    return tuple(out)


# -- targets ---------------------------------------------------------------------------------------


def new_dispatcher_name(tick: Tick, span: str, op: SpanOperator, avoid: str = "") -> str:
    attempt = 0
    while True:
        name = naming.dispatcher_name(span, op.name, tick.epoch, attempt)
        if name != avoid and name not in tick.dispatchers:
            return name
        attempt += 1


def dispatcher_for(tick: Tick, op: SpanOperator, target: Target, span: Span) -> Dispatcher:
    return Dispatcher(
        name=target.dispatcher,
        namespace=span.namespace,
        changefeed=tick.changefeed.name,
        span=target.span,
        table_id=span.table_id,
        mode=span.mode,
        key_range=target.key_range,
        capture=target.capture,
        start_ts=target.start_ts,
        operator=op.name,
        epoch=tick.epoch,
        created=tick.now,
        finalizers=(DISPATCHER_FINALIZER,),
        labels=(
            ("cdc.maintainer.dev/capture", target.capture),
            ("cdc.maintainer.dev/changefeed", tick.changefeed.name),
        ),
    )


def set_span(tick: Tick, span: Span, **changes: object) -> list[Write]:
    """A status write moving ``span`` to ``changes``, or nothing if it is already there."""
    new = replace(span, **changes)  # type: ignore[arg-type]
    if new.status_equal(span) and not tick.is_touched(span):
        return []
    return [tick.write_status(new)]


def place_targets(tick: Tick, op: SpanOperator) -> tuple[tuple[Target, ...], list[Write], list[Write]]:
    """Drive every unfinished target towards a Working dispatcher on its capture.

    Returns the updated targets, the writes that *act* (creates, deletes; to follow the operator's
    status write), and span writes that *settle* finished targets (to precede it).
    """
    targets: list[Target] = []
    acts: list[Write] = []
    settles: list[Write] = []
    for t in op.targets:
        if t.done:
            targets.append(t)
            continue
        span = tick.spans.get(t.span)
        if span is None:
            # The span vanished under the operator (deleted by hand): close what we made for it, then
            # there is nothing left to place (the safety net re-covers its keys).
            mine = [x for x in tick.dispatchers_of_span(t.span)]
            if t.dispatcher in tick.dispatchers and tick.dispatchers[t.dispatcher] not in mine:
                mine.append(tick.dispatchers[t.dispatcher])
            if mine:
                acts.extend(w for x in mine for w in tick.close_dispatcher(x))
                targets.append(t)
            else:
                targets.append(replace(t, done=True, lost=True))
            continue
        d = tick.dispatchers.get(t.dispatcher) if t.dispatcher else None
        others = [x for x in tick.dispatchers_of_span(t.span) if x.name != t.dispatcher]
        if not tick.capture_alive(t.capture):
            # Destination lost: close what we made there; once nothing is left, the span goes Absent.
            closing = [w for x in ([d] if d else []) + others for w in tick.close_dispatcher(x)]
            if d is None and not others:
                targets.append(replace(t, done=True, lost=True))
                settles.extend(
                    set_span(
                        tick,
                        span,
                        state=SpanState.ABSENT,
                        capture="",
                        dispatcher="",
                        operator="",
                        checkpoint_ts=max(span.checkpoint_ts, t.start_ts),
                    )
                )
            else:
                targets.append(t)
                acts.extend(closing)
            continue
        if others and not tick.mutant("move-adds-before-origin-stopped"):
            # Break before make: a stray dispatcher of this span must be gone before ours is created.
            acts.extend(w for x in others for w in tick.close_dispatcher(x))
            targets.append(t)
            continue
        if d is None:
            blockers = [
                x.name
                for x in tick.overlapping_dispatchers(span.table_id, span.mode, t.key_range)
                if x.span != t.span
            ]
            if blockers:
                # Another span's dispatcher runs some of these keys: only a maintainer superseded
                # mid-write (its span creates are not fenced) can leave two accepted spans overlapping.
                # Never run both: give up this placement; the safety net removes the newer span.
                targets.append(replace(t, done=True, lost=True))
                settles.extend(set_span(tick, span, state=SpanState.ABSENT, capture="", dispatcher="", operator=""))
                continue
            acts.append(tick.create(dispatcher_for(tick, op, t, span)))
            targets.append(t)
        elif d.deleting or d.state in CLOSED_DISPATCHER_STATES:
            # Refused (stale epoch) or failed: replace it, under a new name, once it is gone.
            acts.extend(tick.close_dispatcher(d))
            targets.append(replace(t, dispatcher=new_dispatcher_name(tick, t.span, op, avoid=d.name)))
        elif d.state is DispatcherState.WORKING:
            targets.append(replace(t, done=True))
            settles.extend(
                set_span(
                    tick,
                    span,
                    state=SpanState.REPLICATING,
                    capture=d.capture,
                    dispatcher=d.name,
                    operator="",
                    checkpoint_ts=max(d.known_checkpoint, span.checkpoint_ts),
                )
            )
        else:
            targets.append(t)  # Pending or Initializing: wait
    return tuple(targets), acts, settles


def advance_targets(tick: Tick, op: SpanOperator, lost_reason: str) -> list[Write]:
    """The common AddDest/AddSpans step: place, record progress, finish when every target is done."""
    targets, acts, settles = place_targets(tick, op)
    if all(t.done for t in targets):
        lost = [t for t in targets if t.lost]
        if not lost:
            return settles + finish(tick, op, OpPhase.SUCCEEDED, "", "", targets=targets)
        reason, why = _why_lost(tick, lost[0], lost_reason)
        names = ", ".join(t.span for t in lost)
        if len(lost) == len(targets):
            return settles + finish(tick, op, OpPhase.FAILED, reason, f"{why}: {names}", targets=targets)
        msg = f"{len(lost)} of {len(targets)} spans not placed ({why}): {names}"
        return settles + finish(tick, op, OpPhase.SUCCEEDED, "PartiallyPlaced", msg, targets=targets)
    if targets != op.targets:
        _, write = record(tick, op, targets=targets)
        return [*settles, write, *acts]
    return settles + acts


def _why_lost(tick: Tick, t: Target, lost_reason: str) -> tuple[str, str]:
    """Reason and message for a target given up: span deleted, keys busy, or its capture lost."""
    if t.span not in tick.spans:
        return "SpanDeleted", "span deleted by hand mid-way; its keys are re-covered by the safety net"
    if tick.capture_alive(t.capture):
        return "KeysBusy", "another span's dispatcher runs these keys; left Absent, the overlap is repaired"
    return lost_reason, f"destination capture {t.capture or '(none)'} lost; left Absent for rescheduling"


def choose_targets(tick: Tick, op: SpanOperator, targets: tuple[Target, ...], start_ts: int) -> tuple[Target, ...]:
    """Give each target a capture (the operator's, if alive, else spread by load) and a dispatcher name."""
    load = tick.load()
    preferred = op.target if op.target and op.target in tick.schedulable_captures() else ""
    out = []
    for t in targets:
        capture = t.capture
        if not capture:
            if preferred:
                capture = preferred
            else:
                caps = tick.schedulable_captures()
                capture = min(caps, key=lambda c: (load.get(c, 0), c)) if caps else ""
        if capture:
            load[capture] = load.get(capture, 0) + 1
        out.append(
            replace(
                t,
                capture=capture,
                start_ts=start_ts if not t.start_ts else t.start_ts,
                dispatcher=t.dispatcher or new_dispatcher_name(tick, t.span, op),
            )
        )
    return tuple(out)


def owned_spans(op: SpanOperator) -> set[str]:
    return set(op.spans) | {t.span for t in op.targets}


def span_kind_check(tick: Tick, op: SpanOperator) -> None:
    if op.changefeed != tick.changefeed.name:
        raise Rejected("WrongChangefeed", f"operator belongs to changefeed {op.changefeed!r}")


__all__ = [
    "Kind",
    "Rejected",
    "advance_targets",
    "choose_targets",
    "close_origins",
    "fail",
    "final_checkpoint",
    "finish",
    "least_loaded",
    "origins_of",
    "owned_spans",
    "place_targets",
    "record",
    "refresh_origins",
    "require_capture",
    "require_placeable",
    "require_span",
    "set_span",
]
