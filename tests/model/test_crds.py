"""The CRDs in crds/ and the examples in examples/: structure, agreement with the model, CEL rules."""

from __future__ import annotations

import copy
import enum
import itertools
import re
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, Field, fields, is_dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import celpy
import jsonschema
import pytest
import yaml
from celpy.adapter import json_to_cel

from controller.model import (
    Capture,
    Changefeed,
    Dispatcher,
    DispatcherState,
    KeyRange,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    Span,
    SpanOperator,
    SpanState,
    Stage,
    Table,
)
from controller.model.records import Record
from controller.model.resources import (
    CHANGEFEED_LABEL,
    TABLE_STATES,
    capture_from_resources,
    from_resource,
    lease_resource,
    resource_paths,
    status_of,
    to_resource,
)
from controller.model.states import GROUP, VERSION

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
EXAMPLES = ROOT / "examples"
KINDS: dict[str, type[Record]] = {
    "changefeeds": Changefeed,
    "tables": Table,
    "spans": Span,
    "dispatchers": Dispatcher,
    "spanoperators": SpanOperator,
    "captures": Capture,
}
#: Built-in resource names and short names a CRD must not shadow (`kubectl get <x>`).
BUILTIN_NAMES = {
    "all", "cm", "configmaps", "cj", "cronjobs", "cs", "csr", "crd", "crds", "deploy", "deployments", "ds",
    "daemonsets", "ep", "endpoints", "ev", "events", "hpa", "ing", "ingresses", "jobs", "leases", "limits",
    "netpol", "no", "nodes", "ns", "namespaces", "pc", "pdb", "po", "pods", "pv", "pvc", "quota", "rc", "rs",
    "sa", "sc", "secrets", "sts", "svc", "services", "roles", "rolebindings",
}  # fmt: skip
SCHEMA_KEYS = {
    "type",
    "description",
    "properties",
    "required",
    "items",
    "enum",
    "default",
    "format",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}
FORMATS = {"string": {"date-time"}, "integer": {"int32", "int64"}, "number": {"double"}}
METADATA_FIELDS = {"name": "string", "namespace": "string", "creationTimestamp": "date-time", "uid": "string"}


def load_crd(plural: str) -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((CRD_DIR / f"{plural}.yaml").read_text())
    return crd


@cache
def schema_of(kind: str) -> dict[str, Any]:
    for plural in KINDS:
        crd = load_crd(plural)
        if crd["spec"]["names"]["kind"] == kind:
            schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            return schema
    raise AssertionError(f"no CRD declares kind {kind}")


def json_schema(node: Any, strict: bool = True) -> Any:
    """OpenAPI -> JSON Schema: drop x-kubernetes-*; strict: refuse undeclared properties (the API server
    would prune them silently, which is what we want to catch)."""
    if isinstance(node, dict):
        # metadata is never pruned (a CRD may only restrict its name): not strict under it
        out = {
            k: json_schema(v, strict and k != "metadata") for k, v in node.items() if not k.startswith("x-kubernetes-")
        }
        if strict and "properties" in out and "type" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [json_schema(v, strict) for v in node]
    return node


def validation_errors(obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(json_schema(schema_of(obj["kind"])))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any], bool]]:
    """Every schema node: (path, node, under_list_items)."""

    def go(n: dict[str, Any], p: str, in_list: bool) -> Iterator[tuple[str, dict[str, Any], bool]]:
        yield p, n, in_list
        for name, sub in n.get("properties", {}).items():
            yield from go(sub, f"{p}.{name}", in_list)
        if isinstance(n.get("items"), dict):
            yield from go(n["items"], f"{p}[]", True)

    yield from go(node, path, False)


def declared(schema: dict[str, Any], path: Sequence[str | int]) -> dict[str, Any] | None:
    """The schema node at ``path`` of an object (ints step into list items), or None if undeclared."""
    node = schema
    for step in path:
        if isinstance(step, int):
            if node.get("type") != "array":
                return None
            node = node["items"]
        else:
            props = node.get("properties")
            if props is None or step not in props:
                return None
            node = props[step]
    return node


