"""Conversion between Kubernetes resource dictionaries and the model records. Pure: no I/O.

This module writes records as resources (``to_resource``, ``status_of``, ``status_merge_patch``, ``lease_resource``)
and is the one every caller imports: it re-exports the reading side (``controller.model.reading``) and the base both
share (``controller.model.resource_base``: labels, errors, times, field paths, the JSON of progress reports).

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

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from controller.model.progress import (
    PROGRESS_ANNOTATION,
)
from controller.model.reading import (
    SINK_KINDS,
    capture_from_resources,
    changefeed_from_resource,
    dispatcher_from_resource,
    from_resource,
    operator_from_resource,
    span_from_resource,
    table_from_resource,
)
from controller.model.records import (
    Capture,
    Changefeed,
    Condition,
    Dispatcher,
    Origin,
    Record,
    SchedulerConfig,
    Span,
    SpanCounts,
    SpanOperator,
    Table,
    Target,
)
from controller.model.resource_base import (
    CAPTURE_LABEL,
    CHANGEFEED_LABEL,
    CONDITION_STATUSES,
    DRAIN_FOR_SHUTDOWN,
    DRAIN_REASON_ANNOTATION,
    FENCED_ANNOTATION,
    LEASE_API_VERSION,
    MAX_INT32,
    MAX_TS,
    PLACEMENT_ANNOTATION,
    TABLE_ID_LABEL,
    TABLE_STATES,
    InvalidResource,
    Obj,
    changefeed_labels,
    dispatcher_labels,
    format_time,
    lease_name,
    parse_time,
    placement_from_json,
    placement_to_json,
    progress_from_json,
    progress_to_json,
    resource_paths,
    round_time,
    span_labels,
)
from controller.model.states import (
    API_VERSION,
)
from controller.model.verification import LAST_VERIFY_ANNOTATION

__all__ = [
    "CAPTURE_LABEL",
    "CHANGEFEED_LABEL",
    "CONDITION_STATUSES",
    "DRAIN_FOR_SHUTDOWN",
    "DRAIN_REASON_ANNOTATION",
    "FENCED_ANNOTATION",
    "LEASE_API_VERSION",
    "MAX_INT32",
    "MAX_TS",
    "PLACEMENT_ANNOTATION",
    "SINK_KINDS",
    "TABLE_ID_LABEL",
    "TABLE_STATES",
    "InvalidResource",
    "Obj",
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
