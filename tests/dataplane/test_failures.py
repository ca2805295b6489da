"""Failures on real data, each ending with ``kubectl changefeed verify`` finding 0 differences, each run against
both sinks.

A real etcd is the source and a real PostgreSQL or MariaDB the sink (the session's servers, conftest.py:
``sink_server``); the embedded
Kubernetes API runs the maintainer and captures as processes. A writer puts, overwrites and deletes keys across
every span of the table at a steady rate throughout, and is still writing when verify runs: verify compares
etcd at a revision at or below the changefeed's checkpoint with the sink, online.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import aetcd
import pytest

from controller.apiserver import ApiServerHandle
from controller.cli.__main__ import main as kubectl_changefeed
from controller.demo.servers import EtcdServer
from controller.demo.writer import Writer
from controller.engine.maintainer import FAILED_EVENT, REPLICATION_FAILED, RETRYING, SINK_EVENT, SINK_UNAVAILABLE
from controller.model.states import DispatcherState, OpPhase, Stage
from controller.model.verification import LAST_VERIFY_ANNOTATION, verification_from_json
from tests.dataplane.conftest import SinkServer
from tests.dataplane.test_end_to_end import create_changefeed
from tests.integration.harness import CHANGEFEED, Api, Snap, System, Watch, set_hooks

#: What verify prints for a table that matched (rows ahead of R, checked at their own revision, in parentheses).
CLEAN = r"table {table} \(default\): [\d,]+ keys at revision \d+: 0 differences( \(.*\))?\n"


#: The writer's pace: changes a second (in etcd transactions of 50), over 65,536 keys of the table.
RATE = 1_000.0
#: What each failure is written through, at least: changes made from the failure on, and keys touched in all.
CHANGES = 10_000


def writer(etcd: EtcdServer, table_id: int) -> Writer:
    return Writer(etcd.host, etcd.port, [table_id], rate=RATE, batch=50, keys=65_536, seed=table_id)


def written_through(w: Writer, since: int) -> None:
    """Let the writer make ``CHANGES`` changes from ``since`` on, over at least ``CHANGES`` keys in all."""
    w.wait_for(since + CHANGES, touched=CHANGES)


def verify(api: Api, capsys: pytest.CaptureFixture[str], sink_server: SinkServer) -> tuple[int, str]:
    """``kubectl changefeed verify -c cf`` (its endpoints and credentials from the Changefeed's Secrets)."""
    capsys.readouterr()
    rc = kubectl_changefeed(["--kubeconfig", str(api.kubeconfig), "-n", api.namespace, "verify", "-c", CHANGEFEED])
    out, err = capsys.readouterr()
    assert sink_server.dsn not in out + err
    return rc, out + err


def start_feed(
    api: Api,
    system: System,
    etcd: EtcdServer,
    sink_server: SinkServer,
    table_id: int,
    *,
    redo: bool = False,
    maintainers: tuple[str, ...] = ("m0",),
) -> Watch:
    """A Changefeed from ``etcd`` to ``sink_server`` (through Secrets; ``redo``: with redo-mode spans too), captures
    c0 and c1, the ``maintainers`` replicas, and the table pre-split into 4 spans (per mode)."""
    create_changefeed(api, etcd, sink_server, redo=redo)
    for c in ("c0", "c1"):
        system.capture(c)
    for m in maintainers:
        system.maintainer(m)
    spec: dict[str, Any] = {"changefeed": CHANGEFEED, "tableID": table_id, "preSplit": {"spans": 4}}
    api.create("tables", "Table", f"t{table_id}", spec, labels={"cdc.maintainer.dev/changefeed": CHANGEFEED})
    return Watch(api, system)


def checkpoint_past(watch: Watch, revision: int, what: str, timeout: float = 60) -> None:
    watch.until(
        lambda s: (s.changefeed is not None and s.changefeed.checkpoint_ts >= revision)
        or f"checkpoint {s.changefeed and s.changefeed.checkpoint_ts} < {revision}",
        what,
        timeout,
    )


def verified(api: Api, capsys: pytest.CaptureFixture[str], sink_server: SinkServer, table_id: int) -> None:
    """verify exits 0 and says 0 differences for the table."""
    rc, out = verify(api, capsys, sink_server)
    assert rc == 0, out
    assert re.fullmatch(CLEAN.format(table=table_id), out), out


def settled_on(s: Snap, captures: set[str], table: int, modes: tuple[str, ...] = ("default",)) -> object:
    """Every span of the table (in each of ``modes``) Replicating, its dispatcher Working on one of
    ``captures``, nothing in flight."""
    per_mode = {mode: s.spans_of(table, mode) for mode in modes}
    if not all(per_mode.values()):
        return f"spans per mode: { {m: len(v) for m, v in per_mode.items()} }"
    spans = [sp for v in per_mode.values() for sp in v]
    running = {d.span: d for d in s.live_dispatchers() if d.state is DispatcherState.WORKING}
    flight = [o.name for o in s.operators.values() if o.in_flight]
    off = [sp.name for sp in spans if sp.name not in running or running[sp.name].capture not in captures]
    if flight or off or not spans:
        return f"in flight {flight}, spans not running on {sorted(captures)}: {off}"
    return True


#: The operators the SIGKILL tests hold in flight.
HELD = ("op-move", "op-split", "op-merge")


def held(s: Snap) -> object:
    """Every one of ``HELD`` Running, at RemoveOrigin."""
    ops = {n: s.operators.get(n) for n in HELD}
    if all(o is not None and o.phase is OpPhase.RUNNING and o.stage is Stage.REMOVE_ORIGIN for o in ops.values()):
        return True
    return f"operators: {[(n, o and (o.phase, o.stage)) for n, o in ops.items()]}"


def finished_on(captures: set[str], table: int, modes: tuple[str, ...] = ("default",)) -> Callable[[Snap], object]:
    """Every one of ``HELD`` finished, and the table settled on ``captures`` (``settled_on``)."""

    def done(s: Snap) -> object:
        ops = {n: s.operators.get(n) for n in HELD}
        if any(o is None or o.in_flight for o in ops.values()):
            return f"operators: {[(n, o and (o.phase, o.stage)) for n, o in ops.items()]}"
        return settled_on(s, captures, table, modes)

    return done


def test_a_maintainer_and_a_capture_sigkilled_with_a_move_a_split_and_a_merge_in_flight_lose_no_row(
    api: Api,
    system: System,
    etcd: EtcdServer,
    sink_server: SinkServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    watch = start_feed(api, system, etcd, sink_server, table_id)
    with writer(etcd, table_id) as w:
        snap = watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id), "4 spans Working", 60)
        first, second, third, fourth = sorted(snap.spans_of(table_id), key=lambda sp: sp.key_range.start)
        target = "c1" if first.capture == "c0" else "c0"

        # Held in flight: every origin's dispatcher held while closing (as TiCDC's operators wait in RemoveOrigin).
        set_hooks(api, system, ["c0", "c1"], hold_close="*", pause_create="*")
        api.operator("op-move", "Move", [first.name], target=target)
        api.operator("op-split", "Split", [second.name], splitInto=2)
        api.operator("op-merge", "Merge", [third.name, fourth.name])
        watch.until(held, "the Move, the Split and the Merge held in RemoveOrigin", 30)
        failure = w.changes
        system.signal("m0", signal.SIGKILL)
        system.signal("c1", signal.SIGKILL)  # half the dispatchers, held mid-close, die with their capture
        system.capture("c2")
        system.maintainer("m1")
        set_hooks(api, system, ["c0"], hold_close=None, pause_create=None)
        done = finished_on({"c0", "c2"}, table_id)
        snap = watch.until(done, "every operator finished and the table replicated on c0 and c2", 90)
        phases = {n: snap.operators[n].phase for n in HELD}
        assert phases["op-split"] is OpPhase.SUCCEEDED, phases
        assert phases["op-merge"] is OpPhase.SUCCEEDED, phases
        # The Move's destination may have been the killed capture: then it fails, and its span is placed anew.
        assert phases["op-move"] in (OpPhase.SUCCEEDED, OpPhase.FAILED), phases
        assert len(snap.spans_of(table_id)) == 4  # 1 moved + 2 split halves + 1 merged

        # Online: the writer still writes while verify compares etcd at the checkpoint with the sink.
        written_through(w, failure)
        during = w.last
        checkpoint_past(watch, during, "the checkpoint to pass what was written through the failures", 60)
        verified(api, capsys, sink_server, table_id)
    last = w.last
    checkpoint_past(watch, last, "the checkpoint to pass the writer's last revision", 60)
    rc, out = verify(api, capsys, sink_server)
    assert rc == 0, out
    recorded = verification_from_json(
        (api.get("changefeeds", CHANGEFEED) or {})["metadata"]["annotations"][LAST_VERIFY_ANNOTATION]
    )
    assert recorded is not None
    assert recorded.differences == 0
    assert recorded.revision >= last
    assert recorded.keys > 0
    assert recorded.keys >= CHANGES // 2, recorded.keys  # live keys at the revision (tombstones not counted)
    print(f"writer: {w.changes} changes over {len(w.touched)} keys; verified {recorded.keys} keys at revision "
          f"{recorded.revision}")  # fmt: skip