def leaf_paths(value: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from leaf_paths(v, (*path, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from leaf_paths(v, (*path, i))
    else:
        yield path


# --------------------------------------------------------------------------------------------------
# The CRD files themselves


def test_one_crd_per_kind() -> None:
    assert sorted(p.stem for p in CRD_DIR.glob("*.yaml")) == sorted(KINDS)


@pytest.mark.parametrize("plural", sorted(KINDS))
def test_crd_header(plural: str) -> None:
    crd = load_crd(plural)
    kind = KINDS[plural].KIND.value
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == f"{plural}.{GROUP}"
    spec = crd["spec"]
    assert spec["group"] == GROUP
    assert spec["scope"] == "Namespaced"
    names = spec["names"]
    assert names["kind"] == kind
    assert names["listKind"] == f"{kind}List"
    assert names["plural"] == plural
    assert names["singular"] == kind.lower()
    assert "cdc" in names["categories"]
    assert names["shortNames"]
    assert [v["name"] for v in spec["versions"]] == [VERSION]
    version = spec["versions"][0]
    assert version["served"] is True
    assert version["storage"] is True
    assert version["subresources"] == {"status": {}}
    assert "Age" in [c["name"] for c in version["additionalPrinterColumns"]]


def test_names_do_not_clash() -> None:
    seen: dict[str, str] = {}
    for plural in KINDS:
        names = load_crd(plural)["spec"]["names"]
        for name in [names["plural"], names["singular"], *names["shortNames"]]:
            assert name not in BUILTIN_NAMES, f"{plural}: {name} shadows a built-in resource"
            assert seen.setdefault(name, plural) == plural, f"{name} is used by {seen[name]} and {plural}"


@pytest.mark.parametrize("plural", sorted(KINDS))
def test_schema_is_structural(plural: str) -> None:
    schema = load_crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["type"] == "object"
    assert {"apiVersion", "kind", "metadata", "spec", "status"} <= set(schema["properties"])
    # No constraints on metadata but the only ones a CRD may have (name, generateName): a Changefeed's name must
    # fit in a label value.
    name_limit = (
        {"properties": {"name": {"type": "string", "maxLength": 63, "description": ANY}}}
        if plural == "changefeeds"
        else {}
    )
    assert schema["properties"]["metadata"] == {"type": "object", **name_limit}
    problems: list[str] = []
    for path, node, in_list in walk(schema):
        if path == ".metadata":
            continue
        where = f"{plural}{path or ' (root)'}"
        unknown = set(node) - SCHEMA_KEYS
        if unknown:
            problems.append(f"{where}: unknown keys {sorted(unknown)}")
        type_ = node.get("type")
        if type_ not in {"object", "array", "string", "integer", "number", "boolean"}:
            problems.append(f"{where}: no or bad type {type_!r}")
        if not node.get("description"):
            problems.append(f"{where}: no description")
        if type_ == "object":
            if not node.get("properties"):
                problems.append(f"{where}: object without properties")
            missing = set(node.get("required", [])) - set(node.get("properties", {}))
            if missing:
                problems.append(f"{where}: required {sorted(missing)} not declared")
        if type_ == "array" and not isinstance(node.get("items"), dict):
            problems.append(f"{where}: array without items")
        if "format" in node and node["format"] not in FORMATS.get(type_ or "", set()):
            problems.append(f"{where}: format {node['format']!r} on {type_}")
        for value in node.get("enum", []):
            if not isinstance(value, str) or not value:
                problems.append(f"{where}: enum value {value!r} is not a non-empty string")
        if "default" in node:
            bare = {k: v for k, v in node.items() if k != "default"}
            errors = list(jsonschema.Draft7Validator(json_schema(bare)).iter_errors(node["default"]))
            if errors:
                problems.append(f"{where}: default {node['default']!r} is invalid: {errors[0].message}")
        list_type = node.get("x-kubernetes-list-type")
        if list_type == "map":
            items = node["items"]
            for key in node.get("x-kubernetes-list-map-keys", []):
                if key not in items.get("required", []):
                    problems.append(f"{where}: map key {key} is not required")
                if items["properties"][key]["type"] not in {"string", "integer", "boolean"}:
                    problems.append(f"{where}: map key {key} is not scalar")
        elif list_type == "set" and node["items"]["type"] not in {"string", "integer", "boolean", "number"}:
            problems.append(f"{where}: set of non-scalars")
        elif list_type not in (None, "atomic", "map", "set"):
            problems.append(f"{where}: list type {list_type!r}")
        for rule in node.get("x-kubernetes-validations", []):
            if not rule.get("message"):
                problems.append(f"{where}: rule {rule['rule']!r} has no message")
            if "oldSelf" in rule["rule"] and in_list:
                problems.append(f"{where}: transition rule inside a list cannot be correlated")
            if "fieldPath" in rule and declared(node, rule["fieldPath"].lstrip(".").split(".")) is None:
                problems.append(f"{where}: fieldPath {rule['fieldPath']} is not declared")
    assert problems == []


@pytest.mark.parametrize("plural", sorted(KINDS))
def test_conditions_are_standard(plural: str) -> None:
    schema = load_crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node, _ in walk(schema):
        if not path.endswith(".conditions"):
            continue
        assert node["type"] == "array"
        assert node["x-kubernetes-list-type"] == "map"
        assert node["x-kubernetes-list-map-keys"] == ["type"]
        props = node["items"]["properties"]
        assert set(props) == {"type", "status", "reason", "message", "observedGeneration", "lastTransitionTime"}
        assert props["status"]["enum"] == ["True", "False", "Unknown"]
        assert props["lastTransitionTime"]["format"] == "date-time"
        assert props["observedGeneration"]["type"] == "integer"


def _enum_at(kind: str, path: str) -> list[str]:
    node = declared(schema_of(kind), path.split("."))
    assert node is not None, f"{kind} {path} is not declared"
    values: list[str] = node["enum"]
    return values


def _values(e: type[enum.StrEnum]) -> list[str]:
    return [m.value for m in e if m.value]


def test_enums_match_the_model() -> None:
    assert _enum_at("Span", "spec.mode") == _values(Mode)
    assert _enum_at("Dispatcher", "spec.mode") == _values(Mode)
    assert _enum_at("Span", "status.state") == _values(SpanState)
    assert _enum_at("Dispatcher", "status.state") == _values(DispatcherState)
    assert _enum_at("SpanOperator", "spec.type") == _values(OpType)
    assert _enum_at("SpanOperator", "spec.source") == _values(OpSource)
    assert _enum_at("SpanOperator", "status.phase") == _values(OpPhase)
    assert _enum_at("SpanOperator", "status.stage") == _values(Stage)
    assert _enum_at("Table", "status.state") == list(TABLE_STATES)


def test_defaults_match_the_model() -> None:
    sched = declared(schema_of("Changefeed"), ["spec", "scheduler"])
    assert sched is not None
    model = Changefeed(name="x").scheduler
    # Every knob but ``paused`` has its default in the schema; ``paused`` is left absent (absent reads as false),
    # so that a Changefeed stored before the field existed reads back as it was written.
    assert "default" not in sched["properties"]["paused"]
    assert {k: v["default"] for k, v in sched["properties"].items() if k != "paused"} == {
        resource_paths(f.name)[0]: getattr(model, f.name) for f in fields(model) if f.name != "paused"
    }
    assert model.paused is False
    assert sched["properties"]["maxInFlightOperators"]["default"] == 10000
    assert sched["properties"]["balanceIntervalSeconds"]["default"] == 15.0
    splittable = declared(schema_of("Table"), ["spec", "splittable"]) or {}
    assert splittable.get("default") == Table(name="t", changefeed="c", table_id=1).splittable
    for kind in ("Span", "Dispatcher"):
        assert (declared(schema_of(kind), ["spec", "mode"]) or {}).get("default") == Mode.DEFAULT.value
    assert (declared(schema_of("SpanOperator"), ["spec", "source"]) or {}).get("default") == OpSource.USER.value


def test_keys_are_lower_case_hex() -> None:
    for kind in ("Span", "Dispatcher", "SpanOperator", "Table"):
        for path, node, _ in walk(schema_of(kind)):
            if re.search(r"(startKey|endKey|splitKeys\[\])$", path):
                assert node["pattern"] == "^([0-9a-f]{2})*$", f"{kind}{path}"
                assert node["maxLength"] > 0


def test_minimums() -> None:
    problems = []
    for plural, cls in KINDS.items():
        for path, node, _ in walk(schema_of(cls.KIND.value)):
            if node.get("type") in {"integer", "number"} and "minimum" not in node:
                problems.append(f"{plural}{path}")
    assert problems == []
    assert (declared(schema_of("Changefeed"), ["spec", "scheduler", "maxInFlightOperators"]) or {})["minimum"] == 1
    assert (declared(schema_of("Table"), ["spec", "tableID"]) or {})["minimum"] == 0


# --------------------------------------------------------------------------------------------------
# Printer columns

_JSONPATH_STEP = re.compile(r'\.([A-Za-z0-9_]+)|\[\?\(@\.([A-Za-z0-9_]+)=="[^"]*"\)\]')


def column_target(schema: dict[str, Any], jsonpath: str) -> dict[str, Any] | None:
    steps = [(m.group(1), m.group(2)) for m in _JSONPATH_STEP.finditer(jsonpath)]
    if "".join(m.group(0) for m in _JSONPATH_STEP.finditer(jsonpath)) != jsonpath:
        return None
    if steps and steps[0][0] == "metadata":
        if len(steps) != 2 or steps[1][0] not in METADATA_FIELDS:
            return None
        fmt = METADATA_FIELDS[steps[1][0]]
        return {"type": "string", "format": fmt} if fmt == "date-time" else {"type": fmt}
    node: dict[str, Any] | None = schema
    for field_, filter_field in steps:
        if node is None:
            return None
        if filter_field is not None:
            items = node.get("items") if node.get("type") == "array" else None
            if items is None or filter_field not in items.get("properties", {}):
                return None
            node = items
        else:
            node = node.get("properties", {}).get(field_)
    return node


@pytest.mark.parametrize("plural", sorted(KINDS))
def test_printer_columns_point_at_declared_fields(plural: str) -> None:
    version = load_crd(plural)["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    problems = []
    for column in version["additionalPrinterColumns"]:
        target = column_target(schema, column["jsonPath"])
        if target is None:
            problems.append(f"{column['name']}: {column['jsonPath']} is not declared")
            continue
        type_ = column["type"]
        ok = {
            "integer": target.get("type") == "integer",
            "number": target.get("type") in {"number", "integer"},
            "boolean": target.get("type") == "boolean",
            "date": target.get("format") == "date-time",
            "string": target.get("type") == "string"
            or (target.get("type") == "array" and target["items"].get("type") == "string"),
        }.get(type_, False)
        if not ok:
            problems.append(f"{column['name']}: column type {type_} does not fit {target.get('type')}")
    assert problems == []


def test_column_target_rejects_typos() -> None:
    schema = schema_of("Span")
    assert column_target(schema, ".status.state") is not None
    assert column_target(schema, ".status.stat") is None
    assert column_target(schema, ".metadata.creationTimestamp") == {"type": "string", "format": "date-time"}
    cf = schema_of("Changefeed")
    assert column_target(cf, '.status.conditions[?(@.type=="Bootstrapped")].status') is not None
    assert column_target(cf, '.status.conditions[?(@.kind=="Bootstrapped")].status') is None


@pytest.mark.parametrize(
    ("plural", "columns"),
    [
        ("spans", ["Table", "Mode", "State", "Capture", "Operator", "Checkpoint", "Age"]),
        ("spanoperators", ["Type", "Phase", "Stage", "Spans", "Target", "Reason", "Age"]),
        ("dispatchers", ["Span", "Capture", "State", "Epoch", "Checkpoint", "Age"]),
        ("tables", ["TableID", "State", "Replicating", "Absent", "Age"]),
        ("changefeeds", ["Epoch", "Checkpoint", "InFlight", "Bootstrapped", "Scheduler", "Age"]),
        ("captures", ["Draining", "Pod", "Dispatchers", "Age"]),
    ],
)
def test_default_columns(plural: str, columns: list[str]) -> None:
    version = load_crd(plural)["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")] == columns


# --------------------------------------------------------------------------------------------------
# Every field of the model has a declared place in the resource.
#
# ``populated(cls)`` fills every field of a record (recursively) with a value other than its default,
# derived from the type annotations, so a field added to the model is populated without touching this
# file. Then: each field changes the rendered resource (so to_resource carries it), and every path of the
# rendered resource is declared in the CRD (so the API server would not prune it).

SPECIAL_VALUES: dict[tuple[str, str], Any] = {
    ("Condition", "type"): "Bootstrapped",
    ("Condition", "status"): "True",
    ("Condition", "reason"): "Restored",
    ("Table", "state"): "Active",
    ("Record", "labels"): ((CHANGEFEED_LABEL, "demo"), ("team", "cdc")),
}


def _default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _sample(tp: Any, owner: type, f: Field[Any]) -> Any:
    for cls in owner.__mro__:
        if (cls.__name__, f.name) in SPECIAL_VALUES:
            return SPECIAL_VALUES[(cls.__name__, f.name)]
    default = _default(f)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)), owner, f)
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        if elem is str:
            return ("xa", "xb")
        if elem is bytes:
            return (b"\x74\x01", b"\x74\x02")
        if is_dataclass(elem):
            return (populated(typing.cast(type, elem)),)
        raise AssertionError(f"no sample for {owner.__name__}.{f.name}: {tp}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m for m in tp if m.value and m != default][-1]
    if tp is bool:
        return not default if isinstance(default, bool) else True
    if tp is int:
        return 7
    if tp is float:
        return 42.0
    if tp is str and f.name == "sink_kind":
        return "mysql"  # one of the kinds the CRD admits (postgres is what an empty one renders as)
    if tp is str:
        return "x" + f.name.replace("_", "")
    if tp is KeyRange:
        return KeyRange(b"\x74\x00", b"\x74\x09")
    if is_dataclass(tp):
        return populated(typing.cast(type, tp))
    raise AssertionError(f"no sample for {owner.__name__}.{f.name}: {tp}")


def populated(cls: type) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name], cls, f) for f in fields(cls)})


