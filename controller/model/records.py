"""The model: one frozen dataclass per resource kind, holding exactly what the engine reasons about.

Every record carries the object metadata the engine needs (name, resourceVersion, uid, creation time,
deletion and finalizers). Fields are split into ``SPEC_FIELDS`` and ``STATUS_FIELDS`` so that a status
write can replace exactly the status part, as the API server's status subresource does.

Conversion to and from Kubernetes resource dictionaries lives in ``controller.model.resources``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, TypeVar

from controller.model.keys import KeyRange
from controller.model.progress import Progress
from controller.model.states import (
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SchedulerState,
    SpanState,
    Stage,
)
from controller.model.verification import Verification

R = TypeVar("R", bound="Record")


@dataclass(frozen=True, kw_only=True)
class Record:
    """Object metadata common to every kind."""

    KIND: ClassVar[Kind]
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = ()
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = ()

    name: str
    namespace: str = "default"
    uid: str = ""
    resource_version: str = ""  # "" for an object not yet created
    generation: int = 0
    created: float = 0.0  # creationTimestamp, seconds since the epoch
    deleting: bool = False  # deletionTimestamp is set
    finalizers: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def kind(self) -> Kind:
        return self.KIND

    def evolve(self: R, **changes: object) -> R:
        """``dataclasses.replace`` without re-running ``__init__``: records have no validation in
        ``__init__``, and this is the hot path of every status write in the simulator."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for key, value in changes.items():
            if key not in new.__dict__:
                raise TypeError(f"{type(self).__name__} has no field {key!r}")
            new.__dict__[key] = value
        return new

    def with_status_of(self: R, other: R) -> R:
        """This object with ``other``'s status fields (what a status write does)."""
        return self.evolve(**{f: getattr(other, f) for f in self.STATUS_FIELDS})

    def status_equal(self: R, other: R) -> bool:
        return all(getattr(self, f) == getattr(other, f) for f in self.STATUS_FIELDS)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# --------------------------------------------------------------------------------------------------
# Changefeed


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """``Changefeed.spec.scheduler``. Defaults follow TiCDC's (see docs/architecture.md, Schedulers).

    A threshold, ``balance_interval_seconds`` or ``merge_max_per_round`` of 0 switches that scheduler
    off; ``traffic_check_interval_seconds`` 0 checks at every decision; ``drain_cooldown_seconds`` 0
    means no cool-down. Batch sizes and check counts are at least 1.
    """

    #: Stop the automatic schedulers alone (basic, balance, split, merge, drain), replication going on:
    #: ``spec.scheduler.paused``. ``spec.paused`` pauses replication, and the schedulers with it.
    paused: bool = False
    max_in_flight_operators: int = 10000
    #: How many Add operators the basic scheduler starts per tick (TiCDC's add-table batch).
    basic_batch_size: int = 512
    #: Seconds a finished scheduler/maintainer operator is kept before it is garbage-collected.
    operator_retention_seconds: float = 300.0
    #: Seconds a finished user operator is kept.
    user_operator_retention_seconds: float = 3600.0
    #: Seconds between balance rounds (TiCDC: 15 s); 0: no balancing.
    balance_interval_seconds: float = 15.0
    #: At most this many Moves per balance round.
    balance_max_moves: int = 1024
    #: At most this many Moves per tick off draining captures.
    drain_batch_size: int = 512
    #: Balancing stays off this long after a drain finished (TiCDC: 120 s).
    drain_cooldown_seconds: float = 120.0
    #: Seconds between the traffic checks that split and merge count (a "check" of TiCDC).
    traffic_check_interval_seconds: float = 15.0
    #: Split a span whose write rate (rows/s) stays above this for ``split_checks`` checks; 0: off.
    split_write_threshold: float = 0.0
    #: Split a span holding more than this many regions (TiCDC's region-threshold); 0: off.
    split_region_threshold: int = 10000
    split_checks: int = 3
    #: The split scheduler never makes a table (per mode) hold more spans than this.
    max_spans_per_table: int = 128
    #: Merge adjacent spans of one table whose write rates stay below this for ``merge_checks``; 0: off.
    merge_write_threshold: float = 0.0
    merge_checks: int = 5
    #: At most this many Merge operators per check.
    merge_max_per_round: int = 8


