"""Label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``) and field selectors
(``metadata.name``, ``metadata.namespace``, ``=``/``==``/``!=``), parsed once per request."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

JSON = dict[str, Any]
Predicate = Callable[[JSON], bool]


class SelectorError(ValueError):
    """An unparsable selector (400 BadRequest)."""


def _split_terms(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    terms: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


_SET_RE = re.compile(r"^([^\s!=(),]+)\s+(in|notin)\s+\((.*)\)$")
_OP_RE = re.compile(r"^([^\s!=(),]+)\s*(==|!=|=)\s*([^\s!=(),]*)$")
_KEY_RE = re.compile(r"^(!?)\s*([^\s!=(),]+)$")


def _label_check(key: str, op: str, values: frozenset[str]) -> Callable[[dict[str, str]], bool]:
    def check(labels: dict[str, str]) -> bool:
        if op == "in":
            return labels.get(key) in values
        if op == "notin":
            return labels.get(key) not in values
        if op == "exists":
            return key in labels
        if op == "!exists":
            return key not in labels
        if op == "!=":
            return labels.get(key) not in values
        return labels.get(key) in values

    return check


def parse_label_selector(text: str | None) -> Predicate | None:
    if not text:
        return None
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_terms(text):
        m = _SET_RE.match(term)
        if m:
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            checks.append(_label_check(m.group(1), m.group(2), values))
            continue
        m = _OP_RE.match(term)
        if m:
            checks.append(_label_check(m.group(1), "!=" if m.group(2) == "!=" else "=", frozenset([m.group(3)])))
            continue
        m = _KEY_RE.match(term)
        if m:
            checks.append(_label_check(m.group(2), "!exists" if m.group(1) else "exists", frozenset()))
            continue
        raise SelectorError(f"unable to parse requirement: {term!r}")

    def predicate(obj: JSON) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return predicate


_FIELDS = {"metadata.name": "name", "metadata.namespace": "namespace"}


def parse_field_selector(text: str | None) -> Predicate | None:
    if not text:
        return None
    checks: list[Callable[[JSON], bool]] = []
    for term in _split_terms(text):
        m = _OP_RE.match(term)
        if not m:
            raise SelectorError(f"invalid selector: {term!r}")
        field, op, value = m.group(1), m.group(2), m.group(3)
        if field not in _FIELDS:
            raise SelectorError(f"field label not supported: {field}")
        checks.append(_field_check(_FIELDS[field], value, op == "!="))

    def predicate(obj: JSON) -> bool:
        meta = obj.get("metadata") or {}
        return all(check(meta) for check in checks)

    return predicate


def _field_check(attr: str, value: str, negate: bool) -> Callable[[JSON], bool]:
    def check(meta: JSON) -> bool:
        return bool((meta.get(attr, "") == value) != negate)

    return check


def combine(*predicates: Predicate | None) -> Predicate | None:
    active = [p for p in predicates if p is not None]
    if not active:
        return None
    if len(active) == 1:
        return active[0]
    return lambda obj: all(p(obj) for p in active)
