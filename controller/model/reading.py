"""Reading resources into records (``controller.model.resources``, which re-exports what is here): tolerant of absent
optional fields, strict about present ones (``InvalidResource`` names kind, object, field path and the problem).
Pure: no I/O."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from datetime import datetime
from enum import StrEnum
from typing import Any, NoReturn, TypeGuard

from controller.model.keys import MAX_TABLE_ID, KeyRange
from controller.model.progress import (
    PROGRESS_ANNOTATION,
    Progress,
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
from controller.model.resource_base import (
    _AT_LEAST_ONE,
    _HEX_KEY,
    CONDITION_STATUSES,
    MAX_INT32,
    MAX_TS,
    PLACEMENT_ANNOTATION,
    TABLE_STATES,
    E,
    InvalidResource,
    lease_name,
    parse_time,
    placement_from_json,
    progress_from_json,
    resource_paths,
)
from controller.model.states import (
    API_VERSION,
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
