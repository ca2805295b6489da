"""What a real kube-apiserver refuses in a CRD's schema, checked without one (``make test`` and the double).

Two sorts of problem, both found by reading the schema alone:

- **Refused at CRD create/update** (``ValidateCustomResourceDefinition``): a non-structural schema (a
  property without ``type``, ``properties`` beside ``additionalProperties``, ``x-kubernetes-*`` misused),
  a CEL rule that does not compile or whose estimated cost exceeds the budget, a bad ``reason`` or
  ``fieldPath`` on a rule, a transition rule (``oldSelf``) where no old value can be correlated.
- **Accepted, then every create of the kind fails** (the tableID bug: it took a real cluster to find): the
  API server holds ``minimum``/``maximum`` as float64, and for an integer field they must then be exact
  integers within the field's format (``int64``, ``int32``); 9223372036854775806 rounds to 2^63, outside
  int64, and every object is refused with ``Maximum boundary value must be of type integer with format
  int64 in spec.tableID``, with or without CEL rules.

The CEL cost is an approximation of the real estimator (cel-go's checker with the schema's size bounds):
each rule costs about one unit per node of its syntax tree, plus, for every comprehension macro
(``all``, ``exists``, ``exists_one``, ``map``, ``filter``), its body times the largest list or map it can
range over, plus the longest string it can read per string operation; that is multiplied by how many
times the rule can run in one object (the product of ``maxItems``/``maxProperties`` above it, unbounded
collections taken as as many elements as a 3 MiB request can hold). The limits are the real server's:
10^7 per rule and 10^8 per CRD. A rule far from them (ours are) is safe either way; one near them needs
a real server to be sure.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]

#: kube-apiserver's limits (apiextensions-apiserver: StaticEstimatedCostLimit, StaticEstimatedCRDCostLimit).
RULE_COST_LIMIT = 10_000_000
CRD_COST_LIMIT = 100_000_000
#: The largest request the API server accepts; unbounded collections are sized from it, as the real estimator.
MAX_REQUEST_BYTES = 3 * 1024 * 1024
RULE_REASONS = ("FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate")
COMPREHENSIONS = ("all", "exists", "exists_one", "map", "filter")
STRING_OPS = ("matches", "contains", "startsWith", "endsWith", "lowerAscii", "upperAscii", "split", "indexOf")
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_FIELD_PATH = re.compile(r"^(\.[A-Za-z_][A-Za-z0-9_]*|\['[^']*'\])+$")
_ROOT = "spec.validation.openAPIV3Schema"


@dataclass(frozen=True)
class Problem:
    """``path`` is the real server's (``spec.validation.openAPIV3Schema.properties[spec].type``);
    ``at_create`` tells a refused CRD from one accepted whose objects are then all refused."""

    path: str
    message: str
    at_create: bool = True

    def __str__(self) -> str:
        when = "" if self.at_create else " (the CRD is accepted, then every create of its kind fails)"
        return f"{self.path}: {self.message}{when}"


def check_crd(crd: JSON) -> list[Problem]:
    """Every problem of every served version's schema of ``crd``."""
    problems: list[Problem] = []
    total = 0
    for version in (crd.get("spec") or {}).get("versions") or []:
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if not isinstance(schema, dict):
            problems.append(Problem(f"spec.versions[{version.get('name')}].schema.openAPIV3Schema", "Required value"))
            continue
        found, cost = _check_schema(schema)
        problems += found
        total += cost
    if total > CRD_COST_LIMIT:
        problems.append(
            Problem(
                _ROOT,
                f"Forbidden: total CRD cost exceeds budget by factor of {total / CRD_COST_LIMIT:.1f}x "
                "(try simplifying the rule(s), or adding maxItems, maxProperties, and maxLength where arrays, "
                "maps, and strings are declared)",
            )
        )
    return problems


# -- walking the schema ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    schema: JSON
    path: str  # the real server's path of this node
    data_path: str  # spec.tableID: how object-time messages name the field
    cardinality: int  # how many values this node can have in one object
    in_list_items: bool  # under the items of a list that is not a map or a set (no old value correlation)


