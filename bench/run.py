"""``python bench/run.py``: figures of the maintainer on the embedded Kubernetes API (a figure printer, not a test).

For each span count N it starts a fresh embedded API server (``python -m controller.apiserver``, a
subprocess), C capture agents (subprocesses) and an instrumented maintainer (``bench/maintainer_worker.py``,
a subprocess running ``controller.maintainer.runner.Maintainer`` with asyncio; it reports its exact
request counts over a pipe), then measures:

1. scale-up: Tables with ``preSplit.spans`` summing to N applied -> all N spans Replicating;
0. at rest (right after 1): API writes per second by verb and resource as the API server counts them
   (every client), CPU of every process, and the changefeed's checkpoint lag;
2. API requests by verb, overall and per user operator (Move, Split, Merge, Remove);
3. failover: K Moves held in RemoveOrigin by the ``hold-close`` hook, the maintainer SIGKILLed
   (a real SIGKILL: no Lease release), a new one started: Lease wait, bootstrap time, bootstrap
   requests by verb, and the time to finish all K after the hooks are released;
4. peak RSS of the maintainer process, and per span;
5. the raw rates of the same API server, measured in the same run before anything else starts: sequential
   status writes from one client (``controller.apiserver.bench.run``), and create + status-patch pairs
   (one object created, then its status patched), from one client and from 16 concurrent ones; the
   apply -> all Replicating rate of phase 1 as a ratio of both pair rates;
6. decision time (p50, p99) while scaling up, idle, and under a single user Move; idle CPU; requests and
   writes per placement; a single user Move's duration.

See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller.apiserver import bench as api_bench  # noqa: E402
from controller.kube.client import RESOURCES, ApiError, Client, Config  # noqa: E402
from controller.model import resources as conv  # noqa: E402
from controller.model.keys import KeyRange  # noqa: E402
from controller.model.records import Span  # noqa: E402
from controller.model.states import GROUP, Kind, SpanState  # noqa: E402
from controller.process import heap, tenure  # noqa: E402

NS = "bench"
CF = "bench"
HOLD_CLOSE = f"{GROUP}/hold-close"
API_VERSION = f"{GROUP}/v1alpha1"
TERMINAL = ("Succeeded", "Failed", "Canceled")
WORKER = ROOT / "bench" / "maintainer_worker.py"
COUNTING_SERVER = ROOT / "bench" / "apiserver_counting.py"
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
MAX_PRESPLIT = 1000  # the Table CRD caps preSplit.spans at 1024 (the engine at 4096)
RAW_NS = "bench-raw"  # the raw-rate objects live here, out of the maintainer's sight
#: Maintainer requests that write, as the worker's counting client names them (Events are best effort and
#: not counted as placement writes). ``WRITE_VERBS`` above: as the counting API server names them.
MAINTAINER_WRITE_VERBS = ("create", "patch", "patch/status", "delete", "update")


#: Requests that read (a LIST's continuation pages included).
READ_VERBS = ("get", "list", "list/continue", "watch")


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys) if after.get(k, 0) != before.get(k, 0)}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a (live) process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def worker_flags(a: argparse.Namespace) -> list[str]:
    flags = ["--gc-tenure", str(a.gc_tenure), "--heap-reserve", str(a.heap_reserve), "--probe", a.probe, "--audit-interval", str(a.audit_interval)]
    flags += ["--scrape", str(a.scrape)]
    return [*flags, *(["--stall-stacks"] if a.stall_stacks else [])]


def machine_busy() -> tuple[float, float] | None:
    """(busy, total) CPU jiffies of the whole machine so far (/proc/stat), None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class Scraper:
    """GET /metrics of a maintainer every ``period`` seconds, as Prometheus would, for as long as it lives: how long
    each scrape took to answer (served in the maintainer's event loop, so it includes waiting for the loop's current
    turn), when (seconds since the scraper started), and how busy the machine's cores were over the second before it
    (/proc/stat: on this 2-core VM the API server, three captures, the maintainer and this driver share them). A
    figure to read, not a target."""

    def __init__(self, port: int, period: float) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.period = period
        self.took: list[float] = []
        #: (round trip s, seconds since start, share of the machine's cores busy over the second before)
        self.samples: list[tuple[float, float, float | None]] = []
        self.bytes = 0
        self.errors = 0
        self.started = time.monotonic()
        self.task = asyncio.create_task(self._run(), name=f"scrape-{port}")

    async def _run(self) -> None:
        import aiohttp

        before = machine_busy()
        async with aiohttp.ClientSession() as session:
            while True:
                began = time.monotonic()
                now = machine_busy()
                busy = (
                    (now[0] - before[0]) / (now[1] - before[1])
                    if now is not None and before is not None and now[1] > before[1]
                    else None
                )
                before = now
                try:
                    async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                        body = await resp.read()
                    took = time.monotonic() - began
                    self.took.append(took)
                    self.samples.append((took, began - self.started, busy))
                    self.bytes = len(body)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    self.errors += 1
                await asyncio.sleep(max(0.0, self.period - (time.monotonic() - began)))

    def figures(self) -> dict[str, Any]:
        took = sorted(self.took)
        if not took:
            return {"n": 0, "errors": self.errors}

        def spread(values: list[float]) -> dict[str, Any]:
            v = sorted(values)
            if not v:
                return {"n": 0}
            return {
                "n": len(v),
                "p50_ms": round(v[len(v) // 2] * 1000, 1),
                "p99_ms": round(v[min(len(v) - 1, int(len(v) * 0.99))] * 1000, 1),
                "max_ms": round(v[-1] * 1000, 1),
            }

        worst = sorted(self.samples, reverse=True)[:5]
        return {
            "n": len(took),
            "max_ms": round(took[-1] * 1000, 1),
            "p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1000, 1),
            "p50_ms": round(took[len(took) // 2] * 1000, 1),
            "bytes": self.bytes,
            "errors": self.errors,
            "worst_ms_at_s_busy": [
                [round(t * 1000, 1), round(at, 1), None if b is None else round(b, 2)] for t, at, b in worst
            ],
            "machine_busy_below_90": spread([t for t, _, b in self.samples if b is not None and b < 0.9]),
            "machine_busy_90_or_more": spread([t for t, _, b in self.samples if b is not None and b >= 0.9]),
        }

    def stop(self) -> None:
        self.task.cancel()


class Worker:
    """The maintainer process; commands over its stdin, JSON replies on its stdout."""

    def __init__(self, proc: asyncio.subprocess.Process, identity: str, spawned: float) -> None:
        self.proc = proc
        self.identity = identity
        self.spawned = spawned
        self.ready: dict[str, Any] = {}
        self.lock = asyncio.Lock()
        self.scraper: Scraper | None = None

    @classmethod
    async def start(
        cls, kubeconfig: str, identity: str, log_dir: Path, lease: float, retry: float, *extra: str
    ) -> Worker:
        spawned = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), "--kubeconfig", kubeconfig, "--namespace", NS, "--identity", identity,
            "--lease-duration", str(lease), "--retry", str(retry), *extra,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=open(log_dir / f"{identity}.log", "ab"),  # noqa: SIM115, ASYNC230 - lives as long as the process
            cwd=ROOT, start_new_session=True, limit=2**28,
        )  # fmt: skip
        w = cls(proc, identity, spawned)
        assert proc.stdout is not None
        w.ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        if w.ready.get("metrics_port"):
            w.scraper = Scraper(int(w.ready["metrics_port"]), float(w.ready["scrape"]))
        return w

    def scrapes(self) -> dict[str, Any] | None:
        return self.scraper.figures() if self.scraper is not None else None

    async def ask(self, cmd: str, timeout: float = 120.0) -> Any:  # noqa: ASYNC109
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        async with self.lock:
            self.proc.stdin.write(cmd.encode() + b"\n")
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"maintainer {self.identity} exited")
        return json.loads(line)

    def sigkill(self) -> None:
        if self.scraper is not None:
            self.scraper.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        if self.scraper is not None:
            self.scraper.stop()
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.sigkill()
                await self.proc.wait()


def api_cost_args(a: argparse.Namespace) -> list[str]:
    """The API server's cost model (controller/apiserver/cost.py) as asked for: none by default."""
    if not a.api_cost:
        return []
    args = ["--api-cost"]
    if a.commit_latency_ms is not None:
        args += ["--commit-latency-ms", str(a.commit_latency_ms)]
    if a.commit_per_write_ms is not None:
        args += ["--commit-per-write-ms", str(a.commit_per_write_ms)]
    return args


class System:
    def __init__(self, a: argparse.Namespace, n: int) -> None:
        self.a = a
        self.n = n
        self.tmp = Path(tempfile.mkdtemp(prefix=f"cfm-bench-{n}-"))
        self.log_dir = Path(a.log_dir) / str(n)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = str(self.tmp / "kubeconfig")
        self.server: subprocess.Popen[str] | None = None
        self.url = ""
        self.captures: dict[str, subprocess.Popen[bytes]] = {}
        self.worker: Worker | None = None
        self.client: Client | None = None

    def start_server(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, str(COUNTING_SERVER), "--crds", str(ROOT / "crds"), "--kubeconfig",
             self.kubeconfig, "--history-size", str(max(50_000, 40 * self.n)), *api_cost_args(self.a)],
            stdout=subprocess.PIPE, stderr=open(self.log_dir / "apiserver.log", "ab"), text=True, cwd=ROOT,  # noqa: SIM115
        )  # fmt: skip
        assert self.server.stdout is not None
        self.url = self.server.stdout.readline().strip()
        self.server.stdout.readline()  # "kubeconfig: ..."
        self.client = Client(Config.load(self.kubeconfig))

    def start_captures(self) -> None:
        for i in range(self.a.captures):
            name = f"capture-{i}"
            self.captures[name] = subprocess.Popen(
                [sys.executable, "-m", "controller.capture", "--name", name, "--namespace", NS, "--kubeconfig",
                 self.kubeconfig, "--report-interval", str(self.a.report_interval),
                 "--renew-interval", str(self.a.renew_interval), "--log-level", "WARNING", "--test-hooks"],
                stdout=open(self.log_dir / f"{name}.log", "ab"), stderr=subprocess.STDOUT, cwd=ROOT,  # noqa: SIM115
                start_new_session=True,
            )  # fmt: skip

    async def served(self) -> dict[str, int]:
        """Requests the API server has served so far, by "verb resource" (bench/apiserver_counting.py)."""
        assert self.client is not None
        counts: dict[str, int] = await self.client.request("get", "GET", "/_bench/requests")
        return counts

    def cpu(self) -> dict[str, float]:
        out = {"driver": sum(resource.getrusage(resource.RUSAGE_SELF)[:2])}
        if self.server is not None:
            out["apiserver"] = cpu_seconds(self.server.pid)
        if self.worker is not None:
            out["maintainer"] = cpu_seconds(self.worker.proc.pid)
        each = {name: cpu_seconds(p.pid) for name, p in self.captures.items()}
        out["captures"] = sum(each.values())
        out.update(each)
        return out

    async def close(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
        for p in self.captures.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.captures.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if self.client is not None:
            await self.client.close()
        if self.server is not None:
            self.server.terminate()
            self.server.wait(timeout=30)


# -- resources --------------------------------------------------------------------------------------------


def changefeed() -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "Changefeed",
        "metadata": {"name": CF, "namespace": NS},
        # Balancing off until phase 4, so that phases 1-3 measure only what they start.
        "spec": {"scheduler": {"maxInFlightOperators": 10000, "basicBatchSize": 512, "balanceIntervalSeconds": 0}},
    }


