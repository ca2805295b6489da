"""CustomResourceDefinitions: what the real apiextensions-apiserver defaults, refuses and reports.

A CRD is defaulted (``conversion.strategy: None``, ``names.singular`` and ``names.listKind``), its schema
numbers are held as Go holds them (``maximum`` is a float64, so 9223372036854775806 becomes 2^63: accepted
here, and then every write that sets the field fails, as on a real server), and it is refused with 422 when
its name is not ``<plural>.<group>``, its schema is not structural (a property without ``type``) or a CEL
rule does not compile. It answers its create with an empty ``status.acceptedNames`` and no conditions; the
establishing controller (:mod:`controller.apiserver.controllers`) then accepts the names and marks it
``Established``, and only then are its resources served.
"""

from __future__ import annotations

import json
from typing import Any

from controller.apiserver.errors import FieldError, forbidden, invalid, required
from controller.apiserver.gojson import canonical_number
from controller.apiserver.schema import CEL

JSON = dict[str, Any]

_FLOAT_KEYWORDS = ("maximum", "minimum", "multipleOf")


def _schema_numbers(node: Any) -> Any:
    """JSONSchemaProps as Go holds it: maximum, minimum and multipleOf are float64."""
    if isinstance(node, dict):
        out: JSON = {}
        for k, v in node.items():
            if k in _FLOAT_KEYWORDS and isinstance(v, int | float) and not isinstance(v, bool):
                out[k] = canonical_number(float(v))
            elif k in ("properties", "patternProperties", "definitions") and isinstance(v, dict):
                out[k] = {pk: _schema_numbers(pv) for pk, pv in v.items()}
            elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
                out[k] = _schema_numbers(v)
            elif k in ("allOf", "anyOf", "oneOf") and isinstance(v, list):
                out[k] = [_schema_numbers(x) for x in v]
            else:
                out[k] = v
        return out
    return node


def default(crd: JSON) -> None:
    """The defaults the real server fills in (in place)."""
    spec = crd.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    spec.setdefault("conversion", {"strategy": "None"})
    names = spec.get("names")
    if isinstance(names, dict) and names.get("kind"):
        names.setdefault("singular", str(names["kind"]).lower())
        names.setdefault("listKind", f"{names['kind']}List")
    for version in spec.get("versions") or []:
        if isinstance(version, dict):
            schema = version.get("schema")
            if isinstance(schema, dict) and isinstance(schema.get("openAPIV3Schema"), dict):
                version["schema"] = dict(schema, openAPIV3Schema=_schema_numbers(schema["openAPIV3Schema"]))


def initial_status(crd: JSON) -> JSON:
    versions = (crd.get("spec") or {}).get("versions") or []
    return {
        "acceptedNames": {"kind": "", "plural": ""},
        "conditions": None,
        "storedVersions": [v.get("name") for v in versions if isinstance(v, dict) and v.get("storage")],
    }


def established_status(crd: JSON, now: str) -> JSON:
    status = dict(crd.get("status") or {})
    status["acceptedNames"] = dict((crd.get("spec") or {}).get("names") or {})
    status["conditions"] = [
        {
            "type": "NamesAccepted",
            "status": "True",
            "lastTransitionTime": now,
            "reason": "NoConflicts",
            "message": "no conflicts found",
        },
        {
            "type": "Established",
            "status": "True",
            "lastTransitionTime": now,
            "reason": "InitialNamesAccepted",
            "message": "the initial names have been accepted",
        },
    ]
    status.setdefault("storedVersions", initial_status(crd)["storedVersions"])
    return status


def established(crd: JSON) -> bool:
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def _rule_value(rule: JSON) -> JSON:
    """A ValidationRule as Go's json.Marshal of the internal struct prints it in the error."""
    return {
        "Rule": rule.get("rule", ""),
        "Message": rule.get("message", ""),
        "MessageExpression": rule.get("messageExpression", ""),
        "Reason": rule.get("reason"),
        "FieldPath": rule.get("fieldPath", ""),
        "OptionalOldSelf": rule.get("optionalOldSelf"),
    }


