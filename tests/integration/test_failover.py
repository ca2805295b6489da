"""Maintainer failover with operators in flight: real maintainer and capture processes, real signals.

Mirrors TiCDC's ``maintainer_failover_when_operator``: three captures; the capture hooks
(``cdc.maintainer.dev/hold-close`` / ``pause-create``) hold an Add, a Remove, a Move, a Split and a Merge
in flight; the maintainer process is killed; a new one takes over; the hooks are released; every operator
must finish with its original intent and the invariants of ``engine.invariants`` must hold, as read back
from the resources. Every poll also checks single ownership (at most one Initializing/Working dispatcher
per key per mode among live captures) and that no overlap of spans lacks an operator to explain it.

Timings are short (maintainer Lease 3 s, renew deadline 2 s, retry 0.5 s, tick 0.2 s; capture Lease 4 s,
renewals, which carry the progress reports, every 0.5 s, fencing after 3 s). Every test ends with the
delivery ledger's no-gap check (``harness.no_gap``). Runs against the embedded API server, or against a
real cluster when ``CFM_TEST_KUBECONFIG`` names a kubeconfig (see conftest.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from controller.model.keys import KeyRange, table_key
from controller.model.records import SpanOperator
from controller.model.states import DispatcherState, OpPhase, OpType, SpanState, Stage
from tests.integration.harness import (
    CAPTURE_LEASE,
    CHANGEFEED,
    MAINTAINER_LEASE,
    Api,
    Snap,
    System,
    Watch,
    all_settled,
    no_gap,
    set_hooks,
)

CAPTURES = ["c0", "c1", "c2"]
#: t1: moved; t2: split; t3: dropped; t6: two spans, merged; t4 and t5 are created mid-scenario.
INITIAL_TABLES = ((1, 0), (2, 0), (3, 0), (6, 2))
SETTLE = 60.0


# ------------------------------------------------------------------------------------------------------
# Helpers


def boot(api: Api, system: System, *maintainers: str, redo: bool = False) -> tuple[Watch, Snap]:
    """Captures up (Leases current), the changefeed and its tables applied, maintainers started, all settled."""
    watch = Watch(api, system)
    for c in CAPTURES:
        system.capture(c)
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.changefeed(redo=redo)
    for table_id, pre_split in INITIAL_TABLES:
        api.table(table_id, pre_split)
    for m in maintainers:
        system.maintainer(m)
    modes = ("default", "redo") if redo else ("default",)
    expected = sum(max(1, pre) for _, pre in INITIAL_TABLES) * len(modes)

    def placed(s: Snap) -> object:
        if len(s.spans) != expected:
            return f"{len(s.spans)} spans, want {expected}"
        return all_settled(s)

    return watch, watch.until(placed, "initial placement", SETTLE)


def op(snap: Snap, name: str) -> SpanOperator:
    found = snap.operators.get(name)
    assert found is not None, f"operator {name} is gone"
    return found


def published(snap: Snap, identity: str, above: int) -> object:
    """``identity`` holds the Lease, published a higher epoch, and has bootstrapped."""
    cond = snap.changefeed.condition("Bootstrapped") if snap.changefeed else None
    if snap.epoch <= above or snap.holder != identity:
        return f"epoch {snap.epoch} holder {snap.holder!r}"
    if snap.lease_holder() != identity:
        return f"lease held by {snap.lease_holder()!r}"
    if cond is None or cond.status != "True" or f"at epoch {snap.epoch}" not in cond.message:
        return f"not bootstrapped: {cond}"
    return True


def terminal(names: list[str]) -> object:
    def check(s: Snap) -> object:
        running = [n for n in names if n not in s.operators or s.operators[n].in_flight]
        if running:
            return f"in flight: {running}"
        return all_settled(s)

    return check


@dataclass
class InFlight:
    """What a scenario holds in flight: operators and their stages, new tables, the dropped table's spans."""

    stages: dict[str, Stage] = field(default_factory=dict)  # operator -> stage it is held in
    adds: dict[int, list[str]] = field(default_factory=dict)  # new table -> its spans (every mode)
    removed_spans: list[str] = field(default_factory=list)  # spans of the dropped table


