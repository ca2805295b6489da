"""Structural-schema behaviour of kube-apiserver for custom resources: pruning, defaulting, validation, CEL.

Order, as in apiextensions-apiserver: unknown fields are pruned (nulls of non-nullable fields dropped), defaults
applied top-down, then the object is validated against its openAPIV3Schema with kube-openapi's validators
(type, string, format, number, array, enum, object, in that order per node), then the list-type ``set``/``map``
invariants, then the ``x-kubernetes-validations`` CEL rules (``celpy``), which are skipped, with the
``some validation rules were not checked`` error, when an earlier error is of a blocking kind (wrong type,
required, enum, too long, too many).

The messages are kube-openapi's and apiextensions' (``spec.size in body should be less than or equal to 10``),
with the field path relative to what is validated: a status update validates ``status`` alone, so its messages
say ``heartbeat in body`` while the cause's field is ``status.heartbeat``. Numbers follow Go: a JSON integer
beyond int64 is a float64 (a type error in an integer field, plus ``Checked value must be of type integer``),
and a ``maximum`` the server holds as a float64 outside int64 (9223372036854775806 rounds to 2^63) fails every
write that sets the field (``Maximum boundary value must be of type integer with format int64``).

Ratcheting, as the real server does since 1.30: on an update, a value that did not change is not re-validated,
which also keeps status writes cheap. Transition rules (those that mention ``oldSelf``) run only on updates and
only where an old value exists.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from controller.apiserver.errors import (
    FieldError,
    duplicate,
    forbidden,
    invalid,
    not_supported,
    required,
    too_long,
    too_many,
    type_invalid,
)
from controller.apiserver.gojson import INT64_MAX, INT64_MIN, MAX_JSON_FLOAT_INT, format_float, quote

JSON = dict[str, Any]
logger = logging.getLogger(__name__)

_ROOT_KEEP = ("apiVersion", "kind", "metadata")
BLOCKING = {
    "FieldValueNotSupported",
    "FieldValueRequired",
    "FieldValueTooLong",
    "FieldValueTooMany",
    "FieldValueTypeInvalid",
}
NOT_CHECKED = invalid(
    None,
    None,
    "some validation rules were not checked because the object was invalid; correct the existing errors to "
    "complete validation",
)

# -- Go and kube-openapi number rules ------------------------------------------------------------------------------


def _kind_of(value: Any) -> tuple[str, str]:
    """kube-openapi's schema type and format of a decoded value (an int beyond int64 was a float64 in Go)."""
    if isinstance(value, bool):
        return "boolean", ""
    if isinstance(value, int):
        return ("integer", "int64") if INT64_MIN <= value <= INT64_MAX else ("number", "float64")
    if isinstance(value, float):
        return "number", "float64"
    if isinstance(value, str):
        return "string", ""
    if isinstance(value, list):
        return "array", ""
    if value is None:
        return "null", ""
    return "object", ""


def _float_json_integer(value: float) -> bool:
    """swag.IsFloat64AJSONInteger."""
    return value.is_integer() and abs(value) <= MAX_JSON_FLOAT_INT


def _format_f(value: Any) -> str:
    """swag.FormatFloat64 / the string form the range check parses ('f' format, shortest)."""
    if isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX:
        return str(value)
    f = float(value)
    if f.is_integer() and abs(f) < 1e300:
        from decimal import Decimal

        return str(int(Decimal(repr(f))))
    return repr(f)


_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1), "uint64": (0, 2**64 - 1)}


def _range_error(value: Any, typ: str, fmt: str, prefix: str, path: str) -> str | None:
    """kube-openapi's IsValueValidAgainstRange: does ``value`` parse as an integer of the format?"""
    if typ != "integer":
        return None
    lo, hi = _INT_RANGES.get(fmt, (INT64_MIN, INT64_MAX))
    if type(value) is int and lo <= value <= hi:
        return None  # the common case, without formatting the number
    text = _format_f(value)
    func = "ParseUint" if fmt.startswith("uint") else "ParseInt"
    try:
        number = int(text)
        problem = None if lo <= number <= hi else "value out of range"
    except ValueError:
        problem = "invalid syntax"
    if problem is None:
        return None
    if fmt:
        return f"{prefix} value must be of type {typ} with format {fmt} in {path}"
    return f"{prefix} value must be of type {typ}: strconv.{func}: parsing {quote(text)}: {problem}"


