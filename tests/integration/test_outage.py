"""An outage of the Kubernetes API, with the default timings: real processes, each behind its own TCP proxy.

Every process (the maintainer, three captures) reaches the embedded API server through a proxy of its own
(tests/integration/chaos.py), which can drop every connection and refuse new ones.

1. All of them cut off for ``CFM_OUTAGE_SECONDS`` (30 s by default; the issue's done-criterion is 60 s,
   run it with ``CFM_OUTAGE_SECONDS=60``), with a Move, a Split, a Merge and an Add held in flight:
   no process exits, no dispatcher is started again, every operator finishes with its intent, the
   maintainer keeps its epoch, and the checkpoint moves again within seconds of the API's return.
   Both tests end with the delivery ledger's no-gap check (``harness.no_gap``).
2. One capture cut off alone until its spans are replicated elsewhere (about 10 s), or for
   ``CFM_CUT_SECONDS`` if that is longer (60 s for the done-criterion): it pauses, the maintainer takes its
   Lease only after that, its spans are replicated elsewhere; when it gets through again it finds its
   Lease taken, exits without resuming anything, and a restarted process of it joins again.

The figures (seconds from the API's return to the checkpoint moving, to every operator finished, to a
settled world) are printed (``pytest -s``); speed is not what is asserted, beyond "within seconds".
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from controller.model.keys import KeyRange, table_key
from controller.model.states import DispatcherState, OpPhase, SpanState, Stage
from tests.integration.chaos import Chaos
from tests.integration.conftest import Target
from tests.integration.harness import PAUSE_CREATE, Api, Snap, System, Watch, all_settled, no_gap

CAPTURES = ["c0", "c1", "c2"]
OUTAGE = float(os.environ.get("CFM_OUTAGE_SECONDS", "30"))
#: CFM_OUTAGE_BLACKHOLE=1: connections hang instead of being refused, and those open during the outage
#: stay dead after it (see chaos.py); by hand, not in CI: convergence then waits for the streams' idle
#: timeouts (a known limitation, see docs/architecture.md), so only the figures are reported.
BLACKHOLE = os.environ.get("CFM_OUTAGE_BLACKHOLE") == "1"
CONVERGE = 300.0 if BLACKHOLE else 60.0
CUT = float(os.environ.get("CFM_CUT_SECONDS", "0"))
#: "Within a few seconds": a generous bound for a loaded CI machine (the figure is printed).
PROMPTLY = 15.0


@pytest.fixture
def chaos(target: Target, tmp_path: Path) -> Iterator[Chaos]:
    if target.handle is None:
        pytest.skip("cuts the embedded API server off through proxies")
    c = Chaos(target.handle.url, target.kubeconfig, tmp_path)
    yield c
    c.close()


def boot(api: Api, system: System, chaos: Chaos, tables: tuple[tuple[int, int], ...]) -> tuple[Watch, Snap]:
    """Captures and a maintainer with the default timings, each through its own proxy; the tables placed."""
    watch = Watch(api, system, every=0.25)
    for c in CAPTURES:
        system.capture(c, kubeconfig=chaos.proxy(c)[1], flags=[])
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.changefeed()
    for table_id, pre_split in tables:
        api.table(table_id, pre_split)
    system.maintainer("m1", kubeconfig=chaos.proxy("m1")[1], flags=[])
    expected = sum(max(1, pre) for _, pre in tables)

    def placed(s: Snap) -> object:
        return f"{len(s.spans)} spans, want {expected}" if len(s.spans) != expected else all_settled(s)

    return watch, watch.until(placed, "initial placement", 60)


def log_lines(system: System, name: str) -> list[dict[str, object]]:
    proc = system.procs.get(name) or system.gone[name]
    out = []
    for line in proc.log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def said(system: System, name: str, msg: str) -> list[dict[str, object]]:
    return [x for x in log_lines(system, name) if str(x["msg"]).startswith(msg)]


def wall(ts: object) -> float:
    return datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()


def test_an_api_outage_costs_no_restart_and_no_failed_operator(api: Api, system: System, chaos: Chaos) -> None:
    # t1: moved; t2: split; t6: merged; t5: a new table placed while held (a placement without an operator:
    # its Span records the destination, its Dispatcher waits Pending); t7, t8: left alone (their dispatchers must
    # simply pause and resume).
    watch, snap = boot(api, system, chaos, ((1, 0), (2, 0), (6, 2), (7, 2), (8, 0)))
    epoch = snap.epoch
    (mover,) = snap.spans_of(1)
    target = next(c for c in CAPTURES if c != mover.capture)
    (parent,) = snap.spans_of(2)
    cuts = [table_key(2) + b"\x40", table_key(2) + b"\x80"]
    sources = snap.spans_of(6)
    quiet = {sp.dispatcher: snap.dispatchers[sp.dispatcher].uid for t in (7, 8) for sp in snap.spans_of(t)}
    assert len(quiet) == 3

    # Hold the placements of t1, t2, t5, t6 (pause-create): the operators wait in their add stage.
    for c in CAPTURES:
        api.patch("captures", c, {"metadata": {"annotations": {PAUSE_CREATE: "1,2,5,6"}}})
    watch.until(lambda s: all(said(system, c, "test hooks changed") for c in CAPTURES), "hooks seen", 15)
    api.operator("op-move", "Move", [mover.name], target=target)
    api.operator("op-split", "Split", [parent.name], splitKeys=[k.hex() for k in cuts])
    api.operator("op-merge", "Merge", [s.name for s in sources])
    api.table(5)
    stages = {"op-move": Stage.ADD_DEST, "op-split": Stage.ADD_SPANS, "op-merge": Stage.ADD_SPANS}

    def held(s: Snap) -> object:
        for name, stage in stages.items():
            o = s.operators.get(name)
            if o is None or o.phase is not OpPhase.RUNNING or o.stage is not stage:
                return f"{name}: {o and (o.phase, o.stage)}"
            if any(t.dispatcher not in s.dispatchers for t in o.targets):
                return f"{name}: targets not created yet"
        fresh = s.spans_of(5)
        if not fresh or any(
            sp.state is not SpanState.SCHEDULING or not sp.capture or sp.dispatcher not in s.dispatchers for sp in fresh
        ):
            return f"t5's placement not in flight: {[(sp.state, sp.capture, sp.dispatcher) for sp in fresh]}"
        return True

    snap = watch.until(held, "operators held in flight", 30)
    tracked = sorted(o.name for o in snap.operators.values() if o.in_flight)
    assert len(tracked) == 3, tracked
    t5 = {sp.name: sp.dispatcher for sp in snap.spans_of(5)}
    checkpoint = snap.changefeed.checkpoint_ts if snap.changefeed else 0
    started = {c: len(said(system, c, "started dispatcher")) for c in CAPTURES}

    # The outage: every process cut off. Meanwhile (the test reaches the API directly) the hooks go, so
    # that the operators can finish as soon as the processes get through again.
    chaos.cut(blackhole=BLACKHOLE)
    for c in CAPTURES:
        api.patch("captures", c, {"metadata": {"annotations": {PAUSE_CREATE: None}}})
    watch.stays(lambda s: True, "every process running through the outage", OUTAGE)
    assert all(said(system, c, "paused") for c in CAPTURES), "a capture did not pause"
    chaos.restore()
    back = time.monotonic()

    def moved_on(s: Snap) -> object:
        cp = s.changefeed.checkpoint_ts if s.changefeed else 0
        return True if cp > checkpoint else f"checkpoint {cp} <= {checkpoint}"

    watch.until(moved_on, "the checkpoint to move again", CONVERGE)
    to_checkpoint = time.monotonic() - back

    def finished(s: Snap) -> object:
        left = [n for n in tracked if n not in s.operators or s.operators[n].in_flight]
        left += [n for n in t5 if n not in s.spans or s.spans[n].state is not SpanState.REPLICATING]
        return f"in flight: {left}" if left else True

    watch.until(finished, "every operator to finish", CONVERGE)
    to_operators = time.monotonic() - back
    final = watch.until(all_settled, "a settled world", CONVERGE)
    to_settled = time.monotonic() - back
    print(
        f"\nAPI outage of {OUTAGE:.0f}s{' (blackhole)' if BLACKHOLE else ''}: after the API returned,"
        f" the checkpoint moved in {to_checkpoint:.1f}s, "
        f"every operator finished in {to_operators:.1f}s, the world settled in {to_settled:.1f}s"
    )

    with watch.explained(final):
        assert not system.gone, f"processes exited: {sorted(system.gone)}"
        for name in tracked:
            o = final.operators[name]
            assert o.phase is OpPhase.SUCCEEDED, f"{name} ended {o.phase} {o.status_reason}: {o.message}"
        # The same maintainer, the same epoch (its Lease was still its own after the outage).
        assert (final.epoch, final.holder, final.lease_holder()) == (epoch, "m1", "m1")
        # Intent: the Move on its target, the Split's pieces, the Merge's union, t5 replicating.
        moved = final.spans[mover.name]
        assert (moved.state, moved.capture) == (SpanState.REPLICATING, target)
        bounds = [parent.key_range.start, *cuts, parent.key_range.end]
        assert [c.key_range for c in final.spans_of(2)] == [KeyRange(a, b) for a, b in itertools.pairwise(bounds)]
        (merged,) = final.spans_of(6)
        assert merged.key_range == KeyRange(sources[0].key_range.start, sources[-1].key_range.end)
        # t5's placement finished with the dispatcher it had made before the outage (no second attempt).
        assert {sp.name: (sp.state, sp.dispatcher) for sp in final.spans_of(5)} == {
            n: (SpanState.REPLICATING, d) for n, d in t5.items()
        }
        # Nothing started again: the dispatchers nobody moved are the same objects, Working, and no capture
        # started any dispatcher but those the operators placed; every capture resumed all it had paused.
        for name, uid in quiet.items():
            d = final.dispatchers.get(name)
            assert d is not None, f"{name} is gone"
            assert (d.uid, d.state, d.deleting) == (uid, DispatcherState.WORKING, False)
        placed = {t.dispatcher for n in tracked for t in final.operators[n].targets} | set(t5.values())
        for c in CAPTURES:
            new = [str(x["dispatcher"]) for x in said(system, c, "started dispatcher")[started[c] :]]
            assert set(new) <= placed, f"{c} started {new}, only {sorted(placed)} were placed"
            assert not said(system, c, "fenced itself"), f"{c} fenced itself"
            for resumed in said(system, c, "resumed"):
                assert resumed["dropped"] == {}, f"{c} dropped {resumed['dropped']}"
        # No capture's Lease was taken.
        for c in CAPTURES:
            assert final.lease_holder(f"capture-{c}") == c
    if not BLACKHOLE:
        assert to_checkpoint < PROMPTLY, f"the checkpoint moved again only {to_checkpoint:.1f}s after the API returned"
    # The pause and the resume in place skipped nothing: the delivery ledger covers every key of every table
    # (t5 from where its spans started) up to the checkpoint published after the test.
    no_gap(watch, {5: min(sp.start_ts for sp in final.spans_of(5))})


def test_a_capture_cut_off_alone_is_fenced_and_its_spans_move(api: Api, system: System, chaos: Chaos) -> None:
    watch, snap = boot(api, system, chaos, ((1, 0), (2, 0), (3, 0), (4, 0)))
    victim = max(CAPTURES, key=lambda c: sum(1 for sp in snap.spans.values() if sp.capture == c))
    spans = sorted(n for n, sp in snap.spans.items() if sp.capture == victim)
    assert spans
    chaos.cut([victim])
    cut = time.time()

    def elsewhere(s: Snap) -> object:
        if s.lease_holder(f"capture-{victim}") == victim:
            return "its Lease is still its own"
        for n in spans:
            sp = s.spans[n]
            if sp.state is not SpanState.REPLICATING or sp.capture == victim:
                return f"{n}: {sp.state} on {sp.capture}"
        return True

    moved = watch.until(elsewhere, "its spans replicated elsewhere", 60)
    taken = time.time()
    print(f"\none capture cut off: its {len(spans)} span(s) replicated elsewhere {taken - cut:.1f}s after the cut")
    with watch.explained(moved):
        paused = said(system, victim, "paused")
        assert paused, f"{victim} did not pause"
        # It stopped delivering before the maintainer could take its Lease: never two captures at once.
        assert wall(paused[0]["ts"]) < taken
        assert wall(paused[0]["ts"]) - cut < 7.0 + 3.0  # its renew deadline (7 s) after its last renewal
    left = CUT - (time.time() - cut)
    if left > 0:
        watch.stays(lambda s: True, "the others running while it is cut off", left)
    proc = system.procs.pop(victim)  # it is expected to exit once it gets through again
    system.gone[victim] = proc
    chaos.restore([victim])
    assert proc.popen.wait(timeout=30) == 3, system.tails()
    assert not said(system, victim, "resumed"), "a capture whose Lease was taken resumed"
    assert "Lease" in str(said(system, victim, "fenced itself")[0]["reason"])

    # The pod restarts (a kubelet would): it registers again and takes work again.
    system.capture(victim, kubeconfig=chaos.kubeconfigs[victim], flags=[])
    final = watch.until(lambda s: s.alive(victim) and all_settled(s), "the restarted capture back", 60)
    with watch.explained(final):
        assert final.lease_holder(f"capture-{victim}") == victim
        assert all(final.spans[n].capture != victim for n in spans)  # balancing is off: they stay where they went
    no_gap(watch)  # the fenced capture's spans were taken over with nothing skipped