@dataclass(frozen=True, kw_only=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""
    observed_generation: int = 0
    last_transition: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SchedulerStatus:
    """``Changefeed.status.scheduler``: what the automatic schedulers are doing, durably.

    ``state``: Active, Paused (``spec.paused``), Draining (a draining capture still holds spans) or
    CoolingDown (a drain finished; balancing resumes at ``balance_resumes_at``). Kept in status, not
    in memory, so that a new maintainer honours a cool-down its predecessor started.
    """

    state: SchedulerState = SchedulerState.NONE
    message: str = ""
    balance_resumes_at: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Join:
    """``Changefeed.status.joining[]``: a table whose first spans a maintainer is about to create, and the ts they
    start from at the lowest (the checkpoint as that maintainer's view had it).

    Written with a compare-and-swap on the Changefeed before any of the table's spans exists, counted in the
    checkpoint's minimum while it is there, dropped once the view shows the table's spans covering it (they count
    then) or the table gone. Why: the checkpoint's publisher must know of every table whose spans may start below
    what it publishes, and a deposed maintainer, not yet fenced, may create a new table's spans from its own older
    view of the checkpoint while the new leader's Table and Span views have not seen the table yet. The Changefeed
    is the one object every leader writes with a compare-and-swap: a deposed maintainer's join fails on the
    resourceVersion the new leader's epoch moved, and a join written before that is read by it."""

    table: str
    uid: str
    start_ts: int


@dataclass(frozen=True, kw_only=True)
class SpanCounts:
    absent: int = 0
    scheduling: int = 0
    replicating: int = 0
    removing: int = 0
    invalid: int = 0


@dataclass(frozen=True, kw_only=True)
class Changefeed(Record):
    KIND: ClassVar[Kind] = Kind.CHANGEFEED
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = (
        "paused",
        "redo",
        "start_ts",
        "scheduler",
        "source_secret",
        "sink_kind",
        "sink_secret",
    )
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = (
        "epoch",
        "holder",
        "checkpoint_ts",
        "span_counts",
        "operators_in_flight",
        "scheduler_status",
        "conditions",
        "observed_generation",
        "joining",
    )

    #: ``spec.paused``: replication paused (as TiCDC's ``changefeed pause``): no dispatcher reads or writes, the
    #: captures close their connections, the checkpoint holds; the schedulers stop too. ``resume`` continues from
    #: the checkpoint.
    paused: bool = False
    redo: bool = False
    start_ts: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: The Secret naming the etcd source (``spec.source.etcd.secretRef.name``), the sink's kind (``postgres`` or
    #: ``mysql``: the one key of ``spec.sink``) and the Secret naming it (``spec.sink.<kind>.secretRef.name``): all
    #: "" for a changefeed that replicates nothing (the logical clock runtime). With a source, every ts of the
    #: changefeed is an etcd revision.
    source_secret: str = ""
    sink_kind: str = ""
    sink_secret: str = ""

    epoch: int = 0
    holder: str = ""  # identity of the maintainer that published ``epoch``
    checkpoint_ts: int = 0
    span_counts: SpanCounts = field(default_factory=SpanCounts)
    operators_in_flight: int = 0
    scheduler_status: SchedulerStatus = field(default_factory=SchedulerStatus)
    conditions: tuple[Condition, ...] = ()
    observed_generation: int = 0
    joining: tuple[Join, ...] = ()

    @property
    def schedulers_stopped(self) -> bool:
        """No automatic scheduling: replication paused (``spec.paused``) or the schedulers alone
        (``spec.scheduler.paused``)."""
        return self.paused or self.scheduler.paused

    #: The last ``kubectl changefeed verify`` (metadata: the annotation ``cdc.maintainer.dev/last-verify``,
    #: neither spec nor status; ``controller.model.verification``); None if it never ran.
    last_verify: Verification | None = None

    @property
    def modes(self) -> tuple[Mode, ...]:
        return (Mode.DEFAULT, Mode.REDO) if self.redo else (Mode.DEFAULT,)

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


# --------------------------------------------------------------------------------------------------
# Table


@dataclass(frozen=True, kw_only=True)
class Table(Record):
    KIND: ClassVar[Kind] = Kind.TABLE
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = (
        "changefeed",
        "table_id",
        "splittable",
        "pre_split_spans",
        "pre_split_keys",
        "start_ts",
        "write_rate",
        "region_count",
    )
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = ("state", "message", "span_counts", "observed_generation")

    changefeed: str
    table_id: int
    splittable: bool = True
    #: Cut the table into this many even spans when it is first seen (0 or 1: one span).
    pre_split_spans: int = 0
    #: Or cut it at these keys (takes precedence over ``pre_split_spans``).
    pre_split_keys: tuple[bytes, ...] = ()
    #: Replicate from this ts (never below the changefeed's checkpoint). 0: from the checkpoint.
    start_ts: int = 0
    #: Simulated upstream write rate (rows/s) the default dispatcher runtime reports.
    write_rate: float = 0.0
    #: Simulated number of regions of the table, which the default runtime reports per span.
    region_count: int = 0

    state: str = ""  # "" | "Active" | "Invalid" | "Removing" | "Detached"
    message: str = ""
    span_counts: SpanCounts = field(default_factory=SpanCounts)
    observed_generation: int = 0

    @property
    def key_range(self) -> KeyRange:
        return KeyRange.of_table(self.table_id)


# --------------------------------------------------------------------------------------------------
# Span


@dataclass(frozen=True, kw_only=True)
class Span(Record):
    KIND: ClassVar[Kind] = Kind.SPAN
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = ("changefeed", "table_id", "mode", "key_range", "start_ts")
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = (
        "state",
        "capture",
        "dispatcher",
        "checkpoint_ts",
        "operator",
        "message",
    )

    changefeed: str
    table_id: int
    mode: Mode = Mode.DEFAULT
    key_range: KeyRange
    #: The ts this span's data must be replicated from (set by split/merge/hole repair; 0: unknown).
    start_ts: int = 0

    state: SpanState | None = None  # None: status never written (new span, not yet validated)
    capture: str = ""
    dispatcher: str = ""
    checkpoint_ts: int = 0
    operator: str = ""
    message: str = ""

    #: The placement the maintainer recorded in the span when it created it (metadata: the annotation
    #: ``cdc.maintainer.dev/placement``, which a create keeps where it drops the status): the destination
    #: capture and the name of the dispatcher to create there, from ``start_ts``. It is the span's record
    #: only while the status was never written (:meth:`with_recorded_placement`).
    created_capture: str = ""
    created_dispatcher: str = ""

    @property
    def accepted(self) -> bool:
        """The span stands for its key range: validated (a state written, not Invalid) and not being deleted. A
        live table's accepted spans cover its range in every mode, without gaps or overlaps (engine/invariants.py)."""
        return self.state not in (None, SpanState.INVALID) and not self.deleting

    @property
    def known_checkpoint(self) -> int:
        """The best persisted lower bound of this span's replicated-up-to ts."""
        return max(self.start_ts, self.checkpoint_ts)

    def with_recorded_placement(self) -> Span:
        """The span as its records say: one whose status was never written but which was created with a
        placement is Scheduling there, without an operator, from ``start_ts``, exactly as if that
        placement had been written to its status (``controller.engine.placement``). Any other span is
        returned as it is: once the status is written, the status is the record."""
        if self.state is not None or not (self.created_capture and self.created_dispatcher):
            return self
        return self.evolve(
            state=SpanState.SCHEDULING,
            capture=self.created_capture,
            dispatcher=self.created_dispatcher,
            checkpoint_ts=self.start_ts,
            operator="",
            message="",
        )


# --------------------------------------------------------------------------------------------------
# Dispatcher


#: How a capture's status message of a Dispatcher its runtime stopped for good begins (``Dispatcher.failure``).
DISPATCHER_FAILED_PREFIX = "failed: "


@dataclass(frozen=True, kw_only=True)
class Dispatcher(Record):
    KIND: ClassVar[Kind] = Kind.DISPATCHER
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = (
        "changefeed",
        "span",
        "table_id",
        "mode",
        "key_range",
        "capture",
        "start_ts",
        "operator",
        "epoch",
    )
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = (
        "state",
        "checkpoint_ts",
        "heartbeat",
        "message",
        "write_rate",
        "region_count",
    )

    changefeed: str
    span: str
    table_id: int
    mode: Mode = Mode.DEFAULT
    key_range: KeyRange
    capture: str
    start_ts: int
    operator: str = ""
    epoch: int

    state: DispatcherState = DispatcherState.PENDING
    checkpoint_ts: int = 0
    heartbeat: float = 0.0
    message: str = ""
    #: Upstream rows/s the span receives, as the capture last reported it (split/merge by traffic).
    write_rate: float = 0.0
    #: Regions of the span, as the capture last reported them (split by size).
    region_count: int = 0

    @property
    def known_checkpoint(self) -> int:
        return max(self.start_ts, self.checkpoint_ts)

    @property
    def failure(self) -> str | None:
        """Why its runtime stopped it for good (the capture's status message ``failed: <why>``, e.g. the source
        compacted past its position: its checkpoint cannot move again), None if it did not."""
        if self.message.startswith(DISPATCHER_FAILED_PREFIX):
            return self.message[len(DISPATCHER_FAILED_PREFIX) :]
        return None


# --------------------------------------------------------------------------------------------------
# SpanOperator


@dataclass(frozen=True, kw_only=True, order=True)
class Origin:
    """A dispatcher an operator closes (remove, move, split, merge), recorded before it is deleted."""

    span: str
    dispatcher: str
    capture: str
    checkpoint_ts: int = 0  # best known checkpoint of the dispatcher when last recorded


@dataclass(frozen=True, kw_only=True)
class Target:
    """A span an operator places (add, move, split child, merged span), recorded before it acts."""

    span: str
    key_range: KeyRange
    capture: str = ""  # chosen destination ("" until chosen)
    dispatcher: str = ""  # name of the dispatcher to create ("" until chosen)
    start_ts: int = 0
    done: bool = False  # reached Working (or given up: ``lost``)
    lost: bool = False  # given up: the span was left Absent for the basic scheduler (or deleted by hand)
    #: Why it was given up, recorded with ``lost`` so that the operator's outcome is a function of its
    #: record (a capture lost then, alive again after a restart, does not change it): DestinationLost /
    #: CaptureLost (its capture lost), NoCapture (none was live when it was to be placed), KeysBusy,
    #: SpanDeleted. Empty on a target recorded before these fields existed.
    lost_reason: str = ""
    lost_message: str = ""  # for a person: what was lost (names the captures) and what happens next


@dataclass(frozen=True, kw_only=True)
class SpanOperator(Record):
    KIND: ClassVar[Kind] = Kind.OPERATOR
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = (
        "changefeed",
        "type",
        "spans",
        "target",
        "split_keys",
        "split_into",
        "delete_spans",
        "source",
        "reason",
    )
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = (
        "phase",
        "stage",
        "status_reason",
        "message",
        "epoch",
        "origins",
        "targets",
        "checkpoint_ts",
        "started_at",
        "finished_at",
    )

    changefeed: str
    type: OpType
    spans: tuple[str, ...]
    target: str = ""  # destination capture (add, move; optional for split and merge)
    split_keys: tuple[bytes, ...] = ()
    split_into: int = 0
    delete_spans: bool = False  # remove: delete the spans afterwards instead of leaving them Absent
    source: OpSource = OpSource.USER
    reason: str = ""  # why it was created (free text; the table removal and repairs fill it)

    phase: OpPhase = OpPhase.PENDING
    stage: Stage = Stage.NONE
    status_reason: str = ""  # machine-readable reason of the phase (e.g. CaptureLost, SpanNotFound)
    message: str = ""
    epoch: int = 0  # epoch of the maintainer that last wrote this status
    origins: tuple[Origin, ...] = ()
    targets: tuple[Target, ...] = ()
    checkpoint_ts: int = 0  # final checkpoint of the origins: the start ts of what replaces them
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def in_flight(self) -> bool:
        return not self.phase.terminal


# --------------------------------------------------------------------------------------------------
# Capture


@dataclass(frozen=True, kw_only=True)
class Capture(Record):
    """A worker, with its Lease folded in: alive while ``now < renew_time + lease_duration`` and the Lease
    still names it.

    ``lease_taken``: the Lease ``capture-<name>`` does not name this capture as its holder (there is none,
    the capture released it at shutdown, or a maintainer took it after it lapsed). Nothing the process
    that held it runs can resume then (its renewals are compare-and-swaps on the Lease), so the maintainer
    may release its dispatchers' finalizers; a lapsed Lease that still names the capture must be taken
    first (``intents.FenceCapture``, with ``lease_version`` as the precondition). See docs/architecture.md,
    Fencing.

    ``progress`` is the report its Lease carries (how far its dispatchers got, see
    ``controller.model.progress``); None when it carries none (or one that does not parse).
    """

    KIND: ClassVar[Kind] = Kind.CAPTURE
    SPEC_FIELDS: ClassVar[tuple[str, ...]] = ("draining",)
    STATUS_FIELDS: ClassVar[tuple[str, ...]] = ("renew_time", "lease_duration", "lease_taken", "progress")

    draining: bool = False
    renew_time: float | None = None  # from the capture's Lease; None: no Lease (or no renewal in it)
    lease_duration: float = 15.0
    lease_taken: bool = False
    lease_version: str = ""  # the Lease's resourceVersion as observed ("" if unknown)
    progress: Progress | None = None  # from the capture's Lease (annotation cdc.maintainer.dev/progress)

    def alive(self, now: float) -> bool:
        return (
            not self.deleting
            and not self.lease_taken
            and self.renew_time is not None
            and now < self.renew_time + self.lease_duration
        )

    def expired(self, now: float) -> bool:
        """Its Lease still names it but has not been renewed for a lease duration (as the caller counts
        time): the capture has stopped delivering by now, but it could resume until the Lease is taken."""
        return not self.lease_taken and (self.renew_time is None or now >= self.renew_time + self.lease_duration)