def tables(n: int) -> list[dict[str, Any]]:
    count = math.ceil(n / MAX_PRESPLIT)
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "Table",
            "metadata": {"name": f"t{i}", "namespace": NS, "labels": {f"{GROUP}/changefeed": CF}},
            "spec": {"changefeed": CF, "tableID": 1000 + i, "preSplit": {"spans": size}},
        }
        for i, size in enumerate(sizes)
    ]


def operator(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "SpanOperator",
        "metadata": {"name": name, "namespace": NS, "labels": {f"{GROUP}/changefeed": CF}},
        "spec": {"changefeed": CF, "reason": "bench", **spec},
    }


async def create_all(client: Client, kind: Kind, bodies: list[dict[str, Any]], parallel: int = 16) -> None:
    sem = asyncio.Semaphore(parallel)

    async def one(body: dict[str, Any]) -> None:
        async with sem:
            try:
                await client.create(RESOURCES[kind], NS, body)
            except ApiError as exc:
                if not exc.already_exists:
                    raise

    await asyncio.gather(*(one(b) for b in bodies))


async def raw_pairs(client: Client, n: int, parallel: int, tag: str) -> float:
    """Create + status-patch pairs per second: ``n`` Span objects (as the maintainer makes them) each created
    and then given a status, ``parallel`` at a time, in namespace ``bench-raw`` (out of the maintainer's sight)."""
    res = RESOURCES[Kind.SPAN]
    queue = list(range(n))

    def body(i: int) -> dict[str, Any]:
        rng = KeyRange.of_table(9000 + i)
        span = Span(name=f"raw-{tag}-{i}", namespace=RAW_NS, changefeed="raw", table_id=9000 + i, key_range=rng,
                    start_ts=1, labels=conv.changefeed_labels("raw"))  # fmt: skip
        out = conv.to_resource(span)
        out.pop("status", None)
        return out

    async def one_worker() -> None:
        while queue:
            i = queue.pop()
            created = await client.create(res, RAW_NS, body(i))
            rec = conv.span_from_resource(created)
            rec = rec.evolve(state=SpanState.REPLICATING, capture="capture-0", dispatcher=f"{rec.name}-d",
                             checkpoint_ts=2)  # fmt: skip
            patch = conv.status_merge_patch(rec)
            patch["metadata"] = {"resourceVersion": created["metadata"]["resourceVersion"]}
            await client.patch(res, RAW_NS, rec.name, patch, sub="status")

    t0 = time.perf_counter()
    await asyncio.gather(*(one_worker() for _ in range(parallel)))
    return n / (time.perf_counter() - t0)


async def set_hold(system: System, value: str | None) -> None:
    assert system.client is not None
    for c in system.captures:
        patch = {"metadata": {"annotations": {HOLD_CLOSE: value}}}
        await system.client.patch(RESOURCES[Kind.CAPTURE], NS, c, patch)


def pick_ops(kind: str, spans: list[dict[str, Any]], k: int, captures: list[str], prefix: str) -> list[dict[str, Any]]:
    ready = sorted((s for s in spans if s["state"] == "Replicating"), key=lambda s: (s["table"], s["start"]))
    bodies: list[dict[str, Any]] = []
    if kind == "Merge":
        i = 0
        while i + 1 < len(ready) and len(bodies) < k:
            x, y = ready[i], ready[i + 1]
            if x["table"] == y["table"] and x["end"] == y["start"]:
                bodies.append(operator(f"{prefix}{len(bodies)}", {"type": "Merge", "spans": [x["name"], y["name"]]}))
                i += 2
            else:
                i += 1
        return bodies
    step = max(1, len(ready) // k)  # spread over the tables and captures
    for s in ready[::step][:k]:
        i = len(bodies)
        if kind == "Move":
            target = next(c for c in captures[i % len(captures) :] + captures if c != s["capture"])
            spec: dict[str, Any] = {"type": "Move", "spans": [s["name"]], "target": target}
        elif kind == "Split":
            spec = {"type": "Split", "spans": [s["name"]], "splitInto": 2}
        else:
            spec = {"type": "Remove", "spans": [s["name"]]}
        bodies.append(operator(f"{prefix}{i}", spec))
    return bodies


# -- waiting -------------------------------------------------------------------------------------------------


async def wait_for(
    worker: Worker,
    prefix: str,
    done: Any,
    timeout: float,  # noqa: ASYNC109
    label: str,
    every: float = 0.5,
) -> tuple[bool, float, dict[str, Any]]:
    start = time.monotonic()
    last_print = 0.0
    st: dict[str, Any] = {}
    while True:
        st = await worker.ask(f"state {prefix}")
        elapsed = time.monotonic() - start
        if done(st):
            return True, elapsed, st
        if elapsed - last_print >= 10:
            last_print = elapsed
            log(f"  {label} {elapsed:5.0f}s spans={st['spans']} in_flight={st['in_flight']} ops={st['ops']}")
        if elapsed > timeout:
            return False, elapsed, st
        await asyncio.sleep(every)


def all_replicating(n: int | None = None) -> Any:
    def check(st: dict[str, Any]) -> bool:
        total = st["span_total"]
        return (n is None or total == n) and total > 0 and st["spans"].get("Replicating", 0) == total

    return check


def ops_finished(k: int) -> Any:
    return lambda st: sum(v for p, v in st["ops"].items() if p in TERMINAL) >= k


def settled(k: int) -> Any:
    rep = all_replicating()
    return lambda st: ops_finished(k)(st) and st["in_flight"] == 0 and rep(st)


# -- phases -------------------------------------------------------------------------------------------------


async def profile_and_report(system: System, out: dict[str, Any], why: str) -> None:
    assert system.worker is not None
    log(f"{why}: profiling the maintainer for {system.a.profile_window:.0f}s")
    cpu0 = system.cpu()
    prof = await system.worker.ask(f"profile {system.a.profile_window}", timeout=system.a.profile_window + 120)
    cpu1 = system.cpu()
    share = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}
    out.setdefault("profiles", []).append({"why": why, "cpu_seconds_in_window": share, **prof})
    print(f"--- CPU seconds per process during the {system.a.profile_window:.0f}s window: {share}")
    print("--- maintainer profile, by own time (tottime) ---")
    print(prof["tottime"])
    print("--- maintainer profile, by cumulative time ---")
    print(prof["cumulative"])