def held(flight: InFlight, expect_adds: bool, modes: tuple[str, ...]) -> object:
    """Every tracked operator Running in its stage with its step issued; every new span's placement recorded
    (Scheduling with its destination, no operator: engine/placement.py) and its dispatcher created."""

    def check(s: Snap) -> object:
        for name, stage in flight.stages.items():
            o = s.operators.get(name)
            if o is None or o.phase is not OpPhase.RUNNING or o.stage is not stage:
                return f"{name}: {o and (o.phase, o.stage)}, want Running/{stage}"
            if stage is Stage.REMOVE_ORIGIN:
                for origin in o.origins:
                    d = s.dispatchers.get(origin.dispatcher)
                    if d is None or not d.deleting:
                        return f"{name}: origin {origin.dispatcher} not being deleted"
            else:
                for t in o.targets:
                    if t.dispatcher not in s.dispatchers:
                        return f"{name}: target dispatcher {t.dispatcher} not created yet"
        if expect_adds:
            for table_id in flight.adds:
                spans = [sp for m in modes for sp in s.spans_of(table_id, m)]
                if len(spans) != len(modes):
                    return f"t{table_id}: spans {[sp.name for sp in spans]}"
                for sp in spans:
                    placed = sp.state is SpanState.SCHEDULING and not sp.operator and sp.capture
                    if not placed or sp.dispatcher not in s.dispatchers:
                        return f"t{table_id}: span {sp.name} {sp.state} on {sp.capture!r}, dispatcher {sp.dispatcher!r}"
        return True

    return check


# ------------------------------------------------------------------------------------------------------
# 1. Every operator type in flight across a SIGKILL of the maintainer (TiCDC's scenario)