def _altered(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, enum.Enum):
        return next(m for m in type(value) if m.value and m != value)
    if isinstance(value, str):
        return value + "z"
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, KeyRange):
        return KeyRange(value.start, value.end + b"\x00")
    if isinstance(value, tuple):
        return value[:-1]
    raise AssertionError(f"cannot alter {value!r}")


def variants(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(field path, obj with exactly that leaf field changed), for every leaf field of obj."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if is_dataclass(value) and not isinstance(value, KeyRange):  # a KeyRange is one field
            for sub, changed in variants(value, f"{path}."):
                yield sub, replace(obj, **{f.name: changed})
        elif isinstance(value, tuple) and value and is_dataclass(value[0]):
            for sub, changed in variants(value[0], f"{path}[0]."):
                yield sub, replace(obj, **{f.name: (changed, *value[1:])})
        else:
            yield path, replace(obj, **{f.name: _altered(value)})


def unpopulated(obj: Any, prefix: str = "") -> list[str]:
    """Fields of obj (recursively) still at their default: the builder must leave none."""
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value == _default(f):
            out.append(f"{prefix}{f.name}")
        if is_dataclass(value):
            out += unpopulated(value, f"{prefix}{f.name}.")
        if isinstance(value, tuple) and value and is_dataclass(value[0]):
            out += unpopulated(value[0], f"{prefix}{f.name}[0].")
    return out


ALL_KINDS = sorted(KINDS.values(), key=lambda c: c.KIND.value)


@pytest.mark.parametrize("cls", ALL_KINDS, ids=lambda c: c.KIND.value)
def test_populated_record_round_trips(cls: type[Record]) -> None:
    full = populated(cls)
    assert unpopulated(full) == []
    if isinstance(full, Capture):
        assert capture_from_resources(to_resource(full), lease_resource(full)) == full
    else:
        assert from_resource(to_resource(full)) == full


@pytest.mark.parametrize("cls", ALL_KINDS, ids=lambda c: c.KIND.value)
def test_every_model_field_is_rendered(cls: type[Record]) -> None:
    full = populated(cls)
    lost = []
    for path, changed in variants(full):
        if isinstance(full, Capture) and path.split(".")[0] in (*Capture.STATUS_FIELDS, "lease_version"):
            same = lease_resource(changed) == lease_resource(full)  # they live in the Lease
        else:
            same = to_resource(changed) == to_resource(full)
        if same:
            lost.append(path)
    assert lost == [], f"{cls.KIND.value}: fields that to_resource does not carry"


@pytest.mark.parametrize("cls", ALL_KINDS, ids=lambda c: c.KIND.value)
def test_every_rendered_field_is_declared(cls: type[Record]) -> None:
    obj = to_resource(populated(cls))
    schema = schema_of(cls.KIND.value)
    undeclared = [
        ".".join(map(str, path))
        for part in ("spec", "status")
        for path in leaf_paths(obj.get(part, {}), (part,))
        if declared(schema, list(path)) is None
    ]
    assert undeclared == []
    assert validation_errors(obj) == []


@pytest.mark.parametrize("cls", [c for c in ALL_KINDS if c is not Capture], ids=lambda c: c.KIND.value)
def test_every_status_field_is_declared(cls: type[Record]) -> None:
    expected = {path for f in cls.STATUS_FIELDS for path in resource_paths(f)}
    status = status_of(populated(cls))
    assert set(status) == expected
    status_schema = declared(schema_of(cls.KIND.value), ["status"])
    assert status_schema is not None
    assert expected <= set(status_schema["properties"])


def test_declared_check_can_fail() -> None:
    obj = to_resource(populated(Span))
    obj["status"]["newField"] = 1
    assert declared(schema_of("Span"), ["status", "newField"]) is None
    assert any("newField" in e for e in validation_errors(obj))


def test_capture_lease_fields() -> None:
    assert set(Capture.STATUS_FIELDS) == {"renew_time", "lease_duration", "lease_taken", "progress"}
    lease = lease_resource(populated(Capture))
    assert set(lease["spec"]) == {"holderIdentity", "renewTime", "leaseDurationSeconds"}
    assert lease["metadata"]["resourceVersion"]  # lease_version
    # The progress report is an annotation of the Lease (a Lease has no status and a fixed spec).
    assert set(lease["metadata"]["annotations"]) == {"cdc.maintainer.dev/progress"}


# --------------------------------------------------------------------------------------------------
# CEL rules (evaluated with cel-python, in the way the API server applies them)


@cache
def _program(expr: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(expr))


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server does before validating: fill in defaults of absent properties."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def cel_errors(schema: dict[str, Any], new: Any, old: Any) -> list[str]:
    """Messages of the rules ``new`` breaks; transition rules only when there is an old value."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        activation = {"self": json_to_cel(new)}
        if transition:
            activation["oldSelf"] = json_to_cel(old)
        result = _program(rule["rule"]).evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType), f"{rule['rule']!r} gave {result!r}"
        if not result:
            errors.append(rule["message"])
    if isinstance(new, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in new:
                errors += cel_errors(sub, new[name], old.get(name) if isinstance(old, dict) else None)
    if isinstance(new, list) and isinstance(schema.get("items"), dict):
        for item in new:
            errors += cel_errors(schema["items"], item, None)
    return errors


def admit(new: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    schema = schema_of(new["kind"])
    new = apply_defaults(schema, new)
    assert validation_errors(new) == [], "CEL cases must be otherwise valid"
    return cel_errors(schema, new, None if old is None else apply_defaults(schema, old))


def rules() -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    for cls in ALL_KINDS:
        for path, node, _ in walk(schema_of(cls.KIND.value)):
            out.extend((cls.KIND.value, path, r["message"]) for r in node.get("x-kubernetes-validations", []))
    return out


def obj(kind: str, spec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A resource of ``kind`` with ``spec`` updated by ``changes`` (None deletes a field)."""
    new = {**spec, **changes}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {"name": "x"},
        "spec": {k: v for k, v in new.items() if v is not None},
    }


