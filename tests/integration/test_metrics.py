"""The maintainer's Prometheus endpoint, scraped over HTTP from a real maintainer process.

What it reports is compared with what the API holds: the span gauges with the Span resources by state and
capture, the operators-in-flight gauge with the SpanOperators not finished, and a user Move that succeeds
must leave one operator-duration sample. The informer (and so the metrics) lags the API a little, so every
comparison polls the API and the endpoint together until they agree, with a deadline; on a timeout the
failure carries both sides, the state dump and the process logs.
"""

from __future__ import annotations

import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import urllib3
from prometheus_client.parser import text_string_to_metric_families

from controller.model.states import OpPhase, Stage
from tests.integration.harness import CHANGEFEED, Api, Snap, System, Watch, all_settled, set_hooks

PREFIX = "changefeed_maintainer_"
CAPTURES = ["c0", "c1", "c2"]
SETTLE = 60.0
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Scrape:
    """One scrape: samples by metric sample name, each as (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]]
    text: str

    def get(self, name: str, **labels: str) -> float | None:
        for have, value in self.samples.get(PREFIX + name, []):
            if all(have.get(k) == v for k, v in labels.items()):
                return value
        return None

    def by(self, name: str, *keys: str, **match: str) -> Counter[tuple[str, ...]]:
        """Sum of the samples of ``name`` (matching ``match``) grouped by the labels ``keys``; zeros dropped."""
        out: Counter[tuple[str, ...]] = Counter()
        for labels, value in self.samples.get(PREFIX + name, []):
            if all(labels.get(k) == v for k, v in match.items()):
                out[tuple(labels[k] for k in keys)] += int(value)
        return +out


def scrape(port: int) -> Scrape:
    r = urllib3.request("GET", f"http://{HOST}:{port}/metrics", timeout=urllib3.Timeout(5, 10))
    assert r.status == 200, (r.status, r.data[:500])
    text = r.data.decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return Scrape(samples, text)


def api_spans(snap: Snap) -> Counter[tuple[str, ...]]:
    return Counter(
        (s.state.value if s.state is not None else "Unknown", s.capture or "none") for s in snap.spans.values()
    )


def api_in_flight(snap: Snap) -> Counter[tuple[str, ...]]:
    ops = (o for o in snap.operators.values() if o.in_flight)
    return Counter((o.type.value, o.phase.value, o.stage.value or "None") for o in ops)


def agree(snap: Snap, m: Scrape) -> str | bool:
    """The endpoint reports the spans and the operators in flight that the API holds."""
    spans = m.by("spans", "state", "capture", changefeed=CHANGEFEED)
    if spans != api_spans(snap):
        return f"spans: metrics {dict(spans)} != API {dict(api_spans(snap))}"
    ops = m.by("operators_in_flight", "type", "phase", "stage", changefeed=CHANGEFEED)
    if ops != api_in_flight(snap):
        return f"operators in flight: metrics {dict(ops)} != API {dict(api_in_flight(snap))}"
    return True


def until_metrics(
    watch: Watch, port: int, cond: Callable[[Snap, Scrape], str | bool], what: str, timeout: float = 30.0
) -> tuple[Snap, Scrape]:
    """Poll the API (with the harness's invariant checks) and the endpoint until ``cond`` holds for both."""
    deadline = time.monotonic() + timeout
    while True:
        snap = watch.poll()
        m = scrape(port)
        why = cond(snap, m)
        if why is True:
            return snap, m
        if time.monotonic() > deadline:
            raise watch.fail(f"timed out after {timeout:.0f}s waiting for {what}: {why}\n=== scrape ===\n{m.text}")
        time.sleep(0.3)


def test_metrics_follow_the_resources_through_a_move(api: Api, system: System) -> None:
    port = free_port()
    watch = Watch(api, system)
    for c in CAPTURES:
        system.capture(c)
    watch.until(lambda s: all(s.alive(c) for c in CAPTURES), "captures registered", 30)
    api.changefeed()
    api.table(1, pre_split=4)
    api.table(2)
    system.maintainer("m1", "--metrics-port", str(port), "--metrics-address", HOST)
    watch.until(lambda s: len(s.spans) == 5 and all_settled(s), "initial placement", SETTLE)

    # Settled: every span Replicating somewhere, nothing in flight, and the process-level series.
    def settled(snap: Snap, m: Scrape) -> str | bool:
        if m.get("leader", changefeed=CHANGEFEED) != 1:
            return "not reported as leader yet"
        if m.get("captures", state="alive") != len(CAPTURES):
            return f"captures alive: {m.get('captures', state='alive')}"
        if m.get("bootstrap_duration_seconds", changefeed=CHANGEFEED) is None:
            return "no bootstrap duration"
        if m.get("checkpoint_lag_seconds", changefeed=CHANGEFEED) is None:
            return "no checkpoint lag (checkpoint still 0)"
        covered = m.by("capture_report_covered", "capture", changefeed=CHANGEFEED, mode="default")
        if sum(covered.values()) != len({s.capture for s in snap.spans.values()}):
            return f"capture reports not all covering: {covered}"
        return agree(snap, m)

    snap, m = until_metrics(watch, port, settled, "the metrics of the settled changefeed")
    with watch.explained(snap):
        assert sum(m.by("spans", "state", changefeed=CHANGEFEED).values()) == 5
        assert m.by("operators_in_flight", "type", changefeed=CHANGEFEED) == Counter()
        assert (m.get("decisions_total") or 0) > 0
        assert (m.get("writes_total") or 0) > 0
        assert m.get("epoch", changefeed=CHANGEFEED) == snap.epoch
        assert m.get("bootstrap_restored_operators", changefeed=CHANGEFEED) == 0
        lag = m.get("checkpoint_lag_seconds", changefeed=CHANGEFEED)
        assert lag is not None
        assert -5 < lag < 120, lag
        assert m.get("informer_synced") == 1
        # The captures' reports: 5 dispatchers between them, each capture's lag and slowest span.
        reported = m.by("capture_reported_dispatchers", "capture", changefeed=CHANGEFEED, mode="default")
        assert sum(reported.values()) == 5, reported
        for (c,) in reported:
            capture_lag = m.get("capture_checkpoint_lag_seconds", changefeed=CHANGEFEED, mode="default", capture=c)
            assert capture_lag is not None
            assert -5 < capture_lag < 120, capture_lag
        slowest = [labels["span"] for labels, _ in m.samples.get(PREFIX + "slowest_span_lag_seconds", [])]
        assert slowest
        assert set(slowest) <= set(snap.spans), slowest
        state = (api.get("changefeeds", CHANGEFEED) or {})["status"]["scheduler"]["state"]
        assert m.get("scheduler_state", changefeed=CHANGEFEED, state=state) == 1

    # A user Move held in RemoveOrigin by the capture hook: reported in flight, in its stage.
    mover = sorted(snap.spans_of(1), key=lambda s: s.name)[0]
    target = next(c for c in CAPTURES if c != mover.capture)
    set_hooks(api, system, CAPTURES, hold_close="*")
    api.operator("op-move", "Move", [mover.name], target=target)

    def held(s: Snap) -> object:
        o = s.operators.get("op-move")
        return (o is not None and o.phase is OpPhase.RUNNING and o.stage is Stage.REMOVE_ORIGIN) or f"op-move: {o}"

    watch.until(held, "the Move held in RemoveOrigin", 30)

    def moving(snap: Snap, m: Scrape) -> str | bool:
        if m.get("operators_in_flight", changefeed=CHANGEFEED, type="Move", stage="RemoveOrigin") != 1:
            return "the Move is not reported in RemoveOrigin"
        return agree(snap, m)

    until_metrics(watch, port, moving, "the Move in flight")
    assert scrape(port).get("operator_duration_seconds_count", type="Move", outcome="Succeeded") is None

    # Released: it succeeds, and its duration is observed once.
    set_hooks(api, system, CAPTURES, hold_close=None)

    def moved(s: Snap) -> object:
        o = s.operators.get("op-move")
        if o is None or o.phase is not OpPhase.SUCCEEDED:
            return f"op-move: {o and (o.phase, o.stage)}"
        return all_settled(s)

    watch.until(moved, "the Move to succeed", SETTLE)

    def observed(snap: Snap, m: Scrape) -> str | bool:
        if m.get("operator_duration_seconds_count", type="Move", outcome="Succeeded") != 1:
            return "no Move duration observed"
        return agree(snap, m)

    snap, m = until_metrics(watch, port, observed, "the Move's duration")
    with watch.explained(snap):
        o = snap.operators["op-move"]
        assert snap.spans[mover.name].capture == target
        took = m.get("operator_duration_seconds_sum", type="Move", outcome="Succeeded")
        assert took is not None
        assert abs(took - (o.finished_at - (o.started_at or o.created))) < 0.01, (took, o.started_at, o.finished_at)
        assert m.get("operator_duration_seconds_bucket", type="Move", outcome="Succeeded", le="+Inf") == 1

    # The endpoint goes away with the process.
    rc = system.signal("m1", signal.SIGTERM)
    assert rc == 0, watch.fail(f"m1 exited with {rc} after SIGTERM")
    with socket.socket() as s:
        assert s.connect_ex((HOST, port)) != 0, "the metrics port is still open after the maintainer exited"


def test_a_busy_metrics_port_stops_the_maintainer(api: Api, system: System) -> None:
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = system.maintainer("m1", "--metrics-port", str(port), "--metrics-address", HOST)
        deadline = time.monotonic() + 60
        while proc.alive():
            assert time.monotonic() < deadline, f"the maintainer still runs\n{system.tails()}"
            time.sleep(0.2)
    assert proc.popen.returncode == 1
    assert proc.count("changefeed-maintainer: cannot serve metrics") == 1, system.tails()  # one line at the end
    assert proc.tail(1).strip().startswith("changefeed-maintainer: cannot serve metrics"), system.tails()
    assert proc.count("Traceback") == 0, system.tails()
