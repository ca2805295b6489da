"""A restart of the Kubernetes API with a Move and a Split in flight (issue 36): the embedded API restarts in place.

On a real cluster, kube-apiserver restarted (an 8 s outage, as a control plane upgrade does) with a Move and a
Split in flight; the Split ended Succeeded, yet its table ended with one span covering the parent's whole range,
under the parent's name with a new uid. The maintainer's own Delete of the parent had not taken it out of its
view, the Span view lagged after the restart (every watch resumed from before it gets 410, and each kind relists
on its own schedule), the repair "overlap no operator explains" removed the children (the newer spans), and the
coverage rule re-created the parent's range under the parent's deterministic name.

Here the embedded API restarts in place (``ApiServerHandle.restart``: every connection and watch dropped,
nothing served for ``CFM_RESTART_OUTAGE_SECONDS``, 8 s by default, then the same objects and resourceVersions
served again, a watch resumed from before the restart answered 410). A maintainer and three captures run with
the default timings, each straight against the API: the captures pause their dispatchers after their renew
deadline (7 s) and resume when their renewals get through; a capture is lost only after 10 s of silence the
maintainer could see, which an outage is not. Before the restart the capture hooks hold a Move in AddDest and
a Split in RemoveOrigin (its parent's dispatcher being deleted, not closed); the hooks are released, then the
API restarts a moment later, so that the Split closes its parent's dispatcher, deletes its parent and places
its children around the restart and finishes right after it, while the maintainer's watches relist. The restart
comes ``OFFSETS[run]`` seconds after the parent's dispatcher is gone, so the runs spread over "parent deleted
before the restart", "as the server closed its watches" (its DELETED never sent) and "after it" (refused, then
retried). Every kind of the embedded API relists at once after its restart, so on its own the Span view would
never lag the Dispatcher view; as after a real restart (each resource's watch cache initializes on its own,
answering 429 until then) the maintainer's Span reads are refused for ``SPAN_LAG`` seconds after it
(``SpanLag``): the maintainer's Span view is in doubt meanwhile, and it decides nothing until Spans are listed
again (``World.stale``); the Split finishes after that.

What catches what: the maintainer's Delete taking the parent out of its view (``Informer.gone``) and deciding
nothing on a view in doubt each suffice here. Measured while the engine still gated only its destructive rules on
the view (the decision-wide pause came later, for what the long simulator run found): with the executor's old
``forget`` and that gate off, every run failed (the children removed as "overlap no operator explains", the
parent's range re-created under its name: the issue); with the old ``forget`` and the gate on, every run passed.

Asserted: every operator ends with its original intent (the Split Succeeded with exactly its recorded children,
each with the uid it was created with, the parent gone and never re-created under its name; the Move's span
Replicating on its destination); each table's spans cover its range exactly once; no repair removed anything
(no SpanOperator with the reason "overlap no operator explains", seen at any poll); no process exited, no
capture fenced itself or dropped anything, every capture paused and resumed; the maintainer kept its epoch; its
Dispatcher, Span and SpanOperator streams relisted after the restart (its log) and its Span reads were refused a
while; the delivery ledger shows no gap.

``CFM_RESTART_RUNS=N`` runs it N times (the issue's done-criterion: 20 in a row); 1 by default. Skipped against
a real cluster (``CFM_TEST_KUBECONFIG``): a test cannot restart its API server.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from aiohttp import web

from controller.apiserver import ApiServerHandle
from controller.apiserver.errors import ApiError
from controller.model.keys import KeyRange, table_key
from controller.model.states import DispatcherState, OpPhase, SpanState, Stage
from tests.integration.conftest import Target
from tests.integration.harness import (
    HOLD_CLOSE,
    PAUSE_CREATE,
    Api,
    Snap,
    System,
    Watch,
    all_settled,
    no_gap,
    set_hooks,
    table_range,
)
from tests.integration.test_outage import log_lines, said, wall

CAPTURES = ["c0", "c1", "c2"]
RUNS = int(os.environ.get("CFM_RESTART_RUNS", "1"))
OUTAGE = float(os.environ.get("CFM_RESTART_OUTAGE_SECONDS", "8"))
#: Seconds between the hooks' release (every capture has seen it) and the restart, by run: the Split's parent is
#: deleted before the restart, as it starts, or after it (the captures' writes refused, retried after it).
OFFSETS = tuple(float(x) for x in os.environ.get("CFM_RESTART_OFFSETS", "0,0.03,0.01,0.1,0.02,0.04").split(","))
#: Seconds after the restart during which the maintainer's Span reads are refused (``SpanLag``): its Span view lags
#: the others, which relist at once; the Split finishes meanwhile (about 1.5 s after the restart).
SPAN_LAG = float(os.environ.get("CFM_RESTART_SPAN_LAG_SECONDS", "4"))
#: The captures' default renew deadline: an outage longer than this pauses their dispatchers.
CAPTURE_RENEW_DEADLINE = 7.0
CONVERGE = 60.0
REPAIR_REASON = "overlap no operator explains"


@pytest.fixture
def restartable(target: Target) -> ApiServerHandle:
    if target.handle is None:
        pytest.skip("restarts the embedded API server in place")
    return target.handle


@dataclass
class Seen:
    """What every poll saw, so that a transient (a repair, a re-created parent) fails the test even if it is gone
    from the final state."""

    parent: str
    parent_uid: str
    children: dict[str, str] = field(default_factory=dict)  # child span -> the uid it was first seen with
    child_names: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def observe(self, s: Snap) -> None:
        for name in self.child_names:
            sp = s.spans.get(name)
            if sp is None:
                continue
            first = self.children.setdefault(name, sp.uid)
            if sp.uid != first:
                self.note(f"child {name} re-created: uid {first} -> {sp.uid}")
        sp = s.spans.get(self.parent)
        if sp is not None and sp.uid != self.parent_uid:
            self.note(f"parent {self.parent} re-created under its name (uid {sp.uid}, was {self.parent_uid})")
        for o in s.operators.values():
            if o.reason == REPAIR_REASON:
                self.note(f"repair operator {o.name} {o.type} spans={list(o.spans)} ({o.reason})")

    def note(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)


class Observed(Watch):
    """A Watch whose every poll is also given to ``observer``."""

    def __init__(self, api: Api, system: System, observer: Callable[[Snap], None], every: float = 0.25) -> None:
        super().__init__(api, system, every)
        self.observer = observer

    def poll(self) -> Snap:
        snap = super().poll()
        self.observer(snap)
        return snap


def covered_once(s: Snap, table_id: int) -> str:
    """ "" if the table's live spans cover its range exactly once (no overlap, no hole), else why not."""
    spans = s.spans_of(table_id)
    rng = table_range(table_id)
    if not spans:
        return f"t{table_id}: no span"
    edge = rng.start
    for sp in spans:  # sorted by range
        if sp.key_range.start != edge:
            what = "hole" if sp.key_range.start > edge else "overlap"
            return f"t{table_id}: {what} at {edge.hex()} ({sp.name} starts at {sp.key_range.start.hex()})"
        edge = sp.key_range.end
    return "" if edge == rng.end else f"t{table_id}: hole from {edge.hex()} to {rng.end.hex()}"