SPAN = {"changefeed": "demo", "tableID": 104, "startKey": "74", "endKey": "75"}
DISP = {**SPAN, "span": "s", "capture": "c0", "startTs": 5, "epoch": 1}
TABLE = {"changefeed": "demo", "tableID": 104}
MOVE = {"changefeed": "demo", "type": "Move", "spans": ["s"], "target": "c1"}
SPLIT = {"changefeed": "demo", "type": "Split", "spans": ["s"], "splitInto": 2}
MERGE = {"changefeed": "demo", "type": "Merge", "spans": ["s1", "s2"]}
REMOVE = {"changefeed": "demo", "type": "Remove", "spans": ["s1", "s2", "s3"]}
ADD = {"changefeed": "demo", "type": "Add", "spans": ["s"], "target": "c1"}

Case = tuple[dict[str, Any], dict[str, Any] | None]  # (new, old or None for a create)
PG = {"postgres": {"secretRef": {"name": "pg"}}}
MY = {"mysql": {"secretRef": {"name": "my"}}}
FEED = {"source": {"etcd": {"secretRef": {"name": "src"}}}, "sink": PG}
ONE_SINK = "spec.sink names exactly one sink kind: postgres or mysql"
SINK_KIND_FIXED = "the sink kind cannot change (its checkpoints are rows of that sink): create a new changefeed"


