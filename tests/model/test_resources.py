"""Conversion between resource dicts and model records: round trips, tolerance, strictness."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.model import (
    Capture,
    Changefeed,
    Condition,
    Dispatcher,
    DispatcherState,
    Join,
    KeyRange,
    Mode,
    OpPhase,
    OpSource,
    OpType,
    Origin,
    SchedulerConfig,
    SchedulerState,
    SchedulerStatus,
    Span,
    SpanCounts,
    SpanOperator,
    SpanState,
    Stage,
    Table,
    Target,
)
from controller.model.keys import MAX_TABLE_ID
from controller.model.records import Record
from controller.model.resources import (
    CHANGEFEED_LABEL,
    InvalidResource,
    capture_from_resources,
    changefeed_labels,
    dispatcher_from_resource,
    format_time,
    from_resource,
    lease_name,
    lease_resource,
    operator_from_resource,
    parse_time,
    round_time,
    span_from_resource,
    status_merge_patch,
    status_of,
    table_from_resource,
    to_resource,
)
from tests.model.test_crds import json_schema

CRDS = Path(__file__).resolve().parents[2] / "crds"
API = "cdc.maintainer.dev/v1alpha1"

# --------------------------------------------------------------------------------------------------
# Strategies: values a real API server would accept (so to_resource output can be schema-checked).

LOWER = "abcdefghijklmnopqrstuvwxyz0123456789"
NAMES = st.text(LOWER, min_size=1, max_size=12) | st.builds(
    "{}-{}.{}".format, *[st.text(LOWER, min_size=1, max_size=5)] * 3
)
OPT_NAMES = st.just("") | NAMES
TEXT = st.text(max_size=30)
TS = st.integers(0, 2**63 - 1)
SMALL = st.integers(0, 2**31 - 1)
#: Microsecond-exact times before 2106 (2**32 s): beyond that a float no longer resolves microseconds.
TIMES = st.integers(0, 2**32 * 1_000_000 - 1).map(lambda m: m / 1_000_000)
KEYS = st.binary(max_size=24)
KEY_RANGES = st.tuples(KEYS, KEYS).filter(lambda t: t[0] != t[1]).map(lambda t: KeyRange(*sorted(t)))
REASONS = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghij", min_size=1, max_size=12)
LABEL_KEYS = st.builds("{}{}".format, st.sampled_from(["", "cdc.maintainer.dev/", "example.com/"]), NAMES)


@st.composite
def metadata(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "name": draw(NAMES),
        "namespace": draw(NAMES),
        "uid": draw(st.just("") | st.uuids().map(str)),
        "resource_version": draw(st.just("") | st.integers(1, 10**12).map(str)),
        "generation": draw(st.integers(0, 2**63 - 1)),
        "created": draw(TIMES),
        "deleting": draw(st.booleans()),
        "finalizers": tuple(draw(st.lists(LABEL_KEYS, unique=True, max_size=3))),
        "labels": tuple(sorted(draw(st.dictionaries(LABEL_KEYS, NAMES | st.just(""), max_size=3)).items())),
    }


def counts() -> st.SearchStrategy[SpanCounts]:
    return st.builds(SpanCounts, absent=SMALL, scheduling=SMALL, replicating=SMALL, removing=SMALL, invalid=SMALL)


@st.composite
def changefeeds(draw: st.DrawFn) -> Changefeed:
    conditions = draw(
        st.lists(
            st.builds(
                Condition,
                type=REASONS,
                status=st.sampled_from(["True", "False", "Unknown"]),
                reason=REASONS,
                message=TEXT,
                observed_generation=st.integers(0, 2**63 - 1),
                last_transition=TIMES,
            ),
            max_size=3,
            unique_by=lambda c: c.type,
        )
    )
    return Changefeed(
        **draw(metadata()),
        paused=draw(st.booleans()),
        redo=draw(st.booleans()),
        start_ts=draw(TS),
        scheduler=draw(
            st.builds(
                SchedulerConfig,
                max_in_flight_operators=st.integers(1, 2**31 - 1),
                basic_batch_size=st.integers(1, 2**31 - 1),
                operator_retention_seconds=st.floats(0, 1e9),
                user_operator_retention_seconds=st.floats(0, 1e9),
                balance_interval_seconds=st.floats(0, 1e9),
                balance_max_moves=st.integers(1, 2**31 - 1),
                split_write_threshold=st.floats(0, 1e9),
                split_checks=st.integers(1, 2**31 - 1),
                merge_max_per_round=st.integers(0, 2**31 - 1),
            )
        ),
        scheduler_status=draw(
            st.builds(
                SchedulerStatus,
                state=st.sampled_from(SchedulerState),
                message=TEXT,
                balance_resumes_at=TIMES,
            )
        ),
        epoch=draw(TS),
        holder=draw(OPT_NAMES),
        checkpoint_ts=draw(TS),
        span_counts=draw(counts()),
        operators_in_flight=draw(SMALL),
        conditions=tuple(conditions),
        observed_generation=draw(st.integers(0, 2**63 - 1)),
        joining=tuple(draw(st.lists(st.builds(Join, table=NAMES, uid=NAMES, start_ts=TS), max_size=3))),
    )


@st.composite
def tables(draw: st.DrawFn) -> Table:
    return Table(
        **draw(metadata()),
        changefeed=draw(NAMES),
        table_id=draw(st.integers(0, MAX_TABLE_ID)),
        splittable=draw(st.booleans()),
        pre_split_spans=draw(st.integers(0, 1024)),
        pre_split_keys=tuple(sorted(draw(st.sets(KEYS, max_size=4)))),
        start_ts=draw(TS),
        write_rate=draw(st.floats(0, 1e12)),
        state=draw(st.sampled_from(["", "Active", "Invalid", "Removing"])),
        message=draw(TEXT),
        span_counts=draw(counts()),
        observed_generation=draw(st.integers(0, 2**63 - 1)),
    )


@st.composite
def spans(draw: st.DrawFn) -> Span:
    return Span(
        **draw(metadata()),
        changefeed=draw(NAMES),
        table_id=draw(st.integers(0, MAX_TABLE_ID)),
        mode=draw(st.sampled_from(Mode)),
        key_range=draw(KEY_RANGES),
        start_ts=draw(TS),
        state=draw(st.none() | st.sampled_from(SpanState)),
        capture=draw(OPT_NAMES),
        dispatcher=draw(OPT_NAMES),
        checkpoint_ts=draw(TS),
        operator=draw(OPT_NAMES),
        message=draw(TEXT),
    )


@st.composite
def dispatchers(draw: st.DrawFn) -> Dispatcher:
    return Dispatcher(
        **draw(metadata()),
        changefeed=draw(NAMES),
        span=draw(NAMES),
        table_id=draw(st.integers(0, MAX_TABLE_ID)),
        mode=draw(st.sampled_from(Mode)),
        key_range=draw(KEY_RANGES),
        capture=draw(NAMES),
        start_ts=draw(TS),
        operator=draw(OPT_NAMES),
        epoch=draw(TS),
        state=draw(st.sampled_from(DispatcherState)),
        checkpoint_ts=draw(TS),
        heartbeat=draw(TIMES),
        message=draw(TEXT),
    )


@st.composite
def operators(draw: st.DrawFn) -> SpanOperator:
    origins = st.builds(Origin, span=NAMES, dispatcher=NAMES, capture=NAMES, checkpoint_ts=TS)
    targets = st.builds(
        Target,
        span=NAMES,
        key_range=KEY_RANGES,
        capture=OPT_NAMES,
        dispatcher=OPT_NAMES,
        start_ts=TS,
        done=st.booleans(),
        lost=st.booleans(),
    )
    return SpanOperator(
        **draw(metadata()),
        changefeed=draw(NAMES),
        type=draw(st.sampled_from(OpType)),
        spans=tuple(draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))),
        target=draw(OPT_NAMES),
        split_keys=tuple(sorted(draw(st.sets(KEYS, max_size=4)))),
        split_into=draw(st.integers(0, 128)),
        delete_spans=draw(st.booleans()),
        source=draw(st.sampled_from(OpSource)),
        reason=draw(TEXT),
        phase=draw(st.sampled_from(OpPhase)),
        stage=draw(st.sampled_from(Stage)),
        status_reason=draw(st.just("") | REASONS),
        message=draw(TEXT),
        epoch=draw(TS),
        origins=tuple(draw(st.lists(origins, max_size=3))),
        targets=tuple(draw(st.lists(targets, max_size=3))),
        checkpoint_ts=draw(TS),
        started_at=draw(TIMES),
        finished_at=draw(TIMES),
    )


@st.composite
def captures(draw: st.DrawFn) -> Capture:
    return Capture(
        **draw(metadata()),
        draining=draw(st.booleans()),
        renew_time=draw(st.none() | TIMES),
        lease_duration=float(draw(st.integers(1, 3600))),
    )


RECORDS = st.one_of(changefeeds(), tables(), spans(), dispatchers(), operators(), captures())


def wire(obj: dict[str, Any]) -> dict[str, Any]:
    """What comes back over the API: JSON."""
    result: dict[str, Any] = json.loads(json.dumps(obj))
    return result


# --------------------------------------------------------------------------------------------------
# Round trips


@given(spans())
def test_span_round_trip(span: Span) -> None:
    assert from_resource(wire(to_resource(span))) == span
    assert span_from_resource(to_resource(span)) == span


@given(dispatchers())
def test_dispatcher_round_trip(disp: Dispatcher) -> None:
    assert from_resource(wire(to_resource(disp))) == disp
    assert dispatcher_from_resource(to_resource(disp)) == disp


@given(operators())
def test_operator_round_trip(op: SpanOperator) -> None:
    assert from_resource(wire(to_resource(op))) == op
    assert operator_from_resource(to_resource(op)) == op


@given(changefeeds())
def test_changefeed_round_trip(cf: Changefeed) -> None:
    assert from_resource(wire(to_resource(cf))) == cf


@given(tables())
def test_table_round_trip(table: Table) -> None:
    assert from_resource(wire(to_resource(table))) == table
    assert table_from_resource(to_resource(table)) == table


@given(captures())
def test_capture_round_trip_with_lease(capture: Capture) -> None:
    lease = wire(lease_resource(capture))
    assert capture_from_resources(wire(to_resource(capture)), lease) == capture
    # Without its Lease a capture is not alive: the lease fields take their defaults.
    assert from_resource(to_resource(capture)) == replace(
        capture, renew_time=None, lease_duration=15.0, lease_taken=True, lease_version=""
    )


@given(RECORDS)
def test_status_of_is_the_status_part(record: Record) -> None:
    assert status_of(record) == to_resource(record).get("status", {})


@given(st.one_of(st.tuples(spans(), spans()), st.tuples(operators(), operators()), st.tuples(tables(), tables())))
def test_status_write_is_with_status_of(pair: tuple[Record, Record]) -> None:
    # Replacing the status part of ``a``'s resource with ``status_of(b)`` is what with_status_of models.
    a, b = pair
    obj = to_resource(a)
    obj.pop("status", None)
    obj["status"] = status_of(b)
    assert from_resource(obj) == a.with_status_of(b)


def _strict_validator(kind: str) -> jsonschema.Draft7Validator:
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            return jsonschema.Draft7Validator(_json_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    raise AssertionError(f"no CRD for {kind}")


def _json_schema(node: Any) -> Any:
    """OpenAPI -> JSON Schema: drop x-kubernetes-*, and refuse undeclared properties (as pruning would); metadata
    is never pruned (test_crds.json_schema)."""
    return json_schema(node)


VALIDATORS: dict[str, jsonschema.Draft7Validator] = {}


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(RECORDS)
def test_to_resource_is_accepted_by_the_crd_schema(record: Record) -> None:
    kind = record.KIND.value
    if kind not in VALIDATORS:
        VALIDATORS[kind] = _strict_validator(kind)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATORS[kind].iter_errors(to_resource(record))]
    assert errors == []


# --------------------------------------------------------------------------------------------------
# Layout pinned on small examples

KR = KeyRange(bytes.fromhex("740000000000000065"), bytes.fromhex("740000000000000066"))


def test_minimal_span_layout() -> None:
    span = Span(name="orders-1", changefeed="demo", table_id=101, key_range=KR)
    assert to_resource(span) == {
        "apiVersion": API,
        "kind": "Span",
        "metadata": {"name": "orders-1", "namespace": "default"},
        "spec": {
            "changefeed": "demo",
            "tableID": 101,
            "mode": "default",
            "startKey": "740000000000000065",
            "endKey": "740000000000000066",
        },
    }


def test_full_dispatcher_layout() -> None:
    disp = Dispatcher(
        name="d1",
        namespace="cdc",
        uid="u-1",
        resource_version="42",
        generation=3,
        created=1_700_000_000.25,
        deleting=True,
        finalizers=("cdc.maintainer.dev/dispatcher-closed",),
        labels=(("b", "2"), (CHANGEFEED_LABEL, "demo")),
        changefeed="demo",
        span="orders-1",
        table_id=101,
        mode=Mode.REDO,
        key_range=KR,
        capture="c0",
        start_ts=0,
        operator="op-1",
        epoch=0,
        state=DispatcherState.WORKING,
        checkpoint_ts=7,
        heartbeat=1_700_000_001.0,
        message="ok",
    )
    assert to_resource(disp) == {
        "apiVersion": API,
        "kind": "Dispatcher",
        "metadata": {
            "name": "d1",
            "namespace": "cdc",
            "uid": "u-1",
            "resourceVersion": "42",
            "generation": 3,
            "creationTimestamp": "2023-11-14T22:13:20.250000Z",
            "deletionTimestamp": "2023-11-14T22:13:20.250000Z",
            "finalizers": ["cdc.maintainer.dev/dispatcher-closed"],
            "labels": {"b": "2", CHANGEFEED_LABEL: "demo"},
        },
        "spec": {
            "changefeed": "demo",
            "span": "orders-1",
            "tableID": 101,
            "mode": "redo",
            "startKey": "740000000000000065",
            "endKey": "740000000000000066",
            "capture": "c0",
            "startTs": 0,  # required fields are written even when zero
            "operator": "op-1",
            "epoch": 0,
        },
        "status": {"state": "Working", "checkpointTs": 7, "heartbeat": "2023-11-14T22:13:21Z", "message": "ok"},
    }


def test_empty_enum_values_are_omitted() -> None:
    disp = Dispatcher(name="d", changefeed="c", span="s", table_id=1, key_range=KR, capture="c0", start_ts=5, epoch=1)
    assert "status" not in to_resource(disp)  # PENDING is "no state yet"
    op = SpanOperator(name="op", changefeed="c", type=OpType.ADD, spans=("s",), target="c0")
    assert to_resource(op)["status"] == {"phase": "Pending"}  # Stage.NONE omitted, phase always written
    assert to_resource(op)["spec"] == {
        "changefeed": "c",
        "type": "Add",
        "spans": ["s"],
        "target": "c0",
        "source": "user",
    }
    table = Table(name="t", changefeed="c", table_id=5)
    assert to_resource(table)["spec"] == {"changefeed": "c", "tableID": 5, "splittable": True}
    assert "status" not in to_resource(table)


def test_table_and_changefeed_layout() -> None:
    table = Table(
        name="users",
        changefeed="demo",
        table_id=102,
        splittable=False,
        pre_split_spans=4,
        pre_split_keys=(b"\x74\x01", b"\x74\x02"),
        write_rate=12.5,
        state="Active",
        span_counts=SpanCounts(replicating=4),
    )
    obj = to_resource(table)
    assert obj["spec"] == {
        "changefeed": "demo",
        "tableID": 102,
        "splittable": False,
        "preSplit": {"spans": 4, "splitKeys": ["7401", "7402"]},
        "writeRate": 12.5,
    }
    assert obj["status"] == {
        "state": "Active",
        "spans": {"absent": 0, "scheduling": 0, "replicating": 4, "removing": 0, "invalid": 0},
    }
    cf = Changefeed(
        name="demo",
        conditions=(Condition(type="Bootstrapped", status="True", reason="Restored", last_transition=1.5),),
    )
    assert to_resource(cf)["spec"] == {
        "scheduler": {
            "paused": False,
            "maxInFlightOperators": 10000,
            "basicBatchSize": 512,
            "operatorRetentionSeconds": 300.0,
            "userOperatorRetentionSeconds": 3600.0,
            "balanceIntervalSeconds": 15.0,
            "balanceMaxMoves": 1024,
            "drainBatchSize": 512,
            "drainCooldownSeconds": 120.0,
            "trafficCheckIntervalSeconds": 15.0,
            "splitWriteThreshold": 0.0,
            "splitRegionThreshold": 10000,
            "splitChecks": 3,
            "maxSpansPerTable": 128,
            "mergeWriteThreshold": 0.0,
            "mergeChecks": 5,
            "mergeMaxPerRound": 8,
        }
    }
    assert to_resource(cf)["status"] == {
        "conditions": [
            {
                "type": "Bootstrapped",
                "status": "True",
                "reason": "Restored",
                "message": "",
                "observedGeneration": 0,
                "lastTransitionTime": "1970-01-01T00:00:01.500000Z",
            }
        ]
    }


def test_operator_status_layout() -> None:
    op = SpanOperator(
        name="move-1",
        changefeed="demo",
        type=OpType.MOVE,
        spans=("s1",),
        target="c1",
        source=OpSource.SCHEDULER,
        phase=OpPhase.RUNNING,
        stage=Stage.REMOVE_ORIGIN,
        status_reason="Moving",
        epoch=3,
        origins=(Origin(span="s1", dispatcher="d1", capture="c0", checkpoint_ts=9),),
        targets=(Target(span="s1", key_range=KR, capture="c1", dispatcher="d2"),),
        started_at=10.0,
    )
    assert to_resource(op)["status"] == {
        "phase": "Running",
        "stage": "RemoveOrigin",
        "reason": "Moving",
        "epoch": 3,
        "origins": [{"span": "s1", "dispatcher": "d1", "capture": "c0", "checkpointTs": 9}],
        "targets": [
            {
                "span": "s1",
                "startKey": "740000000000000065",
                "endKey": "740000000000000066",
                "capture": "c1",
                "dispatcher": "d2",
            }
        ],
        "startedAt": "1970-01-01T00:00:10Z",
    }


def test_status_merge_patch_clears_what_status_of_omits() -> None:
    span = Span(name="s", changefeed="c", table_id=1, key_range=KR, state=SpanState.ABSENT, checkpoint_ts=5)
    assert status_merge_patch(span) == {
        "status": {
            "state": "Absent",
            "capture": None,
            "dispatcher": None,
            "checkpointTs": 5,
            "operator": None,
            "message": None,
        }
    }
    table = Table(name="t", changefeed="c", table_id=1)
    assert status_merge_patch(table)["status"]["spans"] == {
        "absent": 0,
        "scheduling": 0,
        "replicating": 0,
        "removing": 0,
        "invalid": 0,
    }
    assert status_merge_patch(Capture(name="c")) == {"status": {}}


def test_lease_layout_and_liveness() -> None:
    capture = Capture(name="c0", namespace="cdc", renew_time=100.5, lease_duration=20.0)
    lease = lease_resource(capture)
    assert lease == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "capture-c0", "namespace": "cdc"},
        "spec": {"holderIdentity": "c0", "leaseDurationSeconds": 20, "renewTime": "1970-01-01T00:01:40.500000Z"},
    }
    back = capture_from_resources(to_resource(capture), lease)
    assert back.alive(120.0)
    assert not back.alive(120.5)
    assert lease_name("c0") == "capture-c0"
    assert changefeed_labels("demo") == (("cdc.maintainer.dev/changefeed", "demo"),)


def test_lease_duration_must_be_whole_seconds() -> None:
    with pytest.raises(InvalidResource, match=r"^Lease capture-c0: spec.leaseDurationSeconds: 1.5 is not a whole"):
        lease_resource(Capture(name="c0", renew_time=1.0, lease_duration=1.5))


# --------------------------------------------------------------------------------------------------
# Timestamps


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1970-01-01T00:00:00Z", 0.0),
        ("2023-11-14T22:13:20Z", 1_700_000_000.0),
        ("2023-11-14T22:13:20.25Z", 1_700_000_000.25),
        ("2023-11-14t22:13:20.250000z", 1_700_000_000.25),
        ("2023-11-15T00:13:20.000001+02:00", 1_700_000_000.000001),
        ("2023-11-14T21:13:20-01:00", 1_700_000_000.0),
        ("2023-11-14T22:13:20.0000004Z", 1_700_000_000.0),  # finer than a microsecond: rounded
        ("2023-11-14T22:13:20.0000005Z", 1_700_000_000.000001),
        ("2023-11-14T22:13:20.999999999Z", 1_700_000_001.0),
    ],
)
def test_parse_time(text: str, seconds: float) -> None:
    assert parse_time(text) == seconds


def test_parse_time_accepts_datetimes() -> None:
    # PyYAML loads unquoted timestamps as datetimes.
    assert parse_time(datetime(2023, 11, 14, 22, 13, 20, 250000, tzinfo=UTC)) == 1_700_000_000.25
    assert parse_time(datetime(2023, 11, 14, 22, 13, 20)) == 1_700_000_000.0
    east = timezone(timedelta(hours=1))
    assert parse_time(datetime(2023, 11, 14, 23, 13, 20, tzinfo=east)) == 1_700_000_000.0


@pytest.mark.parametrize(
    "text", ["", "2023-11-14", "2023-11-14 22:13:20Z", "2023-11-14T22:13:20", "2023-13-01T00:00:00Z"]
)
def test_parse_time_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="timestamp"):
        parse_time(text)


def test_format_time_rounds_to_microseconds() -> None:
    assert format_time(1_700_000_000.0) == "2023-11-14T22:13:20Z"
    assert format_time(1_700_000_000.0, micro=True) == "2023-11-14T22:13:20.000000Z"
    assert format_time(1_700_000_000.1234567) == "2023-11-14T22:13:20.123457Z"
    assert round_time(1_700_000_000.1234567) == 1_700_000_000.123457
    with pytest.raises(ValueError, match="finite"):
        format_time(float("nan"))


@given(st.floats(0, 253_402_300_799, allow_nan=False))
def test_time_round_trip_is_round_time(seconds: float) -> None:
    assert parse_time(format_time(seconds)) == round_time(seconds)
    assert round_time(round_time(seconds)) == round_time(seconds)


def test_created_is_rounded_to_microseconds() -> None:
    span = Span(name="s", changefeed="c", table_id=1, key_range=KR, created=1_700_000_000.1234567)
    assert from_resource(to_resource(span)) == replace(span, created=1_700_000_000.123457)


# --------------------------------------------------------------------------------------------------
# Tolerance of absent optional fields


def test_minimal_objects_take_model_defaults() -> None:
    span = span_from_resource(
        {
            "kind": "Span",
            "metadata": {"name": "s"},
            "spec": {"changefeed": "c", "tableID": 1, "startKey": "", "endKey": "00"},
        }
    )
    assert span == Span(name="s", changefeed="c", table_id=1, key_range=KeyRange(b"", b"\x00"))
    assert span.namespace == "default"
    assert span.state is None
    assert span.mode is Mode.DEFAULT

    assert from_resource({"kind": "Changefeed", "metadata": {"name": "demo"}}) == Changefeed(name="demo")
    # Without its Lease a capture counts as fenced: nothing of it can run.
    assert from_resource({"kind": "Capture", "metadata": {"name": "c0"}}) == Capture(name="c0", lease_taken=True)
    assert from_resource(
        {"kind": "Table", "metadata": {"name": "t"}, "spec": {"changefeed": "c", "tableID": 0}}
    ) == Table(name="t", changefeed="c", table_id=0)
    op = from_resource(
        {
            "kind": "SpanOperator",
            "metadata": {"name": "o"},
            "spec": {"changefeed": "c", "type": "Remove", "spans": ["s"]},
        }
    )
    assert op == SpanOperator(name="o", changefeed="c", type=OpType.REMOVE, spans=("s",))
    assert isinstance(op, SpanOperator)
    assert op.phase is OpPhase.PENDING
    assert op.source is OpSource.USER


def test_partial_scheduler_and_nulls() -> None:
    cf = from_resource(
        {
            "apiVersion": API,
            "kind": "Changefeed",
            "metadata": {"name": "demo", "namespace": None, "labels": None, "finalizers": None},
            "spec": {"paused": None, "scheduler": {"basicBatchSize": 8}},
            "status": None,
            "unknownTopLevel": {"ignored": True},
        }
    )
    assert cf == Changefeed(name="demo", scheduler=SchedulerConfig(basic_batch_size=8))


def test_integral_numbers_and_empty_enums_are_accepted() -> None:
    # The API server writes 300.0 back as 300; "" enum values mean "none yet".
    cf = from_resource(
        {"kind": "Changefeed", "metadata": {"name": "demo"}, "spec": {"scheduler": {"operatorRetentionSeconds": 60}}}
    )
    assert isinstance(cf, Changefeed)
    assert cf.scheduler.operator_retention_seconds == 60.0
    assert isinstance(cf.scheduler.operator_retention_seconds, float)
    table = from_resource(
        {
            "kind": "Table",
            "metadata": {"name": "t"},
            "spec": {"changefeed": "c", "tableID": 1, "writeRate": 5000},
            "status": {"state": ""},
        }
    )
    assert isinstance(table, Table)
    assert table.write_rate == 5000.0
    assert table.state == ""
    disp = from_resource(
        {
            "kind": "Dispatcher",
            "metadata": {"name": "d"},
            "spec": {
                "changefeed": "c",
                "span": "s",
                "tableID": 1,
                "startKey": "00",
                "endKey": "01",
                "capture": "c0",
                "startTs": 1,
                "epoch": 1,
            },
            "status": {"state": ""},
        }
    )
    assert isinstance(disp, Dispatcher)
    assert disp.state is DispatcherState.PENDING


def test_labels_are_sorted_pairs() -> None:
    span = from_resource(
        {
            "kind": "Span",
            "metadata": {"name": "s", "labels": {"z": "1", "a": "2"}, "finalizers": ["f1", "f2"]},
            "spec": {"changefeed": "c", "tableID": 1, "startKey": "00", "endKey": "01"},
        }
    )
    assert span.labels == (("a", "2"), ("z", "1"))
    assert span.finalizers == ("f1", "f2")


# --------------------------------------------------------------------------------------------------
# Strictness


def span_obj(**spec: Any) -> dict[str, Any]:
    base = {"changefeed": "demo", "tableID": 101, "startKey": "740000000000000065", "endKey": "740000000000000066"}
    base.update(spec)
    return {"apiVersion": API, "kind": "Span", "metadata": {"name": "orders-1"}, "spec": base}


def op_obj(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "kind": "SpanOperator",
        "metadata": {"name": "op-1"},
        "spec": {"changefeed": "demo", "type": "Move", "spans": ["orders-1"], "target": "c1", **(spec or {})},
    }
    if status is not None:
        obj["status"] = status
    return obj


STRICT_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "bad hex",
        span_obj(startKey="zz"),
        "Span orders-1: spec.startKey: 'zz' is not a hex-encoded key (lower-case hex digits, two per byte)",
    ),
    ("upper-case hex", span_obj(endKey="74FF"), "Span orders-1: spec.endKey: '74FF' is not a hex-encoded key"),
    ("odd hex", span_obj(startKey="740"), "Span orders-1: spec.startKey: '740' is not a hex-encoded key"),
    ("spaced hex", span_obj(startKey="74 00"), "Span orders-1: spec.startKey: '74 00' is not a hex-encoded key"),
    (
        "key type",
        span_obj(startKey=116),
        "Span orders-1: spec.startKey: expected a hex-encoded key string, got int 116",
    ),
    (
        "empty range",
        span_obj(startKey="7401", endKey="7401"),
        "Span orders-1: spec: empty key range: startKey '7401' is not below endKey '7401'",
    ),
    (
        "reversed range",
        span_obj(startKey="7402", endKey="7401"),
        "Span orders-1: spec: empty key range: startKey '7402' is not below endKey '7401'",
    ),
    ("int as str", span_obj(tableID="101"), "Span orders-1: spec.tableID: expected an integer, got str '101'"),
    ("int as bool", span_obj(tableID=True), "Span orders-1: spec.tableID: expected an integer, got bool True"),
    ("int as float", span_obj(startTs=1.0), "Span orders-1: spec.startTs: expected an integer, got float 1.0"),
    ("negative ts", span_obj(startTs=-1), "Span orders-1: spec.startTs: -1 is out of range 0..9223372036854775807"),
    (
        "table id range",
        span_obj(tableID=2**63 - 1),
        "Span orders-1: spec.tableID: 9223372036854775807 is out of range 0..9223372036854775806",
    ),
    ("unknown mode", span_obj(mode="fast"), "Span orders-1: spec.mode: 'fast' is not one of 'default', 'redo'"),
    ("missing table", span_obj(tableID=None), "Span orders-1: spec.tableID: is required"),
    ("missing key", span_obj(endKey=None), "Span orders-1: spec.endKey: is required"),
    ("str as int", span_obj(changefeed=5), "Span orders-1: spec.changefeed: expected a string, got int 5"),
    (
        "unknown span state",
        {**span_obj(), "status": {"state": "Lost"}},
        "Span orders-1: status.state: 'Lost' is not one of 'Absent', 'Scheduling', 'Replicating', 'Removing', "
        "'Invalid'",
    ),
    ("spec not object", {**span_obj(), "spec": ["x"]}, "Span orders-1: spec: expected an object, got list ['x']"),
    ("no metadata", {"kind": "Span", "spec": {}}, "Span <unnamed>: metadata: is required"),
    ("no name", {"kind": "Span", "metadata": {"namespace": "x"}}, "Span <unnamed>: metadata.name: is required"),
    (
        "bad creation time",
        {**span_obj(), "metadata": {"name": "orders-1", "creationTimestamp": "yesterday"}},
        "Span orders-1: metadata.creationTimestamp: 'yesterday' is not an RFC 3339 timestamp",
    ),
    (
        "bad label",
        {**span_obj(), "metadata": {"name": "orders-1", "labels": {"a": 1}}},
        "Span orders-1: metadata.labels['a']: expected a string, got int 1",
    ),
    (
        "wrong api version",
        {**span_obj(), "apiVersion": "cdc.maintainer.dev/v1"},
        "Span orders-1: apiVersion: expected 'cdc.maintainer.dev/v1alpha1', got 'cdc.maintainer.dev/v1'",
    ),
    (
        "unknown kind",
        {"kind": "Pod", "metadata": {"name": "p"}},
        "Pod p: kind: 'Pod' is not one of 'Changefeed', 'Table', 'Span', 'Dispatcher', 'SpanOperator', 'Capture'",
    ),
    ("no kind", {"metadata": {"name": "p"}}, "<unknown kind> p: kind: None is not one of"),
    (
        "unknown op type",
        op_obj({"type": "Teleport"}),
        "SpanOperator op-1: spec.type: 'Teleport' is not one of 'Add', 'Remove', 'Move', 'Split', 'Merge'",
    ),
    (
        "spans not list",
        op_obj({"spans": "orders-1"}),
        "SpanOperator op-1: spec.spans: expected a list, got str 'orders-1'",
    ),
    ("span item", op_obj({"spans": ["a", 1]}), "SpanOperator op-1: spec.spans[1]: expected a string, got int 1"),
    (
        "split key",
        op_obj({"splitKeys": ["7401", "x"]}),
        "SpanOperator op-1: spec.splitKeys[1]: 'x' is not a hex-encoded key",
    ),
    (
        "bool as str",
        op_obj({"deleteSpans": "yes"}),
        "SpanOperator op-1: spec.deleteSpans: expected a boolean, got str 'yes'",
    ),
    (
        "unknown phase",
        op_obj(status={"phase": "Done"}),
        "SpanOperator op-1: status.phase: 'Done' is not one of 'Pending'",
    ),
    (
        "unknown stage",
        op_obj(status={"stage": "Teleport"}),
        "SpanOperator op-1: status.stage: 'Teleport' is not one of 'AddDest'",
    ),
    (
        "target range",
        op_obj(status={"targets": [{"span": "s", "startKey": "02", "endKey": "01"}]}),
        "SpanOperator op-1: status.targets[0]: empty key range: startKey '02' is not below endKey '01'",
    ),
    (
        "target missing span",
        op_obj(status={"targets": [{"startKey": "01", "endKey": "02"}]}),
        "SpanOperator op-1: status.targets[0].span: is required",
    ),
    (
        "origin not object",
        op_obj(status={"origins": ["d1"]}),
        "SpanOperator op-1: status.origins[0]: expected an object, got str 'd1'",
    ),
    (
        "bad started",
        op_obj(status={"startedAt": 12}),
        "SpanOperator op-1: status.startedAt: expected an RFC 3339 timestamp string, got int 12",
    ),
]


@pytest.mark.parametrize(("obj", "message"), [(o, m) for _, o, m in STRICT_CASES], ids=[c[0] for c in STRICT_CASES])
def test_invalid_resources_are_named_precisely(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidResource) as info:
        from_resource(obj)
    assert str(info.value).startswith(message)
    assert isinstance(info.value, ValueError)


def test_other_kinds_strictness() -> None:
    disp: dict[str, Any] = {
        "kind": "Dispatcher",
        "metadata": {"name": "d"},
        "spec": {
            "changefeed": "c",
            "span": "s",
            "tableID": 1,
            "startKey": "00",
            "endKey": "01",
            "capture": "c0",
            "startTs": 1,
        },
    }
    with pytest.raises(InvalidResource, match=r"^Dispatcher d: spec.epoch: is required$"):
        from_resource(disp)
    disp["spec"]["epoch"] = 1
    disp["status"] = {"state": "Running"}
    with pytest.raises(InvalidResource, match=r"^Dispatcher d: status.state: 'Running' is not one of 'Initializing',"):
        from_resource(disp)
    disp["status"] = {"heartbeat": "2023-02-30T00:00:00Z"}
    with pytest.raises(
        InvalidResource, match=r"^Dispatcher d: status.heartbeat: '2023-02-30T00:00:00Z' is not a valid"
    ):
        from_resource(disp)

    cf = {"kind": "Changefeed", "metadata": {"name": "demo"}, "spec": {"scheduler": {"maxInFlightOperators": 0}}}
    with pytest.raises(
        InvalidResource, match=r"^Changefeed demo: spec.scheduler.maxInFlightOperators: 0 is out of range 1\.\."
    ):
        from_resource(cf)
    cf = {"kind": "Changefeed", "metadata": {"name": "demo"}, "spec": {"scheduler": {"operatorRetentionSeconds": -1}}}
    with pytest.raises(
        InvalidResource, match=r"^Changefeed demo: spec.scheduler.operatorRetentionSeconds: -1 is not a finite"
    ):
        from_resource(cf)
    cf = {
        "kind": "Changefeed",
        "metadata": {"name": "demo"},
        "status": {"conditions": [{"type": "Ready", "status": "Yes"}]},
    }
    with pytest.raises(
        InvalidResource, match=r"^Changefeed demo: status.conditions\[0\].status: 'Yes' is not one of 'True'"
    ):
        from_resource(cf)

    table = {
        "kind": "Table",
        "metadata": {"name": "t"},
        "spec": {"changefeed": "c", "tableID": 1},
        "status": {"state": "Gone"},
    }
    with pytest.raises(
        InvalidResource,
        match=r"^Table t: status.state: 'Gone' is not one of 'Active', 'Invalid', 'Removing', 'Detached'$",
    ):
        from_resource(table)
    table = {
        "kind": "Table",
        "metadata": {"name": "t"},
        "spec": {"changefeed": "c", "tableID": 1, "preSplit": {"splitKeys": ["AB"]}},
    }
    with pytest.raises(InvalidResource, match=r"^Table t: spec.preSplit.splitKeys\[0\]: 'AB' is not a hex-encoded key"):
        from_resource(table)

    cap = {"kind": "Capture", "metadata": {"name": "c0"}, "spec": {"draining": 1}}
    with pytest.raises(InvalidResource, match=r"^Capture c0: spec.draining: expected a boolean, got int 1$"):
        from_resource(cap)


def test_lease_strictness() -> None:
    cap = {"kind": "Capture", "metadata": {"name": "c0"}}
    lease = {"kind": "Lease", "metadata": {"name": "capture-c1"}, "spec": {}}
    with pytest.raises(InvalidResource, match=r"^Lease capture-c1: metadata.name: is not 'capture-c0', the Lease of"):
        capture_from_resources(cap, lease)
    lease = {"kind": "Lease", "metadata": {"name": "capture-c0"}, "spec": {"renewTime": "soon"}}
    with pytest.raises(InvalidResource, match=r"^Lease capture-c0: spec.renewTime: 'soon' is not an RFC 3339"):
        capture_from_resources(cap, lease)
    lease = {"kind": "Lease", "metadata": {"name": "capture-c0"}, "spec": {"leaseDurationSeconds": 0}}
    with pytest.raises(InvalidResource, match=r"^Lease capture-c0: spec.leaseDurationSeconds: 0 is out of range 1\.\."):
        capture_from_resources(cap, lease)
    # A Lease with no renewTime yet: present but not alive; naming no holder, it is not the capture's.
    lease = {"kind": "Lease", "metadata": {"name": "capture-c0"}, "spec": {"leaseDurationSeconds": 40}}
    assert capture_from_resources(cap, lease) == Capture(
        name="c0", renew_time=None, lease_duration=40.0, lease_taken=True
    )
    lease["spec"]["holderIdentity"] = "c0"
    lease["metadata"]["resourceVersion"] = "7"
    held = capture_from_resources(cap, lease)
    assert (held.lease_taken, held.lease_version, held.alive(0.0), held.expired(0.0)) == (False, "7", False, True)


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _leaves(v, (*path, k))] or [path]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _leaves(v, (*path, i))] or [path]
    return [path]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(RECORDS, st.data())
def test_mangled_resources_raise_only_invalid_resource(record: Record, data: st.DataObject) -> None:
    obj = wire(to_resource(record))
    path = data.draw(st.sampled_from([p for p in _leaves(obj) if p and p[0] != "kind"]))
    node: Any = obj
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = data.draw(JSON_VALUES)
    problem: InvalidResource | None = None
    try:
        from_resource(obj)
    except InvalidResource as exc:  # anything else (TypeError, KeyError...) fails the test
        problem = exc
    if problem is not None:
        assert problem.kind == record.KIND.value
        assert str(problem).startswith(f"{problem.kind} {problem.name}: ")
