"""What the monitoring tests share: the chart rendered with helm, its alert rules and dashboard queries, the
metric names the maintainer's collector exports, the metric names a PromQL expression uses, and the Prometheus
binaries (Debian's, unpacked by hack/fetch-prometheus.sh).

The rules and the dashboard live once, in charts/changefeed-maintainer/monitoring/; everything here reads them
from there or from what helm renders of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "changefeed-maintainer"
ALERTS = CHART / "monitoring" / "alerts.yaml"
DASHBOARD = CHART / "monitoring" / "dashboard.json"
NAMESPACE = "cfm-system"  # the release namespace of every render here

Obj = dict[str, Any]


def binary(tool: str) -> Path:
    """prometheus or promtool: from CFM_PROMETHEUS_BIN (set by `make test`), .cache/prometheus/bin, or PATH.

    Missing: a failure when CFM_REQUIRE_PROMETHEUS=1 (`make test`, CI), else a skip that says what to run.
    """
    where = Path(os.environ.get("CFM_PROMETHEUS_BIN") or ROOT / ".cache" / "prometheus" / "bin")
    path = where / tool
    if path.is_file() and os.access(path, os.X_OK):
        return path
    found = shutil.which(tool)
    if found:
        return Path(found)
    message = (
        f"{tool} not found in {where} nor on PATH: run `make prometheus` (hack/fetch-prometheus.sh unpacks "
        "Debian's prometheus package into .cache/prometheus/bin)"
    )
    if os.environ.get("CFM_REQUIRE_PROMETHEUS") == "1":
        pytest.fail(message + "; CFM_REQUIRE_PROMETHEUS=1 makes this a failure")
    pytest.skip(message)


def helm() -> str:
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "fetch-helm.py")], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def render(*args: str) -> list[Obj]:
    """``helm template`` of the chart (release cfm in cfm-system) with these extra arguments."""
    out = subprocess.run(
        [helm(), "template", "cfm", str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def rule_groups(*args: str) -> list[Obj]:
    """The ``spec.groups`` of the PrometheusRule the chart renders (monitoring.prometheusRule.enabled)."""
    docs = render("--set", "monitoring.prometheusRule.enabled=true", *args)
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert len(rules) == 1, [d["kind"] for d in docs]
    return cast(list[Obj], rules[0]["spec"]["groups"])


def alerts(groups: list[Obj]) -> dict[str, Obj]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def alert_sources() -> list[Obj]:
    """monitoring/alerts.yaml: each alert's name, values key, expr (with placeholders) and annotations."""
    return cast(list[Obj], yaml.safe_load(ALERTS.read_text())["alerts"])


def dashboard() -> Obj:
    return cast(Obj, json.loads(DASHBOARD.read_text()))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, and of the template variables."""
    out: list[tuple[str, str]] = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", label_values_query(var["definition"])))
    return out


def label_values_query(definition: str) -> str:
    """``label_values(SELECTOR, label)`` (a Grafana variable) as the PromQL it runs: the selector."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition.strip())
    assert m, definition
    return m.group(1)


def grafana_to_promql(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard query as Grafana sends it, with every variable selecting everything."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace('=~"$namespace"', '=~".*"')
        .replace('=~"$changefeed"', '=~".*"')
    )


def exported_names() -> set[str]:
    """Every sample name the maintainer's registry exports (``<family>_total`` for counters, ``_bucket``,
    ``_count`` and ``_sum`` for histograms), from the collector itself: a Maintainer that is never started."""
    from controller.kube.client import Client
    from controller.maintainer.runner import Maintainer, Settings
    from controller.process import tenure

    # As the command line makes it: tenure on (a Settings made in code has it off), so its series are exported.
    settings = Settings(namespace="ns", identity="probe", gc_tenure=tenure.PERIOD)
    m = Maintainer(cast(Client, object()), settings)
    names: set[str] = set()
    for family in m.metrics.registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
        names.update(s.name for s in family.samples if not s.name.endswith("_created"))  # disabled in main()
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (parsed with promql-parser, not matched with a regex)."""
    import promql_parser

    names: set[str] = set()

    def walk(node: Any) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            if node.name:
                names.add(node.name)
            else:  # {__name__="..."}
                names.update(m.value for m in node.matchers.matchers if m.name == "__name__")
            return
        if kind == "MatrixSelector":
            walk(node.vector_selector)
            return
        for attr in ("expr", "lhs", "rhs", "param"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)
        for arg in getattr(node, "args", None) or []:
            walk(arg)

    walk(promql_parser.parse(expr))
    return names