def _compile_message(rule: str, error: str) -> str:
    """celpy's parse error in cel-go's shape (``ERROR: <input>:1:10: Syntax error: ...`` and a caret line)."""
    lines = error.splitlines()
    column = 1
    if len(lines) >= 2 and "^" in lines[-1]:
        column = lines[-1].index("^") + 1
    first = rule.splitlines()[0] if rule else ""
    return (
        f"ERROR: <input>:1:{column}: Syntax error: {lines[0] if lines else error}\n | {first}\n | {'.' * (column - 1)}^"
    )


def _structural(node: Any, path: str, errors: list[FieldError], where: str) -> None:
    if not isinstance(node, dict):
        return
    typ = node.get("type")
    loose = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
    if not typ and not loose:
        errors.append(required(f"{path}.type", f"must not be empty {where}"))
    if where == "at the root" and typ and typ != "object":
        errors.append(invalid(f"{path}.type", typ, "must be object at the root"))
    if node.get("properties") and isinstance(node.get("additionalProperties"), dict):
        errors.append(
            forbidden(f"{path}.additionalProperties", "additionalProperties and properties are mutual exclusive")
        )
    for i, rule in enumerate(node.get("x-kubernetes-validations") or []):
        if not isinstance(rule, dict) or not rule.get("rule"):
            errors.append(required(f"{path}.x-kubernetes-validations[{i}].rule"))
            continue
        problem = CEL.compile_error(str(rule["rule"]))
        if problem:
            errors.append(
                invalid(
                    f"{path}.x-kubernetes-validations[{i}].rule",
                    _rule_value(rule),
                    "compilation failed: " + _compile_message(str(rule["rule"]), problem),
                )
            )
    for name, sub in (node.get("properties") or {}).items():
        _structural(sub, f"{path}.properties[{name}]", errors, "for specified object fields")
    if isinstance(node.get("items"), dict):
        _structural(node["items"], f"{path}.items", errors, "for specified array items")
    if isinstance(node.get("additionalProperties"), dict):
        _structural(
            node["additionalProperties"], f"{path}.additionalProperties", errors, "for specified additionalProperties"
        )


def validate(crd: JSON) -> list[FieldError]:
    """The CRD's own validity: name, names, versions, structural schemas, CEL rules that compile."""
    errors: list[FieldError] = []
    meta = crd.get("metadata") or {}
    spec: JSON = crd["spec"] if isinstance(crd.get("spec"), dict) else {}
    names: JSON = spec["names"] if isinstance(spec.get("names"), dict) else {}
    group = str(spec.get("group") or "")
    plural = str(names.get("plural") or "")
    name = str(meta.get("name") or "")
    if name != f"{plural}.{group}":
        errors.append(invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))
    if not group:
        errors.append(required("spec.group"))
    if not plural:
        errors.append(required("spec.names.plural"))
    if not names.get("kind"):
        errors.append(required("spec.names.kind"))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errors.append(required("spec.scope") if not spec.get("scope") else invalid("spec.scope", spec.get("scope")))
    versions = [v for v in spec.get("versions") or [] if isinstance(v, dict)]
    if not versions:
        errors.append(required("spec.versions", "must have exactly one version marked as storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(invalid("spec.versions", versions, "must have exactly one version marked as storage version"))
    schemas = [json.dumps((v.get("schema") or {}).get("openAPIV3Schema"), sort_keys=True) for v in versions]
    same = len(set(schemas)) <= 1
    for i, version in enumerate(versions):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            continue
        path = "spec.validation.openAPIV3Schema" if same else f"spec.versions[{i}].schema.openAPIV3Schema"
        _structural(schema, path, errors, "at the root")
        if same:
            break
    return errors


def served_names(crd: JSON) -> tuple[str, str]:
    spec = crd.get("spec") or {}
    return str(spec.get("group", "")), str((spec.get("names") or {}).get("plural", ""))
