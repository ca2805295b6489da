"""Finished operators are deleted once their retention has passed (``userOperatorRetentionSeconds`` for a user's
operator, ``operatorRetentionSeconds`` for the maintainer's), counted from when they finished (or were created, if
later). The rule, and the queue of finished operators the index keeps in order of when their retention ends, so
that a decision finds the due ones (``controller.garbage_collect``) and the next one (``maintainer.next_due``)
without a pass over every operator."""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from controller.model.records import SpanOperator
from controller.model.states import OpSource


def retained(op: SpanOperator) -> bool:
    """``op`` waits for its retention to end: finished, and not being deleted yet."""
    return op.phase.terminal and not op.deleting


def since(op: SpanOperator) -> float:
    """When ``op``'s retention starts."""
    return max(op.finished_at, op.created)


def keep(op: SpanOperator, keep_user: float, keep_other: float) -> float:
    """How long ``op`` is kept once finished."""
    return keep_user if op.source is OpSource.USER else keep_other


class GcQueue:
    """The finished operators of ``operators`` (the index's map, read as it changes), per source, in heaps of
    ``(since, name)``. An entry goes stale when its operator changes or goes; stale entries are dropped when met."""

    def __init__(self, operators: Mapping[str, SpanOperator]) -> None:
        self._operators = operators
        self._heaps: dict[bool, list[tuple[float, str]]] = {True: [], False: []}  # user? -> heap of (since, name)

    def put(self, op: SpanOperator) -> None:
        """``op`` was stored (as it is now): queued if it waits for its retention."""
        if retained(op):
            heapq.heappush(self._heaps[op.source is OpSource.USER], (since(op), op.name))

    def _valid(self, name: str, base: float, user: bool) -> bool:
        op = self._operators.get(name)
        return op is not None and retained(op) and (op.source is OpSource.USER) == user and since(op) == base

    def due(self, now: float, keep_user: float, keep_other: float) -> list[str]:
        """Finished operators past their retention (the heap entries of others are left in place)."""
        due: list[str] = []
        for user, kept in ((True, keep_user), (False, keep_other)):
            heap = self._heaps[user]
            held: list[tuple[float, str]] = []
            while heap and now - heap[0][0] >= kept:
                base, name = heapq.heappop(heap)
                if self._valid(name, base, user):
                    held.append((base, name))
                    due.append(name)
            for entry in held:
                heapq.heappush(heap, entry)
        return sorted(set(due))

    def next(self, keep_user: float, keep_other: float) -> float | None:
        """When the next finished operator's retention ends (None: no finished operator)."""
        out: float | None = None
        for user, kept in ((True, keep_user), (False, keep_other)):
            heap = self._heaps[user]
            while heap and not self._valid(heap[0][1], heap[0][0], user):
                heapq.heappop(heap)
            if heap:
                at = heap[0][0] + kept
                out = at if out is None else min(out, at)
        return out
