"""Enumerations shared by resources, the engine and the simulator.

The string values are exactly what appears in the resources (``status.state``, ``spec.type``...).
"""

from __future__ import annotations

from enum import StrEnum

GROUP = "cdc.maintainer.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Finalizer the maintainer puts on a Table so that deleting it first removes its spans.
TABLE_FINALIZER = f"{GROUP}/spans"
#: Finalizer the maintainer puts on a Changefeed: deleting it waits for the teardown (engine/teardown.py).
CHANGEFEED_FINALIZER = f"{GROUP}/teardown"
#: Finalizer the maintainer puts on a Dispatcher; the capture releases it once the dispatcher is closed.
DISPATCHER_FINALIZER = f"{GROUP}/dispatcher-closed"


class Kind(StrEnum):
    CHANGEFEED = "Changefeed"
    TABLE = "Table"
    SPAN = "Span"
    DISPATCHER = "Dispatcher"
    OPERATOR = "SpanOperator"
    CAPTURE = "Capture"


class Mode(StrEnum):
    """Which stream a span and its dispatcher belong to. Each mode is scheduled independently."""

    DEFAULT = "default"
    REDO = "redo"


class SpanState(StrEnum):
    ABSENT = "Absent"  # no dispatcher; the basic scheduler will place it
    SCHEDULING = "Scheduling"  # an operator is placing it
    REPLICATING = "Replicating"  # exactly one dispatcher replicates it
    REMOVING = "Removing"  # an operator is closing its dispatcher
    INVALID = "Invalid"  # a user-applied span the maintainer refused; see status.message


class DispatcherState(StrEnum):
    PENDING = ""  # created, not yet picked up by its capture
    INITIALIZING = "Initializing"
    WORKING = "Working"
    STOPPED = "Stopped"  # closed or failed; its checkpoint is final
    REMOVED = "Removed"
    REJECTED = "Rejected"  # refused by the capture: stamped with a stale epoch


#: States in which a dispatcher may write to the downstream (single-owner invariant).
LIVE_DISPATCHER_STATES = frozenset({DispatcherState.INITIALIZING, DispatcherState.WORKING})
#: States from which a dispatcher never writes again.
CLOSED_DISPATCHER_STATES = frozenset({DispatcherState.STOPPED, DispatcherState.REMOVED, DispatcherState.REJECTED})


class OpType(StrEnum):
    ADD = "Add"
    REMOVE = "Remove"
    MOVE = "Move"
    SPLIT = "Split"
    MERGE = "Merge"


class OpPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELED = "Canceled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


class Stage(StrEnum):
    """Operator stages. Each operator module documents which it uses and how they connect."""

    NONE = ""
    ADD_DEST = "AddDest"  # create the destination dispatcher, wait for Working
    REMOVE_ORIGIN = "RemoveOrigin"  # delete the origin dispatcher(s), wait until gone
    ABORT = "Abort"  # undo: close what this operator created, then leave the span Absent
    CREATE_SPANS = "CreateSpans"  # split/merge: create the new Span objects, delete the replaced ones
    ADD_SPANS = "AddSpans"  # split/merge: create a dispatcher for each new span, wait for Working
    FINISH = "Finish"  # remove: settle the spans (delete or Absent)


_TERMINAL = frozenset({OpPhase.SUCCEEDED, OpPhase.FAILED, OpPhase.CANCELED})


class OpSource(StrEnum):
    USER = "user"
    SCHEDULER = "scheduler"
    MAINTAINER = "maintainer"  # safety net and table removal


class SchedulerState(StrEnum):
    """``Changefeed.status.scheduler.state``: what the automatic schedulers are doing."""

    NONE = ""  # not written yet
    ACTIVE = "Active"
    PAUSED = "Paused"  # spec.paused: no automatic scheduler runs
    DRAINING = "Draining"  # a draining capture still holds spans; balancing waits
    COOLING_DOWN = "CoolingDown"  # a drain finished; balancing resumes at balanceResumesAt
