#!/usr/bin/env python3
"""Validate rendered manifests offline: Kubernetes kinds against the Kubernetes OpenAPI schemas, our own kinds
against our CRDs, plus the chart's promises.

* Built-in kinds (Deployment, Role, CustomResourceDefinition, ...): ``kubernetes-validate`` (strict: unknown
  fields are errors) for ``--kube-version``.
* Our kinds (group cdc.maintainer.dev): the ``openAPIV3Schema`` of the matching CRD in ``crds/``, as JSON Schema
  (x-kubernetes-* dropped, undeclared properties refused, as the API server would prune them).
* The Prometheus operator's kinds (group monitoring.coreos.com: PodMonitor, PrometheusRule): the JSON-schema
  validators of the npm package @kubernetes-models/prometheus-operator (``--po-schemas``: where
  hack/fetch-po-schemas.sh installed it), run by hack/validate-prometheus-operator.mjs.
* ``--chart`` (output of ``helm template``): rendered CRDs equal ``crds/`` except for the metadata the chart adds,
  and carry ``helm.sh/resource-policy: keep``; every container is hardened (non-root numeric user, read-only
  root, no privilege escalation, ALL capabilities dropped, RuntimeDefault seccomp) and has resources; the
  maintainer Deployment's strategy is Recreate for one replica, RollingUpdate otherwise; no ClusterRole.
  The monitoring objects (all four with ``--expect-monitoring``, else none): the PodMonitor selects the
  maintainer pods and scrapes their ``metrics`` port; the PodDisruptionBudget selects them, with more than one
  replica only; the dashboard ConfigMap holds JSON and the sidecar's label; every alert has a severity and a
  runbook_url, and the rules pass ``promtool check rules`` (``--promtool``).

    python hack/validate-manifests.py [--kube-version 1.33.0] [--chart] [--expect-crds N] [--expect-monitoring]
        [--po-schemas DIR] [--promtool PATH] FILE...
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
GROUP = "cdc.maintainer.dev"
MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_KINDS = ("PodMonitor", "PrometheusRule", "PodDisruptionBudget", "ConfigMap")
KEEP = "helm.sh/resource-policy"


def source_crds() -> dict[str, dict[str, Any]]:
    crds = (yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml")))
    return {c["metadata"]["name"]: c for c in crds}


def json_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if "properties" in out and "type" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [json_schema(v) for v in node]
    return node


def custom_errors(doc: dict[str, Any], crds: dict[str, dict[str, Any]]) -> list[str]:
    group, _, version = doc["apiVersion"].partition("/")
    for crd in crds.values():
        if crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == doc["kind"]:
            for v in crd["spec"]["versions"]:
                if v["name"] == version:
                    validator = jsonschema.Draft7Validator(json_schema(v["schema"]["openAPIV3Schema"]))
                    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                            for e in validator.iter_errors(doc)]  # fmt: skip
            return [f"CRD {crd['metadata']['name']} serves no version {version}"]
    return [f"no CRD in crds/ for {doc['apiVersion']} {doc['kind']}"]


def builtin_errors(doc: dict[str, Any], kube_version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path) or "<root>"
        return [f"{path}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no Kubernetes {kube_version} schema for {doc.get('apiVersion')} {doc.get('kind')}: {exc}"]
    return []


def operator_errors(docs: list[dict[str, Any]], po_schemas: str | None) -> list[list[str]]:
    """Errors of each Prometheus-operator object, from the npm package's validators (hack/fetch-po-schemas.sh)."""
    if not docs:
        return []
    node = shutil.which("node")
    if po_schemas is None or not Path(po_schemas, "node_modules").is_dir() or node is None:
        why = "no --po-schemas" if po_schemas is None else f"nothing installed in {po_schemas}" if node else "no node"
        return [[f"cannot validate against the Prometheus operator's schemas ({why}): run hack/fetch-po-schemas.sh"]
                for _ in docs]  # fmt: skip
    script = ROOT / "hack" / "validate-prometheus-operator.mjs"
    out = subprocess.run([node, str(script), po_schemas], input=json.dumps(docs), capture_output=True, text=True)
    if out.returncode != 0:
        return [[f"{script.name} failed: {out.stderr.strip()}"] for _ in docs]
    errors: list[list[str]] = json.loads(out.stdout)
    return errors


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    want = selector.get("matchLabels") or {}
    return bool(want) and not selector.get("matchExpressions") and all(labels.get(k) == v for k, v in want.items())


