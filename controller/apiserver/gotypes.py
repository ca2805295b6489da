"""Typed decoding of built-in kinds and of ObjectMeta, as Go's encoding/json does it on the real server.

Built-in kinds are Go structs: a wrong JSON type is a 400 (``json: cannot unmarshal number into Go struct field
LeaseSpec.spec.leaseDurationSeconds of type int32``), a time must parse with its layout, unknown fields are
dropped (with a warning, or a 400 under ``fieldValidation=Strict``), and the object reads back in Go's encoding:
``omitempty`` fields left out when empty, the others always present (``"eventTime": null``, ``"source": {}``).
A :class:`Struct` describes one Go struct; :func:`decode` applies it to a JSON document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from controller.apiserver.gojson import (
    INT64_MAX,
    INT64_MIN,
    RFC3339,
    RFC3339_MICRO,
    TimeParseError,
    json_type,
    parse_time,
)

JSON = dict[str, Any]


class DecodeError(ValueError):
    """The decoding failed; ``str()`` is Go's message (the request answers 400)."""


@dataclass
class Decoder:
    unknown: list[str] = field(default_factory=list)
    error: str | None = None

    def type_error(self, value: Any, struct: str, path: str, go: str, literal: bool = False) -> None:
        if self.error is None:
            what = json_type(value)
            if literal and what == "number":
                what = f"number {_number_text(value)}"
            where = f"Go struct field {struct}.{path}" if struct else "Go value"
            self.error = f"json: cannot unmarshal {what} into {where} of type {go}"


def _number_text(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class GoType:
    go = "interface {}"
    #: Go's omitempty treats this type's zero value as empty (structs and times never are).
    emptiable = True

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        return value

    def zero(self) -> Any:
        return None

    def empty(self, value: Any) -> bool:
        return value in (None, "", 0, False) or value == {} or value == []


class _Str(GoType):
    go = "string"

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return ""
        if not isinstance(value, str):
            d.type_error(value, struct, path, self.go)
            return ""
        return value

    def zero(self) -> Any:
        return ""


class _Bool(GoType):
    go = "bool"

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return False
        if not isinstance(value, bool):
            d.type_error(value, struct, path, self.go)
            return False
        return value

    def zero(self) -> Any:
        return False


class _Int(GoType):
    def __init__(self, bits: int) -> None:
        self.go = f"int{bits}"
        self.lo, self.hi = (-(2**31), 2**31 - 1) if bits == 32 else (INT64_MIN, INT64_MAX)

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int | float):
            d.type_error(value, struct, path, self.go)
            return 0
        if isinstance(value, float) or not self.lo <= value <= self.hi:
            d.type_error(value, struct, path, self.go, literal=True)
            return 0
        return value

    def zero(self) -> Any:
        return 0


class _Time(GoType):
    """metav1.Time (RFC 3339, read back to the second) or metav1.MicroTime (exactly six fractional digits)."""

    emptiable = False

    def __init__(self, micro: bool) -> None:
        self.micro = micro
        self.layout = RFC3339_MICRO if micro else RFC3339
        self.go = "v1.MicroTime" if micro else "v1.Time"

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return None
        if not isinstance(value, str):
            if d.error is None:
                d.error = f"json: cannot unmarshal {json_type(value)} into Go value of type string"
            return None
        try:
            y, mo, day, h, mi, s, micros, offset = parse_time(value, self.layout)
        except TimeParseError as exc:
            raise DecodeError(str(exc)) from None
        stamp = datetime(y, mo, day, h, mi, s, micros, tzinfo=UTC) - timedelta(seconds=offset)
        if self.micro:
            return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond:06d}Z"
        return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


class Map(GoType):
    def __init__(self, elem: GoType) -> None:
        self.elem = elem
        self.go = f"map[string]{elem.go}"

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict):
            d.type_error(value, struct, path, self.go)
            return None
        return {k: self.elem.decode(v, d, struct, path) for k, v in value.items()}