@pytest.mark.parametrize(
    ("redo", "hold"),
    [(False, "close"), (True, "close"), (False, "create")],
    ids=["default-held-closing", "redo-held-closing", "default-held-creating"],
)
def test_every_operator_finishes_after_maintainer_sigkill(api: Api, system: System, redo: bool, hold: str) -> None:
    """hold "close": hold-close and pause-create on every capture (as TiCDC): Move, Split, Merge and the
    dropped table's Remove wait in RemoveOrigin, the new tables' Adds in AddDest. hold "create": only
    pause-create, so Move waits in AddDest and Split and Merge in AddSpans (origins already closed)."""
    modes = ("default", "redo") if redo else ("default",)
    op_mode = "redo" if redo else "default"  # redo mode: operate on the redo spans
    watch, snap = boot(api, system, "m1", redo=redo)
    epoch1 = snap.epoch
    assert snap.holder == "m1"
    assert snap.lease_holder() == "m1"

    (mover,) = snap.spans_of(1, op_mode)
    target = next(c for c in CAPTURES if c != mover.capture)
    (parent,) = snap.spans_of(2, op_mode)
    t2 = table_key(2)
    cuts = [t2 + b"\x40", t2 + b"\x80"]
    sources = snap.spans_of(6, op_mode)
    assert len(sources) == 2
    others = {(t, m): [sp.name for sp in snap.spans_of(t, m)] for t in (1, 2, 6) for m in modes if m != op_mode}

    if hold == "close":
        set_hooks(api, system, CAPTURES, hold_close="*", pause_create="*")
    else:
        set_hooks(api, system, CAPTURES, pause_create="*")
    api.operator("op-move", "Move", [mover.name], target=target)
    api.operator("op-split", "Split", [parent.name], splitKeys=[k.hex() for k in cuts])
    api.operator("op-merge", "Merge", [s.name for s in sources])
    flight = InFlight()
    if hold == "close":
        flight.stages = {
            "op-move": Stage.REMOVE_ORIGIN,
            "op-split": Stage.REMOVE_ORIGIN,
            "op-merge": Stage.REMOVE_ORIGIN,
        }
        flight.removed_spans = [sp.name for m in modes for sp in snap.spans_of(3, m)]
        api.delete("tables", "t3")
    else:
        flight.stages = {"op-move": Stage.ADD_DEST, "op-split": Stage.ADD_SPANS, "op-merge": Stage.ADD_SPANS}
    for table_id in (4, 5):
        api.table(table_id)
        flight.adds[table_id] = []

    def held_with_remove(s: Snap) -> object:
        result = held(flight, True, modes)(s)
        if result is not True or not flight.removed_spans:
            return result
        gone = set(flight.removed_spans)
        remove = [o for o in s.operators.values() if o.type is OpType.REMOVE and set(o.spans) & gone]
        if len(remove) != 1 or remove[0].phase is not OpPhase.RUNNING or remove[0].stage is not Stage.REMOVE_ORIGIN:
            return f"removal: {[(o.name, o.phase, o.stage) for o in remove]}"
        ds = [d for d in s.dispatchers.values() if d.table_id == 3]
        if len(ds) != len(modes) or not all(d.deleting and d.state is DispatcherState.WORKING for d in ds):
            return f"t3 dispatchers {[(d.name, d.state, d.deleting) for d in ds]}"
        return True

    snap = watch.until(held_with_remove, "operators held in flight", 30)
    for table_id in flight.adds:
        flight.adds[table_id] = sorted(sp.name for m in modes for sp in snap.spans_of(table_id, m))
    # The new tables are replicated from the checkpoint at which the maintainer took them on.
    since = {t: min(sp.start_ts for m in modes for sp in snap.spans_of(t, m)) for t in flight.adds}
    # Where each new span is being placed, as recorded before the kill: it must end there.
    destinations = {sp: snap.spans[sp].capture for names in flight.adds.values() for sp in names}
    removal = ""
    if flight.removed_spans:
        removal = next(
            o.name
            for o in snap.operators.values()
            if o.type is OpType.REMOVE and set(o.spans) & set(flight.removed_spans)
        )
    tracked = [*flight.stages, *([removal] if removal else [])]

    system.signal("m1", signal.SIGKILL)
    in_flight = sum(1 for o in watch.poll().operators.values() if o.in_flight)
    assert in_flight == len(tracked), watch.fail(f"{in_flight} in flight, tracked {tracked}")
    system.maintainer("m2")
    snap = watch.until(lambda s: published(s, "m2", epoch1), "m2 to take over", 30)
    epoch2 = snap.epoch
    cond = snap.changefeed.condition("Bootstrapped") if snap.changefeed else None
    assert cond is not None
    assert f"restored {in_flight} in-flight operators" in cond.message, watch.fail(cond.message, snap)
    # Restored where they were: still held in the same stages.
    in_place = held(flight, True, modes)(snap)
    assert in_place is True, watch.fail(f"not restored in place: {in_place}")

    set_hooks(api, system, CAPTURES, hold_close=None, pause_create=None)
    final = watch.until(terminal(tracked), "every operator to finish and the world to settle", SETTLE)

    with watch.explained(final):
        # The new maintainer leads, at a higher epoch, and every tracked operator finished under it.
        assert final.epoch == epoch2 > epoch1
        assert final.holder == final.lease_holder() == "m2"
        for name in tracked:
            o = op(final, name)
            assert o.phase is OpPhase.SUCCEEDED, f"{name} ended {o.phase} {o.status_reason}: {o.message}"
            assert o.epoch == epoch2, f"{name} last written at epoch {o.epoch}"
            for t in o.targets:  # every dispatcher an operator started after the failover carries the new epoch
                span = final.spans.get(t.span)
                assert span is not None, f"{name}: target span {t.span} does not exist"
                d = final.dispatchers[span.dispatcher]
                assert d.epoch == epoch2, f"{name}: {d.name} at epoch {d.epoch}"

        # Move: on the capture the user named (and still recorded as the destination).
        assert [t.capture for t in op(final, "op-move").targets] == [target]
        moved = final.spans[mover.name]
        assert moved.state is SpanState.REPLICATING
        assert moved.capture == target
        d = final.dispatchers[moved.dispatcher]
        assert (d.capture, d.state) == (target, DispatcherState.WORKING)

        # Split: exactly the requested pieces, the parent gone.
        bounds = [parent.key_range.start, *cuts, parent.key_range.end]
        children = final.spans_of(2, op_mode)
        assert [c.key_range for c in children] == [KeyRange(a, b) for a, b in itertools.pairwise(bounds)]
        assert sorted(c.name for c in children) == sorted(t.span for t in op(final, "op-split").targets)
        assert parent.name not in final.spans

        # Merge: one span covering exactly the sources, the sources gone.
        (merged,) = final.spans_of(6, op_mode)
        assert merged.key_range == KeyRange(sources[0].key_range.start, sources[-1].key_range.end)
        assert [merged.name] == [t.span for t in op(final, "op-merge").targets]
        assert not {s.name for s in sources} & set(final.spans)

        # The other mode was left alone.
        for (table_id, m), names in others.items():
            assert [sp.name for sp in final.spans_of(table_id, m)] == names

        # Placements: the new tables' spans (the same ones) Replicating on the capture recorded before the kill,
        # their dispatcher (re-made: the first carried the old epoch, which the capture refused) at the new epoch.
        for table_id, names in flight.adds.items():
            spans = [sp for m in modes for sp in final.spans_of(table_id, m)]
            assert sorted(sp.name for sp in spans) == names
            assert all(sp.state is SpanState.REPLICATING for sp in spans)
            assert {sp.name: sp.capture for sp in spans} == {n: destinations[n] for n in names}
            assert all(final.dispatchers[sp.dispatcher].epoch == epoch2 for sp in spans)

    # Remove: the table, its spans and dispatchers gone, and they stay gone.
    if hold == "close":

        def t3_gone(s: Snap) -> object:
            left = [n for n in s.tables if n == "t3"] + [n for n, sp in s.spans.items() if sp.table_id == 3]
            left += [n for n, d in s.dispatchers.items() if d.table_id == 3]
            return f"left: {left}" if left else all_settled(s)

        watch.stays(t3_gone, "t3 removed", 2.0)

    # No key and no timestamp skipped, through the moves, split, merge and the maintainer's SIGKILL.
    no_gap(watch, since)


