"""ObjectMeta: names, labels, annotations, finalizers and ownerReferences, validated as apimachinery does.

The checks and their messages are apimachinery's (``pkg/api/validation/objectmeta.go`` and
``pkg/util/validation``): a name that is not a DNS subdomain, a label value that is not a label value, an
ownerReference without a uid, a finalizer added to an object being deleted. Field paths carry no list index
where apimachinery's have none (``metadata.ownerReferences.uid``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from controller.apiserver.errors import FieldError, forbidden, invalid, required, too_long
from controller.apiserver.gojson import quote

JSON = dict[str, Any]

_DNS_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = _DNS_LABEL + "(\\." + _DNS_LABEL + ")*"
_DNS_LABEL_RE = re.compile(_DNS_LABEL)
_DNS_SUBDOMAIN_RE = re.compile(_DNS_SUBDOMAIN)
_QUALIFIED = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QUALIFIED_RE = re.compile(_QUALIFIED)
_LABEL_VALUE = "(" + _QUALIFIED + ")?"
_LABEL_VALUE_RE = re.compile(_LABEL_VALUE)
_QUALIFIED_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
)
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character"
)
STANDARD_FINALIZERS = {"kubernetes", "orphan", "foregroundDeletion"}
ORPHAN = "orphan"
FOREGROUND = "foregroundDeletion"
TOTAL_ANNOTATION_SIZE = 256 * 1024

NameFunc = Callable[[str, bool], list[str]]


def regex_error(msg: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    shown = " or ".join(f"'{e}', " for e in examples)
    return f"{msg} (e.g. {shown}regex used for validation is '{fmt}')"


def max_len_error(n: int) -> str:
    return f"must be no more than {n} characters"


def _mask_trailing_dash(name: str) -> str:
    return name[:-1] + "a" if len(name) > 1 and name.endswith("-") else name


def dns1123_subdomain(name: str, prefix: bool = False) -> list[str]:
    if prefix:
        name = _mask_trailing_dash(name)
    errs = []
    if len(name) > 253:
        errs.append(max_len_error(253))
    if not _DNS_SUBDOMAIN_RE.fullmatch(name):
        errs.append(
            regex_error(
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                "must start and end with an alphanumeric character",
                _DNS_SUBDOMAIN,
                "example.com",
            )
        )
    return errs


def dns1123_label(name: str, prefix: bool = False) -> list[str]:
    if prefix:
        name = _mask_trailing_dash(name)
    errs = []
    if len(name) > 63:
        errs.append(max_len_error(63))
    if not _DNS_LABEL_RE.fullmatch(name):
        errs.append(
            regex_error(
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
                "start and end with an alphanumeric character",
                _DNS_LABEL,
                "my-name",
                "123-abc",
            )
        )
    return errs


def path_segment(name: str, prefix: bool = False) -> list[str]:
    """``path.IsValidPathSegmentName``: what any object name must be (core Events need no more)."""
    if prefix:
        return [f"may not contain '{c}'" for c in ("/", "%") if c in name]
    if name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]


def qualified_name(value: str, what: str = "a qualified name") -> list[str]:
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs += ["prefix part " + m for m in dns1123_subdomain(prefix)]
    else:
        return [
            what
            + " "
            + regex_error(_QUALIFIED_MSG, _QUALIFIED, "MyName", "my.name", "123-abc")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part " + max_len_error(63))
    if not _QUALIFIED_RE.fullmatch(name):
        errs.append("name part " + regex_error(_QUALIFIED_MSG, _QUALIFIED, "MyName", "my.name", "123-abc"))
    return errs


def label_value(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 bytes")
    if not _LABEL_VALUE_RE.fullmatch(value):
        errs.append(regex_error(_LABEL_VALUE_MSG, _LABEL_VALUE, "MyValue", "my_value", "12345"))
    return errs


def validate_labels(labels: dict[str, str] | None, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for key, value in (labels or {}).items():
        errors += [invalid(path, key, m) for m in qualified_name(key, "a valid label key")]
        errors += [invalid(path, value, m) for m in label_value(value)]
    return errors


def validate_annotations(annotations: dict[str, str] | None, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    total = 0
    for key, value in (annotations or {}).items():
        errors += [invalid(path, key, m) for m in qualified_name(key.lower())]
        total += len(key) + len(value)
    if total > TOTAL_ANNOTATION_SIZE:
        errors.append(too_long(path, TOTAL_ANNOTATION_SIZE))
    return errors


def validate_finalizers(finalizers: list[str] | None, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for f in finalizers or []:
        errors += [invalid(path, f, m) for m in qualified_name(f)]
    if ORPHAN in (finalizers or []) and FOREGROUND in (finalizers or []):
        errors.append(invalid(path, finalizers, f"finalizer {ORPHAN} and {FOREGROUND} cannot be both set"))
    return errors


def finalizer_warnings(finalizers: list[str] | None) -> list[str]:
    return [
        f"metadata.finalizers: {quote(f)}: prefer a domain-qualified finalizer name to avoid accidental conflicts "
        "with other finalizer writers"
        for f in finalizers or []
        if "/" not in f and f not in STANDARD_FINALIZERS
    ]


def validate_owner_references(refs: list[JSON] | None, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    controllers = []
    for ref in refs or []:
        api_version = str(ref.get("apiVersion") or "")
        version = api_version.rpartition("/")[2]
        if not version:
            errors.append(invalid(f"{path}.apiVersion", api_version, "version must not be empty"))
        for key in ("kind", "name", "uid"):
            if not ref.get(key):
                errors.append(invalid(f"{path}.{key}", str(ref.get(key) or ""), "must not be empty"))
        if ref.get("controller"):
            controllers.append(ref.get("name", ""))
    if len(controllers) > 1:
        shown = ", ".join(quote(str(c)) for c in controllers)
        errors.append(
            invalid(
                path,
                refs,
                f'Only one reference can have Controller set to true. Found "true" in references for {shown}',
            )
        )
    return errors


def validate_create(meta: JSON, namespaced: bool, name_func: NameFunc) -> list[FieldError]:
    """``ValidateObjectMetaAccessor``."""
    errors: list[FieldError] = []
    generate = meta.get("generateName") or ""
    if generate:
        errors += [invalid("metadata.generateName", generate, m) for m in name_func(generate, True)]
    name = meta.get("name") or ""
    if not name:
        errors.append(required("metadata.name", "name or generateName is required"))
    else:
        errors += [invalid("metadata.name", name, m) for m in name_func(name, False)]
    namespace = meta.get("namespace") or ""
    if namespaced:
        if not namespace:
            errors.append(required("metadata.namespace"))
        else:
            errors += [invalid("metadata.namespace", namespace, m) for m in dns1123_label(namespace)]
    elif namespace:
        errors.append(forbidden("metadata.namespace", "not allowed on this type"))
    generation = meta.get("generation")
    if isinstance(generation, int) and generation < 0:
        errors.append(invalid("metadata.generation", generation, "must be greater than or equal to 0"))
    errors += validate_labels(meta.get("labels"), "metadata.labels")
    errors += validate_annotations(meta.get("annotations"), "metadata.annotations")
    errors += validate_owner_references(meta.get("ownerReferences"), "metadata.ownerReferences")
    errors += validate_finalizers(meta.get("finalizers"), "metadata.finalizers")
    return errors


def validate_update(meta: JSON, old: JSON) -> list[FieldError]:
    """``ValidateObjectMetaAccessorUpdate`` (the server-set fields are kept from ``old`` before this runs)."""
    errors: list[FieldError] = []
    if old.get("deletionTimestamp"):
        have = old.get("finalizers") or []
        added = [f for f in meta.get("finalizers") or [] if f not in have]
        if added:
            shown = ", ".join(quote(f) for f in added)
            errors.append(
                forbidden(
                    "metadata.finalizers",
                    "no new finalizers can be added if the object is being deleted, found new finalizers "
                    f"[]string{{{shown}}}",
                )
            )
    for key in ("name", "namespace", "uid"):
        if (meta.get(key) or "") != (old.get(key) or ""):
            errors.append(invalid(f"metadata.{key}", meta.get(key) or "", "field is immutable"))
    errors += validate_labels(meta.get("labels"), "metadata.labels")
    errors += validate_annotations(meta.get("annotations"), "metadata.annotations")
    errors += validate_owner_references(meta.get("ownerReferences"), "metadata.ownerReferences")
    return errors
