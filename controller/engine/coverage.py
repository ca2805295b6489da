"""The coverage rule, in one place: which spans stand for a table's keys, and what is a hole.

A live table's spans cover its key range in every enabled mode, without gaps or overlaps (docs/architecture.md,
invariant 1). Everything in the engine that asks whether they do asks here: the join (engine/tables.py), the
checkpoint's hole test (engine/checkpoint.py), the index's candidate tables (engine/index.py) and the safety net
that fills holes (``repair.coverage``). They differ in two ways only, each a parameter:

- ``new``: whether a span with no state yet (created, not yet validated by the maintainer) counts. The index and
  the safety net count it: a hole fill must not create a span over keys a new span (a split child, a span an
  operator owns before its status is written) already stands for. The join and the checkpoint do not: such a
  span's data is replicated from nothing known yet.
- ``planned``: the ranges in-flight Split and Merge operators will create. The checkpoint and the safety net count
  them as covered (the operator's checkpoint holds the changefeed back meanwhile); each gathers them as it sees
  the operators (``checkpoint._has_hole``, ``repair._planned_ranges``).

The simulator's oracle does not use this module (engine/invariants.py says why).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from controller.model.keys import KeyRange, gaps
from controller.model.records import Span
from controller.model.states import SpanState


def counts(span: Span, *, new: bool = False) -> bool:
    """``span`` stands for its key range in its table's coverage: not being deleted, not Invalid, and validated (a
    state written: ``Span.accepted``); with ``new``, also while it has no state yet."""
    if new:
        return not span.deleting and span.state is not SpanState.INVALID
    return span.accepted


def ranges(spans: Iterable[Span], planned: Iterable[KeyRange] = (), *, new: bool = False) -> list[KeyRange]:
    """The key ranges that cover a table's keys in one mode: those of ``spans`` (the table's, in that mode) that
    count (:func:`counts`), and the ``planned`` ones."""
    return [s.key_range for s in spans if counts(s, new=new)] + list(planned)


def holes(
    table: KeyRange, spans: Iterable[Span], planned: Iterable[KeyRange] = (), *, new: bool = False
) -> list[KeyRange]:
    """The parts of ``table`` (a table's range) that none of ``spans`` (the table's, in one mode) that count, nor a
    ``planned`` range, covers, in key order. Overlaps are not holes."""
    return gaps(table, ranges(spans, planned, new=new))


def exact(table: KeyRange, spans: Iterable[Span], *, new: bool = False) -> bool:
    """The spans that count of ``spans`` (a table's, in one mode) partition ``table`` exactly: no hole, no overlap,
    nothing outside it, and at least one span."""
    return exact_partition(table, ranges(spans, new=new))


def exact_partition(outer: KeyRange, parts: list[KeyRange]) -> bool:
    """``parts`` cover ``outer`` exactly: no hole, no overlap, nothing outside."""
    if not parts:
        return False
    ordered = sorted(parts)
    if ordered[0].start != outer.start or ordered[-1].end != outer.end:
        return False
    return all(a.end == b.start for a, b in itertools.pairwise(ordered))


def covers_differently(old: Span | None, new: Span | None) -> bool:
    """``old`` and ``new`` (versions of one span) may count differently in their table's coverage, with or without
    ``new`` (:func:`counts`): one exists and the other not, or one is deleting, Invalid or not yet validated and the
    other not. A change of state among accepted ones (Absent, Scheduling, Replicating, Removing) does not matter."""
    if old is None or new is None:
        return old is not new
    return (
        old.deleting != new.deleting
        or (old.state is SpanState.INVALID) != (new.state is SpanState.INVALID)
        or (old.state is None) != (new.state is None)
    )
