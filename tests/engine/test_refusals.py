"""``maintainer.observed``: what the caller feeds back after applying a decision (issue 24: creates the API
refuses are reported, not retried silently). The report itself is checked by the runner test
(tests/maintainer/test_runner.py) and by the simulator's refusal check (mutant refusals-not-reported)."""

from __future__ import annotations

from controller.engine.maintainer import Memory, Refusal, observed

REFUSED = Refusal("create Span t1-s0", "Invalid", "denied")


def test_a_refusal_is_kept_until_a_later_create_lands() -> None:
    m = observed(Memory(epoch=1, identity="m"), created=0, refusals=(REFUSED,))
    assert m.refusal == REFUSED
    assert observed(m, created=0, refusals=()).refusal == REFUSED  # a decision with no create says nothing
    assert observed(m, created=2, refusals=()).refusal is None  # creates land again
    other = Refusal("create Dispatcher d", "Forbidden", "no")
    assert observed(m, created=3, refusals=(other, REFUSED)).refusal == other  # a refusal wins over landed ones


def test_no_refusal_leaves_the_memory_as_it_was() -> None:
    m = Memory(epoch=1, identity="m")
    assert observed(m, created=5, refusals=()) is m