async def phase_scale(system: System, out: dict[str, Any]) -> bool:
    worker, client, n = system.worker, system.client, system.n
    assert worker is not None
    assert client is not None
    before = await worker.ask("stats")
    served0 = await system.served()
    cpu0 = system.cpu()
    t0 = time.monotonic()
    await create_all(client, Kind.TABLE, tables(n))
    log(f"phase 1: applied {len(tables(n))} Table(s) with preSplit spans summing to {n}")
    window = system.a.profile_window if system.a.profile else 0
    timeout = system.a.timeout
    if window:
        await asyncio.sleep(min(system.a.profile_at, timeout / 2))
        await profile_and_report(system, out, "requested (--profile)")
    ok, _, st = await wait_for(worker, "", all_replicating(n), timeout - (time.monotonic() - t0), "scale-up")
    elapsed = time.monotonic() - t0
    served = delta(await system.served(), served0)
    served.pop("list /_bench", None)
    after = await worker.ask("stats")
    cpu1 = system.cpu()
    if system.a.raw_pairs:
        # The raw pair rates again, right after phase 1, so that the ratio is taken against the mean of a
        # measurement before and one after (on a shared machine the load moves between the two).
        assert system.client is not None
        for key, parallel in (("raw_pairs_per_s_1_client", 1), ("raw_pairs_per_s_16_clients", 16)):
            again = await raw_pairs(system.client, system.a.raw_pairs, parallel, f"after-{parallel}")
            out[f"{key}_before"] = out.get(key)
            out[f"{key}_after"] = round(again, 1)
            if out.get(key):
                out[key] = round((out[key] + again) / 2, 1)
    reqs = delta(after["requests"], before["requests"])
    timing = await worker.ask(f"decisions {before['decide_count']} {after['decide_count']}")
    p1: dict[str, Any] = {
        "complete": ok,
        "seconds": round(elapsed, 2),
        "spans_replicating": st["spans"].get("Replicating", 0),
        "spans_per_s": round(st["spans"].get("Replicating", 0) / elapsed, 1),
        "requests": reqs,
        "requests_total": sum(reqs.values()),
        "requests_by_resource": delta(after["by_resource"], before["by_resource"]),
        "status_writes_per_s": round(reqs.get("patch/status", 0) / elapsed, 1),
        "writes_per_s": round(sum(v for k, v in reqs.items() if k not in READ_VERBS) / elapsed, 1),
        "decisions": after["decisions"] - before["decisions"],
        "decide_seconds": round(after["decide_s"] - before["decide_s"], 2),
        "snapshot_seconds": round(after["snapshot_s"] - before["snapshot_s"], 2),
        "cpu_seconds": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0},
        "executor_errors": after["executor_errors"],
        "decision_ms": timing["decide"],
        "snapshot_ms": timing["snapshot"],
        "audit_ms": timing.get("audits"),
    }
    by_res = p1["requests_by_resource"]
    # Writes per placement: every maintainer write of the window (Lease renewals excluded) per span placed.
    writes = sum(c for k, c in by_res.items() if k.split()[0] in MAINTAINER_WRITE_VERBS and "leases" not in k)
    placed = max(1, p1["spans_replicating"])
    p1["writes_per_placement"] = round(writes / placed, 2)
    p1["requests_per_placement"] = round(sum(c for k, c in by_res.items() if "leases" not in k) / placed, 2)
    p1["writes_per_placement_by_resource"] = {
        k: round(c / placed, 3)
        for k, c in sorted(by_res.items())
        if k.split()[0] in MAINTAINER_WRITE_VERBS and "leases" not in k
    }
    # Every client's requests as the API server counted them (captures' included), per span placed.
    p1["api_requests_per_placement"] = round(sum(served.values()) / placed, 2)
    p1["api_requests_per_placement_by_verb"] = {k: round(c / placed, 3) for k, c in sorted(served.items())}
    # Every client's writes as the API server counted them (Leases and Events included), per second of the
    # window, against the 16-client raw write rate of the same run (a raw pair is 2 writes).
    api_writes = sum(c for k, c in served.items() if k.split()[0] in WRITE_VERBS)
    p1["api_writes_per_s"] = round(api_writes / elapsed, 1)
    pairs16 = out.get("raw_pairs_per_s_16_clients")
    p1["api_writes_ratio_to_raw_16_clients"] = round(p1["api_writes_per_s"] / (2 * pairs16), 3) if pairs16 else None
    raw = out["raw_status_patches_per_s"]
    p1["status_write_ratio_to_raw"] = round(p1["status_writes_per_s"] / raw, 3) if raw else None
    for key in ("raw_pairs_per_s_1_client", "raw_pairs_per_s_16_clients"):
        pairs = out.get(key)
        p1[f"spans_per_s_ratio_to_{key}"] = round(p1["spans_per_s"] / pairs, 3) if pairs else None
    out["scale"] = p1
    log(f"phase 1: {'done' if ok else 'NOT done'} in {elapsed:.1f}s: {st['spans']}")
    if not ok:
        await profile_and_report(system, out, f"scale-up of {n} spans not done within {timeout:.0f}s")
    return ok


