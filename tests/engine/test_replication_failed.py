"""A dispatcher its runtime stopped for good (the capture's status message ``failed: <why>``: the etcd source
compacted past its position) is reported on the Changefeed: condition ReplicationFailed True naming how many and
the first one's failure, a warning Event when that changes, the metric from the index's set; False once none is.
The simulator injects such failures (``sim/captures.py``, FAILURE_ODDS) and checks the report after every
decision; the mutant ``failures-not-reported`` is caught there."""

from __future__ import annotations

from dataclasses import replace

from controller.engine import intents as I
from controller.engine.index import Index
from controller.engine.maintainer import FAILED_EVENT, REPLICATION_FAILED, decide
from controller.engine.world import Options
from controller.model.records import Changefeed, Condition
from controller.sim.index_check import verify
from tests.engine.fixtures import (
    CF,
    Kind,
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
B = span("b", key_range=P[1], capture="c0", dispatcher="db", checkpoint_ts=150)
WHY = "the source was compacted to revision 900, past this dispatcher's position (150)"
DA = replace(dispatcher("da", A, "c0", checkpoint_ts=150), message=f"failed: {WHY}")
DB = dispatcher("db", B, "c0", checkpoint_ts=150)


def condition(dec: object, cf: Changefeed) -> Condition | None:
    return written_condition(dec, cf, REPLICATION_FAILED)


def events(dec: object) -> list[I.Event]:
    return written_events(dec, FAILED_EVENT)


def test_a_failed_dispatcher_sets_the_condition_and_says_so_once() -> None:
    assert DA.failure == WHY
    assert DB.failure is None
    w = world(table(1), capture("c0"), A, B, DA, DB)
    dec = decide(w, memory())
    cond = condition(dec, w.changefeed)
    assert cond is not None
    assert (cond.status, cond.reason) == ("True", "DispatcherFailed")
    assert cond.message == f"1 dispatcher(s) stopped for good, the checkpoint held at theirs; da (span a): {WHY}"
    [event] = events(dec)
    assert (event.warning, event.name, event.message) == (True, CF, cond.message)
    # Level-triggered: the next decision over a Changefeed that already says so writes no new Event.
    again = world(table(1), capture("c0"), A, B, DA, DB, cf=changefeed(conditions=(cond,)))
    dec = decide(again, memory())
    assert events(dec) == []
    assert condition(dec, again.changefeed) == cond


def test_the_condition_goes_false_once_no_dispatcher_is_stopped() -> None:
    stopped = Condition(type=REPLICATION_FAILED, status="True", reason="DispatcherFailed", message="1 dispatcher(s)")
    w = world(table(1), capture("c0"), A, B, replace(DA, message=""), DB, cf=changefeed(conditions=(stopped,)))
    cond = condition(decide(w, memory()), w.changefeed)
    assert cond is not None
    assert (cond.status, cond.reason) == ("False", "Replicating")
    # A changefeed that never had the condition does not get one.
    w = world(table(1), capture("c0"), A, B, replace(DA, message=""), DB)
    assert condition(decide(w, memory()), w.changefeed) is None


def test_a_dispatcher_being_deleted_is_not_counted() -> None:
    w = world(table(1), capture("c0"), A, B, replace(DA, deleting=True), DB)
    assert condition(decide(w, memory()), w.changefeed) is None


def test_the_index_keeps_the_failed_set_per_event() -> None:
    index = Index.build(CF, [changefeed(), table(1), A, B, DA, DB])
    assert index.failed_dispatchers == {"da"}
    index.put(replace(DB, message="failed: another reason"))
    assert index.failed_dispatchers == {"da", "db"}
    index.put(replace(DA, deleting=True))
    index.remove(Kind.DISPATCHER, "db")
    assert index.failed_dispatchers == set()
    assert verify(index) == []


def test_the_mutant_reports_nothing() -> None:
    w = world(table(1), capture("c0"), A, B, DA, DB)
    dec = decide(w, memory(), Options(mutants=frozenset({"failures-not-reported"})))
    assert condition(dec, w.changefeed) is None
    assert events(dec) == []
