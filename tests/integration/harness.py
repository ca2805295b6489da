"""A harness for the failover tests: real maintainer and capture processes against one Kubernetes API.

- :class:`Api`: synchronous HTTP (urllib3) bound to one namespace, against the embedded API server or
  a real cluster (TLS and credentials from the kubeconfig).
- :class:`System`: the maintainer and capture subprocesses, each in its own session (so a signal
  reaches the whole process group), with their logs in files whose tails go into every failure message.
- :class:`Snap`: one listing of every kind, converted to model records with ``from_resource`` and
  ``capture_from_resources``, as the engine's :class:`World` for ``engine.invariants``.
- :func:`wait_until`: polls with a deadline; at every poll it checks the invariants that must hold at
  every instant (single owner over the live dispatchers of live captures, no unexplained overlap) and
  on a timeout or a violation fails with a dump of spans, operators, dispatchers, leases and log tails.
- :func:`no_gap`: every capture writes the delivery ledger (``--ledger-dir``, controller/capture/ledger.py);
  at the end of a test this proves from it that every key of every live table was delivered over
  (start, published checkpoint], once the checkpoint has passed the moment of the call (so every handoff
  the test made is inside the range checked).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3

from controller.capture import ledger
from controller.engine import invariants
from controller.engine.world import World
from controller.model.keys import KeyRange
from controller.model.records import Capture, Changefeed, Dispatcher, Span, SpanOperator, Table
from controller.model.resources import capture_from_resources, from_resource, lease_name
from controller.model.states import LIVE_DISPATCHER_STATES
from controller.model.tso import tso

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
GROUP = "cdc.maintainer.dev"
API_VERSION = f"{GROUP}/v1alpha1"
HOLD_CLOSE = f"{GROUP}/hold-close"
PAUSE_CREATE = f"{GROUP}/pause-create"
CHANGEFEED = "cf"

#: Short timings, so that a failover takes seconds (client-go defaults are 15/10/2 s). No metrics endpoint
#: (several maintainers run side by side); a test that scrapes passes ``--metrics-port N`` after these.
MAINTAINER_LEASE = 3.0
MAINTAINER_FLAGS = [
    "--lease-duration",
    "3",
    "--renew-deadline",
    "2",
    "--retry-period",
    "0.5",
    "--tick",
    "0.2",
    "--metrics-port",
    "0",
]
CAPTURE_LEASE = 4.0
CAPTURE_FLAGS = [
    "--lease-duration",
    "4",
    "--renew-interval",
    "0.5",
    "--renew-deadline",
    "3",
    "--report-interval",
    "0.5",
]

Obj = dict[str, Any]


# ------------------------------------------------------------------------------------------------------
# The API


@dataclass
class Api:
    host: str
    headers: dict[str, str]
    pool: urllib3.PoolManager
    namespace: str
    kubeconfig: Path

    def path(self, plural: str, name: str = "", sub: str = "") -> str:
        if plural == "leases":
            base = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        else:
            base = f"/apis/{API_VERSION}/namespaces/{self.namespace}/{plural}"
        return base + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def req(self, method: str, path: str, body: Any = None, ct: str = "application/json", **params: Any) -> Any:
        """(status, decoded body)."""
        headers = {**self.headers, "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = ct
            data = json.dumps(body).encode()
        url = self.host + path + ("?" + urlencode(params) if params else "")
        r = self.pool.request(method, url, body=data, headers=headers, timeout=urllib3.Timeout(10, 30))
        return r.status, (json.loads(r.data) if r.data else None)

    def ok(self, method: str, path: str, body: Any = None, ct: str = "application/json") -> Any:
        status, out = self.req(method, path, body, ct)
        assert status < 300, (method, path, status, out)
        return out

    def list(self, plural: str) -> list[Obj]:
        items: list[Obj] = self.ok("GET", self.path(plural))["items"]
        return items

    def get(self, plural: str, name: str) -> Obj | None:
        status, out = self.req("GET", self.path(plural, name))
        if status == 404:
            return None
        assert status == 200, (status, out)
        return dict(out)

    def create(self, plural: str, kind: str, name: str, spec: Obj, **meta: Any) -> Obj:
        body = {"apiVersion": API_VERSION, "kind": kind, "metadata": {"name": name, **meta}, "spec": spec}
        out: Obj = self.ok("POST", self.path(plural), body)
        return out

    def patch(self, plural: str, name: str, patch: Obj, sub: str = "") -> Obj:
        out: Obj = self.ok("PATCH", self.path(plural, name, sub), patch, "application/merge-patch+json")
        return out

    def delete(self, plural: str, name: str) -> None:
        status, out = self.req("DELETE", self.path(plural, name))
        assert status in (200, 202, 404), (status, out)

    # -- the user's side -----------------------------------------------------------------------------

    def changefeed(self, redo: bool = False, **scheduler: Any) -> None:
        """The test changefeed; balancing is off unless asked for, as in TiCDC's failover test (the
        tests pin spans to captures and must not see them moved by the balance scheduler)."""
        knobs = {"balanceIntervalSeconds": 0, **scheduler}
        self.create("changefeeds", "Changefeed", CHANGEFEED, {"redo": redo, "scheduler": knobs})

    def table(self, table_id: int, pre_split: int = 0) -> None:
        spec: Obj = {"changefeed": CHANGEFEED, "tableID": table_id}
        if pre_split:
            spec["preSplit"] = {"spans": pre_split}
        self.create("tables", "Table", f"t{table_id}", spec, labels={f"{GROUP}/changefeed": CHANGEFEED})

    def operator(self, name: str, type_: str, spans: list[str], **spec: Any) -> None:
        body = {"changefeed": CHANGEFEED, "type": type_, "spans": spans, **spec}
        self.create("spanoperators", "SpanOperator", name, body, labels={f"{GROUP}/changefeed": CHANGEFEED})


def embedded_api(url: str, kubeconfig: Path, namespace: str, ca_pem: bytes | None = None) -> Api:
    """An Api on the embedded server; ``ca_pem``: its certificate, when it serves HTTPS (``tls=True``)."""
    pool = urllib3.PoolManager(ca_cert_data=ca_pem.decode()) if ca_pem else urllib3.PoolManager()
    return Api(url, {}, pool, namespace, kubeconfig)


def cluster_api(kubeconfig: Path, namespace: str) -> Api:
    """An Api on the cluster a kubeconfig names (TLS and credentials as the kubernetes package reads them)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    pool = urllib3.PoolManager(
        cert_reqs="CERT_REQUIRED" if cfg.verify_ssl else "CERT_NONE",
        ca_certs=cfg.ssl_ca_cert,
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
    )
    headers = {}
    auth = cfg.get_api_key_with_prefix("authorization")
    if auth:
        headers["Authorization"] = auth
    return Api(cfg.host, headers, pool, namespace, kubeconfig)