def updated(kind: str, spec: dict[str, Any], **changes: Any) -> Case:
    return obj(kind, spec, **changes), obj(kind, spec)


#: For each rule (kind, message): objects it must admit and objects it must refuse (with that message only).
TABLE_ID_MAX = "tableID must be at most 9223372036854775806 (its range ends at t<tableID+1>)"
CEL_CASES: dict[tuple[str, str], tuple[list[Case], list[Case]]] = {
    ("Changefeed", ONE_SINK): (
        [(obj("Changefeed", FEED), None), (obj("Changefeed", FEED, sink=MY), None), (obj("Changefeed", {}), None)],
        [(obj("Changefeed", FEED, sink={**PG, **MY}), None), (obj("Changefeed", FEED, sink={}), None)],
    ),
    ("Changefeed", SINK_KIND_FIXED): (
        [updated("Changefeed", FEED, sink={"postgres": {"secretRef": {"name": "rotated"}}})],
        [(obj("Changefeed", FEED, sink=MY), obj("Changefeed", FEED))],
    ),
    ("Span", "startKey must be below endKey"): (
        [
            (obj("Span", SPAN), None),
            (obj("Span", SPAN, startKey="", endKey="00"), None),
            (obj("Span", SPAN, startKey="74", endKey="7400"), None),  # a prefix sorts first, as bytes do
        ],
        [
            (obj("Span", SPAN, startKey="75", endKey="74"), None),
            (obj("Span", SPAN, startKey="74", endKey="74"), None),
            (obj("Span", SPAN, startKey="7400", endKey="74"), None),
            (obj("Span", SPAN, startKey="74ff", endKey="7400"), None),
        ],
    ),
    ("Span", "changefeed is immutable"): ([updated("Span", SPAN, startTs=9)], [updated("Span", SPAN, changefeed="o")]),
    ("Span", "tableID is immutable"): ([updated("Span", SPAN)], [updated("Span", SPAN, tableID=105)]),
    ("Span", "mode is immutable"): (
        [updated("Span", SPAN, mode="default")],  # explicit default == defaulted
        [updated("Span", SPAN, mode="redo")],
    ),
    ("Span", "startKey is immutable"): ([updated("Span", SPAN)], [updated("Span", SPAN, startKey="7401")]),
    ("Span", "endKey is immutable"): ([updated("Span", SPAN)], [updated("Span", SPAN, endKey="7401")]),
    ("Table", "changefeed is immutable"): (
        [updated("Table", TABLE, splittable=False, writeRate=10)],
        [updated("Table", TABLE, changefeed="other")],
    ),
    ("Table", "tableID is immutable"): (
        [updated("Table", TABLE, preSplit={"spans": 4})],
        [updated("Table", TABLE, tableID=105)],
    ),
    ("Span", TABLE_ID_MAX): (
        [(obj("Span", SPAN, tableID=9223372036854775806), None)],
        [(obj("Span", SPAN, tableID=9223372036854775807), None)],
    ),
    ("Table", TABLE_ID_MAX): (
        [(obj("Table", TABLE, tableID=9223372036854775806), None)],
        [(obj("Table", TABLE, tableID=9223372036854775807), None)],
    ),
    ("Dispatcher", TABLE_ID_MAX): (
        [(obj("Dispatcher", DISP, tableID=9223372036854775806), None)],
        [(obj("Dispatcher", DISP, tableID=9223372036854775807), None)],
    ),
    ("Dispatcher", "Dispatcher spec is immutable"): (
        [updated("Dispatcher", DISP, mode="default")],
        [updated("Dispatcher", DISP, capture="c1"), updated("Dispatcher", DISP, epoch=2)],
    ),
    ("Dispatcher", "startKey must be below endKey"): (
        [(obj("Dispatcher", DISP), None)],
        [(obj("Dispatcher", DISP, startKey="75", endKey="7401"), None)],
    ),
    ("SpanOperator", "SpanOperator spec is immutable"): (
        [updated("SpanOperator", MOVE, source="user")],
        [updated("SpanOperator", MOVE, target="c2"), updated("SpanOperator", MOVE, reason="why")],
    ),
    ("SpanOperator", "Add and Move need a target capture"): (
        [(obj("SpanOperator", MOVE), None), (obj("SpanOperator", ADD), None), (obj("SpanOperator", MERGE), None)],
        [
            (obj("SpanOperator", MOVE, target=None), None),
            (obj("SpanOperator", ADD, target=""), None),
        ],
    ),
    ("SpanOperator", "Add, Move and Split take exactly one span"): (
        [(obj("SpanOperator", SPLIT), None), (obj("SpanOperator", REMOVE), None)],
        [
            (obj("SpanOperator", MOVE, spans=["s1", "s2"]), None),
            (obj("SpanOperator", ADD, spans=["s1", "s2"]), None),
            (obj("SpanOperator", SPLIT, spans=["s1", "s2"]), None),
        ],
    ),
    ("SpanOperator", "Merge takes at least two spans"): (
        [(obj("SpanOperator", MERGE), None), (obj("SpanOperator", REMOVE, spans=["s"]), None)],
        [(obj("SpanOperator", MERGE, spans=["s1"]), None)],
    ),
    ("SpanOperator", "Split takes either splitKeys or splitInto >= 2, not both"): (
        [
            (obj("SpanOperator", SPLIT), None),
            (obj("SpanOperator", SPLIT, splitInto=None, splitKeys=["7401", "7402"]), None),
            (obj("SpanOperator", SPLIT, splitInto=0, splitKeys=["7401"]), None),
        ],
        [
            (obj("SpanOperator", SPLIT, splitInto=None), None),
            (obj("SpanOperator", SPLIT, splitInto=1), None),
            (obj("SpanOperator", SPLIT, splitInto=None, splitKeys=[]), None),
            (obj("SpanOperator", SPLIT, splitInto=3, splitKeys=["7401"]), None),
        ],
    ),
    ("SpanOperator", "splitKeys and splitInto are only for Split"): (
        [(obj("SpanOperator", MOVE, splitInto=0, splitKeys=[]), None)],
        [
            (obj("SpanOperator", MOVE, splitInto=2), None),
            (obj("SpanOperator", MERGE, splitKeys=["7401"]), None),
        ],
    ),
}


