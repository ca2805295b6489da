"""The alert rules and the dashboard, as the chart renders them: only metrics that exist, promtool's checks and
unit tests of every alert (tests/monitoring/alerts.test.yaml), thresholds from the values, and the docs in step
(a runbook entry per alert in docs/operations.md, every exported metric in docs/metrics.md).

The live counterpart, a real Prometheus scraping a running maintainer, is tests/integration/test_prometheus.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring.tools import (
    NAMESPACE,
    ROOT,
    alert_sources,
    alerts,
    binary,
    dashboard,
    dashboard_queries,
    exported_names,
    grafana_to_promql,
    metric_names,
    rule_groups,
)

HERE = Path(__file__).resolve().parent
OPERATIONS = ROOT / "docs" / "operations.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"


def unknown_metrics(exprs: list[tuple[str, str]], known: set[str]) -> list[str]:
    return [f"{where}: {name} (in {expr})" for where, expr in exprs for name in sorted(metric_names(expr) - known)]


def test_the_rules_and_the_dashboard_name_only_exported_metrics() -> None:
    known = exported_names()
    rules = [(f"alert {name}", r["expr"]) for name, r in alerts(rule_groups()).items()]
    queries = [(f"panel {title}", grafana_to_promql(expr)) for title, expr in dashboard_queries()]
    assert len(rules) == len(alert_sources()) == 10
    assert unknown_metrics(rules, known) == []
    assert unknown_metrics(queries, known) == []
    # Every metric of the maintainer is on the dashboard (process_* and python_* only where useful).
    used = set().union(*(metric_names(q) for _, q in queries))
    ours = {n for n in known if n.startswith("changefeed_maintainer_")}
    assert (
        ours
        - used
        - {
            "changefeed_maintainer_checkpoint_timestamp_seconds",  # the lag, as the maintainer computes it, is shown
            "changefeed_maintainer_bootstrap_repairs",
            "changefeed_maintainer_operator_duration_seconds_sum",
            "changefeed_maintainer_leader",  # in the "Not led" stat
        }
        <= set()
    ), sorted(ours - used)


def test_a_query_that_names_a_metric_the_collector_does_not_export_is_caught() -> None:
    known = exported_names()
    bad = [
        ("typo", "max by (changefeed) (changefeed_maintainer_checkpoint_lag{namespace='x'}) > 1"),
        ("renamed", "sum(rate(changefeed_maintainer_decisions[5m])) and on () changefeed_maintainer_leader"),
    ]
    assert unknown_metrics(bad, known) == [
        "typo: changefeed_maintainer_checkpoint_lag (in max by (changefeed) "
        "(changefeed_maintainer_checkpoint_lag{namespace='x'}) > 1)",
        "renamed: changefeed_maintainer_decisions (in sum(rate(changefeed_maintainer_decisions[5m])) and on () "
        "changefeed_maintainer_leader)",
    ]


def test_thresholds_windows_and_durations_come_from_the_values() -> None:
    default = alerts(rule_groups())
    assert default["ChangefeedCheckpointLagHigh"]["expr"].endswith("> 600")
    assert default["ChangefeedCheckpointLagHigh"]["for"] == "5m"
    assert f'namespace="{NAMESPACE}"' in default["ChangefeedNotLed"]["expr"]
    changed = alerts(
        rule_groups(
            "--set-json", "monitoring.prometheusRule.alerts.checkpointLag.threshold=42.5",
            "--set", "monitoring.prometheusRule.alerts.checkpointLag.for=90s",
            "--set", "monitoring.prometheusRule.alerts.loopCrashes.window=1h",
            "--set", "monitoring.prometheusRule.alerts.capturesLost.enabled=false",
            "--set", "monitoring.prometheusRule.alerts.notLed.severity=page",
            "--set", "monitoring.prometheusRule.additionalLabels.team=data",
            "--set", 'monitoring.prometheusRule.selector=job="cfm"',
        )
    )  # fmt: skip
    lag = changed["ChangefeedCheckpointLagHigh"]
    want = 'max by (namespace, changefeed) (changefeed_maintainer_checkpoint_lag_seconds{job="cfm"}) > 42.5'
    assert lag["expr"] == want
    assert lag["for"] == "90s"
    assert "more than 42.5 seconds" in lag["annotations"]["summary"]
    assert "[1h]" in changed["ChangefeedMaintainerLoopCrashing"]["expr"]
    assert "ChangefeedCapturesLost" not in changed
    assert changed["ChangefeedNotLed"]["labels"] == {"severity": "page", "team": "data"}


def test_promtool_checks_the_rules_and_runs_their_unit_tests(tmp_path: Path) -> None:
    promtool = binary("promtool")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    shutil.copy(HERE / "alerts.test.yaml", tmp_path / "alerts.test.yaml")
    check = subprocess.run([str(promtool), "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 10 rules found" in check.stdout, check.stdout
    test = subprocess.run(
        [str(promtool), "test", "rules", "alerts.test.yaml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout, test.stdout


def test_every_alert_has_unit_tests_that_fire_it_and_keep_it_quiet() -> None:
    spec = yaml.safe_load((HERE / "alerts.test.yaml").read_text())
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alert_sources()}
    assert fires == names, f"never seen firing: {sorted(names - fires)}"
    assert quiet == names, f"never seen quiet: {sorted(names - quiet)}"


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings (lower case, spaces to dashes, punctuation dropped)."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_each_alert_has_a_runbook_entry_and_its_url_points_there() -> None:
    text = OPERATIONS.read_text()
    rendered = alerts(rule_groups())
    for source in alert_sources():
        name = source["alert"]
        assert name.lower() in anchors(text), f"docs/operations.md has no section '### {name}'"
        url = rendered[name]["annotations"]["runbook_url"]
        assert url.endswith("docs/operations.md#" + name.lower()), url
        section = text.split(f"### {name}", 1)[1].split("\n### ", 1)[0]
        for part in ("**Means**", "**Do**"):
            assert part in section, f"docs/operations.md, {name}: no {part}"
        assert f"alerts.{source['key']}" in section, f"docs/operations.md, {name}: which values tune it"
    documented = set(re.findall(r"^### (Changefeed\w+)", text, re.M))
    assert documented == {a["alert"] for a in alert_sources()}


def test_every_exported_metric_is_documented() -> None:
    text = METRICS_DOC.read_text()
    prefix = "changefeed_maintainer_"
    families = {
        re.sub(r"_(total|bucket|count|sum)$", "", n)[len(prefix) :] for n in exported_names() if n.startswith(prefix)
    }
    families |= {"operator_duration_seconds"}
    missing = [f for f in sorted(families) if f"`{f}`" not in text and f"`{f}_total`" not in text]
    assert missing == []


def test_the_dashboard_is_a_grafana_dashboard_with_a_datasource_variable() -> None:
    d = dashboard()
    assert d["uid"] == "changefeed-maintainer"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.parametrize("source", alert_sources(), ids=lambda a: a["alert"])
def test_alert_sources_are_complete(source: dict[str, str]) -> None:
    assert set(source) == {"alert", "key", "expr", "summary", "description"}
    assert source["alert"].startswith("Changefeed")


def test_a_missing_prometheus_fails_when_required_and_skips_with_a_message_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CFM_PROMETHEUS_BIN", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CFM_REQUIRE_PROMETHEUS", "1")
    with pytest.raises(pytest.fail.Exception, match="make prometheus"):
        binary("promtool")
    monkeypatch.delenv("CFM_REQUIRE_PROMETHEUS")
    with pytest.raises(pytest.skip.Exception, match="make prometheus"):
        binary("promtool")
