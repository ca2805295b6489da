"""``in_order`` sorts exactly as ``sorted`` does, and a full decision never sorts more than a run in one call;
an ``Overlay``'s values and length are what its lookups give (the full decision's passes).

Why it matters: the decision runs in a thread beside the event loop, and one C call (a sort) holds the GIL
for as long as it runs; at 100,000 spans the full audit's sorts held the loop for about 90 ms (issue 25).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.engine.maintainer import Options, decide
from controller.engine.world import Overlay, World
from controller.model import ordering
from controller.model.ordering import in_order
from controller.model.states import SpanState
from tests.engine import fixtures as F


@given(
    items=st.lists(st.tuples(st.integers(0, 5), st.integers()), max_size=200),
    run=st.integers(1, 40),
    reverse=st.booleans(),
)
def test_in_order_is_sorted_ties_and_reverse_included(items: list[tuple[int, int]], run: int, reverse: bool) -> None:
    # Keys tie often (0..5): equal keys keep their input order, as ``sorted``'s do (the second field tells).
    def key(x: tuple[int, int]) -> int:
        return x[0]

    assert in_order(items, key=key, reverse=reverse, run=run) == sorted(items, key=key, reverse=reverse)
    assert in_order(iter(items), key=None, run=run) == sorted(items)


@given(
    items=st.lists(st.tuples(st.integers(0, 5), st.integers()), max_size=100),
    run=st.integers(1, 10),
    reverse=st.booleans(),
)
def test_in_order_of_what_is_in_order_already(items: list[tuple[int, int]], run: int, reverse: bool) -> None:
    """Input already in key order (a cache listed by name): the runs are joined, not merged; ties across a run's
    boundary keep their input order (the second field tells)."""

    def key(x: tuple[int, int]) -> int:
        return x[0]

    ordered = sorted(items, key=key, reverse=reverse)
    assert in_order(ordered, key=key, reverse=reverse, run=run) == sorted(ordered, key=key, reverse=reverse)


def test_in_order_sorts_no_more_than_a_run_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _record_sorts(monkeypatch)
    assert in_order(list(range(100, 0, -1)), key=None, run=8) == list(range(1, 101))
    assert max(sizes) <= 8


def _record_sorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = builtins.sorted

    def recording(items: Iterable[Any], key: Callable[[Any], Any] | None = None, reverse: bool = False) -> list[Any]:
        seq = list(items)
        sizes.append(len(seq))
        return real(seq, key=key, reverse=reverse)

    monkeypatch.setattr(builtins, "sorted", recording)
    return sizes


def _big_world() -> World:
    """Every full-pass rule has a pool of more than 16: 40 Replicating spans all on one capture (balance),
    40 Absent ones (the scheduler, repair), 20 dispatchers whose span does not exist (repair)."""
    records: list[Any] = [F.capture("c0"), F.capture("c1"), F.capture("c2"), F.table(1), F.table(2)]
    for i, kr in enumerate(F.pieces(1, 40)):
        sp = F.span(f"a{i:02}", table_id=1, key_range=kr, capture="c0", dispatcher=f"da{i:02}")
        records += [sp, F.dispatcher(f"da{i:02}", sp, "c0")]
    for i, kr in enumerate(F.pieces(2, 40)):
        records.append(F.span(f"b{i:02}", table_id=2, key_range=kr, state=SpanState.ABSENT))
    for i, kr in enumerate(F.pieces(3, 20)):
        ghost = F.span(f"gone{i:02}", table_id=3, key_range=kr)
        records.append(F.dispatcher(f"dg{i:02}", ghost, "c1"))
    return F.world(*records)


def test_a_full_decision_sorts_in_runs_and_decides_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = F.flat(decide(_big_world(), F.memory(), Options(audit_interval=0)), keep_bookkeeping=True)
    assert whole, "the world needs decisions: placements, closes, moves"
    monkeypatch.setattr(ordering, "RUN", 16)
    sizes = _record_sorts(monkeypatch)
    in_runs = F.flat(decide(_big_world(), F.memory(), Options(audit_interval=0)), keep_bookkeeping=True)
    assert in_runs == whole
    assert max(sizes) <= 16, f"one sort call had {max(sizes)} items"


@given(
    base=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(), max_size=8),
    ops=st.lists(st.tuples(st.sampled_from("abcdefghij"), st.one_of(st.none(), st.integers())), max_size=12),
)
def test_an_overlays_values_and_length_are_its_lookups(base: dict[str, int], ops: list[tuple[str, int | None]]) -> None:
    """``Overlay.values()`` reads the base's items and ``len`` counts the changes only (a full decision's passes
    over 100,000 records): both must be what a lookup of every name gives."""
    overlay: Overlay[int] = Overlay(base)
    for name, value in ops:
        if value is None:
            overlay.pop(name)
        else:
            overlay[name] = value
    assert list(overlay.values()) == [overlay[name] for name in overlay]
    assert len(overlay) == sum(1 for _ in overlay)
    assert len(overlay.values()) == len(list(overlay.values()))


def test_an_overlay_set_while_its_values_are_read_shows_the_new_value() -> None:
    overlay: Overlay[int] = Overlay({"a": 1, "b": 2, "c": 3})
    seen = []
    for value in overlay.values():
        seen.append(value)
        if value == 1:
            overlay["c"] = 30  # a later name, changed mid-pass: read through the overlay as __getitem__ would
            overlay.pop("b")
    assert seen == [1, 30]