def test_every_rule_has_cases() -> None:
    assert sorted({(k, m) for k, _, m in rules()}) == sorted(CEL_CASES)
    assert len(rules()) == len(CEL_CASES), "rule messages must be unique within a kind"


@pytest.mark.parametrize(("kind", "message"), sorted(CEL_CASES), ids=lambda v: str(v))
def test_cel_rule(kind: str, message: str) -> None:
    admitted, refused = CEL_CASES[(kind, message)]
    assert admitted
    assert refused
    for new, old in admitted:
        assert new["kind"] == kind
        assert admit(new, old) == [], new["spec"]
    for new, old in refused:
        assert new["kind"] == kind
        assert admit(new, old) == [message], new["spec"]


def test_rules_compile_and_are_bounded() -> None:
    """Every rule parses; every string and list a rule can reach has a bound, as the cost estimator needs."""
    problems = []
    for cls in ALL_KINDS:
        for path, node, _ in walk(schema_of(cls.KIND.value)):
            for rule in node.get("x-kubernetes-validations", []):
                _program(rule["rule"])
                for sub_path, sub, _ in walk(node, path):
                    if sub.get("type") == "string" and "maxLength" not in sub and "enum" not in sub:
                        problems.append(f"{cls.KIND.value}{sub_path}: string without maxLength")
                    if sub.get("type") == "array" and "maxItems" not in sub:
                        problems.append(f"{cls.KIND.value}{sub_path}: list without maxItems")
    assert problems == []