def apply_crds(api: Api) -> None:
    import yaml

    base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    names = []
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names.append(crd["metadata"]["name"])
        status, out = api.req("POST", base, crd)
        if status == 409:
            current = api.ok("GET", f"{base}/{crd['metadata']['name']}")
            crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            api.ok("PUT", f"{base}/{crd['metadata']['name']}", crd)
        else:
            assert status == 201, out
    deadline = time.monotonic() + 60
    for name in names:
        while True:
            conditions = (api.ok("GET", f"{base}/{name}").get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                break
            assert time.monotonic() < deadline, f"CRD {name} not established"
            time.sleep(0.2)


def release_everything(api: Api) -> None:
    """Strip the finalizers a dead capture or maintainer left, so that the namespace can go."""
    for plural in ("dispatchers", "tables", "spans", "spanoperators", "changefeeds", "captures"):
        with contextlib.suppress(Exception):
            for obj in api.list(plural):
                if obj["metadata"].get("finalizers"):
                    api.req(
                        "PATCH",
                        api.path(plural, obj["metadata"]["name"]),
                        {"metadata": {"finalizers": None}},
                        "application/merge-patch+json",
                    )


# ------------------------------------------------------------------------------------------------------
# The processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join(f"    {line[:400]}" for line in text[-lines:])

    def count(self, needle: str) -> int:
        try:
            return self.log.read_text(errors="replace").count(needle)
        except OSError:
            return 0


class System:
    """The maintainers and captures of one test. ``stop_all`` SIGKILLs whatever still runs."""

    def __init__(self, api: Api, log_dir: Path) -> None:
        self.api = api
        self.log_dir = log_dir
        #: Where every capture of this test writes what it delivered (controller/capture/ledger.py).
        self.ledger_dir = log_dir / "ledger"
        self.procs: dict[str, Proc] = {}
        self.gone: dict[str, Proc] = {}

    def _spawn(self, name: str, args: list[str]) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        proc = Proc(name, popen, log_path)
        self.procs[name] = proc
        return proc

    def maintainer(
        self, identity: str, *extra: str, kubeconfig: Path | None = None, flags: list[str] | None = None
    ) -> Proc:
        """A maintainer process; ``flags`` replace the short timings (``[]``: the defaults, no metrics port)."""
        args = [
            "-m",
            "controller.maintainer",
            "--namespace",
            self.api.namespace,
            "--kubeconfig",
            str(kubeconfig or self.api.kubeconfig),
            "--identity",
            identity,
            *(MAINTAINER_FLAGS if flags is None else [*flags, "--metrics-port", "0"]),
            *extra,
        ]
        return self._spawn(identity, args)

    def capture(self, name: str, *, kubeconfig: Path | None = None, flags: list[str] | None = None) -> Proc:
        """A capture agent process; ``flags`` replace the short timings (``[]``: the defaults). The test hooks are
        on (``--test-hooks``) whatever the flags: the tests hold operators in flight with them."""
        args = [
            "-m",
            "controller.capture",
            "--name",
            name,
            "--namespace",
            self.api.namespace,
            "--kubeconfig",
            str(kubeconfig or self.api.kubeconfig),
            *(CAPTURE_FLAGS if flags is None else flags),
            "--test-hooks",
            "--ledger-dir",
            str(self.ledger_dir),
        ]
        return self._spawn(name, args)

    def signal(self, name: str, sig: int = signal.SIGKILL, wait: float = 20.0) -> int:
        proc = self.procs.pop(name)
        self.gone[name] = proc
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, sig)
        try:
            return proc.popen.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)
            raise

    def stop_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
        self.gone.update(self.procs)
        self.procs.clear()

    def tails(self) -> str:
        out = []
        for name, proc in sorted({**self.gone, **self.procs}.items()):
            state = "running" if proc.alive() else f"exited {proc.popen.returncode}"
            out.append(f"--- {name} ({state}), {proc.log}:\n{proc.tail()}")
        return "\n".join(out)

    def check_running(self) -> list[str]:
        return [f"process {n} exited with {p.popen.returncode}" for n, p in self.procs.items() if not p.alive()]