#: What verify prints for a redo changefeed's table that matched in both modes.
CLEAN_BOTH = (
    r"table {table} \(default\): [\d,]+ keys at revision \d+: 0 differences( \(.*\))?\n"
    r"table {table} \(redo\): [\d,]+ keys at revision \d+: 0 differences( \(.*\))?\n"
)


def test_three_maintainer_replicas_with_redo_lose_no_row_when_the_leader_is_sigkilled_mid_operators(
    api: Api,
    system: System,
    etcd: EtcdServer,
    sink_server: SinkServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Three maintainer replicas (any may lead the changefeed: its Lease decides), a redo changefeed (every span
    has a redo twin writing t<id>_redo), a Move, a Split and a Merge held in RemoveOrigin: the replica that leads
    is SIGKILLed, another takes the Lease over and finishes every operator with its intent, and verify finds both
    modes equal to etcd while the writer still writes."""
    watch = start_feed(api, system, etcd, sink_server, table_id, redo=True, maintainers=("m0", "m1", "m2"))
    with writer(etcd, table_id) as w:
        both = ("default", "redo")
        snap = watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id, both), "the spans of both modes Working", 60)
        leader = watch.until(
            lambda s: bool(s.lease_holder()) or "no leader yet", "a replica to lead cf", 30
        ).lease_holder()
        default, redo = snap.spans_of(table_id, "default"), snap.spans_of(table_id, "redo")
        assert (len(default), len(redo)) == (4, 4)
        target = "c1" if default[0].capture == "c0" else "c0"
        set_hooks(api, system, ["c0", "c1"], hold_close="*")
        api.operator("op-move", "Move", [default[0].name], target=target)
        api.operator("op-split", "Split", [redo[1].name], splitInto=2)
        api.operator("op-merge", "Merge", [default[2].name, default[3].name])
        watch.until(held, "the Move, the Split and the Merge held in RemoveOrigin", 30)
        failure = w.changes
        system.signal(leader, signal.SIGKILL)
        taker = watch.until(
            lambda s: (s.lease_holder() not in ("", leader)) or f"holder {s.lease_holder()!r}",
            "another replica to lead",
            60,
        ).lease_holder()
        set_hooks(api, system, ["c0", "c1"], hold_close=None)

        snap = watch.until(
            finished_on({"c0", "c1"}, table_id, both), "every operator finished and the table replicated", 90
        )
        assert {n: snap.operators[n].phase for n in HELD} == dict.fromkeys(HELD, OpPhase.SUCCEEDED)
        counts = (len(snap.spans_of(table_id, "default")), len(snap.spans_of(table_id, "redo")))
        assert counts == (3, 5), counts  # the merge in default, the split in redo
        assert taker in {"m0", "m1", "m2"} - {leader}
        written_through(w, failure)
        checkpoint_past(watch, w.last, "the checkpoint to pass what was written through the failover", 60)
        rc, out = verify(api, capsys, sink_server)
        assert rc == 0, out
        assert re.fullmatch(CLEAN_BOTH.format(table=table_id), out), out
    checkpoint_past(watch, w.last, "the checkpoint to pass the writer's last revision", 60)
    rc, out = verify(api, capsys, sink_server)
    assert rc == 0, out
    assert re.fullmatch(CLEAN_BOTH.format(table=table_id), out), out


def sink_condition(s: Snap, status: str) -> object:
    cond = s.changefeed.condition(SINK_UNAVAILABLE) if s.changefeed is not None else None
    return (cond is not None and cond.status == status) or f"SinkUnavailable: {cond}"


@pytest.mark.parametrize("kind", ["postgres", "mysql"])
def test_the_sink_crashed_and_restarted_mid_stream_loses_no_row(
    api: Api,
    system: System,
    etcd: EtcdServer,
    start_sink: Callable[..., SinkServer],
    kind: str,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The sink crashes (SIGKILL, then 10 s down) while the writer writes: every transaction of the captures fails
    meanwhile and is retried with back-off, no checkpoint is claimed for rows not committed, the Changefeed says
    so (condition SinkUnavailable, a warning Event) until the sink is back, and then everything written
    arrives. A durable server (fsync on): the rows a sink committed survive its
    crash (test_servers.py shows a throwaway one losing them)."""
    sink_server = start_sink(kind, fsync=True)
    watch = start_feed(api, system, etcd, sink_server, table_id)
    with writer(etcd, table_id) as w:
        watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id), "4 spans Working", 60)
        before = w.last
        checkpoint_past(watch, before, "the checkpoint to pass the writes before the crash", 30)
        failure = w.changes
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sink-down") as pool:
            down = pool.submit(sink_server.restart, 10.0, crash=True)
            try:  # the captures retry, their reports say why, and the Changefeed shows it
                unavailable = "the Changefeed to say the sink is unavailable"
                snap = watch.until(lambda s: sink_condition(s, "True"), unavailable, 9)
            finally:
                down.result(timeout=60)  # a restart that failed fails the test with its own error
        assert snap.changefeed is not None
        cond = snap.changefeed.condition(SINK_UNAVAILABLE)
        assert cond is not None
        assert "cannot use the sink" in cond.message, cond
        assert cond.reason == RETRYING, cond
        assert sink_server.dsn not in cond.message
        retried = sum(proc.count("sink unavailable") for proc in system.procs.values())
        assert retried > 0, system.tails()  # the captures saw the sink down, and said so
        events = api.ok("GET", f"/api/v1/namespaces/{api.namespace}/events")["items"]
        assert any(e.get("reason") == SINK_EVENT and e["type"] == "Warning" for e in events), events
        watch.until(lambda s: sink_condition(s, "False"), "the Changefeed to say the sink writes again", 30)
        written_through(w, failure)
        after = w.last
        checkpoint_past(watch, after, "the checkpoint to pass what was written while the sink was down", 60)
        verified(api, capsys, sink_server, table_id)
    last = w.last
    checkpoint_past(watch, last, "the checkpoint to pass the writer's last revision", 60)
    verified(api, capsys, sink_server, table_id)


