"""Structural-schema behaviour of the real API server for custom resources: pruning, defaulting, validation.

Order, as in kube-apiserver: unknown fields are pruned (and nulls of non-nullable fields dropped), defaults
are applied, then the object is validated against the openAPIV3Schema and its ``x-kubernetes-validations``
(CEL, through ``celpy``). CEL rules are *ratcheted* as the real server does: a rule is not re-evaluated on a
value that did not change in an update, which also keeps status writes cheap. Transition rules (those that
mention ``oldSelf``) run only on updates, and only where an old value exists.

Error messages follow apimachinery's ``field.Error`` format (``spec.mode: Unsupported value: "x": ...``) so
tests written against a real cluster can match them.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

JSON = dict[str, Any]
logger = logging.getLogger(__name__)

_ROOT_KEEP = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class FieldError:
    """One invalid field: the ``reason`` (``FieldValueInvalid``...), the dotted ``field`` and a full message."""

    reason: str
    field: str
    message: str


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return str(value)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _type_ok(schema: JSON, value: Any) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    expected = schema.get("type")
    if expected is None:
        return True
    if expected == "object":
        return isinstance(value, dict)
    if expected == "array":
        return isinstance(value, list)
    if expected == "string":
        return isinstance(value, str)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


class _Cel:
    """Compiled CEL programs, cached per rule text. Rules that fail to compile are reported once and skipped."""

    def __init__(self) -> None:
        self._programs: dict[str, Any] = {}
        self._env: Any = None

    def program(self, rule: str) -> Any:
        if rule in self._programs:
            return self._programs[rule]
        import celpy

        if self._env is None:
            self._env = celpy.Environment()
        try:
            prg = self._env.program(self._env.compile(rule))
        except Exception as exc:  # a rule celpy cannot parse: skip it rather than reject every write
            logger.warning("CEL rule not supported, skipped: %r (%s)", rule, exc)
            prg = None
        self._programs[rule] = prg
        return prg

    def evaluate(self, rule: str, value: Any, old: Any, has_old: bool) -> tuple[bool, str]:
        from celpy.adapter import json_to_cel
        from celpy.evaluation import CELEvalError

        prg = self.program(rule)
        if prg is None:
            return True, ""
        activation: dict[str, Any] = {"self": json_to_cel(value)}
        if has_old:
            activation["oldSelf"] = json_to_cel(old)
        try:
            result = prg.evaluate(activation)
        except Exception as exc:
            return False, f"rule evaluation error: {exc}"
        if isinstance(result, CELEvalError):
            return False, f"rule evaluation error: {result.args[0] if result.args else result}"
        return bool(result is True or result == True), ""  # noqa: E712 - celpy BoolType compares to True


CEL = _Cel()


class Schema:
    """A CRD version's openAPIV3Schema, able to prune, default and validate objects of that kind."""

    def __init__(self, root: JSON) -> None:
        self.root = root
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

    def prune(self, obj: JSON) -> list[str]:
        """Drop fields the schema does not declare (in place); return their paths (for fieldValidation)."""
        pruned: list[str] = []
        props = self.root.get("properties") or {}
        for key in list(obj):
            if key in _ROOT_KEEP:
                continue
            if key in props:
                obj[key] = self._prune(props[key], obj[key], key, pruned)
                if obj[key] is None and not props[key].get("nullable"):
                    del obj[key]
            elif not self.root.get("x-kubernetes-preserve-unknown-fields"):
                del obj[key]
                pruned.append(key)
        return pruned

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

    def default(self, obj: JSON) -> None:
        """Apply ``default``s where a field is absent (in place), top-down as the real server does."""
        props = self.root.get("properties") or {}
        for key, sub in props.items():
            if key in _ROOT_KEEP:
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

    def validate(self, obj: JSON, old: JSON | None) -> list[FieldError]:
        """Schema and CEL validation of a (pruned, defaulted) object; ``old`` on updates."""
        errors: list[FieldError] = []
        props = self.root.get("properties") or {}
        for key in self.root.get("required") or []:
            if key not in obj:
                errors.append(FieldError("FieldValueRequired", key, f"{key}: Required value"))
        for key, sub in props.items():
            if key in _ROOT_KEEP or key not in obj:
                continue
            has_old = old is not None and key in old
            self._validate(sub, obj[key], key, old[key] if has_old and old else None, has_old, errors)
        self._cel(self.root, obj, "", old, old is not None, errors)
        return errors

    def _validate(self, schema: JSON, value: Any, path: str, old: Any, has_old: bool, errors: list[FieldError]) -> None:
        if value is None and schema.get("nullable"):
            return
        if not _type_ok(schema, value):
            expected = schema.get("type", "")
            errors.append(
                FieldError(
                    "FieldValueTypeInvalid",
                    path,
                    f'{path}: Invalid value: "{_type_name(value)}": {path} in body must be of type {expected}: '
                    f'"{_type_name(value)}"',
                )
            )
            return
        if has_old and old == value:
            return  # ratcheting: an unchanged value stays valid (the real server ratchets since 1.30)
        enum = schema.get("enum")
        if enum is not None and value not in enum:
            allowed = ", ".join(_fmt(v) for v in enum)
            errors.append(
                FieldError(
                    "FieldValueNotSupported",
                    path,
                    f"{path}: Unsupported value: {_fmt(value)}: supported values: {allowed}",
                )
            )
        if isinstance(value, str):
            self._validate_string(schema, value, path, errors)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            self._validate_number(schema, value, path, errors)
        elif isinstance(value, list):
            self._validate_array(schema, value, path, old if isinstance(old, list) else None, errors)
        elif isinstance(value, dict):
            self._validate_object(schema, value, path, old if isinstance(old, dict) else None, errors)
        self._cel(schema, value, path, old, has_old, errors)

    def _validate_string(self, schema: JSON, value: str, path: str, errors: list[FieldError]) -> None:
        max_len = schema.get("maxLength")
        if max_len is not None and len(value) > max_len:
            errors.append(
                FieldError("FieldValueTooLong", path, f"{path}: Too long: may not be more than {max_len} bytes")
            )
        min_len = schema.get("minLength")
        if min_len is not None and len(value) < min_len:
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"{path}: Invalid value: {_fmt(value)}: {path} in body should be at least {min_len} chars long",
                )
            )
        pattern = schema.get("pattern")
        if pattern is not None and re.search(pattern, value) is None:
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"{path}: Invalid value: {_fmt(value)}: {path} in body should match '{pattern}'",
                )
            )
        if schema.get("format") == "date-time" and not _is_datetime(value):
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"{path}: Invalid value: {_fmt(value)}: {path} in body must be of type date-time: {_fmt(value)}",
                )
            )

    def _validate_number(self, schema: JSON, value: float, path: str, errors: list[FieldError]) -> None:
        minimum = schema.get("minimum")
        if minimum is not None:
            if schema.get("exclusiveMinimum") and value <= minimum:
                msg = f"should be greater than {minimum}"
            elif value < minimum:
                msg = f"should be greater than or equal to {minimum}"
            else:
                msg = ""
            if msg:
                errors.append(
                    FieldError("FieldValueInvalid", path, f"{path}: Invalid value: {value}: {path} in body {msg}")
                )
        maximum = schema.get("maximum")
        if maximum is not None:
            if schema.get("exclusiveMaximum") and value >= maximum:
                msg = f"should be less than {maximum}"
            elif value > maximum:
                msg = f"should be less than or equal to {maximum}"
            else:
                msg = ""
            if msg:
                errors.append(
                    FieldError("FieldValueInvalid", path, f"{path}: Invalid value: {value}: {path} in body {msg}")
                )

    def _validate_array(
        self, schema: JSON, value: list[Any], path: str, old: list[Any] | None, errors: list[FieldError]
    ) -> None:
        max_items = schema.get("maxItems")
        if max_items is not None and len(value) > max_items:
            errors.append(
                FieldError(
                    "FieldValueTooMany", path, f"{path}: Too many: {len(value)}: must have at most {max_items} items"
                )
            )
        min_items = schema.get("minItems")
        if min_items is not None and len(value) < min_items:
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"{path}: Invalid value: {len(value)}: {path} in body should have at least {min_items} items",
                )
            )
        if schema.get("x-kubernetes-list-type") == "set" or schema.get("uniqueItems"):
            seen: list[Any] = []
            for i, item in enumerate(value):
                if item in seen:
                    errors.append(
                        FieldError("FieldValueDuplicate", f"{path}[{i}]", f"{path}[{i}]: Duplicate value: {_fmt(item)}")
                    )
                else:
                    seen.append(item)
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                # list items correlate with old items only for map/set lists; index correlation is not done.
                self._validate(items, item, f"{path}[{i}]", None, False, errors)

    def _validate_object(
        self, schema: JSON, value: JSON, path: str, old: JSON | None, errors: list[FieldError]
    ) -> None:
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(FieldError("FieldValueRequired", f"{path}.{key}", f"{path}.{key}: Required value"))
        max_props = schema.get("maxProperties")
        if max_props is not None and len(value) > max_props:
            errors.append(
                FieldError(
                    "FieldValueTooMany", path, f"{path}: Too many: {len(value)}: must have at most {max_props} items"
                )
            )
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for key, child in value.items():
            sub = props.get(key)
            if sub is None and isinstance(addl, dict):
                sub = addl
            if sub is None:
                continue
            has_old = old is not None and key in old
            self._validate(sub, child, f"{path}.{key}", old[key] if has_old and old else None, has_old, errors)

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
            field = path + str(rule.get("fieldPath", "")) if rule.get("fieldPath") else path
            message = detail or str(rule.get("message") or f"failed rule: {text}")
            shown = field or "<nil>"
            reason = str(rule.get("reason") or "FieldValueInvalid")
            errors.append(FieldError(reason, field, f"{shown}: Invalid value: {_fmt_cel(value)}: {message}"))


def _fmt_cel(value: Any) -> str:
    return f'"{_type_name(value)}"'


def _is_datetime(value: str) -> bool:
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return False
    return True