@lru_cache(maxsize=4096)
def _bound_error(bound: float, typ: str, fmt: str, prefix: str, path: str) -> str | None:
    """:func:`_range_error` of a schema's ``maximum`` or ``minimum`` (the same for every object)."""
    return _range_error(bound, typ, fmt, prefix, path)


def _show_number(value: Any) -> str:
    if isinstance(value, float):
        return format_float(value)
    return str(value)


# -- CEL -------------------------------------------------------------------------------------------------------------


class _Cel:
    """Compiled CEL programs, cached per rule text, and their results, cached per (rule, self, oldSelf): a rule is
    a pure function of its inputs, and celpy's interpreter takes about a millisecond per evaluation, which
    dominated creates. A rule runs first on celpy's own transpiler (CEL to Python, 2 to 7 times faster than
    its interpreter) and its answer stands when it is a boolean; any error (the transpiler does not absorb
    errors under ``&&``/``||`` as CEL does, e.g. ``!has(x) || x > 0``) sends the rule to celpy's interpreter,
    whose answer is the one given, as before."""

    RESULTS = 8192

    def __init__(self) -> None:
        self._programs: dict[str, Any] = {}
        self._errors: dict[str, str] = {}
        self._env: Any = None
        self._compiled_env: Any = None
        self._fast: dict[str, Any] = {}
        self._results: dict[tuple[str, str, bool, str], tuple[bool, str]] = {}

    def _environments(self) -> tuple[Any, Any]:
        if self._env is None:
            import celpy
            from celpy.celparser import CELParser
            from celpy.evaluation import TranspilerTree

            # celpy keeps one parser per process, with the tree class of whoever made it first; the transpiler
            # needs its own (a subclass of lark's, which the interpreter and crdcheck read as well).
            parser = CELParser.CEL_PARSER
            if parser is not None and parser.options.tree_class is not TranspilerTree:
                CELParser.CEL_PARSER = None
            # Its transpiled code logs every error it meets (which the interpreter then answers) at ERROR.
            logging.getLogger("celpy.Transpiler").setLevel(logging.CRITICAL)
            self._compiled_env = celpy.Environment(runner_class=celpy.CompiledRunner)
            self._env = celpy.Environment()
        return self._env, self._compiled_env

    def compile_error(self, rule: str) -> str | None:
        """Why ``rule`` does not compile (celpy's message), or None."""
        self.program(rule)
        return self._errors.get(rule)

    def program(self, rule: str) -> Any:
        if rule in self._programs:
            return self._programs[rule]
        env, compiled_env = self._environments()
        try:
            ast = env.compile(rule)
            prg = env.program(ast)
        except Exception as exc:
            self._errors[rule] = str(exc).strip() or type(exc).__name__
            prg = None
        fast = None
        if prg is not None:
            with contextlib.suppress(Exception):  # what the transpiler cannot translate, the interpreter runs
                fast = compiled_env.program(ast)
        self._programs[rule] = prg
        self._fast[rule] = fast
        return prg

    def evaluate(self, rule: str, value: Any, old: Any, has_old: bool) -> tuple[bool, str]:
        key = (rule, _freeze(value), has_old, _freeze(old) if has_old else "")
        cached = self._results.get(key)
        if cached is None:
            cached = self._evaluate(rule, value, old, has_old)
            if len(self._results) >= self.RESULTS:
                self._results.clear()
            self._results[key] = cached
        return cached

    def _evaluate(self, rule: str, value: Any, old: Any, has_old: bool) -> tuple[bool, str]:
        from celpy.adapter import json_to_cel
        from celpy.celtypes import BoolType
        from celpy.evaluation import CELEvalError

        prg = self.program(rule)
        if prg is None:
            return True, ""
        activation: dict[str, Any] = {"self": json_to_cel(value)}
        if has_old:
            activation["oldSelf"] = json_to_cel(old)
        fast = self._fast.get(rule)
        if fast is not None:
            with contextlib.suppress(Exception):
                answer = fast.evaluate(activation)
                if isinstance(answer, BoolType):
                    return bool(answer), ""
        try:
            result = prg.evaluate(activation)
        except Exception as exc:
            return False, f"rule evaluation error: {exc}"
        if isinstance(result, CELEvalError):
            return False, f"rule evaluation error: {result.args[0] if result.args else result}"
        return bool(result is True or result == True), ""  # noqa: E712 - celpy BoolType compares to True


