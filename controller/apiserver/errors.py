"""API errors as kube-apiserver reports them: ``kind: Status`` bodies and apimachinery's field errors.

A client reads ``code``, ``reason``, ``details`` and often the ``message``; their texts follow apimachinery
(``k8s.io/apimachinery/pkg/api/errors`` and ``pkg/util/validation/field``) so that code and tests written
against a real cluster behave the same here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controller.apiserver.gojson import format_value, quote

JSON = dict[str, Any]


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT: Any = _Omit()  # a field error whose bad value is not shown

_TYPE_TEXT = {
    "FieldValueNotFound": "Not found",
    "FieldValueRequired": "Required value",
    "FieldValueDuplicate": "Duplicate value",
    "FieldValueInvalid": "Invalid value",
    "FieldValueNotSupported": "Unsupported value",
    "FieldValueForbidden": "Forbidden",
    "FieldValueTooLong": "Too long",
    "FieldValueTooMany": "Too many",
    "InternalError": "Internal error",
    "FieldValueTypeInvalid": "Invalid value",
}
_NO_VALUE = {"FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong", "InternalError"}


@dataclass(frozen=True)
class FieldError:
    """``field.Error``: ``type`` (the cause reason), ``field`` (``None`` renders ``<nil>``), bad value, detail."""

    type: str
    field: str | None
    value: Any = OMIT
    detail: str = ""

    @property
    def path(self) -> str:
        return self.field if self.field is not None else "<nil>"

    def body(self) -> str:
        text = _TYPE_TEXT.get(self.type, self.type)
        if self.type not in _NO_VALUE and self.value is not OMIT:
            text += ": " + format_value(self.value)
        if self.detail:
            text += ": " + self.detail
        return text

    def __str__(self) -> str:
        return f"{self.path}: {self.body()}"

    def cause(self) -> JSON:
        return {"reason": self.type, "message": self.body(), "field": self.path}


def required(path: str | None, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", path, OMIT, detail)


def invalid(path: str | None, value: Any, detail: str = "") -> FieldError:
    return FieldError("FieldValueInvalid", path, value, detail)


def forbidden(path: str | None, detail: str) -> FieldError:
    return FieldError("FieldValueForbidden", path, OMIT, detail)


def not_supported(path: str | None, value: Any, allowed: list[Any]) -> FieldError:
    shown = [v if isinstance(v, str) else format_value(v) for v in allowed]
    return FieldError("FieldValueNotSupported", path, value, "supported values: " + ", ".join(quote(s) for s in shown))


def duplicate(path: str | None, value: Any) -> FieldError:
    return FieldError("FieldValueDuplicate", path, value)


def too_long(path: str | None, limit: int) -> FieldError:
    return FieldError("FieldValueTooLong", path, OMIT, f"may not be more than {limit} bytes")


def too_many(path: str | None, actual: int, limit: int) -> FieldError:
    return FieldError("FieldValueTooMany", path, actual, f"must have at most {limit} items")


def type_invalid(path: str | None, value: Any, detail: str) -> FieldError:
    return FieldError("FieldValueTypeInvalid", path, value, detail)


class ApiError(Exception):
    """An API failure; :meth:`status` is the ``kind: Status`` body the real server sends.

    ``reason`` may be empty (a 500 without reason, as the real server sends for some decoding failures)."""

    def __init__(
        self, code: int, reason: str, message: str, details: JSON | None = None, warnings: list[str] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.warnings = warnings or []  # Warning headers sent with the error

    def status(self) -> JSON:
        body: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
        }
        if self.reason:
            body["reason"] = self.reason
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def details(name: str = "", group: str = "", kind: str = "", **extra: Any) -> JSON:
    """``StatusDetails`` with Go's omitempty: empty name/group/kind are left out."""
    out: JSON = {}
    if name:
        out["name"] = name
    if group:
        out["group"] = group
    if kind:
        out["kind"] = kind
    out.update(extra)
    return out


def invalid_error(group: str, kind: str, name: str, errors: list[FieldError]) -> ApiError:
    """``errors.NewInvalid``: 422 ``<Kind>.<group> "<name>" is invalid: ...``; the message lists each distinct
    error once (``[a, b]`` for several), the causes list every error."""
    qualified = f"{kind}.{group}" if group else kind
    texts: list[str] = []
    for e in errors:
        text = str(e)
        if text not in texts:
            texts.append(text)
    summary = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    message = f"{qualified} {quote(name)} is invalid"
    if texts:
        message += ": " + summary
    return ApiError(422, "Invalid", message, details(name, group, kind, causes=[e.cause() for e in errors]))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def internal(message: str) -> ApiError:
    """A 500 as the real server answers some decoding failures: no reason."""
    return ApiError(500, "", message)


def not_found(group: str, resource: str, name: str) -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, "NotFound", f"{qualified} {quote(name)} not found", details(name, group, resource))


def already_exists(group: str, resource: str, name: str) -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(409, "AlreadyExists", f"{qualified} {quote(name)} already exists", details(name, group, resource))


MODIFIED = "the object has been modified; please apply your changes to the latest version and try again"


def conflict(group: str, resource: str, name: str, text: str = MODIFIED) -> ApiError:
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(
        409,
        "Conflict",
        f"Operation cannot be fulfilled on {qualified} {quote(name)}: {text}",
        details(name, group, resource),
    )


def unsupported_media_type(accepted: list[str]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: " + ", ".join(accepted),
    )


class PageNotFound(Exception):
    """A path the server does not serve at all: ``404 page not found`` in plain text, as the real mux answers."""
