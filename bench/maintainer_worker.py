"""One instrumented Maintainer in its own process, driven by ``bench/run.py`` over stdin/stdout (JSON lines).

Why a process of its own: so that the benchmark can SIGKILL it for real (no Lease release, writes cut
mid-flight) while still counting every API request exactly (``Client.requests``, read in this process).
The maintainer code is not changed; it is only observed:

* ``CountingClient`` also counts requests by (verb, resource, collection-or-object);
* ``changefeeds.LeaderElector`` is wrapped to time the Lease acquisition;
* ``changefeeds.decide`` and ``Changefeeds.snapshot`` are wrapped to time them and to snapshot the request
  counter at the exact decision that completes bootstrap (before its writes are applied).

Commands (one per line on stdin, one JSON reply per line on stdout): ``state PREFIX``, ``spans``,
``stats``, ``checkpoint`` (the lag of the changefeed's published checkpoint, as the cache holds it),
``op NAME`` (one operator's phase), ``decisions I J`` (decision-time percentiles of decisions I..J-1),
``profile SECONDS``. EOF on stdin: graceful stop (Lease released).
"""

from __future__ import annotations

import time

T_PROCESS = time.monotonic()  # before the heavy imports: the process start, on the system-wide monotonic clock

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# This checkout's code, not whatever the interpreter's editable install points at (a worktree of another commit).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import bisect  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import resource  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from array import array  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402
from typing import Any  # noqa: E402

import controller.maintainer.changefeeds as changefeeds  # noqa: E402
import controller.maintainer.membership as membership  # noqa: E402
import controller.maintainer.runner as runner  # noqa: E402
from controller.engine import shards  # noqa: E402
from controller.kube.client import Client, Config  # noqa: E402
from controller.maintainer import metrics  # noqa: E402
from controller.maintainer.metrics import MetricsServer  # noqa: E402
from controller.model.records import Changefeed, Span, SpanOperator  # noqa: E402
from controller.model.states import Kind  # noqa: E402
from controller.model.tso import physical_ms  # noqa: E402
from controller.process import heap, tenure  # noqa: E402

STATE: dict[str, Any] = {"t_process": T_PROCESS, "decide_n": 0, "decide_s": 0.0, "snapshot_s": 0.0}
#: Seconds of every ``decide`` call, in order (``decisions I J`` summarises a slice of it).
DECIDE_TIMES: list[float] = []
#: Seconds of every ``snapshot`` call, in order (same indexes as DECIDE_TIMES: one snapshot per decision).
SNAPSHOT_TIMES: list[float] = []
#: Indexes (into DECIDE_TIMES) of the full decisions: the periodic audits (and a term's teardown).
FULL: set[int] = set()
TERMINAL = ("Succeeded", "Failed", "Canceled")


def _resource_of(path: str) -> tuple[str, bool]:
    """('spans', True) for .../namespaces/ns/spans/NAME[/status]; per-object or collection."""
    parts = path.split("?")[0].strip("/").split("/")
    if "namespaces" in parts:
        i = parts.index("namespaces") + 2
        return (parts[i] if i < len(parts) else "?"), len(parts) > i + 1
    return (parts[-1] if parts else "?"), False