def test_status_updates_pass_the_rules() -> None:
    # A status write re-validates the whole object: the spec rules must not trip on unchanged specs.
    for spec, kind in ((SPAN, "Span"), (DISP, "Dispatcher"), (MOVE, "SpanOperator"), (TABLE, "Table")):
        old = obj(kind, spec)
        assert admit(old, old) == []


# --------------------------------------------------------------------------------------------------
# Examples

EXAMPLE_FILES = {
    "changefeed.yaml": ["Changefeed"],
    "tables.yaml": ["Table", "Table", "Table"],
    "span-presplit.yaml": ["Span", "Span", "Table"],
    "move.yaml": ["SpanOperator"],
    "split.yaml": ["SpanOperator"],
    "merge.yaml": ["SpanOperator"],
}


def example_docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d is not None]


def all_examples() -> list[Any]:
    return [
        pytest.param(name, doc, id=f"{name}#{i}")
        for name in sorted(EXAMPLE_FILES)
        for i, doc in enumerate(example_docs(name))
    ]


def test_example_files() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXAMPLE_FILES)
    for name, kinds in EXAMPLE_FILES.items():
        text = (EXAMPLES / name).read_text()
        assert text.startswith("#"), f"{name} should open with a comment saying what it does"
        assert [d["kind"] for d in example_docs(name)] == kinds


