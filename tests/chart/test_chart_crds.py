"""The chart's CRD templates are exactly what hack/sync-chart-crds.py generates from crds/ (no helm needed;
`make chart-check` also compares what `helm template` renders)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "changefeed-maintainer"


def _sync() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_chart_crds", ROOT / "hack" / "sync-chart-crds.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_crds_are_generated_from_crds_dir() -> None:
    assert _sync().stale() == [], "run: python hack/sync-chart-crds.py"


def test_every_crd_is_kept_and_gated() -> None:
    templates = sorted((CHART / "templates" / "crds").glob("*.yaml"))
    assert [p.name for p in templates] == sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    for path in templates:
        text = path.read_text()
        assert "{{- if .Values.crds.enabled }}" in text, path
        assert text.rstrip().endswith("{{- end }}"), path
        assert "helm.sh/resource-policy: keep" in text, path


def test_default_values_satisfy_the_schema() -> None:
    import jsonschema  # type: ignore[import-untyped]

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


def test_every_value_is_documented() -> None:
    """helm-docs style: every leaf value has a `# --` comment block right above it, or sits inside a block
    (e.g. podSecurityContext) whose key has one."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- ") or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        documented = (j >= 0 and lines[j].strip().startswith("# --")) or any(d for _, d in stack)
        is_block = stripped.endswith(":")
        if not is_block and not documented:
            undocumented.append(f"values.yaml:{i + 1}: {stripped}")
        stack.append((indent, documented))
    assert undocumented == []