def relists(system: System, name: str, since: float) -> list[str]:
    """The informer's log lines of ``name`` about a watch that relisted or ended with an error, after ``since``."""
    out = []
    for x in log_lines(system, name):
        msg = str(x.get("msg", ""))
        if re.match(r"watch \S+ (ended with|back \(relisted\))", msg) and _wall(x) >= since:
            out.append(msg)
    return out


def _wall(line: dict[str, Any]) -> float:
    return wall(line.get("ts", "1970-01-01T00:00:00Z"))


class SpanLag:
    """After the restart the maintainer's Span view lags the others, as on the real cluster (each resource's watch
    cache initializes on its own after a kube-apiserver restart, and until then its reads are answered ``429
    storage is (re)initializing``): from :meth:`hold` until ``seconds`` after :meth:`release_in`, every LIST and
    WATCH of the namespace's Spans but the test's own (urllib3) is answered so. Installed on the embedded
    server's instance (its ``_resource``), taken away by :meth:`close`."""

    def __init__(self, handle: ApiServerHandle, namespace: str) -> None:
        self.server = cast(Any, handle._restart).__self__.server  # the Serving's ApiServer
        self.collection = f"/namespaces/{namespace}/spans"
        self.until = 0.0
        self.refused = 0
        original = self.server._resource

        async def resource(request: web.Request, *args: Any) -> web.StreamResponse:
            if (
                time.monotonic() < self.until
                and request.method == "GET"
                and request.path.endswith(self.collection)
                and "urllib3" not in request.headers.get("User-Agent", "")
            ):
                self.refused += 1
                raise ApiError(429, "TooManyRequests", "storage is (re)initializing", {"retryAfterSeconds": 1})
            return cast(web.StreamResponse, await original(request, *args))

        self.server._resource = resource

    def hold(self) -> None:
        self.until = math.inf

    def release_in(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def close(self) -> None:
        self.server.__dict__.pop("_resource", None)


@pytest.fixture
def span_lag(restartable: ApiServerHandle, api: Api) -> Iterator[SpanLag]:
    lag = SpanLag(restartable, api.namespace)
    yield lag
    lag.close()


def deleted_at(handle: ApiServerHandle, namespace: str, name: str) -> int | None:
    """The resourceVersion at which the embedded API deleted the Span ``name`` (None: not in its history)."""

    def find() -> int | None:
        for ev in handle.store.history:
            meta = ev.obj.get("metadata") or {}
            if (
                ev.type == "DELETED"
                and ev.obj.get("kind") == "Span"
                and (meta.get("namespace"), meta.get("name"))
                == (
                    namespace,
                    name,
                )
            ):
                return ev.rv
        return None

    return handle.call(find)


@pytest.mark.parametrize("run", range(RUNS), ids=[f"run{i + 1}" for i in range(RUNS)])
def test_an_api_restart_with_a_move_and_a_split_in_flight(
    api: Api, system: System, restartable: ApiServerHandle, span_lag: SpanLag, run: int
) -> None:
    started = time.monotonic()
    # t1: moved; t2: split in three; t3: left alone (its dispatcher pauses and resumes).
    pre = Watch(api, system, every=0.25)
    for c in CAPTURES:
        system.capture(c, flags=[])
    pre.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.changefeed()
    for table_id in (1, 2, 3):
        api.table(table_id)
    system.maintainer("m1", flags=[])

    def placed(s: Snap) -> object:
        return f"{len(s.spans)} spans, want 3" if len(s.spans) != 3 else all_settled(s)

    snap = pre.until(placed, "initial placement", 60)
    epoch = snap.epoch
    (mover,) = snap.spans_of(1)
    destination = next(c for c in CAPTURES if c != mover.capture)
    (parent,) = snap.spans_of(2)
    cuts = [table_key(2) + b"\x40", table_key(2) + b"\x80"]
    (quiet,) = snap.spans_of(3)
    quiet_uid = snap.dispatchers[quiet.dispatcher].uid
    seen = Seen(parent.name, parent.uid)
    watch = Observed(api, system, seen.observe)

    # Held: the Move's destination is not created (AddDest), the Split's parent's dispatcher is not closed
    # (RemoveOrigin: its children do not exist yet).
    set_hooks(api, system, CAPTURES, hold_close="2", pause_create="1,2")
    api.operator("op-move", "Move", [mover.name], target=destination)
    api.operator("op-split", "Split", [parent.name], splitKeys=[k.hex() for k in cuts])
    stages = {"op-move": Stage.ADD_DEST, "op-split": Stage.REMOVE_ORIGIN}

    def held(s: Snap) -> object:
        for name, stage in stages.items():
            o = s.operators.get(name)
            if o is None or o.phase is not OpPhase.RUNNING or o.stage is not stage:
                return f"{name}: {o and (o.phase, o.stage)}, want Running/{stage}"
        move, split = s.operators["op-move"], s.operators["op-split"]
        if any(t.dispatcher not in s.dispatchers for t in move.targets):
            return "op-move: destination dispatcher not created yet"
        origin = s.dispatchers.get(parent.dispatcher)
        if origin is None or not origin.deleting:
            return f"op-split: the parent's dispatcher {parent.dispatcher} not being deleted"
        seen.child_names = {t.span for t in split.targets}
        return True

    snap = watch.until(held, "the Move and the Split held in flight", 30)
    children = [t.span for t in snap.operators["op-split"].targets]
    assert len(children) == 3, children
    checkpoint = snap.changefeed.checkpoint_ts if snap.changefeed else 0

    # Release every hook, then restart the API a moment later: the Split closes its parent's dispatcher, creates
    # its children and deletes its parent around the restart, and finishes right after it.
    offset = OFFSETS[run % len(OFFSETS)]
    for c in CAPTURES:  # the captures see it within milliseconds; nothing waits for them to log it
        api.patch("captures", c, {"metadata": {"annotations": {HOLD_CLOSE: None, PAUSE_CREATE: None}}})
    # The parent's dispatcher closed and gone: the maintainer's next decision creates the children and deletes the
    # parent. The restart comes ``offset`` seconds after that, so the deletion lands just before it, while the
    # server closes its watches and connections, or after it (refused, then retried).
    deadline = time.monotonic() + 15
    while api.get("dispatchers", parent.dispatcher) is not None:
        assert time.monotonic() < deadline, watch.fail("the parent's dispatcher was not closed")
        time.sleep(0.005)
    time.sleep(offset)
    restart_wall = time.time()
    rv_before = restartable.call(lambda: restartable.store.rv)
    span_lag.hold()
    restartable.restart(OUTAGE)
    back = time.monotonic()
    span_lag.release_in(SPAN_LAG)
    rv_restarted = restartable.call(lambda: restartable.store.cache_start)

    tracked = ["op-move", "op-split"]

    def finished(s: Snap) -> object:
        left = [n for n in tracked if n not in s.operators or s.operators[n].in_flight]
        if left:
            return f"in flight: {left}"
        cp = s.changefeed.checkpoint_ts if s.changefeed else 0
        return True if cp > checkpoint else f"checkpoint {cp} <= {checkpoint}"

    # The maintainer's Span view current again (its stream relisted after the restart and the lag): what it decides
    # from now on reads the API's Spans, the parent gone from them.
    def span_relisted(s: Snap) -> object:
        said_so = [m for m in relists(system, "m1", restart_wall) if m.startswith("watch Span back (relisted)")]
        return True if said_so else f"the maintainer has not relisted its Spans yet ({span_lag.refused} refused)"

    watch.until(span_relisted, "the maintainer's Span view to be relisted", SPAN_LAG + CONVERGE)
    watch.until(finished, "every operator to finish and the checkpoint to move", CONVERGE)
    to_finished = time.monotonic() - back
    final = watch.until(all_settled, "a settled world", CONVERGE)
    # A little longer: a repair the maintainer would make on a view still holding the parent shows by now.
    final = watch.stays(lambda s: seen.problems or True, "nothing undone", 2.0)
    to_settled = time.monotonic() - back

    with watch.explained(final):
        assert not seen.problems, "; ".join(seen.problems)
        assert not system.gone, f"processes exited: {sorted(system.gone)}"
        for name in tracked:
            o = final.operators[name]
            assert o.phase is OpPhase.SUCCEEDED, f"{name} ended {o.phase} {o.status_reason}: {o.message}"
        # The same maintainer, the same term.
        assert (final.epoch, final.holder, final.lease_holder()) == (epoch, "m1", "m1")
        # The Move: its span Replicating on its destination, its dispatcher there Working.
        moved = final.spans[mover.name]
        assert (moved.state, moved.capture) == (SpanState.REPLICATING, destination)
        d = final.dispatchers[moved.dispatcher]
        assert (d.capture, d.state) == (destination, DispatcherState.WORKING)
        # The Split: exactly its recorded children, each the object it created (the uid first seen), the parent
        # gone and not re-created under its name.
        split = final.operators["op-split"]
        assert [t.span for t in split.targets] == children
        bounds = [parent.key_range.start, *cuts, parent.key_range.end]
        pieces = final.spans_of(2)
        assert [sp.key_range for sp in pieces] == [KeyRange(a, b) for a, b in itertools.pairwise(bounds)]
        assert [sp.name for sp in pieces] == children
        assert {sp.name: sp.uid for sp in pieces} == {n: seen.children[n] for n in children}
        assert all(sp.state is SpanState.REPLICATING for sp in pieces), [(sp.name, sp.state) for sp in pieces]
        assert parent.name not in final.spans, f"the parent {parent.name} exists"
        # Every table covered exactly once; the quiet table's dispatcher paused and resumed in place.
        for table_id in (1, 2, 3):
            problem = covered_once(final, table_id)
            assert not problem, problem
        dq = final.dispatchers[quiet.dispatcher]
        assert (dq.uid, dq.state, dq.deleting) == (quiet_uid, DispatcherState.WORKING, False)
        for c in CAPTURES:
            assert not said(system, c, "fenced itself"), f"{c} fenced itself"
            assert final.lease_holder(f"capture-{c}") == c
            for resumed in said(system, c, "resumed"):
                assert resumed["dropped"] == {}, f"{c} dropped {resumed['dropped']}"
            if OUTAGE > CAPTURE_RENEW_DEADLINE + 0.5:
                assert said(system, c, "paused"), f"{c} did not pause through a {OUTAGE:.0f}s outage"
                assert said(system, c, "resumed"), f"{c} did not resume"
        # The restart is one the maintainer's informer saw: its record kinds relisted after it, its Leases and
        # Captures on the 410 of a watch resumed from before it; its Span reads were refused a while.
        seen_relists = relists(system, "m1", restart_wall)
        for kind in ("Dispatcher", "Span", "SpanOperator"):
            assert f"watch {kind} back (relisted) after" in " ".join(seen_relists), seen_relists
        assert span_lag.refused > 0, "the maintainer's Span view did not lag"
    no_gap(watch)
    deleted = deleted_at(restartable, api.namespace, parent.name)
    when = (
        "never"
        if deleted is None
        else "before the restart"
        if deleted <= rv_before
        else "as the server closed"
        if deleted <= rv_restarted
        else "after the restart"
    )
    print(
        f"\nrun {run + 1}: API restart ({OUTAGE:.0f}s outage) {offset:.3f}s after the parent's dispatcher went; "
        f"the parent deleted {when}; after the restart: operators "
        f"finished in {to_finished:.1f}s, settled in {to_settled:.1f}s; whole run {time.monotonic() - started:.1f}s; "
        f"maintainer's Span reads refused {span_lag.refused} times; its log: {sorted(set(seen_relists))}"
    )