def monitoring_errors(docs: list[dict[str, Any]], expect: set[str], promtool: str | None) -> list[str]:
    """The monitoring objects: exactly the ``expect``ed kinds, once each, consistent with the maintainer pods."""
    problems: list[str] = []
    found = {kind: [d for d in docs if d["kind"] == kind] for kind in MONITORING_KINDS}
    found["ConfigMap"] = [d for d in found["ConfigMap"] if any(k.endswith(".json") for k in d.get("data") or {})]
    # The captures' budget (capture.podDisruptionBudget, on by default) is not the maintainer's: checked on its own.
    captures = [d for d in found["PodDisruptionBudget"] if d["metadata"]["name"].endswith("-capture")]
    found["PodDisruptionBudget"] = [d for d in found["PodDisruptionBudget"] if d not in captures]
    statefulsets = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-capture")]
    for pdb in captures:
        sts = statefulsets[0] if len(statefulsets) == 1 else None
        if sts is None or not selects(pdb["spec"].get("selector") or {}, sts["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']}: does not select the capture pods")
        elif sts["spec"].get("replicas", 1) < 2:
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']}: rendered for fewer than two captures")
    for kind, objs in found.items():
        if len(objs) != (1 if kind in expect else 0):
            problems.append(f"expected {1 if kind in expect else 0} {kind}, rendered {len(objs)}")
    deployments = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-maintainer")]
    if len(deployments) != 1:
        return [*problems, f"expected one maintainer Deployment, rendered {len(deployments)}"]
    deployment = deployments[0]
    pod_labels = deployment["spec"]["template"]["metadata"].get("labels") or {}
    ports = {p.get("name") for c in containers(deployment) for p in c.get("ports") or []}
    for pm in found["PodMonitor"]:
        if not selects(pm["spec"].get("selector") or {}, pod_labels):
            problems.append(f"PodMonitor {pm['metadata']['name']}: its selector does not select the maintainer pods")
        for ep in pm["spec"].get("podMetricsEndpoints") or []:
            if ep.get("port") not in ports:
                problems.append(f"PodMonitor {pm['metadata']['name']}: port {ep.get('port')!r} is no maintainer port")
    for pdb in found["PodDisruptionBudget"]:
        if not selects(pdb["spec"].get("selector") or {}, pod_labels):
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']}: does not select the maintainer pods")
        if deployment["spec"].get("replicas", 1) < 2:
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']}: rendered for fewer than two replicas")
    for cm in found["ConfigMap"]:
        problems += dashboard_errors(cm)
    for rule in found["PrometheusRule"]:
        problems += rule_errors(rule, promtool)
    return problems


def dashboard_errors(cm: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    for key, text in cm["data"].items():
        try:
            dashboard = json.loads(text)
        except ValueError as exc:
            problems.append(f"ConfigMap {cm['metadata']['name']}: {key} is not JSON: {exc}")
            continue
        if not dashboard.get("panels") or not dashboard.get("uid"):
            problems.append(f"ConfigMap {cm['metadata']['name']}: {key} is no Grafana dashboard (no uid or panels)")
    return problems


def rule_errors(rule: dict[str, Any], promtool: str | None) -> list[str]:
    problems: list[str] = []
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            if not (r.get("labels") or {}).get("severity") or not (r.get("annotations") or {}).get("runbook_url"):
                problems.append(f"PrometheusRule alert {r.get('alert')}: needs a severity label and a runbook_url")
    if promtool is None:
        problems.append("no --promtool: the rules were not checked with promtool check rules")
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
            f.flush()
            out = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
        if out.returncode != 0:
            problems.append(f"promtool check rules: {out.stdout.strip()} {out.stderr.strip()}")
    return problems


def containers(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    yield from spec.get("initContainers", []) or []
    yield from spec.get("containers", []) or []


def chart_errors(docs: list[dict[str, Any]], crds: dict[str, dict[str, Any]], expect_crds: int | None) -> list[str]:
    problems: list[str] = []
    rendered = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    if expect_crds is not None and len(rendered) != expect_crds:
        problems.append(f"expected {expect_crds} CRDs, rendered {len(rendered)}")
    for crd in rendered:
        name = crd["metadata"]["name"]
        if (crd["metadata"].get("annotations") or {}).get(KEEP) != "keep":
            problems.append(f"CRD {name}: no {KEEP}: keep annotation")
        src = crds.get(name)
        if src is None:
            problems.append(f"CRD {name}: not in crds/")
            continue
        strip = {k: v for k, v in crd.items() if k != "metadata"}
        if strip != {k: v for k, v in src.items() if k != "metadata"} or crd["metadata"]["name"] != name:
            problems.append(f"CRD {name}: differs from crds/ (run hack/sync-chart-crds.py)")
        extra = set(crd["metadata"]) - {"name", "annotations", "labels"}
        if extra or set(src["metadata"]) != {"name"}:
            problems.append(f"CRD {name}: unexpected metadata {sorted(extra | (set(src['metadata']) - {'name'}))}")
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            problems.append(f"{where}: the chart must stay namespaced")
        if doc["kind"] == "Role":
            for rule in doc.get("rules", []):
                if "*" in rule.get("verbs", []) or "*" in rule.get("resources", []):
                    problems.append(f"{where}: wildcard rule {rule}")
                if "resourceNames" in rule and not rule["resourceNames"]:
                    problems.append(f"{where}: empty resourceNames means every name: {rule}")
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        psc = pod.get("securityContext") or {}
        if not psc.get("runAsNonRoot") or (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: pod securityContext must set runAsNonRoot and seccompProfile RuntimeDefault")
        for c in containers(doc):
            sc = c.get("securityContext") or {}
            user = sc.get("runAsUser", psc.get("runAsUser"))
            checks = {
                "numeric non-root runAsUser": isinstance(user, int) and user > 0,
                "readOnlyRootFilesystem": sc.get("readOnlyRootFilesystem") is True,
                "allowPrivilegeEscalation false": sc.get("allowPrivilegeEscalation") is False,
                "capabilities drop ALL": "ALL" in ((sc.get("capabilities") or {}).get("drop") or []),
                "resources.requests": bool((c.get("resources") or {}).get("requests")),
            }
            problems += [f"{where} container {c['name']}: {what}" for what, ok in checks.items() if not ok]
        if doc["kind"] == "Deployment":
            want = "Recreate" if doc["spec"].get("replicas", 1) == 1 else "RollingUpdate"
            if doc["spec"].get("strategy", {}).get("type") != want:
                problems.append(f"{where}: strategy must be {want} for {doc['spec'].get('replicas')} replicas")
            if not any(c.get("livenessProbe") for c in containers(doc)):
                problems.append(f"{where}: no liveness probe")
        if doc["kind"] in ("Deployment", "StatefulSet") and not all(c.get("readinessProbe") for c in containers(doc)):
            problems.append(f"{where}: a container without a readiness probe (helm --wait would not mean working)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--kube-version", default="1.33.0")
    p.add_argument("--chart", action="store_true", help="also check the chart's promises (helm template output)")
    p.add_argument("--expect-crds", type=int, default=None)
    p.add_argument("--expect-monitoring", default="", help=f"comma-separated, of {', '.join(MONITORING_KINDS)}")
    p.add_argument("--po-schemas", default=None, help="where hack/fetch-po-schemas.sh installed the operator's schemas")
    p.add_argument("--promtool", default=None, help="promtool, for `promtool check rules` (with --chart)")
    a = p.parse_args(argv)
    crds = source_crds()
    problems: list[str] = []
    docs: list[dict[str, Any]] = []
    operator_docs: list[tuple[str, dict[str, Any]]] = []
    for f in a.files:
        for doc in yaml.safe_load_all(Path(f).read_text()):
            if not doc:
                continue
            docs.append(doc)
            where = f"{f}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            group = doc.get("apiVersion", "").split("/")[0]
            if group == GROUP:
                errors = custom_errors(doc, crds)
            elif group == MONITORING_GROUP:
                operator_docs.append((where, doc))
                continue
            else:
                errors = builtin_errors(doc, a.kube_version)
            problems += [f"{where}: {e}" for e in errors]
    operator_problems = operator_errors([d for _, d in operator_docs], a.po_schemas)
    for (where, _), errors in zip(operator_docs, operator_problems, strict=True):
        problems += [f"{where}: {e}" for e in errors]
    if a.chart:
        problems += chart_errors(docs, crds, a.expect_crds)
        expect = {k for k in a.expect_monitoring.split(",") if k}
        if expect - set(MONITORING_KINDS):
            p.error(f"--expect-monitoring: unknown kinds {sorted(expect - set(MONITORING_KINDS))}")
        problems += monitoring_errors(docs, expect, a.promtool)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(docs)} manifests in {len(a.files)} file(s): {'INVALID' if problems else 'valid'} "
          f"(Kubernetes {a.kube_version} schemas, strict; CRDs from crds/"
          f"{'; Prometheus operator schemas from npm' if operator_docs else ''})")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