async def phase_rest(system: System, out: dict[str, Any]) -> None:
    """N spans Replicating, nothing else happening: what standing still costs the API and each process."""
    worker, a = system.worker, system.a
    assert worker is not None
    assert system.client is not None
    # The scale-up's Add operators are garbage-collected operatorRetentionSeconds (300 s) after they finished,
    # a burst of deletes that is not "at rest": let them go at once, and wait until none is left.
    retention = {"spec": {"scheduler": {"operatorRetentionSeconds": 1}}}
    await system.client.patch(RESOURCES[Kind.CHANGEFEED], NS, CF, retention)
    ok, took, _ = await wait_for(worker, "", lambda st: st["operators"] == 0, a.timeout, "operator GC")
    log(f"phase 0: finished operators garbage-collected in {took:.0f}s ({'done' if ok else 'NOT done'})")
    retention["spec"]["scheduler"]["operatorRetentionSeconds"] = 300
    await system.client.patch(RESOURCES[Kind.CHANGEFEED], NS, CF, retention)
    log(f"phase 0: at rest: {a.rest_settle:.0f}s to settle, then {a.rest:.0f}s measured")
    await asyncio.sleep(a.rest_settle)
    served0, cpu0, s0, t0 = await system.served(), system.cpu(), await worker.ask("stats"), time.monotonic()
    lags: list[float] = []
    if a.profile_rest:  # the window profiled instead of polled for the checkpoint lag
        prof = await worker.ask(f"profile {a.rest}", timeout=a.rest + 120)
        out.setdefault("profiles", []).append({"why": "at rest (--profile-rest)", **prof})
        print("--- maintainer profile at rest, by own time (tottime) ---")
        print(prof["tottime"])
        print("--- maintainer profile at rest, by cumulative time ---")
        print(prof["cumulative"])
    while time.monotonic() - t0 < a.rest:
        cps = await worker.ask("checkpoint")
        if CF in cps:
            lags.append(cps[CF]["lag"])
        await asyncio.sleep(0.5)
    served1, cpu1, s1 = await system.served(), system.cpu(), await worker.ask("stats")
    dt = time.monotonic() - t0
    d = delta(served1, served0)
    d.pop("list /_bench", None)
    writes = {k: round(v / dt, 2) for k, v in sorted(d.items()) if k.split()[0] in WRITE_VERBS}
    total = sum(v for k, v in d.items() if k.split()[0] in WRITE_VERBS) / dt
    leases = sum(v for k, v in d.items() if k.split()[0] in WRITE_VERBS and k.split()[1] == "leases") / dt
    lags.sort()
    rest: dict[str, Any] = {
        "seconds": round(dt, 1),
        "requests_per_s": {k: round(v / dt, 2) for k, v in sorted(d.items())},
        "writes_per_s_by_resource": writes,
        "writes_per_s": round(total, 2),
        "lease_writes_per_s": round(leases, 2),
        "other_writes_per_s": round(total - leases, 2),
        # The bound: (captures x changefeeds) per report interval, plus Lease renewals.
        "bound_other_writes_per_s": round(a.captures * 1 / a.renew_interval, 2),
        "cpu_cores": {k: round((cpu1[k] - cpu0[k]) / dt, 3) for k in cpu0},
        "decisions_per_s": round((s1["decisions"] - s0["decisions"]) / dt, 2),
        "decide_share": round((s1["decide_s"] - s0["decide_s"]) / dt, 3),
        "checkpoint_lag_s": {
            "samples": len(lags),
            "mean": round(sum(lags) / len(lags), 2) if lags else None,
            "p50": round(lags[len(lags) // 2], 2) if lags else None,
            "max": round(lags[-1], 2) if lags else None,
            "two_report_intervals": 2 * a.renew_interval,
        },
    }
    timing = await worker.ask(f"decisions {s0['decide_count']} {s1['decide_count']}")
    rest["decision_ms"] = timing["decide"]
    rest["loop_stalls"] = await worker.ask(f"stalls {s0['stall_count']} {s1['stall_count']}")
    out["rest"] = rest
    log(f"phase 0: at rest {total:.2f} writes/s ({leases:.2f} Lease renewals): {writes}")
    log(f"phase 0: checkpoint lag {rest['checkpoint_lag_s']}")


async def phase_operators(system: System, out: dict[str, Any]) -> bool:
    worker, client = system.worker, system.client
    assert worker is not None
    assert client is not None
    k = system.a.ops
    s0 = await worker.ask("stats")
    cpu0 = system.cpu()
    await asyncio.sleep(system.a.idle)
    s1 = await worker.ask("stats")
    idle = delta(s1["requests"], s0["requests"])
    span_idle = s1["now"] - s0["now"]
    cpu1 = system.cpu()
    out["idle_requests_per_s"] = {v: round(c / span_idle, 2) for v, c in idle.items()}
    out["idle_requests_by_resource"] = delta(s1["by_resource"], s0["by_resource"])
    out["idle_cpu_share"] = {p: round((cpu1[p] - cpu0[p]) / span_idle, 2) for p in cpu0}
    out["idle_decisions_per_s"] = round((s1["decisions"] - s0["decisions"]) / span_idle, 2)
    out["idle_decide_share"] = round((s1["decide_s"] - s0["decide_s"]) / span_idle, 4)
    out["idle_seconds"] = round(span_idle, 1)
    out["idle_maintainer_cpu_share"] = round((cpu1["maintainer"] - cpu0["maintainer"]) / span_idle, 4)
    idle_timing = await worker.ask(f"decisions {s0['decide_count']} {s1['decide_count']}")
    out["idle_decision_ms"] = idle_timing["decide"]
    out["idle_audit_ms"] = idle_timing.get("audits")
    # A full audit's cost (the longest seen so far in this run), spread over the audit interval.
    every = await worker.ask(f"decisions 0 {s1['decide_count']}")
    out["audits_so_far_ms"] = every.get("audits")
    if system.a.single_moves:
        await phase_single_moves(system, out)
    per_op: dict[str, Any] = {}
    out["operators"] = per_op
    for kind in ("Move", "Split", "Merge", "Remove"):
        spans = await worker.ask("spans")
        prefix = f"bench-{kind.lower()}-"
        bodies = pick_ops(kind, spans, k, list(system.captures), prefix)
        if not bodies:
            per_op[kind] = {"skipped": "no suitable spans"}
            continue
        before = await worker.ask("stats")
        t0 = time.monotonic()
        await create_all(client, Kind.OPERATOR, bodies)
        ok1, t_fin, _ = await wait_for(worker, prefix, ops_finished(len(bodies)), system.a.timeout, kind)
        at_fin = await worker.ask("stats")
        ok2, _, st = await wait_for(worker, prefix, settled(len(bodies)), system.a.timeout, kind)
        t_set = time.monotonic() - t0
        at_set = await worker.ask("stats")
        kk = len(bodies)
        fin = delta(at_fin["requests"], before["requests"])
        sett = delta(at_set["requests"], before["requests"])
        per_op[kind] = {
            "k": kk,
            "finished": ok1,
            "settled": ok2,
            "seconds_to_finish": round(t_fin, 2),
            "seconds_to_settle": round(t_set, 2),
            "phases": st["ops"],
            "requests_per_op_to_finish": {v: round(c / kk, 2) for v, c in fin.items()},
            "requests_per_op_to_settle": {v: round(c / kk, 2) for v, c in sett.items()},
            "total_per_op_to_settle": round(sum(sett.values()) / kk, 2),
            "requests_by_resource_to_settle": delta(at_set["by_resource"], before["by_resource"]),
        }
        log(f"phase 2: {kk} {kind}s finished in {t_fin:.1f}s, settled in {t_set:.1f}s; {st['ops']}")
        if not (ok1 and ok2):
            return False
    return True


async def phase_single_moves(system: System, out: dict[str, Any]) -> None:
    """One user Move at a time (the rest idle): seconds from its create to Succeeded, and the decisions meanwhile."""
    worker, client = system.worker, system.client
    assert worker is not None
    assert client is not None
    times: list[float] = []
    s0 = await worker.ask("stats")
    for i in range(system.a.single_moves):
        spans = await worker.ask("spans")
        ready = sorted((s for s in spans if s["state"] == "Replicating"), key=lambda s: s["name"])
        if not ready:
            break
        span = ready[(i * 7919) % len(ready)]
        target = next(c for c in system.captures if c != span["capture"])
        name = f"bench-single-move-{i}"
        body = operator(name, {"type": "Move", "spans": [span["name"]], "target": target})
        t0 = time.monotonic()
        await create_all(client, Kind.OPERATOR, [body])
        while (await worker.ask(f"op {name}"))["phase"] not in TERMINAL:
            if time.monotonic() - t0 > system.a.timeout:
                break
            await asyncio.sleep(0.01)
        else:
            times.append(time.monotonic() - t0)
            await asyncio.sleep(0.5)
            continue
        break
        await asyncio.sleep(0.5)
    s1 = await worker.ask("stats")
    timing = await worker.ask(f"decisions {s0['decide_count']} {s1['decide_count']}")
    times.sort()
    out["single_move"] = {
        "k": len(times),
        "seconds": [round(t, 3) for t in times],
        "median_s": round(times[len(times) // 2], 3) if times else None,
        "decision_ms": timing["decide"],
    }
    log(f"single Moves: {[round(t, 2) for t in times]} s")


async def phase_failover(system: System, out: dict[str, Any]) -> None:
    worker, client = system.worker, system.client
    assert worker is not None
    assert client is not None
    k = system.a.inflight
    fo: dict[str, Any] = {"k": k, "kill": "SIGKILL of the maintainer process (no Lease release)"}
    out["failover"] = fo
    await set_hold(system, "*")
    await asyncio.sleep(1.5)  # the captures re-read their hooks every loop (0.2 s)
    spans = await worker.ask("spans")
    prefix = "bench-held-"
    bodies = pick_ops("Move", spans, k, list(system.captures), prefix)
    fo["k"] = k = len(bodies)
    await create_all(client, Kind.OPERATOR, bodies)

    def held(st: dict[str, Any]) -> bool:
        return st["ops"].get("Running/RemoveOrigin", 0) >= k

    ok, t_held, st = await wait_for(worker, prefix, held, system.a.timeout, "hold")
    fo["seconds_to_hold"] = round(t_held, 2)
    fo["held"] = st["ops"]
    if not ok:
        log(f"phase 3: only {st['ops']} held in RemoveOrigin; killing anyway")
    old = await worker.ask("stats")
    out["maintainer_rss_kib_before_kill"] = old["rss"]
    out["maintainer_cpu_s_before_kill"] = old.get("cpu_s")
    out["loop_stalls_first_maintainer"] = await worker.ask("stalls 0")
    out["scrapes_first_maintainer"] = worker.scrapes()
    out["scrape_work_first_maintainer"] = old.get("scrape_work_ms")
    out["scrape_cpu_first_maintainer"] = old.get("scrape_cpu_ms")
    if system.a.stall_stacks:
        out["stall_stacks_first_maintainer"] = await worker.ask("stall_stacks")
    out["gc_full_first_maintainer"] = old.get("gc_full")
    out["tenure_first_maintainer"] = old.get("tenure")
    out["heap_reserve_first_maintainer"] = old.get("heap_reserve")
    out["pacer_yields_first_maintainer"] = old.get("pacer_yields")
    out["audits_first_maintainer_ms"] = (await worker.ask("decisions 0")).get("audits")
    out["gc_leak_first_maintainer"] = await worker.ask("gc_leak", timeout=120)
    t_kill = time.monotonic()
    worker.sigkill()
    await worker.proc.wait()
    log(f"phase 3: SIGKILLed {worker.identity} with {st['ops']}")
    new = await Worker.start(
        system.kubeconfig, "maintainer-2", system.log_dir, system.a.lease, system.a.retry, *worker_flags(system.a)
    )
    system.worker = new

    def booted(st: dict[str, Any]) -> bool:
        return bool(st["bootstrapped"])

    ok, _, _ = await wait_for(new, prefix, booted, system.a.timeout, "bootstrap")
    s = await new.ask("stats")
    boot_reqs = s.get("bootstrap_requests", {})
    by_res = s.get("bootstrap_by_resource", {})
    kinds = len(RESOURCES) + 1  # the six kinds and Leases
    per_object_gets = {r: c for r, c in by_res.items() if r.startswith("get ") and "/<name>" in r}
    non_lease_gets = {r: c for r, c in per_object_gets.items() if not r.startswith("get leases")}
    lists = {r: c for r, c in by_res.items() if r.startswith("list ")}
    watches = {r: c for r, c in by_res.items() if r.startswith("watch ")}
    goal = len(lists) == kinds and all(c == 1 for c in lists.values()) and len(watches) == kinds
    goal = goal and all(c == 1 for c in watches.values()) and not non_lease_gets
    fo.update(
        {
            "bootstrapped": ok,
            "process_start_to_maintainer_start_s": round(s["t_start"] - s["t_process"], 3),
            "lease_wait_s": round(s.get("t_lease_acquired", math.nan) - s["t_start"], 3),
            "bootstrap_seconds": round(s["bootstrap_seconds"].get(CF, math.nan), 3),
            "kill_to_bootstrapped_s": round(s.get("t_bootstrapped", math.nan) - t_kill, 3),
            "bootstrap_report": s.get("bootstrap_report", ""),
            "bootstrap_requests": boot_reqs,
            "bootstrap_requests_by_resource": by_res,
            "goal_one_list_one_watch_per_kind_no_object_get": goal,
            "lease_gets_during_bootstrap": sum(c for r, c in per_object_gets.items() if r.startswith("get leases")),
        }
    )
    log(f"phase 3: bootstrapped: lease wait {fo['lease_wait_s']}s, bootstrap {fo['bootstrap_seconds']}s; {boot_reqs}")
    t_rel = time.monotonic()
    await set_hold(system, None)
    ok, t_fin, st = await wait_for(new, prefix, ops_finished(k), system.a.timeout, "release")
    fo["finished"] = ok
    fo["seconds_release_to_all_finished"] = round(t_fin, 2)
    fo["seconds_kill_to_all_finished"] = round(time.monotonic() - t_kill, 2)
    fo["phases_after"] = st["ops"]
    log(f"phase 3: {st['ops']} {t_fin:.1f}s after releasing the hooks (released {t_rel - t_kill:.1f}s after kill)")
    end = await new.ask("stats")
    out["new_maintainer_rss_kib"] = end["rss"]
    out["scrape_work_new_maintainer"] = end.get("scrape_work_ms")
    out["scrape_cpu_new_maintainer"] = end.get("scrape_cpu_ms")
    out["loop_stalls_new_maintainer"] = await new.ask("stalls 0")
    out["scrapes_new_maintainer"] = new.scrapes()
    if system.a.stall_stacks:
        out["stall_stacks_new_maintainer"] = await new.ask("stall_stacks")
    out["gc_full_new_maintainer"] = end.get("gc_full")
    out["tenure_new_maintainer"] = end.get("tenure")
    out["heap_reserve_new_maintainer"] = end.get("heap_reserve")
    out["pacer_yields_new_maintainer"] = end.get("pacer_yields")
    out["new_maintainer_requests_total"] = end["requests"]


async def phase_drain_balance(system: System, out: dict[str, Any]) -> None:
    """Drain the capture holding the most spans, then undrain it and let the balance scheduler even out."""
    worker, client = system.worker, system.client
    assert worker is not None
    assert client is not None
    caps = list(system.captures)
    db: dict[str, Any] = {}
    out["drain_balance"] = db

    async def per_capture() -> dict[str, int]:
        spans = await worker.ask("spans")
        counts = dict.fromkeys(caps, 0)
        for sp in spans:
            if sp["state"] == "Replicating" and sp["capture"] in counts:
                counts[sp["capture"]] += 1
        return counts

    async def until(cond: Any, label: str) -> tuple[bool, float, dict[str, int]]:
        t0 = time.monotonic()
        while True:
            counts = await per_capture()
            st = await worker.ask("state ")
            if cond(counts, st):
                return True, time.monotonic() - t0, counts
            if time.monotonic() - t0 > system.a.timeout:
                log(f"phase 4: {label} not reached: {counts}")
                return False, time.monotonic() - t0, counts
            await asyncio.sleep(0.5)

    before = await per_capture()
    victim = max(caps, key=lambda c: before[c])
    db["before"] = before
    db["drained_capture"] = victim
    db["spans_on_it"] = before[victim]
    stats0 = await worker.ask("stats")
    await client.patch(RESOURCES[Kind.CAPTURE], NS, victim, {"spec": {"draining": True}})
    ok, secs, counts = await until(
        lambda c, st: c[victim] == 0 and st["in_flight"] == 0 and all_replicating()(st), "drained"
    )
    stats1 = await worker.ask("stats")
    db.update({"drained": ok, "seconds_to_drain": round(secs, 2), "after_drain": counts})
    db["requests_per_span_drained"] = {
        v: round(c / max(1, before[victim]), 2) for v, c in delta(stats1["requests"], stats0["requests"]).items()
    }
    log(f"phase 4: drained {victim} ({before[victim]} spans) in {secs:.1f}s: {counts}")
    await client.patch(RESOURCES[Kind.CAPTURE], NS, victim, {"spec": {"draining": False}})
    knobs = {"balanceIntervalSeconds": 1, "drainCooldownSeconds": 0}
    await client.patch(RESOURCES[Kind.CHANGEFEED], NS, CF, {"spec": {"scheduler": knobs}})
    total = sum(counts.values())
    floor = total // len(caps)
    ok, secs, counts = await until(
        lambda c, st: min(c.values()) >= floor and max(c.values()) - min(c.values()) <= 1 and st["in_flight"] == 0,
        "balanced",
    )
    db.update({"balanced": ok, "seconds_to_balance": round(secs, 2), "after_balance": counts})
    log(f"phase 4: balanced in {secs:.1f}s (balance interval 1 s): {counts}")


async def run_size(a: argparse.Namespace, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "spans": n,
        "api_cost": api_cost_args(a) or "off",
        "captures": a.captures,
        "ops_k": a.ops,
        "inflight_k": a.inflight,
        "renew_interval": a.renew_interval,
        "maintainer_lease": [a.lease, a.retry],
    }
    system = System(a, n)
    try:
        system.start_server()
        log(f"N={n}: embedded API at {system.url}; logs in {system.log_dir}")
        raw = await api_bench.run(system.url, a.raw_writes, 2)
        out["raw_status_patches_per_s"] = round(raw["status_patches_per_s"], 1)
        log(f"raw sequential status writes from one client: {raw['status_patches_per_s']:.0f}/s")
        assert system.client is not None
        for name in (NS, RAW_NS):
            ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            with contextlib.suppress(ApiError):
                await system.client.request("create", "POST", "/api/v1/namespaces", body=ns)
        if a.raw_pairs:
            out["raw_pairs_per_s_1_client"] = round(await raw_pairs(system.client, a.raw_pairs, 1, "seq"), 1)
            out["raw_pairs_per_s_16_clients"] = round(await raw_pairs(system.client, a.raw_pairs, 16, "par"), 1)
            log(f"raw create + status-patch pairs/s: {out['raw_pairs_per_s_1_client']} (1 client), "
                f"{out['raw_pairs_per_s_16_clients']} (16 concurrent)")  # fmt: skip
        if a.raw_only:
            return out
        await system.client.create(RESOURCES[Kind.CHANGEFEED], NS, changefeed())
        system.start_captures()
        while len((await system.client.list(RESOURCES[Kind.CAPTURE], NS))[0]) < a.captures:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        system.worker = await Worker.start(
            system.kubeconfig, "maintainer-1", system.log_dir, a.lease, a.retry, *worker_flags(a)
        )
        ok, _, _ = await wait_for(system.worker, "", lambda st: st["bootstrapped"], 60, "first bootstrap")
        if not ok:
            raise RuntimeError("the first maintainer did not bootstrap within 60 s")
        done = await phase_scale(system, out)
        if done and a.rest > 0:
            await phase_rest(system, out)
        if done and a.ops > 0:
            done = await phase_operators(system, out)
        stats = await system.worker.ask("stats")
        out["maintainer_rss_kib"] = stats["rss"]
        out["loop_stalls_first_maintainer"] = await system.worker.ask("stalls 0")
        out["scrapes_first_maintainer"] = system.worker.scrapes()
        if a.stall_stacks:
            out["stall_stacks_first_maintainer"] = await system.worker.ask("stall_stacks")
        out["tenure_first_maintainer"] = stats.get("tenure")
        out["heap_reserve_first_maintainer"] = stats.get("heap_reserve")
        out["pacer_yields_first_maintainer"] = stats.get("pacer_yields")
        out["gc_full_first_maintainer"] = stats.get("gc_full")
        out["maintainer_requests_total"] = stats["requests"]
        if done and a.inflight:
            await phase_failover(system, out)
        if done and a.drain:
            await phase_drain_balance(system, out)
        elif not done:
            out["skipped"] = "phases after the first incomplete one"
        # Last, for it thaws the maintainer's heap (and holds its loop for a full pass).
        leak = "gc_leak_new_maintainer" if "tenure_new_maintainer" in out else "gc_leak_first_maintainer"
        if done and leak not in out:
            out[leak] = await system.worker.ask("gc_leak", timeout=120)
    except Exception as exc:  # print partial figures rather than nothing
        out["error"] = repr(exc)
        log(f"N={n}: stopped by {exc!r}")
    finally:
        await system.close()
    return out


# -- printing -----------------------------------------------------------------------------------------------


def fmt_scrapes(d: dict[str, Any] | None) -> str:
    if not d or not d.get("n"):
        return "-"
    return f"{d['n']}, {d['p50_ms']} / {d['p99_ms']} / {d['max_ms']}, {d['bytes']}"


def fmt_spread(d: dict[str, Any] | None) -> str:
    if not d or not d.get("n"):
        return "-"
    return f"{d['n']}, {d['p99_ms']} / {d['max_ms']}"


def fmt_reqs(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(d.items())) or "-"


def fmt_ms(d: dict[str, Any] | None) -> str:
    if not d or not d.get("n"):
        return "-"
    return f"{d['p50_ms']:g} / {d['p99_ms']:g} (n={d['n']}, max {d['max_ms']:g})"


def rows(r: dict[str, Any], base: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    sc = r.get("scale", {})
    fo = r.get("failover", {})
    rest = r.get("rest", {})
    lag = rest.get("checkpoint_lag_s", {})
    sm = r.get("single_move", {})
    n = r.get("spans", 0) or 1
    base_move = (base or {}).get("single_move", {}).get("median_s")
    move_ratio = f" ({sm['median_s'] / base_move:.2f}x N={base['spans']})" if base_move and sm.get("median_s") else ""
    out = [
        ("0 at rest: API writes/s, all clients", f"{rest.get('writes_per_s', '-')}"),
        ("0 at rest: writes/s by verb and resource", fmt_reqs(rest.get("writes_per_s_by_resource", {}))),
        ("0 at rest: writes/s other than Leases; bound",
         f"{rest.get('other_writes_per_s', '-')}; {rest.get('bound_other_writes_per_s', '-')} "
         f"(captures x changefeeds / {r.get('renew_interval', '-')} s)"),
        ("0 at rest: CPU cores per process", fmt_reqs(rest.get("cpu_cores", {}))),
        ("0 at rest: decision ms p50 / p99", fmt_ms(rest.get("decision_ms"))),
        ("0 at rest: event-loop stall ms max / p99 (--probe)",
         f"{rest.get('loop_stalls', {}).get('max_ms', '-')} / {rest.get('loop_stalls', {}).get('p99_ms', '-')}"),
        ("whole run: event-loop stall ms max (first | new maintainer)",
         f"{r.get('loop_stalls_first_maintainer', {}).get('max_ms', '-')} | "
         f"{r.get('loop_stalls_new_maintainer', {}).get('max_ms', '-')}"),
        ("whole run: longest single turn ms (first | new; --probe busy)",
         f"{r.get('loop_stalls_first_maintainer', {}).get('longest_turn_ms_so_far', '-')} | "
         f"{r.get('loop_stalls_new_maintainer', {}).get('longest_turn_ms_so_far', '-')}"),
        ("whole run: ... of it the loop thread's CPU, ms (first | new)",
         f"{r.get('loop_stalls_first_maintainer', {}).get('longest_turn_cpu_ms', '-')} | "
         f"{r.get('loop_stalls_new_maintainer', {}).get('longest_turn_cpu_ms', '-')}"),
        ("whole run: /metrics scrapes, n, p50 / p99 / max ms, bytes (first | new)",
         " | ".join(fmt_scrapes(r.get(k)) for k in ("scrapes_first_maintainer", "scrapes_new_maintainer"))),
        ("... when the machine's cores were < 90 % busy: n, p99 / max ms (first | new)",
         " | ".join(fmt_spread((r.get(k) or {}).get("machine_busy_below_90"))
                    for k in ("scrapes_first_maintainer", "scrapes_new_maintainer"))),
        ("... when they were >= 90 % busy: n, p99 / max ms (first | new)",
         " | ".join(fmt_spread((r.get(k) or {}).get("machine_busy_90_or_more"))
                    for k in ("scrapes_first_maintainer", "scrapes_new_maintainer"))),
        ("... the worst five: ms at s, machine busy (first)",
         " ".join(f"{w[0]}@{w[1]}({w[2]})"
                  for w in (r.get("scrapes_first_maintainer") or {}).get("worst_ms_at_s_busy", [])) or "-"),
        ("... the scrape's own turn in the loop (collect and encode), p99 / max ms (first | new)",
         " | ".join(f"{(r.get(k) or {}).get('p99_ms', '-')} / {(r.get(k) or {}).get('max_ms', '-')}"
                    for k in ("scrape_work_first_maintainer", "scrape_work_new_maintainer"))),
        ("... of that the loop thread's CPU, p99 / max ms (first | new)",
         " | ".join(f"{(r.get(k) or {}).get('p99_ms', '-')} / {(r.get(k) or {}).get('max_ms', '-')}"
                    for k in ("scrape_cpu_first_maintainer", "scrape_cpu_new_maintainer"))),
        ("whole run: generation-2 passes (tenure steps too), longest ms (first | new)",
         " | ".join(f"{(r.get(k) or {}).get('n', '-')}, {round((r.get(k) or {}).get('max_s', 0) * 1000, 1)}"
                    for k in ("gc_full_first_maintainer", "gc_full_new_maintainer"))),
        ("whole run: tenure steps, longest ms (first | new maintainer)",
         " | ".join(f"{(r.get(k) or {}).get('steps', '-')}, {round((r.get(k) or {}).get('longest_s', 0) * 1000, 1)}"
                    for k in ("tenure_first_maintainer", "tenure_new_maintainer"))),
        ("whole run: heap reserve refills, MiB written, s, top MiB at the end, longest mallinfo2 ms (first | new)",
         " | ".join(f"{(r.get(k) or {}).get('refills', '-')}, {(r.get(k) or {}).get('written_mib', '-')}, "
                    f"{(r.get(k) or {}).get('refill_s', '-')}, {(r.get(k) or {}).get('top_mib', '-')}, "
                    f"{(r.get(k) or {}).get('longest_check_ms', '-')}{' OFF' if (r.get(k) or {}).get('off') else ''}"
                    for k in ("heap_reserve_first_maintainer", "heap_reserve_new_maintainer"))),
        ("whole run: paced units that waited for a later turn (first | new maintainer)",
         f"{r.get('pacer_yields_first_maintainer', '-')} | {r.get('pacer_yields_new_maintainer', '-')}"),
        ("end: frozen objects; cycles that died frozen (gc_leak)",
         " | ".join(f"{(r.get(k) or {}).get('frozen', '-')}; {(r.get(k) or {}).get('cycles_found', '-')}"
                    for k in ("gc_leak_first_maintainer", "gc_leak_new_maintainer"))),
        ("0 at rest: decisions/s, share of a core in decide",
         f"{rest.get('decisions_per_s', '-')}, {rest.get('decide_share', '-')}"),
        ("0 at rest: checkpoint lag s mean / p50 / max",
         f"{lag.get('mean', '-')} / {lag.get('p50', '-')} / {lag.get('max', '-')} "
         f"(2 intervals: {lag.get('two_report_intervals', '-')})"),
        ("raw status writes/s (1 client)", f"{r.get('raw_status_patches_per_s', '-')}"),
        ("raw create+status-patch pairs/s (1 client)",
         f"{r.get('raw_pairs_per_s_1_client', '-')} ({r.get('raw_pairs_per_s_1_client_before', '-')} before, "
         f"{r.get('raw_pairs_per_s_1_client_after', '-')} after phase 1)"),
        ("raw create+status-patch pairs/s (16 clients)",
         f"{r.get('raw_pairs_per_s_16_clients', '-')} ({r.get('raw_pairs_per_s_16_clients_before', '-')} before, "
         f"{r.get('raw_pairs_per_s_16_clients_after', '-')} after phase 1)"),
        ("1 scale-up: seconds to all Replicating",
         f"{sc.get('seconds', '-')}{'' if sc.get('complete') else ' (INCOMPLETE)'}"),
        ("1 scale-up: spans/s", f"{sc.get('spans_per_s', '-')}"),
        ("1 ... ratio to raw pairs/s (1 client | 16)",
         f"{sc.get('spans_per_s_ratio_to_raw_pairs_per_s_1_client', '-')} | "
         f"{sc.get('spans_per_s_ratio_to_raw_pairs_per_s_16_clients', '-')}"),
        ("1 API writes/s, all clients; ratio to raw 16-client writes/s",
         f"{sc.get('api_writes_per_s', '-')}; {sc.get('api_writes_ratio_to_raw_16_clients', '-')}"),
        ("1 maintainer writes per placement", f"{sc.get('writes_per_placement', '-')}"),
        ("1 ... by resource", fmt_reqs(sc.get("writes_per_placement_by_resource", {}))),
        ("1 maintainer requests per placement", f"{sc.get('requests_per_placement', '-')}"),
        ("1 API requests per placement, all clients", f"{sc.get('api_requests_per_placement', '-')}"),
        ("1 ... by verb and resource", fmt_reqs(sc.get("api_requests_per_placement_by_verb", {}))),
        ("1 decision ms p50 / p99 (scale-up)", fmt_ms(sc.get("decision_ms"))),
        ("1 snapshot ms p50 / p99 (scale-up)", fmt_ms(sc.get("snapshot_ms"))),
        ("1 scale-up: requests by verb", fmt_reqs(sc.get("requests", {}))),
        ("1 scale-up: maintainer status writes/s", f"{sc.get('status_writes_per_s', '-')}"),
        ("5 ... as a ratio of the raw rate", f"{sc.get('status_write_ratio_to_raw', '-')}"),
        ("1 scale-up: decisions / decide s / snapshot s",
         f"{sc.get('decisions', '-')} / {sc.get('decide_seconds', '-')} / {sc.get('snapshot_seconds', '-')}"),
        ("1 scale-up: CPU s per process", fmt_reqs(sc.get("cpu_seconds", {}))),
        ("2 idle requests/s", fmt_reqs(r.get("idle_requests_per_s", {}))),
        ("2 idle CPU (cores) per process", fmt_reqs(r.get("idle_cpu_share", {}))),
        ("2 idle decisions/s, share of a core in decide",
         f"{r.get('idle_decisions_per_s', '-')}, {r.get('idle_decide_share', '-')}"),
        ("2 idle maintainer CPU, share of a core", f"{r.get('idle_maintainer_cpu_share', '-')}"),
        ("2 idle decision ms p50 / p99", fmt_ms(r.get("idle_decision_ms"))),
        ("2 full audits so far: ms p50 / p99 (n)", fmt_ms(r.get("audits_so_far_ms"))),
        ("whole run: first maintainer's full audits ms p50 / p99 (n)", fmt_ms(r.get("audits_first_maintainer_ms"))),
        ("2 single user Move s (median)", f"{sm.get('median_s', '-')}{move_ratio}"),
        ("2 single Move: decision ms p50 / p99", fmt_ms(sm.get("decision_ms"))),
    ]  # fmt: skip
    for kind, o in r.get("operators", {}).items():
        if "skipped" in o:
            out.append((f"2 {kind}", o["skipped"]))
            continue
        out.append(
            (f"2 {kind} x{o['k']}: s to finish / settle", f"{o['seconds_to_finish']} / {o['seconds_to_settle']}")
        )
        out.append((f"2 {kind}: requests per op (to settle)", fmt_reqs(o["requests_per_op_to_settle"])))
    if fo:
        out += [
            (f"3 failover: in flight at kill (of {fo.get('k')})", fmt_reqs(fo.get("held", {}))),
            ("3 new maintainer: process start -> start s", f"{fo.get('process_start_to_maintainer_start_s', '-')}"),
            ("3 new maintainer: Lease wait s", f"{fo.get('lease_wait_s', '-')}"),
            ("3 new maintainer: bootstrap_seconds", f"{fo.get('bootstrap_seconds', '-')}"),
            ("3 kill -> bootstrapped s", f"{fo.get('kill_to_bootstrapped_s', '-')}"),
            ("3 bootstrap requests by verb", fmt_reqs(fo.get("bootstrap_requests", {}))),
            ("3 goal 1 LIST + 1 WATCH per kind, no GET", str(fo.get("goal_one_list_one_watch_per_kind_no_object_get"))),
            ("3 Lease GETs during bootstrap", f"{fo.get('lease_gets_during_bootstrap', '-')}"),
            ("3 release -> all K finished s", f"{fo.get('seconds_release_to_all_finished', '-')}"),
            ("3 operators after", fmt_reqs(fo.get("phases_after", {}))),
        ]
    db = r.get("drain_balance", {})
    if db:
        out += [
            ("4 drain the fullest capture: spans, s", f"{db.get('spans_on_it')}, {db.get('seconds_to_drain')}"),
            ("4 drain: requests per span moved", fmt_reqs(db.get("requests_per_span_drained", {}))),
            ("4 undrain -> balanced s (interval 1 s)", f"{db.get('seconds_to_balance')} {db.get('after_balance')}"),
        ]
    # The first maintainer's peak through placing the spans and resting, read before phase 3: phase 3 asks it for
    # every span (the ``spans`` command builds a 15 MB reply at 100,000 spans in its process), which is the bench's
    # own memory, shown on the row after.
    rss = r.get("maintainer_rss_kib") or {}
    out.append(("4 maintainer peak RSS MiB (VmHWM)", f"{rss.get('VmHWM', 0) / 1024:.0f}" if rss else "-"))
    out.append(("4 maintainer peak RSS KiB per span", f"{rss.get('VmHWM', 0) / n:.1f}" if rss else "-"))
    kill = r.get("maintainer_rss_kib_before_kill") or {}
    out.append(("4 ... at the kill, after the bench's own spans reply (KiB per span)",
                f"{kill.get('VmHWM', 0) / n:.1f}" if kill else "-"))  # fmt: skip
    out.append(("4 maintainer CPU s until the kill", f"{r.get('maintainer_cpu_s_before_kill', '-')}"))
    rss2 = r.get("new_maintainer_rss_kib") or {}
    out.append(("4 new maintainer peak RSS MiB", f"{rss2.get('VmHWM', 0) / 1024:.0f}" if rss2 else "-"))
    out.append(("4 new maintainer peak RSS KiB per span", f"{rss2.get('VmHWM', 0) / n:.1f}" if rss2 else "-"))
    if "error" in r or "skipped" in r:
        out.append(("note", r.get("error") or r.get("skipped", "")))
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    base = next((r for r in results if r.get("spans") == 1000 and r.get("single_move")), None)
    cols = [dict(rows(r, base)) for r in results]
    labels = [label for label, _ in rows(results[0], base)]
    for c in cols[1:]:
        labels += [k for k in c if k not in labels]
    width = max(len(x) for x in labels)
    colw = [max(12, *(len(c.get(x, "")) for x in labels)) for c in cols]
    colw = [min(w, 70) for w in colw]
    print()
    print(" " * width + " | " + " | ".join(f"N={r['spans']}".ljust(w) for r, w in zip(results, colw, strict=True)))
    print("-" * (width + sum(w + 3 for w in colw)))
    for x in labels:
        print(x.ljust(width) + " | " + " | ".join(c.get(x, "-").ljust(w) for c, w in zip(cols, colw, strict=True)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spans", default="1000,10000", help="comma-separated span counts (default 1000,10000)")
    p.add_argument("--inflight", type=int, default=1000, help="Moves held in flight at the SIGKILL (default 1000)")
    p.add_argument("--ops", type=int, default=100, help="operators of each type in phase 2 (default 100)")
    p.add_argument("--captures", type=int, default=3)
    p.add_argument("--lease", type=float, help="maintainer Lease duration, s (default 3; 15 with --rest-only)")
    p.add_argument(
        "--retry", type=float, help="maintainer Lease retry (renewal) period, s (default 0.5; 2 with --rest-only)"
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=2.0,
        help="captures' --report-interval (re-sends, traffic checks), s (default 2)",
    )
    p.add_argument(
        "--renew-interval",
        type=float,
        default=2.0,
        help="captures' Lease renew interval, which carries their progress reports, s (default 2)",
    )
    p.add_argument("--rest", type=float, default=30.0, help="seconds measured at rest after phase 1 (0: skip)")
    p.add_argument("--rest-settle", type=float, default=15.0, help="seconds after phase 1 before measuring at rest")
    p.add_argument("--rest-only", action="store_true", help="phases 1 and 0 only (no operators, failover, drain)")
    p.add_argument("--raw-pairs", type=int, default=2000, help="create + status-patch pairs for the raw pair rates")
    p.add_argument("--single-moves", type=int, default=5, help="user Moves timed one at a time (default 5)")
    p.add_argument("--raw-writes", type=int, default=3000, help="sequential status writes for the raw rate")
    p.add_argument("--idle", type=float, default=20.0, help="seconds of idle baseline (requests, CPU, decisions)")
    p.add_argument(
        "--timeout", type=float, default=0.0, help="per-phase limit, s; then profile and stop (default: max(600, N/20))"
    )
    p.add_argument("--profile", action="store_true", help="also profile a window early in phase 1")
    p.add_argument("--profile-at", type=float, default=10.0, help="seconds after the Table apply (--profile)")
    p.add_argument("--profile-window", type=float, default=20.0)
    p.add_argument("--profile-rest", action="store_true", help="profile the maintainer over phase 0's window")
    p.add_argument(
        "--api-cost",
        action="store_true",
        help="the API server's cost model: writes wait for batched commits, calibrated to a real server",
    )
    p.add_argument("--raw-only", action="store_true", help="only the raw rates (to calibrate --api-cost)")
    p.add_argument("--commit-latency-ms", type=float, help="with --api-cost: ms a commit lasts")
    p.add_argument("--commit-per-write-ms", type=float, help="with --api-cost: ms each write adds to its commit")
    p.add_argument(
        "--gc-tenure",
        type=float,
        default=tenure.PERIOD,
        help=f"the maintainer's --gc-tenure (0: off; default {tenure.PERIOD:g}, as the maintainer's)",
    )
    p.add_argument(
        "--heap-reserve",
        type=int,
        default=0,
        help=f"the maintainer's --heap-reserve, MiB (0: off, the default, as the maintainer's; {heap.CEILING // heap.MiB}: "
        "the opt-in's usual ceiling)",
    )
    p.add_argument(
        "--audit-interval", type=float, default=300.0, help="the maintainer's full audits, s apart (default 300)"
    )
    p.add_argument(
        "--probe",
        choices=("busy", "heartbeat"),
        default="busy",
        help="how the maintainer's loop stalls are measured: busy (default: each turn's callbacks, timed; no wake-up "
        "of its own) or heartbeat (a 10 ms callback's lateness: 100 wake-ups a second)",
    )
    p.add_argument(
        "--stall-stacks",
        action="store_true",
        help="sample the maintainer's stack while its loop stalls (> 50 ms); also count each loop callback of 20 ms "
        "or more (by task, with its CPU and collection time), each turn of 50 ms or more (its time by callback "
        "kind), each informer write-through or event of 10 ms or more, and the loop's stack under a profiling "
        "timer while a callback runs long (in --json, stall_stacks_*)",
    )
    p.add_argument(
        "--scrape",
        type=float,
        default=0.0,
        help="serve the maintainer's /metrics and scrape it every this many seconds throughout, as Prometheus would "
        "(0: no metrics endpoint, the default)",
    )
    p.add_argument("--json", help="write all figures to this file")
    p.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "cfm-bench-logs"))
    p.add_argument("--no-drain", dest="drain", action="store_false", help="skip phase 4 (drain, then balance)")
    p.add_argument("--quick", action="store_true", help="300 spans, 20 ops per type, 50 in flight")
    a = p.parse_args(argv)
    if a.quick:
        a.spans, a.ops, a.inflight, a.raw_writes, a.idle, a.timeout = "300", 20, 50, 1000, 2.0, 120.0
        a.rest, a.rest_settle = 10.0, 5.0
        a.raw_pairs, a.single_moves = 300, 2
    if a.rest_only:
        a.ops, a.inflight, a.drain = 0, 0, False
    # Short maintainer Lease timings make phase 3's failover fast; without it, client-go's defaults (15 s /
    # 2 s), so that phase 0 sees the maintainer's Lease renewals at their production rate.
    a.lease = a.lease or (15.0 if a.rest_only else 3.0)
    a.retry = a.retry or (2.0 if a.rest_only else 0.5)
    sizes = [int(x) for x in a.spans.split(",") if x.strip()]
    results = []
    started = time.monotonic()
    fixed_timeout = a.timeout
    for n in sizes:
        a.timeout = fixed_timeout or max(600.0, n / 20)
        r = asyncio.run(run_size(a, n))
        results.append(r)
        if a.json:  # after every size, so a later stall still leaves the earlier figures
            Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2, default=str))
    print_table(results)
    at_rest = [(r["spans"], r["rest"]["writes_per_s"]) for r in results if r.get("rest")]
    if len(at_rest) >= 2:
        (n0, w0), (n1, w1) = at_rest[0], at_rest[-1]
        print(f"\nat rest: {w1} writes/s at {n1} spans vs {w0} at {n0}: "
              f"{'+' if w1 >= w0 else ''}{(w1 - w0) / w0 * 100 if w0 else float('nan'):.1f} %")  # fmt: skip
    print(f"\ntotal wall time {time.monotonic() - started:.0f}s; logs in {a.log_dir}")
    counts = Counter("error" in r for r in results)
    return 1 if counts[True] else 0


if __name__ == "__main__":
    sys.exit(main())
