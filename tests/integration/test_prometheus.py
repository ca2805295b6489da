"""The chart's alert rules and dashboard against a real Prometheus that scrapes a real maintainer.

Prometheus (Debian's, unpacked by hack/fetch-prometheus.sh) runs on loopback with the rules the chart renders
(helm template, monitoring.prometheusRule.enabled) with short thresholds and `for` durations given as values,
and scrapes the maintainer process every second; the scrape adds the `namespace` and `pod` labels a PodMonitor
target carries. Then, with the maintainer and three capture agents running against the embedded API:

- settled: no alert is pending or firing;
- a user Move held in RemoveOrigin by the capture hook `hold-close` stalls the changefeed: the operator alert
  (ChangefeedOperatorStuck) and the checkpoint-lag alert (ChangefeedCheckpointLagHigh) are seen pending, then
  firing, with the changefeed's labels; released, the Move finishes and both resolve;
- a Move to a capture that does not exist fails: ChangefeedOperatorsFailing goes pending, fires, and resolves
  once the failure leaves its window;
- a capture SIGKILLed: ChangefeedCapturesLost fires;
- every dashboard query (and variable) returns data over the test's time range, as Grafana would ask for it;
- the maintainer stopped: ChangefeedMaintainerAbsent fires.

Alert states are read from Prometheus's /api/v1/rules, polled; every wait has a deadline and no duration is
asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3
import yaml

from controller.model.states import OpPhase, Stage
from controller.model.verification import LAST_VERIFY_ANNOTATION, Verification
from tests.integration.harness import CHANGEFEED, Api, Snap, System, Watch, all_settled, set_hooks
from tests.integration.test_metrics import HOST, free_port
from tests.monitoring.tools import binary, dashboard_queries, grafana_to_promql, rule_groups

CAPTURES = ["c0", "c1", "c2"]
SETTLE = 60.0
ALERT_WAIT = 60.0
POD = "cfm-maintainer-0"


#: The metrics of a sink's figures (tombstones, live rows): reported by captures that replicate data only.
SINK_FIGURES = ("sink_tombstones", "sink_live_rows")


def rule_values(namespace: str) -> dict[str, Any]:
    """The chart's values for this test: every threshold and duration short, one-second evaluation."""
    return {
        "monitoring": {
            "prometheusRule": {
                "enabled": True,
                "interval": "1s",
                "selector": f'namespace="{namespace}"',
                "alerts": {
                    "checkpointLag": {"enabled": True, "threshold": 10, "for": "3s", "severity": "warning"},
                    "operatorStuck": {"enabled": True, "threshold": 4, "for": "3s", "severity": "warning"},
                    "notLed": {"enabled": True, "for": "10s", "severity": "critical"},
                    "maintainerAbsent": {"enabled": True, "for": "3s", "severity": "critical"},
                    "capturesLost": {"enabled": True, "threshold": 0, "for": "2s", "severity": "warning"},
                    "loopCrashes": {
                        "enabled": True,
                        "threshold": 1,
                        "window": "1m",
                        "for": "0s",
                        "severity": "warning",
                    },
                    "operatorsFailing": {
                        "enabled": True,
                        "threshold": 1,
                        "window": "20s",
                        "for": "2s",
                        "severity": "warning",
                    },
                },
            }
        }
    }


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    pool: urllib3.PoolManager = field(default_factory=urllib3.PoolManager)
    #: alert name -> every state seen, in order, without repeats (inactive, pending, firing).
    history: dict[str, list[str]] = field(default_factory=dict)

    def get(self, path: str, **params: Any) -> Any:
        r = self.pool.request(
            "GET", f"{self.url}{path}?{urlencode(params)}", timeout=urllib3.Timeout(connect=2, read=10)
        )
        assert r.status == 200, (path, params, r.status, r.data[:500])
        body = json.loads(r.data)
        assert body["status"] == "success", body
        return body["data"]

    def rules(self) -> dict[str, dict[str, Any]]:
        """Alerting rules by name, each with its state and active alerts; records the state history."""
        out = {}
        for group in self.get("/api/v1/rules", type="alert")["groups"]:
            for rule in group["rules"]:
                out[rule["name"]] = rule
                seen = self.history.setdefault(rule["name"], [])
                if not seen or seen[-1] != rule["state"]:
                    seen.append(rule["state"])
        return out

    def tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "<no log>"


