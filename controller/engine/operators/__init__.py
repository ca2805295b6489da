"""One module per operator type. Each exposes ``start(tick, op)`` and ``advance(tick, op)``.

Both return the chain of writes for that operator in this tick (possibly empty). ``start`` takes a
Pending operator, validates it against the world (a user operator that cannot run fails with a reason
and never half-runs) and records its first stage; ``advance`` re-derives the current stage's progress
from the observed world and re-issues whatever is still missing, so that a restored operator and a
running one are handled by exactly the same code.
"""

from __future__ import annotations

from collections.abc import Callable

from controller.engine.intents import Write
from controller.engine.operators import add, merge, move, remove, split
from controller.engine.world import Tick
from controller.model.records import SpanOperator
from controller.model.states import OpType

Handler = Callable[[Tick, SpanOperator], list[Write]]

START: dict[OpType, Handler] = {
    OpType.ADD: add.start,
    OpType.REMOVE: remove.start,
    OpType.MOVE: move.start,
    OpType.SPLIT: split.start,
    OpType.MERGE: merge.start,
}

ADVANCE: dict[OpType, Handler] = {
    OpType.ADD: add.advance,
    OpType.REMOVE: remove.advance,
    OpType.MOVE: move.advance,
    OpType.SPLIT: split.advance,
    OpType.MERGE: merge.advance,
}