def set_hooks(api: Api, system: System, captures: Iterable[str], **hooks: str | None) -> None:
    """Set test hooks (``hold_close``/``pause_create``: "*", "1,2" or None to clear) and wait until every
    capture has logged the change, so that nothing it does afterwards escapes them."""
    annotations = {HOLD_CLOSE if k == "hold_close" else PAUSE_CREATE: v for k, v in hooks.items()}
    captures = list(captures)
    before = {c: system.procs[c].count("test hooks changed") for c in captures}
    for c in captures:
        api.patch("captures", c, {"metadata": {"annotations": annotations}})
    deadline = time.monotonic() + 15
    while any(system.procs[c].count("test hooks changed") <= before[c] for c in captures):
        assert time.monotonic() < deadline, f"captures did not pick up hooks {annotations}\n{system.tails()}"
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------------
# Snapshots and invariants


@dataclass
class Snap:
    now: float
    raw: dict[str, list[Obj]]
    changefeed: Changefeed | None
    tables: dict[str, Table] = field(default_factory=dict)
    spans: dict[str, Span] = field(default_factory=dict)
    dispatchers: dict[str, Dispatcher] = field(default_factory=dict)
    operators: dict[str, SpanOperator] = field(default_factory=dict)
    captures: dict[str, Capture] = field(default_factory=dict)
    leases: dict[str, Obj] = field(default_factory=dict)

    @property
    def epoch(self) -> int:
        return self.changefeed.epoch if self.changefeed else 0

    @property
    def holder(self) -> str:
        return self.changefeed.holder if self.changefeed else ""

    def lease_holder(self, name: str = f"cfm-{CHANGEFEED}") -> str:
        return str(((self.leases.get(name) or {}).get("spec") or {}).get("holderIdentity") or "")

    def world(self) -> World:
        assert self.changefeed is not None, "no Changefeed"
        return World(
            self.now, self.changefeed, self.tables, self.spans, self.dispatchers, self.operators, self.captures
        )

    def alive(self, capture: str) -> bool:
        cap = self.captures.get(capture)
        return cap is not None and cap.alive(self.now)

    def live_dispatchers(self) -> list[Dispatcher]:
        """Initializing or Working (being deleted or not) on a capture whose Lease is current."""
        return [d for d in self.dispatchers.values() if d.state in LIVE_DISPATCHER_STATES and self.alive(d.capture)]

    def spans_of(self, table_id: int, mode: str = "default") -> list[Span]:
        spans = (s for s in self.spans.values() if s.table_id == table_id and s.mode == mode and not s.deleting)
        return sorted(spans, key=lambda s: s.key_range)

    def always(self) -> list[str]:
        """What must hold at every instant."""
        problems = invariants.single_owner(self.live_dispatchers())
        if self.changefeed is not None:
            problems += invariants.unexplained_overlaps(self.world())
        return problems

    def settled(self) -> list[str]:
        return invariants.settled(self.world()) if self.changefeed else ["no Changefeed"]

    def dump(self) -> str:
        lines = []
        cf = self.changefeed
        if cf is not None:
            lines.append(
                f"changefeed: epoch={cf.epoch} holder={cf.holder} in-flight={cf.operators_in_flight} "
                f"conditions={[(c.type, c.status, c.reason, c.message) for c in cf.conditions]}"
            )
        for name, lease in sorted(self.leases.items()):
            spec = lease.get("spec") or {}
            lines.append(
                f"lease {name}: holder={spec.get('holderIdentity')!r} renew={spec.get('renewTime')} "
                f"duration={spec.get('leaseDurationSeconds')} transitions={spec.get('leaseTransitions')}"
            )
        for c in sorted(self.captures.values(), key=lambda c: c.name):
            lines.append(f"capture {c.name}: alive={c.alive(self.now)} renew={c.renew_time}")
        for t in sorted(self.tables.values(), key=lambda t: t.name):
            lines.append(f"table {t.name} id={t.table_id} deleting={t.deleting} finalizers={list(t.finalizers)}")
        for s in sorted(self.spans.values(), key=lambda s: (s.table_id, s.mode, s.key_range)):
            lines.append(
                f"span {s.name} t{s.table_id}/{s.mode} [{s.key_range.start.hex()},{s.key_range.end.hex()}) "
                f"{s.state} capture={s.capture} dispatcher={s.dispatcher} op={s.operator} "
                f"deleting={s.deleting} {s.message}"
            )
        for o in sorted(self.operators.values(), key=lambda o: o.name):
            lines.append(
                f"operator {o.name} {o.type} spans={list(o.spans)} target={o.target} {o.phase}/{o.stage} "
                f"reason={o.status_reason} epoch={o.epoch} msg={o.message!r} "
                f"targets={[(t.span, t.capture, t.dispatcher, t.done, t.lost) for t in o.targets]}"
            )
        for d in sorted(self.dispatchers.values(), key=lambda d: d.name):
            lines.append(
                f"dispatcher {d.name} span={d.span} t{d.table_id}/{d.mode} capture={d.capture} "
                f"state={d.state.value or 'Pending'} epoch={d.epoch} deleting={d.deleting} op={d.operator} "
                f"{d.message}"
            )
        return "\n".join(lines)


