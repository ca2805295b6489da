#!/usr/bin/env python3
"""Validate rendered manifests offline: Kubernetes kinds against the Kubernetes OpenAPI schemas, our own kinds
against our CRDs, plus the chart's promises.

* Built-in kinds (Deployment, Role, CustomResourceDefinition, ...): ``kubernetes-validate`` (strict: unknown
  fields are errors) for ``--kube-version``.
* Our kinds (group cdc.maintainer.dev): the ``openAPIV3Schema`` of the matching CRD in ``crds/``, as JSON Schema
  (x-kubernetes-* dropped, undeclared properties refused, as the API server would prune them).
* ``--chart`` (output of ``helm template``): rendered CRDs equal ``crds/`` except for the metadata the chart adds,
  and carry ``helm.sh/resource-policy: keep``; every container is hardened (non-root numeric user, read-only
  root, no privilege escalation, ALL capabilities dropped, RuntimeDefault seccomp) and has resources; the
  maintainer Deployment's strategy is Recreate for one replica, RollingUpdate otherwise; no ClusterRole.

    python hack/validate-manifests.py [--kube-version 1.33.0] [--chart] [--expect-crds N] FILE...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
GROUP = "cdc.maintainer.dev"
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
    a = p.parse_args(argv)
    crds = source_crds()
    problems: list[str] = []
    docs: list[dict[str, Any]] = []
    for f in a.files:
        for doc in yaml.safe_load_all(Path(f).read_text()):
            if not doc:
                continue
            docs.append(doc)
            where = f"{f}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            if doc.get("apiVersion", "").split("/")[0] == GROUP:
                errors = custom_errors(doc, crds)
            else:
                errors = builtin_errors(doc, a.kube_version)
            problems += [f"{where}: {e}" for e in errors]
    if a.chart:
        problems += chart_errors(docs, crds, a.expect_crds)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(docs)} manifests in {len(a.files)} file(s): {'INVALID' if problems else 'valid'} "
          f"(Kubernetes {a.kube_version} schemas, strict; CRDs from crds/)")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