def _walk(schema: JSON) -> Iterator[Node]:
    stack = [Node(schema, _ROOT, "", 1, False)]
    while stack:
        node = stack.pop()
        yield node
        s = node.schema
        for name, sub in sorted((s.get("properties") or {}).items(), reverse=True):
            if isinstance(sub, dict):
                data = f"{node.data_path}.{name}" if node.data_path else name
                stack.append(Node(sub, f"{node.path}.properties[{name}]", data, node.cardinality, node.in_list_items))
        addl = s.get("additionalProperties")
        if isinstance(addl, dict):
            n = node.cardinality * _bound(s, "maxProperties", addl)
            stack.append(Node(addl, f"{node.path}.additionalProperties", f"{node.data_path}[*]", n, node.in_list_items))
        items = s.get("items")
        if isinstance(items, dict):
            n = node.cardinality * _bound(s, "maxItems", items)
            uncorrelated = node.in_list_items or s.get("x-kubernetes-list-type") not in ("map", "set")
            stack.append(Node(items, f"{node.path}.items", f"{node.data_path}[*]", n, uncorrelated))


def _min_size(schema: JSON) -> int:
    """The fewest bytes one value of ``schema`` takes in JSON, plus a separator (as the estimator assumes)."""
    kind = schema.get("type")
    if kind == "string":
        return 2 + max(0, int(schema.get("minLength") or 0)) + 1
    if kind in ("integer", "number", "boolean"):
        return 2
    return 3  # {} or []


def _bound(schema: JSON, key: str, item: JSON) -> int:
    if key in schema:
        return int(schema[key])
    return MAX_REQUEST_BYTES // _min_size(item)


def _check_schema(root: JSON) -> tuple[list[Problem], int]:
    problems: list[Problem] = []
    total = 0
    for node in _walk(root):
        problems += _structural(node, node.path == _ROOT)
        problems += _bounds(node)
        found, cost = _rules(node)
        problems += found
        total += cost
    return problems, total


def _structural(node: Node, root: bool) -> list[Problem]:
    s, path = node.schema, node.path
    out: list[Problem] = []
    special = s.get("x-kubernetes-int-or-string") or s.get("x-kubernetes-preserve-unknown-fields")
    if not s.get("type") and not special:
        out.append(Problem(f"{path}.type", "Required value: must not be empty for specified object fields"))
    if root and s.get("type") not in (None, "object"):
        out.append(Problem(f"{path}.type", 'Invalid value: must be "object" at the root'))
    meta = (s.get("properties") or {}).get("metadata") if root else None
    if isinstance(meta, dict) and (
        set(meta) - {"type", "properties"} or set(meta.get("properties") or {}) - {"name", "generateName"}
    ):
        out.append(
            Problem(
                f"{path}.properties[metadata]",
                "Forbidden: must not specify anything other than name and generateName, "
                "but metadata is implicitly specified",
            )
        )
    if "properties" in s and "additionalProperties" in s and s.get("additionalProperties") is not False:
        out.append(
            Problem(
                f"{path}.additionalProperties", "Forbidden: additionalProperties and properties are mutual exclusive"
            )
        )
    if "$ref" in s:
        out.append(Problem(f"{path}.$ref", "Forbidden: $ref is not supported"))
    if s.get("x-kubernetes-preserve-unknown-fields") is False:
        out.append(
            Problem(f"{path}.x-kubernetes-preserve-unknown-fields", "Invalid value: false: must be true or undefined")
        )
    if s.get("x-kubernetes-embedded-resource") and s.get("type") != "object":
        out.append(Problem(f"{path}.type", "Invalid value: must be object if x-kubernetes-embedded-resource is true"))
    if s.get("x-kubernetes-int-or-string") and s.get("type"):
        out.append(Problem(f"{path}.type", "Invalid value: must be empty if x-kubernetes-int-or-string is true"))
    map_type = s.get("x-kubernetes-map-type")
    if map_type is not None and map_type not in ("granular", "atomic"):
        out.append(
            Problem(
                f"{path}.x-kubernetes-map-type",
                f'Unsupported value: "{map_type}": supported values: "atomic", "granular"',
            )
        )
    list_type = s.get("x-kubernetes-list-type")
    if list_type is not None:
        out += _list_type(s, path, list_type)
    elif "x-kubernetes-list-map-keys" in s:
        out.append(
            Problem(
                f"{path}.x-kubernetes-list-map-keys", 'Forbidden: must be empty if x-kubernetes-list-type is not "map"'
            )
        )
    if "default" in s and s.get("type") and not _type_ok(s, s["default"]):
        out.append(Problem(f"{path}.default", f"Invalid value: {s['default']!r}: must be of type {s['type']}"))
    if s.get("type") == "string" and "pattern" in s:
        try:
            re.compile(str(s["pattern"]))
        except re.error as exc:
            out.append(Problem(f"{path}.pattern", f"Invalid value: {s['pattern']!r}: {exc}"))
    return out