def test_a_capture_drained_by_sigterm_and_a_30_s_api_outage_lose_no_row(
    kube: ApiServerHandle,
    api: Api,
    system: System,
    etcd: EtcdServer,
    sink_server: SinkServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A capture stopped by SIGTERM as a rollout stops a pod (without ``--drain-timeout``: it closes its dispatchers,
    reports each Stopped with its final checkpoint and releases its Lease; the maintainer places their spans again
    from those checkpoints on the others), then the API server restarted with 30 s of outage (every client cut off:
    the captures pause their dispatchers at their renew deadline, and resume them once their Leases are theirs
    again): the writer writes through both. A drain proper (spans moved off while the capture still runs) is
    tests/integration/test_capture.py's."""
    watch = start_feed(api, system, etcd, sink_server, table_id)
    with writer(etcd, table_id) as w:
        watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id), "4 spans Working", 60)
        system.capture("c2")
        failure = w.changes
        assert system.signal("c0", signal.SIGTERM, wait=60) == 0, system.tails()
        watch.until(lambda s: settled_on(s, {"c1", "c2"}, table_id), "the table replicated on c1 and c2", 60)
        checkpoint_past(watch, w.last, "the checkpoint to pass what was written through the drain")
        verified(api, capsys, sink_server, table_id)

        written_through(w, failure)
        failure = w.changes
        kube.restart(30.0)
        assert sum(proc.count("paused: stopped delivering") for proc in system.procs.values()) > 0, system.tails()
        watch.until(lambda s: settled_on(s, {"c1", "c2"}, table_id), "the table replicated again after the outage", 60)
        written_through(w, failure)
        checkpoint_past(watch, w.last, "the checkpoint to pass what was written through the outage")
        verified(api, capsys, sink_server, table_id)
    checkpoint_past(watch, w.last, "the checkpoint to pass the writer's last revision")
    verified(api, capsys, sink_server, table_id)