PLURALS = ("changefeeds", "tables", "spans", "dispatchers", "spanoperators", "captures", "leases")


def snapshot(api: Api) -> Snap:
    # Operators first: an overlap in the (later) span listing is then explained by an operator listed here.
    raw = {p: api.list(p) for p in ("spanoperators", "changefeeds", "tables", "spans", "dispatchers")}
    raw["leases"] = api.list("leases")
    raw["captures"] = api.list("captures")
    now = time.time()
    leases = {lease["metadata"]["name"]: lease for lease in raw["leases"]}
    cfs = [from_resource(o) for o in raw["changefeeds"]]
    cf = next((c for c in cfs if isinstance(c, Changefeed) and c.name == CHANGEFEED), None)

    def records(plural: str, cls: type[Any]) -> dict[str, Any]:
        out = {}
        for obj in raw[plural]:
            rec = from_resource(obj)
            assert isinstance(rec, cls)
            out[rec.name] = rec
        return out

    return Snap(
        now=now,
        raw=raw,
        changefeed=cf,
        tables=records("tables", Table),
        spans=records("spans", Span),
        dispatchers=records("dispatchers", Dispatcher),
        operators=records("spanoperators", SpanOperator),
        captures={
            c["metadata"]["name"]: capture_from_resources(c, leases.get(lease_name(c["metadata"]["name"])))
            for c in raw["captures"]
        },
        leases=leases,
    )


