"""What keeps a changefeed's data from flowing is on the Changefeed, from the captures' reports: each capture names,
per changefeed and side, a trouble (``progress.Trouble``: a Secret missing, a server refusing connections, an
authentication failure...), whether or not any of its dispatchers is Working; the maintainer sets the condition
SourceUnavailable or SinkUnavailable True naming how many live captures and the first one's trouble, with the reason
ConfigurationError when one needs a person (else Retrying), a warning Event when it turns True or its reason changes,
and False once no live capture says so. The simulator injects such reports (``sim/captures.py``, TROUBLE_ODDS) and
checks every decision; the mutants ``source-errors-not-reported`` and ``sink-errors-not-reported`` are caught there
and here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.engine import intents as I
from controller.engine.maintainer import (
    CONFIGURATION_ERROR,
    RETRYING,
    SINK_EVENT,
    SINK_UNAVAILABLE,
    SOURCE_EVENT,
    SOURCE_UNAVAILABLE,
    decide,
)
from controller.engine.world import Options
from controller.model.progress import SINK, SOURCE, Progress, Trouble
from controller.model.records import Capture, Changefeed, Condition
from tests.engine.fixtures import (
    CF,
    capture,
    changefeed,
    dispatcher,
    memory,
    pieces,
    span,
    table,
    world,
    written_condition,
    written_events,
)

P = pieces(1, 2)
A = span("a", key_range=P[0], capture="c0", dispatcher="da", checkpoint_ts=150)
B = span("b", key_range=P[1], capture="c1", dispatcher="db", checkpoint_ts=150)
DA = dispatcher("da", A, "c0", checkpoint_ts=150)
DB = dispatcher("db", B, "c1", checkpoint_ts=150)
REFUSED = "cannot write the sink: OperationalError: connection failed: Connection refused"
MISSING = "the sink Secret ns/pg does not exist"
SIDES = {SOURCE: (SOURCE_UNAVAILABLE, SOURCE_EVENT), SINK: (SINK_UNAVAILABLE, SINK_EVENT)}


def reporting(name: str, *troubles: Trouble, alive: bool = True) -> Capture:
    """A capture whose report has no entry at all (no dispatcher Working yet) and these troubles."""
    return replace(capture(name, alive=alive), progress=Progress(incarnation="i", at=0.0, troubles=troubles))


def trouble(side: str = SINK, message: str = REFUSED, transient: bool = True, cf: str = CF) -> Trouble:
    return Trouble(changefeed=cf, side=side, transient=transient, message=message)


def condition(dec: object, cf: Changefeed, side: str = SINK) -> Condition | None:
    return written_condition(dec, cf, SIDES[side][0])


def events(dec: object, side: str = SINK) -> list[I.Event]:
    return written_events(dec, SIDES[side][1])


@pytest.mark.parametrize("side", [SOURCE, SINK])
def test_a_capture_reporting_a_trouble_sets_the_condition_and_says_so_once(side: str) -> None:
    w = world(table(1), reporting("c0", trouble(side)), reporting("c1"), A, B, DA, DB)
    dec = decide(w, memory())
    cond = condition(dec, w.changefeed, side)
    assert cond is not None
    assert (cond.status, cond.reason) == ("True", RETRYING)
    assert cond.message == (
        f"1 capture(s) cannot use the {side}; c0: {REFUSED} (retrying; the checkpoint holds, nothing is lost)"
    )
    [event] = events(dec, side)
    assert (event.warning, event.name, event.message) == (True, CF, cond.message)
    other = SINK if side == SOURCE else SOURCE
    assert condition(dec, w.changefeed, other) is None  # the other side never had a trouble
    # Still down, other words (a retry's error): the condition follows, no new Event.
    again = world(table(1), reporting("c0", trouble(side, "cannot write the sink: timeout")),
                  reporting("c1", trouble(side)), A, B, DA, DB, cf=changefeed(conditions=(cond,)))  # fmt: skip
    dec = decide(again, memory())
    assert events(dec, side) == []
    later = condition(dec, again.changefeed, side)
    assert later is not None
    assert later.message.startswith(f"2 capture(s) cannot use the {side}")
    # One capture now needs a person: the reason changes, it is named first, and an Event says so.
    stuck = world(table(1), reporting("c0", trouble(side)), reporting("c1", trouble(side, MISSING, transient=False)),
                  A, B, DA, DB, cf=changefeed(conditions=(later,)))  # fmt: skip
    dec = decide(stuck, memory())
    cond = condition(dec, stuck.changefeed, side)
    assert cond is not None
    assert (cond.status, cond.reason) == ("True", CONFIGURATION_ERROR)
    assert cond.message.startswith(f"2 capture(s) cannot use the {side}; c1: {MISSING} (fix it")
    [event] = events(dec, side)
    assert event.message == cond.message


def test_the_condition_goes_false_once_no_live_capture_says_so() -> None:
    down = Condition(type=SINK_UNAVAILABLE, status="True", reason=RETRYING, message="1 capture(s) ...")
    w = world(table(1), reporting("c0"), reporting("c1"), A, B, DA, DB, cf=changefeed(conditions=(down,)))
    cond = condition(decide(w, memory()), w.changefeed)
    assert cond is not None
    assert (cond.status, cond.reason) == ("False", "Available")
    # A lost capture's last report says nothing about now; another changefeed's trouble is not this one's.
    w = world(table(1), reporting("c0", trouble(), alive=False), reporting("c1", trouble(cf="other")), A, B, DA, DB,
              cf=changefeed(conditions=(down,)))  # fmt: skip
    cond = condition(decide(w, memory()), w.changefeed)
    assert cond is not None
    assert cond.status == "False"
    # A changefeed that never had the condition does not get one.
    w = world(table(1), reporting("c0"), reporting("c1"), A, B, DA, DB)
    assert condition(decide(w, memory()), w.changefeed) is None


@pytest.mark.parametrize("side", [SOURCE, SINK])
def test_the_mutant_reports_nothing(side: str) -> None:
    w = world(table(1), reporting("c0", trouble(side)), reporting("c1"), A, B, DA, DB)
    dec = decide(w, memory(), Options(mutants=frozenset({f"{side}-errors-not-reported"})))
    assert condition(dec, w.changefeed, side) is None
    assert events(dec, side) == []
