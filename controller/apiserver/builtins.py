"""The built-in kinds the project uses, as typed Go objects: Namespace, ConfigMap, Secret, Lease, Event.

Each kind is a :class:`gotypes.Struct` (what decodes, what reads back, which fields are always present) plus
its validation (``pkg/apis/*/validation`` of kube-apiserver, with their messages). Core/v1 and
events.k8s.io/v1 Events are one storage: objects are stored in the core/v1 form and converted, field by field,
when read or written through events.k8s.io/v1 (``involvedObject`` <-> ``regarding``, ``message`` <-> ``note``...).
"""

from __future__ import annotations

import base64
import re
from typing import Any

from controller.apiserver.errors import FieldError, forbidden, invalid, required, too_long
from controller.apiserver.gotypes import (
    BOOL,
    INT32,
    MICROTIME,
    OBJECT_META,
    RAW,
    STRING,
    TIME,
    Field,
    Map,
    Slice,
    Struct,
)
from controller.apiserver.meta import dns1123_subdomain, qualified_name, regex_error, validate_finalizers

JSON = dict[str, Any]

NAMESPACE_CONDITION = Struct(
    "NamespaceCondition",
    "v1.NamespaceCondition",
    {
        "type": Field(STRING, omitempty=False),
        "status": Field(STRING, omitempty=False),
        "lastTransitionTime": Field(TIME, pointer=True),
        "reason": Field(STRING),
        "message": Field(STRING),
    },
)
NAMESPACE = Struct(
    "Namespace",
    "v1.Namespace",
    {
        "kind": Field(STRING),
        "apiVersion": Field(STRING),
        "metadata": Field(OBJECT_META),
        "spec": Field(Struct("NamespaceSpec", "v1.NamespaceSpec", {"finalizers": Field(Slice(STRING))})),
        "status": Field(
            Struct(
                "NamespaceStatus",
                "v1.NamespaceStatus",
                {"phase": Field(STRING), "conditions": Field(Slice(NAMESPACE_CONDITION))},
            )
        ),
    },
)
CONFIGMAP = Struct(
    "ConfigMap",
    "v1.ConfigMap",
    {
        "kind": Field(STRING),
        "apiVersion": Field(STRING),
        "metadata": Field(OBJECT_META),
        "immutable": Field(BOOL, pointer=True),
        "data": Field(Map(STRING)),
        "binaryData": Field(Map(STRING)),
    },
)
#: core/v1 Secret: ``data`` holds base64 strings; ``stringData`` (write-only) is merged into ``data`` on write
#: (:func:`secret_string_data`), as kube-apiserver does. A changefeed's source and sink credentials live here.
SECRET = Struct(
    "Secret",
    "v1.Secret",
    {
        "kind": Field(STRING),
        "apiVersion": Field(STRING),
        "metadata": Field(OBJECT_META),
        "immutable": Field(BOOL, pointer=True),
        "data": Field(Map(STRING)),
        "stringData": Field(Map(STRING)),
        "type": Field(STRING),
    },
)


