"""What a real API server refuses in a CRD schema, found without one (controller/apiserver/crdcheck.py).

The int64 cases are the ones a real kube-apiserver v1.36 answered in ../shared/real-apiserver (probes
``int64max-*``): a maximum of 9223372036854775806 made every create fail, 2^53-1 did not.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.apiserver.crdcheck import RULE_COST_LIMIT, check_crd, main

ROOT = Path(__file__).resolve().parents[2]
CRDS = sorted((ROOT / "crds").glob("*.yaml"))
CHART_CRDS = sorted((ROOT / "charts" / "changefeed-maintainer" / "templates" / "crds").glob("*.yaml"))


def crd(spec_schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.test"},
        "spec": {
            "group": "example.test",
            "names": {"plural": "things", "kind": "Thing"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec_schema}}},
                }
            ],
        },
    }


def obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, **extra}


def messages(doc: dict[str, Any]) -> list[str]:
    return [str(p) for p in check_crd(doc)]


@pytest.mark.parametrize("path", CRDS, ids=lambda p: p.name)
def test_our_crds_pass(path: Path) -> None:
    assert messages(yaml.safe_load(path.read_text())) == []


def test_the_chart_ships_the_same_crds() -> None:
    # The chart's templates are generated from crds/ (make chart-check also checks them rendered).
    assert [p.name for p in CHART_CRDS] == [p.name for p in CRDS]


def test_the_tableid_bug_is_caught() -> None:
    """Regression (issue 10, item 1): the schema as it was failed every create on a real cluster."""
    tables = yaml.safe_load((ROOT / "crds" / "tables.yaml").read_text())
    old = copy.deepcopy(tables)
    table_id = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["tableID"]
    table_id["maximum"] = 9223372036854775806
    found = check_crd(old)
    assert len(found) == 1
    assert not found[0].at_create, "the API server accepts such a CRD..."
    assert found[0].message.endswith(  # ... and then refuses every Table with this message
        "Maximum boundary value must be of type integer with format int64 in spec.tableID"
    )


@pytest.mark.parametrize(
    ("bound", "fmt", "ok"),
    [
        (9223372036854775806, "int64", False),  # float64 2^63: the real server refused every create
        (9223372036854775807, "int64", False),
        (2**53 - 1, "int64", True),  # exact in float64: the real server accepted (probe int64max-2p53-cel)
        (9223372036854774784, "int64", True),  # the largest float64 below 2^63 (how the corpus was recorded)
        (2**31 - 1, "int32", True),
        (2**31, "int32", False),
        (1.5, "int64", False),
    ],
)
def test_integer_bounds_must_be_exact_int64(bound: float, fmt: str, ok: bool) -> None:
    doc = crd(obj({"n": {"type": "integer", "format": fmt, "maximum": bound}}))
    assert (messages(doc) == []) is ok, messages(doc)


def test_non_structural_schema() -> None:
    """As the probe crd-non-structural: a property without a type."""
    assert messages(crd(obj({"a": {"description": "no type"}}))) == [
        "spec.validation.openAPIV3Schema.properties[spec].properties[a].type: "
        "Required value: must not be empty for specified object fields"
    ]
    assert messages(crd(obj({"a": {"x-kubernetes-preserve-unknown-fields": True}}))) == []


def test_cel_that_does_not_compile() -> None:
    """As the probe crd-bad-cel: ``self.a ===``."""
    (problem,) = check_crd(
        crd(obj({"a": {"type": "string"}}, **{"x-kubernetes-validations": [{"rule": "self.a ==="}]}))
    )
    assert problem.path == "spec.validation.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule"
    assert "compilation failed" in problem.message


def test_rule_reason_and_field_path() -> None:
    rules = [
        {"rule": "self.a != ''", "reason": "Bogus"},
        {"rule": "self.a != ''", "fieldPath": ".missing"},
        {"rule": "self.a != ''", "fieldPath": "a"},
        {"rule": "self.a != ''", "reason": "FieldValueForbidden", "fieldPath": ".a"},
    ]
    found = messages(crd(obj({"a": {"type": "string", "maxLength": 8}}, **{"x-kubernetes-validations": rules})))
    assert len(found) == 3
    assert "x-kubernetes-validations[0].reason: Unsupported value" in found[0]
    assert "x-kubernetes-validations[1].fieldPath" in found[1]
    assert "does not refer to a valid field" in found[1]
    assert "must be a valid relative JSON path" in found[2]


def test_old_self_needs_a_correlatable_value() -> None:
    items = {"type": "string", "maxLength": 8, "x-kubernetes-validations": [{"rule": "self == oldSelf"}]}
    plain = crd(obj({"l": {"type": "array", "maxItems": 4, "items": items}}))
    (problem,) = check_crd(plain)
    assert "oldSelf cannot be used on the uncorrelatable portion" in problem.message
    as_set = crd(obj({"l": {"type": "array", "maxItems": 4, "items": items, "x-kubernetes-list-type": "set"}}))
    assert messages(as_set) == []


def test_list_and_map_types() -> None:
    keyed = {"type": "object", "properties": {"k": {"type": "string"}}}
    assert 'must not be empty if x-kubernetes-list-type is "map"' in " ".join(
        messages(crd(obj({"l": {"type": "array", "items": keyed, "x-kubernetes-list-type": "map"}})))
    )
    no_default = {"type": "array", "items": keyed, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["k"]}
    assert "must have a default or be a required property" in " ".join(messages(crd(obj({"l": no_default}))))
    good = copy.deepcopy(no_default)
    good["items"]["required"] = ["k"]
    assert messages(crd(obj({"l": good}))) == []
    objects_set = {"type": "array", "items": keyed, "x-kubernetes-list-type": "set"}
    assert "must be atomic" in " ".join(messages(crd(obj({"l": objects_set}))))
    assert "Unsupported value" in " ".join(messages(crd(obj({"l": {"type": "array", "x-kubernetes-list-type": "x"}}))))


def test_an_unbounded_comprehension_is_over_budget() -> None:
    rule = [{"rule": "self.all(x, x.startsWith('a'))"}]
    unbounded = crd(obj({"l": {"type": "array", "items": {"type": "string"}, "x-kubernetes-validations": rule}}))
    found = [p.message for p in check_crd(unbounded)]
    assert any("estimated rule cost exceeds budget" in m for m in found), found
    assert any("total CRD cost exceeds budget" in m for m in found), found
    bounded = crd(
        obj(
            {
                "l": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {"type": "string", "maxLength": 64},
                    "x-kubernetes-validations": rule,
                }
            }
        )
    )
    assert messages(bounded) == []
    assert RULE_COST_LIMIT == 10_000_000  # kube-apiserver's StaticEstimatedCostLimit


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(crd(obj({"n": {"type": "integer", "maximum": 9223372036854775806}}))))
    assert main([str(p) for p in CRDS]) == 0
    assert main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "bad.yaml: CustomResourceDefinition things.example.test: " in out
    assert "every create of its kind fails" in out


def test_metadata_may_restrict_only_name_and_generate_name() -> None:
    def crd(metadata: dict[str, object]) -> dict[str, object]:
        schema = {"type": "object", "properties": {"metadata": metadata, "spec": {"type": "object"}}}
        return {
            "metadata": {"name": "things.example.com"},
            "spec": {
                "group": "example.com",
                "names": {"plural": "things", "kind": "Thing"},
                "scope": "Namespaced",
                "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}],
            },
        }

    ok = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 63}}}
    assert not [p for p in check_crd(crd(ok)) if "metadata" in str(p)]
    bad = {"type": "object", "properties": {"labels": {"type": "object"}}}
    assert any("must not specify anything other than name and generateName" in str(p) for p in check_crd(crd(bad)))
