"""A sink that refuses a capture's transactions (PostgreSQL down, refusing connections or writes) is reported
on the Changefeed: the capture retries with back-off and its progress report says so
(``ProgressEntry.sink_error``); the maintainer sets condition SinkUnavailable True naming how many live captures
and the first one's error, a warning Event when it turns True, and False once no live capture says so. The
simulator injects such reports (``sim/captures.py``, SINK_ODDS) and checks every decision; the mutant
``sink-errors-not-reported`` is caught there."""

from __future__ import annotations

from dataclasses import replace

from controller.engine import intents as I
from controller.engine.maintainer import SINK_EVENT, SINK_UNAVAILABLE, decide
from controller.engine.world import Options
from controller.model.progress import Progress, ProgressEntry
from controller.model.records import Capture, Changefeed, Condition
from tests.unit.fixtures import (
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
ERROR = "OperationalError: connection failed: Connection refused"


def reporting(name: str, error: str = "", alive: bool = True, changefeed_name: str = CF) -> Capture:
    entry = ProgressEntry(changefeed=changefeed_name, mode=A.mode, checkpoint_ts=150, dispatchers=1, digest="x",
                          sink_error=error)  # fmt: skip
    return replace(capture(name, alive=alive), progress=Progress(incarnation="i", at=0.0, entries=(entry,)))


def condition(dec: object, cf: Changefeed) -> Condition | None:
    return written_condition(dec, cf, SINK_UNAVAILABLE)


def events(dec: object) -> list[I.Event]:
    return written_events(dec, SINK_EVENT)


def test_a_capture_reporting_a_sink_error_sets_the_condition_and_says_so_once() -> None:
    w = world(table(1), reporting("c0", ERROR), reporting("c1"), A, B, DA, DB)
    dec = decide(w, memory())
    cond = condition(dec, w.changefeed)
    assert cond is not None
    assert (cond.status, cond.reason) == ("True", "SinkError")
    assert cond.message == (
        f"1 capture(s) cannot write to the sink and retry, the checkpoint held meanwhile; c0: {ERROR}"
    )
    [event] = events(dec)
    assert (event.warning, event.name, event.message) == (True, CF, cond.message)
    # Still down, other words (a retry's error): the condition follows, no new Event.
    again = world(table(1), reporting("c0", "OperationalError: timeout"), reporting("c1", ERROR), A, B, DA, DB,
                  cf=changefeed(conditions=(cond,)))  # fmt: skip
    dec = decide(again, memory())
    assert events(dec) == []
    later = condition(dec, again.changefeed)
    assert later is not None
    assert later.message.startswith("2 capture(s) cannot write to the sink")


def test_the_condition_goes_false_once_no_live_capture_says_so() -> None:
    down = Condition(type=SINK_UNAVAILABLE, status="True", reason="SinkError", message="1 capture(s) ...")
    w = world(table(1), reporting("c0"), reporting("c1"), A, B, DA, DB, cf=changefeed(conditions=(down,)))
    cond = condition(decide(w, memory()), w.changefeed)
    assert cond is not None
    assert (cond.status, cond.reason) == ("False", "SinkWriting")
    # A lost capture's last report says nothing about now; another changefeed's error is not this one's.
    w = world(table(1), reporting("c0", ERROR, alive=False), reporting("c1", ERROR, changefeed_name="other"), A, B, DA,
              DB, cf=changefeed(conditions=(down,)))  # fmt: skip
    cond = condition(decide(w, memory()), w.changefeed)
    assert cond is not None
    assert cond.status == "False"
    # A changefeed that never had the condition does not get one.
    w = world(table(1), reporting("c0"), reporting("c1"), A, B, DA, DB)
    assert condition(decide(w, memory()), w.changefeed) is None


def test_the_mutant_reports_nothing() -> None:
    w = world(table(1), reporting("c0", ERROR), reporting("c1"), A, B, DA, DB)
    dec = decide(w, memory(), Options(mutants=frozenset({"sink-errors-not-reported"})))
    assert condition(dec, w.changefeed) is None
    assert events(dec) == []