def _freeze(value: Any) -> str:
    """A value as a cache key: canonical JSON (with its JSON types: 1, 1.0 and true stay distinct)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


CEL = _Cel()


def _mark(node: Any, own: Callable[[JSON], bool], marked: set[int]) -> bool:
    """Add to ``marked`` the ids of the schema nodes at or above a node for which ``own`` holds; whether
    ``node`` is one of them. Walks that look for such nodes skip the subtrees without one."""
    if not isinstance(node, dict):
        return False
    found = own(node)
    for sub in (node.get("properties") or {}).values():
        found = _mark(sub, own, marked) or found
    for key in ("items", "additionalProperties"):
        found = _mark(node.get(key), own, marked) or found
    if found:
        marked.add(id(node))
    return found


# -- the schema ------------------------------------------------------------------------------------------------------


class Schema:
    """A CRD version's openAPIV3Schema, able to prune, default and validate objects of that kind."""

    def __init__(self, root: JSON) -> None:
        self.root = root
        self._cel_nodes: set[int] = set()  # ids of the nodes with a CEL rule at or below them
        self._list_nodes: set[int] = set()  # ids of the nodes with a set or map list type at or below them
        self.has_cel = _mark(root, lambda n: bool(n.get("x-kubernetes-validations")), self._cel_nodes)
        _mark(root, lambda n: n.get("x-kubernetes-list-type") in ("set", "map"), self._list_nodes)
        self._precompile(root)

    def _precompile(self, node: Any) -> None:
        if not isinstance(node, dict):
            return
        for rule in node.get("x-kubernetes-validations") or []:
            if isinstance(rule, dict) and "rule" in rule:
                CEL.program(str(rule["rule"]))
        for sub in (node.get("properties") or {}).values():
            self._precompile(sub)
        for key in ("items", "additionalProperties"):
            self._precompile(node.get(key))

    # -- pruning ---------------------------------------------------------------------------------------

    def prune(self, obj: JSON, old: JSON | None = None) -> list[str]:
        """Drop fields the schema does not declare (in place); return their paths, sorted (for warnings).
        Top-level values that are ``old``'s own (a patch left them alone) are pruned already."""
        pruned: list[str] = []
        props = self.root.get("properties") or {}
        for key in list(obj):
            if key in _ROOT_KEEP or (old is not None and obj[key] is old.get(key)):
                continue
            if key in props:
                if obj[key] is None and not props[key].get("nullable"):
                    del obj[key]
                    continue
                obj[key] = self._prune(props[key], obj[key], key, pruned)
            elif not self.root.get("x-kubernetes-preserve-unknown-fields"):
                del obj[key]
                pruned.append(key)
        return sorted(pruned)

    def _prune(self, schema: JSON, value: Any, path: str, pruned: list[str]) -> Any:
        if isinstance(value, dict):
            props = schema.get("properties")
            addl = schema.get("additionalProperties")
            preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
            if schema.get("x-kubernetes-embedded-resource"):
                preserve = preserve or props is None
            for key in list(value):
                sub: JSON | None = None
                if props is not None and key in props:
                    sub = props[key]
                elif isinstance(addl, dict):
                    sub = addl
                elif addl is True or preserve:
                    continue
                if sub is None:
                    del value[key]
                    pruned.append(f"{path}.{key}")
                    continue
                child = value[key]
                if child is None and not sub.get("nullable"):
                    del value[key]
                    continue
                value[key] = self._prune(sub, child, f"{path}.{key}", pruned)
            return value
        if isinstance(value, list):
            items = schema.get("items")
            if isinstance(items, dict):
                return [self._prune(items, item, f"{path}[{i}]", pruned) for i, item in enumerate(value)]
        return value

    # -- defaulting ------------------------------------------------------------------------------------

    def default(self, obj: JSON, old: JSON | None = None) -> None:
        """Apply ``default``s where a field is absent (in place), top-down as the real server does."""
        props = self.root.get("properties") or {}
        for key, sub in props.items():
            if key in _ROOT_KEEP or (old is not None and key in obj and obj[key] is old.get(key)):
                continue
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                self._default(sub, obj[key])

    def _default(self, schema: JSON, value: Any) -> None:
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            for key, sub in props.items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    self._default(sub, value[key])
            addl = schema.get("additionalProperties")
            if isinstance(addl, dict):
                for child in value.values():
                    self._default(addl, child)
        elif isinstance(value, list):
            items = schema.get("items")
            if isinstance(items, dict):
                for item in value:
                    self._default(items, item)

    # -- validation ------------------------------------------------------------------------------------

    def validate(self, obj: JSON, old: JSON | None, *, status_only: bool = False) -> list[FieldError]:
        """Schema validation of a pruned, defaulted object (``old`` on updates); ``status_only`` validates
        ``status`` alone, as the status subresource does. CEL is separate (:meth:`validate_cel`)."""
        errors: list[FieldError] = []
        props = self.root.get("properties") or {}
        if status_only:
            sub = props.get("status")
            if isinstance(sub, dict) and "status" in obj:
                has_old = old is not None and "status" in old
                self._node(
                    sub, obj["status"], "", "status", old["status"] if has_old and old else None, has_old, errors
                )
            return errors
        for key in self.root.get("required") or []:
            if key not in obj:
                errors.append(required(key))
        self._metadata(props.get("metadata"), obj.get("metadata"), (old or {}).get("metadata"), errors)
        for key, sub in props.items():
            if key in _ROOT_KEEP or key not in obj:
                continue
            has_old = old is not None and key in old
            self._node(sub, obj[key], key, key, old[key] if has_old and old else None, has_old, errors)
        return errors

    def _metadata(self, schema: Any, meta: Any, old: Any, errors: list[FieldError]) -> None:
        """A CRD's schema may restrict ``metadata.name`` and ``metadata.generateName`` (and nothing else of
        metadata: crdcheck refuses the rest); the real server validates them with the rest of the object."""
        if not isinstance(schema, dict) or not isinstance(meta, dict):
            return
        for key, sub in (schema.get("properties") or {}).items():
            if key in ("name", "generateName") and isinstance(sub, dict) and key in meta:
                has_old = isinstance(old, dict) and key in old
                path = f"metadata.{key}"
                self._node(sub, meta[key], path, path, old[key] if has_old else None, has_old, errors)

    def validate_lists(self, obj: JSON, old: JSON | None = None) -> list[FieldError]:
        """``x-kubernetes-list-type`` invariants: no duplicate items in a ``set``, no duplicate keys in a ``map``
        (not re-checked in a top-level value an update left as it was)."""
        errors: list[FieldError] = []
        if id(self.root) not in self._list_nodes:
            return errors
        props = self.root.get("properties") or {}
        for key, sub in props.items():
            if key not in _ROOT_KEEP and key in obj and (old is None or obj[key] is not old.get(key)):
                self._lists(sub, obj[key], key, errors)
        return errors

    def validate_cel(self, obj: JSON, old: JSON | None) -> list[FieldError]:
        errors: list[FieldError] = []
        if not self.has_cel:
            return errors
        props = self.root.get("properties") or {}
        for key, sub in props.items():
            if key in _ROOT_KEEP or key not in obj:
                continue
            has_old = old is not None and key in old
            self._cel_tree(sub, obj[key], key, old[key] if has_old and old else None, has_old, errors)
        self._cel(self.root, obj, "", old, old is not None, errors)
        return errors

    # per node ---------------------------------------------------------------------------------------------

    def _node(
        self, schema: JSON, value: Any, msg: str, fld: str, old: Any, has_old: bool, errors: list[FieldError]
    ) -> None:
        if has_old and old == value:
            return  # ratcheting: an unchanged value stays valid
        if value is None:
            if schema.get("nullable"):
                return
            expected = schema.get("type")
            if expected:
                errors.append(type_invalid(fld, "null", f'{msg} in body must be of type {expected}: "null"'))
            return
        self._type(schema, value, msg, fld, errors)
        kind, _ = _kind_of(value)
        if kind == "string":
            self._string(schema, value, msg, fld, errors)
        if kind in ("integer", "number") and schema.get("type") in ("integer", "number"):
            self._number(schema, value, msg, fld, errors)
        if kind == "array":
            self._array(schema, value, msg, fld, old if isinstance(old, list) else None, errors)
        enum = schema.get("enum")
        if enum is not None and value not in enum:
            errors.append(not_supported(fld, value, list(enum)))
        if kind == "object":
            self._object(schema, value, msg, fld, old if isinstance(old, dict) else None, errors)

    def _type(self, schema: JSON, value: Any, msg: str, fld: str, errors: list[FieldError]) -> None:
        if schema.get("x-kubernetes-int-or-string"):
            if not (isinstance(value, int | str) and not isinstance(value, bool)):
                kind, _ = _kind_of(value)
                errors.append(type_invalid(fld, kind, f"{msg} in body must be of type integer,string: {quote(kind)}"))
            return
        expected = schema.get("type")
        if not expected:
            return
        kind, fmt = _kind_of(value)
        want_fmt = str(schema.get("format") or "")
        float_int = (
            kind == "number" and isinstance(value, float) and _float_json_integer(value) and expected == "integer"
        )
        int_float = kind == "integer" and expected == "number"
        lower_int = want_fmt == "int64" and fmt == "int32"
        if (
            kind not in ("string", "array")
            and want_fmt
            and not (expected == kind or fmt == want_fmt or float_int or int_float or lower_int)
        ):
            errors.append(type_invalid(fld, fmt, f"{msg} in body must be of type {want_fmt}: {quote(fmt)}"))
            return
        if expected not in ("number", "integer") and want_fmt and kind == "string":
            return
        if not (expected == kind or float_int or int_float):
            errors.append(type_invalid(fld, kind, f"{msg} in body must be of type {expected}: {quote(kind)}"))

    def _string(self, schema: JSON, value: str, msg: str, fld: str, errors: list[FieldError]) -> None:
        max_len = schema.get("maxLength")
        if max_len is not None and len(value) > max_len:
            errors.append(too_long(fld, int(max_len)))
        min_len = schema.get("minLength")
        if min_len is not None and len(value) < min_len:
            errors.append(invalid(fld, value, f"{msg} in body should be at least {min_len} chars long"))
        pattern = schema.get("pattern")
        if pattern is not None and _pattern(str(pattern)).search(value) is None:
            errors.append(invalid(fld, value, f"{msg} in body should match '{pattern}'"))
        fmt = schema.get("format")
        if fmt and not _format_ok(str(fmt), value):
            errors.append(type_invalid(fld, value, f"{msg} in body must be of type {fmt}: {quote(value)}"))

    def _number(self, schema: JSON, value: Any, msg: str, fld: str, errors: list[FieldError]) -> None:
        typ = str(schema.get("type"))
        fmt = str(schema.get("format") or "")
        checked = _range_error(value, typ, fmt, "Checked", msg)
        if checked:
            errors.append(invalid(None, "", checked))
        native = isinstance(value, int) and INT64_MIN <= value <= INT64_MAX
        multiple = schema.get("multipleOf")
        if multiple and float(value) / float(multiple) != int(float(value) / float(multiple)):
            errors.append(invalid(fld, value, f"{msg} in body should be a multiple of {_show_number(float(multiple))}"))
        for key, is_max in (("maximum", True), ("minimum", False)):
            bound = schema.get(key)
            if bound is None:
                continue
            exclusive = bool(schema.get("exclusiveMaximum" if is_max else "exclusiveMinimum"))
            boundary_error = _bound_error(
                float(bound), typ, fmt, "Maximum boundary" if is_max else "Minimum boundary", msg
            )
            if boundary_error:
                errors.append(invalid(None, "", boundary_error))
            if native and not boundary_error:
                limit: Any = int(float(bound))
                shown = str(limit)
                v: Any = value
            else:
                limit = float(bound)
                shown = format_float(limit)
                v = float(value)
            if is_max:
                bad = v >= limit if exclusive else v > limit
                text = f"should be less than {shown}" if exclusive else f"should be less than or equal to {shown}"
            else:
                bad = v <= limit if exclusive else v < limit
                text = f"should be greater than {shown}" if exclusive else f"should be greater than or equal to {shown}"
            if bad:
                errors.append(invalid(fld, value, f"{msg} in body {text}"))

    def _array(
        self, schema: JSON, value: list[Any], msg: str, fld: str, old: list[Any] | None, errors: list[FieldError]
    ) -> None:
        max_items = schema.get("maxItems")
        if max_items is not None and len(value) > max_items:
            errors.append(too_many(fld, len(value), int(max_items)))
        min_items = schema.get("minItems")
        if min_items is not None and len(value) < min_items:
            errors.append(invalid(fld, len(value), f"{msg} in body should have at least {min_items} items"))
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                self._node(items, item, f"{msg}[{i}]", f"{fld}[{i}]", None, False, errors)

    def _object(
        self, schema: JSON, value: JSON, msg: str, fld: str, old: JSON | None, errors: list[FieldError]
    ) -> None:
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(required(f"{fld}.{key}" if fld else key))
        max_props = schema.get("maxProperties")
        if max_props is not None and len(value) > max_props:
            errors.append(too_many(fld, len(value), int(max_props)))
        min_props = schema.get("minProperties")
        if min_props is not None and len(value) < min_props:
            errors.append(invalid(fld, len(value), f"{msg} in body should have at least {min_props} properties"))
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for key, child in value.items():
            sub = props.get(key)
            if sub is None and isinstance(addl, dict):
                sub = addl
            if sub is None:
                continue
            has_old = old is not None and key in old
            self._node(
                sub,
                child,
                f"{msg}.{key}" if msg else key,
                f"{fld}.{key}" if fld else key,
                old[key] if has_old and old else None,
                has_old,
                errors,
            )

    def _lists(self, schema: JSON, value: Any, path: str, errors: list[FieldError]) -> None:
        if id(schema) not in self._list_nodes:
            return
        if isinstance(value, list):
            list_type = schema.get("x-kubernetes-list-type")
            if list_type == "set":
                seen: list[Any] = []
                for i, item in enumerate(value):
                    if item in seen:
                        errors.append(duplicate(f"{path}[{i}]", item))
                    else:
                        seen.append(item)
            elif list_type == "map":
                keys = list(schema.get("x-kubernetes-list-map-keys") or [])
                seen_keys: list[Any] = []
                for i, item in enumerate(value):
                    if not isinstance(item, dict):
                        continue
                    key = {k: item[k] for k in keys if k in item}
                    if key in seen_keys:
                        errors.append(duplicate(f"{path}[{i}]", key))
                    else:
                        seen_keys.append(key)
            items = schema.get("items")
            if isinstance(items, dict):
                for i, item in enumerate(value):
                    self._lists(items, item, f"{path}[{i}]", errors)
        elif isinstance(value, dict):
            props = schema.get("properties") or {}
            addl = schema.get("additionalProperties")
            for key, child in value.items():
                sub = props.get(key, addl if isinstance(addl, dict) else None)
                if isinstance(sub, dict):
                    self._lists(sub, child, f"{path}.{key}", errors)

    def _cel_tree(self, schema: JSON, value: Any, path: str, old: Any, has_old: bool, errors: list[FieldError]) -> None:
        if id(schema) not in self._cel_nodes:
            return
        if has_old and old == value:
            return  # ratcheting: rules are not re-evaluated on an unchanged value
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            addl = schema.get("additionalProperties")
            for key, child in value.items():
                sub = props.get(key, addl if isinstance(addl, dict) else None)
                if isinstance(sub, dict):
                    child_has_old = has_old and isinstance(old, dict) and key in old
                    self._cel_tree(
                        sub, child, f"{path}.{key}", old.get(key) if child_has_old else None, child_has_old, errors
                    )
        elif isinstance(value, list):
            items = schema.get("items")
            if isinstance(items, dict):
                for i, item in enumerate(value):
                    self._cel_tree(items, item, f"{path}[{i}]", None, False, errors)
        self._cel(schema, value, path, old, has_old, errors)

    def _cel(self, schema: JSON, value: Any, path: str, old: Any, has_old: bool, errors: list[FieldError]) -> None:
        for rule in schema.get("x-kubernetes-validations") or []:
            text = str(rule.get("rule", ""))
            if not text:
                continue
            if "oldSelf" in text and not has_old:
                continue  # transition rules run only on updates
            ok, detail = CEL.evaluate(text, value, old, has_old)
            if ok:
                continue
            field: str | None = (path + str(rule.get("fieldPath", "")) if rule.get("fieldPath") else path) or None
            message = detail or str(rule.get("message") or f"failed rule: {text}")
            reason = str(rule.get("reason") or "FieldValueInvalid")
            scalar = not isinstance(value, dict | list)
            if reason == "FieldValueForbidden":
                errors.append(forbidden(field, message))
            elif reason == "FieldValueRequired":
                errors.append(required(field, message))
            elif reason == "FieldValueDuplicate":
                errors.append(duplicate(field, value))
            else:
                errors.append(FieldError("FieldValueInvalid", field, value if scalar else _omit(), message))


