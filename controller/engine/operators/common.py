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
from controller.engine.intents import ConfirmGone, Create, Write, record_unchanged
from controller.engine.world import Tick
from controller.model import resources as conv
from controller.model.keys import KeyRange
from controller.model.records import Dispatcher, Origin, Record, Span, SpanOperator, Target
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


def cancel(tick: Tick, op: SpanOperator, reason: str, message: str) -> Write:
    """The write that cancels ``op``, built on the operator as the view has it, not as another chain of this
    decision left it: chains fail independently, so a cancel must not carry what an earlier chain concluded behind a
    read that stopped it (an AddSpans chain whose ``ConfirmGone`` finds the span stops before it records the span as
    deleted by hand; a cancel built on what that chain concluded, in a chain of its own, would write that record all
    the same). If the earlier chain lands, this write fails on the resourceVersion and the next decision cancels the
    newer record."""
    base = tick.world.operators.get(op.name, op)
    _, write = record(tick, base, phase=OpPhase.CANCELED, status_reason=reason, message=message, finished_at=tick.now)
    return write


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


def new_dispatcher(
    tick: Tick,
    span: Span,
    *,
    name: str,
    span_name: str,
    key_range: KeyRange,
    capture: str,
    start_ts: int,
    operator: str = "",
) -> Dispatcher:
    """Every Dispatcher the maintainer creates: of ``span``'s table and mode, in this term's epoch, with the
    finalizer its capture releases once closed and the labels its capture watches by."""
    return Dispatcher(
        name=name,
        namespace=span.namespace,
        changefeed=tick.changefeed.name,
        span=span_name,
        table_id=span.table_id,
        mode=span.mode,
        key_range=key_range,
        capture=capture,
        start_ts=start_ts,
        operator=operator,
        epoch=tick.epoch,
        created=tick.now,
        finalizers=(DISPATCHER_FINALIZER,),
        labels=conv.dispatcher_labels(tick.changefeed.name, capture),
    )


def dispatcher_for(tick: Tick, op: SpanOperator, target: Target, span: Span) -> Dispatcher:
    """The dispatcher of an operator's target."""
    return new_dispatcher(
        tick,
        span,
        name=target.dispatcher,
        span_name=target.span,
        key_range=target.key_range,
        capture=target.capture,
        start_ts=target.start_ts,
        operator=op.name,
    )


def set_span(tick: Tick, span: Span, **changes: object) -> list[Write]:
    """A status write moving ``span`` to ``changes``, or nothing if it is already there."""
    new = replace(span, **changes)  # type: ignore[arg-type]
    if new.status_equal(span) and not tick.is_touched(span):
        return []
    return [tick.write_status(new)]


