"""``decide``: one maintainer decision for one changefeed. Purely computational, no side effects.

Input: a :class:`World` snapshot (from synced caches), the maintainer's :class:`Memory` for this
leadership term, and :class:`Options`. Output: a :class:`Decision`, the chains of intended writes
plus the next memory. The caller applies the chains and calls again: on events, when something is
due, and at least every ``--tick`` seconds (30 by default) as a backstop.

Order of one decision::

    epoch not yet published?  -> only publish it (Changefeed.status.epoch, holder), nothing else
    someone newer published?  -> fenced: no writes at all
    tables      finalizers; deleted tables' operators canceled and replaced by a Remove
    operators   advance every Running operator (restored ones included) from the observed world
    repair      the safety net: new spans validated, spans and dispatchers no operator explains
    operators   admit Pending operators (oldest first) within maxInFlightOperators
    schedulers  (none while spec.paused or spec.scheduler.paused) drain: spans off draining captures;
                basic: Absent spans to the least-loaded capture; split/merge by reported traffic; balance
                (see balance.py, traffic.py for when each may run)
    coverage    initial spans for new tables, holes filled, unexplained overlaps removed
    gc          finished operators past their retention
    (a Changefeed being deleted: only its teardown, see teardown.py)
    status      Changefeed and Table status (incl. what the schedulers do); on the term's first
                decision, the Bootstrapped condition and one Event saying what was restored and
                repaired; an Event for each capture newly found lost while it held our spans; the
                WritesRefused condition (and an Event) when the API refused a create of the last
                decisions (``Memory.refusal``, fed by the caller through :func:`observed`)

There is no separate recovery path: bootstrap is the first ordinary decision of a term, and every
rule is level-triggered on the snapshot.

Incremental and full: with an index (``World.index``) each phase visits only its rule's candidates
(engine/index.py) and the decision costs what changed plus what is in flight; every
``Options.audit_interval`` seconds (and for a Changefeed being deleted) the decision is full, every rule
over every record, the backstop for a candidate the index failed to offer. ``Decision.next_due`` says
when a decision would next have something to do if nothing happened meanwhile (a balance round, a
traffic check, a garbage collection, a capture's Lease running out, the end of a cool-down, the next
audit), so the caller can sleep until then or until an event.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from controller.engine import balance, checkpoint, controller, operator_gc, repair, scheduler, tables, teardown, traffic
from controller.engine.index import span_counts
from controller.engine.intents import Chain, WriteStatus
from controller.engine.world import Options, Tick, World
from controller.model import progress as prog
from controller.model.records import Changefeed, Condition, SchedulerStatus, SpanCounts
from controller.model.states import SchedulerState, SpanState

BOOTSTRAPPED = "Bootstrapped"
#: At rest the checkpoint moves only when a capture's report arrives (one per capture per renew interval),
#: so it is written at most once per report; and a status write whose only change is the checkpoint waits
#: until this many seconds passed since the last one. With three captures reporting every 2 s the wait
#: nearly always binds, so a changefeed costs one write per second at rest, however many captures report
#: and however long a decision takes (0.5 s made it depend on how the captures' renewals fall, 0.7-1.4/s).
#: A lower published checkpoint is always safe: it only bounds from below where new dispatchers start.
#: The wait adds at most this much to the lag.
CHECKPOINT_INTERVAL = 1.0
#: Condition of a Changefeed being deleted: what its teardown still has to remove.
DELETING = "Deleting"
#: Condition: True while the API refuses a create this maintainer keeps retrying (reason: the API's reason,
#: message: which create and the API's message); False once a later create lands.
WRITES_REFUSED = "WritesRefused"
#: The Event of a refusal (once per new refusal message).
REFUSED_EVENT = "WriteRefused"
#: Condition: True while dispatchers of this changefeed are stopped for good by their runtime (``Dispatcher.failure``:
#: the source compacted past their position, as TiCDC's GC safepoint error): their checkpoints, and so the
#: changefeed's, cannot move until a person acts. False once none is (the condition existed).
REPLICATION_FAILED = "ReplicationFailed"
#: The Event when that condition turns True or its message changes.
FAILED_EVENT = "DispatcherFailed"
#: Condition: True while replication is paused (``spec.paused``): the captures hold every dispatcher of the
#: changefeed where it is and close its connections, the checkpoint holds. False once resumed (for a changefeed
#: that was ever paused).
PAUSED = "Paused"
#: Conditions: True while a live capture's progress report names a trouble of this changefeed on that side
#: (``progress.Trouble``: a Secret missing or malformed, a server refusing connections, an authentication or TLS
#: failure, a statement the sink refuses): its data does not flow there, the checkpoint holds, nothing is lost.
#: False once no live capture reports one (for a changefeed that had the condition).
SOURCE_UNAVAILABLE = "SourceUnavailable"
SINK_UNAVAILABLE = "SinkUnavailable"
#: Their reasons: a person must change something (a trouble that is not ``transient``), or the captures retry
#: and it is expected to pass by itself.
CONFIGURATION_ERROR = "ConfigurationError"
RETRYING = "Retrying"
#: The Events when such a condition turns True or its reason changes (not on every change of the servers' words:
#: they may vary per retry).
SOURCE_EVENT = "SourceUnavailable"
SINK_EVENT = "SinkUnavailable"
#: Condition and Event per side.
UNAVAILABLE = {prog.SOURCE: (SOURCE_UNAVAILABLE, SOURCE_EVENT), prog.SINK: (SINK_UNAVAILABLE, SINK_EVENT)}


@dataclass(frozen=True)
class Refusal:
    """A create the API refused for good (not a conflict, a timeout or a transient error): 400, 403 or 422.
    Retrying cannot help until something changes (the object, a quota, a webhook, RBAC), so a person must
    be told (``WritesRefused``)."""

    write: str  # e.g. "create Span t1-s0"
    reason: str  # the API's reason (Invalid, Forbidden, BadRequest)
    message: str  # the API's message


#: Status codes of a refusal: the request itself is refused, as opposed to a conflict or an unavailable API.
REFUSAL_CODES = (400, 403, 422)


def observed(memory: Memory, created: int, refusals: tuple[Refusal, ...]) -> Memory:
    """The memory after applying a decision: the first create the API refused (kept until a later decision's
    create lands), or none once ``created`` creates landed without a refusal. What the caller must call
    after every apply (the runner and the simulator alike)."""
    if refusals:
        return replace(memory, refusal=refusals[0])
    if created and memory.refusal is not None:
        return replace(memory, refusal=None)
    return memory


@dataclass(frozen=True)
class Memory:
    """What a maintainer keeps between decisions of one term. Losing it loses nothing durable."""

    epoch: int
    identity: str
    bootstrapped: bool = False
    restored: int = 0
    #: Placements in flight (placement.py) the term's first decision found, restored like operators.
    restored_placements: int = 0
    repaired: int = 0
    report: str = ""  # the Bootstrapped condition's message, kept so the condition is re-asserted
    #: When the last balance round ran (the term's start until one has).
    balanced_at: float = 0.0
    #: Consecutive hot/cold traffic checks per span (lost with the term: counting starts afresh).
    counters: traffic.Counters = field(default_factory=traffic.Counters)
    #: Captures this term has already reported as lost (one Event each).
    lost_captures: frozenset[str] = frozenset()
    #: When this term last wrote a new checkpoint (``CHECKPOINT_INTERVAL``).
    checkpoint_at: float = 0.0
    #: When the last full decision (every rule over everything) ran: the term's first decision counts.
    audited_at: float = 0.0
    #: A create the API refused and that no later create has followed (:func:`observed`).
    refusal: Refusal | None = None


@dataclass(frozen=True)
class Decision:
    chains: tuple[Chain, ...]
    memory: Memory
    fenced: bool = False
    repairs: tuple[str, ...] = ()
    #: When a decision would next have something to do if nothing happened meanwhile (None: never).
    next_due: float | None = None
    #: This decision visited every record (the full audit), not the index's candidates.
    full: bool = False

    @property
    def writes(self) -> int:
        return sum(len(c.writes) for c in self.chains)


def decide(world: World, memory: Memory, options: Options | None = None) -> Decision:
    options = options or Options()
    cf = world.changefeed
    if cf.epoch > memory.epoch or (cf.epoch == memory.epoch and cf.holder and cf.holder != memory.identity):
        return Decision((), memory, fenced=True)
    if cf.epoch < memory.epoch or cf.holder != memory.identity:
        return Decision((_publish_epoch(world, memory),), memory)

    if world.stale and "decides-on-stale-view" not in options.mutants:
        # A view in doubt (a kind's watch broke and it has not been listed since: Informer.in_doubt) may still hold
        # what is gone and lack what is new, on any kind: removing on it undoes what others did (a finished Split's
        # children removed as overlapping its deleted parent), and adding on it makes two owners (a span placed
        # beside a dispatcher the Dispatcher view does not show yet). Nothing is
        # decided until every kind is listed again; the LIST's end wakes the next decision.
        return Decision((), memory)
    first = not memory.bootstrapped
    audit_due = memory.bootstrapped and world.now - memory.audited_at >= options.audit_interval
    full = world.index is None or cf.deleting or options.audit_interval <= 0 or audit_due
    tick = Tick(world, memory.epoch, options, full=full)
    if cf.deleting:
        return _teardown(tick, memory)
    tick.first_tick = first
    if first:
        restored = (
            len(tick.index.in_flight)
            if tick.index is not None
            else sum(1 for op in world.operators.values() if op.in_flight)
        )
    else:
        restored = memory.restored
    placements = tick.snapshot_placing if first else memory.restored_placements

    teardown.ensure_finalizer(tick)
    tables.lifecycle(tick)
    controller.advance_running(tick)
    repair.run(tick)
    controller.admit_pending(tick)
    sched = balance.status(tick)
    balanced_at = memory.balanced_at if memory.bootstrapped else world.now
    counters = memory.counters if memory.bootstrapped else traffic.Counters(checked_at=world.now)
    if tick.schedulers_stopped:
        counters = traffic.Counters(checked_at=world.now)  # "N checks in a row" start again on resume
    else:
        balance.drain(tick)
        scheduler.basic(tick)
        counters = traffic.run(tick, counters)
    repair.coverage(tick)
    # After coverage: spans it creates for a new table or a hole are not Replicating, which holds balancing.
    if not tick.schedulers_stopped and balance.balance_due(tick, balanced_at, sched):
        balance.balance(tick)
        balanced_at = world.now
    controller.garbage_collect(tick)
    repaired = len(tick.repairs) if first else memory.repaired
    also = f" and {placements} placements" if placements else ""
    report = (
        f"restored {restored} in-flight operators{also} and made {repaired} repairs at epoch {tick.epoch}"
        if first
        else memory.report
    )
    lost = _lost_captures(tick)
    refusal = None if "refusals-not-reported" in options.mutants else memory.refusal
    published, waiting = _status(
        tick, first, report, sched, sorted(lost - memory.lost_captures), memory.checkpoint_at, refusal
    )

    new_memory = replace(
        memory,
        bootstrapped=True,
        restored=restored,
        restored_placements=placements,
        repaired=repaired,
        report=report,
        balanced_at=balanced_at,
        counters=counters,
        lost_captures=frozenset(lost),
        checkpoint_at=world.now if published else memory.checkpoint_at,
        audited_at=world.now if full or first else memory.audited_at,
    )
    return Decision(
        tuple(tick.chains),
        new_memory,
        repairs=tuple(tick.repairs),
        # The next audit is counted from the last one that ran as such (not from a decision that was full
        # only because it had no index, as the simulator's agreement check makes).
        next_due=_next_due(
            tick,
            new_memory,
            sched,
            options,
            world.now if audit_due or first else memory.audited_at,
            memory.checkpoint_at + CHECKPOINT_INTERVAL if waiting else None,
        ),
        full=full,
    )


def _next_due(
    tick: Tick,
    memory: Memory,
    sched: SchedulerStatus,
    options: Options,
    audited_at: float,
    checkpoint_due: float | None,
) -> float | None:
    """The earliest time after now at which this decision, re-run on the same records, would do something
    it does not do now: what lets the caller sleep until an event or then (events wake it anyway).
    ``checkpoint_due``: a new checkpoint waits for ``CHECKPOINT_INTERVAL`` until then."""
    cf = tick.changefeed
    cfg = cf.scheduler
    due: list[float] = []
    if checkpoint_due is not None:
        due.append(checkpoint_due)
    if options.audit_interval > 0:
        due.append(audited_at + options.audit_interval)
    if not tick.schedulers_stopped:
        if cfg.balance_interval_seconds > 0:
            due.append(memory.balanced_at + cfg.balance_interval_seconds)
        if traffic.enabled(tick):
            due.append(memory.counters.checked_at + cfg.traffic_check_interval_seconds)
    if sched.balance_resumes_at > tick.now:
        due.append(sched.balance_resumes_at)
    if sched.state is SchedulerState.COOLING_DOWN and sched.balance_resumes_at:
        due.append(sched.balance_resumes_at)
    # A finished operator's retention ends.
    keep_user, keep_other = cfg.user_operator_retention_seconds, cfg.operator_retention_seconds
    if tick.index is not None:
        gc = tick.index.gc.next(keep_user, keep_other)
        if gc is not None:
            due.append(gc)
    else:
        for op in tick.world.operators.values():
            if operator_gc.retained(op):
                due.append(operator_gc.since(op) + operator_gc.keep(op, keep_user, keep_other))
    # A capture's Lease runs out (on the maintainer's clock): a live one's spans are placed again; one being
    # deleted (its Capture object, or its Lease deleted by hand: the informer's stand-in) has its dispatchers
    # released then. A Lease that names nobody has run out for good.
    for c in tick.world.captures.values():
        if c.renew_time is not None and not c.lease_taken:
            due.append(c.renew_time + c.lease_duration)
    # What is due already either ran now or waits for something only an event ends (a balance round
    # waits for operators to finish, spans to be placed): the event wakes the caller.
    later = [t for t in due if t > tick.now]
    return min(later) if later else None


def _teardown(tick: Tick, memory: Memory) -> Decision:
    """The Changefeed is being deleted: only the teardown runs (see engine/teardown.py), plus the safety
    net for dispatchers no span claims; the status says what is left."""
    controller.advance_running(tick)
    left = teardown.run(tick)
    repair.run(tick)
    cf = tick.changefeed
    cond = Condition(
        type=DELETING,
        status="True",
        reason="Teardown",
        message=left,
        observed_generation=cf.generation,
        last_transition=tick.now,
    )
    new = replace(
        cf,
        span_counts=_counts([s.state for s in tick.spans.values()]),
        operators_in_flight=sum(1 for op in tick.operators.values() if op.in_flight),
        conditions=_set_condition(cf, cond),
    )
    if not new.status_equal(cf):
        tick.emit("changefeed status", [WriteStatus(new)])
    return Decision(tuple(tick.chains), replace(memory, bootstrapped=True), repairs=tuple(tick.repairs))


def _publish_epoch(world: World, memory: Memory) -> Chain:
    cf = world.changefeed
    cond = Condition(
        type=BOOTSTRAPPED,
        status="False",
        reason="Bootstrapping",
        message=f"maintainer {memory.identity} took over at epoch {memory.epoch}",
        observed_generation=cf.generation,
        last_transition=world.now,
    )
    new = replace(cf, epoch=memory.epoch, holder=memory.identity, conditions=_set_condition(cf, cond))
    return Chain((WriteStatus(new),), f"publish epoch {memory.epoch}")


def _set_condition(cf: Changefeed, cond: Condition) -> tuple[Condition, ...]:
    old = cf.condition(cond.type)
    if old is not None and (old.status, old.reason, old.message, old.observed_generation) == (
        cond.status,
        cond.reason,
        cond.message,
        cond.observed_generation,
    ):
        return cf.conditions
    if old is not None and old.status == cond.status:
        cond = replace(cond, last_transition=old.last_transition)
    return (*tuple(c for c in cf.conditions if c.type != cond.type), cond)


def _counts(states: list[SpanState | None]) -> SpanCounts:
    return SpanCounts(
        absent=sum(1 for s in states if s is SpanState.ABSENT),
        scheduling=sum(1 for s in states if s is SpanState.SCHEDULING),
        replicating=sum(1 for s in states if s is SpanState.REPLICATING),
        removing=sum(1 for s in states if s is SpanState.REMOVING),
        invalid=sum(1 for s in states if s is SpanState.INVALID),
    )


def _lost_captures(tick: Tick) -> set[str]:
    """Captures whose Lease lapsed while they held spans or dispatchers of this changefeed."""
    if tick.index is not None:
        holding = {c for c, n in tick.index.holding.items() if n > 0} | set(tick.index.disp_by_capture)
        return {c for c in holding if c not in tick.alive}
    holding = {s.capture for s in tick.world.spans.values() if s.capture and s.state is not SpanState.ABSENT}
    holding |= {d.capture for d in tick.world.dispatchers.values()}
    return {c for c in holding if c not in tick.alive}


def _state_counts(tick: Tick, table_id: int | None = None) -> SpanCounts:
    """Spans per state as this decision leaves them (of one table, or all): from the index, adjusted by
    what this decision changed (incremental), or by a scan (full)."""
    if tick.index is None:
        if table_id is None:
            return _counts([s.state for s in tick.spans.values()])
        if tick.per_table_states is None:
            tick.per_table_states = {}
            for s in tick.spans.values():
                tick.per_table_states.setdefault(s.table_id, []).append(s.state)
        return _counts(tick.per_table_states.get(table_id, []))
    base = tick.index.state_counts if table_id is None else tick.index.table_counts.get(table_id, Counter())
    counts = Counter(base)
    for name in tick.spans.changed:
        for span, sign in ((tick.world.spans.get(name), -1), (tick.spans.get(name), 1)):
            if span is not None and (table_id is None or span.table_id == table_id):
                counts[span.state] += sign
    return span_counts(counts)


def _in_flight_count(tick: Tick) -> int:
    if tick.index is None:
        return sum(1 for op in tick.operators.values() if op.in_flight)
    return len(tick.in_flight())


def _failed_condition(tick: Tick) -> Condition | None:
    """ReplicationFailed from the dispatchers of the view: True naming how many and the first one's failure,
    False once none (for a changefeed that had the condition), None for one that never had it."""
    cf = tick.changefeed
    world = tick.world
    if tick.index is not None:
        names = sorted(tick.index.failed_dispatchers)
    else:
        names = sorted(n for n, d in world.dispatchers.items() if d.failure is not None and not d.deleting)
    if names:
        first = world.dispatchers[names[0]]
        message = (
            f"{len(names)} dispatcher(s) stopped for good, the checkpoint held at theirs; "
            f"{first.name} (span {first.span}): {first.failure}"
        )
        return _condition(cf, REPLICATION_FAILED, True, "DispatcherFailed", message, tick.now)
    return _condition(cf, REPLICATION_FAILED, False, "Replicating", "no dispatcher is stopped", tick.now)


def troubles(world: World, now: float, side: prog.Side) -> list[tuple[str, prog.Trouble]]:
    """(capture, its trouble) for every live capture whose report names a trouble of the changefeed on ``side``
    (``progress.SOURCE`` or ``SINK``), by capture name (a lost capture's last report says nothing about now). The
    conditions SourceUnavailable and SinkUnavailable, and the metrics source_ and sink_unavailable_captures."""
    cf = world.changefeed.name
    return [
        (name, trouble)
        for name, report in _live_reports(world, now)
        if (trouble := next((t for t in report.troubles if t.changefeed == cf and t.side == side), None)) is not None
    ]


def _live_reports(world: World, now: float) -> Iterator[tuple[str, prog.Progress]]:
    """(capture, its progress report) for every live capture with one, by name (a lost capture's last report says
    nothing about now)."""
    for name in sorted(world.captures):
        cap = world.captures[name]
        if cap.progress is not None and cap.alive(now):
            yield name, cap.progress


def sink_figures(world: World, now: float) -> list[tuple[str, prog.SinkFigures]]:
    """(capture, its figures of the changefeed's sink) for every live capture that reports them, by capture name:
    the metrics of tombstones collected and held and of live rows."""
    cf = world.changefeed.name
    return [
        (name, figures)
        for name, report in _live_reports(world, now)
        if (figures := next((f for f in report.sinks if f.changefeed == cf), None)) is not None
    ]


def _unavailable_condition(tick: Tick, side: prog.Side) -> Condition | None:
    """SourceUnavailable or SinkUnavailable from the live captures' reports: True naming how many and the first
    one's trouble (one that needs a person first: the reason ConfigurationError, else Retrying), False once none
    (for a changefeed that had the condition), None for one that never had it."""
    kind = UNAVAILABLE[side][0]
    troubled = troubles(tick.world, tick.now, side)
    cf = tick.changefeed
    if troubled:
        stuck = [(c, t) for c, t in troubled if not t.transient]
        first, trouble = (stuck or troubled)[0]
        if stuck:
            reason, then = CONFIGURATION_ERROR, "fix it: the captures use a changed Secret within 30 s"
        else:
            reason, then = RETRYING, "retrying; the checkpoint holds, nothing is lost"
        message = f"{len(troubled)} capture(s) cannot use the {side}; {first}: {trouble.message} ({then})"
        return _condition(cf, kind, True, reason, message, tick.now)
    return _condition(cf, kind, False, "Available", f"every capture uses the {side}", tick.now)


def _refused_condition(cf: Changefeed, refusal: Refusal | None, now: float) -> Condition | None:
    """WritesRefused as the last applies left it: True with the API's words, False once a create landed
    after a refusal, None (no such condition) for a changefeed that never had one."""
    if refusal is not None:
        message = f"the API refused {refusal.write}: {refusal.message} (retried at every decision)"
        return _condition(cf, WRITES_REFUSED, True, refusal.reason or "Refused", message, now)
    return _condition(cf, WRITES_REFUSED, False, "Accepted", "the API accepts this maintainer's creates", now)


def _condition(cf: Changefeed, kind: str, true: bool, reason: str, message: str, now: float) -> Condition | None:
    """A condition of ``cf`` that is True while its trouble lasts: False is written only over one that was
    there (None: a changefeed that never had it gets none)."""
    if not true and cf.condition(kind) is None:
        return None
    return Condition(
        type=kind,
        status="True" if true else "False",
        reason=reason,
        message=message,
        observed_generation=cf.generation,
        last_transition=now,
    )


def _status(
    tick: Tick,
    first: bool,
    report: str,
    sched: SchedulerStatus,
    newly_lost: list[str],
    checkpoint_at: float,
    refusal: Refusal | None = None,
) -> tuple[bool, bool]:
    """Changefeed and Table status. Returns (the Changefeed's write carries a new checkpoint, a new
    checkpoint waits for ``CHECKPOINT_INTERVAL``: the caller is due again then)."""
    cf = tick.changefeed
    writes: list[object] = []
    # Level-triggered: re-asserted every decision, so a lost first status write is repaired.
    cond = Condition(
        type=BOOTSTRAPPED,
        status="True",
        reason="Restored",
        message=report,
        observed_generation=cf.generation,
        last_transition=tick.now,
    )
    conditions = _set_condition(cf, cond)
    # Events in a chain of their own: a 409 on the status write must not drop them.
    events: list[object] = []
    if first:
        events.append(tick.event(cf, "Bootstrapped", report))
    refused = _refused_condition(cf, refusal, tick.now)
    if refused is not None:
        old = cf.condition(WRITES_REFUSED)
        conditions = _set_condition(replace(cf, conditions=conditions), refused)
        if refusal is not None and (old is None or (old.status, old.message) != ("True", refused.message)):
            events.append(tick.event(cf, REFUSED_EVENT, refused.message, warning=True))
    failed = _failed_condition(tick)
    if failed is not None and not tick.mutant("failures-not-reported"):
        old = cf.condition(REPLICATION_FAILED)
        conditions = _set_condition(replace(cf, conditions=conditions), failed)
        if failed.status == "True" and (old is None or (old.status, old.message) != ("True", failed.message)):
            events.append(tick.event(cf, FAILED_EVENT, failed.message, warning=True))
    paused = _condition(
        cf,
        PAUSED,
        cf.paused,
        "Paused" if cf.paused else "Resumed",
        "replication is paused (spec.paused): no dispatcher reads or writes, the captures close their connections, "
        "the checkpoint holds; resume continues from it"
        if cf.paused
        else "replication runs",
        tick.now,
    )
    if paused is not None and not tick.mutant("pause-not-reported"):
        conditions = _set_condition(replace(cf, conditions=conditions), paused)
    for side in prog.SIDES:
        unavailable = _unavailable_condition(tick, side)
        if unavailable is None or tick.mutant(f"{side}-errors-not-reported"):
            continue
        old = cf.condition(unavailable.type)
        conditions = _set_condition(replace(cf, conditions=conditions), unavailable)
        if unavailable.status == "True" and (old is None or (old.status, old.reason) != ("True", unavailable.reason)):
            events.append(tick.event(cf, UNAVAILABLE[side][1], unavailable.message, warning=True))
    for name in newly_lost:
        if tick.index is not None:
            held = tick.index.holding.get(name, 0)
        else:
            held = sum(1 for s in tick.world.spans.values() if s.capture == name and s.state is not SpanState.ABSENT)
        capture = tick.world.captures.get(name)
        message = (
            f"capture {name} lost its Lease while holding {held} span(s) of changefeed {cf.name}; they are placed again"
        )
        if capture is not None:
            events.append(tick.event(capture, "CaptureLost", message, warning=True))
        else:
            events.append(tick.event(cf, "CaptureLost", message, warning=True))
    joins, join_reads = tables.joining(tick)
    new = replace(
        cf,
        joining=joins,
        checkpoint_ts=checkpoint.compute(tick),
        span_counts=_state_counts(tick),
        operators_in_flight=_in_flight_count(tick),
        scheduler_status=sched,
        conditions=conditions,
        observed_generation=cf.generation,
    )
    # (A wall clock stepped back makes the difference negative: write then, rather than stall until it catches up.)
    waiting = False
    if new.checkpoint_ts != cf.checkpoint_ts and 0 <= tick.now - checkpoint_at < CHECKPOINT_INTERVAL:
        unmoved = replace(new, checkpoint_ts=cf.checkpoint_ts)
        if unmoved.status_equal(cf):
            new = unmoved  # only the checkpoint moved, and it was written less than an interval ago: later
            waiting = True
    published = new.checkpoint_ts != cf.checkpoint_ts
    if not new.status_equal(cf):
        # A join dropped for a table the view lacks follows a read that finds no such Table (engine/tables.py).
        writes[:0] = [*join_reads, WriteStatus(new)]
    # Only the progress moved (what a changefeed at rest writes, once a second): no rule reads it back but the
    # checkpoint as the floor of where new dispatchers start, and a lower floor is safe; its landing needs no
    # decision (the next capture report, event or due time brings one).
    progress_only = replace(
        new, checkpoint_ts=cf.checkpoint_ts, span_counts=cf.span_counts, operators_in_flight=cf.operators_in_flight
    ).status_equal(cf)
    tick.emit("changefeed status", writes, wake=first or not progress_only)
    tick.emit("changefeed events", events)
    if tick.index is None:
        candidates = list(tick.world.tables.values())
    else:
        # Tables whose status may be stale: those the index found so, and those whose spans changed now.
        ids = {s.table_id for n in tick.spans.changed for s in (tick.world.spans.get(n), tick.spans.get(n)) if s}
        names = set(tick.index.table_stale())
        for tid in ids:
            names.update(tick.index.table_names.get(tid, ()))
        candidates = [tick.world.tables[n] for n in names if n in tick.world.tables]
    for table in sorted(candidates, key=lambda t: t.name):
        if tick.is_touched(table) or table.changefeed != cf.name or tick.tables_by_id.get(table.table_id) is not table:
            continue
        state = "Removing" if table.deleting else "Active"
        counts = _state_counts(tick, table.table_id)
        if (table.state, table.message, table.span_counts, table.observed_generation) == (
            state,
            "",
            counts,
            table.generation,
        ):
            continue
        updated = replace(table, state=state, message="", span_counts=counts, observed_generation=table.generation)
        tick.emit(f"table {table.name} status", [WriteStatus(updated)])
    return published, waiting
