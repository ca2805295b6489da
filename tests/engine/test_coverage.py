"""The coverage rule (engine/coverage.py), the one the join, the checkpoint, the index and the safety net ask:
which spans stand for a table's keys (validated ones; with ``new``, those with no state yet too; never Invalid or
deleted ones), planned ranges, holes, and the exact partition."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine import coverage
from controller.model.keys import KeyRange
from tests.engine.fixtures import SpanState, pieces, span, trange

T = trange(1)
P = pieces(1, 4)
#: One span per piece, in every state that counts once validated.
VALIDATED = [
    span("a", key_range=P[0], state=SpanState.ABSENT),
    span("b", key_range=P[1], state=SpanState.SCHEDULING),
    span("c", key_range=P[2], state=SpanState.REPLICATING),
    span("d", key_range=P[3], state=SpanState.REMOVING),
]


def test_validated_spans_that_partition_the_table_leave_no_hole() -> None:
    assert coverage.holes(T, VALIDATED) == []
    assert coverage.exact(T, VALIDATED)
    assert all(coverage.counts(s) and coverage.counts(s, new=True) for s in VALIDATED)


def test_a_missing_piece_is_a_hole_and_no_span_at_all_is_one_hole() -> None:
    spans = [VALIDATED[0], VALIDATED[2]]
    assert coverage.holes(T, spans) == [P[1], KeyRange(P[3].start, P[3].end)]
    assert not coverage.exact(T, spans)
    assert coverage.holes(T, []) == [T]
    assert not coverage.exact(T, [])


def test_an_overlap_is_no_hole_but_no_exact_partition() -> None:
    wide = span("w", key_range=KeyRange(P[0].start, P[1].end), state=SpanState.ABSENT)
    spans = [*VALIDATED, wide]
    assert coverage.holes(T, spans) == []
    assert not coverage.exact(T, spans)


def test_a_range_beyond_the_table_is_no_exact_partition() -> None:
    beyond = span("x", key_range=KeyRange(P[3].start, trange(2).end), state=SpanState.ABSENT)
    spans = [*VALIDATED[:3], beyond]
    assert coverage.holes(T, spans) == []
    assert not coverage.exact(T, spans)


@pytest.mark.parametrize(
    ("change", "counts", "counts_new"),
    [
        (dict(state=None), False, True),  # created, not validated yet: counts only with ``new``
        (dict(state=SpanState.INVALID), False, False),  # refused: never
        (dict(deleting=True), False, False),  # being deleted: never
        (dict(state=None, deleting=True), False, False),
    ],
    ids=["no state", "invalid", "deleting", "no state, deleting"],
)
def test_which_spans_count(change: dict[str, object], counts: bool, counts_new: bool) -> None:
    other = replace(VALIDATED[1], **change)  # type: ignore[arg-type]
    spans = [VALIDATED[0], other, *VALIDATED[2:]]
    assert coverage.counts(other) is counts
    assert coverage.counts(other, new=True) is counts_new
    assert coverage.holes(T, spans) == ([] if counts else [P[1]])
    assert coverage.holes(T, spans, new=True) == ([] if counts_new else [P[1]])
    assert coverage.exact(T, spans, new=True) is counts_new
    assert coverage.counts(other) is other.accepted  # without ``new``: ``Span.accepted``


def test_planned_ranges_cover_what_no_span_does() -> None:
    spans = [VALIDATED[0], VALIDATED[3]]  # the middle is being split or merged: its new spans are planned
    assert coverage.holes(T, spans, [P[1]]) == [P[2]]
    assert coverage.holes(T, spans, [P[1], P[2]]) == []
    assert coverage.holes(T, [], [T]) == []


def test_what_may_count_differently() -> None:
    s = VALIDATED[0]
    assert not coverage.covers_differently(s, replace(s, state=SpanState.REPLICATING))
    assert not coverage.covers_differently(None, None)
    for other in (None, replace(s, state=None), replace(s, state=SpanState.INVALID), replace(s, deleting=True)):
        assert coverage.covers_differently(s, other)
        assert coverage.covers_differently(other, s)