@pytest.fixture
def prometheus(api: Api, tmp_path: Path) -> Iterator[Callable[[int], Prometheus]]:
    """Starts Prometheus for a maintainer metrics port; stopped (SIGTERM, then SIGKILL) at the end."""
    started: list[Prometheus] = []

    def start(metrics_port: int) -> Prometheus:
        exe = binary("prometheus")
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(rule_values(api.namespace)))
        (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups("-f", str(values))}))
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {
                    "job_name": "changefeed-maintainer",
                    "static_configs": [
                        {
                            "targets": [f"{HOST}:{metrics_port}"],
                            # What a PodMonitor's target carries (the rules group and select by them).
                            "labels": {"namespace": api.namespace, "pod": POD, "container": "maintainer"},
                        }
                    ],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = tmp_path / "prometheus.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [
                    str(exe),
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address={HOST}:{port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
                start_new_session=True,
            )
        prom = Prometheus(f"http://{HOST}:{port}", proc, log)
        started.append(prom)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}\n{prom.tail()}"
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                r = prom.pool.request(
                    "GET", f"{prom.url}/-/ready", timeout=urllib3.Timeout(connect=1, read=2), retries=False
                )
                if r.status == 200:
                    return prom
            assert time.monotonic() < deadline, f"prometheus not ready\n{prom.tail()}"
            time.sleep(0.2)

    yield start
    for prom in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(prom.proc.pid, signal.SIGTERM)
        try:
            prom.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(prom.proc.pid, signal.SIGKILL)
            prom.proc.wait(timeout=10)


def until_alerts(
    watch: Watch, prom: Prometheus, cond: Callable[[dict[str, dict[str, Any]]], str | bool], what: str
) -> dict[str, dict[str, Any]]:
    """Poll the API (the harness's invariants) and Prometheus's rules until ``cond`` holds."""
    deadline = time.monotonic() + ALERT_WAIT
    while True:
        watch.poll()
        rules = prom.rules()
        why = cond(rules)
        if why is True:
            return rules
        if time.monotonic() > deadline:
            states = {name: (r["state"], [a["labels"] for a in r["alerts"]]) for name, r in rules.items()}
            raise watch.fail(
                f"timed out after {ALERT_WAIT:.0f}s waiting for {what}: {why}\nrules: {states}\n"
                f"history: {prom.history}\n=== prometheus ===\n{prom.tail()}"
            )
        time.sleep(0.2)


def state(name: str, want: str) -> Callable[[dict[str, dict[str, Any]]], str | bool]:
    def cond(rules: dict[str, dict[str, Any]]) -> str | bool:
        have = rules[name]["state"]
        return True if have == want else f"{name} is {have}"

    return cond


def labels_of(rule: dict[str, Any]) -> list[dict[str, str]]:
    return [a["labels"] for a in rule["alerts"]]