def place_targets(
    tick: Tick, op: SpanOperator, lost_reason: str
) -> tuple[tuple[Target, ...], list[Write], list[Write]]:
    """Drive every unfinished target towards a Working dispatcher on its capture.

    Returns the updated targets, the writes that *act* (creates, deletes; to follow the operator's
    status write), and span writes that *settle* finished targets (to precede it). A target given up
    records why (``lost_reason``: the operator's reason for a lost capture), in the same write.
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
            # there is nothing left to place (the safety net re-covers its keys). Absent from the view is not
            # deleted: another maintainer may have created it, its event still on the way, so a consistent read
            # confirms it gone before either.
            gone = [] if tick.mutant("gives-up-a-span-unseen") else [ConfirmGone(Kind.SPAN, t.span)]
            mine = [x for x in tick.dispatchers_of_span(t.span)]
            if t.dispatcher in tick.dispatchers and tick.dispatchers[t.dispatcher] not in mine:
                mine.append(tick.dispatchers[t.dispatcher])
            if mine:
                acts.extend([*gone, *(w for x in mine for w in tick.close_dispatcher(x))])
                targets.append(t)
            else:
                targets.append(give_up(t, SPAN_DELETED, SPAN_DELETED_MESSAGE))
                settles.extend(gone)  # before the operator's record of it
            continue
        d = tick.dispatchers.get(t.dispatcher) if t.dispatcher else None
        others = [x for x in tick.dispatchers_of_span(t.span) if x.name != t.dispatcher]
        if not tick.capture_alive(t.capture):
            # Destination lost (or none was chosen: no capture was live then): close what we made there;
            # once nothing is left, the span goes Absent, and why is recorded with the target.
            closing = [w for x in ([d] if d else []) + others for w in tick.close_dispatcher(x)]
            if d is None and not others:
                if t.capture:
                    targets.append(give_up(t, lost_reason, capture_lost_message(t.capture)))
                else:
                    targets.append(give_up(t, NO_CAPTURE, no_capture_message(tick)))
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
                x.name for x in tick.overlapping_dispatchers(span.table_id, span.mode, t.key_range) if x.span != t.span
            ]
            if blockers:
                # Another span's dispatcher runs some of these keys: only a maintainer superseded
                # mid-write (its span creates are not fenced) can leave two accepted spans overlapping.
                # Never run both: give up this placement; the safety net removes the newer span.
                targets.append(give_up(t, KEYS_BUSY, KEYS_BUSY_MESSAGE))
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


def advance_targets(tick: Tick, op: SpanOperator, lost_reason: str, reshape: bool = False) -> list[Write]:
    """The common AddDest/AddSpans step: place, record progress, finish when every target is done.

    ``reshape`` (Split, Merge): the targets are new spans that already exist and replaced the old ones,
    so the operator's intent, the new shape, is achieved whatever becomes of their placement.
    """
    targets, acts, settles = place_targets(tick, op, lost_reason)
    if all(t.done for t in targets):
        phase, reason, message = outcome(tick, op, targets, lost_reason, reshape)
        return settles + finish(tick, op, phase, reason, message, targets=targets)
    if targets != op.targets:
        _, write = record(tick, op, targets=targets)
        return [*settles, write, *acts]  # the write is a compare-and-swap on the record the creates rest on
    if creates_from_record(tick, op, acts):
        # A create from the target as recorded before, not written by this decision: only if the record still
        # names it.
        return [record_unchanged(op), *settles, *acts]
    return settles + acts


def creates_from_record(tick: Tick, record: Record, writes: list[Write]) -> bool:
    """Whether ``writes`` create a dispatcher on the strength of ``record`` as the view shows it: not written by
    this decision (whose own write is the compare-and-swap the create then follows)."""
    return (
        (record.kind, record.name) not in tick.touched
        and any(isinstance(w, Create) and w.obj.kind is Kind.DISPATCHER for w in writes)
        and not tick.mutant("creates-from-an-unconfirmed-record")
    )


# -- giving a target up ----------------------------------------------------------------------------

#: Why a target was given up (``Target.lost_reason``), besides the operator's own reason for a lost
#: destination capture (CaptureLost for an Add, DestinationLost for the others).
NO_CAPTURE = "NoCapture"
KEYS_BUSY = "KeysBusy"
SPAN_DELETED = "SpanDeleted"
PARTIALLY_PLACED = "PartiallyPlaced"

LEFT_ABSENT = "left Absent for the basic scheduler"
KEYS_BUSY_MESSAGE = "another span's dispatcher runs some of these keys; left Absent, the safety net repairs the overlap"
SPAN_DELETED_MESSAGE = "deleted by hand mid-way; the safety net re-covers its keys"
#: Captures named in a message at most (a status message is for a person, not an inventory).
NAMED_CAPTURES = 8


def give_up(t: Target, reason: str, message: str) -> Target:
    """``t`` done without a dispatcher: left Absent (or gone), with why, recorded in the same write."""
    return replace(t, done=True, lost=True, lost_reason=reason, lost_message=message)


def capture_lost_message(capture: str) -> str:
    return f"destination capture {capture} lost; {LEFT_ABSENT}"


def no_capture_message(tick: Tick) -> str:
    """Why no capture could take a span now, naming the captures, and what happens next."""
    caps = tick.world.captures
    lost = sorted(n for n in caps if not tick.capture_alive(n))
    draining = sorted(n for n in caps if tick.capture_alive(n) and caps[n].draining)
    why = []
    if lost:
        why.append(f"{_listed(lost)} lost")
    if draining:
        why.append(f"{_listed(draining)} draining")
    return (
        f"no live, non-draining capture ({'; '.join(why) or 'none registered'}); {LEFT_ABSENT}, "
        "which places Absent spans as soon as a capture is live"
    )


def _listed(names: list[str]) -> str:
    more = len(names) - NAMED_CAPTURES
    return ", ".join(names[:NAMED_CAPTURES]) + (f" and {more} more" if more > 0 else "")


def outcome(
    tick: Tick, op: SpanOperator, targets: tuple[Target, ...], lost_reason: str, reshape: bool
) -> tuple[OpPhase, str, str]:
    """Phase, reason and message of an operator whose targets are all done: a function of the record.

    Add and Move fail when their one span could not be placed (placing it was the whole intent). A
    Split or Merge succeeds once its new spans exist, even if none could be placed ("PartiallyPlaced":
    they are Absent and the basic scheduler places them); it fails only if every new span was
    deleted by hand, for then nothing of the new shape is left.
    """
    lost = [_explained(tick, t, lost_reason) for t in targets if t.lost]
    if not lost:
        return OpPhase.SUCCEEDED, "", ""
    every_span_deleted = all(t.lost_reason == SPAN_DELETED for t in lost)
    mutant = reshape and tick.mutant("reshape-fails-when-every-target-lost")
    if len(lost) < len(targets) or (reshape and not every_span_deleted and not mutant):
        groups: dict[str, list[str]] = {}
        for t in lost:
            groups.setdefault(t.lost_message, []).append(t.span)
        kind = "new spans" if reshape else "spans"
        done = f" (the {op.type} itself is done)" if reshape else ""
        details = "; ".join(f"{', '.join(names)}: {why}" for why, names in groups.items())
        return OpPhase.SUCCEEDED, PARTIALLY_PLACED, f"{len(lost)} of {len(targets)} {kind} not placed{done}: {details}"
    names = ", ".join(t.span for t in lost)
    if reshape and every_span_deleted:
        message = f"every new span was deleted by hand mid-way ({names}); the safety net re-covers their keys"
        return OpPhase.FAILED, SPAN_DELETED, message
    first = lost[0]
    return OpPhase.FAILED, first.lost_reason, f"{first.lost_message}: {names}"


def _explained(tick: Tick, t: Target, lost_reason: str) -> Target:
    """A lost target with its reason; one recorded before reasons were, explained from the world now."""
    if t.lost_reason:
        return t
    if t.span not in tick.spans:
        return give_up(t, SPAN_DELETED, SPAN_DELETED_MESSAGE)
    if not t.capture:
        return give_up(t, NO_CAPTURE, no_capture_message(tick))
    if tick.capture_alive(t.capture):
        return give_up(t, KEYS_BUSY, KEYS_BUSY_MESSAGE)
    return give_up(t, lost_reason, capture_lost_message(t.capture))


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
    "KEYS_BUSY",
    "NO_CAPTURE",
    "PARTIALLY_PLACED",
    "SPAN_DELETED",
    "Kind",
    "Rejected",
    "advance_targets",
    "cancel",
    "capture_lost_message",
    "choose_targets",
    "close_origins",
    "fail",
    "final_checkpoint",
    "finish",
    "give_up",
    "least_loaded",
    "no_capture_message",
    "origins_of",
    "outcome",
    "owned_spans",
    "place_targets",
    "record",
    "refresh_origins",
    "require_capture",
    "require_placeable",
    "require_span",
    "set_span",
]
