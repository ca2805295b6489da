"""Conversion between Kubernetes resource dictionaries and the model records. Pure: no I/O.

Layout (every kind is ``cdc.maintainer.dev/v1alpha1``, namespaced; the CRDs in ``crds/`` declare it):

* ``metadata``: name, namespace, uid, resourceVersion, generation, creationTimestamp (``created``),
  deletionTimestamp (present: ``deleting``), finalizers, labels (a sorted tuple of pairs in the model).
* every field of the model is carried in camelCase under ``spec`` or ``status`` (``SPEC_FIELDS`` and
  ``STATUS_FIELDS`` of the record), with these exceptions (:func:`resource_paths` knows them):
  ``table_id`` -> ``tableID``;
  ``key_range`` -> ``startKey``/``endKey`` (lower-case hex); ``span_counts`` -> ``spans``;
  ``Table.pre_split_spans``/``pre_split_keys`` -> ``spec.preSplit.spans``/``spec.preSplit.splitKeys``;
  ``SpanOperator.status_reason`` -> ``status.reason``; ``Condition.last_transition`` ->
  ``lastTransitionTime``; ``Capture.renew_time``/``lease_duration`` live in the capture's
  ``coordination.k8s.io/v1`` Lease ``capture-<name>`` (``spec.renewTime``, ``spec.leaseDurationSeconds``),
  see :func:`lease_resource` and :func:`capture_from_resources`; so does ``Capture.progress``, as JSON in
  the Lease's annotation ``cdc.maintainer.dev/progress`` (:func:`progress_to_json`), which is read
  leniently: a report that does not parse is ignored (``progress`` None), it never makes the Capture
  invalid (that would make a live capture look gone).
* ``Span.created_capture``/``created_dispatcher`` (a placement recorded when the maintainer created the span)
  live in the annotation ``cdc.maintainer.dev/placement``, JSON ``{"capture": ..., "dispatcher": ...}``,
  read leniently like a progress report (one that does not parse is no placement); a span whose status was
  never written is read as Scheduling there (``Span.with_recorded_placement``).

``to_resource`` omits an optional field whose value is the zero value of its type (``""``, ``0``,
``0.0``, ``False``, ``()``, ``None``, all-zero span counts) when that is also the model's default;
fields without a model default, and fields whose default is not a zero value (``mode``, ``source``,
``splittable``, the scheduler knobs, an operator's ``phase``), are always written. Empty-string enum
values (``DispatcherState.PENDING``, ``Stage.NONE``, a Table's ``state`` "") mean "none yet" and are
omitted. Conditions are always written in full, in the standard ``metav1.Condition`` shape.

``from_resource`` tolerates absent optional fields (and ``None``, as some clients render absent fields),
filling in the model's defaults, and ignores fields it does not know. It is strict about present ones:
a wrong type, an unknown enum value, a key that is not lower-case hex, a negative ts or an empty key
range raises :class:`InvalidResource`, whose message names kind, object, field path and the problem.

Timestamps are RFC 3339 strings in resources and float seconds since the epoch (UTC) in the model,
kept to the microsecond: :func:`format_time` rounds to the nearest microsecond and :func:`parse_time`
rounds a finer fraction to the nearest microsecond (half up). A time that is a whole number of
microseconds (``round_time(x) == x``, e.g. any decimal with at most six fractional digits) survives a
round trip exactly if it is before 2106 (2**32 s; beyond that a float cannot resolve a microsecond).
Stamp model times with :func:`round_time` (e.g. ``round_time(time.time())``) so that records equal what
they read back. ``0.0`` means "absent" for every time except a Capture's ``renew_time``, where ``None``
does. A time without fraction is written ``...:05Z``, otherwise with six digits (``...:05.250000Z``);
a Lease's ``renewTime`` (a MicroTime) always has six. Note that the API server keeps metadata
timestamps (creationTimestamp) to the second only; times in ``status`` are kept as written.

The model does not keep the deletion time: ``to_resource`` of a deleting record writes its creation
time as a stand-in ``deletionTimestamp`` (the API server sets the real one; only presence matters).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, NoReturn, TypeGuard, TypeVar

from controller.model.keys import MAX_TABLE_ID, KeyRange
from controller.model.progress import (
    PROGRESS_ANNOTATION,
    SIDES,
    Progress,
    ProgressEntry,
    Side,
    SinkFigures,
    Trouble,
)
from controller.model.records import (
    Capture,
    Changefeed,
    Condition,
    Dispatcher,
    Join,
    Origin,
    Record,
    SchedulerConfig,
    SchedulerStatus,
    Span,
    SpanCounts,
    SpanOperator,
    Table,
    Target,
)
from controller.model.states import (
    API_VERSION,
    GROUP,
    DispatcherState,
    Kind,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    SchedulerState,
    SpanState,
    Stage,
)
from controller.model.verification import LAST_VERIFY_ANNOTATION, verification_from_json

#: The placement the maintainer recorded in a Span it created (``Span.created_capture``/``created_dispatcher``).
PLACEMENT_ANNOTATION = f"{GROUP}/placement"
#: On a Capture whose ``spec.draining`` its own agent set while shutting down (value ``shutdown``): the next
#: process of that capture clears the drain as it starts; a drain a person set (no annotation) stays.
DRAIN_REASON_ANNOTATION = f"{GROUP}/drain-reason"
#: On a capture's Lease, written by the maintainer that takes it (``intents.FenceCapture``): when, by its clock.
#: Informational; what matters is that the take is a write, so that it lands after the decision's view.
FENCED_ANNOTATION = f"{GROUP}/fenced-at"
DRAIN_FOR_SHUTDOWN = "shutdown"

__all__ = [
    "CAPTURE_LABEL",
    "CHANGEFEED_LABEL",
    "CONDITION_STATUSES",
    "DRAIN_FOR_SHUTDOWN",
    "DRAIN_REASON_ANNOTATION",
    "LEASE_API_VERSION",
    "MAX_TS",
    "PLACEMENT_ANNOTATION",
    "TABLE_ID_LABEL",
    "TABLE_STATES",
    "InvalidResource",
    "capture_from_resources",
    "changefeed_from_resource",
    "changefeed_labels",
    "dispatcher_from_resource",
    "dispatcher_labels",
    "format_time",
    "from_resource",
    "lease_name",
    "lease_resource",
    "operator_from_resource",
    "parse_time",
    "placement_from_json",
    "placement_to_json",
    "progress_from_json",
    "progress_to_json",
    "resource_paths",
    "round_time",
    "span_from_resource",
    "span_labels",
    "status_merge_patch",
    "status_of",
    "table_from_resource",
    "to_resource",
]

#: Label on every object the maintainer creates, naming its changefeed (selectors, ``kubectl -l``).
CHANGEFEED_LABEL = f"{GROUP}/changefeed"
#: Label of a Dispatcher naming its capture (each capture watches only its own: a label selector).
CAPTURE_LABEL = f"{GROUP}/capture"
#: Label of a Span naming its table's ID (``kubectl get spans -l cdc.maintainer.dev/table-id=7``).
TABLE_ID_LABEL = f"{GROUP}/table-id"
LEASE_API_VERSION = "coordination.k8s.io/v1"
#: Values of ``Table.status.state`` ("" in the model: not yet validated, omitted in the resource).
TABLE_STATES = ("Active", "Invalid", "Removing", "Detached")
#: Scheduler knobs whose minimum is 1 (for the others 0 means off, or, for intervals, every decision).
_AT_LEAST_ONE = frozenset(
    {
        "max_in_flight_operators",
        "basic_batch_size",
        "balance_max_moves",
        "drain_batch_size",
        "split_checks",
        "merge_checks",
    }
)
CONDITION_STATUSES = ("True", "False", "Unknown")
#: Largest ts the resources carry (int64, as the API server stores integers).
MAX_TS = 2**63 - 1
MAX_INT32 = 2**31 - 1

_HEX_KEY = re.compile(r"(?:[0-9a-f]{2})*")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROS = 1_000_000

E = TypeVar("E", bound=StrEnum)
Obj = dict[str, Any]


class InvalidResource(ValueError):
    """A resource that cannot be converted: ``<Kind> <name>: <field path>: <problem>``."""

    def __init__(self, kind: str, name: str, path: str, problem: str) -> None:
        self.kind = kind
        self.name = name
        self.path = path
        self.problem = problem
        super().__init__(f"{kind} {name}: {path}: {problem}" if path else f"{kind} {name}: {problem}")


def changefeed_labels(changefeed: str) -> tuple[tuple[str, str], ...]:
    """The labels of an object the maintainer creates for ``changefeed``, in the model's form."""
    return ((CHANGEFEED_LABEL, changefeed),)