class Watch:
    """Polls the world; every poll checks the always-invariants and that no process died unexpectedly."""

    def __init__(self, api: Api, system: System, every: float = 0.3) -> None:
        self.api = api
        self.system = system
        self.every = every
        self.polls = 0
        self.last: Snap | None = None

    def fail(self, message: str, snap: Snap | None = None) -> AssertionError:
        snap = snap or self.last
        dump = snap.dump() if snap is not None else "<no snapshot>"
        return AssertionError(f"{message}\n=== state ===\n{dump}\n=== logs ===\n{self.system.tails()}")

    @contextlib.contextmanager
    def explained(self, snap: Snap) -> Iterator[None]:
        """Failed assertions (and lookups) inside the block carry the state dump and the log tails."""
        try:
            yield
        except (AssertionError, KeyError, ValueError) as exc:
            message = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            raise self.fail(message, snap) from exc

    def poll(self) -> Snap:
        snap = snapshot(self.api)
        self.polls += 1
        self.last = snap
        problems = snap.always() + self.system.check_running()
        if problems:
            raise self.fail("invariant violated:\n  " + "\n  ".join(problems), snap)
        return snap

    def until(self, cond: Callable[[Snap], Any], what: str, timeout: float = 60.0) -> Snap:
        """Poll until ``cond(snap)`` is truthy; a string or list result means "not yet, because ..."."""
        deadline = time.monotonic() + timeout
        why: Any = None
        while True:
            snap = self.poll()
            result = cond(snap)
            if result and not isinstance(result, (str, list)):
                return snap
            why = result
            if time.monotonic() > deadline:
                raise self.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {why!r}", snap)
            time.sleep(self.every)

    def stays(self, cond: Callable[[Snap], Any], what: str, seconds: float) -> Snap:
        deadline = time.monotonic() + seconds
        while True:
            snap = self.poll()
            result = cond(snap)
            if not result or isinstance(result, (str, list)):
                raise self.fail(f"{what} stopped holding: {result!r}", snap)
            if time.monotonic() > deadline:
                return snap
            time.sleep(self.every)


# ------------------------------------------------------------------------------------------------------
# Conditions


def all_settled(snap: Snap) -> list[str] | bool:
    """``engine.invariants.settled`` on the world read from the resources (True when it holds)."""
    problems = snap.settled()
    return problems or True


def table_range(table_id: int) -> KeyRange:
    return KeyRange.of_table(table_id)


def no_gap(watch: Watch, since: dict[int, int] | None = None, timeout: float = 30.0) -> Snap:
    """The delivery ledger shows no gap: for every key of every live table of the changefeed, in every mode,
    the captures delivered every ts in (start, published checkpoint], where start is the changefeed's (or
    the table's ``startTs``, or ``since[table_id]`` for a table the test created later: a table is
    replicated from the checkpoint at which the maintainer took it on). Waits first until the published
    checkpoint has passed the moment of the call, so the range covers every handoff the test made."""
    now = tso(int(time.time() * 1000))

    def passed(s: Snap) -> object:
        cp = s.changefeed.checkpoint_ts if s.changefeed else 0
        return cp >= now or f"checkpoint {cp} not yet past {now}"

    snap = watch.until(passed, "the checkpoint to pass the end of the test", timeout)
    cf = snap.changefeed
    assert cf is not None
    required = [
        ledger.Required(cf.name, t.table_id, mode, max(cf.start_ts, t.start_ts, (since or {}).get(t.table_id, 0)),
                        cf.checkpoint_ts)
        for t in snap.tables.values()
        if t.changefeed == cf.name and not t.deleting
        for mode in cf.modes
    ]  # fmt: skip
    delivered = ledger.read(watch.system.ledger_dir)
    problems = ledger.check(delivered, required)
    if problems:
        raise watch.fail(
            f"the delivery ledger has gaps ({len(delivered)} lines, {len(required)} table-modes):\n  "
            + "\n  ".join(problems[:10]),
            snap,
        )
    assert required, "no table to check"
    return snap