def _list_type(s: JSON, path: str, list_type: Any) -> list[Problem]:
    out: list[Problem] = []
    where = f"{path}.x-kubernetes-list-type"
    if list_type not in ("atomic", "set", "map"):
        return [Problem(where, f'Unsupported value: "{list_type}": supported values: "atomic", "map", "set"')]
    if s.get("type") != "array":
        return [Problem(where, "Invalid value: must only be used on type array")]
    raw = s.get("items")
    items: JSON = raw if isinstance(raw, dict) else {}
    if list_type == "set" and items.get("type") == "object" and items.get("x-kubernetes-map-type") != "atomic":
        out.append(
            Problem(
                f"{path}.items.x-kubernetes-map-type",
                "Invalid value: must be atomic as item of a list with x-kubernetes-list-type=set",
            )
        )
    if list_type == "map":
        keys = s.get("x-kubernetes-list-map-keys") or []
        if items.get("type") != "object":
            out.append(
                Problem(
                    f"{path}.items.type",
                    'Invalid value: must be object if parent array\'s x-kubernetes-list-type is "map"',
                )
            )
        if not keys:
            out.append(
                Problem(
                    f"{path}.x-kubernetes-list-map-keys",
                    'Required value: must not be empty if x-kubernetes-list-type is "map"',
                )
            )
        props = items.get("properties") or {}
        for key in keys:
            sub = props.get(key)
            if sub is None:
                out.append(
                    Problem(
                        f"{path}.x-kubernetes-list-map-keys",
                        f'Invalid value: "{key}": entries must all be names of item properties',
                    )
                )
            elif key not in (items.get("required") or []) and "default" not in sub:
                out.append(
                    Problem(
                        f"{path}.items.properties[{key}]",
                        "Required value: this property is in x-kubernetes-list-map-keys, "
                        "so it must have a default or be a required property",
                    )
                )
            elif sub.get("type") in ("object", "array"):
                out.append(
                    Problem(
                        f"{path}.items.properties[{key}].type",
                        "Invalid value: must be a scalar type if parent array's x-kubernetes-list-type is map",
                    )
                )
    return out


_PY_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "boolean": bool,
    "object": dict,
    "array": list,
    "integer": int,
    "number": (int, float),
}


def _type_ok(s: JSON, value: Any) -> bool:
    if value is None:
        return bool(s.get("nullable"))
    kind = str(s.get("type"))
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _PY_TYPES.get(kind, object))


def _as_float64(value: Any) -> float:
    return float(struct.unpack("<d", struct.pack("<d", float(value)))[0])


def _bounds(node: Node) -> list[Problem]:
    s = node.schema
    if s.get("type") != "integer":
        return []
    fmt = s.get("format") or "int64"
    low, high = INT_RANGES.get(str(fmt), INT_RANGES["int64"])
    out: list[Problem] = []
    for key, word in (("maximum", "Maximum"), ("minimum", "Minimum")):
        if key not in s:
            continue
        held = _as_float64(s[key])  # what the API server keeps of it
        exact = held.is_integer() and low <= held <= high and (held < 2.0**63 if fmt == "int64" else True)
        if not exact:
            out.append(
                Problem(
                    f"{node.path}.{key}",
                    f"Invalid value: {s[key]}: held as the float64 {held!r}, not an integer of format {fmt}: "
                    f"{word} boundary value must be of type integer with format {fmt} in {node.data_path}",
                    at_create=False,
                )
            )
    return out


# -- CEL ------------------------------------------------------------------------------------------


def _compile(text: str) -> tuple[Any, str]:
    from celpy.celparser import CELParser
    from lark import Tree

    try:
        tree = CELParser().parse(text)
    except Exception as exc:  # celpy raises its own parse errors
        return None, f"compilation failed: {exc}".replace("\n", " ")
    return (tree if isinstance(tree, Tree) else None), ""


def _max_length(schema: JSON) -> int:
    """The longest a string of ``schema`` can be: maxLength, the longest enum value, else a whole request."""
    if "maxLength" in schema:
        return int(schema["maxLength"])
    if schema.get("enum"):
        return max(len(str(v)) for v in schema["enum"])
    return MAX_REQUEST_BYTES


