"""Label and field selectors, parsed as apimachinery parses them (same grammar, same error messages).

Label selectors: ``k=v``, ``k==v``, ``k!=v`` (matches objects without the label), ``k in (a,b)``,
``k notin (a)``, ``k``, ``!k``, ``k>1``, ``k<1``; the lexer and recursive-descent parser follow
``k8s.io/apimachinery/pkg/labels/selector.go``, so a malformed selector fails with the real message
(``unable to parse requirement: found 'x' expected: '('``). Field selectors: ``=``, ``==``, ``!=`` over the field
labels a kind supports (``metadata.name`` and ``metadata.namespace`` everywhere; ``involvedObject.name`` and
friends on Events; ``status.phase`` on Namespaces), ``field label not supported: ...`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controller.apiserver.gojson import format_value
from controller.apiserver.meta import label_value, qualified_name

JSON = dict[str, Any]
Predicate = Callable[[JSON], bool]
FieldGetter = Callable[[JSON], str | None]


class SelectorError(ValueError):
    """An unparsable selector (400 BadRequest)."""


_SPECIAL = "=!(),><"
_WHITESPACE = " \t\r\n"
_OPERATORS = ["!=", "==", "=", "!", "(", ")", ",", ">", "<"]
_BINARY = ["in", "notin", "=", "==", "!=", "gt", "lt"]

EOS, IDENT, IN, NOTIN, EQ, DEQ, NEQ, GT, LT, NOT, LPAR, RPAR, COMMA, ERROR = range(14)
_SYMBOL_TOKENS = {"!=": NEQ, "==": DEQ, "=": EQ, "!": NOT, "(": LPAR, ")": RPAR, ",": COMMA, ">": GT, "<": LT}


def _lex(text: str) -> list[tuple[int, str]]:
    tokens: list[tuple[int, str]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _WHITESPACE:
            i += 1
        if i >= n:
            tokens.append((EOS, ""))
            return tokens
        if text[i] in _SPECIAL:
            for op in _OPERATORS:
                if text.startswith(op, i):
                    tokens.append((_SYMBOL_TOKENS[op], op))
                    i += len(op)
                    break
            else:
                tokens.append((ERROR, text[i]))
                i += 1
            continue
        j = i
        while j < n and text[j] not in _WHITESPACE and text[j] not in _SPECIAL:
            j += 1
        word = text[i:j]
        tokens.append((IN if word == "in" else NOTIN if word == "notin" else IDENT, word))
        i = j


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _lex(text)
        self.pos = 0

    def lookahead(self, values: bool = True) -> tuple[int, str]:
        tok, lit = self.tokens[self.pos]
        if values and tok in (IN, NOTIN):
            tok = IDENT
        return tok, lit

    def consume(self, values: bool = True) -> tuple[int, str]:
        tok, lit = self.lookahead(values)
        if self.pos < len(self.tokens) - 1:
            self.pos += 1
        return tok, lit

    def parse(self) -> list[tuple[str, str, list[str]]]:
        requirements = []
        while True:
            tok, lit = self.lookahead()
            if tok in (IDENT, NOT):
                try:
                    requirements.append(self.requirement())
                except SelectorError as exc:
                    raise SelectorError(f"unable to parse requirement: {exc}") from None
                t, lit2 = self.consume()
                if t == EOS:
                    return requirements
                if t == COMMA:
                    t2, l2 = self.lookahead()
                    if t2 not in (IDENT, NOT):
                        raise SelectorError(f"found '{l2}', expected: identifier after ','")
                    continue
                raise SelectorError(f"found '{lit2}', expected: ',' or 'end of string'")
            if tok == EOS:
                return requirements
            raise SelectorError(f"found '{lit}', expected: !, identifier, or 'end of string'")

    def requirement(self) -> tuple[str, str, list[str]]:
        op = ""
        tok, key = self.consume()
        if tok == NOT:
            op = "!"
            tok, key = self.consume()
        if tok != IDENT:
            raise SelectorError(f"found '{key}', expected: identifier")
        _check_key(key)
        t, _ = self.lookahead()
        if op == "!" or t in (EOS, COMMA):
            return key, op or "exists", []
        tok, lit = self.consume(values=False)
        ops = {IN: "in", NOTIN: "notin", EQ: "=", DEQ: "==", NEQ: "!=", GT: "gt", LT: "lt"}
        if tok not in ops:
            raise SelectorError(f"found '{lit}', expected: {', '.join(_BINARY)}")
        op = ops[tok]
        values = self.set_values() if op in ("in", "notin") else self.exact_value()
        _check_values(key, op, values)
        return key, op, values

    def set_values(self) -> list[str]:
        tok, lit = self.consume()
        if tok != LPAR:
            raise SelectorError(f"found '{lit}' expected: '('")
        tok, lit = self.lookahead()
        if tok in (IDENT, COMMA):
            values = self.identifiers()
            tok2, _ = self.consume()
            if tok2 != RPAR:
                raise SelectorError(f"found '{lit}', expected: ')'")
            return sorted(set(values))
        if tok == RPAR:
            self.consume()
            return [""]
        raise SelectorError(f"found '{lit}', expected: ',', ')' or identifier")

    def identifiers(self) -> list[str]:
        out: list[str] = []
        while True:
            tok, lit = self.consume()
            if tok == IDENT:
                out.append(lit)
                t2, l2 = self.lookahead()
                if t2 == COMMA:
                    continue
                if t2 == RPAR:
                    return out
                raise SelectorError(f"found '{l2}', expected: ',' or ')'")
            if tok == COMMA:
                if not out:
                    out.append("")
                t2, _ = self.lookahead()
                if t2 == RPAR:
                    out.append("")
                    return out
                if t2 == COMMA:
                    self.consume()
                    out.append("")
                continue
            raise SelectorError(f"found '{lit}', expected: ',', or identifier")

    def exact_value(self) -> list[str]:
        tok, _ = self.lookahead()
        if tok in (EOS, COMMA):
            return [""]
        tok, lit = self.consume()
        if tok == IDENT:
            return [lit]
        raise SelectorError(f"found '{lit}', expected: identifier")


def _check_key(key: str) -> None:
    errs = qualified_name(key)
    if errs:
        raise SelectorError(f"key: Invalid value: {format_value(key)}: {'; '.join(errs)}")


def _check_values(key: str, op: str, values: list[str]) -> None:
    problems = []
    if op in ("gt", "lt"):
        for i, v in enumerate(values):
            try:
                int(v)
            except ValueError:
                detail = "for 'Gt', 'Lt' operators, the value must be an integer"
                problems.append(f"values[{i}]: Invalid value: {format_value(v)}: {detail}")
    for i, v in enumerate(values):
        errs = label_value(v)
        if errs:
            problems.append(f"values[{i}][{key}]: Invalid value: {format_value(v)}: {'; '.join(errs)}")
    if problems:
        raise SelectorError(problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]")


def _label_check(key: str, op: str, values: list[str]) -> Callable[[dict[str, str]], bool]:
    allowed = frozenset(values)

    def check(labels: dict[str, str]) -> bool:
        if op == "exists":
            return key in labels
        if op == "!":
            return key not in labels
        if op in ("=", "==", "in"):
            return key in labels and labels[key] in allowed
        if op in ("!=", "notin"):
            return key not in labels or labels[key] not in allowed
        if key not in labels:
            return False
        try:
            have, want = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > want if op == "gt" else have < want

    return check


def parse_label_selector(text: str | None) -> Predicate | None:
    if not text:
        return None
    checks = [_label_check(k, op, vals) for k, op, vals in _Parser(text).parse()]
    if not checks:
        return None

    def predicate(obj: JSON) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return predicate


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    current = ""
    escaped = False
    for ch in text:
        if escaped:
            current += ch
            escaped = False
        elif ch == "\\":
            current += ch
            escaped = True
        elif ch == sep:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def _unescape(text: str) -> str:
    out = ""
    escaped = False
    for ch in text:
        if escaped:
            out += ch
            escaped = False
        elif ch == "\\":
            escaped = True
        else:
            out += ch
    return out


def metadata_fields() -> dict[str, FieldGetter]:
    return {
        "metadata.name": lambda o: str((o.get("metadata") or {}).get("name", "")),
        "metadata.namespace": lambda o: str((o.get("metadata") or {}).get("namespace", "")),
    }


def parse_field_selector(text: str | None, fields: dict[str, FieldGetter] | None = None) -> Predicate | None:
    if not text:
        return None
    fields = fields if fields is not None else metadata_fields()
    checks: list[tuple[FieldGetter, str, bool]] = []
    for term in _split_unescaped(text, ","):
        if not term:
            continue
        for op in ("!=", "==", "="):
            idx = term.find(op)
            if idx > 0:
                key, value = term[:idx], _unescape(term[idx + len(op) :])
                break
        else:
            raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
        getter = fields.get(key)
        if getter is None:
            raise SelectorError(f"field label not supported: {key}")
        checks.append((getter, value, op == "!="))
    if not checks:
        return None

    def predicate(obj: JSON) -> bool:
        return all((getter(obj) == value) != negate for getter, value, negate in checks)

    return predicate


def combine(*predicates: Predicate | None) -> Predicate | None:
    active = [p for p in predicates if p is not None]
    if not active:
        return None
    if len(active) == 1:
        return active[0]
    return lambda obj: all(p(obj) for p in active)
