"""JSON, numbers, value formatting and time layouts as kube-apiserver (Go) sees them.

Why: clients read the server's messages and number types. A Go server decodes a JSON integer into int64 when
it fits and into float64 otherwise; ``3.0`` is a float64 that validation accepts as an integer and that
reads back as ``3``; its syntax errors, ``%v``/``%q`` renderings and ``time.Parse`` errors have fixed
texts. This module reproduces exactly those behaviours the API exposes, nothing more.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_JSON_FLOAT_INT = 2**53 - 1  # go-openapi's bound for "a float64 that is a JSON integer"


class JSONSyntaxError(ValueError):
    """Not JSON; ``str()`` is the text Go's encoding/json gives (``invalid character 'n' ...``)."""


def _parse_int(text: str) -> int | float:
    value = int(text)
    if INT64_MIN <= value <= INT64_MAX:
        return value
    return float(value)  # Go: does not fit int64, so float64


def _parse_float(text: str) -> int | float:
    value = float(text)
    if value.is_integer() and abs(value) <= MAX_JSON_FLOAT_INT:
        return int(value)  # reads back as an integer, and validates as one
    return value


def loads(raw: bytes | str) -> Any:
    """Decode like the API server does; :class:`JSONSyntaxError` with Go's message for invalid input."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float)
    except (ValueError, RecursionError):
        raise JSONSyntaxError(syntax_error(text)) from None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def canonical_number(value: float) -> int | float:
    """A float64 as Go encodes it in JSON (an integral value below 1e21 has no fraction or exponent)."""
    if math.isfinite(value) and value.is_integer() and abs(value) < 1e21:
        return int(Decimal(repr(value)))
    return value


def normalize_numbers(obj: Any) -> Any:
    """Numbers of a document decoded elsewhere (YAML) as :func:`loads` would have produced them."""
    if isinstance(obj, bool):
        return obj
    if isinstance(obj, float):
        return _parse_float(repr(obj)) if math.isfinite(obj) else obj
    if isinstance(obj, int):
        return _parse_int(str(obj))
    if isinstance(obj, dict):
        return {k: normalize_numbers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalize_numbers(v) for v in obj]
    return obj


def is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def json_type(value: Any) -> str:
    """The JSON type name Go's unmarshal errors use."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if value is None:
        return "null"
    return "object"


# -- formatting ------------------------------------------------------------------------------------------------


def quote(text: str) -> str:
    """Go's ``%q`` (close enough for API messages: JSON escaping, non-ASCII kept)."""
    return json.dumps(text, ensure_ascii=False)


def _digits(value: float) -> tuple[str, int]:
    """Shortest round-trip digits and the decimal point position (value = 0.d1d2... * 10**dp)."""
    _, digits, exponent = Decimal(repr(abs(value))).as_tuple()
    text = "".join(str(d) for d in digits).rstrip("0") or "0"
    assert isinstance(exponent, int)
    return text, len(digits) + exponent