# ------------------------------------------------------------------------------------------------------
# 2. SIGTERM: the Lease is released, the standby takes over before the Lease could have expired


def test_sigterm_releases_the_lease_for_a_fast_takeover(api: Api, system: System) -> None:
    watch, snap = boot(api, system, "m1")
    epoch1 = snap.epoch
    (mover,) = snap.spans_of(1)
    target = next(c for c in CAPTURES if c != mover.capture)
    set_hooks(api, system, CAPTURES, hold_close="*")
    api.operator("op-move", "Move", [mover.name], target=target)
    watch.until(held(InFlight(stages={"op-move": Stage.REMOVE_ORIGIN}), False, ()), "the Move held", 30)

    standby = system.maintainer("m2")
    deadline = time.monotonic() + 30
    while standby.count("maintainer m2 started") == 0:
        assert time.monotonic() < deadline, watch.fail("m2 did not start")
        time.sleep(0.1)
    # The standby competes for a while and does not get the Lease from a live leader.
    watch.stays(lambda s: s.holder == s.lease_holder() == "m1" and s.epoch == epoch1, "m1 leading", 2.0)

    sent = time.monotonic()
    rc = system.signal("m1", signal.SIGTERM)
    snap = watch.until(lambda s: published(s, "m2", epoch1), "m2 to take over", 3 * MAINTAINER_LEASE)
    took = time.monotonic() - sent
    print(f"takeover {took:.2f}s after SIGTERM")
    assert rc == 0, watch.fail(f"m1 exited with {rc} after SIGTERM")
    assert took < MAINTAINER_LEASE, watch.fail(f"takeover took {took:.1f}s, lease duration {MAINTAINER_LEASE}s")
    assert snap.epoch > epoch1

    set_hooks(api, system, CAPTURES, hold_close=None)
    final = watch.until(terminal(["op-move"]), "the Move to finish", SETTLE)
    with watch.explained(final):
        assert op(final, "op-move").phase is OpPhase.SUCCEEDED
        assert final.spans[mover.name].capture == target
    no_gap(watch)