def span_labels(changefeed: str, table_id: int) -> tuple[tuple[str, str], ...]:
    """The labels of a Span the maintainer creates (a new table's, a hole's, a split's or merge's)."""
    return ((CHANGEFEED_LABEL, changefeed), (TABLE_ID_LABEL, str(table_id)))


def dispatcher_labels(changefeed: str, capture: str) -> tuple[tuple[str, str], ...]:
    """The labels of a Dispatcher the maintainer creates."""
    return ((CAPTURE_LABEL, capture), (CHANGEFEED_LABEL, changefeed))


def lease_name(capture: str) -> str:
    """The name of the ``coordination.k8s.io/v1`` Lease through which ``capture`` shows it is alive."""
    return f"capture-{capture}"


# --------------------------------------------------------------------------------------------------
# Timestamps


def round_time(seconds: float) -> float:
    """``seconds`` rounded to the nearest microsecond: the value a resource round trip gives back."""
    return _micros(seconds) / _MICROS


def _micros(seconds: float) -> int:
    if not math.isfinite(seconds):
        raise ValueError(f"timestamp {seconds!r} is not a finite number")
    return round(seconds * _MICROS)


def format_time(seconds: float, *, micro: bool = False) -> str:
    """RFC 3339 in UTC, to the microsecond (``micro=True``: always six fractional digits)."""
    micros = _micros(seconds)
    try:
        stamp = _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise ValueError(f"timestamp {seconds!r} is out of the range of RFC 3339 (years 1 to 9999)") from None
    text = f"{stamp.year:04d}-{stamp.month:02d}-{stamp.day:02d}T{stamp.hour:02d}:{stamp.minute:02d}:{stamp.second:02d}"
    if micro or stamp.microsecond:
        text += f".{stamp.microsecond:06d}"
    return text + "Z"