def format_float(value: float) -> str:
    """Go's ``%v`` of a float64 (``strconv.FormatFloat(f, 'g', -1, 64)``): ``15``, ``0.5``, ``1e+06``,
    ``9.223372036854776e+18``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    digits, dp = _digits(value)
    sign = "-" if value < 0 else ""
    exp = dp - 1
    if exp < -4 or exp >= 6:  # shortest 'g': the exponent form from 1e+06 on
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    if dp <= 0:
        return f"{sign}0.{'0' * -dp}{digits}"
    if dp >= len(digits):
        return f"{sign}{digits}{'0' * (dp - len(digits))}"
    return f"{sign}{digits[:dp]}.{digits[dp:]}"


def format_value(value: Any) -> str:
    """How apimachinery's field errors print a bad value: ``%v`` for numbers and booleans, ``%q`` for strings,
    JSON for anything else, ``null`` for nil."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format_float(value)
    if isinstance(value, str):
        return quote(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- Go's JSON syntax errors -------------------------------------------------------------------------------------


def _quote_char(ch: str) -> str:
    if ch == "'":
        return "'\\''"
    if ch == '"':
        return "'\"'"
    inner = json.dumps(ch)[1:-1]
    return f"'{inner}'"


def syntax_error(text: str) -> str:
    """The message of Go's ``json.Unmarshal`` for an invalid document (its scanner's first error)."""
    s = text
    n = len(s)
    i = 0

    def ws(i: int) -> int:
        while i < n and s[i] in " \t\r\n":
            i += 1
        return i

    class Fail(Exception):
        pass

    def err(msg: str) -> Fail:
        return Fail(msg)

    def value(i: int, context: str) -> int:
        i = ws(i)
        if i >= n:
            raise err("unexpected end of JSON input")
        ch = s[i]
        if ch == "{":
            return obj(i + 1)
        if ch == "[":
            return arr(i + 1)
        if ch == '"':
            return string(i + 1)
        if ch == "-" or ch.isdigit():
            return number(i)
        for word in ("true", "false", "null"):
            if ch == word[0]:
                for k, expected in enumerate(word[1:], start=1):
                    if i + k >= n:
                        raise err("unexpected end of JSON input")
                    if s[i + k] != expected:
                        bad, want = _quote_char(s[i + k]), _quote_char(expected)
                        raise err(f"invalid character {bad} in literal {word} (expecting {want})")
                return i + len(word)
        raise err(f"invalid character {_quote_char(ch)} {context}")

    def string(i: int) -> int:
        while i < n:
            ch = s[i]
            if ch == '"':
                return i + 1
            if ch == "\\":
                if i + 1 >= n:
                    raise err("unexpected end of JSON input")
                esc = s[i + 1]
                if esc in '"\\/bfnrt':
                    i += 2
                    continue
                if esc == "u":
                    for k in range(4):
                        if i + 2 + k >= n:
                            raise err("unexpected end of JSON input")
                        if s[i + 2 + k] not in "0123456789abcdefABCDEF":
                            raise err(
                                f"invalid character {_quote_char(s[i + 2 + k])} in \\u hexadecimal character escape"
                            )
                    i += 6
                    continue
                raise err(f"invalid character {_quote_char(esc)} in string escape code")
            if ord(ch) < 0x20:
                raise err(f"invalid character {_quote_char(ch)} in string literal")
            i += 1
        raise err("unexpected end of JSON input")

    def number(i: int) -> int:
        if s[i] == "-":
            i += 1
            if i >= n:
                raise err("unexpected end of JSON input")
            if not s[i].isdigit():
                raise err(f"invalid character {_quote_char(s[i])} in numeric literal")
        if s[i] == "0":
            i += 1
        else:
            while i < n and s[i].isdigit():
                i += 1
        if i < n and s[i] == ".":
            i += 1
            if i >= n:
                raise err("unexpected end of JSON input")
            if not s[i].isdigit():
                raise err(f"invalid character {_quote_char(s[i])} after decimal point in numeric literal")
            while i < n and s[i].isdigit():
                i += 1
        if i < n and s[i] in "eE":
            i += 1
            if i < n and s[i] in "+-":
                i += 1
            if i >= n:
                raise err("unexpected end of JSON input")
            if not s[i].isdigit():
                raise err(f"invalid character {_quote_char(s[i])} in exponent of numeric literal")
            while i < n and s[i].isdigit():
                i += 1
        return i

    def obj(i: int) -> int:
        i = ws(i)
        if i < n and s[i] == "}":
            return i + 1
        while True:
            i = ws(i)
            if i >= n:
                raise err("unexpected end of JSON input")
            if s[i] != '"':
                raise err(f"invalid character {_quote_char(s[i])} looking for beginning of object key string")
            i = string(i + 1)
            i = ws(i)
            if i >= n:
                raise err("unexpected end of JSON input")
            if s[i] != ":":
                raise err(f"invalid character {_quote_char(s[i])} after object key")
            i = value(i + 1, "looking for beginning of value")
            i = ws(i)
            if i >= n:
                raise err("unexpected end of JSON input")
            if s[i] == "}":
                return i + 1
            if s[i] != ",":
                raise err(f"invalid character {_quote_char(s[i])} after object key:value pair")
            i += 1

    def arr(i: int) -> int:
        i = ws(i)
        if i < n and s[i] == "]":
            return i + 1
        while True:
            i = value(i, "looking for beginning of value")
            i = ws(i)
            if i >= n:
                raise err("unexpected end of JSON input")
            if s[i] == "]":
                return i + 1
            if s[i] != ",":
                raise err(f"invalid character {_quote_char(s[i])} after array element")
            i += 1

    try:
        if not s.strip():
            return "unexpected end of JSON input"
        i = value(0, "looking for beginning of value")
        i = ws(i)
        if i < n:
            return f"invalid character {_quote_char(s[i])} after top-level value"
    except Fail as exc:
        return str(exc)
    except RecursionError:
        return "exceeded max depth"
    return "invalid JSON"


# -- Go's time layouts ---------------------------------------------------------------------------------------------

RFC3339 = "2006-01-02T15:04:05Z07:00"
RFC3339_MICRO = "2006-01-02T15:04:05.000000Z07:00"


class TimeParseError(ValueError):
    pass


def parse_time(value: str, layout: str) -> tuple[int, int, int, int, int, int, int, int]:
    """``time.Parse`` for the two layouts the API uses; returns (y, mo, d, h, mi, s, micros, offset seconds).

    Errors carry Go's text: ``parsing time "x" as "<layout>": cannot parse "x" as "2006"``."""
    micro_layout = layout == RFC3339_MICRO
    elements = ["2006", "-", "01", "-", "02", "T", "15", ":", "04", ":", "05"]
    if micro_layout:
        elements.append(".000000")
    elements.append("Z07:00")
    rest = value
    fields: dict[str, int] = {}
    micros = 0
    offset = 0

    def fail(elem: str) -> TimeParseError:
        return TimeParseError(
            f"parsing time {quote(value)} as {quote(layout)}: cannot parse {quote(rest)} as {quote(elem)}"
        )

    for elem in elements:
        if elem in ("2006", "01", "02", "15", "04", "05"):
            width = 4 if elem == "2006" else 2
            chunk = rest[:width]
            if len(chunk) < width or not chunk.isdigit():
                raise fail(elem)
            number = int(chunk)
            rest = rest[width:]
            fields[elem] = number
            if elem == "05" and not micro_layout and rest[:1] == "." and rest[1:2].isdigit():
                j = 1
                while j < len(rest) and rest[j].isdigit():
                    j += 1
                frac = rest[1:j]
                micros = int((frac + "000000")[:6])
                rest = rest[j:]
            ranges = {
                "01": (1, 12, "month"),
                "02": (1, 31, "day"),
                "15": (0, 23, "hour"),
                "04": (0, 59, "minute"),
                "05": (0, 59, "second"),
            }
            if elem in ranges:
                lo, hi, what = ranges[elem]
                if not lo <= number <= hi:
                    raise TimeParseError(f"parsing time {quote(value)}: {what} out of range")
        elif elem == ".000000":
            if len(rest) < 7 or rest[0] != "." or not rest[1:7].isdigit():
                raise fail(elem)
            micros = int(rest[1:7])
            rest = rest[7:]
        elif elem == "Z07:00":
            if rest[:1] == "Z":
                rest = rest[1:]
            elif len(rest) >= 6 and rest[0] in "+-" and rest[1:3].isdigit() and rest[3] == ":" and rest[4:6].isdigit():
                offset = (int(rest[1:3]) * 3600 + int(rest[4:6]) * 60) * (1 if rest[0] == "+" else -1)
                rest = rest[6:]
            else:
                raise fail(elem)
        else:
            if not rest.startswith(elem):
                raise fail(elem)
            rest = rest[len(elem) :]
    if rest:
        raise TimeParseError(f"parsing time {quote(value)}: extra text: {quote(rest)}")
    return fields["2006"], fields["01"], fields["02"], fields["15"], fields["04"], fields["05"], micros, offset