class Slice(GoType):
    def __init__(self, elem: GoType) -> None:
        self.elem = elem
        self.go = f"[]{elem.go}"

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return None
        if not isinstance(value, list):
            d.type_error(value, struct, path, self.go)
            return None
        return [self.elem.decode(v, d, struct, f"{path}") for v in value]


@dataclass
class Field:
    type: GoType
    omitempty: bool = True
    pointer: bool = False


class Struct(GoType):
    emptiable = False

    def __init__(self, name: str, go: str, fields: dict[str, Field], open_keys: bool = False) -> None:
        self.name = name
        self.go = go
        self.fields = fields
        self.open_keys = open_keys  # keep unknown keys (e.g. an embedded raw extension)

    def decode(self, value: Any, d: Decoder, struct: str, path: str) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict):
            d.type_error(value, struct, path, self.go)
            return None
        out: JSON = {}
        for key, val in value.items():
            spec = self.fields.get(key)
            sub = f"{path}.{key}" if path else key
            if spec is None:
                if self.open_keys:
                    out[key] = val
                else:
                    d.unknown.append(sub)
                continue
            if spec.pointer and val is None:
                continue
            decoded = spec.type.decode(val, d, self.name, sub)
            if spec.pointer or decoded is not None or not spec.omitempty:
                out[key] = decoded
        return self.encode(out)

    def encode(self, decoded: JSON) -> JSON:
        """Go's encoding of a decoded struct: field order, omitempty, zero values of the other fields."""
        out: JSON = {}
        for key, spec in self.fields.items():
            if key in decoded:
                val = decoded[key]
                if spec.pointer:
                    out[key] = val
                    continue
                if spec.omitempty and spec.type.emptiable and spec.type.empty(val):
                    continue
                if isinstance(spec.type, Struct) and val is None:
                    val = spec.type.encode({})
                out[key] = val
            elif not spec.omitempty or not spec.type.emptiable:
                if spec.pointer:
                    continue
                if isinstance(spec.type, Struct):
                    out[key] = spec.type.encode({})
                else:
                    out[key] = None if isinstance(spec.type, Map | Slice | _Time) else spec.type.zero()
        for key, val in decoded.items():
            if key not in self.fields:
                out[key] = val
        return out

    def zero(self) -> Any:
        return self.encode({})


STRING = _Str()
BOOL = _Bool()
INT32 = _Int(32)
INT64 = _Int(64)
TIME = _Time(micro=False)
MICROTIME = _Time(micro=True)
RAW = GoType()


def decode(struct: Struct, value: JSON, path: str = "") -> tuple[JSON, list[str]]:
    """Decode ``value`` as ``struct``; returns (Go's re-encoding, unknown field paths). :class:`DecodeError`."""
    d = Decoder()
    out = struct.decode(value, d, "", path)
    if d.error is not None:
        raise DecodeError(d.error)
    return out, d.unknown


OWNER_REFERENCE = Struct(
    "OwnerReference",
    "v1.OwnerReference",
    {
        "apiVersion": Field(STRING, omitempty=False),
        "kind": Field(STRING, omitempty=False),
        "name": Field(STRING, omitempty=False),
        "uid": Field(STRING, omitempty=False),
        "controller": Field(BOOL, pointer=True),
        "blockOwnerDeletion": Field(BOOL, pointer=True),
    },
)

OBJECT_META = Struct(
    "ObjectMeta",
    "v1.ObjectMeta",
    {
        "name": Field(STRING),
        "generateName": Field(STRING),
        "namespace": Field(STRING),
        "selfLink": Field(STRING),
        "uid": Field(STRING),
        "resourceVersion": Field(STRING),
        "generation": Field(INT64),
        "creationTimestamp": Field(TIME, pointer=True),
        "deletionTimestamp": Field(TIME, pointer=True),
        "deletionGracePeriodSeconds": Field(INT64, pointer=True),
        "labels": Field(Map(STRING)),
        "annotations": Field(Map(STRING)),
        "ownerReferences": Field(Slice(OWNER_REFERENCE)),
        "finalizers": Field(Slice(STRING)),
        "managedFields": Field(Slice(RAW)),
    },
)