def test_a_live_captures_lease_deleted_by_hand_frees_its_dispatchers_only_once_it_ran_out(
    api: Api, system: System
) -> None:
    """``kubectl delete lease capture-c0`` while c0 runs: c0 may deliver until its next renewal finds the Lease
    gone, so its dispatchers are released (and its spans placed again) only once it could not have renewed for
    a lease duration, as for a Lease that lapsed. c0 is stopped (SIGSTOP) before the delete, so it cannot fence
    itself early: until 2 s after it stopped (its Lease runs out 3.5 s after at the soonest) its dispatchers
    must stay where they are (before the informer's stand-in for a vanished Lease, they were released at once).
    Then the spans go to the other captures; c0, continued, finds its Lease deleted and fences itself (exit 3).
    A Lease PUT to a missing name creates it (issue 36: on a real server the renewal re-created the Lease, the
    capture resumed and never exited): the renewal carries the Lease's uid, so it is refused (409), the Lease
    reads as gone (404), and it stays deleted."""
    watch, snap = boot(api, system, "m1")
    victim = next(c for c in CAPTURES if any(d.capture == c for d in snap.dispatchers.values()))
    held_before = sorted(d.name for d in snap.dispatchers.values() if d.capture == victim)
    spans_before = len(snap.spans)
    stopped = time.monotonic()
    os.killpg(system.procs[victim].popen.pid, signal.SIGSTOP)
    try:
        api.delete("leases", f"capture-{victim}")
        watch.until(lambda s: victim not in s.captures or not s.alive(victim), "the Lease deleted", 10)

        spans = {snap.dispatchers[d].span for d in held_before}

        def kept(s: Snap) -> object:
            # Asked to close (deleted), but never released (the finalizer stays), and nothing else runs its spans.
            mine = sorted(d.name for d in s.dispatchers.values() if d.capture == victim)
            if mine != held_before:
                return f"{victim} holds {mine}, held {held_before}"
            elsewhere = [d.name for d in s.dispatchers.values() if d.span in spans and d.capture != victim]
            return not elsewhere or f"placed elsewhere: {elsewhere}"

        # c0 renewed at most 0.5 s (its renew interval) before it stopped, so its Lease runs out no sooner than
        # 3.5 s after: nothing of it may go until 2 s after it stopped (a poll takes a moment, and the stays loop
        # polls once more after its deadline).
        until = stopped + CAPTURE_LEASE - 2.0
        what = f"{victim}'s dispatchers kept while its Lease could still be renewed"
        watch.stays(kept, what, until - time.monotonic())

        def moved(s: Snap) -> object:
            left = [d.name for d in s.dispatchers.values() if d.capture == victim]
            if left:
                return f"{victim} still holds {left}"
            return all_settled(s)

        final = watch.until(moved, f"{victim}'s spans placed on the others", SETTLE)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(system.procs[victim].popen.pid, signal.SIGCONT)
    try:
        rc: int | None = system.signal(victim, signal.SIGCONT)  # already continued: wait for it to fence and exit
    except subprocess.TimeoutExpired:
        rc = None  # it never fenced (SIGKILLed after the wait): its renewal had re-created the Lease
    with watch.explained(final):
        assert rc == 3, f"{victim} exited with {rc} (None: it did not exit)"
        assert len(final.spans) == spans_before
        assert all(sp.capture != victim for sp in final.spans.values())
        fenced = [line for line in system.gone[victim].tail(200).splitlines() if "fenced itself" in line]
        assert fenced, f"{victim} did not fence itself"
        assert "deleted" in fenced[0]
        recreated = api.get("leases", f"capture-{victim}")
        assert recreated is None, f"{victim}'s renewal created its deleted Lease again: {recreated}"
    no_gap(watch)


# ------------------------------------------------------------------------------------------------------
# 3. Two replicas: one leads; SIGKILL it and the standby finishes the operators