def _tree_cost(tree: Any, node: Node) -> int:
    """About one unit per node of the syntax tree (chains of single-child grammar nodes count once);
    a comprehension's body times the largest collection under ``node``; a string operation or comparison
    reads the longest string under ``node`` (0.1 per byte, as cel-go's string costs)."""
    from lark import Token, Tree

    below = list(_walk(node.schema))  # cardinalities relative to one value of ``node``
    biggest = max((n.cardinality for n in below), default=1)
    longest = max((_max_length(n.schema) for n in below if n.schema.get("type") == "string"), default=0)
    reading = 1 + longest // 10

    def cost(t: Any) -> int:
        if not isinstance(t, Tree):
            return 0
        kids = [c for c in t.children if isinstance(c, Tree)]
        if len(t.children) == 1 and kids:
            return cost(kids[0])  # a grammar wrapper (expr -> conditionalor -> ...): not an AST node
        body = 1 + sum(cost(c) for c in kids)
        names = {c.value for c in t.children if isinstance(c, Token)}
        if t.data in ("member_dot_arg", "ident_arg") and names & set(COMPREHENSIONS):
            return body * biggest
        if t.data in ("member_dot_arg", "ident_arg") and names & set(STRING_OPS):
            return body + reading
        if any(str(k.data).startswith("relation_") for k in kids):  # relation(relation_lt(a), b): a < b
            return body + reading
        return body

    return max(cost(tree), 1)


def _rules(node: Node) -> tuple[list[Problem], int]:
    out: list[Problem] = []
    total = 0
    for i, rule in enumerate(node.schema.get("x-kubernetes-validations") or []):
        where = f"{node.path}.x-kubernetes-validations[{i}]"
        if not isinstance(rule, dict) or not str(rule.get("rule") or ""):
            out.append(Problem(f"{where}.rule", "Required value"))
            continue
        text = str(rule["rule"])
        tree, error = _compile(text)
        if tree is None:
            out.append(Problem(f"{where}.rule", f"Invalid value: {text!r}: {error or 'compilation failed'}"))
            continue
        if rule.get("messageExpression") and _compile(str(rule["messageExpression"]))[0] is None:
            out.append(Problem(f"{where}.messageExpression", "Invalid value: messageExpression compilation failed"))
        reason = rule.get("reason")
        if reason is not None and reason not in RULE_REASONS:
            allowed = ", ".join(f'"{r}"' for r in RULE_REASONS)
            out.append(Problem(f"{where}.reason", f'Unsupported value: "{reason}": supported values: {allowed}'))
        field_path = rule.get("fieldPath")
        if field_path and not _FIELD_PATH.match(str(field_path)):
            out.append(
                Problem(f"{where}.fieldPath", f"Invalid value: {field_path!r}: must be a valid relative JSON path")
            )
        elif field_path and not _path_exists(node.schema, str(field_path)):
            out.append(Problem(f"{where}.fieldPath", f"Invalid value: {field_path!r}: does not refer to a valid field"))
        if "oldSelf" in text and node.in_list_items:
            out.append(
                Problem(
                    f"{where}.rule",
                    "Forbidden: oldSelf cannot be used on the uncorrelatable portion of the schema within "
                    "x-kubernetes-validations",
                )
            )
        cost = _tree_cost(tree, node) * node.cardinality
        total += cost
        if cost > RULE_COST_LIMIT:
            out.append(
                Problem(
                    f"{where}.rule",
                    f"Forbidden: estimated rule cost exceeds budget by factor of {cost / RULE_COST_LIMIT:.1f}x "
                    "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, "
                    "maps, and strings are declared)",
                )
            )
    return out, total


def _path_exists(schema: JSON, field_path: str) -> bool:
    node: Any = schema
    for m in re.finditer(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']*)'\]", field_path):
        name = m.group(1) or m.group(2)
        props = node.get("properties") or {} if isinstance(node, dict) else {}
        if name not in props:
            return False
        node = props[name]
    return True


def check_documents(docs: list[Any]) -> dict[str, list[Problem]]:
    """Problems by CRD name, for every CustomResourceDefinition among ``docs`` (others are skipped)."""
    out: dict[str, list[Problem]] = {}
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
            out[str((doc.get("metadata") or {}).get("name"))] = check_crd(doc)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m controller.apiserver.crdcheck FILE...``: every CRD in the YAML files; exit 1 on a problem."""
    import argparse
    from pathlib import Path

    import yaml

    p = argparse.ArgumentParser(prog="python -m controller.apiserver.crdcheck", description=main.__doc__)
    p.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    bad = 0
    count = 0
    for f in a.files:
        for name, problems in check_documents(list(yaml.safe_load_all(Path(f).read_text()))).items():
            count += 1
            for problem in problems:
                print(f"{f}: CustomResourceDefinition {name}: {problem}")
                bad += 1
    print(f"{count} CRD(s) in {len(a.files)} file(s): {'OK' if not bad else f'{bad} problem(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