def test_alerts_fire_and_resolve_and_every_dashboard_query_has_data(
    api: Api, system: System, prometheus: Callable[[int], Prometheus]
) -> None:
    began = time.time()
    metrics_port = free_port()
    watch = Watch(api, system)
    for c in CAPTURES:
        system.capture(c)
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.changefeed()
    api.table(1, pre_split=4)
    api.table(2)
    system.maintainer("m1", "--metrics-port", str(metrics_port), "--metrics-address", HOST)
    watch.until(lambda s: len(s.spans) == 5 and all_settled(s), "initial placement", SETTLE)
    prom = prometheus(metrics_port)

    def scraped(rules: dict[str, dict[str, Any]]) -> str | bool:
        result = prom.get("/api/v1/query", query=f'changefeed_maintainer_leader{{namespace="{api.namespace}"}}')
        if not result["result"]:
            return "the maintainer's leader series is not scraped yet"
        return True

    until_alerts(watch, prom, scraped, "the first scrapes")

    # Settled: every rule evaluated, nothing pending or firing (a rule whose state is inactive has no alert).
    def quiet(rules: dict[str, dict[str, Any]]) -> str | bool:
        if len(rules) != 10:
            return f"rules loaded: {sorted(rules)}"
        if any(r.get("lastEvaluation", "").startswith("0001") for r in rules.values()):
            return "not every rule evaluated yet"
        noisy = {n: r["state"] for n, r in rules.items() if r["state"] != "inactive"}
        return True if not noisy else f"not inactive: {noisy}"

    settled = until_alerts(watch, prom, quiet, "every alert inactive in the settled system")
    # From here on, each alert's history starts inactive (before the first scrapes, ChangefeedMaintainerAbsent
    # may have been pending or firing: nothing was scraped yet, rightly so).
    prom.history = {name: ["inactive"] for name in settled}

    # A user Move held in RemoveOrigin: the changefeed stalls, its operator and its checkpoint lag alert.
    snap = watch.poll()
    mover = sorted(snap.spans_of(1), key=lambda s: s.name)[0]
    target = next(c for c in CAPTURES if c != mover.capture)
    set_hooks(api, system, CAPTURES, hold_close="*")
    api.operator("op-move", "Move", [mover.name], target=target)

    def held(s: Snap) -> object:
        o = s.operators.get("op-move")
        return (o is not None and o.phase is OpPhase.RUNNING and o.stage is Stage.REMOVE_ORIGIN) or f"op-move: {o}"

    watch.until(held, "the Move held in RemoveOrigin", 30)
    for name in ("ChangefeedOperatorStuck", "ChangefeedCheckpointLagHigh"):
        until_alerts(watch, prom, state(name, "firing"), f"{name} firing")
    rules = prom.rules()
    with watch.explained(watch.poll()):
        for name in ("ChangefeedOperatorStuck", "ChangefeedCheckpointLagHigh"):
            assert prom.history[name] == ["inactive", "pending", "firing"], (name, prom.history[name])
        stuck = labels_of(rules["ChangefeedOperatorStuck"])
        assert stuck == [
            {
                "alertname": "ChangefeedOperatorStuck",
                "namespace": api.namespace,
                "changefeed": CHANGEFEED,
                "type": "Move",
                "severity": "warning",
            }
        ], stuck
        lag = labels_of(rules["ChangefeedCheckpointLagHigh"])
        assert lag == [
            {
                "alertname": "ChangefeedCheckpointLagHigh",
                "namespace": api.namespace,
                "changefeed": CHANGEFEED,
                "severity": "warning",
            }
        ], lag
        annotations = rules["ChangefeedOperatorStuck"]["alerts"][0]["annotations"]
        assert annotations["runbook_url"].endswith("docs/operations.md#changefeedoperatorstuck")
        assert f"changefeed {CHANGEFEED}" in annotations["description"], annotations

    # Released: the Move finishes, the checkpoint catches up, both alerts resolve.
    set_hooks(api, system, CAPTURES, hold_close=None)

    def moved(s: Snap) -> object:
        o = s.operators.get("op-move")
        return (o is not None and o.phase is OpPhase.SUCCEEDED and all_settled(s) is True) or f"op-move: {o}"

    watch.until(moved, "the Move to succeed", SETTLE)
    for name in ("ChangefeedOperatorStuck", "ChangefeedCheckpointLagHigh"):
        until_alerts(watch, prom, state(name, "inactive"), f"{name} resolved")
        assert prom.history[name] == ["inactive", "pending", "firing", "inactive"], prom.history[name]
    alerts_now = prom.get("/api/v1/alerts")["alerts"]
    assert [a for a in alerts_now if a["labels"]["alertname"] == "ChangefeedOperatorStuck"] == [], alerts_now

    # A Move to a capture that does not exist fails: the failed-operators alert fires, then resolves when the
    # failure leaves its window.
    api.operator("op-nowhere", "Move", [mover.name], target="no-such-capture")

    def failed(s: Snap) -> object:
        o = s.operators.get("op-nowhere")
        return (o is not None and o.phase is OpPhase.FAILED) or f"op-nowhere: {o}"

    snap = watch.until(failed, "the Move to nowhere to fail", 30)
    rules = until_alerts(watch, prom, state("ChangefeedOperatorsFailing", "firing"), "ChangefeedOperatorsFailing")
    with watch.explained(snap):
        assert "pending" in prom.history["ChangefeedOperatorsFailing"], prom.history
        assert [(a["changefeed"], a["type"]) for a in labels_of(rules["ChangefeedOperatorsFailing"])] == [
            (CHANGEFEED, "Move")
        ]
    until_alerts(watch, prom, state("ChangefeedOperatorsFailing", "inactive"), "ChangefeedOperatorsFailing resolved")

    # A capture SIGKILLed: lost once its Lease lapses.
    system.signal("c2", signal.SIGKILL)
    rules = until_alerts(watch, prom, state("ChangefeedCapturesLost", "firing"), "ChangefeedCapturesLost")
    assert labels_of(rules["ChangefeedCapturesLost"])[0]["namespace"] == api.namespace

    # A verification recorded as `kubectl changefeed verify` records it (this changefeed replicates nothing, so
    # there is no sink to compare; tests/dataplane runs the verb itself): the verify series appear with its figures.
    recorded = Verification(revision=4242, differences=3, keys=17, at=time.time())
    api.patch("changefeeds", CHANGEFEED, {"metadata": {"annotations": {LAST_VERIFY_ANNOTATION: recorded.to_json()}}})

    def verify_scraped(rules: dict[str, dict[str, Any]]) -> str | bool:
        # A range query as the dashboard's below: a sample scraped after its last step (steps are 1 s from
        # ``began``) is not in it yet, though an instant query already shows it.
        got = {}
        for metric in ("differences", "revision"):
            query = f'changefeed_maintainer_verify_{metric}{{namespace="{api.namespace}"}}'
            result = prom.get("/api/v1/query_range", query=query, start=began, end=time.time(), step="1s")["result"]
            got[metric] = sorted({v for r in result for _, v in r["values"]})
        return True if got == {"differences": ["3"], "revision": ["4242"]} else f"verify series: {got}"

    until_alerts(watch, prom, verify_scraped, "the recorded verification scraped")

    # Every query of the dashboard returns data over the test's time range (as Grafana asks: a range query), but
    # those of a sink's figures: this changefeed replicates nothing, so no capture reports them (their values are
    # tests/maintainer/test_metrics.py's; the figures themselves tests/dataplane/test_tombstones.py's).
    empty = []
    for title, expr in dashboard_queries():
        if any(f"changefeed_maintainer_{m}" in expr for m in SINK_FIGURES):
            continue
        query = grafana_to_promql(expr, rate_interval="5s")
        result = prom.get("/api/v1/query_range", query=query, start=began, end=time.time(), step="1s")
        if not result["result"]:
            empty.append(f"{title}: {query}")
    assert empty == [], "dashboard queries without data:\n  " + "\n  ".join(empty)

    # Throughout, the maintainer never crashed a loop and always led the changefeed.
    for name in ("ChangefeedMaintainerLoopCrashing", "ChangefeedNotLed", "ChangefeedMaintainerAbsent"):
        assert prom.history[name] == ["inactive"], (name, prom.history[name])

    # The maintainer stopped: nothing is scraped any more.
    assert system.signal("m1", signal.SIGTERM) == 0, watch.fail("m1 did not exit cleanly")
    rules = until_alerts(watch, prom, state("ChangefeedMaintainerAbsent", "firing"), "ChangefeedMaintainerAbsent")
    assert labels_of(rules["ChangefeedMaintainerAbsent"]) == [
        {"alertname": "ChangefeedMaintainerAbsent", "namespace": api.namespace, "severity": "critical"}
    ]