@pytest.mark.parametrize(("name", "doc"), all_examples())
def test_example_is_valid(name: str, doc: dict[str, Any]) -> None:
    assert "namespace" not in doc["metadata"]
    assert validation_errors(doc) == []
    assert admit(doc) == []
    record = from_resource(doc)
    assert record.name == doc["metadata"]["name"]
    assert record.namespace == "default"
    if isinstance(record, Changefeed):
        assert record.name == "demo"
    else:
        assert getattr(record, "changefeed", None) == "demo"
        assert (CHANGEFEED_LABEL, "demo") in record.labels


def test_examples_fit_together() -> None:
    tables = [from_resource(d) for d in example_docs("tables.yaml")]
    assert [type(t) for t in tables] == [Table, Table, Table]
    plain, presplit, hot = typing.cast(list[Table], tables)
    assert (plain.pre_split_spans, plain.pre_split_keys, plain.write_rate) == (0, (), 0.0)
    assert presplit.pre_split_spans == 4
    assert hot.write_rate > 0
    docs = [from_resource(d) for d in example_docs("span-presplit.yaml")]
    spans = [d for d in docs if isinstance(d, Span)]
    (table,) = [d for d in docs if isinstance(d, Table)]
    assert all(s.table_id == table.table_id for s in spans)
    # The user's spans partition the table's key range.
    ordered = sorted(s.key_range for s in spans)
    assert ordered[0].start == table.key_range.start
    assert ordered[-1].end == table.key_range.end
    assert all(a.end == b.start for a, b in itertools.pairwise(ordered))
    names = {s.name for s in spans}
    ops = {n: from_resource(example_docs(n)[0]) for n in ("move.yaml", "split.yaml", "merge.yaml")}
    assert {n: typing.cast(SpanOperator, o).type for n, o in ops.items()} == {
        "move.yaml": OpType.MOVE,
        "split.yaml": OpType.SPLIT,
        "merge.yaml": OpType.MERGE,
    }
    for op in ops.values():
        assert set(typing.cast(SpanOperator, op).spans) <= names


def test_engine_pre_split_cap_matches_the_table_crd() -> None:
    from controller.engine.repair import MAX_PRE_SPLIT

    crd = yaml.safe_load((ROOT / "crds" / "tables.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["preSplit"]["properties"]["spans"]["maximum"] == MAX_PRE_SPLIT