def test_two_replicas_one_leads_and_the_standby_takes_over(api: Api, system: System) -> None:
    watch, snap = boot(api, system, "m1", "m2")
    leader = snap.holder
    assert leader in ("m1", "m2")
    standby = "m2" if leader == "m1" else "m1"
    epoch1 = snap.epoch
    watch.stays(lambda s: s.holder == s.lease_holder() == leader and s.epoch == epoch1, f"{leader} leading", 2.0)
    acquired = {m: system.procs[m].count(f"acquired lease cfm-{CHANGEFEED}") for m in ("m1", "m2")}
    assert acquired == {leader: 1, standby: 0}, watch.fail(f"lease acquisitions: {acquired}")

    (mover,) = snap.spans_of(1)
    target = next(c for c in CAPTURES if c != mover.capture)
    (parent,) = snap.spans_of(2)
    set_hooks(api, system, CAPTURES, hold_close="*")
    api.operator("op-move", "Move", [mover.name], target=target)
    api.operator("op-split", "Split", [parent.name], splitInto=4)
    flight = InFlight(stages={"op-move": Stage.REMOVE_ORIGIN, "op-split": Stage.REMOVE_ORIGIN})
    watch.until(held(flight, False, ()), "operators held", 30)

    system.signal(leader, signal.SIGKILL)
    snap = watch.until(lambda s: published(s, standby, epoch1), f"{standby} to take over", 30)
    epoch2 = snap.epoch
    set_hooks(api, system, CAPTURES, hold_close=None)
    final = watch.until(terminal(list(flight.stages)), "the operators to finish", SETTLE)
    with watch.explained(final):
        assert final.epoch == epoch2 > epoch1
        assert final.holder == final.lease_holder() == standby
        for name in flight.stages:
            o = op(final, name)
            assert o.phase is OpPhase.SUCCEEDED, f"{name} ended {o.phase}"
            assert o.epoch == epoch2
        assert final.spans[mover.name].capture == target
        children = final.spans_of(2)
        assert len(children) == 4
        assert sorted(c.name for c in children) == sorted(t.span for t in op(final, "op-split").targets)
        assert KeyRange(children[0].key_range.start, children[-1].key_range.end) == parent.key_range
    no_gap(watch)


# ------------------------------------------------------------------------------------------------------
# 4. The destination capture of a Move is SIGKILLed


@pytest.mark.parametrize(
    ("stage", "with_maintainer"),
    [(Stage.ADD_DEST, False), (Stage.REMOVE_ORIGIN, False), (Stage.ADD_DEST, True)],
    ids=["while-adding", "while-closing-origin", "together-with-the-maintainer"],
)
def test_move_whose_destination_capture_dies(api: Api, system: System, stage: Stage, with_maintainer: bool) -> None:
    """AddDest: pause-create holds the new dispatcher on the destination, which is then killed.
    RemoveOrigin: hold-close holds the origin; the destination dies; the origin is released only once
    the destination's Lease has lapsed. Together with the maintainer: as AddDest, and the maintainer is
    SIGKILLed at the same moment; a new one restores the Move and sees its destination lost. In every
    case: Failed (DestinationLost), never two owners, the span Replicating on a live capture, no span
    lost, and nothing left on the dead capture."""
    watch, snap = boot(api, system, "m1")
    (mover,) = snap.spans_of(1)
    origin = mover.capture
    dest = next(c for c in CAPTURES if c != origin)
    spans_before = len(snap.spans)
    if stage is Stage.ADD_DEST:
        set_hooks(api, system, [dest], pause_create="*")
    else:
        set_hooks(api, system, [origin], hold_close="*")
    api.operator("op-move", "Move", [mover.name], target=dest)
    watch.until(held(InFlight(stages={"op-move": stage}), False, ()), f"the Move held in {stage}", 30)

    epoch1 = watch.poll().epoch
    system.signal(dest, signal.SIGKILL)
    if with_maintainer:
        system.signal("m1", signal.SIGKILL)
        system.maintainer("m2")
        watch.until(lambda s: published(s, "m2", epoch1), "m2 to take over", 30)
    if stage is Stage.REMOVE_ORIGIN:
        watch.until(lambda s: not s.alive(dest), f"{dest}'s Lease to lapse", 30)
        time.sleep(1.0)  # a few maintainer ticks with the destination known lost, the origin still held
        assert op(watch.poll(), "op-move").stage is Stage.REMOVE_ORIGIN
        set_hooks(api, system, [origin], hold_close=None)
    final = watch.until(terminal(["op-move"]), "the Move to end and the world to settle", SETTLE)

    with watch.explained(final):
        o = op(final, "op-move")
        assert (o.phase, o.status_reason) == (OpPhase.FAILED, "DestinationLost"), f"{o.phase} {o.status_reason}"
        moved = final.spans[mover.name]
        assert moved.state is SpanState.REPLICATING
        assert moved.capture != dest
        assert final.alive(moved.capture)
        assert len(final.spans) == spans_before
        assert not [d.name for d in final.dispatchers.values() if d.capture == dest]
        if with_maintainer:
            assert final.holder == "m2"
            assert o.epoch == final.epoch > epoch1
    no_gap(watch)  # the killed destination's deliveries (and the origin's) leave no gap