def test_etcd_compacted_past_the_checkpoint_stops_the_changefeed_with_a_clear_failure(
    api: Api,
    system: System,
    start_etcd: Callable[..., EtcdServer],
    sink_server: SinkServer,
    table_id: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every capture down while the writer goes on, and etcd compacted meanwhile past the changefeed's checkpoint
    (TiCDC's GC safepoint passed): the history the dispatchers need is gone. The capture that comes back starts
    them from the checkpoint, etcd refuses the watch, and they stop for good: the Changefeed says so (condition
    ReplicationFailed, a DispatcherFailed Event), its checkpoint does not move past what was delivered, and
    verify refuses to compare at a revision etcd no longer has, rather than report differences."""
    etcd = start_etcd()
    watch = start_feed(api, system, etcd, sink_server, table_id)
    with writer(etcd, table_id) as w:
        watch.until(lambda s: settled_on(s, {"c0", "c1"}, table_id), "4 spans Working", 60)
        checkpoint_past(watch, w.last, "the checkpoint to pass the first writes")
        system.signal("c0", signal.SIGKILL)
        system.signal("c1", signal.SIGKILL)
        time.sleep(1.0)  # more writes nobody delivers
    compacted = w.last
    asyncio.run(compact(etcd, compacted))
    system.capture("c2")
    failed_at_compaction(watch, compacted)
    events = api.ok("GET", f"/api/v1/namespaces/{api.namespace}/events")["items"]
    told = [e for e in events if e.get("reason") == FAILED_EVENT and e["involvedObject"]["name"] == CHANGEFEED]
    assert told, [e.get("reason") for e in events]
    assert told[0]["type"] == "Warning"
    rc, out = verify(api, capsys, sink_server)
    assert rc != 0, out
    assert "compacted" in out, out


def failed_at_compaction(watch: Watch, compacted: int) -> None:
    """The Changefeed reports its dispatchers stopped for good by etcd's compaction to ``compacted`` (condition
    ReplicationFailed naming it), and its checkpoint claims nothing at or after it."""

    def failed(s: Snap) -> object:
        cond = s.changefeed.condition(REPLICATION_FAILED) if s.changefeed is not None else None
        return (cond is not None and cond.status == "True") or f"ReplicationFailed: {cond}"

    snap = watch.until(failed, "the Changefeed to report its dispatchers stopped for good", 60)
    assert snap.changefeed is not None
    cond = snap.changefeed.condition(REPLICATION_FAILED)
    assert cond is not None
    assert f"compacted to revision {compacted}" in cond.message, cond.message
    assert snap.changefeed.checkpoint_ts < compacted  # nothing after the checkpoint is claimed delivered


async def compact(server: EtcdServer, revision: int) -> None:
    options = {"grpc.enable_http_proxy": 0}
    async with aetcd.Client(host=server.host, port=server.port, timeout=5, options=options) as c:
        await c.compact(revision, physical=True)