def parse_time(text: str | datetime) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp (or an aware datetime; naive is taken as UTC).

    A fraction finer than a microsecond is rounded to the nearest microsecond (half up).
    Raises ``ValueError`` for anything else.
    """
    if isinstance(text, datetime):
        stamp = text if text.tzinfo is not None else text.replace(tzinfo=UTC)
        delta = stamp - _EPOCH
        return ((delta.days * 86400 + delta.seconds) * _MICROS + delta.microseconds) / _MICROS
    return _parse_text(text)


@functools.lru_cache(maxsize=1 << 16)
def _parse_text(text: str) -> float:
    """Memoised: the informer re-converts an object on every watch event, and most of its timestamps
    (creationTimestamp above all) are the same strings every time; parsing was a hot spot at 10k spans."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not an RFC 3339 timestamp")
    year, month, day, hour, minute, second = (int(g) for g in match.group(1, 2, 3, 4, 5, 6))
    try:
        stamp = datetime(year, month, day, hour, minute, second, tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid timestamp: {exc}") from None
    nanos = int((match.group(7) or "").ljust(9, "0"))
    if match.group(9):
        offset = timedelta(hours=int(match.group(10)), minutes=int(match.group(11)))
        stamp -= offset if match.group(9) == "+" else -offset
    delta = stamp - _EPOCH
    micros = (delta.days * 86400 + delta.seconds) * _MICROS + (nanos + 500) // 1000
    return micros / _MICROS


# --------------------------------------------------------------------------------------------------
# Model -> resource


def _put(target: Obj, key: str, value: Any) -> None:
    """Set ``key`` unless ``value`` is the zero value of its type."""
    if value is None or value == "" or value is False or (isinstance(value, (tuple, list, dict)) and not value):
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return
    target[key] = value


def _put_time(target: Obj, key: str, seconds: float) -> None:
    if seconds != 0.0:
        target[key] = format_time(seconds)


def _hex_keys(keys: Iterable[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def _metadata(record: Record) -> Obj:
    meta: Obj = {"name": record.name, "namespace": record.namespace}
    _put(meta, "uid", record.uid)
    _put(meta, "resourceVersion", record.resource_version)
    _put(meta, "generation", record.generation)
    _put_time(meta, "creationTimestamp", record.created)
    if record.deleting:
        meta["deletionTimestamp"] = format_time(record.created)
    _put(meta, "finalizers", list(record.finalizers))
    _put(meta, "labels", dict(record.labels))
    if isinstance(record, Span) and record.created_capture:
        meta["annotations"] = {PLACEMENT_ANNOTATION: placement_to_json(record)}
    if isinstance(record, Changefeed) and record.last_verify is not None:
        meta["annotations"] = {LAST_VERIFY_ANNOTATION: record.last_verify.to_json()}
    return meta


def placement_to_json(span: Span) -> str:
    """The placement recorded at the span's creation, as its annotation ``cdc.maintainer.dev/placement``."""
    return json.dumps({"capture": span.created_capture, "dispatcher": span.created_dispatcher}, separators=(",", ":"))


def placement_from_json(text: object) -> tuple[str, str]:
    """(capture, dispatcher) of a placement annotation; ("", "") if there is none or it does not parse."""
    if not isinstance(text, str):
        return "", ""
    try:
        value = json.loads(text)
    except ValueError:
        return "", ""
    if not isinstance(value, dict):
        return "", ""
    capture, dispatcher = value.get("capture"), value.get("dispatcher")
    if not (isinstance(capture, str) and capture and isinstance(dispatcher, str) and dispatcher):
        return "", ""
    return capture, dispatcher


def _counts(counts: SpanCounts) -> Obj:
    if counts == SpanCounts():
        return {}
    return {
        "absent": counts.absent,
        "scheduling": counts.scheduling,
        "replicating": counts.replicating,
        "removing": counts.removing,
        "invalid": counts.invalid,
    }


def _condition(cond: Condition) -> Obj:
    return {
        "type": cond.type,
        "status": cond.status,
        "reason": cond.reason,
        "message": cond.message,
        "observedGeneration": cond.observed_generation,
        "lastTransitionTime": format_time(cond.last_transition),
    }


def _changefeed_parts(cf: Changefeed) -> tuple[Obj, Obj]:
    spec: Obj = {}
    _put(spec, "paused", cf.paused)
    _put(spec, "redo", cf.redo)
    _put(spec, "startTs", cf.start_ts)
    if cf.source_secret:
        spec["source"] = {"etcd": {"secretRef": {"name": cf.source_secret}}}
    if cf.sink_secret:
        spec["sink"] = {cf.sink_kind or SINK_KINDS[0]: {"secretRef": {"name": cf.sink_secret}}}
    spec["scheduler"] = {resource_paths(f.name)[0]: getattr(cf.scheduler, f.name) for f in fields(SchedulerConfig)}
    status: Obj = {}
    _put(status, "epoch", cf.epoch)
    _put(status, "holder", cf.holder)
    _put(status, "checkpointTs", cf.checkpoint_ts)
    _put(status, "spans", _counts(cf.span_counts))
    _put(status, "operatorsInFlight", cf.operators_in_flight)
    sched: Obj = {}
    _put(sched, "state", cf.scheduler_status.state.value)
    _put(sched, "message", cf.scheduler_status.message)
    _put_time(sched, "balanceResumesAt", cf.scheduler_status.balance_resumes_at)
    _put(status, "scheduler", sched)
    _put(status, "conditions", [_condition(c) for c in cf.conditions])
    _put(status, "observedGeneration", cf.observed_generation)
    _put(status, "joining", [{"table": j.table, "uid": j.uid, "startTs": j.start_ts} for j in cf.joining])
    return spec, status


def _table_parts(table: Table) -> tuple[Obj, Obj]:
    spec: Obj = {"changefeed": table.changefeed, "tableID": table.table_id, "splittable": table.splittable}
    pre_split: Obj = {}
    _put(pre_split, "spans", table.pre_split_spans)
    _put(pre_split, "splitKeys", _hex_keys(table.pre_split_keys))
    _put(spec, "preSplit", pre_split)
    _put(spec, "startTs", table.start_ts)
    _put(spec, "writeRate", table.write_rate)
    _put(spec, "regionCount", table.region_count)
    status: Obj = {}
    _put(status, "state", table.state)
    _put(status, "message", table.message)
    _put(status, "spans", _counts(table.span_counts))
    _put(status, "observedGeneration", table.observed_generation)
    return spec, status


def _span_parts(span: Span) -> tuple[Obj, Obj]:
    start, end = span.key_range.hex()
    spec: Obj = {
        "changefeed": span.changefeed,
        "tableID": span.table_id,
        "mode": span.mode.value,
        "startKey": start,
        "endKey": end,
    }
    _put(spec, "startTs", span.start_ts)
    status: Obj = {}
    _put(status, "state", span.state.value if span.state is not None else None)
    _put(status, "capture", span.capture)
    _put(status, "dispatcher", span.dispatcher)
    _put(status, "checkpointTs", span.checkpoint_ts)
    _put(status, "operator", span.operator)
    _put(status, "message", span.message)
    return spec, status


def _dispatcher_parts(disp: Dispatcher) -> tuple[Obj, Obj]:
    start, end = disp.key_range.hex()
    spec: Obj = {
        "changefeed": disp.changefeed,
        "span": disp.span,
        "tableID": disp.table_id,
        "mode": disp.mode.value,
        "startKey": start,
        "endKey": end,
        "capture": disp.capture,
        "startTs": disp.start_ts,
    }
    _put(spec, "operator", disp.operator)
    spec["epoch"] = disp.epoch
    status: Obj = {}
    _put(status, "state", disp.state.value)
    _put(status, "checkpointTs", disp.checkpoint_ts)
    _put_time(status, "heartbeat", disp.heartbeat)
    _put(status, "message", disp.message)
    _put(status, "writeRate", disp.write_rate)
    _put(status, "regionCount", disp.region_count)
    return spec, status


def _origin(origin: Origin) -> Obj:
    out: Obj = {"span": origin.span, "dispatcher": origin.dispatcher, "capture": origin.capture}
    _put(out, "checkpointTs", origin.checkpoint_ts)
    return out


def _target(target: Target) -> Obj:
    start, end = target.key_range.hex()
    out: Obj = {"span": target.span, "startKey": start, "endKey": end}
    _put(out, "capture", target.capture)
    _put(out, "dispatcher", target.dispatcher)
    _put(out, "startTs", target.start_ts)
    _put(out, "done", target.done)
    _put(out, "lost", target.lost)
    _put(out, "lostReason", target.lost_reason)
    _put(out, "lostMessage", target.lost_message)
    return out


def _operator_parts(op: SpanOperator) -> tuple[Obj, Obj]:
    spec: Obj = {"changefeed": op.changefeed, "type": op.type.value, "spans": list(op.spans)}
    _put(spec, "target", op.target)
    _put(spec, "splitKeys", _hex_keys(op.split_keys))
    _put(spec, "splitInto", op.split_into)
    _put(spec, "deleteSpans", op.delete_spans)
    spec["source"] = op.source.value
    _put(spec, "reason", op.reason)
    status: Obj = {"phase": op.phase.value}
    _put(status, "stage", op.stage.value)
    _put(status, "reason", op.status_reason)
    _put(status, "message", op.message)
    _put(status, "epoch", op.epoch)
    _put(status, "origins", [_origin(o) for o in op.origins])
    _put(status, "targets", [_target(t) for t in op.targets])
    _put(status, "checkpointTs", op.checkpoint_ts)
    _put_time(status, "startedAt", op.started_at)
    _put_time(status, "finishedAt", op.finished_at)
    return spec, status


def _capture_parts(capture: Capture) -> tuple[Obj, Obj]:
    spec: Obj = {}
    _put(spec, "draining", capture.draining)
    # renew_time and lease_duration belong to the Lease (lease_resource); the Capture's own status
    # (address, pod, dispatchers) is written by the capture agent and is not part of the model.
    return spec, {}


def _parts(record: Record) -> tuple[Obj, Obj]:
    if isinstance(record, Changefeed):
        return _changefeed_parts(record)
    if isinstance(record, Table):
        return _table_parts(record)
    if isinstance(record, Span):
        return _span_parts(record)
    if isinstance(record, Dispatcher):
        return _dispatcher_parts(record)
    if isinstance(record, SpanOperator):
        return _operator_parts(record)
    if isinstance(record, Capture):
        return _capture_parts(record)
    raise TypeError(f"no resource layout for {type(record).__name__}")


def to_resource(record: Record) -> Obj:
    """The full object (apiVersion, kind, metadata, spec, and status unless it is empty)."""
    spec, status = _parts(record)
    obj: Obj = {
        "apiVersion": API_VERSION,
        "kind": record.KIND.value,
        "metadata": _metadata(record),
        "spec": spec,
    }
    if status:
        obj["status"] = status
    return obj


def status_of(record: Record) -> Obj:
    """Just the status (what a replacing write of the status subresource sends); ``{}`` for a Capture."""
    return _parts(record)[1]


#: Resource paths of model fields that are not simply camelCased (relative to spec or status).
_RENAMED: dict[str, tuple[str, ...]] = {
    "table_id": ("tableID",),
    "key_range": ("startKey", "endKey"),
    "pre_split_spans": ("preSplit.spans",),
    "pre_split_keys": ("preSplit.splitKeys",),
    "span_counts": ("spans",),
    "scheduler_status": ("scheduler",),
    "status_reason": ("reason",),
    "last_transition": ("lastTransitionTime",),
    "source_secret": ("source.etcd.secretRef.name",),
    "sink_kind": ("sink",),
    "sink_secret": ("sink.<kind>.secretRef.name",),
}


def resource_paths(model_field: str) -> tuple[str, ...]:
    """Where a model field lives under spec/status (or in a list item): camelCase, or a rename above."""
    if model_field in _RENAMED:
        return _RENAMED[model_field]
    head, *rest = model_field.split("_")
    return (head + "".join(part.title() for part in rest),)


def _status_keys(record: Record) -> tuple[str, ...]:
    """Every key ``status_of`` can write for this kind (a Capture's status fields live in its Lease)."""
    if isinstance(record, Capture):
        return ()
    return tuple(path for f in record.STATUS_FIELDS for path in resource_paths(f))


def status_merge_patch(record: Record) -> Obj:
    """A JSON merge patch ``{"status": {...}}`` that makes the stored status equal ``status_of(record)``.

    Keys that ``status_of`` omits are set to ``None`` so that the patch clears them (a merge patch
    leaves absent keys alone). Lists are replaced whole by a merge patch; the one nested object, the
    span counts, is written in full (zeros included) so that merging it leaves nothing stale.
    """
    status = status_of(record)
    patch: Obj = {key: status.get(key) for key in _status_keys(record)}
    if "spans" in patch and patch["spans"] is None:
        patch["spans"] = {"absent": 0, "scheduling": 0, "replicating": 0, "removing": 0, "invalid": 0}
    if "scheduler" in patch:  # a nested object: every key written, absent ones cleared
        patch["scheduler"] = {"state": None, "message": None, "balanceResumesAt": None, **(patch["scheduler"] or {})}
    return {"status": patch}


def lease_resource(capture: Capture) -> Obj:
    """The capture's Lease as the capture agent writes it (``renewTime`` omitted when ``None``)."""
    if not float(capture.lease_duration).is_integer():
        raise InvalidResource(
            "Lease",
            lease_name(capture.name),
            "spec.leaseDurationSeconds",
            f"{capture.lease_duration!r} is not a whole number of seconds",
        )
    holder = "" if capture.lease_taken else capture.name
    spec: Obj = {"holderIdentity": holder, "leaseDurationSeconds": int(capture.lease_duration)}
    if capture.renew_time is not None:
        spec["renewTime"] = format_time(capture.renew_time, micro=True)
    meta: Obj = {"name": lease_name(capture.name), "namespace": capture.namespace}
    if capture.lease_version:
        meta["resourceVersion"] = capture.lease_version
    if capture.progress is not None:
        meta["annotations"] = {PROGRESS_ANNOTATION: progress_to_json(capture.progress)}
    return {"apiVersion": LEASE_API_VERSION, "kind": "Lease", "metadata": meta, "spec": spec}


def progress_to_json(progress: Progress) -> str:
    """A capture's report as the compact JSON its Lease annotation carries."""
    doc = {
        "incarnation": progress.incarnation,
        "at": format_time(progress.at, micro=True),
        "changefeeds": [_entry_to_json(e) for e in progress.entries],
    }
    if progress.sinks:
        doc["sinks"] = [
            {"changefeed": f.changefeed, "collected": f.collected, "tombstones": f.tombstones, "liveRows": f.live_rows}
            for f in progress.sinks
        ]
    if progress.troubles:
        doc["troubles"] = [
            {"changefeed": t.changefeed, "side": t.side.value, "transient": t.transient, "message": t.message}
            for t in progress.troubles
        ]
    return json.dumps(doc, separators=(",", ":"))


def _entry_to_json(e: ProgressEntry) -> dict[str, object]:
    doc: dict[str, object] = {
        "changefeed": e.changefeed,
        "mode": e.mode.value,
        "checkpointTs": e.checkpoint_ts,
        "dispatchers": e.dispatchers,
        "digest": e.digest,
        "slowest": e.slowest,
    }
    if e.checkpoint_time is not None:
        doc["checkpointTime"] = round(e.checkpoint_time, 3)
    return doc


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def progress_from_json(text: object) -> Progress | None:
    """The report in a Lease annotation, or None if there is none or it does not parse (never raises)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        doc = json.loads(text)
        entries = []
        for item in doc["changefeeds"]:
            ts, count = item["checkpointTs"], item["dispatchers"]
            if not (isinstance(ts, int) and isinstance(count, int)) or isinstance(ts, bool) or ts < 0 or count < 0:
                return None
            digest = item["digest"]
            if not isinstance(digest, str) or not isinstance(item["changefeed"], str):
                return None
            when = item.get("checkpointTime")
            if when is not None and (
                isinstance(when, bool) or not isinstance(when, int | float) or not 0 <= when < math.inf
            ):
                return None
            entries.append(
                ProgressEntry(
                    changefeed=item["changefeed"],
                    mode=Mode(item["mode"]),
                    checkpoint_ts=ts,
                    dispatchers=count,
                    digest=digest,
                    slowest=str(item.get("slowest") or ""),
                    checkpoint_time=None if when is None else float(when),
                )
            )
        troubles = []
        for item in doc.get("troubles") or ():
            changefeed, side, transient, message = item["changefeed"], item["side"], item["transient"], item["message"]
            if not (isinstance(changefeed, str) and isinstance(transient, bool) and isinstance(message, str)):
                return None
            if side in SIDES:  # a side this version does not know (a newer capture's) is not one it can show
                troubles.append(Trouble(changefeed=changefeed, side=Side(side), transient=transient, message=message))
        sinks = []
        for item in doc.get("sinks") or ():
            numbers = (item["collected"], item["tombstones"], item["liveRows"])
            if not isinstance(item["changefeed"], str) or not all(_count(n) for n in numbers):
                return None
            sinks.append(SinkFigures(changefeed=item["changefeed"], collected=numbers[0], tombstones=numbers[1],
                                     live_rows=numbers[2]))  # fmt: skip
        incarnation = doc["incarnation"]
        if not isinstance(incarnation, str):
            return None
        return Progress(
            incarnation=incarnation,
            at=parse_time(doc["at"]),
            entries=tuple(entries),
            troubles=tuple(troubles),
            sinks=tuple(sinks),
        )
    except (ValueError, KeyError, TypeError, AttributeError):  # json.JSONDecodeError is a ValueError
        return None


# --------------------------------------------------------------------------------------------------
# Resource -> model


def _type_name(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


_KIND_NAMES = {k: k.value for k in Kind}


def _is_mapping(value: object) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, quick for the usual plain dict (an ABC check is slow, and converting a
    record made a dozen of them)."""
    return type(value) is dict or isinstance(value, Mapping)


@functools.cache
def _enum_values(enum: type[StrEnum]) -> tuple[str, ...]:
    """The non-empty values of ``enum`` (memoised: converting a record read them a dozen times, and an
    enum member's ``.value`` is a property: at 50,000 spans a LIST spent seconds there)."""
    return tuple(e.value for e in enum if e.value)


class _Reader:
    """Typed, path-aware access to one resource; every problem raises ``InvalidResource``."""

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name

    def fail(self, path: str, problem: str) -> NoReturn:
        raise InvalidResource(self.kind, self.name, path, problem)

    def raw(self, m: Mapping[str, Any], key: str, path: str, required: bool) -> Any:
        value = m.get(key)
        if value is None and required:
            self.fail(path, "is required")
        return value

    def obj(self, m: Mapping[str, Any], key: str, path: str, required: bool = False) -> Mapping[str, Any]:
        value = self.raw(m, key, path, required)
        if value is None:
            return {}
        if not _is_mapping(value):
            self.fail(path, f"expected an object, got {_type_name(value)}")
        return value

    def str_(self, m: Mapping[str, Any], key: str, path: str, required: bool = False, default: str = "") -> str:
        value = self.raw(m, key, path, required)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(path, f"expected a string, got {_type_name(value)}")
        return value

    def int_(
        self,
        m: Mapping[str, Any],
        key: str,
        path: str,
        required: bool = False,
        default: int = 0,
        minimum: int = 0,
        maximum: int = MAX_TS,
    ) -> int:
        value = self.raw(m, key, path, required)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(path, f"expected an integer, got {_type_name(value)}")
        if not minimum <= value <= maximum:
            self.fail(path, f"{value} is out of range {minimum}..{maximum}")
        return value

    def float_(self, m: Mapping[str, Any], key: str, path: str, default: float = 0.0, minimum: float = 0.0) -> float:
        value = self.raw(m, key, path, False)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            self.fail(path, f"expected a number, got {_type_name(value)}")
        if not math.isfinite(value) or value < minimum:
            self.fail(path, f"{value} is not a finite number >= {minimum}")
        return float(value)

    def bool_(self, m: Mapping[str, Any], key: str, path: str, default: bool = False) -> bool:
        value = self.raw(m, key, path, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(path, f"expected a boolean, got {_type_name(value)}")
        return value

    def choice(self, m: Mapping[str, Any], key: str, path: str, values: Sequence[str], required: bool = False) -> str:
        """A string that is one of ``values``; absent (or ``""`` when not required): ``""``."""
        text = self.str_(m, key, path, required)
        if text == "" and not required:
            return ""
        if text not in values:
            self.fail(path, f"{text!r} is not one of {', '.join(repr(v) for v in values)}")
        return text

    def enum(self, m: Mapping[str, Any], key: str, path: str, enum: type[E], default: E) -> E:
        """A member of ``enum``; absent or ``""``: ``default``."""
        text = self.choice(m, key, path, _enum_values(enum))
        return enum(text) if text else default

    def required_enum(self, m: Mapping[str, Any], key: str, path: str, enum: type[E]) -> E:
        return enum(self.choice(m, key, path, _enum_values(enum), required=True))

    def time(self, m: Mapping[str, Any], key: str, path: str) -> float | None:
        value = self.raw(m, key, path, False)
        if value is None:
            return None
        if not isinstance(value, (str, datetime)):
            self.fail(path, f"expected an RFC 3339 timestamp string, got {_type_name(value)}")
        try:
            return parse_time(value)
        except ValueError as exc:
            self.fail(path, str(exc))

    def time0(self, m: Mapping[str, Any], key: str, path: str) -> float:
        value = self.time(m, key, path)
        return 0.0 if value is None else value

    def list_(self, m: Mapping[str, Any], key: str, path: str, required: bool = False) -> list[Any]:
        value = self.raw(m, key, path, required)
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            self.fail(path, f"expected a list, got {_type_name(value)}")
        return list(value)

    def strings(self, m: Mapping[str, Any], key: str, path: str, required: bool = False) -> tuple[str, ...]:
        out: list[str] = []
        for i, item in enumerate(self.list_(m, key, path, required)):
            if not isinstance(item, str):
                self.fail(f"{path}[{i}]", f"expected a string, got {_type_name(item)}")
            out.append(item)
        return tuple(out)

    def hex_value(self, value: Any, path: str) -> bytes:
        if not isinstance(value, str):
            self.fail(path, f"expected a hex-encoded key string, got {_type_name(value)}")
        if not _HEX_KEY.fullmatch(value):
            self.fail(path, f"{value!r} is not a hex-encoded key (lower-case hex digits, two per byte)")
        return bytes.fromhex(value)

    def key(self, m: Mapping[str, Any], key: str, path: str) -> bytes:
        return self.hex_value(self.raw(m, key, path, True), path)

    def keys(self, m: Mapping[str, Any], key: str, path: str) -> tuple[bytes, ...]:
        return tuple(self.hex_value(v, f"{path}[{i}]") for i, v in enumerate(self.list_(m, key, path)))

    def key_range(self, m: Mapping[str, Any], path: str) -> KeyRange:
        start = self.key(m, "startKey", f"{path}.startKey")
        end = self.key(m, "endKey", f"{path}.endKey")
        if not start < end:
            self.fail(path, f"empty key range: startKey {start.hex()!r} is not below endKey {end.hex()!r}")
        return KeyRange(start, end)

    def objects(self, m: Mapping[str, Any], key: str, path: str) -> list[tuple[str, Mapping[str, Any]]]:
        out: list[tuple[str, Mapping[str, Any]]] = []
        for i, item in enumerate(self.list_(m, key, path)):
            item_path = f"{path}[{i}]"
            if not isinstance(item, Mapping):
                self.fail(item_path, f"expected an object, got {_type_name(item)}")
            out.append((item_path, item))
        return out


def _start(obj: Mapping[str, Any], kind: Kind) -> tuple[_Reader, dict[str, Any], Mapping[str, Any], Mapping[str, Any]]:
    """Check kind and apiVersion, read metadata: (reader, metadata kwargs, spec, status)."""
    kind_name = _KIND_NAMES[kind]
    if not _is_mapping(obj):
        raise InvalidResource(kind_name, "<unknown>", "", f"expected an object, got {_type_name(obj)}")
    raw_meta = obj.get("metadata")
    raw_name = raw_meta.get("name") if _is_mapping(raw_meta) else None
    reader = _Reader(kind_name, raw_name if isinstance(raw_name, str) and raw_name else "<unnamed>")
    if obj.get("kind") not in (None, kind_name):
        reader.fail("kind", f"expected {kind_name!r}, got {obj.get('kind')!r}")
    if obj.get("apiVersion") not in (None, API_VERSION):
        reader.fail("apiVersion", f"expected {API_VERSION!r}, got {obj.get('apiVersion')!r}")
    meta = reader.obj(obj, "metadata", "metadata", required=True)
    name = reader.str_(meta, "name", "metadata.name", required=True)
    if not name:
        reader.fail("metadata.name", "must not be empty")
    labels = reader.obj(meta, "labels", "metadata.labels")
    for key, value in labels.items():
        if not isinstance(value, str):
            reader.fail(f"metadata.labels[{key!r}]", f"expected a string, got {_type_name(value)}")
    common: dict[str, Any] = {
        "name": name,
        "namespace": reader.str_(meta, "namespace", "metadata.namespace") or "default",
        "uid": reader.str_(meta, "uid", "metadata.uid"),
        "resource_version": reader.str_(meta, "resourceVersion", "metadata.resourceVersion"),
        "generation": reader.int_(meta, "generation", "metadata.generation"),
        "created": reader.time0(meta, "creationTimestamp", "metadata.creationTimestamp"),
        "deleting": reader.time(meta, "deletionTimestamp", "metadata.deletionTimestamp") is not None,
        "finalizers": reader.strings(meta, "finalizers", "metadata.finalizers"),
        "labels": tuple(sorted((str(k), v) for k, v in labels.items())),
    }
    spec = reader.obj(obj, "spec", "spec")
    status = reader.obj(obj, "status", "status")
    return reader, common, spec, status


def _read_counts(reader: _Reader, status: Mapping[str, Any], path: str) -> SpanCounts:
    counts = reader.obj(status, "spans", path)
    return SpanCounts(
        absent=reader.int_(counts, "absent", f"{path}.absent"),
        scheduling=reader.int_(counts, "scheduling", f"{path}.scheduling"),
        replicating=reader.int_(counts, "replicating", f"{path}.replicating"),
        removing=reader.int_(counts, "removing", f"{path}.removing"),
        invalid=reader.int_(counts, "invalid", f"{path}.invalid"),
    )


def _read_condition(reader: _Reader, path: str, item: Mapping[str, Any]) -> Condition:
    return Condition(
        type=reader.str_(item, "type", f"{path}.type", required=True),
        status=reader.choice(item, "status", f"{path}.status", CONDITION_STATUSES, required=True),
        reason=reader.str_(item, "reason", f"{path}.reason"),
        message=reader.str_(item, "message", f"{path}.message"),
        observed_generation=reader.int_(item, "observedGeneration", f"{path}.observedGeneration"),
        last_transition=reader.time0(item, "lastTransitionTime", f"{path}.lastTransitionTime"),
    )


def _secret_name(reader: _Reader, spec: Mapping[str, Any], part: str, kind: str) -> str:
    """``spec.<part>.<kind>.secretRef.name`` ("" when absent)."""
    outer = reader.obj(spec, part, f"spec.{part}")
    inner = reader.obj(outer, kind, f"spec.{part}.{kind}")
    ref = reader.obj(inner, "secretRef", f"spec.{part}.{kind}.secretRef")
    return reader.str_(ref, "name", f"spec.{part}.{kind}.secretRef.name")


#: The sink kinds a Changefeed may name (``spec.sink.<kind>``; the CRD admits exactly one).
SINK_KINDS = ("postgres", "mysql")


def _sink(reader: _Reader, spec: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, Secret name) from ``spec.sink``: the one kind it names (none: both "")."""
    sink = reader.obj(spec, "sink", "spec.sink")
    named = [kind for kind in SINK_KINDS if kind in sink]
    unknown = sorted(set(sink) - set(SINK_KINDS))
    if unknown:
        reader.fail(f"spec.sink.{unknown[0]}", f"unknown sink kind (known: {', '.join(SINK_KINDS)})")
    if len(named) > 1:
        reader.fail("spec.sink", f"names {len(named)} sinks ({', '.join(named)}): a changefeed writes to exactly one")
    if not named:
        return "", ""
    return named[0], _secret_name(reader, spec, "sink", named[0])


def changefeed_from_resource(obj: Mapping[str, Any]) -> Changefeed:
    reader, common, spec, status = _start(obj, Kind.CHANGEFEED)
    sink = _sink(reader, spec)
    sched = reader.obj(spec, "scheduler", "spec.scheduler")
    defaults = SchedulerConfig()
    knobs: dict[str, Any] = {}
    for f in fields(SchedulerConfig):
        key = resource_paths(f.name)[0]
        default = getattr(defaults, f.name)
        path = f"spec.scheduler.{key}"
        if isinstance(default, bool):
            knobs[f.name] = reader.bool_(sched, key, path)
        elif isinstance(default, int):
            low = 1 if f.name in _AT_LEAST_ONE else 0
            knobs[f.name] = reader.int_(sched, key, path, default=default, minimum=low, maximum=MAX_INT32)
        else:
            knobs[f.name] = reader.float_(sched, key, path, default=default)
    scheduler = SchedulerConfig(**knobs)
    sstatus = reader.obj(status, "scheduler", "status.scheduler")
    return Changefeed(
        **common,
        paused=reader.bool_(spec, "paused", "spec.paused"),
        redo=reader.bool_(spec, "redo", "spec.redo"),
        start_ts=reader.int_(spec, "startTs", "spec.startTs"),
        scheduler=scheduler,
        source_secret=_secret_name(reader, spec, "source", "etcd"),
        sink_kind=sink[0],
        sink_secret=sink[1],
        epoch=reader.int_(status, "epoch", "status.epoch"),
        holder=reader.str_(status, "holder", "status.holder"),
        checkpoint_ts=reader.int_(status, "checkpointTs", "status.checkpointTs"),
        span_counts=_read_counts(reader, status, "status.spans"),
        operators_in_flight=reader.int_(status, "operatorsInFlight", "status.operatorsInFlight"),
        scheduler_status=SchedulerStatus(
            state=reader.enum(sstatus, "state", "status.scheduler.state", SchedulerState, SchedulerState.NONE),
            message=reader.str_(sstatus, "message", "status.scheduler.message"),
            balance_resumes_at=reader.time0(sstatus, "balanceResumesAt", "status.scheduler.balanceResumesAt"),
        ),
        conditions=tuple(
            _read_condition(reader, path, item)
            for path, item in reader.objects(status, "conditions", "status.conditions")
        ),
        observed_generation=reader.int_(status, "observedGeneration", "status.observedGeneration"),
        joining=tuple(
            Join(
                table=reader.str_(item, "table", f"{path}.table"),
                uid=reader.str_(item, "uid", f"{path}.uid"),
                start_ts=reader.int_(item, "startTs", f"{path}.startTs"),
            )
            for path, item in reader.objects(status, "joining", "status.joining")
        ),
        last_verify=verification_from_json(_annotation(obj, LAST_VERIFY_ANNOTATION)),
    )


def _annotation(obj: Mapping[str, Any], name: str) -> object:
    meta = obj.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    return annotations.get(name) if isinstance(annotations, Mapping) else None


def table_from_resource(obj: Mapping[str, Any]) -> Table:
    reader, common, spec, status = _start(obj, Kind.TABLE)
    pre_split = reader.obj(spec, "preSplit", "spec.preSplit")
    return Table(
        **common,
        changefeed=reader.str_(spec, "changefeed", "spec.changefeed", required=True),
        table_id=reader.int_(spec, "tableID", "spec.tableID", required=True, maximum=MAX_TABLE_ID),
        splittable=reader.bool_(spec, "splittable", "spec.splittable", default=True),
        pre_split_spans=reader.int_(pre_split, "spans", "spec.preSplit.spans", maximum=MAX_INT32),
        pre_split_keys=reader.keys(pre_split, "splitKeys", "spec.preSplit.splitKeys"),
        start_ts=reader.int_(spec, "startTs", "spec.startTs"),
        write_rate=reader.float_(spec, "writeRate", "spec.writeRate"),
        region_count=reader.int_(spec, "regionCount", "spec.regionCount", maximum=MAX_INT32),
        state=reader.choice(status, "state", "status.state", TABLE_STATES),
        message=reader.str_(status, "message", "status.message"),
        span_counts=_read_counts(reader, status, "status.spans"),
        observed_generation=reader.int_(status, "observedGeneration", "status.observedGeneration"),
    )


def span_from_resource(obj: Mapping[str, Any]) -> Span:
    reader, common, spec, status = _start(obj, Kind.SPAN)
    state = reader.choice(status, "state", "status.state", _enum_values(SpanState))
    annotations = obj["metadata"].get("annotations")
    placed = placement_from_json(annotations.get(PLACEMENT_ANNOTATION)) if _is_mapping(annotations) else ("", "")
    return Span(
        **common,
        changefeed=reader.str_(spec, "changefeed", "spec.changefeed", required=True),
        table_id=reader.int_(spec, "tableID", "spec.tableID", required=True, maximum=MAX_TABLE_ID),
        mode=reader.enum(spec, "mode", "spec.mode", Mode, Mode.DEFAULT),
        key_range=reader.key_range(spec, "spec"),
        start_ts=reader.int_(spec, "startTs", "spec.startTs"),
        state=SpanState(state) if state else None,
        capture=reader.str_(status, "capture", "status.capture"),
        dispatcher=reader.str_(status, "dispatcher", "status.dispatcher"),
        checkpoint_ts=reader.int_(status, "checkpointTs", "status.checkpointTs"),
        operator=reader.str_(status, "operator", "status.operator"),
        message=reader.str_(status, "message", "status.message"),
        created_capture=placed[0],
        created_dispatcher=placed[1],
    ).with_recorded_placement()


def dispatcher_from_resource(obj: Mapping[str, Any]) -> Dispatcher:
    reader, common, spec, status = _start(obj, Kind.DISPATCHER)
    return Dispatcher(
        **common,
        changefeed=reader.str_(spec, "changefeed", "spec.changefeed", required=True),
        span=reader.str_(spec, "span", "spec.span", required=True),
        table_id=reader.int_(spec, "tableID", "spec.tableID", required=True, maximum=MAX_TABLE_ID),
        mode=reader.enum(spec, "mode", "spec.mode", Mode, Mode.DEFAULT),
        key_range=reader.key_range(spec, "spec"),
        capture=reader.str_(spec, "capture", "spec.capture", required=True),
        start_ts=reader.int_(spec, "startTs", "spec.startTs", required=True),
        operator=reader.str_(spec, "operator", "spec.operator"),
        epoch=reader.int_(spec, "epoch", "spec.epoch", required=True),
        state=reader.enum(status, "state", "status.state", DispatcherState, DispatcherState.PENDING),
        checkpoint_ts=reader.int_(status, "checkpointTs", "status.checkpointTs"),
        heartbeat=reader.time0(status, "heartbeat", "status.heartbeat"),
        message=reader.str_(status, "message", "status.message"),
        write_rate=reader.float_(status, "writeRate", "status.writeRate"),
        region_count=reader.int_(status, "regionCount", "status.regionCount", maximum=MAX_INT32),
    )


def _read_origin(reader: _Reader, path: str, item: Mapping[str, Any]) -> Origin:
    return Origin(
        span=reader.str_(item, "span", f"{path}.span", required=True),
        dispatcher=reader.str_(item, "dispatcher", f"{path}.dispatcher", required=True),
        capture=reader.str_(item, "capture", f"{path}.capture", required=True),
        checkpoint_ts=reader.int_(item, "checkpointTs", f"{path}.checkpointTs"),
    )


def _read_target(reader: _Reader, path: str, item: Mapping[str, Any]) -> Target:
    return Target(
        span=reader.str_(item, "span", f"{path}.span", required=True),
        key_range=reader.key_range(item, path),
        capture=reader.str_(item, "capture", f"{path}.capture"),
        dispatcher=reader.str_(item, "dispatcher", f"{path}.dispatcher"),
        start_ts=reader.int_(item, "startTs", f"{path}.startTs"),
        done=reader.bool_(item, "done", f"{path}.done"),
        lost=reader.bool_(item, "lost", f"{path}.lost"),
        lost_reason=reader.str_(item, "lostReason", f"{path}.lostReason"),
        lost_message=reader.str_(item, "lostMessage", f"{path}.lostMessage"),
    )


def operator_from_resource(obj: Mapping[str, Any]) -> SpanOperator:
    reader, common, spec, status = _start(obj, Kind.OPERATOR)
    return SpanOperator(
        **common,
        changefeed=reader.str_(spec, "changefeed", "spec.changefeed", required=True),
        type=reader.required_enum(spec, "type", "spec.type", OpType),
        spans=reader.strings(spec, "spans", "spec.spans", required=True),
        target=reader.str_(spec, "target", "spec.target"),
        split_keys=reader.keys(spec, "splitKeys", "spec.splitKeys"),
        split_into=reader.int_(spec, "splitInto", "spec.splitInto", maximum=MAX_INT32),
        delete_spans=reader.bool_(spec, "deleteSpans", "spec.deleteSpans"),
        source=reader.enum(spec, "source", "spec.source", OpSource, OpSource.USER),
        reason=reader.str_(spec, "reason", "spec.reason"),
        phase=reader.enum(status, "phase", "status.phase", OpPhase, OpPhase.PENDING),
        stage=reader.enum(status, "stage", "status.stage", Stage, Stage.NONE),
        status_reason=reader.str_(status, "reason", "status.reason"),
        message=reader.str_(status, "message", "status.message"),
        epoch=reader.int_(status, "epoch", "status.epoch"),
        origins=tuple(
            _read_origin(reader, path, item) for path, item in reader.objects(status, "origins", "status.origins")
        ),
        targets=tuple(
            _read_target(reader, path, item) for path, item in reader.objects(status, "targets", "status.targets")
        ),
        checkpoint_ts=reader.int_(status, "checkpointTs", "status.checkpointTs"),
        started_at=reader.time0(status, "startedAt", "status.startedAt"),
        finished_at=reader.time0(status, "finishedAt", "status.finishedAt"),
    )


def capture_from_resources(obj: Mapping[str, Any], lease: Mapping[str, Any] | None) -> Capture:
    """A Capture from its resource and its Lease ``capture-<name>`` (``None``: no Lease, not alive)."""
    reader, common, spec, _status = _start(obj, Kind.CAPTURE)
    renew_time: float | None = None
    lease_duration = Capture(name=common["name"]).lease_duration
    taken, version = True, ""  # no Lease: nothing of the capture can run
    progress: Progress | None = None
    if lease is not None:
        expected = lease_name(common["name"])
        if not isinstance(lease, Mapping):
            reader.fail("lease", f"expected a Lease object, got {_type_name(lease)}")
        meta = lease.get("metadata")
        actual = meta.get("name") if isinstance(meta, Mapping) else None
        lease_reader = _Reader("Lease", actual if isinstance(actual, str) and actual else "<unnamed>")
        if lease.get("kind") not in (None, "Lease"):
            lease_reader.fail("kind", f"expected 'Lease', got {lease.get('kind')!r}")
        if actual != expected:
            lease_reader.fail("metadata.name", f"is not {expected!r}, the Lease of Capture {common['name']}")
        lease_spec = lease_reader.obj(lease, "spec", "spec")
        annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
        if isinstance(annotations, Mapping):
            progress = progress_from_json(annotations.get(PROGRESS_ANNOTATION))
        renew_time = lease_reader.time(lease_spec, "renewTime", "spec.renewTime")
        lease_duration = float(
            lease_reader.int_(
                lease_spec,
                "leaseDurationSeconds",
                "spec.leaseDurationSeconds",
                default=int(lease_duration),
                minimum=1,
                maximum=MAX_INT32,
            )
        )
        taken = lease_spec.get("holderIdentity") != common["name"]
        version = str((meta or {}).get("resourceVersion") or "")
    return Capture(
        **common,
        draining=reader.bool_(spec, "draining", "spec.draining"),
        renew_time=renew_time,
        lease_duration=lease_duration,
        lease_taken=taken,
        lease_version=version,
        progress=progress,
    )


_FROM: dict[str, Callable[[Mapping[str, Any]], Record]] = {
    Kind.CHANGEFEED.value: changefeed_from_resource,
    Kind.TABLE.value: table_from_resource,
    Kind.SPAN.value: span_from_resource,
    Kind.DISPATCHER.value: dispatcher_from_resource,
    Kind.OPERATOR.value: operator_from_resource,
    Kind.CAPTURE.value: lambda obj: capture_from_resources(obj, None),
}


def from_resource(obj: Mapping[str, Any]) -> Record:
    """The record of any kind (a Capture without its Lease: use ``capture_from_resources`` for that)."""
    if not isinstance(obj, Mapping):
        raise InvalidResource("<unknown kind>", "<unknown>", "", f"expected an object, got {_type_name(obj)}")
    kind = obj.get("kind")
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    convert = _FROM.get(kind) if isinstance(kind, str) else None
    if convert is None:
        raise InvalidResource(
            str(kind) if kind else "<unknown kind>",
            name if isinstance(name, str) and name else "<unnamed>",
            "kind",
            f"{kind!r} is not one of {', '.join(repr(k) for k in _FROM)}",
        )
    return convert(obj)
