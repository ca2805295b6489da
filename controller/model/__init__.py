"""Plain data: key ranges, states, records, and their conversion to and from resources. No I/O."""

from controller.model.keys import KeyRange
from controller.model.records import (
    Capture,
    Changefeed,
    Condition,
    Dispatcher,
    Origin,
    Record,
    SchedulerConfig,
    Span,
    SpanCounts,
    SpanOperator,
    Table,
    Target,
)
from controller.model.states import (
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SpanState,
    Stage,
)

__all__ = [
    "Capture",
    "Changefeed",
    "Condition",
    "Dispatcher",
    "DispatcherState",
    "KeyRange",
    "Kind",
    "Mode",
    "OpPhase",
    "OpSource",
    "OpType",
    "Origin",
    "Record",
    "SchedulerConfig",
    "Span",
    "SpanCounts",
    "SpanOperator",
    "SpanState",
    "Stage",
    "Table",
    "Target",
]