def _omit() -> Any:
    from controller.apiserver.errors import OMIT

    return OMIT


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _pattern(text: str) -> re.Pattern[str]:
    compiled = _PATTERNS.get(text)
    if compiled is None:
        compiled = _PATTERNS[text] = re.compile(text)
    return compiled


_DATE_TIME_RE = re.compile(r"^([0-9]{2}):([0-9]{2}):([0-9]{2})(.[0-9]+)?(z|([+-][0-9]{2}:[0-9]{2}))$")
_DATE_RE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")


def _is_date(text: str) -> bool:
    m = _DATE_RE.match(text)
    if not m:
        return False
    import datetime

    try:
        datetime.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        return False
    return True


def _format_ok(fmt: str, value: str) -> bool:
    """kube-openapi's strfmt checks for the formats CRDs use; unknown formats pass."""
    if fmt == "date-time":
        if len(value) < 4:
            return False
        parts = value.lower().split("t")
        if len(parts) < 2 or not _is_date(parts[0]):
            return False
        m = _DATE_TIME_RE.match(parts[1])
        return m is not None and m.group(1) <= "23" and m.group(2) <= "59" and m.group(3) <= "59"
    if fmt == "date":
        return _is_date(value)
    if fmt == "uuid":
        return re.fullmatch(r"(?i)[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", value) is not None
    if fmt == "byte":
        import base64
        import binascii

        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return False
        return True
    return True


def list_map_key(item: JSON, keys: list[str]) -> str:
    return json.dumps({k: item[k] for k in keys if k in item}, separators=(",", ":"))