def secret_string_data(obj: JSON) -> JSON:
    """A Secret as stored: ``stringData`` merged into ``data`` (base64; it wins on a shared key), ``type``
    defaulted to ``Opaque``."""
    out = dict(obj)
    string_data = out.pop("stringData", None) or {}
    if string_data:
        data = dict(out.get("data") or {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        out["data"] = data
    out.setdefault("type", "Opaque")
    return out


LEASE_SPEC = Struct(
    "LeaseSpec",
    "v1.LeaseSpec",
    {
        "holderIdentity": Field(STRING, pointer=True),
        "leaseDurationSeconds": Field(INT32, pointer=True),
        "acquireTime": Field(MICROTIME, pointer=True),
        "renewTime": Field(MICROTIME, pointer=True),
        "leaseTransitions": Field(INT32, pointer=True),
        "strategy": Field(STRING, pointer=True),
        "preferredHolder": Field(STRING, pointer=True),
    },
)
LEASE = Struct(
    "Lease",
    "v1.Lease",
    {"kind": Field(STRING), "apiVersion": Field(STRING), "metadata": Field(OBJECT_META), "spec": Field(LEASE_SPEC)},
)
OBJECT_REFERENCE = Struct(
    "ObjectReference",
    "v1.ObjectReference",
    {
        "kind": Field(STRING),
        "namespace": Field(STRING),
        "name": Field(STRING),
        "uid": Field(STRING),
        "apiVersion": Field(STRING),
        "resourceVersion": Field(STRING),
        "fieldPath": Field(STRING),
    },
)
EVENT_SOURCE = Struct("EventSource", "v1.EventSource", {"component": Field(STRING), "host": Field(STRING)})
EVENT_SERIES = Struct(
    "EventSeries",
    "v1.EventSeries",
    {"count": Field(INT32), "lastObservedTime": Field(MICROTIME)},
)
CORE_EVENT = Struct(
    "Event",
    "v1.Event",
    {
        "kind": Field(STRING),
        "apiVersion": Field(STRING),
        "metadata": Field(OBJECT_META),
        "involvedObject": Field(OBJECT_REFERENCE),
        "reason": Field(STRING),
        "message": Field(STRING),
        "source": Field(EVENT_SOURCE),
        "firstTimestamp": Field(TIME),
        "lastTimestamp": Field(TIME),
        "count": Field(INT32),
        "type": Field(STRING),
        "eventTime": Field(MICROTIME),
        "series": Field(EVENT_SERIES, pointer=True),
        "action": Field(STRING),
        "related": Field(OBJECT_REFERENCE, pointer=True),
        "reportingComponent": Field(STRING, omitempty=False),
        "reportingInstance": Field(STRING, omitempty=False),
    },
)
V1_EVENT = Struct(
    "Event",
    "v1.Event",
    {
        "kind": Field(STRING),
        "apiVersion": Field(STRING),
        "metadata": Field(OBJECT_META),
        "eventTime": Field(MICROTIME, omitempty=False),
        "series": Field(EVENT_SERIES, pointer=True),
        "reportingController": Field(STRING),
        "reportingInstance": Field(STRING),
        "action": Field(STRING),
        "reason": Field(STRING),
        "regarding": Field(OBJECT_REFERENCE),
        "related": Field(OBJECT_REFERENCE, pointer=True),
        "note": Field(STRING),
        "type": Field(STRING),
        "deprecatedSource": Field(EVENT_SOURCE),
        "deprecatedFirstTimestamp": Field(TIME),
        "deprecatedLastTimestamp": Field(TIME),
        "deprecatedCount": Field(INT32),
    },
)
DELETE_OPTIONS = Struct(
    "DeleteOptions",
    "v1.DeleteOptions",
    {
        "kind": Field(STRING),
        "apiVersion": Field(STRING),
        "gracePeriodSeconds": Field(RAW, pointer=True),
        "preconditions": Field(
            Struct(
                "Preconditions",
                "v1.Preconditions",
                {"uid": Field(STRING, pointer=True), "resourceVersion": Field(STRING, pointer=True)},
            ),
            pointer=True,
        ),
        "orphanDependents": Field(BOOL, pointer=True),
        "propagationPolicy": Field(STRING, pointer=True),
        "dryRun": Field(Slice(STRING)),
        "ignoreStoreReadErrorWithClusterBreakingPotential": Field(BOOL, pointer=True),
    },
)

#: core/v1 field <-> events.k8s.io/v1 field (the rest have the same name).
_EVENT_FIELDS = {
    "involvedObject": "regarding",
    "message": "note",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
    "reportingComponent": "reportingController",
}
_EVENT_FIELDS_BACK = {v: k for k, v in _EVENT_FIELDS.items()}


def event_to_v1(core: JSON) -> JSON:
    out = {_EVENT_FIELDS.get(k, k): v for k, v in core.items()}
    out["apiVersion"] = "events.k8s.io/v1"
    return V1_EVENT.encode(out)


def event_to_core(v1: JSON) -> JSON:
    out = {_EVENT_FIELDS_BACK.get(k, k): v for k, v in v1.items()}
    out["apiVersion"] = "v1"
    return CORE_EVENT.encode(out)


#: events.k8s.io/v1 field selector names -> the core/v1 ones the storage indexes.
EVENT_FIELD_LABELS = {f"{_EVENT_FIELDS.get(k, k)}": k for k in ("reportingComponent", "source", "type", "reason")} | {
    f"regarding.{k}": f"involvedObject.{k}"
    for k in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")
}
EVENT_CORE_FIELD_LABELS = [
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
]


def event_field(obj: JSON, label: str) -> str | None:
    """The value a core Event's field selector compares (``involvedObject.name``, ``source``...)."""
    if label.startswith("involvedObject."):
        return str((obj.get("involvedObject") or {}).get(label.split(".", 1)[1], ""))
    if label == "source":
        return str((obj.get("source") or {}).get("component", ""))
    if label in ("reason", "reportingComponent", "type"):
        return str(obj.get(label) or "")
    return None


# -- validation --------------------------------------------------------------------------------------------------


def validate_namespace(obj: JSON) -> list[FieldError]:
    errors: list[FieldError] = []
    for f in (obj.get("spec") or {}).get("finalizers") or []:
        errors += [invalid("spec.finalizers", f, m) for m in qualified_name(f)]
        if "/" not in f and f != "kubernetes":
            errors.append(
                forbidden("spec.finalizers", "name is neither a standard finalizer name nor is it fully qualified")
            )
    return errors


_CONFIG_KEY_RE = re.compile(r"[-._a-zA-Z0-9]+")


def validate_configmap(obj: JSON, old: JSON | None) -> list[FieldError]:
    errors: list[FieldError] = []
    total = 0
    for part in ("data", "binaryData"):
        for key, value in (obj.get(part) or {}).items():
            problems = []
            if len(key) > 253:
                problems.append("must be no more than 253 characters")
            if not _CONFIG_KEY_RE.fullmatch(key):
                problems.append(
                    regex_error(
                        "a valid config key must consist of alphanumeric characters, '-', '_' or '.'",
                        "[-._a-zA-Z0-9]+",
                        "key.name",
                        "KEY_NAME",
                        "key-name",
                    )
                )
            errors += [invalid(f"{part}[{key}]", key, m) for m in problems]
            total += len(key) + len(value)
    for key in set(obj.get("data") or {}) & set(obj.get("binaryData") or {}):
        errors.append(invalid(f"data[{key}]", key, "duplicate of key present in binaryData"))
    if total > 1024 * 1024:
        errors.append(too_long("", 1024 * 1024))
    if old is not None and old.get("immutable"):
        if obj.get("immutable") is not True:
            errors.append(forbidden("immutable", "field is immutable when `immutable` is set"))
        if obj.get("data") != old.get("data") or obj.get("binaryData") != old.get("binaryData"):
            errors.append(forbidden("data", "field is immutable when `immutable` is set"))
    return errors


def validate_lease(obj: JSON) -> list[FieldError]:
    spec = obj.get("spec") or {}
    errors: list[FieldError] = []
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and duration <= 0:
        errors.append(invalid("spec.leaseDurationSeconds", duration, "must be greater than 0"))
    transitions = spec.get("leaseTransitions")
    if transitions is not None and transitions < 0:
        errors.append(invalid("spec.leaseTransitions", transitions, "must be greater than or equal to 0"))
    if spec.get("preferredHolder") and not spec.get("strategy"):
        errors.append(forbidden("spec.preferredHolder", "may only be specified if `strategy` is defined"))
    return errors


_REPORTING_INSTANCE_MAX = 128
_ACTION_MAX = 128
_REASON_MAX = 128
_NOTE_MAX = 1024


def validate_event(event: JSON, namespace: str, strict: bool) -> list[FieldError]:
    """``ValidateEventCreate``; ``strict`` for writes through events.k8s.io/v1 (the core API stays lenient)."""
    errors: list[FieldError] = []
    involved = event.get("involvedObject") or {}
    involved_ns = str(involved.get("namespace") or "")
    controller_field = "reportingController" if strict else "reportingComponent"
    if not event.get("eventTime"):
        if not involved_ns:
            if namespace not in ("", "default"):
                errors.append(invalid("involvedObject.namespace", involved_ns, "does not match event.namespace"))
        elif namespace != involved_ns:
            errors.append(invalid("involvedObject.namespace", involved_ns, "does not match event.namespace"))
    else:
        if not involved_ns and namespace not in ("default", "kube-system"):
            errors.append(invalid("involvedObject.namespace", involved_ns, "does not match event.namespace"))
        controller = str(event.get("reportingComponent") or "")
        if not controller:
            errors.append(required(controller_field))
        errors += [invalid(controller_field, controller, m) for m in qualified_name(controller)]
        instance = str(event.get("reportingInstance") or "")
        if not instance:
            errors.append(required("reportingInstance"))
        if len(instance) > _REPORTING_INSTANCE_MAX:
            errors.append(invalid("reportingInstance", "", f"can have at most {_REPORTING_INSTANCE_MAX} characters"))
        action = str(event.get("action") or "")
        if not action:
            errors.append(required("action"))
        if len(action) > _ACTION_MAX:
            errors.append(invalid("action", "", f"can have at most {_ACTION_MAX} characters"))
        reason = str(event.get("reason") or "")
        if not reason:
            errors.append(required("reason"))
        if len(reason) > _REASON_MAX:
            errors.append(invalid("reason", "", f"can have at most {_REASON_MAX} characters"))
        if len(str(event.get("message") or "")) > _NOTE_MAX:
            errors.append(invalid("message", "", f"can have at most {_NOTE_MAX} characters"))
    errors += [invalid("namespace", namespace, m) for m in dns1123_subdomain(namespace)]
    if not strict:
        return errors
    series = event.get("series")
    if series is not None:
        if (series.get("count") or 0) < 2:
            errors.append(invalid("series.count", series.get("count") or 0, "should be at least 2"))
        if not series.get("lastObservedTime"):
            errors.append(required("series.lastObservedTime"))
    if not event.get("eventTime"):
        errors.append(required("eventTime"))
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(invalid("type", "", f"has invalid value: {event.get('type') or ''}"))
    if event.get("firstTimestamp"):
        errors.append(invalid("firstTimestamp", "", "needs to be unset"))
    if event.get("lastTimestamp"):
        errors.append(invalid("lastTimestamp", "", "needs to be unset"))
    if event.get("count"):
        errors.append(invalid("count", "", "needs to be unset"))
    source = event.get("source") or {}
    if source.get("component") or source.get("host"):
        errors.append(invalid("source", "", "needs to be unset"))
    return errors


def namespace_finalizer_errors(obj: JSON) -> list[FieldError]:
    return validate_finalizers((obj.get("spec") or {}).get("finalizers"), "spec.finalizers")
