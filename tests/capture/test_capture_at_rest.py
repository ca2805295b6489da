"""A capture at rest costs the same whatever it holds (issue 25): its progress report reuses its groups while
nothing starts, stops or changes state, and the default runtime gives a group's minimum at once when every
dispatcher in it is at the same point; what it claims then never goes back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from controller.capture.agent import Agent, Settings
from controller.capture.runtime import LogicalClockRuntime
from controller.kube.client import Client, Config
from controller.model import progress
from controller.model.keys import KeyRange
from controller.model.records import Dispatcher
from controller.model.states import DispatcherState, Mode
from controller.model.tso import tso

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.wall = T0
        self.mono = 100.0

    def tick(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


def disp(i: int, start_ts: int | None = None, changefeed: str = "cf", mode: Mode = Mode.DEFAULT) -> Dispatcher:
    return Dispatcher(
        name=f"d{i:03d}",
        uid=f"uid-{i}",
        changefeed=changefeed,
        span=f"s{i}",
        table_id=1,
        mode=mode,
        key_range=KeyRange.of_table(1),
        capture="c0",
        start_ts=tso(int((T0 - 60) * 1000)) if start_ts is None else start_ts,
        epoch=1,
    )


def runtime(clock: Clock, **kw: object) -> LogicalClockRuntime:
    return LogicalClockRuntime(clock=lambda: clock.wall, monotonic=lambda: clock.mono, **kw)  # type: ignore[arg-type]


def test_low_watermark_is_every_runs_checkpoint_when_all_are_at_the_target() -> None:
    clock = Clock()
    rt = runtime(clock)
    names = []
    for i in range(5):
        rt.start(disp(i))
        names.append(f"d{i:03d}")
    clock.tick(1.0)
    low = rt.low_watermark(names)
    assert low is not None
    assert low[1] == "d000"
    each = [rt.checkpoint(n) for n in names]  # asked later: at least the claim
    assert min(each) >= low[0]
    assert low[0] > disp(0).start_ts


def test_low_watermark_declines_when_it_cannot_tell() -> None:
    clock = Clock()
    rt = runtime(clock)
    rt.start(disp(0))
    assert rt.low_watermark(["d000"]) is None  # not yet past init_delay
    clock.tick(1.0)
    assert rt.low_watermark([]) is None
    assert rt.low_watermark(["d000"]) is not None
    rt.pause("d000")
    assert rt.low_watermark(["d000"]) is None  # something paused
    rt.resume("d000")
    assert rt.low_watermark(["d000"]) is not None
    rt.start(disp(1, start_ts=tso(int((clock.wall + 60) * 1000))))  # starts past the target
    clock.tick(1.0)
    assert rt.low_watermark(["d000", "d001"]) is None
    late = runtime(clock, deliver_until=lambda: clock.mono - 1)
    late.start(disp(2))
    clock.tick(1.0)
    assert late.low_watermark(["d002"]) is None

    class Sink:
        def delivered(self, d: Dispatcher, to_ts: int) -> None: ...
        def flush(self) -> None: ...
        def forget(self, uid: str) -> None: ...

    recorded = runtime(clock, sink=Sink())
    recorded.start(disp(3))
    clock.tick(1.0)
    assert recorded.low_watermark(["d003"]) is None  # each delivery is recorded: ask each


def test_what_low_watermark_claimed_never_goes_back() -> None:
    clock = Clock()
    renewed = {"until": 1e18}
    rt = runtime(clock, deliver_until=lambda: renewed["until"])
    rt.start(disp(0))
    clock.tick(1.0)
    low = rt.low_watermark(["d000"])
    assert low is not None
    renewed["until"] = clock.mono  # late from now on: nothing more is delivered
    clock.tick(5.0)
    assert rt.checkpoint("d000") >= low[0]
    assert rt.pause("d000") >= low[0]
    assert rt.close("d000") >= low[0]


def test_a_run_started_after_a_claim_is_not_raised_to_it() -> None:
    clock = Clock()
    rt = runtime(clock)
    rt.start(disp(0))
    clock.tick(1.0)
    low = rt.low_watermark(["d000"])
    assert low is not None
    old = disp(1, start_ts=disp(0).start_ts)
    rt.start(old)
    rt.pause("d001")  # it has delivered nothing yet
    assert rt.checkpoint("d001") == old.start_ts


def with_agent(check: Callable[[Agent, Clock], None]) -> None:
    """Run ``check`` on an agent that never reaches an API (only its bookkeeping is looked at)."""

    async def main() -> None:
        clock = Clock()
        async with Client(Config(url="http://127.0.0.1:1")) as client:
            check(Agent(client, Settings(name="c0", namespace="ns"), runtime=runtime(clock)), clock)

    asyncio.run(main())


def add(a: Agent, d: Dispatcher, state: DispatcherState = DispatcherState.WORKING) -> None:
    a.routed.start(d)
    run = a.runs.start(d)
    a.runs.set_state(run, state)
    a.runs.written(run, state)


def expected(a: Agent) -> tuple[progress.ProgressEntry, ...]:
    running = [
        progress.Running(r.record.uid, n, r.record.changefeed, r.record.mode, r.record.start_ts, a.routed.checkpoint(n))
        for n, r in a.runs.items()
        if r.state is DispatcherState.WORKING and r.written_state is DispatcherState.WORKING
    ]
    return progress.build(running, a.incarnation, 0.0).entries


def test_the_report_is_the_one_built_from_every_run() -> None:
    with_agent(report_is_built_from_every_run)


def report_is_built_from_every_run(a: Agent, clock: Clock) -> None:
    for i in range(6):
        add(a, disp(i, changefeed="cf" if i % 2 else "other", mode=Mode.DEFAULT if i < 4 else Mode.REDO))
    add(a, disp(9), DispatcherState.INITIALIZING)  # not reported
    clock.tick(1.0)
    got = a.reporter.progress().entries
    assert [replace(e, checkpoint_ts=0) for e in got] == [replace(e, checkpoint_ts=0) for e in expected(a)]
    assert all(e.checkpoint_ts > 0 for e in got)


def test_the_groups_follow_every_change_of_the_runs() -> None:
    with_agent(groups_follow_every_change)


def groups_follow_every_change(a: Agent, clock: Clock) -> None:
    for i in range(3):
        add(a, disp(i))
    clock.tick(1.0)
    assert a.reporter.progress().entries[0].dispatchers == 3
    a.runs.pop("d001")
    a.routed.close("d001")
    assert a.reporter.progress().entries[0].dispatchers == 2
    a.runs.written(a.runs["d000"], None)  # its Working status no longer the last written
    (entry,) = a.reporter.progress().entries
    assert entry.dispatchers == 1
    assert entry.digest == progress.digest(["uid-2"])
    add(a, disp(7))
    assert a.reporter.progress().entries[0].dispatchers == 2


def test_a_tables_traffic_change_marks_its_runs_for_the_next_pass() -> None:
    """At rest no pass walks the dispatchers (a full pass comes once a minute); a Table whose write rate or
    region count changed gets its dispatchers looked at by the next pass instead."""

    class Tables(Client):
        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.rate = 0.0

        async def list(self, res: object, namespace: str, *args: object, **kw: object) -> tuple[list[dict], str]:  # type: ignore[override]
            spec = {"changefeed": "cf", "tableID": 1, "writeRate": self.rate, "regionCount": 4}
            return [{"spec": spec}, {"spec": {"changefeed": "cf", "tableID": 2, "writeRate": 5.0}}], "1"

    async def main() -> None:
        clock = Clock()
        async with Tables(Config(url="http://127.0.0.1:1")) as client:
            a = Agent(client, Settings(name="c0", namespace="ns", tables_interval=0.001), runtime=runtime(clock))
            add(a, disp(0))
            add(a, replace(disp(1), table_id=2, name="other"))
            a.runs["d000"].traffic_at = a.runs["other"].traffic_at = 50.0
            await a.reconciler._refresh_rates()
            assert a.reconciler.active == {"d000", "other"}  # first read: every table is new
            a.reconciler.active.clear()
            a.runs["d000"].traffic_at = a.runs["other"].traffic_at = 50.0
            await asyncio.sleep(0.01)
            await a.reconciler._refresh_rates()
            assert a.reconciler.active == set()  # nothing moved
            client.rate = 100.0
            await asyncio.sleep(0.01)
            await a.reconciler._refresh_rates()
            assert a.reconciler.active == {"d000"}
            assert a.runs["d000"].traffic_at < 0
            assert a.runs["other"].traffic_at == 50.0

    asyncio.run(main())


def test_a_pass_at_rest_does_not_walk_the_dispatchers_held() -> None:
    """Between full passes (once a minute), a pass with nothing changed visits nothing and copies nothing:
    at 16,700 dispatchers a capture's ``names & set(live)`` (a copy of every name, every pass) was two
    thirds of its CPU at rest."""

    class Walked(dict):  # type: ignore[type-arg]
        walks = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            Walked.walks += 1
            return super().__iter__()

    async def main() -> None:
        clock = Clock()
        async with Client(Config(url="http://127.0.0.1:1")) as client:
            a = Agent(client, Settings(name="c0", namespace="ns"), runtime=runtime(clock))
            live = Walked()
            for i in range(50):
                d = disp(i)
                add(a, d)
                a.runs[d.name].traffic_at = 1.0  # its traffic already looked at
                live[d.name] = {"metadata": {"name": d.name}, "status": {"state": DispatcherState.WORKING.value}}
            a.dispatchers.objects = live
            now = asyncio.get_running_loop().time()
            a.reconciler.full_at = a.rates._at = a.epochs._at = now  # the full pass and the Table reads not due
            a.capture.status, a.capture.status_at = {"dispatchers": 50, "pod": None, "address": None}, now
            a.dispatchers.dirty = {"d007"}  # one changed
            Walked.walks = 0
            await a.reconciler.reconcile()
            assert Walked.walks == 0
            a.reconciler.full_at = -1e9
            await a.reconciler.reconcile()  # the full pass, on the other hand, does look at every one
            assert Walked.walks > 0

    asyncio.run(main())