class CountingClient(Client):
    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.by_resource: Counter[str] = Counter()

    async def request(self, verb: str, method: str, path: str, **kw: Any) -> dict[str, Any]:  # type: ignore[override]
        plural, one = _resource_of(path)
        self.by_resource[f"{verb} {plural}{'/<name>' if one and verb in ('get', 'list') else ''}"] += 1
        return await super().request(verb, method, path, **kw)

    async def list_pages(self, res: Any, namespace: str, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        async for items, rv in super().list_pages(res, namespace, *args, **kw):
            self.by_resource[f"listed {res.plural}"] += len(items)  # objects, not requests
            yield items, rv

    async def watch(self, res: Any, namespace: str, resource_version: str, **kw: Any) -> Any:  # type: ignore[override]
        self.by_resource[f"watch {res.plural}"] += 1
        async for ev in super().watch(res, namespace, resource_version, **kw):
            yield ev


class TimedElector(changefeeds.LeaderElector):
    async def acquire(self, floor: int = 0, may: Any = lambda: True, answered: Any = lambda: None) -> int:
        changefeed = not self.name.startswith(MEMBER_PREFIX)  # the replica's member Lease is not timed
        if changefeed:
            STATE.setdefault("t_lease_first_try", time.monotonic())
        epoch = await super().acquire(floor, may=may, answered=answered)
        if changefeed:
            STATE.setdefault("t_lease_acquired", time.monotonic())
        return epoch


MEMBER_PREFIX = shards.MEMBER_PREFIX
#: The event loop's stalls. By default (``--probe busy``) each entry is, for one turn of the loop, the time it
#: ran callbacks (its turn minus the time it waited in epoll) plus the previous turn's: a timer or an I/O event
#: due during a turn waits at most that long, so the largest entry bounds the worst lateness (the longest
#: stretch the loop gave no renewal, watch or decision a turn). It costs the loop two clock reads a turn and
#: no wake-up of its own. ``--probe heartbeat``: a callback every STALL_PERIOD records how late it runs
#: instead (what the issue suggested; 100 wake-ups a second: 0.6 % of a core on this machine by itself).
STALL_PERIOD = 0.01
STALLS: array[float] = array("f")
#: The five worst, with when they ended (seconds since the worker started).
WORST: list[tuple[float, float]] = []
#: ``--probe busy``: the longest single turn (an entry of STALLS is two turns).
TURN_MAX = [0.0]
#: The loop thread's CPU time during that longest turn, s (the rest of it was waiting: for the GIL, a decision's
#: thread holding it, or for a core, the other processes having them).
TURN_MAX_CPU = [0.0]


def _stall(late: float) -> None:
    STALLS.append(late)
    if len(WORST) < 5 or late > WORST[-1][0]:
        WORST.append((late, time.monotonic() - T_PROCESS))
        WORST.sort(reverse=True)
        del WORST[5:]


#: The garbage collector's full (generation 2) collections: how many, and the longest, in seconds.
GC_FULL: dict[str, float] = {"n": 0, "max_s": 0.0, "total_s": 0.0}
_gc_began = 0.0


#: Seconds the loop's thread spent in collections of any generation (--stall-stacks: a long callback's share).
GC_LOOP = [0.0]
_LOOP_THREAD = threading.get_ident()


def _gc_watch(phase: str, info: dict[str, int]) -> None:
    global _gc_began
    if phase == "start":
        _gc_began = time.perf_counter()
        return
    took = time.perf_counter() - _gc_began
    if threading.get_ident() == _LOOP_THREAD:
        GC_LOOP[0] += took
    if info.get("generation") != 2:
        return
    GC_FULL["n"] += 1
    GC_FULL["total_s"] += took
    GC_FULL["max_s"] = max(GC_FULL["max_s"], took)


gc.callbacks.append(_gc_watch)


class ProbedSelector(selectors.EpollSelector):
    """Epoll, timed: how long the loop waited, and when it last came back."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = 0.0
        self.waiting = False
        self.back = time.perf_counter()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        t = time.perf_counter()
        self.waiting = True
        try:
            return super().select(timeout)
        finally:
            self.waiting = False
            self.back = time.perf_counter()
            self.waited += self.back - t


class ProbedLoop(asyncio.SelectorEventLoop):
    """The loop whose turns ``--probe busy`` times (``_run_once``: one epoll, then the callbacks ready)."""

    def __init__(self) -> None:
        self.probe = ProbedSelector()
        super().__init__(self.probe)
        self.last = 0.0

    def _run_once(self) -> None:
        t, waited, cpu = time.perf_counter(), self.probe.waited, time.thread_time()
        super()._run_once()  # type: ignore[misc]
        busy = time.perf_counter() - t - (self.probe.waited - waited)
        _turn_ended(busy)
        _stall(busy + self.last)
        self.last = busy
        if busy > TURN_MAX[0]:
            TURN_MAX[0] = busy
            TURN_MAX_CPU[0] = time.thread_time() - cpu


class Probe:
    """``--probe heartbeat`` (or nothing more for ``busy``: ProbedLoop records the turns), and with ``stacks``
    a thread that samples the loop thread's stack whenever the loop has been busy (or a beat late) more than
    STACK_AFTER, so that a stall says where it was spent (``stall_stacks``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, heartbeat: bool, stacks: bool) -> None:
        self.loop = loop
        self.due = time.perf_counter() + STALL_PERIOD
        self.handle = loop.call_at(loop.time() + STALL_PERIOD, self.beat) if heartbeat else None
        self.stopped = threading.Event()
        self.thread_id = threading.get_ident()
        if stacks:
            threading.Thread(target=self.sample, name="stall-stacks", daemon=True).start()
            _time_callbacks()

    def beat(self) -> None:
        now = time.perf_counter()
        _stall(max(0.0, now - self.due))
        self.due = now + STALL_PERIOD
        self.handle = self.loop.call_at(self.loop.time() + STALL_PERIOD, self.beat)

    def stalled(self) -> float:
        if self.handle is not None:
            return time.perf_counter() - self.due
        probe = getattr(self.loop, "probe", None)
        if probe is None or probe.waiting:
            return 0.0
        return float(time.perf_counter() - probe.back)

    def sample(self) -> None:
        while not self.stopped.wait(STACK_EVERY):
            if self.stalled() < STACK_AFTER:
                continue
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            where = [f"{fs.filename.rsplit('/', 2)[-1]}:{fs.lineno} {fs.name}"
                     for fs in traceback.extract_stack(frame)[-STACK_DEPTH:]]  # fmt: skip
            STACKS[" <- ".join(reversed(where))] += 1

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.stopped.set()
        signal.setitimer(signal.ITIMER_PROF, 0)  # --stall-stacks' timer: a SIGPROF after exit kills the process


#: (perf_counter, the machine's steal time in ms) every STEAL_EVERY s, from /proc/stat (--stall-stacks).
STEAL: list[tuple[float, float]] = []
STEAL_EVERY = 0.01


def _steal_reader() -> None:
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    while True:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
            STEAL.append((time.perf_counter(), int(fields[8]) * tick_ms))
            if len(STEAL) > 20_000:
                del STEAL[:10_000]
        except (OSError, IndexError, ValueError):
            return
        time.sleep(STEAL_EVERY)


def _steal_between(began: float, ended: float) -> str:
    """The machine's steal time (all CPUs, in ms) from the last sample before ``began`` to the latest one (taken
    while the callback ran, the reader thread getting the GIL at switch intervals): "?" without one."""
    samples = STEAL[-200:]
    before = [v for t, v in samples if t <= began]
    if not before or samples[-1][0] <= began:
        return "?"
    return f"{samples[-1][1] - before[-1]:.0f}"


def _time_callbacks() -> None:
    """With --stall-stacks, also each callback of the loop: one that runs LONG_CALLBACK or more is counted in
    ``STACKS`` as ``callback <ms> ms (<ms> cpu): <what>`` (a task: its coroutine, and where it stopped). A long
    C call (a JSON decode, a collection) holds the GIL, so the sampler cannot see it; this can."""
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        began, cpu, collected = time.perf_counter(), time.thread_time(), GC_LOOP[0]
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        CALLBACK_BEGAN[0] = began
        try:
            run(handle)
        finally:
            CALLBACK_BEGAN[0] = 0.0
            took = time.perf_counter() - began
            TURN[_kind(handle)] += took
            TURN_N[0] += 1
            if took >= LONG_CALLBACK:
                spent, gc_s = time.thread_time() - cpu, GC_LOOP[0] - collected
                now = resource.getrusage(resource.RUSAGE_THREAD)
                # Where the thread's CPU went (user, system: page faults are system time), the faults, the times
                # it was preempted, and the machine's steal time meanwhile (a vCPU the host ran something else
                # on: this VM may count it as the running thread's CPU).
                what = (
                    f"{took * 1000:.0f} ms ({spent * 1000:.0f} cpu, {gc_s * 1000:.0f} gc; "
                    f"user {(now.ru_utime - usage.ru_utime) * 1000:.0f} "
                    f"sys {(now.ru_stime - usage.ru_stime) * 1000:.0f} "
                    f"minflt {now.ru_minflt - usage.ru_minflt} preempted {now.ru_nivcsw - usage.ru_nivcsw} "
                    f"steal {_steal_between(began, time.perf_counter())} ms)"
                )
                STACKS[f"callback {what}: {_what(handle)}"] += 1

    asyncio.events.Handle._run = timed  # type: ignore[method-assign]
    threading.Thread(target=_steal_reader, name="steal", daemon=True).start()
    # Where a long callback spends its time: a profiling timer (process CPU) whose handler, in the loop's
    # thread, counts the stack while the current callback has run LONG_CALLBACK or more.
    signal.signal(signal.SIGPROF, _in_long_callback)
    signal.setitimer(signal.ITIMER_PROF, 0.002, 0.002)
    # And the synchronous steps a long callback may be made of: each one of LONG_STEP or more is counted too.
    from controller.kube import executor as executor_module
    from controller.kube import informer as informer_module
    from controller.kube import store as store_module

    for owner, attr in (
        (informer_module.Informer, "_offer"),
        (informer_module.Informer, "received"),
        (store_module.Store, "list_page"),
        (store_module.Store, "end_listing"),
        (changefeeds.Changefeeds, "snapshot"),
        (executor_module.Executor, "owner_reference"),
    ):
        setattr(owner, attr, _timed_step(getattr(owner, attr), f"{owner.__name__}.{attr}"))


def _timed_step(fn: Any, name: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        began, collected = time.perf_counter(), GC_LOOP[0]
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - began
            if took >= LONG_STEP:
                kind = next((a for a in args[1:] if isinstance(a, str)), "")
                STACKS[f"step {name}({kind}) {took * 1000:.0f} ms ({(GC_LOOP[0] - collected) * 1000:.0f} gc)"] += 1

    return timed


#: With --stall-stacks: synchronous steps (an offer, a LIST page) that ran this long or longer are counted.
LONG_STEP = 0.01


#: When the loop's current callback began (0: none running).
CALLBACK_BEGAN = [0.0]


def _in_long_callback(signum: int, frame: Any) -> None:
    began = CALLBACK_BEGAN[0]
    if not began or time.perf_counter() - began < LONG_CALLBACK:
        return
    where = []
    while frame is not None and len(where) < 7:
        where.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    STACKS["in a long callback: " + " <- ".join(where)] += 1


#: With --stall-stacks: this turn's callbacks, seconds by kind (``_kind``), and how many ran.
TURN: Counter[str] = Counter()
TURN_N = [0]
#: A turn this long or longer is counted in ``STACKS`` with what its time went to.
LONG_TURN = 0.05


def _kind(handle: asyncio.events.Handle) -> str:
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        return "task " + getattr(task.get_coro(), "__qualname__", "?")
    return getattr(callback, "__qualname__", type(callback).__name__)


def _turn_ended(busy: float) -> None:
    if busy >= LONG_TURN and TURN:
        top = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in TURN.most_common(4))
        STACKS[f"turn {busy * 1000:.0f} ms, {TURN_N[0]} callbacks: {top}"] += 1
    TURN.clear()
    TURN_N[0] = 0


def _what(handle: asyncio.events.Handle) -> str:
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro: Any = task.get_coro()
        name = getattr(coro, "__qualname__", repr(coro))
        where = []
        while coro is not None and len(where) < 4:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                where.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        return f"task {name} now at {' > '.join(where)}"
    return repr(callback)[:160]


#: With --stall-stacks: callbacks that ran this long or longer are counted, by what they were.
LONG_CALLBACK = 0.02


#: With --stall-stacks: the loop thread's stack, sampled every STACK_EVERY while the loop is more than
#: STACK_AFTER late, by where it was (innermost first): each count is STACK_EVERY of stall.
STACKS: Counter[str] = Counter()
STACK_EVERY = 0.01
STACK_AFTER = 0.05
STACK_DEPTH = 8


changefeeds.LeaderElector = TimedElector  # type: ignore[misc]
membership.LeaderElector = TimedElector  # type: ignore[misc]
_decide = changefeeds.decide
CLIENT: CountingClient | None = None


def timed_decide(world: Any, memory: Any, options: Any = None) -> Any:
    t = time.perf_counter()
    d = _decide(world, memory, options)
    took = time.perf_counter() - t
    if getattr(d, "full", False) and getattr(world, "index", None) is not None:
        FULL.add(len(DECIDE_TIMES))
    DECIDE_TIMES.append(took)
    STATE["decide_s"] += took
    STATE["decide_n"] += 1
    if not memory.bootstrapped and d.memory.bootstrapped and "t_bootstrapped" not in STATE:
        STATE["t_bootstrapped"] = time.monotonic()
        STATE["bootstrap_report"] = d.memory.report
        STATE["bootstrap_writes"] = d.writes
        assert CLIENT is not None
        STATE["bootstrap_requests"] = dict(CLIENT.requests)
        STATE["bootstrap_by_resource"] = dict(CLIENT.by_resource)
    return d


changefeeds.decide = timed_decide  # type: ignore[assignment]


#: Seconds each scrape took in the loop (the handler: the registry's collection and its encoding, one turn of the
#: loop): wall time, and the loop thread's CPU time (the difference is waiting, for the GIL mostly).
SCRAPE_WORK: list[float] = []
SCRAPE_CPU: list[float] = []
_metrics_handler = metrics.MetricsServer._metrics


async def timed_metrics_handler(self: metrics.MetricsServer, request: Any) -> Any:
    t, c = time.perf_counter(), time.thread_time()
    try:
        return await _metrics_handler(self, request)
    finally:
        SCRAPE_WORK.append(time.perf_counter() - t)
        SCRAPE_CPU.append(time.thread_time() - c)


metrics.MetricsServer._metrics = timed_metrics_handler  # type: ignore[method-assign]


_snapshot = changefeeds.Changefeeds.snapshot


def timed_snapshot(self: changefeeds.Changefeeds, name: str) -> Any:
    t = time.perf_counter()
    try:
        return _snapshot(self, name)
    finally:
        took = time.perf_counter() - t
        SNAPSHOT_TIMES.append(took)
        STATE["snapshot_s"] += took


changefeeds.Changefeeds.snapshot = timed_snapshot  # type: ignore[method-assign]
TimedMaintainer = runner.Maintainer


def percentiles(values: list[float]) -> dict[str, float]:
    """n, p50, p99 and max of ``values`` (seconds), in milliseconds."""
    if not values:
        return {"n": 0}
    v = sorted(values)

    def at(q: float) -> float:
        return round(v[min(len(v) - 1, int(q * len(v)))] * 1000, 3)

    return {"n": len(v), "p50_ms": at(0.50), "p99_ms": at(0.99), "max_ms": round(v[-1] * 1000, 3)}


def decisions(arg: str) -> dict[str, Any]:
    """``decisions I J``: percentiles of decide (and snapshot) times of decisions I..J-1 (J omitted: to now)."""
    parts = arg.split()
    i = int(parts[0]) if parts else 0
    j = int(parts[1]) if len(parts) > 1 else len(DECIDE_TIMES)
    incremental = [t for k, t in enumerate(DECIDE_TIMES[i:j], i) if k not in FULL]
    full = [t for k, t in enumerate(DECIDE_TIMES[i:j], i) if k in FULL]
    return {
        "decide": percentiles(DECIDE_TIMES[i:j]),
        "incremental": percentiles(incremental),
        "audits": percentiles(full),
        "snapshot": percentiles(SNAPSHOT_TIMES[i:j]),
    }


def rss_kib(pid: str = "self") -> dict[str, int]:
    out = {"ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} if pid == "self" else {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def _span_states(m: runner.Maintainer) -> Counter[str]:
    """Spans per state, from the engine's index when the maintainer keeps one (cheap), else by a scan."""
    indexes = getattr(m.informer.store, "indexes", None)
    if indexes is not None:
        out: Counter[str] = Counter()
        for index in indexes.values():
            for st, n in index.state_counts.items():
                if n:
                    out[str(st or "New")] += n
        return out
    return Counter(str(s.state or "New") for s in m.informer.store.all(Kind.SPAN).values() if isinstance(s, Span))


def _operators(m: runner.Maintainer, prefix: str) -> tuple[int, Counter[str]]:
    """Operators in flight, and the phases of those whose name starts with ``prefix``."""
    phases: Counter[str] = Counter()
    in_flight = 0
    store = m.informer.store
    names = getattr(store, "names", None)
    every = names(Kind.OPERATOR) if callable(names) else list(store.all(Kind.OPERATOR))
    for name in every:
        op = store.record(Kind.OPERATOR, name)
        if not isinstance(op, SpanOperator):
            continue
        in_flight += op.in_flight
        if prefix and name.startswith(prefix):
            phases[f"{op.phase}/{op.stage}" if op.phase == "Running" else str(op.phase)] += 1
    return in_flight, phases


def state(m: runner.Maintainer, prefix: str) -> dict[str, Any]:
    spans = _span_states(m)
    in_flight, phases = _operators(m, prefix)
    return {
        "spans": dict(spans),
        "span_total": sum(spans.values()),
        "in_flight": in_flight,
        "operators": sum(1 for op in m.informer.store.all(Kind.OPERATOR).values() if isinstance(op, SpanOperator)),
        "ops": dict(phases),
        "synced": m.informer.synced.is_set(),
        "bootstrapped": "t_bootstrapped" in STATE,
        "leading": sorted(m.leading),
        # The led changefeeds whose current term has bootstrapped.
        "led_bootstrapped": sorted(n for n in m.leading if (mem := m.memories.get(n)) is not None and mem.bootstrapped),
    }


async def spans(m: runner.Maintainer) -> AsyncIterator[str]:
    """Every span, as one JSON list, built and encoded a thousand at a time with the loop let go in between:
    at 100,000 spans, one list and one ``json.dumps`` held the maintainer's loop half a second, a stall of
    the bench's own making counted as the maintainer's."""
    records = m.informer.store.all(Kind.SPAN)
    names = list(records)
    yield "["
    first = True
    for i in range(0, len(names), 1000):
        chunk = []
        for name in names[i : i + 1000]:
            s = records.get(name)
            if isinstance(s, Span):
                chunk.append({
                    "name": s.name,
                    "table": s.table_id,
                    "start": s.key_range.start.hex(),
                    "end": s.key_range.end.hex(),
                    "capture": s.capture,
                    "state": str(s.state),
                })  # fmt: skip
        if chunk:
            yield ("" if first else ",") + json.dumps(chunk)[1:-1]
            first = False
        await asyncio.sleep(0)
    yield "]"


def checkpoint(m: runner.Maintainer) -> dict[str, Any]:
    """The published checkpoint of every changefeed (the cache has our own writes: what the API holds)."""
    now = time.time()
    out = {}
    for name, cf in m.informer.store.all(Kind.CHANGEFEED).items():
        if isinstance(cf, Changefeed) and cf.checkpoint_ts > 0:
            out[name] = {"checkpoint": cf.checkpoint_ts, "lag": now - physical_ms(cf.checkpoint_ts) / 1000.0}
    return out


def stats(m: runner.Maintainer, client: CountingClient) -> dict[str, Any]:
    return {
        **STATE,
        "now": time.monotonic(),
        "decide_count": len(DECIDE_TIMES),
        "requests": dict(client.requests),
        "by_resource": dict(client.by_resource),
        "decisions": m.stats.decisions,
        "handoffs": m.stats.handoffs,
        "writes": m.stats.writes,
        "failed_chains": m.stats.failed_chains,
        "bootstrap_seconds": m.stats.bootstrap_seconds,
        "epochs": m.stats.epochs,
        "executor_errors": dict(m.executor.errors),
        "rss": rss_kib(),
        "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
        "stall_count": len(STALLS),
        "gc_full": dict(GC_FULL),
        "tenure": None
        if m.tenure is None
        else {
            "steps": m.tenure.steps,
            "longest_s": round(m.tenure.longest_s, 4),
            "total_s": round(m.tenure.total_s, 3),
        },
        "pacer_yields": m.informer.pacer.yields,
        "scrape_work_ms": percentiles(SCRAPE_WORK) if SCRAPE_WORK else None,
        "scrape_cpu_ms": percentiles(SCRAPE_CPU) if SCRAPE_CPU else None,
        "heap_reserve": None
        if m.heap is None
        else {
            "refills": m.heap.refills,
            "written_mib": round(m.heap.written / heap.MiB, 1),
            "refill_s": round(m.heap.refill_s, 3),
            "top_mib": round(m.heap.top / heap.MiB, 1),
            "longest_check_ms": round(m.heap.longest_check_s * 1000, 2),
            "off": m.heap.off,
        },
    }


def gc_leak() -> dict[str, Any]:
    """What freezing cost: the reference cycles that died frozen (tenure steps, LIST pages), which no pass
    collects. The garbage not frozen is collected first; then everything is thawed and one full pass counts
    what it finds. Holds the loop for that pass (seconds at 100,000 spans): asked once the figures are in."""
    gc.collect()
    frozen = gc.get_freeze_count()
    t = time.perf_counter()
    gc.unfreeze()
    found = gc.collect()
    return {"frozen": frozen, "cycles_found": found, "full_pass_s": round(time.perf_counter() - t, 3)}


async def stalls(arg: str) -> dict[str, Any]:
    """The stalls (STALLS) between two ``stall_count`` readings ("I J"; "I" to now), in ms. Computed a chunk
    at a time (a run at 100,000 spans has 600,000 turns: one sort of them held the loop 100 ms)."""
    i, _, j = arg.partition(" ")
    window = STALLS[int(i or 0) : int(j) if j else len(STALLS)]
    n = len(window)
    if not n:
        return {"n": 0}
    k = n - min(n - 1, int(n * 0.99))  # the p99 is the k-th largest
    top: list[float] = []
    over = 0
    for a in range(0, n, 20_000):
        chunk = sorted(window[a : a + 20_000])
        top = sorted(top + chunk[-k:])[-k:]
        over += len(chunk) - bisect.bisect_right(chunk, 0.1)
        await asyncio.sleep(0)
    return {
        "n": n,
        "max_ms": round(top[-1] * 1000, 1),
        "p99_ms": round(top[0] * 1000, 1),
        "over_100ms": over,
        "worst_ms_at_s": [(round(late * 1000, 1), round(at, 1)) for late, at in WORST],
        "longest_turn_ms_so_far": round(TURN_MAX[0] * 1000, 1),
        "longest_turn_cpu_ms": round(TURN_MAX_CPU[0] * 1000, 1),
    }


async def profile(seconds: float, top: int = 25) -> dict[str, Any]:
    prof = cProfile.Profile()
    prof.enable()
    await asyncio.sleep(seconds)
    prof.disable()
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        out[key] = buf.getvalue()
    return out


#: The replies' pipe, written without blocking the loop (a 15 MB reply into a 64 KiB pipe blocked the
#: maintainer's thread until the driver had read it all).
OUT: asyncio.StreamWriter | None = None


async def reply(obj: Any) -> None:
    await send(json.dumps(obj))


async def send(*parts: str) -> None:
    """The parts, each drained before the next is encoded (the spans reply is 15 MB at 100,000 spans: written
    in one go, its copies held the maintainer's loop for tens of milliseconds)."""
    assert OUT is not None
    for part in parts:
        OUT.write(part.encode())
        await OUT.drain()
    OUT.write(b"\n")
    await OUT.drain()


async def main(a: argparse.Namespace) -> None:
    global CLIENT
    client = CLIENT = CountingClient(Config.load(a.kubeconfig))
    settings = runner.Settings(
        namespace=a.namespace,
        identity=a.identity,
        tick=a.tick,
        lease_duration=a.lease_duration,
        renew_deadline=a.lease_duration * 2 / 3,
        retry=a.retry,
        cache=a.cache,
        expected_replicas=a.expected_replicas,
        gc_tenure=a.gc_tenure,
        heap_reserve=a.heap_reserve * heap.MiB,
        audit_interval=a.audit_interval,
    )
    m = TimedMaintainer(client, settings)
    STATE["t_start"] = time.monotonic()
    global OUT
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    OUT = asyncio.StreamWriter(transport, protocol, None, loop)
    beat = Probe(loop, a.probe == "heartbeat", a.stall_stacks)
    await m.start()
    server: MetricsServer | None = None
    if a.scrape > 0:  # served as the maintainer's own is: the driver scrapes it (bench/run.py --scrape)
        server = MetricsServer(m.metrics.registry, "127.0.0.1", 0)
        await server.start()
        STATE["metrics_port"], STATE["scrape"] = server.port, a.scrape
    await reply({"ready": True, **STATE})
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode().strip():
            cmd, _, arg = line.partition(" ")
            if cmd == "state":
                await reply(state(m, arg))
            elif cmd == "spans":
                await send(*[part async for part in spans(m)])
            elif cmd == "stats":
                await reply(stats(m, client))
            elif cmd == "checkpoint":
                await reply(checkpoint(m))
            elif cmd == "op":
                op = m.informer.store.record(Kind.OPERATOR, arg)
                await reply({"phase": str(op.phase) if isinstance(op, SpanOperator) else None})
            elif cmd == "decisions":
                await reply(decisions(arg))
            elif cmd == "stalls":
                await reply(await stalls(arg))
            elif cmd == "gc_leak":
                await reply(gc_leak())
            elif cmd == "stall_stacks":
                await reply(dict(STACKS.most_common(int(arg or 300))))
            elif cmd == "profile":
                await reply(await profile(float(arg or 10)))
            else:
                await reply({"error": f"unknown command {cmd!r}"})
    finally:
        beat.stop()
        if server is not None:
            await server.stop()
        await m.stop()
        await client.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--lease-duration", type=float, default=3.0)
    p.add_argument("--retry", type=float, default=0.5)
    p.add_argument("--tick", type=float, default=0.5)
    p.add_argument("--cache", choices=("warm", "sharded"), default="warm")
    p.add_argument("--expected-replicas", type=int, default=1)
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--gc-tenure", type=float, default=tenure.PERIOD)
    p.add_argument("--heap-reserve", type=int, default=0, help="MiB (0: off, the maintainer's default)")
    p.add_argument("--audit-interval", type=float, default=runner.Settings.audit_interval)
    p.add_argument("--probe", choices=("busy", "heartbeat"), default="busy", help="how stalls are measured")
    p.add_argument("--scrape", type=float, default=0.0, help="serve /metrics for a scrape every this many s (0: off)")
    p.add_argument("--stall-stacks", action="store_true", help="sample the loop's stack while it stalls")
    args = p.parse_args()
    if args.heap_reserve:
        heap.configure(args.heap_reserve * heap.MiB)  # as the maintainer's main does, before any thread allocates
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if args.probe == "busy":
        with asyncio.Runner(loop_factory=ProbedLoop) as run:
            run.run(main(args))
    else:
        asyncio.run(main(args))
