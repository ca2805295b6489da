"""The changefeed checkpoint: the ts up to which every span of every live table has been delivered.

It is the minimum, over the spans of live tables, of what is known for each:

- a Replicating span: the best of its dispatcher's persisted checkpoint (written when it became
  Working), the span's persisted one, and the minimum its capture reported for a set of dispatchers
  that is exactly the set the maintainer believes it runs (``engine/progress.py``);
- any other span: its persisted checkpoint (the start ts it will be replicated from);
- a span some in-flight Add, Move, Split or Merge owns: also the operator's recorded checkpoint (the
  ts its new dispatchers start from), which holds the changefeed back while the span is in flight.

It never goes backwards: a lower minimum (cannot happen unless a span is created below the
checkpoint, which the engine never does) leaves the published value where it is.
"""

from __future__ import annotations

from collections import defaultdict

from controller.engine import progress
from controller.engine.world import Tick
from controller.model.keys import KeyRange, gaps
from controller.model.states import DispatcherState, Mode, OpPhase, OpType, SpanState


def compute(tick: Tick) -> int:
    low: int | None = None

    def lower(value: int) -> None:
        nonlocal low
        low = value if low is None else min(low, value)

    reported = progress.covered(tick)
    for span in tick.spans.values():
        if span.state in (None, SpanState.INVALID) or not tick.table_live(span.table_id):
            continue
        if not tick.mode_enabled(span.mode):
            continue
        d = tick.dispatchers.get(span.dispatcher) if span.dispatcher else None
        if span.state is SpanState.REPLICATING and d is not None and d.state is DispatcherState.WORKING:
            lower(max(d.known_checkpoint, span.known_checkpoint, reported.get(d.name, 0)))
        else:
            lower(span.known_checkpoint)
    for op in tick.operators.values():
        if op.phase is OpPhase.RUNNING and op.type is not OpType.REMOVE:
            if any(tick.table_live(s.table_id) for s in (tick.spans.get(n) for n in op.spans) if s):
                lower(op.checkpoint_ts)
            for t in op.targets:
                if not t.done and t.start_ts:
                    lower(t.start_ts)
    previous = tick.checkpoint_floor
    if low is None or _has_hole(tick):
        return previous
    return max(previous, low)


def _has_hole(tick: Tick) -> bool:
    """Keys of a live table that no accepted span (nor an operator's planned span) covers.

    Their data is replicated by nobody, so nothing bounds how far they are delivered: the checkpoint
    must not move until the safety net has covered them again (simulator seed 34720).
    """
    ranges: dict[tuple[int, Mode], list[KeyRange]] = defaultdict(list)
    for span in tick.spans.values():
        if span.state not in (None, SpanState.INVALID) and not span.deleting:
            ranges[(span.table_id, span.mode)].append(span.key_range)
    for op in tick.operators.values():
        if op.phase is OpPhase.RUNNING and op.type in (OpType.SPLIT, OpType.MERGE):
            for t in op.targets:
                s = tick.spans.get(t.span) or tick.world.spans.get(op.spans[0]) if op.spans else None
                if s is not None:
                    ranges[(s.table_id, s.mode)].append(t.key_range)
    for table in tick.tables_by_id.values():
        if table.deleting or table.changefeed != tick.changefeed.name:
            continue
        for mode in tick.changefeed.modes:
            if gaps(table.key_range, ranges.get((table.table_id, mode), [])):
                return True
    return False
